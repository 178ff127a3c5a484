"""Index batches that follow a table's access distribution, or come from its real trace.

A batch of one table is `(indices, lengths)`: `lengths[b]` lookups for sample b and the
row ids for all of them, sample-major, as the fbgemm kernels take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shard_ray.workload.tables import TableSpec

# The public histogram describes one batch of 65536 samples; other batch sizes scale the
# access counts of each row with the batch, so hot rows stay hot and cold rows stay single.
REFERENCE_BATCH = 65536
# Zipf ranks are spread over the row space by r -> r * m mod rows with m a prime that does not
# divide rows: a permutation, so hot rows are not all at the start of the table (which would
# make them look cache-friendly) and every row stays reachable. m < 2^20 keeps r * m inside
# int64 for tables up to 2^43 rows.
_SCATTER_PRIMES = (1_000_003, 999_983)


@dataclass(frozen=True)
class TableBatch:
    indices: np.ndarray  # int64 row ids, sample-major
    lengths: np.ndarray  # int64 lookups per sample


def draw_lengths(pooling_factor: float, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """Bag lengths with mean `pooling_factor`, at least one lookup on average per bag."""
    return rng.poisson(pooling_factor, size=batch_size).astype(np.int64)


def zipf_indices(rows: int, exponent: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """Row ids whose ranks follow a power law p(r) ~ r^-exponent over `rows` rows."""
    u = rng.random(count)
    upper = float(rows) + 1.0
    if abs(exponent - 1.0) < 1e-9:
        x = upper**u
    else:
        x = (1.0 + u * (upper ** (1.0 - exponent) - 1.0)) ** (1.0 / (1.0 - exponent))
    ranks = np.clip(np.floor(x).astype(np.int64) - 1, 0, rows - 1)
    return scatter_rows(ranks, rows)


def scatter_rows(ranks: np.ndarray, rows: int) -> np.ndarray:
    multiplier = next(p for p in _SCATTER_PRIMES if rows % p)
    return (ranks.astype(np.int64) * multiplier) % rows


def reuse_histogram_indices(
    rows: int, histogram: tuple[float, ...], count: int, batch_size: int, rng: np.random.Generator
) -> np.ndarray:
    """Row ids whose per-row access counts follow a 17-bin reuse histogram."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    probs = np.asarray(histogram, dtype=np.float64)
    # Bin k covers access counts (2^(k-1), 2^k]; bin 0 is exactly one access, the last bin
    # ("more") is taken as (32768, 65536].
    low = np.array([1] + [2 ** (k - 1) + 1 for k in range(1, len(probs))], dtype=np.float64)
    high = np.array([1] + [2**k for k in range(1, len(probs))], dtype=np.float64)
    scale = batch_size / REFERENCE_BATCH
    expected = float(np.sum(probs * np.maximum(1.0, (low + high) / 2 * scale)))
    draws = int(count / expected * 1.3) + 16
    bins = rng.choice(len(probs), size=draws, p=probs)
    counts = rng.uniform(low[bins], high[bins]) * scale
    counts = np.maximum(1, np.rint(counts)).astype(np.int64)
    while counts.sum() < count:
        counts = np.concatenate([counts, counts])
    cut = int(np.searchsorted(np.cumsum(counts), count)) + 1
    counts = counts[:cut]
    if cut <= rows <= 2**20:
        unique_rows = rng.choice(rows, size=cut, replace=False)
    else:
        # With replacement: collisions are rare when rows >> cut and unavoidable when rows < cut.
        unique_rows = rng.integers(0, rows, size=cut)
    indices = np.repeat(unique_rows, counts)[:count]
    rng.shuffle(indices)
    return indices


def generate_table_batch(table: TableSpec, batch_size: int, rng: np.random.Generator) -> TableBatch:
    """One batch for `table`: its real trace when it has one, else drawn from its distribution."""
    if table.trace is not None:
        from shard_ray.workload.dlrm_dataset import trace_batch

        return trace_batch(table.trace, batch_size)
    lengths = draw_lengths(table.pooling_factor, batch_size, rng)
    count = int(lengths.sum())
    if table.reuse_histogram is not None:
        indices = reuse_histogram_indices(table.rows, table.reuse_histogram, count, batch_size, rng)
    else:
        indices = zipf_indices(table.rows, table.effective_zipf_exponent, count, rng)
    return TableBatch(indices=indices, lengths=lengths)


def fold_rows(batch: TableBatch, rows: int) -> TableBatch:
    """Map a batch onto a table of `rows` rows (used when only part of a table is allocated)."""
    return TableBatch(indices=batch.indices % rows, lengths=batch.lengths)
