"""MLflow runs of plan evaluations (estimates, task identity, where artifacts go) and quiet command output."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shard_ray.placement import place
from shard_ray.plan import GB, Topology
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.tracking.mlflow_runs import (
    POLICY_EXPERIMENT,
    default_tracking_uri,
    log_plan_evaluation,
    use_experiment,
)
from shard_ray.workload.tables import TableSpec, save_tables


def _cost(devices: int) -> PlanCost:
    parts = dict(fwd_compute_ms=1.0, fwd_comm_ms=0.5, bwd_comm_ms=0.5, bwd_compute_ms=2.0)
    return PlanCost(devices=[DeviceCost(device=d, **parts) for d in range(devices)])


def _runs(uri: str, experiment: str):
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment])


@pytest.mark.slow
def test_evaluation_run_carries_the_estimates_and_keeps_artifacts_beside_the_default_store(
    ray_session, tmp_path, monkeypatch, small_tables
):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=128)
    # twice the widest dim the shipped models were trained on
    tables = [*small_tables, TableSpec(name="wide", rows=1000, dim=2048, pooling_factor=1.0)]
    plan = place("cost_search", tables, topology)
    assert plan.estimate is not None and plan.estimate.lower_bound_ms is not None
    with DeviceGang(2) as gang:
        cost = gang.evaluate(plan, tables, MeasureConfig.for_topology(topology, warmup=1, repeats=2))
    uri = default_tracking_uri()
    assert uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    run_id = log_plan_evaluation(plan, cost, topology, "small", tables, uri)

    run = _runs(uri, "shard-ray").iloc[0]
    assert run["run_id"] == run_id
    # milliseconds to the microsecond, ratios to the thousandth (the runs table shows them whole)
    assert run["metrics.cost_ms"] == round(cost.cost_ms, 3)
    assert run["metrics.predicted_cost_ms"] == round(plan.estimate.predicted.cost_ms, 3)
    assert run["metrics.lower_bound_ms"] == round(plan.estimate.lower_bound_ms, 3)
    assert run["metrics.cost_over_lower_bound"] == round(cost.cost_ms / plan.estimate.lower_bound_ms, 3)
    assert run["metrics.measured_over_predicted"] == round(cost.cost_ms / plan.estimate.predicted.cost_ms, 3)
    assert run["metrics.placement_seconds"] == plan.placement_seconds  # as measured
    # which models priced the plan, their hardware and what they were calibrated on
    assert (
        run["tags.cost_model"] == plan.estimate.cost_model and run["tags.cost_model_hardware"] == "cpu:AMD EPYC:1thread"
    )
    assert run["tags.cost_model_provenance"].startswith("priced by the shipped models")
    # the run says, beside the prices, that the models never saw a table so wide
    assert any(w.startswith("table wide: dim 2048") for w in plan.estimate.warnings)
    assert run["tags.model_warnings"].startswith(f"{len(plan.estimate.warnings)}: ")
    # The artifacts are beside the database, and MLflow's ./mlruns never appears.
    assert not (tmp_path / "mlruns").exists()
    run_artifacts = tmp_path / "mlartifacts" / run_id / "artifacts"
    logged = {"plan.json", "result.json", "device_costs.png", "model_warnings.txt"}
    assert {p.name for p in run_artifacts.iterdir()} == logged
    assert {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)} == logged
    assert (run_artifacts / "model_warnings.txt").read_text().splitlines() == plan.estimate.warnings


def _schema(database: Path) -> list[tuple]:
    """Every table's and index's definition, its lines as a set (MLflow's migrations write a table's constraints in
    an order that differs from process to process), and the schema's version."""
    import sqlite3

    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        version = db.execute("SELECT * FROM alembic_version").fetchall()
    return [
        (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())) for kind, name, sql in rows
    ] + version


