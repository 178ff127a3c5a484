"""A lower bound on the simulated cost of any plan of a task.

Compute: fusing never costs more than running tables apart (subadditivity), so the devices'
fused costs add up to at least the fused cost of all tables, and the slowest device carries at
least a 1/D share of it; in a table-wise plan it also carries at least the costliest single
table. Communication: the all-to-alls cost at least what they cost with the columns spread
evenly. Both terms are evaluated with the cost models, so this bounds the simulated cost, and
holds to the extent the models are subadditive and monotone as the hardware is.
"""

from __future__ import annotations

import numpy as np
import torch

from shard_ray.costmodel.models import CostModels
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec


def lower_bound_ms(models: CostModels, tables: list[TableSpec], topology: Topology, column_wise: bool = True) -> float:
    d = topology.num_devices
    encodings = models.encode_tables([(t, t.dim) for t in tables])
    everything = models.compute_from_sums(encodings.sum(dim=0, keepdim=True), torch.tensor([float(len(tables))]), topology.batch_size)
    compute = float(everything.sum()) / d
    if not column_wise:
        single = models.compute_from_sums(encodings, torch.ones(len(tables)), topology.batch_size).sum(axis=1)
        compute = max(compute, float(single.max()))
    total_width = sum(t.dim for t in tables)
    comm = models.predict_comm(np.full(d, total_width / d), topology.batch_size).sum(axis=1)
    return compute + float(comm.min())
