"""Index batches that follow a table's access distribution, or come from its real trace.

A batch of one table is `(indices, lengths)`: `lengths[b]` lookups for sample b and the
row ids for all of them, sample-major, as the fbgemm kernels take them.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# scipy.special, not scipy.stats: the same Poisson CDF kernel for a third of the import (every actor imports this)
from scipy.special import pdtr

from shard_ray.workload.tables import REUSE_BINS, TableBatch, TableSpec

# The public histogram describes one batch of 65536 samples; other batch sizes scale the
# access counts of each row with the batch, so hot rows stay hot and cold rows stay single.
REFERENCE_BATCH = 65536
# Zipf ranks are spread over the row space by r -> r * m mod rows with m a prime that does not
# divide rows: a permutation, so hot rows are not all at the start of the table (which would
# make them look cache-friendly) and every row stays reachable. m < 2^20 keeps r * m inside
# int64 for tables up to 2^43 rows.
_SCATTER_PRIMES = (1_000_003, 999_983)


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


def reuse_histogram_of(table: TableSpec) -> tuple[float, ...]:
    """The table's reuse histogram whichever way its access distribution is given.

    The one description of access that the cost models see: a histogram table's own, a Zipf
    table's derived from the distribution its batches are drawn from (`zipf_reuse_histogram`).
    """
    if table.reuse_histogram is not None:
        return table.reuse_histogram
    return zipf_reuse_histogram(table.rows, table.effective_zipf_exponent, table.pooling_factor)


# Ranks below this get a term each in the derived histogram; above it, ranks are taken in
# geometric groups whose expected counts differ by under 1%, so a table of 2^43 rows costs a few
# thousand terms.
_EXACT_RANKS = 2048
_RANK_GROUP_RATIO = 1.01


@functools.lru_cache(maxsize=4096)
def zipf_reuse_histogram(rows: int, exponent: float, pooling_factor: float) -> tuple[float, ...]:
    """Expected reuse histogram of a Zipf table over the reference batch, as `zipf_indices` draws it.

    `zipf_indices` draws rank r (0-based) with the probability the continuous power law puts on
    [r + 1, r + 2), so a group of ranks [a, b) gets mass (b^(1-s) - a^(1-s)) / ((R+1)^(1-s) - 1).
    Over REFERENCE_BATCH x pooling factor lookups each row's access count is Poisson with mean
    lookups x its mass; the histogram is the expected share of accessed rows in each count bin
    (exactly 1, then (2^(k-1), 2^k], the last bin open), as `reuse_histogram` counts a trace.
    """
    lookups = REFERENCE_BATCH * pooling_factor
    exact = min(rows, _EXACT_RANKS)
    edges = np.arange(1, exact + 2, dtype=np.float64)  # rank groups are [edges[i], edges[i + 1]), 1-based
    if rows > exact:
        count = math.ceil(math.log((rows + 1) / (exact + 1)) / math.log(_RANK_GROUP_RATIO))
        edges = np.unique(np.concatenate([edges, np.rint(np.geomspace(exact + 1, rows + 1, count + 1))]))
    low, high = edges[:-1], edges[1:]
    if abs(exponent - 1.0) < 1e-9:
        mass = (np.log(high) - np.log(low)) / math.log(rows + 1.0)
    else:
        one_minus = 1.0 - exponent
        mass = (high**one_minus - low**one_minus) / ((rows + 1.0) ** one_minus - 1.0)
    members = high - low
    mean_count = lookups * mass / members
    # P(count <= 2^k) for k = 0..15 per group; bin 0 is count 1, bin k is (2^(k-1), 2^k], the last the rest
    cdf = pdtr(np.exp2(np.arange(REUSE_BINS - 1))[None, :], mean_count[:, None])
    zero = np.exp(-mean_count)[:, None]
    per_bin = np.diff(np.concatenate([zero, cdf, np.ones_like(zero)], axis=1), axis=1)
    rows_per_bin = (members[:, None] * per_bin).sum(axis=0)
    return tuple(float(p) for p in rows_per_bin / rows_per_bin.sum())


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
