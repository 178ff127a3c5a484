"""Training and evaluating the cost models on the measurement store, top to bottom.

Data split: shards whose tables all come from the training pool are divided by their key's
hash into train (80%), validation (10%) and held-out test (10%), so the split is stable as the
store grows and a resumed collection never moves a shard between splits. Shards with any table
outside the training pool are never trained on; they are reported as "unseen".
Plans for the communication model are split the same way by key.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from shard_ray.costmodel.coverage import training_coverage
from shard_ray.costmodel.features import COMM_FEATURES, batch_context
from shard_ray.costmodel.info import Coverage, ModelInfo, UpdatedOn
from shard_ray.costmodel.links import plan_links_between_hosts
from shard_ray.costmodel.models import CostModels, comm_features
from shard_ray.costmodel.networks import CommCostNet, ComputeCostNet, fused_shard_tensors
from shard_ray.costmodel.pricing import analytic_devices_per_host, gradient_mb, over_hosts, ring_bus_mb
from shard_ray.costmodel.settings import TrainConfig
from shard_ray.costmodel.simulator import Simulator
from shard_ray.costmodel.spine import fit_spine
from shard_ray.errors import ShardRayError, ShardRayWarning
from shard_ray.profiling.procedure import FusedShardMeasurement
from shard_ray.profiling.sampling import MICROBENCHMARK, base_table_name
from shard_ray.profiling.store import MeasurementStore, PlanMeasurement
from shard_ray.threads import one_thread


class MissingCommModelWarning(ShardRayWarning):
    """Models were trained without a communication model, so the links' profile alone prices their all-to-alls."""


