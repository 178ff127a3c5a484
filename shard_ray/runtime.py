"""Connecting to Ray: an existing cluster when one is named, else a small local instance."""

from __future__ import annotations

import logging
import os

import ray

# Enough object store for shard specs and results; Ray's default takes 30% of memory.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2


def connect_ray(address: str | None = None, min_cpus: int = 1) -> str:
    """Join the cluster at `address` (or RAY_ADDRESS); otherwise start a local Ray.

    A local instance gets at least `min_cpus` logical CPUs so a gang of that many CPU devices
    can be placed; the gang itself warns when that exceeds the cores it lands on.
    Returns a one-line description of what it connected to.
    """
    if ray.is_initialized():
        return "ray: already initialised"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return f"ray: joined cluster at {address}"
    cpus = max(os.cpu_count() or 1, min_cpus)
    # "local": a new instance even when a `ray start` cluster on this machine (live or stale) would be joined
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
    )
    return f"ray: started a local instance with {cpus} CPUs"
