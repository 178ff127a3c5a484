"""Failure and recovery: actors killed mid-run, runs stopped by SIGINT or SIGKILL and started again."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.procedure import MeasureConfig, fused_shard_key
from shard_ray.profiling.sampling import draw_fused_shards
from shard_ray.profiling.store import MeasurementStore

# Clusters, jobs, sweeps and killed runs: minutes each, left out of `make test-fast`.
pytestmark = pytest.mark.slow

# Enough timed steps that a shard takes a good fraction of a second, so kills land mid-shard.
SLOW = MeasureConfig(batch_size=1024, warmup=2, repeats=25)


# Profiling kills must land while a measurement runs (a killed idle actor is only found out when next
# used): shards of about a second each, so the last kill never comes after the last shard has started.
SLOWER = SLOW.model_copy(update={"batch_size": 4096, "repeats": 40})

# The most a test waits for a run to reach the point where it is stopped: the wait ends when it gets there, so the
# limit need not be tight, only hold on a busy machine.
WAIT_LIMIT = 600


def test_profiling_survives_killed_actors(ray_session, tmp_path, small_tables):
    shards = draw_fused_shards(small_tables, count=10, max_tables=4, seed=3)
    keys = {fused_shard_key(s, SLOWER, "") for s in shards}  # distinct shards (hardware does not change identity here)
    pool = ProfilingPool(num_actors=2)
    db = tmp_path / "m.db"
    kills: list[int] = []  # shards stored when each kill landed

    def kill_during_the_run() -> None:
        with MeasurementStore(db) as watcher:
            for n in range(4):
                while watcher.count() < 1 + 2 * n:
                    time.sleep(0.05)
                # three restarts, then one actor killed for good: its shard must move to the other
                ray_session.kill(pool.actors[n % 2], no_restart=(n == 3))
                kills.append(watcher.count())
                time.sleep(0.3)

    killer = threading.Thread(target=kill_during_the_run, daemon=True)
    try:
        with MeasurementStore(db) as store:
            killer.start()
            results = pool.measure(shards, SLOWER, store, progress=False)
            killer.join(timeout=60)
            assert len(kills) == 4 and all(k < len(keys) for k in kills), kills  # every kill hit a running measurement
            assert len(pool.actors) == 1
            assert all(r is not None and r.status == "ok" for r in results)
            assert store.count() == len(keys)  # every distinct shard, exactly once
            assert [r.key for r in results] == [fused_shard_key(s, SLOWER, pool.hardware) for s in shards]
    finally:
        pool.shutdown()


def test_gang_rebuilds_itself_when_a_member_dies(ray_session, small_tables):
    from shard_ray.placement import place
    from shard_ray.plan.topology import GB, Topology
    from shard_ray.profiling.gang import DeviceGang

    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=1024)
    plans = [
        place(name, small_tables, topology) for name in ("dim_greedy", "size_greedy", "lookup_greedy", "round_robin")
    ]
    gang = DeviceGang(2)
    kills: list[int] = []  # plans finished when each kill landed
    finished: list[int] = []

    def kill_members() -> None:
        for n in range(3):
            time.sleep(0.6)
            members = list(gang.members)
            if not members:
                return
            ray_session.kill(members[n % 2])
            kills.append(len(finished))
            while gang.restarts <= n or not gang.members:  # wait for the new gang
                time.sleep(0.05)

    killer = threading.Thread(target=kill_members, daemon=True)
    try:
        killer.start()
        costs = []
        for plan in plans:
            costs.append(gang.evaluate(plan, small_tables, SLOW))
            finished.append(1)
        killer.join(timeout=120)
        assert len(kills) == 3 and all(k < len(plans) for k in kills), kills
        assert gang.restarts == 3
        assert len(costs) == len(plans)
        assert all(d.fwd_compute_ms > 0 and d.fwd_comm_ms > 0 for c in costs for d in c.devices)
    finally:
        gang.shutdown()


@pytest.fixture(scope="module")
def joined() -> Iterator[dict[str, str]]:
    """The environment of a shell on a cluster (RAY_ADDRESS set) whose Ray the module's commands join: the runs
    started and stopped here would otherwise each start a local Ray of their own, about 10 CPU-seconds apiece.
    What a stopped run keeps and how it resumes does not depend on whose Ray it ran on. Its tests are one
    `xdist_group`: one worker starts the cluster once."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": False,
            "object_store_memory": 256 * 1024**2,
            "dashboard_agent_listen_port": 0,  # not Ray's fixed 52365, which a Ray beside it holds (3.3 s of retries)
        },
    )
    try:
        yield {**os.environ, "RAY_ADDRESS": cluster.address}
    finally:
        cluster.shutdown()


