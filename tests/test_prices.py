"""The shipped models' prices held against today's measurement of reference plans, on the hardware they were made on;
and where a machine of that name runs at another speed, doctor's check says so and the plans' prices are off with it."""

from pathlib import Path

import numpy as np
import pytest
import torch

from shard_ray.costmodel.models import CostModels, shipped_models_path
from shard_ray.costmodel.simulator import Simulator
from shard_ray.doctor import PRICES_HOLD, PricesCheck, check_prices, time_microbenchmark
from shard_ray.placement import place
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.profiling.fused_shard import measure_fused_shard
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.hardware import hardware_id
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec, load_tables

TABLES = Path(__file__).parents[1] / "experiments" / "tables"
# A file written by hand in the README's minimal format, in no model's training data, whose 4.9 GiB of tables a
# 2-device gang holds whole on a machine of 24 GB: measured as training holds them, not capped (docs/results.md,
# "Prices against measurement", where the files this machine cannot hold whole are priced against capped
# measurements, and the cheap-table files' shortfall is recorded).
REFERENCE_FILES = ("ranking_model.json",)


# A gang's measurement of the same plans moves with the machine, both ways: a gang once measured both plans 1.2x,
# once 1.75x, slower than the others; on the AMD EPYC eight gangs in a row measured the ranking model's cost_search
# plan at 7.9-9.0 ms and one of them at 6.6 ms (priced 1.27x, as a CI run met it). The models are fitted to typical
# gangs, so the median of three gangs judges. Where it misses, two more gangs and the second fastest of the five: a
# host taking CPU time only slows gangs, and CI's run of 2026-12-02 measured that plan at 8.2 and 8.5 ms in two gangs,
# 10.8 in one and 15.1 and 19.3 ms in two (both plans slow together), whose median priced it 0.72x; the second
# fastest of five outvotes one fast gang as it does two slow ones.
GANGS, MORE_GANGS = 3, 2


def judged_steps(measured: list[list[float]]) -> np.ndarray:
    """Each plan's step as the test judges it from the gangs' measurements (one row per gang): the median of three,
    the second fastest of five."""
    if len(measured) <= GANGS:
        return np.median(measured, axis=0)
    return np.sort(measured, axis=0)[1]


def cpu_times() -> np.ndarray:
    """The host's CPU time so far as /proc/stat counts it (user, nice, system, idle, iowait, irq, softirq, steal)."""
    return np.array(Path("/proc/stat").read_text().split("\n")[0].split()[1:9], dtype=float)


def measure_in_gangs(plans, tables, topology, gangs: int) -> list[list[float]]:
    """Each plan's step in each of `gangs` new gangs (5 rounds each: in 3, a repetition moved a plan's median by up
    to 20%, docs/results.md), every table whole."""
    measured = []
    for _ in range(gangs):
        with DeviceGang(2) as gang:
            costs = gang.evaluate_rounds(plans, tables, MeasureConfig.for_topology(topology), rounds=5)
        for cost in costs:
            assert not any("at most" in w for w in cost.warnings), cost.warnings
        measured.append([cost.cost_ms for cost in costs])
    return measured


# A machine of the models' hardware id is not always of their speed, and doctor's check says which way: CI's AMD EPYC
# of 2026-11-29 ran about 2.5x slower than the one the models were made on, the check priced the microbenchmark there
# at a median 0.31x and the ranking model's plans were 0.41-0.42x; CI's machine of 2026-12-02 ran faster, the check
# 1.65x and the cost_search plan 1.44x (docs/results.md, "Prices on machines of other speeds"); CI's Intel Xeon of
# 2026-12-03 had the microbenchmark at a median 1.17x and the plan at 1.34x, where the check's cold-rows shard, timed
# since, priced 1.66x on a machine like it (docs/results.md, "Prices where the caches differ"). Where the check finds
# the prices hold (doctor's PRICES_HOLD), the plans are within a quarter, as the check reads it (0.75-1.33x: the
# fresh clone of 2026-12-06 found the microbenchmark at a median 1.30x and the ranking model's plan at 1.29x, which
# the test's own 1.25 refused where the check had found the prices to hold); where it finds them off, the plans are not
# off the other way, and where the microbenchmark's median is beyond MODELS_SPEED they are off its way by more than a
# quarter (the plans' error grows as about the 0.75th power of the median's, so between PRICES_HOLD and these bounds
# a plan may still be within a quarter).
MODELS_SPEED = (0.6, 1.67)


