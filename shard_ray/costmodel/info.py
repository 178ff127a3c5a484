"""What a cost model file says about its models: what they were trained on, calibrated on and updated with.

The file stores it as a plain mapping (`ModelInfo.to_file`), so a file written before it was typed loads
as it is: every field may be missing, and keys this version does not know are kept, not dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shard_ray.costmodel.links import LinkProfile

# One accuracy figure (`shard_ray.costmodel.train.accuracy`): mape, spearman and n, the first two None without data.
Accuracy = dict[str, float | None]


class Coverage(BaseModel):
    """The training range: each table feature's lowest and highest value over the training pieces, and the most
    tables of a training fused shard (`shard_ray.costmodel.coverage`)."""

    features: list[str]
    low: list[float]
    high: list[float]
    max_tables: int


class Calibrated(BaseModel):
    """What `calibrate` fitted the models to and how they did on its held-out data."""

    model_config = ConfigDict(extra="allow")

    hardware: str
    tables: list[str]
    task: str
    at: str | None = None
    chosen: str
    reason: str
    started_from: dict[str, Any] = {}
    held_out: dict[str, Accuracy] = {}
    fine_tuned: dict[str, Accuracy] | None = None
    shards: dict[str, int] = {}
    plans: dict[str, int] = {}
    measuring_seconds: float | None = None
    seconds: float | None = None
    noise_floor: dict[str, Any] | None = None
    # Tables whose fitted shards were measured with fewer rows than they have (a measuring process's share of memory
    # held no more), with the fewest rows allocated: their measurements, and so the models' fit, are optimistic.
    capped_rows: dict[str, int] = {}

    def fitted(self, task: str) -> bool:
        """Whether the models were fitted to the task of digest `task`: calibrated on it, and the fine-tuned models
        kept (a calibration that kept the starting models fitted nothing)."""
        return self.task == task and self.chosen == "fine-tuned"


class UpdatedOn(BaseModel):
    """The measurements DreamShard's update trained the models further on."""

    hardware: str
    shards: int
    plans: int


class ModelInfo(BaseModel):
    """What the models were trained on (`costmodel train`), then calibrated on or updated with."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    rows_cap: int | None = None
    train_config: dict[str, Any] = {}
    train_tables: list[str] = []
    device_counts: list[int] = []
    batch_sizes: list[int] = []
    num_shards: dict[str, int] = {}
    num_plans: dict[str, int] = {}
    coverage: Coverage | None = None
    held_out: dict[str, Accuracy] | None = None
    # The devices per host of the all-to-alls the comm model was last fit to, when they ran over several hosts
    # (`comm_hosts` in the file, its name before the one name for devices per host).
    comm_devices_per_host: int | None = Field(default=None, alias="comm_hosts")
    calibrated: Calibrated | None = None
    updated_on: UpdatedOn | None = None
    # The link profile `calibrate` fitted to this hardware's measured collectives; None: the published one
    # (`CostModels.links`).
    links: LinkProfile | None = None

    def to_file(self) -> dict[str, Any]:
        """The mapping a model file stores: the fields that are set, and any keys an older or newer version wrote."""
        return self.model_dump(by_alias=True, exclude_unset=True, exclude_none=True)
