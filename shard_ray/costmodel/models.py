"""Neural cost models of fused compute and all-to-all communication, and their file format.

Compute (format 3): the physical spine (`shard_ray.costmodel.spine`) prices each table from what
the kernel moves and does, and a per-table network on the shared log-scaled features and the batch
size corrects it by a factor bounded to [1/2, 2]; a shard S costs, per phase,

    sum of c_t over S  +  kernels and pairs of S,     c_t = spine_t x correction_t

where the kernels and pairs (a fixed cost per weight precision present, and each kernel's tables x
their output MB) are sums of per-table columns too. Every term is non-negative and non-decreasing,
so the predicted cost never drops when a table is added (monotone), which the exact search's
pruning relies on, and a table far from the training data is priced by physics within the bound.

Compute (formats 1 and 2, the network alone): the network gives each table its own ms c_t >= 0 and
an encoding e_t >= 0; a shard costs `sum c_t + shared(E) + contention(E)`, E = sum of e_t, with
both terms non-decreasing in every coordinate of E (non-negative weights, monotone activations):
`shared` is concave with shared(0) >= 0, the fixed cost of a kernel and what fused tables save
together (subadditive); `contention` is convex with contention(0) = 0, what fused tables cost each
other beyond running apart (superadditive). The lower bound (`shard_ray.costmodel.bounds`) uses the
two curvatures: the concave term over devices adds up to at least its value at the sum, the convex
term to at least D times its value at the mean.

Either way sums make the model permutation-invariant, able to take any number of tables, and cheap
to search with: a device's running sum plus one table's row prices the device with it.

Communication: per device, an MLP over what its all-to-alls move (its own width, the total and
largest widths, batch size, device count) predicting log forward and log backward all-to-all
ms; any number of devices.

Both train on log ms, so the loss is relative error, not raw-ms MSE dominated by big shards.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from shard_ray.costmodel.features import NUM_TABLE_FEATURES, batch_context, pieces_features
from shard_ray.costmodel.info import ModelInfo
from shard_ray.costmodel.links import LinkProfile, link_profile
from shard_ray.costmodel.settings import FUSIONS
from shard_ray.costmodel.spine import Spine
from shard_ray.errors import ShardRayError, describe_validation_error, first_line
from shard_ray.io import read_torch_file, shard_ray_home, write_atomic
from shard_ray.plan.piece import TablePiece
from shard_ray.workload.tables import TableSpec

FORMAT = "shard-ray-costmodels/3"
# Files of the second format have no physical spine: the network prices tables alone.
FREE_FORMAT = "shard-ray-costmodels/2"
# Files of the first format have no `contention` term: they load as subadditive models.
SUBADDITIVE_FORMAT = "shard-ray-costmodels/1"
PRETRAINED_DIR = Path(__file__).parent / "pretrained"
DEFAULT_PRETRAINED = "cpu-reference.pt"


def default_cost_model_path() -> Path:
    """The models shipped with the package, trained on the reference 2-core CPU machine."""
    return PRETRAINED_DIR / DEFAULT_PRETRAINED


def hardware_file_name(hardware: str) -> str:
    """A hardware id as a file name: `cuda:NVIDIA H200` -> `cuda-NVIDIA-H200`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", hardware).strip("-")


# An unmeasured GPU is priced by a measured GPU's models, not the CPU's: the H100's priced the H200's shards at 17.6%
# MAPE, the H200's the H100's at 24.8%, the reference CPU's either at 1465-2007% (docs/gpu.md).
OTHER_GPU_PRETRAINED = "cuda-NVIDIA-H100-80GB-HBM3.pt"


def shipped_models_path(hardware: str | None) -> Path:
    """The shipped models for `hardware`: those trained on it where the package has them (`pretrained/` holds an
    NVIDIA H200's and an H100's, compute only: docs/gpu.md), else, on another GPU, the H100's, else the reference
    CPU's."""
    if hardware is not None:
        path = PRETRAINED_DIR / (hardware_file_name(hardware) + ".pt")
        if path.is_file():
            return path
        if hardware.startswith("cuda:"):
            return PRETRAINED_DIR / OTHER_GPU_PRETRAINED
    return default_cost_model_path()


