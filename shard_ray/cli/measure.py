"""`profile`, `collect` and `evaluate`: measurements on Ray actors and on the device gang."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shard_ray.cli.commands import add_command
from shard_ray.cli.common import (
    DEFAULT_STORE,
    STORE_HELP,
    add_ray,
    add_tracking,
    check_plan_of,
    connect,
    say_other_shapes,
    say_warnings,
    tracking,
)
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.cli.planning import TopologyArgs
from shard_ray.configfile import setting
from shard_ray.costmodel.collect import CollectConfig
from shard_ray.errors import ShardRayError
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workflows.comparison import CompareConfig

if TYPE_CHECKING:
    from shard_ray.plan.plan import Plan
    from shard_ray.plan.topology import Topology
    from shard_ray.workload.tables import TableSpec

_MEASURE = MeasureConfig.model_fields


@dataclass(frozen=True)
class MeasureArgs:
    """How each shard or plan is timed; the defaults are MeasureConfig's."""

    warmup: int = setting(
        _MEASURE["warmup"].default,
        "untimed steps first, at least; warm-up goes on until the step times settle (0: none)",
        min=0,
    )
    repeats: int = setting(
        _MEASURE["repeats"].default,
        "timed steps a round; each part costs the fastest of them (docs: How measurement works)",
        min=1,
    )
    max_rows: int | None = setting(
        None, "rows allocated per table at most (default: whole tables where memory holds them)", min=1
    )


@dataclass(frozen=True)
class ProfileArgs:
    tables: str = setting(None, "table file whose tables are profiled", required=True)
    shards: int = setting(20, "random multi-table shards to measure", min=0)
    max_tables: int = setting(8, "most tables in a random shard", min=1)
    no_singles: bool = setting(False, "do not also measure every table alone")
    actors: int = setting(2, "profiling actors, one device each", min=1)
    batch_size: int = setting(_MEASURE["batch_size"].default, "global batch size", min=1)
    store: str = setting(DEFAULT_STORE, STORE_HELP)
    seed: int = setting(0, "random seed", min=0)


@dataclass(frozen=True)
class CollectArgs:
    kind: Literal["compute", "comm"] = setting(None, "what to measure", required=True)
    tables: str = setting(
        None, "table file the samples are drawn from (e.g. tasks/train_pool.json)", required=True, old_names=("--pool",)
    )
    actors: int = setting(2, "profiling actors for compute data", min=1)
    store: str = setting(DEFAULT_STORE, STORE_HELP)


@dataclass(frozen=True)
class EvaluateArgs:
    tables: str = setting(None, "the table file the plan places", required=True)
    plan: str = setting(None, "plan file to measure", required=True)
    out: str = setting(None, "result file to write (.json)", required=True, new_file=True)
    task: str | None = setting(None, "task name for MLflow (default: the table file's name)")
    rounds: int = setting(
        7,
        "rounds of --repeats steps on fresh batches; the result is the median round, with a distribution-free "
        "interval of at least 95 percent coverage (the coverage reached is printed)",
        min=1,
    )


@dataclass(frozen=True)
class CompareArgs:
    tables: str = setting(None, "the table file the plans place", required=True)
    plans: tuple[str, ...] = setting(
        (), "two or more plan files (any: shard-ray's, TorchRec's planner's, written by hand)", required=True, many=True
    )
    out: str = setting(
        "shard-ray-out/compare",
        "folder for comparison.json, comparison.md and comparison.png (created if missing)",
        new_folder=True,
    )
    task: str | None = setting(None, "task name for MLflow (default: the table file's name)")
    incumbent: str | None = setting(
        None,
        "one of the plan files: the plan you run now, chosen unless another is separated as faster than it "
        "(default: none; among plans the race cannot tell apart, the lowest median is chosen)",
    )
    cost_model: str | None = setting(
        None,
        "cost model file that prices every plan beside its measurement (default: the models `plan` picks for the "
        "gang's hardware and these tables)",
    )


