"""Benchmark: how faithful an oversubscribed CPU gang is, with and without compute taking turns.

    python experiments/gang_fidelity.py --devices 8 --tables 40

One test task planned by lookup_greedy is measured three ways, side by side in one run: on a
gang of `--devices` CPU devices whose compute phases take turns, on the same gang computing all
at once, and shard by shard on one profiling actor with a core to itself (the reference). Prints
per device the fused forward + backward ms of each, and the median ratio to the reference; the
last line is JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.costmodel.simulator import price_comm
from shard_ray.placement import place
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import connect_ray
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--tables", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    _, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    tables = draw_task(
        test_pool, TaskConfig(min_tables=args.tables, max_tables=args.tables), np.random.default_rng(args.seed)
    )
    topology = Topology(num_devices=args.devices, memory_bytes=memory_cap_with_headroom(tables, args.devices, 1.5))
    plan = place("lookup_greedy", tables, topology)
    config = MeasureConfig.for_topology(topology, repeats=args.repeats, seed=args.seed)
    print(connect_ray(min_cpus=args.devices))
    with DeviceGang(args.devices, comm_pricer=price_comm) as gang:
        gang.take_turns = True
        in_turn = gang.evaluate(plan, tables, config)
        gang.take_turns = False
        at_once = gang.evaluate(plan, tables, config)
    with (
        ProfilingPool(1) as profiler,
        tempfile.TemporaryDirectory() as tmp,
        MeasurementStore(Path(tmp) / "reference.db") as store,
    ):
        hardware = profiler.hardware
        reference = profiler.measure(plan.pieces(tables), config, store, progress=False)

    rows = []
    for turn, once, ref in zip(in_turn.devices, at_once.devices, reference):
        rows.append(
            (
                turn.fwd_compute_ms + turn.bwd_compute_ms,
                once.fwd_compute_ms + once.bwd_compute_ms,
                ref.fwd_ms + ref.bwd_ms,
            )
        )
        print(
            f"device {turn.device}: taking turns {rows[-1][0]:.2f} ms, all at once {rows[-1][1]:.2f} ms, alone {rows[-1][2]:.2f} ms"
        )
    result = {
        "hardware": hardware,
        "devices": args.devices,
        "median_ratio_taking_turns": statistics.median(t / r for t, _, r in rows),
        "median_ratio_all_at_once": statistics.median(o / r for _, o, r in rows),
        "plan_cost_ms_taking_turns": in_turn.cost_ms,
        "plan_cost_ms_all_at_once": at_once.cost_ms,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
