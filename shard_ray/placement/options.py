"""Sharding types per table, as TorchRec's enumerator lists them, chosen and explained with the cost models.

A table may go table-wise (whole, on a device the search picks), column-wise (halves, each
placed), row-wise (TorchRec's blocks, block k on device k), table-row-wise (over hosts: blocks on
the devices of one host, the host the search picks) or data-parallel (a replica on every
device). `table_options` (shard_ray.plan.plan) lists what fits; `option_costs` prices each
option for one table with every other table left where it is (its free pieces put on the device
the simulated plan cost likes best), which is how `cost_search` chooses a table's type and how
`plan --explain` says what the best other type would have cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from shard_ray.costmodel.pricing import CANDIDATE_DEVICES, Candidate, Pricer, single_costs
from shard_ray.placement.budget import PhaseEnd
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.enumerator import table_options
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.piece import SHARDING_TYPES, TablePiece, replica, table_row_wise, table_wise
from shard_ray.plan.plan import Plan, TableChoice
from shard_ray.plan.summary import device_ranges
from shard_ray.workload.tables import TableSpec

# A table goes table-row-wise on the host, of this many least loaded, that prices the plan lowest.
CANDIDATE_HOSTS = 4
# The plan replicating every table is priced only where it is at most this many pieces (tables x devices): making
# and pricing 20,000 replicas took 1.2 s (5,136 tables on 512 devices would be 2.6 million).
MOST_REPLICAS = 4_096


def switch(pricer: Pricer, placed: Candidate, table: str, pieces: list[TablePiece]) -> Candidate | None:
    """`placed` with `table`'s pieces replaced by `pieces`: pinned ones on their device, others each
    on the device that prices the plan lowest (among the `CANDIDATE_DEVICES` cheapest so far, where
    more have room) of those holding none of the table yet; None when they do not fit beside the rest."""
    keep = [i for i, p in enumerate(placed.pieces) if p.table.name != table]
    placing = [placed.pieces[i] for i in keep] + sorted(pieces, key=lambda p: not p.restricted)
    enc, sizes = pricer.encodings(placing), pricer.sizes(placing)
    assign = np.append(placed.assign[keep], np.zeros(len(pieces), dtype=np.int64))
    ledger = MemoryLedger.of_assignment(pricer.topology, assign[: len(keep)], sizes.need[: len(keep)])
    # Two column slices of the table on one device would run its lookups twice; the models can price
    # that cheaper, no kernel is (see `shard_ray.placement.search.joined_columns`).
    free = np.ones(pricer.topology.num_devices, dtype=bool)
    for k in range(len(keep), len(placing)):
        devices = np.flatnonzero(ledger.room(sizes.need[k]) & sizes.allowed[k] & free)
        if not len(devices):
            return None
        if len(devices) > 1:
            before = sizes.take(slice(0, k))
            if len(devices) > CANDIDATE_DEVICES:
                now = pricer.device_costs(enc[:k], before, assign[:k])
                devices = np.sort(devices[np.argsort(now[devices], kind="stable")[:CANDIDATE_DEVICES]])
            candidates = np.tile(assign[: k + 1], (len(devices), 1))
            candidates[:, k] = devices
            costs = pricer.device_costs(enc[: k + 1], sizes.take(slice(0, k + 1)), candidates).max(axis=1)
            devices = devices[[int(np.argmin(costs))]]
        assign[k] = devices[0]
        free[devices[0]] = False
        ledger.take(int(devices[0]), sizes.need[k])
    return Candidate(placing, assign, float(pricer.device_costs(enc, sizes, assign).max()))


def option_costs(
    pricer: Pricer,
    placed: Candidate,
    table: TableSpec,
    constraints: Constraints | None = None,
    allowed: Sequence[str] = SHARDING_TYPES,
) -> dict[str, Candidate | None]:
    """Each sharding type of `table` with the rest of `placed` kept: the plan it makes (None: it does not fit)."""
    options = table_options(table, pricer.topology, constraints, allowed)
    made = {
        kind: switch(pricer, placed, table.name, pieces) for kind, pieces in options.items() if kind != "table_row_wise"
    }
    if "table_row_wise" in options:
        made["table_row_wise"] = _on_best_host(pricer, placed, table)
    return made


def _on_best_host(pricer: Pricer, placed: Candidate, table: TableSpec) -> Candidate | None:
    """The table table-row-wise on the host that prices the plan lowest, of the `CANDIDATE_HOSTS`
    least loaded (their slowest device the fastest) without it; None when it fits on none."""
    topology = pricer.topology
    others = [i for i, p in enumerate(placed.pieces) if p.table.name != table.name]
    pieces = [placed.pieces[i] for i in others]
    now = pricer.device_costs(pricer.encodings(pieces), pricer.sizes(pieces), placed.assign[others])
    hosts = np.argsort(now.reshape(topology.num_hosts, -1).max(axis=1), kind="stable")[:CANDIDATE_HOSTS]
    made = [
        switch(pricer, placed, table.name, table_row_wise(table, topology.devices_per_host_or_all, int(h)))
        for h in hosts
    ]
    return min((c for c in made if c is not None), key=lambda c: c.cost, default=None)


def choose_types(
    pricer: Pricer,
    placed: Candidate,
    tables: list[TableSpec],
    allowed: Sequence[str],
    until: PhaseEnd,
    constraints: Constraints | None = None,
) -> Candidate:
    """Tables in turn, costliest first, each switched to the sharding type that lowers the simulated
    plan cost most, until a pass changes nothing or the phase's budget is spent."""
    order = np.argsort(-single_costs(pricer, table_wise(tables)), kind="stable")
    if "data_parallel" in allowed and not until.reached():
        replicated = every_table_replicated(pricer, tables, constraints)
        if replicated is not None and replicated.cost < placed.cost * (1 - 1e-4):
            placed = replicated
    improved = True
    while improved:
        improved = False
        for i in order:
            if until.reached():
                return placed
            if constraints is not None and constraints.group_of(tables[i].name) is not None:
                continue  # a group's tables stay together, table-wise
            options = [c for c in option_costs(pricer, placed, tables[i], constraints, allowed).values() if c]
            best = min(options, key=lambda c: c.cost, default=None)
            if best is not None and best.cost < placed.cost * (1 - 1e-4):
                placed, improved = best, True
    return placed


