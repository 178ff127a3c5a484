"""Ray profiling actors, one per device, and the pool that keeps them all busy.

An actor holds one device (one GPU, or one CPU core with one intra-op thread) and measures
fused shards on it. The pool hands each actor a shard as soon as it is free, writes each
result to the measurement store as it arrives, and skips shards the store already has.

A dead actor (its process killed, its node lost) is restarted by Ray up to `MAX_RESTARTS`
times and the shard it was measuring is run again on it (`max_task_retries`); an actor past
its restarts leaves the pool and its shard goes back in the queue for the others. The store
is keyed by shard content, so a shard measured twice is stored once.
"""

from __future__ import annotations

import os
import sys
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, Protocol

import ray
from tqdm import tqdm

from shard_ray.errors import ShardRayError
from shard_ray.niceness import at_niceness, niceness
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.hardware import cores_for, free_cores, hardware_id, machine_id, measurement_device, pin_to
from shard_ray.profiling.keeper import release_kept_gang
from shard_ray.profiling.procedure import FusedShardMeasurement, MeasureConfig, fused_shard_key
from shard_ray.profiling.store import MeasurementStore
from shard_ray.runtime import measuring_runtime_env

MAX_RESTARTS = 8
MAX_TASK_RETRIES = 3


@ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES)
class ProfilingActor:
    """A device measuring fused shards, in a process of its own: torch and fbgemm are imported there, not in the
    command that starts the pool."""

    def __init__(self, threads: int = 1, command_niceness: int = 0) -> None:
        import torch

        from shard_ray.profiling.fused_shard import HostBuffers, memory_budget

        at_niceness(command_niceness)
        torch.set_num_threads(threads)
        self._hardware = hardware_id(threads)
        self._budget = memory_budget(measurement_device(), 1)
        self._host_buffers = HostBuffers()

    def hardware(self) -> str:
        return self._hardware

    def pid(self) -> int:
        return os.getpid()

    def machine(self) -> str:
        return machine_id()

    def node(self) -> str:
        """The Ray node the actor runs on (it moves when its node is lost and Ray restarts it)."""
        return ray.get_runtime_context().get_node_id()

    def cores(self) -> list[int]:
        return free_cores()

    def pin(self, core: int) -> None:
        pin_to({core})

    def share_memory(self, sharing: int) -> int:
        """Measure as one of `sharing` measuring processes sharing this machine's memory: its `memory_budget`."""
        from shard_ray.profiling.fused_shard import memory_budget

        self._budget = memory_budget(measurement_device(), sharing)
        return self._budget

    def measure(self, pieces: list[TablePiece], config: MeasureConfig) -> FusedShardMeasurement:
        from shard_ray.profiling.fused_shard import measure_fused_shard

        return measure_fused_shard(pieces, config, self._hardware, self._budget, self._host_buffers)


def capped_warning(capped: int, measured: int) -> str:
    return (
        f"{capped} of {measured} shards were measured with their largest tables capped (a profiling actor's share of "
        "memory holds no more; docs/measurement.md), which times them optimistically"
    )


def resources_per_device(use_gpus: bool) -> dict[str, Any]:
    """Ray options of an actor that holds one device: its resources and the measuring environment
    (`measuring_runtime_env`: transparent huge pages for its tables)."""
    resources = {"num_cpus": 1, "num_gpus": 1} if use_gpus else {"num_cpus": 1}
    return {**resources, **measuring_runtime_env()}


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


class Lender(Protocol):
    """A set of device actors a profiling pool may measure on instead of its own (`DeviceGang`)."""

    use_gpus: bool
    hardware: str

    def lends(self, actors: int, threads: int, use_gpus: bool | None) -> bool:
        """Whether its actors can be `actors` profiling actors measuring on `threads` threads."""
        ...

    def lent_members(self) -> tuple[list[Any], list[str]]:
        """The actors, ready to measure, and each one's machine."""
        ...


