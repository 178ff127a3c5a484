"""`algorithms`, `plan` and `export`: placing tables on devices, and handing the plan to TorchRec."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shard_ray.cli.commands import add_command
from shard_ray.cli.common import (
    DEFAULT_STORE,
    STORE_HELP,
    add_ray,
    add_tracking,
    check_plan_of,
    connect,
    say_other_shapes,
    tracking,
)
from shard_ray.cli.flags import add_settings, flag_name, given, settings_from
from shard_ray.configfile import setting
from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.io import DOCUMENT_SUFFIXES
from shard_ray.plan.plan import Plan, PlanEstimate, PlanSettings
from shard_ray.plan.topology import (
    GB,
    MAX_DEVICES,
    MAX_MEMORY_GB,
    Optimizer,
    Topology,
    check_whole_hosts,
    devices_per_host_setting,
    host_link_gbps_setting,
    inter_host_gbps_setting,
)
from shard_ray.workflows.comparison import CompareConfig
from shard_ray.workflows.refinement import RefineConfig

if TYPE_CHECKING:
    from shard_ray.plan.constraints import Constraints
    from shard_ray.plan.cost import MeasuredComparison
    from shard_ray.profiling.gang import DeviceActors
    from shard_ray.workflows.comparison import ComparedPlans
    from shard_ray.workload.tables import TableSpec


# Whose plans `plan --measure` races the chosen algorithm's plan against.
BASELINE_FAMILIES = ("heuristic", "planner")
# The name `plan --measure` races the --incumbent plan file under.
INCUMBENT = "incumbent"


@dataclass(frozen=True)
class MeasureRaceArgs:
    """`plan --measure`: the comparison's limits (the procedure is `shard_ray.workflows.comparison`'s)."""

    measure_budget: float = setting(120.0, "plan --measure: seconds of measuring to separate the best candidate", min=1)
    measure_rounds: int = setting(40, "plan --measure: most interleaved rounds", min=2)

    def config(self) -> CompareConfig:
        return CompareConfig(rounds=self.measure_rounds, budget_seconds=self.measure_budget)


@dataclass(frozen=True)
class TopologyArgs:
    """The devices a plan is for; unset values come from the plan file (evaluate) or Topology's defaults."""

    memory_gb: float | None = setting(
        None,
        "memory cap per device in GiB (weights + optimizer state); `plan` needs it, `evaluate` and `compare` read "
        "it from the plan file when not given, `calibrate` caps its candidate plans by it when given (else nothing)",
        min=1e-9,
        max=MAX_MEMORY_GB,
    )
    batch_size: int | None = setting(
        None,
        f"global batch size (default: the one a plan file records, else {Topology.model_fields['batch_size'].default})",
        min=1,
    )
    optimizer: Optimizer | None = setting(
        None,
        "optimizer whose state counts towards memory (default: the one a plan file records, else "
        f"{Topology.model_fields['optimizer'].default})",
    )
    devices_per_host: int | None = devices_per_host_setting("the plan file's, else one host holds every device")
    inter_host_gbps: float | None = inter_host_gbps_setting("the plan file's; for a new plan, ")

    intra_host_gbps: float | None = setting(
        None,
        "GB/s a device receives from the devices of its own host (NVLink, PCIe), in place of the published or "
        "calibrated figure of the hardware the models price (default: the plan file's, else that figure)",
        min=1e-9,
    )
    host_link_gbps: float | None = host_link_gbps_setting("the plan file's, else ")

    def topology(self, num_devices: int, recorded: PlanSettings | None = None) -> Topology:
        """The topology these flags give, a plan's `recorded` settings filling what is not given."""
        recorded_values = recorded.model_dump() if recorded is not None else {}
        memory_gb = self.memory_gb if self.memory_gb is not None else recorded_values.get("memory_gb")
        if memory_gb is None:
            raise ShardRayError("give --memory-gb, the memory cap per device (a plan file from `plan` records it)")
        values = {
            "batch_size": self.batch_size or recorded_values.get("batch_size"),
            "optimizer": self.optimizer or recorded_values.get("optimizer"),
            "devices_per_host": self.devices_per_host or recorded_values.get("devices_per_host"),
            "inter_host_gbps": self.inter_host_gbps or recorded_values.get("inter_host_gbps"),
            "intra_host_gbps": self.intra_host_gbps or recorded_values.get("intra_host_gbps"),
            "host_link_gbps": self.host_link_gbps or recorded_values.get("host_link_gbps"),
        }
        # the rates given as flags (a plan file records its topology's, of one host or several)
        check_whole_hosts(num_devices, values["devices_per_host"], self.inter_host_gbps, self.host_link_gbps)
        return Topology(
            num_devices=num_devices, memory_bytes=int(memory_gb * GB), **{k: v for k, v in values.items() if v}
        )


