"""The cost models' networks in torch, as training fits them (`shard_ray.costmodel.train`).

Pricing does not import this module: `shard_ray.costmodel.models` runs the same networks in numpy on their weights
(`ComputeModel`, `CommModel`), so that a plan costs no torch import (a second of a plan's 1.3-1.7 s here:
docs/commands.md). What each network computes is described in `shard_ray.costmodel.models`; a test holds the two
forwards to one another.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn

from shard_ray.costmodel.features import COMM_FEATURES, NUM_TABLE_FEATURES, padded_shards
from shard_ray.costmodel.settings import FUSIONS
from shard_ray.costmodel.spine import CORRECTION_BOUND, Spine
from shard_ray.errors import ShardRayError
from shard_ray.plan.piece import TablePiece


def bounded_log_correction(raw: torch.Tensor, bound: torch.Tensor | float = CORRECTION_BOUND) -> torch.Tensor:
    """The network's raw correction outputs as log factors in [-log bound, log bound]."""
    limit = math.log(float(bound))
    return limit * torch.tanh(raw / limit)


def mlp(inputs: int, hidden: int, depth: int, outputs: int | None = None) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = inputs
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    if outputs is not None:
        layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


class Monotone(nn.Module):
    """g: R+^H -> R+^2, non-decreasing in every input; concave with g(0) = softplus(bias) >= 0, or
    convex with g(0) = 0. Non-negative weights keep the curvature and the monotonicity of the
    activation: log-sigmoid is concave and non-decreasing, softplus convex and non-decreasing."""

    def __init__(self, inputs: int, hidden: int, convex: bool, outputs: int = 2) -> None:
        super().__init__()
        self.convex = convex
        self.w1 = nn.Parameter(torch.randn(inputs, hidden) / math.sqrt(inputs) - 1.0)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, outputs) / math.sqrt(hidden) - 1.0)
        if convex:
            # Softplus bends only near its knee and is linear beyond, so a convex term whose units all
            # start past their knees is additive and stays so. Its units start flat for one table's
            # encoding (weights about 1/inputs, encodings about 0.7 each), with knees spread over
            # the sums of about 1 to 25 tables, and small, so that training grows what the data shows.
            with torch.no_grad():
                self.w1.sub_(math.log(inputs))
                self.b1.uniform_(-6.0, -0.3)
                self.w2.sub_(3.0)
        else:
            self.b2 = nn.Parameter(torch.full((outputs,), -2.0))

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        pre = x @ nn.functional.softplus(self.w1) + self.b1
        return nn.functional.softplus(pre) if self.convex else nn.functional.logsigmoid(pre)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rise = (self._inner(x) - self._inner(torch.zeros_like(x))) @ nn.functional.softplus(self.w2)
        return rise if self.convex else rise + nn.functional.softplus(self.b2)

    def switch_off(self) -> None:
        """Make the term (close to) zero everywhere and keep it there through training."""
        with torch.no_grad():
            self.w2.fill_(-40.0)  # softplus(-40) = 4e-18
        self.requires_grad_(False)


class SpineState(nn.Module):
    """The physical spine (`shard_ray.costmodel.spine.Spine`, numpy) as buffers of the compute network, so that it is
    saved and loaded with it (`spine.rates`, ...). No gradient flows into it: its prices are data to the network."""

    def __init__(self) -> None:
        super().__init__()
        for name, value in Spine().state().items():
            self.register_buffer(name, torch.from_numpy(value.copy()))

    def set(self, spine: Spine) -> None:
        """Take `spine`'s rates (a fit's)."""
        for name, value in spine.state().items():
            getattr(self, name).copy_(torch.from_numpy(value))

    def physics(self) -> Spine:
        return Spine.of_state({name: buffer.numpy() for name, buffer in self.named_buffers()})


def _numpy(x: torch.Tensor | float) -> np.ndarray | float:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else x


