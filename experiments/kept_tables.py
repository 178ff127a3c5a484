"""Fresh tables for every shard against tables kept from shard to shard: what a profiling actor's measurements carry.

    python experiments/kept_tables.py --tables shard-ray-out/tables.json --store shard-ray-out/measurements.db

Measures again every shard of the store that is of these tables (a calibration's: the candidates' shards, each
table alone, drawn shards) and the microbenchmark's, both ways on two actors each, one way at a time, blocks of 8
shards interleaved (fresh, kept, kept, fresh, ...), on new batches (--seed). Per way: the shards' median ms, and the
MAPE at which a spine fitted to the microbenchmark's shards and four fifths of the task's prices the other fifth
(5 folds, the correction off: what a single measurement lets a fit learn). Then each shard's fresh / kept ratio.
Prints its lines; writes nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import ray
import torch

from shard_ray.arguments import Parser
from shard_ray.costmodel.models import CostModels, shipped_models_path
from shard_ray.costmodel.spine import fit_spine
from shard_ray.costmodel.train import compute_data, is_microbenchmark, step_compute_ms
from shard_ray.profiling.actors import resources_per_device
from shard_ray.profiling.fused_shard import HostBuffers, measure_fused_shard, memory_budget
from shard_ray.profiling.hardware import hardware_id, measurement_device
from shard_ray.profiling.procedure import FusedShardMeasurement, MeasureConfig
from shard_ray.profiling.store import MeasurementStore
from shard_ray.workload.tables import load_tables

BLOCK = 8


@ray.remote
class Measurer:
    """A profiling actor's measurement, its tables kept from shard to shard or allocated afresh."""

    def __init__(self, keep: bool) -> None:
        torch.set_num_threads(1)
        self.buffers = HostBuffers() if keep else None
        self.budget = memory_budget(measurement_device(), 2)  # as two actors measure: one way at a time

    def measure(self, pieces: list, config: MeasureConfig) -> FusedShardMeasurement:
        return measure_fused_shard(pieces, config, "", self.budget, self.buffers)


def spine_error(measured: list[FusedShardMeasurement], models: CostModels) -> float:
    """MAPE of a spine (correction off) fitted to the microbenchmark's shards and 4/5 of the rest, on the other 1/5."""
    micro = [m for m in measured if is_microbenchmark(m)]
    task = [m for m in measured if not is_microbenchmark(m)]
    folds = np.random.default_rng(0).permutation(len(task)) % 5
    alone = models.compute.network().without_correction()
    errors: list[float] = []
    for fold in range(5):
        data = compute_data(micro + [m for m, f in zip(task, folds) if f != fold])
        model = copy.deepcopy(alone)
        model.spine.set(fit_spine(data.features, data.mask, data.log_batch, data.log_ms, data.replicas))
        predicted, actual = step_compute_ms(model, compute_data([m for m, f in zip(task, folds) if f == fold]))
        errors += list(np.abs(predicted / actual - 1))
    return float(np.mean(errors))


def main() -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=Path, required=True, help="the calibration's table file")
    parser.add_argument("--store", type=Path, required=True, help="the calibration's measurement store")
    parser.add_argument("--seed", type=int, default=7, help="the batches' seed (the store's shards were on 0)")
    args = parser.parse_args()
    tables = {t.name: t for t in load_tables(args.tables)}
    hardware = hardware_id(threads=1)
    stored = [
        m
        for m in MeasurementStore(args.store).fused_shard_measurements(hardware)
        if m.status == "ok" and (is_microbenchmark(m) or all(tables.get(p.table.name) == p.table for p in m.tables))
    ]
    config = stored[0].config.model_copy(update={"seed": args.seed})
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        options = resources_per_device(use_gpus=False)
        actors = {
            way: [Measurer.options(**options).remote(way == "kept") for _ in range(2)] for way in ("fresh", "kept")
        }
        measured: dict[str, list[FusedShardMeasurement]] = {"fresh": [], "kept": []}
        for start in range(0, len(stored), BLOCK):
            block = stored[start : start + BLOCK]
            for way in ("fresh", "kept") if start // BLOCK % 2 == 0 else ("kept", "fresh"):
                pair = actors[way]
                measured[way] += ray.get([pair[i % 2].measure.remote(m.tables, config) for i, m in enumerate(block)])
    finally:
        ray.shutdown()
    models = CostModels.load(shipped_models_path(hardware))
    for way, shards in measured.items():
        ok = [m for m in shards if m.status == "ok"]
        total = np.array([m.fwd_ms + m.bwd_ms for m in ok])
        print(
            f"{way}: {len(ok)} shards, median {np.median(total):.2f} ms; a spine fitted to 4/5 prices the other 1/5 at "
            f"MAPE {spine_error(ok, models):.1%}"
        )
    ratios = np.array(
        [
            (a.fwd_ms + a.bwd_ms) / (b.fwd_ms + b.bwd_ms)
            for a, b in zip(measured["fresh"], measured["kept"])
            if a.status == b.status == "ok"
        ]
    )
    low, high = np.percentile(ratios, [10, 90])
    print(f"fresh / kept per shard: median {np.median(ratios):.3f}, 10th-90th percentile {low:.2f}-{high:.2f}")


if __name__ == "__main__":
    main()