def test_a_new_store_is_mlflows_schema_built_once_a_release_and_copied(tmp_path, monkeypatch):
    """A new SQLite store is a copy of the empty schema built once for this MLflow release (MLflow migrates each new
    store for seconds otherwise): the same tables, indexes and schema version as a store MLflow builds itself, opened
    by MLflow as its own; a store that exists is left alone, and nothing half-written is left beside either."""
    import mlflow

    # where shard-ray's home cannot be written, MLflow builds the store itself: the store to compare with
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "a_file" / "home"))
    built_by_mlflow = tmp_path / "by_mlflow" / "mlflow.db"
    built_by_mlflow.parent.mkdir()
    use_experiment(f"sqlite:///{built_by_mlflow}", "shard-ray")
    assert sorted(p.name for p in built_by_mlflow.parent.iterdir()) == ["mlflow.db"]

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
        uri = f"sqlite:///{tmp_path / folder / 'mlflow.db'}"
        experiment_id = use_experiment(uri, "shard-ray")
        with mlflow.start_run(experiment_id=experiment_id):
            mlflow.log_metric("cost_ms", 1.5)
        assert _runs(uri, "shard-ray")["metrics.cost_ms"].tolist() == [1.5]
        assert mlflow.get_experiment(experiment_id).artifact_location == (tmp_path / folder / "mlartifacts").as_uri()
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["mlflow.db"]
    (template,) = (tmp_path / "home" / "mlflow").iterdir()
    assert template.name == f"empty-store-mlflow-{mlflow.__version__}.db"
    assert _schema(template) == _schema(built_by_mlflow)
    # a store with runs is opened, not replaced
    uri = f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}"
    use_experiment(uri, "shard-ray")
    assert len(_runs(uri, "shard-ray")) == 1


