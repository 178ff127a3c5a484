"""`calibrate`: fit the cost models to this hardware and this task in minutes, top to bottom.

1. Candidate plans: every heuristic and model-based search plans the task with the starting
   models, so calibration measures what the decision between plans hinges on.
2. Compute data, on the profiling actors in parallel, most useful first: the shards the choice
   between candidates hinges on (`decisive_shards`: each candidate's devices from the slowest
   predicted, the candidates taking turns from the cheapest predicted), every table alone, then
   random shards of the task's tables of up to as many tables as a candidate puts on one device.
3. Communication data, on the device gang (and the link profile fitted to it: `fit_links`): the candidate plans, cheapest predicted first, then plans of random balance
   of the task's tables, at the task's device count. Over hosts (`--devices-per-host`), the gang
   spans them and the comm model is fit to what crossed them: it learns the inter-host share of
   this cluster instead of pricing it at a stated bandwidth. First, the noise floor: the first
   candidate against a copy of itself, so the report says how far equal plans measure apart.
4. Held-out accuracy: measurements are split by their key's hash into fit (with a validation
   part) and held out; the starting models are fine-tuned on the fit part (their weights are
   the prior), and the fine-tuned models are kept only when they are more accurate on validation
   and price the held-out plans no worse, in error and in ranking (`choose_models`); the report
   says which were kept and why. Accuracy before and after is reported on the held-out part.

Measuring stops at the time budget, leaving time for the fit; the shards stop sooner, leaving the
gang's plans a share. Every measurement goes to the store and is looked up there first, so an
interrupted calibration resumes where it stopped, and measurements of these tables already in the
store (an earlier calibration's, `plan --measure`'s) are used too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from shard_ray.costmodel.collect import varied_balance
from shard_ray.costmodel.info import Calibrated
from shard_ray.costmodel.links import LinkProfile, fit_link_between_hosts, fit_link_rate
from shard_ray.costmodel.models import CommModel, ComputeModel, CostModels
from shard_ray.costmodel.networks import ComputeCostNet
from shard_ray.costmodel.pricing import measured_collectives, slowest_of_each
from shard_ray.costmodel.settings import TrainConfig
from shard_ray.costmodel.simulator import Simulator, price_comm
from shard_ray.costmodel.train import (
    ComputeData,
    accuracy,
    comm_samples,
    comm_timed,
    compute_data,
    data_coverage,
    evaluate_comm,
    evaluate_compute,
    evaluate_device_compute,
    fit_overheads,
    is_microbenchmark,
    mape,
    step_compute_ms,
    train_comm_model,
    train_compute_model,
)
from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.placement import algorithms, place
from shard_ray.plan.piece import TablePiece, table_wise
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.profiling.actors import capped_warning
from shard_ray.profiling.gang import DeviceActors, check_hosts
from shard_ray.profiling.procedure import (
    MEASUREMENT_PROCEDURE,
    FusedShardMeasurement,
    MeasureConfig,
    content_digest,
    fused_shard_key,
)
from shard_ray.profiling.sampling import draw_fused_shards, microbenchmark_shards
from shard_ray.profiling.store import MeasurementStore, PlanMeasurement
from shard_ray.workflows.comparison import NoiseFloor, noise_floor
from shard_ray.workflows.settings import CalibrateConfig
from shard_ray.workload.tables import TableSpec, task_digest

# Families whose plans are the candidates: the baselines and the model-based searches (the RL
# policy and TorchRec's planner place from the same models' prices or none at all).
CANDIDATE_FAMILIES = ("heuristic", "search")


@dataclass
class Calibration:
    models: CostModels  # the models kept
    chosen: str  # "fine-tuned" or "starting"
    report: dict[str, Any]  # accuracy before and after, counts, seconds


Measured = TypeVar("Measured", FusedShardMeasurement, PlanMeasurement)


def split_of(key: str, held_out: float) -> str:
    """held-out / val / fit, by the key's hash: stable as the store grows."""
    u = int(key[:8], 16) / 16**8
    return "held_out" if u < held_out else "val" if u < held_out + (1 - held_out) / 5 else "fit"


