"""Names for the hardware a measurement was taken on; measurements are only comparable within one."""

from __future__ import annotations

import platform
from functools import cache

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
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def hardware_id(threads: int | None = None) -> str:
    device = measurement_device()
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads() if threads is None else threads
    return f"cpu:{_cpu_model()}:{threads}thread"
