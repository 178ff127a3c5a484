"""Whole-plan measurement on a gang of Ray actors, one per device, joined by torch.distributed.

Each step every device runs its fused shard forward over the global batch, an all-to-all
hands device j the j-th slice of the batch with every device's pooled embeddings, the
backward all-to-all returns the gradients, and the fused backward applies the update. A
barrier before each phase keeps one device's wait for a slower one out of its own numbers,
so the four parts are what the device itself spends; the plan's cost is the slowest
device's sum (see `shard_ray.plan.cost`).

NCCL is used when the gang holds GPUs, gloo on CPU. On CPU a device is one core with one
intra-op thread, so a gang is faithful only when each of its members has a free core. When a
node hosts more CPU devices than it has cores, the compute phases take turns (one device
computes while the others wait at a barrier), so the fused compute times stay those of a
device with a core to itself; the all-to-alls need every device at once and still share cores,
which the plan's warnings say.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

from shard_ray.errors import ShardRayError, first_line
from shard_ray.plan.cost import DeviceCost, PlanCost, median_round
from shard_ray.plan.plan import Plan, TablePiece
from shard_ray.profiling.actors import cluster_has_gpus, resources_per_device
from shard_ray.profiling.fused_shard import FusedShard, MeasureConfig
from shard_ray.profiling.hardware import hardware_id, measurement_device
from shard_ray.workload.tables import TableSpec


def batch_slices(batch_size: int, num_devices: int) -> list[int]:
    """Rows of the global batch each device trains on after the all-to-all."""
    base, extra = divmod(batch_size, num_devices)
    return [base + (1 if d < extra else 0) for d in range(num_devices)]


@ray.remote
class GangMember:
    def __init__(self, rank: int, world_size: int, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.rank = rank
        self.world_size = world_size
        self.device = measurement_device()
        self.hardware = hardware_id(threads)

    def host(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "cores": os.cpu_count() or 1,
            "hardware": self.hardware,
        }

    def rendezvous_address(self) -> str:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def join(self, address: str, timeout_s: float) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=address,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def run_plan(
        self, parts: list[TablePiece], widths: list[int], config: MeasureConfig, take_turns: bool = False
    ) -> dict:
        """Time the real embedding step of this device's share of a plan; returns median ms per part.

        With `take_turns` the devices run their compute phases one after another.
        """
        shard = FusedShard(parts, config, self.device)
        slices = batch_slices(config.batch_size, self.world_size)
        mine = slices[self.rank]
        parts_ms: dict[str, list[float]] = {
            k: [] for k in ("fwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms", "bwd_compute_ms")
        }

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

        # Batch-major outputs make each device's slice a contiguous block, so one flat
        # all_to_all_single with split sizes carries every (slice, width) pair, as TorchRec does.
        fwd_in_splits = [n * widths[self.rank] for n in slices]
        fwd_out_splits = [mine * w for w in widths]
        # Gradients arriving from the dense part for every device's embeddings of my batch slice.
        generator = torch.Generator().manual_seed(config.seed + self.rank)
        upstream_flat = torch.randn(sum(fwd_out_splits), generator=generator).to(self.device)
        for step in range(config.warmup + config.repeats):
            fwd_ms, output = timed_compute(lambda: shard.forward(step))
            received = torch.empty(sum(fwd_out_splits), device=self.device)
            fwd_comm_ms, _ = timed(
                lambda: dist.all_to_all_single(received, output.detach().reshape(-1), fwd_out_splits, fwd_in_splits)
            )
            grads_back = torch.empty(sum(fwd_in_splits), device=self.device)
            bwd_comm_ms, _ = timed(
                lambda: dist.all_to_all_single(grads_back, upstream_flat, fwd_in_splits, fwd_out_splits)
            )
            grad_output = grads_back.view(config.batch_size, widths[self.rank])
            bwd_ms, _ = timed_compute(lambda: shard.backward(output, grad_output))
            if step >= config.warmup:
                for name, value in zip(parts_ms, (fwd_ms, fwd_comm_ms, bwd_comm_ms, bwd_ms)):
                    parts_ms[name].append(value)
        return {"device": self.rank, **{name: statistics.median(values) for name, values in parts_ms.items()}}


class DeviceGang:
    """D actors, one per device, reserved together in a placement group and joined in one process group.

    Should a member die during a plan (its process killed, its node lost), the surviving members
    are stuck in a collective: the gang kills them all, starts a new gang in their place and runs
    the plan again, up to `max_retries` times.
    """

    def __init__(
        self,
        num_devices: int,
        use_gpus: bool | None = None,
        threads: int = 1,
        reserve_timeout_s: float = 60.0,
        collective_timeout_s: float = 300.0,
        max_retries: int = 3,
    ) -> None:
        self.num_devices = num_devices
        self.use_gpus = cluster_has_gpus() if use_gpus is None else use_gpus
        self.threads = threads
        self.reserve_timeout_s = reserve_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.max_retries = max_retries
        self.restarts = 0
        self.members: list[Any] = []
        self._group: PlacementGroup | None = None
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
        """Reserve the devices, start the members and join them; on any failure nothing is left running."""
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if self.use_gpus else {})}
        self._group = placement_group([bundle] * self.num_devices, strategy="PACK")
        try:
            try:
                ray.get(self._group.ready(), timeout=self.reserve_timeout_s)
            except ray.exceptions.GetTimeoutError as err:
                available = ray.available_resources()
                raise ShardRayError(
                    f"cannot reserve {self.num_devices} devices ({bundle} each) within {self.reserve_timeout_s:.0f}s; "
                    f"the cluster has {available.get('CPU', 0):.0f} CPUs and {available.get('GPU', 0):.0f} GPUs free"
                ) from err
            self._start_members()
        except BaseException:
            self._stop()
            raise

    def _start_members(self) -> None:
        options = resources_per_device(self.use_gpus)
        self.members = [
            GangMember.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank),
            ).remote(rank, self.num_devices, self.threads)
            for rank in range(self.num_devices)
        ]
        hosts = ray.get([m.host.remote() for m in self.members])
        self.hardware = hosts[0]["hardware"]
        self.warnings = self._oversubscription(hosts)
        self.take_turns = bool(self.warnings)
        address = ray.get(self.members[0].rendezvous_address.remote())
        ray.get([m.join.remote(address, self.collective_timeout_s) for m in self.members])

    def _stop(self) -> None:
        for member in self.members:
            ray.kill(member)
        self.members = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    def _oversubscription(self, hosts: list[dict]) -> list[str]:
        if self.use_gpus:
            return []
        per_node: dict[str, list[dict]] = {}
        for host in hosts:
            per_node.setdefault(host["node"], []).append(host)
        return [
            f"{len(members)} CPU devices share a node with {members[0]['cores']} cores: their compute phases "
            "take turns, but their all-to-alls compete for cores, so communication is not faithful to separate devices"
            for members in per_node.values()
            if len(members) > members[0]["cores"]
        ]

    def evaluate(self, plan: Plan, tables: list[TableSpec], config: MeasureConfig) -> PlanCost:
        """Run the plan's real embedding step on the gang; per-device medians and the plan cost."""
        if plan.num_devices != self.num_devices:
            raise ShardRayError(f"plan is for {plan.num_devices} devices but the gang has {self.num_devices}")
        plan.check(tables)
        parts = plan.pieces(tables)
        widths = [sum(p.width for p in device_parts) for device_parts in parts]
        for attempt in range(self.max_retries + 1):
            try:
                if not self.members:
                    self._start()
                refs = [
                    m.run_plan.remote(parts[d], widths, config, self.take_turns) for d, m in enumerate(self.members)
                ]
                results = self._gather(refs)
                break
            except ray.exceptions.RayActorError as err:
                if attempt == self.max_retries:
                    raise ShardRayError(
                        f"the device gang lost a member {attempt + 1} times on one plan: {first_line(err)}"
                    ) from err
                self._stop()
                self.restarts += 1
        return PlanCost(
            devices=[DeviceCost(**r) for r in sorted(results, key=lambda r: r["device"])],
            hardware=self.hardware,
            batch_size=config.batch_size,
            warnings=self.warnings,
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
        with tqdm(total=rounds * len(plans), desc="measuring plans", unit="plan", disable=not progress) as bar:
            for r in range(rounds):
                measure = config.model_copy(update={"seed": config.seed + r})
                for i in order.permutation(len(plans)):
                    per_plan[i].append(self.evaluate(plans[i], tables, measure))
                    bar.update(1)
        return [median_round(costs) for costs in per_plan]

    def shutdown(self) -> None:
        try:
            ray.get([m.leave.remote() for m in self.members], timeout=30)
        except Exception:  # noqa: BLE001  the actors are killed next either way
            pass
        self._stop()
