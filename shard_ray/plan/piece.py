"""What a device holds of a table, and how TorchRec's sharding types cut a table into such pieces."""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shard_ray.plan.topology import Optimizer, shard_bytes
from shard_ray.workload.tables import TableSpec


class TablePiece(BaseModel):
    """What a device holds of a table, priced, profiled and placed as one.

    A range of the table's columns and (for row-wise sharding) of its rows, or, with `replicas`
    > 1, one of a data-parallel table's whole replicas, which looks up only its device's share of
    the batch. The plan file records it as a `Shard` (the table's name, a device, the ranges); the
    searches, the cost models and the profilers work on pieces, which carry the table's whole spec.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: TableSpec
    columns: tuple[int, int]
    rows: tuple[int, int] | None = None  # [start, end) of the table's rows; None: all of them
    replicas: int = Field(default=1, ge=1)  # > 1: a data-parallel replica, one per device of `replicas`
    # Where the piece may go (None: any device): TorchRec's row-wise block k lives on device k, replica
    # k likewise, and a constraints file may name a table's devices. Not part of its cost.
    devices: tuple[int, ...] | None = None
    group: int | None = None  # a constraints file's group: its tables go whole on one device
    # > 1: a table-row-wise block, one of a table's row blocks on the `within_host` devices of one host,
    # whose partial sums are added up inside the host before its share of them crosses to other hosts.
    # How its output travels, not what its lookups cost.
    within_host: int = Field(default=1, ge=1)

    @property
    def restricted(self) -> bool:
        """Where it goes is (partly) decided already: such pieces are placed first."""
        return self.devices is not None or self.group is not None

    @classmethod
    def whole(cls, table: TableSpec) -> TablePiece:
        return cls(table=table, columns=(0, table.dim))

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    @property
    def row_range(self) -> tuple[int, int]:
        return self.rows if self.rows is not None else (0, self.table.rows)

    @property
    def row_count(self) -> int:
        # read without `row_range`'s tuple: the searches and the policy read it hundreds of thousands of times a plan
        rows = self.rows
        return self.table.rows if rows is None else rows[1] - rows[0]

    def allocated_rows(self, cap: int | None) -> int:
        """Rows a kernel allocates for the piece when at most `cap` rows are allocated per table (profiling on CPU)."""
        return self.row_count if cap is None else min(self.row_count, cap)

    @property
    def replicated(self) -> bool:
        return self.replicas > 1

    @property
    def sharding_type(self) -> CollectiveType:
        """The sharding type whose collectives carry the piece's lookups and output, as TorchRec runs a set for
        each type: read off the piece (a column range of a table split by columns, a row block, a replica), so a
        column-wise table in one piece is table-wise, as TorchRec records it, and a row block of some of a table's
        columns is a grid's."""
        if self.replicated:
            return "data_parallel"
        if self.within_host > 1:
            return "table_row_wise"
        split_rows = self.row_count != self.table.rows
        if self.width != self.table.dim:
            return "grid" if split_rows else "column_wise"
        return "row_wise" if split_rows else "table_wise"

    @cached_property
    def key(self) -> tuple:
        """What tells this piece apart from the other pieces of a plan. Kept once computed: the searches look pieces
        up by it millions of times (`model_copy` drops it, as the copy's fields may differ)."""
        name, columns, rows, replicas, group, within_host = self.priced_key
        return (name, columns, rows, replicas, self.devices, group, within_host)

    @cached_property
    def priced_key(self) -> tuple:
        """`key` without `devices`, which is not part of a piece's cost: pieces alike but for where they may go (a
        table's row blocks on one host or another) are encoded and sized once (`Pricer`)."""
        rows = self.rows if self.rows is not None else (0, self.table.rows)
        return (self.table.name, self.columns, rows, self.replicas, self.group, self.within_host)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> TablePiece:
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("key", None)
        copied.__dict__.pop("priced_key", None)
        return copied

    def describe(self) -> str:
        """The piece for a message: 'table 't0'', 'rows [0, 500) of table 't0'', ..."""
        ranges = []
        if self.row_count != self.table.rows:
            ranges.append(f"rows [{self.row_range[0]}, {self.row_range[1]})")
        if self.width != self.table.dim:
            ranges.append(f"columns [{self.columns[0]}, {self.columns[1]})")
        whose = f"table {self.table.name!r}"
        return f"{', '.join(ranges)} of {whose}" if ranges else whose

    def content(self) -> dict:
        """What determines this piece's cost: the table's spec less its name, the width, the rows, the replicas."""
        spec = self.table.model_dump(mode="json", exclude={"name"})
        spec["dim"] = self.width
        # Only non-default ranges are recorded, so the keys of table- and column-wise measurements stay as they were.
        if self.rows is not None and self.row_count != self.table.rows:
            spec["row_range"] = list(self.rows)
        if self.replicated:
            spec["replicas"] = self.replicas
        return spec

    def memory_bytes(self, optimizer: Optimizer) -> int:
        """Weights and optimizer state of the piece's rows and columns; a replica adds its dense gradient."""
        stored = shard_bytes(self.table, self.width, optimizer, self.row_count)
        if self.replicated:
            stored += self.row_count * self.width * 4
        return stored