def every_table_replicated(
    pricer: Pricer, tables: list[TableSpec], constraints: Constraints | None = None
) -> Candidate | None:
    """The plan replicating every table, which no switch of one table reaches where replicas are cheaper only all
    together (the last table's all-to-all gone with it); None where a table may not be replicated, the replicas do
    not fit a device's memory together, or they would be more than `MOST_REPLICAS` pieces."""
    topology = pricer.topology
    if len(tables) * topology.num_devices > MOST_REPLICAS:
        return None
    ledger = MemoryLedger(topology)
    if sum(ledger.need(replica(t, topology.num_devices, 0)) for t in tables) > topology.memory_bytes:
        return None
    pieces = []
    for table in tables:
        replicas = table_options(table, topology, constraints, ("data_parallel",)).get("data_parallel")
        if replicas is None or (constraints is not None and constraints.group_of(table.name) is not None):
            return None
        pieces += replicas
    assign = np.array([p.devices[0] for p in pieces], dtype=np.int64)
    return Candidate(pieces, assign, pricer.plan_cost(pieces, assign))


def explain(
    pricer: Pricer, plan: Plan, tables: list[TableSpec], constraints: Constraints | None = None, progress: bool = True
) -> tuple[float, list[TableChoice]]:
    """The plan's simulated cost and, per table, its type, devices and the cost of every other type it may take."""
    pieces, assign = plan.assignment(tables)
    placed = Candidate(pieces, assign, pricer.plan_cost(pieces, assign))
    choices = []
    shardings = plan.table_shardings(tables)
    for table in tqdm(tables, desc="explaining", unit="table", disable=not progress or len(tables) < 50):
        shards = [s for s in plan.shards if s.table == table.name]
        kind = shardings[table.name].type
        options = option_costs(pricer, placed, table, constraints)
        alternatives = {k: (c.cost if c is not None else None) for k, c in options.items() if k != kind}
        devices = sorted({s.device for s in shards})
        choices.append(TableChoice(table=table.name, sharding_type=kind, devices=devices, alternatives_ms=alternatives))
    return placed.cost, choices


def format_explanation(cost_ms: float, choices: list[TableChoice], constrained: bool) -> str:
    """`plan --explain`'s table; `constrained`: a constraints file was given (a table without another type is said
    to be allowed none only then)."""
    lines = [
        f"why each table is sharded as it is: the predicted plan cost ({cost_ms:.3f} ms as planned) with that "
        "table switched to its best other sharding type, every other table kept (below 0%: switching would "
        "have been cheaper under the models, as for plans made without them, cut short by a budget, or by an "
        "algorithm not given that type: cost_search leaves data_parallel out on one host unless --set "
        "sharding_types=[...] has it)",
        f"{'table':<24} {'type':<14} {'devices':<16} {'best other':<14} {'plan ms':>9} {'vs chosen':>10}",
    ]
    for choice in choices:
        devices = device_ranges(choice.devices)
        best = choice.next_best
        if best is not None:
            tail = f"{best[0]:<14} {best[1]:>9.3f} {best[1] / cost_ms - 1:>+10.1%}"
        elif choice.alternatives_ms:  # every other type the table may take does not fit beside the rest
            tail = "(none fits)"
        else:  # the constraints allow no other, or none applies (one device; a table too narrow to split)
            tail = "(no other type allowed)" if constrained else "(no other type it can take)"
        lines.append(f"{choice.table:<24} {choice.sharding_type:<14} {devices:<16} {tail}")
    return "\n".join(lines)
