"""The `shard-ray` command. Every subcommand is documented in the README.

User errors print one line, `shard-ray: error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shard_ray.errors import ShardRayError

if TYPE_CHECKING:
    from shard_ray.costmodel.train import TrainConfig
    from shard_ray.plan.topology import Topology
    from shard_ray.policy.ppo import PolicyConfig
    from shard_ray.tuning.sweep import SweepConfig

DEFAULT_STORE = "shard-ray-out/measurements.db"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dims(text: str) -> tuple[int, ...]:
    dims = _positive_ints(text)
    if any(d % 4 for d in dims):
        raise argparse.ArgumentTypeError("dims must be positive multiples of 4")
    return dims


def _add_measure_flags(parser: argparse.ArgumentParser, batch_default: int | None = 1024) -> None:
    parser.add_argument(
        "--batch-size", type=_positive_int, default=batch_default, help="global batch size (default %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default %(default)s)")
    parser.add_argument(
        "--repeats", type=_positive_int, default=10, help="timed steps; medians are reported (default %(default)s)"
    )
    parser.add_argument(
        "--max-rows",
        type=_positive_int,
        default=None,
        help="rows allocated per table (default: 200000 on CPU, all on GPU)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")


def _add_tracking_flags(parser: argparse.ArgumentParser, experiment: str = "shard-ray") -> None:
    parser.add_argument(
        "--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)"
    )
    parser.add_argument("--experiment", default=experiment, help="MLflow experiment (default %(default)s)")


def _policy_flags(parser: argparse.ArgumentParser, experiment: str = "shard-ray") -> None:
    parser.add_argument("--pool", required=True, help="table file tasks are drawn from (e.g. tasks/train_pool.json)")
    parser.add_argument(
        "--out", required=True, help="folder for the checkpoint and policy.pt; an existing one is resumed"
    )
    parser.add_argument(
        "--train-batch", type=_positive_int, default=2048, help="tables placed per iteration (default %(default)s)"
    )
    parser.add_argument("--minibatch", type=_positive_int, default=None, help="SGD minibatch (default 256)")
    parser.add_argument("--lr", type=_positive_float, default=None, help="Adam learning rate (default 0.001)")
    parser.add_argument("--hidden", type=_positive_int, default=None, help="network width (default 128)")
    parser.add_argument(
        "--config", default=None, help="tuned PPO settings (best.json of `tune policy`); flags given override them"
    )
    parser.add_argument(
        "--min-tables", type=_positive_int, default=15, help="fewest tables in a training task (default %(default)s)"
    )
    parser.add_argument(
        "--max-tables", type=_positive_int, default=25, help="most tables in a training task (default %(default)s)"
    )
    parser.add_argument(
        "--devices",
        type=_positive_ints,
        default=(4,),
        help="device counts of training tasks, comma-separated (default 4)",
    )
    parser.add_argument(
        "--max-devices",
        type=_positive_int,
        default=8,
        help="observations are padded to this many devices (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, default=1024, help="global batch size priced (default %(default)s)"
    )
    parser.add_argument(
        "--env-runners",
        type=int,
        default=0,
        help="RLlib env runner actors; 0 samples in the driver (default %(default)s)",
    )
    parser.add_argument(
        "--learners", type=int, default=0, help="RLlib learner actors, on GPUs when there are any (default %(default)s)"
    )
    parser.add_argument(
        "--cost-model", default=None, help="cost model file pricing the MDP (default: the shipped CPU models)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log MLflow runs")
    _add_tracking_flags(parser, experiment)


def _sweep_flags(parser: argparse.ArgumentParser, kind: str, samples: int) -> None:
    parser.add_argument("--samples", type=_positive_int, default=samples, help="trials in all (default %(default)s)")
    parser.add_argument(
        "--search", choices=["optuna", "random"], default="optuna", help="how trials are chosen (default %(default)s)"
    )
    parser.add_argument(
        "--max-concurrent", type=_positive_int, default=2, help="trials at once, one CPU each (default %(default)s)"
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=2,
        help="retries of a failed trial before it is left out (default %(default)s)",
    )
    if kind != "policy":  # the policy flags bring these
        parser.add_argument("--no-mlflow", action="store_true", help="do not log MLflow runs")
        parser.add_argument(
            "--out", required=True, help="sweep folder: best.json, trials.csv, tune/; an existing one is resumed"
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)"
        )
        _add_tracking_flags(parser, experiment=f"shard-ray-tune-{kind}")


def _topology_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--devices", type=_positive_int, required=required, help="number of devices")
    parser.add_argument(
        "--memory-gb",
        type=_positive_float,
        required=required,
        help="memory cap per device in GiB (weights + optimizer state)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["rowwise_adagrad", "sgd", "adam"],
        default=None,
        help="optimizer whose state counts towards memory (default rowwise_adagrad)",
    )


# ---------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> None:
    from shard_ray.workload.dlrm_dataset import tables_from_dataset
    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    if args.from_dataset:
        tables = tables_from_dataset(args.from_dataset, dim=args.dim)
        source = {"source": str(Path(args.from_dataset).resolve())}
    else:
        tables = generate_pool(PoolConfig(num_tables=args.num_tables, seed=args.seed))
        source = {"source": "synthetic", "seed": args.seed}
    save_tables(args.out, tables, **source)
    print(f"wrote {len(tables)} tables to {args.out}")


def cmd_tasks(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables
    from shard_ray.workload.tasks import TaskConfig, write_tasks

    pool = load_tables(args.pool)
    config = TaskConfig(
        num_tasks=args.num_tasks,
        min_tables=args.min_tables,
        max_tables=args.max_tables,
        dims=args.dims,
        test_fraction=args.test_fraction,
        seed=args.seed,
    )
    paths = write_tasks(pool, config, args.out_dir)
    print(
        f"wrote {len(paths) - 2} task files ({args.num_tasks} train, {args.num_tasks} test) "
        f"and the train_pool.json / test_pool.json they were drawn from to {args.out_dir}"
    )


def cmd_algorithms(args: argparse.Namespace) -> None:
    from shard_ray.placement import algorithms

    for info in algorithms():
        print(f"{info.name:<20} {info.family:<10} {info.description}")


def _topology(args: argparse.Namespace, plan_settings: dict | None = None) -> Topology:
    from shard_ray.plan.topology import GB, Topology

    settings = plan_settings or {}
    memory_gb = args.memory_gb if args.memory_gb is not None else settings.get("memory_gb")
    if memory_gb is None:
        raise ShardRayError("give --memory-gb (the plan file does not record its memory cap)")
    return Topology(
        num_devices=args.devices,
        memory_bytes=int(memory_gb * GB),
        batch_size=args.batch_size or settings.get("batch_size", 1024),
        optimizer=args.optimizer or settings.get("optimizer", "rowwise_adagrad"),
    )


def cmd_plan(args: argparse.Namespace) -> None:
    from shard_ray.placement import place
    from shard_ray.plan.cost import PlanCost
    from shard_ray.plan.plan import save_plan
    from shard_ray.plan.summary import format_plan_summary
    from shard_ray.workload.tables import load_tables

    tables = load_tables(args.tables)
    topology = _topology(args)
    plan = place(
        args.algo,
        tables,
        topology,
        seed=args.seed,
        cost_model=args.cost_model,
        policy=args.policy,
        samples=args.samples,
        search_config=args.search_config,
    )
    save_plan(args.out, plan)
    predicted = plan.metadata.get("predicted")
    print(
        format_plan_summary(
            plan, tables, topology, PlanCost.model_validate(predicted) if predicted else None, "simulated"
        )
    )
    if "lower_bound_ms" in plan.metadata:
        print(f"lower bound on the simulated cost: {plan.metadata['lower_bound_ms']:.3f} ms")
    print(f"placed {len(tables)} tables in {plan.placement_seconds * 1e3:.2f} ms; wrote {args.out}")


def cmd_profile(args: argparse.Namespace) -> None:
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.fused_shard import MeasureConfig
    from shard_ray.profiling.sampling import draw_shards
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.runtime import connect_ray
    from shard_ray.workload.tables import load_tables

    tables = load_tables(args.tables)
    config = MeasureConfig(
        batch_size=args.batch_size, warmup=args.warmup, repeats=args.repeats, max_rows=args.max_rows, seed=args.seed
    )
    shards = draw_shards(tables, args.shards, args.max_tables, seed=args.seed, singles=not args.no_singles)
    print(connect_ray(args.address, min_cpus=args.actors))
    pool = ProfilingPool(args.actors)
    with MeasurementStore(args.store) as store:
        before = store.count()
        results = pool.measure(shards, config, store)
        pool.shutdown()
        added = store.count() - before
        ok = [m for m in results if m.status == "ok"]
        print(
            f"{len(shards)} shards on {pool.hardware}: {added} measured now, {len(shards) - added} already in {args.store}"
        )
        print(f"{len(ok)} ok, {len(results) - len(ok)} infeasible; store holds {store.count()} measurements")
        if ok:
            fwd = sorted(m.fwd_ms for m in ok)
            bwd = sorted(m.bwd_ms for m in ok)
            print(f"forward ms: min {fwd[0]:.3f}, median {fwd[len(fwd) // 2]:.3f}, max {fwd[-1]:.3f}")
            print(f"backward ms: min {bwd[0]:.3f}, median {bwd[len(bwd) // 2]:.3f}, max {bwd[-1]:.3f}")


def cmd_collect(args: argparse.Namespace) -> None:
    from shard_ray.costmodel.collect import CollectConfig, collect_comm, collect_compute
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.runtime import connect_ray
    from shard_ray.workload.tables import load_tables

    pool = load_tables(args.pool)
    config = CollectConfig(
        samples=args.samples,
        min_tables=args.min_tables,
        max_tables=args.max_tables,
        batch_sizes=args.batch_sizes,
        device_counts=args.device_counts,
        repeats=args.repeats,
        seed=args.seed,
    )
    print(connect_ray(args.address, min_cpus=max(args.actors, *args.device_counts)))
    with MeasurementStore(args.store) as store:
        if args.kind == "compute":
            profiler = ProfilingPool(args.actors)
            try:
                added = collect_compute(pool, config, profiler, store)
            finally:
                profiler.shutdown()
            print(f"{added} new shard measurements; the store holds {store.count()} ({args.store})")
        else:
            added = collect_comm(pool, config, store)
            print(f"{added} new plan measurements; the store holds {store.count('plan_measurements')} ({args.store})")


def cmd_costmodel_train(args: argparse.Namespace) -> None:
    from shard_ray.costmodel.train import describe_accuracy, train_cost_models
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.workload.tables import load_tables

    train_tables = {t.name for t in load_tables(args.train_pool)}
    config = _train_config(args)
    if not Path(args.store).is_file():
        raise ShardRayError(f"measurement store not found: {args.store}")
    with MeasurementStore(args.store) as store:
        models, report = train_cost_models(store, train_tables, config, args.hardware)
    models.save(args.out)
    for name, metrics in report.items():
        print(describe_accuracy(name, metrics))
    print(f"wrote {args.out} (models of {models.hardware})")
    print(json.dumps(report))


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """Flags given win over the tuned file (`--config`), which wins over TrainConfig's defaults."""
    from dataclasses import asdict

    from shard_ray.costmodel.train import TrainConfig
    from shard_ray.tuning.sweep import dataclass_from, load_tuned

    values = asdict(TrainConfig())
    if args.config:
        values.update(load_tuned(args.config, "costmodel"))
    given = {
        "hidden": args.hidden,
        "depth": args.depth,
        "lr": args.lr,
        "max_epochs": args.epochs,
        "patience": args.patience,
        "loss": args.loss,
        "feature_scaling": args.feature_scaling,
        "seed": args.seed,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    return dataclass_from(TrainConfig, values, "cost-model training settings")


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
    from shard_ray.tracking.mlflow_runs import default_tracking_uri, log_costmodel_evaluation

    models = CostModels.load(args.model)
    if not Path(args.data).is_file():
        raise ShardRayError(f"measurement store not found: {args.data}")
    with MeasurementStore(args.data) as store:
        splits = split_compute_measurements(
            store.measurements(models.hardware), set(models.info.get("train_tables", []))
        )
        plans = store.plan_measurements(models.hardware)
    groups = {name: predicted_and_measured(models, splits[name]) for name in ("test", "unseen")}
    result = accuracy(*map(np.concatenate, zip(*groups.values())))
    result["seen"] = accuracy(*groups["test"])
    result["unseen"] = accuracy(*groups["unseen"])
    result["comm"] = evaluate_comm(models, [p for p in plans if data_split(p.key) == "test"])
    if result["n"] == 0:
        raise ShardRayError(f"{args.data} has no held-out or unseen shard measurements on {models.hardware}")
    for name in ("seen", "unseen", "comm"):
        print(describe_accuracy(name, result[name]))
    if not args.no_mlflow:
        flat = {"mape": result["mape"], "spearman": result["spearman"]}
        flat.update({f"{k}_{m}": result[k][m] for k in ("seen", "unseen", "comm") for m in ("mape", "spearman")})
        flat = {k: v for k, v in flat.items() if v is not None}
        log_costmodel_evaluation(
            args.model,
            models.hardware,
            flat,
            {
                "held-out, seen tables": tuple(v.tolist() for v in groups["test"]),
                "unseen tables": tuple(v.tolist() for v in groups["unseen"]),
            },
            args.tracking_uri or default_tracking_uri(),
            args.experiment,
        )
    print(json.dumps(result))


def _policy_config(args: argparse.Namespace) -> PolicyConfig:
    """The flags' PolicyConfig: a flag given wins over the tuned file (`--config`), which wins over the defaults."""
    from dataclasses import asdict

    from shard_ray.policy.ppo import PolicyConfig
    from shard_ray.tuning.sweep import dataclass_from, load_tuned

    values = asdict(PolicyConfig())
    if getattr(args, "config", None):
        values.update(load_tuned(args.config, "policy"))
    given = {"lr": args.lr, "hidden": args.hidden, "minibatch_size": args.minibatch}
    values.update({k: v for k, v in given.items() if v is not None})
    values.update(
        iterations=getattr(args, "iterations", 1),
        train_batch_size=args.train_batch,
        minibatch_size=min(values["minibatch_size"], args.train_batch),
        num_env_runners=args.env_runners,
        num_learners=args.learners,
        min_tables=args.min_tables,
        max_tables=args.max_tables,
        devices=args.devices,
        max_devices=max(args.max_devices, max(args.devices)),
        batch_size=args.batch_size,
        seed=args.seed,
    )
    return dataclass_from(PolicyConfig, values, "policy settings")


def _check_policy_inputs(config: PolicyConfig, pool: list, cost_model: str | None) -> None:
    """Refuse bad settings, pools and model files before Ray starts."""
    from shard_ray.costmodel.models import CostModels
    from shard_ray.policy.ppo import env_config

    config.check()
    if cost_model is not None:
        CostModels.load(cost_model)
    env_config(config, pool, cost_model).check()


def cmd_policy_train(args: argparse.Namespace) -> None:
    from shard_ray.policy.ppo import train_policy
    from shard_ray.runtime import connect_ray
    from shard_ray.tracking.mlflow_runs import default_tracking_uri
    from shard_ray.workload.tables import load_tables

    pool = load_tables(args.pool)
    config = _policy_config(args)
    _check_policy_inputs(config, pool, args.cost_model)
    print(connect_ray(args.address, min_cpus=1 + args.env_runners))
    tracking_uri = None if args.no_mlflow else args.tracking_uri or default_tracking_uri()
    policy_file = train_policy(pool, config, args.out, args.cost_model, tracking_uri, args.experiment)
    print(f"policy: {policy_file} (place with: shard-ray plan --algo dreamshard --policy {policy_file} ...)")


def cmd_policy_outer_loop(args: argparse.Namespace) -> None:
    from shard_ray.policy.outer_loop import OuterLoopConfig, run_outer_loop
    from shard_ray.runtime import connect_ray
    from shard_ray.tracking.mlflow_runs import default_tracking_uri
    from shard_ray.workload.tables import load_tables

    pool = load_tables(args.pool)
    config = _policy_config(args)
    _check_policy_inputs(config, pool, args.cost_model)
    loop = OuterLoopConfig(
        rounds=args.rounds,
        tasks_per_round=args.tasks_per_round,
        ppo_iterations_per_round=args.ppo_iterations,
        gang_devices=args.gang_devices,
        profiling_actors=args.actors,
        repeats=args.repeats,
        update_epochs=args.update_epochs,
        seed=args.seed,
    )
    loop.check()
    print(connect_ray(args.address, min_cpus=args.gang_devices + args.actors))
    tracking_uri = None if args.no_mlflow else args.tracking_uri or default_tracking_uri()
    policy_file = run_outer_loop(
        pool, config, loop, args.out, args.store, args.cost_model, tracking_uri, args.experiment
    )
    print(f"policy: {policy_file}; updated cost models: {Path(args.out) / 'costmodels.pt'}")


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    from shard_ray.tuning.sweep import SweepConfig

    config = SweepConfig(
        samples=args.samples,
        search=args.search,
        max_concurrent=args.max_concurrent,
        max_failures=args.max_failures,
        seed=args.seed,
    )
    config.check()
    return config


def _sweep_tracking(args: argparse.Namespace) -> str | None:
    from shard_ray.tracking.mlflow_runs import default_tracking_uri

    return None if args.no_mlflow else args.tracking_uri or default_tracking_uri()


def _report_sweep(best: Path) -> None:
    document = json.loads(best.read_text())
    print(f"best {document['metric']} {document['value']:.4f}; wrote {best} and {best.parent / 'trials.csv'}")
    print(
        json.dumps(
            {"best": str(best), "metric": document["metric"], "value": document["value"], "config": document["config"]}
        )
    )


def cmd_tune_costmodel(args: argparse.Namespace) -> None:
    from shard_ray.runtime import connect_ray
    from shard_ray.tuning.costmodel_sweep import CostModelSweepConfig, tune_cost_models
    from shard_ray.workload.tables import load_tables

    train_tables = {t.name for t in load_tables(args.train_pool)}
    sweep = _sweep_config(args)
    settings = CostModelSweepConfig(
        max_epochs=args.max_epochs, report_every=args.report_every, grace_reports=args.grace_reports, seed=args.seed
    )
    settings.check()
    if not Path(args.store).is_file():
        raise ShardRayError(f"measurement store not found: {args.store}")
    print(connect_ray(args.address))
    _report_sweep(
        tune_cost_models(
            args.store, train_tables, sweep, settings, args.out, _sweep_tracking(args), args.experiment, args.hardware
        )
    )


def cmd_tune_search(args: argparse.Namespace) -> None:
    from shard_ray.costmodel.models import CostModels
    from shard_ray.runtime import connect_ray
    from shard_ray.tuning.search_sweep import SearchSweepConfig, tune_search
    from shard_ray.workload.tables import load_tables

    pool = load_tables(args.pool)
    sweep = _sweep_config(args)
    settings = SearchSweepConfig(
        tasks=args.tasks,
        min_tables=args.min_tables,
        max_tables=args.max_tables,
        devices=args.devices,
        memory_headroom=args.memory_headroom,
        batch_size=args.batch_size,
        time_budget_s=args.time_budget,
        measure_top=args.measure_top,
        measure_tasks=args.measure_tasks,
        repeats=args.repeats,
        seed=args.seed,
    )
    settings.check()
    if len(pool) < settings.max_tables:
        raise ShardRayError(
            f"the pool has {len(pool)} tables; tasks of up to {settings.max_tables} need at least that many"
        )
    if args.cost_model is not None:
        CostModels.load(args.cost_model)
    print(connect_ray(args.address, min_cpus=settings.devices))
    _report_sweep(tune_search(pool, sweep, settings, args.out, _sweep_tracking(args), args.experiment, args.cost_model))


def cmd_tune_policy(args: argparse.Namespace) -> None:
    from shard_ray.runtime import connect_ray
    from shard_ray.tuning.policy_sweep import PolicySweepConfig, tune_policy
    from shard_ray.workload.tables import load_tables

    pool = load_tables(args.pool)
    base = _policy_config(args)
    _check_policy_inputs(base, pool, args.cost_model)
    sweep = _sweep_config(args)
    settings = PolicySweepConfig(grace_iterations=args.grace_iterations, validation_tasks=args.validation_tasks)
    settings.check()
    print(connect_ray(args.address))
    _report_sweep(
        tune_policy(pool, base, sweep, settings, args.out, _sweep_tracking(args), args.experiment, args.cost_model)
    )


def cmd_evaluate(args: argparse.Namespace) -> None:
    from shard_ray.io import write_json
    from shard_ray.plan.plan import load_plan
    from shard_ray.plan.summary import format_plan_summary
    from shard_ray.profiling.fused_shard import MeasureConfig
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.runtime import connect_ray
    from shard_ray.tracking.mlflow_runs import default_tracking_uri, log_plan_evaluation
    from shard_ray.workload.tables import load_tables

    tables = load_tables(args.tables)
    plan = load_plan(args.plan)
    plan.check(tables)
    args.devices = plan.num_devices
    topology = _topology(args, plan.metadata.get("settings"))
    plan.check_memory(tables, topology)
    config = MeasureConfig.for_topology(topology, warmup=args.warmup, repeats=args.repeats, max_rows=args.max_rows)
    print(connect_ray(args.address, min_cpus=plan.num_devices))
    gang = DeviceGang(plan.num_devices)
    for warning in gang.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        cost = gang.evaluate(plan, tables, config)
    finally:
        gang.shutdown()
    write_json(args.out, cost.model_dump(mode="json"))
    print(format_plan_summary(plan, tables, topology, cost))
    if not args.no_mlflow:
        uri = args.tracking_uri or default_tracking_uri()
        task = args.task or Path(args.tables).stem
        run_id = log_plan_evaluation(plan, cost, topology, task, len(tables), uri, args.experiment)
        print(f"logged MLflow run {run_id} to {uri}")
    print(f"wrote {args.out}")


def cmd_bench(args: argparse.Namespace) -> None:
    from shard_ray.benchmark import BenchmarkConfig, headline, run_benchmark
    from shard_ray.runtime import connect_ray
    from shard_ray.tracking.mlflow_runs import default_tracking_uri
    from shard_ray.workload.tables import load_tables

    table_files = tuple(
        path for given in args.tables or () for path in given.split(",")
    )  # a config's list arrives comma-joined
    config = BenchmarkConfig(
        tasks=args.tasks,
        min_tables=args.min_tables,
        max_tables=args.max_tables,
        table_files=table_files,
        devices=args.devices,
        batch_size=args.batch_size,
        repeats=args.repeats,
        memory_headroom=args.memory_headroom,
        cost_model=args.cost_model,
        policy=args.policy,
        algorithms=tuple(args.algorithms.split(",")) if args.algorithms else (),
        seed=args.seed,
        out=args.out,
        tracking_uri=None if args.no_mlflow else args.tracking_uri or default_tracking_uri(),
        experiment=args.experiment,
    )
    config.check()
    for path in config.table_files:  # refuse bad table files before Ray starts
        load_tables(path)
    print(connect_ray(args.address, min_cpus=args.devices))
    report = run_benchmark(config)
    print(f"wrote benchmark.md, .csv, .png and .json to {args.out}")
    print(json.dumps(headline(report)))


def cmd_export(args: argparse.Namespace) -> None:
    from shard_ray.interop.torchrec import export_plan, save_export
    from shard_ray.plan.plan import load_plan
    from shard_ray.workload.tables import load_tables

    tables = load_tables(args.tables)
    plan = load_plan(args.plan)
    exported = export_plan(plan, tables, module_path=args.module_path, device_type=args.device)
    save_export(args.out, exported)
    column_wise = sum(t.sharding_type == "column_wise" for t in exported.tables.values())
    print(
        f"wrote {args.out}: {len(exported.tables)} tables on {exported.world_size} ranks "
        f"({len(exported.tables) - column_wise} table-wise, {column_wise} column-wise) for module {args.module_path!r}"
    )
    print(
        f"use: plan = shard_ray.interop.torchrec.load_sharding_plan({str(args.out)!r}); DistributedModelParallel(model, plan=plan, ...)"
    )


def cmd_demo(args: argparse.Namespace) -> None:
    from shard_ray.demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(
            workdir=Path(args.workdir),
            num_devices=args.devices,
            min_tables=args.tables,
            max_tables=args.tables,
            profile_shards=args.profile_shards,
            seed=args.seed,
            tracking_uri=args.tracking_uri,
            experiment=args.experiment,
            address=args.address,
        )
    )


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shard-ray", description="Shard embedding tables over devices; measure the plans on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "generate", help="write a synthetic DLRM-like table pool, or derive one from a dlrm_datasets file"
    )
    p.add_argument("--out", required=True, help="table file to write (.json)")
    p.add_argument("--num-tables", type=_positive_int, default=856, help="tables in the pool (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-dataset", default=None, help="a dlrm_datasets file (indices, offsets, lengths; plain or gzipped)"
    )
    p.add_argument(
        "--dim", type=int, default=64, help="dim given to tables derived from a dataset (default %(default)s)"
    )
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("tasks", help="split a pool into train/test pools and draw task table files from each")
    p.add_argument("--pool", required=True, help="table file of the pool")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--num-tasks", type=_positive_int, default=10, help="tasks per split (default %(default)s)")
    p.add_argument("--min-tables", type=_positive_int, default=10)
    p.add_argument("--max-tables", type=_positive_int, default=40)
    p.add_argument("--dims", type=_dims, default=(16, 32, 64, 128), help="dims tables are given, comma-separated")
    p.add_argument("--test-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_tasks)

    p = sub.add_parser("algorithms", help="list the placement algorithms")
    p.set_defaults(run=cmd_algorithms)

    p = sub.add_parser("plan", help="place a table file's tables on devices and write a plan")
    p.add_argument("--tables", required=True)
    _topology_flags(p, required=True)
    p.add_argument("--algo", required=True, help="algorithm name (see `shard-ray algorithms`)")
    p.add_argument("--batch-size", type=_positive_int, default=1024, help="global batch size (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cost-model", default=None, help="cost model file for search algorithms (default: the shipped CPU models)"
    )
    p.add_argument(
        "--policy",
        default=None,
        help="policy file or `policy train` folder for dreamshard (default: the shipped policy)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=0,
        help="dreamshard: also sample this many plans, keep the best simulated (default 0)",
    )
    p.add_argument(
        "--search-config", default=None, help="cost_search: tuned search settings (best.json of `tune search`)"
    )
    p.add_argument("--out", required=True, help="plan file to write (.json)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("profile", help="measure fused shards of a table file on Ray profiling actors")
    p.add_argument("--tables", required=True)
    p.add_argument("--shards", type=int, default=20, help="random multi-table shards to measure (default %(default)s)")
    p.add_argument(
        "--max-tables", type=_positive_int, default=8, help="most tables in a random shard (default %(default)s)"
    )
    p.add_argument("--no-singles", action="store_true", help="do not also measure every table alone")
    p.add_argument(
        "--actors", type=_positive_int, default=2, help="profiling actors, one device each (default %(default)s)"
    )
    p.add_argument("--store", default=DEFAULT_STORE, help="measurement store, SQLite (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    _add_measure_flags(p)
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser(
        "collect", help="measure cost-model training data: random fused shards (compute) or plans (comm)"
    )
    p.add_argument("--kind", choices=["compute", "comm"], required=True)
    p.add_argument("--pool", required=True, help="table file the samples are drawn from (e.g. tasks/train_pool.json)")
    p.add_argument(
        "--samples", type=_positive_int, default=500, help="shards (compute) or plans per device count (comm)"
    )
    p.add_argument(
        "--min-tables", type=_positive_int, default=1, help="fewest tables in a compute shard (default %(default)s)"
    )
    p.add_argument(
        "--max-tables", type=_positive_int, default=16, help="most tables in a compute shard (default %(default)s)"
    )
    p.add_argument(
        "--batch-sizes",
        type=_positive_ints,
        default=(512, 1024, 2048),
        help="batch sizes, comma-separated, used in turn",
    )
    p.add_argument(
        "--device-counts",
        type=_positive_ints,
        default=(2,),
        help="gang sizes for comm data, comma-separated (default 2)",
    )
    p.add_argument(
        "--actors", type=_positive_int, default=2, help="profiling actors for compute data (default %(default)s)"
    )
    p.add_argument("--repeats", type=_positive_int, default=7, help="timed steps per sample (default %(default)s)")
    p.add_argument("--store", default=DEFAULT_STORE, help="measurement store (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.set_defaults(run=cmd_collect)

    p = sub.add_parser("costmodel", help="train or evaluate the neural cost models")
    models_sub = p.add_subparsers(dest="costmodel_command", required=True, parser_class=_Parser)
    q = models_sub.add_parser("train", help="train compute and communication models on a measurement store")
    q.add_argument("--store", default=DEFAULT_STORE, help="measurement store (default %(default)s)")
    q.add_argument(
        "--train-pool",
        required=True,
        help="table file of the training pool; shards of other tables are held out as unseen",
    )
    q.add_argument("--out", required=True, help="model file to write (.pt)")
    q.add_argument(
        "--config",
        default=None,
        help="tuned training settings (best.json of `tune costmodel`); flags given override them",
    )
    q.add_argument("--hidden", type=_positive_int, default=None, help="encoder width (default 128)")
    q.add_argument("--depth", type=_positive_int, default=None, help="encoder layers (default 2)")
    q.add_argument("--lr", type=_positive_float, default=None, help="learning rate (default 0.002)")
    q.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="most epochs; early stopping usually ends sooner (default 400)",
    )
    q.add_argument(
        "--patience",
        type=_positive_int,
        default=None,
        help="epochs without validation gain before stopping (default 40)",
    )
    q.add_argument("--loss", choices=["mse", "huber", "l1"], default=None, help="loss on log ms (default mse)")
    q.add_argument(
        "--feature-scaling", choices=["standardise", "minmax", "none"], default=None, help="(default standardise)"
    )
    q.add_argument(
        "--hardware", default=None, help="train on this hardware's measurements (default: the most measured)"
    )
    q.add_argument("--seed", type=int, default=None, help="(default 0)")
    q.set_defaults(run=cmd_costmodel_train)
    q = models_sub.add_parser("evaluate", help="held-out accuracy of cost models; the last line is JSON")
    q.add_argument("--model", required=True)
    q.add_argument("--data", required=True, help="measurement store with held-out or unseen measurements")
    q.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    _add_tracking_flags(q)
    q.set_defaults(run=cmd_costmodel_evaluate)

    p = sub.add_parser("policy", help="train DreamShard placement policies with RLlib")
    policy_sub = p.add_subparsers(dest="policy_command", required=True, parser_class=_Parser)
    q = policy_sub.add_parser(
        "train", help="PPO on the cost models' estimated MDP; resumes from the folder's checkpoint"
    )
    q.add_argument("--iterations", type=_positive_int, default=30, help="PPO iterations in all (default %(default)s)")
    _policy_flags(q)
    q.set_defaults(run=cmd_policy_train)
    q = policy_sub.add_parser(
        "outer-loop", help="DreamShard's loop: measure the policy's plans, update the cost models, PPO again; resumes"
    )
    q.add_argument(
        "--rounds", type=_positive_int, default=5, help="rounds of measure / update / train (default %(default)s)"
    )
    q.add_argument(
        "--tasks-per-round", type=_positive_int, default=4, help="policy plans measured per round (default %(default)s)"
    )
    q.add_argument(
        "--ppo-iterations", type=_positive_int, default=10, help="PPO iterations per round (default %(default)s)"
    )
    q.add_argument(
        "--gang-devices", type=_positive_int, default=2, help="devices of the measuring gang (default %(default)s)"
    )
    q.add_argument("--actors", type=_positive_int, default=2, help="profiling actors (default %(default)s)")
    q.add_argument("--repeats", type=_positive_int, default=7, help="timed steps per measurement (default %(default)s)")
    q.add_argument(
        "--update-epochs",
        type=_positive_int,
        default=40,
        help="most epochs of each cost-model update (default %(default)s)",
    )
    q.add_argument("--store", default=None, help="measurement store (default: measurements.db in --out)")
    _policy_flags(q)
    q.set_defaults(run=cmd_policy_outer_loop)

    p = sub.add_parser("tune", help="Ray Tune sweeps of the cost-model, search and PPO hyperparameters; resumable")
    tune_sub = p.add_subparsers(dest="tune_command", required=True, parser_class=_Parser)
    q = tune_sub.add_parser(
        "costmodel", help="sweep the compute cost model's training (objective: validation MAPE, ASHA)"
    )
    q.add_argument("--store", default=DEFAULT_STORE, help="measurement store (default %(default)s)")
    q.add_argument("--train-pool", required=True, help="table file of the training pool (as for `costmodel train`)")
    q.add_argument(
        "--max-epochs",
        type=_positive_int,
        default=300,
        help="largest epoch budget a trial may draw (default %(default)s)",
    )
    q.add_argument(
        "--report-every", type=_positive_int, default=10, help="epochs between a trial's reports (default %(default)s)"
    )
    q.add_argument(
        "--grace-reports",
        type=_positive_int,
        default=3,
        help="reports before ASHA may stop a trial (default %(default)s)",
    )
    q.add_argument(
        "--hardware", default=None, help="sweep on this hardware's measurements (default: the most measured)"
    )
    _sweep_flags(q, "costmodel", samples=16)
    q.set_defaults(run=cmd_tune_costmodel)
    q = tune_sub.add_parser(
        "search", help="sweep cost_search's settings: simulated on validation tasks, finalists measured"
    )
    q.add_argument(
        "--pool", required=True, help="table file validation tasks are drawn from (e.g. tasks/train_pool.json)"
    )
    q.add_argument("--tasks", type=_positive_int, default=8, help="validation tasks (default %(default)s)")
    q.add_argument("--min-tables", type=_positive_int, default=20, help="(default %(default)s)")
    q.add_argument("--max-tables", type=_positive_int, default=40, help="(default %(default)s)")
    q.add_argument(
        "--devices",
        type=_positive_int,
        default=2,
        help="devices of the tasks and the measuring gang (default %(default)s)",
    )
    q.add_argument(
        "--memory-headroom",
        type=float,
        default=1.5,
        help="memory cap over an even split of a task's bytes (default %(default)s)",
    )
    q.add_argument("--batch-size", type=_positive_int, default=1024, help="(default %(default)s)")
    q.add_argument(
        "--time-budget",
        type=_positive_float,
        default=3.0,
        help="anytime budget of each plan, seconds (default %(default)s)",
    )
    q.add_argument(
        "--measure-top",
        type=int,
        default=2,
        help="best simulated settings measured on the gang; 0: none (default %(default)s)",
    )
    q.add_argument(
        "--measure-tasks", type=_positive_int, default=3, help="validation tasks measured (default %(default)s)"
    )
    q.add_argument(
        "--repeats", type=_positive_int, default=5, help="timed steps per measured plan (default %(default)s)"
    )
    q.add_argument("--cost-model", default=None, help="cost model file (default: the shipped CPU models)")
    _sweep_flags(q, "search", samples=24)
    q.set_defaults(run=cmd_tune_search)
    q = tune_sub.add_parser(
        "policy", help="sweep PPO's hyperparameters (objective: simulated cost on validation tasks, ASHA)"
    )
    q.add_argument(
        "--iterations", type=_positive_int, default=20, help="PPO iterations of a trial at most (default %(default)s)"
    )
    q.add_argument(
        "--grace-iterations",
        type=_positive_int,
        default=3,
        help="iterations before ASHA may stop a trial (default %(default)s)",
    )
    q.add_argument(
        "--validation-tasks", type=_positive_int, default=8, help="tasks each trial is scored on (default %(default)s)"
    )
    _policy_flags(q, experiment="shard-ray-tune-policy")
    _sweep_flags(q, "policy", samples=8)
    q.set_defaults(run=cmd_tune_policy)

    p = sub.add_parser("evaluate", help="run a plan's real embedding step on a gang of Ray actors")
    p.add_argument("--tables", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True, help="result file to write (.json)")
    p.add_argument(
        "--memory-gb", type=_positive_float, default=None, help="memory cap per device (default: the plan's)"
    )
    p.add_argument("--optimizer", choices=["rowwise_adagrad", "sgd", "adam"], default=None)
    p.add_argument("--task", default=None, help="task name for MLflow (default: the table file's name)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    _add_measure_flags(p, batch_default=None)
    _add_tracking_flags(p)
    p.set_defaults(run=cmd_evaluate)

    p = sub.add_parser(
        "bench", help="the benchmark report: every algorithm on test tasks and table files, every plan measured"
    )
    p.add_argument(
        "--tasks", type=int, default=5, help="synthetic test-pool tasks; 0 for only --tables (default %(default)s)"
    )
    p.add_argument("--min-tables", type=_positive_int, default=20, help="(default %(default)s)")
    p.add_argument("--max-tables", type=_positive_int, default=40, help="(default %(default)s)")
    p.add_argument("--tables", action="append", help="a table file to benchmark as a task of its own; repeat for more")
    p.add_argument("--devices", type=_positive_int, default=2, help="devices of the gang (default %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=1024, help="(default %(default)s)")
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=10,
        help="timed steps per plan; medians are reported (default %(default)s)",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=1.5,
        help="memory cap over an even split of a task's bytes (default %(default)s)",
    )
    p.add_argument("--cost-model", default=None, help="cost model file (default: the shipped CPU models)")
    p.add_argument("--policy", default=None, help="policy for dreamshard (default: the shipped one)")
    p.add_argument(
        "--algorithms", default=None, help="comma-separated names (default: every one that handles the task)"
    )
    p.add_argument("--seed", type=int, default=100)
    p.add_argument(
        "--out",
        default="shard-ray-out/benchmark",
        help="report folder; an existing one is resumed (default %(default)s)",
    )
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log MLflow runs")
    _add_tracking_flags(p, experiment="shard-ray-benchmark")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("export", help="write a plan as a TorchRec ShardingPlan for DistributedModelParallel")
    p.add_argument("--plan", required=True, help="plan file to export")
    p.add_argument("--tables", required=True, help="the table file the plan places (for row counts)")
    p.add_argument("--format", choices=["torchrec"], default="torchrec", help="(default %(default)s)")
    p.add_argument(
        "--module-path",
        default="",
        help="the EmbeddingBagCollection's path in the model, e.g. sparse_arch.embedding_bag_collection (default: the model is the collection)",
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="device type of the ranks (default %(default)s)"
    )
    p.add_argument("--out", required=True, help="file to write (.json)")
    p.set_defaults(run=cmd_export)

    p = sub.add_parser(
        "demo", help="the main job end to end: pool, task, profiling, every algorithm, measured plans, MLflow"
    )
    p.add_argument("--workdir", default="shard-ray-out/demo", help="where files are written (default %(default)s)")
    p.add_argument("--devices", type=_positive_int, default=2, help="devices in the gang (default %(default)s)")
    p.add_argument("--tables", type=_positive_int, default=16, help="tables in the demo task (default %(default)s)")
    p.add_argument(
        "--profile-shards", type=int, default=12, help="random multi-table shards to profile (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    _add_tracking_flags(p)
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    try:
        run(args)
    except ShardRayError as err:
        print(f"shard-ray: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shard-ray: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