class ProfilingPool:
    """`num_actors` profiling actors; GPUs are used when the cluster has them unless told not to.

    Given a `gang` whose members can be the actors (`DeviceGang.lends`: as many devices as actors, each its own),
    the pool measures on the gang's members and starts none of its own: a command that profiles shards and
    measures plans starts one set of device actors (each loads Python, Ray, torch and fbgemm: about 3 s of CPU).
    """

    def __init__(
        self, num_actors: int, use_gpus: bool | None = None, threads: int = 1, gang: Lender | None = None
    ) -> None:
        if num_actors < 1:
            raise ValueError("a profiling pool needs at least one actor")
        self.actors: list[Any] = []  # the pool's own
        self._gang = gang if gang is not None and gang.lends(num_actors, threads, use_gpus) else None
        if self._gang is not None:
            self.use_gpus, self.hardware = self._gang.use_gpus, self._gang.hardware
            return
        release_kept_gang()  # a gang kept for a later command would hold the devices these actors need
        self.use_gpus = cluster_has_gpus() if use_gpus is None else use_gpus
        # Ray would keep actors it can never place waiting, and the pool's first call on them forever with them.
        kind = "GPU" if self.use_gpus else "CPU"
        held = int(ray.cluster_resources().get(kind, 0))
        if num_actors > held:
            raise ShardRayError(
                f"a profiling pool of {num_actors} actors needs {num_actors} {kind}s, one each, but the Ray cluster "
                f"has {held}; give fewer actors or a bigger cluster"
            )
        # Spread over the nodes: on a cluster, every node's devices profile.
        options = {**resources_per_device(self.use_gpus), "scheduling_strategy": "SPREAD"}
        self.actors = [ProfilingActor.options(**options).remote(threads, niceness()) for _ in range(num_actors)]
        try:
            hardware = set(ray.get([a.hardware.remote() for a in self.actors]))
            if len(hardware) != 1:
                raise ShardRayError(f"profiling actors landed on different hardware: {sorted(hardware)}")
            # the machine whose memory each actor shares (a GPU actor's device is its own)
            self._machine: dict[Any, str] = {a: str(i) for i, a in enumerate(self.actors)}
            if not self.use_gpus:
                self._pin()
        except BaseException:  # Ctrl-C or a dead actor while starting: no actor is left running
            self.shutdown()
            raise
        self.hardware = hardware.pop()

    def _pin(self) -> None:
        """Each actor on a core of its own (the last cores, as the gang's members). Actors past a node's
        cores leave the pool: sharing cores, they would time each other's contention, not the kernels
        (with 8 on 2 cores, refinement measured an 8-device plan's slowest device at 98 ms where the
        gang, its devices taking turns, measured the whole step at 41 ms)."""
        nodes = ray.get([a.node.remote() for a in self.actors])
        kept = set()
        for node in set(nodes):
            actors = [a for a, n in zip(self.actors, nodes) if n == node]
            cores = ray.get(actors[0].cores.remote())
            for extra in actors[len(cores) :]:
                ray.kill(extra)
            actors = actors[: len(cores)]
            ray.get([a.pin.remote(core) for a, core in zip(actors, cores_for(len(actors), cores) or [])])
            kept.update(actors)
        self.actors = [a for a in self.actors if a in kept]
        # Ray nodes may share a machine (a cluster emulated on one): its memory is shared by all its actors.
        machines = ray.get([a.machine.remote() for a in self.actors])
        self._machine = dict(zip(self.actors, machines))
        sharing = Counter(machines)
        ray.get([a.share_memory.remote(sharing[m]) for a, m in zip(self.actors, machines)])

    def __enter__(self) -> ProfilingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def measure(
        self,
        shards: Sequence[list[TablePiece]],
        config: MeasureConfig,
        store: MeasurementStore,
        progress: bool = True,
        alone: bool = False,
        say_capped: bool = True,
    ) -> list[FusedShardMeasurement]:
        """Measure every shard not yet in `store`; returns all shards' measurements in input order. `alone`: each
        shard with no other measured on its machine at the time, for measurements compared with each other.
        `say_capped`: warn of the shards measured with their largest tables capped (`capped_warning`), unless the
        caller, measuring in many calls, says it once.

        CPU actors on one machine share its memory bandwidth: a shard measured beside another is slowed for all its
        steps, while the last shard of a batch finishes alone, and the fastest step (`step_estimate`) favours it. A
        5-table shard measured beside the 6-table shard it came from measured 0.92 of it (median of 8 on the 2-core
        AMD EPYC), one at a time 0.785 (docs/measurement.md); GPU actors each have their own device. Alone, a
        machine's shards all go to one actor: each actor builds shards in buffers of its own (`HostBuffers`), whose
        pages the kernel backs well or badly for as long as they are kept, and a 4-table shard measured on one
        actor timed 6% slower than the 5-table shard it came from on the other, twice, with new batches."""
        actors, machine_of = self._measuring_actors()
        keys = [fused_shard_key(pieces, config, self.hardware) for pieces in shards]
        known = store.known_keys(keys)
        todo = [i for i, key in enumerate(keys) if key not in known]
        # Identical shards are measured once, the largest first: each actor's kept buffers (`HostBuffers`) then grow
        # once, to its first shard, where in the given order they grew shard after shard, each growth a fresh
        # allocation of gigabytes. Within this call only: a caller measuring in batches keeps its order across them
        # (docs/measurement.md, "Largest shards first within a batch, not across the list").
        first_of_key: dict[str, int] = {}
        for i in todo:
            first_of_key.setdefault(keys[i], i)

        def stored_bytes(index: int) -> int:
            return sum(piece.memory_bytes(config.optimizer) for piece in shards[index])

        queue = deque(sorted(first_of_key.values(), key=stored_bytes, reverse=True))
        bar = tqdm(total=len(queue), desc="profiling shards", unit="shard", disable=not progress)
        in_flight: dict[ray.ObjectRef, tuple[ProfilingActor, int]] = {}
        idle = list(actors)
        capped = 0
        while queue or in_flight:
            # alone: the first actor of each machine measures that machine's shards, one at a time
            usable = actors if not alone else list({machine_of[a]: a for a in reversed(actors)}.values())
            for actor in [a for a in reversed(idle) if a in usable][: len(queue)]:
                idle.remove(actor)
                index = queue.popleft()
                in_flight[actor.measure.remote(shards[index], config)] = (actor, index)
            if not in_flight:
                raise ShardRayError(f"every profiling actor died; {len(queue)} shards were left unmeasured")
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                actor, index = in_flight.pop(ref)
                try:
                    measurement = ray.get(ref)
                except ray.exceptions.RayActorError:
                    # out of restarts (or retries; a gang's member has none): the actor leaves, its shard goes to
                    # the others (a gang is started again before its next use)
                    actors.remove(actor)
                    if actor in self.actors:
                        self.actors.remove(actor)
                    queue.append(index)
                    bar.write(f"a profiling actor died for good; {len(actors)} left")
                    continue
                idle.append(actor)
                store.put_fused_shard(measurement)
                if measurement.rows_cap is not None and config.max_rows is None:
                    capped += 1
                bar.update(1)
        bar.close()
        if capped and say_capped:
            print(f"warning: {capped_warning(capped, len(first_of_key))}", file=sys.stderr)
        return [store.get_fused_shard(key) for key in keys]  # type: ignore[misc]

    def _measuring_actors(self) -> tuple[list[Any], dict[Any, str]]:
        """The actors that measure (the pool's own, or its gang's members) and each one's machine."""
        if self._gang is None:
            return list(self.actors), self._machine
        members, machines = self._gang.lent_members()
        return members, dict(zip(members, machines))

    def shutdown(self) -> None:
        """Stop the pool's own actors (a gang's members are the gang's to stop)."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
