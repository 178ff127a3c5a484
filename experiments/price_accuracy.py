"""Benchmark: how well model files price plans of table files they were not fitted to, against the gang.

    python experiments/price_accuracy.py --models shard_ray/costmodel/pretrained/cpu-reference.pt OLD.pt \
        --tables experiments/tables/ranking_model.json experiments/tables/many_tiny.json ...

For each table file (written by hand in the minimal format, none of them in any model's training
data), on 2 devices: every heuristic, cost_search and TorchRec's planner plan the task with the
first model file; the distinct plans are measured side by side on the device gang in `--rounds`
interleaved rounds (each plan's median round); and every model file prices every plan. So the
models are compared on the same measurements, in one run. Per file and model it prints the
plan-level error (|predicted / measured - 1| of each plan's cost, mean and worst), the compute
error (each device's fused forward + backward) and the all-to-all error, MAPEs in percent, and the
Spearman correlation of predicted and measured plan costs. The last line is JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_file_to_write
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.costmodel.train import accuracy
from shard_ray.errors import InfeasibleError
from shard_ray.placement import place
from shard_ray.plan.cost import PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.runtime import connect_ray
from shard_ray.workload.tables import TableSpec, load_tables

ALGORITHMS = ("size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "random", "cost_search", "torchrec")


def distinct_plans(tables: list[TableSpec], topology: Topology, cost_model: str) -> list[Plan]:
    """Each algorithm's plan, once per distinct placement."""
    plans, seen = [], set()
    for name in ALGORITHMS:
        try:
            plan = place(name, tables, topology, seed=0, cost_model=cost_model)
        except InfeasibleError:
            continue
        key = tuple(sorted((s.table, s.device, s.columns, s.rows) for s in plan.shards))
        if key not in seen:
            seen.add(key)
            plans.append(plan)
    return plans


def errors(models: CostModels, plans: list[Plan], measured: list[PlanCost], tables: list[TableSpec]) -> dict[str, Any]:
    """The models' prices of `plans` against their measurements: plan, compute and all-to-all errors."""
    simulator = Simulator(models)
    priced = [simulator.plan_cost(plan, tables, m.batch_size) for plan, m in zip(plans, measured)]
    plan_ratio = np.array([p.cost_ms / m.cost_ms for p, m in zip(priced, measured)])
    compute = accuracy(
        np.array([d.fwd_compute_ms + d.bwd_compute_ms for p in priced for d in p.devices]),
        np.array([d.fwd_compute_ms + d.bwd_compute_ms for m in measured for d in m.devices]),
    )
    comm = accuracy(
        np.array([d.input_dist_ms + d.fwd_comm_ms + d.bwd_comm_ms for p in priced for d in p.devices]),
        np.array([d.input_dist_ms + d.fwd_comm_ms + d.bwd_comm_ms for m in measured for d in m.devices]),
    )
    ranking = accuracy(np.array([p.cost_ms for p in priced]), np.array([m.cost_ms for m in measured]))["spearman"]
    return {
        "plan_error_mean": float(np.mean(np.abs(plan_ratio - 1))),
        "plan_error_worst": float(np.max(np.abs(plan_ratio - 1))),
        "predicted_over_measured": plan_ratio.tolist(),
        "compute_mape": compute["mape"],
        "comm_mape": comm["mape"],
        "plan_spearman": ranking,
    }


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", required=True, help="table files")
    parser.add_argument("--models", nargs="+", default=[str(default_cost_model_path())], help="model files")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per plan (its median is taken)")
    parser.add_argument("--out", type=a_file_to_write, default=None, help="JSON file for the results")
    args = parser.parse_args()
    connect_ray(min_cpus=args.devices)
    models = {path: CostModels.load(path) for path in args.models}
    results: dict[str, Any] = {}
    with DeviceGang(args.devices) as gang:
        for path in args.tables:
            tables = load_tables(path)
            topology = Topology(
                num_devices=args.devices, memory_bytes=memory_cap_with_headroom(tables, args.devices, 1.5)
            )
            plans = distinct_plans(tables, topology, args.models[0])
            measured = gang.evaluate_rounds(plans, tables, MeasureConfig.for_topology(topology), rounds=args.rounds)
            name = Path(path).stem
            results[name] = {
                "plans": [p.algorithm for p in plans],
                "measured_ms": [m.cost_ms for m in measured],
                "models": {model: errors(m, plans, measured, tables) for model, m in models.items()},
            }
            print(
                f"\n{name}: {len(tables)} tables, {len(plans)} distinct plans, {args.rounds} rounds on {gang.hardware}"
            )
            print(
                f"  {'model file':<48} {'plan error mean':>15} {'worst':>7} {'compute':>8} {'comm':>8} {'Spearman':>8}"
            )
            for model, e in results[name]["models"].items():
                rho = "n/a" if e["plan_spearman"] is None else f"{e['plan_spearman']:.2f}"
                print(
                    f"  {model[-48:]:<48} {e['plan_error_mean']:>15.1%} {e['plan_error_worst']:>7.1%} "
                    f"{e['compute_mape']:>8.1%} {e['comm_mape']:>8.1%} {rho:>8}"
                )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
