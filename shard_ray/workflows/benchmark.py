"""The benchmark report: every algorithm on the same tasks, every plan measured on the device gang.

Tasks are drawn from the test half of the synthetic pool (tables the shipped cost models never
saw), plus any table files given. For each task every algorithm that handles its size plans the
same tables under the same memory cap (`memory_gb` per device, or `memory_headroom` times an
even split of the task's bytes, never below its largest table), and all of a task's plans are measured side by side in
one run on one gang. Averages are over the tasks every algorithm could plan (failures, such as
a heuristic finding no placement within memory, are counted apart). Per algorithm: mean
measured cost; improvement over the best single heuristic (lowest mean cost) and mean
improvement over each task's best heuristic (an oracle choice); mean measured cost over the
task's lower bound (a bound on the simulated cost); median placement time; mean error of the
cost models' simulated plan cost against the measured one.

Writes `benchmark.md`, `benchmark.csv`, `benchmark.png` and `benchmark.json` to `out`, logs every
plan and a summary run to MLflow, and keeps each finished task in `out`/tasks/, so a stopped
run started again with the same settings measures only the tasks it had not finished.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, describe_models, models_for
from shard_ray.costmodel.simulator import Simulator, price_comm
from shard_ray.costmodel.train import mape
from shard_ray.errors import ShardRayError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import algorithms
from shard_ray.placement.base import PlacementContext, with_fitted_links
from shard_ray.plan.cost import PlanRatio
from shard_ray.plan.summary import gang_layout
from shard_ray.plan.topology import (
    GB,
    Topology,
    memory_cap_with_headroom,
)
from shard_ray.profiling.gang import DeviceGang
from shard_ray.workflows.comparison import AlgorithmComparison, CompareConfig, compare_algorithms, format_comparison
from shard_ray.workflows.settings import BenchmarkConfig
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec, load_tables
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool

COLUMNS = (
    ("mean_cost_ms", "mean measured cost (ms)"),
    ("improvement_over_best_single_heuristic", "vs best single heuristic"),
    ("mean_improvement_over_best_heuristic", "vs each task's best heuristic"),
    ("mean_over_lower_bound", "over lower bound"),
    ("median_placement_ms", "placement (ms, median)"),
    ("mean_simulation_error", "simulated vs measured error"),
    ("best_or_tied", "tasks best or tied for best"),
    ("failed_tasks", "tasks failed"),
)


def benchmark_tasks(config: BenchmarkConfig) -> list[tuple[str, list[TableSpec]]]:
    """(name, tables) of every task: synthetic test-pool tasks first, then the table files."""
    tasks = []
    if config.tasks:
        task_config = TaskConfig(min_tables=config.min_tables, max_tables=config.max_tables, seed=0)
        _, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), task_config.test_fraction, 0)
        rng = np.random.default_rng(config.seed)
        tasks += [(f"test_{i:03d}", draw_task(test_pool, task_config, rng)) for i in range(config.tasks)]
    tasks += [(Path(path).stem, load_tables(path)) for path in config.table_files]
    names = [name for name, _ in tasks]
    if len(set(names)) != len(names):
        raise ShardRayError("two tasks share a name; give table files with different names")
    return tasks


def run_benchmark(config: BenchmarkConfig) -> dict[str, Any]:
    """Measure every task (resuming finished ones), then write and return the report (needs a connected Ray)."""
    config.check()
    out = Path(config.out)
    tasks = benchmark_tasks(config)
    heuristics = {a.name for a in algorithms() if a.family == "heuristic"}
    settings = config.recorded()
    config.refuse_other_settings()
    per_task: dict[str, dict[str, dict]] = {}
    failures: dict[str, list[str]] = {}
    with DeviceGang(config.devices, devices_per_host=config.devices_per_host, comm_pricer=price_comm) as gang:
        # written once the gang stands: a gang the cluster refused leaves nothing that would refuse the next run
        write_json(config.settings_file, settings)
        if len(set(gang.hosts)) > 1:
            print(gang_layout(gang.hosts), flush=True)
        for name, tables in tasks:
            done_file = out / "tasks" / f"{name}.json"
            if done_file.exists():
                done = json.loads(done_file.read_text())
                print(f"{name}: measured by an earlier run ({done_file})", flush=True)
            else:
                # the models calibrated for the gang's hardware and these tables, if any, as `plan` picks them
                cost_model = config.cost_model or str(models_for(gang.hardware, config.devices_per_host, tables))
                models = CostModels.load(cost_model)
                print(f"{name}: {describe_models(cost_model, models, tables)[0]}", flush=True)
                done = _measure_task(name, tables, config, gang, cost_model, models, heuristics)
                write_json(done_file, done)
            per_task[name] = done["records"]
            for algorithm, why in done["failures"].items():
                failures.setdefault(algorithm, []).append(why)
    report = summarise(per_task, failures, heuristics)
    report.update({"settings": settings, "hardware": gang.hardware, "warnings": gang.warnings, "tasks": len(tasks)})
    write_report(report, out, config)
    return report


def _measure_task(
    name: str,
    tables: list[TableSpec],
    config: BenchmarkConfig,
    gang: DeviceGang,
    cost_model: str,
    models: CostModels,
    heuristics: set[str],
) -> dict[str, Any]:
    """One task planned by every algorithm and raced on the gang: each algorithm's record, and what failed why."""
    hosts = {
        name: value
        for name in ("devices_per_host", "inter_host_gbps", "host_link_gbps")
        if (value := getattr(config, name)) is not None
    }
    topology = Topology(
        num_devices=config.devices,
        memory_bytes=round(config.memory_gb * GB)
        if config.memory_gb is not None
        else memory_cap_with_headroom(tables, config.devices, config.memory_headroom),
        batch_size=config.batch_size,
        **hosts,
    )
    context = PlacementContext(
        cost_model=cost_model, hardware=gang.hardware, devices_per_host=topology.devices_per_host_if_spanning
    )
    topology, rate_between_hosts = with_fitted_links(topology, context)
    if rate_between_hosts:
        print(f"{name}: {rate_between_hosts}", flush=True)
    compare = CompareConfig(
        rounds=config.rounds,
        budget_seconds=config.budget_seconds,
        min_rounds=min(6, config.rounds),
        repeats=config.repeats,
    )
    comparison = compare_algorithms(
        tables,
        topology,
        gang,
        compare,
        name,
        tracking_uri=config.tracking_uri,
        experiment=config.experiment,
        cost_model=cost_model,
        settings={"dreamshard": {"policy": config.policy}} if config.policy else None,
        names=list(config.algorithms) or None,
        log=lambda line, task=name: print(f"{task}: {line}", flush=True),
    )
    model_warnings = sorted({w for p in comparison.plans.values() if p.estimate for w in p.estimate.warnings})
    for line in model_warnings:
        print(f"{name}: warning: {line}", flush=True)
    for algorithm, why in comparison.failures.items():
        print(f"{name}: {algorithm} failed: {why}", flush=True)
    bound = lower_bound_ms(models, tables, topology, column_wise=True)
    records = _records(comparison, tables, topology, Simulator(models), bound, heuristics)
    if comparison.result is not None:
        print(
            f"{name} ({len(tables)} tables, bound {bound:.1f} ms):\n{format_comparison(comparison.result)}", flush=True
        )
    return {"records": records, "failures": comparison.failures}


