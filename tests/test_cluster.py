"""The cluster route, for real: an MLflow tracking server, a Ray head taking `ray job submit`, the launcher files."""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from pages import page_block, page_line
from ports import free_port

from shard_ray.process_groups import stop_process_group

# Clusters, jobs, sweeps and killed runs: minutes each, left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The docs page that gives the cluster route's commands; the tests run them as a user pastes them.


def _wait_for(check, what: str, timeout: float = 300, stopped=lambda: False, explain=lambda: "") -> None:
    """Polls `check` until it holds; fails at once when `stopped()` says the server's process has ended, and with
    what `explain()` gives (its log, the last answer) either way, so that a failure in CI says why."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        if stopped():
            raise AssertionError(f"{what} stopped while starting\n{explain()}")
        time.sleep(0.5)
    raise AssertionError(f"{what} did not come up in {timeout} s\n{explain()}")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with an SQLite backend and served artifacts, its server-side jobs off as
    docs/mlflow.md starts it."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200, "mlflow server")
        yield uri
    finally:
        stop_process_group(server, 5)


def _search_runs(uri: str, experiment: str) -> list[dict]:
    """Runs of `experiment`, read through MLflow's REST API."""

    def post(endpoint: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{uri}/api/2.0/mlflow/{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        return json.loads(urllib.request.urlopen(request, timeout=10).read())

    experiment_id = json.loads(
        urllib.request.urlopen(
            f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}", timeout=10
        ).read()
    )["experiment"]["experiment_id"]
    return post("runs/search", {"experiment_ids": [experiment_id]}).get("runs", [])


def _user_env(home: Path) -> dict[str, str]:
    """The environment of a new shell after `make setup`: the virtual environment not active, no Ray settings.

    HOME is a fresh folder, so that the head's token (~/.ray/auth_token) and the jobs' $RUNS are the test's own.
    """
    venv_bin = (REPO / ".venv" / "bin").resolve()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "MLFLOW_TRACKING_URI")
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv_bin
    )
    env["HOME"] = str(home)
    return env


class _Head:
    """One try at a Ray head started as docs/clusters.md says, in a HOME of its own (its token and log)."""

    def __init__(self) -> None:
        # Not under pytest's basetemp: a pytest run started meanwhile by the same user prunes old ones, token and all.
        self.home = tempfile.TemporaryDirectory(prefix="shard-ray-home-")
        env = _user_env(Path(self.home.name))
        dashboard, self.port = free_port(), free_port()
        agent_ports = " ".join(
            f"--{name}-port {free_port()}"
            for name in (
                "dashboard-agent-listen",
                "dashboard-agent-grpc",
                "metrics-export",
                "runtime-env-agent",
                "ray-client-server",
            )
        )
        # A temp dir of its own as well: Ray resolves a job's `auto` address from the ray_current_cluster file in
        # its node's temp dir, which a multi-node test's cluster started meanwhile in the default one (/tmp/ray)
        # rewrites; the benchmark job then joined that cluster (with -n 5, once).
        start = page_line("clusters.md", "ray start --head").replace(
            "--port 6379",
            f"--port {self.port} --dashboard-port {dashboard} {agent_ports} --disable-usage-stats "
            f"--temp-dir {self.home.name}/ray",
        )
        self.pid_file = Path(self.home.name) / "ray-head.pid"
        script = "\n".join(
            [
                page_line("clusters.md", "source .venv/bin/activate"),
                page_line("clusters.md", "ray get-auth-token --generate"),
                page_line("clusters.md", "export RAY_AUTH_MODE="),
                page_line("clusters.md", "export RAY_worker_niceness="),
                start,
                page_line("clusters.md", "RAY_HEAD=$!"),
                f"echo $RAY_HEAD > {self.pid_file}",
                "wait $RAY_HEAD",
            ]
        )
        # Ray's dashboard keeps its forkserver's socket in a folder of the temporary directory, which outlives a head
        # ended by a signal (two `/tmp/pymp-*` a head): in the head's own folder, removed with it.
        tmp = Path(self.home.name) / "tmp"
        tmp.mkdir()
        self.shell = subprocess.Popen(
            ["bash", "-c", script], cwd=REPO, env={**env, "TMPDIR": str(tmp)}, start_new_session=True
        )
        self.address = f"http://127.0.0.1:{dashboard}"
        self.env = {**env, "RAY_AUTH_MODE": "token"}  # as docs/clusters.md's shells have it
        self.answers: list[subprocess.CompletedProcess] = []

    def wait(self, timeout: float) -> None:
        """Until it takes a job: its job agent comes up some seconds after the dashboard answers."""
        ready = [str(BIN / "ray"), "job", "submit", "--address", self.address, "--no-wait", "--", "true"]

        def takes_a_job() -> bool:
            self.answers.append(subprocess.run(ready, env=self.env, capture_output=True, text=True, timeout=30))
            return self.answers[-1].returncode == 0

        _wait_for(takes_a_job, "ray head", timeout, stopped=lambda: self.shell.poll() is not None, explain=self.explain)

    def explain(self) -> str:
        """The head's log, Ray's error logs and the last `ray job submit` answer."""
        home = Path(self.home.name)
        last = self.answers[-1] if self.answers else None
        said = f"last `ray job submit` ({last.returncode}): {last.stdout[-1500:]}{last.stderr[-3000:]}" if last else ""
        log = home / "ray-head.log"
        head = f"ray-head.log: {log.read_text(errors='replace')[-3000:]}" if log.exists() else "no ray-head.log"
        logs = [
            *sorted(home.glob("ray/session_latest/logs/*.err")),
            *home.glob("ray/session_latest/logs/dashboard*.log"),
        ]
        tails = "\n".join(f"{f.name}: {f.read_text(errors='replace')[-1500:]}" for f in logs if f.stat().st_size)
        return f"{said}\n{head}\n{tails}"

    def stop_as_the_page_says(self) -> None:
        stop = f"RAY_HEAD={self.pid_file.read_text().strip()}\n{page_line('clusters.md', 'kill $RAY_HEAD')}"
        assert subprocess.run(["bash", "-c", stop], env=self.env).returncode == 0
        self.shell.wait(timeout=30)  # the head is gone, and with it the shell that waited on it

    def close(self) -> None:
        # Also where the page's `kill $RAY_HEAD` ended the head: its processes end after it, and one still writing a
        # session's logs kept the folder from being removed (a fresh clone's run of 2026-12-03).
        stop_process_group(self.shell, 5)
        self.home.cleanup()


