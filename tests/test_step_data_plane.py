"""The training step's data plane without Ray: each rank of a plan is a process of its own, joined to the others by
torch.distributed's gloo (real all-to-alls), running `PlanStep.values`, what a gang's member runs.

What is checked is the step's bookkeeping: which columns each device sends whom (sharding type by sharding type),
the lookups each device gathers, row-wise partial sums added up, table-row-wise sums inside a host (`HostSums`) and
the gradients going back the same way. One step of a plan from the same initial weights gives the pooled embeddings
and the updated weights one unsharded table gives. A gang of Ray actors runs the same code
(tests/test_ray_measurement.py checks it once there); here a plan takes a few seconds on 2 cores, not a gang's start.
"""

from __future__ import annotations

import datetime
import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from unsharded import assert_trains_as_one_unsharded_table, every_sharding_type_plan, sgd_step

from shard_ray.plan import Plan, Shard
from shard_ray.plan.plan import PlanSettings
from shard_ray.profiling.plan_step import PlanStep
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec

# Ranks are forked from a server process that imported the step's modules once (it runs no threads, so forking it
# is safe, unlike forking a test worker that has Ray's); a rank then starts in milliseconds.
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["torch", "shard_ray.profiling.gang"])


def _member(rank: int, world: int, rendezvous: str, by_device, tables, config, results) -> None:
    """Rank `rank` of a gloo group of `world`: one step of the plan as a gang's member runs it; its embeddings and
    weights as numpy (a tensor sent through a queue would be shared memory its exiting process takes away)."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        value = PlanStep(by_device, tables, rank, config, torch.device("cpu"), [2**40] * world).values()
        dist.destroy_process_group()
        results.put((rank, value["embeddings"].numpy(), [w.numpy() for w in value["weights"]], None))
    except BaseException:
        results.put((rank, None, None, traceback.format_exc()))


def step_values_without_ray(plan: Plan, tables: list[TableSpec], config: MeasureConfig, folder: Path) -> list[dict]:
    """Every rank's `PlanStep.values` of `plan`, each rank a process, in rank order."""
    by_device = plan.pieces(tables)
    world = plan.num_devices
    results = FORKSERVER.Queue()
    rendezvous = f"file://{folder / 'rendezvous'}"
    ranks = [
        FORKSERVER.Process(target=_member, args=(rank, world, rendezvous, by_device, tables, config, results))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    try:
        got = [results.get(timeout=120) for _ in ranks]
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [error for *_, error in got if error]
    assert not errors, errors[0]
    return [
        {"embeddings": torch.from_numpy(embeddings), "weights": [torch.from_numpy(w) for w in weights]}
        for _, embeddings, weights, _ in sorted(got, key=lambda item: item[0])
    ]


def test_every_sharding_type_trains_as_one_unsharded_table(small_tables, tmp_path):
    """On 2 devices, table-, column-, row-wise, a grid and data-parallel give the pooled embeddings and the updated
    weights one unsharded table gives for the same batch."""
    tables, plan = every_sharding_type_plan(small_tables)
    config = sgd_step(seed=3)
    assert_trains_as_one_unsharded_table(step_values_without_ray(plan, tables, config, tmp_path), plan, tables, config)


def test_table_row_wise_sums_inside_hosts_and_trains_as_one_unsharded_table(small_tables, tmp_path):
    """On 4 devices of 2 hosts, table-row-wise tables (on both hosts, two on one) are added up inside their host and
    sent on in column slices, beside row-wise, column-wise and table-wise tables: the pooled embeddings and updated
    weights are one unsharded table's for the same batch."""
    tables = [*small_tables, TableSpec(name="few", rows=3, dim=12, pooling_factor=3.0)]
    shards = [
        Shard(table="a", device=2, columns=(0, 32), rows=(0, 2500)),  # table-row-wise on host 1
        Shard(table="a", device=3, columns=(0, 32), rows=(2500, 5000)),
        Shard(table="b", device=0, columns=(0, 32)),
        Shard(table="b", device=3, columns=(32, 64)),
        Shard(table="c", device=0, columns=(0, 16), rows=(0, 400)),  # fp16, table-row-wise on host 0
        Shard(table="c", device=1, columns=(0, 16), rows=(400, 800)),
        *[Shard(table="d", device=k, columns=(0, 32), rows=(k * 25000, (k + 1) * 25000)) for k in range(4)],  # row-wise
        Shard(table="e", device=1, columns=(0, 8)),
        Shard(table="few", device=2, columns=(0, 12), rows=(0, 2)),  # table-row-wise on host 1, slices of 6 columns
        Shard(table="few", device=3, columns=(0, 12), rows=(2, 3)),
    ]
    plan = Plan(num_devices=4, algorithm="twrw", shards=shards)
    plan.settings = PlanSettings(memory_gb=1, batch_size=96, optimizer="sgd", devices_per_host=2)
    kinds = {name: sharding.type for name, sharding in plan.table_shardings(tables).items()}  # a hand-written plan
    assert kinds == {
        "a": "table_row_wise", "b": "column_wise", "c": "table_row_wise", "d": "row_wise", "e": "table_wise",
        "few": "table_row_wise",
    }  # fmt: skip
    config = sgd_step(seed=5)
    assert_trains_as_one_unsharded_table(step_values_without_ray(plan, tables, config, tmp_path), plan, tables, config)


@pytest.mark.parametrize("world", [3, 5])
def test_uneven_samples_and_devices_without_work_train_as_one_unsharded_table(small_tables, tmp_path, world):
    """Batches that do not divide by the devices (96 samples over 5) and devices holding no more than a row block and
    a replica still exchange every column they owe: the step is one unsharded table's."""
    shards = [
        Shard(table="a", device=0, columns=(0, 32)),
        Shard(table="b", device=1, columns=(0, 40)),
        Shard(table="b", device=world - 1, columns=(40, 64)),
        *[Shard(table="c", device=k, columns=(0, 16), rows=(k * 800 // world, (k + 1) * 800 // world)) for k in range(world)],
        Shard(table="d", device=1, columns=(0, 32)),
        *[Shard(table="e", device=k, columns=(0, 8), replicated=True) for k in range(world)],
    ]  # fmt: skip
    plan = Plan(num_devices=world, algorithm="uneven", shards=shards)
    config = sgd_step(seed=7)
    assert_trains_as_one_unsharded_table(step_values_without_ray(plan, small_tables, config, tmp_path), plan, small_tables, config)  # fmt: skip


def test_a_device_holding_nothing_still_takes_part_in_the_step(small_tables, tmp_path):
    """A device with no piece receives its samples' embeddings and sends its samples' gradients all the same."""
    shards = [
        Shard(table="a", device=0, columns=(0, 32)),
        Shard(table="b", device=0, columns=(0, 32)),
        Shard(table="b", device=1, columns=(32, 64)),
        *[Shard(table=t, device=1, columns=(0, dim)) for t, dim in (("c", 16), ("d", 32), ("e", 8))],
    ]
    plan = Plan(num_devices=3, algorithm="one-empty", shards=shards)
    config = sgd_step(seed=11)
    values = step_values_without_ray(plan, small_tables, config, tmp_path)
    assert values[2]["weights"] == [] and values[2]["embeddings"].shape == (32, sum(t.dim for t in small_tables))
    assert_trains_as_one_unsharded_table(values, plan, small_tables, config)
