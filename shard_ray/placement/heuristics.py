"""The classic baselines: random, round robin, and greedy balancing of a per-table proxy.

The greedy ones sort tables by their proxy, largest first, and put each on the device with
the smallest running proxy sum that still has memory for it. A table no device can hold is
sharded row-wise over all devices (`pieces_to_place`), its blocks where TorchRec puts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from shard_ray.costmodel.features import behaves_as
from shard_ray.errors import InfeasibleError
from shard_ray.placement.base import PlacementContext, Placer, register
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.enumerator import pieces_to_place
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec

Proxy = Callable[[TableSpec], float]

PROXIES: dict[str, tuple[Proxy, str]] = {
    "size_greedy": (lambda t: float(t.rows * t.dim * t.bytes_per_element), "weight bytes"),
    "dim_greedy": (lambda t: float(t.dim), "embedding dim"),
    "lookup_greedy": (lambda t: t.dim * t.pooling_factor, "dim x pooling factor"),
    "size_lookup_greedy": (
        lambda t: t.dim * t.pooling_factor * math.log10(max(t.rows, 10)),
        "dim x pooling factor x log10(rows)",
    ),
}


def greedy_by_proxy(name: str, proxy: Proxy, constraints: Constraints | None) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        ledger = MemoryLedger(topology)
        load = [0.0] * topology.num_devices
        pieces = pieces_to_place(tables, topology, constraints)
        # Groups, then other pieces with fixed devices (row-wise blocks, pins) first: where they go is
        # (partly) not a choice, and they need the room.
        ordered = sorted(pieces, key=lambda p: (p.group is None, not p.restricted, -proxy(behaves_as(p))))
        group_device: dict[int, int] = {}
        devices = []
        for piece in ordered:
            if piece.group in group_device:
                device = group_device[piece.group]
                if device not in _room(ledger, piece):
                    raise InfeasibleError(f"{piece.describe()} does not fit beside its group on device {device}")
            else:
                room = _room(ledger, piece)
                if piece.group is not None:  # the group's first table: a device every member may go to (a member
                    # pinned to devices: the constraints' check found one they share), with room for them all
                    members = [p for p in pieces if p.group == piece.group]
                    room = [d for d in room if all(p.devices is None or d in p.devices for p in members)] or room
                    group_need = sum(ledger.need(p) for p in members)
                    room = [d for d in room if ledger.free[d] >= group_need] or room
                device = min(room, key=lambda d: (load[d], d))
                if piece.group is not None:
                    group_device[piece.group] = device
            ledger.take(device, ledger.need(piece))
            load[device] += proxy(behaves_as(piece))
            devices.append(device)
        return Plan.from_assignment(ordered, devices, topology.num_devices, name)

    return placer


def _room(ledger: MemoryLedger, piece: TablePiece) -> list[int]:
    """The ledger's devices with room for the piece; when none, its error and what would help."""
    try:
        return ledger.devices_with_room(piece)
    except InfeasibleError as err:
        raise InfeasibleError(f"{err}; cost_search also splits tables row-wise to fit them together") from None


for _name, (_proxy, _what) in PROXIES.items():
    register(_name, "heuristic", f"greedy: balance the sum of {_what}, largest first", takes_constraints=True)(
        lambda context, _n=_name, _p=_proxy: greedy_by_proxy(_n, _p, context.constraints)
    )


@register("random", "heuristic", "each table on a uniformly random device that has room")
def random_placement(context: PlacementContext) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        rng = np.random.default_rng(context.seed)
        ledger = MemoryLedger(topology)
        pieces = sorted(pieces_to_place(tables, topology), key=lambda p: not p.restricted)
        devices = []
        for piece in pieces:
            device = int(rng.choice(_room(ledger, piece)))
            ledger.take(device, ledger.need(piece))
            devices.append(device)
        return Plan.from_assignment(pieces, devices, topology.num_devices, "random")

    return placer


@register("round_robin", "heuristic", "table i on device i mod D, moving on when a device is full")
def round_robin(context: PlacementContext) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        ledger = MemoryLedger(topology)
        pieces = sorted(pieces_to_place(tables, topology), key=lambda p: not p.restricted)
        devices = []
        d = topology.num_devices
        for i, piece in enumerate(pieces):
            room = set(_room(ledger, piece))
            device = next((i + k) % d for k in range(d) if (i + k) % d in room)
            ledger.take(device, ledger.need(piece))
            devices.append(device)
        return Plan.from_assignment(pieces, devices, topology.num_devices, "round_robin")

    return placer
