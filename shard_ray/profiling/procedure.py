"""How fused shards and plans are measured: the settings and the procedure's number, without the kernels.

The measuring code (`shard_ray.profiling.fused_shard`) needs torch and fbgemm; these records do not, so that
commands parse their flags, and refuse bad ones, without loading either, and a command that has its measuring done
by actors (and the store that keeps what they measured) loads neither itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shard_ray.errors import ShardRayError
from shard_ray.plan.piece import TablePiece
from shard_ray.plan.topology import Optimizer, Topology

# fbgemm's CPU kernels have no Adam: said where a CPU shard is built, and by a command before its CPU devices start
ADAM_ON_CPU = "fbgemm's CPU kernels do not support Adam; profile Adam on a GPU"

# How shards are measured, kept with every measurement and in its key: a change that makes earlier
# measurements incomparable takes the next number, and training uses the newest procedure's.
#   1: on CPU at most 200,000 rows allocated per table, lookups folded into them; the gang ran one set of
#      collectives for every sharding type (until 2026-11);
#   2: whole tables where the measuring process's memory share holds them (`shard_rows_cap`); the gang's
#      collectives once per sharding type, as TorchRec runs them (`TypeCollectives`);
#   3: a histogram table's batches sample the reference batch's traffic, its hot rows the same in every batch
#      (`shard_ray.workload.access.reuse_histogram_indices`; before, every row drawn was looked up at least once
#      and the rows were drawn afresh each batch).
MEASUREMENT_PROCEDURE = 3
PROCEDURE_1_CPU_MAX_ROWS = 200_000
# Batches the warm-up steps cycle through, apart from the timed steps' own.
WARMUP_BATCHES = 2


class MeasureConfig(BaseModel):
    """How a fused shard or a plan is measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(default=1024, ge=1)
    optimizer: Optimizer = "rowwise_adagrad"
    warmup: int = Field(default=3, ge=0)
    repeats: int = Field(default=10, ge=1)
    num_batches: int | None = Field(
        default=None, ge=1, description="distinct batches; None: one per timed step and WARMUP_BATCHES for warm-up"
    )
    max_rows: int | None = Field(
        default=None, ge=1, description="rows allocated per table at most; None: whole tables where memory holds them"
    )
    seed: int = 0

    @model_validator(mode="after")
    def _one_batch_per_timed_step(self) -> MeasureConfig:
        # Training never runs a batch twice: a timed step on a batch the kernel ran a moment before finds its
        # rows in cache, and cycling through 2 batches timed tables optimistically (docs/measurement.md, "A fresh
        # batch for every timed step").
        if self.num_batches is None:
            object.__setattr__(self, "num_batches", self.repeats + WARMUP_BATCHES)
        return self

    def batch_of_step(self, timed: int | None, warmup: int = 0) -> int:
        """The batch a step runs on: timed step `timed` (0, 1, ...) on batch `timed`, each once; warm-up step
        `warmup` (timed None) on the WARMUP_BATCHES after them, in turn; with fewer batches, in a cycle."""
        step = timed if timed is not None else self.repeats + warmup % WARMUP_BATCHES
        return step % self.num_batches

    @classmethod
    def for_topology(cls, topology: Topology, **overrides: object) -> MeasureConfig:
        return cls(batch_size=topology.batch_size, optimizer=topology.optimizer, **overrides)


def content_digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fused_shard_key(pieces: list[TablePiece], config: MeasureConfig, hardware: str) -> str:
    """Key of a measurement: the shard's content (order-free), the settings, the procedure and the hardware."""
    contents = sorted(content_digest(p.content()) for p in pieces)
    return content_digest(
        {
            "parts": contents,
            "config": config.model_dump(mode="json"),
            "hardware": hardware,
            "procedure": MEASUREMENT_PROCEDURE,
        }
    )


def step_estimate(step_ms: Sequence[float]) -> float:
    """One number for a part's timed steps: their minimum, the estimator that repeats best here.

    The same 11 plans measured in two passes, one after the other, on the 2-device gang
    (`experiments/measurement_noise.py`, docs/results.md, "Measurement noise") moved by a median 1.0% with the
    minimum, against 3.3% with a 20%-trimmed mean, 3.4% with the mean and 4.8% with the median: the
    noise on a shared machine only ever adds time, and the minimum is what the kernel costs without it.
    """
    return min(step_ms)


class FusedShardMeasurement(BaseModel):
    """A measured fused shard, as kept in the store. Infeasible shards carry the reason. `rows_cap` is the rows
    allocated per table (None: whole tables), `procedure` the MEASUREMENT_PROCEDURE it was taken by (the store
    reads records from before it was kept as procedure 1: `read_record`)."""

    key: str
    hardware: str
    tables: list[TablePiece]
    config: MeasureConfig
    status: Literal["ok", "infeasible"] = "ok"
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    reason: str | None = None
    procedure: int = MEASUREMENT_PROCEDURE
    rows_cap: int | None = None

    @model_validator(mode="after")
    def _procedure_1_cap(self) -> FusedShardMeasurement:
        # Procedure 1 kept no cap: it was the config's, or on CPU its default.
        if self.procedure == 1 and self.rows_cap is None:
            default = PROCEDURE_1_CPU_MAX_ROWS if self.hardware.startswith("cpu") else None
            object.__setattr__(self, "rows_cap", self.config.max_rows or default)
        return self

    @property
    def modelled_rows_cap(self) -> int | None:
        """The rows cap the cost models' features see for this measurement: the one it was taken with, except that
        a shard capped only because memory could not hold it stands for its whole tables."""
        return self.rows_cap if self.procedure == 1 else self.config.max_rows

    @property
    def compute_ms(self) -> float:
        """Forward + backward ms of a measured shard."""
        if self.fwd_ms is None or self.bwd_ms is None:
            raise ShardRayError(f"a shard of {len(self.tables)} tables could not be measured: {self.reason}")
        return self.fwd_ms + self.bwd_ms
