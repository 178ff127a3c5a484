"""`costmodel train` and `costmodel evaluate`: the neural cost models and their held-out accuracy."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from shard_ray.cli.commands import add_command
from shard_ray.cli.common import DEFAULT_STORE, STORE_HELP, add_tracking, tracking
from shard_ray.cli.flags import Parser, add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.train import TrainConfig
from shard_ray.errors import ShardRayError


@dataclass(frozen=True)
class TrainArgs:
    tables: str = setting(
        None,
        "table file of the training pool; shards of other tables are held out as unseen",
        required=True,
        old_names=("--train-pool",),
    )
    out: str = setting(None, "model file to write (.pt)", required=True)
    store: str = setting(DEFAULT_STORE, STORE_HELP)
    config: str | None = setting(
        None, "tuned training settings (best.json of `tune costmodel`); flags given override them"
    )
    hardware: str | None = setting(None, "train on this hardware's measurements (default: the most measured)")


@dataclass(frozen=True)
class EvaluateModelArgs:
    cost_model: str = setting(None, "cost model file to evaluate", required=True, old_names=("--model",))
    store: str = setting(DEFAULT_STORE, "measurement store with held-out or unseen measurements", old_names=("--data",))


def existing_store(path: str) -> str:
    if not Path(path).is_file():
        raise ShardRayError(f"measurement store not found: {path}")
    return path


def cmd_costmodel_train(args: argparse.Namespace) -> None:
    from shard_ray.configfile import load_tuned
    from shard_ray.costmodel.train import describe_accuracy, train_cost_models
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.workload.tables import load_tables

    flags = settings_from(TrainArgs, args)
    train_tables = {t.name for t in load_tables(flags.tables)}
    config = settings_from(TrainConfig, args, tuned=load_tuned(flags.config, "costmodel") if flags.config else None)
    with MeasurementStore(existing_store(flags.store)) as store:
        models, report = train_cost_models(store, train_tables, config, flags.hardware)
    models.save(flags.out)
    for name, metrics in report.items():
        print(describe_accuracy(name, metrics))
    print(f"wrote {flags.out} (models of {models.hardware})")
    print(json.dumps(report))


def cmd_costmodel_evaluate(args: argparse.Namespace) -> None:
    import numpy as np

    from shard_ray.costmodel.models import CostModels
    from shard_ray.costmodel.train import (
        accuracy,
        data_split,
        describe_accuracy,
        evaluate_comm,
        predicted_and_measured,
        split_compute_measurements,
    )
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.tracking.mlflow_runs import log_costmodel_evaluation

    flags = settings_from(EvaluateModelArgs, args)
    tracking_uri, experiment = tracking(args)
    models = CostModels.load(flags.cost_model)
    with MeasurementStore(existing_store(flags.store)) as store:
        splits = split_compute_measurements(
            store.shard_measurements(models.hardware), set(models.info.get("train_tables", []))
        )
        plans = store.plan_measurements(models.hardware)
    groups = {name: predicted_and_measured(models, splits[name]) for name in ("test", "unseen")}
    result = accuracy(*map(np.concatenate, zip(*groups.values())))
    result["seen"] = accuracy(*groups["test"])
    result["unseen"] = accuracy(*groups["unseen"])
    result["comm"] = evaluate_comm(models, [p for p in plans if data_split(p.key) == "test"])
    if result["n"] == 0:
        raise ShardRayError(f"{flags.store} has no held-out or unseen shard measurements on {models.hardware}")
    for name in ("seen", "unseen", "comm"):
        print(describe_accuracy(name, result[name]))
    if tracking_uri is not None:
        flat = {"mape": result["mape"], "spearman": result["spearman"]}
        flat.update({f"{k}_{m}": result[k][m] for k in ("seen", "unseen", "comm") for m in ("mape", "spearman")})
        flat = {k: v for k, v in flat.items() if v is not None}
        log_costmodel_evaluation(
            flags.cost_model,
            models.hardware,
            flat,
            {
                "held-out, seen tables": tuple(v.tolist() for v in groups["test"]),
                "unseen tables": tuple(v.tolist() for v in groups["unseen"]),
            },
            tracking_uri,
            experiment,
        )
    print(json.dumps(result))


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "costmodel")
    commands = p.add_subparsers(dest="costmodel_command", required=True, parser_class=Parser)
    q = commands.add_parser("train", help="train compute and communication models on a measurement store")
    add_settings(q, TrainArgs)
    add_settings(q, TrainConfig)
    q.set_defaults(run=cmd_costmodel_train)

    q = commands.add_parser("evaluate", help="held-out accuracy of cost models; the last line is JSON")
    add_settings(q, EvaluateModelArgs)
    add_tracking(q)
    q.set_defaults(run=cmd_costmodel_evaluate)
