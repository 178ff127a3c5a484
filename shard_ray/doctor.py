"""`shard-ray doctor`: what this machine, or each node of a Ray cluster, offers shard-ray, and the fix
for every problem found.

Per node (`node_report`, run on the node itself): Python, torch and the CUDA it was built for,
the GPUs, the fbgemm package and whether a real fused shard runs on the node's device (fbgemm's
CUDA kernels load only when its build matches torch's), NCCL, and the hardware id measurements
and models are keyed by. Then the cluster (nodes, CPUs, GPUs), MLflow's tracking store, and the
cost models available for each hardware. `Finding`s are `ok`, a `note` (works, with a caveat) or
a `problem` (something shard-ray needs is missing or broken), each problem with its fix.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from shard_ray.plan.piece import TablePiece

# FBGEMM's compatibility table (pytorch.org/FBGEMM/general/Releases.html): release 1.N goes with
# PyTorch 2.(N + 5) (1.0 with 2.5 through 1.5 with 2.10, and on: 1.6 with 2.11, 1.8 with 2.13).
FBGEMM_TORCH_OFFSET = 5
FBGEMM_PACKAGES = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-genai", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")


@dataclass(frozen=True)
class Finding:
    what: str
    level: Literal["ok", "note", "problem"]
    detail: str
    fix: str = ""


def expected_fbgemm(torch_version: str) -> str | None:
    """The fbgemm-gpu release (major.minor) made for a torch version; None for torch before 2.5."""
    match = re.match(r"2\.(\d+)", torch_version)
    if match is None or int(match.group(1)) < FBGEMM_TORCH_OFFSET:
        return None
    return f"1.{int(match.group(1)) - FBGEMM_TORCH_OFFSET}"


def cuda_tag(cuda_version: str) -> str:
    """PyTorch's wheel-index name of a CUDA version: '13.0' -> 'cu130', '12.8' -> 'cu128'."""
    major, minor = cuda_version.split(".")[:2]
    return f"cu{major}{minor}"


def node_report(microbenchmark: bool = True, command_niceness: int | None = None) -> dict:
    """What this process's node offers: run it on the node (a Ray task pinned there) or here. `microbenchmark`: time
    the microbenchmark's shards too (`time_microbenchmark`), where the machine's have not been timed. On a node, given
    the command's `command_niceness`, also the niceness a measuring actor there runs at, having raised itself to the
    command's as far as it may (`at_niceness`)."""
    import torch

    from shard_ray.errors import first_line
    from shard_ray.niceness import at_niceness
    from shard_ray.profiling.hardware import machine_id

    report: dict = {
        "host": platform.node(),
        "niceness": None if command_niceness is None else at_niceness(command_niceness),
        "command_niceness": command_niceness,
        "python": platform.python_version(),
        "cpus": os.cpu_count() or 1,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": None,
        "fbgemm": None,
        "fused_shard": None,
        "hardware": None,
        "machine": machine_id(),
    }
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for package in FBGEMM_PACKAGES:
        try:
            report["fbgemm"] = {"package": package, "version": importlib.metadata.version(package)}
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        report["fused_shard"], report["hardware"] = _run_fused_shard()
        if microbenchmark and "error" not in report["fused_shard"]:
            report["microbenchmark"] = time_microbenchmark()
    except Exception as err:  # noqa: BLE001  a broken install can fail anywhere in the import or the kernel
        report["fused_shard"] = {"error": f"{type(err).__name__}: {first_line(err)}"}
    return report