def expected_price_ratios(check: PricesCheck):
    """What the plans' price over their measurement must be where doctor's check found `check`, and the claim in
    words."""
    median, (low, high) = check.median, PRICES_HOLD  # a quarter either way, as doctor's check reads it
    if check.holds:
        return (lambda ratio: low <= ratio <= high), f"within a quarter ({low}-{high}x)"
    if median < MODELS_SPEED[0]:
        return (lambda ratio: ratio < low), f"below {low}x, as doctor's median {median:.2f}x says"
    if median > MODELS_SPEED[1]:
        return (lambda ratio: ratio > high), f"above {high}x, as doctor's median {median:.2f}x says"
    if check.off < 1:  # the figure the check found off, furthest from 1
        return (lambda ratio: ratio <= high), f"not above {high}x, as doctor finds them low ({check.describe()})"
    return (lambda ratio: ratio >= low), f"not below {low}x, as doctor finds them high ({check.describe()})"


@pytest.mark.slow
@pytest.mark.alone
def test_the_shipped_models_price_reference_plans_within_a_quarter_where_doctor_finds_them_of_this_speed(ray_session):
    shipped = CostModels.load(shipped_models_path(hardware_id(threads=1)))
    if hardware_id(threads=1) != shipped.hardware:
        pytest.skip(f"the shipped models are of {shipped.hardware}, this machine is {hardware_id(threads=1)}")
    check = check_prices(shipped.hardware, time_microbenchmark())  # doctor's
    expected, claim = expected_price_ratios(check)
    simulator = Simulator(shipped)
    for name in REFERENCE_FILES:
        tables = load_tables(TABLES / name)
        topology = Topology(num_devices=2, memory_bytes=memory_cap_with_headroom(tables, 2, 1.5))
        plans = [place(algo, tables, topology, seed=0) for algo in ("cost_search", "size_greedy")]
        priced = np.array([simulator.plan_cost(plan, tables, topology.batch_size).cost_ms for plan in plans])
        before = cpu_times()
        measured = measure_in_gangs(plans, tables, topology, GANGS)
        ratios = priced / judged_steps(measured)
        if not all(expected(ratio) for ratio in ratios):
            measured += measure_in_gangs(plans, tables, topology, MORE_GANGS)
            ratios = priced / judged_steps(measured)
        spent = cpu_times() - before
        for plan, ratio in zip(plans, ratios):
            assert expected(ratio), (
                f"{name}, {plan.algorithm}: priced {ratio:.2f}x its measurement, not {claim} (doctor: "
                f"{check.describe()}; gangs measured {np.round(measured, 2).tolist()} ms; the host stole "
                f"{spent[7] / spent.sum():.0%} of the CPU time meanwhile)"
            )


@pytest.mark.slow
@pytest.mark.alone
def test_the_shipped_models_price_many_small_tables_as_the_kernels_scale():
    """A shard of 128 small tables is priced as the kernels scale from 8, not as the square of its tables: a spine
    fitted to shards of at most 48 tables priced 128 on the Intel Xeon at 4.4x its measurement where 8 were 1.1x
    (docs/cost-models.md, the microbenchmark's many-table shards)."""
    shipped = CostModels.load(shipped_models_path(hardware_id(threads=1)))
    if hardware_id(threads=1) != shipped.hardware:
        pytest.skip(f"the shipped models are of {shipped.hardware}, this machine is {hardware_id(threads=1)}")
    config, threads = MeasureConfig(batch_size=1024), torch.get_num_threads()
    torch.set_num_threads(1)  # as a profiling actor measures
    shards = {
        count: [
            TablePiece.whole(TableSpec(name=f"small{i}", rows=1000, dim=16, pooling_factor=1)) for i in range(count)
        ]
        for count in (8, 128)
    }
    # The two shards in turn, each judged by its fastest, so that a spell of the host falls on both: measured one after
    # the other, the 8 tables (0.24-0.30 ms here) were once priced at 1.67x their measurement and the 128 (4.3-4.9 ms)
    # at 1.05x (a fresh clone's alone pass, 2026-12-03), where they are priced at about 1.2x and 0.97x
    measured: dict[int, list[float]] = {count: [] for count in shards}
    try:
        for _ in range(3):
            for count, pieces in shards.items():
                measured[count].append(measure_fused_shard(pieces, config, "").bwd_ms)
    finally:
        torch.set_num_threads(threads)
    ratios = [float(shipped.predict_fused_shards([shards[c]], 1024)[0, 1]) / min(measured[c]) for c in shards]
    assert 2 / 3 <= ratios[1] / ratios[0] <= 3 / 2, (
        f"backward priced {ratios[0]:.2f}x at 8 tables, {ratios[1]:.2f}x at 128"
    )
