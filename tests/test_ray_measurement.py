"""End to end on Ray: profiling actors, the measurement store, and a 2-device gang with real all-to-all."""

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from unsharded import assert_trains_as_one_unsharded_table, every_sharding_type_plan, sgd_step

from shard_ray.cli import main
from shard_ray.errors import ShardRayError
from shard_ray.placement import place
from shard_ray.plan import GB, Plan, Shard, Topology, save_plan
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.actors import ProfilingPool, resources_per_device
from shard_ray.profiling.fused_shard import sample_ranges
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig, fused_shard_key
from shard_ray.profiling.sampling import draw_fused_shards
from shard_ray.profiling.store import MeasurementStore

CONFIG = MeasureConfig(batch_size=128, warmup=1, repeats=3)


@pytest.mark.slow
def test_a_profiling_pool_keeps_one_actor_a_core(ray_session, tmp_path, small_tables):
    """Actors sharing a core would time each other's contention: a pool asked for 4 on a node of fewer
    cores keeps one a core, each pinned to its own, and measures with them."""
    from shard_ray.profiling.hardware import free_cores

    with ProfilingPool(num_actors=4) as pool, MeasurementStore(tmp_path / "m.db") as store:
        assert len(pool.actors) == min(4, len(free_cores()))
        pinned = ray_session.get([a.cores.remote() for a in pool.actors])
        assert all(len(c) == 1 for c in pinned) and len({c[0] for c in pinned}) == len(pool.actors)
        shards = draw_fused_shards(small_tables, count=3, max_tables=2, seed=0)
        assert all(m.status == "ok" for m in pool.measure(shards, CONFIG, store, progress=False))


@pytest.mark.slow
def test_profiling_pool_measures_in_parallel_and_skips_known_shards(ray_session, tmp_path, small_tables):
    shards = draw_fused_shards(small_tables, count=4, max_tables=3, seed=0)
    pool = ProfilingPool(num_actors=2)
    assert len(set(ray_session.get([a.pid.remote() for a in pool.actors]))) == 2
    try:
        with MeasurementStore(tmp_path / "m.db") as store:
            # A record already in the store under a shard's key must be reused, not re-measured.
            planted_parts = shards[0]
            planted = pool.actors[0].measure.remote(planted_parts, CONFIG)
            record = ray_session.get(planted).model_copy(update={"fwd_ms": 12345.0})
            store.put_fused_shard(record)
            results = pool.measure(shards, CONFIG, store, progress=False)
            assert len(results) == len(shards)
            assert results[0].fwd_ms == 12345.0
            assert all(r.status == "ok" and r.fwd_ms > 0 and r.bwd_ms > 0 for r in results)
            assert [r.key for r in results] == [fused_shard_key(s, CONFIG, pool.hardware) for s in shards]
            assert store.count() == len({r.key for r in results})
            again = pool.measure(shards, CONFIG, store, progress=False)
            assert again == results
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_a_profiling_pool_measures_the_largest_shards_first(ray_session, tmp_path, small_tables):
    """An actor's kept buffers take their size from its first shard and serve the rest: given smallest first, the
    shards are measured largest first (one actor: the store's order is the order measured), where in the given order
    the buffers grew shard after shard, each growth a fresh allocation (docs/measurement.md)."""
    a, b, c, d, e = (TablePiece.whole(t) for t in small_tables)

    def stored_bytes(shard: list[TablePiece]) -> int:
        return sum(piece.memory_bytes(CONFIG.optimizer) for piece in shard)

    shards = sorted([[c], [a, e], [b], [d], [b, d]], key=stored_bytes)
    with ProfilingPool(num_actors=1) as pool, MeasurementStore(tmp_path / "m.db") as store:
        pool.measure(shards, CONFIG, store, progress=False)
        measured = [m.tables for m in store.fused_shard_measurements()]
    assert measured == shards[::-1]


