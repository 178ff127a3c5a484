"""Benchmark: how far below the policy's prior a search or sampling places tables, by memory cap, simulated.

    OMP_NUM_THREADS=1 python experiments/policy_headroom.py --rows-log-sigma 0.7 --tables 64-128 --memory 1.02,1.1
    OMP_NUM_THREADS=1 python experiments/policy_headroom.py --tables 80-120 --memory 1.05,1.2,1.65 --large
    OMP_NUM_THREADS=1 python experiments/policy_headroom.py --devices 4 --tables 10-12 --memory 1.3 --tasks 8 --optimal

The policy issue asks training to price 5% below the untrained network, whose prior is the cost models' greedy
choice: this shows whether any method here finds plans that far below it. Tasks of `--tables` tables drawn (seed
`--seed`) from the held-out half of the synthetic pool (`generate_pool`, its rows' log-normal spread
`--rows-log-sigma`: 2.0, the default pool's, makes a few tables far larger than the rest; 0.7 keeps them within about
an order of magnitude, so that a cap near an even split binds every device), on `--devices` devices whose memory is
each `--memory` times an even split (never below 1.05x the largest table: `memory_cap_with_headroom`). On each task:
the untrained network (the prior), the shipped policy, its best of 16 samples, `cost_search` with its defaults and,
with `--large`, a larger `cost_search` (beam 6 by 5, 6 branches, 3,000 local-search steps, 5,000,000 evaluations);
with `--optimal` (tasks of at most 14 tables), the best table-wise plan under the models (`optimal`, branch and bound;
a task where its budget ran out is counted in the last column): what foresight can win over the greedy steps
where no table is split; with `--rollouts`, one step of policy improvement on the prior (`improved_by_rollouts`: each
step the option after which the prior finishes the cheapest plan): what a policy trained to improve on its prior
reaches in one step of improvement (docs/results.md).
Each plan priced by the shipped models over the task's lower bound; the mean over tasks. Writes `policy_headroom.md`
and `policy_headroom.json` to `--out`; the last printed line is JSON.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.errors import InfeasibleError
from shard_ray.io import write_atomic, write_json
from shard_ray.placement import place
from shard_ray.placement.exact import MAX_TABLES
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.policy.decode import best_option, play_on
from shard_ray.policy.env import PlacementState
from shard_ray.policy.network import OptionScorer, save_policy
from shard_ray.policy.policy_file import DecodingScorer, PolicyInfo
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec
from shard_ray.workload.tasks import TaskConfig, draw_task, split_pool

# The prior's rollouts: what one step of policy improvement on the prior reaches (`--rollouts`).


def _copy(state: PlacementState) -> PlacementState:
    """A copy of `state` to play on, sharing its models and their pricer (read only)."""
    return copy.deepcopy(state, {id(state.models): state.models, id(state.pricer): state.pricer})


def prior_finish(prior: DecodingScorer, state: PlacementState) -> float:
    """The predicted cost of the plan the prior finishes from `state` (left as it is), as greedy decoding plays it;
    inf where it gets stuck."""
    ahead = play_on(prior, _copy(state))
    return ahead.cost if ahead.done else math.inf


def improved_by_rollouts(
    prior: DecodingScorer, tables: list[TableSpec], topology: Topology, models: CostModels
) -> Plan:
    """The plan of one step of policy improvement on the prior (rollouts): each step the option after which the prior
    finishes the cheapest plan (`prior_finish`), the prior's own where it ties: no worse than the prior's plan."""
    state = PlacementState(tables, topology, models)
    while not state.done:
        if state.stuck():
            raise InfeasibleError(f"the prior's rollouts found no room for {state.piece.describe()}")
        own = best_option(prior.logits(state.observation()))
        finished = {}
        for slot in np.flatnonzero(state.option_mask()).tolist():
            ahead = _copy(state)
            ahead.take(slot)
            finished[slot] = prior_finish(prior, ahead)
        best = min(finished.values())
        state.take(own if finished[own] <= best else min(finished, key=finished.__getitem__))
    return state.plan("rollouts")


LARGE = {"beam_width": 6, "beam_depth": 5, "branching": 6, "local_search_steps": 3000, "max_evaluations": 5_000_000}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=16, help="devices of every task (default %(default)s)")
    parser.add_argument("--tables", default="64-128", help="fewest-most tables of a task (default %(default)s)")
    parser.add_argument(
        "--memory", default="1.02,1.1", help="caps over an even split, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--rows-log-sigma", type=float, default=2.0, help="the pool's spread of rows (default %(default)s)"
    )
    parser.add_argument("--tasks", type=int, default=5, help="tasks a cap (default %(default)s)")
    parser.add_argument("--seed", type=int, default=7, help="the tasks' draw (default %(default)s)")
    parser.add_argument("--large", action="store_true", help="also the larger cost_search")
    parser.add_argument("--optimal", action="store_true", help="also the best table-wise plan (at most 14 tables)")
    parser.add_argument("--rollouts", action="store_true", help="also the prior improved by its rollouts")
    parser.add_argument(
        "--out",
        type=a_folder_to_write,
        default="experiments/results/policy_headroom",
        help="folder (default %(default)s)",
    )
    args = parser.parse_args()
    try:
        fewest, most = map(int, args.tables.split("-"))
    except ValueError:
        parser.error(f"--tables {args.tables}: give FEWEST-MOST, two whole numbers (e.g. 64-128)")
    try:
        caps = [float(c) for c in args.memory.split(",")]
    except ValueError:
        parser.error(f"--memory {args.memory}: give caps over an even split, numbers comma-separated (e.g. 1.02,1.1)")
    if not 1 <= fewest <= most:
        parser.error(f"--tables {args.tables}: give 1 <= FEWEST <= MOST")
    if not all(math.isfinite(c) and c >= 1 for c in caps):
        parser.error(f"--memory {args.memory}: every cap at least 1 (below an even split the tables do not fit)")
    if args.optimal and most > MAX_TABLES:
        parser.error(f"--optimal --tables {args.tables}: branch and bound takes at most {MAX_TABLES} tables")
    if args.tasks < 1 or args.devices < 2:
        parser.error(f"--tasks {args.tasks} --devices {args.devices}: give 1 or more tasks and 2 or more devices")

    models = CostModels.load(default_cost_model_path())
    simulator = Simulator(models)
    _, pool = split_pool(generate_pool(PoolConfig(rows_log_sigma=args.rows_log_sigma)), 0.5, 0)
    folder = tempfile.TemporaryDirectory(prefix="untrained-policy-")  # removed when the script ends
    untrained = Path(folder.name) / "untrained.pt"
    torch.manual_seed(0)
    network = OptionScorer()
    save_policy(untrained, network, PolicyInfo(iterations=0))
    entries = [
        ("prior", "dreamshard", {"policy": str(untrained)}),
        ("shipped policy", "dreamshard", {}),
        ("its best of 16 samples", "dreamshard", {"samples": 16}),
        ("cost_search", "cost_search", {}),
    ] + ([("the larger search", "cost_search", LARGE)] if args.large else [])
    # branch and bound given a billion model evaluations, about the 2 million nodes it had before its budget counted
    # them (its default, about a minute at 8 devices, is for a user's `plan`)
    entries += [("best table-wise", "optimal", {"max_evaluations": 1_000_000_000})] if args.optimal else []
    rollouts = partial(improved_by_rollouts, DecodingScorer.of_network(network))
    entries += [("the prior's rollouts", rollouts, {})] if args.rollouts else []
    results: dict[str, dict[str, list[float | None]]] = {}
    floored: dict[str, int] = {}  # tasks a cap whose cap `memory_cap_with_headroom` raised to its floor
    unproven: dict[str, int] = {}  # tasks a cap where branch and bound's budget ran out
    for cap in caps:
        rng = np.random.default_rng(args.seed)
        results[str(cap)] = {label: [] for label, _, _ in entries}
        floored[str(cap)] = unproven[str(cap)] = 0
        for task in range(args.tasks):
            tables = draw_task(pool, TaskConfig(min_tables=fewest, max_tables=most), rng)
            memory = memory_cap_with_headroom(tables, args.devices, cap)
            floored[str(cap)] += memory == memory_cap_with_headroom(tables, args.devices, 0.0)  # the floor alone
            topology = Topology(num_devices=args.devices, memory_bytes=memory, batch_size=1024)
            bound = lower_bound_ms(models, tables, topology)
            for label, algorithm, settings in entries:
                try:
                    plan = (
                        algorithm(tables, topology, models)
                        if callable(algorithm)
                        else place(algorithm, tables, topology, settings=settings)
                    )
                    unproven[str(cap)] += algorithm == "optimal" and not (plan.search and plan.search.proven_optimal)
                    ratio = simulator.plan_cost(plan, tables, topology.batch_size).cost_ms / bound
                except InfeasibleError:
                    ratio = None
                results[str(cap)][label].append(ratio)
            row = {label: None if r[-1] is None else round(r[-1], 3) for label, r in results[str(cap)].items()}
            print(f"memory {cap}x, task {task} ({len(tables)} tables): {row}", flush=True)

    def mean(ratios: list[float | None]) -> str:
        placed = [r for r in ratios if r is not None]
        failed = len(ratios) - len(placed)
        return (f"{statistics.mean(placed):.3f}" if placed else "—") + (f" ({failed} failed)" if failed else "")

    tasks = f"{args.tasks} task" + ("s" if args.tasks > 1 else "")
    lines = [
        f"Simulated cost over the lower bound, the mean of {tasks} of {args.tables} held-out tables (seed {args.seed}, "
        f"the pool's rows' log sigma {args.rows_log_sigma}) on {args.devices} devices. A cap is never below 1.05x the "
        "task's largest table: the last column counts the tasks where that floor, not the cap asked for, set it.",
        "",
        "| memory over an even split | "
        + " | ".join(label for label, _, _ in entries)
        + " | cap at the floor |"
        + (" optimum unproven |" if args.optimal else ""),
        "|---|" + "---:|" * (len(entries) + 1 + args.optimal),
    ]
    lines += [
        f"| {cap} | "
        + " | ".join(mean(r) for r in by.values())
        + f" | {floored[cap]} of {args.tasks} |"
        + (f" {unproven[cap]} of {args.tasks} |" if args.optimal else "")
        for cap, by in results.items()
    ]
    out = Path(args.out)
    write_atomic(out / "policy_headroom.md", "\n".join(lines) + "\n")
    write_json(
        out / "policy_headroom.json",
        {"settings": vars(args), "ratios": results, "at_the_floor": floored, "optimum_unproven": unproven},
    )
    print("\n".join(lines))
    print(f"wrote {out / 'policy_headroom.md'} and {out / 'policy_headroom.json'}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