def test_a_plan_without_estimates_logs_no_estimate_metrics(tmp_path, small_tables):
    topology = Topology(num_devices=2, memory_bytes=GB)
    plan = place("round_robin", small_tables, topology)
    assert plan.estimate is None
    cost = _cost(2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_plan_evaluation(plan, cost, topology, "small", small_tables, uri)
    columns = set(_runs(uri, "shard-ray").columns)
    assert "metrics.cost_ms" in columns
    assert not columns & {"metrics.predicted_cost_ms", "metrics.lower_bound_ms", "metrics.cost_over_lower_bound"}


def test_tasks_with_the_same_name_get_different_task_ids(tmp_path, small_tables):
    from shard_ray.workload.tables import load_tables

    other = [t.model_copy(update={"rows": t.rows * 2}) for t in small_tables]
    for folder, tables in (("a", small_tables), ("b", other), ("c", small_tables)):
        save_tables(tmp_path / folder / "test_000.json", tables)
    topology = Topology(num_devices=2, memory_bytes=GB)
    cost = _cost(2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for folder in ("a", "b", "c"):
        path = tmp_path / folder / "test_000.json"
        tables = load_tables(path)
        log_plan_evaluation(place("round_robin", tables, topology), cost, topology, path.stem, tables, uri)
    runs = _runs(uri, "shard-ray").sort_values("start_time")
    assert list(runs["tags.task"]) == ["test_000"] * 3
    a, b, c = runs["tags.task_id"]
    assert a != b and a == c  # the same tables are the same task wherever their file is
    # and in whatever order: the digest the plans, the model files and `shard-ray models` name (a walk's filter on
    # that one found none of the task's runs)
    from shard_ray.workload.tables import task_digest

    assert a == task_digest(small_tables) == task_digest(small_tables[::-1])


@pytest.mark.slow
def test_policy_training_is_quiet_and_logs_to_the_policy_experiment(tmp_path):
    """No MLflow/alembic INFO lines, no Ray token-auth notice, no RLlib chatter; the iteration lines stay.

    The command runs in a fresh process, as `shard-ray` does, with the call the CLI's `main` makes first.
    """
    pool = [TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=8 * (1 + i % 4), pooling_factor=2.0) for i in range(12)]
    save_tables(tmp_path / "pool.json", pool)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_LOGGING_LEVEL", "RAY_ADDRESS")
    }
    env |= {"OMP_NUM_THREADS": "1"}
    shard_ray = str(Path(sys.executable).parent / "shard-ray")  # the console script `make setup` installs
    flags = "--iterations 1 --train-batch 64 --minibatch 32 --hidden 16 --min-tables 4 --max-tables 6 --devices 2"
    result = subprocess.run(
        [shard_ray, "policy", "train", "--tables", "pool.json", "--out", "policy", *flags.split()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "PPO iteration 1/1" in result.stdout and "policy: policy/policy.pt" in result.stdout
    assert "PPO: sampling in the driver, learning in the driver on the CPU" in result.stdout
    assert re.search(r"PPO iteration 1/1: .*, \d+\.\d s \(sampling \d+\.\d s, learning \d+\.\d s\)\n", result.stdout)
    noise = [
        line
        for line in result.stderr.splitlines()
        if " INFO " in line
        or "Token authentication is enabled" in line
        or "new API stack" in line
        or "RLModule(config=" in line
        or "gputil" in line
    ]
    assert noise == [], result.stderr
    runs = _runs(f"sqlite:///{tmp_path / 'mlflow.db'}", POLICY_EXPERIMENT)
    assert list(runs["tags.mlflow.runName"]) == ["policy/train"]
    assert f"logged MLflow run {runs['run_id'][0]} to sqlite:///" in result.stdout  # said, as other commands say it
    assert not (tmp_path / "mlruns").exists() and (tmp_path / "mlartifacts").is_dir()


def test_progress_bars_redraw_rarely_in_a_log_file():
    """Where stderr is not a terminal, a command's progress bar (tqdm) is redrawn at most every 30 s after the CLI's
    first call: a 1.5 s bar draws its start and its end, not 15 redraws; a user's TQDM_MININTERVAL wins."""
    script = (
        "import time\nfrom shard_ray.quiet import quiet_output\nquiet_output()\nfrom tqdm import tqdm\n"
        "for _ in tqdm(range(150), desc='work'):\n    time.sleep(0.01)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.count("/150 [") <= 3 and "150/150" in quiet.stderr, repr(quiet.stderr)
    chosen = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env | {"TQDM_MININTERVAL": "0.05"},
    )
    assert chosen.stderr.count("/150 [") >= 10, repr(chosen.stderr)


def test_ray_is_told_to_print_its_workers_lines_without_colour_codes_into_a_pipe():
    """Where stdout is not a terminal, the driver prints Ray's worker lines without escape codes (RAY_COLOR_PREFIX=0,
    read by Ray each time it prints one); a user's RAY_COLOR_PREFIX wins."""
    script = (
        "import os\nfrom shard_ray.quiet import quiet_output\nquiet_output()\nprint(os.environ['RAY_COLOR_PREFIX'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_COLOR_PREFIX"}
    for given, said in ((None, "0"), ("1", "1")):
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env=env if given is None else env | {"RAY_COLOR_PREFIX": given},
        )
        assert done.returncode == 0 and done.stdout.strip() == said, done.stderr


def test_the_report_process_logs_a_run_and_raises_what_its_calls_raise_here(tmp_path, small_tables):
    """`compare` and `evaluate` hand their reports to a process that imported MLflow and matplotlib while they
    started (shard_ray/tracking/report_process.py): its calls log as the command's own would, what they raise is
    raised in the command (a one-line error stays one), and the process ends with the command's use of it."""
    from shard_ray.errors import ShardRayError
    from shard_ray.tracking.report_process import ReportProcess
    from shard_ray.workload.tables import load_tables

    topology = Topology(num_devices=2, memory_bytes=GB)
    plan = place("round_robin", small_tables, topology)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with ReportProcess(uri, [log_plan_evaluation, load_tables]) as report:
        report.wait_until_imported()
        assert report.call(os.getpid) == report._process.pid != os.getpid()
        run_id = report.call(log_plan_evaluation, plan, _cost(2), topology, "small", small_tables, uri)
        with pytest.raises(ShardRayError, match=r"^table file .*missing\.json"):
            report.call(load_tables, tmp_path / "missing.json")
        with pytest.raises(RuntimeError, match="^ZeroDivisionError: integer division or modulo by zero"):
            report.call(divmod, 1, 0)
        assert report.call(os.getpid) == report._process.pid  # still answering after them
    assert report._process.returncode == 0
    assert list(_runs(uri, "shard-ray")["run_id"]) == [run_id]


def test_a_report_process_left_before_it_imported_is_stopped():
    """A command refused after its report process started (a bad Ray address, say) stops it on the way out rather
    than leave it importing behind the error."""
    from shard_ray.tracking.report_process import ReportProcess

    with pytest.raises(RuntimeError, match="refused"), ReportProcess("sqlite:///unused.db", []) as report:
        raise RuntimeError("refused")
    assert report._process.returncode is not None


def test_a_report_process_ends_with_its_command_however_that_ends(tmp_path):
    """A command stopped by SIGKILL (or SIGTERM, which runs no exit code either) takes its report process with it
    (Linux's parent-death signal): left, a process retrying an MLflow server ran on for minutes after `timeout`
    stopped its command."""
    import signal
    import time

    command = (  # killed while its report process is busy with a call (a closed pipe would end an idle one)
        "import os, threading, time\n"
        "from shard_ray.tracking.report_process import ReportProcess\n"
        "report = ReportProcess(None, [time.sleep])\n"
        "report.wait_until_imported()\n"
        "threading.Thread(target=report.call, args=(time.sleep, 60), daemon=True).start()\n"
        "time.sleep(1)\n"
        "print(report._process.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = tmp_path / "out.txt"
    with out.open("w") as printed:  # a file, not a pipe: reading a pipe would wait for the child too
        code = subprocess.run([sys.executable, "-c", command], stdout=printed, stderr=printed, timeout=120).returncode
    assert code == -signal.SIGKILL, out.read_text()
    child = int(out.read_text().split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the report process outlived its command"
        time.sleep(0.1)


def test_the_ui_command_is_offered_for_a_local_store_only():
    """A tracking server serves its own UI: offered `mlflow ui --backend-store-uri http://127.0.0.1:5000`, a user
    ran a command that failed on that URI and clashed with the server's port (from a new user's walk)."""
    from shard_ray.tracking.mlflow_runs import LoggedComparison

    logged = LoggedComparison(experiment_id="1", run_id="abc", plan_runs={"a": "r1"})
    server = logged.describe("http://127.0.0.1:5000")
    assert "mlflow ui" not in server and "http://127.0.0.1:5000/#/experiments/1/runs" in server
    assert "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db" in logged.describe("sqlite:////tmp/x/mlflow.db")


def test_the_ui_links_and_command_take_mlflow_port_where_5000_is_someone_elses(monkeypatch, tmp_path):
    """On a shared machine port 5000 may be taken: with MLFLOW_PORT (which `mlflow ui` reads too) the printed links
    and UI command name that port, where they named 5000 whatever the UI ran on (a walk); a port that is not a number
    is refused before a command's work, at the tracking URI's check."""
    from shard_ray.errors import ShardRayError
    from shard_ray.tracking.mlflow_runs import LoggedComparison, check_tracking_uri

    logged = LoggedComparison(experiment_id="1", run_id="abc", plan_runs={"a": "r1"})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_PORT", "5392")
    said = logged.describe(store)
    assert "http://127.0.0.1:5392/#/experiments/1/runs" in said and "--port 5392 --workers 1" in said
    assert "5000" not in said
    monkeypatch.setenv("MLFLOW_PORT", "53x2")
    with pytest.raises(ShardRayError, match=r"MLFLOW_PORT='53x2' is not a port number"):
        check_tracking_uri(store, "the default store")


def test_a_plan_several_algorithms_made_alike_is_tagged_by_them_all(tmp_path, small_tables):
    """A race names a plan that several algorithms placed alike by their names joined with `=`; its MLflow run was
    tagged by the first alone, so a filter on the others found none of the race's runs (a new user's walk)."""
    from shard_ray.plan.cost import MeasuredComparison, PlanRatio, RoundsSummary
    from shard_ray.tracking.mlflow_runs import log_comparison

    topology = Topology(num_devices=2, memory_bytes=GB)
    plans = {name: place(name, small_tables, topology) for name in ("lookup_greedy", "round_robin")}
    rounds = RoundsSummary.of([1.0, 1.1, 1.0])
    result = MeasuredComparison(
        hardware="cpu:test", chosen="lookup_greedy=random", confidence=0.95, separated=False, steps_per_round=10,
        candidates={"lookup_greedy=random": rounds, "round_robin": rounds},
        ratios={"round_robin": PlanRatio(ratio=1.0, low=0.9, high=1.1, separated=False)},
    )  # fmt: skip
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    costs = {name: _cost(2) for name in plans}
    log_comparison(result, plans, costs, topology, "mine", small_tables, uri, kind="race")
    runs = _runs(uri, "shard-ray")
    plan_runs = runs[runs["tags.kind"] == "plan"]
    assert (
        sorted(plan_runs["tags.algorithm"])
        == sorted(plan_runs["params.algorithm"])
        == [
            "lookup_greedy=random",
            "round_robin",
        ]
    )