def _foreground_signals() -> None:
    """As for a command run in a terminal: a test runner started in the background ignores SIGINT, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _store_count(db) -> int:
    import sqlite3

    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db, timeout=10)) as conn:
        try:
            return conn.execute("SELECT COUNT(*) FROM shard_measurements").fetchone()[0]
        except sqlite3.OperationalError:  # the table is not created yet
            return 0


@pytest.mark.slow(seconds=45)
@pytest.mark.xdist_group("joined")
def test_stopped_by_sigint_and_sigkill_resumes_to_the_same_set(joined, tmp_path, small_tables):
    """`profile` stopped part way by Ctrl-C, then killed outright, keeps what it measured and finishes the same set
    when run again. (`collect` measures through the same pool and store; its resume is
    tests/test_ray_measurement.py's `test_collect_resumes_without_measuring_twice`.)"""
    from shard_ray.workload.tables import save_tables

    pool_file, db = tmp_path / "pool.json", tmp_path / "m.db"
    save_tables(pool_file, small_tables)
    command = [
        sys.executable, "-m", "shard_ray.cli", "profile", "--tables", str(pool_file), "--shards", "12",
        "--max-tables", "4", "--batch-size", "2048", "--repeats", "60", "--actors", "2", "--store", str(db),
    ]  # fmt: skip
    config = MeasureConfig(batch_size=2048, warmup=3, repeats=60, seed=0)
    drawn = draw_fused_shards(small_tables, 12, 4, seed=0, singles=True)
    for stop in (signal.SIGINT, signal.SIGKILL):
        before = _store_count(db)
        run = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_foreground_signals,
            env=joined,
        )
        deadline = time.time() + WAIT_LIMIT
        while _store_count(db) < before + 1 and time.time() < deadline and run.poll() is None:
            time.sleep(0.1)
        assert run.poll() is None, run.stdout.read().decode()[-2000:]
        os.killpg(run.pid, stop)
        run.wait(timeout=60)
        if stop == signal.SIGINT:
            output = run.stdout.read().decode()
            assert run.returncode == 130 and "Traceback" not in output, output[-3000:]
        assert before < _store_count(db) < len(drawn)  # stopped part way, what was measured is kept
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with MeasurementStore(db) as store:
        stored = store.fused_shard_measurements()
        hardware = stored[0].hardware
        assert {m.key for m in stored} == {
            fused_shard_key(s, config, hardware) for s in drawn
        }  # the set an unbroken run makes
        assert all(m.status == "ok" for m in stored)


def _run_until(command: list[str], env: dict[str, str], done: Callable[[], bool], stop: int) -> None:
    """Start `command`, and stop its whole process group with `stop` once `done()` holds."""
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + WAIT_LIMIT
    while not done() and time.time() < deadline and run.poll() is None:
        time.sleep(0.1)
    assert run.poll() is None, run.stdout.read().decode()[-3000:]
    os.killpg(run.pid, stop)
    run.wait(timeout=60)


