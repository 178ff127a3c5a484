"""Flag groups several commands share, defined once: the Ray cluster, MLflow tracking, the store; and the check of a
plan file against a table file that every command reading both makes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError

if TYPE_CHECKING:
    from shard_ray.plan.cost import PlanCost
    from shard_ray.plan.plan import Plan
    from shard_ray.workload.tables import TableSpec

DEFAULT_STORE = "shard-ray-out/measurements.db"
STORE_HELP = "measurement store, SQLite"


@dataclass(frozen=True)
class RayArgs:
    address: str | None = setting(None, "Ray cluster address (default: RAY_ADDRESS, else a local Ray)")


@dataclass(frozen=True)
class TrackingArgs:
    tracking_uri: str | None = setting(None, "MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    experiment: str = setting("shard-ray", "MLflow experiment")
    no_mlflow: bool = setting(False, "do not log MLflow runs")


def add_ray(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, RayArgs)


def add_tracking(parser: argparse.ArgumentParser, experiment: str = "shard-ray") -> None:
    add_settings(parser, TrackingArgs, defaults={"experiment": experiment})
    parser.set_defaults(default_experiment=experiment)


def tracking(args: argparse.Namespace) -> tuple[str | None, str]:
    """The MLflow tracking URI (None with --no-mlflow) and experiment the flags ask for."""
    from shard_ray.tracking.mlflow_runs import check_tracking_uri, default_tracking_uri

    flags = settings_from(TrackingArgs, args, defaults={"experiment": args.default_experiment})
    if flags.no_mlflow:
        return None, flags.experiment
    uri = flags.tracking_uri or default_tracking_uri()
    given_as = (
        "--tracking-uri"
        if flags.tracking_uri
        else "MLFLOW_TRACKING_URI"
        if os.environ.get("MLFLOW_TRACKING_URI")
        else "the default store"
    )
    check_tracking_uri(uri, given_as)
    return uri, flags.experiment


def connect(args: argparse.Namespace, min_cpus: int = 1, hosts: int = 1, optimizer: str | None = None) -> None:
    """Join the cluster the flags name, or start a local Ray, and say which (`connect_ray`: a gang of `hosts` hosts
    is refused a local one before it starts); plans of `optimizer` Adam are refused a cluster without GPUs before
    its devices start (they failed in the gang's first step, with the actor's traceback)."""
    import ray

    from shard_ray.profiling.keeper import keep_seconds
    from shard_ray.profiling.procedure import ADAM_ON_CPU
    from shard_ray.runtime import connect_ray

    keep_seconds()  # a bad SHARD_RAY_KEEP_GANG_S is refused before joining
    if optimizer == "adam" and not (args.address or os.environ.get("RAY_ADDRESS")):
        from shard_ray.profiling.hardware import local_gpu

        if not local_gpu():  # a local Ray's devices would be this machine's CPU cores
            raise ShardRayError(ADAM_ON_CPU)
    print(connect_ray(args.address, min_cpus=min_cpus, hosts=hosts))
    if optimizer == "adam" and not ray.cluster_resources().get("GPU"):
        raise ShardRayError(ADAM_ON_CPU)


def check_plan_of(plan: Plan, plan_path: object, tables: list[TableSpec], tables_path: object) -> None:
    """Refuse `plan` (read from `plan_path`) unless it places `tables` (read from `tables_path`), naming both files:
    which of the two is the wrong one is the user's to say."""
    try:
        plan.check(tables)
    except ShardRayError as err:
        raise ShardRayError(f"{plan_path} is not a plan of {tables_path}: {err}") from None


def say_other_shapes(plan: Plan, plan_path: object, tables: list[TableSpec], tables_path: object) -> None:
    """Warn where `plan` was made for tables of these names but other shapes (its `tables_digest`), naming them where
    it records each table's (`table_digests`), once the command's refusals are past: a refusal is one line."""
    from shard_ray.workload.tables import table_digests, task_digest

    settings = plan.settings
    if settings is None or settings.tables_digest is None or settings.tables_digest == task_digest(tables):
        return
    changed = ""
    if settings.table_digests is not None:  # a plan of an earlier release has none
        names = [name for name, digest in table_digests(tables).items() if settings.table_digests.get(name) != digest]
        more = f" and {len(names) - 3:,} more" if len(names) > 3 else ""
        changed = f": {', '.join(map(repr, names[:3]))}{more}"
    print(
        f"warning: {plan_path} was made for tables of these names but other shapes than {tables_path}'s (rows, "
        f"dims, pooling factors, precision or access){changed}; its placement is taken as it is, for these",
        file=sys.stderr,
    )


def say_warnings(plans: list[Plan], costs: Mapping[str, PlanCost], told: set[str]) -> None:
    """The models' warnings on `plans` and what the gang found measuring each plan of `costs` (`measured_warnings`),
    each once on stderr; the gang's own, which it said when it started (`told`), not again."""
    from shard_ray.workflows.comparison import measured_warnings

    said = dict.fromkeys(w for plan in plans if plan.estimate for w in plan.estimate.warnings)
    for line in [*said, *measured_warnings(costs, set(said) | told)]:
        print(f"warning: {line}", file=sys.stderr)
