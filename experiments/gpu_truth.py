"""Fused shards measured on a GPU with the project's own kernels, on a machine with no Ray or MLflow.

    python experiments/gpu_truth.py --out gpu-out [--seconds 360] [--files experiments/tables/*.json]
    python experiments/gpu_truth.py --out gpu-out --plans PLAN.json... [--rounds 5] [--first-round 0]
    python experiments/gpu_truth.py --report gpu-out/gpu_log.jsonl --plans PLAN.json...

A GPU machine lent for minutes may have torch and a carried fbgemm-gpu but nothing else of the stack, so
this script uses the profiling code alone (`FusedShard`, `measure_fused_shard`, the measurement store),
and measures, most wanted first, until `--seconds` are spent:

1. one-device evaluations: every table of each table file fused on the one device (a plan of one device
   has no all-to-all), at batch 1024, 8192 and 65536, with the time the CUDA kernels took beside the wall
   time the procedure measures (torch's profiler; on CPU, the wall time alone);
2. each table file's tables one by one at batch 1024: the same tables apart;
3. the microbenchmark's shards (`microbenchmark_shards`) at batch 512 to 65536;
4. random augmented shards of the training pool's tables (and of `--unseen` tables, held out), batches in turn.

With `--plans`, it measures only plans, device by device: each device's fused shard alone, every plan's devices
in a round with that round's batches, plans in a rotated order (a plan of more devices than the machine has, as
refinement measures it); `--report LOG` then prints what a log of theirs says.

It writes `gpu.db`, a measurement store (`shard-ray costmodel train --store gpu-out/gpu.db` trains models of
this hardware from it), and `gpu_log.jsonl`, one line per measurement. Figures: docs/gpu.md.
"""

from __future__ import annotations

import glob
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from shard_ray.arguments import Parser
from shard_ray.errors import ShardRayError
from shard_ray.plan.cost import median_of
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.plan import load_plan
from shard_ray.profiling.fused_shard import FusedShard, MeasureConfig, measure_fused_shard
from shard_ray.profiling.hardware import hardware_id
from shard_ray.profiling.sampling import draw_augmented_fused_shards, microbenchmark_shards
from shard_ray.profiling.store import MeasurementStore
from shard_ray.workflows.comparison import ratio_interval
from shard_ray.workload.tables import TableSpec, load_tables

EVALUATION_BATCHES = (1024, 8192, 65536)
MICROBENCHMARK_BATCHES = (512, 1024, 2048, 16384, 65536)
RANDOM_BATCHES = (512, 1024, 2048, 16384, 65536)
# The dims `shard-ray collect` draws (`shard_ray.costmodel.collect.COLLECT_DIMS`; not imported: it needs Ray).
DIMS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROFILED_STEPS = 5
# A plan file named `<stem>.<algorithm>_twin.json` is a copy of `<stem>.<algorithm>.json`: the report judges it
# against its original, an A/A check that the procedure does not separate a plan from itself.
TWIN = "_twin"


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

    def measure(
        self, label: str, pieces: list[TablePiece], batch_size: int, seed: int = 0, **extra: float
    ) -> dict | None:
        if self.over():
            return None
        started = time.monotonic()
        config = MeasureConfig(batch_size=batch_size, warmup=2, repeats=7, seed=seed)
        m = measure_fused_shard(pieces, config, self.hardware)
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


def plan_tables(path: str) -> list[TableSpec]:
    """The tables of a plan file named `<table file stem>.<algorithm>.json`: `experiments/tables/<stem>.json`'s."""
    return load_tables(f"experiments/tables/{Path(path).name.split('.')[0]}.json")


def measure_plans(run: Run, plan_files: list[str], rounds: range) -> None:
    """Each plan's devices' fused shards, one at a time on the one GPU, in interleaved rounds: every round measures
    every plan's devices with that round's batches (its seed), the plans in a rotated order. A plan file is named
    `<table file stem>.<algorithm>.json`, its tables read from `experiments/tables/<stem>.json`."""
    plans = []
    for path in plan_files:
        plan = load_plan(path)
        batch = plan.settings.batch_size if plan.settings is not None else 1024
        plans.append((Path(path).stem, plan.pieces(plan_tables(path)), batch))
    for r in rounds:
        order = plans[r % len(plans) :] + plans[: r % len(plans)]
        for name, held, batch in order:
            for device, pieces in enumerate(held):
                if pieces and run.measure(f"plan:{name}:{device}", pieces, batch, seed=r, round=r) is None:
                    return
        print(f"round {r}: {len(plans)} plans measured device by device", flush=True)