def splits(keys: list[str], held_out: float, least: int) -> dict[str, str]:
    """Each key's split (`split_of`), evened out where few keys leave the hash's draw lopsided: fit keys moved to the
    held-out split, lowest hash first, where the hash leaves it fewer than `least` and a third of the keys allow (a
    task of few tables makes few distinct plans and shards: the README's four tables, 22 plans, of which the hash
    held out 2; the own-tables guide's five, 27 shards, of which it held out 7 and a quarter would have allowed 6,
    and a judgement needs `least` of them); held-out keys moved back to fit, highest hash first, where the fit split
    has fewer than FEWEST_FIT and the held-out one can spare them down to that third (13 shards of 5 tables at
    --held-out 0.5: the hash held out 9 and left 3 to fit); and the fit split's highest hash moved to validation where
    it has none and the fit split more than FEWEST_FIT (a tenth of the keys go there at --held-out 0.5); validation
    keys moved to fit, down to one, where it still has fewer than FEWEST_FIT."""
    split = {key: split_of(key, held_out) for key in keys}
    by_hash = sorted(keys, key=lambda k: int(k[:8], 16))
    third = min(least, len(keys) // 3)
    room = max(0, third - list(split.values()).count("held_out"))
    for key in [k for k in by_hash if split[k] == "fit"][:room]:
        split[key] = "held_out"
    wanted = FEWEST_FIT + ("val" not in split.values())  # one more where validation will take one
    for key in reversed([k for k in by_hash if split[k] == "held_out"]):
        if list(split.values()).count("fit") >= wanted or list(split.values()).count("held_out") <= max(1, third):
            break
        split[key] = "fit"
    # validation keys moved to fit, highest hash first, where it still has fewer than FEWEST_FIT, down to one (the
    # README's four tables on the AMD EPYC: 14 shards, the hash leaving 5 to fit and 7 to validate, 3 once the held-out
    # split had its third, and calibrate refused)
    for key in reversed([k for k in by_hash if split[k] == "val"][1:]):
        if list(split.values()).count("fit") >= FEWEST_FIT:
            break
        split[key] = "fit"
    fits = [k for k in by_hash if split[k] == "fit"]
    if "val" not in split.values() and len(fits) > FEWEST_FIT:
        split[fits[-1]] = "val"
    return split


def split_measurements(measured: list[Measured], held_out: float, least: int) -> dict[str, list[Measured]]:
    """The measurements (shards or plans) by split (`splits`)."""
    split = splits([m.key for m in measured], held_out, least)
    return {name: [m for m in measured if split[m.key] == name] for name in ("fit", "val", "held_out")}


def candidate_plans(tables: list[TableSpec], topology: Topology, cost_model: str, seed: int) -> list[Plan]:
    """The plans of every heuristic and search on this task, under the starting models."""
    plans = []
    for info in algorithms():
        if info.family in CANDIDATE_FAMILIES and info.handles(len(tables)):
            try:
                plans.append(place(info.name, tables, topology, seed=seed, cost_model=cost_model))
            except InfeasibleError:
                continue
    return plans


def random_plans(tables: list[TableSpec], num_devices: int, count: int, seed: int) -> list[Plan]:
    """Plans of the task's tables with device shares from skewed to even (Dirichlet 0.2 to 5)."""
    rng = np.random.default_rng(seed)
    return [
        Plan.from_assignment(
            table_wise(tables), varied_balance(rng, len(tables), num_devices), num_devices, "calibration_sample"
        )
        for _ in range(count)
    ]


def decisive_shards(
    candidates: list[Plan], tables: list[TableSpec], simulator: Simulator, batch_size: int
) -> list[list[TablePiece]]:
    """The candidates' fused shards in the order their measurements decide between the plans: a
    plan costs its slowest device, so each candidate's devices go from the slowest predicted down,
    and the candidates (given cheapest predicted first) take turns, so that a short budget still
    measures every candidate's bottleneck before any candidate's fastest device."""
    ranked = []
    for plan in candidates:
        shards = plan.pieces(tables)
        devices = simulator.plan_cost(plan, tables, batch_size).devices
        ranked.append([shards[d.device] for d in sorted(devices, key=lambda d: -d.total_ms)])
    return [turn[i] for i in range(max(map(len, ranked), default=0)) for turn in ranked if i < len(turn)]


def unique_shards(shards: list[list[TablePiece]]) -> list[list[TablePiece]]:
    seen, unique = set(), []
    for pieces in shards:
        key = content_digest(sorted(p.key for p in pieces))
        if pieces and key not in seen:
            seen.add(key)
            unique.append(pieces)
    return unique


def task_measurements(
    store: MeasurementStore,
    tables: list[TableSpec],
    hardware: str,
    measure: MeasureConfig,
    devices_per_host: int | None = None,
) -> tuple[list[FusedShardMeasurement], list[PlanMeasurement]]:
    """Every measurement in the store of shards and plans of these tables, on this hardware, at these
    settings, by today's procedure; plans only as measured over hosts of `devices_per_host` (None: on one host)."""
    specs = {t.name: t for t in tables}
    shards = [
        m
        for m in store.fused_shard_measurements(hardware)
        if m.status == "ok"
        and m.config == measure
        and m.procedure == MEASUREMENT_PROCEDURE
        and all(specs.get(p.table.name) == p.table for p in m.tables)
    ]
    plans = [
        p
        for p in store.plan_measurements(hardware)
        if p.plan.num_devices > 1
        and p.procedure == MEASUREMENT_PROCEDURE
        and p.cost.batch_size == measure.batch_size
        and p.cost.devices_per_host == devices_per_host
        and all(specs.get(t.name) == t for t in p.tables)
    ]
    return shards, plans


def microbenchmark_measurements(
    store: MeasurementStore, hardware: str, measure: MeasureConfig
) -> list[FusedShardMeasurement]:
    """The store's measurements of the microbenchmark's shards on this hardware at these settings."""
    return [
        m
        for m in store.fused_shard_measurements(hardware)
        if m.config == measure and m.procedure == MEASUREMENT_PROCEDURE and is_microbenchmark(m)
    ]


def calibrate(
    tables: list[TableSpec],
    topology: Topology,
    start: CostModels,
    start_path: str,
    config: CalibrateConfig,
    store: MeasurementStore,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Measure this task on the connected cluster and fit `start` (read from `start_path`) to it."""
    began = time.monotonic()
    shards_end, measuring_ends = measuring_deadlines(began, config, topology.num_devices)
    measure = MeasureConfig.for_topology(topology, warmup=config.warmup, repeats=config.repeats, seed=config.seed)
    if topology.num_hosts > 1:
        check_hosts(topology.num_devices, topology.devices_per_host)  # before minutes of measuring, not after

    # 1. candidate plans, cheapest predicted first
    simulator = Simulator(start)
    candidates = sorted(
        candidate_plans(tables, topology, start_path, config.seed),
        key=lambda plan: simulator.plan_cost(plan, tables, topology.batch_size).cost_ms,
    )
    if not candidates:
        raise InfeasibleError(f"no algorithm could place these {len(tables)} tables on {topology.num_devices} devices")
    log(f"{len(candidates)} candidate plans: {', '.join(p.algorithm for p in candidates)}")
    # One set of device actors where the gang's members can profile too (as many devices as actors): the gang starts
    # first and lends them to the profiling pool; else the pool starts its own, and the gang after the shards.
    with DeviceActors(
        topology.num_devices, devices_per_host=topology.devices_per_host, comm_pricer=price_comm
    ) as devices:
        # 2. compute data, most useful first, until the measuring time is spent
        hardware, shards_ran_out = _measure_shards(
            candidates, tables, topology, simulator, config, store, measure, shards_end, log, devices
        )
        # Before the plans are measured: with too few shards, the plans' measurements could not save the
        # calibration. The gang adds plans only, so these are the shards the fit uses.
        shards, _ = task_measurements(store, tables, hardware, measure, topology.devices_per_host_if_spanning)
        by_split = split_measurements(shards, config.held_out, MIN_HELD_OUT_SHARDS)
        if len(by_split["fit"]) < FEWEST_FIT or not by_split["val"] or not by_split["held_out"]:
            split = {part: len(measured) for part, measured in by_split.items()}
            raise ShardRayError(too_few_to_fit(split, len(tables), hardware, shards_ran_out))
        # 3. communication data on the gang
        floor, plans_ran_out = _measure_plans(
            candidates, tables, topology, config, store, measure, measuring_ends, log, devices
        )
    measuring_seconds = time.monotonic() - began
    # 4. fit and compare on held-out data
    _, plans = task_measurements(store, tables, hardware, measure, topology.devices_per_host_if_spanning)
    plan_split = split_measurements(plans, config.held_out, MIN_HELD_OUT_PLANS)
    # The fit may change the row cap (models of measurements capped at 200,000 rows on CPU): features follow the
    # measurements, which stand for whole tables unless `--max-rows` was given.
    start = replace(start, info=start.info.model_copy(update={"rows_cap": measure.max_rows}))
    micro = microbenchmark_measurements(store, hardware, measure)
    timed = comm_timed(plan_split)
    comm_kept = comm_kept_because(plan_split, timed)
    if comm_kept:
        log(comm_kept)
    comm_plans = None if comm_kept else timed
    tuned, compute_fit = _fine_tuned(
        start, hardware, by_split, plan_split, comm_plans, micro, topology.devices_per_host_if_spanning, config
    )
    log(compute_fit)
    tuned, comm_refused = refuse_comm_worse_than_chance(
        start,
        tuned,
        {"held-out": plan_split["held_out"], "validation and held-out": plan_split["val"] + plan_split["held_out"]},
    )
    if comm_refused:
        log(comm_refused)
    ran_out = {"shards": shards_ran_out, "plans": plans_ran_out}
    kept, choice = _kept_models(start, tuned, hardware, by_split, plan_split, topology.batch_size, ran_out)
    links, said = fit_links(plans, topology, kept, hardware)
    log(said)
    if links is not None:
        kept.info.links = links
    report = {
        "hardware": hardware,
        "started_from": {"path": start_path, "hardware": start.hardware},
        **choice,
        "compute_fit": compute_fit,
        "comm_kept": comm_kept,
        "comm_refused": comm_refused,
        "shards": {k: len(v) for k, v in by_split.items()},
        "plans": {k: len(v) for k, v in plan_split.items()},
        "ran_out": ran_out,
        "measuring_seconds": measuring_seconds,
        "seconds": time.monotonic() - began,
        "noise_floor": asdict(floor) if floor else None,
        "links": said,
        "capped_rows": capped_rows(by_split["fit"], tables),
    }
    _record_calibration(kept, report, tables, compute_data(by_split["fit"]), start)
    return Calibration(models=kept, chosen=report["chosen"], report=report)


def capped_rows(measurements: list[FusedShardMeasurement], tables: list[TableSpec]) -> dict[str, int]:
    """The tables of `tables` whose pieces `measurements` hold with fewer rows allocated than they have, for want of
    the measuring process's memory (not a `max_rows` asked for), each with the fewest rows allocated."""
    names = {t.name for t in tables}
    capped: dict[str, int] = {}
    for m in measurements:
        if m.rows_cap is None or m.config.max_rows is not None:
            continue
        for piece in m.tables:
            allocated = piece.allocated_rows(m.rows_cap)
            if piece.table.name in names and allocated < piece.row_count:
                capped[piece.table.name] = min(capped.get(piece.table.name, allocated), allocated)
    return capped


def comm_kept_because(
    plan_split: dict[str, list[PlanMeasurement]], timed: dict[str, list[PlanMeasurement]]
) -> str | None:
    """Why the comm model is kept as it started (None where it is fitted): too few plans of `plan_split` whose
    all-to-alls the gang timed (`timed`, `comm_timed`'s) to fit it and to validate it."""
    if timed["fit"] and timed["val"]:
        return None
    said = (
        f"the comm model is kept as it started: {len(timed['fit'])} plans with all-to-alls timed to fit it and "
        f"{len(timed['val'])} to validate it, one at least each needed"
    )
    priced = sum(len(plan_split[k]) - len(timed[k]) for k in ("fit", "val"))
    if priced:
        said += (
            f" ({priced} more plans had their all-to-alls priced, where the devices share cores, or mixed collectives "
            "the comm model does not describe alone)"
        )
    return said + "; more --plans or --budget-minutes measures more, and a core or GPU per device times them all"


def measuring_deadlines(began: float, config: CalibrateConfig, num_devices: int) -> tuple[float, float]:
    """When the shards' measuring stops and when the plans' does (monotonic seconds): the budget less its fitting
    share is the measuring time, and where a gang measures plans the shards leave them `plan_share` of it (shards
    that finish sooner leave the plans more)."""
    measuring = 60 * config.budget_minutes * (1 - config.fit_share)
    plans = config.plan_share * measuring if num_devices > 1 else 0.0
    return began + measuring - plans, began + measuring


# The fewest measured all-to-alls a link profile is fitted to.
MIN_COLLECTIVES = 12


def fit_links(
    plans: list[PlanMeasurement], topology: Topology, models: CostModels, hardware: str
) -> tuple[LinkProfile | None, str]:
    """The link profile of `hardware` fitted to the all-to-alls measured in `plans` (`fit_link_rate`), and a line
    saying what was fitted; None where too few were measured. On one host it fits a collective's fixed time and
    the rate inside the host; over hosts, the rate between them (the time the slower links set) and whether a
    host's devices share one link (`fit_link_between_hosts`), keeping the rest of `models`' profile."""
    spanning = topology.devices_per_host_if_spanning
    rows = measured_collectives(plans, spanning)
    if plans and all(p.cost.priced_parts for p in plans):
        return None, (
            f"links: not fitted: the gang priced every plan's all-to-alls ({topology.num_devices} devices share "
            "fewer cores), so none was measured; calibrate on a cluster with a core or GPU per device to fit them"
        )
    if len(rows) < MIN_COLLECTIVES:
        return None, (
            f"links: not fitted ({len(rows)} all-to-alls measured in plans of one sharding type, {MIN_COLLECTIVES} "
            "needed); a larger --budget-minutes or more --plans measures more"
        )
    devices = f"{topology.num_devices} devices on {hardware}"
    try:
        if spanning:  # judged by each collective's slowest device, which the step waits for
            slowest = slowest_of_each(rows)
            fixed_ms, gbps, shared, errors = fit_link_between_hosts(slowest[:, 1], slowest[:, 3], slowest[:, 2])
            where = f"{len(slowest)} all-to-alls of {devices}, each its slowest device"
        else:
            fixed_ms, gbps = fit_link_rate(rows[:, 0], rows[:, 2])
            where = f"{len(rows)} all-to-alls of {devices}"
    except ValueError as err:
        return None, f"links: not fitted: {err}"
    if spanning:
        kind = "a link each host's devices share" if shared else "a link per device"
        profile = models.links.model_copy(
            update={
                "inter_host_gbps": gbps,
                "host_link_gbps": gbps if shared else None,
                "source": f"{models.links.source}; between hosts fitted to {where}, {kind}",
            }
        )
        judged = ""
        if errors:
            judged = (
                f" (median error {errors[shared]:.0%} where hosts' devices share a collective; as "
                f"{'a link per device' if shared else 'one link a host'} {errors[not shared]:.0%})"
            )
        flags = "--inter-host-gbps" + (" and --host-link-gbps" if shared else "")
        return profile, (
            f"links between hosts: {gbps:.4g} GB/s ({gbps * 8e3:.0f} Mbit/s) achieved, {kind}{judged}, fitted to "
            f"{where}; `plan` with these models over such hosts takes it unless given {flags}"
        )
    profile = LinkProfile(
        collective_ms=fixed_ms, message_ms=0.0, intra_host_gbps=gbps, source=f"`calibrate` fitted to {where}"
    )
    return profile, (
        f"links inside a host: {gbps:.4g} GB/s and {fixed_ms:.3f} ms a collective, fitted to {where}; between hosts "
        "the topology's --inter-host-gbps (calibrate over hosts with --devices-per-host fits it)"
    )


def refuse_comm_worse_than_chance(
    start: CostModels, tuned: CostModels, judged_on: dict[str, list[PlanMeasurement]]
) -> tuple[CostModels, str | None]:
    """`tuned` with the starting comm model back where its fine-tuned one ranks the devices of any of the sets of
    plans it was not fit to (by name: the held-out plans whose figures `calibrate` prints, and those with the
    validation plans) worse than chance (Spearman below 0), and why; else `tuned` and None. A fit that orders
    all-to-alls backwards would steer every search the wrong way, whatever its MAPE."""
    if tuned.comm is start.comm:
        return tuned, None
    judged_sets = ((name, evaluate_comm(tuned, plans)) for name, plans in judged_on.items())  # judged until one fails
    backwards = next(((n, j) for n, j in judged_sets if j["spearman"] is not None and j["spearman"] < 0), None)
    if backwards is None:
        return tuned, None
    name, judged = backwards
    info = tuned.info.model_copy(
        update={"comm_devices_per_host": start.info.comm_devices_per_host, "device_counts": start.info.device_counts}
    )
    # A walk read "Spearman -0.24" of the starting model here against its 0.383 in the held-out figures printed after
    # (those of the held-out plans alone), and then "kept the fine-tuned models": each figure names its plans, and
    # what stands in for the refused model is said.
    reason = (
        f"refused the fine-tuned comm model: it ranks the all-to-alls of the {name} plans worse than chance "
        f"(Spearman {judged['spearman']:.2f} over their {judged['n']} devices); the starting comm model takes its "
        "place in the fine-tuned models, judged below"
    )
    kept = evaluate_comm(start, judged_on[name])["spearman"]
    if kept is not None and kept < 0:  # kept all the same: it was not fitted here, and there is no third
        held = evaluate_comm(start, judged_on["held-out"])["spearman"] if name != "held-out" else None
        reason += (
            f". The starting one ranks those plans worse than chance too (Spearman {kept:.2f} over the same devices"
            + ("" if held is None else f"; {held:.2f} over the held-out plans' alone, the figure printed below")
            + "): neither orders these plans' all-to-alls, so prices of them (and races that price them: more devices "
            "than cores) rest on no measured order"
        )
    return replace(tuned, comm=start.comm, info=info), reason


def _kept_models(
    start: CostModels,
    tuned: CostModels,
    hardware: str,
    by_split: dict[str, list],
    plan_split: dict[str, list[PlanMeasurement]],
    batch_size: int,
    ran_out: dict[str, bool],
) -> tuple[CostModels, dict[str, Any]]:
    """The fine-tuned models where they are better on validation and no worse on held-out data, else the starting
    ones (as models of `hardware`); both's held-out accuracy and the choice, for the report. `ran_out`: whether the
    tables made no more new shards and plans when more were wanted (what to advise where too few are held out)."""

    def scores(models: CostModels, split: str) -> dict[str, Any]:
        return {
            "compute": evaluate_compute(models, by_split[split]),
            "device_compute": evaluate_device_compute(models, plan_split[split]),
            "comm": evaluate_comm(models, plan_split[split]),
            "plan": plan_error(models, plan_split[split], batch_size),
        }

    before, tuned_held_out = scores(start, "held_out"), scores(tuned, "held_out")
    thin = too_thin_to_judge(len(by_split["held_out"]), len(plan_split["held_out"]), any(plan_split.values()), ran_out)
    if thin is not None:
        chosen, reason = "starting", thin
    else:
        chosen, reason = choose_models(
            _error(scores(start, "val")), _error(scores(tuned, "val")), before, tuned_held_out
        )
    kept = tuned if chosen == "fine-tuned" else replace(start, hardware=hardware, info=start.info.model_copy(deep=True))
    return kept, {
        "before": before,
        "after": tuned_held_out if chosen == "fine-tuned" else before,
        "fine_tuned": tuned_held_out,
        "chosen": chosen,
        "reason": reason,
    }


Drawn = TypeVar("Drawn")


def unmeasured(
    kind: str,
    drawn: dict[str, Drawn],
    known: set[str],
    held_out: int,
    needed: int,
    draw: int,
    log: Callable[[str], None],
) -> list[Drawn]:
    """The `drawn` shards or plans (by store key) not in the store yet, saying how many are measured for the held-out
    split's sake (the `draw`th of `MORE_BATCHES`); none where these tables make no new ones."""
    fresh = [item for key, item in drawn.items() if key not in known]
    if fresh:
        log(
            f"{held_out} measured {kind} fall in the held-out split, {needed} are needed: measuring {len(fresh)} more "
            f"(draw {draw} of at most {MORE_BATCHES}; a measurement falls in a split by its key)"
        )
    else:
        log(f"{held_out} measured {kind} fall in the held-out split: these tables make no more new {kind}")
    return fresh


def _measure_shards(
    candidates: list[Plan],
    tables: list[TableSpec],
    topology: Topology,
    simulator: Simulator,
    config: CalibrateConfig,
    store: MeasurementStore,
    measure: MeasureConfig,
    shards_end: float,
    log: Callable[[str], None],
    devices: DeviceActors,
) -> tuple[str, bool]:
    """The candidates' decisive shards, every table alone, the microbenchmark's shards (which fit the compute
    model's spine to this hardware) and drawn shards measured on the profiling actors (the gang's members where
    they can be, `DeviceActors.pool`), most useful first, until `shards_end`; the actors' hardware, and whether
    the tables made no new shards when more were wanted for the held-out split."""
    decisive = decisive_shards(candidates, tables, simulator, topology.batch_size)
    most_tables = max(len(pieces) for pieces in decisive)
    wanted = unique_shards(
        decisive
        + [[p] for p in table_wise(tables)]
        + microbenchmark_shards()
        + draw_fused_shards(tables, config.shards, max(2, most_tables), seed=config.seed, singles=False)
    )
    with devices.pool(config.actors) as pool:
        known = store.known_keys([fused_shard_key(pieces, measure, pool.hardware) for pieces in wanted])
        rest = "measuring the rest" if len(known) < len(wanted) else "none left to measure"
        log(f"{len(known)} of {len(wanted)} shards already measured in {store.path}; {rest}")
        capped = measured = 0
        ran_out = False
        for more in range(MORE_BATCHES + 1):
            if more:
                shards, _ = task_measurements(
                    store, tables, pool.hardware, measure, topology.devices_per_host_if_spanning
                )
                held_out = len(split_measurements(shards, config.held_out, MIN_HELD_OUT_SHARDS)["held_out"])
                if held_out >= MIN_HELD_OUT_SHARDS or time.monotonic() > shards_end:
                    break
                drawn = draw_fused_shards(
                    tables, config.shards, max(2, most_tables), seed=config.seed + more, singles=False
                )
                keys = {fused_shard_key(pieces, measure, pool.hardware): pieces for pieces in drawn}
                known = store.known_keys(list(keys))
                wanted = unmeasured("shards", keys, known, held_out, MIN_HELD_OUT_SHARDS, more, log)
                if not wanted:
                    ran_out = True
                    break
            with tqdm(total=len(wanted), desc="calibration: shards", unit="shard") as bar:
                for start_index in range(0, len(wanted), 2 * config.actors):
                    if time.monotonic() > shards_end:
                        bar.write(f"the shards' measuring time spent: {start_index} of {len(wanted)} shards measured")
                        break
                    chunk = wanted[start_index : start_index + 2 * config.actors]
                    done = pool.measure(chunk, measure, store, progress=False, say_capped=False)
                    capped += sum(m.rows_cap is not None and measure.max_rows is None for m in done)
                    measured += len(done)
                    bar.update(len(chunk))
        if capped:  # once, where the pool would say it a chunk at a time beside the bar
            log(f"warning: {capped_warning(capped, measured)}")
        return pool.hardware, ran_out


def _measure_plans(
    candidates: list[Plan],
    tables: list[TableSpec],
    topology: Topology,
    config: CalibrateConfig,
    store: MeasurementStore,
    measure: MeasureConfig,
    measuring_ends: float,
    log: Callable[[str], None],
    devices: DeviceActors,
) -> tuple[NoiseFloor | None, bool]:
    """The candidates and random plans measured on the devices' gang, those not in the store, until the measuring
    time is spent; the noise floor, a candidate against a copy of itself (None on one device, which has no gang),
    and whether the tables made no new plans when more were wanted for the held-out split."""
    if topology.num_devices == 1:
        return None, False
    gang = devices.gang()
    plans = candidates + random_plans(tables, topology.num_devices, config.plans, config.seed)
    floor = noise_floor(candidates[0], tables, topology, gang, measure, config.noise_rounds)
    log(f"noise floor: {floor.describe()}")
    for more in range(MORE_BATCHES + 1):
        if more:
            hosts = topology.devices_per_host_if_spanning
            _, measured = task_measurements(store, tables, gang.hardware, measure, hosts)
            held_out = len(split_measurements(measured, config.held_out, MIN_HELD_OUT_PLANS)["held_out"])
            if held_out >= MIN_HELD_OUT_PLANS or time.monotonic() > measuring_ends:
                break
            drawn = random_plans(tables, topology.num_devices, max(config.plans, 8), config.seed + more)
            keys = {gang.plan_key(plan, tables, measure): plan for plan in drawn}
            known = store.known_keys(list(keys), table="plan_measurements")
            plans = unmeasured("plans", keys, known, held_out, MIN_HELD_OUT_PLANS, more, log)
            if not plans:
                return floor, True
        for plan in tqdm(plans, desc="calibration: plans", unit="plan"):
            key = gang.plan_key(plan, tables, measure)
            if store.known_keys([key], table="plan_measurements"):
                continue
            if time.monotonic() > measuring_ends:
                break
            cost = gang.evaluate(plan, tables, measure)
            store.put_plan(PlanMeasurement(key=key, plan=plan, tables=tables, cost=cost))
    return floor, False


def _fine_tuned(
    start: CostModels,
    hardware: str,
    by_split: dict[str, list],
    plan_split: dict[str, list[PlanMeasurement]],
    comm_plans: dict[str, list[PlanMeasurement]] | None,
    microbenchmark: list[FusedShardMeasurement],
    devices_per_host: int | None,
    config: CalibrateConfig,
) -> tuple[CostModels, str]:
    """`start` fine-tuned on the fit split, stopped by the validation split, its spine first fitted to this hardware
    (the microbenchmark's shards and the fit split's), its correction kept where it prices the validation shards
    better than the spine alone (`spine_alone_where_better`, which it says); its comm model fitted to `comm_plans`' fit split and stopped
    by their validation split (the plans whose all-to-alls the gang timed), kept where None. Over hosts, the comm
    model is fit to all-to-alls measured over them: it learns their inter-host share, and prices it itself
    thereafter (`comm_devices_per_host`, `shard_ray.costmodel.pricing.analytic_devices_per_host`)."""
    train = TrainConfig(lr=config.lr, max_epochs=config.epochs, patience=30, minibatch=16, seed=config.seed)
    fit = compute_data(by_split["fit"])
    spine_data = compute_data(microbenchmark + by_split["fit"]) if microbenchmark else None
    val = compute_data(by_split["val"])
    compute, compute_fit = spine_alone_where_better(
        train_compute_model(fit, val, train, init=start.compute.network(), spine_data=spine_data), val
    )
    comm, info = start.comm, start.info.model_copy(deep=True)
    if comm_plans is not None:
        fit_plans, val_plans = comm_plans["fit"], comm_plans["val"]
        init = None if comm is None else comm.network()
        trained = train_comm_model(comm_samples(fit_plans), comm_samples(val_plans), train, init=init)
        comm = CommModel.of_network(trained)
        info.comm_devices_per_host = devices_per_host or None
        info.device_counts = sorted({*info.device_counts, *(p.plan.num_devices for p in fit_plans)})
    tuned = replace(start, compute=ComputeModel.of_network(compute), comm=comm, hardware=hardware, info=info)
    # What the networks do not price, fitted to this task's plans (the fit split) as the fine-tuned models price them.
    return fit_overheads(tuned, plan_split["fit"]), compute_fit


def spine_alone_where_better(corrected: ComputeCostNet, val: ComputeData) -> tuple[ComputeCostNet, str]:
    """The fine-tuned compute model, or its spine alone (`ComputeCostNet.without_correction`) where that prices the
    validation shards better, and which it is. The spine refitted to this machine and task's shards, corrected by a
    network trained on other tables on other days, priced the held-out shards worse than the spine alone in 10 of
    12 calibrations of four table files on the AMD EPYC (docs/results.md, "Calibration with its defaults on the AMD
    EPYC")."""
    if corrected.spine is None or len(val) == 0:
        return (
            corrected,
            "the fine-tuned candidate prices compute by its network (no spine to price alone, or no validation shards)",
        )
    alone = corrected.without_correction()
    with_it, without = (mape(*step_compute_ms(model, val)) for model in (corrected, alone))
    if without < with_it:
        return alone, (
            f"the fine-tuned candidate prices compute by the spine alone, its learned correction off (validation "
            f"shards' MAPE {without:.1%}; corrected {with_it:.1%})"
        )
    return (
        corrected,
        f"the fine-tuned candidate prices compute by the spine and its learned correction (validation shards' MAPE "
        f"{with_it:.1%}; alone {without:.1%})",
    )


def _record_calibration(
    kept: CostModels, report: dict[str, Any], tables: list[TableSpec], fit_data: Any, start: CostModels
) -> None:
    """What the kept models were calibrated on, and the range of tables they have now seen, in their info. Starting
    models kept unchanged have seen nothing new: their range stays theirs, so their warnings still fire."""
    kept.info.calibrated = Calibrated(
        **{k: v for k, v in report.items() if k not in ("before", "after")},
        held_out=report["after"],
        tables=[t.name for t in tables],
        task=task_digest(tables),
        at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    if report["chosen"] == "fine-tuned":
        kept.info.coverage = data_coverage(fit_data, start.info.coverage)


def plan_error(models: CostModels, plans: list[PlanMeasurement], batch_size: int) -> dict[str, Any]:
    """Simulated against measured plan cost (MAPE, Spearman) of measured plans."""
    if not plans:
        return accuracy(np.zeros(0), np.zeros(0))
    simulator = Simulator(models)
    simulated = [simulator.plan_cost(p.plan, p.tables, batch_size).cost_ms for p in plans]
    return accuracy(np.asarray(simulated), np.asarray([p.cost.cost_ms for p in plans]))


# The fewest shards a fit is made from.
FEWEST_FIT = 4
# The fewest held-out shards and plans a choice between the starting and the fine-tuned models may rest on: with
# fewer, one unlucky measurement decides it (a calibration once kept its models on 2 held-out plans).
MIN_HELD_OUT_SHARDS = 8
MIN_HELD_OUT_PLANS = 3
# How much more a fit may misprice the held-out plans (MAPE, in points) and still count as no worse: on the Intel
# Xeon, fits of Criteo's and the many-tiny-tables file better in every other held-out figure (compute 8.9% -> 8.3%
# and 11.5% -> 4.2%) were refused for 0.1 point (5.0% -> 5.1%, 6.6% -> 6.7%), a difference no measurement resolves.
PLAN_MAPE_TOLERANCE = 0.01
# Batches of random shards (`--shards` each) and of random plans (`--plans`, at least 8) measured after the first,
# while the held-out split has fewer than these and the measuring time lasts.
MORE_BATCHES = 3


def too_few_to_fit(split: dict[str, int], tables: int, hardware: str, ran_out: bool) -> str:
    """Why the measured shards of a task of `tables` tables, `split` (how many fall to "fit", "val" and "held_out"),
    are too few to fit the models to, and what would give more: a larger budget, unless the tables make no more
    distinct shards (`ran_out`), which only more tables do. The split is said: 6 shards read as enough for a fit that
    needs 4, one and one, where 3 fell to fitting (a new user's walk)."""
    said = (
        f"too few measurements to calibrate ({sum(split.values())} shards of these tables on {hardware}, "
        f"{split['fit']} to fit, {split['val']} to validate and {split['held_out']} held out"
    )
    if not ran_out:
        return f"{said}); give a larger --budget-minutes"
    return (
        f"{said}, all that these {tables} tables make; a fit needs {FEWEST_FIT} to fit, one to validate and one held "
        "out): calibrate on a table file with more of the model's tables; `plan` prices with the models at hand "
        "meanwhile"
    )


def too_thin_to_judge(shards: int, plans: int, with_plans: bool, ran_out: dict[str, bool] | None = None) -> str | None:
    """Why `shards` held-out shards (and `plans` held-out plans, `with_plans`: the task has a gang) are too few to
    choose the fine-tuned models on, and what would give more; None when they are enough. `ran_out` says of
    "shards" and "plans" whether the tables made no new ones when more were wanted: then more --shards or --plans
    would measure nothing new, and only a larger --held-out helps."""
    counted = {"shards": (shards, MIN_HELD_OUT_SHARDS), "plans": (plans, MIN_HELD_OUT_PLANS) if with_plans else (0, 0)}
    short = [kind for kind, (count, fewest) in counted.items() if count < fewest]
    if not short:
        return None
    need = f"at least {MIN_HELD_OUT_SHARDS} shards" + (f" and {MIN_HELD_OUT_PLANS} plans" if with_plans else "")
    held = f"{shards} shards" + (f", {plans} plans" if with_plans else "")
    if all((ran_out or {}).get(kind, False) for kind in short):
        advice = (
            f"these tables make no more distinct {' or '.join(short)} to measure: a larger --held-out (0.2 by default) "
            "judges the fit on more of those measured"
        )
    else:
        advice = (
            "give more --shards" + (" and --plans" if with_plans else "") + " (or a larger --budget-minutes) to "
            "measure enough, or, where the tables make few distinct ones, a larger --held-out"
        )
    return f"too few held-out measurements to judge the fit on ({held}; {need} are needed); {advice}"


def one_swap(n: int) -> float:
    """How much two neighbours of `n` ranked items trading places lowers a Spearman correlation: 12 / (n (n^2 - 1)).
    The held-out plans' measurements rank within noise where plans measure alike, so a fit is not refused for that
    (a walk's fit, held-out plan MAPE 46.3% -> 17.1%, was refused for Spearman 0.399 -> 0.387: one such swap of 10)."""
    return 12 / (n * (n * n - 1)) + 1e-9 if n > 2 else 0.0


def choose_models(
    start_val: float, tuned_val: float, start_held_out: dict[str, Any], tuned_held_out: dict[str, Any]
) -> tuple[str, str]:
    """ "fine-tuned" or "starting", and why: the fine-tuned models are kept only when they are more
    accurate on the validation shards and plans and price the held-out plans no worse, in error (within
    PLAN_MAPE_TOLERANCE) and in ranking (but for two neighbours trading places, `one_swap`; a calibration that made
    the plan ranking worse was kept before, with no word). The held-out plans take part in this choice, so their
    after figures are not independent of it."""
    if not tuned_val < start_val:
        return (
            "starting",
            f"the fine-tuned models were no more accurate on validation (mean MAPE of {VALIDATION_PARTS}: "
            f"{start_val:.1%} -> {tuned_val:.1%})",
        )
    old, new = start_held_out["plan"], tuned_held_out["plan"]
    if old["mape"] is not None and new["mape"] > old["mape"] + PLAN_MAPE_TOLERANCE:
        return (
            "starting",
            f"the fine-tuned models mispriced the held-out plans more (MAPE {old['mape']:.1%} -> {new['mape']:.1%})",
        )
    if old["spearman"] is not None and new["spearman"] is not None:
        if new["spearman"] < old["spearman"] - one_swap(new["n"]):
            return "starting", (
                f"the fine-tuned models ranked the held-out plans worse (Spearman {old['spearman']:.3f} -> "
                f"{new['spearman']:.3f}, more than two neighbours trading places)"
            )
    held_out = "no held-out plans to check them on" if old["mape"] is None else "no worse on the held-out plans"
    if old["mape"] is not None and new["mape"] > old["mape"]:
        held_out = f"within a point of the held-out plans' MAPE (MAPE {old['mape']:.1%} -> {new['mape']:.1%})"
    elif old["spearman"] is not None and new["spearman"] is not None and new["spearman"] < old["spearman"]:
        held_out = (
            f"ranking them as well but for two neighbours trading places (Spearman {old['spearman']:.3f} -> "
            f"{new['spearman']:.3f}; MAPE {old['mape']:.1%} -> {new['mape']:.1%})"
        )
    return "fine-tuned", (
        f"more accurate on validation (mean MAPE of {VALIDATION_PARTS}: {start_val:.1%} -> {tuned_val:.1%}) and "
        f"{held_out}"
    )


# The held-out parts whose MAPEs' mean chooses between the starting and fine-tuned models (`_error`), and as said.
VALIDATION_KEYS = ("compute", "device_compute", "comm")
VALIDATION_PARTS = ", ".join(key.replace("_", " ") for key in VALIDATION_KEYS)


def _error(scores: dict[str, Any]) -> float:
    """One number to choose models by: the compute (fused shards and the plans' devices) and comm MAPEs, those that
    have data."""
    values = [scores[k]["mape"] for k in VALIDATION_KEYS if scores[k]["mape"] is not None]
    return float(np.mean(values)) if values else float("inf")
