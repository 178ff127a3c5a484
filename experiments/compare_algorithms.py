"""Benchmark: every algorithm on held-out test tasks, each plan measured on the device gang.

    python experiments/compare_algorithms.py --tasks 5 --min-tables 20 --max-tables 40 --devices 2
    python experiments/compare_algorithms.py --config experiments/configs/compare_algorithms.yaml

Tasks are drawn from the test half of the synthetic pool (tables the shipped cost models never
saw). For each task every algorithm that handles its size plans the same tables, and all of a
task's plans are measured side by side in one run on one gang (each device part is the median
over `--repeats` steps). Averages are over the tasks every algorithm could plan (failures, such
as a heuristic finding no placement within memory, are counted apart). Per algorithm: mean
measured cost; improvement over the best single heuristic (lowest mean cost); mean improvement
over each task's best heuristic (an oracle choice); mean measured cost over the task's lower
bound (a bound on the simulated cost); median placement time; mean error of the simulated plan
cost against the measured one. Writes Markdown and JSON; the last printed line is JSON.
Each finished task is saved in `--out`/tasks/, so a stopped run started again with the same
arguments measures only the tasks it had not finished. Runs locally, or on a cluster with
RAY_ADDRESS set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from shard_ray.comparison import compare_algorithms
from shard_ray.configfile import expand_config
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import ShardRayError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import algorithms
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.fused_shard import MeasureConfig
from shard_ray.profiling.gang import DeviceGang
from shard_ray.runtime import connect_ray
from shard_ray.tracking.mlflow_runs import default_tracking_uri
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--min-tables", type=int, default=20)
    parser.add_argument("--max-tables", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--memory-headroom", type=float, default=1.5)
    parser.add_argument("--cost-model", default=str(default_cost_model_path()))
    parser.add_argument("--policy", default=None, help="policy for dreamshard (default: the shipped one)")
    parser.add_argument("--algorithms", default=None, help="comma-separated names (default: every one that handles the task)")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    parser.add_argument("--experiment", default="shard-ray-compare", help="MLflow experiment (default %(default)s)")
    parser.add_argument("--out", default="experiments/results/compare")
    try:
        args = parser.parse_args(expand_config(sys.argv[1:]))
    except ShardRayError as err:
        parser.error(str(err))

    out = Path(args.out)
    models = CostModels.load(args.cost_model)
    simulator = Simulator(models)
    heuristics = {a.name for a in algorithms() if a.family == "heuristic"}
    pool = generate_pool(PoolConfig(seed=0))  # the pool the shipped models' training half came from
    task_config = TaskConfig(min_tables=args.min_tables, max_tables=args.max_tables, seed=0)
    _, test_pool = split_pool(pool, task_config.test_fraction, 0)
    rng = np.random.default_rng(args.seed)
    settings_file = out / "tasks" / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != vars(args):
        sys.exit(f"{settings_file.parent} holds tasks measured with other settings; give another --out or remove it")
    write_json(settings_file, vars(args))
    print(connect_ray(min_cpus=args.devices))
    gang = DeviceGang(args.devices)
    for warning in gang.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    per_task: list[dict[str, dict]] = []
    failures: dict[str, list[str]] = {}
    try:
        for i in range(args.tasks):
            tables = draw_task(test_pool, task_config, rng)  # drawn every time, so a resumed run draws the same tasks
            done_file = out / "tasks" / f"test_{i:03d}.json"
            if done_file.exists():
                done = json.loads(done_file.read_text())
                per_task.append(done["records"])
                for name, why in done["failures"].items():
                    failures.setdefault(name, []).append(why)
                print(f"task {i}: measured by an earlier run ({done_file})", flush=True)
                continue
            topology = Topology(
                num_devices=args.devices,
                memory_bytes=memory_cap_with_headroom(tables, args.devices, args.memory_headroom),
                batch_size=args.batch_size,
            )
            config = MeasureConfig.for_topology(topology, repeats=args.repeats, seed=args.seed)
            comparison = compare_algorithms(
                tables, topology, gang, config, f"test_{i:03d}",
                tracking_uri=None if args.no_mlflow else args.tracking_uri or default_tracking_uri(),
                experiment=args.experiment, progress=False, cost_model=args.cost_model, policy=args.policy,
                names=args.algorithms.split(",") if args.algorithms else None,
            )
            rows = comparison.rows
            for name, why in comparison.failures.items():
                failures.setdefault(name, []).append(why)
                print(f"task {i}: {name} failed: {why}", flush=True)
            bound = lower_bound_ms(models, tables, topology, column_wise=True)
            best_heuristic = min(r.cost.cost_ms for r in rows if r.plan.algorithm in heuristics)
            task_records = {}
            for r in rows:
                simulated = simulator.plan_cost(r.plan, tables, topology.batch_size).cost_ms
                task_records[r.plan.algorithm] = {
                    "cost_ms": r.cost.cost_ms,
                    "improvement": 1.0 - r.cost.cost_ms / best_heuristic,
                    "over_bound": r.cost.cost_ms / bound - 1.0,
                    "placement_ms": r.plan.placement_seconds * 1e3,
                    "sim_error": abs(simulated - r.cost.cost_ms) / r.cost.cost_ms,
                }
            per_task.append(task_records)
            write_json(done_file, {"records": task_records, "failures": comparison.failures})
            print(f"task {i} ({len(tables)} tables, bound {bound:.1f} ms): "
                  + ", ".join(f"{r.plan.algorithm} {r.cost.cost_ms:.1f}" for r in rows), flush=True)
    finally:
        gang.shutdown()

    names = sorted({name for task in per_task for name in task})
    common = [task for task in per_task if all(name in task for name in names)]
    if not common:
        sys.exit("no task was planned by every algorithm; see the failures above")
    records = {name: [task[name] for task in common] for name in names}
    mean_cost = {name: statistics.mean(x["cost_ms"] for x in rs) for name, rs in records.items()}
    best_single = min((n for n in names if n in heuristics), key=lambda n: mean_cost[n])
    summary = {
        name: {
            "mean_cost_ms": mean_cost[name],
            "improvement_over_best_single_heuristic": 1.0 - mean_cost[name] / mean_cost[best_single],
            "mean_improvement_over_best_heuristic": statistics.mean(x["improvement"] for x in rs),
            "mean_over_lower_bound": statistics.mean(x["over_bound"] for x in rs),
            "median_placement_ms": statistics.median(x["placement_ms"] for x in rs),
            "mean_simulation_error": statistics.mean(x["sim_error"] for x in rs),
            "tasks": len(rs),
            "failed_tasks": len(failures.get(name, [])),
        }
        for name, rs in records.items()
    }
    lines = [
        f"{len(common)} of {args.tasks} test tasks of {args.min_tables}-{args.max_tables} unseen tables (those every "
        f"algorithm planned), {args.devices} devices, batch {args.batch_size}, measured on `{gang.hardware}` "
        f"(CPU devices: one core each); best single heuristic: {best_single}",
        *(f"Warning: {w}." for w in gang.warnings),
        "",
        "| algorithm | mean measured cost (ms) | vs best single heuristic | vs each task's best heuristic | over lower bound | placement (ms, median) | simulated vs measured error | tasks failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in sorted(summary.items(), key=lambda kv: kv[1]["mean_cost_ms"]):
        lines.append(
            f"| {name} | {s['mean_cost_ms']:.2f} | {100 * s['improvement_over_best_single_heuristic']:+.1f}% | "
            f"{100 * s['mean_improvement_over_best_heuristic']:+.1f}% | "
            f"{100 * s['mean_over_lower_bound']:+.1f}% | {s['median_placement_ms']:.1f} | {100 * s['mean_simulation_error']:.1f}% | "
            f"{s['failed_tasks']} |"
        )
    write_atomic(out / "compare.md", "\n".join(lines) + "\n")
    write_json(
        out / "compare.json",
        {"settings": vars(args), "hardware": gang.hardware, "algorithms": summary, "per_task": per_task, "failures": failures},
    )
    print("\n".join(lines))
    print(json.dumps({"hardware": gang.hardware, "mean_cost_ms": {k: round(v["mean_cost_ms"], 3) for k, v in summary.items()}}))


if __name__ == "__main__":
    main()
