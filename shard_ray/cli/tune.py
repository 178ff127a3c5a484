"""`tune costmodel|search|policy`: Ray Tune sweeps; each writes best.json, a tuned-config file."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from shard_ray.arguments import Parser
from shard_ray.cli.commands import add_command
from shard_ray.cli.common import DEFAULT_STORE, STORE_HELP, add_ray, add_tracking, connect, tracking
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.cli.policy import add_policy_flags, policy_inputs
from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError
from shard_ray.tuning.settings import POLICY_SWEPT, CostModelSweepConfig, PolicySweepConfig, SearchSweepConfig
from shard_ray.tuning.sweep import SweepConfig
from shard_ray.workflows.comparison import CompareConfig

TRIALS = {"costmodel": 16, "search": 24, "policy": 8}
SEARCH_RACE = {"rounds": 12, "budget_seconds": 60.0}  # each measured task's race: `compare`'s settings, shorter
POLICY_TRIAL_ITERATIONS = {"iterations": 20}  # PPO iterations of a trial at most


@dataclass(frozen=True)
class SweepOut:
    out: str = setting(
        None, "sweep folder: best.json, trials.csv, tune/; an existing one is resumed", required=True, new_folder=True
    )


@dataclass(frozen=True)
class CostModelSweepArgs:
    tables: str = setting(
        None, "table file of the training pool (as for `costmodel train`)", required=True, old_names=("--train-pool",)
    )
    store: str = setting(DEFAULT_STORE, STORE_HELP)
    hardware: str | None = setting(None, "sweep on this hardware's measurements (default: the most measured)")


@dataclass(frozen=True)
class SearchSweepArgs:
    tables: str = setting(
        None,
        "table file validation tasks are drawn from (e.g. tasks/train_pool.json)",
        required=True,
        old_names=("--pool",),
    )
    cost_model: str | None = setting(None, "cost model file (default: the shipped reference CPU's)")


def add_sweep_flags(parser: argparse.ArgumentParser, kind: str) -> None:
    """What every sweep takes: the trials, the folder, Ray and MLflow (the policy sweep brings its own seed)."""
    add_settings(parser, SweepConfig, defaults={"samples": TRIALS[kind]}, exclude=("seed",) if kind == "policy" else ())
    if kind != "policy":  # the policy flags bring --out and --address
        add_settings(parser, SweepOut)
        add_ray(parser)
    add_tracking(parser, f"shard-ray-tune-{kind}")


def sweep_settings(args: argparse.Namespace, kind: str, **fixed: object) -> SweepConfig:
    return settings_from(SweepConfig, args, defaults={"samples": TRIALS[kind]}, **fixed)


def report(best: Path, tracking_uri: str | None, experiment: str) -> None:
    document = json.loads(best.read_text())
    if tracking_uri:
        print(f"logged every trial as an MLflow run in the experiment {experiment} to {tracking_uri}")
    print(f"best {document['metric']} {document['value']:.4f}; wrote {best} and {best.parent / 'trials.csv'}")
    print(
        json.dumps(
            {"best": str(best), "metric": document["metric"], "value": document["value"], "config": document["config"]}
        )
    )


def cmd_tune_costmodel(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables

    flags = settings_from(CostModelSweepArgs, args)
    train_tables = {t.name for t in load_tables(flags.tables)}
    sweep = sweep_settings(args, "costmodel")
    settings = settings_from(CostModelSweepConfig, args, seed=sweep.seed)
    from shard_ray.profiling.store import MeasurementStore, existing_store

    store = existing_store(flags.store)
    with MeasurementStore(store) as measured:
        measured.main_hardware(flags.hardware)  # a store of none of its measurements refused before torch loads
    from shard_ray.tuning.costmodel_sweep import scored_with, sweep_data, tune_cost_models  # input checked: torch now

    hardware, data = sweep_data(store, train_tables, flags.hardware)  # the store's refusals before Ray starts
    scored_with(hardware, data, settings).refuse_other_in(args.out, "costmodel")
    tracking_uri, experiment = tracking(args)
    connect(args)
    out = settings_from(SweepOut, args).out
    report(tune_cost_models(hardware, data, sweep, settings, out, tracking_uri, experiment), tracking_uri, experiment)


def cmd_tune_search(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables

    flags = settings_from(SearchSweepArgs, args)
    pool = load_tables(flags.tables)
    sweep = sweep_settings(args, "search")
    settings = settings_from(SearchSweepConfig, args, seed=sweep.seed)
    race = settings_from(CompareConfig, args, defaults=SEARCH_RACE)
    if len(pool) < settings.max_tables:
        raise ShardRayError(
            f"the pool has {len(pool)} tables; tasks of up to {settings.max_tables} need at least that many"
        )
    from shard_ray.costmodel.models import CostModels  # the input checked: torch only now
    from shard_ray.tuning.search_sweep import scored_with, tune_search

    if flags.cost_model is not None:
        CostModels.load(flags.cost_model)
    scored_with(pool, settings, flags.cost_model).refuse_other_in(args.out, "search")
    tracking_uri, experiment = tracking(args)
    connect(args, min_cpus=settings.devices)
    out = settings_from(SweepOut, args).out
    report(
        tune_search(pool, sweep, settings, race, out, tracking_uri, experiment, flags.cost_model),
        tracking_uri,
        experiment,
    )


def cmd_tune_policy(args: argparse.Namespace) -> None:
    flags, base, pool = policy_inputs(args, defaults=POLICY_TRIAL_ITERATIONS)
    from shard_ray.tuning.policy_sweep import scored_with, tune_policy

    sweep = sweep_settings(args, "policy", seed=base.seed)
    settings = settings_from(PolicySweepConfig, args)
    scored_with(pool, base, settings, flags.cost_model).refuse_other_in(flags.out, "policy")
    tracking_uri, experiment = tracking(args)
    connect(args)
    report(
        tune_policy(pool, base, sweep, settings, flags.out, tracking_uri, experiment, flags.cost_model),
        tracking_uri,
        experiment,
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "tune")
    commands = p.add_subparsers(dest="tune_command", required=True, parser_class=Parser)
    q = commands.add_parser(
        "costmodel", help="sweep the compute cost model's training (objective: validation MAPE, ASHA)"
    )
    add_settings(q, CostModelSweepArgs)
    add_settings(q, CostModelSweepConfig)
    add_sweep_flags(q, "costmodel")
    q.set_defaults(run=cmd_tune_costmodel)

    q = commands.add_parser(
        "search", help="sweep cost_search's settings: simulated on validation tasks, finalists measured"
    )
    add_settings(q, SearchSweepArgs)
    add_settings(q, SearchSweepConfig)
    add_settings(q, CompareConfig, defaults=SEARCH_RACE)
    add_sweep_flags(q, "search")
    q.set_defaults(run=cmd_tune_search)

    q = commands.add_parser(
        "policy", help="sweep PPO's hyperparameters (objective: simulated cost on validation tasks, ASHA)"
    )
    add_settings(q, PolicySweepConfig)
    # the sweep's own --validation-tasks scores its trials; the settings it draws (and a tuned file of them) are no flags
    add_policy_flags(q, defaults=POLICY_TRIAL_ITERATIONS, exclude=("validation_tasks", "config", *POLICY_SWEPT))
    add_sweep_flags(q, "policy")
    q.set_defaults(run=cmd_tune_policy)
