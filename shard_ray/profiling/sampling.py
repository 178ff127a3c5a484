"""Which shards to profile: every single table, then random multi-table shards; and the microbenchmark's."""

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


# The microbenchmark's tables are named MICROBENCHMARK~i: its shards train every model, whatever its pool.
MICROBENCHMARK = "microbenchmark"


def microbenchmark_shards() -> list[list[TablePiece]]:
    """The fixed shards that fit the compute model's physical spine (`shard_ray.costmodel.spine`) on a hardware.

    Each series moves one quantity the spine prices, the others held: the tables of a shard (1 to 48 cheap
    ones, for a kernel's fixed cost, a table's own and the pairs), the lookups (pooling factors 1 to 256),
    the row width (dims 4 to 1024), the rows (100 to 10^7, in and far out of the caches: 2.6 GB at the most, which
    a measuring process holds whole on a machine of 12 GB and more) and the precision;
    then mixed shards of 2 to 32 tables drawn from all of them; then 64 to 256 small tables (1,000 rows; dims 16 and
    64, pooling 1 and 8), where a term growing faster than the tables would show. Tables follow the table file's
    default access (Zipf 1.05). The same shards every time: a hardware's rates are comparable to another's.
    """
    rng = np.random.default_rng(20261126)

    def table(i: int, rows: int, dim: int, pooling: float, precision: str = "fp32") -> TableSpec:
        return TableSpec(name=f"{MICROBENCHMARK}~{i}", rows=rows, dim=dim, pooling_factor=pooling, precision=precision)

    series: list[list[TableSpec]] = []
    cheap = [table(i, int(10 ** (2 + i % 5)), (8, 16, 32)[i % 3], 1.0) for i in range(48)]
    series += [cheap[:count] for count in (1, 2, 4, 8, 16, 24, 32, 48)]
    series += [[table(100 + i, 100_000, 16, pooling)] for i, pooling in enumerate((1, 4, 16, 64, 256))]
    series += [[table(110 + i, 100_000, dim, 8.0)] for i, dim in enumerate((4, 32, 128, 512, 1024))]
    series += [[table(120 + i, rows, 64, 8.0)] for i, rows in enumerate((100, 10_000, 1_000_000, 10_000_000))]
    series += [[table(130 + i, 100_000, dim, 16.0, "fp16")] for i, dim in enumerate((16, 128, 512))]
    everything = list({t.name: t for shard in series for t in shard}.values())
    for _ in range(16):
        size = int(rng.integers(2, 33))
        series.append([everything[j] for j in sorted(rng.choice(len(everything), size=size, replace=False))])
    # Last, so that the shards above stay as they were measured: many small tables, up to 256 in a shard. Fitted
    # without them, the Intel Xeon's spine took the backward's cost per table and batch for pairs (tables x their
    # output) and priced 256 tables of dim 64 at 27x their measurement; the kernels are linear in tables there.
    for start, dim, pooling, counts in (
        (200, 16, 1.0, (64, 128, 256)),
        (500, 64, 1.0, (64, 128)),
        (700, 16, 8.0, (64, 128)),
    ):
        many = [table(start + i, 1000, dim, pooling) for i in range(max(counts))]
        series += [many[:count] for count in counts]
    return [[TablePiece.whole(t) for t in shard] for shard in series]
