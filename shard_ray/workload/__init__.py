"""The workload: table specs, their access distributions, synthetic pools, real data and tasks."""

from shard_ray.workload.tables import TableSpec, load_tables, save_tables, validate_tables

__all__ = ["TableSpec", "load_tables", "save_tables", "validate_tables"]