@pytest.mark.slow(seconds=60)
@pytest.mark.xdist_group("joined")
def test_benchmark_killed_mid_run_measures_only_what_is_left(joined, tmp_path):
    import json

    out = tmp_path / "benchmark"
    command = [
        sys.executable,
        "-m",
        "shard_ray.cli",
        "bench",
        "--tasks",
        "2",
        "--min-tables",
        "4",
        "--max-tables",
        "5",
        "--devices",
        "2",
        "--repeats",
        "10",
        "--rounds",
        "3",
        "--algorithms",
        "lookup_greedy,size_greedy",
        "--no-mlflow",
        "--out",
        str(out),
    ]
    _run_until(command, joined, lambda: (out / "tasks" / "test_000.json").exists(), signal.SIGKILL)
    first = json.loads((out / "tasks" / "test_000.json").read_text())
    assert not (out / "benchmark.json").exists()
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_000: measured by an earlier run" in done.stdout
    result = json.loads((out / "benchmark.json").read_text())
    assert len(result["per_task"]) == 2 and result["per_task"]["test_000"] == first["records"]
    assert json.loads(done.stdout.strip().splitlines()[-1])["tasks"] == 2


@pytest.mark.slow(seconds=55)
@pytest.mark.xdist_group("joined")
def test_outer_loop_killed_mid_round_resumes(joined, tmp_path):
    import json

    from shard_ray.policy.network import load_policy
    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    pool = tmp_path / "pool.json"
    save_tables(pool, generate_pool(PoolConfig(num_tables=40, seed=4)))
    out = tmp_path / "loop"
    command = [
        sys.executable,
        "-m",
        "shard_ray.cli",
        "policy",
        "outer-loop",
        "--tables",
        str(pool),
        "--out",
        str(out),
        "--rounds",
        "2",
        "--tasks-per-round",
        "1",
        "--ppo-iterations",
        "1",
        "--train-batch",
        "64",
        "--minibatch",
        "32",
        "--hidden",
        "16",
        "--min-tables",
        "3",
        "--max-tables",
        "4",
        "--devices",
        "2",
        "--actors",
        "1",
        "--repeats",
        "2",
        "--update-epochs",
        "2",
        "--no-mlflow",
    ]
    # killed once the first round is saved and the second has begun measuring
    _run_until(command, joined, lambda: (out / "outer_loop.json").exists(), signal.SIGKILL)
    assert [r["round"] for r in json.loads((out / "outer_loop.json").read_text())["rounds"]] == [1]
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resuming after round 1" in done.stdout
    assert [r["round"] for r in json.loads((out / "outer_loop.json").read_text())["rounds"]] == [1, 2]
    assert load_policy(out)[1].iterations == 2


@pytest.mark.slow(seconds=35)
@pytest.mark.xdist_group("joined")
def test_policy_training_killed_resumes_from_its_checkpoint(joined, tmp_path):
    from shard_ray.policy.network import load_policy
    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    pool = tmp_path / "pool.json"
    save_tables(pool, generate_pool(PoolConfig(num_tables=40, seed=5)))
    out = tmp_path / "policy"
    command = [
        sys.executable,
        "-m",
        "shard_ray.cli",
        "policy",
        "train",
        "--tables",
        str(pool),
        "--out",
        str(out),
        "--iterations",
        "3",
        "--checkpoint-every",
        "2",
        "--train-batch",
        "64",
        "--minibatch",
        "32",
        "--hidden",
        "16",
        "--min-tables",
        "3",
        "--max-tables",
        "4",
        "--devices",
        "2",
        "--no-mlflow",
    ]
    # the first checkpoint is at iteration 2, the last (the end) at 3: killed between them
    _run_until(command, joined, lambda: (out / "policy.pt").exists(), signal.SIGKILL)
    assert load_policy(out)[1].iterations == 2
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "after iteration 2" in done.stdout and "PPO iteration 3/3" in done.stdout
    assert "PPO iteration 2/3" not in done.stdout
    assert load_policy(out)[1].iterations == 3