# The microbenchmark's shards doctor times (`microbenchmark_shards`' indices): 1, 8 and 32 cheap tables, the most
# lookups, the widest rows, the most rows and the widest fp16 table; about a second on a CPU core.
DOCTOR_MICROBENCHMARK = (0, 3, 6, 12, 17, 21, 24)
DOCTOR_BATCH = 1024
# Beside them a shard the spine is not fitted to: one table of a million rows of 64 floats and 64 lookups a sample,
# drawn Zipf as a table file's default, whose backward pays for distinct rows that miss the caches, as the heaviest
# devices of plans do. Machines of one name differ there more than in the microbenchmark: on an Intel Xeon whose
# microbenchmark the models priced at a median 1.17-1.27x, such a shard priced 1.66x and the ranking model's plans
# 1.34-1.43x (docs/results.md, "Prices where the caches differ").
COLD_ROWS = {"rows": 1_000_000, "dim": 64, "pooling_factor": 64.0}
# The microbenchmark's median price over its measurement, and the cold-rows shard's, within which doctor finds the
# models hold here.
PRICES_HOLD = (0.75, 1.33)


def doctor_shards() -> list[list[TablePiece]]:
    """The shards doctor times: DOCTOR_MICROBENCHMARK's, then the cold-rows shard (COLD_ROWS)."""
    from shard_ray.plan.piece import TablePiece
    from shard_ray.profiling.sampling import MICROBENCHMARK, microbenchmark_shards
    from shard_ray.workload.tables import TableSpec

    shards = microbenchmark_shards()
    cold = TableSpec(name=f"{MICROBENCHMARK}~cold", **COLD_ROWS)
    return [shards[i] for i in DOCTOR_MICROBENCHMARK] + [[TablePiece.whole(cold)]]


def time_microbenchmark() -> list[list[float]]:
    """[index, fwd ms, bwd ms] of `doctor_shards` on this process's device, as profiling measures them (on CPU with
    one thread, as a profiling actor has)."""
    from shard_ray.profiling.fused_shard import measure_fused_shard  # torch with it, which `one_thread` limits
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.threads import one_thread

    with one_thread():
        timed = [
            (i, measure_fused_shard(shard, MeasureConfig(batch_size=DOCTOR_BATCH), ""))
            for i, shard in enumerate(doctor_shards())
        ]
    return [[i, m.fwd_ms, m.bwd_ms] for i, m in timed if m.status == "ok"]


