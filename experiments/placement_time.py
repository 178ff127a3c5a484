"""Benchmark: how long each algorithm takes to place large tasks (no hardware in the loop).

    python experiments/placement_time.py --tables 856 --devices 64 --repeats 3

Places the whole synthetic pool (856 tables by default) on many devices with every
algorithm that handles the size; reports the median placement time over repeats and the
simulated plan cost. The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.placement import algorithms, place
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.workload.synthetic import PoolConfig, generate_pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=856)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args()
    tables = generate_pool(PoolConfig(num_tables=args.tables))
    topology = Topology(
        num_devices=args.devices, memory_bytes=memory_cap_with_headroom(tables, args.devices, 1.5), batch_size=args.batch_size
    )
    simulator = Simulator(CostModels.load(default_cost_model_path()))
    results = {}
    for info in algorithms():
        if not info.handles(len(tables)):
            continue
        plans = [place(info.name, tables, topology) for _ in range(args.repeats)]
        seconds = statistics.median(p.placement_seconds for p in plans)
        simulated = simulator.plan_cost(plans[0], tables, topology.batch_size).cost_ms
        results[info.name] = {"median_seconds": seconds, "simulated_cost_ms": simulated}
        print(f"{info.name:<20} {seconds:8.3f} s   simulated cost {simulated:8.2f} ms", flush=True)
    print(json.dumps({"tables": args.tables, "devices": args.devices, "algorithms": results}))


if __name__ == "__main__":
    main()
