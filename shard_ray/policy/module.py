"""The RLlib face of the placement network: a TorchRLModule with a value function for PPO.

Action masking happens inside `OptionScorer.logits` (finite masked logits, so a terminal
observation with no valid device gives no NaN); the module only hands RLlib the logits, and
the pooled device summary as the embeddings the value function reuses in training.
"""

from __future__ import annotations

from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from shard_ray.policy.network import OptionScorer


class DevicePolicyModule(TorchRLModule, ValueFunctionAPI):
    """model_config: {"hidden": int}."""

    def setup(self) -> None:
        self.network = OptionScorer(hidden=int(self.model_config.get("hidden", 128)))

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        obs = batch[Columns.OBS]
        h, pooled = self.network.embed(obs)
        return {Columns.ACTION_DIST_INPUTS: self.network.logits(obs, h, pooled)}

    def _forward_train(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        obs = batch[Columns.OBS]
        h, pooled = self.network.embed(obs)
        return {Columns.ACTION_DIST_INPUTS: self.network.logits(obs, h, pooled), Columns.EMBEDDINGS: pooled}

    def compute_values(self, batch: dict[str, Any], embeddings: torch.Tensor | None = None) -> torch.Tensor:
        if embeddings is None:
            _, embeddings = self.network.embed(batch[Columns.OBS])
        return self.network.value(embeddings)
