"""Refinement on the hardware against every baseline, confirmed by a separate comparison.

    OMP_NUM_THREADS=1 python experiments/refinement.py --out experiments/results/refinement

For a synthetic test task (26-40 tables, drawn as `experiments/calibration.py` draws them) and each
public-shape table file (Criteo Kaggle and MLPerf DLRM-DCNv2 cardinalities, minimal format) on the
device gang (`--devices`; with more devices than cores, compute measured per device and all-to-alls
priced), from the shipped models, as a user types it:

0. `shard-ray calibrate --budget-minutes 5` from the shipped models: held-out accuracy before and
   after, and the models the next steps plan with;
1. `shard-ray plan --algo cost_search --measure --refine`: the searched plan raced against every
   baseline, the race's choice refined with measured moves and written only if the gang separates
   the refined plan from it;
2. every baseline's plan (`plan --algo NAME`) and the shipped DreamShard policy's (with the calibrated
   models), then `shard-ray compare` of the written plan against TorchRec's, every heuristic's and the
   policy's: the separate run that confirms (or not) what step 1 wrote, and where the policy stands.

Over hosts emulated on this machine (`shard-ray hosts up`), run it in host 0 with the layout and the rate `hosts up`
printed, which every command of the run is given (TorchRec's planner plans with it too):

    shard-ray hosts up --hosts 4 --devices-per-host 4 --rate 300mbit
    shard-ray hosts run -- env OMP_NUM_THREADS=1 .venv/bin/python experiments/refinement.py --devices 16 \
        --devices-per-host 4 --link-gbps 0.0338 --batch-size 512 --out experiments/results/refinement_16dev_hosts
    shard-ray hosts down

Writes `refinement.json` and `refinement.md` (the figures docs/results.md quotes) to `--out`; the
measurements go to one store there.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration import PUBLIC_SHAPES, shard_ray, write_synthetic_tasks

from shard_ray.arguments import Parser
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.models import default_cost_model_path
from shard_ray.io import write_json
from shard_ray.plan.plan import load_plan
from shard_ray.plan.topology import GB, memory_cap_with_headroom
from shard_ray.workflows.comparison import ratio_interval
from shard_ray.workflows.settings import BenchmarkConfig
from shard_ray.workload.tables import load_tables

POLICY = "dreamshard"  # the shipped policy, planning with the calibrated models
BASELINES = ("torchrec", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "round_robin", "random")


@dataclass(frozen=True)
class RefinementBenchmark:
    out: str = setting("experiments/results/refinement", "folder of the results, the plans and the store")
    tables: tuple[str, ...] = setting(PUBLIC_SHAPES, "table files, comma-separated", repeat=True)
    tasks: int = setting(1, "synthetic test tasks of 26 to 40 tables", min=0)
    devices: int = setting(2, "devices of the gang", min=2)
    memory_headroom: float = setting(1.5, "memory cap over an even split of a task's bytes", min=1)
    measure_budget: float = setting(150.0, "plan --measure-budget and compare --budget-seconds", min=1)
    budget_minutes: float = setting(5.0, "calibrate --budget-minutes", min=0.1)
    batch_size: int = setting(1024, "global batch", min=1)
    devices_per_host: int = setting(0, "devices a host (0: one host holds them all)", min=0)
    link_gbps: float = setting(0.0, "over hosts: the GB/s of a host's one link, as `hosts up` measured it", min=0)


def run_task(tables_file: Path, config: RefinementBenchmark, out: Path) -> dict[str, Any]:
    name = tables_file.stem
    memory_gb = memory_cap_with_headroom(load_tables(tables_file), config.devices, config.memory_headroom) / GB
    store, plans = str(out / "measurements.db"), out / "plans" / name
    common = ["--tables", str(tables_file), "--devices", str(config.devices), "--memory-gb", f"{memory_gb:.4f}"]
    common += ["--batch-size", str(config.batch_size)]
    layout = ["--devices-per-host", str(config.devices_per_host)] if config.devices_per_host else []
    rates = ["--inter-host-gbps", str(config.link_gbps), "--host-link-gbps", str(config.link_gbps)]
    hosts = layout + (rates if config.link_gbps else [])  # calibrate takes the layout only: it fits the rates
    written, models = plans / "written.json", out / "models" / f"{name}.pt"
    for folder in (plans, out / "models"):
        folder.mkdir(parents=True, exist_ok=True)
    calibration = json.loads(
        shard_ray(
            "calibrate", *common, *layout, "--cost-model", str(default_cost_model_path()), "--store", store,
            "--out", str(models), "--budget-minutes", str(config.budget_minutes), "--no-mlflow",
        ).strip().splitlines()[-1]
    )  # fmt: skip
    printed = shard_ray(
        "plan", *common, *hosts, "--algo", "cost_search", "--cost-model", str(models), "--out", str(written), "--measure",
        "--refine", "--measure-budget", str(config.measure_budget), "--store", store, "--no-mlflow",
    )  # fmt: skip
    refinement = [line for line in printed.splitlines() if line.startswith("refinement")]
    for baseline in BASELINES:
        shard_ray("plan", *common, *hosts, "--algo", baseline, "--out", str(plans / f"{baseline}.json"), "--no-mlflow")
    shard_ray(
        "plan", *common, *hosts, "--algo", POLICY, "--cost-model", str(models), "--out", str(plans / f"{POLICY}.json"),
        "--no-mlflow",
    )  # fmt: skip
    shard_ray(
        "compare", "--tables", str(tables_file), "--plans", str(written),
        *(str(plans / f"{b}.json") for b in (*BASELINES, POLICY)), "--budget-seconds", str(config.measure_budget),
        "--out", str(out / "compare" / name), "--no-mlflow",
    )  # fmt: skip
    confirm = json.loads((out / "compare" / name / "comparison.json").read_text())["comparison"]
    chosen_in_race = load_plan(written)
    mine = next(n for n in confirm["candidates"] if "written" in n.split("="))
    policy = next(n for n in confirm["candidates"] if POLICY in n.split("="))
    return {
        "calibration": calibration,
        "memory_gb": memory_gb,
        "written_plan": chosen_in_race.algorithm,
        "race_separated": chosen_in_race.measured.separated if chosen_in_race.measured else None,
        "refinement": refinement,
        "confirm": confirm,
        "written_name": mine,
        "policy_name": policy,
    }


def over_best_baseline(confirm: dict[str, Any], name: str) -> str:
    """Candidate `name`'s cost over the fastest baseline's in the separate comparison, with the interval
    the comparison's procedure gives a pair (its level corrected for many plans and looks)."""
    rounds = {n: c["rounds_ms"] for n, c in confirm["candidates"].items()}
    baselines = [n for n in rounds if n != name and set(n.split("=")) & set(BASELINES)]
    best = min(baselines, key=lambda n: ratio_interval(rounds[n], rounds[name], 1.0).ratio)
    r = ratio_interval(rounds[name], rounds[best], confirm["pair_level"])
    return f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}] (vs {best})"


