"""Benchmark: does Optuna's TPE find better settings than random search in the same number of trials?

    python experiments/search_algorithms.py --tables tasks/train_pool.json --samples 16 --seeds 0,1

Runs `shard-ray tune search` (simulated objective only, `--measure-top 0`) once per search
algorithm and seed (a seed draws the validation tasks too, so both algorithms of a seed see the
same tasks), then reports the best simulated cost over the lower bound after n trials, and the
shipped `cost_search` settings' on the same tasks.
Writes Markdown and JSON to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli import main as shard_ray
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_atomic, write_json

METRIC = "simulated_over_bound"


def best_so_far(trials_csv: Path) -> list[float]:
    """The best objective after each trial, in the order the trials finished."""
    with trials_csv.open() as handle:
        rows = sorted((r for r in csv.DictReader(handle) if r.get(METRIC)), key=lambda r: float(r["timestamp"]))
    curve, best = [], float("inf")
    for row in rows:
        best = min(best, float(row[METRIC]))
        curve.append(best)
    return curve


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", required=True)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--min-tables", type=int, default=20)
    parser.add_argument("--max-tables", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-evaluations", type=int, default=300_000)
    parser.add_argument(
        "--out", type=a_folder_to_write, default="experiments/results/search_algorithms", help="the report's folder"
    )
    parser.add_argument("--work", default="shard-ray-out/search_algorithms", help="the sweeps' folders")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(x) for x in args.seeds.split(",")]
    curves: dict[str, dict[int, list[float]]] = {"optuna": {}, "random": {}}
    shipped: dict[int, float] = {}
    for search in curves:
        for seed in seeds:
            folder = Path(args.work) / f"{search}-{seed}"
            code = shard_ray(
                [
                    "tune",
                    "search",
                    "--tables",
                    args.tables,
                    "--out",
                    str(folder),
                    "--samples",
                    str(args.samples),
                    "--search",
                    search,
                    "--seed",
                    str(seed),
                    "--tasks",
                    str(args.tasks),
                    "--min-tables",
                    str(args.min_tables),
                    "--max-tables",
                    str(args.max_tables),
                    "--devices",
                    str(args.devices),
                    "--max-evaluations",
                    str(args.max_evaluations),
                    "--measure-top",
                    "0",
                    "--no-mlflow",
                ]
            )
            if code:
                return code
            curves[search][seed] = best_so_far(folder / "trials.csv")
            shipped[seed] = json.loads((folder / "best.json").read_text())["notes"]["shipped_simulated_over_bound"]
    checkpoints = sorted({n for n in (4, 8, 16, 32, args.samples) if n <= args.samples})
    lines = [
        f"Best simulated cost over the lower bound after n trials; {args.tasks} validation tasks of {args.min_tables}-{args.max_tables} "
        f"tables on {args.devices} devices, a budget of {args.max_evaluations:,} model evaluations. The seed draws both the validation tasks and the search's "
        "choices, so compare rows of one seed.",
        "",
        "| seed | search | " + " | ".join(f"n={n}" for n in checkpoints) + " | shipped cost_search settings |",
        "|---|---|" + "---:|" * (len(checkpoints) + 1),
    ]
    for seed in seeds:
        for search in curves:
            curve = curves[search][seed]
            cells = [f"{curve[n - 1]:.4f}" if len(curve) >= n else "—" for n in checkpoints]
            lines.append(f"| {seed} | {search} | " + " | ".join(cells) + f" | {shipped[seed]:.4f} |")
    write_atomic(out / "search_algorithms.md", "\n".join(lines) + "\n")
    write_json(out / "search_algorithms.json", {"settings": vars(args), "curves": curves, "shipped": shipped})
    print("\n".join(lines))
    print(
        json.dumps(
            {"shipped": shipped, **{s: {seed: c[-1] for seed, c in found.items()} for s, found in curves.items()}}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
