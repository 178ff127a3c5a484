"""Placement algorithms, one module per family, all behind `place(name, tables, topology)`."""

from shard_ray.placement import heuristics as _heuristics  # noqa: F401  (each module registers its algorithms)
from shard_ray.placement import search as _search  # noqa: F401

from shard_ray.placement import exact as _exact  # noqa: F401  isort: skip
from shard_ray.placement import dreamshard as _dreamshard  # noqa: F401  isort: skip
from shard_ray.placement import torchrec_planner as _torchrec  # noqa: F401  isort: skip
from shard_ray.placement.base import AlgorithmInfo, algorithms, place

__all__ = ["AlgorithmInfo", "algorithms", "place"]
