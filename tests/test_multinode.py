"""Several Ray nodes on this machine, each with its own raylet and resources (Ray's own
`ray.cluster_utils.Cluster`): the profiling pool spreads over them, a gang spans hosts, and
losing a node mid-run loses no measurement."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from console import shard_ray_here

from shard_ray.costmodel.simulator import price_comm
from shard_ray.placement import place
from shard_ray.plan.topology import GB, Topology
from shard_ray.profiling.procedure import MeasureConfig, fused_shard_key
from shard_ray.profiling.sampling import draw_fused_shards
from shard_ray.profiling.store import MeasurementStore, plan_key

# Clusters, jobs, sweeps and killed runs: minutes each, left out of `make test-fast`.
# one worker runs the module: its tests share one cluster (`cluster`), which a second worker would start again
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

SHARD_RAY = str(Path(sys.executable).parent / "shard-ray")
NODE_CPUS = 2
# Shards of about half a second, so a node removed after the first results lands mid-run.
SLOW = MeasureConfig(batch_size=4096, warmup=2, repeats=30)


# Each node's dashboard agent on a port of its own: on one machine every node after the first found Ray's fixed 52365
# taken and retried it for 3.3 s (`shard_ray.runtime.dashboard_agent_on_any_port`).
ANY_AGENT_PORT = {"dashboard_agent_listen_port": 0}


def _add_worker(cluster):
    return cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=80 * 1024**2, **ANY_AGENT_PORT)


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (nothing runs where the cluster's state lives) and three worker nodes of two CPUs."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the suite's local Ray, if a test before this module started one
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 80 * 1024**2,
            "include_dashboard": False,
            # A lost node is declared dead after 3 missed half-second health checks (Ray's default: 5 of 3 s).
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
            **ANY_AGENT_PORT,
        },
    )
    try:
        for _ in range(3):
            _add_worker(cluster)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of(actor) -> str:
    import ray

    if hasattr(actor, "host"):  # a gang member
        return ray.get(actor.host.remote())["node"]
    return ray.get(actor.node.remote())


def _remove_node_of(cluster, node_id: str) -> None:
    """Kill the raylet (and every worker process) of the node with this id, as a lost host; returns once
    the cluster has marked it dead."""
    import ray

    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.time() + 60
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        assert time.time() < deadline, "the removed node is still alive after 60 s"
        time.sleep(0.2)


@pytest.mark.slow(seconds=40)
def test_profiling_spreads_over_nodes_and_survives_losing_one(cluster, tmp_path, small_tables):
    from shard_ray.profiling.actors import ProfilingPool

    shards = draw_fused_shards(small_tables, count=12, max_tables=4, seed=5)
    distinct = {fused_shard_key(s, SLOW, "") for s in shards}
    db = tmp_path / "store.db"
    removed: list[int] = []  # shards stored when the node went
    with ProfilingPool(num_actors=3) as pool:
        nodes = [_node_of(a) for a in pool.actors]
        assert len(set(nodes)) == 3, nodes  # one actor per node

        def remove_a_node() -> None:
            with MeasurementStore(db) as watcher:
                while watcher.count() < 2:
                    time.sleep(0.05)
                removed.append(watcher.count())
                _remove_node_of(cluster, nodes[0])

        killer = threading.Thread(target=remove_a_node, daemon=True)
        with MeasurementStore(db) as store:
            killer.start()
            results = pool.measure(shards, SLOW, store, progress=False)
            killer.join(timeout=60)
            assert removed and removed[0] < len(distinct), removed  # the node went while shards were left
            assert all(r is not None and r.status == "ok" for r in results)
            assert store.count() == len(distinct)  # every distinct shard, exactly once
        survivors = {_node_of(a) for a in pool.actors}
        assert nodes[0] not in survivors
    _add_worker(cluster)
    cluster.wait_for_nodes()


def test_gang_spans_hosts_records_them_and_survives_losing_a_node(cluster, small_tables):
    from shard_ray.profiling.gang import DeviceGang

    topology = Topology(num_devices=4, memory_bytes=GB, devices_per_host=2)
    plans = [place(name, small_tables, topology) for name in ("size_greedy", "lookup_greedy", "round_robin")]
    config = MeasureConfig(batch_size=1024, warmup=1, repeats=3)
    # 4 devices on a 2-core machine, whatever its nodes: compute takes turns, the all-to-alls are priced
    with DeviceGang(4, devices_per_host=2, comm_pricer=price_comm) as gang:
        assert gang.hosts == [0, 0, 1, 1]
        assert gang.take_turns == (len(os.sched_getaffinity(0)) < 4)
        nodes = [_node_of(m) for m in gang.members]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        cost = gang.evaluate(plans[0], small_tables, config)
        assert cost.hosts == [0, 0, 1, 1]
        # A plan measured across hosts is not the same measurement as on one host.
        assert gang.plan_key(plans[0], small_tables, config) != plan_key(plans[0], small_tables, config, gang.hardware)

        _remove_node_of(cluster, nodes[0])
        costs = [gang.evaluate(plan, small_tables, config) for plan in plans]
        assert gang.restarts >= 1
        assert all(c.hosts == [0, 0, 1, 1] for c in costs)
        assert nodes[0] not in {_node_of(m) for m in gang.members}
        assert all(d.fwd_compute_ms > 0 and d.fwd_comm_ms > 0 for c in costs for d in c.devices)
    _add_worker(cluster)
    cluster.wait_for_nodes()


def test_plan_measure_and_export_on_hosts_as_a_user_types_them(cluster, capsys, monkeypatch, tmp_path, table_file):
    """The commands a user types on a head, run in this process (tests/console.py), which has joined the cluster."""
    monkeypatch.chdir(tmp_path)

    planned = shard_ray_here(
        capsys,
        *("plan", "--tables", str(table_file), "--devices", "4", "--devices-per-host", "2"),
        *("--memory-gb", "1", "--algo", "size_greedy", "--out", "plan.json"),
    )
    assert planned.returncode == 0, planned.stderr
    assert "on 4 devices on 2 hosts of 2" in planned.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["settings"]["devices_per_host"] == 2

    # The measured race over hosts: the search's plan against the heuristics' and TorchRec's (told the hosts), on the
    # gang `evaluate` measures a plan on.
    raced = shard_ray_here(
        capsys,
        *("plan", "--tables", str(table_file), "--devices", "4", "--devices-per-host", "2", "--memory-gb", "1"),
        *("--algo", "cost_search", "--measure", "--measure-rounds", "3", "--address", cluster.address),
        "--out",
        "raced.json",
    )
    assert raced.returncode == 0, raced.stderr
    measured = json.loads((tmp_path / "raced.json").read_text())["measured"]
    assert "torchrec" in "=".join(measured["candidates"]) and "the gang spanned 2 Ray nodes" in raced.stdout

    exported = shard_ray_here(
        capsys, "export", "--plan", "plan.json", "--tables", str(table_file), "--out", "torchrec.json"
    )
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "torchrec.json").read_text())["local_world_size"] == 2

    # Four hosts of one device on three nodes: refused before anything starts, in one line.
    refused = shard_ray_here(
        capsys,
        *("evaluate", "--plan", "plan.json", "--tables", str(table_file), "--address", cluster.address),
        *("--devices-per-host", "1", "--rounds", "1", "--no-mlflow", "--out", "never.json"),
    )
    assert refused.returncode == 2, refused.stderr
    assert "needs 4 Ray nodes" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "never.json").exists()

    # From a shell of its own joining by the address: 8 devices on a cluster of 6 CPUs, refused before any actor.
    eight = shard_ray_here(
        capsys,
        *("plan", "--tables", str(table_file), "--devices", "8", "--memory-gb", "1", "--algo", "size_greedy"),
        *("--out", "eight.json"),
    )
    assert eight.returncode == 0, eight.stderr
    joined = subprocess.run(
        [SHARD_RAY, "evaluate", "--plan", "eight.json", "--tables", str(table_file), "--address", cluster.address]
        + ["--no-mlflow", "--out", "never.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert joined.returncode == 2 and "Traceback" not in joined.stderr, joined.stderr
    assert f"this needs 8 devices at once but the cluster at {cluster.address} has 6" in joined.stderr
    assert not (tmp_path / "never.json").exists()


@pytest.mark.slow(seconds=80)
def test_doctor_reports_every_node(cluster, tmp_path):
    done = subprocess.run(
        [SHARD_RAY, "doctor", "--address", cluster.address], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ray: 4 Ray nodes, 6 CPUs and 0 GPUs in all" in done.stdout  # the head and three workers
    assert done.stdout.count("fused kernels: a fused shard trained on cpu") == 5  # this machine, then each node
    # the microbenchmark timed once: the nodes share this machine, whose shards were timed already
    assert done.stdout.count("microbenchmark shards timed here") == 1, done.stdout


@pytest.mark.slow(seconds=120)
def test_calibrate_over_hosts_fits_the_comm_model_to_what_crossed_them(cluster, capsys, monkeypatch, tmp_path):
    """`calibrate --devices-per-host 2`, as a user types it against a cluster (in this process, which has joined
    it): the gang spans two nodes, the comm model is fit to the all-to-alls measured across them, and the models
    are saved for hosts of 2, which `plan --devices-per-host 2` picks and a one-host plan does not. Where the
    machine has fewer cores than the 4 devices (these nodes share one machine), the gang prices the all-to-alls
    instead, no comm fit is made of them, and the models are saved for one host (`tuned_comm` below); measuring
    them across links is what emulated hosts are for (docs/clusters.md)."""
    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.plan.plan import load_plan

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / ".shard-ray"))  # the models go to a home of the test's own
    monkeypatch.chdir(tmp_path)

    (tmp_path / "tables.json").write_text(
        '{"tables": [{"name": "user_id", "rows": 200000, "dim": 64, "pooling_factor": 1},\n'
        '  {"name": "ad_id", "rows": 50000, "dim": 32, "pooling_factor": 4},\n'
        '  {"name": "category", "rows": 300, "dim": 16, "pooling_factor": 2},\n'
        '  {"name": "history", "rows": 10000, "dim": 32, "pooling_factor": 30}]}\n'
    )
    # a budget it never reaches (it ends by its shards and plans in about two minutes alone): beside other tests, a
    # 2-minute budget once ended it before any plan was measured, and an 8-minute one its shards (in CI, beside
    # the own-tables guide's calibration, both measuring their largest shards at once)
    calibrated = shard_ray_here(
        capsys,
        *("calibrate", "--tables", "tables.json", "--devices", "4", "--devices-per-host", "2"),
        *("--address", cluster.address, "--budget-minutes", "30", "--shards", "10", "--plans", "12"),
        *("--warmup", "1", "--repeats", "3", "--epochs", "40", "--noise-rounds", "3", "--no-mlflow"),
        *("--cost-model", str(default_cost_model_path()), "--for-hardware"),
    )
    assert calibrated.returncode == 0, calibrated.stderr
    report = json.loads(calibrated.stdout.strip().splitlines()[-1])
    assert sum(report["plans"].values()) >= 8  # plans measured over the two hosts, and only those
    saved = sorted((tmp_path / ".shard-ray" / "models").glob("*.pt"), key=lambda p: len(p.name))  # hardware-wide first
    assert len(saved) == 2 and saved[0].name.endswith("-hosts-of-2.pt") and "-hosts-of-2-tables-" in saved[1].name
    assert "`shard-ray plan` picks it for" in calibrated.stdout and "with --devices-per-host 2" in calibrated.stdout
    # where no plan of a split had its all-to-alls timed (the gang priced them, or a split is empty) the comm model
    # cannot be fit, and calibrate says so
    untuned = report["comm_kept"] is not None
    tuned_comm = report["chosen"] == "fine-tuned" and not untuned
    assert ("the comm model is kept as it started" in calibrated.stdout) == untuned, calibrated.stdout
    if os.cpu_count() < 4:  # 4 devices on fewer cores: the gang priced every all-to-all, and none counts as measured
        assert untuned and "had their all-to-alls priced" in report["comm_kept"]
        assert (
            CostModels.load(saved[0]).info.device_counts
            == CostModels.load(default_cost_model_path()).info.device_counts
        )
    assert CostModels.load(saved[0]).comm_devices_per_host == (2 if tuned_comm else None)

    for hosts, picked in ((["--devices-per-host", "2"], True), ([], False)):
        planned = shard_ray_here(
            capsys,
            *("plan", "--tables", "tables.json", "--devices", "4", *hosts, "--memory-gb", "4"),
            *("--algo", "neuroshard", "--out", "plan.json"),
        )
        assert planned.returncode == 0, planned.stderr
        # the models of these tables over these hosts; on one host, no models calibrated here fit
        assert (load_plan(tmp_path / "plan.json").estimate.cost_model == str(saved[1])) == picked
