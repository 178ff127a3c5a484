"""Benchmark: the DreamShard policy's learning curves, PPO's training return beside greedy decoding on held-out tasks.

    python experiments/policy_learning_curves.py --iterations 30 --every 5

Trains a fresh network with `shard-ray policy train`'s settings (`PolicyConfig`'s defaults: tasks of 15-25
training-pool tables on 4 devices, priced by the shipped cost models) on a local Ray, and every `--every`
iterations (and before the first: the untrained network, whose prior is the cost models' greedy choice) places
held-out tasks of the test pool greedily: like training (4 devices), 16 devices (80-120 tables) and 64 devices
(200-300 tables), the cost over each task's lower bound (`shard_ray.policy.ppo.validation_score`). A curve that
does not fall below its first point is PPO adding nothing to the prior. Writes `curves.json`, `curves.md` and
`curves.png` to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.io import write_atomic, write_json
from shard_ray.policy.ppo import (
    build_algorithm,
    episode_return,
    policy_network,
    validation_score,
    validation_tasks,
)
from shard_ray.policy.settings import PolicyConfig
from shard_ray.runtime import connect_ray
from shard_ray.threads import one_thread
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tasks import split_pool

# The held-out sets: (name, tables, devices); tasks of the test pool, memory 1.65x an even split.
HELD_OUT = (
    ("4 devices, 15-25 tables", 15, 25, 4),
    ("16 devices, 80-120", 80, 120, 16),
    ("64 devices, 200-300", 200, 300, 64),
)


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train, held) = plt.subplots(1, 2, figsize=(11, 4))
    train.plot(range(1, len(curves["returns"]) + 1), [-r for r in curves["returns"]], marker=".")
    train.set_xlabel("PPO iteration")
    train.set_ylabel("sampled episodes' cost / lower bound")
    train.set_title("training (sampled actions, 4 devices)")
    for name, scores in curves["held_out"].items():
        first = scores[0]
        held.plot(curves["evaluated_at"], [s / first for s in scores], marker="o", label=f"{name} ({first:.3f} at 0)")
    held.axhline(0.95, color="grey", linestyle=":", label="5% below the prior")
    held.set_xlabel("PPO iteration (0: the untrained network, its prior)")
    held.set_ylabel("greedy cost / the prior's")
    held.set_title("held-out tasks, greedy decoding")
    held.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="iterations between held-out evaluations")
    parser.add_argument("--tasks", type=int, default=6, help="held-out tasks per set")
    parser.add_argument("--seed", type=int, default=7, help="the held-out tasks' seed")
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/policy_learning_curves")
    args = parser.parse_args()
    if args.iterations < 1 or args.every < 1 or args.tasks < 1:
        parser.error("--iterations, --every and --tasks must be at least 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = CostModels.load(default_cost_model_path())
    train_pool, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    config = PolicyConfig(iterations=args.iterations)
    held_out = {
        name: validation_tasks(
            test_pool, PolicyConfig(min_tables=low, max_tables=high, devices=(devices,)), args.tasks, args.seed
        )
        for name, low, high, devices in HELD_OUT
    }
    print(connect_ray(min_cpus=1))
    algo = build_algorithm(config, train_pool)
    curves: dict = {"returns": [], "evaluated_at": [], "held_out": {name: [] for name in held_out}, "seconds": []}

    def evaluate(iteration: int) -> None:
        network = policy_network(algo)
        curves["evaluated_at"].append(iteration)
        for name, tasks in held_out.items():
            score, stuck = validation_score(network, tasks, models)
            curves["held_out"][name].append(score)
            print(f"  iteration {iteration}: {name}: {score:.4f} over the bound ({stuck} stuck)", flush=True)

    try:
        with one_thread():
            evaluate(0)
            for iteration in range(1, args.iterations + 1):
                began = time.perf_counter()
                curves["returns"].append(episode_return(algo.train()))
                curves["seconds"].append(time.perf_counter() - began)
                print(f"PPO iteration {iteration}: mean return {curves['returns'][-1]:.4f}", flush=True)
                if iteration % args.every == 0 or iteration == args.iterations:
                    evaluate(iteration)
    finally:
        algo.stop()

    rows = [
        "| held-out set | the prior (iteration 0) | "
        + " | ".join(f"it. {i}" for i in curves["evaluated_at"][1:])
        + " |"
    ]
    rows.append("|---|" + "---:|" * len(curves["evaluated_at"]))
    for name, scores in curves["held_out"].items():
        rows.append(f"| {name} | " + " | ".join(f"{s:.3f}" for s in scores) + " |")
    write_atomic(out / "curves.md", "\n".join(rows) + "\n")
    write_json(out / "curves.json", curves)
    plot(curves, out / "curves.png")
    print("\n".join(rows))
    print(json.dumps({k: v for k, v in curves.items() if k != "seconds"}))


if __name__ == "__main__":
    main()
