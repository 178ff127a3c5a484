"""Pricing plans with the cost models instead of the hardware.

The simulated cost uses the one cost definition (`shard_ray.plan.cost`): per device the
predicted fused forward and backward of its shard plus its predicted all-to-alls, and the
plan costs its slowest device.
"""

from __future__ import annotations

from shard_ray.costmodel.models import CostModels
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.workload.tables import TableSpec


class Simulator:
    def __init__(self, models: CostModels) -> None:
        self.models = models

    def plan_cost(self, plan: Plan, tables: list[TableSpec], batch_size: int) -> PlanCost:
        shards = plan.pieces(tables)
        compute = self.models.predict_shards(shards, batch_size)
        comm = self.models.predict_comm([sum(p.width for p in shard) for shard in shards], batch_size)
        return PlanCost(
            devices=[
                DeviceCost(
                    device=d,
                    fwd_compute_ms=float(compute[d, 0]),
                    fwd_comm_ms=float(comm[d, 0]),
                    bwd_comm_ms=float(comm[d, 1]),
                    bwd_compute_ms=float(compute[d, 1]),
                )
                for d in range(plan.num_devices)
            ],
            hardware=f"simulated:{self.models.hardware}",
            batch_size=batch_size,
        )
