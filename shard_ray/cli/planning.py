"""`algorithms`, `plan` and `export`: placing tables on devices, and handing the plan to TorchRec."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Literal

from shard_ray.cli.commands import add_command
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError
from shard_ray.plan.plan import PlanSettings
from shard_ray.plan.topology import GB, Optimizer, Topology


@dataclass(frozen=True)
class TopologyArgs:
    """The devices a plan is for; unset values come from the plan file (evaluate) or Topology's defaults."""

    memory_gb: float | None = setting(None, "memory cap per device in GiB (weights + optimizer state)", min=1e-9)
    batch_size: int | None = setting(
        None, f"global batch size (default {Topology.model_fields['batch_size'].default})", min=1
    )
    optimizer: Optimizer | None = setting(
        None, f"optimizer whose state counts towards memory (default {Topology.model_fields['optimizer'].default})"
    )

    def topology(self, num_devices: int, recorded: PlanSettings | None = None) -> Topology:
        """The topology these flags give, a plan's `recorded` settings filling what is not given."""
        recorded_values = recorded.model_dump() if recorded is not None else {}
        memory_gb = self.memory_gb if self.memory_gb is not None else recorded_values.get("memory_gb")
        if memory_gb is None:
            raise ShardRayError("give --memory-gb, the memory cap per device (a plan file from `plan` records it)")
        values = {
            "batch_size": self.batch_size or recorded_values.get("batch_size"),
            "optimizer": self.optimizer or recorded_values.get("optimizer"),
        }
        return Topology(
            num_devices=num_devices, memory_bytes=int(memory_gb * GB), **{k: v for k, v in values.items() if v}
        )


@dataclass(frozen=True)
class PlanArgs:
    tables: str = setting(None, "table file to place", required=True)
    devices: int = setting(None, "number of devices", required=True, min=1)
    algo: str = setting(None, "algorithm name (see `shard-ray algorithms`)", required=True)
    out: str = setting(None, "plan file to write (.json)", required=True)
    seed: int = setting(0, "random seed")
    cost_model: str | None = setting(
        None,
        "cost model file for model-based algorithms (default: the models `calibrate` saved for --hardware, "
        "else the shipped CPU models)",
    )
    hardware: str | None = setting(
        None, "hardware id the plan is for, e.g. 'cuda:NVIDIA H100 80GB HBM3' (default: this machine's)"
    )
    policy: str | None = setting(None, "dreamshard: policy file or `policy train` folder (default: the shipped policy)")
    samples: int | None = setting(
        None, "dreamshard: also sample this many plans, keep the best simulated (default 0)", min=0
    )
    search_config: str | None = setting(None, "cost_search: tuned search settings (best.json of `tune search`)")
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

        settings = load_tuned(self.search_config, "search") if self.search_config else {}
        settings.update({k: v for k, v in {"policy": self.policy, "samples": self.samples}.items() if v is not None})
        for item in self.set:
            name, equals, value = item.partition("=")
            if not equals or not name.strip():
                raise ShardRayError(f"--set takes NAME=VALUE, got {item!r}")
            try:
                settings[name.strip()] = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ShardRayError(f"--set {name.strip()}: {value!r} is not a YAML value") from None
        return settings


@dataclass(frozen=True)
class ExportArgs:
    plan: str = setting(None, "plan file to export", required=True)
    tables: str = setting(None, "the table file the plan places (for row counts)", required=True)
    out: str = setting(None, "file to write (.json)", required=True)
    format: Literal["torchrec"] = setting("torchrec", "export format")
    module_path: str = setting(
        "",
        "the EmbeddingBagCollection's path in the model, e.g. sparse_arch.embedding_bag_collection (default: the model is the collection)",
    )
    device: Literal["cuda", "cpu"] = setting("cuda", "device type of the ranks")


def cmd_algorithms(args: argparse.Namespace) -> None:
    from shard_ray.placement import algorithms

    for info in algorithms():
        print(f"{info.name:<20} {info.family:<10} {info.description}")


def cmd_plan(args: argparse.Namespace) -> None:
    from shard_ray.placement import place
    from shard_ray.plan.plan import save_plan
    from shard_ray.plan.summary import format_plan_summary
    from shard_ray.profiling.hardware import hardware_id
    from shard_ray.workload.tables import load_tables

    flags = settings_from(PlanArgs, args)
    tables = load_tables(flags.tables)
    topology = settings_from(TopologyArgs, args).topology(flags.devices)
    plan = place(
        flags.algo,
        tables,
        topology,
        seed=flags.seed,
        cost_model=flags.cost_model,
        hardware=flags.hardware or hardware_id(threads=1),  # as the profiling actors and the gang name it
        settings=flags.algorithm_settings(),
        settings_source=flags.search_config,
    )
    save_plan(flags.out, plan)
    estimate = plan.estimate
    predicted, lower_bound = (estimate.predicted, estimate.lower_bound_ms) if estimate else (None, None)
    print(format_plan_summary(plan, tables, topology, predicted, "simulated", lower_bound))
    warnings = estimate.warnings if estimate else []
    for line in warnings:
        print(f"warning: {line}")
    if warnings:
        print(
            f"the models' prices above are extrapolated: `shard-ray calibrate --tables {flags.tables} "
            f"--devices {flags.devices}` measures this task here and fits the models to this hardware"
        )
    print(f"placed {len(tables)} tables in {plan.placement_seconds * 1e3:.2f} ms; wrote {flags.out}")


def cmd_export(args: argparse.Namespace) -> None:
    from shard_ray.interop.torchrec import export_plan, save_export
    from shard_ray.plan.plan import load_plan
    from shard_ray.workload.tables import load_tables

    flags = settings_from(ExportArgs, args)
    tables = load_tables(flags.tables)
    exported = export_plan(load_plan(flags.plan), tables, module_path=flags.module_path, device_type=flags.device)
    save_export(flags.out, exported)
    column_wise = sum(t.sharding_type == "column_wise" for t in exported.tables.values())
    print(
        f"wrote {flags.out}: {len(exported.tables)} tables on {exported.world_size} ranks "
        f"({len(exported.tables) - column_wise} table-wise, {column_wise} column-wise) for module {flags.module_path!r}"
    )
    print(
        f"use: plan = shard_ray.interop.torchrec.load_sharding_plan({str(flags.out)!r}); "
        "DistributedModelParallel(model, plan=plan, ...)"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "algorithms")
    p.set_defaults(run=cmd_algorithms)

    p = add_command(sub, "plan")
    add_settings(p, PlanArgs)
    add_settings(p, TopologyArgs)
    p.set_defaults(run=cmd_plan)

    p = add_command(sub, "export")
    add_settings(p, ExportArgs)
    p.set_defaults(run=cmd_export)
