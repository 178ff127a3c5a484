"""Calibration and measured selection on this machine, from the shipped models.

    python experiments/calibration.py --out shard-ray-out/calibration

For each task (synthetic test tasks of 26-40 tables, and the public-shape table files in
`experiments/tables/`, written in the minimal table format), as a user types it:

1. `shard-ray calibrate --cost-model SHIPPED`: held-out accuracy before and after, its time;
2. `shard-ray plan --algo cost_search --measure` with the calibrated models: the searched plan
   raced on the gang against every baseline (the heuristics, TorchRec's planner).

Writes `calibration.json` and `calibration.md` (the figures docs/results.md quotes) to `--out`.
Every step's measurements go to one store in `--out`, so a run started again measures only
what is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shard_ray.arguments import Parser
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.models import default_cost_model_path
from shard_ray.errors import ShardRayError
from shard_ray.io import write_json
from shard_ray.plan.plan import load_plan
from shard_ray.plan.topology import GB, memory_cap_with_headroom
from shard_ray.workflows.settings import BenchmarkConfig
from shard_ray.workload.tables import load_tables, save_tables

SHARD_RAY = str(Path(sys.executable).parent / "shard-ray")
PUBLIC_SHAPES = ("experiments/tables/criteo_kaggle.json", "experiments/tables/mlperf_dlrm_dcnv2.json")


@dataclass(frozen=True)
class CalibrationBenchmark:
    out: str = setting("shard-ray-out/calibration", "folder of the results, the store and the models", new_folder=True)
    tasks: int = setting(1, "synthetic test tasks of --min-tables to --max-tables tables", min=0)
    min_tables: int = setting(26, "fewest tables in a synthetic task", min=1)
    max_tables: int = setting(40, "most tables in a synthetic task", min=1)
    tables: tuple[str, ...] = setting(PUBLIC_SHAPES, "table files, comma-separated", repeat=True)
    devices: int = setting(2, "devices of the gang", min=2)
    memory_headroom: float = setting(1.5, "memory cap over an even split of a task's bytes", min=1)
    budget_minutes: float = setting(5.0, "calibrate --budget-minutes", min=0.1)
    measure_budget: float = setting(180.0, "plan --measure-budget", min=1)


def shard_ray(*args: str) -> str:
    """Run a shard-ray command as a user would; its stdout (also echoed), progress bars on stderr."""
    print(f"$ shard-ray {' '.join(args)}", flush=True)
    result = subprocess.run([SHARD_RAY, *args], stdout=subprocess.PIPE, text=True)
    print(result.stdout, flush=True)
    if result.returncode:
        raise SystemExit(f"shard-ray {args[0]} failed with status {result.returncode}")
    return result.stdout


def run_task(name: str, tables_file: Path, config: CalibrationBenchmark, out: Path) -> dict[str, Any]:
    tables = load_tables(tables_file)
    memory_gb = memory_cap_with_headroom(tables, config.devices, config.memory_headroom) / GB
    store, models, plan = str(out / "measurements.db"), out / "models" / f"{name}.pt", out / "plans" / f"{name}.json"
    common = ["--tables", str(tables_file), "--devices", str(config.devices), "--memory-gb", f"{memory_gb:.4f}"]
    for folder in (out / "models", out / "plans"):
        folder.mkdir(parents=True, exist_ok=True)
    report = json.loads(
        shard_ray(
            "calibrate", *common, "--cost-model", str(default_cost_model_path()), "--store", store,
            "--out", str(models), "--budget-minutes", str(config.budget_minutes), "--no-mlflow",
        ).strip().splitlines()[-1]
    )  # fmt: skip
    shard_ray(
        "plan", *common, "--algo", "cost_search", "--cost-model", str(models), "--out", str(plan),
        "--measure", "--measure-budget", str(config.measure_budget), "--store", store,
    )  # fmt: skip
    selection = load_plan(plan).measured
    heuristics = {"size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "random", "round_robin"}
    searched = next(n for n in selection.candidates if "cost_search" in n.split("="))
    record = {
        "tables": len(tables),
        "calibration": report,
        "chosen": selection.chosen,
        "separated": selection.separated,
        "cost_search": selection.candidates[searched].model_dump(),
    }
    for label, names in (("best_heuristic", heuristics), ("torchrec", {"torchrec"})):
        found = selection.best_of(names)
        if found:
            ratio = selection.ratios.get(found)
            record[label] = {
                "name": found,
                **selection.candidates[found].model_dump(),
                "ratio_to_chosen": ratio.model_dump() if ratio else None,
            }
            record[f"gain_over_{label}"] = 1 - selection.candidates[searched].median_ms / record[label]["median_ms"]
    return record


def markdown(results: dict[str, dict[str, Any]]) -> str:
    def pct(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.1f}%"

    lines = [
        "| task | tables | compute MAPE before → after | Spearman after | comm MAPE before → after | "
        "plan sim error before → after | calibration s | cost_search ms (95% CI) | best heuristic ms | "
        "TorchRec ms | vs heuristic | vs TorchRec |",
        "|---|---:|---|---:|---|---|---:|---|---|---|---:|---:|",
    ]
    for name, r in results.items():
        before, after = r["calibration"]["before"], r["calibration"]["after"]
        cs = r["cost_search"]
        heuristic, torchrec = r.get("best_heuristic"), r.get("torchrec")
        lines.append(
            f"| {name} | {r['tables']} | {pct(before['compute']['mape'])} → {pct(after['compute']['mape'])} | "
            f"{after['compute']['spearman'] or 0:.3f} | {pct(before['comm']['mape'])} → {pct(after['comm']['mape'])} | "
            f"{pct(before['plan']['mape'])} → {pct(after['plan']['mape'])} | {r['calibration']['seconds']:.0f} | "
            f"{cs['median_ms']:.2f} [{cs['ci_low_ms']:.2f}, {cs['ci_high_ms']:.2f}] | "
            + (f"{heuristic['median_ms']:.2f} ({heuristic['name']}) | " if heuristic else "— | ")
            + (f"{torchrec['median_ms']:.2f} | " if torchrec else "— | ")
            + f"{pct(r.get('gain_over_best_heuristic'))} | {pct(r.get('gain_over_torchrec'))} |"
        )
    return "\n".join(lines) + "\n"


def write_synthetic_tasks(synthetic: BenchmarkConfig, folder: Path) -> list[Path]:
    """The benchmark's synthetic test tasks as table files in `folder`, as a user would hand them over."""
    # imported here: it loads torch (1.5 s), which a bad flag of this script or of lower_bound.py need not wait for
    from shard_ray.workflows.benchmark import benchmark_tasks

    paths = []
    for name, tables in benchmark_tasks(synthetic) if synthetic.tasks else []:
        save_tables(folder / f"{name}.json", tables)
        paths.append(folder / f"{name}.json")
    return paths


def main(argv: list[str]) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_settings(parser, CalibrationBenchmark)
    config = settings_from(CalibrationBenchmark, parser.parse_args(argv))
    # the files given are read before the synthetic tasks are written and calibrated (minutes): a mistyped name is
    # refused in a line, not after them
    for path in config.tables:
        try:
            load_tables(path)
        except ShardRayError as err:
            parser.error(f"--tables: {err}")
    out = Path(config.out)
    synthetic = BenchmarkConfig(tasks=config.tasks, min_tables=config.min_tables, max_tables=config.max_tables)
    tasks = [(path.stem, path) for path in write_synthetic_tasks(synthetic, out / "tasks")]
    tasks += [(Path(path).stem, Path(path)) for path in config.tables]
    results = {}
    for name, path in tasks:
        results[name] = run_task(name, path, config, out)
        write_json(out / "calibration.json", results)
    (out / "calibration.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