@pytest.mark.slow
@pytest.mark.alone
def test_gang_runs_the_plan_with_real_all_to_all(ray_session, small_tables):
    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=128)
    gang = DeviceGang(2)
    try:
        plan = place("dim_greedy", small_tables, topology)
        cost = gang.evaluate(plan, small_tables, CONFIG)
        assert [d.device for d in cost.devices] == [0, 1]
        for d in cost.devices:
            assert d.fwd_compute_ms > 0 and d.bwd_compute_ms > 0
            assert d.fwd_comm_ms > 0 and d.bwd_comm_ms > 0
        assert cost.cost_ms == max(d.total_ms for d in cost.devices)
        assert cost.hardware.startswith("cpu:")

        # Column shards across devices and an empty device still run a full step.
        split = Plan(
            num_devices=2,
            algorithm="manual",
            shards=[Shard(table="b", device=0, columns=(0, 32)), Shard(table="b", device=0, columns=(32, 64))]
            + [Shard(table=t.name, device=0, columns=(0, t.dim)) for t in small_tables if t.name != "b"],
        )
        empty = gang.evaluate(split, small_tables, CONFIG)
        # (compared by their kernels: a gloo all-to-all on a loaded machine once took 4 ms more than device 0's compute,
        # and the empty device its slowest)
        assert empty.devices[1].fwd_compute_ms < empty.devices[0].fwd_compute_ms
        assert empty.devices[1].bwd_compute_ms < empty.devices[0].bwd_compute_ms
        # run by the other rank (as every other round of a comparison runs it), the plan's devices keep their work
        assert gang.devices_of_ranks(1) == [1, 0] and gang.devices_of_ranks(2) == [0, 1]
        shifted = gang.evaluate(split, small_tables, CONFIG, shift=1)
        assert [d.device for d in shifted.devices] == [0, 1]
        assert shifted.devices[1].fwd_compute_ms < shifted.devices[0].fwd_compute_ms
        assert shifted.devices[1].bwd_compute_ms < shifted.devices[0].bwd_compute_ms

        # Devices taking turns for compute (as on an oversubscribed node) still run the whole step.
        assert not gang.take_turns and not gang.warnings  # 2 devices, 2 cores
        gang.take_turns = True
        in_turn = gang.evaluate(plan, small_tables, CONFIG)
        assert all(d.fwd_compute_ms > 0 and d.bwd_compute_ms > 0 and d.fwd_comm_ms > 0 for d in in_turn.devices)
        gang.take_turns = False

        with pytest.raises(ShardRayError, match="for 3 devices"):
            gang.evaluate(Plan(num_devices=3, algorithm="x", shards=plan.shards), small_tables, CONFIG)

        # Whole tables unless a member's memory share cannot hold its shard: then its largest tables alone are
        # capped, the lookups sent to it folded into its rows, and the cost says so.
        assert "at most" not in " ".join(cost.warnings)
        budgets = gang.budgets
        gang.budgets = [budgets[0], 2**20]
        whole = gang.evaluate(split, small_tables, CONFIG)  # the capped rank 1 runs device 1, which is empty
        assert not any("at most" in w for w in whole.warnings)
        capped = gang.evaluate(split, small_tables, CONFIG, shift=1)  # rank 1 runs device 0, every table
        assert any(w.startswith("device 0 measured with at most") for w in capped.warnings), capped.warnings
        gang.budgets = budgets

        # The step's data plane on real Ray actors (its cases are tests/test_step_data_plane.py's, on gloo alone):
        # a plan of every sharding type trains as one unsharded table.
        tables, every_type = every_sharding_type_plan(small_tables)
        config = sgd_step(seed=3)
        assert_trains_as_one_unsharded_table(gang.step_values(every_type, tables, config), every_type, tables, config)
    finally:
        gang.shutdown()


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE_SET = THP_MODE.read_text().split("[")[1].split("]")[0] if THP_MODE.exists() else "never"


@ray.remote
def huge_page_kb_of_a_table() -> int:
    """A 64 MB table allocated in this process; the kB of its memory on transparent huge pages."""
    table = torch.ones(16 * 2**20)
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    del table
    return next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages"))


@pytest.mark.slow
@pytest.mark.skipif(THP_MODE_SET == "never", reason="the kernel has transparent huge pages off")
def test_a_devices_tables_are_on_huge_pages_unless_turned_off(ray_session, monkeypatch):
    measuring = resources_per_device(use_gpus=False)
    assert ray.get(huge_page_kb_of_a_table.options(**measuring).remote()) >= 32 * 1024
    if THP_MODE_SET == "madvise":  # with "always" every process gets them
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
        assert ray.get(huge_page_kb_of_a_table.options(**resources_per_device(use_gpus=False)).remote()) == 0