def models_home() -> Path:
    """Where `calibrate` keeps models per hardware: $SHARD_RAY_HOME/models, else ~/.shard-ray/models."""
    return shard_ray_home() / "models"


def task_digest(tables: list[TableSpec]) -> str:
    """Which tables models were calibrated on: a digest of their specs, whatever their order."""
    specs = sorted(json.dumps(t.model_dump(mode="json"), sort_keys=True) for t in tables)
    return hashlib.sha256(json.dumps(specs).encode()).hexdigest()[:12]


def hardware_models_path(
    hardware: str, devices_per_host: int | None = None, tables: list[TableSpec] | None = None
) -> Path:
    """The model file of `hardware` (a hardware id such as `cpu:AMD EPYC:1thread`) in `models_home()`;
    models calibrated over hosts of `devices_per_host` devices have their own, and so do models
    calibrated on `tables` (`-tables-DIGEST`), so that a calibration on one task does not reprice others."""
    name = hardware_file_name(hardware)
    hosts = f"-hosts-of-{devices_per_host}" if devices_per_host else ""
    task = f"-tables-{task_digest(tables)}" if tables else ""
    return models_home() / (name + hosts + task + ".pt")


def models_for(
    hardware: str | None, devices_per_host: int | None = None, tables: list[TableSpec] | None = None
) -> Path:
    """The models to plan for `hardware` with: those calibrated for it on these `tables` (over hosts of
    `devices_per_host`, then on one host), else its hardware-wide ones (likewise), else the shipped ones for it
    (`shipped_models_path`)."""
    if hardware is not None:
        for task in ([tables] if tables else []) + [None]:
            for hosts in dict.fromkeys((devices_per_host, None)):
                path = hardware_models_path(hardware, hosts, task)
                if path.is_file():
                    return path
    return shipped_models_path(hardware)


def describe_models(
    path: str | os.PathLike[str], models: CostModels, tables: list[TableSpec]
) -> tuple[str, str | None]:
    """Where the prices come from, one line: the model file, its hardware and what it was calibrated
    on; and a warning when that was other tables than `tables` (None otherwise)."""
    calibrated = models.info.calibrated
    if calibrated is None:
        shipped = "the shipped models " if Path(path).parent == PRETRAINED_DIR else ""
        return f"priced by {shipped}{path} (models of {models.hardware}, not calibrated on a task)", None
    names = calibrated.tables
    when = f" on {calibrated.at}" if calibrated.at else ""
    if calibrated.fitted(task_digest(tables)):
        return f"priced by {path}: models of {models.hardware}, calibrated on these {len(names)} tables{when}", None
    if calibrated.task == task_digest(tables):  # the calibration kept the models it started from
        return (
            f"priced by {path}: models of {models.hardware}, unchanged by a calibration on these {len(names)} tables"
            f"{when} that kept the models it started from (`shard-ray models` says why)"
        ), None
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    line = f"priced by {path}: models of {models.hardware}, calibrated on other tables ({len(names)}: {shown}){when}"
    warning = (
        f"the cost models were calibrated on other tables than these ({len(names)}: {shown}); "
        "`shard-ray calibrate --tables` with this table file fits models to them"
    )
    return line, warning


COMM_FEATURES = ("log2_width", "log2_total_width", "log2_max_width", "log2_batch", "log2_devices", "share")


# A spine model's learned correction multiplies a table's spine price by at most this factor, or divides it by
# at most this: the bound is where physics takes over from a network extrapolating beyond its data.
CORRECTION_BOUND = 2.0
# A correction this close to its bound (in log ratio: within 1.4% of the factor 2) is "at the bound": the price rests
# on the bound, not on what the network learned.
AT_BOUND = 0.98


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