# The sharding types of TorchRec a plan expresses (table-row-wise only on topologies of several hosts).
SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


ShardingType = Literal["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel"]
# The sets of collectives a step runs, one per sharding type present, in this order: TorchRec's types, and a
# grid's blocks (a table split by rows and by columns, which the gang runs and TorchRec does not).
COLLECTIVE_TYPES = (*SHARDING_TYPES, "grid")
CollectiveType = Literal[ShardingType, "grid"]


def table_wise(tables: list[TableSpec]) -> list[TablePiece]:
    """Each table whole: the pieces of a table-wise plan."""
    return [TablePiece.whole(t) for t in tables]


def row_block(table: TableSpec, num_devices: int) -> int:
    """TorchRec's row-wise block: ceil(rows / D) rows; the last block holds the rest."""
    return -(-table.rows // num_devices)


def row_wise(table: TableSpec, num_devices: int, columns: tuple[int, int] | None = None) -> list[TablePiece]:
    """The table (or a column range of it) row-wise over the devices, as TorchRec cuts and places it:
    blocks of `row_block` rows, block k pinned to device k (devices past the rows get none)."""
    block = row_block(table, num_devices)
    columns = columns or (0, table.dim)
    return [
        TablePiece(table=table, columns=columns, rows=(start, min(start + block, table.rows)), devices=(k,))
        for k, start in enumerate(range(0, table.rows, block))
    ]


def table_row_wise(table: TableSpec, devices_per_host: int, host: int) -> list[TablePiece]:
    """The table row-wise over one host's devices, as TorchRec's table-row-wise cuts it: blocks of
    ceil(rows / devices_per_host) rows, block k pinned to the host's k-th device."""
    first = host * devices_per_host
    return [
        p.model_copy(update={"devices": (first + p.devices[0],), "within_host": devices_per_host})
        for p in row_wise(table, devices_per_host)
    ]


def replica(table: TableSpec, num_devices: int, device: int) -> TablePiece:
    """The table's data-parallel replica on `device`, of one on each of `num_devices`."""
    return TablePiece(table=table, columns=(0, table.dim), replicas=num_devices, devices=(device,))


def data_parallel(table: TableSpec, num_devices: int) -> list[TablePiece]:
    """The table replicated on every device, replica k pinned to device k."""
    return [replica(table, num_devices, k) for k in range(num_devices)]


def split_piece(piece: TablePiece, ways: int) -> list[TablePiece] | None:
    """The piece's columns in `ways` equal slices, or None when slices would not be multiples of 4 or
    the piece is a row-wise block, a replica or in a constraints group."""
    start, width = piece.columns[0], piece.width
    if width % (4 * ways) or piece.rows is not None or piece.replicated or piece.group is not None:
        return None
    step = width // ways
    return [piece.model_copy(update={"columns": (start + k * step, start + (k + 1) * step)}) for k in range(ways)]
