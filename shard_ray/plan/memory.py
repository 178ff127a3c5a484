"""The one memory ledger: each device's free memory while pieces are placed."""

from __future__ import annotations

import numpy as np

from shard_ray.errors import InfeasibleError
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.topology import Topology, format_gb


class MemoryLedger:
    """Free memory of each device (weights plus optimizer state) while pieces are placed: the one ledger.

    `free` is an int64 array [D], or [copies, D] for searches that run several placements side
    by side (NeuroShard's greedy passes, one per dim-sum cap). Needs are the pieces' `memory_bytes`.
    """

    def __init__(self, topology: Topology, copies: int | None = None) -> None:
        self.topology = topology
        shape = (topology.num_devices,) if copies is None else (copies, topology.num_devices)
        self.free = np.full(shape, topology.memory_bytes, dtype=np.int64)

    @classmethod
    def of_assignment(cls, topology: Topology, devices: np.ndarray, needs: np.ndarray) -> MemoryLedger:
        """The ledger once the pieces of `needs` bytes are on `devices`."""
        ledger = cls(topology)
        ledger.free -= np.bincount(devices, weights=needs, minlength=topology.num_devices).astype(np.int64)
        return ledger

    def need(self, piece: TablePiece) -> int:
        return piece.memory_bytes(self.topology.optimizer)

    def room(self, need: int | np.ndarray) -> np.ndarray:
        """Where `need` bytes fit: a bool array shaped like `free`."""
        return self.free >= need

    def take(self, device: int | np.ndarray, need: int | np.ndarray) -> None:
        """Put `need` bytes on `device`."""
        self.free[device] -= need

    def take_flat(self, at: np.ndarray, need: int | np.ndarray) -> None:
        """Put `need` bytes at `at`, places in a ledger of several copies flattened (copy * D + device): one index
        into the [copies, D] array costs half a (copy, device) pair, and the searches pay it per piece."""
        self.free.reshape(-1)[at] -= need

    def give(self, device: int, need: int) -> None:
        self.free[device] += need

    def devices_with_room(self, piece: TablePiece) -> list[int]:
        """Devices with room for the piece, among those it may go to; InfeasibleError naming it when none."""
        need = self.need(piece)
        room = self.room(need)
        if piece.devices is not None:
            room &= np.isin(np.arange(len(room)), piece.devices)
        devices = np.flatnonzero(room).tolist()
        if not devices:
            raise InfeasibleError(
                f"{piece.describe()} needs {format_gb(need)} "
                f"(weights + {self.topology.optimizer} state) but no device has that much free "
                f"(most free: {format_gb(int(self.free.max()))} of {format_gb(self.topology.memory_bytes)})"
            )
        return devices
