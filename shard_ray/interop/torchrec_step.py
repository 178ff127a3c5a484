"""One training step of an exported plan under TorchRec's DistributedModelParallel, on gloo ranks of this machine.

    shard-ray export --plan plan.json --tables my_model.json --format torchrec --device cpu --out sharding_plan.json
    python -m shard_ray.interop.torchrec_step --tables my_model.json --plan sharding_plan.json

Each rank builds the table file's EmbeddingBagCollection on the meta device, lets DistributedModelParallel shard
it by the plan (`load_sharding_plan`, as a training script does), runs a forward and a backward with SGD fused in
on random ids, and reports the shards it holds, the pooled output's shape and whether the update reached its
shards. The last line is JSON, per rank. On GPUs the same calls run under torchrun with the nccl backend; here the
ranks are CPU processes, where TorchRec runs table-wise, column-wise and data-parallel shards but not row-wise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shard_ray.arguments import Parser
from shard_ray.errors import ShardRayError
from shard_ray.interop.torchrec import check_cpu_ranks, embedding_bag_configs, load_export, load_sharding_plan
from shard_ray.plan.topology import format_gb
from shard_ray.workload.tables import BYTES_PER_ELEMENT, TableSpec, load_tables

# What a rank imports (`train_step`), imported once by the server the ranks fork from.
RANK_MODULES = [
    "torchrec.distributed.embeddingbag",
    "torchrec.distributed.model_parallel",
    "torchrec.modules.embedding_modules",
    "torchrec.optim.apply_optimizer_in_backward",
    "shard_ray.interop.torchrec",
]


def train_step(rank: int, world: int, port: int, tables_file: str, plan_file: str, batch: int, results: dict) -> None:
    """One rank: DistributedModelParallel with the exported plan, a forward and a backward with SGD fused in."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    # TorchRec's modules ask torch.fx whether they are traced, and torch warns once a rank that the answer is
    # ambiguous: nothing here traces, so the warning says nothing about the plan
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tables = load_tables(tables_file)
        collection = EmbeddingBagCollection(tables=embedding_bag_configs(tables), device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), {"lr": 0.5})
        model = DistributedModelParallel(
            collection,
            device=torch.device("cpu"),
            plan=load_sharding_plan(plan_file),
            sharders=[EmbeddingBagCollectionSharder()],
        )
        state = model.state_dict()
        local = {k: v.local_shards() for k, v in state.items() if hasattr(v, "local_shards")}
        # each shard's sum, not a copy of it: a copy of every shard would double the memory the step needs
        before = {k: [_checksum(s.tensor) for s in shards] for k, shards in local.items()}
        replicas = {k.split(".")[-2] for k, v in state.items() if not hasattr(v, "local_shards")}  # data-parallel
        pooled = model(_random_batch(tables, batch, seed=rank))
        pooled.values().sum().backward()
        after = model.state_dict()
        results[rank] = {
            "shape": list(pooled.values().shape),
            # per table, each local shard's [row offset, column offset, rows, columns]
            "local_shards": {
                k.split(".")[-2]: [list(s.metadata.shard_offsets) + list(s.metadata.shard_sizes) for s in v]
                for k, v in local.items()
            },
            # the tables whose local shards all changed: the backward reached them and SGD updated them
            "updated": sorted(
                k.split(".")[-2]
                for k in before
                if before[k] and all(b != _checksum(a.tensor) for b, a in zip(before[k], after[k].local_shards()))
            ),
            # A data-parallel table's gradient is DDP's to all-reduce and a dense optimizer's to apply.
            "replicas": {
                name.split(".")[-2]: bool(p.grad is not None and p.grad.abs().sum() > 0)
                for name, p in model.named_parameters()
                if name.split(".")[-2] in replicas
            },
        }
    finally:
        dist.destroy_process_group()