@dataclass(frozen=True)
class PricesCheck:
    """How the models `plan` uses for a hardware price `doctor_shards` timed there: each shard's price over its
    measurement."""

    models: str  # the model file's name
    ratios: list[float]  # the microbenchmark's shards', smallest first
    cold: float | None  # the cold-rows shard's (None where it was not timed)

    @property
    def median(self) -> float:
        return self.ratios[len(self.ratios) // 2]

    @property
    def figures(self) -> list[float]:
        """What the check judges by: the microbenchmark's median and the cold-rows shard's ratio, where timed."""
        return [figure for figure in (self.median, self.cold) if figure is not None]

    @property
    def off(self) -> float | None:
        """The figure furthest from 1 of those beyond PRICES_HOLD; None where the prices hold."""
        beyond = [figure for figure in self.figures if not PRICES_HOLD[0] <= figure <= PRICES_HOLD[1]]
        return max(beyond, key=lambda figure: abs(math.log(figure))) if beyond else None

    @property
    def holds(self) -> bool:
        return self.off is None

    def off_way(self) -> str:
        """Which of the figures are off and which way, in words (where they are: `off`): the microbenchmark's median
        within while the cold-rows shard was high read as the models pricing every kernel high (a walk)."""
        figures = [
            ("the microbenchmark's median", "its shards", "run", self.median),
            ("the cold-rows shard", "it", "runs", self.cold),
        ]
        said = []
        for name, them, run, figure in figures:
            if figure is None:
                continue
            if PRICES_HOLD[0] <= figure <= PRICES_HOLD[1]:
                said.append(f"{name} within the range")  # "within" alone read as a line cut short (a walk)
            else:
                way = "slower" if figure > 1 else "faster"
                said.append(f"{name} {'high' if figure > 1 else 'low'} (priced {way} than {them} {run} here)")
        return "; ".join(sorted(said, key=lambda part: part.endswith("within the range")))

    def describe(self) -> str:
        """The check in words."""
        described = (
            f"the models {self.models} price {len(self.ratios)} microbenchmark shards timed here at "
            f"{self.ratios[0]:.2f}x-{self.ratios[-1]:.2f}x their measurement (median {self.median:.2f}x)"
        )
        if self.cold is not None:
            described += f" and a shard of rows that miss the caches at {self.cold:.2f}x"
        return described


def check_prices(hardware: str, timed: list[list[float]]) -> PricesCheck:
    """How the models `plan` uses for `hardware` price `doctor_shards` timed there (`time_microbenchmark`'s rows)."""
    from shard_ray.costmodel.models import CostModels, models_for

    path = models_for(hardware)
    shards = doctor_shards()
    predicted = CostModels.load(path).predict_fused_shards([shards[int(i)] for i, _, _ in timed], DOCTOR_BATCH)
    ratios = {int(i): p / (fwd + bwd) for p, (i, fwd, bwd) in zip(predicted.sum(axis=1), timed)}
    cold = ratios.pop(len(shards) - 1, None)
    return PricesCheck(path.name, sorted(ratios.values()), cold)


def prices_finding(report: dict) -> Finding | None:
    """How the models `plan` uses for a node's hardware price the doctor's shards timed there (None when none were):
    the first sign that models of other hardware, or of an older measurement, are off here."""
    timed = report.get("microbenchmark")
    if not timed or report.get("hardware") is None:
        return None
    check = check_prices(report["hardware"], timed)
    detail = f"{report['hardware']}: {check.describe()}"
    if check.holds:
        return Finding("prices", "ok", detail)
    return Finding(
        "prices",
        "note",
        f"{detail}: off by more than a quarter (outside {PRICES_HOLD[0]}-{PRICES_HOLD[1]}x), {check.off_way()}",
        "shard-ray calibrate --tables YOUR_TABLES.json --devices N --for-hardware (fits the models' spine to this "
        "machine, for every task on it)",
    )


def _run_fused_shard() -> tuple[dict, str]:
    """A small fused shard, forward and backward with the optimizer, on the node's device, as profiling runs it."""
    from shard_ray.plan.piece import TablePiece
    from shard_ray.profiling.fused_shard import measure_fused_shard
    from shard_ray.profiling.hardware import hardware_id, measurement_device
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.threads import one_thread
    from shard_ray.workload.tables import TableSpec

    hardware = hardware_id(threads=1)
    tables = [
        TableSpec(name="doctor_a", rows=1000, dim=32, pooling_factor=4.0),
        TableSpec(name="doctor_b", rows=500, dim=16, pooling_factor=2.0, precision="fp16"),
    ]
    # on one thread, as a profiling actor runs it (`--this-machine` runs it in the command's own process, where
    # torch's threads beside a busy core timed its backward at 95 ms against 0.16 on a Ray actor)
    with one_thread():
        measured = measure_fused_shard(
            [TablePiece.whole(t) for t in tables], MeasureConfig(batch_size=256, warmup=1, repeats=2), hardware
        )
    if measured.status != "ok":
        return {"error": measured.reason}, hardware
    return {"device": measurement_device().type, "fwd_ms": measured.fwd_ms, "bwd_ms": measured.bwd_ms}, hardware


def node_findings(report: dict) -> list[Finding]:
    """What is right and wrong with one node's report, each problem with its fix."""
    findings = []
    torch_version, torch_cuda, gpus = report["torch"], report["torch_cuda"], report["gpus"]
    cuda_index = f"https://download.pytorch.org/whl/{cuda_tag(torch_cuda)}" if torch_cuda else None
    release = torch_version.split("+")[0]
    if gpus and torch_cuda:
        findings.append(Finding("torch", "ok", f"torch {torch_version} built for CUDA {torch_cuda}, {len(gpus)} GPUs"))
    elif gpus or report.get("gpus_declared"):  # torch sees none of the GPUs Ray counts on the node
        findings.append(
            Finding(
                "torch",
                "problem",
                f"torch {torch_version} has no CUDA, but the node has GPUs",
                f"install torch's CUDA build: pip install torch=={release} --index-url "
                "https://download.pytorch.org/whl/cu130 (the cuXYZ of your driver's CUDA)",
            )
        )
    else:
        findings.append(Finding("torch", "ok", f"torch {torch_version} on CPU (no GPU on this node)"))

    fbgemm = report["fbgemm"]
    wanted = expected_fbgemm(torch_version)
    cpu_package = fbgemm is not None and fbgemm["package"].endswith("cpu")
    pin = f"=={wanted}.*" if wanted else ""  # torch before 2.5: FBGEMM's table has no rule to pin by
    fbgemm_fix = (
        f"pip uninstall -y fbgemm-gpu-cpu fbgemm-gpu; pip install fbgemm-gpu{pin} --index-url {cuda_index}"
        if torch_cuda
        else f"pip install fbgemm-gpu-cpu{pin}"
    )
    if fbgemm is None:
        findings.append(Finding("fbgemm", "problem", "no fbgemm-gpu package is installed", fbgemm_fix))
    else:
        name = f"{fbgemm['package']} {fbgemm['version']}"
        have = ".".join(fbgemm["version"].split("+")[0].split(".")[:2])
        local = fbgemm["version"].partition("+")[2]
        if wanted is not None and have != wanted:
            findings.append(
                Finding("fbgemm", "problem", f"{name} is not the release for torch {release} ({wanted})", fbgemm_fix)
            )
        elif torch_cuda and cpu_package:
            findings.append(
                Finding("fbgemm", "problem", f"{name} has no CUDA kernels, and torch is built for CUDA", fbgemm_fix)
            )
        elif torch_cuda and local.startswith("cu") and local != cuda_tag(torch_cuda):
            findings.append(
                Finding(
                    "fbgemm",
                    "problem",
                    f"{name} is built for {local}, torch for {cuda_tag(torch_cuda)}",
                    fbgemm_fix,
                )
            )
        else:
            findings.append(Finding("fbgemm", "ok", f"{name}, the release for torch {release}"))

    shard = report["fused_shard"]
    if shard is not None and "error" not in shard:
        findings.append(
            Finding(
                "fused kernels",
                "ok",
                f"a fused shard trained on {shard['device']}: forward {shard['fwd_ms']:.3f} ms, "
                f"backward {shard['bwd_ms']:.3f} ms",
            )
        )
    else:
        findings.append(
            Finding(
                "fused kernels",
                "problem",
                f"a fused shard does not run: {shard['error'] if shard else 'not tried'}",
                fbgemm_fix,
            )
        )
    from shard_ray.runtime import WORKER_NICENESS

    reached, wanted = report.get("niceness"), report.get("command_niceness") or WORKER_NICENESS
    if reached is not None and reached > wanted:
        findings.append(
            Finding(
                "priority",
                "note",
                f"Ray's workers on this node run at nice {reached}, below the command's {wanted}, and this user may "
                "not raise them: any busy process on the node takes their cores first, and what they measure beside "
                "one is inflated",
                f"start the node's Ray with RAY_worker_niceness={WORKER_NICENESS} in its environment "
                f"(RAY_worker_niceness={WORKER_NICENESS} ray start ...), or as a user who may raise priorities",
            )
        )
    if gpus:
        if report["nccl"]:
            findings.append(Finding("NCCL", "ok", f"NCCL {report['nccl']} for the gang's collectives"))
        else:
            findings.append(
                Finding(
                    "NCCL",
                    "problem",
                    "torch.distributed has no NCCL: a GPU gang cannot run its all-to-alls",
                    f"install torch's CUDA build with NCCL: pip install torch=={release} --index-url {cuda_index}",
                )
            )
    return findings


def mlflow_finding(tracking_uri: str) -> Finding:
    """Whether runs can be logged at `tracking_uri`, without writing anything there."""
    if tracking_uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=5) as response:
                healthy = response.status == 200
        except (urllib.error.URLError, OSError) as err:
            return Finding(
                "MLflow",
                "problem",
                f"the tracking server at {tracking_uri} does not answer ({err})",
                "start it (`mlflow server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000`) "
                "or give --no-mlflow to the commands",
            )
        if not healthy:
            return Finding("MLflow", "problem", f"the tracking server at {tracking_uri} answers /health with an error")
        return Finding("MLflow", "ok", f"tracking server at {tracking_uri} is up")
    from shard_ray.tracking.mlflow_runs import sqlite_database

    path = sqlite_database(tracking_uri)
    if path is not None:
        folder = path.parent if path.parent.exists() else Path.cwd()
        if not os.access(folder, os.W_OK):
            return Finding(
                "MLflow",
                "problem",
                f"{path} cannot be written here",
                "set MLFLOW_TRACKING_URI (or --tracking-uri) to a writable place",
            )
        state = "exists" if path.exists() else "is created by the first logged run"
        return Finding("MLflow", "ok", f"local store {path} ({state})")
    return Finding("MLflow", "note", f"tracking URI {tracking_uri} is not checked by doctor")


