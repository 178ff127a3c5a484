"""Cost-model search: NeuroShard's greedy grid and column-split beam search, and our refinement.

`neuroshard` (as published): tables sorted by predicted single-table cost, largest first; for
each dim-sum cap scale on a grid 1.0..1.5 a greedy pass puts each table on the allowed device
(dim sum under scale x mean, memory permitting) whose fused shard is predicted cheapest with
it; the best pass by simulated plan cost wins. A beam search over column-wise halvings of the
costliest tables reruns the greedy for each candidate split and keeps the best `beam_width`.

`cost_search` (ours) adds what the published search leaves out: splits into halves and
quarters, splits by rows (a table row-wise over every device, the rest re-packed as the greedy
start packs, so several large tables can go row-wise together where one alone would not fit beside
the others whole), the tables packed with every one that dominates the task split at once, and local
search (moves and swaps off the slowest device, judged by the simulated cost of the whole plan) on the
best of the final beam's states and that packing, all within a budget of model evaluations
(`shard_ray.placement.budget`), so that a plan is the same on an idle or a busy machine.

Pricing is incremental (`shard_ray.costmodel.pricing`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np
from tqdm import tqdm

from shard_ray.costmodel.models import CostModels
from shard_ray.costmodel.pricing import CANDIDATE_DEVICES, Candidate, PieceSizes, Pricer, added_up, single_costs
from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.placement.base import LONG_PLACING_S, PlacementContext, Placer, register, with_splitting_hint
from shard_ray.placement.budget import PhaseEnd, SearchBudget, Spending
from shard_ray.placement.options import choose_types
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.enumerator import pieces_to_place, table_options
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.piece import SHARDING_TYPES, TablePiece, row_wise, split_piece
from shard_ray.plan.plan import Plan, SearchReport
from shard_ray.plan.topology import Topology, format_gb
from shard_ray.workload.tables import TableSpec

# Where cost_search's beam may start (`SearchConfig.start`).
Start = Literal["auto", "greedy", "policy"]
STARTS: tuple[str, ...] = get_args(Start)
# cost_search's budget in model evaluations: the searches of the public model shapes at 2 devices
# finish within it, and thousands of tables on hundreds of devices take 7-12 s on one AMD EPYC core.
MAX_EVALUATIONS = 300_000


@dataclass(frozen=True)
class SearchConfig(SearchBudget):
    """cost_search's settings (its defaults are cost_search's); NeuroShard's are `NEUROSHARD`."""

    scales: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)
    beam_width: int = 3
    beam_depth: int = 3
    branching: int = 3  # costliest pieces tried as split candidates per beam state
    split_ways: tuple[int, ...] = (2, 4)
    local_search_steps: int = 200
    # Each table's sharding type is chosen among these after the column-split search (table-wise and
    # column-wise are the beam's own); see `shard_ray.placement.options`. Data-parallel is left out on one
    # host by default: there its plans measured slower than the models predicted on the reference CPU
    # (docs/results.md: Sharding types, measured). Table-row-wise is a choice only on topologies of several hosts.
    sharding_types: tuple[str, ...] = ("table_wise", "column_wise", "row_wise", "table_row_wise")
    # Over hosts, data-parallel joins them: a small table's replicas keep its columns off the links, and on 2
    # emulated hosts at 48 Mbit/s the plan with them measured 10% faster than without, as fast as TorchRec's
    # (which replicates them too), priced within 1% (docs/clusters.md).
    data_parallel_over_hosts: bool = True
    # Anytime search: the greedy start prices by single costs if it would take over 30% of the budget,
    # beam expansion stops at 50%, local search of the beam at 70%, the sharding types' choice (and a
    # last local search) at 100%; a phase the settings leave out gives its share to the one before.
    max_evaluations: int | None = MAX_EVALUATIONS
    # Where the beam starts: the greedy grid's plan ("greedy", NeuroShard's start), or that and the DreamShard
    # policy's greedy plan ("policy": `policy`'s, else the shipped one), the beam keeping the cheaper first; "auto":
    # the policy's too where no constraints file is given and there are no more tables than devices or a table no
    # device holds whole (`start_of_search`): there the grid's moves do not take a set of all-to-alls away (the
    # policy's plans priced 0.82-0.90x the grid's search on few tables a device, docs/results.md).
    start: Start = "auto"
    policy: str | None = None
    # The tables packed with every one that dominates the task split by columns at once (`dominant_split_packing`)
    # joins the beam's states as a candidate for local search: the beam, a split a level, does not reach it where
    # splitting one such table alone prices no lower (each split adds a set of collectives every device pays, while
    # the next such table still sets the cost).
    split_dominant: bool = True
    # The greedy heuristics' plans (`baseline_candidates`) are priced too, and kept where one prices below every plan
    # the search reached: on few tables its grid and moves can miss a balance a proxy finds (MLPerf DLRM-DCNv2 on 2
    # devices: 31.04 ms against size_lookup_greedy's 30.68), and "ours" priced above a baseline by its own models
    # is no plan to hand a user.
    baselines: bool = True

    def check(self) -> None:
        super().check()
        if self.policy is not None and self.start == "greedy":
            raise ShardRayError(
                "start=greedy starts from the grid alone, with no policy: leave --policy out, or give "
                "--set start=policy (or auto, the default)"
            )
        if not self.scales or any(not s > 0 for s in self.scales):
            raise ShardRayError(f"scales must be positive numbers, got {list(self.scales)}")
        if self.beam_width < 1 or self.branching < 1:
            raise ShardRayError("beam_width and branching must be at least 1")
        if self.beam_depth < 0 or self.local_search_steps < 0:
            raise ShardRayError("beam_depth and local_search_steps must be 0 or more")
        if any(w < 2 for w in self.split_ways):
            raise ShardRayError(f"split_ways must be 2 or more, got {list(self.split_ways)}")
        unknown = set(self.sharding_types) - set(SHARDING_TYPES)
        if unknown or "table_wise" not in self.sharding_types:
            raise ShardRayError(
                f"sharding_types must include table_wise and be among {', '.join(SHARDING_TYPES)}; "
                f"got {list(self.sharding_types)}"
            )

    def types_for(self, topology: Topology) -> tuple[str, ...]:
        """The sharding types each table's is chosen among on `topology`: `sharding_types`, with data-parallel over
        hosts where `data_parallel_over_hosts`."""
        if self.data_parallel_over_hosts and topology.num_hosts > 1 and "data_parallel" not in self.sharding_types:
            return (*self.sharding_types, "data_parallel")
        return self.sharding_types


