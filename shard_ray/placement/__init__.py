"""Placement algorithms, one module per family, all behind `place(name, tables, topology)`."""

from shard_ray.placement import heuristics as _heuristics  # noqa: F401  (registers the baselines)
from shard_ray.placement.base import AlgorithmInfo, algorithms, place

__all__ = ["AlgorithmInfo", "algorithms", "place"]
