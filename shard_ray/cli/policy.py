"""`policy train` and `policy outer-loop`: DreamShard placement policies trained with RLlib."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shard_ray.arguments import Parser
from shard_ray.cli.commands import add_command
from shard_ray.cli.common import add_ray, add_tracking, connect, tracking
from shard_ray.cli.flags import add_settings, merged_settings, settings_from
from shard_ray.configfile import dataclass_from, setting
from shard_ray.policy.settings import PolicyConfig
from shard_ray.tracking.mlflow_runs import POLICY_EXPERIMENT
from shard_ray.workflows.settings import OuterLoopConfig


@dataclass(frozen=True)
class PolicyArgs:
    tables: str = setting(
        None,
        "table file training tasks are drawn from (e.g. tasks/train_pool.json)",
        required=True,
        old_names=("--pool",),
    )
    out: str = setting(
        None,
        "folder for the checkpoint and policy.pt (`tune policy`: the sweep's); an existing one is resumed",
        required=True,
        new_folder=True,
    )
    config: str | None = setting(None, "tuned PPO settings (best.json of `tune policy`); flags given override them")
    cost_model: str | None = setting(
        None,
        "cost model file pricing the MDP (default: the shipped reference CPU's; outer-loop: those plan prices the "
        "measured hardware with)",
    )


@dataclass(frozen=True)
class OuterLoopArgs:
    store: str | None = setting(None, "measurement store (default: measurements.db in --out)")


def add_policy_flags(
    parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None, exclude: tuple[str, ...] = ()
) -> None:
    """The flags of a policy's training: inputs and PPO settings but those `exclude` names, Ray and MLflow."""
    add_settings(parser, PolicyArgs, exclude=exclude)
    add_settings(parser, PolicyConfig, defaults=defaults, exclude=exclude)
    add_ray(parser)


def policy_inputs(
    args: argparse.Namespace, defaults: Mapping[str, Any] | None = None, trains_against_flag: bool = True, **fixed: Any
) -> tuple[PolicyArgs, PolicyConfig, list]:
    """The flags' inputs, PPO settings (defaults < tuned file < flags given) and pool, checked before Ray starts;
    `trains_against_flag`: the models training prices with are --cost-model's (the outer loop's are those it updates
    each round)."""
    from shard_ray.configfile import load_tuned
    from shard_ray.workload.tables import load_tables

    flags = settings_from(PolicyArgs, args)
    pool = load_tables(flags.tables)  # before torch loads
    from shard_ray.costmodel.models import CostModels
    from shard_ray.policy.ppo import env_config

    tuned = load_tuned(flags.config, "policy") if flags.config else None
    values = merged_settings(PolicyConfig, args, tuned, defaults, **fixed)
    # the minibatch cannot exceed the batch, and observations must have room for every task's devices
    values["minibatch_size"] = min(values["minibatch_size"], values["train_batch_size"])
    values["max_devices"] = max(values["max_devices"], *values["devices"])
    config = dataclass_from(PolicyConfig, values, "PPO settings")
    if (Path(flags.out) / "checkpoint").is_dir():  # a training to resume: refused now if Ray would only refuse it
        from shard_ray.policy.policy_file import models_label, refuse_other_training

        models = models_label(flags.cost_model) if trains_against_flag else None
        refuse_other_training(Path(flags.out) / "checkpoint", values, models, len(pool))
    if flags.cost_model is not None:
        CostModels.load(flags.cost_model)
    env_config(config, pool, flags.cost_model).check()
    return flags, config, pool


def cmd_policy_train(args: argparse.Namespace) -> None:
    flags, config, pool = policy_inputs(args)
    from shard_ray.policy.policy_file import nothing_to_train, read_policy

    policy_file = Path(flags.out) / "policy.pt"
    # the policy file is written with every checkpoint, after it: where it records the iterations asked for, so does
    # the checkpoint, and resuming would train nothing (a walk's command started Ray to say so)
    resuming = (Path(flags.out) / "checkpoint").is_dir() and policy_file.is_file()
    done = read_policy(policy_file)[1].iterations if resuming else None
    if done is not None and done >= config.iterations:
        print(nothing_to_train(done, config.iterations))
        print(f"policy: {policy_file} (place with: shard-ray plan --algo dreamshard --policy {policy_file} ...)")
        return
    from shard_ray.policy.ppo import train_policy

    tracking_uri, experiment = tracking(args)
    connect(args, min_cpus=1 + config.num_env_runners)
    policy_file = train_policy(pool, config, flags.out, flags.cost_model, tracking_uri, experiment)
    print(f"policy: {policy_file} (place with: shard-ray plan --algo dreamshard --policy {policy_file} ...)")


def cmd_policy_outer_loop(args: argparse.Namespace) -> None:
    flags, config, pool = policy_inputs(args, trains_against_flag=False, iterations=1)
    from shard_ray.workflows.outer_loop import run_outer_loop

    loop = settings_from(OuterLoopConfig, args, seed=config.seed)
    store = settings_from(OuterLoopArgs, args).store
    tracking_uri, experiment = tracking(args)
    connect(args, min_cpus=loop.gang_devices + loop.profiling_actors)
    policy_file = run_outer_loop(pool, config, loop, flags.out, store, flags.cost_model, tracking_uri, experiment)
    print(f"policy: {policy_file}; updated cost models: {Path(flags.out) / 'costmodels.pt'}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "policy")
    commands = p.add_subparsers(dest="policy_command", required=True, parser_class=Parser)
    q = commands.add_parser("train", help="PPO on the cost models' estimated MDP; resumes from the folder's checkpoint")
    add_policy_flags(q)
    add_tracking(q, POLICY_EXPERIMENT)
    q.set_defaults(run=cmd_policy_train)

    q = commands.add_parser(
        "outer-loop", help="DreamShard's loop: measure the policy's plans, update the cost models, PPO again; resumes"
    )
    add_settings(q, OuterLoopConfig)
    add_settings(q, OuterLoopArgs)
    # its rounds set the iterations, and its policy.pt is the last round's: the models change from round to round, so
    # held-out scores under one round's models do not judge another's network
    add_policy_flags(q, exclude=("iterations", "validation_tasks"))
    add_tracking(q, POLICY_EXPERIMENT)
    q.set_defaults(run=cmd_policy_outer_loop)
