"""The devices a plan is for: how many, how much memory each, the batch and the optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shard_ray.workload.tables import TableSpec

Optimizer = Literal["rowwise_adagrad", "sgd", "adam"]
GB = 1024**3


class Topology(BaseModel):
    """`memory_bytes` is each device's cap for embedding weights plus optimizer state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_devices: int = Field(ge=1, le=4096)
    memory_bytes: int = Field(gt=0)
    batch_size: int = Field(default=1024, ge=1)
    optimizer: Optimizer = "rowwise_adagrad"

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB


def shard_bytes(table: TableSpec, width: int, optimizer: Optimizer) -> int:
    """Bytes a column shard of `width` columns takes: weights at their precision plus optimizer state.

    Exact row-wise Adagrad keeps one fp32 per row in every shard; Adam keeps two fp32 moments
    per element; SGD keeps nothing.
    """
    weights = table.rows * width * table.bytes_per_element
    if optimizer == "rowwise_adagrad":
        return weights + table.rows * 4
    if optimizer == "adam":
        return weights + 2 * table.rows * width * 4
    return weights


def memory_cap_with_headroom(
    tables: list[TableSpec], num_devices: int, headroom: float, optimizer: Optimizer = "rowwise_adagrad"
) -> int:
    """A per-device cap `headroom` times an even split of all tables, and never below the largest table."""
    sizes = [shard_bytes(t, t.dim, optimizer) for t in tables]
    return int(max(headroom * sum(sizes) / num_devices, 1.05 * max(sizes))) + 1
