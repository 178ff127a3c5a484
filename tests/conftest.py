import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

from shard_ray.workload.tables import TableSpec

os.environ.setdefault("MPLBACKEND", "Agg")
# Models a developer calibrated on this machine (~/.shard-ray/models) would change what `plan`
# picks in every test: the suite plans from the shipped models unless a test says otherwise.
# Removed when the process ends (each pytest-xdist worker has its own): left, every run kept one a process.
os.environ["SHARD_RAY_HOME"] = tempfile.mkdtemp(prefix="shard-ray-home-")
atexit.register(shutil.rmtree, os.environ["SHARD_RAY_HOME"], ignore_errors=True)
# `make test` runs the quick tests three at a time on two cores: torch's and numpy's BLAS threads in each would only
# wait on one another (the tests call the pricing and the searches directly, outside the commands' `one_thread`).
torch.set_num_threads(1)
ONE_BLAS_THREAD = threadpool_limits(limits=1, user_api="blas")


@pytest.fixture(autouse=True)
def mlflow_uri_left_as_found():
    """`mlflow.set_tracking_uri` also exports MLFLOW_TRACKING_URI, so a test that reads a store in-process
    would send every later test's `shard-ray` subprocess to that store: a user's shell has no such
    variable, and the suite keeps it that way."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(before)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(autouse=True)
def in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Every test runs in a folder of its own, as a user runs the commands in theirs. A command run in-process writes
    its default outputs (MLflow's `mlflow.db` and `mlartifacts/`, `shard-ray-out/`) where it runs: from the
    repository's top, they landed in the folder `ray job submit --working-dir .` uploads, while the cluster page's test
    beside them checked that folder unchanged (it failed so once, 2026-12-06)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def ray_session():
    """A small local Ray, started once and kept for the tests after; 4 logical CPUs so a pool and a
    gang can overlap. (The multi-node tests shut it down and bring up their cluster instead.)"""
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < 4:
        # a local Ray an in-process command of an earlier test started (as many CPUs as cores): the pools and gangs
        # of the tests after would wait forever for the CPUs it lacks
        ray.shutdown()
    if not ray.is_initialized():
        # its workers at the priority a command's local Ray gives them, its agent on a port of its own as there
        from shard_ray.runtime import LOCAL_RAY_CONFIG, dashboard_agent_on_any_port

        with dashboard_agent_on_any_port():
            ray.init(
                address="local",
                num_cpus=4,
                include_dashboard=False,
                object_store_memory=200 * 1024**2,
                log_to_driver=False,
                _system_config=LOCAL_RAY_CONFIG,
            )
    return ray


@pytest.fixture
def small_tables() -> list[TableSpec]:
    return [
        TableSpec(name="a", rows=5000, dim=32, pooling_factor=4.0),
        TableSpec(name="b", rows=20000, dim=64, pooling_factor=2.0, zipf_exponent=1.2),
        TableSpec(name="c", rows=800, dim=16, pooling_factor=8.0, precision="fp16"),
        TableSpec(
            name="d", rows=100000, dim=32, pooling_factor=1.5, reuse_histogram=tuple([0.5, 0.3, 0.2] + [0.0] * 14)
        ),
        TableSpec(name="e", rows=3000, dim=8, pooling_factor=12.0),
    ]


@pytest.fixture
def table_file(tmp_path: Path, small_tables) -> Path:
    from shard_ray.workload.tables import save_tables

    path = tmp_path / "tables.json"
    save_tables(path, small_tables)
    return path


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """Slow tests first, the longest first, then the quick ones: `make test` hands them out in this order as its
    workers free up (pytest-xdist's `loadgroup`), so that they start on the long ones and the quick ones fill in after.
    A test's length is its `slow(seconds=N)`, a group's (`xdist_group`: tests one worker runs, sharing a costly
    fixture) its tests' together. Handed out in runs of the files' order, the pass once ended on the longest test
    alone, two workers idle for its last 100 s (docs/install.md)."""

    def unit(item: pytest.Item) -> str:
        group = item.get_closest_marker("xdist_group")
        return str(group.args[0]) if group else item.nodeid

    def seconds(item: pytest.Item) -> float:
        slow = item.get_closest_marker("slow")
        return slow.kwargs.get("seconds", 0) if slow else 0

    lengths: dict[str, float] = {}
    for item in items:
        lengths[unit(item)] = lengths.get(unit(item), 0) + seconds(item)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -lengths[unit(item)]))
