"""The placement contract, checked for every registered algorithm: a new algorithm is tested by being registered."""

import json
import subprocess
import sys
from pathlib import Path

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


# Tasks of few rows and few tables, where a split by rows is one block or no other table is placed: found by
# `experiments/random_tasks.py` (`TableSpec(rows, dim, pooling_factor)`, devices, devices per host).
FEW_ROWS = {
    # dreamshard and TorchRec's planner split the one-row table table-row-wise: one block, laid out as the table whole,
    # and the plan was refused as recording otherwise (cost_search's too, from `shard-ray plan` on 16 devices)
    "a one-row table over hosts": ([(1, 4, 1.0), (400_000_000, 128, 1.0), (10_000, 64, 40.0)], 8, 4),
    # cost_search priced the hosts for the only table with no other pieces: a traceback (a stack of no rows)
    "the only table over hosts": ([(7, 4, 0.01)], 4, 2),
    # TorchRec's planner split a table row-wise over its one rank
    "one device": ([(7, 16, 3.0), (3, 4, 100.0), (1, 12, 3.0), (2, 128, 100.0), (1, 4, 0.01)], 1, None),
}


@pytest.mark.parametrize("task", FEW_ROWS)
@pytest.mark.parametrize("name", NAMES)
def test_plans_tasks_of_few_rows_and_few_tables_validly(name, task):
    """Every algorithm plans such a task validly, within memory, and the plan exports to TorchRec."""
    shapes, devices, per_host = FEW_ROWS[task]
    tables = [TableSpec(name=f"t{k}", rows=r, dim=w, pooling_factor=f) for k, (r, w, f) in enumerate(shapes)]
    topology = Topology(num_devices=devices, devices_per_host=per_host, memory_bytes=80 * 1024**3, batch_size=1024)
    plan = place(name, tables, topology, seed=3)
    plan.check(tables)
    assert max(plan.memory_bytes) <= topology.memory_bytes
    export_plan(plan, tables)


BIGGER = ["--max-tables", "300", "--max-devices", "128", "--algorithms", "dreamshard,cost_search"]


@pytest.mark.parametrize("flags", [[], ["--constraints"], BIGGER], ids=["plain", "constraints", "bigger"])
def test_the_random_tasks_benchmark_finds_no_problem_as_documented(tmp_path, flags):
    """`experiments/random_tasks.py` as docs/results.md runs it, on a few tasks: every plan valid, within memory and
    its constraints, exported (the tasks above are three it found problems in); a bad count refused in a line."""
    repo = Path(__file__).resolve().parent.parent
    script = [sys.executable, "experiments/random_tasks.py"]
    done = subprocess.run(
        [*script, "--tasks", "6", "--seed", "4", *flags, "--out", str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "random_tasks.json").read_text())
    names = report["algorithms"]
    assert names == (["dreamshard", "cost_search"] if flags == BIGGER else NAMES)
    assert report["plans"] == 6 * len(names) and report["problems"] == [], report["problems"]
    assert report["infeasible"] < report["plans"]  # plans were made and checked, not every task refused
    assert json.loads(done.stdout.splitlines()[-1])["problems"] == 0
    assert f"wrote {tmp_path / 'random_tasks.md'} and {tmp_path / 'random_tasks.json'}" in done.stdout.splitlines()
    if flags != BIGGER:  # the refusals once: the script imports every algorithm before it reads its flags (2 s)
        return
    for bad, named in ((["--tasks", "0"], "--tasks"), (["--algorithms", "dreamshard,greedy"], "greedy")):
        refused = subprocess.run([*script, *bad], cwd=repo, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1 and named in refused.stderr


@pytest.mark.parametrize("name", NAMES)
def test_refuses_a_task_that_cannot_fit_with_infeasible_error(name, task):
    tables, _ = task
    largest = max(shard_bytes(t, t.dim, "rowwise_adagrad") for t in tables)
    # a cap below the largest table: no table-wise plan fits, and a column split of it would
    # still need at least its per-row optimizer state twice over
    cramped = Topology(num_devices=2, memory_bytes=largest // 8, batch_size=512)
    with pytest.raises(InfeasibleError) as refused:
        place(name, tables, cramped)
    # nor would any other algorithm place it: none is named (neuroshard's refusal sent a walk to cost_search's)
    assert "cost_search also" not in str(refused.value)


def test_a_refusal_names_the_search_that_may_place_the_tables_only_where_one_may():
    """Three tables of 0.73 GiB on 2 devices of 1.1 GiB: placed whole, the third fits nowhere, and the algorithms that
    place tables whole say that `cost_search`, which splits them by rows, may place them; it does. On devices of 0.5
    GiB no algorithm may: none is named (neuroshard's refusal sent a walk to `cost_search`, refused the same)."""
    tables = [TableSpec(name=name, rows=3_000_000, dim=64, pooling_factor=1.0) for name in "abc"]
    fits_split = Topology(num_devices=2, memory_bytes=int(1.1 * 2**30), batch_size=1024)
    for name in ("optimal", "neuroshard", "size_greedy"):
        with pytest.raises(InfeasibleError, match="cost_search also splits others by rows to fit them together"):
            place(name, tables, fits_split)
    place("cost_search", tables, fits_split).check_memory(tables, fits_split)
    for name in ("optimal", "neuroshard", "size_greedy"):
        with pytest.raises(InfeasibleError, match="more than the 2 devices' 1 GiB together$"):
            place(name, tables, fits_split.model_copy(update={"memory_bytes": 2**29}))


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