@dataclass(frozen=True)
class PlanArgs:
    tables: str = setting(None, "table file to place", required=True)
    devices: int = setting(None, f"number of devices (at most {MAX_DEVICES:,})", required=True, min=1, max=MAX_DEVICES)
    algo: str = setting(None, "algorithm name (see `shard-ray algorithms`)", required=True)
    out: str = setting(
        None, "plan file to write (.json; YAML where named .yaml or .yml)", required=True, new_file=True,
        suffixes=DOCUMENT_SUFFIXES,
    )  # fmt: skip
    seed: int = setting(0, "random seed", min=0)
    cost_model: str | None = setting(
        None,
        "cost model file that prices the plan, and places it for the model-based algorithms (default: the models "
        "`calibrate` saved for --hardware, else the shipped ones of its hardware: an H200's, an H100's (on any other "
        "GPU too), else the reference CPU's)",
    )
    hardware: str | None = setting(
        None, "hardware id the plan is for, e.g. 'cuda:NVIDIA H100 80GB HBM3' (default: this machine's)"
    )
    policy: str | None = setting(None, "dreamshard: policy file or `policy train` folder (default: the shipped policy)")
    samples: int | None = setting(
        None, "dreamshard: also sample this many plans, keep the best simulated (default 0)", min=0
    )
    search_config: str | None = setting(None, "cost_search: tuned search settings (best.json of `tune search`)")
    constraints: str | None = setting(
        None,
        "constraints file (JSON/YAML): pin tables to devices, keep groups of tables on one device, allow or forbid "
        "sharding types per table (docs: File formats, Constraints file); taken by cost_search, neuroshard and the greedy heuristics",
    )
    explain: bool = setting(
        False,
        "print, per table, its sharding type and devices and the predicted plan cost of its next-best type "
        "(why not data-parallel, why split); recorded in the plan's metadata",
    )
    measure: bool = setting(
        False,
        "race the plan against every baseline (heuristics, TorchRec's planner) on the device gang and keep the "
        "measured best, with confidence intervals",
    )
    incumbent: str | None = setting(
        None,
        "plan --measure: the plan file you run now (shard-ray's, TorchRec's planner's, written by hand); it races "
        "too, and another plan is written only when measured faster than it (default: TorchRec's plan of the task, "
        "where TorchRec's planner can make one)",
    )
    store: str = setting(DEFAULT_STORE, "plan --measure: " + STORE_HELP + ", where every round's measurement goes")
    set: tuple[str, ...] = setting(
        (),
        "one of the algorithm's own settings, NAME=VALUE (VALUE read as YAML); repeat for more",
        repeat=True,
        whole=True,
        metavar="NAME=VALUE",
    )

    def algorithm_settings(self) -> dict[str, Any]:
        """The chosen algorithm's own settings from the flags given; the algorithm refuses what it does not take."""
        import yaml

        from shard_ray.configfile import load_tuned

        if self.search_config and self.algo != "cost_search":
            raise ShardRayError(
                f"--search-config holds the settings a `tune search` sweep found for cost_search; {self.algo!r} "
                "takes no search settings from it"
            )
        if self.samples is not None and self.algo != "dreamshard":
            raise ShardRayError(
                f"--samples draws plans from dreamshard's policy; {self.algo!r} draws none: leave it out"
            )
        if self.policy is not None and self.algo not in ("dreamshard", "cost_search"):
            raise ShardRayError(
                f"--policy is the policy dreamshard places with, and cost_search may start from; {self.algo!r} takes "
                "none: leave it out"
            )
        settings = load_tuned(self.search_config, "search") if self.search_config else {}
        flags = {k: v for k, v in {"policy": self.policy, "samples": self.samples}.items() if v is not None}
        settings.update(flags)
        given: dict[str, str] = {}
        for item in self.set:
            name, equals, value = item.partition("=")
            name = name.strip()
            if not equals or not name:
                raise ShardRayError(f"--set takes NAME=VALUE, got {item!r}")
            if name in given and given[name] != value:  # the last would win, silently
                raise ShardRayError(f"--set {name} given twice, {given[name]!r} and {value!r}: give it once")
            given[name] = value
            try:
                settings[name] = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ShardRayError(f"--set {name}: {value!r} is not a YAML value") from None
            if name in flags and settings[name] != flags[name]:  # one of the two would be dropped, silently
                raise ShardRayError(f"--{name} {flags[name]} and --set {name}={value} disagree: give one of them")
        return settings