# As published: table- and column-wise only, and no budget (a user may set one: `SearchBudget`).
NEUROSHARD = SearchConfig(
    start="greedy",
    baselines=False,
    split_ways=(2,),
    local_search_steps=0,
    sharding_types=("table_wise", "column_wise"),
    data_parallel_over_hosts=False,
    max_evaluations=None,
    split_dominant=False,
)
COST_SEARCH = SearchConfig()


def greedy_grid(
    pricer: Pricer, pieces: list[TablePiece], scales: tuple[float, ...], until: PhaseEnd | None = None
) -> Candidate:
    """NeuroShard's greedy pass for every dim-sum cap scale at once; the best by simulated cost.

    Tables go largest predicted cost first. When memory is so tight that no pass fits that
    way, the passes are rerun largest memory first, as a memory-first packer would. Passes that
    would run past `until` (projected from their first pieces) give way to the same passes
    pricing a device as the sum of its tables' single costs: no model call per table, so the
    start of a search over thousands of tables and devices stays within its budget.
    """
    enc, sizes = pricer.encodings(pieces), pricer.sizes(pieces)  # looked up once for every pass below
    single = single_costs(pricer, pieces)
    # Groups first, then other pieces with fixed devices: where they go is (partly) not a choice.
    first = (~sizes.restricted, sizes.group < 0)

    def passes(order: np.ndarray) -> tuple[Candidate | None, int | None]:
        try:
            return _greedy_passes(pricer, pieces, enc, sizes, scales, order, until=until)
        except _OutOfBudget:
            return _greedy_passes(pricer, pieces, enc, sizes, scales, order, additive=single)

    found, _ = passes(np.lexsort((-single, *first)))
    if found is None:
        found, stuck = passes(np.lexsort((-sizes.need, *first)))
        if found is None:
            raise InfeasibleError(
                f"the search found no placement within {format_gb(pricer.topology.memory_bytes)} per device: "
                f"placing the largest first, {pieces[stuck].describe()} "
                f"({format_gb(sizes.need[stuck])}) fit on no device"
            )
    return found


class _OutOfBudget(Exception):
    """Greedy passes projected to end past their phase of the budget."""


