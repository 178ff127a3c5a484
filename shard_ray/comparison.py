"""Plan one task with several algorithms, measure every plan on the gang, log each to MLflow.

Used by the demo and the benchmarks, so every comparison is produced the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shard_ray.errors import InfeasibleError
from shard_ray.io import write_json
from shard_ray.placement import algorithms, place
from shard_ray.plan.cost import PlanCost
from shard_ray.plan.plan import Plan, save_plan
from shard_ray.plan.topology import Topology
from shard_ray.profiling.fused_shard import MeasureConfig
from shard_ray.profiling.gang import DeviceGang
from shard_ray.tracking.mlflow_runs import log_plan_evaluation
from shard_ray.workload.tables import TableSpec


@dataclass(frozen=True)
class MeasuredPlan:
    plan: Plan
    cost: PlanCost


@dataclass
class Comparison:
    """Measured plans in the order asked for, and the algorithms that could not plan the task, with why."""

    rows: list[MeasuredPlan]
    failures: dict[str, str]


def compare_algorithms(
    tables: list[TableSpec],
    topology: Topology,
    gang: DeviceGang,
    config: MeasureConfig,
    task: str,
    names: list[str] | None = None,
    tracking_uri: str | None = None,
    experiment: str = "shard-ray",
    out_dir: Path | None = None,
    seed: int = 0,
    progress: bool = True,
    cost_model: str | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    rounds: int = 1,
) -> Comparison:
    """Every named algorithm's plan (all registered ones that handle the task by default), measured.

    With `rounds` > 1 the plans are measured in interleaved rounds (`DeviceGang.evaluate_rounds`)
    and each cost carries the median of its rounds with a confidence interval.

    `settings` gives algorithms their own settings by name. An algorithm that finds no placement
    within memory is recorded in `failures` and the others go on; any other error stops the run.
    """
    names = names or [info.name for info in algorithms() if info.handles(len(tables))]
    plans, failures = [], {}
    for name in names:
        try:
            plans.append(
                place(
                    name,
                    tables,
                    topology,
                    seed=seed,
                    cost_model=cost_model,
                    hardware=gang.hardware,  # picks its calibrated models, or warns that the models are another's
                    settings=(settings or {}).get(name),
                )
            )
        except InfeasibleError as err:
            failures[name] = str(err)
    costs = gang.evaluate_rounds(plans, tables, config, rounds, progress=progress)
    rows = [MeasuredPlan(plan, cost) for plan, cost in zip(plans, costs)]
    for row in rows:
        if out_dir is not None:
            save_plan(out_dir / "plans" / f"{row.plan.algorithm}.json", row.plan)
            write_json(out_dir / "results" / f"{row.plan.algorithm}.json", row.cost.model_dump(mode="json"))
        if tracking_uri is not None:
            log_plan_evaluation(row.plan, row.cost, topology, task, tables, tracking_uri, experiment)
    return Comparison(rows, failures)


def comparison_table(rows: list[MeasuredPlan]) -> str:
    """Algorithms by measured cost, with the ratio to the best and each device's total."""
    best = min(r.cost.cost_ms for r in rows)
    lines = [f"{'algorithm':<20} {'cost ms':>9} {'vs best':>8}  {'per-device total ms':<28} {'placement ms':>12}"]
    for row in sorted(rows, key=lambda r: r.cost.cost_ms):
        per_device = " / ".join(f"{d.total_ms:.1f}" for d in row.cost.devices)
        lines.append(
            f"{row.plan.algorithm:<20} {row.cost.cost_ms:>9.2f} {row.cost.cost_ms / best:>7.2f}x  {per_device:<28} "
            f"{row.plan.placement_seconds * 1e3:>12.2f}"
        )
    return "\n".join(lines)