def cmd_compare(args: argparse.Namespace) -> None:
    from shard_ray.io import write_atomic, write_json
    from shard_ray.plan.plan import load_plan
    from shard_ray.workflows.comparison import CompareConfig, compare_plans, distinct, format_comparison, ratio_chart
    from shard_ray.workload.tables import load_tables

    flags = settings_from(CompareArgs, args)
    timing = settings_from(MeasureArgs, args)
    config = settings_from(CompareConfig, args, warmup=timing.warmup, repeats=timing.repeats)
    if len(flags.plans) < 2:
        raise ShardRayError(f"compare needs two plan files or more, got {len(flags.plans)}")
    tables = load_tables(flags.tables)
    stems = [Path(p).stem for p in flags.plans]
    names = stems if len(set(stems)) == len(stems) else list(flags.plans)
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ShardRayError(f"plan file {twice} is given twice")
    if flags.incumbent is not None and flags.incumbent not in flags.plans:
        raise ShardRayError(f"--incumbent {flags.incumbent} is not one of the plan files given to compare")
    incumbent = names[flags.plans.index(flags.incumbent)] if flags.incumbent else None
    plans = [load_plan(p) for p in flags.plans]
    topology = _topology_of_plans(flags, plans, tables, settings_from(TopologyArgs, args))
    for path, plan in zip(flags.plans, plans):
        say_other_shapes(plan, path, tables, flags.tables)
    if flags.cost_model is not None:
        from shard_ray.costmodel.models import CostModels

        CostModels.load(flags.cost_model)  # a file that is none refused before Ray starts
    merged = [name for name, _ in distinct(list(zip(names, plans)))]
    if len(merged) < 2:
        raise ShardRayError(f"{' and '.join(names)} place the tables identically: nothing to compare")
    for name in merged:
        if "=" in name:
            print(f"{name.replace('=', ' and ')} place the tables identically: measured once, as {name}")
    tracking_uri, experiment = tracking(args)
    from shard_ray.tracking.mlflow_runs import log_comparison
    from shard_ray.tracking.report_process import ReportProcess

    # the files checked: the report's modules imported in a process of its own from now, beside what measures and
    # prices the plans (torch, Ray)
    with ReportProcess(tracking_uri, [ratio_chart, log_comparison]) as report:
        from shard_ray.costmodel.simulator import price_comm
        from shard_ray.placement.base import priced
        from shard_ray.profiling.gang import DeviceGang

        connect(args, min_cpus=topology.num_devices, hosts=topology.num_hosts, optimizer=topology.optimizer)
        with DeviceGang(
            topology.num_devices, devices_per_host=topology.devices_per_host, comm_pricer=price_comm
        ) as gang:
            # every plan priced by one set of models: --cost-model's, else those `plan` picks for the gang's
            # hardware and these tables
            plans = [priced(plan, tables, topology, flags.cost_model, gang.hardware) for plan in plans]
            report.wait_until_imported()  # before measuring: its cores are the gang's
            compared = compare_plans(list(zip(names, plans)), tables, topology, gang, config, incumbent=incumbent)
        result = compared.result
        table = format_comparison(result)
        print(table)
        print(plans[0].estimate.provenance)
        out = Path(flags.out)
        earlier = (out / "comparison.json").exists()  # the default folder is one for every comparison
        write_json(
            out / "comparison.json",
            {
                "tables": flags.tables,
                "plans": dict(zip(names, flags.plans)),
                "comparison": result.model_dump(mode="json"),
                "costs": {name: cost.model_dump(mode="json") for name, cost in compared.costs.items()},
            },
        )
        write_atomic(out / "comparison.md", "```\n" + table + "\n```\n")
        report.call(ratio_chart, result, out / "comparison.png")
        replaced = " (in place of the comparison there before: --out names a folder of its own)" if earlier else ""
        print(f"wrote comparison.json, comparison.md and comparison.png to {out}{replaced}")
        say_warnings(plans, compared.costs, set(gang.warnings))
        if tracking_uri is not None:
            task = flags.task or Path(flags.tables).stem
            files = [out / name for name in ("comparison.json", "comparison.md", "comparison.png")]
            logged = report.call(
                log_comparison, result, compared.plans, compared.costs, topology, task, tables, tracking_uri,
                experiment, files,
            )  # fmt: skip
            print(logged.describe(tracking_uri))