@dataclass(frozen=True)
class ExportArgs:
    plan: str = setting(None, "plan file to export", required=True)
    tables: str = setting(None, "the table file the plan places (for row counts)", required=True)
    out: str = setting(
        None, "file to write (.json; YAML where named .yaml or .yml)", required=True, new_file=True,
        suffixes=DOCUMENT_SUFFIXES,
    )  # fmt: skip
    format: Literal["torchrec"] = setting("torchrec", "export format")
    module_path: str = setting(
        "",
        "the EmbeddingBagCollection's path in the model, e.g. sparse_arch.embedding_bag_collection; empty: the "
        "model is the collection",
    )
    device: Literal["cuda", "cpu"] = setting("cuda", "device type of the ranks")


def cmd_algorithms(args: argparse.Namespace) -> None:
    from shard_ray.placement import algorithms

    for info in algorithms():
        print(f"{info.name:<20} {info.family:<10} {info.description}")


def cmd_plan(args: argparse.Namespace) -> None:
    from shard_ray.plan.constraints import load_constraints
    from shard_ray.plan.plan import save_plan
    from shard_ray.profiling.hardware import check_hardware_id
    from shard_ray.workload.tables import load_tables

    flags = settings_from(PlanArgs, args)
    refine_config = settings_from(RefineConfig, args)
    if refine_config.refine and not flags.measure:
        raise ShardRayError("--refine refines the plan --measure chooses: give --measure too")
    if flags.incumbent and not flags.measure:
        raise ShardRayError("--incumbent is the plan --measure races against: give --measure too")
    # the race's and refinement's settings given without the flag they are settings of would be ignored without a word
    for settings, owner, on in (
        (MeasureRaceArgs, "--measure", flags.measure),
        (RefineConfig, "--refine", refine_config.refine),
    ):
        unused = [flag_name(f.name, f.metadata) for f in fields(settings) if f.name in given(args, settings)]
        unused = [flag for flag in unused if flag != owner]
        if unused and not on:
            are = "is a setting" if len(unused) == 1 else "are settings"
            raise ShardRayError(f"{', '.join(unused)} {are} of {owner}: give {owner} too")
    tables = load_tables(flags.tables)
    topology = settings_from(TopologyArgs, args).topology(flags.devices)
    incumbent = _incumbent_plan(flags, tables, topology) if flags.incumbent else None
    constraints = load_constraints(flags.constraints) if flags.constraints else None
    _check_cost_model_flag(flags)
    if flags.hardware is not None:
        check_hardware_id(flags.hardware)
    # a race's MLflow run: its store checked now, before the placing (a plan not measured logs nothing)
    tracking_uri, experiment = tracking(args) if flags.measure else (None, "")
    if flags.measure:
        # a gang it cannot hold, or Adam on CPU devices: refused now
        connect(args, min_cpus=flags.devices, hosts=topology.num_hosts, optimizer=topology.optimizer)
    # the race's report written by a process that imports MLflow from now, beside the placing
    reports = tracking_uri is not None
    if reports:
        from shard_ray.tracking.mlflow_runs import log_comparison
        from shard_ray.tracking.report_process import ReportProcess

    with ReportProcess(tracking_uri, [log_comparison]) if reports else contextlib.nullcontext() as report:
        # the searches and the models once the input is known good: a refusal above answers at once
        from shard_ray.placement import plan_tables

        plan = plan_tables(
            flags.algo,
            tables,
            topology,
            seed=flags.seed,
            cost_model=flags.cost_model,
            hardware=flags.hardware,
            settings=flags.algorithm_settings(),
            settings_source=flags.search_config,
            constraints=constraints,
            say=print,
        )
        topology = plan.topology()  # with the rate between hosts it was planned with
        _print_placed(plan, tables, topology, flags)
        if flags.explain:
            plan = explained(plan, tables, topology, flags, constraints)
        raced, placed = None, plan
        if flags.measure:
            from shard_ray.costmodel.simulator import price_comm
            from shard_ray.profiling.gang import DeviceActors

            race = settings_from(MeasureRaceArgs, args).config()
            # one gang for the race, the refinement's shards and its confirmation
            with DeviceActors(
                topology.num_devices, devices_per_host=topology.devices_per_host, comm_pricer=price_comm
            ) as devices:
                if report is not None:
                    report.wait_until_imported()  # before measuring: its cores are the gang's
                plan, raced = measured_best(plan, tables, topology, flags, race, constraints, devices, incumbent)
                if refine_config.refine:
                    plan = refined_and_confirmed(plan, tables, topology, flags, race, refine_config, devices)
        if plan.shards != placed.shards:  # the table above is the placed plan's, not this one's (a walk)
            _print_written(plan, tables, topology)
        save_plan(flags.out, plan)
        print(f"wrote {flags.out}: {_whose(plan)}{_why_written(plan.measured)}")
        if note := _rows_on_cpu_note(plan, tables):
            print(note)
        if raced is not None and report is not None:
            task = Path(flags.tables).stem
            logged = report.call(
                log_comparison,
                raced.result,
                raced.plans,
                raced.costs,
                topology,
                task,
                tables,
                tracking_uri,
                experiment,
                files=[Path(flags.out)],
                kind="race",
            )
            print(logged.describe(tracking_uri))


