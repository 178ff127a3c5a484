"""Measured side by side: cost_search's plan with a table's column slices left on one device, and joined.

    OMP_NUM_THREADS=1 python experiments/joined_slices.py --rounds 40

The search on the MLPerf DLRM shapes (2 devices of 74 GB, unbudgeted) as it ran before slices
were joined, and the same plan with `joined_columns` applied; both measured on the 2-device gang
in interleaved rounds (a fresh random order each round, the same batches for both), with the
paired per-round ratio. Prints the simulated costs, the medians with their intervals, the ratio.
"""

from __future__ import annotations

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.pricing import Candidate, Pricer
from shard_ray.placement import search
from shard_ray.plan.cost import RoundsSummary
from shard_ray.plan.topology import GB, Topology
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.runtime import connect_ray
from shard_ray.workload.tables import load_tables


def shared_devices(candidate: Candidate) -> int:
    """Tables with two of their slices on one device."""
    seen: dict[str, list[int]] = {}
    for piece, device in zip(candidate.pieces, candidate.assign):
        seen.setdefault(piece.table.name, []).append(int(device))
    return sum(len(devices) != len(set(devices)) for devices in seen.values())


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default="experiments/tables/mlperf_dlrm_dcnv2.json")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    tables = load_tables(args.tables)
    topology = Topology(num_devices=2, memory_bytes=74 * GB)
    pricer = Pricer(CostModels.load(default_cost_model_path()), topology)
    join = search.joined_columns
    search.joined_columns = lambda _pricer, candidate: candidate  # the search as it ran before
    separate, _ = search.beam_search(pricer, tables, search.SearchConfig(max_evaluations=None))
    search.joined_columns = join
    candidates = {"slices as searched": separate, "joined": join(pricer, separate)}
    for name, c in candidates.items():
        print(f"{name}: simulated {c.cost:.3f} ms, {shared_devices(c)} tables with slices sharing a device")
    print(connect_ray(min_cpus=2))
    plans = {name: c.plan(2, name) for name, c in candidates.items()}
    names = list(plans)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    config = MeasureConfig(batch_size=1024, warmup=2, repeats=10)
    order = np.random.default_rng(0)
    with DeviceGang(2) as gang:
        for r in range(args.rounds):
            measure = config.model_copy(update={"seed": r})
            for i in order.permutation(len(names)):
                rounds[names[i]].append(gang.evaluate(plans[names[i]], tables, measure).cost_ms)
    for name, values in rounds.items():
        print(f"{name}: {RoundsSummary.of(values).describe()}")
    ratios = [a / b for a, b in zip(rounds[names[0]], rounds[names[1]])]
    summary = RoundsSummary.of(ratios)
    print(
        f"{names[0]} / {names[1]} per round: {summary.median_ms:.3f}, "
        f"{summary.coverage:.0%} CI [{summary.ci_low_ms:.3f}, {summary.ci_high_ms:.3f}]"
    )


if __name__ == "__main__":
    main()
