"""The placement contract, checked for every registered algorithm: a new algorithm is tested by being registered."""

import pytest

from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.interop.torchrec import export_plan
from shard_ray.placement import algorithms, place
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom, shard_bytes
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec

NAMES = [info.name for info in algorithms()]


@pytest.fixture(scope="module")
def task():
    tables = generate_pool(PoolConfig(num_tables=10, seed=4))
    return tables, Topology(num_devices=3, memory_bytes=memory_cap_with_headroom(tables, 3, 3.0), batch_size=512)


def test_the_registry_holds_every_family():
    assert {info.family for info in algorithms()} >= {"heuristic", "search", "exact", "rl", "planner"}


@pytest.mark.parametrize("name", NAMES)
def test_plans_a_small_task_validly_within_memory_and_names_itself(name, task):
    tables, topology = task
    plan = place(name, tables, topology, seed=3)
    assert isinstance(plan, Plan) and plan.algorithm == name and plan.num_devices == topology.num_devices
    plan.check(tables)
    assert max(plan.memory_bytes) <= topology.memory_bytes
    assert plan.memory_bytes == plan.device_memory_bytes(tables, topology)
    assert plan.settings.seed == 3 and plan.settings.memory_gb == pytest.approx(topology.memory_gb)
    if plan.estimate is not None:  # planned with the cost models: never below the task's lower bound
        assert plan.estimate.predicted.cost_ms >= plan.estimate.lower_bound_ms - 1e-6
        assert plan.estimate.hardware and plan.estimate.cost_model.endswith(".pt")
    assert Plan.model_validate_json(plan.model_dump_json()) == plan  # the file format keeps everything


@pytest.mark.parametrize("name", NAMES)
def test_plans_tables_of_a_few_rows_over_hosts_validly(name):
    """A table of one row beside a huge one and another, over two hosts of four devices: split by rows, a table of one
    row is one block, laid out as the table whole, and plans recording it table-row-wise (`dreamshard`'s, TorchRec's
    planner's; `cost_search`'s from `shard-ray plan` on 16 devices) were refused as laid out otherwise. Every plan is
    valid and exports to TorchRec."""
    tables = [
        TableSpec(name="one", rows=1, dim=4, pooling_factor=1.0),
        TableSpec(name="huge", rows=400_000_000, dim=128, pooling_factor=1.0),
        TableSpec(name="mid", rows=10_000, dim=64, pooling_factor=40.0),
    ]
    topology = Topology(num_devices=8, devices_per_host=4, memory_bytes=80 * 1024**3, batch_size=1024)
    plan = place(name, tables, topology, seed=3)
    plan.check(tables)
    assert max(plan.memory_bytes) <= topology.memory_bytes
    export_plan(plan, tables)


@pytest.mark.parametrize("name", NAMES)
def test_refuses_a_task_that_cannot_fit_with_infeasible_error(name, task):
    tables, _ = task
    largest = max(shard_bytes(t, t.dim, "rowwise_adagrad") for t in tables)
    # a cap below the largest table: no table-wise plan fits, and a column split of it would
    # still need at least its per-row optimizer state twice over
    cramped = Topology(num_devices=2, memory_bytes=largest // 8, batch_size=512)
    with pytest.raises(InfeasibleError):
        place(name, tables, cramped)


@pytest.mark.parametrize("name", NAMES)
def test_refuses_settings_it_does_not_take(name, task):
    tables, topology = task
    with pytest.raises(ShardRayError, match=name):
        place(name, tables, topology, settings={"no_such_setting": 1})


def test_old_plan_files_are_read_into_typed_settings_and_estimate():
    old = {
        "num_devices": 2,
        "algorithm": "cost_search",
        "shards": [{"table": "a", "device": 0, "columns": [0, 16]}],
        "metadata": {
            "settings": {
                "memory_gb": 1.0,
                "batch_size": 512,
                "optimizer": "sgd",
                "seed": 2,
                "cost_model": "m.pt",
                "cost_model_hardware": "cpu-x",
                "search_config": "best.json",
            },
            "memory_bytes": [64000, 0],
            "predicted": {
                "devices": [
                    {"device": 0, "fwd_compute_ms": 1.0, "fwd_comm_ms": 0.5, "bwd_comm_ms": 0.5, "bwd_compute_ms": 2.0}
                ],
                "hardware": "simulated:cpu-x",
            },
            "predicted_cost_ms": 4.0,
            "lower_bound_ms": 3.5,
            "proven_optimal": True,
        },
    }
    plan = Plan.model_validate(old)
    assert (plan.settings.memory_gb, plan.settings.batch_size, plan.settings.seed) == (1.0, 512, 2)
    assert plan.settings.source == "best.json" and plan.memory_bytes == [64000, 0]
    assert plan.estimate.predicted.cost_ms == 4.0 and plan.estimate.lower_bound_ms == 3.5
    assert (plan.estimate.cost_model, plan.estimate.hardware, plan.search.proven_optimal) == ("m.pt", "cpu-x", True)
    assert plan.metadata == {}
