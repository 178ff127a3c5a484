"""Plans, the devices they are for, their memory and their cost."""

from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.plan import Plan, Shard, load_plan, save_plan
from shard_ray.plan.topology import GB, Topology, shard_bytes

__all__ = ["DeviceCost", "GB", "Plan", "PlanCost", "Shard", "Topology", "load_plan", "save_plan", "shard_bytes"]
