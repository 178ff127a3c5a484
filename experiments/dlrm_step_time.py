"""Benchmark: a small DLRM trained with TorchRec's DistributedModelParallel on shard-ray's plan and on TorchRec's.

    python experiments/dlrm_step_time.py --tables 20 --steps 150 --rounds 2

The end-to-end check users will make: the same model (an EmbeddingBagCollection of a test task's
tables, a bottom MLP on dense features, a top MLP on both) trained with real TorchRec on 2 gloo
ranks on CPU, once with shard-ray's plan (`--algorithm`, exported with `shard-ray export`) and
once with TorchRec's own planner's plan, for the same tables, memory cap and batches. Rounds
alternate the plans (A B A B ...), each round a fresh model and `--steps` timed steps after
`--warmup`; a step is forward, backward, the fused row-wise Adagrad update of the embeddings and
Adagrad on the dense part, timed on rank 0 between barriers. Reports the median step time of each
plan over all its rounds and their ratio. Writes Markdown and JSON; the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.interop.torchrec import embedding_bag_configs, export_plan, sharding_plan
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import place
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.workload.access import fold_rows, generate_table_batch
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool

DENSE_FEATURES = 13
WORLD = 2


class SmallDLRM(nn.Module):
    """DLRM's shape with tables of any width: bottom MLP on dense features, pooled embeddings, top MLP."""

    def __init__(self, collection: nn.Module, embedding_width: int) -> None:
        super().__init__()
        self.sparse = collection
        self.bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(32 + embedding_width, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: object) -> torch.Tensor:
        pooled = self.sparse(sparse).values()
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1)).squeeze(1)


def batches(tables: list[TableSpec], batch: int, count: int, seed: int) -> list[tuple]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(seed)
    made = []
    for _ in range(count):
        drawn = [fold_rows(generate_table_batch(t, batch, rng), t.rows) for t in tables]
        kjt = KeyedJaggedTensor(
            keys=[t.name for t in tables],
            values=torch.from_numpy(np.concatenate([d.indices for d in drawn])),
            lengths=torch.from_numpy(np.concatenate([d.lengths for d in drawn])),
        )
        made.append(
            (
                torch.from_numpy(rng.standard_normal((batch, DENSE_FEATURES)).astype(np.float32)),
                kjt,
                torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32)),
            )
        )
    return made


def train_rank(
    rank: int, port: int, tables: list[TableSpec], plans: dict, order: list[str], args: argparse.Namespace, times: dict
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    data = batches(tables, args.batch, 8, seed=rank)
    width = sum(t.dim for t in tables)
    loss_fn = nn.BCEWithLogitsLoss()
    try:
        for round_index, label in enumerate(order):
            torch.manual_seed(round_index)
            collection = EmbeddingBagCollection(tables=embedding_bag_configs(tables), device=torch.device("meta"))
            apply_optimizer_in_backward(RowWiseAdagrad, collection.parameters(), {"lr": 0.05})
            model = DistributedModelParallel(
                SmallDLRM(collection, width),
                device=torch.device("cpu"),
                plan=sharding_plan(plans[label]),
                sharders=[EmbeddingBagCollectionSharder()],
            )
            dense = torch.optim.Adagrad([p for n, p in model.named_parameters() if ".sparse." not in f".{n}"], lr=0.05)
            steps = []
            for step in range(args.warmup + args.steps):
                features, sparse, labels = data[step % len(data)]
                dist.barrier()
                began = time.perf_counter()
                dense.zero_grad()
                loss = loss_fn(model(features, sparse), labels)
                loss.backward()
                dense.step()
                dist.barrier()
                if step >= args.warmup:
                    steps.append((time.perf_counter() - began) * 1e3)
            if rank == 0:
                times[f"{round_index}:{label}"] = steps
                print(
                    f"round {round_index + 1}/{len(order)} ({label}): median step {statistics.median(steps):.2f} ms, last loss {loss.item():.4f}",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=20, help="tables in the task (default %(default)s)")
    parser.add_argument(
        "--max-rows", type=int, default=100_000, help="rows per table at most, to fit CPU memory (default %(default)s)"
    )
    parser.add_argument("--batch", type=int, default=512, help="samples per rank and step (default %(default)s)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per round (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per plan, alternating (default %(default)s)")
    parser.add_argument("--memory-headroom", type=float, default=1.5)
    parser.add_argument("--algorithm", default="cost_search", help="shard-ray's algorithm (default %(default)s)")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/dlrm_step_time")
    args = parser.parse_args()

    _, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    drawn = draw_task(
        test_pool, TaskConfig(min_tables=args.tables, max_tables=args.tables, seed=0), np.random.default_rng(args.seed)
    )
    tables = [t.model_copy(update={"rows": min(t.rows, args.max_rows)}) for t in drawn]
    topology = Topology(
        num_devices=WORLD,
        memory_bytes=memory_cap_with_headroom(tables, WORLD, args.memory_headroom),
        batch_size=args.batch * WORLD,
    )
    plans = {}
    for label, algorithm in ((f"shard-ray {args.algorithm}", args.algorithm), ("torchrec planner", "torchrec")):
        plan = place(algorithm, tables, topology)
        plans[label] = export_plan(plan, tables, module_path="sparse", device_type="cpu")
        split = sum(1 for t in plans[label].tables.values() if t.sharding_type == "column_wise")
        print(
            f"{label}: {len(plan.shards)} shards, {split} tables column-wise, placed in {plan.placement_seconds * 1e3:.0f} ms",
            flush=True,
        )
    order = [label for _ in range(args.rounds) for label in plans]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    times = mp.Manager().dict()
    mp.spawn(train_rank, args=(port, tables, plans, order, args, times), nprocs=WORLD, join=True)

    medians = {
        label: statistics.median([t for key, steps in times.items() if key.endswith(label) for t in steps])
        for label in plans
    }
    ours, theirs = medians[f"shard-ray {args.algorithm}"], medians["torchrec planner"]
    lines = [
        f"Small DLRM, {len(tables)} test-pool tables (rows capped at {args.max_rows}), {WORLD} gloo ranks on CPU, batch {args.batch} per rank, "
        f"memory cap {args.memory_headroom}x an even split; {args.rounds} alternating rounds of {args.steps} timed steps per plan.",
        "",
        "| plan | median step (ms) |",
        "|---|---:|",
        *(f"| {label} | {value:.2f} |" for label, value in medians.items()),
        "",
        f"TorchRec's plan over shard-ray's: {theirs / ours:.3f}x step time.",
    ]
    out = Path(args.out)
    write_atomic(out / "dlrm_step_time.md", "\n".join(lines) + "\n")
    write_json(
        out / "dlrm_step_time.json",
        {
            "settings": vars(args),
            "median_step_ms": medians,
            "steps": dict(times),
            "plans": {k: v.model_dump(mode="json") for k, v in plans.items()},
        },
    )
    print("\n".join(lines))
    print(json.dumps({"median_step_ms": medians, "torchrec_over_shard_ray": theirs / ours}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