def models_finding(hardware: str) -> Finding:
    """Which cost models `plan` uses for `hardware`: calibrated ones, the shipped ones, or extrapolated ones."""
    from shard_ray.costmodel.models import CostModels, hardware_models_path, shipped_models_path

    calibrated = hardware_models_path(hardware)
    # models calibrated over hosts: the one-host file's name, then -hosts-of-L; on a task's tables, then -tables-DIGEST
    over_hosts = sorted(
        p for p in calibrated.parent.glob(calibrated.stem + "-hosts-of-*.pt") if "-tables-" not in p.name
    )
    hosts = f"; over hosts: {', '.join(str(p) for p in over_hosts)}" if over_hosts else ""
    tasks = len({p.stem.rsplit("-tables-", 1)[1] for p in calibrated.parent.glob(calibrated.stem + "*-tables-*.pt")})
    if tasks:
        hosts += (
            f"; models calibrated on the tables of {tasks} task{'s' if tasks > 1 else ''} in {calibrated.parent}, "
            "which `plan` picks for those tables (`shard-ray models` lists them)"
        )
    if calibrated.is_file():
        return Finding("cost models", "ok", f"{hardware}: calibrated models {calibrated}{hosts}")
    shipped = CostModels.load(shipped_models_path(hardware))
    if shipped.hardware == hardware:
        unpriced = (
            ""
            if shipped.comm is not None
            else " (compute only: all-to-alls priced by the links' profile until `calibrate`)"
        )
        return Finding(
            "cost models", "ok", f"{hardware}: the shipped models were trained on this hardware{unpriced}{hosts}"
        )
    return Finding(
        "cost models",
        "note",
        f"{hardware}: no models calibrated here for every task"
        + (" on one host" if over_hosts else "")
        + f"; plans use the shipped models of {shipped.hardware}, extrapolated{hosts}",
        "shard-ray calibrate --tables YOUR_TABLES.json --devices N (on this hardware; minutes)",
    )


