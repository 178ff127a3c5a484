"""The classic baselines: random, round robin, and greedy balancing of a per-table proxy.

The greedy ones sort tables by their proxy, largest first, and put each on the device with
the smallest running proxy sum that still has memory for it. A table no device can hold is
sharded row-wise over all devices (`pieces_to_place`), its blocks where TorchRec puts them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from shard_ray.costmodel.features import behaves_as
from shard_ray.errors import InfeasibleError
from shard_ray.placement.base import PlacementContext, Placer, register, with_splitting_hint
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
        pieces = pieces_to_place(tables, topology, constraints)
        order, devices = balanced_by_proxy(pieces, topology, proxy)
        return Plan.from_assignment([pieces[i] for i in order], devices, topology.num_devices, name)

    return placer


def balanced_by_proxy(
    pieces: list[TablePiece], topology: Topology, proxy: Proxy, needs: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """The greedy heuristic over `pieces` (`pieces_to_place`'s): the order it places them in (their indices: groups,
    then pieces with fixed devices, then by `proxy`, largest first) and each one's device, that of the smallest
    running sum of `proxy` (the lowest index of a tie) with room. `needs`: the pieces' memory, where the caller has
    it."""
    ledger = MemoryLedger(topology)
    load = [0.0] * topology.num_devices
    heap = [(0.0, d) for d in range(topology.num_devices)]  # (load, device), an entry of an older load skipped
    needs = [ledger.need(p) for p in pieces] if needs is None else needs
    values = [proxy(behaves_as(p)) for p in pieces]
    # Groups, then other pieces with fixed devices (row-wise blocks, pins) first: where they go is
    # (partly) not a choice, and they need the room.
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i].group is None, not pieces[i].restricted, -values[i]))
    group_device: dict[int, int] = {}
    devices = []
    for i in order:
        piece = pieces[i]
        if piece.group in group_device:
            device = group_device[piece.group]
            if device not in _room(ledger, piece):
                raise InfeasibleError(f"{piece.describe()} does not fit beside its group on device {device}")
        elif piece.group is not None:  # the group's first table: a device every member may go to (a member
            # pinned to devices: the constraints' check found one they share), with room for them all
            room = _room(ledger, piece)
            members = [p for p in pieces if p.group == piece.group]
            room = [d for d in room if all(p.devices is None or d in p.devices for p in members)] or room
            group_need = sum(ledger.need(p) for p in members)
            room = [d for d in room if ledger.free[d] >= group_need] or room
            device = min(room, key=lambda d: (load[d], d))
            group_device[piece.group] = device
        else:
            # the least loaded with room, the first of a tie, off a heap: a list of the devices with room and a
            # `min` over it took 0.4 s a heuristic for 5,136 tables on 512 devices
            device = _least_loaded_with_room(heap, load, ledger, needs[i], piece.devices)
            if device is None:
                _room(ledger, piece)  # its error
        ledger.take(device, needs[i])
        load[device] += values[i]
        heapq.heappush(heap, (load[device], device))
        devices.append(device)
    return order, devices


def _least_loaded_with_room(
    heap: list[tuple[float, int]], load: list[float], ledger: MemoryLedger, need: int, allowed: tuple[int, ...] | None
) -> int | None:
    """The device of least `load` (then lowest index) with `need` bytes free among `allowed` (None: any), off `heap`
    (its entries of an older load dropped, those passed over pushed back); None where none has room."""
    passed, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        if entry[0] != load[entry[1]]:
            continue
        if ledger.free[entry[1]] >= need and (allowed is None or entry[1] in allowed):
            found = entry[1]
            break
        passed.append(entry)
    for entry in passed:
        heapq.heappush(heap, entry)
    return found


def _room(ledger: MemoryLedger, piece: TablePiece) -> list[int]:
    """The ledger's devices with room for the piece; when none, its error and what would help."""
    try:
        return ledger.devices_with_room(piece)
    except InfeasibleError as err:
        raise with_splitting_hint(err, "the heuristics split no table a device holds whole") from None


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
