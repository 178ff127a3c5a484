"""One device's fused embedding shard: all its tables in fbgemm's table-batched kernel.

`FusedShard` builds `SplitTableBatchedEmbeddingBagsCodegen` modules for a set of tables (one
per weight precision, as TorchRec groups them) and runs the forward and the backward with
the fused optimizer update on batches drawn from the tables' distributions. The profiling
actors time it alone; the device gang runs it inside the full step with the all-to-alls.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from shard_ray.errors import ShardRayError, first_line
from shard_ray.plan.plan import TablePiece
from shard_ray.plan.topology import Optimizer, Topology
from shard_ray.profiling.hardware import measurement_device
from shard_ray.workload.access import fold_rows, generate_table_batch

# On CPU the kernel's cost is set by the rows a batch touches and by cache misses; beyond a
# few hundred thousand rows a table is far out of cache either way, so CPU profiling
# allocates at most this many rows per table and folds indices into them. On GPUs the
# default is to allocate the whole table.
DEFAULT_CPU_MAX_ROWS = 200_000


class MeasureConfig(BaseModel):
    """How a fused shard or a plan is measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(default=1024, ge=1)
    optimizer: Optimizer = "rowwise_adagrad"
    warmup: int = Field(default=3, ge=0)
    repeats: int = Field(default=10, ge=1)
    num_batches: int = Field(default=2, ge=1, description="distinct batches cycled through")
    max_rows: int | None = Field(default=None, ge=1, description="rows allocated per table; None: the CPU default")
    seed: int = 0

    @classmethod
    def for_topology(cls, topology: Topology, **overrides: object) -> MeasureConfig:
        return cls(batch_size=topology.batch_size, optimizer=topology.optimizer, **overrides)

    def rows_cap(self, device: torch.device) -> int | None:
        if self.max_rows is not None:
            return self.max_rows
        return DEFAULT_CPU_MAX_ROWS if device.type == "cpu" else None

    def rows_cap_on(self, hardware: str) -> int | None:
        """The rows cap measurements on `hardware` (a `hardware_id`) were taken with."""
        return self.rows_cap(torch.device("cpu" if hardware.startswith("cpu") else "cuda"))


def content_digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def shard_key(parts: list[TablePiece], config: MeasureConfig, hardware: str) -> str:
    """Key of a measurement: the shard's content (order-free), the settings and the hardware."""
    contents = sorted(content_digest(p.content()) for p in parts)
    return content_digest({"parts": contents, "config": config.model_dump(mode="json"), "hardware": hardware})


def _batch_seed(part: TablePiece, config: MeasureConfig, batch: int) -> int:
    # Same table content -> same batches, so column slices of one table see the same lookups.
    spec = part.table.model_dump(mode="json", exclude={"name", "dim"})
    return int(content_digest([spec, config.seed, batch])[:15], 16)


