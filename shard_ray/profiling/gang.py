"""Whole-plan measurement on a gang of Ray actors, one per device, joined by torch.distributed.

Each step runs as TorchRec runs it (`PlanStep`): the input all-to-all sends every device the
lookups of its pieces, each device runs its fused shard forward over the global batch, an
all-to-all hands device j the j-th slice of the batch with every device's pooled embeddings
(row-wise partial sums added up there; table-row-wise ones inside their host first), the
backward all-to-all returns the gradients, data-parallel replicas all-reduce theirs, and the
fused backward applies the update. A
barrier before each phase keeps one device's wait for a slower one out of its own numbers,
so the five parts are what the device itself spends; the plan's cost is the slowest
device's sum (see `shard_ray.plan.cost`).

NCCL is used when the gang holds GPUs, gloo on CPU. On CPU a device is one core with one
intra-op thread, so a gang is faithful only when each of its members has a free core. When a
machine hosts more CPU devices than it has cores (whatever Ray nodes they are on), the all-to-alls
need every device at once and would share cores, so they are priced, which the plan's warnings say,
and each device's fused shard is timed on its own member as a profiling actor times a shard, as many
members at once as the machine has cores, each on a core of its own (`evaluate`): a round of a plan of
D devices costs D shard measurements, not D turns of every step's barriers. Across hosts emulated on
the machine (`shard_ray.hosts`) the all-to-alls cross the hosts' links and are measured: there the
plan's steps run whole, the compute phases taking turns (one device computes while the others wait
at a barrier), so the fused compute times stay those of a device with a core to itself.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

from shard_ray import neighbours
from shard_ray.errors import ShardRayError, first_line, sigterm_received
from shard_ray.hosts import emulated_link_mbit
from shard_ray.niceness import at_niceness, niceness
from shard_ray.plan.cost import PRICED_WHEN_SHARED, STEP_PARTS, DeviceCost, PlanCost, median_round
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.plan import Plan
from shard_ray.plan.summary import device_ranges
from shard_ray.profiling.actors import ProfilingPool, cluster_has_gpus, resources_per_device
from shard_ray.profiling.hardware import cores_for, free_cores, hardware_id, machine_id, measurement_device, pin_to
from shard_ray.profiling.keeper import (
    KEEP_ENV,
    KEEPER_NAMESPACE,
    gang_group_name,
    gang_keeper,
    gang_shape,
    keep_seconds,
    release_kept_gang,
)
from shard_ray.profiling.procedure import FusedShardMeasurement, MeasureConfig, step_estimate
from shard_ray.profiling.store import plan_key
from shard_ray.runtime import joined_ray
from shard_ray.workload.tables import TableSpec

# How often a gang waiting for its devices looks for a gang of its shape kept meanwhile (`DeviceGang._reserve`).
RESERVE_POLL_S = 1.0


@ray.remote
class GangMember:
    """A device of the gang, in a process of its own: torch, fbgemm and the step's code (`plan_step`) are imported
    there, not in the command that starts the gang (a second of its start: docs/commands.md)."""

    def __init__(self, rank: int, world_size: int, threads: int = 1, command_niceness: int = 0) -> None:
        import torch

        from shard_ray.profiling.fused_shard import HostBuffers, memory_budget

        at_niceness(command_niceness)
        torch.set_num_threads(threads)
        self.rank = rank
        self.world_size = world_size
        self.device = measurement_device()
        self.hardware = hardware_id(threads)
        self.host_buffers = HostBuffers()
        self.budget = memory_budget(self.device, 1)  # until `share_memory` says how many share the machine

    def host(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "cores": free_cores(),
            "hardware": self.hardware,
            "pid": os.getpid(),
            "machine": machine_id(),
        }

    def pin(self, core: int) -> None:
        pin_to({core})

    def measure(self, pieces: list[TablePiece], config: MeasureConfig) -> FusedShardMeasurement:
        """A fused shard timed on its own, as a profiling actor times one (`measure_fused_shard`), within this
        member's memory budget (`share_memory`)."""
        from shard_ray.profiling.fused_shard import measure_fused_shard

        return measure_fused_shard(pieces, config, self.hardware, self.budget, self.host_buffers)

    def share_memory(self, sharing: int) -> int:
        """Measure as one of `sharing` members sharing its machine's memory (or its GPU's): this member's
        `memory_budget`, kept for `measure` and returned for the plans' steps, which size every rank's shard."""
        from shard_ray.profiling.fused_shard import memory_budget

        self.budget = memory_budget(self.device, sharing)
        return self.budget

    def rendezvous_address(self) -> str:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def join(self, address: str, timeout_s: float) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=address,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def leave(self) -> None:
        import torch.distributed as dist

        from shard_ray.profiling.plan_step import forget_host_groups

        forget_host_groups()
        if dist.is_initialized():
            dist.destroy_process_group()

    def run_plan(
        self,
        by_device: list[list[TablePiece]],
        tables: list[TableSpec],
        config: MeasureConfig,
        budgets: list[int],
        take_turns: bool = False,
    ) -> dict:
        """Time the real training step of this device's share of a plan: every timed step's ms per part, and the
        rows allocated per table (`rows_cap`: None, whole tables, unless its memory `budgets[rank]` holds fewer).

        With `take_turns` the devices run their compute phases one after another.
        """
        import torch
        import torch.distributed as dist

        from shard_ray.profiling.fused_shard import warmed_up
        from shard_ray.profiling.plan_step import PlanStep

        step = PlanStep(by_device, tables, self.rank, config, self.device, budgets, self.host_buffers)
        shard = step.shard
        parts_ms: dict[str, list[float]] = {name: [] for name in STEP_PARTS}

        def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
            dist.barrier()
            shard.synchronize()
            start = time.perf_counter()
            result = fn()
            shard.synchronize()
            return (time.perf_counter() - start) * 1e3, result

        def timed_compute(fn: Callable[[], Any]) -> tuple[float, Any]:
            if not take_turns:
                return timed(fn)
            elapsed, result = 0.0, None
            for turn in range(self.world_size):
                if turn == self.rank:
                    elapsed, result = timed(fn)
                else:
                    dist.barrier()
            return elapsed, result

        # Warm-up until every device's timings settle (`warmed_up`): the steps are collective, so the
        # devices agree on when to start timing.
        warmup: list[float] | None = [] if config.warmup else None
        settling = torch.zeros(1, device=self.device)
        warmup_steps = 0
        while len(parts_ms[STEP_PARTS[0]]) < config.repeats:
            timed_steps = len(parts_ms[STEP_PARTS[0]])
            batch = config.batch_of_step(timed_steps if warmup is None else None, warmup_steps)
            step_ms, _ = step.train_step(batch, timed, timed_compute)
            if warmup is None:
                for name, value in zip(STEP_PARTS, step_ms):
                    parts_ms[name].append(value)
                continue
            warmup.append(sum(step_ms))
            warmup_steps += 1
            settling.fill_(0.0 if warmed_up(warmup, config.warmup) else 1.0)
            dist.all_reduce(settling)
            if settling.item() == 0:
                warmup = None
        return {"device": self.rank, "warmup_steps": warmup_steps, "steps": parts_ms, "rows_cap": shard.cap}

    def step_values(
        self,
        by_device: list[list[TablePiece]],
        tables: list[TableSpec],
        config: MeasureConfig,
        budgets: list[int],
    ) -> dict:
        """One step from `initial_weights` (`PlanStep.values`)."""
        from shard_ray.profiling.plan_step import PlanStep

        return PlanStep(by_device, tables, self.rank, config, self.device, budgets, self.host_buffers).values()


