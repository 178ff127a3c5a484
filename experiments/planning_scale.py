"""Benchmark: planning at production scale, thousands of tables on up to a thousand devices.

    OMP_NUM_THREADS=1 python experiments/planning_scale.py
    OMP_NUM_THREADS=1 python experiments/planning_scale.py --sizes 5000x8,10000x1024 --algorithms cost_search
    OMP_NUM_THREADS=1 python experiments/planning_scale.py --sizes 5000x64,10000x1024 --devices-per-host 8 \
        --algorithms cost_search,neuroshard --out experiments/results/planning_scale_hosts

Each (tables x devices) size is a synthetic pool of that many tables (`generate_pool`, seed 0)
on devices with 1.5 times an even share of its memory, on one host or, with `--devices-per-host`,
on hosts of that many devices (where table-row-wise is one of cost_search's types). Every algorithm plans each size in a
fresh process (so the peak resident memory is its own), killed after `--timeout` seconds; the
process reports the placement time (`place`'s, the search alone), the wall time of `place`
(with the estimate: simulated cost, lower bound, model warnings), its peak RSS, and, under
the shipped models, the plan's simulated cost and the task's lower bound. Writes Markdown and JSON to `--out`; the last printed line is JSON.

    OMP_NUM_THREADS=1 python experiments/planning_scale.py --sizes 100x8,856x64,5136x512 \
        --algorithms cost_search,neuroshard,dreamshard --previous 221ca62 --repeats 2

`--previous COMMIT` plans every size with that commit's code too (its `planning_scale.py --one`, from a git worktree
put first on PYTHONPATH, in this environment), the two releases in turn plan by plan, `--repeats` times over: side by
side in one run, so that a change of the machine's speed (on a shared host, up to twice from hour to hour) falls on
both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from releases import REPO, checkout_of, file_at, is_commit

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_atomic, write_json

ALGORITHMS = ("cost_search", "neuroshard", "dreamshard", "size_lookup_greedy", "torchrec")
SIZES = "5000x8,5000x64,5000x512,10000x1024"


def plan_once(algorithm: str, num_tables: int, num_devices: int, devices_per_host: int | None = None) -> dict:
    """Plan one size in this process; what `main` reads back from the child."""
    import resource

    from shard_ray.costmodel.bounds import lower_bound_ms
    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.placement import place
    from shard_ray.plan.topology import Topology, memory_cap_with_headroom
    from shard_ray.workload.synthetic import PoolConfig, generate_pool

    tables = generate_pool(PoolConfig(num_tables=num_tables))
    topology = Topology(
        num_devices=num_devices,
        memory_bytes=memory_cap_with_headroom(tables, num_devices, 1.5),
        batch_size=1024,
        devices_per_host=devices_per_host,
    )
    began = time.perf_counter()
    plan = place(algorithm, tables, topology)
    wall = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    # Every plan priced by the shipped models, whether its algorithm used them or not.
    models = CostModels.load(default_cost_model_path())
    return {
        "placement_seconds": plan.placement_seconds,
        "wall_seconds": wall,
        "peak_rss_gb": peak,
        "simulated_cost_ms": Simulator(models).plan_cost(plan, tables, topology.batch_size).cost_ms,
        "lower_bound_ms": lower_bound_ms(models, tables, topology),
        "cut_short": plan.search is not None and plan.search.cut_short is not None,
        "sharding_types": dict(Counter(sharding.type for sharding in plan.table_shardings(tables).values())),
    }


def run_child(
    algorithm: str,
    num_tables: int,
    num_devices: int,
    timeout: float,
    devices_per_host: int | None = None,
    code: Path | None = None,
) -> dict:
    """Plan one size in a fresh process with the code at `code` (None: this checkout's)."""
    script = (code or REPO) / "experiments" / "planning_scale.py"
    command = [sys.executable, str(script), "--one", f"{algorithm}:{num_tables}x{num_devices}"]
    command += ["--devices-per-host", str(devices_per_host)] if devices_per_host else []
    env = {**os.environ, "PYTHONPATH": str(code)} if code else None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"no plan within {timeout:.0f} s"}
    if done.returncode != 0:
        return {"failed": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: dict[str, dict[str, dict[str, list[dict]]]]) -> list[str]:
    """A row per algorithm (and release, where there are two), a column per size: each run's placement time, the
    first's wall time with the estimate, peak memory, simulated cost and its gap to the lower bound."""
    first = next(iter(results.values()))
    sizes = list(next(iter(first.values())))
    lines = [
        "| algorithm | " + " | ".join(f"{s.replace('x', ' tables, ')} devices" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for algorithm in first:
        for release, by_algorithm in results.items():
            cells = []
            for size in sizes:
                runs = by_algorithm[algorithm][size]
                failed = [r["failed"] for r in runs if "failed" in r]
                if failed:
                    cells.append(failed[0])
                    continue
                r = runs[0]
                gap = r["simulated_cost_ms"] / r["lower_bound_ms"] - 1
                cells.append(
                    ", ".join(f"{run['placement_seconds']:.2f}" for run in runs)
                    + f" s ({r['wall_seconds']:.1f} s), {r['peak_rss_gb']:.2f} GB, "
                    f"{r['simulated_cost_ms']:.3f} ms (+{gap:.0%})"
                )
            label = algorithm if len(results) == 1 else f"{algorithm}, {release}"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=SIZES, help="TABLESxDEVICES, comma-separated (default %(default)s)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per plan (default %(default)s)")
    parser.add_argument("--devices-per-host", type=int, help="devices on each host (default: one host)")
    parser.add_argument("--previous", help="a commit whose code plans the same sizes, plan by plan in turn")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every plan (default %(default)s)")
    parser.add_argument(
        "--out",
        type=a_folder_to_write,
        default="experiments/results/planning_scale",
        help="folder (default %(default)s)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # ALGORITHM:TABLESxDEVICES, in the child process
    args = parser.parse_args()
    if args.one:
        algorithm, size = args.one.split(":")
        tables, devices = map(int, size.split("x"))
        print(json.dumps(plan_once(algorithm, tables, devices, args.devices_per_host)))
        return
    if args.previous and not is_commit(args.previous):
        parser.error(f"--previous {args.previous}: no such commit in this repository")
    if args.previous and "--one" not in file_at(args.previous, "experiments/planning_scale.py"):
        parser.error(f"--previous {args.previous}: that commit's experiments/planning_scale.py cannot plan one size")
    if args.repeats < 1 or not args.timeout > 0:
        parser.error(f"--repeats {args.repeats} --timeout {args.timeout:g}: give 1 or more runs and seconds above 0")
    try:
        sizes = [(int(t), int(d)) for t, d in (size.split("x") for size in args.sizes.split(","))]
    except ValueError:
        sizes = []
    if not sizes or min(min(size) for size in sizes) < 1:
        parser.error(f"--sizes {args.sizes}: give TABLESxDEVICES, comma-separated, each at least 1 (e.g. 856x64)")
    from shard_ray.placement import algorithms as registered

    algorithms = args.algorithms.split(",")
    known = {info.name for info in registered()}
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        parser.error(f"--algorithms: unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    with tempfile.TemporaryDirectory(prefix="planning-scale-") as folder, contextlib.ExitStack() as stack:
        releases: dict[str, Path | None] = {"this checkout": None}
        if args.previous:
            releases[f"previous ({args.previous})"] = stack.enter_context(
                checkout_of(args.previous, Path(folder) / "previous")
            )
        results = {r: {a: {f"{t}x{d}": [] for t, d in sizes} for a in algorithms} for r in releases}
        for repeat in range(args.repeats):
            for algorithm in algorithms:
                for tables, devices in sizes:
                    for release, code in releases.items():
                        run = run_child(algorithm, tables, devices, args.timeout, args.devices_per_host, code)
                        results[release][algorithm][f"{tables}x{devices}"].append(run)
                        print(f"{algorithm:<20} {tables}x{devices:<8} {release} run {repeat + 1}: {run}", flush=True)
    out = Path(args.out)
    write_json(out / "planning_scale.json", results)
    lines = [
        "Placement time (the search alone), in parentheses the wall time of `place` with the estimate `plan` prints; "
        "peak memory of "
        "the planning process; simulated cost under the shipped models, and how far above the lower bound. "
        "One core (OMP_NUM_THREADS=1), a fresh process per plan"
        + (f"; hosts of {args.devices_per_host} devices" if args.devices_per_host else "")
        + (f"; this checkout and commit {args.previous} plan by plan in turn" if args.previous else "")
        + (f"; {args.repeats} runs each, their placement times in order" if args.repeats > 1 else "")
        + ".",
        "",
        *markdown(results),
    ]
    write_atomic(out / "planning_scale.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'planning_scale.md'} and {out / 'planning_scale.json'}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
