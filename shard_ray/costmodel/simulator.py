"""Pricing plans with the cost models instead of the hardware.

The simulated cost uses the one cost definition (`shard_ray.plan.cost`): per device the
predicted fused forward and backward of its shard plus its predicted collectives, and the plan
costs its slowest device. The comm model learned the pooled embeddings' all-to-all; the input
all-to-all (lookup ids and lengths) and data-parallel gradients' all-reduce are priced as the
all-to-all moving as many bytes per device (`shard_ray.costmodel.pricing`).
"""

from __future__ import annotations

import numpy as np

from shard_ray.costmodel.models import CostModels
from shard_ray.costmodel.pricing import input_width, output_width, sync_width
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.workload.tables import TableSpec


class Simulator:
    def __init__(self, models: CostModels) -> None:
        self.models = models

    def plan_cost(self, plan: Plan, tables: list[TableSpec], batch_size: int) -> PlanCost:
        shards = plan.pieces(tables)
        compute = self.models.predict_shards(shards, batch_size)
        comm = self.models.predict_comm([sum(output_width(p) for p in shard) for shard in shards], batch_size)
        inputs = self.models.predict_comm([sum(input_width(p) for p in shard) for shard in shards], batch_size)
        syncs = [sum(sync_width(p, batch_size, self.models.rows_cap) for p in shard) for shard in shards]
        sync = self.models.predict_comm(syncs, batch_size)[:, 1] if any(syncs) else np.zeros(len(shards))
        return PlanCost(
            devices=[
                DeviceCost(
                    device=d,
                    input_dist_ms=float(inputs[d, 0]),
                    fwd_compute_ms=float(compute[d, 0]),
                    fwd_comm_ms=float(comm[d, 0]),
                    bwd_comm_ms=float(comm[d, 1] + sync[d]),
                    bwd_compute_ms=float(compute[d, 1]),
                )
                for d in range(plan.num_devices)
            ],
            hardware=f"simulated:{self.models.hardware}",
            batch_size=batch_size,
        )
