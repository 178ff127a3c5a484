"""Index batches that follow a table's access distribution, or come from its real trace.

A batch of one table is `(indices, lengths)`: `lengths[b]` lookups for sample b and the
row ids for all of them, sample-major, as the fbgemm kernels take them.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import io
import math
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

from shard_ray.io import shard_ray_home, write_atomic
from shard_ray.workload.tables import REUSE_BINS, TableBatch, TableSpec

# The public histogram describes one batch of 65536 samples; a batch of another size samples that traffic
# (`reuse_histogram_indices`).
REFERENCE_BATCH = 65536
# A reuse bin's access count at the reference batch: bin 0 is one access, bin k the middle of (2^(k-1), 2^k], the
# last ("more") taken as (32768, 65536].
BIN_ACCESS_COUNTS = np.array([1.0] + [(2 ** (k - 1) + 1 + 2**k) / 2 for k in range(1, REUSE_BINS)])
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
    rows: int, histogram: tuple[float, ...], pooling_factor: float, count: int, rng: np.random.Generator
) -> np.ndarray:
    """Row ids of `count` lookups of a table whose rows are looked up, over the reference batch, as its 17-bin
    reuse histogram says.

    The reference batch's REFERENCE_BATCH x pooling factor lookups fall on the histogram's rows, those of bin k
    looked up BIN_ACCESS_COUNTS[k] times each. A batch of any size samples that traffic: each lookup falls in bin k
    with the bin's share of the accesses, on one of its rows at random, so a row of count c is looked up
    Poisson(c x batch / reference) times, and in a small batch most cold rows not at all, as in a sample of real
    traffic. (Until measurement procedure 3 every row drawn was looked up at least once, which gave a batch of 1,024
    samples several times the distinct rows: 3.3 times on pool table t193, docs/measurement.md.) The bins' rows are
    fixed ranks, hottest first, spread over the table by `scatter_rows` as a Zipf table's are, so a table's hot rows
    are the same in every batch.
    """
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    probs = np.asarray(histogram, dtype=np.float64)
    probs = probs / probs.sum()
    distinct = REFERENCE_BATCH * pooling_factor / float(probs @ BIN_ACCESS_COUNTS)
    # A table with fewer rows than that shares them out among the bins alike.
    bin_rows = np.where(probs > 0, np.maximum(1, np.rint(probs * min(distinct, rows))), 0).astype(np.int64)
    hottest_first = np.arange(len(probs))[::-1]
    starts = np.zeros(len(probs), dtype=np.int64)
    starts[hottest_first] = np.concatenate([[0], np.cumsum(bin_rows[hottest_first])[:-1]])
    accesses = probs * BIN_ACCESS_COUNTS
    bins = rng.choice(len(probs), size=count, p=accesses / accesses.sum())
    ranks = starts[bins] + (rng.random(count) * bin_rows[bins]).astype(np.int64)
    return scatter_rows(ranks % rows, rows)


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


def _certain_below(counts: np.ndarray) -> np.ndarray:
    """For each count k, a mean m up to which P(Poisson(m) > k) < 2^-60, by Chernoff's bound
    exp(-m) (e m / (k + 1))^(k + 1), which grows with m below k + 1 (found by bisection, from below): there the CDF at k
    is 1 to the last bit of a float64, and `pdtr` returns 1.0 (checked on 6 million means and counts, the means
    from 1e-12 to 1e5)."""
    a = counts + 1.0
    low, high = np.zeros_like(a), a.copy()
    for _ in range(200):
        mid = (low + high) / 2
        tail = (-mid + a * (1.0 + np.log(mid) - np.log(a))) / math.log(2.0)
        low, high = np.where(tail < -60.0, mid, low), np.where(tail < -60.0, high, mid)
    return low


_BIN_TOPS = np.exp2(np.arange(REUSE_BINS - 1))  # the counts the bins but the last end at: 1, 2, 4, ..., 2^15
_CERTAIN_BELOW = _certain_below(_BIN_TOPS)


# Kept for as many distinct tables as the largest tasks hold: a placement describes every table several times over,
# so a cache smaller than the task misses on every call (5,136 tables given by Zipf exponents, the README's full
# format, on 512 devices: 37,728 misses at 1-3 ms each, 65 s of a profiled 82 s `cost_search`). An entry is under 1 kB.
@functools.lru_cache(maxsize=2**16)
def zipf_reuse_histogram(rows: int, exponent: float, pooling_factor: float) -> tuple[float, ...]:
    """Expected reuse histogram of a Zipf table over the reference batch, as `zipf_indices` draws it
    (`derive_zipf_histogram`), or as an earlier command on this machine derived it (`KEPT_HISTOGRAMS`)."""
    key = (rows, exponent, pooling_factor)
    histogram = KEPT_HISTOGRAMS.get(key)
    if histogram is None:
        histogram = derive_zipf_histogram(rows, exponent, pooling_factor)
        KEPT_HISTOGRAMS.add(key, histogram)
    return histogram


def derive_zipf_histogram(rows: int, exponent: float, pooling_factor: float) -> tuple[float, ...]:
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
    # P(count <= 2^k) for k = 0..15 per group; bin 0 is count 1, bin k is (2^(k-1), 2^k], the last the rest. Where the
    # mean is so far below 2^k that the CDF is 1 to the last bit (most of a large table's groups: its cold rows), it
    # is set so rather than computed: `pdtr` took 2.6 ms of a 3 ms call on a table of 10^8 rows.
    # scipy.special, not scipy.stats: the same Poisson CDF kernel for a third of the import; here, not at the module's
    # top, where it took 0.13 s of every command's start, most of which read their histograms kept
    from scipy.special import pdtr

    cdf = np.ones((len(mean_count), REUSE_BINS - 1))
    for k, (top, certain) in enumerate(zip(_BIN_TOPS, _CERTAIN_BELOW)):
        unsure = mean_count > certain
        cdf[unsure, k] = pdtr(top, mean_count[unsure])
    zero = np.exp(-mean_count)[:, None]
    per_bin = np.diff(np.concatenate([zero, cdf, np.ones_like(zero)], axis=1), axis=1)
    rows_per_bin = (members[:, None] * per_bin).sum(axis=0)
    return tuple(float(p) for p in rows_per_bin / rows_per_bin.sum())


class KeptHistograms:
    """Zipf histograms derived by earlier commands on this machine, in `$SHARD_RAY_HOME/cache/` (else
    ~/.shard-ray/cache/), one file for this derivation: this module's source, numpy's and scipy's releases and Python's
    name the file, so a histogram is read back only where deriving it again gives the same bits.

    Deriving one takes 1.0-1.5 ms (`pdtr`), twice a table (the table and its data-parallel replicas): a table file
    of thousands of tables in the README's minimal format spent most of a `plan` there (docs/commands.md). A
    process reads the file at its first Zipf table, and at its exit adds what it derived (the file read again and
    written whole, so that commands ending together each keep theirs, but for a race's loser). A file that cannot
    be read is taken as empty and one that cannot be written is left: the histograms are derived as before."""

    # About 160 bytes an entry: at most 21 MB, a few large tasks' tables; the oldest go first.
    MOST = 2**17

    def __init__(self) -> None:
        self._index: dict[tuple[int, float, float], int] | None = None  # a key's row in `_values`
        self._values = np.zeros((0, REUSE_BINS))
        self._new: dict[tuple[int, float, float], tuple[float, ...]] = {}

    @staticmethod
    def path() -> Path:
        return shard_ray_home() / "cache" / f"zipf-histograms-{_derivation_digest()}.npz"

    def get(self, key: tuple[int, float, float]) -> tuple[float, ...] | None:
        if key in self._new:
            return self._new[key]
        if self._index is None:
            keys, self._values = self._read()
            self._index = {
                (int(rows), exponent, pooling): k for k, (rows, exponent, pooling) in enumerate(keys.tolist())
            }
        at = self._index.get(key)
        return None if at is None else tuple(self._values[at].tolist())

    def add(self, key: tuple[int, float, float], histogram: tuple[float, ...]) -> None:
        if not self._new:
            atexit.register(self.save)
        self._new[key] = histogram

    def save(self) -> None:
        """Add the histograms derived since the file was read to what it holds now."""
        if not self._new:
            return
        keys, values = self._read()
        kept = {tuple(k): v for k, v in zip(keys.tolist(), values)}
        kept.update({(float(r), e, p): np.asarray(h) for (r, e, p), h in self._new.items()})
        newest = list(kept.items())[-self.MOST :]
        buffer = io.BytesIO()
        np.savez(
            buffer,
            keys=np.array([k for k, _ in newest], dtype=np.float64).reshape(-1, 3),
            values=np.array([v for _, v in newest], dtype=np.float64).reshape(-1, REUSE_BINS),
        )
        try:
            write_atomic(self.path(), buffer.getvalue())
        except OSError:  # a home this user cannot write: nothing kept
            pass
        self._new.clear()

    def _read(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            with np.load(self.path(), allow_pickle=False) as held:
                keys, values = held["keys"], held["values"]
            if keys.ndim == 2 and keys.shape[1] == 3 and values.shape == (len(keys), REUSE_BINS):
                return keys.astype(np.float64), values.astype(np.float64)
        except (OSError, ValueError, KeyError, EOFError):  # none yet, or not a file of this kind: as if empty
            pass
        return np.zeros((0, 3)), np.zeros((0, REUSE_BINS))


@functools.cache
def _derivation_digest() -> str:
    """What names the file of kept histograms: whatever could change a derived histogram's bits."""
    release = f"{Path(__file__).read_bytes().hex()} {np.__version__} {version('scipy')} {sys.version}"
    return hashlib.sha256(release.encode()).hexdigest()[:16]


KEPT_HISTOGRAMS = KeptHistograms()


def generate_table_batch(table: TableSpec, batch_size: int, rng: np.random.Generator) -> TableBatch:
    """One batch for `table`: its real trace when it has one, else drawn from its distribution."""
    if table.trace is not None:
        from shard_ray.workload.dlrm_dataset import trace_batch

        return trace_batch(table.trace, batch_size)
    lengths = draw_lengths(table.pooling_factor, batch_size, rng)
    count = int(lengths.sum())
    if table.reuse_histogram is not None:
        indices = reuse_histogram_indices(table.rows, table.reuse_histogram, table.pooling_factor, count, rng)
    else:
        indices = zipf_indices(table.rows, table.effective_zipf_exponent, count, rng)
    return TableBatch(indices=indices, lengths=lengths)


def fold_rows(batch: TableBatch, rows: int) -> TableBatch:
    """Map a batch onto a table of `rows` rows (used when only part of a table is allocated)."""
    return TableBatch(indices=batch.indices % rows, lengths=batch.lengths)
