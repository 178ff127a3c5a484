"""The sweeps' own settings (`tune costmodel`, `tune search`, `tune policy`), apart from the sweeps so that `tune`
reads its flags, answers --help and refuses bad input without importing torch or Ray; what every sweep shares is
`SweepConfig` (`shard_ray.tuning.sweep`)."""

from __future__ import annotations

from dataclasses import dataclass

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError


@dataclass(frozen=True)
class CostModelSweepConfig:
    max_epochs: int = setting(300, "largest epoch budget a trial may draw", min=1)
    report_every: int = setting(10, "epochs between a trial's reports (ASHA's time unit)", min=1)
    grace_reports: int = setting(3, "reports before ASHA may stop a trial", min=1)
    seed: int = 0

    def check(self) -> None:
        for name in ("max_epochs", "report_every", "grace_reports"):
            if getattr(self, name) < 1:
                raise ShardRayError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SearchSweepConfig:
    tasks: int = setting(8, "validation tasks every trial plans", min=1)
    min_tables: int = setting(20, "fewest tables in a validation task", min=1)
    max_tables: int = setting(40, "most tables in a validation task", min=1)
    devices: int = setting(2, "devices of the tasks and the measuring gang", min=1)
    memory_headroom: float = setting(1.5, "memory cap over an even split of a task's bytes", min=1)
    batch_size: int = setting(1024, "global batch size", min=1)
    max_evaluations: int | None = setting(
        None, "model evaluations each plan's search may spend (default: cost_search's own budget)", min=1
    )
    measure_top: int = setting(2, "best simulated settings measured on the gang; 0: none", min=0)
    measure_tasks: int = setting(3, "validation tasks measured", min=1)
    repeats: int = setting(5, "timed steps per plan and round of a measured task's race", min=1)
    seed: int = 0

    def check(self) -> None:
        for name in ("tasks", "min_tables", "max_tables", "devices", "measure_tasks", "repeats", "batch_size"):
            if getattr(self, name) < 1:
                raise ShardRayError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.min_tables > self.max_tables:
            raise ShardRayError("min_tables must not exceed max_tables")
        if self.measure_top < 0:
            raise ShardRayError(f"measure_top must be 0 or more, got {self.measure_top}")
        if not self.memory_headroom >= 1.0:
            raise ShardRayError(f"memory_headroom must be at least 1, got {self.memory_headroom}")
        if self.max_evaluations is not None and self.max_evaluations < 1:
            raise ShardRayError(f"max_evaluations must be at least 1, got {self.max_evaluations}")


# PolicyConfig's fields `tune policy` draws for every trial: not its flags, which the draw would override
POLICY_SWEPT = ("lr", "entropy_coeff", "num_epochs", "clip_param", "lambda_", "minibatch_size", "hidden")


@dataclass(frozen=True)
class PolicySweepConfig:
    grace_iterations: int = setting(3, "iterations before ASHA may stop a trial", min=1)
    validation_tasks: int = setting(
        8, "tasks like training's each trial is scored on, and as many on 2x and on 8x its most devices", min=1
    )

    def check(self) -> None:
        if self.grace_iterations < 1 or self.validation_tasks < 1:
            raise ShardRayError("grace_iterations and validation_tasks must be at least 1")
