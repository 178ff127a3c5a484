"""Benchmark: how placement time grows with tables and devices, and profiling throughput with actors.

    python experiments/scaling.py --table-counts 50,100,200,428,856,1712 --device-counts 4,8,16,32,64,128

Placement (no hardware in the loop): every algorithm that handles the size places tasks drawn
from synthetic pools of each table count on `--devices-for-tables` devices, and the 856-table
pool on each device count; median placement time over `--repeats`, and the simulated plan cost.
Profiling: the same `--shards` fused shards measured by 1 and by `--actors` profiling actors
(fresh stores), shards per second, median over `--repeats`. Writes Markdown, JSON and a plot;
the last printed line is JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import ShardRayError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import algorithms, place
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.workload.synthetic import PoolConfig, generate_pool


def placement_times(num_tables: int, devices: int, repeats: int, simulator: Simulator) -> dict[str, dict]:
    tables = generate_pool(PoolConfig(num_tables=num_tables))
    topology = Topology(
        num_devices=devices, memory_bytes=memory_cap_with_headroom(tables, devices, 1.5), batch_size=1024
    )
    results = {}
    for info in algorithms():
        if not info.handles(num_tables):
            continue
        try:
            plans = [place(info.name, tables, topology) for _ in range(repeats)]
        except ShardRayError as err:
            results[info.name] = {"failed": str(err)}
            continue
        results[info.name] = {
            "median_seconds": statistics.median(p.placement_seconds for p in plans),
            "simulated_cost_ms": simulator.plan_cost(plans[0], tables, topology.batch_size).cost_ms,
        }
        print(
            f"{num_tables:>5} tables {devices:>4} devices  {info.name:<20} {results[info.name]['median_seconds']:8.3f} s",
            flush=True,
        )
    return results


def profiling_throughput(actor_counts: list[int], shards: int, repeats: int) -> dict[int, float]:
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.profiling.sampling import draw_fused_shards
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.runtime import connect_ray

    print(connect_ray(min_cpus=max(actor_counts)))
    drawn = draw_fused_shards(generate_pool(PoolConfig(num_tables=200, seed=1)), shards, 6, seed=2, singles=False)
    throughput = {}
    for actors in actor_counts:
        rates = []
        with ProfilingPool(actors) as pool:
            for repeat in range(repeats):
                with tempfile.TemporaryDirectory() as folder, MeasurementStore(Path(folder) / "m.db") as store:
                    began = time.perf_counter()
                    pool.measure(drawn, MeasureConfig(batch_size=1024, seed=repeat), store)
                    rates.append(len(drawn) / (time.perf_counter() - began))
        throughput[actors] = statistics.median(rates)
        print(f"profiling with {actors} actor(s): {throughput[actors]:.2f} shards/s", flush=True)
    return throughput


def plot(by_tables: dict, by_devices: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, results, label in ((axes[0], by_tables, "tables"), (axes[1], by_devices, "devices")):
        names = sorted({n for r in results.values() for n in r})
        for name in names:
            points = [
                (int(x), r[name]["median_seconds"]) for x, r in results.items() if "median_seconds" in r.get(name, {})
            ]
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("placement time (s, median)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict, label: str) -> list[str]:
    names = sorted({n for r in results.values() for n in r})
    lines = ["| algorithm | " + " | ".join(f"{x} {label}" for x in results) + " |", "|---|" + "---:|" * len(results)]
    for name in names:
        cells = []
        for r in results.values():
            entry = r.get(name)
            cells.append("—" if entry is None else "failed" if "failed" in entry else f"{entry['median_seconds']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-counts", default="50,100,200,428,856,1712")
    parser.add_argument("--devices-for-tables", type=int, default=16)
    parser.add_argument("--device-counts", default="4,8,16,32,64,128")
    parser.add_argument("--tables-for-devices", type=int, default=856)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--actors", type=int, default=2, help="profiling actors compared with 1 (default %(default)s)")
    parser.add_argument(
        "--shards", type=int, default=60, help="shards profiled per throughput run (default %(default)s)"
    )
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/scaling")
    args = parser.parse_args()
    simulator = Simulator(CostModels.load(default_cost_model_path()))
    by_tables = {
        n: placement_times(n, args.devices_for_tables, args.repeats, simulator)
        for n in map(int, args.table_counts.split(","))
    }
    by_devices = {
        d: placement_times(args.tables_for_devices, d, args.repeats, simulator)
        for d in map(int, args.device_counts.split(","))
    }
    throughput = profiling_throughput(sorted({1, args.actors}), args.shards, args.repeats)
    out = Path(args.out)
    plot(by_tables, by_devices, out / "scaling.png")
    lines = [
        f"Placement time (s, median of {args.repeats}), no hardware in the loop, one core:",
        "",
        f"**Against table count**, {args.devices_for_tables} devices:",
        "",
        *table(by_tables, "tables"),
        "",
        f"**Against device count**, {args.tables_for_devices} tables:",
        "",
        *table(by_devices, "devices"),
        "",
        f"**Profiling throughput**, {args.shards} fused shards of 2-6 tables: "
        + ", ".join(f"{a} actor(s) {r:.2f} shards/s" for a, r in throughput.items())
        + (f" ({throughput[args.actors] / throughput[1]:.2f}x)" if args.actors != 1 else ""),
    ]
    write_atomic(out / "scaling.md", "\n".join(lines) + "\n")
    write_json(
        out / "scaling.json",
        {
            "settings": vars(args),
            "by_tables": by_tables,
            "by_devices": by_devices,
            "profiling_shards_per_s": throughput,
        },
    )
    print("\n".join(lines))
    print(
        json.dumps(
            {
                "profiling_shards_per_s": throughput,
                "tables_856_seconds": {n: r.get("median_seconds") for n, r in by_devices.get(64, {}).items()},
            }
        )
    )


if __name__ == "__main__":
    main()