def _random_batch(tables: list[TableSpec], batch: int, seed: int) -> Any:
    """A KeyedJaggedTensor of `batch` samples: 1 to 3 uniformly drawn ids of every table a sample."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(tables) * batch,), generator=generator)
    values = torch.cat(
        [
            torch.randint(0, t.rows, (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=generator)
            for i, t in enumerate(tables)
        ]
    )
    return KeyedJaggedTensor(keys=[t.name for t in tables], values=values, lengths=lengths)


# The share of the machine's available memory the tables' weights may take: the ranks' processes (TorchRec and torch
# loaded in each) and TorchRec's buffers need the rest. A refusal naming weights below what is available read as a
# contradiction without it (a walk).
WEIGHTS_SHARE = 0.8
# Elements a checksum sums at a time (`_checksum`).
CHECKSUM_BLOCK = 1 << 22


def _checksum(tensor: torch.Tensor) -> float:
    """The tensor's sum in float64, a block of rows at a time: summed whole so, torch first copies it to float64,
    twice its bytes again (a rank holding a 50M-row table whole was killed for memory)."""
    rows = max(1, CHECKSUM_BLOCK // max(1, math.prod(tensor.shape[1:])))
    return sum(float(torch.sum(block, dtype=torch.float64)) for block in tensor.split(rows))


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tables_file: str, plan_file: str, batch: int) -> dict[int, dict[str, Any]]:
    """Every rank of the exported plan's world, one process each; their reports by rank."""
    exported = load_export(plan_file)
    tables = load_tables(tables_file)  # a bad table file is refused here, not in every rank
    if exported.device_type != "cpu":
        raise ShardRayError(f"{plan_file} is exported for {exported.device_type}: export with --device cpu to run here")
    check_cpu_ranks(exported)  # a file exported for CPU ranks before export refused row-wise tables for them
    # TorchRec allocates every table in full (no row cap, as the profilers have): refuse what memory cannot hold
    weights = sum(t.rows * t.dim * BYTES_PER_ELEMENT[t.precision] for t in tables)
    available = _available_memory()
    if available is not None and weights > WEIGHTS_SHARE * available:
        raise ShardRayError(
            f"the tables' weights take {format_gb(weights)}, more than {WEIGHTS_SHARE:.0%} of the "
            f"{format_gb(available)} this machine has available (the rest its ranks' processes and TorchRec's own "
            "buffers take): TorchRec allocates them in full; try a table file with fewer rows"
        )
    world = exported.world_size
    print(f"one training step on {world} gloo ranks, the tables' weights ({format_gb(weights)}) allocated in full")
    results = mp.Manager().dict()
    # The ranks fork from a server process that imported TorchRec once (it runs no threads, so forking it is safe),
    # where `spawn` made each rank import it afresh: docs/commands.md gives the time this saves.
    mp.set_forkserver_preload(RANK_MODULES)
    args = (world, _free_port(), tables_file, plan_file, batch, results)
    mp.start_processes(train_step, args=args, nprocs=world, join=True, start_method="forkserver")
    return dict(sorted(results.items()))


def main() -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", required=True, help="the table file the plan places")
    parser.add_argument("--plan", required=True, help="the plan as `shard-ray export --device cpu` wrote it")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    args = parser.parse_args()
    try:
        results = run(args.tables, args.plan, args.batch)
    except ShardRayError as err:
        print(f"shard-ray: error: {err}", file=sys.stderr)
        return 2
    for rank, result in results.items():
        held = "; ".join(
            f"{table} rows {o[0]}:{o[0] + o[2]}, columns {o[1]}:{o[1] + o[3]}"
            for table, shards in result["local_shards"].items()
            for o in shards
        )
        replicas = ", ".join(result["replicas"]) or "none"
        sharded = sorted(t for t, shards in result["local_shards"].items() if shards)
        missed = [t for t in sharded if t not in result["updated"]]
        updated = "yes" if not missed else f"not {', '.join(missed)}"
        print(
            f"rank {rank}: holds {held or 'no sharded table'}; replicas: {replicas}; pooled output "
            f"{result['shape']}; SGD updated its shards: {updated}"
        )
    print(json.dumps({str(rank): result for rank, result in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
