"""Record how fusing tables costs on this hardware: real fused shards of one set of tables, alone and together.

    python experiments/fusion_measurements.py [--out tests/data/fusion_shards.json] [--shards 48] [--seed 0]

Twenty of the synthetic pool's tables in fp16 (where the CPU kernels' fused backward costs most
over running its tables apart, docs/results.md: Cost-model accuracy) are measured on one profiling actor,
each alone and in random fused shards of 2 to 20 of them, plus all 20 together, at batch 512.
The measurements (`FusedShardMeasurement`s, as the store keeps them) are written as JSON: the test
suite fits the compute model to them (`tests/test_costmodel.py`), so it checks the model learns
the fusion this hardware measured, with no hardware of its own. The run prints the fused against
the apart cost of the full shard, per phase.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_file_to_write
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import connect_ray
from shard_ray.workload.synthetic import PoolConfig, generate_pool

NUM_TABLES = 20


def fusion_shards(num_shards: int, seed: int) -> list[list[TablePiece]]:
    """Every table alone, `num_shards` random shards of 2 to 20 of them, and all of them together."""
    tables = [
        t.model_copy(update={"precision": "fp16"}) for t in generate_pool(PoolConfig(num_tables=NUM_TABLES, seed=seed))
    ]
    pieces = [TablePiece.whole(t) for t in tables]
    rng = np.random.default_rng(seed)
    drawn = [
        [pieces[i] for i in sorted(rng.choice(NUM_TABLES, size=int(rng.integers(2, NUM_TABLES + 1)), replace=False))]
        for _ in range(num_shards)
    ]
    return [[p] for p in pieces] + drawn + [pieces]


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=a_file_to_write, default="tests/data/fusion_shards.json")
    parser.add_argument(
        "--shards", type=int, default=48, help="random fused shards besides the singles and the whole set"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shards = fusion_shards(args.shards, args.seed)
    config = MeasureConfig(batch_size=512, seed=args.seed)
    connect_ray()
    with tempfile.TemporaryDirectory() as scratch, MeasurementStore(Path(scratch) / "fusion.db") as store:
        with ProfilingPool(1) as pool:
            measured = pool.measure(shards, config, store)
    failed = [m for m in measured if m.status != "ok"]
    if failed:
        raise SystemExit(f"{len(failed)} shards could not be measured: {failed[0].reason}")
    singles, whole = measured[:NUM_TABLES], measured[-1]
    for phase in ("fwd_ms", "bwd_ms"):
        apart = sum(getattr(m, phase) for m in singles)
        print(f"{phase[:3]}: all {NUM_TABLES} fused {getattr(whole, phase):.2f} ms, apart {apart:.2f} ms")
    Path(args.out).write_text(json.dumps([m.model_dump(mode="json") for m in measured]) + "\n")
    print(f"wrote {len(measured)} measurements on {whole.hardware} to {args.out}")


if __name__ == "__main__":
    main()