class ComputeCostNet(nn.Module):
    """Rows of `encode` are [fwd ms, bwd ms, encoding...] per table; `from_sums` prices their sums.

    With a `spine` (`shard_ray.costmodel.spine`, format 3), a table's own ms are the spine's times a
    correction the network learns, bounded to [1/CORRECTION_BOUND, CORRECTION_BOUND], and a shard's
    fusion is the spine's (its kernels and pairs), so a shard's price is within that factor of the
    spine's physics, whatever the network does far from its data: rows are [fwd ms, bwd ms, the
    spine's kernel columns]. Without one (formats 1 and 2), the network prices tables alone, unbounded,
    and learns the fusion terms `shared` and `contention` over encodings: rows are [fwd ms, bwd ms,
    encoding...]. (With a spine and the learned fusion terms both, the network moved every table's
    own cost to its lower bound and the rest into the unbounded fusion terms: the bound held nothing.)
    """

    def __init__(self, hidden: int = 128, depth: int = 2, fusion: str = "free", spine: bool = False) -> None:
        super().__init__()
        if fusion not in FUSIONS:
            raise ShardRayError(f"unknown fusion {fusion!r}; known: {', '.join(FUSIONS)}")
        self.hidden, self.depth, self.fusion = hidden, depth, fusion
        self.encoder = mlp(NUM_TABLE_FEATURES + 1, hidden, depth, outputs=2 if spine else hidden + 2)
        self.interaction = None if spine else Monotone(hidden, hidden, convex=False)  # `shared` in the docstring
        self.contention = None if spine else Monotone(hidden, hidden, convex=True)
        if fusion == "subadditive" and self.contention is not None:
            self.contention.switch_off()
        self.register_buffer("feature_mean", torch.zeros(NUM_TABLE_FEATURES))
        self.register_buffer("feature_std", torch.ones(NUM_TABLE_FEATURES))
        self.spine = Spine().requires_grad_(False) if spine else None
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
        or with a spine its `kernel_columns`, whose sums over a shard price the shard's kernels (`replicas` [...]:
        the data-parallel replicas, whose kernels are apart; the network without a spine does not tell them)."""
        out = self.network_outputs(features, log_batch)
        if self.spine is not None:
            spine = self.spine(features, log_batch, replicas)
            own_ms = spine[..., :2] * torch.exp(bounded_log_correction(out, self.correction_bound))
            return torch.cat([own_ms, spine[..., 2:]], dim=-1)
        # A table's own ms span five orders of magnitude (a 4-dim one-hot table to a 1024-dim bag of
        # hundreds at batch 2048) and scale multiplicatively with dim, lookups and batch: the network
        # gives their logs. The clamp keeps exp finite (e^15 ms is hours) before training has settled.
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

    def correction_at_bound(self, features: torch.Tensor, log_batch: torch.Tensor | float) -> torch.Tensor:
        """[..., F] -> [...] bools: tables whose learned correction sits at its bound in either phase, so that
        their price rests on the bound rather than on what the network learned (all False without a spine)."""
        if self.spine is None:
            return torch.zeros(features.shape[:-1], dtype=torch.bool)
        log_factor = bounded_log_correction(self.network_outputs(features, log_batch), self.correction_bound)
        return (log_factor.abs() >= AT_BOUND * math.log(float(self.correction_bound))).any(dim=-1)

    def _shard_terms(self, sums: torch.Tensor, devices: int = 1) -> torch.Tensor:
        """(fwd, bwd) ms [..., 2] beyond the tables' own of shards with summed rows `sums`; over `devices` shards,
        the least they add up to (`least_total`)."""
        if self.spine is not None:
            return self.spine.shard_ms(sums[..., 2:], devices)
        assert self.interaction is not None and self.contention is not None
        encoding = sums[..., 2:]
        return self.interaction(encoding) + devices * self.contention(encoding / devices)

    def from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Log (fwd, bwd) ms of shards from their summed rows [B, 2 + H]."""
        return torch.log(sums[..., :2] + self._shard_terms(sums))

    def least_total(self, sums: torch.Tensor, devices: int) -> torch.Tensor:
        """A lower bound on the total (fwd, bwd) ms [..., 2] of `devices` shards whose rows add up to
        at least `sums` [..., 2 + H]: own ms add; the concave term over the non-empty shards adds up
        to at least its value at the sum (subadditive, as it is >= 0 at 0); the convex term, 0 at 0,
        to at least `devices` times its value at the mean (Jensen); with a spine, at least one shard pays a
        kernel, and every table its own output's pair (`Spine.shard_ms`); all terms are monotone."""
        return sums[..., :2] + self._shard_terms(sums, devices)

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