def _rows_on_cpu_note(plan: Plan, tables: list[TableSpec]) -> str | None:
    """Where the plan was measured on CPU devices and splits tables by rows, which TorchRec's CPU ranks do not run:
    a user on CPUs meets it only at `export --device cpu` (a walk's measured plan, TorchRec's own, split three)."""
    from shard_ray.interop.torchrec import ROW_TYPES

    if plan.measured is None or not plan.measured.hardware.startswith("cpu:"):
        return None
    by_rows = sorted(name for name, sharding in plan.table_shardings(tables).items() if sharding.type in ROW_TYPES)
    if not by_rows:
        return None
    return (
        f"note: measured on CPU devices, this plan splits {', '.join(by_rows)} by rows, which TorchRec runs on GPUs "
        "only: `shard-ray export --device cpu` refuses it (for GPUs it exports as it is); a constraints file giving "
        "them `not_types: [row_wise]` plans for CPU ranks"
    )


def _whose(plan: Plan) -> str:
    """Whose plan `plan --measure` wrote, naming the algorithms that placed the tables alike (it raced as one)."""
    alike = [name for name in plan.measured.chosen.split("=") if name != plan.algorithm] if plan.measured else []
    return f"{plan.algorithm}'s plan" + (f", which {', '.join(alike)} placed alike" if alike else "")


def _why_written(measured: MeasuredComparison | None) -> str:
    """Why `plan --measure` wrote the plan it wrote, for its last line."""
    if measured is None:  # not measured, or every candidate placed the tables alike
        return ""
    if measured.separated:
        return ", measured faster than every other plan raced"
    if measured.incumbent is None:
        return ", within noise of the measured fastest and the lowest measured cost of those"
    if measured.chosen == measured.incumbent:
        return f", the incumbent ({measured.incumbent}), kept: no plan measured faster than it"
    return f", measured faster than the incumbent ({measured.incumbent}), not separated from every other plan"


def _incumbent_plan(flags: PlanArgs, tables: list[TableSpec], topology: Topology) -> Plan:
    """The plan file given as --incumbent, checked to be a plan of these tables on these devices."""
    from shard_ray.plan.plan import load_plan

    incumbent = load_plan(flags.incumbent)
    try:
        incumbent.check(tables)
        if incumbent.num_devices != topology.num_devices:
            raise ShardRayError(f"it is for {incumbent.num_devices} devices, not --devices {topology.num_devices}")
        incumbent.check_memory(tables, topology)
    except ShardRayError as err:
        raise ShardRayError(f"--incumbent {flags.incumbent} is not a plan of {flags.tables} here: {err}") from None
    return incumbent


def _check_cost_model_flag(flags: PlanArgs) -> None:
    """Refuse a bad model file before planning."""
    from shard_ray.costmodel.models import CostModels

    if flags.cost_model is not None:
        CostModels.load(flags.cost_model)


