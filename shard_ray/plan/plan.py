"""The plan type and its file format.

    {"num_devices": 4, "algorithm": "size_lookup_greedy", "placement_seconds": 0.01,
     "shards": [{"table": "t0", "device": 2, "columns": [0, 64]}, ...], "metadata": {...}}

A shard is a column range of a table on a device; table-wise placement is one shard per
table with columns [0, dim).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shard_ray.errors import ShardRayError, describe_validation_error
from shard_ray.io import read_document, write_json
from shard_ray.plan.topology import GB, Topology, shard_bytes
from shard_ray.workload.tables import TableSpec


class Shard(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str = Field(min_length=1)
    device: int = Field(ge=0)
    columns: tuple[int, int]

    @field_validator("columns")
    @classmethod
    def _range(cls, columns: tuple[int, int]) -> tuple[int, int]:
        start, end = columns
        if not 0 <= start < end:
            raise ValueError(f"columns must be [start, end) with 0 <= start < end, got {list(columns)}")
        if start % 4 or end % 4:
            raise ValueError(f"column bounds must be multiples of 4, got {list(columns)}")
        return columns

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_devices: int = Field(ge=1)
    algorithm: str
    placement_seconds: float = Field(default=0.0, ge=0)
    shards: list[Shard] = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def shards_on(self, device: int) -> list[Shard]:
        return [s for s in self.shards if s.device == device]

    def check(self, tables: list[TableSpec]) -> None:
        """Raise a ShardRayError unless every table's columns are covered exactly once on valid devices."""
        by_name = {t.name: t for t in tables}
        ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for shard in self.shards:
            if shard.table not in by_name:
                raise ShardRayError(f"plan places table {shard.table!r}, which is not in the table file")
            if shard.device >= self.num_devices:
                raise ShardRayError(f"plan puts table {shard.table!r} on device {shard.device} of {self.num_devices}")
            ranges[shard.table].append(shard.columns)
        for name, table in by_name.items():
            covered = sorted(ranges.get(name, []))
            if not covered:
                raise ShardRayError(f"plan does not place table {name!r}")
            end = 0
            for start, stop in covered:
                if start != end:
                    raise ShardRayError(
                        f"plan's column shards of table {name!r} overlap or leave a gap at column {end}"
                    )
                end = stop
            if end != table.dim:
                raise ShardRayError(f"plan's column shards of table {name!r} cover {end} of its {table.dim} columns")

    def device_memory_bytes(self, tables: list[TableSpec], topology: Topology) -> list[int]:
        by_name = {t.name: t for t in tables}
        used = [0] * self.num_devices
        for shard in self.shards:
            used[shard.device] += shard_bytes(by_name[shard.table], shard.width, topology.optimizer)
        return used

    def check_memory(self, tables: list[TableSpec], topology: Topology) -> None:
        """Refuse a plan that puts more on a device than its memory cap."""
        for device, used in enumerate(self.device_memory_bytes(tables, topology)):
            if used > topology.memory_bytes:
                raise ShardRayError(
                    f"plan needs {used / GB:.3f} GB on device {device}, over the cap of "
                    f"{topology.memory_gb:.3f} GB (weights + {topology.optimizer} state)"
                )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    document = read_document(path, "plan")
    if not isinstance(document, dict):
        raise ShardRayError(f"plan file {path}: expected a JSON object")
    try:
        return Plan.model_validate(document)
    except ValidationError as err:
        raise ShardRayError(describe_validation_error(err, f"plan file {path}")) from err


def save_plan(path: str | os.PathLike[str], plan: Plan) -> None:
    write_json(path, plan.model_dump(mode="json"))