# A command's own local Ray, in a process of its own (this one may have joined the suite's): a measuring actor asks
# for no environment of its own, and so takes a worker process Ray started with the instance, which has the measuring
# environment: huge pages on, or off where the command's environment has THP_MEM_ALLOC_ENABLE=0.
LOCAL_RAY_ACTOR = """
import json, os, time
import ray
from shard_ray.profiling.actors import resources_per_device
from shard_ray.runtime import connect_ray

@ray.remote
def measuring_process():
    def since_boot(stat):  # the process's start, in seconds since the machine's boot
        return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    niceness = os.getpriority(os.PRIO_PROCESS, 0)  # the worker's, as Ray started it
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), since_boot(open("/proc/self/stat").read()), niceness

connect_ray(None, 2)
time.sleep(2)  # the workers Ray starts ahead are up
options = resources_per_device(use_gpus=False)
asked = float(open("/proc/uptime").read().split()[0])
huge_pages, started, niceness = ray.get(measuring_process.options(**options).remote())
print(json.dumps({"options": sorted(options), "huge_pages": huge_pages, "started_ahead": started < asked,
                  "niceness": niceness}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("huge_pages", [None, "0"])
def test_a_commands_local_ray_measures_in_the_workers_it_started_ahead(huge_pages):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "THP_"))}
    if huge_pages is not None:
        env["THP_MEM_ALLOC_ENABLE"] = huge_pages
    # the second command niced by its user: its workers as nice as it (Ray's 15 more starved them beside any busy
    # process), the first's at 0
    niced = 5 if huge_pages is not None else 0
    done = subprocess.run([sys.executable, "-c", LOCAL_RAY_ACTOR], env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.nice(niced))  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"options": ["num_cpus"], "huge_pages": huge_pages or "1", "started_ahead": True, "niceness": niced}
    # a script's local Ray (the experiments') drops Ray's notice of token authentication as the commands do
    assert "Token authentication is enabled" not in done.stderr


# A command's own local Ray beside another Ray on the machine, which holds Ray's fixed dashboard agent port.
LOCAL_RAY_AGENT = """
import json
from pathlib import Path
import ray
from shard_ray.runtime import connect_ray

connect_ray(None, 2)
logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
print(json.dumps({"port": ray.nodes()[0]["DashboardAgentListenPort"],
                  "retried": (logs / "dashboard_agent.log").read_text().count("Failed to bind")}))
