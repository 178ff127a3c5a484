"""Loader for Meta's dlrm_datasets files: `indices, offsets, lengths = torch.load(f)`.

Layout (tables-major): `lengths` is [T, B]; `offsets` has T*B+1 entries into `indices`, so
table t's bags are offsets[t*B : (t+1)*B + 1]. Files may be gzipped. A table's spec takes
rows as max index + 1 (at least 100), pooling factor as the mean bag length, and the reuse
histogram of its row access counts, as the published papers do.
"""

from __future__ import annotations

import functools
import gzip
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shard_ray.errors import ShardRayError, first_line
from shard_ray.workload.tables import REUSE_BINS, TableBatch, TableSpec, TraceRef

MIN_ROWS = 100


@dataclass(frozen=True)
class DlrmTrace:
    indices: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray  # [T, B]

    @property
    def num_tables(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[1])

    def table(self, t: int) -> TableBatch:
        b = self.batch_size
        start, end = int(self.offsets[t * b]), int(self.offsets[(t + 1) * b])
        return TableBatch(indices=self.indices[start:end], lengths=self.lengths[t])


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(2) == b"\x1f\x8b"


@functools.lru_cache(maxsize=2)
def load_trace(path: str) -> DlrmTrace:
    """Load and check a dlrm_datasets file (cached: actors reuse it across batches)."""
    file = Path(path)
    if not file.is_file():
        raise ShardRayError(f"dataset file not found: {file}")
    try:
        opener = gzip.open if _is_gzip(file) else open
        with opener(file, "rb") as handle:
            content = torch.load(handle, weights_only=True)
    except Exception as err:  # torch.load raises many types for a bad file
        # torch's first line there advises loading the file with weights_only=False, running what it holds: its
        # loader's reason instead ("Unsupported operand 123" for a JSON file)
        reason = re.search(r"WeightsUnpickler error:\s*([^\n]+?)(?:\.\s|\n|$)", str(err))
        why = f"not a file of tensors ({reason[1]})" if reason else first_line(err)
        raise ShardRayError(f"cannot read dataset file {file}: {why}") from err
    if not (isinstance(content, (tuple, list)) and len(content) == 3):
        raise ShardRayError(f"dataset file {file}: expected (indices, offsets, lengths)")
    indices, offsets, lengths = (torch.as_tensor(x).numpy().astype(np.int64) for x in content)
    if lengths.ndim != 2 or offsets.ndim != 1 or offsets.shape[0] != lengths.size + 1:
        raise ShardRayError(f"dataset file {file}: lengths must be [tables, batch] and offsets tables*batch+1 long")
    if offsets[-1] != indices.shape[0] or np.any(np.diff(offsets) != lengths.reshape(-1)):
        raise ShardRayError(f"dataset file {file}: offsets do not match lengths and indices")
    return DlrmTrace(indices=indices, offsets=offsets, lengths=lengths)


def reuse_histogram(indices: np.ndarray) -> tuple[float, ...]:
    """Fraction of unique rows accessed k times, k in (0,1], (1,2], (2,4], ..., more."""
    if indices.size == 0:
        return (1.0,) + (0.0,) * (REUSE_BINS - 1)
    _, counts = np.unique(indices, return_counts=True)
    bins = np.minimum(np.ceil(np.log2(counts)).astype(np.int64), REUSE_BINS - 1)
    hist = np.bincount(bins, minlength=REUSE_BINS).astype(np.float64)
    return tuple(float(p) for p in hist / hist.sum())


def tables_from_dataset(
    path: str | os.PathLike[str], dim: int = 64, table_ids: list[int] | None = None
) -> list[TableSpec]:
    """Table specs derived from a dataset file; each keeps a reference to its real batches."""
    trace = load_trace(str(Path(path).resolve()))
    ids = range(trace.num_tables) if table_ids is None else table_ids
    specs = []
    for t in ids:
        if not 0 <= t < trace.num_tables:
            raise ShardRayError(f"dataset file {path} has {trace.num_tables} tables; no table {t}")
        batch = trace.table(t)
        rows = max(MIN_ROWS, int(batch.indices.max()) + 1 if batch.indices.size else MIN_ROWS)
        specs.append(
            TableSpec(
                name=f"t{t}",
                rows=rows,
                dim=dim,
                pooling_factor=max(float(batch.lengths.mean()), 1e-3),
                reuse_histogram=reuse_histogram(batch.indices),
                trace=TraceRef(path=str(Path(path).resolve()), table_index=t),
            )
        )
    return specs


def trace_batch(ref: TraceRef, batch_size: int) -> TableBatch:
    """The first `batch_size` samples of a table's real batch (repeated if the file has fewer)."""
    table = load_trace(ref.path).table(ref.table_index)
    reps = -(-batch_size // table.lengths.shape[0])
    lengths = np.tile(table.lengths, reps)[:batch_size]
    indices = np.tile(table.indices, reps)[: int(lengths.sum())]
    return TableBatch(indices=indices, lengths=lengths)
