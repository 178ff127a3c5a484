"""Ray Tune sweep of the compute cost model's hyperparameters, top to bottom; objective: validation MAPE.

Space: the per-table encoder's width and depth, learning rate, weight decay, minibatch, most
epochs and patience, the loss on log ms (mse, huber, l1) and the scaling of the log-scaled
table features. Data: the store's splits, exactly as `costmodel train` makes them, built once
in the driver and handed to the trials through Ray's object store (so trials on other nodes
need no store file). Each trial reports its validation MAPE of fused step compute every
`report_every` epochs, and ASHA stops the trials that trail; a trial that trains to the end
reports last the MAPE of its best weights on validation, held-out test and unseen-table shards.
The best trial by validation MAPE is saved as a `TrainConfig` for `costmodel train --config`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from shard_ray.configfile import dataclass_from
from shard_ray.costmodel.settings import FEATURE_SCALINGS, LOSSES, TrainConfig
from shard_ray.costmodel.train import (
    ComputeData,
    compute_data,
    compute_splits,
    mape,
    step_compute_ms,
    train_compute_model,
)
from shard_ray.profiling.store import MeasurementStore, existing_store
from shard_ray.tuning.settings import CostModelSweepConfig
from shard_ray.tuning.sweep import ScoredWith, SweepConfig, describe_settings, ranked_trials, run_sweep, save_best

METRIC = "val_mape"
SWEPT = ("hidden", "depth", "lr", "weight_decay", "minibatch", "max_epochs", "patience", "loss", "feature_scaling")


def search_space(settings: CostModelSweepConfig) -> dict[str, Any]:
    from ray import tune

    top = settings.max_epochs
    return {
        "hidden": tune.choice([32, 64, 128, 256]),
        "depth": tune.randint(1, 4),
        "lr": tune.loguniform(3e-4, 1e-2),
        "weight_decay": tune.loguniform(1e-6, 1e-3),
        "minibatch": tune.choice([32, 64, 128]),
        "max_epochs": tune.choice(sorted({max(1, top // 4), max(1, top // 2), top})),
        "patience": tune.choice([20, 40, 80]),
        "loss": tune.choice(list(LOSSES)),
        "feature_scaling": tune.choice(list(FEATURE_SCALINGS)),
    }


def train_config_from(trial: dict[str, Any], seed: int) -> TrainConfig:
    return dataclass_from(TrainConfig, {**{k: trial[k] for k in SWEPT}, "seed": seed}, "cost-model trial")


def split_mape(model: Any, data: ComputeData | None) -> float | None:
    """The model's MAPE on one data split, None when the split is empty."""
    return None if data is None else mape(*step_compute_ms(model, data))


def cost_model_trial(trial: dict[str, Any], data: dict[str, ComputeData], settings: CostModelSweepConfig) -> None:
    """One Tune trial: train the compute model with the trial's settings, reporting validation MAPE."""
    from ray import tune

    config = train_config_from(trial, settings.seed)
    epochs = 0

    def report(epoch: int, loss: float, model: Any) -> None:
        nonlocal epochs
        epochs = epoch + 1
        if epochs % settings.report_every == 0:
            tune.report({METRIC: split_mape(model, data["val"]), "val_loss": loss, "epoch": epochs})

    model = train_compute_model(data["train"], data["val"], config, on_epoch=report)
    final = {f"{name}_mape": split_mape(model, data.get(name)) for name in ("val", "test", "unseen")}
    tune.report({**{k: v for k, v in final.items() if v is not None}, "epoch": epochs, "finished": 1})


def sweep_data(
    store_path: str | Path, train_tables: set[str], hardware: str | None = None
) -> tuple[str, dict[str, ComputeData]]:
    """One hardware's shard measurements in the store, in the splits `costmodel train` makes, as the trials train on
    them: the hardware and each split's data. Refused in a line where the store cannot give them (read before Ray
    starts)."""
    with MeasurementStore(existing_store(store_path)) as store:
        hardware, _, splits = compute_splits(store, train_tables, hardware)
    print(
        f"cost-model sweep on {hardware}: "
        + ", ".join(f"{len(splits[name])} {name}" for name in ("train", "val", "test", "unseen"))
        + " shard measurements",
        flush=True,
    )
    return hardware, {name: compute_data(found) for name, found in splits.items() if found}


def scored_with(hardware: str, data: dict[str, ComputeData], settings: CostModelSweepConfig) -> ScoredWith:
    """What the cost-model sweep's trials are scored with: the sweep's settings, the hardware and how many shard
    measurements each split holds (a store measured further since gives others)."""
    splits = {f"{name} shards": len(found) for name, found in data.items()}
    return ScoredWith.of({**asdict(settings), "hardware": hardware, **splits}, CostModelSweepConfig)


def tune_cost_models(
    hardware: str,
    data: dict[str, ComputeData],
    sweep: SweepConfig,
    settings: CostModelSweepConfig,
    out_dir: str | Path,
    tracking_uri: str | None,
    experiment: str,
) -> Path:
    """Sweep on `sweep_data`'s splits, then write OUT/best.json (a tuned TrainConfig) and OUT/trials.csv; returns
    best.json."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    settings.check()
    scheduler = ASHAScheduler(
        time_attr="training_iteration",
        max_t=settings.max_epochs // settings.report_every + 1,
        grace_period=settings.grace_reports,
        reduction_factor=3,
    )
    results = run_sweep(
        "costmodel",
        tune.with_parameters(cost_model_trial, data=data, settings=settings),
        search_space(settings),
        METRIC,
        "min",
        sweep,
        out_dir,
        tracking_uri,
        experiment,
        {"hardware": hardware},
        scored_with(hardware, data, settings),
        scheduler,
    )
    ranked = ranked_trials(results, METRIC, out_dir)
    # in percent, as `costmodel train` prints it; a trial the scheduler stopped early never reached its test split
    print(f"{'trial':<22} {'val MAPE':>9} {'test MAPE':>13} {'epochs':>7}  settings")
    for r in ranked[:5]:
        test = r.metrics.get("test_mape")
        cell = f"{100 * test:.1f}%" if test is not None else "stopped early" if not r.metrics.get("finished") else "—"
        print(
            f"{r.metrics['trial_id']:<22} {100 * r.metrics[METRIC]:>8.1f}% {cell:>13} "
            f"{r.metrics.get('epoch', 0):>7}  " + describe_settings(r.config, SWEPT)
        )
    best = ranked[0]
    notes = {"hardware": hardware, **{k: best.metrics.get(k) for k in ("test_mape", "unseen_mape")}}
    return save_best(
        "costmodel",
        asdict(train_config_from(best.config, settings.seed)),
        METRIC,
        "min",
        best.metrics[METRIC],
        results,
        out_dir,
        notes,
    )
