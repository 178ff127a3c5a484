"""The main job on the embedded default, end to end.

Generate the synthetic pool, draw a test task, profile fused shards in parallel on Ray
actors, plan the task with every algorithm, measure every plan on a gang of devices with
real all-to-all, log each to MLflow and print the comparison.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from shard_ray.costmodel.simulator import price_comm
from shard_ray.io import write_json
from shard_ray.placement import algorithms
from shard_ray.plan.summary import format_plan_summary
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.gang import DeviceActors
from shard_ray.profiling.procedure import FusedShardMeasurement, MeasureConfig
from shard_ray.profiling.sampling import draw_fused_shards
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import connect_ray
from shard_ray.tracking.mlflow_runs import default_tracking_uri, serves_its_ui, ui_command
from shard_ray.workflows.comparison import (
    AlgorithmComparison,
    CompareConfig,
    claims,
    compare_algorithms,
    format_comparison,
)
from shard_ray.workflows.settings import DemoConfig
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec, save_tables
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool


def fused_vs_singles(measurements: list[FusedShardMeasurement]) -> float | None:
    """Median of (fused step ms) / (sum of the tables' single-table step ms) over multi-table shards."""
    by_table = {m.tables[0].table.name: m.compute_ms for m in measurements if m.status == "ok" and len(m.tables) == 1}
    ratios = [
        m.compute_ms / sum(by_table[p.table.name] for p in m.tables)
        for m in measurements
        if m.status == "ok" and len(m.tables) > 1 and all(p.table.name in by_table for p in m.tables)
    ]
    return statistics.median(ratios) if ratios else None


def run_demo(config: DemoConfig) -> AlgorithmComparison:
    workdir = config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    tracking_uri = config.tracking_uri or default_tracking_uri()
    print("== 1. workload")
    tables, topology = _workload(config)
    print("\n== 2. profiling fused shards on Ray actors")
    print(connect_ray(config.address, min_cpus=config.num_devices))
    # one set of device actors: the gang's members profile the shards where there are as many as profiling actors
    with DeviceActors(config.num_devices, comm_pricer=price_comm) as devices:
        _profile(config, tables, topology, devices)
        print("\n== 3. planning with every algorithm, then measuring every plan on a gang of devices")
        compare = CompareConfig(rounds=config.rounds, budget_seconds=config.budget_seconds, repeats=config.repeats)
        gang = devices.gang()
        comparison = compare_algorithms(
            tables,
            topology,
            gang,
            compare,
            "demo",
            tracking_uri=tracking_uri,
            experiment=config.experiment,
            out_dir=workdir,
            seed=config.seed,
            incumbent="torchrec",  # what a user has today: a plan replaces it only when measured faster
        )
    for name, why in comparison.failures.items():
        print(f"{name} could not plan the task: {why}")
    result = comparison.result
    chosen = result.chosen.split("=")[0] if result else next(iter(comparison.plans))
    print(format_plan_summary(comparison.plans[chosen], tables, topology, comparison.costs[chosen]))
    print(f"\n== 4. comparison (measured on {gang.hardware})")
    print(format_comparison(result) if result else "every algorithm made the same plan")
    print(comparison.plans[chosen].estimate.provenance)
    _write_comparison(comparison, workdir)
    print("\n== 5. verdict")
    if result is None:
        print(f"every algorithm made the same plan; it measured {comparison.costs[chosen].cost_ms:.2f} ms")
    else:
        print(f"shard-ray chose {result.chosen}'s plan: cost_ms {result.cost.median_ms:.2f} a step, measured")
        print(f"- why: {result.rule}")
        heuristics = {a.name for a in algorithms() if a.family == "heuristic"}
        print("\n".join(f"- {line}" for line in claims(result, heuristics)))
        if not result.separated:
            print(
                f"- {result.rounds} rounds (at most {config.rounds}, within {config.budget_seconds:.0f} s) could not "
                "separate it from every other plan; `shard-ray demo --rounds 40 --budget-seconds 300` measures longer"
            )
    if comparison.logged is not None:
        print(comparison.logged.describe(tracking_uri))
    else:
        print(f"every plan is an MLflow run in experiment '{config.experiment}' at {tracking_uri}")
        print(
            f"see them at {tracking_uri}"
            if serves_its_ui(tracking_uri)
            else f"see them with {ui_command(tracking_uri)}"
        )
    print(f"plans, results and comparison.json are in {workdir}")
    return comparison


def _write_comparison(comparison: AlgorithmComparison, workdir: Path) -> None:
    result = comparison.result
    write_json(
        workdir / "comparison.json",
        {
            "comparison": result.model_dump(mode="json") if result else None,
            "plans": [
                {"algorithm": name, "cost_ms": comparison.costs[name].cost_ms, "placement_seconds": p.placement_seconds}
                for name, p in comparison.plans.items()
            ],
        },
    )


def _workload(config: DemoConfig) -> tuple[list[TableSpec], Topology]:
    """The demo's task, drawn from the test split of a synthetic pool, and its topology; both files written."""
    workdir = config.workdir
    pool = generate_pool(PoolConfig(seed=config.seed))
    save_tables(workdir / "pool.json", pool, source="synthetic", seed=config.seed)
    task_config = TaskConfig(min_tables=config.num_tables, max_tables=config.num_tables, seed=config.seed)
    _, test_pool = split_pool(pool, task_config.test_fraction, config.seed)
    tables: list[TableSpec] = draw_task(test_pool, task_config, np.random.default_rng(config.seed))
    task_file = workdir / "task.json"
    save_tables(task_file, tables, task="demo", split="test", seed=config.seed)
    topology = Topology(
        num_devices=config.num_devices,
        memory_bytes=memory_cap_with_headroom(tables, config.num_devices, config.memory_headroom),
        batch_size=config.batch_size,
    )
    print(
        f"pool of {len(pool)} synthetic tables -> {workdir / 'pool.json'}; task of {len(tables)} test tables -> {task_file}\n"
        f"{topology.num_devices} devices, {topology.memory_gb:.3f} GiB each, batch {topology.batch_size}"
    )
    return tables, topology


def _profile(config: DemoConfig, tables: list[TableSpec], topology: Topology, devices: DeviceActors) -> None:
    """Fused shards of the task measured on profiling actors, and what fusing saved."""
    measure_config = MeasureConfig.for_topology(topology, repeats=config.repeats, seed=config.seed)
    shards = draw_fused_shards(tables, config.profile_shards, config.max_tables_per_shard, seed=config.seed)
    with (
        devices.pool(min(2, config.num_devices)) as profiler,
        MeasurementStore(config.workdir / "measurements.db") as store,
    ):
        measurements = profiler.measure(shards, measure_config, store)
    ratio = fused_vs_singles(measurements)
    print(f"{len(measurements)} shards measured on {profiler.hardware} -> {config.workdir / 'measurements.db'}")
    if ratio is not None:
        print(f"a fused multi-table shard costs {ratio:.2f}x the sum of its tables measured alone (median)")