def _calibration_advice(plan: Plan, tables: list[TableSpec], flags: PlanArgs) -> str | None:
    """What to run so that the models fit this task: `calibrate`, or, where a calibration on these very tables kept
    the models it started from, `calibrate` measuring more; None where the models were fitted to these tables (their
    warning says what their fit lacks)."""
    from shard_ray.costmodel.models import CostModels
    from shard_ray.workload.tables import task_digest

    hosts = f" --devices-per-host {plan.devices_per_host}" if plan.devices_per_host else ""
    command = f"`shard-ray calibrate --tables {flags.tables} --devices {flags.devices}{hosts}`"
    path = plan.estimate.cost_model if plan.estimate else None
    calibrated = CostModels.load(path).info.calibrated if path else None
    if calibrated is not None and calibrated.fitted(task_digest(tables)):
        return None
    if calibrated is not None and calibrated.task == task_digest(tables):
        kept = f"the calibration on these tables kept the models it started from ({calibrated.reason})"
        if calibrated.reason.startswith("too few held-out measurements"):
            return (
                f"{kept}; {command} with more --shards and --plans (or --budget-minutes) measures enough to judge a fit"
            )
        # judged, and the fit lost: more of the same measurements is no remedy the calibration can promise
        return f"{kept}: a fit to these tables was no better than they are here"
    return f"{command}, run on the hardware the plan is for, measures this task there and fits the models to it"


# The most replicas `_replicated_note` prices (a table's on every device): few small tables are where replicating them
# all pays, and pricing thousands of tables' replicas on hundreds of devices would take seconds.
REPLICATED_NOTE_PIECES = 4096


def _replicated_note(plan: Plan, tables: list[TableSpec], topology: Topology) -> str | None:
    """Where cost_search, on one host, left data-parallel out and every table replicated would fit and price below its
    plan, that plan's price and how to have it (a walk: 3 tables of 3 rows on 16 devices, 1.706 ms against 0.734 for
    TorchRec's plan, which replicates them, and nothing said); None elsewhere."""
    import numpy as np

    from shard_ray.costmodel.models import CostModels
    from shard_ray.costmodel.pricing import Pricer
    from shard_ray.plan.memory import MemoryLedger
    from shard_ray.plan.piece import data_parallel, replica

    settings = plan.settings.algorithm if plan.settings is not None else {}
    if (
        plan.algorithm != "cost_search"
        or plan.estimate is None
        or plan.estimate.cost_model is None
        or topology.num_hosts > 1
        or topology.num_devices == 1
        or "data_parallel" in settings.get("sharding_types", ())
    ):
        return None
    ledger = MemoryLedger(topology)
    if len(tables) * topology.num_devices > REPLICATED_NOTE_PIECES or (
        sum(ledger.need(replica(table, topology.num_devices, 0)) for table in tables) > topology.memory_bytes
    ):
        return None  # every device would hold every table whole
    pieces = [piece for table in tables for piece in data_parallel(table, topology.num_devices)]
    assign = np.array([p.devices[0] for p in pieces], dtype=np.int64)
    replicated = Pricer(CostModels.load(plan.estimate.cost_model), topology).plan_cost(pieces, assign)
    searched = plan.estimate.predicted.cost_ms
    if replicated >= searched:
        return None
    return (
        f"note: every table replicated (data-parallel) prices {replicated:.3f} ms, below this plan's {searched:.3f}: "
        "cost_search leaves data-parallel out on one host, where such plans measured slower than priced; `--measure` "
        "races them (TorchRec's plan replicates small tables), and `--set sharding_types=[table_wise,column_wise,"
        "row_wise,data_parallel]` lets the search choose them"
    )


def _other_models_note(trained_against: str | None, estimate: PlanEstimate | None) -> str | None:
    """Where a user's policy was trained against other models than those that placed and priced its plan, said so: it
    is a policy for those models (a walk's policy of its own models placed with the shipped ones, without a word)."""
    from shard_ray.policy.policy_file import models_label

    if trained_against is None or estimate is None or estimate.cost_model is None:
        return None
    if not (trained_against.startswith("shipped:") or Path(trained_against).is_absolute()):
        return None  # a file of an earlier release, its path relative to a folder it does not name
    if trained_against == models_label(estimate.cost_model):
        return None
    return (
        f"note: the policy was trained against the models {trained_against} and placed with {estimate.cost_model}: "
        "it is a policy for those; `--cost-model` gives them, or `policy train --cost-model` trains one for these"
    )


