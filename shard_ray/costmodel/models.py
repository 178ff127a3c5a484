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

Pricing runs both networks here in numpy on their weights, read from the model file without torch (`read_torch_file`):
torch's import is most of a plan's time (docs/commands.md). Training fits them in torch
(`shard_ray.costmodel.networks`: `ComputeModel.network`, `CommModel.network`).
"""

from __future__ import annotations

import collections
import io
import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from shard_ray.costmodel.features import (
    COMM_FEATURES,
    NUM_TABLE_FEATURES,
    batch_context,
    padded_shards,
    pieces_features,
    replica_flags,
)
from shard_ray.costmodel.info import ModelInfo
from shard_ray.costmodel.links import LinkProfile, link_profile
from shard_ray.costmodel.spine import AT_BOUND, Spine
from shard_ray.errors import ShardRayError, describe_validation_error, first_line
from shard_ray.io import read_torch_file, shard_ray_home, write_atomic
from shard_ray.plan.piece import TablePiece
from shard_ray.workload.tables import TableSpec, task_digest

if TYPE_CHECKING:
    from shard_ray.costmodel.networks import CommCostNet, ComputeCostNet

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
        # a plan for GPUs made on a laptop is priced as for its CPU unless told otherwise (a walk read the CPU's
        # prices of a 64-GPU plan): the flag that prices it for a GPU, said where the CPU's shipped models price it
        for_gpus = (
            "; for GPUs: --hardware 'cuda:NAME', docs/gpu.md" if shipped and models.hardware.startswith("cpu:") else ""
        )
        return f"priced by {shipped}{path} (models of {models.hardware}, not calibrated on a task{for_gpus})", None
    names = calibrated.tables
    when = f" on {calibrated.at}" if calibrated.at else ""
    if calibrated.fitted(task_digest(tables)):
        line = f"priced by {path}: models of {models.hardware}, calibrated on these {len(names)} tables{when}"
        capped = calibrated.capped_rows
        if not capped:
            return line, None
        shown = ", ".join(f"{name} ({rows:,} rows)" for name, rows in list(capped.items())[:4])
        return line, (
            f"the models were fitted to shards of {shown}{', ...' if len(capped) > 4 else ''} measured with only those "
            "rows allocated (a measuring process's share of memory held no more), which times them optimistically: "
            "their prices of those tables are as optimistic (docs/measurement.md)"
        )
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


Layers = list[tuple[np.ndarray, np.ndarray]]


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus: log(1 + e^x), x itself above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def linear_layers(state: dict[str, np.ndarray], prefix: str, depth: int) -> Layers:
    """An MLP's `depth` + 1 linear layers under `prefix` (torch's `nn.Sequential` numbering, an activation between
    two: 0, 2, 4, ...) as (weight transposed, bias) from its state: views, taken once."""
    return [(state[f"{prefix}{2 * k}.weight"].T, state[f"{prefix}{2 * k}.bias"]) for k in range(depth + 1)]


def _run_mlp(layers: Layers, rows: np.ndarray) -> np.ndarray:
    """`networks.mlp` with outputs: linear layers with a ReLU between each two. Stacked rows [..., n, F] are
    multiplied stack by stack, as numpy's matmul does: a row's low bits change with the rows beside it in one product,
    so a plan priced among others is priced as it is alone."""
    for k, (weight, bias) in enumerate(layers):
        rows = (np.maximum(rows, 0.0) if k else rows) @ weight + bias
    return rows


def _monotone(state: dict[str, np.ndarray], prefix: str, x: np.ndarray, convex: bool) -> np.ndarray:
    """`networks.Monotone` of `x` on its weights in `state` (under `prefix`)."""
    w1, b1, w2 = softplus(state[prefix + "w1"]), state[prefix + "b1"], softplus(state[prefix + "w2"])
    activation = softplus if convex else _log_sigmoid
    rise = (activation(x @ w1 + b1) - activation(np.zeros_like(x) @ w1 + b1)) @ w2
    return rise if convex else rise + softplus(state[prefix + "b2"])


def state_of(network: Any) -> dict[str, np.ndarray]:
    """A torch network's state as numpy arrays of their own (`networks`' modules, the policy's network)."""
    return collections.OrderedDict((k, v.detach().numpy().copy()) for k, v in network.state_dict().items())


