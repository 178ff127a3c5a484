"""Benchmark: the time cost_search takes to reach its own final quality, from the greedy grid and from the policy's plan.

    OMP_NUM_THREADS=1 python experiments/policy_start.py --devices 16,32,64

Held-out tasks of the test pool, as docs/results.md's policy sections draw them (`validation_tasks`, seed 7: 80-120
tables on 16 devices, 120-200 on 32, 200-300 on 64, memory 1.65x an even split). On each, `cost_search` with its
defaults prices its plan at Q, its final quality. Then each start (`start=greedy`, the default, and `start=policy`,
the shipped policy's greedy plan beside the grid's) runs on a ladder of budgets (`max_evaluations`), the smallest
first, until its plan is priced at or below Q: its time to that quality is that run's placement time, the policy's
placing included (`place` times both), the median of `--repeats` runs of that budget. Budgets count work, so each
rung's plan is the same on any machine; only the times are this machine's. Writes `policy_start.md` and
`policy_start.json` to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import place
from shard_ray.placement.search import MAX_EVALUATIONS
from shard_ray.plan.plan import Plan
from shard_ray.policy.ppo import validation_tasks
from shard_ray.policy.settings import PolicyConfig
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tasks import split_pool

TABLES_FOR_DEVICES = {16: (80, 120), 32: (120, 200), 64: (200, 300)}
LADDER = (2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, MAX_EVALUATIONS)
STARTS = ("greedy", "policy")


def median_seconds(first: Plan, tables, topology, settings: dict, repeats: int) -> float:
    """The median placement seconds of `first` and `repeats` - 1 more runs of `cost_search` with `settings`."""
    seconds = [first.placement_seconds]
    seconds += [place("cost_search", tables, topology, settings=settings).placement_seconds for _ in range(repeats - 1)]
    return statistics.median(seconds)


def time_to_quality(tables, topology, simulator: Simulator, start: str, quality: float, repeats: int) -> dict:
    """The least budget of `LADDER` whose plan from `start` is priced at most `quality`, and its placement seconds
    (the median of `repeats` runs); the last rung's price where none is."""
    for budget in LADDER:
        settings = {"start": start, "max_evaluations": budget}
        plan = place("cost_search", tables, topology, settings=settings)
        cost = simulator.plan_cost(plan, tables, topology.batch_size).cost_ms
        if cost <= quality * (1 + 1e-12):
            return {
                "budget": budget,
                "seconds": median_seconds(plan, tables, topology, settings, repeats),
                "cost_ms": cost,
            }
    return {"budget": None, "seconds": None, "cost_ms": cost}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="16,32,64", help="device counts, comma-separated, of 16, 32 and 64")
    parser.add_argument("--tasks", type=int, default=6, help="held-out tasks per device count")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the budget that reaches the quality, timed")
    parser.add_argument("--seed", type=int, default=7, help="the held-out tasks' seed")
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/policy_start")
    args = parser.parse_args()
    try:
        device_counts = [int(d) for d in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices must be comma-separated integers, got {args.devices!r}")
    if any(d not in TABLES_FOR_DEVICES for d in device_counts) or args.tasks < 1 or args.repeats < 1:
        parser.error(f"--devices must be among {sorted(TABLES_FOR_DEVICES)}; --tasks and --repeats at least 1")

    models = CostModels.load(default_cost_model_path())
    simulator = Simulator(models)
    _, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    results = []
    for devices in device_counts:
        low, high = TABLES_FOR_DEVICES[devices]
        config = PolicyConfig(min_tables=low, max_tables=high, devices=(devices,))
        for k, (tables, topology) in enumerate(validation_tasks(test_pool, config, args.tasks, args.seed)):
            final = place("cost_search", tables, topology)
            quality = simulator.plan_cost(final, tables, topology.batch_size).cost_ms
            row = {"devices": devices, "task": k, "tables": len(tables), "quality_ms": quality}
            row["default_seconds"] = median_seconds(final, tables, topology, {}, args.repeats)
            row["bound_ms"] = lower_bound_ms(models, tables, topology)
            for start in STARTS:
                row[start] = time_to_quality(tables, topology, simulator, start, quality, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)

    lines = [
        "| devices | task | tables | quality / bound | defaults: s | grid: budget, s | policy: budget, s "
        "| policy s / defaults' | policy s / grid's |",
        "|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for row in results:
        grid, policy = row["greedy"], row["policy"]
        reached = policy["seconds"] is not None
        lines.append(
            f"| {row['devices']} | {row['task']} | {row['tables']} | {row['quality_ms'] / row['bound_ms']:.3f} | "
            f"{row['default_seconds']:.2f} | {grid['budget']:,}, {grid['seconds']:.2f} | "
            + (
                f"{policy['budget']:,}, {policy['seconds']:.2f} | "
                if reached
                else f"not reached ({policy['cost_ms'] / row['quality_ms']:.4f}x) | "
            )
            + (
                f"{policy['seconds'] / row['default_seconds']:.2f} | {policy['seconds'] / grid['seconds']:.2f} |"
                if reached
                else "| |"
            )
        )
    lines += [
        "",
        "| devices | tasks the policy's start reaches | median policy s / defaults' | median policy s / grid's |",
    ]
    lines.append("|---:|---:|---:|---:|")
    for devices in device_counts:
        rows = [r for r in results if r["devices"] == devices and r["policy"]["seconds"] is not None]
        of_defaults = [r["policy"]["seconds"] / r["default_seconds"] for r in rows]
        of_grid = [r["policy"]["seconds"] / r["greedy"]["seconds"] for r in rows]
        medians = f"{statistics.median(of_defaults):.2f} | {statistics.median(of_grid):.2f}" if rows else "| "
        lines.append(f"| {devices} | {len(rows)} of {args.tasks} | {medians} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "policy_start.md", "\n".join(lines) + "\n")
    write_json(out / "policy_start.json", results)
    print("\n".join(lines))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
