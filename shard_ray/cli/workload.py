"""`generate` and `tasks`: table pools and the task files drawn from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shard_ray.cli.commands import add_command
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.io import DOCUMENT_SUFFIXES
from shard_ray.workload.synthetic import PoolConfig
from shard_ray.workload.tasks import TaskConfig


@dataclass(frozen=True)
class GenerateArgs:
    out: str = setting(
        None, "table file to write (.json; YAML where named .yaml or .yml)", required=True, new_file=True,
        suffixes=DOCUMENT_SUFFIXES,
    )  # fmt: skip
    from_dataset: str | None = setting(None, "a dlrm_datasets file (indices, offsets, lengths; plain or gzipped)")
    dim: int = setting(64, "dim given to tables derived from a dataset", min=4)


@dataclass(frozen=True)
class TasksArgs:
    tables: str = setting(None, "table file of the pool", required=True, old_names=("--pool",))
    out: str = setting(
        None,
        "folder for the task files and the train/test pools",
        required=True,
        old_names=("--out-dir",),
        new_folder=True,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from shard_ray.workload.synthetic import generate_pool
    from shard_ray.workload.tables import save_tables

    flags = settings_from(GenerateArgs, args)
    if flags.from_dataset:
        from shard_ray.workload.dlrm_dataset import tables_from_dataset  # torch reads the file: only here

        tables = tables_from_dataset(flags.from_dataset, dim=flags.dim)
        source = {"source": str(Path(flags.from_dataset).resolve())}
    else:
        pool = settings_from(PoolConfig, args)
        tables = generate_pool(pool)
        source = {"source": "synthetic", "seed": pool.seed}
    save_tables(flags.out, tables, **source)
    print(f"wrote {len(tables)} tables to {flags.out}")


def cmd_tasks(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables
    from shard_ray.workload.tasks import write_tasks

    flags = settings_from(TasksArgs, args)
    config = settings_from(TaskConfig, args)
    paths = write_tasks(load_tables(flags.tables), config, flags.out)
    print(
        f"wrote {len(paths) - 2} task files ({config.num_tasks} train, {config.num_tasks} test) "
        f"and the train_pool.json / test_pool.json they were drawn from to {flags.out}"
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "generate")
    add_settings(p, GenerateArgs)
    add_settings(p, PoolConfig)
    p.set_defaults(run=cmd_generate)

    p = add_command(sub, "tasks")
    add_settings(p, TasksArgs)
    add_settings(p, TaskConfig)
    p.set_defaults(run=cmd_tasks)