@pytest.mark.slow(seconds=40)
@pytest.mark.xdist_group("joined")
def test_sweep_survives_a_killed_trial_and_resumes_after_sigkill(joined, tmp_path):
    """A trial's process killed mid-run is retried (FailureConfig); the sweep killed outright resumes (Tuner.restore)."""
    import json

    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    pool = tmp_path / "pool.json"
    save_tables(pool, generate_pool(PoolConfig(num_tables=80, seed=6)))
    out = tmp_path / "sweep"
    command = [
        sys.executable,
        "-m",
        "shard_ray.cli",
        "tune",
        "search",
        "--tables",
        str(pool),
        "--out",
        str(out),
        "--samples",
        "2",
        "--max-concurrent",
        "1",
        "--tasks",
        "2",
        "--min-tables",
        "10",
        "--max-tables",
        "15",
        "--max-evaluations",
        "5000",
        "--measure-top",
        "0",
        "--no-mlflow",
    ]
    killed_trials: list[int] = []

    def trial_processes() -> list[psutil.Process]:
        """Trials on this worker's cluster (its Ray's processes are this process's children), not another test's."""
        return [p for p in psutil.Process().children(recursive=True) if "ray::ImplicitFunc" in " ".join(p.cmdline())]

    def kill_a_trial_then_wait_for_the_next() -> bool:
        # Tune copies the trials' results into the sweep's folder only as the sweep ends, a tenth of a second
        # before best.json: waiting for them raced the sweep's end (CI killed it after best.json). The next trial
        # process (the retry, or the next trial) starts about 1.5 s before the sweep can end.
        try:
            running = {p.pid: p for p in trial_processes()}
        except psutil.NoSuchProcess:  # one ended while read
            return False
        if not killed_trials:
            for pid, process in running.items():
                process.kill()
                killed_trials.append(pid)
            return False
        return bool(running.keys() - set(killed_trials))

    _run_until(command, joined, kill_a_trial_then_wait_for_the_next, signal.SIGKILL)
    assert killed_trials and not (out / "best.json").exists()
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # killed while Tune copied its state into the sweep's folder, the sweep starts again (the next step, on purpose)
    assert "resuming the sweep" in done.stdout or "is damaged" in done.stdout, done.stdout
    assert "2 trials, 0 failed" in done.stdout, done.stdout
    assert json.loads((out / "best.json").read_text())["trials"] == 2

    # A state file cut short, as a kill during Tune's copy leaves it: Tune would log "Failed to restore the run state"
    # and run a sweep of the one trial its searcher had left; the command says so and runs the whole sweep again.
    state = max((out / "tune" / "search").glob("search_gen_state-*.json"))
    state.write_bytes(state.read_bytes()[:100])
    done = subprocess.run(command, env=joined, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"is damaged ({state.name} is cut short" in done.stdout, done.stdout
    assert "2 trials, 0 failed" in done.stdout and "Failed to restore" not in done.stderr, done.stdout + done.stderr
    assert json.loads((out / "best.json").read_text())["trials"] == 2
    assert (out / "tune" / "search-damaged" / state.name).exists()


def test_a_worker_stopped_by_rays_memory_monitor_is_one_line_and_status_1(tmp_path):
    """Ray's memory monitor, told that 0.5% of the machine's memory in use is too much (95% by default), stops the
    gang's members as they start: `evaluate` says so in one line, with what was in use, exits with status 1 and
    writes nothing (it printed a 75-line traceback)."""
    tables = Path(__file__).resolve().parent.parent / "experiments" / "tables" / "criteo_kaggle.json"
    shell = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own, which reads these
    shell["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{shell['PATH']}"
    plan = f"shard-ray plan --tables {tables} --devices 2 --memory-gb 8 --algo size_greedy --out plan.json"
    done = subprocess.run(["bash", "-c", plan], env=shell, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    evaluate = f"shard-ray evaluate --tables {tables} --plan plan.json --rounds 1 --no-mlflow --out evaluated.json"
    low = {**shell, "RAY_memory_usage_threshold": "0.005", "RAY_memory_monitor_refresh_ms": "100"}
    done = subprocess.run(["bash", "-c", evaluate], env=low, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("shard-ray: error:")]
    assert len(said) == 1 and re.fullmatch(
        r"shard-ray: error: the machine ran low on memory and Ray's memory monitor stopped a worker "
        r"\([\d.]+GB of [\d.]+GB in use\): free memory, or measure less at once \(fewer devices, --max-rows\)",
        said[0],
    ), done.stderr[-3000:]
    assert not (tmp_path / "evaluated.json").exists()
