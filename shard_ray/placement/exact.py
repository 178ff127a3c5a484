"""The exact optimum of the simulated cost for small table-wise tasks, by branch and bound.

Tables go in order of predicted single-table cost, largest first; a branch is cut when its
slowest device's predicted compute already reaches the best complete plan (compute only grows
as tables are added), and devices alike are interchangeable, so a table tries only the first of
them: devices on one host holding pieces alike (none, or the same table's row blocks, say) with
the same room and the same later pieces allowed. The greedy grid's plan is the first incumbent.
Knowing the optimum of small tasks tells how far every other algorithm is from the best possible
plan under the models.

The search is exponential in the tables: its budget counts model evaluations, as the other searches' do, so that
a task too large to prove stops at the same plan on any machine, the best found, and says it is not proven. The
default is about a minute on one core (docs/commands.md); `--set max_evaluations=...` gives more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shard_ray.costmodel.pricing import Candidate, Pricer, single_costs
from shard_ray.errors import InfeasibleError
from shard_ray.placement.base import PlacementContext, Placer, register, with_splitting_hint
from shard_ray.placement.budget import SearchBudget, Spending
from shard_ray.placement.search import NEUROSHARD, SearchProgress, greedy_grid
from shard_ray.plan.enumerator import pieces_to_place
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.plan import Plan, SearchReport
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec

MAX_TABLES = 14


@dataclass(frozen=True)
class ExactBudget(SearchBudget):
    """The search's budget, by default 50 million model evaluations: about a minute on one core of the 2-core AMD
    EPYC at 8 devices, where the 2 million nodes it was given before would take about 21 minutes, at 1,550 a second (a
    walk stopped one after 10)."""

    max_evaluations: int | None = 50_000_000


def branch_and_bound(
    pricer: Pricer, tables: list[TableSpec], budget: SearchBudget = ExactBudget()
) -> tuple[Candidate, Spending]:
    """The best table-wise plan by simulated cost found within `budget`, and the budget's spending: the plan is the
    proven optimum where nothing cut the search short (`spending.cut_short()` is None)."""
    topology = pricer.topology
    d = topology.num_devices
    pieces = pieces_to_place(tables, topology)
    order = np.lexsort((-single_costs(pricer, pieces), [not p.restricted for p in pieces]))  # fixed devices first
    pieces = [pieces[i] for i in order]
    enc = pricer.encodings(pieces)
    sizes = pricer.sizes(pieces)
    need = sizes.need
    # pieces alike to the prices: one id for those of one encoding, widths, memory and set of collectives
    alike: dict[tuple, int] = {}
    kind_of = [
        alike.setdefault((enc[i].tobytes(), *(float(a[i]) for a in (sizes.widths, sizes.inputs, sizes.host_sums)),
                          int(need[i]), int(sizes.kinds[i])), len(alike))
        for i in range(len(pieces))
    ]  # fmt: skip
    held: list[tuple[int, ...]] = [()] * d  # the kinds of piece each device holds, sorted
    host = [x // topology.devices_per_host_or_all for x in range(d)]
    # for each piece, the pieces from it on that each device may take (all of them, for most tasks: no need to ask)
    if sizes.allowed.all():
        allowed_from = [[b""] * d] * len(pieces)
    else:
        allowed_from = [[sizes.allowed[k:, x].tobytes() for x in range(d)] for k in range(len(pieces))]
    incumbent = greedy_grid(pricer, pieces, NEUROSHARD.scales)
    best = {"cost": incumbent.cost, "assign": incumbent.assign.copy()}
    sums = np.zeros((d, enc.shape[1]), dtype=np.float32)
    counts = np.zeros(d, dtype=np.float32)
    compute = np.zeros(d)
    ledger = MemoryLedger(topology)
    assign = np.zeros(len(pieces), dtype=np.int64)
    spending = Spending(pricer, budget)
    end, progress = spending.until(1.0), SearchProgress(spending, "optimal")

    def visit(k: int) -> None:
        if end.reached():
            return
        progress.show("branch and bound", best["cost"])
        devices, seen, free, allowed = [], set(), ledger.free.tolist(), allowed_from[k]
        for x in range(d):
            if free[x] >= need[k] and sizes.allowed[k, x]:
                state = (host[x], held[x], free[x], allowed[x])
                if state not in seen:
                    seen.add(state)
                    devices.append(x)
        if not devices:
            return
        idx = np.array(devices)
        priced = pricer.compute(sums[idx] + enc[k], counts[idx] + 1)
        order = np.argsort(priced)
        if k == len(pieces) - 1:  # the plans this last piece completes, priced in one call, kept in that order
            slowest = compute.max()
            leaves = [j for j in order if max(float(priced[j]), slowest) < best["cost"]]
            plans = np.tile(assign, (len(leaves), 1))
            plans[:, k] = [devices[j] for j in leaves]
            costs = pricer.device_costs(enc, sizes, plans).max(axis=1) if leaves else []
            for j, plan, cost in zip(leaves, plans, costs):
                # cut as the loop below cuts, against the best plan so far: it may be a leaf of this same call
                if max(float(priced[j]), slowest) < best["cost"] and cost < best["cost"]:
                    best["cost"], best["assign"] = float(cost), plan
            return
        for j in order:
            x, new = devices[j], float(priced[j])
            if max(new, compute.max()) >= best["cost"]:
                continue
            old = compute[x]
            sums[x] += enc[k]
            counts[x] += 1
            compute[x] = new
            ledger.take(x, need[k])
            before = held[x]
            held[x] = tuple(sorted((*before, kind_of[k])))
            assign[k] = x
            visit(k + 1)
            held[x] = before
            sums[x] -= enc[k]
            counts[x] -= 1
            compute[x] = old
            ledger.give(x, need[k])

    try:
        visit(0)
    finally:
        progress.close()
    return Candidate(pieces, best["assign"], best["cost"]), spending


@register(
    "optimal",
    "exact",
    f"branch and bound: the best table-wise plan under the cost models (up to {MAX_TABLES} tables; a table no device "
    "holds whole is cut row-wise first); algorithms that split tables may price lower",
    settings=ExactBudget,
    max_tables=MAX_TABLES,
    draws_progress=True,
)
def optimal(context: PlacementContext) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        pricer = Pricer(context.models, topology)
        try:
            candidate, spending = branch_and_bound(pricer, tables, context.settings)
        except InfeasibleError as err:
            raise with_splitting_hint(err, "optimal splits by rows only the tables no device holds whole") from None
        cut_short = spending.cut_short()
        report = SearchReport(
            evaluations=pricer.evaluations,
            cut_short=cut_short and f"{cut_short}; the plan is the best found, not proven optimal",
            proven_optimal=cut_short is None,
        )
        return candidate.plan(topology.num_devices, "optimal").model_copy(update={"search": report})

    return placer
