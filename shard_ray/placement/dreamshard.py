"""DreamShard: a trained placement policy places tables one by one on the estimated MDP, whole or split.

The policy (`shard_ray.policy`) was trained with RLlib's PPO on costs the cost models predict;
here it decodes without Ray (`shard_ray.policy.decode`): greedy, plus `samples` sampled plans,
the best by simulated cost kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_ray.errors import ShardRayError
from shard_ray.placement.base import PlacementContext, Placer, register


@dataclass(frozen=True)
class DreamShardConfig:
    policy: str | None = None  # a policy file or `policy train` folder; None: the shipped policy
    samples: int = 0  # plans sampled besides the greedy one; the best by simulated cost is kept

    def check(self) -> None:
        if self.samples < 0:
            raise ShardRayError(f"samples must be 0 or more, got {self.samples}")


@register(
    "dreamshard",
    "rl",
    "DreamShard: a policy network places tables one by one on the cost model's estimated MDP, each whole on a "
    "device or split column-, row- or table-row-wise (the shipped one is its untrained prior, the cost models' greedy "
    "choice: RLlib's PPO has not priced below it yet; `policy train` trains one)",
    settings=DreamShardConfig,
)
def dreamshard(context: PlacementContext) -> Placer:
    from shard_ray.policy.decode import policy_placer
    from shard_ray.policy.policy_file import DecodingScorer, default_policy_path, read_policy

    config: DreamShardConfig = context.settings
    weights, _ = read_policy(config.policy or default_policy_path())
    return policy_placer(
        DecodingScorer(weights.state), context.models, config.samples, context.seed, context.lower_bound
    )
