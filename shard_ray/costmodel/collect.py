"""Cost data at scale through the Ray profiling actors and the device gang.

Compute data: random fused shards of augmented pool tables, at several batch sizes, measured
forward and backward on the profiling actors. Communication data: plans of varied balance
(device shares drawn from a Dirichlet, from very skewed to even) measured on a gang of each
device count. Both are deterministic in their seed and keyed by content in the store, so a
stopped run started again measures only what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from shard_ray.configfile import setting
from shard_ray.plan.piece import TablePiece, data_parallel, replica, row_wise
from shard_ray.plan.plan import Plan
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.sampling import augment_table, draw_augmented_fused_shards, microbenchmark_shards
from shard_ray.workload.tables import TableSpec

if TYPE_CHECKING:  # Ray, torch and the store where data is collected, not in `collect`'s flags
    from shard_ray.profiling.actors import ProfilingPool
    from shard_ray.profiling.store import MeasurementStore

COLLECT_DIMS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class CollectConfig:
    samples: int = setting(500, "shards (compute) or plans per device count (comm)", min=1)
    min_tables: int = setting(1, "fewest tables in a compute shard", min=1)
    max_tables: int = setting(16, "most tables in a compute shard", min=1)
    batch_sizes: tuple[int, ...] = setting((512, 1024, 2048), "batch sizes, comma-separated, used in turn", min=1)
    device_counts: tuple[int, ...] = setting((2,), "gang sizes for comm data, comma-separated", min=1)
    mixed: float = setting(
        0.3,
        "share of the comm plans with tables split by rows or columns or replicated beside whole ones: several "
        "sharding types, one set of all-to-alls each, as TorchRec's plans run",
        min=0.0,
    )
    replicated: float = setting(
        0.2,
        "share of the compute shards with 1 to 3 of their tables (those of at most 100,000 rows) as data-parallel "
        "replicas of 2 devices, measured with their dense optimizer update",
        min=0.0,
    )
    dims: tuple[int, ...] = COLLECT_DIMS
    warmup: int = 2
    repeats: int = setting(7, "timed steps per sample", min=1)
    seed: int = setting(0, "random seed", min=0)


def collect_compute(
    pool: list[TableSpec], config: CollectConfig, profiler: ProfilingPool, store: MeasurementStore
) -> int:
    """Measure the microbenchmark's shards at every batch size, then `samples` random shards (batch sizes in turn);
    returns how many were new."""
    drawn = draw_augmented_fused_shards(
        pool, config.samples, config.max_tables, config.dims, config.seed, config.min_tables
    )
    shards = [
        replicate_some(s, config.replicated, np.random.default_rng([config.seed, i])) for i, s in enumerate(drawn)
    ]
    before = store.count()
    for b, batch_size in enumerate(config.batch_sizes):
        measure = MeasureConfig(batch_size=batch_size, warmup=config.warmup, repeats=config.repeats, seed=config.seed)
        group = microbenchmark_shards() + shards[b :: len(config.batch_sizes)]
        print(f"batch {batch_size}: {len(group)} shards, the microbenchmark's and drawn ones, the largest first")
        profiler.measure(group, measure, store)
    return store.count() - before


def replicate_some(shard: list[TablePiece], share: float, rng: np.random.Generator) -> list[TablePiece]:
    """With probability `share`, the shard with 1 to 3 of its tables of at most `REPLICA_ROWS` rows as replicas (of 2
    devices, the first's); drawn by a generator of its own, so the shards of a seed are those it always drew."""
    small = [k for k, piece in enumerate(shard) if piece.table.rows <= REPLICA_ROWS]
    if not small or rng.random() >= share:
        return shard
    chosen = set(rng.choice(small, size=min(len(small), int(rng.integers(1, 4))), replace=False).tolist())
    return [replica(piece.table, 2, 0) if k in chosen else piece for k, piece in enumerate(shard)]


def varied_balance(rng: np.random.Generator, count: int, num_devices: int) -> np.ndarray:
    """Devices for `count` items with shares from Dirichlet(alpha), alpha drawn from 0.2 (skewed) to 5 (even)."""
    shares = rng.dirichlet(np.full(num_devices, float(rng.choice([0.2, 0.5, 1.0, 5.0]))))
    return rng.choice(num_devices, size=count, p=shares)


def draw_comm_plans(
    pool: list[TableSpec], num_devices: int, count: int, config: CollectConfig, seed: int
) -> list[tuple[Plan, list[TableSpec]]]:
    """Plans of varied balance: device shares from Dirichlet(alpha) with alpha from 0.2 (skewed) to 5 (even)."""
    rng = np.random.default_rng(seed)
    plans = []
    for i in range(count):
        size = int(rng.integers(num_devices, 4 * num_devices + 1))
        chosen = rng.choice(len(pool), size=min(size, len(pool)), replace=False)
        tables = [augment_table(pool[j], rng, config.dims, f"c{i}") for j in sorted(chosen)]
        devices = varied_balance(rng, len(tables), num_devices)
        pieces = [TablePiece.whole(t) for t in tables]
        # whether and how a plan is mixed is drawn apart, so the table-wise plans of a seed are those it always drew
        mixing = np.random.default_rng([seed, i])
        if mixing.random() < config.mixed:
            pieces, devices = mix_sharding_types(pieces, devices, num_devices, mixing)
        plans.append((Plan.from_assignment(pieces, devices, num_devices, "comm_sample"), tables))
    return plans


# Tables of at most this many rows may be replicated in a mixed comm plan: a replica's gradient all-reduce moves its
# whole table, which for the pool's largest would outlast the all-to-alls measured beside it by far.
REPLICA_ROWS = 100_000


def mix_sharding_types(
    pieces: list[TablePiece], devices: np.ndarray, num_devices: int, rng: np.random.Generator
) -> tuple[list[TablePiece], list[int]]:
    """A table-wise plan's pieces with 1 to 3 of its tables sharded otherwise: by rows over every device (TorchRec's
    blocks), by columns in two halves on two devices, or (of at most `REPLICA_ROWS` rows) replicated on every device;
    the rest stay where they were."""
    changed = set(rng.choice(len(pieces), size=min(len(pieces), int(rng.integers(1, 4))), replace=False).tolist())
    mixed, placed = [], []
    for k, (piece, device) in enumerate(zip(pieces, devices)):
        table = piece.table
        kinds = ["row_wise"] + ["column_wise"] * (table.dim >= 8) + ["data_parallel"] * (table.rows <= REPLICA_ROWS)
        kind = rng.choice(kinds) if k in changed else "table_wise"
        if kind == "row_wise":
            blocks = row_wise(table, num_devices)
            mixed += blocks
            placed += [block.devices[0] for block in blocks]
        elif kind == "column_wise":
            half = table.dim // 8 * 4  # fbgemm's columns come in fours
            mixed += [TablePiece(table=table, columns=(0, half)), TablePiece(table=table, columns=(half, table.dim))]
            placed += rng.choice(num_devices, size=2, replace=False).tolist()
        elif kind == "data_parallel":
            mixed += data_parallel(table, num_devices)
            placed += list(range(num_devices))
        else:
            mixed.append(piece)
            placed.append(int(device))
    return mixed, placed


def collect_comm(pool: list[TableSpec], config: CollectConfig, store: MeasurementStore) -> int:
    """Measure `samples` plans per device count on a gang of that size; returns how many were new."""
    from shard_ray.costmodel.simulator import price_comm
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.profiling.store import PlanMeasurement

    before = store.count("plan_measurements")
    for num_devices in config.device_counts:
        with DeviceGang(num_devices, comm_pricer=price_comm) as gang:
            samples = draw_comm_plans(pool, num_devices, config.samples, config, config.seed + num_devices)
            todo = []
            for i, (plan, tables) in enumerate(samples):
                measure = MeasureConfig(
                    batch_size=config.batch_sizes[i % len(config.batch_sizes)],
                    warmup=config.warmup,
                    repeats=config.repeats,
                    seed=config.seed,
                )
                todo.append((gang.plan_key(plan, tables, measure), plan, tables, measure))
            known = store.known_keys([k for k, *_ in todo], table="plan_measurements")
            for key, plan, tables, measure in tqdm(
                [t for t in todo if t[0] not in known], desc=f"measuring {num_devices}-device plans", unit="plan"
            ):
                cost = gang.evaluate(plan, tables, measure)
                store.put_plan(PlanMeasurement(key=key, plan=plan, tables=tables, cost=cost))
    return store.count("plan_measurements") - before
