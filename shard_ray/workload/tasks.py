"""Sharding tasks as in the published work: disjoint train/test table pools, tasks drawn from each.

A task is a set of T tables (T drawn from a range) whose dims are redrawn from a set, written
as an ordinary table file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError, ShardRayWarning
from shard_ray.workload.tables import TableSpec, save_tables


def check_table_counts(min_tables: int, max_tables: int) -> None:
    """Refuse task sizes of fewer than 1 table, or whose fewest tables are more than their most, naming the flags."""
    if min_tables < 1:
        raise ShardRayError(f"--min-tables must be at least 1, got {min_tables}")
    if min_tables > max_tables:
        raise ShardRayError(
            f"--min-tables {min_tables} is more than --max-tables {max_tables}: a task's fewest tables must be at "
            "most its most"
        )


@dataclass(frozen=True)
class TaskConfig:
    num_tasks: int = setting(10, "tasks per split", min=1)
    min_tables: int = setting(10, "fewest tables in a task", min=1)
    max_tables: int = setting(40, "most tables in a task", min=1)
    dims: tuple[int, ...] = setting((16, 32, 64, 128), "dims tables are given, comma-separated multiples of 4", min=1)
    test_fraction: float = setting(0.5, "share of the pool's tables held out for test tasks")
    seed: int = setting(0, "random seed", min=0)

    def check(self) -> None:
        if self.num_tasks < 1:
            raise ShardRayError(f"--num-tasks must be at least 1, got {self.num_tasks}")
        check_table_counts(self.min_tables, self.max_tables)
        bad = [d for d in self.dims if d <= 0 or d % 4]
        if not self.dims or bad:
            raise ShardRayError(f"--dims must be positive multiples of 4, got {', '.join(map(str, bad or ['none']))}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ShardRayError(
                f"--test-fraction must be between 0 and 1 (the share of the pool's tables held out for test tasks), "
                f"got {self.test_fraction:g}"
            )


def split_pool(pool: list[TableSpec], test_fraction: float, seed: int) -> tuple[list[TableSpec], list[TableSpec]]:
    """Disjoint (train, test) pools; the same seed gives the same split."""
    order = np.random.default_rng(seed).permutation(len(pool))
    n_test = int(round(len(pool) * test_fraction))
    if n_test == 0 or n_test == len(pool):
        raise ShardRayError(f"a pool of {len(pool)} tables cannot be split with test fraction {test_fraction}")
    test = [pool[i] for i in sorted(order[:n_test])]
    train = [pool[i] for i in sorted(order[n_test:])]
    return train, test


def draw_task(pool: list[TableSpec], config: TaskConfig, rng: np.random.Generator) -> list[TableSpec]:
    if config.min_tables > len(pool):
        raise ShardRayError(
            f"tasks need at least {config.min_tables} tables but the pool has {len(pool)}: lower the fewest tables "
            f"in a task to at most {len(pool)}, or give a bigger pool (`shard-ray generate`)"
        )
    count = int(rng.integers(config.min_tables, min(config.max_tables, len(pool)) + 1))
    chosen = sorted(rng.choice(len(pool), size=count, replace=False))
    return [pool[i].with_dim(int(rng.choice(config.dims))) for i in chosen]


def write_tasks(pool: list[TableSpec], config: TaskConfig, out_dir: str | Path) -> list[Path]:
    """Write train_pool.json, test_pool.json, train_000.json ... and test_000.json ... into `out_dir`.

    All or nothing: every task is drawn before anything is written, and the files are written
    to a hidden folder inside `out_dir` and moved in only once all of them are whole.
    """
    config.check()
    train_pool, test_pool = split_pool(pool, config.test_fraction, config.seed)
    fewest = min(len(train_pool), len(test_pool))
    if config.min_tables > fewest:  # said of the splits: the pool itself may hold enough
        raise ShardRayError(
            f"tasks need at least {config.min_tables} tables but the pool of {len(pool)} splits into "
            f"{len(train_pool)} for training and {len(test_pool)} for testing: lower --min-tables to at most {fewest}, "
            "or give a bigger pool (`shard-ray generate`)"
        )
    if config.max_tables > fewest:
        warnings.warn(
            f"--max-tables {config.max_tables} is more than a split holds: the pool of {len(pool)} tables splits into "
            f"{len(train_pool)} for training and {len(test_pool)} for testing, and a task draws its tables from one",
            ShardRayWarning,
            stacklevel=2,
        )
    rng = np.random.default_rng(config.seed + 1)
    files: list[tuple[str, list[TableSpec], dict[str, object]]] = [
        (f"{split}_pool.json", tables, {"split": split, "seed": config.seed})
        for split, tables in (("train", train_pool), ("test", test_pool))
    ]
    for split, split_pool_tables in (("train", train_pool), ("test", test_pool)):
        for i in range(config.num_tasks):
            name = f"{split}_{i:03d}"
            files.append(
                (
                    f"{name}.json",
                    draw_task(split_pool_tables, config, rng),
                    {"task": name, "split": split, "seed": config.seed},
                )
            )
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tasks.", dir=out))
    try:
        for name, tables, metadata in files:
            save_tables(staging / name, tables, **metadata)
        for name, _, _ in files:
            os.replace(staging / name, out / name)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name, _, _ in files]
