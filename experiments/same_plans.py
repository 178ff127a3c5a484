"""Benchmark: whether a change plans as the release before it did, plan by plan.

    python experiments/same_plans.py --previous 4760b62 --out experiments/results/same_plans

Plans the public table files (`experiments/tables/`: Criteo Kaggle, MLPerf DLRM-DCNv2, the ranking model, few huge
and many tiny tables) on 2, 8 and 16 devices (16 also over 4 hosts of 4 at 1 Gbit/s between hosts) and 200 tables of
the generator's pool on 16, with each algorithm, in this checkout and in `--previous`'s code (a git worktree put
first on PYTHONPATH, in the same environment; each release in a process of its own, one core each). Each plan's
digest (its devices' pieces) and its simulated cost under the shipped models; writes same_plans.json and
same_plans.md to --out: how many plans are the same, and for those that are not, the two prices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from releases import checkout_of, is_commit

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_atomic, write_json

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("cost_search", "neuroshard", "dreamshard", "size_lookup_greedy")
FILES = ("criteo_kaggle", "mlperf_dlrm_dcnv2", "ranking_model", "few_huge", "many_tiny")


def plan_all(algorithms: list[str]) -> dict[str, dict]:
    """Every case's plan in this process: its digest and simulated cost, or the error that stopped it."""
    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.errors import ShardRayError
    from shard_ray.placement import place
    from shard_ray.plan.topology import Topology, memory_cap_with_headroom
    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import load_tables

    models = CostModels.load(default_cost_model_path())
    cases = [(name, load_tables(REPO / "experiments" / "tables" / f"{name}.json")) for name in FILES]
    results = {}
    for name, tables in [*cases, ("pool_200", generate_pool(PoolConfig(num_tables=200)))]:
        for devices, hosts in [(2, None), (8, None), (16, None), (16, 4)] if name != "pool_200" else [(16, None)]:
            links = {"devices_per_host": hosts, "inter_host_gbps": 1.0} if hosts else {}
            memory = memory_cap_with_headroom(tables, devices, 1.5)
            topology = Topology(num_devices=devices, memory_bytes=memory, batch_size=1024, **links)
            for algorithm in algorithms:
                case = f"{name}, {devices} devices{f' over hosts of {hosts}' if hosts else ''}, {algorithm}"
                try:
                    plan = place(algorithm, tables, topology)
                except ShardRayError as err:
                    results[case] = {"error": str(err).splitlines()[0]}
                    continue
                shards = [sorted(str(piece) for piece in shard) for shard in plan.pieces(tables)]
                results[case] = {
                    "digest": hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16],
                    "cost_ms": Simulator(models).plan_cost(plan, tables, topology.batch_size).cost_ms,
                }
    return results


def run_child(algorithms: list[str], code: Path | None, core: int) -> dict[str, dict]:
    """`plan_all` in a fresh process on one core, with the code at `code` (None: this checkout's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": str(code)} if code else {})}
    script = (code or REPO) / "experiments" / "same_plans.py"
    if code is not None and not script.exists():  # a release before this script: this one, on its code
        script = REPO / "experiments" / "same_plans.py"
    command = ["taskset", "-c", str(core), sys.executable, str(script), "--child", ",".join(algorithms)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code or REPO)
    if done.returncode != 0:
        raise SystemExit(f"same_plans.py: a release's plans failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(previous: str, now: dict[str, dict], before: dict[str, dict]) -> list[str]:
    same = [case for case in now if now[case].get("digest") == before.get(case, {}).get("digest")]
    lines = [f"{len(same)} of {len(now)} plans the same as {previous}'s (their pieces on every device).", ""]
    differ = [case for case in now if case not in same]
    if differ:
        lines += ["| plan | previous, ms | this checkout, ms | ratio |", "|---|---|---|---|"]
        for case in differ:
            old, new = before.get(case, {}), now[case]
            if "cost_ms" in old and "cost_ms" in new:
                ratio = f"{new['cost_ms'] / old['cost_ms']:.6f}"
                lines.append(f"| {case} | {old['cost_ms']:.6f} | {new['cost_ms']:.6f} | {ratio} |")
            else:
                lines.append(
                    f"| {case} | {old.get('error', old.get('cost_ms'))} | {new.get('error', new.get('cost_ms'))} | |"
                )
    return lines


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", help="the commit whose plans this checkout's are compared with (required)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default %(default)s)")
    parser.add_argument(
        "--out", type=a_folder_to_write, default="experiments/results/same_plans", help="folder (default %(default)s)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the algorithms, in the child process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(plan_all(args.child.split(","))))
        return
    if not args.previous:
        parser.error("the following arguments are required: --previous")
    if not is_commit(args.previous):
        parser.error(f"--previous {args.previous!r} is not a commit of this repository")
    algorithms = args.algorithms.split(",")
    with (
        tempfile.TemporaryDirectory(prefix="same-plans-") as folder,
        checkout_of(args.previous, Path(folder) / "code") as code,
    ):
        now = run_child(algorithms, None, 0)
        before = run_child(algorithms, code, min(1, os.cpu_count() - 1))
    out = Path(args.out)
    write_json(out / "same_plans.json", {"previous": args.previous, "this checkout": now, args.previous: before})
    lines = markdown(args.previous, now, before)
    write_atomic(out / "same_plans.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'same_plans.md'} and {out / 'same_plans.json'}")


if __name__ == "__main__":
    main()