def _records(
    comparison: AlgorithmComparison,
    tables: list[TableSpec],
    topology: Topology,
    simulator: Simulator,
    bound: float,
    heuristics: set[str],
) -> dict[str, dict]:
    """Each algorithm's measured cost, interval, ratio to the chosen plan and verdict, and how it compares."""
    costs, result = comparison.costs, comparison.result
    measured_heuristics = [costs[a].cost_ms for a in costs if a in heuristics]
    best_heuristic = min(measured_heuristics) if measured_heuristics else float("nan")
    records = {}
    for algorithm, plan in comparison.plans.items():
        cost = costs[algorithm]
        simulated = simulator.plan_cost(plan, tables, topology.batch_size).cost_ms
        spread = cost.rounds
        joined = next((n for n in result.candidates if algorithm in n.split("=")), None) if result else None
        ratio = result.ratios.get(joined) if result else None
        records[algorithm] = {
            "cost_ms": cost.cost_ms,
            "ci_ms": [spread.ci_low_ms, spread.ci_high_ms] if spread else None,
            "ci_coverage": spread.coverage if spread else None,
            "ratio_to_chosen": [ratio.ratio, ratio.low, ratio.high] if ratio else [1.0, 1.0, 1.0],
            "verdict": verdict_of(ratio),
            "improvement": 1.0 - cost.cost_ms / best_heuristic,
            "over_bound": cost.cost_ms / bound - 1.0,
            "placement_ms": plan.placement_seconds * 1e3,
            "sim_error": mape([simulated], [cost.cost_ms]),
        }
    return records


