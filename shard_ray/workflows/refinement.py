"""Hardware-in-the-loop refinement: the models propose moves, the hardware judges them.

After `plan --measure`'s race, the plan it chose is refined step by step, top to bottom:

1. Each device's fused shard is measured on the profiling actors, one at a time on a machine (on
   GPUs, in parallel: `ProfilingPool.measure`'s `alone`); every measurement goes to the store and
   is looked up there first, so a refinement run again measures only what is new. A device's cost
   is its measured forward + backward plus its all-to-alls as the models price them (profiling
   actors time kernels, not collectives): the measured plan cost is the slowest device's.
2. From the slowest device, the models propose moves: each of its movable pieces moved to one of
   the `refine_targets` devices measured fastest, swapped with one of theirs, split in two by
   columns with one half moved, or, a whole table, split by rows over the device's host
   (`rows_over_host`). The models rank the moves by `unloading` (the simulated plan cost,
   then the slowest of the devices a move changes), and the best `refine_proposals` that fit in
   memory and lead to a layout not yet taken are kept (a swap taken back two steps later would only
   return to a plan already measured).
3. The devices each proposal changes are measured, all proposals' in one go with the plan as it
   stands, measured again with the same batches (so a move is judged against the same minutes'
   measurement). The proposal best by measured `unloading` is taken when the slowest of the devices
   it changes comes down by more than `refine_min_gain` (a fraction of their cost, set above the
   noise floor `doctor` reports) and the plan cost does not rise; the next step starts from it. So
   where several devices are within noise of the slowest, they are unloaded one step after another
   and the plan cost falls once the last of them is. Where no move gains enough but the models
   price the best one gaining more than that, the step is measured again with new batches
   (`refine_retries` times), each device's shard judged by its fastest measurement: a stall of the
   machine that slowed one shard for a whole measurement does not end the refinement. Otherwise
   refinement stops, unless the plan as measured again has another slowest device than the one the
   moves were for (devices within noise of each other trade places from one measurement to the
   next): the next step then proposes moves off that one.
4. Where moves were kept, the plan as refinement started and as it ends are measured side by side with
   new batches, a device both hold alike measured once: those two figures are the refinement's before
   and after, which differ only by the devices the moves changed (`_measured_side_by_side`).

The refined plan is then confirmed against the race's choice on the device gang with the one
comparison procedure (`shard_ray.workflows.comparison`), by the caller: a kernel measured alone is not a
plan measured whole. The models' errors do not decide anything here; they only order what the
hardware is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.piece import TablePiece, row_wise, split_piece, table_row_wise
from shard_ray.plan.plan import Plan, PlanSettings
from shard_ray.plan.topology import Topology
from shard_ray.profiling.procedure import MeasureConfig, fused_shard_key
from shard_ray.workload.tables import TableSpec

if TYPE_CHECKING:  # Ray, SQLite and the models' torch only where a refinement runs, not in every `plan`'s flags
    from shard_ray.costmodel.models import CostModels
    from shard_ray.costmodel.pricing import Pricer
    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.store import MeasurementStore


@dataclass(frozen=True)
class RefineConfig:
    refine: bool = setting(
        False, "plan --measure: refine the race's choice with moves measured on the profiling actors"
    )
    refine_steps: int = setting(6, "refinement: most moves kept (each one step of measuring)", min=1)
    refine_proposals: int = setting(4, "refinement: moves measured per step, the models' best", min=1)
    refine_targets: int = setting(3, "refinement: devices a piece may move to, those measured fastest", min=1)
    refine_min_gain: float = setting(
        0.03,
        "refinement: measured gain a move must make on the slowest device it changes, a fraction of that device's "
        "cost (above the noise floor)",
        min=0,
    )
    refine_retries: int = setting(
        1,
        "refinement: times a step is measured again, with new batches, when no move gains enough by measurement "
        "though the models price the best one gaining more",
        min=0,
    )


@dataclass
class Refinement:
    """The refined plan, its measured cost before and after, and each kept move in words."""

    plan: Plan
    before_ms: float
    after_ms: float
    moves: list[str] = field(default_factory=list)
    measured_shards: int = 0


@dataclass
class _Meter:
    """Refinement's accounting: layouts' fused shards measured on the profiling actors (those in the store looked
    up there), their all-to-alls priced by the models."""

    tables: list[TableSpec]
    topology: Topology
    simulator: Simulator
    pool: ProfilingPool
    store: MeasurementStore
    measure: MeasureConfig
    algorithm: str
    settings: PlanSettings  # what the plan was made for: its hosts and their links price the all-to-alls
    measured_shards: int = 0  # shards measured on the actors, not found in the store

    def compute(
        self, layouts: list[tuple[list[TablePiece], np.ndarray, list[int]]], seed: int
    ) -> list[dict[int, float]]:
        """Measured forward + backward ms of each layout's `devices`' fused shards, all layouts' shards at once,
        with the batches of `seed`."""
        seeded = self.measure.model_copy(update={"seed": seed})
        shards = [
            [[pieces[i] for i in np.flatnonzero(assign == d)] for d in devices] for pieces, assign, devices in layouts
        ]
        flat = [shard for per_layout in shards for shard in per_layout if shard]
        keys = {fused_shard_key(shard, seeded, self.pool.hardware) for shard in flat}
        self.measured_shards += len(keys - self.store.known_keys(list(keys)))
        results = iter(self.pool.measure(flat, seeded, self.store, progress=False, alone=True))
        computes = []
        for (_, _, devices), per_layout in zip(layouts, shards):
            compute = {}
            for d, shard in zip(devices, per_layout):
                m = next(results) if shard else None
                if m is not None and m.status != "ok":
                    raise ShardRayError(f"refinement: device {d}'s shard could not be measured: {m.reason}")
                compute[d] = m.compute_ms if m is not None else 0.0
            computes.append(compute)
        return computes

    def costs(self, pieces: list[TablePiece], assign: np.ndarray, compute: dict[int, float]) -> np.ndarray:
        """Each device's measured compute plus its priced all-to-alls."""
        layout = Plan.from_assignment(pieces, assign, self.topology.num_devices, self.algorithm)
        layout = layout.model_copy(update={"settings": self.settings})
        return measured_device_costs(self.simulator, layout, self.tables, self.topology.batch_size, compute)


