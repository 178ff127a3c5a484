"""The enumeration stage: the sharding options each table may take, and the pieces every algorithm places.

As TorchRec's planner separates its enumerator from its proposers and partitioners, this lists
what fits a device under the topology and the constraints; the algorithms choose among it.
"""

from __future__ import annotations

from collections.abc import Sequence

from shard_ray.errors import UnplaceableError
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.piece import (
    SHARDING_TYPES,
    TablePiece,
    data_parallel,
    replica,
    row_block,
    row_wise,
    split_piece,
    table_row_wise,
)
from shard_ray.plan.topology import Topology, format_gb
from shard_ray.workload.tables import TableSpec

# The type a table takes to be placed at all, first that fits: whole, else as TorchRec splits to fit.
PREFERENCE = ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel")


def table_options(
    table: TableSpec,
    topology: Topology,
    constraints: Constraints | None = None,
    allowed: Sequence[str] = SHARDING_TYPES,
) -> dict[str, list[TablePiece]]:
    """The pieces of each sharding type the table may take (in `allowed` and its constraints) that fit
    a device each, in the order `pieces_to_place` prefers them; pieces carry the constraints' devices and group."""
    d = topology.num_devices
    kinds = [
        k
        for k in SHARDING_TYPES
        if k in allowed and (constraints is None or k in constraints.allowed_types(table.name))
    ]
    devices = constraints.devices_of(table.name) if constraints else None
    group = constraints.group_of(table.name) if constraints else None
    whole = TablePiece(table=table, columns=(0, table.dim), devices=devices, group=group)
    local = topology.devices_per_host_or_all

    def column_slices() -> int:
        """In halves, or in as few more slices (one a device) as fit a device where halves do not: a table that only
        column quarters fit was refused under constraints allowing it column-wise alone."""
        ways, room = 2, d if devices is None else len(devices)
        while (
            2 * ways <= room
            and table.dim % (8 * ways) == 0
            and whole.model_copy(update={"columns": (0, table.dim // ways)}).memory_bytes(topology.optimizer)
            > topology.memory_bytes
        ):
            ways *= 2
        return ways

    # Each type's first piece is its largest (the last row block holds the rest): it alone is checked
    # against the cap, and only types that fit are cut, so a table over many devices costs little.
    largest = {
        "table_wise": lambda: whole,
        "row_wise": lambda: TablePiece(
            table=table, columns=(0, table.dim), rows=(0, min(row_block(table, d), table.rows))
        ),
        "table_row_wise": lambda: TablePiece(
            table=table, columns=(0, table.dim), rows=(0, min(row_block(table, local), table.rows))
        ),
        "column_wise": lambda: whole.model_copy(update={"columns": (0, table.dim // column_slices())}),
        "data_parallel": lambda: replica(table, d, 0),
    }
    cut = {
        "table_wise": lambda: [whole],
        "row_wise": lambda: row_wise(table, d),
        # host 0's blocks; the search tries the table on other hosts (`shard_ray.placement.options`)
        "table_row_wise": lambda: table_row_wise(table, local, 0),
        "column_wise": lambda: split_piece(whole, column_slices()),
        "data_parallel": lambda: data_parallel(table, d),
    }
    ruled_out = types_ruled_out(table, topology)
    return {
        kind: cut[kind]()
        for kind in PREFERENCE
        if kind in kinds
        and kind not in ruled_out
        and largest[kind]().memory_bytes(topology.optimizer) <= topology.memory_bytes
    }


def types_ruled_out(table: TableSpec, topology: Topology) -> dict[str, str]:
    """The sharding types the table's shape or the devices rule out, whatever the memory, each with why."""
    d, local = topology.num_devices, topology.devices_per_host_or_all
    why: dict[str, str] = {}
    if d == 1:
        why |= dict.fromkeys(("row_wise", "column_wise", "data_parallel"), "one device")
    # Split by rows, a table of one row would be one block: laid out as the table whole, a plan recording it split
    # by rows was refused as laid out otherwise (TorchRec would give the other devices empty blocks).
    if table.rows <= 1:
        why |= dict.fromkeys(("row_wise", "table_row_wise"), "a table of one row")
    if topology.num_hosts <= 1 or local <= 1:
        why.setdefault("table_row_wise", "one host" if topology.num_hosts <= 1 else "one device a host")
    if table.dim % 8:
        why.setdefault("column_wise", f"a dim of {table.dim}, not a multiple of 8")
    return why


def pieces_to_place(
    tables: list[TableSpec], topology: Topology, constraints: Constraints | None = None
) -> list[TablePiece]:
    """What every algorithm places: each table whole, or split to fit when no device can hold it whole.

    A table larger than a device is sharded row-wise over all devices, as TorchRec would (its pieces
    pinned). Under constraints, a table takes the first type they allow that fits (table-wise,
    row-wise, column-wise, data-parallel). A table with no such type is refused, by name, and so
    are tables that need more than all devices hold.
    """
    pieces = []
    for table in tables:
        chosen = next((o for kind in PREFERENCE if (o := table_options(table, topology, constraints, (kind,)))), None)
        if chosen:
            pieces.extend(next(iter(chosen.values())))
            continue
        need = TablePiece.whole(table).memory_bytes(topology.optimizer)
        allowed = constraints.allowed_types(table.name) if constraints else SHARDING_TYPES
        ruled_out = types_ruled_out(table, topology)
        if all(kind in ruled_out for kind in allowed):  # not memory: none of them can cut this table here
            raise UnplaceableError(
                f"constraints leave table {table.name!r} no sharding type it can take: "
                + "; ".join(f"{kind} (not with {ruled_out[kind]})" for kind in allowed)
            )
        largest = max(p.memory_bytes(topology.optimizer) for p in row_wise(table, topology.num_devices))
        if "row_wise" in allowed:
            raise UnplaceableError(
                f"table {table.name!r} needs {format_gb(need)} (weights + {topology.optimizer} state): even cut "
                f"row-wise over all {topology.num_devices} devices a piece needs {format_gb(largest)}, over the "
                f"cap of {format_gb(topology.memory_bytes)} per device"
            )
        group = constraints.group_of(table.name) if constraints else None
        why = "its constraints allow" if group is None else "its group in the constraints allows (a group goes whole)"
        raise UnplaceableError(
            f"table {table.name!r} needs {format_gb(need)} (weights + {topology.optimizer} state) and the "
            f"sharding types {why} ({', '.join(allowed)}) leave a piece over the cap of "
            f"{format_gb(topology.memory_bytes)} per device"
            + (
                f"; row-wise over all devices would need {format_gb(largest)} a device"
                if largest <= topology.memory_bytes
                else ""
            )
            + "".join(f"; {kind} is not possible with {ruled_out[kind]}" for kind in allowed if kind in ruled_out)
        )
    total = sum(p.memory_bytes(topology.optimizer) for p in pieces)
    if total > topology.num_devices * topology.memory_bytes:
        raise UnplaceableError(
            f"the tables need {format_gb(total)} (weights + {topology.optimizer} state), more than the "
            + (
                f"{topology.num_devices} devices' {format_gb(topology.num_devices * topology.memory_bytes)} together"
                if topology.num_devices > 1
                else f"device's {format_gb(topology.memory_bytes)}"
            )
        )
    return pieces
