"""`shard-ray doctor` as a user types it, its verdicts on nodes it cannot meet here, and the GPU install
route of the launcher files checked against fbgemm's release rule."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ports import free_port

from shard_ray.costmodel.models import CostModels, models_for
from shard_ray.doctor import DOCTOR_BATCH, cuda_tag, doctor_shards, expected_fbgemm, node_findings, prices_finding
from shard_ray.workload.tables import TableSpec

REPO = Path(__file__).resolve().parent.parent
SHARD_RAY = str(Path(sys.executable).parent / "shard-ray")


def doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # As in a fresh shell: tests before may have exported a Ray address or an MLflow URI (mlflow does).
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.run(
        [SHARD_RAY, "doctor", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow(seconds=55)
def test_doctor_on_this_machine(tmp_path):
    done = doctor(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"ok +fbgemm: fbgemm-gpu-cpu 1\.8\.\d+, the release for torch 2\.13", out), out
    assert re.search(r"ok +fused kernels: a fused shard trained on cpu: forward [0-9.]+ ms", out), out
    assert "ok       Ray: a local Ray starts and runs tasks" in out
    # the noise floor: a plan against a copy of itself on a 2-device gang, and the smallest difference a comparison sees
    assert re.search(
        r"ok +noise floor: .*2-device gang: a plan against a copy of itself \(8 rounds\): rounds differ by", out
    )
    assert re.search(r"separates differences of about [0-9.]+% or more", out), out
    # the models plan uses, held against the microbenchmark's shards timed here
    assert re.search(r"(ok|note) +prices: cpu:.*: the models \S+ price 7 microbenchmark shards timed here at", out), out
    assert f"local store {tmp_path / 'mlflow.db'}" in out and not (tmp_path / "mlflow.db").exists()
    assert out.rstrip().endswith("no problems found")


@pytest.mark.slow
def test_doctor_names_what_is_unreachable_and_exits_1_at_once(tmp_path):
    port = free_port()
    done = doctor(tmp_path, "--address", f"127.0.0.1:{port}", "--tracking-uri", f"http://127.0.0.1:{port}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"problem  Ray: nothing answers at the Ray address 127.0.0.1:{port}" in done.stdout
    assert f"problem  MLflow: the tracking server at http://127.0.0.1:{port} does not answer" in done.stdout
    assert "fix: start it (`mlflow server" in done.stdout
    assert "2 problems found: Ray; MLflow" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_this_machine_only_starts_no_ray(tmp_path):
    done = doctor(tmp_path, "--this-machine")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ray:" not in done.stdout and "fused kernels" in done.stdout


def test_this_machine_times_the_fused_shard_on_one_thread_as_profiling_does(monkeypatch):
    """`--this-machine` times its fused shard in the command's own process: on torch's threads, beside two busy
    processes, its backward took 59-95 ms against 0.16-0.23 ms on one thread (a new user's walk). The shard is timed
    on one thread, and the command's threads are left as they were."""
    import torch

    from shard_ray import doctor
    from shard_ray.profiling import fused_shard

    threads_while_timed = []

    def timed_here(*args, **kwargs):
        threads_while_timed.append(torch.get_num_threads())
        return measure(*args, **kwargs)

    measure = fused_shard.measure_fused_shard
    monkeypatch.setattr(fused_shard, "measure_fused_shard", timed_here)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report, _ = doctor._run_fused_shard()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert threads_while_timed == [1] and report["bwd_ms"] > 0


def _gpu_node(**changes) -> dict:
    report = {
        "host": "gpu-node",
        "python": "3.12.3",
        "cpus": 64,
        "torch": "2.13.0+cu130",
        "torch_cuda": "13.0",
        "gpus": ["NVIDIA H100 80GB HBM3"] * 8,
        "nccl": "2.27.5",
        "fbgemm": {"package": "fbgemm-gpu", "version": "1.8.0+cu130"},
        "fused_shard": {"device": "cuda", "fwd_ms": 0.05, "bwd_ms": 0.1},
        "hardware": "cuda:NVIDIA H100 80GB HBM3",
    }
    return {**report, **changes}


def _problems(report: dict) -> dict[str, str]:
    return {f.what: f"{f.detail} | {f.fix}" for f in node_findings(report) if f.level == "problem"}


def test_verdicts_on_gpu_nodes():
    assert _problems(_gpu_node()) == {}
    # The CPU fbgemm left in place on a CUDA node (the route's uninstall skipped): its fix installs the CUDA build.
    cpu_fbgemm = _problems(_gpu_node(fbgemm={"package": "fbgemm-gpu-cpu", "version": "1.8.0"}))
    assert "no CUDA kernels" in cpu_fbgemm["fbgemm"]
    assert "pip install fbgemm-gpu==1.8.* --index-url https://download.pytorch.org/whl/cu130" in cpu_fbgemm["fbgemm"]
    # fbgemm of another torch release, and of another CUDA build.
    assert (
        "not the release for torch 2.13.0 (1.8)"
        in _problems(_gpu_node(fbgemm={"package": "fbgemm-gpu", "version": "1.6.0"}))["fbgemm"]
    )
    other_cuda = _problems(_gpu_node(fbgemm={"package": "fbgemm-gpu", "version": "1.8.0+cu128"}))
    assert "built for cu128, torch for cu130" in other_cuda["fbgemm"]
    # torch's CPU build on a node whose GPUs Ray counts; kernels that do not load; no NCCL.
    cpu_torch = _problems(_gpu_node(torch="2.13.0+cpu", torch_cuda=None, gpus=[], nccl=None, gpus_declared=8))
    assert "has no CUDA, but the node has GPUs" in cpu_torch["torch"]
    broken = _problems(_gpu_node(fused_shard={"error": "RuntimeError: no kernel image is available"}))
    assert "no kernel image" in broken["fused kernels"]
    assert "NCCL" in _problems(_gpu_node(nccl=None))


def test_a_node_whose_workers_stay_below_normal_priority_is_noted_with_its_fix():
    """Ray starts its workers at nice 15; where the measuring actors may not raise themselves (a user without the
    right), doctor says what that does to measurements and how to start the node instead."""

    def notes(report: dict) -> dict[str, str]:
        return {f.what: f"{f.detail} | {f.fix}" for f in node_findings(report) if f.level == "note"}

    # a report of this machine (the command's own process, not a Ray worker) has none, nor an earlier release's;
    # workers as nice as a command its user niced are as asked
    reports = ({"niceness": 0}, {"niceness": None}, {}, {"niceness": 10, "command_niceness": 10})
    assert not any("priority" in notes(_gpu_node(**r)) for r in reports)
    low = notes(_gpu_node(niceness=15, command_niceness=0))["priority"]
    assert "run at nice 15, below the command's 0, and this user may not raise them" in low
    assert "RAY_worker_niceness=0 ray start" in low
    assert _problems(_gpu_node(niceness=15, command_niceness=0)) == {}  # it measures, less faithfully beside others


def test_the_gpu_install_route_pairs_fbgemm_with_torch_and_its_cuda():
    """Every place that installs the CUDA stack (the AWS launcher file, the KubeRay image recipe, the
    docs' install page) installs the fbgemm-gpu release made for its torch, from the index of the same CUDA build."""
    setup = "\n".join(yaml.safe_load((REPO / "cluster" / "gpu-cloud.yaml").read_text())["setup_commands"])
    routes = {
        "gpu-cloud.yaml": setup,
        "cluster/README.md": (REPO / "cluster" / "README.md").read_text(),
        "docs/install.md": (REPO / "docs" / "install.md").read_text(),
    }
    for where, text in routes.items():
        torch = re.findall(r"torch==([\d.]+) --index-url https://download\.pytorch\.org/whl/(cu\d+)", text)
        fbgemm = re.findall(r"fbgemm-gpu==([\d.]+) --index-url https://download\.pytorch\.org/whl/(cu\d+)", text)
        assert torch and fbgemm, f"{where}: no CUDA install route found"
        for (torch_version, torch_cuda), (fbgemm_version, fbgemm_cuda) in zip(torch, fbgemm, strict=True):
            assert fbgemm_version.startswith(expected_fbgemm(torch_version) + "."), (
                where,
                torch_version,
                fbgemm_version,
            )
            assert fbgemm_cuda == torch_cuda, where
    assert expected_fbgemm("2.11.0") == "1.6" and expected_fbgemm("2.4.1") is None and cuda_tag("12.8") == "cu128"


def test_models_finding_names_the_models_each_host_layout_gets(tmp_path, monkeypatch):
    from shard_ray.costmodel.models import CostModels, default_cost_model_path, hardware_models_path
    from shard_ray.doctor import models_finding

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path))
    hardware = "cuda:NVIDIA A100-SXM4-80GB"
    assert "no models calibrated here for every task;" in models_finding(hardware).detail
    over_hosts = hardware_models_path(hardware, 8)
    over_hosts.parent.mkdir(parents=True)
    CostModels.load(default_cost_model_path()).save(over_hosts)
    finding = models_finding(hardware)
    assert (
        "no models calibrated here for every task on one host" in finding.detail and str(over_hosts) in finding.detail
    )
    assert "task" not in finding.detail.split("extrapolated")[1]
    # a calibration on one task's tables (the default of `calibrate`) is named, not passed over
    task = [TableSpec(name="t", rows=1000, dim=16, pooling_factor=1.0)]
    CostModels.load(default_cost_model_path()).save(hardware_models_path(hardware, 8, task))
    CostModels.load(default_cost_model_path()).save(hardware_models_path(hardware, None, task))
    finding = models_finding(hardware)
    assert f"models calibrated on the tables of 1 task in {over_hosts.parent}" in finding.detail, finding.detail
    assert finding.detail.count(str(over_hosts)) == 1  # the task's file over hosts is not taken for hardware-wide
    CostModels.load(default_cost_model_path()).save(hardware_models_path(hardware))
    finding = models_finding(hardware)
    assert finding.level == "ok" and str(over_hosts) in finding.detail


