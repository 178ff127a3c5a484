"""Benchmark: does Optuna's TPE find better settings than random search in the same number of trials?

    python experiments/search_algorithms.py --pool tasks/train_pool.json --samples 16 --seeds 0,1

Runs `shard-ray tune search` (simulated objective only, `--measure-top 0`) once per search
algorithm and seed on the same validation tasks, then reports, per algorithm, the best
simulated cost over the lower bound after every trial (median over seeds) and the final best.
Writes Markdown and JSON to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from shard_ray.cli import main as shard_ray
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--min-tables", type=int, default=20)
    parser.add_argument("--max-tables", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=2.0)
    parser.add_argument("--out", default="experiments/results/search_algorithms", help="the report")
    parser.add_argument("--work", default="shard-ray-out/search_algorithms", help="the sweeps' folders")
    args = parser.parse_args()
    out = Path(args.out)
    curves: dict[str, list[list[float]]] = {"optuna": [], "random": []}
    for search in curves:
        for seed in (int(s) for s in args.seeds.split(",")):
            folder = Path(args.work) / f"{search}-{seed}"
            code = shard_ray([
                "tune", "search", "--pool", args.pool, "--out", str(folder), "--samples", str(args.samples), "--search", search,
                "--seed", str(seed), "--tasks", str(args.tasks), "--min-tables", str(args.min_tables), "--max-tables",
                str(args.max_tables), "--devices", str(args.devices), "--time-budget", str(args.time_budget), "--measure-top", "0",
                "--no-mlflow",
            ])
            if code:
                return code
            curves[search].append(best_so_far(folder / "trials.csv"))
    shipped = json.loads((Path(args.work) / f"optuna-{args.seeds.split(',')[0]}" / "best.json").read_text())["notes"]["shipped_simulated_over_bound"]
    checkpoints = sorted({n for n in (4, 8, 16, 32, args.samples) if n <= args.samples})
    summary = {
        search: {n: statistics.median(c[n - 1] for c in found if len(c) >= n) for n in checkpoints}
        for search, found in curves.items()
    }
    lines = [
        f"Best simulated cost over the lower bound after n trials (median over seeds {args.seeds}); "
        f"{args.tasks} validation tasks of {args.min_tables}-{args.max_tables} tables on {args.devices} devices, "
        f"{args.time_budget} s budget; shipped cost_search settings: {shipped:.4f}.",
        "",
        "| search | " + " | ".join(f"n={n}" for n in checkpoints) + " |",
        "|---|" + "---:|" * len(checkpoints),
    ]
    for search, row in summary.items():
        lines.append(f"| {search} | " + " | ".join(f"{row[n]:.4f}" for n in checkpoints) + " |")
    write_atomic(out / "search_algorithms.md", "\n".join(lines) + "\n")
    write_json(out / "search_algorithms.json", {"settings": vars(args), "curves": curves, "summary": summary, "shipped": shipped})
    print("\n".join(lines))
    print(json.dumps({"shipped": shipped, **{s: row[checkpoints[-1]] for s, row in summary.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
