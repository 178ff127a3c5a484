"""The plan type and its file format.

    {"num_devices": 4, "algorithm": "size_lookup_greedy", "placement_seconds": 0.01,
     "shards": [{"table": "t0", "device": 2, "columns": [0, 64]}, ...],
     "settings": {"memory_gb": 1.5, "batch_size": 1024, "optimizer": "rowwise_adagrad", "seed": 0,
                  "algorithm": {...}, "source": null},
     "memory_bytes": [...], "estimate": {"predicted": {...}, "lower_bound_ms": 3.1, ...}, "metadata": {}}

A shard is a column range of a table on a device; table-wise placement is one shard per
table with columns [0, dim). `settings` records what the plan was made for, `estimate` what the
cost models predicted (for algorithms that plan with them). Plan files written before these
were typed kept them in `metadata`; reading such a file moves them into place.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shard_ray.errors import InfeasibleError, ShardRayError, describe_validation_error
from shard_ray.io import read_document, write_json
from shard_ray.plan.cost import PlanCost, RoundsSummary
from shard_ray.plan.topology import GB, Optimizer, Topology, shard_bytes
from shard_ray.workload.tables import TableSpec


class TablePiece(BaseModel):
    """A table, or a column range of it: what a device holds of a table, priced, profiled and placed as one.

    The plan file records it as a `Shard` (the table's name, a device, the range); the searches,
    the cost models and the profilers work on pieces, which carry the table's whole spec.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: TableSpec
    columns: tuple[int, int]

    @classmethod
    def whole(cls, table: TableSpec) -> TablePiece:
        return cls(table=table, columns=(0, table.dim))

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    def content(self) -> dict:
        """What determines this piece's cost: the table's spec less its name, and the width."""
        spec = self.table.model_dump(mode="json", exclude={"name"})
        spec["dim"] = self.width
        return spec


def table_wise(tables: list[TableSpec]) -> list[TablePiece]:
    """Each table whole: the pieces of a table-wise plan."""
    return [TablePiece.whole(t) for t in tables]


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


class PlanSettings(BaseModel):
    """What a plan was made for: the topology's cap, batch and optimizer, the seed, the algorithm's settings."""

    model_config = ConfigDict(extra="forbid")

    memory_gb: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    optimizer: Optimizer
    seed: int = 0
    algorithm: dict[str, Any] = Field(default_factory=dict)  # the algorithm's own settings, as it used them
    source: str | None = None  # the file they were read from (a tuned-config file), if any


class PlanEstimate(BaseModel):
    """What the cost models say of a plan: its predicted per-device costs and the task's lower bound."""

    model_config = ConfigDict(extra="forbid")

    predicted: PlanCost
    lower_bound_ms: float | None = None
    cost_model: str | None = None  # the model file
    hardware: str | None = None  # the hardware the models were trained on
    proven_optimal: bool | None = None  # exact solvers: whether the search finished within its budget
    warnings: list[str] = []  # why the models' prices may be off: other hardware, tables outside their training data


class MeasuredSelection(BaseModel):
    """What `plan --measure` found: candidates (algorithms, '='-joined where their plans agree) raced on the gang."""

    model_config = ConfigDict(extra="forbid")

    hardware: str
    chosen: str
    confidence: float
    separated: bool  # every other candidate was found slower at `confidence`
    steps_per_round: int
    candidates: dict[str, RoundsSummary]
    p_slower: dict[str, float]  # per other candidate: one-sided paired p-value that it is slower than the chosen

    @property
    def cost(self) -> RoundsSummary:
        return self.candidates[self.chosen]

    def best_of(self, algorithms: set[str]) -> tuple[str, RoundsSummary] | None:
        """The measured best candidate made by any of `algorithms` (e.g. the heuristics), if any."""
        made = [(n, c) for n, c in self.candidates.items() if algorithms & set(n.split("="))]
        return min(made, key=lambda item: item[1].median_ms) if made else None


# Keys plan files kept in `metadata` before settings and estimates were typed, and where they go.
_LEGACY_ESTIMATE = ("predicted", "lower_bound_ms", "proven_optimal")
_LEGACY_SETTINGS = ("memory_gb", "batch_size", "optimizer", "seed")


def _lift_legacy_metadata(data: Any) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
        return data
    data, metadata = dict(data), dict(data["metadata"])
    metadata.pop("predicted_cost_ms", None)  # the predicted cost's total, recomputed from its devices
    if "memory_bytes" in metadata and "memory_bytes" not in data:
        data["memory_bytes"] = metadata.pop("memory_bytes")
    old = metadata.pop("settings", None)
    if isinstance(old, dict) and "settings" not in data and all(k in old for k in _LEGACY_SETTINGS[:3]):
        old = dict(old)
        model, hardware = old.pop("cost_model", None), old.pop("cost_model_hardware", None)
        source = old.pop("search_config", None)
        data["settings"] = {**{k: old.pop(k) for k in _LEGACY_SETTINGS if k in old}, "algorithm": old, "source": source}
        if "predicted" in metadata and "estimate" not in data:
            estimate = {key: metadata.pop(key) for key in _LEGACY_ESTIMATE if key in metadata}
            data["estimate"] = {**estimate, "cost_model": model, "hardware": hardware}
    elif old is not None:
        metadata["settings"] = old
    data["metadata"] = metadata
    return data


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_devices: int = Field(ge=1)
    algorithm: str
    placement_seconds: float = Field(default=0.0, ge=0)
    shards: list[Shard] = Field(min_length=1)
    settings: PlanSettings | None = None
    memory_bytes: list[int] | None = None  # per device, weights plus optimizer state
    estimate: PlanEstimate | None = None
    measured: MeasuredSelection | None = None  # plan --measure: the race this plan won on the hardware
    metadata: dict[str, Any] = Field(default_factory=dict)  # anything else an algorithm records

    @model_validator(mode="before")
    @classmethod
    def _read_legacy_metadata(cls, data: Any) -> Any:
        return _lift_legacy_metadata(data)

    @classmethod
    def from_assignment(
        cls, pieces: list[TablePiece], devices: Sequence[int], num_devices: int, algorithm: str
    ) -> Plan:
        """The plan putting each piece (a table's column range) on its device."""
        shards = [
            Shard(table=p.table.name, device=int(d), columns=p.columns) for p, d in zip(pieces, devices, strict=True)
        ]
        return cls(num_devices=num_devices, algorithm=algorithm, shards=shards)

    def pieces(self, tables: list[TableSpec]) -> list[list[TablePiece]]:
        """What every device holds, in plan order: its fused shard."""
        by_name = {t.name: t for t in tables}
        return [
            [TablePiece(table=by_name[s.table], columns=s.columns) for s in self.shards_on(d)]
            for d in range(self.num_devices)
        ]

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
                raise InfeasibleError(
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
