"""shard-ray: embedding-table sharding planned by cost models and proven by measurement on Ray."""

__version__ = "0.1.0"
