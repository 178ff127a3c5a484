"""Which shards to profile: every single table, then random multi-table shards."""

from __future__ import annotations

import numpy as np

from shard_ray.errors import ShardRayError
from shard_ray.plan.plan import TablePiece
from shard_ray.workload.tables import TableSpec


def draw_shards(
    tables: list[TableSpec], count: int, max_tables: int, seed: int = 0, singles: bool = True
) -> list[list[TablePiece]]:
    """`count` random shards of 2..max_tables tables, after one shard per table when `singles`."""
    if count < 0 or max_tables < 1:
        raise ShardRayError("the shard count must be >= 0 and max tables per shard >= 1")
    rng = np.random.default_rng(seed)
    shards = [[TablePiece.whole(t)] for t in tables] if singles else []
    upper = min(max_tables, len(tables))
    for _ in range(count):
        size = int(rng.integers(min(2, upper), upper + 1))
        chosen = rng.choice(len(tables), size=size, replace=False)
        shards.append([TablePiece.whole(tables[i]) for i in sorted(chosen)])
    return shards


def augment_table(table: TableSpec, rng: np.random.Generator, dims: tuple[int, ...], tag: str) -> TableSpec:
    """A variant of a pool table at another dim, pooling factor and row count, for cost data.

    The name keeps the pool table's name before '~', so data can be told apart by the pool
    tables it came from (seen or unseen by a model).
    """
    rows = int(np.clip(table.rows * 10 ** rng.uniform(-1.0, 1.0), 100, 4 * 10**7))
    pooling = float(np.clip(table.pooling_factor * np.exp(rng.uniform(-1.0, 1.0)), 0.5, 300.0))
    return table.model_copy(
        update={
            "name": f"{table.name}~{tag}",
            "dim": int(rng.choice(dims)),
            "rows": rows,
            "pooling_factor": round(pooling, 3),
        }
    )


def base_table_name(name: str) -> str:
    return name.split("~", 1)[0]


def draw_augmented_shards(
    pool: list[TableSpec], count: int, max_tables: int, dims: tuple[int, ...], seed: int = 0, min_tables: int = 1
) -> list[list[TablePiece]]:
    """`count` shards of min_tables..max_tables augmented pool tables; the same seed gives the same shards."""
    if count < 0 or not 1 <= min_tables <= max_tables:
        raise ShardRayError("the sample count must be >= 0 and 1 <= min tables <= max tables per shard")
    if min_tables > len(pool):
        raise ShardRayError(f"shards of {min_tables} tables need a pool of at least that many; it has {len(pool)}")
    rng = np.random.default_rng(seed)
    shards = []
    for i in range(count):
        size = int(rng.integers(min_tables, min(max_tables, len(pool)) + 1))
        chosen = rng.choice(len(pool), size=size, replace=False)
        shards.append([TablePiece.whole(augment_table(pool[j], rng, dims, f"{i}")) for j in sorted(chosen)])
    return shards