def refine(
    plan: Plan,
    tables: list[TableSpec],
    topology: Topology,
    models: CostModels,
    pool: ProfilingPool,
    store: MeasurementStore,
    measure: MeasureConfig,
    config: RefineConfig = RefineConfig(),
    log: Callable[[str], None] = print,
) -> Refinement:
    """`plan` refined by measured moves (module docstring); unchanged when no move gains enough."""
    from shard_ray.costmodel.pricing import Candidate, Pricer
    from shard_ray.costmodel.simulator import Simulator

    pricer = Pricer(models, topology)
    # what the plan was made for, its hosts among them (a table split by rows inside a host is table-row-wise)
    made_for = plan.settings or PlanSettings.for_topology(topology)
    meter = _Meter(tables, topology, Simulator(models), pool, store, measure, plan.algorithm, made_for)
    pieces, assign = plan.assignment(tables)
    (compute,) = meter.compute([(pieces, assign, list(range(topology.num_devices)))], measure.seed)
    costs = meter.costs(pieces, assign, compute)
    before = float(costs.max())
    log(
        f"refinement: measured plan cost {before:.2f} ms (compute measured per device, all-to-alls priced; each step "
        "measures the plan again beside its moves, with new batches)"
    )
    moves: list[str] = []
    started = (pieces, assign)
    taken = {layout_key(pieces, assign)}
    for step in range(1, config.refine_steps + 1):
        slowest = int(np.argmax(costs))
        costs, kept = _measured_best_move(meter, pricer, pieces, assign, costs, config, step, log, taken)
        if kept is None and int(np.argmax(costs)) != slowest:
            log(
                f"refinement step {step}: measured again, device {int(np.argmax(costs))} is the slowest, not "
                f"device {slowest} the moves were for; the next step moves off it"
            )
            continue
        if kept is None:
            break
        pieces, assign, compute, words = kept
        costs = meter.costs(pieces, assign, compute)
        moves.append(words)
        taken.add(layout_key(pieces, assign))
    after = float(costs.max())
    if moves:
        before, after = _measured_side_by_side(meter, started, (pieces, assign), config, log)
    refined = Candidate(pieces, assign, after).plan(topology.num_devices, f"{plan.algorithm}+refined")
    refined = refined.model_copy(update={"settings": made_for})
    refined.check(tables)
    refined.check_memory(tables, topology)
    return Refinement(refined, before, after, moves, meter.measured_shards)