def _greedy_passes(
    pricer: Pricer,
    pieces: list[TablePiece],
    enc: np.ndarray,
    sizes: PieceSizes,
    scales: tuple[float, ...],
    order: np.ndarray,
    until: PhaseEnd | None = None,
    additive: np.ndarray | None = None,
) -> tuple[Candidate | None, int | None]:
    """One greedy pass per scale, side by side: one model call per table prices it on every pass (`enc` and `sizes`:
    the pieces' encodings and sizes).

    None and the first piece that fit nowhere when no pass finds room for every piece. A constraints
    group goes where its first table goes, which needs room for the whole group. With `additive`
    (each piece's single cost) a device is priced as the sum of its pieces' single costs instead.
    Raises _OutOfBudget when, after its first pieces, the passes project to end past `until`."""
    began = until.mark() if until is not None else None
    probe = min(len(order), 32)  # pieces priced before projecting the passes' end
    topology = pricer.topology
    d, s = topology.num_devices, len(scales)
    widths, need = sizes.widths, sizes.need
    caps = np.asarray(scales)[:, None] * widths.sum() / d
    # each device's encoding sum and piece count per pass, added piece by piece as `added_up` adds them
    sums = np.zeros((s, d, enc.shape[1]), dtype=np.float32)
    counts = np.zeros((s, d), dtype=np.float32)
    current = np.zeros((s, d))  # each device's predicted compute as it fills
    dim_sum = np.zeros((s, d))
    ledger = MemoryLedger(topology, copies=s)
    # A pass's devices in the flattened [s, d] arrays start at `row_start`: a device of each pass is updated or
    # read through one index (an [s, d] pair index costs twice as much, and the passes run this per piece).
    row_start = np.arange(s) * d
    flat_current, flat_dim_sum, flat_free = current.reshape(-1), dim_sum.reshape(-1), ledger.free.reshape(-1)
    masked = (~sizes.allowed).any(axis=1).tolist()  # pieces kept off some devices; the others skip the mask
    group_of = sizes.group.tolist()
    assign = np.zeros((s, len(pieces)), dtype=np.int64)
    feasible = np.ones(s, dtype=bool)
    rows = np.arange(s)
    every_device = np.tile(np.arange(d), (s, 1))
    groups = int(sizes.group.max()) + 1
    group_device = np.full((s, groups), -1)
    group_need = np.bincount(sizes.group[sizes.group >= 0], weights=need[sizes.group >= 0], minlength=groups)
    stuck = None
    for n, i in enumerate(order):
        if n == probe and began is not None and additive is None and until.would_pass(began, n / len(order)):
            raise _OutOfBudget
        g = group_of[i]
        device = None
        if additive is not None and not masked[i] and g < 0:
            # Each pass's least loaded device (the first of equals) is its choice wherever it has room in memory
            # and under the cap, as it mostly has: checked there alone, not over every device as below.
            least = current.argmin(axis=1)
            at = row_start + least
            if (flat_free[at] >= need[i]).all() and (flat_dim_sum[at] + widths[i] <= caps[:, 0]).all():
                device = least
                flat_current[at] += additive[i]
        if device is None:
            fits = ledger.room(need[i])
            if masked[i]:
                fits &= sizes.allowed[i]
            if g >= 0:
                placed = group_device[:, g][:, None]
                first = ledger.room(group_need[g]) & sizes.allowed[sizes.group == g].all(axis=0)
                fits = np.where(placed >= 0, fits & (np.arange(d) == placed), first)
            allowed = fits & (dim_sum + widths[i] <= caps)
            if not allowed.any(axis=1).all():  # some pass's cap (or memory) leaves the piece nowhere
                fit_somewhere = fits.any(axis=1)
                if stuck is None and not fit_somewhere.any():
                    stuck = int(i)
                feasible &= fit_somewhere
                capped_out = ~allowed.any(axis=1)  # passes whose cap leaves the piece nowhere: anywhere it fits
                allowed[capped_out] = fits[capped_out]
            if additive is not None:  # every device's price goes up by the piece's: the cheapest now wins
                device = np.argmin(np.where(allowed, current, np.inf), axis=1)
                flat_current[row_start + device] += additive[i]
            else:
                # The piece is priced on the `CANDIDATE_DEVICES` allowed devices cheapest so far (all of them
                # on smaller topologies): the cheapest device with it is one of the least loaded, and one
                # model call of passes x candidates rows per piece keeps the pass linear in the devices.
                if d <= CANDIDATE_DEVICES:
                    candidates = every_device
                else:
                    keyed = np.where(allowed, current, np.inf)
                    candidates = np.argpartition(keyed, CANDIDATE_DEVICES - 1, axis=1)[:, :CANDIDATE_DEVICES]
                picked = rows[:, None], candidates
                priced = pricer.compute(
                    (sums[picked] + enc[i]).reshape(-1, enc.shape[1]), (counts[picked] + 1).reshape(-1)
                ).reshape(candidates.shape)
                best = np.argmin(np.where(allowed[picked], priced, np.inf), axis=1)
                device = candidates[rows, best]
                current[rows, device] = priced[rows, best]
                sums[rows, device] += enc[i]
                counts[rows, device] += 1
        at = row_start + device
        flat_dim_sum[at] += widths[i]
        ledger.take_flat(at, need[i])
        assign[:, i] = device
        if g >= 0:
            group_device[:, g] = device
    if not feasible.any():
        return None, stuck
    costs = np.full(s, np.inf)
    costs[feasible] = pricer.device_costs(enc, sizes, assign[feasible]).max(axis=1)
    best = int(np.argmin(costs))
    return Candidate(pieces, assign[best], float(costs[best])), None


