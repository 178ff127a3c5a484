"""Measured selection: candidate plans raced side by side on the gang until the best is known.

The models choose candidates; the hardware chooses among them. Each round measures every
candidate still in the race once (one median over `repeats` steps), in a fresh random order
and on fresh batches, so drift and batch luck fall on all candidates alike. After each round a
candidate is dropped when a one-sided Wilcoxon signed-rank test on the paired rounds says it
is slower than the current best at the chosen confidence; the race ends when one is left (the
best is separated from every other at that confidence), or at the time budget or round cap.

Medians come with distribution-free confidence intervals (order statistics of the rounds), and
every round's measurement goes to the store, where the next calibration finds it. Rounds are
`DeviceGang.evaluate_rounds`, the one way several plans are measured side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.stats import wilcoxon

from shard_ray.configfile import setting
from shard_ray.plan.cost import RoundsSummary
from shard_ray.plan.plan import MeasuredSelection, Plan
from shard_ray.plan.topology import Topology
from shard_ray.profiling.fused_shard import MeasureConfig
from shard_ray.profiling.store import MeasurementStore, PlanMeasurement
from shard_ray.workload.tables import TableSpec

if TYPE_CHECKING:
    from shard_ray.profiling.gang import DeviceGang


@dataclass(frozen=True)
class SelectionConfig:
    budget_seconds: float = setting(
        120.0, "plan --measure: seconds of measuring to separate the best candidate", flag="--measure-budget", min=1
    )
    min_rounds: int = 6  # fewer paired rounds reach neither p < 0.05 (one-sided) nor a 95% interval
    max_rounds: int = 40
    confidence: float = 0.95
    warmup: int = 3
    repeats: int = 10


def slower_p(candidate: list[float], best: list[float]) -> float:
    """One-sided p-value that `candidate` is slower than `best` over paired rounds (1.0 with too few)."""
    n = min(len(candidate), len(best))
    diffs = np.log(candidate[:n]) - np.log(best[:n])
    if n < 2 or not np.any(diffs):
        return 1.0
    return float(wilcoxon(diffs, alternative="greater").pvalue)


def distinct(plans: list[Plan]) -> list[tuple[str, Plan]]:
    """Candidates with identical placements merged: (names joined by '=', the first such plan)."""
    merged: dict[tuple, tuple[list[str], Plan]] = {}
    for plan in plans:
        placement = tuple(sorted((s.table, s.device, s.columns, s.rows or (), s.replicated) for s in plan.shards))
        merged.setdefault(placement, ([], plan))[0].append(plan.algorithm)
    return [("=".join(names), plan) for names, plan in merged.values()]


def select_measured(
    candidates: list[Plan],
    tables: list[TableSpec],
    topology: Topology,
    gang: DeviceGang,
    config: SelectionConfig,
    store: MeasurementStore,
    log: Callable[[str], None] = print,
) -> tuple[Plan, MeasuredSelection]:
    """Race the candidates on `gang`; the measured best plan and what the race found."""
    entries = distinct(candidates)
    plans = dict(entries)
    log(
        f"measuring {len(plans)} distinct plans of {len(candidates)} candidates side by side on a "
        f"{topology.num_devices}-device gang, for up to {config.budget_seconds:.0f} s"
    )
    rounds: dict[str, list[float]] = {name: [] for name in plans}
    active = list(plans)
    p_values: dict[str, float] = {}
    began = time.monotonic()
    round_index = 0
    while True:
        round_start = time.monotonic()
        # one interleaved round on fresh batches (the seed), the same ones for every candidate in it
        measure = MeasureConfig.for_topology(topology, warmup=config.warmup, repeats=config.repeats, seed=round_index)
        costs = gang.evaluate_rounds([plans[n] for n in active], tables, measure, progress=False)
        for name, cost in zip(active, costs):
            key = gang.plan_key(plans[name], tables, measure)
            store.put_plan(PlanMeasurement(key=key, plan=plans[name], tables=tables, cost=cost))
            rounds[name].append(cost.cost_ms)
        round_index += 1
        best = min(active, key=lambda name: np.median(rounds[name]))
        if round_index >= min(config.min_rounds, config.max_rounds):
            for name in [n for n in active if n != best]:
                p_values[name] = slower_p(rounds[name], rounds[best])
                if p_values[name] < 1 - config.confidence:
                    active.remove(name)
        spent = time.monotonic() - began
        log(
            f"round {round_index}: best {best} {np.median(rounds[best]):.2f} ms; "
            f"{len(active)} of {len(plans)} candidates still in the race ({spent:.0f} s)"
        )
        last_round = time.monotonic() - round_start
        if len(active) == 1 or round_index >= config.max_rounds or spent + last_round > config.budget_seconds:
            break
    selection = MeasuredSelection(
        hardware=gang.hardware,
        chosen=best,
        confidence=config.confidence,
        separated=len(active) == 1,
        steps_per_round=config.repeats,
        candidates={name: RoundsSummary.of(costs, config.confidence) for name, costs in rounds.items()},
        p_slower={
            name: p_values.get(name, slower_p(costs, rounds[best])) for name, costs in rounds.items() if name != best
        },
    )
    return plans[best].model_copy(update={"measured": selection}), selection