class ComputeCostNet(nn.Module):
    """Rows of `encode` are [fwd ms, bwd ms, encoding...] per table; `from_sums` prices their sums (the compute
    model of `shard_ray.costmodel.models`, formats 1 to 3, as training fits it)."""

    def __init__(self, hidden: int = 128, depth: int = 2, fusion: str = "free", spine: bool = False) -> None:
        super().__init__()
        if fusion not in FUSIONS:
            raise ShardRayError(f"unknown fusion {fusion!r}; known: {', '.join(FUSIONS)}")
        self.hidden, self.depth, self.fusion = hidden, depth, fusion
        self.encoder = mlp(NUM_TABLE_FEATURES + 1, hidden, depth, outputs=2 if spine else hidden + 2)
        self.interaction = None if spine else Monotone(hidden, hidden, convex=False)  # `shared` in models' docstring
        self.contention = None if spine else Monotone(hidden, hidden, convex=True)
        if fusion == "subadditive" and self.contention is not None:
            self.contention.switch_off()
        self.register_buffer("feature_mean", torch.zeros(NUM_TABLE_FEATURES))
        self.register_buffer("feature_std", torch.ones(NUM_TABLE_FEATURES))
        self.spine = SpineState() if spine else None
        if spine:
            # saved with the model: its network's outputs mean what they meant under the bound it was trained with
            self.register_buffer("correction_bound", torch.tensor(CORRECTION_BOUND))

    def network_outputs(self, features: torch.Tensor, log_batch: torch.Tensor | float) -> torch.Tensor:
        """[..., F] raw table features -> the encoder's raw outputs [..., 2 + H]."""
        normalised = (features - self.feature_mean) / self.feature_std
        batch = torch.as_tensor(log_batch, dtype=normalised.dtype).expand(normalised.shape[:-1]).unsqueeze(-1)
        return self.encoder(torch.cat([normalised, (batch - 10.0) / 2.0], dim=-1))

    def encode(
        self, features: torch.Tensor, log_batch: torch.Tensor | float, replicas: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[..., F] raw table features -> [..., 2 + H], all >= 0: the table's own fwd and bwd ms, then its encoding,
        or with a spine its kernel columns (`ComputeModel.encode`)."""
        out = self.network_outputs(features, log_batch)
        if self.spine is not None:
            spine = torch.from_numpy(
                self.spine.physics()(
                    _numpy(features), _numpy(log_batch), None if replicas is None else _numpy(replicas)
                )
            )
            own_ms = spine[..., :2] * torch.exp(bounded_log_correction(out, self.correction_bound))
            return torch.cat([own_ms, spine[..., 2:]], dim=-1)
        own_ms = torch.exp(out[..., :2].clamp(-15.0, 15.0))
        return torch.cat([own_ms, nn.functional.softplus(out[..., 2:])], dim=-1)

    def without_correction(self) -> ComputeCostNet:
        """A copy that prices by its spine alone: the network's correction 1 for every table (its last layer zeroed,
        so that its raw outputs are 0 and `bounded_log_correction` of them is 0)."""
        if self.spine is None:
            raise ShardRayError("a compute model without a spine has no correction to switch off")
        alone = copy.deepcopy(self)
        with torch.no_grad():
            alone.encoder[-1].weight.zero_()
            alone.encoder[-1].bias.zero_()
        return alone

    def _shard_terms(self, sums: torch.Tensor) -> torch.Tensor:
        """(fwd, bwd) ms [..., 2] beyond the tables' own of shards with summed rows `sums`."""
        if self.spine is not None:  # the kernel columns are the spine's: no gradient reaches them
            return torch.from_numpy(self.spine.physics().shard_ms(sums[..., 2:].detach().numpy()))
        assert self.interaction is not None and self.contention is not None
        encoding = sums[..., 2:]
        return self.interaction(encoding) + self.contention(encoding)

    def from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Log (fwd, bwd) ms of shards from their summed rows [B, 2 + H]."""
        return torch.log(sums[..., :2] + self._shard_terms(sums))

    def forward(
        self, features: torch.Tensor, mask: torch.Tensor, log_batch: torch.Tensor, replicas: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Padded shards [B, T, F] with mask [B, T] (and replica flags [B, T]) -> log (fwd, bwd) ms [B, 2]."""
        rows = self.encode(features, log_batch.unsqueeze(-1), replicas)
        return self.from_sums((rows * mask.unsqueeze(-1)).sum(dim=1))


class CommCostNet(nn.Module):
    def __init__(self, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.hidden, self.depth = hidden, depth
        self.net = mlp(len(COMM_FEATURES), hidden, depth, outputs=2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def fused_shard_tensors(
    shards: list[list[TablePiece]], rows_caps: list[int | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`padded_shards` as tensors, as the compute network trains on them: features [B, T, F], mask [B, T] and replica
    flags [B, T]."""
    features, mask, replicas = padded_shards(shards, rows_caps)
    return torch.from_numpy(features), torch.from_numpy(mask), torch.from_numpy(replicas)