@dataclass
class ComputeModel:
    """The compute model as pricing runs it: numpy on the network's `state` (a `networks.ComputeCostNet`'s state
    dict, as the model file holds it), with its physical `spine` (format 3) or learned fusion terms (formats 1, 2).

    With a spine, a table's own ms are the spine's times a correction the network learns, bounded to
    [1/CORRECTION_BOUND, CORRECTION_BOUND], and a shard's fusion is the spine's (its kernels and pairs), so a shard's
    price is within that factor of the spine's physics, whatever the network does far from its data: rows are [fwd ms,
    bwd ms, the spine's kernel columns]. Without one, the network prices tables alone, unbounded, and learns the fusion
    terms `shared` and `contention` over encodings: rows are [fwd ms, bwd ms, encoding...]. (With a spine and the
    learned fusion terms both, the network moved every table's own cost to its lower bound and the rest into the
    unbounded fusion terms: the bound held nothing.)"""

    hidden: int
    depth: int
    fusion: str
    state: dict[str, np.ndarray]
    spine: Spine | None = None

    @classmethod
    def of_state(cls, hidden: int, depth: int, fusion: str, spine: bool, state: dict[str, np.ndarray]) -> ComputeModel:
        """The model of a file's `state`, of any release (its spine's state brought to this release's: `Spine.of_state`)."""
        state = float32_state(state)
        physics = None
        if spine:
            physics = Spine.of_state({k.removeprefix("spine."): v for k, v in state.items() if k.startswith("spine.")})
            state.update((f"spine.{k}", v) for k, v in physics.state().items())
        return cls(hidden, depth, fusion, state, physics)

    @classmethod
    def of_network(cls, network: ComputeCostNet) -> ComputeModel:
        return cls.of_state(network.hidden, network.depth, network.fusion, network.spine is not None, state_of(network))

    def network(self) -> ComputeCostNet:
        """The torch network of these weights, to train further (imports torch)."""
        import torch

        from shard_ray.costmodel.networks import ComputeCostNet

        network = ComputeCostNet(self.hidden, self.depth, self.fusion, self.spine is not None)
        state = {k: torch.from_numpy(v.copy()) for k, v in self.state.items()}
        if network.contention is not None and "contention.w2" not in state:  # format 1: no contention term, off
            state.update((f"contention.{k}", v) for k, v in network.contention.state_dict().items())
        network.load_state_dict(state)
        return network.eval()

    @cached_property
    def _encoder(self) -> Layers:
        return linear_layers(self.state, "encoder.", self.depth)

    def _bounded(self, raw: np.ndarray) -> np.ndarray:
        """The network's raw correction outputs as log factors in [-log bound, log bound]."""
        limit = math.log(float(self.state["correction_bound"]))
        return limit * np.tanh(raw / limit)

    def network_outputs(self, features: np.ndarray, log_batch: np.ndarray | float) -> np.ndarray:
        """[..., F] raw table features -> the encoder's raw outputs [..., 2 + H]."""
        normalised = (features - self.state["feature_mean"]) / self.state["feature_std"]
        batch = np.broadcast_to(np.asarray(log_batch, dtype=np.float32), normalised.shape[:-1])[..., None]
        return _run_mlp(self._encoder, np.concatenate([normalised, (batch - 10.0) / 2.0], axis=-1))

    def encode(
        self, features: np.ndarray, log_batch: np.ndarray | float, replicas: np.ndarray | None = None
    ) -> np.ndarray:
        """[..., F] raw table features -> [..., 2 + H], all >= 0: the table's own fwd and bwd ms, then its encoding,
        or with a spine its `kernel_columns`, whose sums over a shard price the shard's kernels (`replicas` [...]:
        the data-parallel replicas, whose kernels are apart; the network without a spine does not tell them)."""
        out = self.network_outputs(features, log_batch)
        if self.spine is not None:
            spine = self.spine(features, log_batch, replicas)
            own_ms = spine[..., :2] * np.exp(self._bounded(out))
            return np.concatenate([own_ms, spine[..., 2:]], axis=-1)
        # A table's own ms span five orders of magnitude (a 4-dim one-hot table to a 1024-dim bag of
        # hundreds at batch 2048) and scale multiplicatively with dim, lookups and batch: the network
        # gives their logs. The clamp keeps exp finite (e^15 ms is hours) before training has settled.
        own_ms = np.exp(np.clip(out[..., :2], -15.0, 15.0))
        return np.concatenate([own_ms, softplus(out[..., 2:])], axis=-1)

    def correction_at_bound(self, features: np.ndarray, log_batch: np.ndarray | float) -> np.ndarray:
        """[..., F] -> [...] bools: tables whose learned correction sits at its bound in either phase, so that
        their price rests on the bound rather than on what the network learned (all False without a spine)."""
        if self.spine is None:
            return np.zeros(features.shape[:-1], dtype=bool)
        log_factor = self._bounded(self.network_outputs(features, log_batch))
        return (np.abs(log_factor) >= AT_BOUND * math.log(float(self.state["correction_bound"]))).any(axis=-1)

    def _shard_terms(self, sums: np.ndarray, devices: int = 1) -> np.ndarray:
        """(fwd, bwd) ms [..., 2] beyond the tables' own of shards with summed rows `sums`; over `devices` shards,
        the least they add up to (`least_total`)."""
        if self.spine is not None:
            return self.spine.shard_ms(sums[..., 2:], devices)
        encoding = sums[..., 2:]
        shared = _monotone(self.state, "interaction.", encoding, convex=False)
        if "contention.w2" not in self.state:  # format 1: no contention term
            return shared
        return shared + devices * _monotone(self.state, "contention.", encoding / devices, convex=True)

    def from_sums(self, sums: np.ndarray) -> np.ndarray:
        """Log (fwd, bwd) ms of shards from their summed rows [B, 2 + H] (-inf for an empty shard)."""
        with np.errstate(divide="ignore"):
            return np.log(sums[..., :2] + self._shard_terms(sums))

    def least_total(self, sums: np.ndarray, devices: int) -> np.ndarray:
        """A lower bound on the total (fwd, bwd) ms [..., 2] of `devices` shards whose rows add up to
        at least `sums` [..., 2 + H]: own ms add; the concave term over the non-empty shards adds up
        to at least its value at the sum (subadditive, as it is >= 0 at 0); the convex term, 0 at 0,
        to at least `devices` times its value at the mean (Jensen); with a spine, at least one shard pays a
        kernel, and every table its own output's pair (`Spine.shard_ms`); all terms are monotone."""
        return sums[..., :2] + self._shard_terms(sums, devices)