@contextmanager
def ray_head():
    """A Ray head started as docs/clusters.md says, in bash, the environment activated, token authentication on,
    `--block` in the background; stopped at the end by the page's `kill $RAY_HEAD`, which must end it in seconds.

    The page's `ray start --head` line runs with free ports: other heads on this machine (other checkouts' tests)
    may hold Ray's defaults. Yields the dashboard's address, the head's port and the shell's environment.

    A head that has taken no job after 150 s is stopped and started once more, with a warning that carries its logs
    (in the run's warnings summary): in one CI run of 374 tests a head waited 300 s and the cause was not kept."""
    head = _Head()
    try:
        try:
            head.wait(150)
        except AssertionError as failed:
            head.close()
            warnings.warn(f"the Ray head was started again after: {failed}", stacklevel=1)
            head = _Head()
            head.wait(300)
        yield head.address, head.port, head.env
        head.stop_as_the_page_says()
    finally:
        head.close()


# docs/clusters.md's benchmark job's config cut to a few samples: the same keys and paths, small work. Every other
# job's command lines are checked by tests/test_docs.py without running them.
SMALL_BENCHMARK = {
    "tasks": 1, "min_tables": 4, "max_tables": 5, "repeats": 2, "rounds": 3, "algorithms": "lookup_greedy,size_greedy",
}  # fmt: skip


@pytest.mark.slow(seconds=75)
def test_the_clusters_pages_benchmark_job_runs_as_pasted(tmp_path, ray_session, mlflow_server):
    with ray_head() as (address, _, env):
        _run_the_benchmark_job(tmp_path, address, env, mlflow_server)
    # the page's `kill $RAY_HEAD` stopped that head only: this process's own local Ray goes on
    assert ray_session.get(ray_session.remote(lambda: 1).remote(), timeout=60) == 1
    _check_benchmark_runs(mlflow_server, "shard-ray-benchmark", tmp_path)