def local_search(
    pricer: Pricer,
    candidate: Candidate,
    steps: int,
    targets: int = 8,
    until: PhaseEnd | None = None,
    pieces_per_device: int = 32,
) -> Candidate:
    """Moves and swaps of pieces between the slowest device and the `targets` fastest ones.

    A candidate move is priced by the two devices it changes (their fused compute and their
    all-to-alls); the best one is then priced on the whole plan and kept only if the simulated
    plan cost drops. Of a device holding more than `pieces_per_device` movable pieces, that many
    spread evenly over its pieces' predicted costs take part, so a step prices at most
    targets x pieces_per_device x (pieces_per_device + 1) moves however many tables a device holds.
    """
    topology = pricer.topology
    d = topology.num_devices
    if d == 1 or (until is not None and until.reached()):
        return candidate
    pieces, assign, cost = candidate.pieces, candidate.assign.copy(), candidate.cost
    enc = pricer.encodings(pieces)
    sizes = pricer.sizes(pieces)
    widths, need = sizes.widths, sizes.need
    movable = (sizes.group < 0) & (sizes.allowed.sum(axis=1) > 1)
    by_cost = np.argsort(single_costs(pricer, pieces), kind="stable")
    total_width = widths.sum()
    for _ in range(steps):
        if until is not None and until.reached():
            break
        costs = pricer.device_costs(enc, sizes, assign)
        order = np.argsort(-costs)
        slowest = int(order[0])
        free = MemoryLedger.of_assignment(topology, assign, need).free
        device_widths = np.bincount(assign, weights=widths, minlength=d)
        sums = added_up(enc, assign, d)
        counts = np.bincount(assign, minlength=d)
        leaving = _spread(by_cost[(assign[by_cost] == slowest) & movable[by_cost]], pieces_per_device)
        moves = []  # [i leaving the slowest device, j coming back or -1, target t] per row
        for t in order[::-1][:targets]:
            if t == slowest:
                continue
            i = leaving[sizes.allowed[leaving, t]]
            mask = (assign[by_cost] == t) & movable[by_cost] & sizes.allowed[by_cost, slowest]
            j = np.concatenate([[-1], _spread(by_cost[mask], pieces_per_device)])
            ii, jj = np.repeat(i, len(j)), np.tile(j, len(i))
            back = np.where(jj >= 0, need[np.maximum(jj, 0)], 0)
            fits = (free[t] + back >= need[ii]) & (free[slowest] + need[ii] >= back)
            moves.append(np.stack([ii[fits], jj[fits], np.full(fits.sum(), t)], axis=1))
        moves = np.concatenate(moves) if moves else np.zeros((0, 3), dtype=np.int64)
        if not len(moves):
            break
        i_idx, j_idx, t_idx = moves[:, 0], moves[:, 1], moves[:, 2]
        back = np.where(j_idx >= 0, j_idx, 0)
        has_back = (j_idx >= 0).astype(np.float32)[:, None]
        going, returning = enc[i_idx], enc[back] * has_back
        new_slowest = pricer.compute(sums[slowest] - going + returning, counts[slowest] - 1 + (j_idx >= 0))
        new_target = pricer.compute(sums[t_idx] + going - returning, counts[t_idx] + 1 - (j_idx >= 0))
        width_moved = widths[i_idx] - np.where(j_idx >= 0, widths[np.maximum(j_idx, 0)], 0.0)
        w_slowest = device_widths[slowest] - width_moved
        w_target = device_widths[t_idx] + width_moved
        # both sides of every move in one call, its stacks priced apart: the same ms as two calls
        comm = pricer.comm_rows(np.stack([w_slowest, w_target]), total_width, np.maximum(w_slowest, w_target), d)
        new_slowest, new_target = new_slowest + comm[0], new_target + comm[1]
        # the slowest device among those the move leaves alone
        untouched = np.where(t_idx == order[1], costs[order[2]] if d > 2 else 0.0, costs[order[1]])
        estimate = np.maximum(untouched, np.maximum(new_slowest, new_target))
        k = int(np.argmin(estimate))
        if estimate[k] >= cost - 1e-6:
            break
        trial = assign.copy()
        trial[i_idx[k]] = t_idx[k]
        if j_idx[k] >= 0:
            trial[j_idx[k]] = slowest
        trial_cost = float(pricer.device_costs(enc, sizes, trial).max())
        if trial_cost >= cost - 1e-6:
            break
        assign, cost = trial, trial_cost
    return Candidate(pieces, assign, cost)