def log_loss(predicted: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """The training loss between log ms; Huber's quadratic zone is about 10% relative error."""
    if kind == "huber":
        return nn.functional.huber_loss(predicted, target, delta=0.1)
    if kind == "l1":
        return (predicted - target).abs().mean()
    return ((predicted - target) ** 2).mean()


def data_split(key: str) -> str:
    bucket = int(key[:8], 16) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


# ---------------------------------------------------------------- data


@dataclass
class ComputeData:
    features: torch.Tensor  # [n, T, F]
    mask: torch.Tensor  # [n, T]
    replicas: torch.Tensor  # [n, T]: the data-parallel replicas, run in a kernel of their own
    log_batch: torch.Tensor  # [n]
    log_ms: torch.Tensor  # [n, 2]: log fwd, log bwd

    def __len__(self) -> int:
        return int(self.log_ms.shape[0])


def data_coverage(data: ComputeData, previous: Coverage | None = None) -> Coverage:
    """The training range (`shard_ray.costmodel.coverage`) of the shards in `data`, widening `previous`."""
    return training_coverage(data.features[data.mask.bool()].numpy(), int(data.mask.sum(dim=1).max()), previous)


def compute_data(measurements: list[FusedShardMeasurement]) -> ComputeData:
    features, mask, replicas = fused_shard_tensors(
        [m.tables for m in measurements], [m.modelled_rows_cap for m in measurements]
    )
    return ComputeData(
        features=features,
        mask=mask,
        replicas=replicas,
        log_batch=torch.tensor([batch_context(m.config.batch_size) for m in measurements], dtype=torch.float32),
        log_ms=torch.log(torch.tensor([[m.fwd_ms, m.bwd_ms] for m in measurements], dtype=torch.float32)),
    )


def is_microbenchmark(measurement: FusedShardMeasurement) -> bool:
    """Whether a measurement is of one of the microbenchmark's shards (`microbenchmark_shards`)."""
    return measurement.status == "ok" and all(
        base_table_name(p.table.name) == MICROBENCHMARK for p in measurement.tables
    )


def split_compute_measurements(
    measurements: list[FusedShardMeasurement], train_tables: set[str]
) -> dict[str, list[FusedShardMeasurement]]:
    """train / val / test (held-out shards of seen tables) / unseen (shards with unseen tables). The microbenchmark's
    tables (`shard_ray.profiling.sampling.microbenchmark_shards`) are seen by every model."""
    splits: dict[str, list[FusedShardMeasurement]] = {"train": [], "val": [], "test": [], "unseen": []}
    for m in measurements:
        if m.status != "ok" or not m.fwd_ms or not m.bwd_ms:
            continue
        seen = all(base_table_name(p.table.name) in train_tables | {MICROBENCHMARK} for p in m.tables)
        splits[data_split(m.key) if seen else "unseen"].append(m)
    return splits


def comm_widths(pm: PlanMeasurement) -> np.ndarray | None:
    """Each device's pooled-embedding all-to-all width in a measured multi-device plan; None where its
    comm holds more than that all-to-all (a replica's gradient all-reduce, table-row-wise sums inside
    a host, or, since procedure 2, one set of all-to-alls for each of several sharding types), which the
    comm model does not describe alone, or where the comm model priced the all-to-alls instead of the gang
    timing them (more devices than cores): a fit to its own prices would learn nothing."""
    if pm.plan.num_devices < 2 or {"fwd_comm_ms", "bwd_comm_ms"} & set(pm.cost.priced_parts):
        return None
    pieces = pm.plan.pieces(pm.tables)
    if any(p.replicated or p.within_host > 1 for shard in pieces for p in shard):
        return None
    if pm.procedure >= 2 and len({p.sharding_type for shard in pieces for p in shard}) > 1:
        return None
    return np.array([sum(p.width for p in shard) for shard in pieces], dtype=np.float64)


def comm_timed(plan_splits: dict[str, list[PlanMeasurement]]) -> dict[str, list[PlanMeasurement]]:
    """The plans of each split whose all-to-alls the gang timed as the comm model describes them (`comm_widths`). A
    gang of more devices than cores prices them instead: fitted to its own prices the model would learn nothing, yet
    count the gang's size among those it measured (`ModelInfo.device_counts`), and price it thereafter unscaled."""
    return {k: [p for p in v if comm_widths(p) is not None] for k, v in plan_splits.items()}


def comm_samples(plans: list[PlanMeasurement]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device comm features [N, C] and log (fwd, bwd) all-to-all ms [N, 2] of multi-device plans."""
    features, targets = [], []
    for pm in plans:
        widths = comm_widths(pm)
        if widths is None:
            continue
        features.append(comm_features(widths, pm.cost.batch_size or 1))
        targets.append([[d.fwd_comm_ms, d.bwd_comm_ms] for d in pm.cost.devices])
    if not features:
        return torch.zeros(0, len(COMM_FEATURES)), torch.zeros(0, 2)
    return torch.from_numpy(np.concatenate(features)), torch.log(
        torch.tensor(np.concatenate(targets), dtype=torch.float32).clamp(min=1e-3)
    )


# ---------------------------------------------------------------- fitting


def fit(
    model: nn.Module,
    num_train: int,
    train_loss: Callable[[torch.Tensor], torch.Tensor],
    val_loss: Callable[[], float],
    config: TrainConfig,
    desc: str,
    on_epoch: Callable[[int, float, nn.Module], None] | None = None,
) -> list[tuple[int, float]]:
    """Adam on minibatches with early stopping on validation loss; leaves the best weights in `model`.

    `on_epoch(epoch, validation loss, model)` is called after each epoch, with the epoch's
    weights in the model (a Tune trial reports there, and its scheduler may stop it); a caller that reports each
    epoch so has no progress bar (a sweep's trials' bars reached its output through Ray, beside its line a trial).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.max_epochs)
    generator = torch.Generator().manual_seed(config.seed)
    best, best_state, since_best, history = float("inf"), copy.deepcopy(model.state_dict()), 0, []
    bar = tqdm(total=config.max_epochs, desc=desc, unit="epoch", disable=on_epoch is not None)
    with one_thread():  # small networks: one thread is faster, and beside a busy process far faster
        for epoch in range(config.max_epochs):
            model.train()
            for batch in torch.randperm(num_train, generator=generator).split(config.minibatch):
                optimizer.zero_grad()
                train_loss(batch).backward()
                optimizer.step()
            scheduler.step()
            model.eval()
            with torch.no_grad():
                loss = val_loss()
            history.append((epoch, loss))
            if loss < best - 1e-5:
                best, best_state, since_best = loss, copy.deepcopy(model.state_dict()), 0
            else:
                since_best += 1
            stopping = since_best >= config.patience
            postfix = {"val_loss": f"{loss:.4f}", "best": f"{best:.4f}"}
            if stopping:  # the bar ends short of its epochs: said on it, or a new user reads "47/300" as a hang
                postfix["stopped"] = f"no gain in {config.patience} epochs"
            bar.set_postfix(postfix, refresh=False)
            bar.update()  # redrawn at tqdm's pace
            if on_epoch is not None:
                on_epoch(epoch, loss, model)
            if stopping:
                break
    bar.close()
    model.load_state_dict(best_state)
    model.eval()
    return history


def feature_scaling(rows: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The offset and scale the model subtracts from and divides its input features by."""
    if kind == "standardise":
        return rows.mean(dim=0), rows.std(dim=0).clamp(min=1e-3)
    if kind == "minmax":
        low = rows.min(dim=0).values
        return low, (rows.max(dim=0).values - low).clamp(min=1e-3)
    return torch.zeros(rows.shape[1]), torch.ones(rows.shape[1])


def train_compute_model(
    train: ComputeData,
    val: ComputeData,
    config: TrainConfig,
    init: ComputeCostNet | None = None,
    on_epoch: Callable[[int, float, nn.Module], None] | None = None,
    spine_data: ComputeData | None = None,
) -> ComputeCostNet:
    """A new model, or `init` trained further (keeping its feature scaling). A new model's spine is fitted to
    `train`; with `spine_data`, either's spine is fitted (again) to those shards first, then the network trained."""
    torch.manual_seed(config.seed)
    if init is not None:
        model = copy.deepcopy(init)
    else:
        model = ComputeCostNet(config.hidden, config.depth, config.fusion, spine=not config.no_spine)
        offset, scale = feature_scaling(train.features[train.mask.bool()], config.feature_scaling)
        model.feature_mean.copy_(offset)
        model.feature_std.copy_(scale)
        spine_data = spine_data or train
    if model.spine is not None and spine_data is not None:
        model.spine.set(
            fit_spine(
                spine_data.features, spine_data.mask, spine_data.log_batch, spine_data.log_ms, spine_data.replicas
            )
        )

    def train_loss(idx: torch.Tensor) -> torch.Tensor:
        return log_loss(
            model(train.features[idx], train.mask[idx], train.log_batch[idx], train.replicas[idx]),
            train.log_ms[idx],
            config.loss,
        )

    def val_loss() -> float:
        return float(log_loss(model(val.features, val.mask, val.log_batch, val.replicas), val.log_ms, config.loss))

    fit(model, len(train), train_loss, val_loss, config, "training compute model", on_epoch)
    return model


def train_comm_model(
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    config: TrainConfig,
    init: CommCostNet | None = None,
) -> CommCostNet:
    torch.manual_seed(config.seed)
    model = copy.deepcopy(init) if init is not None else CommCostNet(config.comm_hidden, config.comm_depth)
    (x, y), (vx, vy) = train, val

    def train_loss(idx: torch.Tensor) -> torch.Tensor:
        return log_loss(model(x[idx]), y[idx], config.loss)

    def val_loss() -> float:
        return float(log_loss(model(vx), vy, config.loss))

    fit(model, len(x), train_loss, val_loss, config, "training comm model")
    return model


# ---------------------------------------------------------------- metrics


def mape(predicted: Sequence[float] | np.ndarray, measured: Sequence[float] | np.ndarray) -> float:
    """Mean absolute percentage error (a fraction) of predicted against measured values."""
    predicted, measured = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return float(np.mean(np.abs(predicted - measured) / measured))


def accuracy(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float | None]:
    """MAPE (fraction) and Spearman rank correlation of predicted vs measured; None without data."""
    if len(measured) == 0:
        return {"mape": None, "spearman": None, "n": 0}
    from scipy.stats import spearmanr  # here, not at the top: scipy.stats costs every process a second to import

    rho = float(spearmanr(predicted, measured).statistic) if len(measured) > 2 else None
    return {"mape": mape(predicted, measured), "spearman": rho, "n": int(len(measured))}


def describe_accuracy(name: str, metrics: dict[str, float | None]) -> str:
    if not metrics["n"]:
        return f"{name:<21} no data"
    rho = "n/a" if metrics["spearman"] is None else f"{metrics['spearman']:.3f}"
    return f"{name:<21} MAPE {metrics['mape']:.1%}, Spearman {rho}, n={metrics['n']}"


def step_compute_ms(model: ComputeCostNet, data: ComputeData) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and measured fused step compute (forward + backward) ms of each shard in `data`."""
    with torch.no_grad():
        predicted = torch.exp(model(data.features, data.mask, data.log_batch, data.replicas)).numpy()
    return predicted.sum(axis=1), torch.exp(data.log_ms).numpy().sum(axis=1)


def predicted_and_measured(
    models: CostModels, measurements: list[FusedShardMeasurement]
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and measured fused step compute (forward + backward) ms of each shard."""
    if not measurements:
        return np.zeros(0), np.zeros(0)
    return step_compute_ms(models.compute.network(), compute_data(measurements))


def evaluate_compute(models: CostModels, measurements: list[FusedShardMeasurement]) -> dict[str, float]:
    """Accuracy on the fused step compute (forward + backward)."""
    return accuracy(*predicted_and_measured(models, measurements))


def device_compute(models: CostModels, plans: list[PlanMeasurement]) -> tuple[np.ndarray, np.ndarray]:
    """The fused kernels' predicted (fwd, bwd) ms [n, 2] of every device that holds pieces in plans measured on the
    gang, and the (fwd, bwd) compute [n, 2] the gang measured on it."""
    predicted, measured = [np.zeros((0, 2))], [np.zeros((0, 2))]
    for pm in plans:
        shards = pm.plan.pieces(pm.tables)
        by_device = {d.device: d for d in pm.cost.devices}
        held = [d for d, pieces in enumerate(shards) if pieces and d in by_device]
        if not held or pm.cost.batch_size is None:
            continue
        predicted.append(models.predict_fused_shards([shards[d] for d in held], pm.cost.batch_size))
        measured.append(np.array([[by_device[d].fwd_compute_ms, by_device[d].bwd_compute_ms] for d in held]))
    return np.concatenate(predicted), np.concatenate(measured)


def fit_step_overhead(models: CostModels, plans: list[PlanMeasurement]) -> tuple[float, float]:
    """Each device's (fwd, bwd) ms in a measured step beyond its fused kernels as `models` price them: the median,
    over the devices of `plans` of one sharding type, of what the gang measured less the kernels' price (at least 0);
    the models' own without such plans. The median, as a few devices measured on a disturbed core or with capped rows
    move it little; plans of one type, as the devices of mixed plans hold what the kernels price otherwise (replicas,
    whose backward measured up to 1.8x its price where table-wise devices measured 0.83x: docs/cost-models.md)."""
    kernels, measured = device_compute(models, [pm for pm in plans if len(sharding_types(pm)) == 1])
    if not len(measured):
        return models.step_overhead_ms
    fwd, bwd = np.maximum(np.median(measured - kernels, axis=0), 0.0)
    return float(fwd), float(bwd)


def sharding_types(pm: PlanMeasurement) -> set[str]:
    """The sharding types of a measured plan's pieces (a replica's `data_parallel` among them)."""
    return {p.sharding_type for pieces in pm.plan.pieces(pm.tables) for p in pieces}


def collectives_timed(pm: PlanMeasurement) -> bool:
    """Whether the gang timed a measured plan's collectives, per device: more than one device, none of them priced
    instead (more devices than cores), and the batch recorded."""
    return pm.plan.num_devices > 1 and pm.cost.batch_size is not None and not pm.cost.priced_parts


def input_dist(models: CostModels, plans: list[PlanMeasurement]) -> tuple[np.ndarray, np.ndarray]:
    """The input all-to-all's priced and measured ms of every device of `plans` that run one set of all-to-alls (one
    sharding type) and whose gang timed them."""
    simulator = Simulator(models)
    priced, measured = [], []
    for pm in plans:
        if not collectives_timed(pm) or len(sharding_types(pm)) != 1:
            continue
        priced += [d.input_dist_ms for d in simulator.plan_cost(pm.plan, pm.tables, pm.cost.batch_size).devices]
        measured += [d.input_dist_ms for d in pm.cost.devices]
    return np.array(priced), np.array(measured)


def fit_input_overhead(models: CostModels, plans: list[PlanMeasurement]) -> float:
    """Each device's input all-to-all ms beyond its price as one all-to-all of its bytes: the median, over the
    devices `input_dist` counts, of what the gang measured less that price (at least 0); the models' own without
    such plans. On the Intel Xeon the training plans' devices measured 1.8x that price, 0.43 ms more (docs/results.md)."""
    priced, measured = input_dist(replace(models, input_overhead_ms=0.0), plans)
    return max(float(np.median(measured - priced)), 0.0) if len(measured) else models.input_overhead_ms


def collective_sets(pm: PlanMeasurement) -> int:
    """How many sets of all-to-alls a measured plan runs: one for each sharding type of its pieces, replicas' none."""
    return len(sharding_types(pm) - {"data_parallel"})


def mixed_comm(models: CostModels, plans: list[PlanMeasurement]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (input, forward, backward) all-to-all ms [n, 3] that `models` price and that the gang measured on every
    device of `plans` that run more than one set of all-to-alls and whose gang timed them, and each device's sets
    beyond the first [n]."""
    simulator = Simulator(models)
    priced, measured, extra = [np.zeros((0, 3))], [np.zeros((0, 3))], []
    for pm in plans:
        sets = collective_sets(pm)
        if not collectives_timed(pm) or sets < 2:
            continue
        devices = simulator.plan_cost(pm.plan, pm.tables, pm.cost.batch_size).devices
        priced.append(np.array([[d.input_dist_ms, d.fwd_comm_ms, d.bwd_comm_ms] for d in devices]))
        measured.append(np.array([[d.input_dist_ms, d.fwd_comm_ms, d.bwd_comm_ms] for d in pm.cost.devices]))
        extra += [sets - 1] * len(devices)
    return np.concatenate(priced), np.concatenate(measured), np.array(extra, dtype=np.float64)


def fit_type_overhead(models: CostModels, plans: list[PlanMeasurement]) -> tuple[float, float, float]:
    """Each device's (input, forward, backward) all-to-all ms for each set of collectives beyond a plan's first, beyond
    their price without it: the median, over the devices of `plans` that run several sets (`mixed_comm`) and hold no
    replicas (whose all-reduce is `fit_all_reduce`'s), of what the gang measured less that price, per set beyond the
    first (at least 0); the models' own without such plans."""
    without_replicas = [pm for pm in plans if "data_parallel" not in sharding_types(pm)]
    priced, measured, extra = mixed_comm(replace(models, type_overhead_ms=(0.0, 0.0, 0.0)), without_replicas)
    if not len(extra):
        return models.type_overhead_ms
    per_set = np.maximum(np.median((measured - priced) / extra[:, None], axis=0), 0.0)
    return float(per_set[0]), float(per_set[1]), float(per_set[2])


def replica_all_reduces(
    models: CostModels, plans: list[PlanMeasurement]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every device holding replicas in `plans` whose gang timed their collectives: the backward collectives' ms the
    gang measured [n], the models' price of their all-to-alls [n] and of the all-reduce [n], and the all-reduce's
    regressors [n, 2]: 1 and the ring's bus MB, 2(D-1)/D of the device's replicas' gradient MB."""
    simulator = Simulator(models)
    measured, all_to_alls, priced, regressors = [], [], [], []
    for pm in plans:
        if not collectives_timed(pm) or "data_parallel" not in sharding_types(pm):
            continue
        parts = simulator.plan_parts(pm.plan, pm.tables, pm.cost.batch_size)
        for d, (held, cost) in enumerate(zip(pm.plan.pieces(pm.tables), pm.cost.devices)):
            if any(p.replicated for p in held):
                measured.append(cost.bwd_comm_ms)
                all_to_alls.append(parts.comm[d, 1] + parts.host_sums[d, 1])
                priced.append(parts.sync[d])
                mb = sum(gradient_mb(p, models.rows_cap) for p in held)
                regressors.append((1.0, ring_bus_mb(mb, pm.plan.num_devices)))
    return np.array(measured), np.array(all_to_alls), np.array(priced), np.array(regressors).reshape(-1, 2)


def fit_all_reduce(models: CostModels, plans: list[PlanMeasurement]) -> tuple[float, float]:
    """The replicas' all-reduce on a device (`CostModels.all_reduce_ms`): ms for taking part and ms per bus MB, fitted
    to what the gang measured in the backward collectives of the devices holding replicas in `plans` beyond their
    all-to-alls' price (`replica_all_reduces`), by non-negative least squares on the error relative to those
    collectives' measured ms (on the reference CPU, weighed by the all-reduce's own ms, the many small ones pulled the
    devices' price to a median 0.84x); the models' own with fewer than 4 such devices."""
    from scipy.optimize import nnls  # here: scipy.optimize costs every importer of the models a second

    measured, all_to_alls, _, regressors = replica_all_reduces(models, plans)
    if len(measured) < 4:
        return models.all_reduce_ms
    weight = 1.0 / np.maximum(measured, 0.25)
    (part, per_mb), _ = nnls(regressors * weight[:, None], (measured - all_to_alls) * weight)
    return float(part), float(per_mb)


def evaluate_replica_comm(models: CostModels, plans: list[PlanMeasurement]) -> dict[str, float]:
    """Predicted against measured backward collectives (the all-to-alls and the replicas' all-reduce) ms per device
    holding replicas (`replica_all_reduces`)."""
    measured, all_to_alls, all_reduce, _ = replica_all_reduces(models, plans)
    return accuracy(all_to_alls + all_reduce, measured)


def fit_overheads(models: CostModels, plans: list[PlanMeasurement], step: bool = True) -> CostModels:
    """`models` with what their networks do not price fitted to the gang's `plans`, in turn, each as the models with
    the ones before it price: the step's overhead (kept where `step` is False), the input all-to-all's, each further
    sharding type's, then the replicas' all-reduce."""
    if step:
        models = replace(models, step_overhead_ms=fit_step_overhead(models, plans))
    models = replace(models, input_overhead_ms=fit_input_overhead(models, plans))
    models = replace(models, type_overhead_ms=fit_type_overhead(models, plans))
    return replace(models, all_reduce_ms=fit_all_reduce(models, plans))


def evaluate_mixed_comm(models: CostModels, plans: list[PlanMeasurement]) -> dict[str, float]:
    """Predicted against measured input, forward and backward all-to-all ms per device of plans of several sets of
    all-to-alls (`mixed_comm`)."""
    priced, measured, _ = mixed_comm(models, plans)
    return accuracy(priced.sum(axis=1), measured.sum(axis=1))


def evaluate_input_dist(models: CostModels, plans: list[PlanMeasurement]) -> dict[str, float]:
    """Predicted against measured input all-to-all ms per device (`input_dist`)."""
    return accuracy(*input_dist(models, plans))


def evaluate_device_compute(models: CostModels, plans: list[PlanMeasurement]) -> dict[str, float]:
    """Predicted (kernels and step overhead) against measured fwd + bwd compute of each device of measured plans."""
    kernels, measured = device_compute(models, plans)
    return accuracy((kernels + np.asarray(models.step_overhead_ms)).sum(axis=1), measured.sum(axis=1))


def evaluate_comm(models: CostModels, plans: list[PlanMeasurement]) -> dict[str, float]:
    """Predicted against measured fwd + bwd all-to-all ms per device, priced as the simulator prices
    them: over the hosts each plan was measured on, inter-host traffic as `analytic_devices_per_host` says."""
    if models.comm is None:
        return accuracy(np.zeros(0), np.zeros(0))
    predicted, measured = [], []
    for pm in plans:
        widths = comm_widths(pm)
        if widths is None:
            continue
        batch = pm.cost.batch_size or 1
        hosts = analytic_devices_per_host(models, pm.cost.devices_per_host)
        rate, host_link = plan_links_between_hosts(pm.plan, models.links)
        predicted_one_host = models.predict_comm(widths, batch)
        priced = over_hosts(predicted_one_host, widths, batch, hosts, rate, models.links, host_link_gbps=host_link)
        predicted.append(priced.sum(axis=1))
        measured.append([d.fwd_comm_ms + d.bwd_comm_ms for d in pm.cost.devices])
    if not predicted:
        return accuracy(np.zeros(0), np.zeros(0))
    return accuracy(np.concatenate(predicted), np.concatenate(measured))


# ---------------------------------------------------------------- the whole job


class OlderMeasurementsWarning(ShardRayWarning):
    """Measurements taken by an earlier procedure were left out of training."""


Measured = TypeVar("Measured", FusedShardMeasurement, PlanMeasurement)


def newest_procedure(measurements: list[Measured]) -> list[Measured]:
    """The measurements taken by the newest MEASUREMENT_PROCEDURE among them, saying how many older ones are left
    out: older procedures measured differently (procedure 1 capped tables at 200,000 rows on CPU)."""
    if not measurements:
        return measurements
    newest = max(m.procedure for m in measurements)
    kept = [m for m in measurements if m.procedure == newest]
    if len(kept) < len(measurements):
        kind = "shard" if isinstance(kept[0], FusedShardMeasurement) else "plan"
        warnings.warn(
            f"{len(measurements) - len(kept)} {kind} measurements on {kept[0].hardware} were taken by an older "
            f"procedure (docs/measurement.md) and are left out; training on the {len(kept)} of procedure {newest}",
            OlderMeasurementsWarning,
            stacklevel=3,
        )
    return kept


def compute_splits(
    store: MeasurementStore, train_tables: set[str], hardware: str | None = None
) -> tuple[str, int | None, dict[str, list[FusedShardMeasurement]]]:
    """One hardware's shard measurements of the newest procedure in their splits, with that hardware and their row
    cap."""
    hardware = store.main_hardware(hardware)
    measurements = newest_procedure(store.fused_shard_measurements(hardware))
    caps = {m.modelled_rows_cap for m in measurements}
    if len(caps) > 1:
        raise ShardRayError(
            f"the measurements on {hardware} were taken with different row caps {sorted(caps, key=str)}; train on one"
        )
    splits = split_compute_measurements(measurements, train_tables)
    if len(splits["train"]) < 8 or len(splits["val"]) < 2:
        raise ShardRayError(
            f"too few shard measurements of training-pool tables on {hardware} to train "
            f"({len(splits['train'])} train, {len(splits['val'])} validation); collect more with `shard-ray collect`"
        )
    return hardware, caps.pop(), splits


def train_cost_models(
    store: MeasurementStore, train_tables: set[str], config: TrainConfig, hardware: str | None = None
) -> tuple[CostModels, dict[str, dict[str, float]]]:
    """Train both models on one hardware's measurements; returns them with held-out accuracy."""
    config.check()
    hardware, rows_cap, splits = compute_splits(store, train_tables, hardware)
    train_data = compute_data(splits["train"])
    # The spine is fitted to the training shards and the microbenchmark's (all of them, whatever their split: they move
    # one physical quantity at a time and are the hardware's rates, not a held-out judgement). Fitted to the
    # microbenchmark's alone, on the Intel Xeon, it priced the training pool's high-pooling tables 1.5-1.9x low and
    # the network learned to raise every table of many lookups, big tables that the spine priced right among them
    # (docs/results.md, "Prices on the Intel Xeon, measured as training runs").
    microbenchmark = [m for split in ("val", "test", "unseen") for m in splits[split] if is_microbenchmark(m)]
    spine_data = compute_data(splits["train"] + microbenchmark)
    compute = train_compute_model(train_data, compute_data(splits["val"]), config, spine_data=spine_data)

    # one device: no all-to-all
    plans = [p for p in newest_procedure(store.plan_measurements(hardware)) if p.plan.num_devices > 1]
    plan_splits = {name: [p for p in plans if data_split(p.key) == name] for name in ("train", "val", "test")}
    timed = comm_timed(plan_splits)
    comm = None
    if timed["train"] and timed["val"]:
        comm = train_comm_model(comm_samples(timed["train"]), comm_samples(timed["val"]), config)
    else:
        # The compute model alone still ranks placements; say what is missing rather than refuse.
        warnings.warn(
            f"no communication model: the store has {len(plans)} multi-device plan measurements on {hardware} "
            f"({len(timed['train'])} with their all-to-alls timed in the train split, {len(timed['val'])} in "
            "validation; one of each is needed), so the links' profile alone prices these models' all-to-alls; "
            "measure plans with `shard-ray collect --kind comm` and train again",
            MissingCommModelWarning,
            stacklevel=2,
        )

    models = CostModels.of_networks(
        compute,
        comm,
        hardware,
        ModelInfo(
            rows_cap=rows_cap,
            train_config=asdict(config),
            train_tables=sorted(train_tables),
            device_counts=sorted({p.plan.num_devices for split in timed.values() for p in split}),
            batch_sizes=sorted({m.config.batch_size for m in splits["train"]}),
            num_shards={k: len(v) for k, v in splits.items()},
            num_plans={k: len(v) for k, v in plan_splits.items()},
            coverage=data_coverage(train_data),
        ),
    )
    models = fit_overheads(models, plan_splits["train"], step=not config.no_step_overhead)
    report = {
        "compute_seen": evaluate_compute(models, splits["test"]),
        "compute_unseen": evaluate_compute(models, splits["unseen"]),
        "device_compute": evaluate_device_compute(models, plan_splits["test"]),
        "comm": evaluate_comm(models, plan_splits["test"]),
        "input_dist": evaluate_input_dist(models, plan_splits["test"]),
        "mixed_comm": evaluate_mixed_comm(models, plan_splits["test"]),
        "replica_comm": evaluate_replica_comm(models, plan_splits["test"]),
    }
    models.info.held_out = report
    return models, report


def update_cost_models(
    models: CostModels, store: MeasurementStore, config: TrainConfig, hardware: str | None = None
) -> CostModels:
    """DreamShard's cost-model update: `models` trained further on all the store holds for `hardware`.

    `hardware` defaults to the models' own; given another, the update adapts the models to it
    and they become models of that hardware. Every measurement taken with the models' row cap
    is used; the stopping rule watches the training loss, as there is nothing to hold out.
    Judge the update on measurements taken after it.
    """
    hardware = hardware or models.hardware
    measurements = [
        m
        for m in newest_procedure(store.fused_shard_measurements(hardware))
        if m.status == "ok" and m.modelled_rows_cap == models.rows_cap
    ]
    if not measurements:
        raise ShardRayError(f"the store has no shard measurements on {hardware} to update the cost models with")
    data = compute_data(measurements)
    compute = train_compute_model(data, data, config, init=models.compute.network())
    plans = [p for p in newest_procedure(store.plan_measurements(hardware)) if p.plan.num_devices > 1]
    comm = None if models.comm is None else models.comm.network()
    if plans and comm is not None:
        samples = comm_samples(plans)
        comm = train_comm_model(samples, samples, config, init=comm)
    info = models.info.model_copy(
        deep=True, update={"updated_on": UpdatedOn(hardware=hardware, shards=len(measurements), plans=len(plans))}
    )
    updated = CostModels.of_networks(compute, comm, hardware, info, step_overhead_ms=models.step_overhead_ms)
    return fit_overheads(updated, plans, step=not config.no_step_overhead)
