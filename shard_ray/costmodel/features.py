"""The one feature extractor: every cost model and the RL environment describe tables with it.

A table (or a column slice of one) becomes a fixed-length vector of log-scaled sizes and its
access distribution, so models see relative, not raw, magnitudes. Every access distribution the
table file takes is described one way, by its reuse histogram (a Zipf table's derived from the
distribution its batches are drawn from), so no table is outside the models' world by the
way its file gives its access. Batch size and device count
are context, given to the models beside the reduced table encodings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shard_ray.plan.piece import TablePiece
from shard_ray.workload.access import reuse_histogram_of, zipf_reuse_histogram
from shard_ray.workload.tables import REUSE_BINS, TableSpec

TABLE_FEATURES = (
    "log2_width",
    "log10_rows",
    "log2_pooling_factor",
    "log2_lookup_width",  # width x pooling factor: floats moved per sample
    "log10_bytes",
    "fp16",
    *(f"reuse_bin_{k}" for k in range(REUSE_BINS)),
)
NUM_SCALAR_FEATURES = TABLE_FEATURES.index("reuse_bin_0")  # the features before the reuse histogram
NUM_TABLE_FEATURES = len(TABLE_FEATURES)
# What the comm model sees of a device's all-to-alls (`shard_ray.costmodel.models.comm_feature_rows`).
COMM_FEATURES = ("log2_width", "log2_total_width", "log2_max_width", "log2_batch", "log2_devices", "share")


def table_features(table: TableSpec, width: int, rows_cap: int | None = None) -> np.ndarray:
    """Features of `width` columns of `table`, as measured with at most `rows_cap` rows allocated.

    Profiling on CPU allocates at most a cap of rows per table (see `MeasureConfig`); models of
    such measurements see the rows that were allocated, so they price what the gang measures.
    """
    values = _feature_values(table, table.rows, width, table.pooling_factor, reuse_histogram_of(table), rows_cap)
    return np.asarray(values, dtype=np.float32)


def _feature_values(
    table: TableSpec, rows: int, width: int, pooling_factor: float, histogram: tuple[float, ...], rows_cap: int | None
) -> list[float]:
    """`table_features` of a table of `table`'s precision with these rows, width, pooling factor and histogram, as
    Python floats: many pieces' make one array at once (`pieces_features`)."""
    rows = rows if rows_cap is None else min(rows, rows_cap)
    return [
        math.log2(width),
        math.log10(rows),
        math.log2(pooling_factor),
        math.log2(width * pooling_factor),
        math.log10(rows * width * table.bytes_per_element),
        float(table.precision == "fp16"),
        *histogram,
    ]


def pieces_features(pieces: list[TablePiece], rows_cap: int | None = None) -> np.ndarray:
    """[n, NUM_TABLE_FEATURES] for the pieces of a shard; [0, F] for an empty shard.

    A row range or a data-parallel replica is described as the table it behaves as (its rows, its
    share of the lookups), so the models price it without having seen one.
    """
    if not pieces:
        return np.zeros((0, NUM_TABLE_FEATURES), dtype=np.float32)
    return np.array([_feature_values(p.table, *_behaving(p), rows_cap) for p in pieces], dtype=np.float32)


def replica_flags(pieces: list[TablePiece]) -> np.ndarray:
    """[n] float32, 1 for each of `pieces` that is a data-parallel replica: what the compute model reads beside their
    features."""
    return np.array([float(p.replicated) for p in pieces], dtype=np.float32)


def spans_features(spans: list[tuple[TableSpec, int, int, int]], rows_cap: int | None = None) -> np.ndarray:
    """`pieces_features` of pieces given as (table, rows, columns, replicas), without building them: the lower bound
    describes seven or so of every table's (`least_encodings`; 5,136 tables in 0.33 s with pieces built)."""
    if not spans:
        return np.zeros((0, NUM_TABLE_FEATURES), dtype=np.float32)
    return np.array([_feature_values(s[0], *_behaving_of(*s), rows_cap) for s in spans], dtype=np.float32)


def batch_context(batch_size: int) -> float:
    return math.log2(batch_size)


def behaves_as(piece: TablePiece) -> TableSpec:
    """The table whose whole lookups cost what this piece's do, as the cost models see a piece.

    Hot rows are scattered over the row space (`shard_ray.workload.access`), so a range of a
    table's rows takes its share of the table's lookups and, being a random sample of its rows,
    keeps its reuse histogram. A data-parallel replica looks up its 1/replicas of the batch.
    """
    table = piece.table
    rows, width, pooling_factor, histogram = _behaving(piece)
    if (rows, width, pooling_factor) == (table.rows, table.dim, table.pooling_factor):
        return table
    update: dict[str, Any] = {"dim": width, "pooling_factor": pooling_factor}
    if rows != table.rows:
        update.update(rows=rows, zipf_exponent=None, reuse_histogram=histogram)
    return table.model_copy(update=update)


def lookups_per_sample(piece: TablePiece) -> float:
    """The piece's lookups a sample, the pooling factor of the table `behaves_as` describes it by: its rows' share of
    the table's, and a replica's of the batch (without describing it, which the all-to-all's input width, priced
    for every piece, does not need)."""
    return _lookups_of(piece.table, piece.row_count, piece.replicas)


def _lookups_of(table: TableSpec, rows: int, replicas: int) -> float:
    """`lookups_per_sample` of a piece of `table` of `rows` rows, one of `replicas` replicas."""
    return table.pooling_factor * (rows / table.rows / replicas)


def _behaving(piece: TablePiece) -> tuple[int, int, float, tuple[float, ...]]:
    """The rows, width, pooling factor and reuse histogram of the table `behaves_as` describes the piece by, without
    building it, as pricing thousands of pieces would (12,012 pieces of 2,002 tables described in 0.072 s, 0.104 s
    building a table for each)."""
    return _behaving_of(piece.table, piece.row_count, piece.width, piece.replicas)


def _behaving_of(table: TableSpec, rows: int, width: int, replicas: int) -> tuple[int, int, float, tuple[float, ...]]:
    """`_behaving` of a piece of `table` of `rows` rows and `width` columns, one of `replicas` replicas."""
    share = rows / table.rows / replicas
    if share == 1 and width == table.dim:
        return table.rows, table.dim, table.pooling_factor, reuse_histogram_of(table)
    pooling_factor = _lookups_of(table, rows, replicas)
    if rows != table.rows or table.reuse_histogram is not None:
        return rows, width, pooling_factor, reuse_histogram_of(table)
    return rows, width, pooling_factor, zipf_reuse_histogram(rows, table.effective_zipf_exponent, pooling_factor)


def padded_shards(
    shards: list[list[TablePiece]], rows_caps: list[int | None]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shards of pieces, each with the rows per table its measurement allocated at most, as the compute model takes
    them: features [B, T, F], mask [B, T] and replica flags [B, T] (float32), padded to the longest shard."""
    longest = max(1, max((len(s) for s in shards), default=0))
    features = np.zeros((len(shards), longest, NUM_TABLE_FEATURES), dtype=np.float32)
    mask = np.zeros((len(shards), longest), dtype=np.float32)
    replicas = np.zeros_like(mask)
    for i, (shard, cap) in enumerate(zip(shards, rows_caps, strict=True)):
        features[i, : len(shard)] = pieces_features(shard, cap)
        mask[i, : len(shard)] = 1.0
        replicas[i, : len(shard)] = replica_flags(shard)
    return features, mask, replicas