def _spread(ordered: np.ndarray, most: int) -> np.ndarray:
    """At most `most` of the `ordered` pieces, evenly spaced from the first to the last."""
    if len(ordered) <= most:
        return ordered
    return ordered[np.unique(np.linspace(0, len(ordered) - 1, most).round().astype(np.int64))]


def rows_split(
    piece: TablePiece, topology: Topology, config: SearchConfig, constraints: Constraints | None
) -> list[TablePiece] | None:
    """The whole table of `piece` row-wise over every device, as TorchRec cuts it, where the search and
    the constraints allow it; None otherwise (a piece, a replica, one device)."""
    table = piece.table
    if (
        topology.num_devices == 1
        or "row_wise" not in config.sharding_types
        or piece.width != table.dim
        or piece.row_count != table.rows
        or piece.replicated
        or not table_options(table, topology, constraints, ("row_wise",))
    ):
        return None
    return row_wise(table, topology.num_devices)


def beam_search(
    pricer: Pricer,
    tables: list[TableSpec],
    config: SearchConfig,
    constraints: Constraints | None = None,
    name: str = "cost_search",
) -> tuple[Candidate, SearchReport]:
    """Split search: each level splits one of the costliest pieces of each beam state by columns (or,
    where `config.sharding_types` has row-wise, a whole table by rows) and re-packs the rest.

    With local search configured, it refines the best of the states the beam reached and, with
    `config.split_dominant`, the packing of every dominant table split (`dominant_split_packing`), and
    keeps the best; then each table's sharding type is chosen among `config.sharding_types` on the
    simulated cost. Returns the best plan and its report: the model evaluations, why the budget cut the search
    short (None when it finished) and where it started.
    """
    if config.start == "policy" and constraints is not None:
        raise ShardRayError(
            "start=policy starts from the DreamShard policy's plan, which takes no constraints file: leave the "
            "constraints out or start from the greedy grid (start=greedy)"
        )
    types = config.types_for(pricer.topology)
    pieces = pieces_to_place(tables, pricer.topology, constraints)
    # the baselines priced before the budget's count begins: the search's phases keep their shares of it
    baselines = baseline_candidates(pricer, pieces, types) if config.baselines else {}
    spending = Spending(pricer, config)
    choosing_types = bool(set(types) - {"table_wise", "column_wise"})
    # Phases with nothing to do leave their share to the beam.
    expand_share = 0.5 if config.local_search_steps or choosing_types else 1.0
    start_until, expand_until = spending.until(0.3), spending.until(expand_share)
    refine_until, last = spending.until(0.7 if choosing_types else 1.0), spending.until(1.0)
    splittable = {t.name for t in tables if constraints is None or "column_wise" in constraints.allowed_types(t.name)}
    starts = [packed_start(pricer, pieces, config, constraints, start_until)]
    from_policy, started_from = start_of_search(config, tables, pieces, pricer.topology, constraints)
    if from_policy:
        policy = policy_start(pricer, tables, config.policy)
        starts += policy
        if not policy:
            started_from += "; the policy's placement got stuck (a table fitted no device), so the grid's alone"
    starts.sort(key=lambda c: c.cost)
    split_packing = dominant_split_packing(pricer, pieces, splittable, config, constraints, start_until)
    progress = SearchProgress(spending, name)
    progress.show("start", starts[0].cost)
    beam, everything, seen = starts, list(starts), {_signature(c.pieces) for c in starts}
    for _ in range(config.beam_depth):
        splits = []
        for state in beam:
            costs = single_costs(pricer, state.pieces)
            for i in np.argsort(-costs)[: config.branching]:
                piece = state.pieces[i]
                ways = [split_piece(piece, w) if piece.table.name in splittable else None for w in config.split_ways]
                for split in [*ways, rows_split(piece, pricer.topology, config, constraints)]:
                    if split is None:
                        continue
                    pieces = state.pieces[:i] + split + state.pieces[i + 1 :]
                    if _signature(pieces) not in seen:
                        seen.add(_signature(pieces))
                        splits.append(pieces)
        children = []
        for pieces in splits:
            if expand_until.reached():
                break
            try:
                children.append(packed_start(pricer, pieces, config, constraints, expand_until))
            except InfeasibleError:
                continue  # a split whose row blocks leave the rest no packing, even with more tables row-wise
            progress.show("splits", min(c.cost for c in everything + children))
        if not children:
            break
        beam = sorted(children, key=lambda c: c.cost)[: config.beam_width]
        everything += beam
    finalists = sorted(everything + split_packing, key=lambda c: c.cost)[: config.beam_width]
    if config.local_search_steps:
        finalists = [local_search(pricer, c, config.local_search_steps, until=refine_until) for c in finalists]
    best = min(finalists, key=lambda c: c.cost)
    if config.local_search_steps:
        progress.show("local search", best.cost)
    if choosing_types:
        typed = choose_types(pricer, best, tables, types, last, constraints)
        if typed is not best and config.local_search_steps:
            typed = local_search(pricer, typed, config.local_search_steps, until=last)
        best = typed
        progress.show("sharding types", best.cost)
    progress.close()
    # Joined, a plan whose column slices of a table met on a device is priced higher than the search held it (26
    # tables on 32 devices: 7.75 -> 9.49 ms, where the policy's start, whose slices never meet, was 7.91): the lowest
    # of the joined finalists and starts is the plan.
    joined = [joined_columns(pricer, c, constraints) for c in [best, *finalists, *starts]]
    searched = min(joined, key=lambda c: c.cost)
    report = SearchReport(evaluations=pricer.evaluations, cut_short=spending.cut_short(), started_from=started_from)
    below = {name: c for name, c in baselines.items() if c.cost < searched.cost}
    if not below:
        return searched, report
    kept = min(below, key=lambda name: below[name].cost)
    return below[kept], report.model_copy(
        update={
            "kept_baseline": f"kept {kept}'s plan, priced at {below[kept].cost:.3f} ms, below the "
            f"{searched.cost:.3f} ms of the best plan the search reached (--set baselines=false leaves it out)"
        }
    )


