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
refinement measures it); `--report LOG` then prints what a log of theirs says. With `--training-step` as well, each
device's shard is also run inside a DLRM training step (`TrainingStep`: MLPerf DLRM's MLPs on the device's share of
the batch, no all-to-all) and the step is timed with and without it: what the embedding part adds to a step where
the host launches ahead of the GPU, beside what the procedure measures.

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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.errors import ShardRayError, first_line
from shard_ray.plan.cost import median_of
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.plan import load_plan
from shard_ray.profiling.fused_shard import FusedShard, measure_fused_shard, time_fused_shard
from shard_ray.profiling.hardware import hardware_id
from shard_ray.profiling.procedure import MeasureConfig
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


# MLPerf DLRM's dense part (its reference model for Criteo Terabyte): 13 dense features, a bottom MLP to 128, a top MLP
# over the bottom's output beside every table's pooled embedding.
DENSE_FEATURES = 13
BOTTOM_MLP = (512, 256, 128)
TOP_MLP = (1024, 1024, 512, 256, 1)
# Steps run back to back between two synchronizations, as training runs them: the host launches ahead of the GPU.
STEPS_PER_TIMING = 10
TIMINGS = 5


def mlp(widths: tuple[int, ...], width_in: int, device: torch.device) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for width in widths:
        layers += [torch.nn.Linear(width_in, width), torch.nn.ReLU()]
        width_in = width
    return torch.nn.Sequential(*layers[:-1]).to(device)


class TrainingStep:
    """One device's DLRM training step without its all-to-alls: the bottom MLP on the device's own samples (the
    global batch over `devices`), the fused shard's forward over the global batch, the top MLP on the bottom's output
    beside the pooled embeddings of the device's samples (its own columns, then a fixed tensor for the columns other
    devices' tables would send), a logistic loss, backward (the shard's optimizer fused into it), Adagrad on the dense
    part and the replicas' update. `embeddings=False` runs the same step with zeros for the device's own columns and
    no embedding kernel: the dense part alone."""

    def __init__(self, shard: FusedShard, devices: int, plan_width: int, dense_bf16: bool = False) -> None:
        self.shard = shard
        self.dense_bf16 = dense_bf16 and shard.device.type == "cuda"
        device = shard.device
        self.local = shard.config.batch_size // devices
        own = shard.width + shard.replicated_width
        self.bottom = mlp(BOTTOM_MLP, DENSE_FEATURES, device)
        self.top = mlp(TOP_MLP, BOTTOM_MLP[-1] + plan_width, device)
        parameters = list(self.bottom.parameters()) + list(self.top.parameters())
        self.optimizer = torch.optim.Adagrad(parameters, lr=0.01)
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(self.local, DENSE_FEATURES, generator=generator).to(device)
        self.labels = torch.randint(0, 2, (self.local, 1), generator=generator).float().to(device)
        self.others = torch.randn(self.local, plan_width - own, generator=generator).to(device)
        self.zeros = torch.zeros(self.local, own, device=device)

    def run(self, batch: int, embeddings: bool) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.dense_bf16):
            bottom = self.bottom(self.features)
        if embeddings:
            sharded, replicated = self.shard.forward(batch)
            own = torch.cat(
                [sharded[: self.local], replicated[: self.local]] if replicated.shape[1] else [sharded[: self.local]],
                dim=1,
            )
        else:
            own = self.zeros
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.dense_bf16):
            logits = self.top(torch.cat([bottom.float(), own, self.others], dim=1))
        torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), self.labels).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if embeddings:
            self.shard.update_replicas()

    def time_ms(self, embeddings: bool) -> float:
        """A step's ms (`back_to_back_ms`), with the embedding part or the dense part alone."""
        return back_to_back_ms(self.shard, lambda batch: self.run(batch, embeddings))

    def embeddings_back_to_back_ms(self) -> float:
        """The fused shard's forward and backward alone, back to back as `time_ms` runs steps."""
        shard = self.shard
        grads = (
            torch.randn(shard.config.batch_size, shard.width, device=shard.device),
            torch.randn(shard.samples[1] - shard.samples[0], shard.replicated_width, device=shard.device),
        )

        def embeddings_only(batch: int) -> None:
            shard.backward(shard.forward(batch), grads)
            shard.update_replicas()

        return back_to_back_ms(shard, embeddings_only)


