"""Which shards to profile: every single table, then random multi-table shards."""

from __future__ import annotations

import numpy as np

from shard_ray.errors import ShardRayError
from shard_ray.plan.piece import TablePiece
from shard_ray.workload.tables import TableSpec


def draw_fused_shards(
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
    """A variant of a pool table for cost data, spread over what table files may hold.

    Its rows (from a few to far past the CPU rows cap), pooling factor (1 to hundreds), dim, and
    precision are redrawn around the pool table's, and two variants in five trade the pool's
    reuse histogram for a Zipf distribution (exponent 0.2 to 1.6: nearly uniform to very skewed),
    the default of a table file that gives none. The name keeps the pool table's name before
    '~', so data can be told apart by the pool tables it came from (seen or unseen by a model).
    """
    rows = int(np.clip(table.rows * 10 ** rng.uniform(-2.0, 1.5), 4, 10**9))
    pooling = float(np.clip(table.pooling_factor * np.exp(rng.uniform(-1.5, 1.5)), 0.5, 500.0))
    zipf = rng.random() < 0.4
    return table.model_copy(
        update={
            "name": f"{table.name}~{tag}",
            "dim": int(rng.choice(dims)),
            "rows": rows,
            "pooling_factor": round(pooling, 3),
            "precision": "fp16" if rng.random() < 0.25 else "fp32",
            "zipf_exponent": round(float(rng.uniform(0.2, 1.6)), 3) if zipf else None,
            "reuse_histogram": None if zipf else table.reuse_histogram,
        }
    )


def base_table_name(name: str) -> str:
    return name.split("~", 1)[0]


def draw_augmented_fused_shards(
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