def baseline_candidates(pricer: Pricer, pieces: list[TablePiece], types: tuple[str, ...]) -> dict[str, Candidate]:
    """The greedy heuristics' plans (`balanced_by_proxy`) of `pieces` (`pieces_to_place`'s, under any constraints)
    by name, priced together: those that place them within memory, in `types`."""
    from shard_ray.placement.heuristics import PROXIES, balanced_by_proxy

    if any(p.sharding_type not in types for p in pieces):
        return {}
    sizes = pricer.sizes(pieces)
    needs = sizes.need.tolist()
    assigns = {}
    for name, (proxy, _) in PROXIES.items():
        try:
            order, devices = balanced_by_proxy(pieces, pricer.topology, proxy, needs)
        except InfeasibleError:
            continue
        assigns[name] = np.empty(len(pieces), dtype=np.int64)
        assigns[name][order] = devices
    if not assigns:
        return {}
    costs = pricer.device_costs(pricer.encodings(pieces), sizes, np.stack(list(assigns.values())))
    return {
        name: Candidate(pieces, assign, float(cost)) for (name, assign), cost in zip(assigns.items(), costs.max(axis=1))
    }


def dominant_split_packing(
    pricer: Pricer,
    pieces: list[TablePiece],
    splittable: set[str],
    config: SearchConfig,
    constraints: Constraints | None,
    until: PhaseEnd | None = None,
) -> list[Candidate]:
    """The greedy grid's plan (`packed_start`) with every piece that dominates the task split by columns at once: a
    piece whose cost alone is at least an even share of all pieces' (their sum over the devices), of a table
    `splittable`, in the fewest of `config.split_ways` that bring each slice under that share, else the most. None
    where `config.split_dominant` is off, no piece dominates or the split pieces do not pack."""
    if not config.split_dominant:
        return []
    singles = single_costs(pricer, pieces)
    share = float(singles.sum()) / pricer.topology.num_devices
    split: list[TablePiece] = []
    for piece, single in zip(pieces, singles.tolist()):
        slices = None
        if single >= share and piece.table.name in splittable:
            fewest = next((w for w in sorted(config.split_ways) if single / w < share), max(config.split_ways))
            slices = split_piece(piece, fewest)
        split += slices or [piece]
    if len(split) == len(pieces):
        return []
    try:
        return [packed_start(pricer, split, config, constraints, until)]
    except InfeasibleError:
        return []


def start_of_search(
    config: SearchConfig,
    tables: list[TableSpec],
    pieces: list[TablePiece],
    topology: Topology,
    constraints: Constraints | None,
) -> tuple[bool, str]:
    """Whether the beam starts from the policy's plan too (`SearchConfig.start`), and the words the plan's report
    keeps for where it started. With `auto`, it does where no constraints file is given and there are no more
    tables than devices, or a table no device holds whole (`pieces_to_place`'s `pieces` split it: the grid starts it
    row-wise, and one move at a time never leaves that set of collectives: Criteo Kaggle's tables at dim 64 on 8
    devices of 2 GB, 10.53 ms from the grid, 7.23 from the policy's plan too)."""
    grid, both = "the greedy grid's plan", "the greedy grid's plan and the DreamShard policy's"
    if config.start != "auto":
        return (True, f"{both} (start=policy)") if config.start == "policy" else (False, grid)
    if constraints is not None:
        # said as why the policy was left out: "the policy takes no constraints file" puzzled a walk that asked for none
        return False, f"{grid} (start=auto: a constraints file is given, which the DreamShard policy cannot follow)"
    if topology.num_devices == 1:
        return False, f"{grid} (start=auto: one device)"
    if len(tables) <= topology.num_devices:
        return True, f"{both} (start=auto: no more tables than devices)"
    if any(p.rows is not None or p.columns != (0, p.table.dim) for p in pieces):
        return True, f"{both} (start=auto: a table no device holds whole)"
    return False, f"{grid} (start=auto: more tables than devices, each held whole by one)"