def comm_feature_rows(
    width: np.ndarray, total: np.ndarray | float, max_width: np.ndarray | float, batch_size: int, devices: int
) -> np.ndarray:
    """[..., n, len(COMM_FEATURES)] for devices of `width` [..., n] columns in plans of `total` columns (per plan:
    [..., 1] or a number), the widest `max_width`."""
    width = np.asarray(width, dtype=np.float64)
    total = np.broadcast_to(np.asarray(total, dtype=np.float64), width.shape)
    # filled column by column: a search builds these thousands of times
    rows = np.empty((*width.shape, len(COMM_FEATURES)))
    rows[..., 0] = np.log2(1.0 + width)
    rows[..., 1] = np.log2(1.0 + total)
    rows[..., 2] = np.log2(1.0 + np.asarray(max_width, dtype=np.float64))
    rows[..., 3] = batch_context(batch_size)
    rows[..., 4] = math.log2(devices)
    rows[..., 5] = np.divide(width, total, out=np.zeros(width.shape), where=total > 0)
    return rows.astype(np.float32)


def comm_features(widths: list[int] | np.ndarray, batch_size: int) -> np.ndarray:
    """[D, len(COMM_FEATURES)] for per-device widths (dim sums) of one plan."""
    widths = np.asarray(widths, dtype=np.float64)
    return comm_feature_rows(widths, float(widths.sum()), float(widths.max()), batch_size, len(widths))


