"""What a plan's training step must give: one unsharded table's pooled embeddings and updated weights for the same
batch, checked on ranks joined without Ray (tests/test_step_data_plane.py) and on a gang of Ray actors
(tests/test_ray_measurement.py)."""

from __future__ import annotations

import torch

from shard_ray.plan import Plan, Shard
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.fused_shard import FusedShard, initial_weights
from shard_ray.profiling.plan_step import upstream_gradient
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec


def every_sharding_type_plan(small_tables: list[TableSpec]) -> tuple[list[TableSpec], Plan]:
    """The conftest's tables and one more, on 2 devices: table-, column-, row-wise, a grid and data-parallel."""
    tables = [*small_tables, TableSpec(name="g", rows=4000, dim=32, pooling_factor=6.0)]
    plan = Plan(
        num_devices=2,
        algorithm="every-type",
        shards=[
            Shard(table="a", device=1, columns=(0, 32)),
            Shard(table="b", device=0, columns=(0, 32)),
            Shard(table="b", device=1, columns=(32, 64)),
            Shard(table="c", device=0, columns=(0, 16), rows=(0, 300)),  # fp16, row-wise
            Shard(table="c", device=1, columns=(0, 16), rows=(300, 800)),
            Shard(table="d", device=1, columns=(0, 32), rows=(0, 30000)),
            Shard(table="d", device=0, columns=(0, 32), rows=(30000, 100000)),
            Shard(table="e", device=0, columns=(0, 8), replicated=True),
            Shard(table="e", device=1, columns=(0, 8), replicated=True),
            Shard(table="g", device=0, columns=(0, 16), rows=(0, 2500)),  # a grid
            Shard(table="g", device=1, columns=(0, 16), rows=(2500, 4000)),
            Shard(table="g", device=1, columns=(16, 32)),
        ],
    )
    return tables, plan


def assert_trains_as_one_unsharded_table(
    values: list[dict], plan: Plan, tables: list[TableSpec], config: MeasureConfig
) -> None:
    """One step of `plan` (each device's `PlanStep.values`) gives the pooled embeddings and updated weights one unsharded
    table gives for the same batch, and every piece trained."""
    reference = FusedShard([TablePiece.whole(t) for t in tables], config, torch.device("cpu"))
    reference.load_initial_weights()
    pooled = reference.forward(0)
    gradient = upstream_gradient(config.batch_size, pooled[0].shape[1], seed=config.seed)
    reference.backward(pooled, (gradient, torch.zeros(0, 0)))
    trained = dict(zip((t.name for t in tables), reference.piece_weights()))

    embeddings = torch.cat([v["embeddings"] for v in values])
    assert torch.allclose(embeddings, pooled[0].detach(), atol=1e-4)
    for pieces, value in zip(plan.pieces(tables), values):
        assert len(value["weights"]) == len(pieces)
        for piece, weights in zip(pieces, value["weights"]):
            rows, columns = piece.row_range, piece.columns
            expected = trained[piece.table.name][rows[0] : rows[1], columns[0] : columns[1]].float()
            tolerance = 2e-3 if piece.table.precision == "fp16" else 1e-5
            assert torch.allclose(weights, expected, atol=tolerance), piece.key
            assert not torch.equal(weights, initial_weights(piece, None).to(weights.dtype)), piece.key  # it trained


def sgd_step(seed: int) -> MeasureConfig:
    """A step the unsharded table computes alike: plain SGD, every table whole in memory."""
    return MeasureConfig(batch_size=96, optimizer="sgd", max_rows=10**6, seed=seed)