@dataclass
class CommModel:
    """The comm model as pricing runs it: numpy on the network's `state` (a `networks.CommCostNet`'s)."""

    hidden: int
    depth: int
    state: dict[str, np.ndarray]

    @classmethod
    def of_network(cls, network: CommCostNet) -> CommModel:
        return cls(network.hidden, network.depth, state_of(network))

    def network(self) -> CommCostNet:
        """The torch network of these weights, to train further (imports torch)."""
        import torch

        from shard_ray.costmodel.networks import CommCostNet

        network = CommCostNet(self.hidden, self.depth)
        network.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in self.state.items()})
        return network.eval()

    @cached_property
    def layers(self) -> Layers:
        return linear_layers(self.state, "net.", self.depth)

    def log_ms(self, features: np.ndarray) -> np.ndarray:
        """Log (fwd, bwd) all-to-all ms [..., n, 2] of comm feature rows [..., n, F] (float32)."""
        return _run_mlp(self.layers, np.asarray(features, dtype=np.float32))


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


@dataclass
class CostModels:
    """The pair of models for one kind of hardware, with what they were trained on."""

    compute: ComputeModel
    comm: CommModel | None
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

    @classmethod
    def of_networks(
        cls,
        compute: ComputeCostNet,
        comm: CommCostNet | None,
        hardware: str,
        info: ModelInfo | None = None,
        **fits: Any,
    ) -> CostModels:
        """Models of networks training fitted (`fits`: the other fields, `step_overhead_ms` and the like)."""
        return cls(
            ComputeModel.of_network(compute),
            None if comm is None else CommModel.of_network(comm),
            hardware,
            ModelInfo() if info is None else info,
            **fits,
        )

    @property
    def rows_cap(self) -> int | None:
        """Rows per table the training measurements allocated (None: whole tables)."""
        return self.info.rows_cap

    def predict_fused_shards(self, shards: list[list[TablePiece]], batch_size: int) -> np.ndarray:
        """Predicted (fwd, bwd) ms [n, 2] of fused shards of table pieces; empty shards cost 0."""
        features, mask, replicas = padded_shards(shards, [self.rows_cap] * len(shards))
        log_batch = np.full((len(shards), 1), batch_context(batch_size), dtype=np.float32)
        rows = self.compute.encode(features, log_batch, replicas)
        ms = np.exp(self.compute.from_sums((rows * mask[..., None]).sum(axis=1)))
        ms[mask.sum(axis=1) == 0] = 0.0
        return ms

    def at_correction_bound(self, tables: list[TableSpec], batch_size: int) -> list[str]:
        """The names of `tables` (whole) whose learned correction sits at its bound at `batch_size`."""
        if not tables:
            return []
        features = pieces_features([TablePiece.whole(t) for t in tables], self.rows_cap)
        flags = self.compute.correction_at_bound(features, batch_context(batch_size))
        return [t.name for t, at_bound in zip(tables, flags.tolist()) if at_bound]

    def encode_tables(self, pieces: list[TablePiece], batch_size: int) -> np.ndarray:
        return self.encode_features(pieces_features(pieces, self.rows_cap), replica_flags(pieces), batch_size)

    def encode_features(self, features: np.ndarray, replicated: np.ndarray, batch_size: int) -> np.ndarray:
        """`encode_tables` of pieces whose `pieces_features` are at hand, and which of them are data-parallel replicas
        (`replica_flags`)."""
        return self.compute.encode(features, batch_context(batch_size), replicated)

    def compute_from_sums(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Predicted (fwd, bwd) ms [B, 2] of devices in a step given by their shards' summed rows: the fused kernels
        and the step's overhead (`step_overhead_ms`); zero where count is 0."""
        ms = np.exp(self.compute.from_sums(sums)) + np.asarray(self.step_overhead_ms)
        ms[np.asarray(counts) == 0] = 0.0
        return ms

    def least_compute(self, sums: np.ndarray, devices: int) -> float:
        """A lower bound on the step compute ms (forward + backward) of the slowest of `devices` devices whose
        shards' summed rows are at least `sums` [2 + H]: a 1/`devices` share of the least their fused kernels add
        up to (see `ComputeModel.least_total`) and the step's overhead (the device with the costliest kernels
        holds a piece)."""
        return float(self.compute.least_total(sums, devices).sum()) / devices + sum(self.step_overhead_ms)

    @property
    def links(self) -> LinkProfile:
        """The link profile that prices these models' collectives from below (`shard_ray.costmodel.links`): the one
        `calibrate` fitted to the hardware, else the published one of the models' hardware."""
        return self.info.links or link_profile(self.hardware)

    def comm_ms(self, features: np.ndarray) -> np.ndarray:
        """Predicted (fwd, bwd) all-to-all ms [..., n, 2] of devices given by comm feature rows [..., n, F]; zeros
        without a comm model. Stacked rows (several plans' devices) are priced stack by stack (`_run_mlp`): a plan
        priced among others is priced as it is alone."""
        if self.comm is None:
            return np.zeros((*np.shape(features)[:-1], 2))
        return np.exp(self.comm.log_ms(features))

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
        import torch

        def tensors(state: dict[str, np.ndarray]) -> collections.OrderedDict:
            return collections.OrderedDict((k, torch.from_numpy(v.copy())) for k, v in state.items())

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
                    "state": tensors(self.compute.state),
                },
                "comm": None
                if self.comm is None
                else {"hidden": self.comm.hidden, "depth": self.comm.depth, "state": tensors(self.comm.state)},
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
        if os.path.isdir(path):
            raise ShardRayError(f"cost model file {path} is a folder: give the model file (.pt) in it")
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
            fusion = "subadditive" if blob["format"] == SUBADDITIVE_FORMAT else blob["compute"]["fusion"]
            spine = blob["format"] == FORMAT and blob["compute"]["spine"]
            hidden, depth = blob["compute"]["hidden"], blob["compute"]["depth"]
            compute = ComputeModel.of_state(hidden, depth, fusion, spine, blob["compute"]["state"])
            _check_compute_state(compute)
            comm = None
            if blob["comm"] is not None:
                comm = CommModel(blob["comm"]["hidden"], blob["comm"]["depth"], float32_state(blob["comm"]["state"]))
                check_layers(comm.layers, len(COMM_FEATURES), comm.hidden, 2)
            # files from before these were fitted have none: 0
            fits = {
                "step_overhead_ms": _milliseconds(blob.get("step_overhead_ms", (0.0, 0.0)), 2),
                "input_overhead_ms": _milliseconds([blob.get("input_overhead_ms", 0.0)], 1)[0],
                "type_overhead_ms": _milliseconds(blob.get("type_overhead_ms", (0.0, 0.0, 0.0)), 3),
                "all_reduce_ms": _milliseconds(blob.get("all_reduce_ms", (0.0, 0.0)), 2),
            }
        except (KeyError, RuntimeError, TypeError, ValueError) as err:
            raise ShardRayError(f"cost model file {source} is damaged: {first_line(err)}") from err
        try:
            info = ModelInfo.model_validate(blob.get("info", {}))
        except ValidationError as err:
            raise ShardRayError(describe_validation_error(err, f"cost model file {source} is damaged: info")) from err
        return cls(compute=compute, comm=comm, hardware=str(blob["hardware"]), info=info, **fits)