def _print_written(plan: Plan, tables: list[TableSpec], topology: Topology) -> None:
    """The summary of the plan `plan --measure` writes where the race chose another than the placed one (the
    incumbent, or another algorithm's): the one printed before it is the placed plan's."""
    from shard_ray.plan.summary import format_plan_summary

    estimate = plan.estimate
    predicted, lower_bound = (estimate.predicted, estimate.lower_bound_ms) if estimate else (None, None)
    print(f"the plan written, {_whose(plan)}:")
    print(format_plan_summary(plan, tables, topology, predicted, "simulated", lower_bound))


def _print_placed(plan: Plan, tables: list[TableSpec], topology: Topology, flags: PlanArgs) -> None:
    """The plan's summary with the models' prices and where they come from; their warnings on stderr."""
    from shard_ray.placement import algorithm
    from shard_ray.plan.summary import format_plan_summary

    estimate = plan.estimate
    predicted, lower_bound = (estimate.predicted, estimate.lower_bound_ms) if estimate else (None, None)
    print(format_plan_summary(plan, tables, topology, predicted, "simulated", lower_bound))
    if estimate and estimate.provenance:
        print(estimate.provenance)
    if not algorithm(flags.algo).uses_models:
        print(f"{flags.algo} places without the cost models: its plan is priced by them to compare with the others'")
    if flags.algo == "dreamshard":  # which network placed it: a run's own policy.pt, or the one the package ships
        from shard_ray.policy.policy_file import default_policy_path, read_policy

        given = plan.settings.algorithm.get("policy") if plan.settings else None
        info = read_policy(given or default_policy_path())[1]
        kept = info.network_kept()
        placed = f"placed by the policy {given}" if given else f"placed by the shipped policy {default_policy_path()}"
        print(placed + (f": {kept}" if kept else ""))
        if given and (note := _other_models_note(info.cost_model, estimate)):
            print(note)
    # the search's own warning first, which a flag answers: after the models' warnings, which every plan of these
    # tables repeats, a walk missed it
    if plan.search is not None and plan.search.cut_short:
        print(f"warning: {plan.search.cut_short}", file=sys.stderr)
    warnings = estimate.warnings if estimate else []
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    advice = _calibration_advice(plan, tables, flags) if warnings else None
    if advice:
        print(f"warning: the models' prices above are extrapolated: {advice}", file=sys.stderr)
    if flags.search_config:  # the file records it too (`settings.source`)
        print(f"{flags.algo} searched with the settings in {flags.search_config} (a `tune search` sweep's best)")
    if plan.search is not None and plan.search.started_from and "start=" in plan.search.started_from:
        print(f"the search started from {plan.search.started_from}")  # cost_search's `start`, and why
    if plan.search is not None and plan.search.sampled:
        print(plan.search.sampled)
    if plan.search is not None and plan.search.kept_baseline:
        print(plan.search.kept_baseline)
    if plan.search is not None and plan.search.proven_optimal:  # said, as a cut one says it is not (a walk)
        print("proven the best table-wise plan under these models (a plan splitting tables may price lower)")
    if note := _replicated_note(plan, tables, topology):
        print(note)
    placed = f"{len(tables)} table" + ("s" if len(tables) != 1 else "")
    took = plan.placement_seconds
    print(f"placed {placed} in {f'{took:.1f} s' if took >= 10 else f'{took * 1e3:.2f} ms'}{search_work(plan)}")


def search_work(plan: Plan) -> str:
    """How much of its budget a cost-model search used, for the `placed ...` line: work, not seconds,
    is what decides the plan (`shard_ray.placement.budget`)."""
    used = plan.search.evaluations if plan.search is not None else None
    if used is None:
        return ""
    budget = plan.settings.algorithm.get("max_evaluations") if plan.settings else None
    if budget is None:
        return f", {used:,} model evaluations (no budget)"
    if used > budget:  # the budget is checked between batches of candidates, and the batch under way finishes
        return f", {used:,} model evaluations: its budget of {budget:,} reached mid-batch (--set max_evaluations=N)"
    return f", {used:,} of its budget of {budget:,} model evaluations (--set max_evaluations=N)"


def explained(
    plan: Plan, tables: list[TableSpec], topology: Topology, flags: PlanArgs, constraints: Constraints | None
) -> Plan:
    """Print why each table is sharded as it is, under the models the plan was made with; record it in the plan."""

    from shard_ray.costmodel.pricing import Pricer
    from shard_ray.placement.base import PlacementContext
    from shard_ray.placement.options import explain, format_explanation

    context = PlacementContext(cost_model=plan.estimate.cost_model if plan.estimate else flags.cost_model)
    context.hardware = flags.hardware
    cost_ms, choices = explain(Pricer(context.models, topology), plan, tables, constraints)
    print(format_explanation(cost_ms, choices, constraints is not None))
    return plan.model_copy(update={"explanation": choices})


