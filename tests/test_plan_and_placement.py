import json

import pytest

from shard_ray.errors import ShardRayError
from shard_ray.placement import algorithms, place
from shard_ray.placement.heuristics import PROXIES
from shard_ray.plan import GB, Plan, Shard, Topology, load_plan, save_plan, shard_bytes
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.summary import format_plan_summary
from shard_ray.workload.tables import TableSpec

BASELINES = {"random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy"}


def test_memory_model():
    t = TableSpec(name="t", rows=1000, dim=64, pooling_factor=1.0)
    assert shard_bytes(t, 64, "sgd") == 1000 * 64 * 4
    assert shard_bytes(t, 64, "rowwise_adagrad") == 1000 * 64 * 4 + 1000 * 4
    assert shard_bytes(t, 32, "rowwise_adagrad") == 1000 * 32 * 4 + 1000 * 4  # state per row per shard
    assert shard_bytes(t, 64, "adam") == 1000 * 64 * 4 * 3
    assert shard_bytes(t.model_copy(update={"precision": "fp16"}), 64, "sgd") == 1000 * 64 * 2


def test_plan_file_round_trip_and_format(tmp_path):
    plan = Plan(
        num_devices=2,
        algorithm="x",
        placement_seconds=0.5,
        shards=[Shard(table="a", device=1, columns=(0, 16)), Shard(table="a", device=0, columns=(16, 32))],
        metadata={"note": 1},
    )
    path = tmp_path / "plan.json"
    save_plan(path, plan)
    doc = json.loads(path.read_text())
    assert doc["shards"][0] == {"table": "a", "device": 1, "columns": [0, 16]}
    assert {"num_devices", "algorithm", "placement_seconds", "shards"} <= set(doc)
    assert load_plan(path) == plan


@pytest.mark.parametrize(
    "shards, message",
    [
        ([("a", 0, 0, 32), ("zz", 0, 0, 4)], "not in the table file"),
        ([("a", 2, 0, 32)], "device 2"),
        ([("a", 0, 0, 16)], "cover 16 of its 32"),
        ([("a", 0, 0, 16), ("a", 1, 8, 32)], "overlap"),
        ([("a", 0, 0, 8), ("a", 1, 16, 32)], "gap"),
    ],
)
def test_plan_check(shards, message):
    tables = [TableSpec(name="a", rows=10, dim=32, pooling_factor=1.0)]
    plan = Plan(
        num_devices=2, algorithm="x", shards=[Shard(table=t, device=d, columns=(s, e)) for t, d, s, e in shards]
    )
    with pytest.raises(ShardRayError, match=message):
        plan.check(tables)


def test_plan_check_names_unplaced_tables(small_tables):
    plan = Plan(num_devices=1, algorithm="x", shards=[Shard(table="a", device=0, columns=(0, 32))])
    with pytest.raises(ShardRayError, match="does not place table 'b'"):
        plan.check(small_tables)


def test_shard_columns_validated():
    with pytest.raises(ValueError):
        Shard(table="a", device=0, columns=(8, 8))
    with pytest.raises(ValueError):
        Shard(table="a", device=0, columns=(0, 6))


def test_registry_has_the_baselines():
    assert BASELINES <= {a.name for a in algorithms()}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_gives_a_valid_plan_within_memory(name, small_tables):
    sizes = [shard_bytes(t, t.dim, "rowwise_adagrad") for t in small_tables]
    # room for the largest table plus a little: memory decides where the rest can go
    topology = Topology(num_devices=3, memory_bytes=max(sizes) + sum(sizes) // 10)
    plan = place(name, small_tables, topology, seed=1)
    plan.check(small_tables)
    assert max(plan.device_memory_bytes(small_tables, topology)) <= topology.memory_bytes
    assert plan.algorithm == name and plan.placement_seconds > 0
    assert plan.settings.memory_gb == pytest.approx(topology.memory_gb)


def test_greedy_balances_its_proxy():
    tables = [
        TableSpec(name=f"t{i}", rows=100, dim=dim, pooling_factor=1.0)
        for i, dim in enumerate([64, 32, 32, 16, 16, 16, 16])
    ]
    plan = place("dim_greedy", tables, Topology(num_devices=2, memory_bytes=GB))
    dims = [sum(s.width for s in plan.shards_on(d)) for d in range(2)]
    assert dims == [96, 96]


def test_greedy_respects_memory_before_balance():
    big = TableSpec(name="big", rows=1_000_000, dim=4, pooling_factor=100.0)
    small = [TableSpec(name=f"s{i}", rows=100, dim=4, pooling_factor=1.0) for i in range(3)]
    cap = shard_bytes(big, 4, "rowwise_adagrad") + 100
    plan = place("lookup_greedy", [big, *small], Topology(num_devices=2, memory_bytes=cap))
    device_of_big = next(s.device for s in plan.shards if s.table == "big")
    assert all(s.device != device_of_big for s in plan.shards if s.table != "big")


def test_infeasible_memory_is_a_clear_error(small_tables):
    with pytest.raises(ShardRayError, match="no device has that much free"):
        place("size_greedy", small_tables, Topology(num_devices=2, memory_bytes=1000))


def test_unknown_algorithm(small_tables):
    with pytest.raises(ShardRayError, match="unknown algorithm 'magic'"):
        place("magic", small_tables, Topology(num_devices=2, memory_bytes=GB))


def test_random_is_seeded(small_tables):
    topology = Topology(num_devices=4, memory_bytes=GB)
    assert (
        place("random", small_tables, topology, seed=7).shards == place("random", small_tables, topology, seed=7).shards
    )


def test_proxies_order_tables_as_published():
    a = TableSpec(name="a", rows=10**6, dim=16, pooling_factor=10.0)
    b = TableSpec(name="b", rows=10**3, dim=32, pooling_factor=4.0)
    assert PROXIES["size_greedy"][0](a) > PROXIES["size_greedy"][0](b)
    assert PROXIES["dim_greedy"][0](a) < PROXIES["dim_greedy"][0](b)
    assert PROXIES["lookup_greedy"][0](a) > PROXIES["lookup_greedy"][0](b)
    assert PROXIES["size_lookup_greedy"][0](a) == pytest.approx(16 * 10 * 6)


def test_check_memory_refuses_overfull_plans(small_tables):
    plan = Plan(
        num_devices=1, algorithm="x", shards=[Shard(table=t.name, device=0, columns=(0, t.dim)) for t in small_tables]
    )
    with pytest.raises(ShardRayError, match="over the cap"):
        plan.check_memory(small_tables, Topology(num_devices=1, memory_bytes=10_000))


def test_cost_is_the_slowest_device_and_summary_marks_it(small_tables):
    cost = PlanCost(
        devices=[
            DeviceCost(device=0, fwd_compute_ms=1, fwd_comm_ms=1, bwd_comm_ms=1, bwd_compute_ms=1),
            DeviceCost(device=1, fwd_compute_ms=3, fwd_comm_ms=0, bwd_comm_ms=0, bwd_compute_ms=2),
        ]
    )
    assert cost.cost_ms == 5 and cost.bottleneck_device == 1
    assert cost.model_dump()["devices"][0]["total_ms"] == 4
    topology = Topology(num_devices=2, memory_bytes=GB)
    plan = place("round_robin", small_tables, topology)
    text = format_plan_summary(plan, small_tables, topology, cost)
    assert "<- slowest" in text.splitlines()[3] and "5.000 ms" in text