def policy_start(pricer: Pricer, tables: list[TableSpec], policy: str | None) -> list[Candidate]:
    """The DreamShard policy's greedy plan (`shard_ray.policy.decode`) as a state of the search: none where it gets
    stuck (a table fits nowhere)."""
    from shard_ray.policy.decode import roll_out
    from shard_ray.policy.policy_file import DecodingScorer, default_policy_path, read_policy

    weights, _ = read_policy(policy or default_policy_path())
    state = roll_out(DecodingScorer(weights.state), tables, pricer.topology, pricer.models)
    if not state.done:
        return []
    # its pieces as placed: read back from a plan file without its topology, a table-row-wise table's blocks are
    # row-wise (their host not recorded), priced higher (few_huge.json over hosts of 4: 4.70 ms against 4.04)
    pieces, assign = list(state.placed), np.array(state.assign, dtype=np.int64)
    return [Candidate(pieces, assign, pricer.plan_cost(pieces, assign))]


def joined_columns(pricer: Pricer, candidate: Candidate, constraints: Constraints | None = None) -> Candidate:
    """The candidate with each device's column slices of a table joined into one range.

    Two slices on one device run the table's lookups twice in the same kernel and send its ids
    twice; the models, which price a slice as a table of its share of the columns, can find that
    cheaper, but no real kernel is, and TorchRec never plans it. Which columns a slice holds does
    not change its price, so a table's slices are laid out device by device and each device's
    become one. Where every slice of a table met on one device and its `constraints` forbid it
    whole, they stay apart instead (`_slices_apart`): joined, the plan broke them."""
    by_table: dict[str, list[int]] = defaultdict(list)
    for i, piece in enumerate(candidate.pieces):
        by_table[piece.table.name].append(i)
    assign_now = _slices_apart(pricer, candidate, by_table, constraints)
    pieces: list[TablePiece] = []
    assign: list[int] = []
    for indices in by_table.values():
        slices = [candidate.pieces[i] for i in indices]
        devices = [int(assign_now[i]) for i in indices]
        free_slices = all(p.rows is None and not p.replicated and p.devices is None and p.group is None for p in slices)
        if len(set(devices)) == len(devices) or not free_slices:
            pieces += slices
            assign += devices
            continue
        width_on: dict[int, int] = defaultdict(int)
        for piece, device in zip(slices, devices):
            width_on[device] += piece.width
        start = 0
        for device, width in width_on.items():
            pieces.append(slices[0].model_copy(update={"columns": (start, start + width)}))
            assign.append(device)
            start += width
    if len(pieces) == len(candidate.pieces) and assign_now is candidate.assign:
        return candidate
    joined = np.array(assign, dtype=np.int64)
    return Candidate(pieces, joined, pricer.plan_cost(pieces, joined))


def _slices_apart(
    pricer: Pricer, candidate: Candidate, by_table: dict[str, list[int]], constraints: Constraints | None
) -> np.ndarray:
    """`candidate.assign`, or, where all the column slices of a table its `constraints` forbid whole sit on one
    device, a copy with every slice but the first moved, in turn, to the device of least predicted step with room
    for it that holds none of the table's slices; InfeasibleError naming the table where there is none."""
    crowded = [
        indices
        for name, indices in by_table.items()
        if constraints is not None
        and "table_wise" not in constraints.allowed_types(name)
        and len(indices) > 1
        and len({int(candidate.assign[i]) for i in indices}) == 1
        and all(candidate.pieces[i].rows is None and not candidate.pieces[i].replicated for i in indices)
    ]
    if not crowded:
        return candidate.assign
    topology = pricer.topology
    assign = candidate.assign.copy()
    encodings, sizes = pricer.encodings(candidate.pieces), pricer.sizes(candidate.pieces)
    ledger = MemoryLedger.of_assignment(topology, assign, sizes.need)
    for indices in crowded:
        for i in indices[1:]:
            steps = pricer.device_costs(encodings, sizes, assign)
            taken = {int(assign[k]) for k in indices}
            room = ledger.room(sizes.need[i]) & sizes.allowed[i]
            room[list(taken)] = False
            if not room.any():
                raise InfeasibleError(
                    f"table {candidate.pieces[i].table.name!r}'s column slices find no devices apart with room, and its "
                    "constraints do not allow it whole"
                )
            device = int(np.flatnonzero(room)[np.argmin(steps[room])])
            ledger.give(int(assign[i]), int(sizes.need[i]))
            ledger.take(device, int(sizes.need[i]))
            assign[i] = device
    return assign


