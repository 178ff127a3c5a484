"""The compute model's physical spine: a fused shard priced from what its kernel must move and do.

Per table, per phase (forward, backward), the spine counts in physical units what fbgemm's
table-batched kernel does for one batch:

- `table`: 1, the per-table work of the launch (offsets, bounds, the table's loop);
- `lookups`: thousands of rows gathered, batch x pooling factor;
- `gathered`: MB those lookups read, lookups x width x bytes per element (the forward's pooling;
  the backward's gradient accumulation per lookup);
- `touched`: MB of the distinct rows the batch touches (the backward reads and writes each once, with
  its optimizer state), from the table's access distribution;
- `cold`: the share of `touched` that misses the caches: touched MB x S / (S + cache), S the table's
  allocated MB, `cache` fitted;
- `output`: MB of pooled output (forward) or of its gradient (backward), batch x width x 4;
- `touched_fp16`: `touched` again for fp16 tables, whose row updates convert to fp32 and back (on the
  reference CPU their backward costs ten times an fp32 table's per MB touched);
- `rows`: thousands of distinct rows the batch touches, whatever their width (the backward's work per row: its
  gradient's accumulation, its optimizer update);
- `cold_rows`: the share of `rows` that misses the caches, as `cold` (on the Intel Xeon a row's update that misses
  costs about 0.3-0.5 microseconds, about as much for 16 floats as for 64: a latency, not bytes);
- `bags`: thousands of pooled bags, the batch (a table's work per sample, whatever its width and pooling: on the
  Intel Xeon a cheap table's backward costs about 0.14 ms at batch 512 and 0.4 at 2048);
- `dense`: MB of a data-parallel replica's whole table (0 for sharded pieces): its optimizer's update is dense, as
  DistributedDataParallel's, reading the gradient and state of every row and writing it, touched or not.

A shard costs, per phase,

    sum over its kernels (one per weight precision, for its sharded pieces and for its data-parallel
    replicas apart, as `FusedShard` runs them) of
        kernel + pairs x (the kernel's tables) x (their output MB)
    + sum over its tables of rate . quantities

every rate non-negative, fitted per hardware on measured shards (`fit_spine`: non-negative least
squares on relative error, so a 0.1 ms shard weighs as much as a 10 ms one). `kernel` is a launch's
fixed cost, paid once per kernel: the fused forward's saving. `pairs` is what each table of a fused
kernel pays for the others' output, the backward's superadditivity measured on the reference CPU,
largest for fp16 (docs/cost-models.md). Being a sum of non-negative, non-decreasing terms the
spine is monotone. What it misses (fusion beyond that, dims, dtypes) the network of
`shard_ray.costmodel.models` corrects, by a factor bounded in ratio, so that a table far from its
training data is priced by physics, not by an extrapolating network.

Everything is computed from the one feature extractor's vector (`shard_ray.costmodel.features`)
and the batch size, so no caller changes and the RL environment's features stay as they are. The spine is numpy
alone: it has no learned weights (its rates are fitted by least squares), so pricing runs without torch, and training
the network that corrects it reads its prices as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shard_ray.costmodel.features import TABLE_FEATURES
from shard_ray.workload.access import BIN_ACCESS_COUNTS, REFERENCE_BATCH
from shard_ray.workload.tables import REUSE_BINS

QUANTITIES = (
    "table",
    "lookups",
    "gathered",
    "touched",
    "cold",
    "output",
    "touched_fp16",
    "rows",
    "cold_rows",
    "bags",
    "dense",
)
PHASES = ("fwd", "bwd")
PRECISIONS = ("fp32", "fp16")
# Where each feature sits in the extractor's vector.
_WIDTH, _ROWS, _POOLING = (TABLE_FEATURES.index(n) for n in ("log2_width", "log10_rows", "log2_pooling_factor"))
_FP16, _HIST = TABLE_FEATURES.index("fp16"), TABLE_FEATURES.index("reuse_bin_0")
MB = 1e6
# A spine model's learned correction multiplies a table's spine price by at most this factor, or divides it by
# at most this: the bound is where physics takes over from a network extrapolating beyond its data.
CORRECTION_BOUND = 2.0
# A correction this close to its bound (in log ratio: within 1.4% of the factor 2) is "at the bound": the price rests
# on the bound, not on what the network learned.
AT_BOUND = 0.98

# The cache sizes `fit_spine` tries (MB): the one that fits the measurements best is kept.
CACHE_CHOICES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)


def physical_quantities(
    features: np.ndarray,
    log_batch: np.ndarray | float,
    cache_mb: float,
    sampled_rows: bool = True,
    replicas: np.ndarray | None = None,
) -> np.ndarray:
    """[..., F] raw table features, log2 batch size (and [...] data-parallel replica flags; None: none) -> [...,
    len(QUANTITIES)] physical quantities (float32).

    `sampled_rows`: the distinct rows a batch touches as a sample of the reference batch's traffic, as batches are
    drawn since measurement procedure 3; False: as procedure 2 drew a histogram table's, every row drawn looked up
    max(1, count x batch / reference) times (models fitted before keep it, so they price as they were fitted)."""
    x = np.asarray(features, dtype=np.float64)
    width = np.exp2(x[..., _WIDTH])
    rows = np.power(10.0, x[..., _ROWS])
    fp16 = (x[..., _FP16] > 0.5).astype(np.float64)
    element = 4.0 - 2.0 * fp16
    batch = np.broadcast_to(np.exp2(np.asarray(log_batch, dtype=np.float64)), x.shape[:-1])
    lookups = batch * np.exp2(x[..., _POOLING])
    histogram = np.maximum(x[..., _HIST : _HIST + REUSE_BINS], 0.0)
    histogram = histogram / np.maximum(histogram.sum(axis=-1, keepdims=True), 1e-12)
    counts = BIN_ACCESS_COUNTS * batch[..., None] / REFERENCE_BATCH  # a bin's row's expected lookups in this batch
    if sampled_rows:
        # The reference batch's lookups over their mean count per row are its distinct rows (a table with fewer rows
        # shares them out, each looked up more often); in this batch a row of bin k is looked up Poisson(counts_k)
        # times, so touched with probability 1 - exp(-counts_k), as `reuse_histogram_indices` draws them.
        at_reference = (
            REFERENCE_BATCH * np.exp2(x[..., _POOLING]) / np.maximum((histogram * BIN_ACCESS_COUNTS).sum(-1), 1.0)
        )
        held = np.minimum(rows, at_reference)
        counts = counts * (at_reference / held)[..., None]
        distinct = np.minimum(lookups, held * -(histogram * np.expm1(-counts)).sum(axis=-1))
    else:
        distinct = np.minimum(rows, lookups / np.maximum((histogram * np.maximum(counts, 1.0)).sum(axis=-1), 1.0))
    row_mb = width * element / MB
    touched = distinct * row_mb
    table_mb = rows * row_mb
    output = batch * width * 4 / MB
    cold_share = table_mb / (table_mb + cache_mb)
    dense = np.zeros_like(table_mb) if replicas is None else table_mb * np.asarray(replicas, dtype=np.float64)
    return np.stack(
        [
            np.ones_like(lookups),
            lookups / 1e3,
            lookups * row_mb,
            touched,
            touched * cold_share,
            output,
            touched * fp16,
            distinct / 1e3,
            distinct * cold_share / 1e3,
            batch / 1e3,
            dense,
        ],
        axis=-1,
    ).astype(np.float32)


# Per table, what its shard's kernel-level terms add up: [fp32 table, its output MB, fp16 table, its output MB] in
# the table-batched kernels, then the same in the replicas' dense kernels. A device holding replicas beside sharded
# pieces runs both: on an H200 the second kernel's launches cost as much as the first's (docs/gpu.md).
KERNEL_COLUMNS = 8
# Columns 0, 2, 4, 6: the tables of the sharded kernels' 2 precisions and the replicas' (a view, not a gather: a
# search prices thousands of shards).
_TABLES = slice(0, None, 2)


def kernel_columns(quantities: np.ndarray, fp16: np.ndarray, replicas: np.ndarray | None = None) -> np.ndarray:
    """[..., Q] quantities, [...] fp16 flags and [...] data-parallel replica flags (None: none) -> [...,
    KERNEL_COLUMNS], whose sums over a shard price its kernels."""
    output = quantities[..., QUANTITIES.index("output")]
    fp32 = 1.0 - fp16
    columns = np.stack([fp32, fp32 * output, fp16, fp16 * output], axis=-1)
    replica = np.zeros_like(fp16) if replicas is None else np.asarray(replicas, dtype=columns.dtype)
    return np.concatenate([columns * (1.0 - replica)[..., None], columns * replica[..., None]], axis=-1)


def kernel_terms(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shards' summed `kernel_columns` [..., KERNEL_COLUMNS] -> per weight precision [..., 2]: the kernels present
    (sharded pieces' and replicas' apart, each counted once), their pairs (each kernel's tables x their output
    MB) and the output MB of all of them."""
    # [..., sharded or replicas, precision, (tables, output)]: one view, where slicing each column apart cost a
    # search's pricing more than the arithmetic; the sums over the first two are each the pair's one addition
    by_kind = columns.reshape(*columns.shape[:-1], 2, len(PRECISIONS), 2)
    tables, output = by_kind[..., 0], by_kind[..., 1]
    return np.minimum(tables, 1.0).sum(axis=-2), (tables * output).sum(axis=-2), output.sum(axis=-2)


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