"""


@pytest.mark.slow
def test_a_commands_local_ray_beside_another_ray_starts_its_agent_on_a_free_port():
    """Ray's dashboard agent listens on 52365 unless told otherwise, and `ray.init` cannot tell it: beside another Ray
    (a head, another command's, the suite's own) a command's local Ray retried that port for 3.3 s before starting
    without it, 6.5 s in all against 2.5. The port held here as another Ray's agent holds it, the command's agent
    takes a free one, at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # already held by a Ray beside this test: the same case
            held.bind(("", 52365))
            held.listen()
        done = subprocess.run([sys.executable, "-c", LOCAL_RAY_AGENT], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["port"] > 0 and seen["port"] != 52365 and seen["retried"] == 0, seen


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness, and dropping the right to, need root")
def test_a_measuring_process_below_its_commands_priority_raises_itself_where_it_may():
    """A Ray worker of a cluster started otherwise than by shard-ray runs at nice 15: a measuring actor raises itself
    to its command's niceness (0, or 5 where its user niced the command) where its user may (here root), and measures
    at 15 where it may not (root without CAP_SYS_NICE, as a user is), without failing."""
    import ctypes

    def niceness_reached(command: int, may: bool) -> int:
        def start() -> None:
            os.nice(15)
            if not may:  # prctl(PR_CAPBSET_DROP, CAP_SYS_NICE): the program exec'd next runs without it
                assert ctypes.CDLL(None, use_errno=True).prctl(24, 23, 0, 0, 0) == 0

        raise_it = f"from shard_ray.niceness import at_niceness; print(at_niceness({command}))"
        done = subprocess.run([sys.executable, "-c", raise_it], preexec_fn=start, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert niceness_reached(0, may=True) == 0
    assert niceness_reached(5, may=True) == 5
    assert niceness_reached(0, may=False) == 15


def test_sample_ranges_cover_the_batch():
    assert sample_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert sample_ranges(1024, 7)[-1][1] == 1024


@pytest.mark.slow
def test_evaluate_command_writes_result_and_mlflow_run(ray_session, tmp_path, table_file, small_tables):
    import mlflow

    plan_path = tmp_path / "plan.json"
    save_plan(
        plan_path, place("size_lookup_greedy", small_tables, Topology(num_devices=2, memory_bytes=GB, batch_size=128))
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "result.json"
    code = main(
        [
            "evaluate",
            "--tables",
            str(table_file),
            "--plan",
            str(plan_path),
            "--out",
            str(out),
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--tracking-uri",
            uri,
            "--experiment",
            "t",
            "--task",
            "small",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["devices"][0]) >= {
        "device",
        "fwd_compute_ms",
        "fwd_comm_ms",
        "bwd_comm_ms",
        "bwd_compute_ms",
        "total_ms",
    }
    assert result["cost_ms"] == max(d["total_ms"] for d in result["devices"])
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["t"])
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["params.algorithm"] == "size_lookup_greedy" and run["tags.task"] == "small"
    assert run["metrics.cost_ms"] == round(result["cost_ms"], 3)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run["run_id"])}
    assert {"plan.json", "result.json", "device_costs.png"} <= artifacts


@pytest.mark.slow
def test_demo_runs_end_to_end(ray_session, tmp_path, capsys):
    import mlflow

    from shard_ray.workflows.demo import run_demo
    from shard_ray.workflows.settings import DemoConfig

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    comparison = run_demo(
        DemoConfig(
            workdir=tmp_path / "demo",
            num_tables=6,
            profile_shards=2,
            repeats=2,
            rounds=3,
            budget_seconds=1,  # spent in the first round: the race still runs to its first look
            batch_size=128,
            tracking_uri=uri,
        )
    )
    out = capsys.readouterr().out
    assert "== 4. comparison" in out and "mlflow ui --backend-store-uri" in out
    # the models that priced the plans are named, and the last screen leads with the verdict
    assert "priced by the shipped models" in out and "measured/predicted" in out
    verdict = out.split("== 5. verdict\n")[1].splitlines()
    result = comparison.result
    assert result is not None and result.rounds == 3  # its first look, however long the rounds took
    assert verdict[0].startswith(f"shard-ray chose {result.chosen}'s plan: cost_ms {result.cost.median_ms:.2f}")
    # why it chose: separated, or TorchRec's plan (the incumbent) kept unless a plan is separated as faster than it
    assert verdict[1] == f"- why: {result.rule}"
    assert "torchrec" in result.incumbent.split("=")
    if not result.separated:
        if result.chosen == result.incumbent:
            assert "which is kept" in result.rule
        else:
            assert result.ratios[result.incumbent].low > 1 and "separated as faster than the incumbent" in result.rule
        assert any("could not separate it" in line for line in verdict)
    assert any("TorchRec's plan" in line for line in verdict) and any("the best heuristic" in line for line in verdict)
    assert any(line.startswith("logged MLflow run") for line in verdict)
    assert set(comparison.plans) >= {"random", "size_lookup_greedy"}
    assert "ratio to chosen" in out
    written = json.loads((tmp_path / "demo" / "comparison.json").read_text())
    assert len(written["plans"]) == len(comparison.plans)
    # MLflow: the comparison's run and a child per distinct plan, each with the cost the table printed
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["shard-ray"])
    assert sorted(runs["tags.kind"]) == ["comparison"] + ["plan"] * len(result.candidates)  # one per distinct plan
    for _, run in runs[runs["tags.kind"] == "plan"].iterrows():
        name = run["tags.mlflow.runName"].removeprefix("demo/")
        assert run["metrics.cost_ms"] == round(result.candidates[name].median_ms, 3)
        assert run["metrics.cost_ms"] == round(comparison.costs[name.split("=")[0]].cost_ms, 3)


