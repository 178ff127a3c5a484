"""What better placement could gain on this hardware: every plan beside a measured balance bound.

    OMP_NUM_THREADS=1 python experiments/lower_bound.py --out experiments/results/lower_bound [--devices 2]
        [--tasks 0 --tables ONE_FILE --plans WRITTEN_PLAN.json]

Is a plan at 0.95x of the best baseline there to be found? For a synthetic test task (drawn as
`experiments/calibration.py` draws it) and each public-shape table file, every algorithm's plan
(the shipped models for the searches and the policy) is measured in refinement's accounting: each
device's fused shard timed on the profiling actors (forward + backward), plus its all-to-alls as the
shipped models price them; a plan costs its slowest device. Beside them the same rounds time
`--splits` random assignments of the tables to the devices, every table alone, and all of them
fused on one device. The bound, per round:

    max_d cost_d  >=  mean_d cost_d  >=  the least mean_d cost_d of any plan or split measured

The first inequality holds for every plan: a plan's slowest device costs at least its devices'
mean, which is what the same fused work and all-to-alls would cost perfectly balanced. The second
is measured, not proven: it assumes no grouping of the tables fuses into less work and traffic than
every one of the plans and random splits did, and the run reports how far their summed compute
spreads (`total compute spread`). A bound from the extremes alone (all tables fused, or all apart,
whichever is cheaper) would need fusing to move the cost one way only; on these kernels it does
not: a few tables fuse far cheaper than apart, while a plan's two halves on two cores can add up
to less than all of them fused on one (`least total over the cheaper extreme` below 1).

Every round measures everything again with new batches (`--rounds`, interleaved: one round's shards
are timed in the same minutes); ratios are paired by round, with the comparison procedure's trimmed-t
95% interval (`shard_ray.workflows.comparison.ratio_interval`). With more devices than cores this is the
accounting `evaluate` reports for such a plan (compute measured, all-to-alls priced). Writes
`lower_bound.json` and `lower_bound.md` to `--out`, the measurements to a store there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from calibration import PUBLIC_SHAPES, write_synthetic_tasks

from shard_ray.arguments import Parser
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import ShardRayError
from shard_ray.io import write_json
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.plan import Plan, load_plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import connect_ray
from shard_ray.workflows.comparison import plan_with_algorithms, ratio_interval
from shard_ray.workflows.refinement import measured_device_costs
from shard_ray.workflows.settings import BenchmarkConfig
from shard_ray.workload.tables import TableSpec, load_tables

SEARCHES = ("cost_search", "dreamshard")
# The comparison procedure's two-sided 95% intervals.
ALPHA = 0.05
BASELINES = ("torchrec", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "round_robin", "random")


@dataclass(frozen=True)
class LowerBoundBenchmark:
    out: str = setting("experiments/results/lower_bound", "folder of the results and the store", new_folder=True)
    tables: tuple[str, ...] = setting(PUBLIC_SHAPES, "table files, comma-separated", repeat=True)
    tasks: int = setting(1, "synthetic test tasks of 26 to 40 tables", min=0)
    devices: int = setting(2, "devices of each plan", min=2)
    memory_headroom: float = setting(1.5, "memory cap over an even split of a task's bytes", min=1)
    rounds: int = setting(7, "rounds, each measuring every shard with new batches", min=3)
    splits: int = setting(16, "random assignments of the tables to the devices measured beside the plans", min=0)
    batch_size: int = setting(1024, "global batch", min=1)
    plans: tuple[str, ...] = setting(
        (),
        "plan files measured beside the algorithms' (e.g. what `plan --measure --refine` wrote), each named by its "
        "file's stem; they must place every task's tables, so give them with one task's",
        repeat=True,
    )


def run_task(
    tables: list[TableSpec], config: LowerBoundBenchmark, pool: ProfilingPool, store: MeasurementStore
) -> dict[str, Any]:
    topology = Topology(
        num_devices=config.devices,
        memory_bytes=memory_cap_with_headroom(tables, config.devices, config.memory_headroom),
        batch_size=config.batch_size,
    )
    models_path = str(default_cost_model_path())
    made = plan_with_algorithms(tables, topology, pool.hardware, [*SEARCHES, *BASELINES], cost_model=models_path)
    plans = {p.algorithm: p for p in made.plans}
    for path in map(Path, config.plans):
        given = load_plan(path)
        given.check(tables)
        plans[path.stem] = given
    simulator = Simulator(CostModels.load(models_path))
    whole = [TablePiece.whole(t) for t in tables]
    rng = np.random.default_rng(0)
    splits = [
        Plan.from_assignment(whole, rng.integers(0, config.devices, len(whole)), config.devices, f"split {i}")
        for i in range(config.splits)
    ]
    layouts = [*plans.values(), *splits]
    pieces = [layout.pieces(tables) for layout in layouts]
    costs: dict[str, list[float]] = {name: [] for name in plans}
    device_computes: dict[str, list[list[float]]] = {name: [] for name in plans}
    bounds, spreads, over_extremes, fused_over_apart = [], [], [], []
    for r in range(config.rounds):
        measure = MeasureConfig.for_topology(topology, seed=r)
        shards = [[p] for p in whole] + [whole] + [shard for layout in pieces for shard in layout if shard]
        measured = iter(pool.measure(shards, measure, store, progress=False))
        apart = sum(next(measured).compute_ms for _ in whole)
        fused = next(measured).compute_ms
        computes = [[next(measured).compute_ms if shard else 0.0 for shard in layout] for layout in pieces]
        device_costs = [
            measured_device_costs(simulator, layout, tables, topology.batch_size, dict(enumerate(compute)))
            for layout, compute in zip(layouts, computes)
        ]
        bounds.append(min(float(c.mean()) for c in device_costs))
        totals = [sum(c) for c in computes]
        spreads.append(max(totals) / min(totals))
        over_extremes.append(min(totals) / min(fused, apart))
        fused_over_apart.append(fused / apart)
        for name, compute, cost in zip(plans, computes, device_costs):
            device_computes[name].append(compute)
            costs[name].append(float(cost.max()))
        print(
            f"round {r + 1}/{config.rounds}: bound {bounds[-1]:.2f} ms; "
            + ", ".join(f"{n} {c[-1]:.2f}" for n, c in costs.items()),
            flush=True,
        )
    best = min((n for n in BASELINES if n in costs), key=lambda n: float(np.median(costs[n])))

    def ratio(over: list[float], under: list[float]) -> dict[str, Any]:
        return ratio_interval(over, under, ALPHA).model_dump()

    return {
        "tables": len(tables),
        "memory_gb": topology.memory_gb,
        "failures": made.failures,
        "median_ms": {n: float(np.median(c)) for n, c in costs.items()},
        "bound_ms": float(np.median(bounds)),
        "total_compute_spread": float(np.median(spreads)),
        "least_total_over_cheaper_extreme": float(np.median(over_extremes)),
        "fused_over_apart": float(np.median(fused_over_apart)),
        "best_baseline": best,
        "best_baseline_over_bound": ratio(costs[best], bounds),
        "device_compute_ms": {n: np.median(c, axis=0).tolist() for n, c in device_computes.items()},
        "device_comm_ms": {
            n: [
                d.input_dist_ms + d.fwd_comm_ms + d.bwd_comm_ms
                for d in simulator.plan_cost(p, tables, topology.batch_size).devices
            ]
            for n, p in plans.items()
        },
        "over_best_baseline": {n: ratio(costs[n], costs[best]) for n in costs if n not in BASELINES},
        "rounds": {"bound": bounds, **costs},
    }


def markdown(results: dict[str, dict[str, Any]], devices: int) -> str:
    def shown(r: dict[str, Any]) -> str:
        return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"

    lines = [
        f"| task ({devices} devices) | bound ms | best baseline ms | best baseline over the bound [95% CI] | "
        "cost_search over the best baseline | dreamshard over the best baseline | total compute spread | "
        "least total over the cheaper extreme |",
        "|---|---:|---|---|---|---|---:|---:|",
    ]
    for name, r in results.items():
        searches = [shown(r["over_best_baseline"][n]) if n in r["over_best_baseline"] else "no plan" for n in SEARCHES]
        lines.append(
            f"| {name} ({r['tables']} tables) | {r['bound_ms']:.2f} | {r['median_ms'][r['best_baseline']]:.2f} "
            f"({r['best_baseline']}) | {shown(r['best_baseline_over_bound'])} | {searches[0]} | {searches[1]} | "
            f"{r['total_compute_spread']:.3f} | {r['least_total_over_cheaper_extreme']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_settings(parser, LowerBoundBenchmark)
    config = settings_from(LowerBoundBenchmark, parser.parse_args(argv))
    # the files given are read before anything is measured: a mistyped name is refused in a line, not after a task
    try:
        given = {Path(path).stem: load_tables(path) for path in config.tables}
    except ShardRayError as err:
        parser.error(f"--tables: {err}")
    try:
        for path in config.plans:
            load_plan(path)
    except ShardRayError as err:
        parser.error(f"--plans: {err}")
    out = Path(config.out)
    synthetic = BenchmarkConfig(tasks=config.tasks, min_tables=26, max_tables=40)
    tasks = {path.stem: load_tables(path) for path in write_synthetic_tasks(synthetic, out / "tasks")} | given
    connect_ray(min_cpus=min(config.devices, 2))
    results = {}
    with MeasurementStore(out / "measurements.db") as store, ProfilingPool(2) as pool:
        for name, tables in tasks.items():
            print(f"== {name}", flush=True)
            results[name] = run_task(tables, config, pool, store)
            write_json(out / "lower_bound.json", results)
    (out / "lower_bound.md").write_text(markdown(results, config.devices))
    print(markdown(results, config.devices))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
