"""TorchRec in and out: its planner as a baseline, and shard-ray plans as TorchRec ShardingPlans.

Tables become an `EmbeddingBagCollection` of `EmbeddingBagConfig`s, one feature per table named
after it. TorchRec's `EmbeddingShardingPlanner` plans that collection on the meta device for the
task's device count, memory cap (its HBM cap, none of it held back), optimizer (so its storage
estimate counts the optimizer state, as shard-ray's memory model does) and per-rank batch, free to
choose table-wise, column-wise, row-wise, table-row-wise and data-parallel, and its plan is
converted to ours (row shards, replicated shards). The other way, a shard-ray plan becomes a
`ShardingPlan` for `DistributedModelParallel`: a table on one device is table-wise, a table split
by columns is column-wise with one `ShardMetadata` per column range (ranks may repeat), a
row-wise table is TorchRec's row-wise layout, a data-parallel one is dense on every rank.

The export file (`shard-ray export --format torchrec`) is JSON, not a pickle, so that loading it
runs no code; `load_sharding_plan` turns it into the ShardingPlan objects:

    {"format": "shard-ray-torchrec-plan/1", "module_path": "sparse_arch.embedding_bag_collection",
     "world_size": 2, "device_type": "cuda",
     "tables": {"t0": {"sharding_type": "column_wise", "compute_kernel": "fused", "ranks": [0, 1],
                       "shards": [{"offsets": [0, 0], "sizes": [1000, 32], "rank": 0}, ...]}}}
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shard_ray.errors import InfeasibleError, ShardRayError, describe_validation_error, first_line
from shard_ray.io import read_document, write_document
from shard_ray.plan.enumerator import pieces_to_place
from shard_ray.plan.piece import TablePiece, row_wise, table_row_wise
from shard_ray.plan.plan import Plan, PlanSettings, Shard, TableSharding, laid_out_as
from shard_ray.plan.topology import Topology, format_gb
from shard_ray.workload.tables import TableSpec

EXPORT_FORMAT = "shard-ray-torchrec-plan/1"


def _row_wise_adagrad() -> type:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return RowWiseAdagrad


def _sgd() -> type:
    import torch

    return torch.optim.SGD


def _adam() -> type:
    import torch

    return torch.optim.Adam


# shard-ray's optimizer names and the classes TorchRec's storage estimate knows
_OPTIMIZERS = {"rowwise_adagrad": _row_wise_adagrad, "sgd": _sgd, "adam": _adam}
# TorchRec's sharding types a shard-ray plan expresses, its planner may choose, and the export writes.
TORCHREC_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
# The types whose input distribution TorchRec runs on GPUs only.
ROW_TYPES = ("row_wise", "table_row_wise")


def embedding_bag_configs(tables: list[TableSpec]) -> list[Any]:
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[t.name],
            data_type=DataType.FP16 if t.precision == "fp16" else DataType.FP32,
        )
        for t in tables
    ]


def meta_collection(tables: list[TableSpec]) -> Any:
    """The tables as an EmbeddingBagCollection on the meta device (no memory)."""
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection(tables=embedding_bag_configs(tables), device=torch.device("meta"))


@contextmanager
def _quiet_torchrec() -> Iterator[None]:
    """TorchRec's planner logs warnings about dry runs and hand-made topologies on every call, some on
    the root logger ("Sharding spec not found" for every data-parallel table)."""
    loggers = [logging.getLogger(name) for name in ("torchrec", "torchrec.distributed.planner", "")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def plan_with_torchrec(tables: list[TableSpec], topology: Topology) -> Plan:
    """TorchRec's EmbeddingShardingPlanner on the task, its plan in shard-ray's type."""
    import warnings

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    constraints = {
        t.name: ParameterConstraints(
            sharding_types=list(TORCHREC_TYPES), compute_kernels=["fused", "dense"], pooling_factors=[t.pooling_factor]
        )
        for t in tables
    }
    with _quiet_torchrec(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = EmbeddingShardingPlanner(
            topology=_torchrec_topology(topology),
            batch_size=max(1, topology.batch_size // topology.num_devices),  # TorchRec's batch is per rank
            storage_reservation=HeuristicalStorageReservation(percentage=0.0, dense_tensor_estimate=0),
            constraints=constraints,
            debug=False,
        )
        collection = meta_collection(tables)
        # the optimizer tells TorchRec's storage estimate what state to count, as shard-ray's memory model does
        apply_optimizer_in_backward(_OPTIMIZERS[topology.optimizer](), collection.parameters(), {"lr": 0.01})
        try:
            sharding_plan = planner.plan(collection, [EmbeddingBagCollectionSharder()])
        except PlannerError as err:  # no plan within memory (or its partitioner gave up)
            raise InfeasibleError(_why_no_plan(tables, topology, first_line(err))) from None
    return _as_plan(sharding_plan.plan[""], tables, topology)


def _torchrec_topology(topology: Topology) -> Any:
    """TorchRec's topology of shard-ray's: its devices, memory cap, hosts and the rates between them."""
    from torchrec.distributed.planner import Topology as TorchRecTopology

    return TorchRecTopology(
        world_size=topology.num_devices,
        compute_device="cuda",
        hbm_cap=topology.memory_bytes,
        local_world_size=topology.devices_per_host_or_all,
        inter_host_bw=topology.inter_host_gbps * 1024**3 / 1000,  # TorchRec's unit: bytes per ms
        # a rate inside a host given to shard-ray (`--intra-host-gbps`) reaches TorchRec's planner too
        **({"intra_host_bw": topology.intra_host_gbps * 1024**3 / 1000} if topology.intra_host_gbps else {}),
    )


def torchrec_table_wise_comms(tables: list[TableSpec], topology: Topology) -> dict[str, tuple[float, float, float]]:
    """TorchRec's estimator's price of each table placed table-wise (fused kernel) on the topology: its input
    distribution, forward and backward all-to-all ms (`EmbeddingPerfEstimator`, TorchRec's planner's own). It is
    the same on every device: a device's all-to-alls, by TorchRec, are its tables' sum."""
    import warnings

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise"], compute_kernels=["fused"], pooling_factors=[t.pooling_factor]
        )
        for t in tables
    }
    with _quiet_torchrec(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchrec_topology = _torchrec_topology(topology)
        enumerator = EmbeddingEnumerator(
            topology=torchrec_topology,
            batch_size=max(1, topology.batch_size // topology.num_devices),
            constraints=constraints,
            estimator=[
                EmbeddingPerfEstimator(torchrec_topology, constraints),
                EmbeddingStorageEstimator(torchrec_topology, constraints),
            ],
        )
        options = enumerator.enumerate(meta_collection(tables), [EmbeddingBagCollectionSharder()])
    return {
        o.name: (o.shards[0].perf.input_dist_comms, o.shards[0].perf.fwd_comms, o.shards[0].perf.bwd_comms)
        for o in options
    }


def _why_no_plan(tables: list[TableSpec], topology: Topology, torchrec_said: str) -> str:
    """TorchRec's no-plan message, with the table that does not fit and by how much by shard-ray's memory model."""
    said = f"TorchRec's planner found no plan ({torchrec_said.strip().rstrip('.')})"
    try:
        pieces_to_place(tables, topology)
    except InfeasibleError as reason:
        return f"{said}: {reason}"
    largest = max(tables, key=lambda t: TablePiece.whole(t).memory_bytes(topology.optimizer))
    need = TablePiece.whole(largest).memory_bytes(topology.optimizer)
    return (
        f"{said}, though the tables fit by shard-ray's memory model; its largest table, {largest.name!r}, needs "
        f"{format_gb(need)} (weights + {topology.optimizer} state) of the {format_gb(topology.memory_bytes)} "
        "per device: TorchRec's storage estimate counts more than weights and optimizer state"
    )


def _as_plan(module_plan: Any, tables: list[TableSpec], topology: Topology) -> Plan:
    """TorchRec's parameter shardings of the collection as a shard-ray plan, each table's type recorded."""
    by_name = {t.name: t for t in tables}
    shards, recorded = [], {}
    for name, sharding in module_plan.items():
        if sharding.sharding_type not in TORCHREC_TYPES:
            raise ShardRayError(
                f"table {name!r} is sharded {sharding.sharding_type}, which a shard-ray plan cannot express (it takes "
                f"{', '.join(TORCHREC_TYPES)})"
            )
        if sharding.compute_kernel not in ("fused", "dense"):  # rows in host memory or a cache: not what is measured
            raise ShardRayError(
                f"table {name!r} runs TorchRec's {sharding.compute_kernel} kernel, which shard-ray neither measures nor "
                "prices (it holds every table in device memory, fused or dense): give it the fused kernel to compare"
            )
        if sharding.sharding_type == "data_parallel":
            recorded[name] = _recorded_sharding(sharding.sharding_type, sharding.ranks, topology, len(sharding.ranks))
            shards += [
                Shard(table=name, device=r, columns=(0, by_name[name].dim), replicated=True) for r in sharding.ranks
            ]
            continue
        # TorchRec's row-wise gives ranks past the table's rows an empty block
        metas = [meta for meta in sharding.sharding_spec.shards if meta.shard_sizes[0] > 0]
        recorded[name] = _recorded_sharding(sharding.sharding_type, sharding.ranks, topology, len(metas))
        for meta in metas:
            (row, start), (rows, width) = meta.shard_offsets, meta.shard_sizes
            row_range = None if (row, rows) == (0, by_name[name].rows) else (row, row + rows)
            shards.append(
                Shard(table=name, device=meta.placement.rank(), columns=(start, start + width), rows=row_range)
            )
    return Plan(num_devices=topology.num_devices, algorithm="torchrec", shards=shards, tables=recorded)


def plan_from_torchrec(
    sharding: Any, tables: list[TableSpec], topology: Topology, module_path: str = "", name: str = "torchrec_plan"
) -> Plan:
    """A TorchRec `ShardingPlan` (the plan a model trains with today: its planner's, or a team's own rules) as a
    shard-ray plan of `tables` on `topology`, the `EmbeddingBagCollection` at `module_path`; `name` its algorithm, as
    `compare` names it. Checked as a plan file is (every table placed once, within the devices' memory), its settings
    recorded as `plan` records them, so that `evaluate`, `compare` and `plan --measure --incumbent` take its file
    (`save_plan`) beside shard-ray's. The inverse of `sharding_plan(export_plan(...))`."""
    plans = getattr(sharding, "plan", None)
    if not isinstance(plans, dict):
        raise ShardRayError(f"expected a TorchRec ShardingPlan, got a {type(sharding).__name__}")
    if module_path not in plans:
        found = ", ".join(repr(m) for m in plans) or "none"
        raise ShardRayError(f"the ShardingPlan has no module {module_path!r} (its modules: {found}): give module_path")
    module_plan = plans[module_path]
    unknown = sorted(set(module_plan) - {t.name for t in tables})
    if unknown:
        raise ShardRayError(f"the ShardingPlan shards tables not among these: {', '.join(map(repr, unknown[:5]))}")
    # A table on every rank (row-wise, data-parallel) or every rank of a host says how many there are: a plan of 4
    # ranks read as 8 devices was taken, 4 of them empty (a walk).
    d, per_host = topology.num_devices, topology.devices_per_host_or_all
    for table, sharding in module_plan.items():
        ranks = list(sharding.ranks or [])
        over = {"row_wise": d, "data_parallel": d, "table_row_wise": per_host}.get(sharding.sharding_type)
        if ranks and max(ranks) >= d:
            raise ShardRayError(f"table {table!r} is on rank {max(ranks)}, past the topology's {d} devices")
        if over is not None and len(ranks) != over:
            ranks_of = "ranks" if sharding.sharding_type != "table_row_wise" else "ranks of a host"
            raise ShardRayError(
                f"table {table!r} is {sharding.sharding_type} over {len(ranks)} ranks, where the topology has {over} "
                f"{ranks_of}: give the Topology the ShardingPlan's world"
            )
    plan = _as_plan(module_plan, tables, topology).model_copy(
        update={
            "algorithm": name,
            "settings": PlanSettings.for_topology(topology, tables),
        }
    )
    plan.check(tables)
    plan.check_memory(tables, topology)
    return plan.model_copy(update={"memory_bytes": plan.device_memory_bytes(tables, topology)})


class ExportedShard(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offsets: tuple[int, int]
    sizes: tuple[int, int]
    rank: int = Field(ge=0)


class ExportedTable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sharding_type: Literal["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel"]
    compute_kernel: str = "fused"
    ranks: list[int] = Field(min_length=1)
    shards: list[ExportedShard] = []  # none for data-parallel: every rank holds the whole table


class ExportedPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["shard-ray-torchrec-plan/1"] = EXPORT_FORMAT
    module_path: str = ""
    world_size: int = Field(ge=1)
    local_world_size: int | None = Field(default=None, ge=1)  # ranks per host; None: every rank on one host
    device_type: Literal["cuda", "cpu"] = "cuda"
    tables: dict[str, ExportedTable]


def _recorded_sharding(kind: str, ranks: list[int], topology: Topology, pieces: int) -> TableSharding:
    """TorchRec's sharding of a table as a plan records it: in one piece (`pieces`: its shards not empty), the table
    whole on its rank (column-wise in one piece, table-row-wise on a host of one device, row-wise on one rank or of a
    table of one row, TorchRec's other blocks empty); table-row-wise on one host row-wise over its devices (the same
    blocks on the same ranks)."""
    if kind != "data_parallel" and pieces == 1:
        return TableSharding(type="table_wise")
    if kind != "table_row_wise":
        return TableSharding(type=kind)
    if topology.num_hosts == 1:
        return TableSharding(type="row_wise")
    return TableSharding(type=kind, host=ranks[0] // topology.devices_per_host_or_all)


def export_plan(
    plan: Plan, tables: list[TableSpec], module_path: str = "", device_type: Literal["cuda", "cpu"] = "cuda"
) -> ExportedPlan:
    """A checked shard-ray plan as TorchRec parameter shardings.

    Table- and column-wise shards go as they are (column ranges in order); a data-parallel table is
    dense on every rank; a row-wise table must be in TorchRec's layout (blocks of ceil(rows / D)
    rows, block k on rank k, as `row_wise` cuts it), because TorchRec's input distribution
    bucketizes ids that way, and goes with TorchRec's empty blocks for ranks past its rows; a
    table-row-wise table likewise over its host's ranks (blocks of ceil(rows / local world size)). A plan that puts
    more on a device than the cap it was made under (of tables grown since, say) is refused: its ranks would run out
    of memory at their start.
    """
    if device_type not in ("cuda", "cpu"):  # pydantic's ValidationError for ExportedPlan, from a script
        raise ShardRayError(f"device_type must be 'cuda' or 'cpu' (TorchRec's device types), got {device_type!r}")
    if module_path and not all(module_path.split(".")):  # torch names no submodule "": "a..b" names none in any model
        raise ShardRayError(
            f"module path {module_path!r} has an empty name between its dots (e.g. sparse_arch.embedding_bag_collection)"
        )
    plan.check(tables)
    if plan.settings is not None:
        plan.check_memory(tables, plan.topology())
    by_name = {t.name: t for t in tables}
    shardings = plan.table_shardings(tables)
    exported = {}
    for name, shards in plan.shards_of().items():
        table = by_name[name]
        kind = shardings[name].type
        if kind == "data_parallel":
            exported[name] = ExportedTable(
                sharding_type=kind, compute_kernel="dense", ranks=list(range(plan.num_devices))
            )
        elif kind == "row_wise":
            exported[name] = _row_wise_export(table, shards, plan.num_devices)
        elif kind == "table_row_wise":
            per_host, host = plan.devices_per_host, shardings[name].host
            exported[name] = _row_blocks_export(
                table, kind, table_row_wise(table, per_host, host), host * per_host, per_host
            )
        elif kind == "grid":
            raise ShardRayError(
                f"table {name!r} is split by rows and by columns (a grid), which the export does not write; "
                "plan it row-wise or column-wise"
            )
        else:
            shards = sorted(shards, key=lambda s: s.columns[0])
            exported[name] = ExportedTable(
                sharding_type=kind,
                ranks=[s.device for s in shards],
                shards=[
                    ExportedShard(offsets=(0, s.columns[0]), sizes=(table.rows, s.width), rank=s.device) for s in shards
                ],
            )
    exported_plan = ExportedPlan(
        module_path=module_path,
        world_size=plan.num_devices,
        local_world_size=plan.settings.devices_per_host if plan.settings is not None else None,
        device_type=device_type,
        tables=exported,
    )
    if device_type == "cpu":
        check_cpu_ranks(exported_plan)
    return exported_plan


def check_cpu_ranks(exported: ExportedPlan) -> None:
    """Refuse a plan for CPU ranks with row-wise or table-row-wise tables: TorchRec runs their input distribution on
    GPUs only, so CPU ranks would fail at their first step; refused when exported, before any rank starts."""
    by_rows = {n: t.sharding_type for n, t in exported.tables.items() if t.sharding_type in ROW_TYPES}
    if by_rows:
        types = ", ".join(t for t in ROW_TYPES if t in by_rows.values())
        raise ShardRayError(
            f"TorchRec runs row-wise shards on GPUs only, and this plan has them: {', '.join(sorted(by_rows))}; plan "
            f"with a constraints file giving these tables `not_types: [{types}]` for CPU ranks"
        )


def _row_wise_export(table: TableSpec, shards: list[Shard], world_size: int) -> ExportedTable:
    blocks = row_wise(table, world_size)
    if not laid_out_as(table, shards, blocks):
        raise ShardRayError(
            f"table {table.name!r}'s row shards are not TorchRec's row-wise layout (blocks of {blocks[0].row_count} "
            "rows, block k on rank k) nor, over hosts, its table-row-wise layout, the only ones its input "
            "distribution runs; plan it with shard-ray, which cuts rows that way"
        )
    return _row_blocks_export(table, "row_wise", blocks, 0, world_size)


def _row_blocks_export(
    table: TableSpec, kind: str, blocks: list[TablePiece], first_rank: int, ranks: int
) -> ExportedTable:
    """Row blocks on `ranks` ranks from `first_rank`; TorchRec gives the ranks past the table's rows an
    empty block, at the end of the rows."""
    sizes = [p.row_count for p in blocks] + [0] * (ranks - len(blocks))
    offsets = [sum(sizes[:k]) for k in range(ranks)]
    return ExportedTable(
        sharding_type=kind,
        ranks=list(range(first_rank, first_rank + ranks)),
        shards=[
            ExportedShard(offsets=(o, 0), sizes=(z, table.dim), rank=first_rank + k)
            for k, (o, z) in enumerate(zip(offsets, sizes))
        ],
    )


def save_export(path: str | Path, exported: ExportedPlan) -> None:
    write_document(path, exported.model_dump(mode="json"))


def load_export(path: str | Path) -> ExportedPlan:
    document = read_document(path, "TorchRec plan")
    try:
        return ExportedPlan.model_validate(document)
    except ValidationError as err:
        raise ShardRayError(describe_validation_error(err, f"TorchRec plan {path}")) from None


def sharding_plan(exported: ExportedPlan, local_world_size: int | None = None) -> Any:
    """The TorchRec `ShardingPlan` for `DistributedModelParallel(..., plan=...)`.

    Rank r's device is cuda:(r mod local_world_size): `local_world_size` given here, else the
    plan's hosts (`plan --devices-per-host`), else one host for every rank.
    """
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    local = local_world_size or exported.local_world_size or exported.world_size

    def placement(rank: int) -> str:
        return f"rank:{rank}/cpu" if exported.device_type == "cpu" else f"rank:{rank}/cuda:{rank % local}"

    module_plan = EmbeddingModuleShardingPlan()
    for name, table in exported.tables.items():
        spec = [
            ShardMetadata(shard_offsets=list(s.offsets), shard_sizes=list(s.sizes), placement=placement(s.rank))
            for s in table.shards
        ]
        module_plan[name] = ParameterSharding(
            sharding_type=table.sharding_type,
            compute_kernel=table.compute_kernel,
            ranks=table.ranks,
            sharding_spec=EnumerableShardingSpec(spec) if spec else None,  # data-parallel: none, as TorchRec's own
        )
    return ShardingPlan({exported.module_path: module_plan})


def load_sharding_plan(path: str | Path, local_world_size: int | None = None) -> Any:
    """Read an exported plan file into a TorchRec ShardingPlan (the call to make in a training script)."""
    return sharding_plan(load_export(path), local_world_size)
