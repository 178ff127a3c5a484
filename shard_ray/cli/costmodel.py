"""`costmodel train` and `costmodel evaluate`: the neural cost models and their held-out accuracy."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shard_ray.arguments import Parser
from shard_ray.cli.commands import add_command
from shard_ray.cli.common import DEFAULT_STORE, STORE_HELP, add_ray, add_tracking, connect, tracking
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.cli.planning import TopologyArgs
from shard_ray.configfile import setting
from shard_ray.costmodel.settings import TrainConfig
from shard_ray.errors import ShardRayError
from shard_ray.plan.topology import MAX_DEVICES

if TYPE_CHECKING:
    from shard_ray.costmodel.models import CostModels
    from shard_ray.workload.tables import TableSpec
from shard_ray.workflows.settings import CalibrateConfig


@dataclass(frozen=True)
class TrainArgs:
    tables: str = setting(
        None,
        "table file of the training pool; shards of other tables are held out as unseen",
        required=True,
        old_names=("--train-pool",),
    )
    out: str = setting(None, "model file to write (.pt)", required=True, new_file=True)
    store: str = setting(DEFAULT_STORE, STORE_HELP)
    config: str | None = setting(
        None, "tuned training settings (best.json of `tune costmodel`); flags given override them"
    )
    hardware: str | None = setting(None, "train on this hardware's measurements (default: the most measured)")


@dataclass(frozen=True)
class EvaluateModelArgs:
    cost_model: str = setting(None, "cost model file to evaluate", required=True, old_names=("--model",))
    store: str = setting(DEFAULT_STORE, "measurement store with held-out or unseen measurements", old_names=("--data",))
    hardware: str | None = setting(
        None,
        "evaluate on this hardware's measurements (default: the models' own if the store has them, else the most measured)",
    )


@dataclass(frozen=True)
class CalibrateArgs:
    tables: str = setting(None, "table file of the task to calibrate for", required=True)
    devices: int = setting(
        None,
        "devices the task is planned on (the gang measures all-to-alls at this count)",
        required=True,
        min=1,
        max=MAX_DEVICES,
    )
    cost_model: str | None = setting(
        None, "models to start from (default: those calibrated for this hardware, else the shipped ones)"
    )
    store: str = setting(DEFAULT_STORE, STORE_HELP)
    out: str | None = setting(
        None, "model file to write (default: these tables' file under ~/.shard-ray/models)", new_file=True
    )
    for_hardware: bool = setting(
        False,
        "also write the models as this hardware's own, which then price every other task on it "
        "(the demo's included) that has no models of its own",
    )


# Fewer held-out measurements than this judge a model's figures only roughly: said beside them.
FEW_HELD_OUT = 10


def cmd_costmodel_train(args: argparse.Namespace) -> None:
    from shard_ray.configfile import load_tuned
    from shard_ray.workload.tables import load_tables

    flags = settings_from(TrainArgs, args)
    train_tables = {t.name for t in load_tables(flags.tables)}
    config = settings_from(TrainConfig, args, tuned=load_tuned(flags.config, "costmodel") if flags.config else None)
    from shard_ray.profiling.store import MeasurementStore, existing_store

    with MeasurementStore(existing_store(flags.store)) as store:
        store.main_hardware(flags.hardware)  # a store of none of its measurements refused before torch loads
        # the input checked: what trains (torch) only now
        from shard_ray.costmodel.train import describe_accuracy, train_cost_models

        models, report = train_cost_models(store, train_tables, config, flags.hardware)
    models.save(flags.out)
    for name, metrics in report.items():
        print(describe_accuracy(name, metrics))
    few = [f"{name} n={metrics['n']}" for name, metrics in report.items() if 0 < metrics["n"] < FEW_HELD_OUT]
    if few:  # a walk's 12 plans left n=2 to judge the comm model, and nothing said so
        print(
            f"note: few held-out measurements judge {', '.join(few)}: those figures are indicative; `shard-ray collect` "
            "of more into the store (--samples: shards, or plans per device count) firms them up"
        )
    fwd, bwd = models.step_overhead_ms
    more = models.type_overhead_ms
    part, per_mb = models.all_reduce_ms
    print(
        f"overheads fitted to the train split's plans: a step's {fwd:.3f} ms forward and {bwd:.3f} ms backward a "
        f"device, an input all-to-all's {models.input_overhead_ms:.3f} ms a device and sharding type, each "
        f"sharding type beyond a plan's first {more[0]:.3f} ms input, {more[1]:.3f} forward, {more[2]:.3f} backward, "
        f"and the replicas' all-reduce {part:.3f} ms a device holding replicas plus {per_mb:.3f} ms per MB on the bus"
    )
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
        evaluate_device_compute,
        evaluate_input_dist,
        evaluate_mixed_comm,
        evaluate_replica_comm,
        newest_procedure,
        predicted_and_measured,
        split_compute_measurements,
    )
    from shard_ray.profiling.store import MeasurementStore, existing_store
    from shard_ray.tracking.mlflow_runs import log_costmodel_evaluation

    flags = settings_from(EvaluateModelArgs, args)
    tracking_uri, experiment = tracking(args)
    models = CostModels.load(flags.cost_model)
    with MeasurementStore(existing_store(flags.store)) as store:
        measured_on = store.summary()
        hardware = flags.hardware or (models.hardware if models.hardware in measured_on else None)
        hardware = store.main_hardware(hardware)
        splits = split_compute_measurements(
            newest_procedure(store.fused_shard_measurements(hardware)), set(models.info.train_tables)
        )
        plans = newest_procedure(store.plan_measurements(hardware))
    if hardware != models.hardware:
        # Another machine's data: every shard is new to the models, so all of it is held out.
        splits = {"test": [], "unseen": [m for split in splits.values() for m in split]}
    print(f"models of {models.hardware}, evaluated on measurements of {hardware}")
    groups = {name: predicted_and_measured(models, splits[name]) for name in ("test", "unseen")}
    result = accuracy(*map(np.concatenate, zip(*groups.values())))
    result["seen"] = accuracy(*groups["test"])
    result["unseen"] = accuracy(*groups["unseen"])
    held_out_plans = [p for p in plans if hardware != models.hardware or data_split(p.key) == "test"]
    result["device_compute"] = evaluate_device_compute(models, held_out_plans)
    result["comm"] = evaluate_comm(models, held_out_plans)
    result["input_dist"] = evaluate_input_dist(models, held_out_plans)
    result["mixed_comm"] = evaluate_mixed_comm(models, held_out_plans)
    result["replica_comm"] = evaluate_replica_comm(models, held_out_plans)
    result["hardware"] = {"models": models.hardware, "measurements": hardware}
    if result["n"] == 0:
        raise ShardRayError(f"{flags.store} has no held-out or unseen shard measurements on {hardware}")
    parts = ("seen", "unseen", "device_compute", "comm", "input_dist", "mixed_comm", "replica_comm")
    for name in parts:
        print(describe_accuracy(name, result[name]))
    if tracking_uri is not None:
        flat = {"mape": result["mape"], "spearman": result["spearman"]}
        flat.update({f"{k}_{m}": result[k][m] for k in parts for m in ("mape", "spearman")})
        flat = {k: v for k, v in flat.items() if v is not None}
        run_id = log_costmodel_evaluation(
            flags.cost_model,
            hardware,
            flat,
            {
                "held-out, seen tables": tuple(v.tolist() for v in groups["test"]),
                "unseen tables": tuple(v.tolist() for v in groups["unseen"]),
            },
            tracking_uri,
            experiment,
        )
        print(f"logged MLflow run {run_id} to {tracking_uri}")
    print(json.dumps(result))


def cmd_calibrate(args: argparse.Namespace) -> None:
    from shard_ray.plan.enumerator import pieces_to_place
    from shard_ray.plan.topology import GB, memory_cap_with_headroom
    from shard_ray.workload.tables import load_tables

    flags = settings_from(CalibrateArgs, args)
    config = settings_from(CalibrateConfig, args)
    tables = load_tables(flags.tables)
    topology_flags = settings_from(TopologyArgs, args)
    if topology_flags.memory_gb is None:  # no cap given: every candidate plan may use any device
        whole_task = memory_cap_with_headroom(tables, flags.devices, float(flags.devices))
        topology_flags = replace(topology_flags, memory_gb=whole_task / GB)
    topology = topology_flags.topology(flags.devices)
    pieces_to_place(tables, topology)  # tables the devices cannot hold are refused before Ray starts
    # the task checked: what measures and fits (torch, Ray, MLflow) only now
    from shard_ray.costmodel.models import CostModels, hardware_models_path, models_for
    from shard_ray.profiling.hardware import hardware_id
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.tracking.mlflow_runs import log_calibration
    from shard_ray.workflows.calibrate import calibrate

    hosts = topology.devices_per_host_if_spanning
    tracking_uri, experiment = tracking(args)
    start_path = str(flags.cost_model or models_for(hardware_id(threads=1), hosts))
    start = CostModels.load(start_path)
    connect(args, min_cpus=max(config.actors, flags.devices), hosts=topology.num_hosts, optimizer=topology.optimizer)
    print(f"calibrating {len(tables)} tables on {flags.devices} devices from {start_path} (models of {start.hardware})")
    with MeasurementStore(flags.store) as store:
        result = calibrate(tables, topology, start, start_path, config, store)
    report = result.report
    out = Path(flags.out) if flags.out else hardware_models_path(report["hardware"], hosts, tables)
    earlier = None if flags.out else earlier_fit_at(out, tables)
    keep_earlier = earlier is not None and result.chosen != "fine-tuned"
    if not keep_earlier:
        result.models.save(out)
    if flags.for_hardware:
        hardware_wide = hardware_models_path(report["hardware"], hosts)
        result.models.save(hardware_wide)
        print(
            f"wrote {hardware_wide} too (--for-hardware): these models now price every task on {report['hardware']} "
            "that has no models of its own, fitted to other tables than theirs"
        )
    print(
        f"calibrated on {report['hardware']} in {report['seconds']:.0f} s ({report['measuring_seconds']:.0f} s measuring)"
    )
    print("\n".join(held_out_accuracy(report)))
    if tracking_uri is not None:
        run_id = log_calibration(report, str(out), Path(flags.tables).stem, tables, tracking_uri, experiment)
        print(f"logged MLflow run {run_id} to {tracking_uri}")
    over_hosts = f" with --devices-per-host {hosts}" if hosts else ""
    kept = "" if result.chosen == "fine-tuned" else " (the starting models, unchanged, with this calibration's report)"
    if keep_earlier:  # written, the unchanged models would replace the fit (one at 4 devices replaced one at 2 so)
        print(
            f"kept {out} as it was: models an earlier calibration fitted to these tables ({earlier}), "
            "which this one, keeping the models it started from, would have replaced; `--cost-model` starts a "
            "calibration from them"
        )
    else:  # said, not silent (a walk's second calibration replaced a better first one without a word)
        replacing = (
            f", replacing the models an earlier calibration fitted to these tables ({earlier})" if earlier else ""
        )
        print(
            f"wrote {out}{kept}{replacing}; `shard-ray plan` picks it for these tables on {report['hardware']}"
            f"{over_hosts}" + ("" if not flags.out else " when given --cost-model")
        )
    print(json.dumps(report))


def earlier_fit_at(out: Path, tables: list[TableSpec]) -> str | None:
    """When an earlier calibration fitted the models in `out` to these tables ("before" where it recorded no time),
    which `calibrate` keeps where it keeps the models it started from (the hardware's, not those) and says it
    replaces otherwise; None where `out` holds no such fit."""
    from shard_ray.costmodel.models import CostModels
    from shard_ray.workload.tables import task_digest

    if not out.is_file():
        return None
    earlier = CostModels.load(out).info.calibrated
    if earlier is None or not earlier.fitted(task_digest(tables)):
        return None
    return earlier.at or "before"


def held_out_accuracy(report: dict[str, Any]) -> list[str]:
    """What a calibration's report says of the models on its held-out measurements, before and after, which it kept
    and why, and how firm that is: the lines `calibrate` prints."""
    from shard_ray.costmodel.train import describe_accuracy

    shards, plans = report["shards"], report["plans"]
    lines = [f"held-out measurements of this task's tables ({shards['held_out']} shards, {plans['held_out']} plans):"]
    # Kept, the starting models are "after" too: the fine-tuned ones set aside are shown as such, so that figures
    # better than "before" are not read as a fit that took effect.
    tuned = "after" if report["chosen"] == "fine-tuned" else "fine-tuned"
    for part in ("compute", "device_compute", "comm", "plan"):
        name = part.replace("_", " ")
        lines.append(f"  {describe_accuracy(name + ' before', report['before'][part])}")
        if part == "comm" and (report["comm_kept"] or report["comm_refused"]):  # the starting model: no second row
            why = "its fit refused" if report["comm_refused"] else "not fitted"
            lines.append(f"  comm {tuned}: the starting comm model ({why}, as said above)")
        else:
            lines.append(f"  {describe_accuracy(name + ' ' + tuned, report['fine_tuned'][part])}")
    # a refused comm fit leaves the starting comm model in the fine-tuned ones (a walk read "kept the fine-tuned models"
    # after the refusal as the refused fit kept)
    comm = " (with the starting comm model)" if report["comm_refused"] and report["chosen"] == "fine-tuned" else ""
    lines.append(f"kept the {report['chosen']} models{comm}: {report['reason']}")
    if report["chosen"] == "fine-tuned":  # judged as a whole: a part of it may have got worse (a walk read none)
        worse = [
            f"{part.replace('_', ' ')} {before['mape']:.1%} -> {after['mape']:.1%}"
            for part in ("compute", "device_compute", "comm", "plan")
            if (before := report["before"][part]).get("n") and (after := report["fine_tuned"][part]).get("n")
            and after["mape"] > before["mape"]
        ]  # fmt: skip
        if worse:
            lines.append(f"note: on the held-out measurements the fit is worse in {', '.join(worse)}")
    if min(shards["held_out"], shards["val"]) < FEW_HELD_OUT:
        # where these tables made no new shards, more --shards would measure nothing new
        firmer = "a larger --held-out" if report["ran_out"]["shards"] else "more --shards or --budget-minutes"
        lines.append(
            f"note: {shards['val']} validation and {shards['held_out']} held-out shards: "
            f"few, so the choice and the figures above are indicative; {firmer} firms them up"
        )
    return lines


def cmd_models(args: argparse.Namespace) -> None:
    from shard_ray.costmodel.models import PRETRAINED_DIR, CostModels, default_cost_model_path, models_home

    home = models_home()
    shipped = [default_cost_model_path(), *sorted(set(PRETRAINED_DIR.glob("*.pt")) - {default_cost_model_path()})]
    if args.files:  # a user's own, `costmodel train --out FILE`'s, which no folder above holds
        files = [Path(f) for f in args.files]
        for path in files:
            CostModels.load(path)  # a file named that is none refused in a line, before any is described
    else:
        files = shipped + sorted(home.glob("*.pt"))
        print(
            f"cost models on this machine: {len(shipped)} shipped, and {len(files) - len(shipped)} calibrated in "
            f"{home} (`plan` picks these tables' own models for its hardware, else the hardware's, else the shipped "
            "ones of its hardware, else, on another GPU, the H100's, else the reference CPU's; `shard-ray models "
            "FILE` describes a file of your own)"
        )
    for k, path in enumerate(files):
        print(("\n" if k or not args.files else "") + str(path) + (" (shipped)" if path in shipped else ""))
        try:
            models = CostModels.load(path)
        except ShardRayError as err:
            print(f"  cannot be read: {err}")
            continue
        print("  " + _models_line(models))


def _models_line(models: CostModels) -> str:
    """A model file's hardware, what it was calibrated on and when, and its held-out error, on one line."""
    calibrated = models.info.calibrated
    if calibrated is None:
        held_out, fitted = models.info.held_out or {}, "trained by `costmodel train`, not calibrated on a task"
    else:
        held_out = calibrated.held_out
        tables = ", ".join(calibrated.tables[:4]) + (", ..." if len(calibrated.tables) > 4 else "")
        fitted = f"calibrated on {len(calibrated.tables)} tables ({tables}; task {calibrated.task})"
        fitted += f" on {calibrated.at}" if calibrated.at else ""
        if calibrated.chosen != "fine-tuned":
            fitted += f", which kept the models it started from unchanged: {calibrated.reason}"
    if models.info.comm_devices_per_host:
        fitted += f", all-to-alls over hosts of {models.info.comm_devices_per_host} devices"
    if models.comm is None:
        fitted += "; no comm model (all-to-alls priced by the links' profile)"
    errors = ", ".join(
        f"{part} {score['mape']:.1%} (n {int(score['n'] or 0)})"
        for part, score in held_out.items()
        if score.get("mape") is not None
    )
    return f"{models.hardware}; {fitted}; held-out error (MAPE): {errors or 'none measured'}"


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "costmodel")
    commands = p.add_subparsers(dest="costmodel_command", required=True, parser_class=Parser)
    q = commands.add_parser("train", help="train compute and communication models on a measurement store")
    add_settings(q, TrainArgs)
    add_settings(q, TrainConfig)
    q.set_defaults(run=cmd_costmodel_train)

    p = add_command(sub, "calibrate")
    add_settings(p, CalibrateArgs)
    add_settings(p, TopologyArgs)
    add_settings(p, CalibrateConfig)
    add_ray(p)
    add_tracking(p)
    p.set_defaults(run=cmd_calibrate)

    p = add_command(sub, "models")
    p.add_argument("files", nargs="*", metavar="FILE", help="model files to describe (default: this machine's)")
    p.set_defaults(run=cmd_models, output_is_the_work=True)

    q = commands.add_parser("evaluate", help="held-out accuracy of cost models; the last line is JSON")
    add_settings(q, EvaluateModelArgs)
    add_tracking(q)
    q.set_defaults(run=cmd_costmodel_evaluate, output_is_the_work=True)