def _measured_side_by_side(
    meter: _Meter,
    started: tuple[list[TablePiece], np.ndarray],
    refined: tuple[list[TablePiece], np.ndarray],
    config: RefineConfig,
    log: Callable[[str], None],
) -> tuple[float, float]:
    """The plan as refinement started and as it ends, measured in one go with new batches: their measured costs.

    Each step's measured cost is the largest of the devices' figures of that step, and the steps' batches differ:
    at 64 devices, where many devices are within noise of the slowest, two moves measured 11.24 -> 10.49 ms step
    by step, and the plans measured again side by side were within noise (docs/results.md). Measured together, a
    device both plans hold alike is one measurement, so the two costs differ only by the devices the moves
    changed."""
    everything = list(range(meter.topology.num_devices))
    seed = meter.measure.seed + (config.refine_retries + 1) * config.refine_steps + 1  # past every step's batches
    first, last = meter.compute([(*started, everything), (*refined, everything)], seed)
    before = float(meter.costs(*started, first).max())
    after = float(meter.costs(*refined, last).max())
    log(
        f"refinement: the plan as it started and as refined, measured side by side with new batches: {before:.2f} "
        f"and {after:.2f} ms ({1 - after / before:+.1%})"
    )
    return before, after


def _measured_best_move(
    meter: _Meter,
    pricer: Pricer,
    pieces: list[TablePiece],
    assign: np.ndarray,
    costs: np.ndarray,
    config: RefineConfig,
    step: int,
    log: Callable[[str], None],
    taken: set[tuple] = frozenset(),
) -> tuple[np.ndarray, tuple[list[TablePiece], np.ndarray, dict[int, float], str] | None]:
    """The plan's device costs as measured again in this step, and the step's measured best move (its pieces,
    assignment, devices' compute and words) when it gains more than `refine_min_gain`; None, said why, otherwise."""
    before = costs
    proposals = propose(pricer, pieces, assign, costs, config, taken)
    if not proposals:
        log(f"refinement step {step}: no move off device {int(np.argmax(costs))} fits; stopping")
        return costs, None
    # The plan as it stands is measured again with the proposals, with the same batches: a move
    # is judged against a measurement of the same minutes, not against one taken a step ago.
    num_devices = meter.topology.num_devices
    changed = [changed_devices(pieces, assign, p_pieces, p_assign, num_devices) for p_pieces, p_assign, _ in proposals]
    layouts = [(pieces, assign, list(range(num_devices)))] + [(p[0], p[1], c) for p, c in zip(proposals, changed)]
    priced_now = pricer.plan_parts(pieces, assign).totals()
    priced_best = pricer.plan_parts(*proposals[0][:2]).totals()  # the models' best first
    priced_gain = 1 - priced_best[changed[0]].max() / priced_now[changed[0]].max()
    fastest: list[dict[int, float]] = []
    for attempt in range(config.refine_retries + 1):
        # Each attempt's batches are new: step s of attempt a is seeded past every earlier attempt's steps.
        again = meter.compute(layouts, meter.measure.seed + step + attempt * config.refine_steps)
        fastest = again if not fastest else [{d: min(f[d], a[d]) for d in f} for f, a in zip(fastest, again)]
        now, *proposed = fastest
        costs = meter.costs(pieces, assign, now)
        current = float(costs.max())
        measured = [
            (unloading(meter.costs(p_pieces, p_assign, {**now, **new}), moved), {**now, **new}, p_pieces, p_assign)
            for (p_pieces, p_assign, _), new, moved in zip(proposals, proposed, changed)
        ]
        best = min(range(len(measured)), key=lambda m: measured[m][0])
        (plan_ms, unloaded_ms), best_compute, best_pieces, best_assign = measured[best]
        words, were_ms = proposals[best][2], float(costs[changed[best]].max())
        # the gain on the devices the move changed, their slowest before and after; where the plan cost rises, the
        # loss on it
        gain = 1 - unloaded_ms / were_ms if plan_ms <= current else 1 - plan_ms / current
        if gain > config.refine_min_gain or priced_gain <= config.refine_min_gain:
            break
        if attempt < config.refine_retries:
            log(
                f"refinement step {step}: the best of {len(measured)} measured moves ({words}) gains {gain:+.1%}, "
                f"the models price the best {priced_gain:+.1%}; measuring the step again with new batches"
            )
    if gain <= config.refine_min_gain:
        log(
            f"refinement step {step}: the best of {len(measured)} measured moves ({words}) gains {gain:+.1%}, "
            f"not more than {config.refine_min_gain:.0%}"
            + ("" if int(np.argmax(costs)) != int(np.argmax(before)) else "; stopping")
        )
        return costs, None
    devices = ", ".join(str(d) for d in changed[best])
    log(
        f"refinement step {step}: {words}: devices {devices} at most {unloaded_ms:.2f} ms against {were_ms:.2f} ms "
        f"({gain:.1%} lower), the plan {plan_ms:.2f} ms against {current:.2f} ms as it stood, measured beside it "
        "with this step's batches"
    )
    return costs, (best_pieces, best_assign, best_compute, words)