def measured_best(
    plan: Plan,
    tables: list[TableSpec],
    topology: Topology,
    flags: PlanArgs,
    config: CompareConfig,
    constraints: Constraints | None,
    devices: DeviceActors,
    incumbent: Plan | None = None,
) -> tuple[Plan, ComparedPlans | None]:
    """`plan` compared with every baseline's plan and the `incumbent` on the devices' gang
    (`shard_ray.workflows.comparison`);
    the chosen plan, with the comparison, and what was compared (None where every candidate placed the tables
    alike). The incumbent (without one, TorchRec's plan where TorchRec planned the task) is kept unless a plan is
    separated as faster than it; without either, among plans the hardware cannot tell apart, the one of the lowest
    measured cost is chosen.

    Under constraints, only the baselines that honour them race (their plans made under them)."""
    from shard_ray.placement import algorithms
    from shard_ray.placement.base import priced
    from shard_ray.plan.summary import gang_layout
    from shard_ray.profiling.hardware import hardware_id
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.workflows.comparison import claims, compare_plans, distinct, format_comparison

    named = [(p.algorithm, p) for p in [plan, *_baselines_plans(plan, tables, topology, flags, constraints)]]
    if incumbent is not None:
        models = plan.estimate.cost_model if plan.estimate else None
        hardware = flags.hardware or hardware_id(threads=1)  # as `plan_tables` names it
        named.append((INCUMBENT, priced(incumbent, tables, topology, models, hardware) if models else incumbent))
    if len(distinct(named)) < 2:
        print("every candidate made the same placement: nothing to compare, the plan is written unmeasured")
        return plan, None
    kept = INCUMBENT if incumbent is not None else ("torchrec" if "torchrec" in dict(named) else None)
    if kept is None:
        print("no incumbent (TorchRec's planner made no plan of this task, and --incumbent is not given)")
    with MeasurementStore(flags.store) as store:
        gang = devices.gang()
        compared = compare_plans(named, tables, topology, gang, config, store, incumbent=kept)
        spanned = gang_layout(gang.hosts) if len(set(gang.hosts)) > 1 else None
    result = compared.result
    print(
        "\n".join(
            [
                format_comparison(result, "--measure-rounds"),
                *claims(result, {a.name for a in algorithms() if a.family == "heuristic"}),
            ]
        )
    )
    if spanned:
        print(spanned)
    for line in result.warnings:  # the models' warnings on the plans were said with the plan's summary
        print(f"warning: {line}", file=sys.stderr)
    return compared.plans[result.chosen].model_copy(update={"measured": result}), compared


def _baselines_plans(
    plan: Plan, tables: list[TableSpec], topology: Topology, flags: PlanArgs, constraints: Constraints | None
) -> list[Plan]:
    """Every baseline's plan of the task (under constraints, of the baselines that honour them), each priced by
    the models that priced `plan`; a baseline that finds no plan is said and left out."""
    from shard_ray.placement import algorithms, place
    from shard_ray.placement.base import priced
    from shard_ray.profiling.hardware import hardware_id

    racing = [a for a in algorithms() if a.family in BASELINE_FAMILIES and a.name != flags.algo]
    if constraints is not None:
        left_out = [a.name for a in racing if not a.takes_constraints]
        print(f"under --constraints, left out of the race (they do not honour constraints): {', '.join(left_out)}")
        racing = [a for a in racing if a.takes_constraints]
    models = plan.estimate.cost_model if plan.estimate else None
    hardware = flags.hardware or hardware_id(threads=1)  # as `plan_tables` names it
    plans = []
    for name in (a.name for a in racing):
        try:
            candidate = place(name, tables, topology, seed=flags.seed, constraints=constraints)
        except InfeasibleError as err:
            print(f"{name}: no plan ({err})")
            continue
        plans.append(priced(candidate, tables, topology, models, hardware) if models else candidate)
    return plans


def pricing_models(plan: Plan, tables: list[TableSpec], topology: Topology, flags: PlanArgs, hardware: str) -> str:
    """The model file to rank a measured plan's alternatives with: the one that priced it, else
    `--cost-model`, else those calibrated for these tables on `hardware` (`models_for`)."""
    from shard_ray.costmodel.models import models_for

    recorded = plan.estimate.cost_model if plan.estimate else None
    return recorded or flags.cost_model or str(models_for(hardware, topology.devices_per_host, tables))


