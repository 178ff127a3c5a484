"""Benchmark: the baseline heuristics on held-out test tasks, each plan measured on the device gang.

    python experiments/baselines.py --tasks 5 --tables 20 --devices 2 --out experiments/results/baselines

For each test task every algorithm plans the same tables, and all plans of a task are
measured side by side in one run on one gang (each device cost is the median over
`--repeats` steps). Reports per algorithm: mean measured plan cost over tasks, mean ratio to
the best plan of the same task, and median placement time. Writes Markdown and JSON; the
last printed line is the JSON summary. Runs locally, or on a cluster with RAY_ADDRESS set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from shard_ray.comparison import compare_algorithms
from shard_ray.io import write_atomic, write_json
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
    parser.add_argument("--tables", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--memory-headroom", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--out", default="experiments/results/baselines")
    args = parser.parse_args()

    out = Path(args.out)
    pool = generate_pool(PoolConfig(seed=args.seed))
    task_config = TaskConfig(min_tables=args.tables, max_tables=args.tables, seed=args.seed)
    _, test_pool = split_pool(pool, task_config.test_fraction, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    print(connect_ray(min_cpus=args.devices))
    gang = DeviceGang(args.devices)
    for warning in gang.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    per_task = []
    try:
        for i in range(args.tasks):
            tables = draw_task(test_pool, task_config, rng)
            topology = Topology(
                num_devices=args.devices,
                memory_bytes=memory_cap_with_headroom(tables, args.devices, args.memory_headroom),
                batch_size=args.batch_size,
            )
            config = MeasureConfig.for_topology(topology, repeats=args.repeats, seed=args.seed)
            rows = compare_algorithms(
                tables, topology, gang, config, f"test_{i:03d}",
                tracking_uri=None if args.no_mlflow else default_tracking_uri(),
                experiment="shard-ray-baselines", progress=False,
            )
            best = min(r.cost.cost_ms for r in rows)
            per_task.append({r.plan.algorithm: (r.cost.cost_ms, r.cost.cost_ms / best, r.plan.placement_seconds) for r in rows})
            print(f"task {i}: " + ", ".join(f"{r.plan.algorithm} {r.cost.cost_ms:.1f} ms" for r in rows), flush=True)
    finally:
        gang.shutdown()

    summary = {}
    for name in per_task[0]:
        summary[name] = {
            "mean_cost_ms": statistics.mean(t[name][0] for t in per_task),
            "mean_ratio_to_task_best": statistics.mean(t[name][1] for t in per_task),
            "median_placement_ms": statistics.median(t[name][2] * 1e3 for t in per_task),
        }
    lines = [
        f"Baselines on {args.tasks} test tasks of {args.tables} tables, {args.devices} devices, batch {args.batch_size}, "
        f"measured on `{gang.hardware}` (CPU devices: one core each)",
        "",
        "| algorithm | mean measured cost (ms) | mean ratio to the task's best | median placement (ms) |",
        "|---|---:|---:|---:|",
    ]
    for name, s in sorted(summary.items(), key=lambda kv: kv[1]["mean_cost_ms"]):
        lines.append(f"| {name} | {s['mean_cost_ms']:.2f} | {s['mean_ratio_to_task_best']:.3f} | {s['median_placement_ms']:.3f} |")
    write_atomic(out / "baselines.md", "\n".join(lines) + "\n")
    write_json(out / "baselines.json", {"settings": vars(args), "hardware": gang.hardware, "algorithms": summary})
    print("\n".join(lines))
    print(json.dumps({"hardware": gang.hardware, "mean_cost_ms": {k: round(v["mean_cost_ms"], 3) for k, v in summary.items()}}))


if __name__ == "__main__":
    main()
