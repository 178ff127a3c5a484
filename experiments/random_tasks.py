"""Robustness: every algorithm places random small tasks, optionally under random constraints files.

    python experiments/random_tasks.py
    python experiments/random_tasks.py --tasks 250 --seed 4
    python experiments/random_tasks.py --constraints --tasks 200 --seed 1
    python experiments/random_tasks.py --max-tables 300 --max-devices 128 --algorithms dreamshard,cost_search

A task is 1 to 7 tables (`--max-tables`) of 1 to 400 million rows, 4 to 256 columns, 0.01 to 100 lookups a sample,
some fp16 or Zipf-drawn, on 1 to 16 devices (`--max-devices`: up to 128), over hosts of 2 or 4 (past 16 devices, 8 too)
or on one, with 10 MB to 80 GiB a device (with more than 7 tables, at least 1.05 to 3 times an even share of the
tables' memory, up to 192 GiB) and batches of 64 to 65,536; with `--constraints`, each table may be pinned to devices,
limited to sharding types or kept off some, and two may form a group. Every registered algorithm (or those
`--algorithms` names) places it (those that take no constraints file skip the constrained tasks); the plan must be
valid (`Plan.check`), within memory, keep its constraints and export to TorchRec (a grid, which the export does not
write, aside). A task no plan fits (`InfeasibleError`) is fine, and counted; any other error is a problem,
printed with its task. Writes `random_tasks.md` and `random_tasks.json` to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import json
import random
import time
import traceback
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.interop.torchrec import export_plan
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import algorithms, place
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.piece import SHARDING_TYPES
from shard_ray.plan.topology import GB, Topology, memory_cap_with_headroom
from shard_ray.workload.tables import TableSpec

# The most memory a device of the bigger tasks (`--max-tables` over 7) gets: a large GPU's.
LARGEST = 192 * GB


def random_task(
    rng: random.Random, constrained: bool, max_tables: int = 7, max_devices: int = 16
) -> tuple[list[TableSpec], Topology, Constraints | None]:
    """One task as the module's docstring draws it; its constraints None where it has none or they do not apply. The
    defaults draw the tasks this benchmark drew before it took bigger ones, seed for seed."""
    tables = []
    for k in range(rng.randint(1, max_tables)):
        spec = {
            "name": f"t{k}",
            "rows": rng.choice([1, 2, 3, 7, 50, 1000, 10**6, 4 * 10**8]),
            "dim": rng.choice([4, 8, 12, 16, 64, 128, 256]),
            "pooling_factor": rng.choice([0.01, 1.0, 3.0, 100.0]),
        }
        if rng.random() < 0.2:
            spec["precision"] = "fp16"
        if rng.random() < 0.3:
            spec["zipf_exponent"] = rng.choice([0.5, 1.05, 1.5])
        tables.append(TableSpec(**spec))
    devices = rng.choice([d for d in (1, 2, 3, 4, 8, 16, 32, 64, 128) if d <= max_devices])
    hosts_of = (2, 4, 8) if devices > 16 else (2, 4)
    per_host = rng.choice([None, *(p for p in hosts_of if devices % p == 0 and devices > p)])
    memory = int(rng.choice([0.01, 1, 16, 80]) * GB)
    if max_tables > 7:  # hundreds of tables fit 80 GiB a device seldom: at least 1.05-3x an even share, up to a GPU's
        memory = max(memory, min(memory_cap_with_headroom(tables, devices, rng.choice([1.05, 1.5, 3.0])), LARGEST))
    topology = Topology(
        num_devices=devices, devices_per_host=per_host, memory_bytes=memory, batch_size=rng.choice([64, 1024, 65536])
    )
    if not constrained:
        return tables, topology, None
    rules: dict[str, dict] = {}
    for table in tables:
        draw = rng.random()
        if draw < 0.2:
            rules[table.name] = {"devices": sorted(rng.sample(range(devices), rng.randint(1, devices)))}
        elif draw < 0.4:
            rules[table.name] = {"types": rng.sample(SHARDING_TYPES, rng.randint(1, 3))}
        elif draw < 0.55:
            rules[table.name] = {"not_types": rng.sample(SHARDING_TYPES, rng.randint(1, 2))}
    free = [t.name for t in tables if t.name not in rules]
    groups = [rng.sample(free, 2)] if len(free) >= 2 and rng.random() < 0.4 else []
    constraints = Constraints.model_validate({"tables": rules, "groups": groups})
    try:
        constraints.check(tables, topology)
    except ShardRayError:  # a file `plan` refuses in a line before placing: not a task
        return tables, topology, None
    return tables, topology, constraints


# What `problem_with` says of a task no plan fits (`InfeasibleError`): fine, and counted.
NO_PLAN_FITS = "no plan fits"


def problem_with(name: str, tables: list[TableSpec], topology: Topology, constraints: Constraints | None) -> str | None:
    """What is wrong with `name`'s plan of the task, None where nothing is, `NO_PLAN_FITS` where no plan fits."""
    try:
        plan = place(name, tables, topology, seed=1, constraints=constraints)
        plan.check(tables)
        if max(plan.memory_bytes) > topology.memory_bytes:
            return "a device over its memory"
        broken = constraints.violations(plan, tables) if constraints is not None else []
        if broken:
            return "; ".join(broken)
        try:
            export_plan(plan, tables)
        except ShardRayError as err:
            if "(a grid)" not in str(err):
                raise
    except InfeasibleError:
        return NO_PLAN_FITS
    except ShardRayError as err:
        if constraints is not None and "does not take a constraints file" in str(err):
            return None
        return str(err)
    except Exception as err:  # noqa: BLE001 (every other error is what this looks for)
        return f"{type(err).__name__}: {err} ({traceback.extract_tb(err.__traceback__)[-1].name})"
    return None


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=60, help="random tasks (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the tasks' seed (default %(default)s)")
    parser.add_argument("--constraints", action="store_true", help="a random constraints file for each task")
    parser.add_argument("--max-tables", type=int, default=7, help="the most tables a task has (default %(default)s)")
    parser.add_argument(
        "--max-devices", type=int, default=16, choices=(16, 32, 64, 128), help="the most devices (default %(default)s)"
    )
    parser.add_argument("--algorithms", help="comma-separated names of algorithms to run (default: every one)")
    parser.add_argument(
        "--out", type=a_folder_to_write, default="experiments/results/random_tasks", help="folder (default %(default)s)"
    )
    args = parser.parse_args()
    if args.tasks < 1:
        parser.error(f"--tasks must be at least 1, got {args.tasks}")
    if args.max_tables < 1:
        parser.error(f"--max-tables must be at least 1, got {args.max_tables}")
    names = [info.name for info in algorithms()]
    if args.algorithms is not None:
        chosen = args.algorithms.split(",")
        unknown = [name for name in chosen if name not in names]
        if unknown:
            parser.error(f"--algorithms: no algorithm named {', '.join(unknown)} (there are {', '.join(names)})")
        names = chosen
    rng = random.Random(args.seed)
    problems: list[dict] = []
    placed = infeasible = 0
    began = time.perf_counter()
    for task in range(args.tasks):
        tables, topology, constraints = random_task(rng, args.constraints, args.max_tables, args.max_devices)
        for name in names:
            found = problem_with(name, tables, topology, constraints)
            placed += 1
            infeasible += found == NO_PLAN_FITS
            if found is not None and found != NO_PLAN_FITS:
                problems.append(
                    {
                        "task": task,
                        "algorithm": name,
                        "problem": found,
                        "tables": [t.model_dump(mode="json", exclude_defaults=True) for t in tables],
                        "devices": topology.num_devices,
                        "devices_per_host": topology.devices_per_host,
                        "memory_gb": topology.memory_gb,
                        "batch_size": topology.batch_size,
                        "constraints": constraints.model_dump(mode="json") if constraints else None,
                    }
                )
                print(f"task {task}, {name}: {found}", flush=True)
    report = {
        "seed": args.seed,
        "tasks": args.tasks,
        "constraints": args.constraints,
        "max_tables": args.max_tables,
        "max_devices": args.max_devices,
        "algorithms": names,
        "plans": placed,
        "infeasible": infeasible,
        "problems": problems,
        "seconds": round(time.perf_counter() - began, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "random_tasks.json", report)
    lines = [
        f"# Random tasks, seed {args.seed}" + (", random constraints" if args.constraints else ""),
        "",
        f"{args.tasks} tasks, {placed} placements by {len(names)} algorithms in {report['seconds']} s ({infeasible} "
        f"where no plan fits): {len(problems)} problems.",
        "",
        *(f"- task {p['task']}, {p['algorithm']}: {p['problem']}" for p in problems),
    ]
    write_atomic(out / "random_tasks.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'random_tasks.md'} and {out / 'random_tasks.json'}")
    print(json.dumps({k: v for k, v in report.items() if k != "problems"} | {"problems": len(problems)}))


if __name__ == "__main__":
    main()