def noise_finding() -> Finding:
    """The connected cluster's noise floor: a small plan against a copy of itself on a 2-device gang (one device where
    the cluster has one CPU or GPU), so the user knows the smallest difference a comparison can see there."""
    import ray

    from shard_ray.costmodel.simulator import price_comm
    from shard_ray.errors import first_line
    from shard_ray.placement import place
    from shard_ray.plan.topology import GB, Topology
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.runtime import joined_ray
    from shard_ray.workflows.comparison import noise_floor
    from shard_ray.workload.synthetic import PoolConfig, generate_pool

    resources = ray.cluster_resources()
    devices = int(resources.get("GPU", 0) or resources.get("CPU", 0))
    if devices < 2:
        return Finding("noise floor", "note", f"not measured: the cluster has {devices} device(s), a gang needs 2")
    tables = generate_pool(PoolConfig(num_tables=8, seed=0))
    topology = Topology(num_devices=2, memory_bytes=8 * GB)
    plan = place("size_greedy", tables, topology)
    try:
        with DeviceGang(2, comm_pricer=price_comm) as gang:
            floor = noise_floor(plan, tables, topology, gang, MeasureConfig.for_topology(topology))
            hardware = gang.hardware
    except Exception as err:  # noqa: BLE001  a gang that cannot measure is what doctor reports
        return Finding(
            "noise floor",
            "problem",
            f"a 2-device gang could not measure a plan: {first_line(err)}",
            "see the Ray line above; `shard-ray evaluate` shows the same error in full",
        )
    busy = "" if joined_ray() else _busy_here()
    return Finding("noise floor", "ok", f"{hardware}, 2-device gang: {floor.describe()}{busy}")


