"""The one cost definition: a plan costs as much as its slowest device's embedding step.

cost(plan) = max over devices d of fwd_compute(d) + fwd_comm(d) + bwd_comm(d) + bwd_compute(d)
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator


def _without(data: Any, derived: str) -> Any:
    # A dump carries its computed total; reading the dump back recomputes it.
    return {k: v for k, v in data.items() if k != derived} if isinstance(data, dict) else data


class DeviceCost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    fwd_compute_ms: float = Field(ge=0)
    fwd_comm_ms: float = Field(ge=0)
    bwd_comm_ms: float = Field(ge=0)
    bwd_compute_ms: float = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _drop_total(cls, data: Any) -> Any:
        return _without(data, "total_ms")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_ms(self) -> float:
        return self.fwd_compute_ms + self.fwd_comm_ms + self.bwd_comm_ms + self.bwd_compute_ms


class PlanCost(BaseModel):
    """Per-device parts of a plan's step; `cost_ms` is the slowest device's total."""

    model_config = ConfigDict(extra="forbid")

    devices: list[DeviceCost] = Field(min_length=1)
    hardware: str = "unknown"
    batch_size: int | None = None
    warnings: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _drop_cost(cls, data: Any) -> Any:
        return _without(data, "cost_ms")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cost_ms(self) -> float:
        return max(d.total_ms for d in self.devices)

    @property
    def bottleneck_device(self) -> int:
        return max(self.devices, key=lambda d: d.total_ms).device
