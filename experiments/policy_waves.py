"""Benchmark: the policy placing the later pieces in waves against placing them a step at a time.

    OMP_NUM_THREADS=1 python experiments/policy_waves.py
    OMP_NUM_THREADS=1 python experiments/policy_waves.py --devices 64 --tasks 3 --seed 11

On 64 devices or more greedy decoding scores runs of the queue's later pieces at once (`PlacementState.wave`). On the
held-out tasks of `experiments/policy_against_search.py` (`tasks_on`: 200-300 tables on 64 devices, memory 1.65x an
even split; on 512 `shard-ray generate`'s 5,136 tables, 1.5x), the shipped policy places each task twice, in waves and
a step at a time (`WAVE_DEVICES` set past the task's devices), each plan priced by the shipped models, each placing
timed on one core. Writes `policy_waves.md` and `policy_waves.json` to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from policy_against_search import AT_SCALE, TABLES_FOR_DEVICES, checked_devices, tasks_on

import shard_ray.policy.env as env
from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.io import write_atomic, write_json
from shard_ray.policy.decode import roll_out
from shard_ray.policy.policy_file import DecodingScorer, default_policy_path, read_policy


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    known = [d for d in sorted(TABLES_FOR_DEVICES) + sorted(AT_SCALE) if d >= env.WAVE_DEVICES]
    parser.add_argument("--devices", default="64,512", help=f"device counts of {known} (default %(default)s)")
    parser.add_argument("--tasks", type=int, default=6, help="held-out tasks a device count (default %(default)s)")
    parser.add_argument("--seed", type=int, default=7, help="the held-out tasks' seed (default %(default)s)")
    parser.add_argument(
        "--out", type=a_folder_to_write, default="experiments/results/policy_waves", help="folder (default %(default)s)"
    )
    args = parser.parse_args()
    device_counts = checked_devices(parser, args, known)

    models = CostModels.load(default_cost_model_path())
    weights, _ = read_policy(default_policy_path())
    scorer = DecodingScorer(weights.state)
    waves_from = env.WAVE_DEVICES
    rows = []
    for devices in device_counts:
        for k, (tables, topology) in enumerate(tasks_on(devices, args.tasks, args.seed)):
            bound = lower_bound_ms(models, tables, topology)
            row = {"devices": devices, "task": k, "tables": len(tables)}
            for label, first in (("waves", waves_from), ("steps", devices + 1)):
                env.WAVE_DEVICES = first
                started = time.perf_counter()
                state = roll_out(scorer, tables, topology, models, lower_bound=bound)
                row[label] = {"cost_ms": state.cost, "done": state.done, "seconds": time.perf_counter() - started}
            env.WAVE_DEVICES = waves_from
            row["ratio"] = row["waves"]["cost_ms"] / row["steps"]["cost_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    lines = [
        f"The shipped policy's greedy decoding in waves and a step at a time; held-out tasks (seed {args.seed}), priced "
        "by the shipped models; seconds of placing on one core, the mean over tasks.",
        "",
        "| devices | tasks | tables | waves / steps: mean [range] | waves: s | steps: s |",
        "|---:|---:|---|---|---:|---:|",
    ]
    for devices in device_counts:
        on = [r for r in rows if r["devices"] == devices]
        ratios = [r["ratio"] for r in on]
        tables = [r["tables"] for r in on]
        lines.append(
            f"| {devices} | {len(on)} | {min(tables)}-{max(tables)} | {statistics.mean(ratios):.4f} "
            f"[{min(ratios):.4f}, {max(ratios):.4f}] | {statistics.mean(r['waves']['seconds'] for r in on):.2f} "
            f"| {statistics.mean(r['steps']['seconds'] for r in on):.2f} |"
        )
    out = Path(args.out)
    write_atomic(out / "policy_waves.md", "\n".join(lines) + "\n")
    write_json(out / "policy_waves.json", rows)
    print("\n".join(lines))
    print(f"wrote {out / 'policy_waves.md'} and {out / 'policy_waves.json'}")
    print(json.dumps({str(d): [r["ratio"] for r in rows if r["devices"] == d] for d in device_counts}))


if __name__ == "__main__":
    main()
