"""Benchmark: the policy on tasks like its training ones and on bigger unseen ones, simulated.

    python experiments/policy_generalisation.py --tasks 8

Two task sets: like training (15-25 tables of the training pool on 4 devices) and bigger, unseen
(40-60 tables of the test pool on 8 devices). Every algorithm plans every task; each plan is
priced by the cost models (simulated cost, no hardware) over the task's table-wise lower bound.
Also the untrained network (its cost-model prior alone), to show what PPO added, and for the
policies how often greedy decoding alone ran out of memory. An algorithm that finds no
placement within memory counts as a failure, and its mean is over the rest.
Measured costs of the same comparison are in `shard-ray bench` (`experiments/benchmark.py`). Writes
Markdown and JSON; the last printed line is JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import InfeasibleError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import place
from shard_ray.policy.network import OptionScorer, load_policy, save_policy
from shard_ray.policy.policy_file import PolicyInfo, default_policy_path
from shard_ray.policy.ppo import validation_score, validation_tasks
from shard_ray.policy.settings import PolicyConfig
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tasks import split_pool

ALGORITHMS = ("lookup_greedy", "size_lookup_greedy", "neuroshard", "cost_search")


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks per set")
    parser.add_argument("--policy", default=str(default_policy_path()))
    parser.add_argument("--samples", type=int, default=16, help="sampled plans for dreamshard best-of-N")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/policy_generalisation")
    args = parser.parse_args()

    models = CostModels.load(default_cost_model_path())
    simulator = Simulator(models)
    train_pool, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    sets = {
        "like training: 15-25 training-pool tables, 4 devices": validation_tasks(
            train_pool, PolicyConfig(), args.tasks, args.seed
        ),
        "unseen and bigger: 40-60 test-pool tables, 8 devices": validation_tasks(
            test_pool, PolicyConfig(min_tables=40, max_tables=60, devices=(8,)), args.tasks, args.seed
        ),
    }
    folder = tempfile.TemporaryDirectory(prefix="untrained-policy-")  # removed when the script ends
    untrained = Path(folder.name) / "untrained.pt"
    torch.manual_seed(args.seed)
    save_policy(untrained, OptionScorer(), PolicyInfo(iterations=0))
    entries = [(name, name, None) for name in ALGORITHMS] + [
        ("dreamshard", "dreamshard", {"policy": args.policy}),
        (f"dreamshard best of {1 + args.samples}", "dreamshard", {"policy": args.policy, "samples": args.samples}),
        ("untrained policy (prior only)", "dreamshard", {"policy": str(untrained)}),
    ]
    summary: dict[str, dict[str, dict]] = {}
    for set_name, tasks in sets.items():
        summary[set_name] = {}
        for label, algorithm, settings in entries:
            policy = (settings or {}).get("policy")
            ratios, seconds, failed = [], [], 0
            for tables, topology in tasks:
                began = time.perf_counter()
                try:
                    plan = place(algorithm, tables, topology, settings=settings)
                except InfeasibleError:
                    failed += 1
                    continue
                seconds.append(time.perf_counter() - began)
                bound = lower_bound_ms(models, tables, topology, column_wise=False)
                ratios.append(simulator.plan_cost(plan, tables, topology.batch_size).cost_ms / bound)
            summary[set_name][label] = {
                "mean_over_table_wise_bound": statistics.mean(ratios) if ratios else None,
                "failed": failed,
                "median_seconds": statistics.median(seconds) if seconds else None,
                "greedy_stuck": None if policy is None else _greedy_stuck(policy, tasks, models),
            }
            print(f"{set_name} | {label}: {summary[set_name][label]}", flush=True)

    lines = [
        f"Simulated with the shipped CPU cost models; {args.tasks} tasks per set; policy `{Path(args.policy).name}`.",
        "",
    ]
    for set_name, rows in summary.items():
        lines += [
            f"**{set_name}**",
            "",
            "| algorithm | simulated cost / table-wise lower bound | no placement found | greedy decoding stuck | placement (s, median) |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, r in rows.items():
            ratio = "—" if r["mean_over_table_wise_bound"] is None else f"{r['mean_over_table_wise_bound']:.3f}"
            time_s = "—" if r["median_seconds"] is None else f"{r['median_seconds']:.2f}"
            stuck = "" if r["greedy_stuck"] is None else f"{r['greedy_stuck']} of {args.tasks}"
            lines.append(f"| {label} | {ratio} | {r['failed']} of {args.tasks} | {stuck} | {time_s} |")
        lines.append("")
    out = Path(args.out)
    write_atomic(out / "policy_generalisation.md", "\n".join(lines))
    write_json(out / "policy_generalisation.json", {"settings": vars(args), "summary": summary})
    print("\n".join(lines))
    print(json.dumps({s: {k: v["mean_over_table_wise_bound"] for k, v in rows.items()} for s, rows in summary.items()}))


def _greedy_stuck(policy: str, tasks: list, models: CostModels) -> int:
    """Tasks on which greedy decoding alone ran out of memory (the placer then samples until a plan fits)."""
    return validation_score(load_policy(policy)[0], tasks, models)[1]


if __name__ == "__main__":
    main()