def verdict_of(ratio: PlanRatio | None) -> str:
    """A plan's verdict in its task's comparison, from its ratio to the chosen plan (None: it is the chosen one)."""
    if ratio is None:
        return "chosen"
    if not ratio.separated:
        return "tied"
    return "slower" if ratio.ratio > 1 else "faster"


def summarise(
    per_task: dict[str, dict[str, dict]], failures: dict[str, list[str]], heuristics: set[str]
) -> dict[str, Any]:
    names = sorted({name for task in per_task.values() for name in task})
    common = [task for task in per_task.values() if all(name in task for name in names)]
    if not common:
        raise ShardRayError(
            "no task was planned by every algorithm; see the failures above, or leave the failing ones out"
        )
    records = {name: [task[name] for task in common] for name in names}
    mean_cost = {name: statistics.mean(x["cost_ms"] for x in rs) for name, rs in records.items()}
    measured_heuristics = [n for n in names if n in heuristics]
    best_single = min(measured_heuristics, key=lambda n: mean_cost[n]) if measured_heuristics else None
    summary = {
        name: {
            "mean_cost_ms": mean_cost[name],
            "improvement_over_best_single_heuristic": 1.0 - mean_cost[name] / mean_cost[best_single]
            if best_single
            else None,
            "mean_improvement_over_best_heuristic": statistics.mean(x["improvement"] for x in rs)
            if best_single
            else None,
            "mean_over_lower_bound": statistics.mean(x["over_bound"] for x in rs),
            "median_placement_ms": statistics.median(x["placement_ms"] for x in rs),
            # tasks where the comparison found no plan faster (older records carry no verdict)
            "best_or_tied": sum(x.get("verdict", "tied") != "slower" for x in rs),
            "mean_simulation_error": statistics.mean(x["sim_error"] for x in rs),
            "tasks": len(rs),
            "failed_tasks": len(failures.get(name, [])),
        }
        for name, rs in records.items()
    }
    return {
        "algorithms": summary,
        "best_single_heuristic": best_single,
        "common_tasks": len(common),
        "per_task": per_task,
        "failures": failures,
    }


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "—"
    if key == "mean_cost_ms":
        return f"{value:.2f}"
    if key == "median_placement_ms":
        return f"{value:.1f}"
    if key in ("failed_tasks", "best_or_tied"):
        return str(value)
    if key == "mean_simulation_error":
        return f"{100 * value:.1f}%"
    return f"{100 * value:+.1f}%"


def write_report(report: dict[str, Any], out: Path, config: BenchmarkConfig) -> None:
    """benchmark.md, .csv, .png and .json in `out`; a summary MLflow run when tracking."""
    summary = report["algorithms"]
    ranked = sorted(summary.items(), key=lambda kv: kv[1]["mean_cost_ms"])
    sources = [f"table files {', '.join(Path(p).name for p in config.table_files)}"] if config.table_files else []
    if config.tasks:
        sources.insert(
            0, f"{config.tasks} synthetic test tasks of {config.min_tables}-{config.max_tables} unseen tables"
        )
    lines = [
        f"{report['common_tasks']} of {report['tasks']} task{'s' if report['tasks'] > 1 else ''} (those every algorithm planned; {', '.join(sources)}"
        + f"), {config.devices} devices, batch {config.batch_size}, memory "
        + (f"{config.memory_gb:g} GiB a device, " if config.memory_gb else f"{config.memory_headroom}x an even split, ")
        + f"measured on `{report['hardware']}`"
        + (" (CPU devices: one core each)" if report["hardware"].startswith("cpu") else "")
        + f"; best single heuristic: {_with_alike(report['best_single_heuristic'], summary)}",
        *(f"Warning: {w}." for w in report["warnings"]),
        "",
        "| algorithm | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    lines += [f"| {name} | " + " | ".join(_cell(key, s[key]) for key, _ in COLUMNS) + " |" for name, s in ranked]
    tied = never_slower(summary)
    if len(tied) > 1:
        lines += [
            "",
            f"No task's race measured {', '.join(tied)} slower than its chosen plan: their ranking is within noise.",
        ]
    lines += [
        "",
        "The percentages are of the plans' median measured costs, with no interval; which plans the hardware told "
        "apart is each task's race's verdict (printed with its intervals as the task ran, and each record's `verdict` "
        "in benchmark.json): `tasks best or tied for best` counts a plan within noise of the best as tied.",
    ]
    write_atomic(out / "benchmark.md", "\n".join(lines) + "\n")
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["algorithm", *(key for key, _ in COLUMNS), "tasks"])
    writer.writerows([name, *(s[key] for key, _ in COLUMNS), s["tasks"]] for name, s in ranked)
    write_atomic(out / "benchmark.csv", buffer.getvalue())
    cost_chart(
        ranked,
        report["best_single_heuristic"],
        f"{report['common_tasks']} task{'s' if report['common_tasks'] > 1 else ''}, {config.devices} devices, {report['hardware']}",
        out / "benchmark.png",
    )
    write_json(out / "benchmark.json", report)
    print("\n".join(lines), flush=True)
    if config.tracking_uri:
        print(f"logged MLflow run {log_summary(report, out, config)} to {config.tracking_uri}")


