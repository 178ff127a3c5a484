"""Which shards to profile: every single table, then random multi-table shards."""

from __future__ import annotations

import numpy as np

from shard_ray.errors import ShardRayError
from shard_ray.profiling.fused_shard import ShardTable
from shard_ray.workload.tables import TableSpec


def draw_shards(
    tables: list[TableSpec], count: int, max_tables: int, seed: int = 0, singles: bool = True
) -> list[list[ShardTable]]:
    """`count` random shards of 2..max_tables tables, after one shard per table when `singles`."""
    if count < 0 or max_tables < 1:
        raise ShardRayError("the shard count must be >= 0 and max tables per shard >= 1")
    rng = np.random.default_rng(seed)
    shards = [[ShardTable.whole(t)] for t in tables] if singles else []
    upper = min(max_tables, len(tables))
    for _ in range(count):
        size = int(rng.integers(min(2, upper), upper + 1))
        chosen = rng.choice(len(tables), size=size, replace=False)
        shards.append([ShardTable.whole(tables[i]) for i in sorted(chosen)])
    return shards
