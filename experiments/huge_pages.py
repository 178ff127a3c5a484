"""Whether transparent huge pages make a plan's measured cost repeatable between `evaluate` runs.

    python experiments/huge_pages.py --out experiments/results/huge_pages

The heuristics' plans of the public MLPerf DLRM-DCNv2 shapes on 2 devices (74 GB each), each
measured by separate `shard-ray evaluate` runs as a user types them, with the measuring actors'
tables on 4 KB pages (THP_MEM_ALLOC_ENABLE=0) and on transparent huge pages (the default),
interleaved: run 1 of every plan with each setting, then run 2, and so on. Per setting: the median
over plans and pairs of runs of |run i / run j - 1|, and the median spread of a run's rounds
(max / min - 1). Writes `huge_pages.json` to --out.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_json
from shard_ray.placement import place
from shard_ray.plan.plan import save_plan
from shard_ray.plan.topology import GB, Topology
from shard_ray.workload.tables import load_tables

TABLE_FILE = "experiments/tables/mlperf_dlrm_dcnv2.json"
ALGORITHMS = ("size_greedy", "lookup_greedy", "round_robin", "dim_greedy")
SETTINGS = {"4 KB pages": "0", "huge pages": "1"}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/huge_pages")
    parser.add_argument("--runs", type=int, default=3, help="evaluate runs per plan and setting")
    args = parser.parse_args()
    tables = load_tables(TABLE_FILE)
    topology = Topology(num_devices=2, memory_bytes=74 * GB)
    shard_ray = str(Path(sys.executable).with_name("shard-ray"))
    rounds: dict[str, dict[str, list[list[float]]]] = {s: {a: [] for a in ALGORITHMS} for s in SETTINGS}
    with tempfile.TemporaryDirectory() as folder:
        for algorithm in ALGORITHMS:
            save_plan(Path(folder, f"{algorithm}.json"), place(algorithm, tables, topology, seed=0))
        for run in range(args.runs):
            for setting, flag in SETTINGS.items():
                for algorithm in ALGORITHMS:
                    out = Path(folder, "cost.json")
                    subprocess.run(
                        [shard_ray, "evaluate", "--tables", TABLE_FILE, "--plan", str(Path(folder, f"{algorithm}.json")),
                         "--out", str(out), "--no-mlflow"],
                        check=True, capture_output=True, env={**os.environ, "THP_MEM_ALLOC_ENABLE": flag},
                    )  # fmt: skip
                    measured = json.loads(out.read_text())["rounds"]
                    rounds[setting][algorithm].append(measured["rounds_ms"])
                    print(f"run {run + 1}, {setting}, {algorithm}: {measured['median_ms']:.2f} ms", flush=True)
    summary = {}
    for setting, per_plan in rounds.items():
        medians = {a: [statistics.median(r) for r in runs] for a, runs in per_plan.items()}
        between = [abs(x / y - 1) for m in medians.values() for x, y in combinations(m, 2)]
        within = [max(r) / min(r) - 1 for runs in per_plan.values() for r in runs]
        summary[setting] = {
            "between_runs_median_abs_deviation": statistics.median(between),
            "between_runs_max_abs_deviation": max(between),
            "within_run_median_spread": statistics.median(within),
            "medians_ms": medians,
        }
        print(f"{setting}: {json.dumps({k: v for k, v in summary[setting].items() if k != 'medians_ms'})}")
    write_json(Path(args.out) / "huge_pages.json", {"summary": summary, "rounds_ms": rounds})


if __name__ == "__main__":
    main()
