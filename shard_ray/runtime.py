"""Connecting to Ray: an existing cluster when one is named, else a small local instance."""

from __future__ import annotations

import logging
import os

import ray

from shard_ray.errors import ShardRayError

# Enough object store for shard specs and results; Ray's default takes 30% of memory.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
# A local instance holds at most this many CPU devices (one logical CPU each) per core: a gang of
# 4 on 2 cores still measures (its compute phases take turns), while a 500-device plan on 2 cores
# would start hundreds of worker processes and stall the machine.
LOCAL_DEVICES_PER_CORE = 4
HOW_TO_JOIN = "point at a cluster that has them with --address HEAD:6379 or RAY_ADDRESS"


def connect_ray(address: str | None = None, min_cpus: int = 1) -> str:
    """Join the cluster at `address` (or RAY_ADDRESS); otherwise start a local Ray.

    `min_cpus` is how many CPU devices (one logical CPU each: gang members, profiling actors,
    env runners) the command will place at once. A local instance gets at least that many
    logical CPUs, up to LOCAL_DEVICES_PER_CORE per core of this machine; the gang warns when it
    lands on fewer cores than devices. Beyond that limit, or when a cluster (or an instance
    already running in this process) has fewer CPUs than `min_cpus`, this refuses with one line
    before any actor is made. Returns a one-line description of what it connected to.
    """
    if ray.is_initialized():
        _check_cluster_cpus(min_cpus, "the Ray instance already running in this process")
        return "ray: already initialised"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        try:
            _check_cluster_cpus(min_cpus, f"the cluster at {address}")
        except ShardRayError:
            ray.shutdown()  # only disconnects this driver; the cluster stays up
            raise
        return f"ray: joined cluster at {address}"
    cores = os.cpu_count() or 1
    if min_cpus > LOCAL_DEVICES_PER_CORE * cores:
        raise ShardRayError(
            f"{min_cpus} CPU devices are too many for a local Ray on this machine's {cores} cores "
            f"(at most {LOCAL_DEVICES_PER_CORE} per core, {LOCAL_DEVICES_PER_CORE * cores}); {HOW_TO_JOIN}"
        )
    cpus = max(cores, min_cpus)
    # "local": a new instance even when a `ray start` cluster on this machine (live or stale) would be joined
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
    )
    return f"ray: started a local instance with {cpus} CPUs"


def _check_cluster_cpus(min_cpus: int, where: str) -> None:
    """Refuse when `where` has fewer CPUs in all than the devices asked for (each takes one CPU, GPU or not).

    Counts the nodes up now: an autoscaling cluster must be started with enough of them.
    """
    cpus = ray.cluster_resources().get("CPU", 0)
    if min_cpus > cpus:
        raise ShardRayError(f"{min_cpus} devices need {min_cpus} CPUs but {where} has {cpus:.0f}; {HOW_TO_JOIN}")
