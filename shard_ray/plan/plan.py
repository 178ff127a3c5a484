"""The plan type and its file format.

    {"format_version": 2, "num_devices": 4, "algorithm": "size_lookup_greedy", "placement_seconds": 0.01,
     "shards": [{"table": "t0", "device": 2, "columns": [0, 64]}, ...],
     "tables": {"t0": {"type": "table_wise"}, "t1": {"type": "table_row_wise", "host": 1}, ...},
     "settings": {"memory_gb": 1.5, "batch_size": 1024, "optimizer": "rowwise_adagrad", "seed": 0,
                  "algorithm": {...}, "source": null},
     "memory_bytes": [...], "estimate": {"predicted": {...}, "lower_bound_ms": 3.1, ...}, "metadata": {}}

A shard is a column range of a table on a device, and for row-wise sharding a row range,
`{"table": "t0", "device": 3, "columns": [0, 64], "rows": [0, 500000]}` (rows default to the whole
table). A table's shards tile its rows x columns: table-wise is one shard with columns [0, dim),
column-wise splits the columns, row-wise (and table-row-wise, the rows over one host's devices)
the rows, a grid both. A data-parallel table has one shard per device, each the whole table, with
`"replicated": true`. `tables` records each table's sharding type as the algorithm chose it (and,
for table-row-wise, the host; for a table a constraints file restricts, its devices or group), so
nothing reading a plan guesses it from the shards' geometry. Plan files of format 1 (before
`tables`, or written by hand) have it inferred from the geometry once, on reading. `settings` records what the plan was made for, `estimate` what the
cost models predicted (for algorithms that plan with them). Plan files written before these
were typed kept them in `metadata`; reading such a file moves them into place.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.io import read_model, write_document
from shard_ray.plan.cost import MeasuredComparison, PlanCost
from shard_ray.plan.piece import TablePiece, table_row_wise
from shard_ray.plan.topology import GB, Optimizer, Topology
from shard_ray.workload.tables import TableSpec, table_digests, task_digest, written_as_number

PLAN_FORMAT_VERSION = 2
# The types whose pieces are pinned to their device: TorchRec's row blocks (block k on device k of the table's
# devices, of the whole table or of a column range in a grid) and the replicas of a data-parallel table.
PINNED_TYPES = ("row_wise", "table_row_wise", "data_parallel", "grid")


class TableSharding(BaseModel):
    """How a plan shards one table: its sharding type ('grid' for rows and columns both split), the host of a
    table-row-wise table's blocks, and the devices or group a constraints file gave it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel", "grid"]
    host: int | None = Field(default=None, ge=0)  # table_row_wise: the host whose devices hold its row blocks
    devices: tuple[int, ...] | None = None  # the devices its constraints allow (None: any)
    group: int | None = None  # its constraints group: the group's tables go whole on one device

    @model_serializer(mode="wrap")
    def _leave_out_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k == "type" or v is not None}

    @classmethod
    def of_pieces(cls, pieces: Sequence[TablePiece], devices: Sequence[int]) -> TableSharding:
        """The sharding of one table's pieces on `devices`, as the pieces say it (replicas, row and column ranges,
        blocks within a host)."""
        first, table = pieces[0], pieces[0].table
        if first.replicated:
            kind = "data_parallel"
        elif first.within_host > 1:
            return cls(type="table_row_wise", host=int(devices[0]) // first.within_host)
        else:
            rows_split = any(p.row_count != table.rows for p in pieces)
            columns_split = any(p.width != table.dim for p in pieces)
            kind = (
                ("grid" if columns_split else "row_wise")
                if rows_split
                else "column_wise"
                if columns_split
                else "table_wise"
            )
        return cls(type=kind, devices=None if kind in PINNED_TYPES else first.devices, group=first.group)


def inferred_sharding(table: TableSpec, shards: Sequence[Shard], devices_per_host: int | None) -> TableSharding:
    """A table's sharding read off its shards' geometry: for plan files of format 1, and to check a recorded one.

    In a plan over hosts of `devices_per_host` (None: one host), row shards on one host's devices in
    TorchRec's table-row-wise layout are table-row-wise."""
    if any(s.replicated for s in shards):
        return TableSharding(type="data_parallel")
    rows_split = any(s.rows not in (None, (0, table.rows)) for s in shards)
    columns_split = any(s.columns != (0, table.dim) for s in shards)
    if rows_split and columns_split:
        return TableSharding(type="grid")
    if rows_split:
        host = _host_of_row_blocks(table, shards, devices_per_host)
        return TableSharding(type="row_wise") if host is None else TableSharding(type="table_row_wise", host=host)
    return TableSharding(type="column_wise" if columns_split else "table_wise")


def _host_of_row_blocks(table: TableSpec, shards: Sequence[Shard], devices_per_host: int | None) -> int | None:
    """The host whose devices hold the table's row shards in table-row-wise layout, if they do."""
    if devices_per_host is None:
        return None
    host = shards[0].device // devices_per_host
    return host if laid_out_as(table, shards, table_row_wise(table, devices_per_host, host)) else None


def laid_out_as(table: TableSpec, shards: Sequence[Shard], blocks: list[TablePiece]) -> bool:
    """Whether the table's shards are exactly these pinned row blocks, each on its device."""
    laid_out = sorted((s.rows or (0, table.rows), s.device) for s in shards)
    return laid_out == [(p.row_range, p.devices[0]) for p in blocks]


def _check_range(kind: str, bounds: tuple[int, int]) -> tuple[int, int]:
    start, end = bounds
    if not 0 <= start < end:
        raise ValueError(f"{kind} must be [start, end) with 0 <= start < end, got {list(bounds)}")
    return bounds


class Shard(BaseModel):
    """A table's columns (and rows, for row-wise sharding) on a device; a data-parallel table has
    one replicated shard, the whole table, on every device. Defaults are left out of plan files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str = Field(min_length=1)
    device: int = Field(ge=0)
    columns: tuple[int, int]
    rows: tuple[int, int] | None = None  # [start, end); None: every row
    replicated: bool = False

    @field_validator("device", "columns", "rows", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return written_as_number(value)

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: tuple[int, int]) -> tuple[int, int]:
        start, end = _check_range("columns", columns)
        if start % 4 or end % 4:
            raise ValueError(f"column bounds must be multiples of 4, got {list(columns)}")
        return columns

    @field_validator("rows")
    @classmethod
    def _rows(cls, rows: tuple[int, int] | None) -> tuple[int, int] | None:
        return None if rows is None else _check_range("rows", rows)

    @model_serializer(mode="wrap")
    def _leave_out_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.rows is None:
            data.pop("rows", None)
        if not self.replicated:
            data.pop("replicated", None)
        return data

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]


class PlanSettings(BaseModel):
    """What a plan was made for: the topology's cap, batch and optimizer, the seed, the algorithm's settings."""

    model_config = ConfigDict(extra="forbid")

    memory_gb: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    optimizer: Optimizer
    devices_per_host: int | None = None  # None: one host holds every device
    inter_host_gbps: float | None = None  # each device's bandwidth to other hosts; recorded for plans over hosts
    intra_host_gbps: float | None = None  # a device's bandwidth from its host mates, where the plan was given one
    host_link_gbps: float | None = None  # the link a host's devices share to other hosts, where the plan had one
    seed: int = 0
    algorithm: dict[str, Any] = Field(default_factory=dict)  # the algorithm's own settings, as it used them
    source: str | None = None  # the file they were read from (a tuned-config file), if any
    constraints: dict[str, Any] | None = None  # the constraints file's content the plan was made under, if any
    # the tables' `task_digest`: a plan evaluated on tables of its names but other shapes is said to be (None: a plan
    # of an earlier release, or written by hand)
    tables_digest: str | None = None
    # each table's digest (`table_digests`), by name: the warning names the tables whose shapes changed
    table_digests: dict[str, str] | None = None

    def topology(self, num_devices: int) -> Topology:
        """The topology of `num_devices` these settings record (`for_topology`'s inverse)."""
        rates = {"inter_host_gbps": self.inter_host_gbps, "intra_host_gbps": self.intra_host_gbps,
                 "host_link_gbps": self.host_link_gbps}  # fmt: skip
        return Topology(
            num_devices=num_devices,
            memory_bytes=round(self.memory_gb * GB),
            batch_size=self.batch_size,
            optimizer=self.optimizer,
            devices_per_host=self.devices_per_host,
            **{name: rate for name, rate in rates.items() if rate is not None},
        )

    @classmethod
    def for_topology(cls, topology: Topology, tables: list[TableSpec] | None = None, **made_with: Any) -> PlanSettings:
        """What a plan for `topology` records of it (its rates between hosts only where it has hosts), the digests of
        the `tables` it places where given, with `made_with`'s fields (seed, the algorithm's settings, ...)."""
        over_hosts = topology.num_hosts > 1
        if tables is not None:
            made_with |= {"tables_digest": task_digest(tables), "table_digests": table_digests(tables)}
        return cls(
            memory_gb=topology.memory_gb,
            batch_size=topology.batch_size,
            optimizer=topology.optimizer,
            devices_per_host=topology.devices_per_host,
            inter_host_gbps=topology.inter_host_gbps if over_hosts else None,
            intra_host_gbps=topology.intra_host_gbps,
            host_link_gbps=topology.host_link_gbps if over_hosts else None,
            **made_with,
        )


class PlanEstimate(BaseModel):
    """What the cost models say of a plan: its predicted per-device costs and the task's lower bound."""

    model_config = ConfigDict(extra="forbid")

    predicted: PlanCost
    lower_bound_ms: float | None = None
    cost_model: str | None = None  # the model file
    hardware: str | None = None  # the hardware the models were trained on
    provenance: str | None = None  # the model file, its hardware and what it was calibrated on, one line
    warnings: list[str] = []  # why the models' prices may be off: other hardware, tables outside their training data


class SearchReport(BaseModel):
    """What a cost-model search says of the plan it returned."""

    model_config = ConfigDict(extra="forbid")

    evaluations: int | None = None  # the plan prices it computed: what its budget counts
    cut_short: str | None = None  # why its budget ended it before it finished; None: it finished
    proven_optimal: bool | None = None  # exact solvers: whether it finished, and so proved the best of its plans
    started_from: str | None = None  # cost-model searches: the plans the beam started from, and why those
    sampled: str | None = None  # a policy's sampled plans (`dreamshard --samples`): how many, and which was kept
    kept_baseline: str | None = None  # cost_search: a greedy heuristic's plan kept, priced below what it reached


class TableChoice(BaseModel):
    """Why a table is sharded as it is (`plan --explain`): the plan's predicted cost with it switched to each
    other type it may take."""

    model_config = ConfigDict(extra="forbid")

    table: str
    sharding_type: str
    devices: list[int]
    alternatives_ms: dict[str, float | None]  # None: that type does not fit beside the rest

    @property
    def next_best(self) -> tuple[str, float] | None:
        fitting = [(kind, ms) for kind, ms in self.alternatives_ms.items() if ms is not None]
        return min(fitting, key=lambda item: item[1]) if fitting else None


# Keys plan files kept in `metadata` before settings, estimates and search reports were typed, and where they go.
_LEGACY_ESTIMATE = ("predicted", "lower_bound_ms")
_LEGACY_SETTINGS = ("memory_gb", "batch_size", "optimizer", "seed")
_LEGACY_SEARCH = {
    "search_evaluations": "evaluations",
    "search_cut_short": "cut_short",
    "proven_optimal": "proven_optimal",
}


def _lift_legacy_metadata(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    data = _lift_search_report(data)
    if not isinstance(data.get("metadata"), dict):
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


def _lift_search_report(data: dict) -> dict:
    """A search's report and explanation out of `metadata` (and, for proven optimality, `estimate`), where plan
    files kept them before they were typed."""
    metadata = dict(data.get("metadata") or {})
    estimate = dict(data["estimate"]) if isinstance(data.get("estimate"), dict) else None
    report = {new: metadata.pop(old) for old, new in _LEGACY_SEARCH.items() if old in metadata}
    if estimate is not None and "proven_optimal" in estimate:
        report["proven_optimal"] = estimate.pop("proven_optimal")
    report = {k: v for k, v in report.items() if v is not None}
    explanation = metadata.pop("explain", None)
    if not report and explanation is None and estimate == data.get("estimate"):
        return data
    data = {**data, "metadata": metadata, **({"estimate": estimate} if estimate is not None else {})}
    if report and "search" not in data:
        data["search"] = report
    if explanation is not None and "explanation" not in data:
        data["explanation"] = explanation
    return data


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1, 2] = PLAN_FORMAT_VERSION
    num_devices: int = Field(ge=1)
    algorithm: str
    placement_seconds: float = Field(default=0.0, ge=0)
    shards: list[Shard] = Field(min_length=1)
    # Each table's sharding; None in format 1 (read off the shards' geometry by `table_shardings`).
    tables: dict[str, TableSharding] | None = None
    settings: PlanSettings | None = None
    memory_bytes: list[int] | None = None  # per device, weights plus optimizer state
    estimate: PlanEstimate | None = None
    search: SearchReport | None = None  # what the cost-model search that made it says of it
    explanation: list[TableChoice] | None = None  # plan --explain: why each table is sharded as it is
    measured: MeasuredComparison | None = None  # plan --measure: the comparison this plan won on the hardware
    metadata: dict[str, Any] = Field(default_factory=dict)  # what older files kept that no field holds

    @model_validator(mode="before")
    @classmethod
    def _read_older_formats(cls, data: Any) -> Any:
        if isinstance(data, dict) and "format_version" not in data:
            data = {**data, "format_version": 1 if data.get("tables") is None else PLAN_FORMAT_VERSION}
        return _lift_legacy_metadata(data)

    @model_validator(mode="after")
    def _tables_recorded_from_format_2(self) -> Plan:
        if self.format_version >= 2 and self.tables is None:
            raise ValueError("a plan of format_version 2 records each table's sharding in `tables`")
        if self.format_version == 1 and self.tables is not None:
            raise ValueError("`tables` came with format_version 2; give it, or leave `tables` out")
        return self

    @classmethod
    def from_assignment(
        cls, pieces: list[TablePiece], devices: Sequence[int], num_devices: int, algorithm: str
    ) -> Plan:
        """The plan putting each piece (a table's column and row range, or a replica) on its device; it records
        each table's sharding as the pieces have it."""
        shards = [
            Shard(table=p.table.name, device=int(d), columns=p.columns, rows=p.rows, replicated=p.replicated)
            for p, d in zip(pieces, devices, strict=True)
        ]
        of_table: dict[str, list[tuple[TablePiece, int]]] = defaultdict(list)
        for piece, device in zip(pieces, devices):
            of_table[piece.table.name].append((piece, int(device)))
        tables = {name: TableSharding.of_pieces(*zip(*placed)) for name, placed in of_table.items()}
        return cls(num_devices=num_devices, algorithm=algorithm, shards=shards, tables=tables)

    @property
    def devices_per_host(self) -> int | None:
        """The devices per host of a plan made over several hosts (`plan --devices-per-host`); None: one host."""
        per_host = self.settings.devices_per_host if self.settings is not None else None
        return per_host if per_host is not None and per_host < self.num_devices else None

    @property
    def inter_host_gbps(self) -> float | None:
        """The bandwidth between hosts the plan was made for, where its settings record one (plan files of earlier
        releases, and hand-written ones, may not: `shard_ray.costmodel.links.plan_links_between_hosts` prices them)."""
        return self.settings.inter_host_gbps if self.settings is not None else None

    @property
    def intra_host_gbps(self) -> float | None:
        """The bandwidth inside a host the plan was given (`--intra-host-gbps`), if any: else the models' profile's."""
        return self.settings.intra_host_gbps if self.settings is not None else None

    @property
    def host_link_gbps(self) -> float | None:
        """The bandwidth of the link a host's devices share to other hosts (`--host-link-gbps`), if the plan had one."""
        return self.settings.host_link_gbps if self.settings is not None else None

    def shards_of(self) -> dict[str, list[Shard]]:
        """Each table's shards, in plan order."""
        of_table: dict[str, list[Shard]] = defaultdict(list)
        for shard in self.shards:
            of_table[shard.table].append(shard)
        return of_table

    def table_shardings(self, tables: list[TableSpec]) -> dict[str, TableSharding]:
        """Each table's sharding: as recorded, or, for a plan file of format 1, read off its shards."""
        if self.tables is not None:
            return self.tables
        by_name = {t.name: t for t in tables}
        return {
            name: inferred_sharding(by_name[name], shards, self.devices_per_host)
            for name, shards in self.shards_of().items()
        }

    def pieces(self, tables: list[TableSpec]) -> list[list[TablePiece]]:
        """What every device holds, in plan order: its fused shard, each piece as the plan's algorithm placed it
        (pinned, within a host, in a constraints group)."""
        by_name = {t.name: t for t in tables}
        shardings = self.table_shardings(tables)
        held: list[list[TablePiece]] = [[] for _ in range(self.num_devices)]
        for shard in self.shards:
            held[shard.device].append(self._piece(shard, by_name[shard.table], shardings[shard.table]))
        return held

    def assignment(self, tables: list[TableSpec]) -> tuple[list[TablePiece], np.ndarray]:
        """Every piece of the plan device by device (`pieces` flattened) and the device each is on, as the searches
        and the pricer take them."""
        by_device = self.pieces(tables)
        devices = [d for d, held in enumerate(by_device) for _ in held]
        return [p for held in by_device for p in held], np.array(devices, dtype=np.int64)

    def _piece(self, shard: Shard, table: TableSpec, sharding: TableSharding) -> TablePiece:
        return TablePiece(
            table=table,
            columns=shard.columns,
            rows=None if shard.rows is None or shard.rows == (0, table.rows) else shard.rows,
            replicas=self.num_devices if shard.replicated else 1,
            devices=(shard.device,) if sharding.type in PINNED_TYPES else sharding.devices,
            group=sharding.group,
            within_host=(self.devices_per_host or 1) if sharding.type == "table_row_wise" else 1,
        )

    def shards_on(self, device: int) -> list[Shard]:
        return [s for s in self.shards if s.device == device]

    def check(self, tables: list[TableSpec]) -> None:
        """Raise a ShardRayError unless every table is placed exactly once on valid devices.

        A table's shards tile its rows x columns exactly (table-, column-, row-wise or a grid of
        these), or it is data-parallel: one replicated shard, the whole table, on every device.
        """
        by_name = {t.name: t for t in tables}
        of_table: dict[str, list[Shard]] = defaultdict(list)
        for shard in self.shards:
            if shard.table not in by_name:
                raise ShardRayError(f"plan places table {shard.table!r}, which is not in the table file")
            if shard.device >= self.num_devices:
                raise ShardRayError(f"plan puts table {shard.table!r} on device {shard.device} of {self.num_devices}")
            of_table[shard.table].append(shard)
        for name, table in by_name.items():
            shards = of_table.get(name, [])
            if not shards:
                raise ShardRayError(f"plan does not place table {name!r}")
            for shard in shards:
                if shard.columns[1] > table.dim:
                    raise ShardRayError(
                        f"plan's shard of table {name!r} has columns [{shard.columns[0]}, {shard.columns[1]}) beyond its {table.dim}"
                    )
                if shard.rows is not None and shard.rows[1] > table.rows:
                    raise ShardRayError(
                        f"plan's shard of table {name!r} has rows [{shard.rows[0]}, {shard.rows[1]}) beyond its {table.rows}"
                    )
            if any(s.replicated for s in shards):
                _check_replicated(table, shards, self.num_devices)
            else:
                _check_tiling(table, shards)
        if self.tables is not None:
            self._check_recorded_shardings(by_name, of_table)

    def _check_recorded_shardings(self, by_name: dict[str, TableSpec], of_table: dict[str, list[Shard]]) -> None:
        """Each table's recorded sharding is one its shards can have: a plan edited by hand may not say
        table-wise of a table split in two."""
        if set(self.tables) != set(of_table):
            named = sorted(set(self.tables) ^ set(of_table))
            raise ShardRayError(f"plan's `tables` and its shards name different tables: {named}")
        for name, recorded in self.tables.items():
            seen = inferred_sharding(by_name[name], of_table[name], self.devices_per_host)
            # Row blocks that fit on one host's devices are laid out alike row-wise and table-row-wise.
            alike = recorded.type == "row_wise" and seen.type == "table_row_wise"
            if (recorded.type, recorded.host) != (seen.type, seen.host) and not alike:
                raise ShardRayError(
                    f"plan records table {name!r} as {recorded.type}"
                    + (f" on host {recorded.host}" if recorded.host is not None else "")
                    + f", but its shards are laid out {seen.type}"
                    + (f" on host {seen.host}" if seen.host is not None else "")
                )

    def topology(self) -> Topology:
        """The topology the plan was made for, as its settings record it."""
        if self.settings is None:
            raise ShardRayError("the plan records no settings (a plan written by hand, say): not the devices it is for")
        return self.settings.topology(self.num_devices)

    def device_memory_bytes(self, tables: list[TableSpec], topology: Topology) -> list[int]:
        used = [0] * self.num_devices
        for device, pieces in enumerate(self.pieces(tables)):
            used[device] = sum(p.memory_bytes(topology.optimizer) for p in pieces)
        return used

    def check_memory(self, tables: list[TableSpec], topology: Topology) -> None:
        """Refuse a plan that puts more on a device than its memory cap."""
        for device, used in enumerate(self.device_memory_bytes(tables, topology)):
            if used > topology.memory_bytes:
                raise InfeasibleError(
                    f"plan needs {used / GB:.3f} GiB on device {device}, over the cap of "
                    f"{topology.memory_gb:.3f} GiB (weights + {topology.optimizer} state)"
                )


def _check_replicated(table: TableSpec, shards: list[Shard], num_devices: int) -> None:
    name = table.name
    if not all(s.replicated for s in shards):
        raise ShardRayError(
            f"plan's table {name!r} has replicated and non-replicated shards; a table is one or the other"
        )
    whole = [s for s in shards if s.columns == (0, table.dim) and s.rows in (None, (0, table.rows))]
    if len(whole) != len(shards):
        raise ShardRayError(f"plan's replicated shards of table {name!r} must each be the whole table")
    if sorted(s.device for s in shards) != list(range(num_devices)):
        raise ShardRayError(
            f"plan's data-parallel table {name!r} must have one replicated shard on each of the {num_devices} devices"
        )


def _check_tiling(table: TableSpec, shards: list[Shard]) -> None:
    """The shards' rectangles cover the table's rows x columns exactly once: counted on the grid of their cuts."""
    if len(shards) == 1 and shards[0].columns == (0, table.dim) and shards[0].rows in (None, (0, table.rows)):
        return  # the table whole, as most are: its one rectangle is the table (0.03 ms a table on the grid)
    row_ranges = [s.rows or (0, table.rows) for s in shards]
    row_cuts = np.unique([0, table.rows, *(r for rows in row_ranges for r in rows)])
    column_cuts = np.unique([0, table.dim, *(c for s in shards for c in s.columns)])
    cover = np.zeros((len(row_cuts), len(column_cuts)), dtype=np.int64)  # a 2-D difference array
    for rows, shard in zip(row_ranges, shards):
        r0, r1 = np.searchsorted(row_cuts, rows)
        c0, c1 = np.searchsorted(column_cuts, shard.columns)
        cover[r0, c0] += 1
        cover[r0, c1] -= 1
        cover[r1, c0] -= 1
        cover[r1, c1] += 1
    cover = cover.cumsum(axis=0).cumsum(axis=1)[:-1, :-1]
    for problem, cells in (("overlap", cover > 1), ("leave a gap", cover == 0)):
        if cells.any():
            r, c = (int(i) for i in np.argwhere(cells)[0])
            rows = "" if len(row_cuts) == 2 else f"rows [{row_cuts[r]}, {row_cuts[r + 1]}), "
            raise ShardRayError(
                f"plan's shards of table {table.name!r} {problem} at {rows}columns [{column_cuts[c]}, {column_cuts[c + 1]})"
            )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    return read_model(path, "plan", Plan, "a JSON object")


def save_plan(path: str | os.PathLike[str], plan: Plan) -> None:
    """Write a plan file: YAML when named .yaml or .yml, JSON otherwise."""
    write_document(path, plan.model_dump(mode="json"))