def back_to_back_ms(shard: FusedShard, step: Callable[[int], None]) -> float:
    """`step`'s ms: 3 untimed steps, then the fastest of TIMINGS runs of STEPS_PER_TIMING steps back to back between
    two synchronizations, each step on the shard's next prepared batch."""
    batches = len(shard.batches)
    for batch in range(3):
        step(batch % batches)
    best = float("inf")
    for timing in range(TIMINGS):
        shard.synchronize()
        start = time.perf_counter()
        for k in range(STEPS_PER_TIMING):
            step((timing * STEPS_PER_TIMING + k) % batches)
        shard.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3 / STEPS_PER_TIMING)
    return best


def measure_training_step(
    run: Run,
    label: str,
    pieces: list[TablePiece],
    batch: int,
    devices: int,
    plan_width: int,
    seed: int,
    dense_bf16: bool = False,
    **extra: float,
) -> dict | None:
    """A device's shard by the procedure (synchronized around forward and backward) and inside `TrainingStep`."""
    if run.over():
        return None
    started = time.monotonic()
    config = MeasureConfig(batch_size=batch, warmup=2, repeats=7, seed=seed)
    shard: FusedShard | None = None  # freed before the next device's, on the GPU too
    step: TrainingStep | None = None
    try:
        shard = FusedShard(pieces, config)
        procedure = time_fused_shard(shard)
        step = TrainingStep(shard, devices, plan_width, dense_bf16)
        record = {
            "fwd_ms": procedure.fwd_ms,
            "bwd_ms": procedure.bwd_ms,
            "back_to_back_ms": step.embeddings_back_to_back_ms(),
            "dense_step_ms": step.time_ms(embeddings=False),
            "step_ms": step.time_ms(embeddings=True),
        }
    except (RuntimeError, MemoryError, ShardRayError) as err:
        record = {"reason": f"{type(err).__name__}: {first_line(err)}"}
    record = {
        "label": label,
        "tables": len(pieces),
        "batch": batch,
        "dense": "bf16" if dense_bf16 and torch.cuda.is_available() else "fp32",
        **record,
        "seconds": round(time.monotonic() - started, 2),
        **extra,
    }
    run.log.write(json.dumps(record) + "\n")
    run.log.flush()
    shard = step = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


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


def measure_plans(
    run: Run, plan_files: list[str], rounds: range, training_step: bool = False, dense_bf16: bool = False
) -> None:
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
            plan_width = sum(t.dim for t in plan_tables(f"{name}.json"))
            for device, pieces in enumerate(held):
                if not pieces:
                    continue
                label = f"plan:{name}:{device}"
                if training_step:
                    measured = measure_training_step(
                        run, label, pieces, batch, len(held), plan_width, r, dense_bf16, round=r
                    )
                else:
                    measured = run.measure(label, pieces, batch, seed=r, round=r)
                if measured is None:
                    return
        print(f"round {r}: {len(plans)} plans measured device by device", flush=True)


def read_log(log: Path) -> list[dict]:
    lines = gzip.decompress(log.read_bytes()).decode() if log.suffix == ".gz" else log.read_text()
    return [json.loads(line) for line in lines.splitlines()]


