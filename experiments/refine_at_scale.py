"""Refinement device by device at a scale no gang on this machine holds: 64 devices on 2 cores.

    OMP_NUM_THREADS=1 python experiments/refine_at_scale.py --tables experiments/tables/mlperf_dlrm_dcnv2.json \\
        --devices 64 --out experiments/results/refine_at_scale
    OMP_NUM_THREADS=1 python experiments/lower_bound.py --devices 64 --tasks 0 --splits 0 \\
        --tables experiments/tables/mlperf_dlrm_dcnv2.json --plans OUT/cost_search.json,OUT/refined.json

`--algo`'s plan (cost_search's by default, the shipped models, memory cap `--memory-headroom` over an even split, as
`experiments/lower_bound.py` plans) is refined with moves measured on the 2 profiling actors
(`shard_ray.workflows.refinement`: each device's fused shard measured, all-to-alls priced, a move kept when the
slowest device it changes comes down by more than the floor): a step at 64 devices costs the changed devices'
shard measurements, not a gang of 64. The confirmation is `experiments/lower_bound.py --plans`, which measures the
written plans beside every algorithm's in interleaved rounds on new batches. Writes the plan before and after, and
the refinement's lines, to `--out`; the measurements to a store there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.plan.plan import save_plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import connect_ray
from shard_ray.workflows.comparison import plan_with_algorithms
from shard_ray.workflows.refinement import RefineConfig, refine
from shard_ray.workload.tables import load_tables


@dataclass(frozen=True)
class RefineAtScale:
    tables: str = setting("experiments/tables/mlperf_dlrm_dcnv2.json", "table file")
    devices: int = setting(64, "devices of the plan", min=2)
    algo: str = setting("cost_search", "the algorithm whose plan is refined")
    memory_headroom: float = setting(1.5, "memory cap over an even split of the tables' bytes", min=1)
    batch_size: int = setting(1024, "global batch", min=1)
    refine_steps: int = setting(12, "refinement: most moves kept", min=1)
    out: str = setting("experiments/results/refine_at_scale", "folder of the plans, the lines and the store")


def main(argv: list[str]) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_settings(parser, RefineAtScale)
    config = settings_from(RefineAtScale, parser.parse_args(argv))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = load_tables(config.tables)
    topology = Topology(
        num_devices=config.devices,
        memory_bytes=memory_cap_with_headroom(tables, config.devices, config.memory_headroom),
        batch_size=config.batch_size,
    )
    connect_ray(min_cpus=2)
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with MeasurementStore(out / "measurements.db") as store, ProfilingPool(2) as pool:
        models_path = str(default_cost_model_path())
        (plan,) = plan_with_algorithms(tables, topology, pool.hardware, [config.algo], cost_model=models_path).plans
        save_plan(out / f"{config.algo}.json", plan)
        refined = refine(
            plan,
            tables,
            topology,
            CostModels.load(models_path),
            pool,
            store,
            MeasureConfig.for_topology(topology),
            RefineConfig(refine=True, refine_steps=config.refine_steps),
            log,
        )
    save_plan(out / "refined.json", refined.plan.model_copy(update={"algorithm": "refined"}))
    log(
        f"{len(refined.moves)} move(s) kept, {refined.measured_shards} shard(s) measured: measured plan cost "
        f"{refined.before_ms:.2f} -> {refined.after_ms:.2f} ms"
    )
    (out / "refinement.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