@dataclass
class Spine:
    """Rates [phases, quantities] (ms per unit); per phase and weight precision a kernel's fixed ms and the pairs'
    rate; and the cache MB: fitted once (`fit_spine`) and saved with the compute model (its state's `spine.*`)."""

    rates: np.ndarray = field(default_factory=lambda: _zeros(len(PHASES), len(QUANTITIES)))
    kernel_ms: np.ndarray = field(default_factory=lambda: _zeros(len(PHASES), len(PRECISIONS)))
    pair_rate: np.ndarray = field(default_factory=lambda: _zeros(len(PHASES), len(PRECISIONS)))
    cache_mb: float = CACHE_CHOICES_MB[2]
    sampled_rows: bool = True  # `physical_quantities`'s

    STATE = ("rates", "kernel_ms", "pair_rate", "cache_mb", "sampled_rows")

    def state(self) -> dict[str, np.ndarray]:
        """The spine as the compute model's file holds it: float32 arrays named as `STATE`."""
        return {name: np.asarray(getattr(self, name), dtype=np.float32) for name in self.STATE}

    @classmethod
    def of_state(cls, state: dict[str, np.ndarray]) -> Spine:
        """A spine from its `state`, of any release: files saved before measurement procedure 3 count distinct rows
        as procedure 2 drew them; files saved before a quantity was added (`rows`, `cold_rows`, then `bags`, then
        `dense`) have no rate for it: 0, so they price as they were fitted."""
        rates = np.asarray(state["rates"], dtype=np.float32)
        missing = len(QUANTITIES) - rates.shape[-1]
        if missing > 0:
            rates = np.concatenate([rates, _zeros(*rates.shape[:-1], missing)], axis=-1)
        return cls(
            rates=rates,
            kernel_ms=np.asarray(state["kernel_ms"], dtype=np.float32),
            pair_rate=np.asarray(state["pair_rate"], dtype=np.float32),
            cache_mb=float(state["cache_mb"]),
            sampled_rows=bool(state.get("sampled_rows", 0.0)),
        )

    def __call__(
        self, features: np.ndarray, log_batch: np.ndarray | float, replicas: np.ndarray | None = None
    ) -> np.ndarray:
        """[..., F] raw features (and [...] replica flags) -> [..., 2 + KERNEL_COLUMNS]: each table's own (fwd, bwd)
        ms, then its `kernel_columns`."""
        quantities = physical_quantities(features, log_batch, self.cache_mb, self.sampled_rows, replicas)
        fp16 = (np.asarray(features)[..., _FP16] > 0.5).astype(np.float32)
        return np.concatenate([quantities @ self.rates.T, kernel_columns(quantities, fp16, replicas)], axis=-1)

    def shard_ms(self, columns: np.ndarray, devices: int = 1) -> np.ndarray:
        """(fwd, bwd) ms [..., 2] of the kernels of shards whose tables' `kernel_columns` add up to `columns`
        [..., KERNEL_COLUMNS]: a kernel's fixed cost per weight precision present, sharded pieces and replicas apart
        (a replicas' kernel priced as a launch of its precision), and its pairs (its tables x their output MB). Over
        `devices` shards, the least they add up to: one kernel, and every table paired with itself at least."""
        kernels, pairs, output = kernel_terms(columns)
        if devices == 1:
            return kernels @ self.kernel_ms.T + pairs @ self.pair_rate.T
        least_kernel = self.kernel_ms.min(axis=1) * (columns[..., _TABLES].sum(axis=-1, keepdims=True) > 0)
        return least_kernel + output @ self.pair_rate.T

    def describe(self) -> dict[str, float]:
        """The fitted rates in their units (ms per table, per thousand lookups, per MB), for reports and the docs."""
        out = {}
        for i, phase in enumerate(PHASES):
            for k, precision in enumerate(PRECISIONS):
                out[f"{phase}_kernel_{precision}"] = float(self.kernel_ms[i, k])
                out[f"{phase}_pairs_{precision}"] = float(self.pair_rate[i, k])
            out.update({f"{phase}_{name}": float(self.rates[i, j]) for j, name in enumerate(QUANTITIES)})
        out["cache_mb"] = float(self.cache_mb)
        return out


