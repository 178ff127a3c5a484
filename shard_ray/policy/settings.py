"""The policy's training settings (`PolicyConfig`), apart from PPO itself (`shard_ray.policy.ppo`) so that the
commands taking them build their flags, answer --help and refuse bad input without importing torch or Ray."""

from __future__ import annotations

from dataclasses import dataclass

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError


@dataclass(frozen=True)
class PolicyConfig:
    iterations: int = setting(30, "PPO iterations in all", min=1)
    train_batch_size: int = setting(2048, "tables placed per iteration", flag="--train-batch", min=1)
    minibatch_size: int = setting(256, "SGD minibatch", flag="--minibatch", min=1)
    num_epochs: int = 10
    lr: float = setting(1e-3, "Adam learning rate", min=0)
    gamma: float = 1.0  # the return is the plan's cost: no discounting
    lambda_: float = 0.95
    clip_param: float = 0.2
    entropy_coeff: float = 0.001
    vf_loss_coeff: float = 0.5
    hidden: int = setting(128, "network width", min=1)
    num_env_runners: int = setting(0, "RLlib env runner actors; 0 samples in the driver", flag="--env-runners")
    num_learners: int = setting(0, "RLlib learner actors, on GPUs when there are any", flag="--learners")
    min_tables: int = setting(15, "fewest tables in a training task", min=1)
    max_tables: int = setting(25, "most tables in a training task", min=1)
    devices: tuple[int, ...] = setting((4,), "device counts of training tasks, comma-separated", min=1)
    max_devices: int = setting(8, "observations are padded to this many devices", min=1)
    memory_headroom: tuple[float, float] = (1.3, 2.0)
    batch_size: int = setting(1024, "global batch size priced", min=1)
    checkpoint_every: int = setting(5, "save the algorithm and policy.pt every this many iterations", min=1)
    validation_tasks: int = setting(
        8,
        "tasks drawn apart from training's (seed + 1), and as many on 2x and on 8x its most devices, that judge the "
        "network at every save: policy.pt keeps the one that prices them cheapest, the untrained network's prior "
        "among them; 0 keeps the last",
        min=0,
    )
    seed: int = setting(0, "random seed", min=0)

    def check(self) -> None:
        for name in ("iterations", "train_batch_size", "minibatch_size", "num_epochs", "hidden", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ShardRayError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.minibatch_size > self.train_batch_size:
            raise ShardRayError("minibatch_size must not exceed train_batch_size")
        if self.validation_tasks < 0:
            raise ShardRayError(f"validation_tasks must be 0 or more, got {self.validation_tasks}")
        if self.num_env_runners < 0 or self.num_learners < 0:
            raise ShardRayError("env runners and learners must be 0 or more")
        if not 0 < self.lr < 1:
            raise ShardRayError(f"the learning rate must be between 0 and 1, got {self.lr}")
        low, high = self.memory_headroom
        if not 1.0 <= low <= high:
            raise ShardRayError(f"memory headroom must be a range of factors of at least 1, got {self.memory_headroom}")