@pytest.mark.slow(seconds=70)
def test_collect_resumes_without_measuring_twice(ray_session, tmp_path, small_tables):
    from shard_ray.costmodel.collect import CollectConfig, collect_comm, collect_compute
    from shard_ray.profiling.sampling import microbenchmark_shards

    config = CollectConfig(samples=3, max_tables=2, batch_sizes=(64,), dims=(8, 16), warmup=0, repeats=1)
    pool = ProfilingPool(num_actors=1)  # one: the microbenchmark touches 3.5 GB an actor (docs/install.md)
    try:
        with MeasurementStore(tmp_path / "m.db") as store:
            micro = len(microbenchmark_shards())  # measured first, at every batch size
            assert collect_compute(small_tables, config, pool, store) == micro + 3
            assert collect_compute(small_tables, config, pool, store) == 0
            bigger = CollectConfig(**{**config.__dict__, "samples": 5})
            assert collect_compute(small_tables, bigger, pool, store) == 2  # the first three are kept
    finally:
        pool.shutdown()
    with MeasurementStore(tmp_path / "m.db") as store:
        assert collect_comm(small_tables, config, store) == 3
        assert collect_comm(small_tables, config, store) == 0
        plans = store.plan_measurements()
        assert len(plans) == 3 and all(p.plan.num_devices == 2 and p.cost.batch_size == 64 for p in plans)


@pytest.mark.slow
def test_a_pool_of_more_actors_than_the_cluster_has_devices_is_refused_before_starting_any(ray_session):
    """Ray would keep actors it can never place pending, and the pool's first call on them waited forever (a test's
    in-process Ray of 2 CPUs once hung the suite so): refused in a line, no actor started."""
    cpus = int(ray.cluster_resources()["CPU"])
    # an earlier test's actors on this worker's Ray may still be giving their CPUs back: what is free now, not all
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(ShardRayError, match=f"{cpus + 1} actors needs {cpus + 1} CPUs, one each, but the Ray cluster"):
        ProfilingPool(num_actors=cpus + 1, use_gpus=False)
    assert ray.available_resources().get("CPU", 0) >= free  # nothing started, nothing more holding a CPU


@pytest.mark.slow
def test_pool_and_gang_are_shut_down_when_their_block_raises(ray_session):
    import pytest
    import ray

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with ProfilingPool(num_actors=1) as pool, DeviceGang(2) as gang:
            actors, members = list(pool.actors), list(gang.members)
            assert ray.get(actors[0].pid.remote()) > 0
            raise Boom
    assert pool.actors == [] and gang.members == []
    for handle in [*actors, *members]:
        assert _dies_within(handle, seconds=30)


@pytest.mark.slow
def test_a_pool_of_as_many_actors_as_the_gang_has_devices_measures_on_its_members(ray_session, tmp_path, small_tables):
    """A command's device actors (`DeviceActors`): a pool of as many actors as the gang has devices starts none of its
    own and measures on the gang's members, which then run plans as before; a member lost since, the gang starts again
    before it is lent; a pool of fewer actors starts its own. Leaving the block stops the members."""
    from shard_ray.profiling.gang import DeviceActors

    shards = draw_fused_shards(small_tables, count=4, max_tables=2, seed=0)
    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=CONFIG.batch_size)
    plan = place("size_greedy", small_tables, topology)
    with DeviceActors(2) as devices, MeasurementStore(tmp_path / "m.db") as store:
        with devices.pool(2) as pool:
            gang = devices.gang()
            members = list(gang.members)
            assert pool.actors == [] and pool.hardware == gang.hardware
            assert all(m.status == "ok" for m in pool.measure(shards[:2], CONFIG, store, progress=False))
        assert gang.members == members  # the pool's block stops none of them
        assert gang.evaluate(plan, small_tables, CONFIG).cost_ms > 0
        ray_session.kill(members[0], no_restart=True)
        assert _dies_within(members[0], seconds=30)
        with devices.pool(2) as pool:  # lent again: the gang started anew
            assert all(m.status == "ok" for m in pool.measure(shards[2:], CONFIG, store, progress=False))
        assert gang.restarts == 1 and members[0] not in gang.members
        assert gang.evaluate(plan, small_tables, CONFIG).cost_ms > 0
        with devices.pool(1) as own:
            assert len(own.actors) == 1 and own.actors[0] not in gang.members
        members = list(gang.members)
    assert all(_dies_within(m, seconds=30) for m in members)


def _dies_within(handle, seconds: float) -> bool:
    """Whether the actor is gone within `seconds` (ray.kill is asynchronous: a call may slip in first)."""
    import time

    import ray

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.5)
    return False
