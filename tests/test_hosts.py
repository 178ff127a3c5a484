"""Hosts emulated on one machine (`shard-ray hosts`), run as docs/clusters.md writes the commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pages import code_blocks, page_line

from shard_ray.hosts import MAX_HOSTS, NODE_MEMORY_BYTES, _available_memory
from shard_ray.process_groups import group_alive, stop_process_group

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"


def _shell_env(home: Path) -> dict[str, str]:
    """A shell after `make setup` and `source .venv/bin/activate`, with its own shard-ray home."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(REPO / ".venv")
    env["SHARD_RAY_HOME"] = str(home)
    return env


def _run(line: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _namespaces(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [ns for ns in listed if ns.startswith(f"srh-{name}-")]


@contextmanager
def _emulated_cluster(name: str, layout: str, env: dict[str, str], cwd: Path) -> Iterator[str]:
    """`hosts up` with `layout` and, after the block, `hosts down`, as a user types them; what up printed. Down must
    leave no namespace."""
    up = _run(f"shard-ray hosts up {layout} --name {name}", env, cwd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield up.stdout
    finally:
        down = _run(f"shard-ray hosts down {name}", env, cwd)
    assert down.returncode == 0, down.stderr
    assert not _namespaces(name)


needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["which", "ip", "tc"], capture_output=True).returncode != 0,
    reason="emulated hosts need root and iproute2's ip and tc, which this machine lacks",
)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ("--rate fast", "link rate 'fast' is not a rate such as 200mbit"),
        ("--rate 50mbps", "write 50mbit for bits a second (tc reads bps as bytes)"),
        ("--name Big_Name", "cluster name 'Big_Name': 1 to 12 lower-case letters"),
        (f"--hosts {MAX_HOSTS + 1}", f"--hosts must be 1 to {MAX_HOSTS}"),
    ],
)
def test_hosts_up_refuses_bad_input_in_one_line_and_makes_nothing(tmp_path, flags, said):
    env = _shell_env(tmp_path)
    done = _run(f"shard-ray hosts up {flags}", env, tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert not (tmp_path / "hosts").exists() and not _namespaces("emulated")


def test_hosts_down_and_run_name_what_is_missing(tmp_path):
    env = _shell_env(tmp_path)
    done = _run("shard-ray hosts down nothing-here", env, tmp_path)
    assert done.returncode == 2 and "no emulated cluster named nothing-here is up (up: none)" in done.stderr
    done = _run("shard-ray hosts run", env, tmp_path)
    assert done.returncode == 2 and "give the command to run after --" in done.stderr
    # docs/clusters.md's line, as written: the cluster is the default one, not the command's first word
    done = _run(page_line("clusters.md", "shard-ray hosts run -- shard-ray evaluate"), env, tmp_path)
    assert done.returncode == 2 and "no emulated cluster named emulated is up (up: none)" in done.stderr, done.stderr
    done = _run("shard-ray hosts run one two -- env", env, tmp_path)
    assert done.returncode == 2 and "one cluster name before --, got one two" in done.stderr


@needs_namespaces
def test_hosts_up_refuses_more_hosts_than_memory_holds_before_making_any(tmp_path):
    # Well past the limit (MEMORY_SHARE of the memory available): what is available moves while tests run beside
    # this one, and a count just past it was once taken, and started, by the command a moment later.
    hosts = int(_available_memory() // NODE_MEMORY_BYTES) + 1
    if hosts > MAX_HOSTS:
        pytest.skip(f"this machine's memory holds {MAX_HOSTS} hosts, the most `hosts up` makes")
    done = _run(f"shard-ray hosts up --hosts {hosts} --name toomany", _shell_env(tmp_path), tmp_path)
    assert done.returncode == 2 and f"{hosts} hosts need about" in done.stderr, done.stderr
    assert not _namespaces("toomany") and not (tmp_path / "hosts" / "toomany.json").exists()


def _raylet_environments(leaders: set[int]) -> list[list[str]]:
    """The environment of each raylet in the process groups of `leaders` (each node's `ray start`)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "raylet":
                if os.getpgid(int(proc.name)) in leaders:
                    found.append((proc / "environ").read_text().split("\0"))
        except OSError:  # ended since it was listed
            continue
    return found


@pytest.mark.slow
@pytest.mark.alone
@needs_namespaces
def test_emulated_hosts_come_up_carry_a_gang_over_their_links_and_go_down_leaving_nothing():
    """docs/clusters.md's four lines, with a name of the test's own: 3 hosts at 200 Mbit/s come up, the link's
    achieved rate is measured twice (a warning when the two differ by more than 10%); a 3-device plan's gang spans
    the 3 hosts; down stops every process it started and leaves no namespace, link, state file or Ray folder."""
    name = f"t{os.getpid() % 10**6}"
    with tempfile.TemporaryDirectory(prefix="shard-ray-hosts-") as folder:
        work = Path(folder)
        env = _shell_env(work / "home")
        up = page_line("clusters.md", "shard-ray hosts up") + f" --name {name}"
        done = _run(up, env, work)
        try:
            assert done.returncode == 0, done.stdout + done.stderr
            rates = [float(r) for r in re.search(r"measured host 0 -> 1: (\d+), (\d+) Mbit/s", done.stdout).groups()]
            assert all(150 <= r <= 205 for r in rates), done.stdout
            # the flags that price plans for these hosts: the slower measurement, the host's devices sharing its link
            flags = re.search(r"--devices-per-host 1 --inter-host-gbps ([\d.]+) --host-link-gbps ([\d.]+)", done.stdout)
            assert flags and flags[1] == flags[2] and float(flags[1]) * 8e3 == pytest.approx(min(rates), rel=0.01)
            # Steadiness is the machine's, not the code's (a loaded 2-core CI machine measured 190 and 166): the
            # warning must say which it was.
            spread = max(rates) / min(rates)  # of the printed, rounded rates: judged away from the bound only
            assert abs(spread - 1.1) < 0.02 or ("not steady" in done.stdout) == (spread > 1.1), done.stdout
            assert len(_namespaces(name)) == 4  # 3 hosts and the switch
            state = json.loads((work / "home" / "hosts" / f"{name}.json").read_text())
            # each node's Ray starts its workers at nice 0 (Ray's default, 15, starved the measuring actors)
            environments = _raylet_environments(set(state["pids"]))
            assert len(environments) == 3 and all("RAY_worker_niceness=0" in e for e in environments), environments
            listed = _run("shard-ray hosts list", env, work)
            assert f"{name}: 3 hosts of 1 device, links of 200 Mbit/s each way" in listed.stdout
            plan = page_line("clusters.md", "shard-ray plan --tables experiments/tables/criteo_kaggle.json")
            plan = plan.replace("experiments/", f"{REPO}/experiments/")
            assert _run(plan, env, work).returncode == 0
            evaluate = page_line("clusters.md", "shard-ray hosts run -- shard-ray evaluate")
            evaluate = evaluate.replace("hosts run --", f"hosts run {name} --").replace(
                "experiments/", f"{REPO}/experiments/"
            )
            done = _run(evaluate, env, work)
            assert done.returncode == 0, done.stdout + done.stderr
            assert (
                "the gang spanned 3 Ray nodes (host 0: devices [0], host 1: devices [1], host 2: devices [2])"
                in done.stdout
            )
            devices = json.loads((work / "evaluated3.json").read_text())["devices"]
            assert len(devices) == 3
            # the hosts know each other's names, so gloo does not warn that it cannot name its peers
            assert "hostname of the client socket cannot be retrieved" not in done.stdout + done.stderr
            assert "given no --devices-per-host" not in done.stderr
            # the same plan made as for one host: measured over the links, priced without them, and said so
            one_host = re.sub(r" --devices-per-host \S+ --inter-host-gbps \S+", "", plan).replace("plan3", "flat3")
            assert _run(one_host, env, work).returncode == 0
            # one round: the warning is said when the gang starts; the measurement is the 3 rounds' above
            flat = evaluate.replace("plan3", "flat3").replace("evaluated3", "flat3_evaluated")
            done = _run(flat.replace("--rounds 3", "--rounds 1"), env, work)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "the gang spans 3 Ray nodes, but was given no --devices-per-host" in done.stderr, done.stderr
        finally:
            down = _run(f"shard-ray hosts down {name}", env, work)
        assert down.returncode == 0, down.stderr
        assert not _namespaces(name) and not list(Path("/etc/netns").glob(f"srh-{name}-*"))  # nor their hosts files
        for pid in state["pids"]:
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
        assert not (work / "home" / "hosts" / f"{name}.json").exists() and not Path(state["temp_dir"]).exists()


@needs_namespaces
@pytest.mark.slow
@pytest.mark.alone
def test_over_slow_links_a_plan_keeping_its_sums_inside_a_host_measures_faster_and_is_priced_so():
    """2 hosts of 2 devices joined at 50 Mbit/s. One wide table row-wise over the 4 devices sends half of every
    device's partial sums across the link; table-row-wise over host 0's 2 devices adds them up inside the host
    and sends a quarter across. `compare`, typed as a user would inside the cluster, measures the second faster,
    separated, and the plans' prices (the links' price over hosts) order them the same way."""
    name = f"l{os.getpid() % 10**6}"
    with tempfile.TemporaryDirectory(prefix="shard-ray-hosts-") as folder:
        work = Path(folder)
        env = _shell_env(work / "home")
        tables = {"tables": [{"name": "wide", "rows": 100_000, "dim": 128, "pooling_factor": 2.0}]}
        tables["tables"] += [{"name": f"s{i}", "rows": 1_000, "dim": 16, "pooling_factor": 1.0} for i in range(2)]
        (work / "tables.json").write_text(json.dumps(tables))
        for kind in ("table_row_wise", "row_wise"):
            (work / f"{kind}.yaml").write_text(f"tables:\n  wide: {{types: [{kind}]}}\n")
            done = _run(
                "shard-ray plan --tables tables.json --devices 4 --devices-per-host 2 --inter-host-gbps 0.00625 "
                f"--memory-gb 1 --algo size_greedy --constraints {kind}.yaml --out {kind}.json",
                env,
                work,
            )
            assert done.returncode == 0, done.stderr
        compare = (
            "shard-ray compare --tables tables.json --plans table_row_wise.json row_wise.json --rounds 6 --warmup 1 --repeats 4 "
            "--no-mlflow"
        )
        with _emulated_cluster(name, "--hosts 2 --devices-per-host 2 --rate 50mbit", env, work):
            done = _run(f"shard-ray hosts run {name} -- {compare} --out cmp", env, work)
        assert done.returncode == 0, done.stdout + done.stderr
        written = json.loads((work / "cmp" / "comparison.json").read_text())
        measured = {k: cost["cost_ms"] for k, cost in written["costs"].items()}
        ratio = written["comparison"]["ratios"]["row_wise"]
        assert written["comparison"]["chosen"] == "table_row_wise" and ratio["separated"], (measured, ratio)
        assert ratio["low"] > 1.0 and ratio["ratio"] > 1.5, (measured, ratio)
        priced = {
            kind: json.loads((work / f"{kind}.json").read_text())["estimate"]["predicted"]["cost_ms"]
            for kind in ("table_row_wise", "row_wise")
        }
        assert priced["row_wise"] > 1.2 * priced["table_row_wise"], priced


@pytest.fixture(scope="module")
def two_hosts_at_50_mbit():
    """docs/commands.md's two hosts of one device joined at 50 Mbit/s (`hosts up`, as a user types it), up once for the
    tests that run commands in it and down after them, leaving no namespace: (its name, a shell's environment with
    the home that knows it, what `hosts up` printed). Each test runs in a folder of its own."""
    name = f"p{os.getpid() % 10**6}"
    with tempfile.TemporaryDirectory(prefix="shard-ray-hosts-") as folder:
        env = _shell_env(Path(folder) / "home")
        layout = page_line("commands.md", "shard-ray hosts up --hosts 2").removeprefix("shard-ray hosts up ")
        with _emulated_cluster(name, layout, env, Path(folder)) as up:
            yield name, env, up


@needs_namespaces
@pytest.mark.slow
@pytest.mark.alone
def test_bench_over_emulated_hosts_plans_for_them_on_a_gang_spanning_them(two_hosts_at_50_mbit, tmp_path):
    """docs/commands.md's `bench` over its 2 emulated hosts, on the README's table file: the algorithms plan for hosts
    of one device (TorchRec's plan included, which over such hosts calls a table on one rank table-row-wise), the gang
    spans both hosts and says so, and the report records the hosts. (Fewer algorithms and rounds than the page's
    line: what is judged is that it runs over the hosts, not which plan wins. Alone, as the other emulated clusters:
    beside the parallel pass on a 2-core machine, once, its Ray nodes did not come up.)"""
    name, env, _ = two_hosts_at_50_mbit
    tables = next(b for b in code_blocks(REPO / "README.md") if "cat > my_model.json" in b)
    assert _run(tables, env, tmp_path).returncode == 0
    bench = page_line("commands.md", "shard-ray hosts run -- shard-ray bench").replace(
        "hosts run --", f"hosts run {name} --"
    )
    bench += " --algorithms torchrec,cost_search,size_greedy --rounds 3 --repeats 4 --budget-seconds 30"
    done = _run(bench, env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the gang spanned 2 Ray nodes (host 0: devices [0], host 1: devices [1])" in done.stdout, done.stdout
    out = tmp_path / bench.split("--out ")[1].split()[0]
    report = json.loads((out / "benchmark.json").read_text())
    assert report["tasks"] == 1 and report["settings"]["devices_per_host"] == 1, report["settings"]
    assert set(report["per_task"]["my_model"]) == {"torchrec", "cost_search", "size_greedy"}, report["failures"]


@needs_namespaces
@pytest.mark.slow
@pytest.mark.alone
def test_calibrate_across_emulated_hosts_recovers_the_rate_their_links_achieve(two_hosts_at_50_mbit, tmp_path):
    """2 hosts of 1 device joined at 50 Mbit/s, where the links and not the 2 cores bound the all-to-alls:
    `calibrate` run inside the cluster, as a user types it, fits the rate between the hosts to the all-to-alls its
    gang measured, within 15% of the rate a TCP stream measured when the cluster came up (47-49 Mbit/s against 48
    in two runs), says so in one line and keeps it in the model file, where `plan` over such hosts takes it."""
    name, env, up = two_hosts_at_50_mbit
    assert "2 hosts of 1 device, links of 50 Mbit/s each way" in up, up  # the hosts the command below is given
    # five small tables: the candidates' plans and 2 random ones give enough all-to-alls to fit the rate (18 of
    # them), in about a minute, well inside the budget; too few held-out measurements to judge the models'
    # fine-tuning by (it keeps the models it started from and says so), which this test does not judge
    tables = [{"name": f"t{i}", "rows": 4_000 * (i + 1), "dim": 32, "pooling_factor": 1 + i % 4} for i in range(5)]
    (tmp_path / "tables.json").write_text(json.dumps({"tables": tables}))
    calibrate = (
        "shard-ray calibrate --tables tables.json --devices 2 --devices-per-host 1 --inter-host-gbps 0.00625 "
        "--memory-gb 1 --budget-minutes 2 --shards 0 --plans 2 --held-out 0.5 --noise-rounds 3 --warmup 1 --repeats 3 "
        "--no-mlflow "
        "--out calibrated.pt"
    )
    calibrated = _run(f"shard-ray hosts run {name} -- {calibrate}", env, tmp_path)
    assert calibrated.returncode == 0, calibrated.stdout + calibrated.stderr
    link = max(float(r) for r in re.search(r"measured host 0 -> 1: (\d+), (\d+) Mbit/s", up).groups())
    fitted = re.search(r"links between hosts: (\S+) GB/s \((\d+) Mbit/s\) achieved", calibrated.stdout)
    assert fitted and float(fitted.group(2)) == pytest.approx(link, rel=0.15), (link, calibrated.stdout)
    from shard_ray.costmodel.models import CostModels

    kept = CostModels.load(tmp_path / "calibrated.pt").info.links
    assert kept is not None and kept.inter_host_gbps == pytest.approx(float(fitted.group(1)), rel=1e-3)
    # and a plan over such hosts with these models, given no rate, takes it
    planned = _run(
        "shard-ray plan --tables tables.json --devices 2 --devices-per-host 1 --memory-gb 1 --algo size_greedy "
        "--cost-model calibrated.pt --out plan.json",
        env,
        tmp_path,
    )
    assert planned.returncode == 0 and "the rate `calibrate` fitted" in planned.stdout, planned.stderr
    recorded = json.loads((tmp_path / "plan.json").read_text())["settings"]["inter_host_gbps"]
    assert recorded == pytest.approx(kept.inter_host_gbps)


def test_a_process_group_is_stopped_whole_after_its_leader_has_ended():
    """A group whose leader has ended and whose members ignore SIGTERM, as a Ray head's processes outlive the page's
    `kill $RAY_HEAD` for a while: stopping it SIGKILLs what is left after the grace and returns once nothing is."""
    group = subprocess.Popen(
        ["bash", "-c", "for _ in 1 2; do (trap '' TERM; echo ready; exec sleep 60) & done; wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert [group.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]
        os.kill(group.pid, 9)  # the leader alone
        group.wait(timeout=10)
        assert group_alive(group.pid)  # its members go on
        started = time.monotonic()
        stop_process_group(group, grace_s=0.5)
        assert not group_alive(group.pid) and time.monotonic() - started >= 0.5
    finally:
        if group_alive(group.pid):
            os.killpg(group.pid, 9)


def _sleeping_in(ns: str) -> bool:
    """Whether a `sleep 120` runs in network namespace `ns`."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in listed:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00120\x00":
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow(seconds=30)
@needs_namespaces
def test_hosts_down_refuses_a_cluster_coming_up_or_with_a_command_running_on_it(tmp_path):
    """Taken down under a command, the command waited a minute on a Ray gone and lost what it had measured; under
    its `hosts up`, that failed a minute later pointing at logs gone (a walk). `down` refuses both, naming the process,
    and `up` of the same name says the cluster is coming up; once the command ends, `down` takes the cluster down."""
    name = f"d{os.getpid() % 10**6}"
    env = _shell_env(tmp_path / "home")
    up = subprocess.Popen(["bash", "-c", f"shard-ray hosts up --hosts 1 --name {name}"], env=env, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    running = None
    try:
        state = tmp_path / "home" / "hosts" / f"{name}.json"
        deadline = time.monotonic() + 60
        while not state.exists():
            assert time.monotonic() < deadline and up.poll() is None, up.stdout.read() if up.poll() is not None else ""
            time.sleep(0.1)
        done = _run(f"shard-ray hosts down {name}", env, tmp_path)
        if up.poll() is None:  # still coming up once down has looked (a 1-host cluster takes seconds)
            assert done.returncode == 2 and f"{name} is still coming up (`shard-ray hosts up`, pid " in done.stderr
            again = _run(f"shard-ray hosts up --hosts 1 --name {name}", env, tmp_path)
            assert again.returncode == 2 and f"named {name} is coming up;" in again.stderr, again.stderr
        assert up.wait(timeout=240) == 0, up.stdout.read()
        running = subprocess.Popen(["bash", "-c", f"exec shard-ray hosts run {name} -- sleep 120"], env=env,
                                   cwd=tmp_path)  # fmt: skip
        deadline = time.monotonic() + 60
        while not _sleeping_in(f"srh-{name}-0"):  # the command on its way into the host
            assert time.monotonic() < deadline and running.poll() is None, "the command never ran in host 0"
            time.sleep(0.2)
        done = _run(f"shard-ray hosts down {name}", env, tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert re.search(rf"1 command still runs on {name}: pid \d+ \(sleep 120\); stop it first", lines[0]), lines[0]
        assert _namespaces(name)
    finally:
        if running is not None:
            running.terminate()
            running.wait(timeout=30)
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=120)
    done = _run(f"shard-ray hosts down {name}", env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert not _namespaces(name)