class SearchProgress:
    """A bar over the budget's evaluations, with the phase and the best simulated cost so far, shown
    once a search has run `LONG_PLACING_S` (shorter ones end before a bar would tell anything; the
    clock decides only what is shown, never what the search does)."""

    def __init__(self, spending: Spending, name: str) -> None:
        self.spending, self.name = spending, name
        self.bar: tqdm | None = None

    def show(self, phase: str, cost_ms: float) -> None:
        if self.bar is None:
            if time.perf_counter() - self.spending.began < LONG_PLACING_S:
                return
            total = self.spending.budget.max_evaluations
            of_total = f"/{total:,}" if total else ""
            self.bar = tqdm(
                total=total, desc=self.name, bar_format="{desc}: {bar} {n:,}" + of_total + " model evaluations{postfix}"
            )
        used, total = self.spending.used(), self.bar.total
        # the bar stops full at the budget; a batch that crosses it runs to its end (`Spending`), said beside it
        self.bar.n = min(used, total or used)
        past = f", {used:,} with the batch that reached the budget" if total and used > total else ""
        self.bar.set_postfix_str(f"{phase}, best {cost_ms:.3f} ms{past}", refresh=False)
        self.bar.update(0)  # redrawn at tqdm's pace (every 30 s into a log file: `quiet_output`), not every call

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def packed_start(
    pricer: Pricer,
    pieces: list[TablePiece],
    config: SearchConfig,
    constraints: Constraints | None,
    until: PhaseEnd | None = None,
) -> Candidate:
    """The greedy grid's plan (priced by single costs should the model-priced passes not end by
    `until`); when the whole tables do not pack, the largest goes row-wise (split to fit the
    packing, as TorchRec would), then the next, while the search and constraints allow it."""
    topology = pricer.topology
    while True:
        try:
            return greedy_grid(pricer, pieces, config.scales, until)
        except InfeasibleError:
            if topology.num_devices == 1 or "row_wise" not in config.sharding_types:
                raise
            # Tables still whole whose constraints allow row-wise (a group's allow only table-wise).
            whole = [
                p
                for p in pieces
                if p.row_count == p.table.rows
                and not p.replicated
                and table_options(p.table, topology, constraints, ("row_wise",))
            ]
            if not whole:
                raise
            largest = max(whole, key=lambda p: p.memory_bytes(topology.optimizer)).table
            pieces = [p for p in pieces if p.table.name != largest.name] + row_wise(largest, topology.num_devices)


def _signature(pieces: list[TablePiece]) -> frozenset:
    return frozenset(p.key for p in pieces)


def search_placer(
    name: str, config: SearchConfig, models: CostModels, constraints: Constraints | None = None
) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        pricer = Pricer(models, topology)
        best, report = beam_search(pricer, tables, config, constraints, name)
        return best.plan(topology.num_devices, name).model_copy(update={"search": report})

    return placer


@register(
    "neuroshard",
    "search",
    "NeuroShard: cost-model greedy grid over dim-sum caps, beam search over column halvings",
    settings=SearchBudget,
    takes_constraints=True,
    draws_progress=True,
)
def neuroshard(context: PlacementContext) -> Placer:
    budget = context.settings
    config = replace(NEUROSHARD, max_evaluations=budget.max_evaluations, time_limit_s=budget.time_limit_s)
    search = search_placer("neuroshard", config, context.models, context.constraints)

    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        try:
            return search(tables, topology)
        except InfeasibleError as err:  # where a table fits only in row blocks, the other searches place it
            why = "neuroshard, as published, splits by rows only the tables no device holds whole"
            raise with_splitting_hint(err, why) from None

    return placer


@register(
    "cost_search",
    "search",
    "ours: NeuroShard's search plus halves and quarters and local search on the simulated cost, never priced above "
    "the greedy heuristics' plans",
    settings=SearchConfig,
    takes_constraints=True,
    draws_progress=True,
)
def cost_search(context: PlacementContext) -> Placer:
    if context.settings.policy is not None:  # read where the search starts from the grid alone too: a typo in the
        # path went unnoticed, the plan file naming a policy that was never there (a walk)
        from shard_ray.policy.policy_file import read_policy

        read_policy(context.settings.policy)
    return search_placer("cost_search", context.settings, context.models, context.constraints)