def report_training_steps(records: list[dict]) -> None:
    """Per plan of a `--training-step` log: the slowest device by the procedure and inside the training step, the
    dense part alone, and what the embedding part adds to the step over what the procedure measures, device by
    device; then each plan over TorchRec's plan of its file by both measures, paired by round, with the comparison
    procedure's interval (simultaneous over the file's other plans)."""
    by_plan: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for record in records:
        _, name, device = record["label"].split(":")
        by_plan[name][record["round"]][int(device)] = record
    devices = {name: max(len(d) for d in rounds.values()) for name, rounds in by_plan.items()}
    slowest: dict[str, dict[str, dict[int, float]]] = {}
    for name, rounds in by_plan.items():
        whole = {r: d for r, d in rounds.items() if len(d) == devices[name]}
        slowest[name] = {
            measure: {r: max(pick(x) for x in d.values()) for r, d in whole.items()}
            for measure, pick in (
                ("procedure", lambda x: x["fwd_ms"] + x["bwd_ms"]),
                ("step", lambda x: x["step_ms"]),
            )
        }
        every = [x for d in whole.values() for x in d.values()]
        added = [(x["step_ms"] - x["dense_step_ms"]) / (x["fwd_ms"] + x["bwd_ms"]) for x in every]
        quartiles = np.percentile(added, [25, 50, 75])
        print(
            f"{name}: {len(whole)} rounds, {every[0].get('dense', 'fp32')} dense part; slowest device "
            f"{median_of(list(slowest[name]['procedure'].values())):.2f} ms by the procedure, its step "
            f"{median_of(list(slowest[name]['step'].values())):.2f} ms (the dense part alone "
            f"{median_of([x['dense_step_ms'] for x in every]):.2f}); the embedding part adds to a step "
            f"{quartiles[1]:.2f}x what the procedure measures (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f} "
            f"over {len(every)} device measurements)"
        )
    for name in slowest:
        stem = name.split(".")[0]
        reference = f"{stem}.torchrec"
        others = [n for n in slowest if n.split(".")[0] == stem and n != reference]
        if name == reference or reference not in slowest:
            continue
        for measure in ("procedure", "step"):
            common = sorted(set(slowest[name][measure]) & set(slowest[reference][measure]))
            ratio = ratio_interval(
                [slowest[name][measure][r] for r in common],
                [slowest[reference][measure][r] for r in common],
                0.05 / len(others),
            )
            print(
                f"{name} / TorchRec's, {measure}, {len(common)} rounds: "
                f"{ratio.describe()}{' separated' if ratio.separated else ''}"
            )


def report_plans(log: Path, plan_files: list[str]) -> None:
    """Per plan: the slowest device's median over the rounds where every device was measured, and the models'
    compute price beside the measured one device by device, as the plan file recorded it when it was made and as
    today's shipped models of its hardware price it; the Spearman correlation over the plans of today's price of
    the slowest device with the measured one; each plan over TorchRec's plan of its table file, paired by round,
    with the comparison procedure's interval (simultaneous over the file's other plans)."""
    from scipy.stats import spearmanr

    from shard_ray.costmodel.models import CostModels, shipped_models_path
    from shard_ray.costmodel.simulator import Simulator

    records = read_log(log)
    if records and "step_ms" in records[0]:
        report_training_steps(records)
        return
    by_round: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for record in records:
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
        # to the microsecond: two plans whose slowest devices hold the same pieces tie, whatever the CPU's last bits
        priced[name] = (round(max(then), 3), round(max(now), 3))
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
    parser.add_argument(
        "--out", type=a_folder_to_write, help="folder for gpu.db and gpu_log.jsonl (needed unless --report)"
    )
    parser.add_argument("--seconds", type=float, default=360.0, help="stop starting measurements after this long")
    parser.add_argument("--files", nargs="+", default=sorted(glob.glob("experiments/tables/*.json")))
    parser.add_argument("--pool", default="experiments/tables/ranking_model.json", help="tables the random shards vary")
    parser.add_argument("--unseen", default=None, help="tables for held-out random shards (none by default)")
    parser.add_argument("--shards", type=int, default=400, help="random shards of the pool at most")
    parser.add_argument("--plans", nargs="+", default=None, help="plan files to measure device by device, only them")
    parser.add_argument("--rounds", type=int, default=5, help="--plans: interleaved rounds at most")
    parser.add_argument("--first-round", type=int, default=0, help="--plans: the first round's number, its seed")
    parser.add_argument("--training-step", action="store_true", help="--plans: each device also inside a DLRM step")
    parser.add_argument("--dense-bf16", action="store_true", help="--training-step: the MLPs under bf16 autocast")
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
        measure_plans(
            run,
            args.plans,
            range(args.first_round, args.first_round + args.rounds),
            args.training_step,
            args.dense_bf16,
        )
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