_OPTIMIZERS = {"rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "sgd": "EXACT_SGD", "adam": "ADAM"}
_PRECISIONS = {"fp32": "FP32", "fp16": "FP16"}


class FusedShard:
    """The fused embedding kernels of one device, with its batches prepared."""

    def __init__(self, parts: list[TablePiece], config: MeasureConfig, device: torch.device | None = None) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.device = device or measurement_device()
        self.config = config
        self.parts = parts
        self.width = sum(p.width for p in parts)
        on_gpu = self.device.type == "cuda"
        if config.optimizer == "adam" and not on_gpu:
            raise ShardRayError("fbgemm's CPU kernels do not support Adam; profile Adam on a GPU")
        location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        cap = config.rows_cap(self.device)
        # One kernel per weight precision; the output columns follow `parts` order.
        self.groups: list[tuple[list[int], torch.nn.Module]] = []
        for precision in ("fp32", "fp16"):
            members = [i for i, p in enumerate(parts) if p.table.precision == precision]
            if not members:
                continue
            specs = [(self._rows(parts[i], cap), parts[i].width, location, compute) for i in members]
            module = SplitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=specs,
                optimizer=getattr(EmbOptimType, _OPTIMIZERS[config.optimizer]),
                learning_rate=0.01,
                weights_precision=getattr(SparseType, _PRECISIONS[precision]),
                output_dtype=SparseType.FP32,
                pooling_mode=PoolingMode.SUM,
                device=self.device,
            )
            self.groups.append((members, module))
        self.batches = [self._make_batch(b, cap) for b in range(config.num_batches)]

    @staticmethod
    def _rows(part: TablePiece, cap: int | None) -> int:
        return part.table.rows if cap is None else min(part.table.rows, cap)

    def _make_batch(self, batch: int, cap: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        inputs = []
        for members, _ in self.groups:
            indices, lengths = [], []
            for i in members:
                part = self.parts[i]
                rng = np.random.default_rng(_batch_seed(part, self.config, batch))
                table_batch = fold_rows(
                    generate_table_batch(part.table, self.config.batch_size, rng), self._rows(part, cap)
                )
                indices.append(table_batch.indices)
                lengths.append(table_batch.lengths)
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
            inputs.append(
                (
                    torch.from_numpy(np.concatenate(indices)).to(self.device),
                    torch.from_numpy(offsets).to(self.device),
                )
            )
        return inputs

    def forward(self, step: int) -> torch.Tensor:
        """Pooled embeddings [batch, width] for the step's batch, columns in `parts` order."""
        batch = self.batches[step % len(self.batches)]
        if not self.groups:
            return torch.zeros(self.config.batch_size, 0, device=self.device, requires_grad=True)
        outputs = [module(indices, offsets) for (_, module), (indices, offsets) in zip(self.groups, batch)]
        if len(outputs) == 1:
            return outputs[0]
        columns = torch.cat(outputs, dim=1)
        order = [i for members, _ in self.groups for i in members]
        starts = np.concatenate([[0], np.cumsum([self.parts[i].width for i in order])])
        position = {part: k for k, part in enumerate(order)}
        return torch.cat(
            [columns[:, starts[position[i]] : starts[position[i] + 1]] for i in range(len(self.parts))], dim=1
        )

    def backward(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward through the kernels, which apply the optimizer update in place."""
        if self.groups:
            output.backward(grad)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class ShardTiming(BaseModel):
    fwd_ms: float
    bwd_ms: float


def time_fused_shard(shard: FusedShard) -> ShardTiming:
    """Median forward and backward ms of a fused shard over `repeats` steps after `warmup`."""
    config = shard.config
    grad = torch.randn(config.batch_size, shard.width, device=shard.device)
    fwd, bwd = [], []
    for step in range(config.warmup + config.repeats):
        shard.synchronize()
        start = time.perf_counter()
        output = shard.forward(step)
        shard.synchronize()
        mid = time.perf_counter()
        shard.backward(output, grad)
        shard.synchronize()
        end = time.perf_counter()
        if step >= config.warmup:
            fwd.append((mid - start) * 1e3)
            bwd.append((end - mid) * 1e3)
    return ShardTiming(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd))


class ShardMeasurement(BaseModel):
    """A measured fused shard, as kept in the store. Infeasible shards carry the reason."""

    key: str
    hardware: str
    tables: list[TablePiece]
    config: MeasureConfig
    status: Literal["ok", "infeasible"] = "ok"
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    reason: str | None = None


def measure_fused_shard(parts: list[TablePiece], config: MeasureConfig, hardware: str) -> ShardMeasurement:
    """Build and time one fused shard; out-of-memory and kernel errors are recorded, not raised."""
    key = shard_key(parts, config, hardware)
    try:
        timing = time_fused_shard(FusedShard(parts, config))
    except (RuntimeError, MemoryError, ShardRayError) as err:
        reason = f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__
        return ShardMeasurement(
            key=key, hardware=hardware, tables=parts, config=config, status="infeasible", reason=reason
        )
    return ShardMeasurement(
        key=key, hardware=hardware, tables=parts, config=config, fwd_ms=timing.fwd_ms, bwd_ms=timing.bwd_ms
    )
