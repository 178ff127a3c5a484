"""TorchRec's own planner as a baseline: its EmbeddingShardingPlanner, planning the same tables.

TorchRec prices options with an analytic model of bandwidths (HBM, DDR, network) rather than
measurements; see `shard_ray.interop.torchrec` for how the task is handed to it.
"""

from __future__ import annotations

from shard_ray.placement.base import PlacementContext, Placer, register


@register(
    "torchrec",
    "planner",
    "TorchRec's EmbeddingShardingPlanner (analytic bandwidth model), free to choose any sharding type",
)
def torchrec_planner(context: PlacementContext) -> Placer:
    import torchrec.distributed.planner  # noqa: F401  (imported here, so placement time leaves the import out)

    from shard_ray.interop.torchrec import plan_with_torchrec

    return plan_with_torchrec