def _topology_of_plans(flags: CompareArgs, plans: list[Plan], tables: list[TableSpec], args: TopologyArgs) -> Topology:
    """The one topology every plan given to `compare` is for, each plan checked against the tables and it."""
    for path, plan in zip(flags.plans, plans):
        check_plan_of(plan, path, tables, flags.tables)
    devices = {p.num_devices for p in plans}
    if len(devices) > 1:
        raise ShardRayError(f"the plans are for different device counts ({sorted(devices)}): compare plans of one gang")
    hosts = {p.devices_per_host for p in plans}
    if len(hosts) > 1:
        raise ShardRayError(f"the plans are for different hosts (devices per host {sorted(hosts, key=str)})")
    # the settings of the first plan that records any: a plan written by hand records none (the first given was
    # asked for --memory-gb that the second recorded)
    recorded = next((plan.settings for plan in plans if plan.settings is not None), None)
    topology = args.topology(plans[0].num_devices, recorded)
    for path, plan in zip(flags.plans, plans):
        try:
            plan.check_memory(tables, topology)
        except ShardRayError as err:
            raise ShardRayError(f"{path}: {err}") from None
    return topology


def cmd_profile(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables

    flags = settings_from(ProfileArgs, args)
    timing = settings_from(MeasureArgs, args)
    tables = load_tables(flags.tables)  # before torch loads
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.procedure import content_digest
    from shard_ray.profiling.sampling import draw_fused_shards
    from shard_ray.profiling.store import MeasurementStore

    config = MeasureConfig(
        batch_size=flags.batch_size,
        warmup=timing.warmup,
        repeats=timing.repeats,
        max_rows=timing.max_rows,
        seed=flags.seed,
    )
    shards = draw_fused_shards(tables, flags.shards, flags.max_tables, seed=flags.seed, singles=not flags.no_singles)
    with MeasurementStore(flags.store) as store:  # a store it cannot use refused before Ray starts
        connect(args, min_cpus=flags.actors)
        with ProfilingPool(flags.actors) as pool:
            before = store.count()
            results = pool.measure(shards, config, store)
            hardware = pool.hardware
        added = store.count() - before
        ok = [m for m in results if m.status == "ok"]
        # a shard drawn twice is measured once: it is not one the store held before (a walk's fresh store held "1")
        distinct = len({tuple(sorted(content_digest(p.content()) for p in shard)) for shard in shards})
        twice = f" ({len(shards) - distinct} drawn again)" if distinct < len(shards) else ""
        print(
            f"{len(shards)} shards{twice} on {hardware}: {added} measured now, {distinct - added} already in "
            f"{flags.store}"
        )
        print(f"{len(ok)} ok, {len(results) - len(ok)} infeasible; store holds {store.count()} measurements")
    if ok:
        for what, values in (("forward", sorted(m.fwd_ms for m in ok)), ("backward", sorted(m.bwd_ms for m in ok))):
            print(f"{what} ms: min {values[0]:.3f}, median {values[len(values) // 2]:.3f}, max {values[-1]:.3f}")


def cmd_collect(args: argparse.Namespace) -> None:
    from shard_ray.costmodel.collect import collect_comm, collect_compute
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.workload.tables import load_tables

    flags = settings_from(CollectArgs, args)
    config = settings_from(CollectConfig, args)
    pool = load_tables(flags.tables)
    with MeasurementStore(flags.store) as store:  # a store it cannot use refused before Ray starts
        connect(args, min_cpus=max(flags.actors, *config.device_counts))
        if flags.kind == "compute":
            with ProfilingPool(flags.actors) as profiler:
                added = collect_compute(pool, config, profiler, store)
            print(f"{added} new shard measurements; the store holds {store.count()} ({flags.store})")
        else:
            added = collect_comm(pool, config, store)
            print(f"{added} new plan measurements; the store holds {store.count('plan_measurements')} ({flags.store})")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from shard_ray.io import write_json
    from shard_ray.plan.plan import load_plan
    from shard_ray.plan.summary import format_plan_summary, format_prediction
    from shard_ray.workload.tables import load_tables

    flags = settings_from(EvaluateArgs, args)
    timing = settings_from(MeasureArgs, args)
    tables = load_tables(flags.tables)
    plan = load_plan(flags.plan)
    check_plan_of(plan, flags.plan, tables, flags.tables)
    topology = settings_from(TopologyArgs, args).topology(plan.num_devices, plan.settings)
    plan.check_memory(tables, topology)
    say_other_shapes(plan, flags.plan, tables, flags.tables)
    config = MeasureConfig.for_topology(
        topology, warmup=timing.warmup, repeats=timing.repeats, max_rows=timing.max_rows
    )
    tracking_uri, experiment = tracking(args)
    if tracking_uri is not None:
        from shard_ray.tracking.mlflow_runs import log_plan_evaluation
        from shard_ray.tracking.report_process import ReportProcess

    # the MLflow run's modules imported in a process of its own from now, beside the gang's and the models' (torch,
    # Ray)
    with ReportProcess(tracking_uri, [log_plan_evaluation]) if tracking_uri else contextlib.nullcontext() as report:
        connect(args, min_cpus=plan.num_devices, hosts=topology.num_hosts, optimizer=topology.optimizer)
        # the gang and the models once the input and the cluster are known good: a refusal above answers at once
        from shard_ray.costmodel.models import models_for
        from shard_ray.costmodel.simulator import price_comm
        from shard_ray.placement.base import priced
        from shard_ray.profiling.gang import DeviceGang

        with DeviceGang(plan.num_devices, devices_per_host=topology.devices_per_host, comm_pricer=price_comm) as gang:
            if report is not None:
                report.wait_until_imported()  # before measuring: its cores are the gang's
            cost = gang.evaluate_rounds([plan], tables, config, flags.rounds)[0]
        write_json(flags.out, cost.model_dump(mode="json"))  # what was measured, whatever pricing it meets
        # the models' price for this batch, by the models that priced the plan when it was made, else those `plan`
        # picks for the gang's hardware
        made_with = plan.estimate.cost_model if plan.estimate else None
        gone = made_with is not None and not Path(made_with).is_file()
        plan = priced(plan, tables, topology, None if gone else made_with, cost.hardware)
        print(format_plan_summary(plan, tables, topology, cost))
        print(format_prediction(plan.estimate, cost.cost_ms, cost.priced_parts))
        print(plan.estimate.provenance)
        say_warnings([plan], {plan.algorithm: cost}, set(gang.warnings))
        newer = models_for(cost.hardware, topology.devices_per_host_if_spanning, tables)
        if gone:
            print(f"note: the models this plan was made with, {made_with}, are not there now: priced by {newer}")
        elif made_with and newer.resolve() != Path(made_with).resolve():
            print(
                f"note: the prices above are by the models this plan was made with, {made_with}; `shard-ray plan` "
                f"without --cost-model prices these tables with {newer}, and may place them otherwise"
            )
        if cost.rounds is not None:
            print(f"median of the rounds: {cost.rounds.describe()} (the table above is the median round)")
            print(
                "the interval is this run's: separate runs can differ by more (on a shared or virtual machine, by"
                " several percent); compare plans side by side in one run with `shard-ray compare`"
            )
        if report is not None:
            task = flags.task or Path(flags.tables).stem
            run_id = report.call(log_plan_evaluation, plan, cost, topology, task, tables, tracking_uri, experiment)
            print(f"logged MLflow run {run_id} to {tracking_uri}")
        print(f"wrote {flags.out}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "profile")
    add_settings(p, ProfileArgs)
    add_settings(p, MeasureArgs)
    add_ray(p)
    p.set_defaults(run=cmd_profile)

    p = add_command(sub, "collect")
    add_settings(p, CollectArgs)
    add_settings(p, CollectConfig)
    add_ray(p)
    p.set_defaults(run=cmd_collect)

    p = add_command(sub, "compare")
    add_settings(p, CompareArgs)
    add_settings(p, CompareConfig)
    add_settings(p, TopologyArgs, exclude=("devices_per_host", "inter_host_gbps", "intra_host_gbps", "host_link_gbps"))
    add_settings(p, MeasureArgs, exclude=("max_rows",))
    add_ray(p)
    add_tracking(p)
    p.set_defaults(run=cmd_compare)

    p = add_command(sub, "evaluate")
    add_settings(p, EvaluateArgs)
    add_settings(p, TopologyArgs)
    add_settings(p, MeasureArgs)
    add_ray(p)
    add_tracking(p)
    p.set_defaults(run=cmd_evaluate)