def test_commands_of_a_shell_with_the_pages_ray_address_join_the_head_and_leave_it_running(tmp_path, table_file):
    """docs/clusters.md's `export RAY_ADDRESS=...` in a shell beside its head: each command joins the head rather
    than starting a Ray of its own, and leaves it running for the next (which still takes a job after them)."""
    with ray_head() as (address, port, env):
        script = "\n".join(
            [
                "set -eo pipefail",
                page_line("clusters.md", "source .venv/bin/activate"),
                page_line("clusters.md", "export RAY_AUTH_MODE="),
                page_line("clusters.md", "export RAY_ADDRESS=").replace("6379", str(port)),
                f"cd {tmp_path}",
                f"shard-ray plan --tables {table_file} --devices 2 --memory-gb 1 --algo size_greedy --out plan.json",
                *[
                    f"shard-ray evaluate --tables {table_file} --plan plan.json --rounds 1 --warmup 1 --repeats 2 "
                    f"--out result{i}.json"
                    for i in range(2)
                ],
                # two at once: the first takes the kept gang, the second waits for its devices and takes it after
                # (it asked the keeper once, and failed after 60 s beside the idle gang: a walk)
                *[
                    f"shard-ray evaluate --tables {table_file} --plan plan.json --rounds 1 --warmup 1 --repeats 2 "
                    f"--out both{i}.json 2> both{i}.err & BOTH{i}=$!"
                    for i in range(2)
                ],
                "wait $BOTH0; wait $BOTH1",
            ]
        )
        done = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for i in range(2):
            both = (tmp_path / f"both{i}.err").read_text()
            assert "gang: took the gang of 2 devices an earlier command left on this Ray" in both, both[-2000:]
        assert done.stdout.count(f"ray: joined cluster at 127.0.0.1:{port}") == 4, done.stdout
        assert "started a local instance" not in done.stdout
        # the first left its gang on the head, and the second took it rather than start one
        assert done.stderr.count("gang: left on this Ray for the next command for 60 s") == 2, done.stderr
        assert done.stderr.count("gang: took the gang of 2 devices an earlier command left on this Ray") == 1, (
            done.stderr
        )
        ready = [str(BIN / "ray"), "job", "submit", "--address", address, "--no-wait", "--", "true"]
        assert subprocess.run(ready, env=env, capture_output=True, timeout=60).returncode == 0
        # a shell without the page's RAY_AUTH_MODE, or with another token: told so in a line at once, where Ray
        # retried for 20 s and said only that it could not connect
        evaluate = [str(BIN / "shard-ray"), "evaluate", "--tables", str(table_file), "--plan", "plan.json"]
        evaluate += ["--address", f"127.0.0.1:{port}", "--out", "refused.json"]
        without = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
        for shell, said in (
            (without, "uses token authentication: set RAY_AUTH_MODE=token"),
            ({**env, "RAY_AUTH_TOKEN": "0" * 32}, "refused this client's token"),
        ):
            done = subprocess.run(evaluate, env=shell, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr


# Run joined to a head: its free CPUs and whether the gangs' keeper is there, looked at until every CPU is free and
# the keeper gone or the seconds given are up, what it saw last printed; a 2-device gang in a process then killed with
# no chance to hand its gang back, its members' process ids printed.
HEAD_FREED = """
import json, sys, time, ray
ray.init(logging_level="ERROR")
deadline = time.monotonic() + float(sys.argv[1])
while True:
    keeper = any(a["name"] == "gang-keeper" for a in ray.util.list_named_actors(all_namespaces=True))
    state = {"free": ray.available_resources().get("CPU", 0), "all": ray.cluster_resources()["CPU"], "keeper": keeper}
    if state["free"] == state["all"] and not keeper or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(state))
"""
KILLED_DRIVER = """
import os, signal, sys, ray
from shard_ray.runtime import connect_ray
from shard_ray.profiling.gang import DeviceGang
connect_ray()
gang = DeviceGang(2)
print(" ".join(str(h["pid"]) for h in ray.get([m.host.remote() for m in gang.members])), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow(seconds=90)
def test_a_kept_gang_ends_when_its_time_is_up_and_with_a_driver_that_died(tmp_path, table_file):
    """A command joined to a head leaves its gang there for `SHARD_RAY_KEEP_GANG_S` seconds (docs/commands.md), after
    which its members, its devices and the keeper are gone; a driver killed while it holds a gang, one it started or one
    it took, leaves nothing."""

    def head_freed(env: dict[str, str], what: str, within_s: float = 60.0) -> None:
        """Every device free and the keeper gone within `within_s`, as one driver polling the head sees it (a new
        process for each look started Python and Ray afresh, about 2 CPU-s a look)."""
        done = subprocess.run([sys.executable, "-c", HEAD_FREED, str(within_s)], env=env, capture_output=True,
                              text=True, timeout=within_s + 120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        state = json.loads(done.stdout.strip().splitlines()[-1])
        assert state["free"] == state["all"] and not state["keeper"], f"not within {within_s:.0f} s: {what}: {state}"

    def until(check, what: str, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while not check():
            assert time.monotonic() < deadline, f"not within {within_s:.0f} s: {what}"
            time.sleep(1.0)

    with ray_head() as (_, port, env):
        env = {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        bin_env = {**env, "PATH": f"{BIN}:{env['PATH']}"}
        plan = [str(BIN / "shard-ray"), "plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1"]
        subprocess.run([*plan, "--algo", "size_greedy", "--out", "plan.json"], cwd=tmp_path, env=bin_env, check=True)
        evaluate = [str(BIN / "shard-ray"), "evaluate", "--tables", str(table_file), "--plan", "plan.json"]
        evaluate += ["--rounds", "1", "--warmup", "1", "--repeats", "2", "--out", "result.json"]
        done = subprocess.run(evaluate, cwd=tmp_path, env={**bin_env, "SHARD_RAY_KEEP_GANG_S": "3"},
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0 and "gang: left on this Ray for the next command for 3 s" in done.stderr, done
        head_freed(env, "the kept gang's devices freed and the keeper gone")

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"

        # killed holding a gang it started (no keeper running yet), then one an earlier command left
        for kept in (False, True):
            if kept:
                done = subprocess.run(evaluate, cwd=tmp_path, env=bin_env, capture_output=True, text=True, timeout=600)
                assert done.returncode == 0 and "gang: left on this Ray" in done.stderr, done
            killed = subprocess.run([sys.executable, "-c", KILLED_DRIVER], env=env, capture_output=True, text=True,
                                    timeout=300)  # fmt: skip
            assert killed.returncode == -9, killed.stderr[-2000:]
            assert ("gang: took the gang of 2 devices" in killed.stderr) == kept, killed.stderr[-2000:]
            pids = [int(pid) for pid in killed.stdout.split()]
            assert len(pids) == 2
            until(lambda: all(gone(pid) for pid in pids), "the killed driver's members ended")
            head_freed(env, "the killed driver's devices freed and the keeper gone")
        # a bad setting is refused in a line, before the command joins the head
        done = subprocess.run(evaluate, cwd=tmp_path, env={**bin_env, "SHARD_RAY_KEEP_GANG_S": "soon"},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "SHARD_RAY_KEEP_GANG_S='soon'" in lines[0], done.stderr
        assert "ray:" not in done.stdout, done.stdout


def _run_the_benchmark_job(tmp_path: Path, address: str, env: dict[str, str], mlflow_server: str) -> None:
    """Step 3 of docs/clusters.md's Run on a cluster, its settings and its benchmark job, pasted into bash after its
    activation line, on its head: the one job that needs no other job's output."""
    config = tmp_path / "benchmark.yaml"
    original = yaml.safe_load((REPO / "experiments" / "configs" / "benchmark.yaml").read_text())
    config.write_text(yaml.safe_dump({**original, **SMALL_BENCHMARK}))
    statements = page_block("clusters.md", "ray job submit").replace("\\\n", " ").splitlines()
    settings = [s for s in statements if not s.startswith("ray job submit")]
    (job,) = [s for s in statements if "experiments/benchmark.py" in s]
    job = (
        job.replace("http://127.0.0.1:8265", address)
        .replace("http://127.0.0.1:5000", mlflow_server)
        .replace("experiments/configs/benchmark.yaml", str(config))
    )
    script = "\n".join(
        [
            "set -eo pipefail",
            page_line("clusters.md", "source .venv/bin/activate"),
            "export RAY_AUTH_MODE=token",
            *[s.replace("http://127.0.0.1:5000", mlflow_server) for s in settings],
            job,
        ]
    )
    before = _working_dir_entries()
    done = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "succeeded" in done.stdout and "joined cluster" in done.stdout, done.stdout[-4000:]
    # the job wrote its results, store and runs outside the directory Ray packaged, and its log is as quiet as the CLI
    assert _working_dir_entries() == before
    assert "View run" not in done.stdout and "View experiment" not in done.stdout
    assert (Path(env["HOME"]) / "shard-ray-runs" / "benchmark" / "benchmark.json").is_file()


def _working_dir_entries() -> dict[str, int]:
    """What `--working-dir .` uploads from (the repository's top level, less the caches that tests running beside
    this one write: pytest's and hypothesis'), with modification times."""
    return {
        p.name: p.stat().st_mtime_ns for p in REPO.iterdir() if p.name not in (".pytest_cache", ".hypothesis", ".git")
    }


def _check_benchmark_runs(uri: str, experiment: str, tmp_path: Path) -> None:
    """The benchmark's runs as the MLflow UI shows them: one per algorithm, alike in tags and metrics so that Compare
    lines them up, with the plan, its result and the device chart; and the summary run with the report."""
    from mlflow.tracking import MlflowClient

    runs = _search_runs(uri, experiment)
    assert len(runs) == 3 and {r["info"]["status"] for r in runs} == {"FINISHED"}
    summary = next(r for r in runs if r["info"]["run_name"] == "benchmark")
    per_plan = [r for r in runs if r is not summary]
    tags = [{t["key"]: t["value"] for t in r["data"]["tags"]} for r in per_plan]
    assert {t["algorithm"] for t in tags} == {"lookup_greedy", "size_greedy"}
    assert len({t["task"] for t in tags}) == 1 and {t["devices"] for t in tags} == {"2"}
    assert all(t["hardware"].startswith("cpu:") for t in tags)
    metric_names = [{m["key"] for m in r["data"]["metrics"]} for r in per_plan]
    assert metric_names[0] == metric_names[1]
    assert {"cost_ms", "placement_seconds", "device_0_total_ms"} <= metric_names[0]
    client = MlflowClient(tracking_uri=uri)
    run_id = per_plan[0]["info"]["run_id"]
    assert {"plan.json", "result.json", "device_costs.png"} <= {a.path for a in client.list_artifacts(run_id)}
    plan = json.loads(Path(client.download_artifacts(run_id, "plan.json", str(tmp_path))).read_text())
    assert plan["num_devices"] == 2 and plan["algorithm"] in {"lookup_greedy", "size_greedy"}
    assert {"benchmark.md", "benchmark.csv", "benchmark.png", "benchmark.json"} <= {
        a.path for a in client.list_artifacts(summary["info"]["run_id"])
    }
    assert {m["key"] for m in summary["data"]["metrics"]} >= {"mean_cost_ms.lookup_greedy", "mean_cost_ms.size_greedy"}


def test_launcher_files_validate_against_rays_schema():
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    for name in ("gpu-cloud.yaml", "on-prem.yaml"):
        config = yaml.safe_load((REPO / "cluster" / name).read_text())
        validate_config(config)  # the file as written, against ray-schema.json (raises on what `ray up` would refuse)
        validate_config(
            prepare_config(copy.deepcopy(config))
        )  # and with the launcher's defaults filled in, as `ray up` does
        assert any("shard-ray" in c or "pip install" in c for c in config["setup_commands"])
        # every node's workers at normal priority (Ray's default nice 15 starved the measuring actors)
        starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        assert all("RAY_worker_niceness=0" in c for c in starts if "ray start" in c)
    cloud = yaml.safe_load((REPO / "cluster" / "gpu-cloud.yaml").read_text())
    workers = cloud["available_node_types"]["gpu_worker"]
    assert workers["resources"]["GPU"] == 8
    assert any("fbgemm-gpu==1.8.0" in c for c in cloud["setup_commands"])
    on_prem = yaml.safe_load((REPO / "cluster" / "on-prem.yaml").read_text())
    assert on_prem["provider"]["type"] == "local"


def test_kuberay_rayjob_manifest_parses():
    manifest = yaml.safe_load((REPO / "cluster" / "kuberay-rayjob.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    assert spec["entrypoint"].startswith("python experiments/")
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == 8
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert all({"name": "RAY_worker_niceness", "value": "0"} in c["env"] for c in (head, workers))