def report_plans(log: Path, plan_files: list[str]) -> None:
    """Per plan: the slowest device's median over the rounds where every device was measured, and the models'
    compute price beside the measured one device by device, as the plan file recorded it when it was made and as
    today's shipped models of its hardware price it; the Spearman correlation over the plans of today's price of
    the slowest device with the measured one; each plan over TorchRec's plan of its table file, paired by round,
    with the comparison procedure's interval (simultaneous over the file's other plans)."""
    from scipy.stats import spearmanr

    from shard_ray.costmodel.models import CostModels, shipped_models_path
    from shard_ray.costmodel.simulator import Simulator

    by_round: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    lines = gzip.decompress(log.read_bytes()).decode() if log.suffix == ".gz" else log.read_text()
    for line in lines.splitlines():
        record = json.loads(line)
        _, name, device = record["label"].split(":")
        by_round[(name, record["round"])][int(device)] = record["fwd_ms"] + record["bwd_ms"]
    slowest: dict[str, dict[int, float]] = {}
    priced: dict[str, tuple[float, float]] = {}  # the slowest device's compute price: when planned, today
    for path in plan_files:
        name, plan = Path(path).stem, load_plan(path)
        used = sorted({s.device for s in plan.shards})
        rounds = sorted(r for (n, r), devices in by_round.items() if n == name and sorted(devices) == used)
        slowest[name] = {r: max(by_round[(name, r)].values()) for r in rounds}
        measured = {d: float(np.median([by_round[(name, r)][d] for r in rounds])) for d in used}
        then = [d.fwd_compute_ms + d.bwd_compute_ms for d in plan.estimate.predicted.devices]
        simulator = Simulator(CostModels.load(shipped_models_path(plan.estimate.hardware)))
        now = [
            d.fwd_compute_ms + d.bwd_compute_ms
            for d in simulator.plan_cost(plan, plan_tables(path), plan.settings.batch_size).devices
        ]
        priced[name] = (max(then), max(now))
        over_then, over_now = ([measured[d] / price[d] for d in used] for price in (then, now))
        kinds = sorted({t.type for t in plan.tables.values()})
        print(
            f"{name}: {len(rounds)} rounds, slowest device {median_of(list(slowest[name].values())):.2f} ms; "
            f"compute priced {max(then):.2f} ms when planned (measured/priced by device "
            f"{min(over_then):.2f}-{max(over_then):.2f}), {max(now):.2f} ms by today's models "
            f"({min(over_now):.2f}-{max(over_now):.2f}); {len(used)} devices used; {', '.join(kinds)}"
        )
    names = list(slowest)
    measured_slowest = [median_of(list(slowest[n].values())) for n in names]
    then_rho, now_rho = (spearmanr([priced[n][k] for n in names], measured_slowest)[0] for k in (0, 1))
    print(
        f"the slowest device's compute price against the measured slowest device, over the {len(names)} plans: "
        f"Spearman {then_rho:.2f} when planned, {now_rho:.2f} by today's models"
    )
    for name in slowest:
        stem = name.split(".")[0]
        reference = f"{stem}.torchrec"
        others = [n for n in slowest if n.split(".")[0] == stem and n != reference and not n.endswith(TWIN)]
        if name.endswith(TWIN):  # the A/A twin: the same plan file again, judged against its original
            reference, others = name.removesuffix(TWIN), [name]
        if name == reference or reference not in slowest:
            continue
        common = sorted(set(slowest[name]) & set(slowest[reference]))
        ratio = ratio_interval(
            [slowest[name][r] for r in common], [slowest[reference][r] for r in common], 0.05 / len(others)
        )
        against = "its original (A/A)" if name.endswith(TWIN) else "TorchRec's"
        print(f"{name} / {against}, {len(common)} rounds: {ratio.describe()}{' separated' if ratio.separated else ''}")


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu.db and gpu_log.jsonl (needed unless --report)")
    parser.add_argument("--seconds", type=float, default=360.0, help="stop starting measurements after this long")
    parser.add_argument("--files", nargs="+", default=sorted(glob.glob("experiments/tables/*.json")))
    parser.add_argument("--pool", default="experiments/tables/ranking_model.json", help="tables the random shards vary")
    parser.add_argument("--unseen", default=None, help="tables for held-out random shards (none by default)")
    parser.add_argument("--shards", type=int, default=400, help="random shards of the pool at most")
    parser.add_argument("--plans", nargs="+", default=None, help="plan files to measure device by device, only them")
    parser.add_argument("--rounds", type=int, default=5, help="--plans: interleaved rounds at most")
    parser.add_argument("--first-round", type=int, default=0, help="--plans: the first round's number, its seed")
    parser.add_argument("--report", default=None, help="--plans: print what this log of theirs measured, nothing else")
    args = parser.parse_args()
    if args.plans and args.report:
        report_plans(Path(args.report), args.plans)
        return
    if args.out is None:
        parser.error("--out is required to measure")
    if args.plans:
        run = Run(Path(args.out), args.seconds)
        print(f"measuring {len(args.plans)} plans on {run.hardware} for at most {args.seconds:.0f} s", flush=True)
        measure_plans(run, args.plans, range(args.first_round, args.first_round + args.rounds))
        run.store.close()
        return
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
