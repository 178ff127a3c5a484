"""Placement algorithms, one module per family, all behind `place(name, tables, topology)`.

Every module of this package is imported here, and registers its algorithms as it loads, so a
new algorithm (with its own settings class, if it has any) is one new module.
"""

import importlib
import pkgutil

from shard_ray.placement.base import (
    AlgorithmInfo,
    PlacementContext,
    algorithm,
    algorithms,
    place,
    plan_tables,
    priced,
    register,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["AlgorithmInfo", "PlacementContext", "algorithm", "algorithms", "place", "plan_tables", "priced", "register"]
