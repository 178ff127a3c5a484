"""What the cost models were trained on, and which tables of a task lie outside it.

A model's coverage is the range of each table feature over its training pieces and the most
tables of a training shard. A table outside it (a pooling factor of 500 where training saw up
to 200, fp16 where training saw fp32 only, rows reused far more often than any training table)
is priced by extrapolation: `coverage_problems` names each such table in one line, so `plan`,
`evaluate` and `bench` can say so and point at `calibrate`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from shard_ray.costmodel.features import NUM_SCALAR_FEATURES, TABLE_FEATURES, pieces_features
from shard_ray.costmodel.info import Coverage
from shard_ray.plan.piece import TablePiece
from shard_ray.workload.tables import TableSpec

if TYPE_CHECKING:
    from shard_ray.costmodel.models import CostModels

# Slack before a value counts as outside: a quarter more or less on log-scaled sizes, two
# percentage points of a reuse bin.
_LOG_SLACK = {"log2_width": math.log2(1.25), "log2_pooling_factor": math.log2(1.25)}
_LOG10_SLACK = math.log10(1.25)
_BIN_SLACK = 0.02


def training_coverage(features: np.ndarray, max_tables: int, previous: Coverage | None = None) -> Coverage:
    """Coverage of training pieces' feature rows [n, F] and shards of up to `max_tables` tables.

    With `previous` (the coverage of the models trained further), the union of both.
    """
    low, high = features.min(axis=0), features.max(axis=0)
    if previous is not None and previous.features == list(TABLE_FEATURES):
        low, high = np.minimum(low, previous.low), np.maximum(high, previous.high)
        max_tables = max(max_tables, previous.max_tables)
    return Coverage(features=list(TABLE_FEATURES), low=low.tolist(), high=high.tolist(), max_tables=int(max_tables))


def _slack(name: str) -> float:
    if name.startswith("reuse_bin_"):
        return _BIN_SLACK
    if name.startswith("log10_"):
        return _LOG10_SLACK
    return _LOG_SLACK.get(name, math.log2(1.25) if name.startswith("log2_") else 0.0)


def _describe(name: str, value: float, low: float, high: float) -> str:
    """One feature's value and training range in the table file's terms."""
    if name == "fp16":
        return "fp16 precision (the models were trained on fp32 tables only)"
    if name.startswith("reuse_bin_"):
        k = int(name.rsplit("_", 1)[1])
        fewest, most = 2 ** (k - 1) + 1, 2**k  # the bin's reads a row, (2^(k-1), 2^k]
        if k == 0:
            accesses = "once"
        elif k == 16:
            accesses = f"more than {2 ** (k - 1)} times"
        else:
            accesses = "twice" if fewest == most else f"{fewest}-{most} times"
        return (
            f"{value:.0%} of its accessed rows are read {accesses} per 65536-sample batch, the reuse histograms' "
            "reference, whatever the plan's batch "
            f"(training tables: {low:.0%}-{high:.0%})"
        )
    base = 2.0 if name.startswith("log2_") else 10.0
    words = {
        "log2_width": "dim",
        "log10_rows": "rows",
        "log2_pooling_factor": "pooling factor",
        "log2_lookup_width": "dim x pooling factor",
        "log10_bytes": "size in bytes",
    }[name]
    return f"{words} {base**value:.4g} (training range {base**low:.4g}-{base**high:.4g})"


def model_warnings(
    models: CostModels,
    tables: list[TableSpec],
    hardware: str | None = None,
    shard_tables: int = 1,
    devices_per_host: int | None = None,
    num_devices: int = 1,
    batch_size: int = 1024,
) -> list[str]:
    """What a user should know before trusting the models' prices of `tables` on `hardware` for
    `num_devices` devices over hosts of `devices_per_host` (None: one host) at `batch_size`, one line each."""
    lines = comm_extrapolation(models, num_devices) + corrections_at_bound(models, tables, batch_size)
    if hardware is not None and models.hardware != hardware:
        lines.append(
            f"the cost models are of {models.hardware}, not of {hardware} that this plan is for; "
            "run `shard-ray calibrate` there for models of that hardware"
        )
    if models.comm_devices_per_host is not None and models.comm_devices_per_host != devices_per_host:
        planned = f"hosts of {devices_per_host}" if devices_per_host else "one host"
        lines.append(
            f"the comm model was calibrated over hosts of {models.comm_devices_per_host} devices, inter-host time included, "
            f"and this plan is for {planned}: its all-to-all prices carry that inter-host time"
        )
    return lines + coverage_problems(models, tables, shard_tables)


def corrections_at_bound(models: CostModels, tables: list[TableSpec], batch_size: int) -> list[str]:
    """A line naming the tables whose price rests on the compute model's correction bound, not on what it learned;
    none for models fitted to these tables by a calibration, which measured them (its held-out figures say how well
    they are priced)."""
    from shard_ray.costmodel.spine import CORRECTION_BOUND
    from shard_ray.workload.tables import task_digest

    calibrated = models.info.calibrated
    if calibrated is not None and calibrated.fitted(task_digest(tables)):
        return []
    names = models.at_correction_bound(tables, batch_size)
    if not names:
        return []
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [
        f"the compute model's learned correction sits at its bound (x{CORRECTION_BOUND:g} or /{CORRECTION_BOUND:g} "
        f"the physical spine's price) for {len(names)} table(s): {shown}; their prices rest on that bound, not on "
        "measurements like them: `shard-ray calibrate` measures them"
    ]


def comm_extrapolation(models: CostModels, num_devices: int) -> list[str]:
    """A line when the models price the all-to-alls of `num_devices` devices from no measurement of them: they have
    no comm model (the links' profile alone prices them), or it never measured gangs of that size."""
    if num_devices == 1:
        return []
    if models.comm is None:
        return [
            f"the models of {models.hardware} have no comm model: this plan's all-to-alls are priced by the links' "
            f"profile alone ({models.links.source}); "
            "`shard-ray calibrate` on a gang of this hardware measures them"
        ]
    measured = models.info.device_counts
    if not measured or num_devices in measured:
        return []
    return [
        f"the comm model's all-to-alls were measured at {', '.join(map(str, measured))} devices, so its prices at "
        f"{num_devices} are extrapolated (the links' price, scaled by what it learned at {max(measured)}); "
        "`calibrate` on a cluster with a core or GPU per device measures them"
    ]


def coverage_problems(models: CostModels, tables: list[TableSpec], shard_tables: int = 1) -> list[str]:
    """One line per table outside the models' training range, and one if shards of `shard_tables` are.

    Models that record no coverage (older model files) give no lines.
    """
    coverage = models.info.coverage
    if coverage is None or coverage.features != list(TABLE_FEATURES):
        return []
    low, high = np.asarray(coverage.low), np.asarray(coverage.high)
    slack = np.array([_slack(name) for name in TABLE_FEATURES])
    every = pieces_features([TablePiece.whole(t) for t in tables], models.rows_cap)  # all at once: 5,136 in 0.02 s
    beyond = (every < low - slack) | (every > high + slack)
    lines = []
    for table, values, outside_at in zip(tables, every, beyond):
        if not outside_at.any():
            continue
        outside = np.flatnonzero(outside_at).tolist()
        # every scalar feature outside, and the first reuse bin outside: one is enough to say the access is new
        shown = [i for i in outside if i < NUM_SCALAR_FEATURES] + [i for i in outside if i >= NUM_SCALAR_FEATURES][:1]
        if shown:
            described = "; ".join(
                _describe(TABLE_FEATURES[i], float(values[i]), float(low[i]), float(high[i])) for i in shown
            )
            lines.append(f"table {table.name}: {described}: outside the cost models' training data")
    if shard_tables > coverage.max_tables:
        lines.append(
            f"devices hold up to {shard_tables} tables; the cost models were trained on shards of up to "
            f"{coverage.max_tables}"
        )
    return lines
