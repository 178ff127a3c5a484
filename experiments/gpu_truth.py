"""Fused shards measured on a GPU with the project's own kernels, on a machine with no Ray or MLflow.

    python experiments/gpu_truth.py --out gpu-out [--seconds 360] [--files experiments/tables/*.json]

A GPU machine lent for minutes may have torch and a carried fbgemm-gpu but nothing else of the stack, so
this script uses the profiling code alone (`FusedShard`, `measure_fused_shard`, the measurement store),
and measures, most wanted first, until `--seconds` are spent:

1. one-device evaluations: every table of each table file fused on the one device (a plan of one device
   has no all-to-all), at batch 1024, 8192 and 65536, with the time the CUDA kernels took beside the wall
   time the procedure measures (torch's profiler; on CPU, the wall time alone);
2. each table file's tables one by one at batch 1024: the same tables apart;
3. the microbenchmark's shards (`microbenchmark_shards`) at batch 512 to 65536;
4. random augmented shards of the training pool's tables (and of `--unseen` tables, held out), batches in turn.

It writes `gpu.db`, a measurement store (`shard-ray costmodel train --store gpu-out/gpu.db` trains models of
this hardware from it), and `gpu_log.jsonl`, one line per measurement. Figures: docs/gpu.md.
"""

from __future__ import annotations

import glob
import json
import sys
import time
from pathlib import Path

import torch

from shard_ray.arguments import Parser
from shard_ray.errors import ShardRayError
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.fused_shard import FusedShard, MeasureConfig, measure_fused_shard
from shard_ray.profiling.hardware import hardware_id
from shard_ray.profiling.sampling import draw_augmented_fused_shards, microbenchmark_shards
from shard_ray.profiling.store import MeasurementStore
from shard_ray.workload.tables import load_tables

EVALUATION_BATCHES = (1024, 8192, 65536)
MICROBENCHMARK_BATCHES = (512, 1024, 2048, 16384, 65536)
RANDOM_BATCHES = (512, 1024, 2048, 16384, 65536)
# The dims `shard-ray collect` draws (`shard_ray.costmodel.collect.COLLECT_DIMS`; not imported: it needs Ray).
DIMS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROFILED_STEPS = 5


def kernel_time(pieces: list[TablePiece], batch_size: int) -> dict[str, float]:
    """Per forward + backward step of the fused shard, after warm-up: the CUDA kernels' summed time and how many
    ran (torch's profiler), beside the wall time of the same steps (inflated by the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    shard = FusedShard(pieces, MeasureConfig(batch_size=batch_size, repeats=PROFILED_STEPS, seed=0))
    grads = (torch.randn(batch_size, shard.width, device=shard.device), torch.zeros(0, 0, device=shard.device))
    for batch in range(PROFILED_STEPS, len(shard.batches)):
        shard.backward(shard.forward(batch), grads)
    shard.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        start = time.perf_counter()
        for batch in range(PROFILED_STEPS):
            shard.backward(shard.forward(batch), grads)
        shard.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / PROFILED_STEPS
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "profiled_wall_ms": wall_ms,
        "kernel_ms": sum(e.device_time for e in kernels) / 1e3 / PROFILED_STEPS,
        "kernels_per_step": len(kernels) / PROFILED_STEPS,
    }


class Run:
    """Measures into one store and one log until the time is spent."""

    def __init__(self, out: Path, seconds: float) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.store = MeasurementStore(out / "gpu.db")
        self.log = (out / "gpu_log.jsonl").open("a")
        self.hardware = hardware_id()
        self.deadline = time.monotonic() + seconds

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def measure(self, label: str, pieces: list[TablePiece], batch_size: int, **extra: float) -> dict | None:
        if self.over():
            return None
        started = time.monotonic()
        m = measure_fused_shard(pieces, MeasureConfig(batch_size=batch_size, warmup=2, repeats=7), self.hardware)
        self.store.put_fused_shard(m)
        record = {
            "label": label,
            "tables": len(pieces),
            "batch": batch_size,
            "fwd_ms": m.fwd_ms,
            "bwd_ms": m.bwd_ms,
            "reason": m.reason,
            "rows_cap": m.rows_cap,
            "seconds": round(time.monotonic() - started, 2),
            **extra,
        }
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        return record


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu.db and gpu_log.jsonl")
    parser.add_argument("--seconds", type=float, default=360.0, help="stop starting measurements after this long")
    parser.add_argument("--files", nargs="+", default=sorted(glob.glob("experiments/tables/*.json")))
    parser.add_argument("--pool", default="experiments/tables/ranking_model.json", help="tables the random shards vary")
    parser.add_argument("--unseen", default=None, help="tables for held-out random shards (none by default)")
    parser.add_argument("--shards", type=int, default=400, help="random shards of the pool at most")
    args = parser.parse_args()
    files = {Path(f).name: [TablePiece.whole(t) for t in load_tables(f)] for f in args.files}
    seen = draw_augmented_fused_shards(load_tables(args.pool), args.shards, 16, DIMS, seed=0)
    unseen = draw_augmented_fused_shards(load_tables(args.unseen), args.shards, 16, DIMS, seed=1) if args.unseen else []
    run = Run(Path(args.out), args.seconds)
    on_gpu = torch.cuda.is_available()
    print(f"measuring on {run.hardware} for at most {args.seconds:.0f} s", flush=True)
    for batch_size in EVALUATION_BATCHES:
        for name, pieces in files.items():
            split = kernel_time(pieces, batch_size) if on_gpu and not run.over() else {}
            record = run.measure(f"file:{name}", pieces, batch_size, **split)
            if record:
                print(json.dumps(record), flush=True)
    for name, pieces in files.items():
        for piece in pieces:
            run.measure(f"single:{name}:{piece.table.name}", [piece], 1024)
    for batch_size in MICROBENCHMARK_BATCHES:
        for i, shard in enumerate(microbenchmark_shards()):
            run.measure(f"micro:{i}", shard, batch_size)
        print(f"microbenchmark at batch {batch_size} measured", flush=True)
    for i, shard in enumerate(seen):
        if run.measure(f"seen:{i}", shard, RANDOM_BATCHES[i % len(RANDOM_BATCHES)]) is None:
            break
        if i < len(unseen) and i % 2 == 0:
            run.measure(f"unseen:{i}", unseen[i], RANDOM_BATCHES[i // 2 % len(RANDOM_BATCHES)])
    print(f"{run.store.count()} measurements in {args.out}/gpu.db", flush=True)
    run.store.close()


if __name__ == "__main__":
    try:
        main()
    except ShardRayError as err:
        print(f"gpu_truth: error: {err}", file=sys.stderr)
        sys.exit(2)
