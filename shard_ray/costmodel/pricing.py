"""Pricing placements with the cost models: pieces (a table's column range) on devices.

Shared by the searches and the RL environment. The compute model works on sums of per-table
rows, so a device's running sum plus one item's row prices the device with that item in one
small model call; encodings are computed once per item.
"""

from __future__ import annotations

import numpy as np
import torch

from shard_ray.costmodel.models import CostModels, comm_feature_rows
from shard_ray.plan.plan import TablePiece
from shard_ray.plan.topology import Topology


class Pricer:
    """Prices devices and plans of items with the cost models, reusing item encodings."""

    def __init__(self, models: CostModels, topology: Topology) -> None:
        self.models = models
        self.topology = topology
        self._encodings: dict[tuple, torch.Tensor] = {}

    def encodings(self, items: list[TablePiece]) -> torch.Tensor:
        missing = [p for p in items if p.key not in self._encodings]
        if missing:
            encoded = self.models.encode_tables(missing, self.topology.batch_size)
            for p, e in zip(missing, encoded):
                self._encodings[p.key] = e
        return torch.stack([self._encodings[p.key] for p in items])

    def compute(self, sums: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
        """Predicted fwd + bwd ms of shards given by encoding sums and table counts."""
        return self.models.compute_from_sums(sums, counts).sum(axis=1)

    def comm(self, widths: np.ndarray) -> np.ndarray:
        return self.models.predict_comm(widths, self.topology.batch_size).sum(axis=1)

    def comm_rows(self, width: np.ndarray, total: float, max_width: np.ndarray, devices: int) -> np.ndarray:
        """Predicted fwd + bwd all-to-all ms of devices of `width` columns in plans of `total` columns."""
        features = comm_feature_rows(width, total, max_width, self.topology.batch_size, devices)
        return self.models.comm_ms(features).sum(axis=1)

    def device_costs(self, encodings: torch.Tensor, widths: np.ndarray, assign: np.ndarray) -> np.ndarray:
        d = self.topology.num_devices
        sums = torch.zeros(d, encodings.shape[1]).index_add_(0, torch.from_numpy(assign), encodings)
        counts = torch.from_numpy(np.bincount(assign, minlength=d).astype(np.float32))
        device_widths = np.bincount(assign, weights=widths, minlength=d)
        return self.compute(sums, counts) + self.comm(device_widths)


def item_sizes(items: list[TablePiece], topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Each item's width (columns) and memory need (bytes, with optimizer state)."""
    widths = np.array([p.width for p in items], dtype=np.float64)
    need = np.array([p.memory_bytes(topology.optimizer) for p in items], dtype=np.int64)
    return widths, need


def single_costs(pricer: Pricer, items: list[TablePiece]) -> np.ndarray:
    enc = pricer.encodings(items)
    return pricer.compute(enc, torch.ones(len(items)))
