"""Names for the hardware a measurement was taken on; measurements are only comparable within one."""

from __future__ import annotations

import os
import platform
from functools import cache
from typing import TYPE_CHECKING

from shard_ray.errors import ShardRayError

if TYPE_CHECKING:  # torch where a device is asked about, not where an id a user typed is checked
    import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def measurement_device() -> torch.device:
    """The GPU Ray gave this process if any, else the CPU."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# Where a GPU's driver shows itself: NVIDIA's and AMD's (ROCm's torch names its GPUs `cuda` too). Without either no
# torch build sees a GPU, so a machine without them is named without importing torch (a second of a plan's time).
GPU_DRIVERS = ("/proc/driver/nvidia/gpus", "/dev/kfd")


def _gpu_driver() -> bool:
    return any(os.path.exists(path) for path in GPU_DRIVERS)


def local_gpu() -> bool:
    """Whether this process measures on a GPU (`measurement_device`): asked of torch only where a GPU driver is."""
    return _gpu_driver() and measurement_device().type == "cuda"


def hardware_id(threads: int | None = None) -> str:
    """This process's hardware as measurements name it: its GPU's name, else the CPU's model and `threads` (None:
    torch's threads)."""
    if threads is not None and not _gpu_driver():
        return f"cpu:{_cpu_model()}:{threads}thread"
    import torch

    device = measurement_device()
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads() if threads is None else threads
    return f"cpu:{_cpu_model()}:{threads}thread"


# What every hardware id starts with: the kind of device it was measured on (`hardware_id`).
HARDWARE_KINDS = ("cuda:", "cpu:")


def check_hardware_id(hardware: str) -> None:
    """Refuse, in one line, a hardware id a user typed that names no kind of device: it would match no models and
    the plan would be priced by another hardware's without a word about it."""
    if not hardware.startswith(HARDWARE_KINDS):
        raise ShardRayError(
            f"hardware id {hardware!r} names no kind of device: write it as measurements name it, "
            "'cuda:<GPU name>' (e.g. 'cuda:NVIDIA H100 80GB HBM3') or 'cpu:<CPU model>:<threads>thread'"
        )
    if hardware != hardware.strip() or not hardware.partition(":")[2].strip():
        raise ShardRayError(
            f"hardware id {hardware!r}: give the device's name after its kind, with no space around it "
            "(e.g. 'cuda:NVIDIA H100 80GB HBM3')"
        )


def machine_id() -> str:
    """The machine this process runs on, the same for every Ray node it hosts (network namespaces included): the
    kernel's boot id, else the host name. Measuring processes share a machine's memory, whatever node they are on."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return platform.node()


def free_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity), in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pin_to(cores: set[int], pid: int = 0) -> None:
    """Keep process `pid` (0: this one) on `cores`, where the platform allows it."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cores)


def cores_for(members: int, cores: list[int]) -> list[int] | None:
    """One core of its own for each of `members` measuring processes on a node with `cores`: the last
    ones, leaving the first to the driver and Ray's own processes; None when the node has too few."""
    return cores[len(cores) - members :][::-1] if members <= len(cores) else None
