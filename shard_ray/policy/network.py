"""The placement policy's network, and the policy file that ships it.

Every option of a step (a candidate device for the piece whole, or a split) is scored by the same
weights from its own row, the current piece and a summary of all options (a masked max and mean
of their embeddings), so one network serves any number of devices and tables. The value reads
the same max and mean reduction.

Scores start from a prior: minus learnable non-negative weights times the option's predicted
increase of the plan's cost and its devices' predicted total with the piece (observation
features). So an untrained policy already takes the cost model's greedy choice, splits
included, and PPO learns what the greedy choice misses (memory left for the tables still to
come, and what they will cost) instead of first rediscovering it. Plain torch: RLlib
wraps it for training (`shard_ray.policy.module`), and placing with a trained policy needs
neither Ray nor RLlib.
"""

from __future__ import annotations

import io
import os

import torch
from torch import nn

from shard_ray.errors import ShardRayError, first_line
from shard_ray.io import write_atomic
from shard_ray.policy.env import NUM_CURRENT_FEATURES, NUM_OPTION_FEATURES
from shard_ray.policy.policy_file import FORMAT, MASKED_LOGIT, PRIOR_FEATURES, PRIOR_INIT, PolicyInfo, read_policy


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


class OptionScorer(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed_option = _mlp(NUM_OPTION_FEATURES + NUM_CURRENT_FEATURES, hidden, hidden)
        self.score = _mlp(3 * hidden, hidden, 1)
        self.value_head = _mlp(2 * hidden, hidden, 1)
        # softplus^-1 of the initial weights, so the weights stay non-negative while learnt
        self.prior_weights = nn.Parameter(torch.log(torch.expm1(torch.tensor(PRIOR_INIT))))

    def embed(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Option embeddings [B, R, H] and their masked max and mean over valid options [B, 2H]."""
        options, table, valid = obs["options"], obs["table"], obs["valid"]
        joined = torch.cat([options, table.unsqueeze(-2).expand(*options.shape[:-1], table.shape[-1])], dim=-1)
        h = self.embed_option(joined)
        v = valid.unsqueeze(-1)
        count = v.sum(dim=-2)
        mean = (h * v).sum(dim=-2) / count.clamp(min=1.0)
        top = torch.where(v > 0, h, torch.full_like(h, -1e9)).max(dim=-2).values
        top = torch.where(count > 0, top, torch.zeros_like(top))
        return h, torch.cat([top, mean], dim=-1)

    def logits(self, obs: dict[str, torch.Tensor], h: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        context = pooled.unsqueeze(-2).expand(*h.shape[:-1], pooled.shape[-1])
        prior = obs["options"][..., PRIOR_FEATURES] @ nn.functional.softplus(self.prior_weights)
        scores = self.score(torch.cat([h, context], dim=-1)).squeeze(-1) - prior
        return torch.where(obs["action_mask"] > 0, scores, torch.full_like(scores, MASKED_LOGIT))

    def value(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.value_head(pooled).squeeze(-1)

    def forward(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked option logits [B, R] and values [B]."""
        h, pooled = self.embed(obs)
        return self.logits(obs, h, pooled), self.value(pooled)


def save_policy(path: str | os.PathLike[str], network: OptionScorer, info: PolicyInfo) -> None:
    buffer = io.BytesIO()
    torch.save(
        {"format": FORMAT, "hidden": network.hidden, "state": network.state_dict(), "info": info.to_file()}, buffer
    )
    write_atomic(path, buffer.getvalue())


def load_policy(path: str | os.PathLike[str]) -> tuple[OptionScorer, PolicyInfo]:
    """A policy file's network, to train further or to score as training does (`read_policy` reads it without torch
    for placing), and what the file says."""
    weights, info = read_policy(path)
    network = OptionScorer(weights.hidden)
    try:
        network.load_state_dict({k: torch.from_numpy(v) for k, v in weights.state.items()})
    except RuntimeError as err:
        raise ShardRayError(f"policy file {weights.path} is damaged: {first_line(err)}") from err
    network.eval()
    return network, info
