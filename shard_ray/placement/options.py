"""Sharding types per table, as TorchRec's enumerator lists them, chosen and explained with the cost models.

A table may go table-wise (whole, on a device the search picks), column-wise (halves, each
placed), row-wise (TorchRec's blocks, block k on device k) or data-parallel (a replica on every
device). `table_options` lists what fits; `best_switch` prices each option for one table with
every other table left where it is (its free pieces put on the device the simulated plan cost
likes best), which is how `cost_search` chooses a table's type and how `plan --explain` says
what the next-best option would have cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from shard_ray.costmodel.pricing import Candidate, Pricer, single_costs
from shard_ray.plan.plan import Shard, TablePiece, data_parallel, row_wise, table_wise
from shard_ray.plan.topology import MemoryLedger, Topology
from shard_ray.workload.tables import TableSpec

SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "data_parallel")


def sharding_type_of(table: TableSpec, shards: Sequence[Shard]) -> str:
    """A table's sharding type in a plan: one of SHARDING_TYPES, or 'grid' for rows and columns both split."""
    if any(s.replicated for s in shards):
        return "data_parallel"
    rows_split = any(s.rows not in (None, (0, table.rows)) for s in shards)
    columns_split = any(s.columns != (0, table.dim) for s in shards)
    if rows_split:
        return "grid" if columns_split else "row_wise"
    return "column_wise" if columns_split else "table_wise"


def table_options(
    table: TableSpec, topology: Topology, allowed: Sequence[str] = SHARDING_TYPES
) -> dict[str, list[TablePiece]]:
    """The pieces of each sharding type in `allowed` that the table can take on this topology (each piece fits a device)."""
    d = topology.num_devices
    options: dict[str, list[TablePiece]] = {"table_wise": [TablePiece.whole(table)]}
    if table.dim % 8 == 0:
        half = table.dim // 2
        options["column_wise"] = [TablePiece(table=table, columns=(k * half, (k + 1) * half)) for k in range(2)]
    if d > 1:
        options["row_wise"] = row_wise(table, d)
        options["data_parallel"] = data_parallel(table, d)
    return {
        kind: pieces
        for kind, pieces in options.items()
        if kind in allowed and max(p.memory_bytes(topology.optimizer) for p in pieces) <= topology.memory_bytes
    }


def switch(pricer: Pricer, placed: Candidate, table: str, pieces: list[TablePiece]) -> Candidate | None:
    """`placed` with `table`'s pieces replaced by `pieces`: pinned ones on their device, others each
    on the device that prices the plan lowest; None when they do not fit beside the rest."""
    topology = pricer.topology
    keep = [i for i, p in enumerate(placed.items) if p.table.name != table]
    items = [placed.items[i] for i in keep]
    assign = placed.assign[keep]
    ledger = MemoryLedger.of_assignment(topology, assign, pricer.sizes(items).need if items else np.zeros(0))
    for piece in sorted(pieces, key=lambda p: not p.restricted):
        need = ledger.need(piece)
        devices = [int(d) for d in np.flatnonzero(ledger.room(need)) if piece.may_go(int(d))]
        if not devices:
            return None
        trial = [*items, piece]
        costs = [pricer.plan_cost(trial, np.append(assign, d)) for d in devices]
        device = devices[int(np.argmin(costs))]
        items, assign = trial, np.append(assign, device)
        ledger.take(device, need)
    return Candidate(items, assign, pricer.plan_cost(items, assign))


def option_costs(
    pricer: Pricer, placed: Candidate, table: TableSpec, allowed: Sequence[str] = SHARDING_TYPES
) -> dict[str, Candidate | None]:
    """Each sharding type of `table` with the rest of `placed` kept: the plan it makes (None: it does not fit)."""
    options = table_options(table, pricer.topology, allowed)
    return {kind: switch(pricer, placed, table.name, pieces) for kind, pieces in options.items()}


def choose_types(
    pricer: Pricer, placed: Candidate, tables: list[TableSpec], allowed: Sequence[str], deadline: float
) -> Candidate:
    """Tables in turn, costliest first, each switched to the sharding type that lowers the simulated
    plan cost most, until a pass changes nothing or the deadline passes."""
    order = np.argsort(-single_costs(pricer, table_wise(tables)), kind="stable")
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for i in order:
            if time.perf_counter() > deadline:
                break
            options = [c for c in option_costs(pricer, placed, tables[i], allowed).values() if c is not None]
            best = min(options, key=lambda c: c.cost, default=None)
            if best is not None and best.cost < placed.cost * (1 - 1e-4):
                placed, improved = best, True
    return placed