def markdown(results: dict[str, dict[str, Any]]) -> str:
    def pct(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.1f}%"

    lines = [
        "| task | compute MAPE before → after | Spearman after | plan sim error before → after | kept |",
        "|---|---|---:|---|---|",
    ]
    for name, r in results.items():
        report = r["calibration"]
        before, after = report["before"], report["after"]
        lines.append(
            f"| {name} | {pct(before['compute']['mape'])} → {pct(after['compute']['mape'])} | "
            f"{after['compute']['spearman'] or 0:.3f} | {pct(before['plan']['mape'])} → {pct(after['plan']['mape'])} | "
            f"{report['chosen']} |"
        )
    lines += [
        "",
        "| task | plan written by `plan --measure --refine` | refinement | separate `compare`: chosen | "
        "written plan over the best baseline [CI] | dreamshard over the best baseline [CI] | separated |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        confirm, mine = r["confirm"], r["written_name"]
        shown = over_best_baseline(confirm, mine)
        kept = next((line for line in r["refinement"] if "move(s) kept" in line), "")
        lines.append(
            f"| {name} | {r['written_plan']} | {kept.removeprefix('refinement: ')} | {confirm['chosen']} | {shown} | "
            f"{over_best_baseline(confirm, r['policy_name'])} | "
            f"{confirm['separated']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_settings(parser, RefinementBenchmark)
    config = settings_from(RefinementBenchmark, parser.parse_args(argv))
    out = Path(config.out)
    synthetic = BenchmarkConfig(tasks=config.tasks, min_tables=26, max_tables=40)
    paths = [*write_synthetic_tasks(synthetic, out / "tasks"), *map(Path, config.tables)]
    results = {}
    for path in paths:
        results[path.stem] = run_task(path, config, out)
        write_json(out / "refinement.json", results)
    (out / "refinement.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
