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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from shard_ray.errors import ShardRayError, first_line
from shard_ray.io import read_torch_file, write_atomic
from shard_ray.policy.env import NUM_CURRENT_FEATURES, NUM_OPTION_FEATURES, OPTION_FEATURES

FORMAT = "shard-ray-policy/2"
# Policies of format 1 scored devices only, from fewer features: their weights do not fit this network.
UNSPLIT_FORMAT = "shard-ray-policy/1"
PRETRAINED_DIR = Path(__file__).parent / "pretrained"
DEFAULT_PRETRAINED = "cpu-reference.pt"
# A masked logit: finite, so an all-masked row (a terminal observation) gives no NaN.
MASKED_LOGIT = -1e9
PRIOR_FEATURES = [OPTION_FEATURES.index("makespan_increase"), OPTION_FEATURES.index("total_with_table")]
# Initial prior weights: a 0.1 x lower-bound increase of the plan's cost is 5 logits.
PRIOR_INIT = (50.0, 5.0)


def default_policy_path() -> Path:
    """The policy shipped with the package, trained against the shipped CPU cost models."""
    return PRETRAINED_DIR / DEFAULT_PRETRAINED


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


class DecodingScorer:
    """`OptionScorer`'s option logits in numpy on its weights as they are, for placing a task: a step scores about
    20 rows, where torch's dispatch and the value head, which placing does not need, took most of the time
    (docs/policy.md). Training keeps the torch network; these logits agree with its to float32 rounding."""

    def __init__(self, network: OptionScorer) -> None:
        self.embed = _numpy_layers(network.embed_option)
        self.score = _numpy_layers(network.score)
        self.prior = nn.functional.softplus(network.prior_weights).detach().numpy()

    def logits(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """Masked option logits [..., R] of an observation (`PlacementState.observation`), or of several stacked
        (`PlacementState.observe_wave`), as `OptionScorer.forward`."""
        options, table, valid = obs["options"], obs["table"], obs["valid"] > 0
        joined = np.concatenate(
            [options, np.broadcast_to(table[..., None, :], (*options.shape[:-1], table.shape[-1]))], axis=-1
        )
        h = _run_layers(joined, self.embed)
        count = valid.sum(axis=-1, keepdims=True)
        top = np.where(count > 0, np.where(valid[..., None], h, -np.inf).max(axis=-2), 0.0)
        mean = (h * valid[..., None]).sum(axis=-2) / np.maximum(count, 1)
        pooled = np.concatenate([top, mean], axis=-1).astype(h.dtype)
        context = np.broadcast_to(pooled[..., None, :], (*h.shape[:-1], pooled.shape[-1]))
        scores = _run_layers(np.concatenate([h, context], axis=-1), self.score)[..., 0]
        scores = scores - options[..., PRIOR_FEATURES] @ self.prior
        return np.where(obs["action_mask"] > 0, scores, np.float32(MASKED_LOGIT))


def _numpy_layers(mlp: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    """`_mlp`'s linear layers as (weight transposed, bias), views on the parameters (tanh between them)."""
    return [(m.weight.detach().numpy().T, m.bias.detach().numpy()) for m in mlp if isinstance(m, nn.Linear)]


def _run_layers(rows: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """`rows` [..., F] through the layers, stacked rows as one matrix: numpy multiplies a stack [K, R, F] matrix by
    matrix, a wave's 32 observations of 16 options (`PlacementState.observe_wave`) at 2.2 ms against 1.1 as one."""
    shape = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1])
    for k, (weight, bias) in enumerate(layers):
        rows = rows @ weight + bias
        if k < len(layers) - 1:
            rows = np.tanh(rows)
    return rows.reshape(*shape, rows.shape[-1])


class PolicyInfo(BaseModel):
    """What a policy file says about its policy: the models it was trained against, its settings, how far it got.

    The file stores it as a plain mapping (`to_file`), so a file written before it was typed loads as it is:
    every field may be missing, and keys this version does not know are kept, not dropped."""

    model_config = ConfigDict(extra="allow")

    cost_model: str | None = None  # the models' file it was trained against, or shipped:NAME
    hardware: str | None = None  # those models' hardware
    config: dict[str, Any] = {}  # the PolicyConfig it was trained with (`shard_ray.policy.ppo`)
    pool_tables: int | None = None  # tables of the pool its episodes were drawn from
    loop: dict[str, Any] = {}  # the outer loop's settings, for a policy `policy outer-loop` trained
    iterations: int | None = None  # PPO iterations done
    # The held-out check that chose the network the file holds (`shard_ray.policy.ppo.HeldOut.record`): how many
    # tasks and their seed, the iteration training started from and its score, the kept network's score and iteration.
    validation: dict[str, Any] = {}

    def to_file(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True, exclude_none=True)

    def network_kept(self) -> str:
        """Which network the file holds, as training's held-out check chose it (empty where the file says nothing)."""
        done = f"{self.iterations} PPO iterations" if self.iterations else ""
        record = self.validation
        if not record or "iteration" not in record:
            return done
        if record["iteration"] == record.get("start", 0):
            start = (
                "the untrained network" if record["iteration"] == 0 else f"iteration {record['iteration']}'s network"
            )
            return f"{start}, which its held-out check kept over {done or 'training'} (none priced its tasks lower)"
        gain = 1 - record["score"] / record["prior"]
        return (
            f"iteration {record['iteration']} of {done or 'training'}, {gain:.2%} below its start on its held-out tasks"
        )


def save_policy(path: str | os.PathLike[str], network: OptionScorer, info: PolicyInfo) -> None:
    buffer = io.BytesIO()
    torch.save(
        {"format": FORMAT, "hidden": network.hidden, "state": network.state_dict(), "info": info.to_file()}, buffer
    )
    write_atomic(path, buffer.getvalue())


def load_policy(path: str | os.PathLike[str]) -> tuple[OptionScorer, PolicyInfo]:
    """A policy file, or a `policy train` output folder holding `policy.pt`."""
    path = Path(path)
    if path.is_dir():
        path = path / "policy.pt"
    if not path.is_file():
        raise ShardRayError(f"policy file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ShardRayError(f"cannot read policy file {path}: {first_line(err)}") from err
    written_by = "`policy train` writes policy.pt"
    blob = read_torch_file(data, str(path), "policy", "a shard-ray policy", FORMAT, written_by, UNSPLIT_FORMAT)
    if blob["format"] == UNSPLIT_FORMAT:
        raise ShardRayError(
            f"policy file {path} is of an earlier release ({UNSPLIT_FORMAT}: it places tables whole only); train one "
            "for this release with `shard-ray policy train`, or leave --policy out for the shipped one"
        )
    try:
        network = OptionScorer(blob["hidden"])
        network.load_state_dict({k: torch.from_numpy(v) for k, v in blob["state"].items()})
        info = PolicyInfo.model_validate(blob.get("info", {}))
    except (KeyError, RuntimeError, TypeError, AttributeError, ValidationError) as err:
        raise ShardRayError(f"policy file {path} is damaged: {first_line(err)}") from err
    network.eval()
    return network, info
