"""Pricing plans with the cost models instead of the hardware.

The simulated cost uses the one cost definition (`shard_ray.plan.cost`): per device the
predicted fused forward and backward of its shard plus its predicted collectives, and the plan
costs its slowest device. The comm model learned the pooled embeddings' all-to-all; the input
all-to-all (lookup ids and lengths) and data-parallel gradients' all-reduce are priced as the
all-to-all moving as many bytes per device (`shard_ray.costmodel.pricing`).
"""

from __future__ import annotations

import numpy as np

from shard_ray.costmodel.coverage import comm_extrapolation
from shard_ray.costmodel.models import CostModels, models_for
from shard_ray.costmodel.pricing import (
    analytic_hosts,
    host_reduce,
    host_sum_width,
    input_width,
    output_width,
    over_hosts,
    sync_width,
)
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.workload.tables import TableSpec


class Simulator:
    def __init__(self, models: CostModels) -> None:
        self.models = models

    def plan_cost(self, plan: Plan, tables: list[TableSpec], batch_size: int) -> PlanCost:
        """The plan's predicted costs; over the hosts its settings record (`plan --devices-per-host`), if any."""
        shards = plan.pieces(tables)
        per_host = analytic_hosts(self.models, plan.devices_per_host)
        inter_gbps = plan.inter_host_gbps

        def collectives(widths: list[float]) -> np.ndarray:
            widths = np.asarray(widths, dtype=np.float64)
            return over_hosts(self.models.predict_comm(widths, batch_size), widths, batch_size, per_host, inter_gbps)

        compute = self.models.predict_shards(shards, batch_size)
        comm = collectives([sum(output_width(p) for p in shard) for shard in shards])
        inputs = collectives([sum(input_width(p) for p in shard) for shard in shards])
        syncs = [sum(sync_width(p, batch_size, self.models.rows_cap) for p in shard) for shard in shards]
        sync = collectives(syncs)[:, 1] if any(syncs) else np.zeros(len(shards))
        sums = [sum(host_sum_width(p) for p in shard) for shard in shards]
        if any(sums):  # table-row-wise partial sums, added up inside each host (forward) and sent back (backward)
            comm += host_reduce(self.models, np.asarray(sums), batch_size, plan.devices_per_host or plan.num_devices)
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


def price_comm(
    hardware: str, devices_per_host: int | None, plan: Plan, tables: list[TableSpec], batch_size: int
) -> tuple[str, list[DeviceCost], list[str]]:
    """The plan's per-device costs as the models for `hardware` price them (the calibrated ones where there are
    some), their file, and a warning when the comm model never measured this many devices: the gang's
    `CommPricer`, for the all-to-alls it cannot time."""
    path = models_for(hardware, devices_per_host, tables)
    models = CostModels.load(path)
    priced = Simulator(models).plan_cost(plan, tables, batch_size).devices
    return str(path), priced, comm_extrapolation(models, plan.num_devices)