def _busy_here() -> str:
    """Where the local Ray's machine ran more than the gang's two members while they measured, said so: the floor
    read a walk's neighbour's load (load average 4 on 2 cores) as the machine's own noise."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores + 1:
        return ""
    return (
        f"; measured while this machine was busy besides (load average {load:.1f} on {cores} cores): idle, it "
        "separates smaller differences"
    )


def cluster_reports(timed_machines: set[str] | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """Every alive node's `node_report`, run on that node (a GPU node's with one of its GPUs); a summary line.

    The microbenchmark is timed once a machine, on its first node, and not on the machines in `timed_machines`
    (this one, timed already): Ray nodes on one machine (emulated hosts, a test cluster) share its kernels, and
    timed at once each held the microbenchmark's largest shard (2.6 GB) beside the others'."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from shard_ray.niceness import niceness
    from shard_ray.profiling.keeper import release_kept_gang

    release_kept_gang()  # its GPUs, and its cores and memory beside the microbenchmark
    nodes = [n for n in ray.nodes() if n["Alive"]]

    def on_each(function: Callable[..., Any], of_nodes: list[dict], *args: Any) -> list:
        """`function(*args)` run on each of `of_nodes` (with one of its GPUs where it has them), at once."""
        remote, refs = ray.remote(function), []
        for node in of_nodes:
            options = {"num_cpus": 0, "num_gpus": 1 if node["Resources"].get("GPU", 0) else 0}
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            refs.append(remote.options(scheduling_strategy=strategy, **options).remote(*args))
        return ray.get(refs, timeout=600)

    reports = on_each(node_report, nodes, False, niceness())
    first_of_machine: dict[str, int] = {}
    for i, report in enumerate(reports):
        if report["machine"] not in (timed_machines or set()) and "error" not in report["fused_shard"]:
            first_of_machine.setdefault(report["machine"], i)
    timed = on_each(time_microbenchmark, [nodes[i] for i in first_of_machine.values()])
    for i, microbenchmark in zip(first_of_machine.values(), timed):
        reports[i]["microbenchmark"] = microbenchmark
    for node, report in zip(nodes, reports):
        report["gpus_declared"] = int(node["Resources"].get("GPU", 0))
    total = ray.cluster_resources()
    summary = f"{len(nodes)} Ray nodes, {total.get('CPU', 0):.0f} CPUs and {total.get('GPU', 0):.0f} GPUs in all"
    return summary, [(n["NodeManagerAddress"], r) for n, r in zip(nodes, reports)]


def task_pid() -> int:
    """A trivial task: that Ray runs it at all."""
    return os.getpid()


def format_findings(findings: list[Finding], indent: str = "  ") -> list[str]:
    lines = []
    for f in findings:
        lines.append(f"{indent}{f.level:<8} {f.what}: {f.detail}")
        if f.fix and f.level != "ok":
            lines.append(f"{indent}{'':<8} fix: {f.fix}")
    return lines


def describe_node(report: dict) -> str:
    gpus = f"{len(report['gpus'])} x {report['gpus'][0]}" if report["gpus"] else "no GPU"
    return (
        f"{report['host']}: {report['cpus']} cores, {gpus}; Python {report['python']}; "
        f"hardware id {report['hardware'] or 'unknown'}"
    )