def spine_shard_ms(
    spine: Spine,
    features: np.ndarray,
    mask: np.ndarray,
    log_batch: np.ndarray,
    replicas: np.ndarray | None = None,
) -> np.ndarray:
    """Padded shards [B, T, F] with mask [B, T] (and replica flags [B, T]) -> the spine's (fwd, bwd) ms [B, 2]."""
    rows = (spine(features, np.asarray(log_batch)[..., None], replicas) * np.asarray(mask)[..., None]).sum(axis=1)
    return rows[:, :2] + spine.shard_ms(rows[:, 2:])


def fit_spine(
    features: np.ndarray,
    mask: np.ndarray,
    log_batch: np.ndarray,
    log_ms: np.ndarray,
    replicas: np.ndarray | None = None,
) -> Spine:
    """The spine fitted to measured shards ([B, T, F], [B, T], [B], log (fwd, bwd) ms [B, 2], replica flags [B, T]):
    per phase and cache size, non-negative least squares of ms weighted by 1 / measured ms (relative error); the
    cache size whose fit has the least error over both phases is kept. Deterministic."""
    from scipy.optimize import nnls  # here: scipy.optimize costs every importer of the models a second

    features, mask, log_batch = (np.asarray(x) for x in (features, mask, log_batch))
    replicas = None if replicas is None else np.asarray(replicas)
    measured = np.exp(np.asarray(log_ms, dtype=np.float32)).astype(np.float64)
    weight = 1.0 / measured
    best: tuple[float, Spine] | None = None
    for cache_mb in CACHE_CHOICES_MB:
        spine = Spine(cache_mb=cache_mb)
        quantities = physical_quantities(features, log_batch[..., None], cache_mb, replicas=replicas)
        columns = kernel_columns(quantities, (features[..., _FP16] > 0.5).astype(np.float32), replicas)
        quantities, columns = ((x * mask[..., None]).sum(axis=1).astype(np.float64) for x in (quantities, columns))
        kernels, pairs, _ = kernel_terms(columns)
        design = np.column_stack([kernels, pairs, quantities])
        error = 0.0
        for phase in range(len(PHASES)):
            coefficients, _ = nnls(design * weight[:, phase, None], measured[:, phase] * weight[:, phase])
            error += float(np.mean(np.abs(design @ coefficients * weight[:, phase] - 1.0)))
            spine.kernel_ms[phase] = coefficients[0:2]
            spine.pair_rate[phase] = coefficients[2:4]
            spine.rates[phase] = coefficients[4:]
        if best is None or error < best[0]:
            best = (error, spine)
    assert best is not None
    return best[1]
