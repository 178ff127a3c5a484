"""The classic baselines: random, round robin, and greedy balancing of a per-table proxy.

The greedy ones sort tables by their proxy, largest first, and put each on the device with
the smallest running proxy sum that still has memory for it. A table no device can hold is
sharded row-wise over all devices (`pieces_to_place`), its blocks where TorchRec puts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from shard_ray.placement.base import PlacementContext, Placer, register
from shard_ray.plan.plan import Plan, pieces_to_place
from shard_ray.plan.topology import MemoryLedger, Topology
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


def greedy_by_proxy(name: str, proxy: Proxy) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        ledger = MemoryLedger(topology)
        load = [0.0] * topology.num_devices
        # Pinned pieces (row-wise blocks) first: where they go is not a choice, and they need the room.
        ordered = sorted(pieces_to_place(tables, topology), key=lambda p: (not p.restricted, -proxy(p.behaves_as())))
        devices = []
        for piece in ordered:
            device = min(ledger.devices_with_room(piece), key=lambda d: (load[d], d))
            ledger.take(device, ledger.need(piece))
            load[device] += proxy(piece.behaves_as())
            devices.append(device)
        return Plan.from_assignment(ordered, devices, topology.num_devices, name)

    return placer


for _name, (_proxy, _what) in PROXIES.items():
    register(_name, "heuristic", f"greedy: balance the sum of {_what}, largest first")(
        lambda context, _n=_name, _p=_proxy: greedy_by_proxy(_n, _p)
    )


@register("random", "heuristic", "each table on a uniformly random device that has room")
def random_placement(context: PlacementContext) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        rng = np.random.default_rng(context.seed)
        ledger = MemoryLedger(topology)
        pieces = sorted(pieces_to_place(tables, topology), key=lambda p: not p.restricted)
        devices = []
        for piece in pieces:
            device = int(rng.choice(ledger.devices_with_room(piece)))
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
            room = set(ledger.devices_with_room(piece))
            device = next((i + k) % d for k in range(d) if (i + k) % d in room)
            ledger.take(device, ledger.need(piece))
            devices.append(device)
        return Plan.from_assignment(pieces, devices, topology.num_devices, "round_robin")

    return placer