def gang_bundles(num_devices: int, devices_per_host: int | None, use_gpus: bool) -> tuple[list[dict[str, float]], str]:
    """A gang's placement-group bundles and strategy: one bundle per device packed onto as few nodes as
    hold them, or, for a gang of hosts, one bundle per host, each on its own node."""
    device = {"CPU": 1.0, **({"GPU": 1.0} if use_gpus else {})}
    if devices_per_host is None:
        return [device] * num_devices, "PACK"
    host = {name: amount * devices_per_host for name, amount in device.items()}
    return [host] * (num_devices // devices_per_host), "STRICT_SPREAD"


def check_hosts(num_devices: int, devices_per_host: int | None, use_gpus: bool | None = None) -> None:
    """Refuse, before anything is reserved, a gang of hosts that the connected cluster has too few
    nodes for (its placement group would wait forever)."""
    if devices_per_host is None:
        return
    use_gpus = cluster_has_gpus() if use_gpus is None else use_gpus
    bundles, _ = gang_bundles(num_devices, devices_per_host, use_gpus)
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    fitting = sum(all(node.get(k, 0) >= v for k, v in bundles[0].items()) for node in nodes)
    if fitting < len(bundles):
        raise ShardRayError(
            f"a gang of {len(bundles)} hosts with {devices_per_host} device{'s' if devices_per_host > 1 else ''} each "
            f"needs {len(bundles)} Ray nodes of "
            f"{bundles[0]} or more, but the cluster has {fitting} of them ({len(nodes)} node{'s' if len(nodes) != 1 else ''} "
            "in all); join a cluster with more nodes (--address, or `shard-ray hosts run -- COMMAND` on hosts emulated "
            "by `shard-ray hosts up`), or plan for fewer hosts (a larger --devices-per-host)"
        )


# Prices the all-to-alls a gang cannot time, where more devices than cores share a machine: given the gang's
# hardware, its devices per host, a plan, its tables and the batch size, the model file that priced them,
# the plan's per-device costs and warnings. The cost models provide it (`shard_ray.costmodel.simulator.price_comm`);
# they sit above profiling, so the gang is handed it.
CommPricer = Callable[[str, "int | None", Plan, list[TableSpec], int], tuple[str, list[DeviceCost], list[str]]]


class DeviceGang:
    """D actors, one per device, reserved together in a placement group and joined in one process group.

    Should a member die during a plan (its process killed, its node lost), the surviving members
    are stuck in a collective: the gang kills them all, starts a new gang in their place and runs
    the plan again, up to `max_retries` times.

    Joined to a Ray it did not start (`joined_ray`), a command takes the gang of its shape an earlier command left
    with the cluster's keeper, and leaves its own there when it is done (`shard_ray.profiling.keeper`).
    """

    def __init__(
        self,
        num_devices: int,
        use_gpus: bool | None = None,
        threads: int = 1,
        devices_per_host: int | None = None,
        reserve_timeout_s: float = 60.0,
        collective_timeout_s: float = 300.0,
        max_retries: int = 3,
        pin_cores: bool = True,
        comm_pricer: CommPricer | None = None,
    ) -> None:
        if devices_per_host is not None and num_devices % devices_per_host:
            raise ShardRayError(f"{num_devices} devices do not fill hosts of {devices_per_host}")
        self.num_devices = num_devices
        self.devices_per_host = devices_per_host
        self.use_gpus = cluster_has_gpus() if use_gpus is None else use_gpus
        self.threads = threads
        self.reserve_timeout_s = reserve_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.max_retries = max_retries
        self.restarts = 0
        self.members: list[Any] = []
        self.hosts: list[int] = []
        self.pin_cores = pin_cores
        self.comm_pricer = comm_pricer
        self._driver_cores: list[int] | None = None  # the driver's cores before the gang kept it off its members'
        self._pinned: list[tuple[list[int], list[int]]] = []  # per node: its members' ranks, their cores
        self._rounds = 0
        self._settled = False  # whether the members have run a plan (see `run_steps`)
        self._group: PlacementGroup | None = None
        self._hosts_seen: list[dict] = []  # each member's `host()` when it started
        self._keep_s = keep_seconds() if joined_ray() else 0.0
        self._token = uuid.uuid4().hex  # this gang's name with the keeper
        self._lent = False  # whether the keeper lent this command its gang (and stops it should this driver die)
        self._keeper_starting: ray.ObjectRef | None = None  # the keeper's answer once it has started
        self._group_name = ""  # a kept gang's placement group's name (`gang_group_name`), its members' by it
        self._shape = gang_shape(
            devices=num_devices,
            devices_per_host=devices_per_host,
            use_gpus=self.use_gpus,
            threads=threads,
            pin_cores=pin_cores,
            collective_timeout_s=collective_timeout_s,
        )
        self._start()
        for warning in self.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)

    def __enter__(self) -> DeviceGang:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # After an error (Ctrl-C included) members may be stuck in a collective: no polite leave.
        if kind is None:
            self.shutdown()
        else:
            self._stop()

    def _start(self) -> None:
        """Reserve the devices, start the members and join them; on any failure nothing is left running. Where a
        gang of this shape is kept (`keeper`), take it instead; any other kept gang frees its devices first."""
        bundles, strategy = gang_bundles(self.num_devices, self.devices_per_host, self.use_gpus)
        check_hosts(self.num_devices, self.devices_per_host, self.use_gpus)
        if self._keep_s:
            job = ray.get_runtime_context().get_job_id()
            if gang_keeper(create=False) is None:
                # Nothing is kept. The keeper, which frees this gang should this driver die holding it, starts while
                # the members do.
                self._keeper_starting = gang_keeper(create=True).ready.remote()
            elif self._take_kept(job):
                return
            self._group_name = gang_group_name(job)
        else:
            release_kept_gang()
        self._group = placement_group(
            bundles, strategy=strategy, **({"lifetime": "detached", "name": self._group_name} if self._keep_s else {})
        )
        try:
            if self._reserve(bundles, strategy):
                return
            self._start_members()
        except BaseException:
            self._stop()
            raise

    def _reserve(self, bundles: list[dict[str, float]], strategy: str) -> bool:
        """Wait for this gang's placement group; True where a gang of this shape was kept meanwhile and taken instead
        (the group given up). On a Ray it joined, the devices may be held by another command's gang: asked again every
        `RESERVE_POLL_S`, the keeper lends the gang that command leaves when it is done, or stops one of another
        shape, where a command asking once waited out its time beside an idle gang of its own shape (a walk: two
        `compare`s started 4 s apart on one head)."""
        ready = self._group.ready()
        began = time.monotonic()
        while not ray.wait([ready], timeout=RESERVE_POLL_S)[0]:
            if joined_ray():
                if not self._keep_s:
                    release_kept_gang()
                else:
                    waiting = self._group, self._group_name
                    if self._take_kept(ray.get_runtime_context().get_job_id()):
                        remove_placement_group(waiting[0])
                        return True
                    self._group, self._group_name = waiting
            if time.monotonic() - began >= self.reserve_timeout_s:
                available, total = ray.available_resources(), ray.cluster_resources()
                held = (
                    ": other work on this Ray holds the rest (another command's gang, Tune's trials, RLlib's workers);"
                    " run it again once that is done"
                    if all(total.get(name, 0) >= amount * len(bundles) for name, amount in bundles[0].items())
                    else ""
                )
                raise ShardRayError(
                    f"cannot reserve {len(bundles)} bundles of {bundles[0]} ({strategy}) within "
                    f"{self.reserve_timeout_s:.0f} s; the cluster has {available.get('CPU', 0):.0f} of its "
                    f"{total.get('CPU', 0):.0f} CPUs and {available.get('GPU', 0):.0f} of its {total.get('GPU', 0):.0f} "
                    f"GPUs free{held}"
                )
        return False

    def _call_keeper(self, method: str, *args: Any) -> Any:
        """`method(*args)` on the cluster's keeper, started again should it have ended meanwhile (it ends when it
        has nothing to keep)."""
        for attempt in range(2):
            keeper = gang_keeper(create=True)
            try:
                return ray.get(getattr(keeper, method).remote(*args))
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _await_keeper(self) -> None:
        """Wait for the keeper this gang's start started, before the gang measures: the keeper's process starting
        would take time on the measured cores (on 2 cores it took seconds more while the members measured)."""
        if self._keeper_starting is not None:
            starting, self._keeper_starting = self._keeper_starting, None
            try:
                ray.get(starting)
            except ray.exceptions.RayActorError:  # it ended meanwhile (having had nothing to keep): started again
                self._call_keeper("ready")

    def _member_names(self) -> list[str]:
        """The names of a kept gang's members (in the keeper's namespace), by its placement group's."""
        return [f"{self._group_name}/{rank}" for rank in range(self.num_devices)]

    def _record(self) -> dict:
        """What the keeper keeps of this gang: its devices, the name its members' names derive from (a handle would
        have the keeper import this module and torch), and what a command learns when it starts."""
        return {
            "group": self._group,
            "group_name": self._group_name,
            "hosts": self._hosts_seen,
            "budgets": self.budgets,
            "settled": self._settled,
        }

    def _take_kept(self, job: str) -> bool:
        """Whether a gang of this shape was kept, now this command's (its members checked alive and pinned again)."""
        kept = self._call_keeper("lend", self._shape, self._token, job)
        if kept is None:
            return False
        self._group, self._group_name, self._lent = kept["group"], kept["group_name"], True
        try:
            self.members = [ray.get_actor(name, namespace=KEEPER_NAMESPACE) for name in self._member_names()]
            self._take(kept["hosts"], kept["budgets"])
        except (ValueError, ray.exceptions.RayActorError):  # a member died while kept: a new gang instead
            self._stop()
            return False
        self._settled = kept["settled"]
        print(
            f"gang: took the gang of {self.num_devices} devices an earlier command left on this Ray ({KEEP_ENV}: kept "
            f"{self._keep_s:g} s after each command)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _start_members(self) -> None:
        options = resources_per_device(self.use_gpus)
        per_bundle = self.devices_per_host or 1
        names = self._member_names() if self._keep_s else [None] * self.num_devices
        if self._keep_s:  # outlives this command, with the keeper (which stops it should this driver die)
            options |= {"lifetime": "detached", "namespace": KEEPER_NAMESPACE}
        self.members = [
            GangMember.options(
                **options,
                name=names[rank],
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank // per_bundle
                ),
            ).remote(rank, self.num_devices, self.threads, niceness())
            for rank in range(self.num_devices)
        ]
        hosts = ray.get([m.host.remote() for m in self.members])
        # Each rank's memory budget: the members on a machine share its memory (Ray nodes may share a machine, as an
        # emulated cluster's do); on GPUs each has its own.
        sharing = Counter(h["machine"] for h in hosts)
        budgets = ray.get(
            [m.share_memory.remote(1 if self.use_gpus else sharing[h["machine"]]) for m, h in zip(self.members, hosts)]
        )
        self._take(hosts, budgets)
        address = ray.get(self.members[0].rendezvous_address.remote())
        ray.get([m.join.remote(address, self.collective_timeout_s) for m in self.members])

    def _take(self, hosts: list[dict], budgets: list[int]) -> None:
        """What this command knows of its members from their `host()` and memory budgets; each pinned to its core."""
        self._hosts_seen, self.budgets = hosts, budgets
        self.hardware = hosts[0]["hardware"]
        self._machines = [(h["machine"], tuple(h["cores"])) for h in hosts]
        # Which devices share a host: nodes numbered in rank order of first appearance.
        numbering: dict[str, int] = {}
        self.hosts = [numbering.setdefault(h["node"], len(numbering)) for h in hosts]
        self.warnings = self._oversubscription(hosts)
        self.take_turns = bool(self.warnings)
        spanned = len(set(self.hosts))
        if spanned > 1 and self.devices_per_host is None:
            self.warnings.append(
                f"the gang spans {spanned} Ray nodes, but was given no --devices-per-host: the plans are priced as on "
                "one host, without the links between hosts; plan and measure with the layout (`--devices-per-host L`, "
                "which `shard-ray hosts up` prints for its hosts; for `compare`, plan its plan files with it: they "
                "record it)"
            )
        link_bound = self.take_turns and emulated_link_mbit() is not None and len(set(self.hosts)) > 1
        self.priced_parts = list(PRICED_WHEN_SHARED) if self.take_turns and not link_bound else []
        if self.pin_cores and not self.use_gpus:
            self._pin(hosts)

    def _pin(self, hosts: list[dict]) -> None:
        """Each member on a core of its own where its machine has enough, the last cores; this driver, where it
        shares the machine with members and cores are left, on the others. Ray nodes on one machine (emulated
        hosts, a test cluster) share its cores."""
        self._pinned = []
        for machine in {h["machine"] for h in hosts}:
            ranks = [r for r, h in enumerate(hosts) if h["machine"] == machine]
            cores = cores_for(len(ranks), hosts[ranks[0]]["cores"])
            if cores is None:
                continue
            self._pinned.append((ranks, cores))
            spare = set(hosts[ranks[0]]["cores"]) - set(cores)
            if machine == machine_id() and spare and set(free_cores()) >= spare:
                self._driver_cores = free_cores()
                pin_to(spare)
        self.rotate_cores(0)

    def lends(self, actors: int, threads: int, use_gpus: bool | None) -> bool:
        """Whether the members can be `actors` profiling actors measuring on `threads` threads (`ProfilingPool`'s
        `gang`): as many members as actors, on the devices a pool's own would hold (each a GPU, or a core it is
        pinned to, sharing its machine's memory with as many), so that their shards measure as the pool's would."""
        pinned = sum(len(ranks) for ranks, _ in self._pinned) == self.num_devices
        return (
            actors == self.num_devices
            and threads == self.threads
            and use_gpus in (None, self.use_gpus)
            and (self.use_gpus or pinned)
        )

    def lent_members(self) -> tuple[list[Any], list[str]]:
        """The members as profiling actors, each on the core `rotate_cores(0)` gives it (shards timed apart may
        have moved them), and each member's machine; a gang that lost a member is started again first."""

        def pinned() -> tuple[list[Any], list[str]]:
            self.rotate_cores(0)
            return list(self.members), [machine for machine, _ in self._machines]

        return self._surviving_lost_members(pinned)

    def rotate_cores(self, shift: int) -> None:
        """Move each node's members `shift` places along their cores. Cores of one machine are not alike (the
        one the kernel, the driver and Ray lean on is measurably slower: 2-4% on a 2-core machine), so rounds
        rotate which member holds which core and a plan's cost is not that of its lucky rank's core."""
        for ranks, cores in self._pinned:
            moved = [cores[(i + shift) % len(cores)] for i in range(len(ranks))]
            ray.get([self.members[r].pin.remote(core) for r, core in zip(ranks, moved)])

    def _unpin_driver(self) -> None:
        if self._driver_cores is not None:
            pin_to(set(self._driver_cores))
            self._driver_cores = None

    def _stop(self) -> None:
        """Stop the members and free their devices. Where the command has had a SIGTERM, a local Ray of its own goes
        with it, placement groups and all, and its group is left to it: a SIGTERM to the command's whole process group
        (`timeout` sends one, as a scheduler stopping a job may) stops Ray's processes too, and the group's removal
        then waited on a raylet gone, a command killed by `timeout` spinning a core until Ray aborted it a minute
        later. (A Ctrl-C leaves Ray's processes running: they block SIGINT.)"""
        self._unpin_driver()
        for member in self.members:
            ray.kill(member)
        if self._lent:
            self._call_keeper("drop", self._token)
            self._lent = False
        self.members = []
        self._settled = False
        if self._group is not None:
            if joined_ray() or not sigterm_received():
                remove_placement_group(self._group)
            self._group = None

    def _oversubscription(self, hosts: list[dict]) -> list[str]:
        """A line per machine whose cores its CPU devices outnumber, whatever Ray nodes they are on."""
        if self.use_gpus:
            return []
        per_machine: dict[str, list[dict]] = {}
        for host in hosts:
            per_machine.setdefault(host["machine"], []).append(host)
        link = emulated_link_mbit()
        lines = []
        for members in per_machine.values():
            cores, nodes = len(members[0]["cores"]), len({m["node"] for m in members})
            if len(members) <= cores:
                continue
            shared = f"{len(members)} CPU devices share a machine with {cores} cores"
            if link is not None and nodes > 1:
                lines.append(
                    f"{shared} on {nodes} emulated hosts: their compute phases take turns and are measured; their "
                    f"all-to-alls cross the hosts' links of {link:g} Mbit/s and are measured, bound by the links as "
                    "long as the cores move bytes faster (devices on one host share cores there too)"
                )
            else:
                lines.append(
                    f"{shared}: each device's fused shard is timed on its own, {cores} at a time; their all-to-alls "
                    "would compete for cores, so they are priced by the comm model instead of measured"
                )
        return lines

    def devices_of_ranks(self, shift: int) -> list[int]:
        """The plan device each rank runs when the roles are moved `shift` places along each host's ranks."""
        local = self.devices_per_host or self.num_devices
        return [r // local * local + (r % local + shift) % local for r in range(self.num_devices)]

    def run_steps(self, plan: Plan, tables: list[TableSpec], config: MeasureConfig, shift: int = 0) -> list[dict]:
        """Run the plan's real embedding step on the gang, its devices moved `shift` places along the ranks of each
        host (`devices_of_ranks`); per plan device (in device order) every timed step's ms per part (`steps`) and
        the warm-up steps it took."""
        if plan.num_devices != self.num_devices:
            raise ShardRayError(f"plan is for {plan.num_devices} devices but the gang has {self.num_devices}")
        plan.check(tables)
        pieces = plan.pieces(tables)
        device_of = self.devices_of_ranks(shift)
        by_device = [pieces[device_of[rank]] for rank in range(self.num_devices)]

        def run() -> list[dict]:
            args = (by_device, tables, config, self.budgets)  # a restarted gang's budgets
            if not self._settled:
                # A new gang's first plan is slow in every part, whatever its warm-up steps (its
                # all-to-alls by a third, on the AMD EPYC: Ray's own processes are still starting):
                # it runs once untimed.
                self._gather([m.run_plan.remote(*args, self.take_turns) for m in self.members])
                self._settled = True
            refs = [m.run_plan.remote(*args, self.take_turns) for m in self.members]
            return [{**r, "device": device_of[r["device"]]} for r in self._gather(refs)]

        return sorted(self._surviving_lost_members(run), key=lambda r: r["device"])

    def _surviving_lost_members(self, run: Callable[[], Any]) -> Any:
        """`run()` on the gang; where a member dies (its process killed, its node lost), the gang is started
        again and `run` repeated, up to `max_retries` times."""
        for attempt in range(self.max_retries + 1):
            try:
                if not self.members:
                    self._start()
                self._await_keeper()
                return run()
            except ray.exceptions.RayActorError as err:
                if attempt == self.max_retries:
                    raise ShardRayError(
                        f"the device gang lost a member {attempt + 1} times on one plan: {first_line(err)}"
                    ) from err
                self._stop()
                self.restarts += 1
        raise AssertionError("unreachable")

    def time_shards_apart(
        self, plan: Plan, tables: list[TableSpec], config: MeasureConfig, shift: int = 0
    ) -> list[FusedShardMeasurement | None]:
        """Each device's fused shard (None for an empty device) timed on its own on the member `shift` places
        along (`devices_of_ranks`), as many members of a machine at once as it has cores, each pinned to one
        of them (the last first, as the profiling pool's actors): where more devices than cores share a machine."""
        plan.check(tables)
        pieces = plan.pieces(tables)
        device_of = self.devices_of_ranks(shift)

        def run() -> list[FusedShardMeasurement | None]:
            measured: list[FusedShardMeasurement | None] = [None] * self.num_devices
            waiting: dict[str, list[int]] = {}
            free: dict[str, list[int]] = {}
            for rank, (machine, cores) in enumerate(self._machines):
                if pieces[device_of[rank]]:
                    waiting.setdefault(machine, []).append(rank)
                free.setdefault(machine, list(cores))  # popped from the end: the last core first
            in_flight: dict[ray.ObjectRef, tuple[str, int, int]] = {}
            while waiting or in_flight:
                for machine in list(waiting):
                    while waiting[machine] and free[machine]:
                        rank, core = waiting[machine].pop(0), free[machine].pop()
                        member = self.members[rank]
                        member.pin.remote(core)  # an actor runs its calls in order: pinned before it measures
                        shard = pieces[device_of[rank]]
                        in_flight[member.measure.remote(shard, config)] = (
                            machine,
                            core,
                            rank,
                        )
                    if not waiting[machine]:
                        del waiting[machine]
                (done,), _ = ray.wait(list(in_flight), num_returns=1)
                machine, core, rank = in_flight.pop(done)
                free[machine].append(core)
                measured[device_of[rank]] = ray.get(done)
            return measured

        return self._surviving_lost_members(run)

    def evaluate(self, plan: Plan, tables: list[TableSpec], config: MeasureConfig, shift: int = 0) -> PlanCost:
        """The plan's per-device `step_estimate` of its timed steps and the plan cost, its devices run by the ranks
        `shift` places along (`run_steps`); with more devices than cores on a machine, each device's fused shard
        timed on its own (`time_shards_apart`) and the all-to-alls priced by the comm model (`priced_parts`)."""
        if self.priced_parts:
            devices, capped = self._devices_timed_apart(plan, tables, config, shift)
        else:
            results = self.run_steps(plan, tables, config, shift)
            devices = [
                DeviceCost(device=r["device"], **{name: step_estimate(values) for name, values in r["steps"].items()})
                for r in results
            ]
            capped = sorted((r["rows_cap"], r["device"]) for r in results if r["rows_cap"] is not None)
        priced_by, warnings = None, list(self.warnings) + neighbours.measured_beside()
        if capped:
            least, most = capped[0][0], capped[-1][0]
            warnings.append(
                f"device{'s' if len(capped) > 1 else ''} {device_ranges(sorted(d for _, d in capped))} measured with "
                f"at most {least:,}{'' if least == most else f' to {most:,}'} rows allocated per table (a measuring "
                "process's share of memory holds no more): their largest tables' lookups were folded into those rows, "
                "which times them optimistically"
            )
        if self.priced_parts:
            priced_by, devices, extrapolated = self._priced_comm(plan, tables, config.batch_size, devices)
            warnings += extrapolated
        return PlanCost(
            devices=devices,
            hardware=self.hardware,
            batch_size=config.batch_size,
            hosts=self.hosts,
            warnings=warnings,
            priced_parts=self.priced_parts,
            priced_by=priced_by,
        )

    def _devices_timed_apart(
        self, plan: Plan, tables: list[TableSpec], config: MeasureConfig, shift: int
    ) -> tuple[list[DeviceCost], list[tuple[int, int]]]:
        """Each device's measured forward and backward (`time_shards_apart`; its collectives are priced after), and
        (rows cap, device) of those measured with their tables capped."""
        devices, capped = [], []
        for device, m in enumerate(self.time_shards_apart(plan, tables, config, shift)):
            if m is not None and m.status != "ok":
                raise ShardRayError(f"device {device}'s fused shard could not be measured: {m.reason}")
            fwd, bwd = (m.fwd_ms, m.bwd_ms) if m is not None else (0.0, 0.0)
            devices.append(
                DeviceCost(device=device, fwd_compute_ms=fwd, fwd_comm_ms=0.0, bwd_comm_ms=0.0, bwd_compute_ms=bwd)
            )
            if m is not None and m.rows_cap is not None:
                capped.append((m.rows_cap, device))
        return devices, sorted(capped)

    def _priced_comm(
        self, plan: Plan, tables: list[TableSpec], batch_size: int, devices: list[DeviceCost]
    ) -> tuple[str, list[DeviceCost], list[str]]:
        """`devices` with their all-to-alls as `comm_pricer` prices them, the pricing model's file and its warnings."""
        if self.comm_pricer is None:
            raise ShardRayError(
                f"a gang of {self.num_devices} devices sharing cores cannot time its all-to-alls, and was given no "
                "comm pricer to price them"
            )
        model_file, priced, warnings = self.comm_pricer(self.hardware, self.devices_per_host, plan, tables, batch_size)
        return (
            model_file,
            [
                d.model_copy(update={part: getattr(p, part) for part in self.priced_parts})
                for d, p in zip(devices, priced)
            ],
            warnings,
        )

    def measure_round(
        self, plans: list[Plan], tables: list[TableSpec], config: MeasureConfig, order: np.random.Generator
    ) -> list[PlanCost]:
        """One round: every plan measured once, in an order drawn from `order`, all with `config`'s batches, the
        members on the next rotation of their cores (`rotate_cores`) and the plans' devices on the next rotation of
        the ranks (`run_steps`): ranks are not alike either (the rank whose process gathers, or leads a collective,
        does a little more; docs/measurement.md, "Ranks take turns too"), so over the rounds every device of a plan
        is run by every rank of its host."""
        self._rounds += 1
        self.rotate_cores(self._rounds)
        costs: list[PlanCost | None] = [None] * len(plans)
        for i in order.permutation(len(plans)):
            costs[i] = self.evaluate(plans[i], tables, config, shift=self._rounds)
        return costs  # type: ignore[return-value]

    def plan_key(self, plan: Plan, tables: list[TableSpec], config: MeasureConfig) -> str:
        """The store key of the plan measured on this gang: its hardware and, across hosts, its host layout."""
        return plan_key(plan, tables, config, self.hardware, self.hosts)

    def step_values(self, plan: Plan, tables: list[TableSpec], config: MeasureConfig) -> list[dict]:
        """One step of the plan from `initial_weights`, per device: its samples' pooled embeddings
        [samples, sum of table dims] and its pieces' updated weights (see `GangMember.step_values`)."""
        plan.check(tables)
        by_device = plan.pieces(tables)
        return sorted(
            self._gather([m.step_values.remote(by_device, tables, config, self.budgets) for m in self.members]),
            key=lambda r: r["device"],
        )

    def _gather(self, refs: list[ray.ObjectRef]) -> list[dict]:
        """Every member's result; raises as soon as one member is found dead (the rest would wait for it)."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready[0])
        return ray.get(refs)

    def evaluate_rounds(
        self, plans: list[Plan], tables: list[TableSpec], config: MeasureConfig, rounds: int = 1, progress: bool = True
    ) -> list[PlanCost]:
        """Every plan measured in `rounds` interleaved rounds; per plan its median round, with the rounds' summary.

        Each round measures every plan once, in a fresh random order, all on the batches of seed
        `config.seed + round`, so drift on the machine and the luck of a batch fall on every plan
        alike and plans are compared side by side.
        """
        order = np.random.default_rng(config.seed)
        per_plan: list[list[PlanCost]] = [[] for _ in plans]
        with tqdm(
            total=rounds * len(plans),
            desc=f"measuring {len(plans)} plan{'s' if len(plans) > 1 else ''} x {rounds} rounds",
            unit="run",
            disable=not progress,
        ) as bar:
            for r in range(rounds):
                measure = config.model_copy(update={"seed": config.seed + r})
                for costs, cost in zip(per_plan, self.measure_round(plans, tables, measure, order)):
                    costs.append(cost)
                bar.update(len(plans))
        return [median_round(costs) for costs in per_plan]

    def shutdown(self) -> None:
        """Leave the gang with the cluster's keeper for the next command (joined to a Ray it did not start), else
        stop its members."""
        if self._keep_s and self.members:
            self._unpin_driver()
            self._call_keeper("keep", self._token, self._shape, self._record(), self._keep_s)
            print(
                f"gang: left on this Ray for the next command for {self._keep_s:g} s ({KEEP_ENV}; 0 keeps none)",
                file=sys.stderr,
                flush=True,
            )
            self.members, self._group, self._lent = [], None, False
            return
        try:
            ray.get([m.leave.remote() for m in self.members], timeout=30)
        except Exception:  # noqa: BLE001  the actors are killed next either way
            pass
        self._stop()


class DeviceActors:
    """A command's device actors: one gang of `num_devices` (the `DeviceGang` options), started the first time it is
    asked for (`gang`) and stopped when the block ends, and profiling pools (`pool`) that measure on its members
    where they can be the pool's actors (`DeviceGang.lends`), so that a command that profiles shards and measures
    plans starts one set of actors, each loading Python, Ray, torch and fbgemm once."""

    def __init__(self, num_devices: int, **gang_options: Any) -> None:
        self.num_devices = num_devices
        self._gang_options = gang_options
        self._gang: DeviceGang | None = None

    def __enter__(self) -> DeviceActors:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._gang is not None:
            self._gang.__exit__(kind, *exc)
            self._gang = None

    def gang(self) -> DeviceGang:
        """The command's gang, started on the first call."""
        if self._gang is None:
            self._gang = DeviceGang(self.num_devices, **self._gang_options)
        return self._gang

    def pool(self, actors: int) -> ProfilingPool:
        """A profiling pool of `actors`: on the gang's members where there are as many (the gang started for it,
        which the command's plans then measure on), else actors of its own."""
        gang = self.gang() if actors == self.num_devices > 1 else None
        return ProfilingPool(actors, gang=gang)