def measured_device_costs(
    simulator: Simulator, plan: Plan, tables: list[TableSpec], batch_size: int, compute: Mapping[int, float]
) -> np.ndarray:
    """Each device's measured compute (forward + backward ms, by device) plus its all-to-alls as the models
    price them: the plan cost refinement judges by, the slowest device's."""
    priced = simulator.plan_cost(plan, tables, batch_size)
    comm = np.array([d.input_dist_ms + d.fwd_comm_ms + d.bwd_comm_ms for d in priced.devices])
    return comm + np.array([compute[d] for d in range(plan.num_devices)])


def layout_key(pieces: list[TablePiece], assign: np.ndarray) -> tuple:
    """Which pieces each device holds, comparable between layouts (the order of `pieces` aside)."""
    return tuple(sorted((p.key, int(d)) for p, d in zip(pieces, assign)))


def propose(
    pricer: Pricer,
    pieces: list[TablePiece],
    assign: np.ndarray,
    costs: np.ndarray,
    config: RefineConfig,
    taken: set[tuple] = frozenset(),
) -> list[tuple[list[TablePiece], np.ndarray, str]]:
    """The models' best `config.refine_proposals` moves off the measured slowest device that fit in memory and lead
    to none of the layouts `taken` before: (pieces, assignment, the move in words), the best `unloading` by the
    simulated device costs first."""
    topology = pricer.topology
    sizes = pricer.sizes(pieces)
    slowest = int(np.argmax(costs))
    targets = [int(d) for d in np.argsort(costs, kind="stable") if d != slowest][: config.refine_targets]
    # Row blocks, replicas and pieces pinned or grouped by constraints stay where they are.
    free = [p.rows is None and not p.replicated and p.devices is None and p.group is None for p in pieces]
    movable = [i for i in np.flatnonzero(assign == slowest) if free[i]]
    candidates: list[tuple[list[TablePiece], np.ndarray, str, list[int]]] = []  # ... and the devices it changes
    for i in movable:
        name = pieces[i].describe()
        blocks = rows_over_host(pieces[i], topology, slowest)
        if blocks is not None:
            held = [b.devices[0] for b in blocks]
            candidates.append(
                (
                    pieces[:i] + blocks + pieces[i + 1 :],
                    np.concatenate([assign[:i], held, assign[i + 1 :]]),
                    f"{name} split by rows over devices {min(held)}-{max(held)}",
                    sorted({*held, slowest}),
                )
            )
        for t in targets:
            if sizes.allowed[i, t]:
                moved = assign.copy()
                moved[i] = t
                candidates.append((pieces, moved, f"{name} moved from device {slowest} to {t}", [slowest, t]))
            for j in np.flatnonzero(assign == t):
                if free[j] and sizes.allowed[i, t] and sizes.allowed[j, slowest]:
                    swapped = assign.copy()
                    swapped[i], swapped[j] = t, slowest
                    candidates.append(
                        (
                            pieces,
                            swapped,
                            f"{name} on device {slowest} swapped with {pieces[j].describe()}",
                            [slowest, t],
                        )
                    )
            halves = split_piece(pieces[i], 2)
            if halves is not None and sizes.allowed[i, t]:
                split_pieces = pieces[:i] + halves + pieces[i + 1 :]
                split_assign = np.concatenate([assign[:i], [slowest, t], assign[i + 1 :]])
                words = f"{name} split by columns, one half to device {t}"
                candidates.append((split_pieces, split_assign, words, [slowest, t]))
    fitting = [
        ((c_pieces, c_assign, words), unloading(pricer.plan_parts(c_pieces, c_assign).totals(), changed))
        for c_pieces, c_assign, words, changed in candidates
        if layout_key(c_pieces, c_assign) not in taken
        and (MemoryLedger.of_assignment(topology, c_assign, pricer.sizes(c_pieces).need).free >= 0).all()
    ]
    fitting.sort(key=lambda pair: pair[1])
    return [c for c, _ in fitting[: config.refine_proposals]]


