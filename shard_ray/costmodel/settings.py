"""The cost models' training settings (`TrainConfig`), apart from the training itself (`shard_ray.costmodel.train`) so
that the commands taking them build their flags, answer --help and refuse bad input without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError

# What fusion the compute model may learn: "free" (saving or costing, both terms) or "subadditive"
# (the concave term only: fusing never costs more than running apart, and the bound is tighter).
FUSIONS = ("free", "subadditive")
LOSSES = ("mse", "huber", "l1")  # on log ms, so every one is a relative error
FEATURE_SCALINGS = ("standardise", "minmax", "none")  # of the log-scaled table features


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = setting(128, "encoder width", min=1)
    depth: int = setting(2, "encoder layers", min=1)
    fusion: str = setting(
        "free",
        "what fusing tables may do to a shard's compute: 'free' (save or cost, per phase) or 'subadditive' "
        "(never cost more than the tables apart; a tighter lower bound)",
        choices=FUSIONS,
    )
    comm_hidden: int = 64
    comm_depth: int = 2
    lr: float = setting(2e-3, "learning rate", min=0)
    weight_decay: float = 1e-5
    max_epochs: int = setting(400, "most epochs; early stopping usually ends sooner", flag="--epochs", min=1)
    minibatch: int = 64
    patience: int = setting(40, "epochs without validation gain before stopping", min=1)
    loss: str = setting("mse", "loss on log ms", choices=LOSSES)
    feature_scaling: str = setting("standardise", "how features are scaled", choices=FEATURE_SCALINGS)
    seed: int = setting(0, "random seed", min=0)
    no_spine: bool = setting(
        False,
        "train the network alone, without the physical spine it corrects (shard_ray/costmodel/spine.py): "
        "the models before format 3",
    )
    no_step_overhead: bool = setting(
        False,
        "leave each device's step overhead at 0 instead of fitting it to the plans (the shipped models: "
        "docs/cost-models.md says why)",
    )

    def check(self) -> None:
        for name in ("hidden", "depth", "comm_hidden", "comm_depth", "max_epochs", "minibatch", "patience"):
            if getattr(self, name) < 1:
                raise ShardRayError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ShardRayError(f"the learning rate must be between 0 and 1, got {self.lr}")
        if not 0 <= self.weight_decay < 1:
            raise ShardRayError(f"weight_decay must be in [0, 1), got {self.weight_decay}")
        if self.fusion not in FUSIONS:
            raise ShardRayError(f"unknown fusion {self.fusion!r}; known: {', '.join(FUSIONS)}")
        if self.loss not in LOSSES:
            raise ShardRayError(f"unknown loss {self.loss!r}; known: {', '.join(LOSSES)}")
        if self.feature_scaling not in FEATURE_SCALINGS:
            raise ShardRayError(
                f"unknown feature scaling {self.feature_scaling!r}; known: {', '.join(FEATURE_SCALINGS)}"
            )
