"""A lower bound on the simulated cost of any plan of a task.

Compute: fusing never costs more than running tables apart (subadditivity), so the devices'
fused costs add up to at least the fused cost of all tables, and the slowest device carries at
least a 1/D share of it; in a table-wise plan it also carries at least the costliest single
table. Communication: the slowest device's all-to-alls cost at least the cheapest the comm
model predicts for any device of any plan of the task (the minimum over a grid of the device's
own width and the widest device's width). Both terms are evaluated with the cost models, whose compute model is subadditive and
monotone by construction (see `shard_ray.costmodel.models`), so the compute term bounds the
simulated compute exactly; the communication term is a minimum over the model's whole range
for the task, up to the grid's resolution.
"""

from __future__ import annotations

import numpy as np
import torch

from shard_ray.costmodel.models import CostModels, comm_feature_rows
from shard_ray.plan.plan import pieces_to_place
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec


def lower_bound_ms(models: CostModels, tables: list[TableSpec], topology: Topology, column_wise: bool = True) -> float:
    d = topology.num_devices
    pieces = pieces_to_place(tables, topology)
    encodings = models.encode_tables(pieces, topology.batch_size)
    everything = models.compute_from_sums(encodings.sum(dim=0, keepdim=True), torch.tensor([float(len(pieces))]))
    compute = float(everything.sum()) / d
    if not column_wise:
        single = models.compute_from_sums(encodings, torch.ones(len(pieces))).sum(axis=1)
        compute = max(compute, float(single.max()))
    if d == 1 or models.comm is None:
        return compute
    total = float(sum(t.dim for t in tables))
    own = np.linspace(0.0, total, 65)
    widest = np.linspace(total / d, total, 33)
    own_grid, widest_grid = np.meshgrid(own, widest)
    feasible = own_grid <= widest_grid
    features = comm_feature_rows(own_grid[feasible], total, widest_grid[feasible], topology.batch_size, d)
    return compute + float(models.comm_ms(features).sum(axis=1).min())