def cost_chart(ranked: list[tuple[str, dict]], best_single: str | None, title: str, path: Path) -> None:
    """Mean measured cost per algorithm, best first, the best single heuristic's marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in ranked]
    costs = [s["mean_cost_ms"] for _, s in ranked]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.5))
    ax.barh(names[::-1], costs[::-1], color=["tab:orange" if n == best_single else "tab:blue" for n in names[::-1]])
    if best_single:
        ax.axvline(
            dict(zip(names, costs))[best_single],
            color="tab:orange",
            linestyle="--",
            linewidth=1,
            label=f"best single heuristic ({best_single})",
        )
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("mean measured cost per step (ms)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_summary(report: dict[str, Any], out: Path, config: BenchmarkConfig) -> str:
    """The benchmark's summary run in MLflow (its settings, each algorithm's figures, its files); the run's id."""
    import mlflow

    from shard_ray.tracking.mlflow_runs import use_experiment

    use_experiment(config.tracking_uri, config.experiment)
    with mlflow.start_run(
        run_name="benchmark", tags={"kind": "benchmark", "hardware": report["hardware"], "devices": str(config.devices)}
    ) as run:
        mlflow.log_params({k: str(v) for k, v in report["settings"].items()})
        for name, s in report["algorithms"].items():
            mlflow.log_metrics({f"{key}.{name}": float(s[key]) for key, _ in COLUMNS if s[key] is not None})
        for suffix in ("md", "csv", "png", "json"):
            mlflow.log_artifact(str(out / f"benchmark.{suffix}"))
        return run.info.run_id


def as_good(name: str | None, summary: dict[str, dict]) -> list[str]:
    """The other algorithms whose mean cost is `name`'s to the last digit: on small tasks most place the tables alike,
    and the plans measured are the same plans (a new user read nine identical plans' "best" as a winner)."""
    if name is None:
        return []
    return [
        other for other, s in summary.items() if other != name and s["mean_cost_ms"] == summary[name]["mean_cost_ms"]
    ]


def never_slower(summary: dict[str, dict]) -> list[str]:
    """The algorithms no task's race measured slower than its chosen plan: where these are several, the lowest mean
    cost among them is not a winner the hardware told apart (a new user's script read `best_algorithm` as one, all ten
    plans of its task within noise)."""
    return sorted(name for name, s in summary.items() if s["best_or_tied"] == s["tasks"])


def _with_alike(name: str | None, summary: dict[str, dict]) -> str:
    alike = as_good(name, summary)
    # the algorithms of the same mean, not "as good" heuristics: a walk read the searches named there as heuristics
    return f"{name} ({', '.join(alike)}: the same mean cost)" if alike else str(name)


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the last printed line carries."""
    summary = report["algorithms"]
    best = min(summary, key=lambda n: summary[n]["mean_cost_ms"])
    return {
        "hardware": report["hardware"],
        "tasks": report["common_tasks"],
        "best_algorithm": best,
        "as_good_as_best": as_good(best, summary),
        "never_separated_slower": never_slower(summary),
        "best_single_heuristic": report["best_single_heuristic"],
        "improvement_over_best_single_heuristic": {
            n: s["improvement_over_best_single_heuristic"] for n, s in summary.items()
        },
        "mean_cost_ms": {n: round(s["mean_cost_ms"], 3) for n, s in summary.items()},
    }