def refined_and_confirmed(
    plan: Plan,
    tables: list[TableSpec],
    topology: Topology,
    flags: PlanArgs,
    race: CompareConfig,
    config: RefineConfig,
    devices: DeviceActors,
) -> Plan:
    """The race's choice refined by measured moves (`shard_ray.workflows.refinement`) on the devices' profiling
    actors, then compared with it on their gang by the one procedure: the refined plan is written only when that
    comparison separates it faster."""
    import ray

    from shard_ray.costmodel.models import CostModels
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.workflows.comparison import claims, compare_plans, distinct, format_comparison
    from shard_ray.workflows.refinement import refine

    actors = max(1, min(topology.num_devices, int(ray.cluster_resources().get("CPU", 1))))
    measure = MeasureConfig.for_topology(topology, warmup=race.warmup, repeats=race.repeats)
    with MeasurementStore(flags.store) as store:
        with devices.pool(actors) as pool:
            models = CostModels.load(pricing_models(plan, tables, topology, flags, pool.hardware))
            refined = refine(plan, tables, topology, models, pool, store, measure, config)
        print(
            f"refinement: {len(refined.moves)} move(s) kept, {refined.measured_shards} shard(s) measured "
            f"(the rest from {flags.store})"
        )
        if not refined.moves:
            return plan
        if refined.after_ms >= refined.before_ms:
            print(
                f"the refined plan measured no faster than {plan.algorithm}'s beside it: {plan.algorithm}'s is written"
            )
            return plan
        if len(distinct([(refined.plan.algorithm, refined.plan), (plan.algorithm, plan)])) < 2:
            print(f"the moves kept lead back to {plan.algorithm}'s placement: it is written")
            return plan
        print(f"confirming the refined plan against {plan.algorithm}'s on the gang")
        compared = compare_plans(
            [(refined.plan.algorithm, refined.plan), (plan.algorithm, plan)],
            tables,
            topology,
            devices.gang(),
            race,
            store,
        )
    result = compared.result
    print("\n".join([format_comparison(result, "--measure-rounds"), *claims(result, set())]))
    if result.chosen == refined.plan.algorithm and result.separated:
        return refined.plan.model_copy(update={"measured": result, "estimate": None})
    print(f"the refined plan is not measured faster on the gang: {plan.algorithm}'s plan is written")
    return plan


def cmd_export(args: argparse.Namespace) -> None:
    from shard_ray.interop.torchrec import export_plan, save_export
    from shard_ray.plan.plan import load_plan
    from shard_ray.workload.tables import load_tables

    flags = settings_from(ExportArgs, args)
    tables = load_tables(flags.tables)
    plan = load_plan(flags.plan)
    check_plan_of(plan, flags.plan, tables, flags.tables)
    try:  # over the cap it was made under, of other shapes (a walk exported such a plan, which `compare` refused)
        exported = export_plan(plan, tables, module_path=flags.module_path, device_type=flags.device)
    except InfeasibleError as err:
        raise ShardRayError(f"{flags.plan}: {err}") from None
    say_other_shapes(plan, flags.plan, tables, flags.tables)
    save_export(flags.out, exported)
    kinds = Counter(t.sharding_type.replace("_", "-") for t in exported.tables.values())
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    print(
        f"wrote {flags.out}: {len(exported.tables)} table{'s' if len(exported.tables) != 1 else ''} on "
        f"{exported.world_size} ranks ({counts}) "
        + (f"for module {flags.module_path!r}" if flags.module_path else "for a model that is the collection itself")
    )
    print(
        f"use: plan = shard_ray.interop.torchrec.load_sharding_plan({str(flags.out)!r}); "
        "DistributedModelParallel(model, plan=plan, ...)"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "algorithms")
    p.set_defaults(run=cmd_algorithms, output_is_the_work=True)

    p = add_command(sub, "plan")
    add_settings(p, PlanArgs)
    add_settings(p, TopologyArgs, required=("memory_gb",))  # a new plan has no plan file to read it from
    add_settings(p, MeasureRaceArgs)
    add_settings(p, RefineConfig)
    add_ray(p)
    add_tracking(p)
    p.set_defaults(run=cmd_plan)

    p = add_command(sub, "export")
    add_settings(p, ExportArgs)
    p.set_defaults(run=cmd_export)
