"""Benchmark: the shipped policy's plans against cost_search's, priced, from 8 to 512 devices.

    OMP_NUM_THREADS=1 python experiments/policy_against_search.py
    OMP_NUM_THREADS=1 python experiments/policy_against_search.py --devices 16,64 --tasks 3 --policy runs/policy

The policy's plans are meant to be priced within 5% of `cost_search`'s at 8, 16, 64 and 512 devices.
Held-out tasks of the test pool as docs/results.md's policy sections draw them (`validation_tasks`, seed `--seed`:
40-60 tables on 8 devices, 80-120 on 16, 120-200 on 32, 200-300 on 64; memory 1.65x an even split), and at 512
devices `shard-ray generate`'s 5,136 tables with 1.5x an even split, as `experiments/planning_scale.py` has them. On
each, the policy (`--policy`, default the shipped one) and `cost_search` with its defaults plan the task; each plan
priced by the shipped models (simulated, no hardware) over the task's lower bound, and each placement timed (one
core: run with `OMP_NUM_THREADS=1`). Writes `policy_against_search.md` and `policy_against_search.json` to `--out`;
the last printed line is JSON. `--search-start` sets where `cost_search`'s beam starts (its `start` setting: `auto`,
its default, starts from the policy's plan too where there are no more tables than devices).

`--few-tables` draws tasks of few tables a device instead: on each count of devices D, tasks of 6 to D tables (at
most the pool's), memory 1.5x an even split, where every table dominates the task and the devices are no fewer than the
tables (docs/results.md, "Few tables on many devices").

`--tables FILE` draws the tasks from a table file instead (one kept outside the repository, say, so that nothing is
fitted to the files in `experiments/tables/`), its tables as the file has them (dims included): on each device count
tasks of as many tables as above, at most the file's; a file of no more tables than a count's fewest, or any file at
512 devices, is one task, whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import ShardRayError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import place
from shard_ray.placement.search import STARTS, SearchConfig
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.policy.policy_file import default_policy_path
from shard_ray.policy.settings import PolicyConfig
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec, load_tables
from shard_ray.workload.tasks import split_pool

TABLES_FOR_DEVICES = {8: (40, 60), 16: (80, 120), 32: (120, 200), 64: (200, 300)}
AT_SCALE = {512: 5136}  # devices: tables of `generate_pool`, one task
FEWEST_TABLES = 6  # --few-tables: tasks of this many tables to one a device


def few_tables_tasks(
    devices: int, count: int, seed: int, pool: list[TableSpec] | None = None
) -> list[tuple[list[TableSpec], Topology]]:
    """`count` tasks of `FEWEST_TABLES` to `devices` tables (at most the pool's) on `devices`, memory 1.5x an even
    split: drawn from the test pool of `generate_pool`'s tables, or from `pool` where given; a task drawn again is
    left out (a file of few tables is one task)."""
    if pool is None:
        _, pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    rng = np.random.default_rng(seed)
    high = min(devices, len(pool))
    sizes = rng.integers(min(FEWEST_TABLES, high), high + 1, size=count)
    # a task drawn twice (a small file's) is one task
    draws = {tuple(sorted(rng.choice(len(pool), size=n, replace=False))): None for n in sizes}
    return [(tables, Topology(num_devices=devices, memory_bytes=memory_cap_with_headroom(tables, devices, 1.5)))
            for tables in ([pool[i] for i in drawn] for drawn in draws)]  # fmt: skip


def tasks_on(
    devices: int, count: int, seed: int, pool: list[TableSpec] | None = None
) -> list[tuple[list[TableSpec], Topology]]:
    """The held-out tasks on `devices`: drawn from the test pool of `generate_pool`'s tables, or from `pool` (a table
    file's tables, kept as they are) where given."""
    if pool is not None:
        low, high = TABLES_FOR_DEVICES.get(devices, (len(pool), len(pool)))
        if len(pool) <= low:
            draws = [pool]
        else:
            rng = np.random.default_rng(seed)
            sizes = rng.integers(low, min(high, len(pool)) + 1, size=count)
            draws = [[pool[i] for i in sorted(rng.choice(len(pool), size=n, replace=False))] for n in sizes]
        headroom = float(np.mean(PolicyConfig().memory_headroom))  # validation_tasks' cap: the middle of the range
        return [(tables, Topology(num_devices=devices, memory_bytes=memory_cap_with_headroom(tables, devices, headroom)))
                for tables in draws]  # fmt: skip
    if devices in AT_SCALE:
        tables = generate_pool(PoolConfig(num_tables=AT_SCALE[devices]))
        memory = memory_cap_with_headroom(tables, devices, 1.5)
        return [(tables, Topology(num_devices=devices, memory_bytes=memory))]
    low, high = TABLES_FOR_DEVICES[devices]
    _, test_pool = split_pool(generate_pool(PoolConfig(seed=0)), 0.5, 0)
    from shard_ray.policy.ppo import validation_tasks  # loads torch: imported once the flags are checked

    return validation_tasks(test_pool, PolicyConfig(min_tables=low, max_tables=high, devices=(devices,)), count, seed)


def checked_devices(parser: Parser, args: argparse.Namespace, known: list[int]) -> list[int]:
    """`--devices`' counts, each one of `known`, and `--tasks` at least 1; else the parser's error."""
    try:
        device_counts = [int(d) for d in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices {args.devices}: give device counts, whole numbers comma-separated (e.g. 8,16,64)")
    if any(d not in known for d in device_counts):
        parser.error(f"--devices {args.devices}: each of {known}")
    if args.tasks < 1:
        parser.error(f"--tasks {args.tasks}: give 1 or more")
    return device_counts


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    known = sorted(TABLES_FOR_DEVICES) + sorted(AT_SCALE)
    parser.add_argument(
        "--devices", default="8,16,64,512", help=f"device counts, comma-separated, of {known} (default %(default)s)"
    )
    parser.add_argument("--tasks", type=int, default=6, help="held-out tasks a device count (default %(default)s)")
    parser.add_argument("--seed", type=int, default=7, help="the held-out tasks' seed (default %(default)s)")
    parser.add_argument("--policy", default=None, help="policy file or folder (default: the shipped policy)")
    parser.add_argument(
        "--tables", default=None, help="draw the tasks from this table file (default: the synthetic test pool)"
    )
    parser.add_argument(
        "--few-tables", action="store_true", help="tasks of 6 tables to one a device (see the module's docstring)"
    )
    parser.add_argument(
        "--search-start",
        choices=STARTS,
        default=SearchConfig.start,
        help="where cost_search's beam starts (its `start` setting; default %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=a_folder_to_write,
        default=None,
        help="folder (default experiments/results/policy_against_search, or with --few-tables "
        "experiments/results/policy_against_search_few_tables_START, START the --search-start)",
    )
    args = parser.parse_args()
    device_counts = checked_devices(parser, args, known)
    policy = args.policy or str(default_policy_path())
    # the policy's modules load torch (1.2 s): imported once the flags are checked
    from shard_ray.policy.network import load_policy

    try:
        load_policy(policy)  # a missing or damaged file is refused before any planning
    except ShardRayError as err:
        parser.error(f"--policy: {err}")

    pool = None
    if args.tables is not None:
        try:
            pool = load_tables(args.tables)
        except ShardRayError as err:
            parser.error(f"--tables: {err}")

    models = CostModels.load(default_cost_model_path())
    simulator = Simulator(models)
    rows = []
    for devices in device_counts:
        draw = few_tables_tasks if args.few_tables else tasks_on
        for k, (tables, topology) in enumerate(draw(devices, args.tasks, args.seed, pool)):
            bound = lower_bound_ms(models, tables, topology)
            row = {"devices": devices, "task": k, "tables": len(tables), "bound_ms": bound}
            for label, algorithm, settings in (
                ("policy", "dreamshard", {"policy": policy}),
                ("search", "cost_search", {"start": args.search_start}),
            ):
                plan = place(algorithm, tables, topology, settings=settings)
                cost = simulator.plan_cost(plan, tables, topology.batch_size).cost_ms
                row[label] = {"cost_ms": cost, "over_bound": cost / bound, "seconds": plan.placement_seconds}
            row["ratio"] = row["policy"]["cost_ms"] / row["search"]["cost_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    lines = [
        f"The policy ({args.policy or 'the shipped one'}) against `cost_search`, priced by the shipped models; held-out tasks "
        f"({'of few tables a device, ' if args.few_tables else ''}{f'of {args.tables}, ' if args.tables else ''}"
        f"seed {args.seed}; `cost_search` starting from {args.search_start!r}). "
        "Cost over the task's lower bound and placement seconds on one core, the mean over tasks; the policy's cost "
        "over `cost_search`'s, the mean and the range over tasks.",
        "",
        "| devices | tasks | tables | policy: cost / bound | `cost_search`: cost / bound | policy / `cost_search` "
        "| policy: s | `cost_search`: s |",
        "|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for devices in device_counts:
        on = [r for r in rows if r["devices"] == devices]
        ratios = [r["ratio"] for r in on]
        counts = sorted(r["tables"] for r in on)
        lines.append(
            f"| {devices} | {len(on)} | {counts[0]}-{counts[-1]} | "
            f"{statistics.mean(r['policy']['over_bound'] for r in on):.3f} | "
            f"{statistics.mean(r['search']['over_bound'] for r in on):.3f} | "
            f"{statistics.mean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] | "
            f"{statistics.mean(r['policy']['seconds'] for r in on):.2f} | "
            f"{statistics.mean(r['search']['seconds'] for r in on):.2f} |"
        )
    mode = f"_few_tables_{args.search_start}" if args.few_tables else ""
    out = Path(args.out or f"experiments/results/policy_against_search{mode}")
    args.out = str(out)
    write_atomic(out / "policy_against_search.md", "\n".join(lines) + "\n")
    write_json(out / "policy_against_search.json", {"settings": vars(args), "tasks": rows})
    print("\n".join(lines))
    print(f"wrote {out / 'policy_against_search.md'} and {out / 'policy_against_search.json'}")
    print(json.dumps({str(d): [r["ratio"] for r in rows if r["devices"] == d] for d in device_counts}))


if __name__ == "__main__":
    main()
