"""Pricing plans with the cost models instead of the hardware.

The simulated cost uses the one cost definition (`shard_ray.plan.cost`): per device the
predicted fused forward and backward of its shard plus its predicted collectives, and the plan
costs its slowest device. The comm model learned the pooled embeddings' all-to-all; the input
all-to-all (lookup ids and lengths) is priced as the all-to-all moving as many bytes per device, and data-parallel
gradients' all-reduce as a ring (`shard_ray.costmodel.pricing`).
"""

from __future__ import annotations

from shard_ray.costmodel.coverage import comm_extrapolation
from shard_ray.costmodel.links import plan_links_between_hosts
from shard_ray.costmodel.models import CostModels, models_for
from shard_ray.costmodel.pricing import DeviceParts, Pricer
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import GB, Topology
from shard_ray.workload.tables import TableSpec


class Simulator:
    """Plans priced by the cost models, as the searches price them (`Pricer.device_parts`)."""

    def __init__(self, models: CostModels) -> None:
        self.models = models

    def plan_parts(self, plan: Plan, tables: list[TableSpec], batch_size: int) -> DeviceParts:
        """The plan's predicted costs part by part; over the hosts its settings record (`plan --devices-per-host`), if
        any, at the rates between them it records, else at the ones `plan` would take today
        (`plan_links_between_hosts`)."""
        inter_host_gbps, host_link_gbps = plan_links_between_hosts(plan, self.models.links)
        topology = Topology(
            num_devices=plan.num_devices,
            memory_bytes=GB,  # what memory the plan may use is no part of its price
            batch_size=batch_size,
            devices_per_host=plan.devices_per_host,
            inter_host_gbps=inter_host_gbps,
            intra_host_gbps=plan.intra_host_gbps,
            host_link_gbps=host_link_gbps,
        )
        pieces, assign = plan.assignment(tables)
        return Pricer(self.models, topology).plan_parts(pieces, assign)

    def plan_cost(self, plan: Plan, tables: list[TableSpec], batch_size: int) -> PlanCost:
        """The plan's predicted costs (`plan_parts`)."""
        return self.plan_parts(plan, tables, batch_size).plan_cost(f"simulated:{self.models.hardware}", batch_size)


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