def test_models_finding_on_an_h200_names_the_shipped_gpu_models_and_their_missing_comm_model(tmp_path, monkeypatch):
    from shard_ray.doctor import models_finding

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path))
    finding = models_finding("cuda:NVIDIA H200")
    assert finding.level == "ok", finding
    assert (
        "the shipped models were trained on this hardware (compute only: all-to-alls priced by the links' profile"
        in finding.detail
    )
    other = models_finding("cuda:NVIDIA A100-SXM4-80GB")
    assert other.level == "note" and "plans use the shipped models of cuda:NVIDIA H100 80GB HBM3, extrapolated" in (
        other.detail
    )


def test_the_prices_check_finds_the_models_off_where_only_rows_that_miss_the_caches_are():
    """A node whose microbenchmark the models price within the quarter but whose cold-rows shard they price 1.6x, as
    an Intel Xeon of the shipped models' name did (docs/results.md, "Prices where the caches differ"), gets a note
    with `calibrate` as the fix; priced within the quarter on every shard, an ok."""
    hardware = "cpu:Intel(R) Xeon(R) Processor:1thread"
    priced = CostModels.load(models_for(hardware)).predict_fused_shards(doctor_shards(), DOCTOR_BATCH)

    def report(cold_ratio: float) -> dict:
        ratios = [1.2] * (len(priced) - 1) + [cold_ratio]  # each shard's price over its time
        timed = [[i, fwd / ratio, bwd / ratio] for i, ((fwd, bwd), ratio) in enumerate(zip(priced, ratios))]
        return {"hardware": hardware, "microbenchmark": timed}

    held, off = prices_finding(report(1.1)), prices_finding(report(1.6))
    assert held.level == "ok" and "(median 1.20x) and a shard of rows that miss the caches at 1.10x" in held.detail
    assert (
        off.level == "note"
        and "at 1.60x: off by more than a quarter (outside 0.75-1.33x), the cold-rows shard high (priced slower than "
        "it runs here); the microbenchmark's median within the range"
        in off.detail
    )
    assert off.fix.startswith("shard-ray calibrate") and "--for-hardware" in off.fix  # the models doctor checks
    # a report without the cold-rows shard (timed where it failed) is judged by the median alone
    assert prices_finding({"hardware": hardware, "microbenchmark": report(1.6)["microbenchmark"][:-1]}).level == "ok"


def test_the_noise_floor_says_when_this_machine_was_busy_besides(monkeypatch):
    """The noise floor measured beside another's load reads as the machine's own (a walk: load average 4 on 2
    cores): more than the gang's two members running, it says so; at the gang's own load, nothing."""
    from shard_ray.doctor import _busy_here

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (4.2, 3.0, 2.0))
    assert _busy_here() == (
        "; measured while this machine was busy besides (load average 4.2 on 2 cores): idle, it separates smaller "
        "differences"
    )
    monkeypatch.setattr("os.getloadavg", lambda: (2.4, 3.0, 2.0))
    assert _busy_here() == ""
