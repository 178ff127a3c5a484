"""Benchmark: the gang's measurement of plans held against TorchRec's own training step of the same plans.

    python experiments/gang_vs_training.py --tables experiments/tables/ranking_model.json --rounds 3

For each table file, on 2 devices: the plans of the table- and column-wise heuristics, cost_search
and TorchRec's planner (those TorchRec runs on CPU: no row-wise shard) are measured three ways, in
`--rounds` interleaved rounds each:
- on the device gang with every table allocated whole (`--max-rows` unset), as shard-ray measures;
- on the gang with tables capped at 200,000 rows (the measurement before whole tables);
- by TorchRec's `DistributedModelParallel` over an EmbeddingBagCollection of the tables on 2 gloo
  ranks (one core each), its plan exported by `shard-ray export`, row-wise Adagrad fused into the
  backward as TorchRec applies it: forward, backward of a fixed upstream gradient, timed between
  barriers, on the same batches the gang runs (every table's lookups of the rank's samples), a fresh
  batch each timed step. This is the embedding part of a real training step.
Per plan: the gang's cost (each part's fastest step, summed), the gang's fastest whole step, TorchRec's
fastest and median step, and their ratios; per device, the gang's compute and collectives beside
TorchRec's kernels, collectives and the rest of its step under torch's profiler, and how many
all-to-alls TorchRec ran a step. Figures: docs/results.md, "The gang against TorchRec's training
step". The last line is JSON.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_file_to_write
from shard_ray.errors import InfeasibleError
from shard_ray.interop.torchrec import ExportedPlan, embedding_bag_configs, export_plan, sharding_plan
from shard_ray.placement import place
from shard_ray.plan.cost import STEP_PARTS
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.fused_shard import sample_ranges, table_batch
from shard_ray.profiling.gang import DeviceGang, upstream_gradient
from shard_ray.profiling.procedure import PROCEDURE_1_CPU_MAX_ROWS, MeasureConfig
from shard_ray.runtime import connect_ray
from shard_ray.workload.access import fold_rows
from shard_ray.workload.tables import TableSpec, load_tables

ALGORITHMS = ("size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "cost_search", "torchrec")
WORLD = 2
PROFILED_STEPS = 5


def cpu_plans(tables: list[TableSpec], topology: Topology) -> list[Plan]:
    """Each algorithm's plan, once per distinct placement, less those with row-wise shards (GPU-only in TorchRec)."""
    plans, seen = [], set()
    for name in ALGORITHMS:
        try:
            plan = place(name, tables, topology, seed=0)
        except InfeasibleError:
            continue
        key = tuple(sorted((s.table, s.device, s.columns, s.rows) for s in plan.shards))
        if key not in seen and not any(s.rows is not None for s in plan.shards):
            seen.add(key)
            plans.append(plan)
    return plans


def rank_batches(tables: list[TableSpec], config: MeasureConfig, rank: int) -> list[Any]:
    """The KeyedJaggedTensor of this rank's samples of each of `config`'s batches, as the gang draws them."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    start, end = sample_ranges(config.batch_size, WORLD)[rank]
    made = []
    for batch in range(config.num_batches):
        values, lengths = [], []
        for t in tables:
            drawn = fold_rows(table_batch(t, config, batch), t.rows)
            bags = np.concatenate([[0], np.cumsum(drawn.lengths)])
            values.append(drawn.indices[bags[start] : bags[end]])
            lengths.append(drawn.lengths[start:end])
        made.append(
            KeyedJaggedTensor(
                keys=[t.name for t in tables],
                values=torch.from_numpy(np.concatenate(values)),
                lengths=torch.from_numpy(np.concatenate(lengths)),
            )
        )
    return made


def train_rank(
    rank: int,
    port: int,
    tables: list[TableSpec],
    plans: list[ExportedPlan],
    configs: list[MeasureConfig],
    results: dict,
) -> None:
    """Every round's plans in TorchRec's DistributedModelParallel: each timed step's ms, by (round, plan)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    start, end = sample_ranges(configs[0].batch_size, WORLD)[rank]
    width = sum(t.dim for t in tables)
    upstream = upstream_gradient(configs[0].batch_size, width, configs[0].seed)[start:end]
    order = np.random.default_rng(0)
    try:
        for round_index, config in enumerate(configs):
            data = rank_batches(tables, config, rank)
            for p in order.permutation(len(plans)):
                collection = EmbeddingBagCollection(tables=embedding_bag_configs(tables), device=torch.device("meta"))
                apply_optimizer_in_backward(RowWiseAdagrad, collection.parameters(), {"lr": 0.01})
                model = DistributedModelParallel(
                    collection,
                    device=torch.device("cpu"),
                    plan=sharding_plan(plans[p]),
                    sharders=[EmbeddingBagCollectionSharder()],
                )
                steps = []
                warmup = config.warmup + 2  # the gang's warm-up takes at least 4 steps
                for step in range(warmup + config.repeats):
                    batch = config.batch_of_step(step - warmup if step >= warmup else None, step)
                    dist.barrier()
                    began = time.perf_counter()
                    model(data[batch]).values().backward(upstream)
                    dist.barrier()
                    if step >= warmup:
                        steps.append((time.perf_counter() - began) * 1e3)
                if rank == 0:
                    results[(round_index, int(p))] = steps
                if round_index == len(configs) - 1:
                    results[("profile", int(p), rank)] = profiled_parts(model, data, upstream)
                del model, collection
                gc.collect()  # a model's tables are gigabytes: free them before the next is built
    finally:
        dist.destroy_process_group()