def pad_fused_shards(shards: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [n_i, F] shard features into [B, T, F] with a [B, T] mask."""
    longest = max(1, max(len(s) for s in shards))
    features = np.zeros((len(shards), longest, NUM_TABLE_FEATURES), dtype=np.float32)
    mask = np.zeros((len(shards), longest), dtype=np.float32)
    for i, s in enumerate(shards):
        features[i, : len(s)] = s
        mask[i, : len(s)] = 1.0
    return torch.from_numpy(features), torch.from_numpy(mask)


def fused_shard_tensors(
    shards: list[list[TablePiece]], rows_caps: list[int | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shards of pieces, each with the rows per table its measurement allocated at most, as the compute model takes
    them: features [B, T, F], mask [B, T] and replica flags [B, T]."""
    features, mask = pad_fused_shards([pieces_features(s, cap) for s, cap in zip(shards, rows_caps, strict=True)])
    replicas = torch.zeros_like(mask)
    for i, shard in enumerate(shards):
        replicas[i, : len(shard)] = torch.tensor([float(p.replicated) for p in shard])
    return features, mask, replicas


@dataclass
class CostModels:
    """The pair of models for one kind of hardware, with what they were trained on."""

    compute: ComputeCostNet
    comm: CommCostNet | None
    hardware: str
    info: ModelInfo = field(default_factory=ModelInfo)
    # Each device's (forward, backward) ms in a measured step beyond its fused kernels as the profiler times them
    # alone (the input's index shuffles, the output's assembly, caches the all-to-alls cleared): fitted to the
    # gang's per-device compute (`shard_ray.costmodel.train.fit_step_overhead`), added to every device that holds
    # a piece.
    step_overhead_ms: tuple[float, float] = (0.0, 0.0)
    # Each device's ms in an input all-to-all beyond its price as one all-to-all of its bytes, per sharding type: the
    # gang runs three (split sizes, lengths, ids) and reassembles the lookups, where the comm model learned the
    # pooled output's one (`shard_ray.costmodel.train.fit_input_overhead`).
    input_overhead_ms: float = 0.0
    # Each device's (input, forward, backward) all-to-all ms for each set of collectives beyond a plan's first, beyond
    # their bytes' price: a plan of several sharding types runs one set of all-to-alls for each, and each set assembles
    # its own buffers (`TypeCollectives`), where the comm model learned plans of one set
    # (`shard_ray.costmodel.train.fit_type_overhead`).
    type_overhead_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # The data-parallel replicas' gradient all-reduce on each device holding replicas: (ms for taking part, ms per MB
    # of gradient on the ring's bus, 2(D-1)/D of the device's replicas' MB), fitted to what the gang measured in the
    # backward collectives beyond the all-to-alls' price (`shard_ray.costmodel.train.fit_all_reduce`). (0, 0): none
    # fitted, the comm model prices it as the all-to-all moving as many bytes (`shard_ray.costmodel.pricing.sync_width`).
    all_reduce_ms: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        self.compute.eval()
        if self.comm is not None:
            self.comm.eval()

    @property
    def rows_cap(self) -> int | None:
        """Rows per table the training measurements allocated (None: whole tables)."""
        return self.info.rows_cap

    @torch.no_grad()
    def predict_fused_shards(self, shards: list[list[TablePiece]], batch_size: int) -> np.ndarray:
        """Predicted (fwd, bwd) ms [n, 2] of fused shards of table pieces; empty shards cost 0."""
        features, mask, replicas = fused_shard_tensors(shards, [self.rows_cap] * len(shards))
        log_batch = torch.full((len(shards),), batch_context(batch_size))
        ms = torch.exp(self.compute(features, mask, log_batch, replicas)).numpy()
        ms[mask.sum(dim=1).numpy() == 0] = 0.0
        return ms

    @torch.no_grad()
    def at_correction_bound(self, tables: list[TableSpec], batch_size: int) -> list[str]:
        """The names of `tables` (whole) whose learned correction sits at its bound at `batch_size`."""
        if not tables:
            return []
        features = torch.from_numpy(pieces_features([TablePiece.whole(t) for t in tables], self.rows_cap))
        flags = self.compute.correction_at_bound(features, batch_context(batch_size))
        return [t.name for t, at_bound in zip(tables, flags.tolist()) if at_bound]

    def encode_tables(self, pieces: list[TablePiece], batch_size: int) -> torch.Tensor:
        return self.encode_features(pieces_features(pieces, self.rows_cap), pieces, batch_size)

    @torch.no_grad()
    def encode_features(self, features: np.ndarray, pieces: list[TablePiece], batch_size: int) -> torch.Tensor:
        """`encode_tables` of pieces whose `pieces_features` are at hand."""
        replicas = torch.tensor([float(p.replicated) for p in pieces])
        return self.compute.encode(torch.from_numpy(features), batch_context(batch_size), replicas)

    @torch.no_grad()
    def compute_from_sums(self, sums: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
        """Predicted (fwd, bwd) ms [B, 2] of devices in a step given by their shards' summed rows: the fused kernels
        and the step's overhead (`step_overhead_ms`); zero where count is 0."""
        ms = torch.exp(self.compute.from_sums(sums)).numpy() + np.asarray(self.step_overhead_ms)
        ms[counts.numpy() == 0] = 0.0
        return ms

    @torch.no_grad()
    def least_compute(self, sums: torch.Tensor, devices: int) -> float:
        """A lower bound on the step compute ms (forward + backward) of the slowest of `devices` devices whose
        shards' summed rows are at least `sums` [2 + H]: a 1/`devices` share of the least their fused kernels add
        up to (see `ComputeCostNet.least_total`) and the step's overhead (the device with the costliest kernels
        holds a piece)."""
        return float(self.compute.least_total(sums, devices).sum()) / devices + sum(self.step_overhead_ms)

    @property
    def links(self) -> LinkProfile:
        """The link profile that prices these models' collectives from below (`shard_ray.costmodel.links`): the one
        `calibrate` fitted to the hardware, else the published one of the models' hardware."""
        return self.info.links or link_profile(self.hardware)

    def comm_ms(self, features: np.ndarray | torch.Tensor) -> np.ndarray:
        """Predicted (fwd, bwd) all-to-all ms [..., n, 2] of devices given by comm feature rows [..., n, F]; zeros
        without a comm model. The network runs in numpy on its weights as they are: a search or the policy prices a
        few rows thousands of times, where torch's dispatch cost most of the call (docs/results.md, placing at
        scale). Stacked rows (several plans' devices) are priced stack by stack, as numpy's matmul multiplies them:
        a row's low bits change with the rows beside it in one product, and a plan priced among others is priced as
        it is alone."""
        if self.comm is None:
            return np.zeros((*np.shape(features)[:-1], 2))
        rows = np.asarray(features, dtype=np.float32)
        for layer in self._comm_layers:
            rows = np.maximum(rows, 0.0) if layer is None else rows @ layer[0] + layer[1]
        return np.exp(rows)

    @cached_property
    def _comm_layers(self) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """The comm network's layers as `comm_ms` runs them: (weight transposed, bias) of a linear layer, None for a
        ReLU. Views on the parameters' storage, taken once: a search calls `comm_ms` thousands of times."""
        assert self.comm is not None
        layers: list[tuple[np.ndarray, np.ndarray] | None] = []
        for layer in self.comm.net:  # `mlp`'s layers
            if isinstance(layer, nn.Linear):
                layers.append((layer.weight.detach().numpy().T, layer.bias.detach().numpy()))
            elif isinstance(layer, nn.ReLU):
                layers.append(None)
            else:
                raise TypeError(f"the comm model's numpy forward has no {type(layer).__name__}")
        return layers

    @property
    def comm_devices_per_host(self) -> int | None:
        """The devices per host of the all-to-alls the comm model was fit to, when they ran over several
        hosts (`calibrate --devices-per-host`): it then prices their inter-host traffic itself."""
        return self.info.comm_devices_per_host

    def predict_comm(self, widths: list[int] | np.ndarray, batch_size: int) -> np.ndarray:
        """Predicted (fwd, bwd) all-to-all ms [D, 2] for per-device widths of one plan; zeros on one device."""
        if len(widths) == 1:
            return np.zeros((1, 2))
        return self.comm_ms(comm_features(widths, batch_size))

    def save(self, path: str | os.PathLike[str]) -> None:
        buffer = io.BytesIO()
        torch.save(
            {
                "format": FORMAT,
                "hardware": self.hardware,
                "compute": {
                    "hidden": self.compute.hidden,
                    "depth": self.compute.depth,
                    "fusion": self.compute.fusion,
                    "spine": self.compute.spine is not None,
                    "state": self.compute.state_dict(),
                },
                "comm": None
                if self.comm is None
                else {"hidden": self.comm.hidden, "depth": self.comm.depth, "state": self.comm.state_dict()},
                "info": self.info.to_file(),
                "step_overhead_ms": list(self.step_overhead_ms),
                "input_overhead_ms": self.input_overhead_ms,
                "type_overhead_ms": list(self.type_overhead_ms),
                "all_reduce_ms": list(self.all_reduce_ms),
            },
            buffer,
        )
        write_atomic(path, buffer.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModels:
        if not os.path.isfile(path):
            raise ShardRayError(f"cost model file not found: {path}")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            raise ShardRayError(f"cannot read cost model file {path}: {first_line(err)}") from err
        return cls.from_bytes(data, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "cost model bytes") -> CostModels:
        """Models from a model file's content (`source` names it in errors)."""
        blob = read_torch_file(
            data,
            source,
            "cost model",
            "shard-ray cost models",
            FORMAT,
            "`costmodel train` writes",
            FREE_FORMAT,
            SUBADDITIVE_FORMAT,
        )
        try:
            old = blob["format"] == SUBADDITIVE_FORMAT
            fusion = "subadditive" if old else blob["compute"]["fusion"]
            spine = blob["format"] == FORMAT and blob["compute"]["spine"]
            compute = ComputeCostNet(blob["compute"]["hidden"], blob["compute"]["depth"], fusion, spine)
            state = blob["compute"]["state"]
            if old:
                state = {**{f"contention.{k}": v for k, v in compute.contention.state_dict().items()}, **state}
            compute.load_state_dict(state)
            comm = None
            if blob["comm"] is not None:
                comm = CommCostNet(blob["comm"]["hidden"], blob["comm"]["depth"])
                comm.load_state_dict(blob["comm"]["state"])
        except (KeyError, RuntimeError, TypeError) as err:
            raise ShardRayError(f"cost model file {source} is damaged: {first_line(err)}") from err
        try:
            info = ModelInfo.model_validate(blob.get("info", {}))
        except ValidationError as err:
            raise ShardRayError(describe_validation_error(err, f"cost model file {source} is damaged: info")) from err
        fwd, bwd = blob.get("step_overhead_ms", (0.0, 0.0))  # files from before they were fitted: none
        return cls(
            compute=compute,
            comm=comm,
            hardware=blob["hardware"],
            info=info,
            step_overhead_ms=(fwd, bwd),
            input_overhead_ms=float(blob.get("input_overhead_ms", 0.0)),
            type_overhead_ms=tuple(float(ms) for ms in blob.get("type_overhead_ms", (0.0, 0.0, 0.0))),
            all_reduce_ms=tuple(float(ms) for ms in blob.get("all_reduce_ms", (0.0, 0.0))),
        )
