"""A synthetic DLRM-like table pool following what is public about Meta's dlrm_datasets.

Published statistics (see DESIGN.md): 856 tables, about 15.8 lookups per table per sample on
average, rows taken as max index + 1 (at least 100), and the reuse histogram below. Row
counts and pooling factors are drawn log-normally around those figures; each table's reuse
histogram is the public one perturbed by a Dirichlet draw, so tables differ as real ones do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shard_ray.configfile import setting
from shard_ray.workload.tables import TableSpec

PUBLIC_REUSE_HISTOGRAM = (
    0.342,
    0.144,
    0.149,
    0.138,
    0.112,
    0.068,
    0.029,
    0.010,
    0.004,
    0.002,
    0.001,
    0.001,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
)


@dataclass(frozen=True)
class PoolConfig:
    num_tables: int = setting(856, "tables in the pool", min=1)
    seed: int = setting(0, "random seed", min=0)
    dims: tuple[int, ...] = (16, 32, 64, 128)
    median_rows: float = 1e5
    rows_log_sigma: float = 2.0
    min_rows: int = 100
    max_rows: int = 40_000_000
    median_pooling_factor: float = 7.5
    pooling_log_sigma: float = 1.2
    max_pooling_factor: float = 200.0
    histogram_concentration: float = 60.0


def generate_pool(config: PoolConfig = PoolConfig()) -> list[TableSpec]:
    """`config.num_tables` tables named t0, t1, ...; the same seed gives the same pool."""
    rng = np.random.default_rng(config.seed)
    n = config.num_tables
    rows = np.exp(rng.normal(np.log(config.median_rows), config.rows_log_sigma, n))
    rows = np.clip(rows, config.min_rows, config.max_rows).astype(np.int64)
    pooling = np.exp(rng.normal(np.log(config.median_pooling_factor), config.pooling_log_sigma, n))
    pooling = np.clip(pooling, 1.0, config.max_pooling_factor)
    dims = rng.choice(config.dims, size=n)
    # A tiny floor keeps every bin drawable by the Dirichlet; bins at ~0 stay ~0.
    alpha = (np.asarray(PUBLIC_REUSE_HISTOGRAM) + 1e-4) * config.histogram_concentration
    histograms = rng.dirichlet(alpha, size=n)
    return [
        TableSpec(
            name=f"t{i}",
            rows=int(rows[i]),
            dim=int(dims[i]),
            pooling_factor=round(float(pooling[i]), 3),
            reuse_histogram=tuple(round(float(p), 5) for p in histograms[i]),
        )
        for i in range(n)
    ]