def rows_over_host(piece: TablePiece, topology: Topology, device: int) -> list[TablePiece] | None:
    """The whole table of `piece` split by rows over the devices of `device`'s host, as TorchRec's table-row-wise
    cuts it (row-wise over every device where one host holds them all): its lookups spread over the host's devices
    and its pooled sums added up inside the host. None for a piece of a table, a replica, a table of one row (one
    block: the table whole), or a host of one device."""
    local = topology.devices_per_host_or_all
    if (
        local == 1
        or piece.width != piece.table.dim
        or piece.rows is not None
        or piece.replicated
        or piece.table.rows < 2
    ):
        return None
    if topology.devices_per_host is None:
        return row_wise(piece.table, topology.num_devices)
    return table_row_wise(piece.table, local, device // local)


def unloading(device_ms: np.ndarray, changed: list[int]) -> tuple[float, float]:
    """How a move is ranked, least first: the plan cost it leaves (its slowest device), then the slowest of the
    devices it changed. Where other devices are as slow as the one a move unloads, the plan cost stays and the
    second figure tells the moves apart: a plan of 8 devices whose slowest few are within noise of each other gets
    faster only by unloading them one after the other."""
    return float(device_ms.max()), float(device_ms[changed].max())


def changed_devices(
    pieces: list[TablePiece], assign: np.ndarray, new_pieces: list[TablePiece], new_assign: np.ndarray, num_devices: int
) -> list[int]:
    """The devices whose pieces differ between the two assignments (a device left empty included)."""

    def holdings(pieces: list[TablePiece], assign: np.ndarray) -> list[frozenset]:
        return [frozenset(p.key for p, d in zip(pieces, assign) if d == device) for device in range(num_devices)]

    return [
        d for d, (old, new) in enumerate(zip(holdings(pieces, assign), holdings(new_pieces, new_assign))) if old != new
    ]