def profiled_parts(model: Any, data: list[Any], upstream: torch.Tensor) -> dict[str, float]:
    """ms per step of TorchRec's step on this rank under torch's profiler, by what the time went to: fbgemm's
    forward and backward kernels, the collectives (waits included: a rank waits there for the slower one) and the
    rest (TorchRec's permutes, concatenations, bounds checks and Python)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        for batch in range(PROFILED_STEPS):
            dist.barrier()
            model(data[batch]).values().backward(upstream)
    parts = dict.fromkeys(("kernel_fwd", "kernel_bwd", "collectives", "rest", "all_to_alls"), 0.0)
    for event in profiled.key_averages():
        own = event.self_cpu_time_total / 1e3 / PROFILED_STEPS
        name = event.key
        if name == "c10d::alltoall_base_":
            parts["all_to_alls"] = event.count / PROFILED_STEPS
        if name.startswith("fbgemm::split_embedding_codegen_forward"):
            parts["kernel_fwd"] += own
        elif name.startswith("fbgemm::split_embedding_backward_codegen"):
            parts["kernel_bwd"] += own
        elif any(word in name for word in ("wait", "Wait", "c10d::", "All2All_Pooled_Req")):
            parts["collectives"] += own
        else:
            parts["rest"] += own
    return parts


def torchrec_steps(tables: list[TableSpec], plans: list[Plan], configs: list[MeasureConfig]) -> dict:
    """Per plan, every timed step of every round in TorchRec's DistributedModelParallel (`steps`) and per rank its
    `profiled_parts` in the last round (`profiled`)."""
    exported = [export_plan(p, tables, device_type="cpu") for p in plans]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(train_rank, args=(port, tables, exported, configs, results), nprocs=WORLD, join=True)
    return {
        "steps": [[ms for r in range(len(configs)) for ms in results[(r, p)]] for p in range(len(plans))],
        "profiled": [[results[("profile", p, rank)] for rank in range(WORLD)] for p in range(len(plans))],
    }


def gang_steps(gang: DeviceGang, plans: list[Plan], tables: list[TableSpec], configs: list[MeasureConfig]) -> dict:
    """Per plan, the gang's cost of each round (each part's fastest step, summed, on the slowest device), every
    timed whole step (its slowest device's parts summed) and, per device, each part's fastest step, median over
    the rounds."""
    order = np.random.default_rng(0)
    costs: list[list[float]] = [[] for _ in plans]
    steps: list[list[float]] = [[] for _ in plans]
    parts: list[list[list[dict[str, float]]]] = [[] for _ in plans]  # plan, round, device
    for round_index, config in enumerate(configs):
        for p in order.permutation(len(plans)):
            results = gang.run_steps(plans[p], tables, config, shift=round_index)
            parts[p].append([{name: min(v) for name, v in r["steps"].items()} for r in results])
            costs[p].append(max(sum(device.values()) for device in parts[p][-1]))
            per_step = [[sum(values) for values in zip(*r["steps"].values())] for r in results]  # device, step
            steps[p] += [max(device_steps) for device_steps in zip(*per_step)]
    medians = [
        [{name: statistics.median(r[d][name] for r in rounds) for name in STEP_PARTS} for d in range(WORLD)]
        for rounds in parts
    ]
    return {"cost": costs, "steps": steps, "parts": medians}


def compared_parts(gang: list[dict[str, float]], torchrec: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per device: the gang's compute and collectives beside TorchRec's kernels, collectives and the rest."""
    return [
        {
            "gang_fwd_compute_ms": g["fwd_compute_ms"],
            "torchrec_kernel_fwd_ms": t["kernel_fwd"],
            "gang_bwd_compute_ms": g["bwd_compute_ms"],
            "torchrec_kernel_bwd_ms": t["kernel_bwd"],
            "gang_collectives_ms": g["input_dist_ms"] + g["fwd_comm_ms"] + g["bwd_comm_ms"],
            "torchrec_collectives_ms": t["collectives"],
            "torchrec_rest_ms": t["rest"],
            "torchrec_all_to_alls": t["all_to_alls"],
        }
        for g, t in zip(gang, torchrec)
    ]


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", required=True, help="table files")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per plan and way (default 3)")
    parser.add_argument("--out", type=a_file_to_write, default=None, help="JSON file for the results")
    args = parser.parse_args()
    connect_ray(min_cpus=WORLD)
    results: dict[str, Any] = {}
    for path in args.tables:
        tables = load_tables(path)
        topology = Topology(num_devices=WORLD, memory_bytes=memory_cap_with_headroom(tables, WORLD, 1.5))
        plans = cpu_plans(tables, topology)
        whole = [MeasureConfig.for_topology(topology, seed=r) for r in range(args.rounds)]
        capped = [c.model_copy(update={"max_rows": PROCEDURE_1_CPU_MAX_ROWS}) for c in whole]
        with DeviceGang(WORLD) as gang:
            measured = {"gang whole": gang_steps(gang, plans, tables, whole)}
            measured["gang capped"] = gang_steps(gang, plans, tables, capped)
        trained = torchrec_steps(tables, plans, whole)
        name = Path(path).stem
        rows = []
        for i, plan in enumerate(plans):
            rows.append(
                {
                    "plan": plan.algorithm,
                    "gang_whole_cost_ms": statistics.median(measured["gang whole"]["cost"][i]),
                    "gang_whole_fastest_step_ms": min(measured["gang whole"]["steps"][i]),
                    "gang_capped_cost_ms": statistics.median(measured["gang capped"]["cost"][i]),
                    "torchrec_fastest_step_ms": min(trained["steps"][i]),
                    "torchrec_median_step_ms": statistics.median(trained["steps"][i]),
                    "devices": compared_parts(measured["gang whole"]["parts"][i], trained["profiled"][i]),
                }
            )
        results[name] = rows
        print(f"\n{name}: {len(tables)} tables, {len(plans)} plans TorchRec runs on CPU, {args.rounds} rounds each")
        print(
            f"  {'plan':<20} {'gang whole':>10} {'fastest':>8} {'capped':>8} {'TorchRec':>9} {'median':>8} "
            f"{'gang/TR':>8} {'capped/TR':>9}"
        )
        for r in rows:
            print(
                f"  {r['plan']:<20} {r['gang_whole_cost_ms']:>10.2f} {r['gang_whole_fastest_step_ms']:>8.2f} "
                f"{r['gang_capped_cost_ms']:>8.2f} {r['torchrec_fastest_step_ms']:>9.2f} "
                f"{r['torchrec_median_step_ms']:>8.2f} "
                f"{r['gang_whole_cost_ms'] / r['torchrec_fastest_step_ms']:>8.3f} "
                f"{r['gang_capped_cost_ms'] / r['torchrec_fastest_step_ms']:>9.3f}"
            )
        print(
            "  per device, ms: gang forward / TorchRec's kernel, backward likewise, collectives likewise; TorchRec's rest"
        )
        for r in rows:
            for d, c in enumerate(r["devices"]):
                print(
                    f"  {r['plan']:<20} {d}  fwd {c['gang_fwd_compute_ms']:6.2f} / {c['torchrec_kernel_fwd_ms']:6.2f}"
                    f"   bwd {c['gang_bwd_compute_ms']:6.2f} / {c['torchrec_kernel_bwd_ms']:6.2f}"
                    f"   comm {c['gang_collectives_ms']:6.2f} / {c['torchrec_collectives_ms']:6.2f}"
                    f"   rest {c['torchrec_rest_ms']:6.2f}   all-to-alls a step {c['torchrec_all_to_alls']:.0f}"
                )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