def float32_state(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """A network's state as float32 arrays, as torch's `load_state_dict` copies a file's tensors into float32
    parameters; ValueError where a weight is not a finite number (a damaged file: its prices would be NaN)."""
    arrays = collections.OrderedDict((k, np.asarray(v, dtype=np.float32)) for k, v in state.items())
    for name, array in arrays.items():
        if not np.isfinite(array).all():
            raise ValueError(f"{name} holds numbers that are not finite")
    return arrays


def _milliseconds(values: Any, count: int) -> tuple[float, ...]:
    """`count` finite ms from a file; ValueError otherwise."""
    numbers = tuple(float(v) for v in values)
    if len(numbers) != count or not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"{values!r} where {count} ms were expected")
    return numbers


def check_layers(layers: Layers, inputs: int, hidden: int, outputs: int) -> None:
    """Raises ValueError where a file's MLP is not of the shapes its settings say (a damaged file)."""
    widths = [inputs] + [hidden] * (len(layers) - 1) + [outputs]
    for (weight, bias), into, out in zip(layers, widths, widths[1:]):
        if weight.shape != (into, out) or bias.shape != (out,):
            raise ValueError(f"a layer of shape {weight.T.shape} where ({out}, {into}) was expected")


def _check_compute_state(compute: ComputeModel) -> None:
    """Raises KeyError or ValueError where a file's compute model lacks a weight or has one of another shape."""
    outputs = 2 if compute.spine is not None else compute.hidden + 2
    check_layers(compute._encoder, NUM_TABLE_FEATURES + 1, compute.hidden, outputs)
    terms = (
        ["correction_bound"] if compute.spine is not None else [f"interaction.{w}" for w in ("w1", "b1", "w2", "b2")]
    )
    for name in ["feature_mean", "feature_std", *terms]:
        if name not in compute.state:
            raise KeyError(name)
