"""Cost models, training, the simulator, the bound, and the searches that use them."""

import dataclasses
import hashlib
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shard_ray.cli import main
from shard_ray.costmodel.bounds import lower_bound, lower_bound_ms
from shard_ray.costmodel.collect import REPLICA_ROWS, CollectConfig, draw_comm_plans, replicate_some
from shard_ray.costmodel.coverage import corrections_at_bound, coverage_problems, training_coverage
from shard_ray.costmodel.features import (
    COMM_FEATURES,
    NUM_SCALAR_FEATURES,
    NUM_TABLE_FEATURES,
    TABLE_FEATURES,
    padded_shards,
    pieces_features,
    table_features,
)
from shard_ray.costmodel.info import Calibrated, ModelInfo
from shard_ray.costmodel.links import link_profile
from shard_ray.costmodel.models import (
    ComputeModel,
    CostModels,
    comm_features,
    default_cost_model_path,
    models_for,
    shipped_models_path,
    task_digest,
)
from shard_ray.costmodel.networks import CommCostNet, ComputeCostNet, Monotone, fused_shard_tensors
from shard_ray.costmodel.pricing import Pricer
from shard_ray.costmodel.settings import TrainConfig
from shard_ray.costmodel.simulator import Simulator
from shard_ray.costmodel.spine import (
    CORRECTION_BOUND,
    QUANTITIES,
    Spine,
    fit_spine,
    physical_quantities,
    spine_shard_ms,
)
from shard_ray.costmodel.train import (
    MissingCommModelWarning,
    collective_sets,
    compute_data,
    data_split,
    evaluate_device_compute,
    evaluate_input_dist,
    evaluate_mixed_comm,
    evaluate_replica_comm,
    fit,
    fit_all_reduce,
    fit_input_overhead,
    fit_step_overhead,
    fit_type_overhead,
    train_compute_model,
    train_cost_models,
)
from shard_ray.errors import ShardRayError
from shard_ray.placement import place
from shard_ray.placement.exact import branch_and_bound
from shard_ray.plan import GB, Plan, Shard, Topology, shard_bytes
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.piece import TablePiece, data_parallel, replica, table_wise
from shard_ray.profiling.fused_shard import measure_fused_shard, table_batch
from shard_ray.profiling.hardware import hardware_id
from shard_ray.profiling.procedure import FusedShardMeasurement, MeasureConfig
from shard_ray.profiling.sampling import draw_augmented_fused_shards
from shard_ray.profiling.store import MeasurementStore, PlanMeasurement
from shard_ray.workload.access import REFERENCE_BATCH, reuse_histogram_of, zipf_indices, zipf_reuse_histogram
from shard_ray.workload.dlrm_dataset import reuse_histogram
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec, load_tables

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def shipped() -> CostModels:
    return CostModels.load(default_cost_model_path())


# The bytes a shard measured in a test's own process may allocate: the pool's largest tables are then capped, as a
# profiling actor's share of memory caps them. Without it they were measured whole, in the pytest worker: 12.8 GB
# of this machine's 23.5, beside the other workers' Ray clusters.
WORKER_BUDGET = GB


@pytest.fixture(scope="module")
def pool() -> list[TableSpec]:
    return generate_pool(PoolConfig(num_tables=60, seed=5))


def test_a_reuse_bins_reads_are_said_as_a_user_counts_them():
    """A new user's walk read "read 2-2 times" for the rows read exactly twice (the bin (1, 2])."""
    from shard_ray.costmodel.coverage import _describe

    assert "read twice per 65536-sample batch" in _describe("reuse_bin_1", 0.4, 0.0, 0.31)
    assert "read 3-4 times per" in _describe("reuse_bin_2", 0.4, 0.0, 0.31)
    assert "read once per" in _describe("reuse_bin_0", 0.4, 0.0, 0.31)


def test_features_are_log_scaled_and_describe_every_distribution_by_its_reuse_histogram():
    zipf = TableSpec(name="a", rows=1000, dim=64, pooling_factor=4.0)
    hist = TableSpec(name="b", rows=1000, dim=64, pooling_factor=4.0, reuse_histogram=(1.0,) + (0.0,) * 16)
    fz, fh = table_features(zipf, 32), table_features(hist, 32)
    assert fz.shape == (NUM_TABLE_FEATURES,)
    assert fz[0] == 5.0 and fz[1] == 3.0 and fz[2] == 2.0  # log2 width, log10 rows, log2 pooling
    bins = slice(NUM_SCALAR_FEATURES, None)
    assert fh[bins].tolist() == [1.0] + [0.0] * 16
    # 262144 lookups over 1000 rows: most rows are read dozens of times or more, almost none once
    assert fz[bins].sum() == pytest.approx(1.0) and fz[NUM_SCALAR_FEATURES] < 0.01 and fz[bins].argmax() >= 5


def test_zipf_and_histogram_tables_of_one_shape_are_priced_alike(shipped):
    """A Zipf table and a histogram table with the histogram its distribution gives: one description, one price."""
    models = shipped
    for rows, pooling, exponent in ((1000, 1.0, 1.05), (5_000_000, 20.0, 1.2), (300_000_000, 3.0, 0.9)):
        zipf = TableSpec(name="z", rows=rows, dim=64, pooling_factor=pooling, zipf_exponent=exponent)
        twin = TableSpec(name="h", rows=rows, dim=64, pooling_factor=pooling, reuse_histogram=reuse_histogram_of(zipf))
        priced = models.predict_fused_shards([[TablePiece.whole(zipf)], [TablePiece.whole(twin)]], 1024)
        assert priced[0] == pytest.approx(priced[1], rel=1e-4)
        # a sane price, not the 38 + 630 ms a Zipf table got when the models read it as out of their world
        assert 0.01 < priced[0].sum() < 100


def test_derived_zipf_histogram_matches_drawn_batches():
    rng = np.random.default_rng(0)
    for rows, exponent, pooling in ((100_000, 1.05, 8.0), (2_000_000, 1.2, 20.0), (50_000, 0.0, 2.0)):
        drawn = reuse_histogram(zipf_indices(rows, exponent, int(REFERENCE_BATCH * pooling), rng))
        derived = zipf_reuse_histogram(rows, exponent, pooling)
        assert np.abs(np.subtract(drawn, derived)).sum() < 0.02


def test_the_spine_counts_the_distinct_rows_a_batch_touches(pool):
    """The spine's `rows` is the distinct rows a batch of the table touches, as the batches are drawn (measurement
    procedure 3): histogram tables (the pool's, some with fewer rows than the reference batch touches) and Zipf
    tables alike, at small batches and at the reference batch."""
    tables = pool[:40] + [TableSpec(name="zipf", rows=3_500_000, dim=64, pooling_factor=40.0)]
    for batch in (1024, 4096):
        counted = physical_quantities(np.stack([table_features(t, t.dim) for t in tables]), math.log2(batch), 16.0)[
            :, QUANTITIES.index("rows")
        ]
        for table, spine_rows in zip(tables, counted.tolist()):
            drawn = len(np.unique(table_batch(table, MeasureConfig(batch_size=batch), 0).indices))
            assert spine_rows * 1e3 == pytest.approx(drawn, rel=0.1, abs=30), (table.name, batch)


def test_models_fitted_before_measurement_procedure_3_price_as_they_did():
    """Model files fitted to procedure 2's batches (before a histogram table's batch sampled the reference traffic,
    and before the per-row quantities) count distinct rows as those batches had them: the reference machine's models
    shipped until they were measured again by procedure 3 (kept in tests/data) price shards as they did before
    (numbers from the release before procedure 3)."""
    reference = CostModels.load(DATA / "cpu-reference-procedure2.pt")
    assert float(reference.compute.spine.sampled_rows) == 0.0
    assert not reference.compute.spine.rates[:, QUANTITIES.index("rows") :].any()
    histogram = (0.6, 0.2, 0.1, 0.05, 0.03, 0.02) + (0.0,) * 11
    tables = [
        TableSpec(name="hist", rows=200_000, dim=32, pooling_factor=20.0, reuse_histogram=histogram),
        TableSpec(name="zipf", rows=3_500_000, dim=64, pooling_factor=40.0),
        TableSpec(name="tiny", rows=40, dim=8, pooling_factor=1.0),
    ]
    shards = [[TablePiece.whole(t)] for t in tables] + [[TablePiece.whole(t) for t in tables]]
    assert np.asarray(reference.predict_fused_shards(shards, 1024)) == pytest.approx(
        np.array([[0.313108, 0.612455], [0.778982, 1.937278], [0.099347, 0.059052], [1.004963, 2.545823]]), rel=1e-5
    )


def test_range_check_names_each_table_outside_the_training_data(shipped):
    # models whose training data was pool tables: fp32, dims 16 to 128, reuse histograms near the public one
    trained_on = generate_pool(PoolConfig(num_tables=50, seed=1))
    features = np.stack([table_features(t, t.dim, shipped.rows_cap) for t in trained_on])
    models = dataclasses.replace(
        shipped, info=shipped.info.model_copy(update={"coverage": training_coverage(features, 16)})
    )
    inside = trained_on[0].model_copy(update={"name": "inside"})
    wide = inside.model_copy(update={"name": "wide", "dim": 1024, "pooling_factor": 5000.0})
    half = inside.model_copy(update={"name": "half", "precision": "fp16"})
    zipf = inside.model_copy(update={"name": "zipf", "rows": 10_000_000, "reuse_histogram": None})
    lines = coverage_problems(models, [inside, wide, half, zipf], shard_tables=40)
    assert [line.split(":")[0] for line in lines[:3]] == ["table wide", "table half", "table zipf"]
    assert "dim 1024 (training range 16-128)" in lines[0] and "pooling factor 5000" in lines[0]
    assert "fp16" in lines[1] and "of its accessed rows are read once" in lines[2]
    assert "up to 40 tables" in lines[3] and len(lines) == 4
    assert coverage_problems(shipped, [inside]) == []  # the shipped models' own range holds the pool's tables


def test_compute_model_is_permutation_invariant_and_takes_any_table_count(pool):
    torch.manual_seed(0)
    net = ComputeCostNet(hidden=16, depth=2).eval()
    shard = [TablePiece.whole(t) for t in pool[:7]]
    features, mask, _ = fused_shard_tensors(
        [shard, shard[::-1], shard[:1], [TablePiece.whole(t) for t in pool[:40]]], [None] * 4
    )
    out = net(features, mask, torch.full((4,), 10.0))
    assert out.shape == (4, 2)
    assert torch.allclose(out[0], out[1], atol=1e-5)
    # padding rows are ignored
    padded, pmask, _ = fused_shard_tensors([shard], [None])
    wide = torch.cat([padded, torch.randn(1, 5, NUM_TABLE_FEATURES)], dim=1)
    wmask = torch.cat([pmask, torch.zeros(1, 5)], dim=1)
    assert torch.allclose(net(wide, wmask, torch.tensor([10.0])), out[:1], atol=1e-5)


@pytest.mark.parametrize("devices", [2, 4, 8, 13])
def test_comm_model_takes_any_device_count(devices):
    net = CommCostNet(hidden=8, depth=1)
    widths = np.arange(devices) * 16
    features = torch.from_numpy(comm_features(widths, 1024))
    assert net(features).shape == (devices, 2)
    assert features[:, -1].sum().item() == pytest.approx(1.0)


def test_plans_say_when_the_comm_model_never_measured_their_device_count(pool):
    """The shipped comm model measured 2-device gangs only; past them the links' price scaled by what it learned
    at 2 prices them, and a plan for 8 devices says they are extrapolated (one for 2 does not)."""
    for devices, warned in ((2, False), (8, True)):
        plan = place("cost_search", pool[:12], Topology(num_devices=devices, memory_bytes=4 * GB))
        lines = [w for w in plan.estimate.warnings if "all-to-alls were measured at 2 devices" in w]
        assert bool(lines) == warned, plan.estimate.warnings
        assert not lines or f"prices at {devices} are extrapolated (the links' price, scaled by what it" in lines[0]


def test_the_shipped_gpu_models_price_the_gpu_and_say_the_links_alone_price_the_all_to_alls(
    pool, tmp_path, monkeypatch
):
    """On an H200, plans are priced by the models trained on its 957 measured fused shards (docs/gpu.md), not by the
    reference CPU's, which price its shards 3-48x too dear; they have no comm model, and a plan of several devices
    says the links' profile alone prices its all-to-alls (NVLink's published rate). An H100 has its own; a GPU never measured gets the H100's, with the
    warning that they are of other hardware. Calibrated models of the hardware still come first."""
    from shard_ray.costmodel.models import PRETRAINED_DIR, hardware_models_path, models_for

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    h200, h100, a100 = "cuda:NVIDIA H200", "cuda:NVIDIA H100 80GB HBM3", "cuda:NVIDIA A100-SXM4-80GB"
    shipped_gpu = PRETRAINED_DIR / "cuda-NVIDIA-H200.pt"
    assert models_for(h200) == shipped_gpu
    assert models_for(h100) == models_for(a100) == PRETRAINED_DIR / "cuda-NVIDIA-H100-80GB-HBM3.pt"
    assert CostModels.load(models_for(h100)).hardware == h100
    assert models_for("cpu:AMD EPYC:1thread") == models_for("cpu:Some Other CPU:1thread") == default_cost_model_path()
    xeon = "cpu:Intel(R) Xeon(R) Processor:1thread"  # the recipe measured on the 2-core Xeon (docs/cost-models.md)
    assert models_for(xeon) == PRETRAINED_DIR / "cpu-Intel-R-Xeon-R-Processor-1thread.pt"
    assert CostModels.load(models_for(xeon)).hardware == xeon
    on_a100 = place("cost_search", pool[:12], Topology(num_devices=1, memory_bytes=4 * GB), hardware=a100)
    assert any(f"not of {a100}" in w for w in on_a100.estimate.warnings), on_a100.estimate.warnings
    models = CostModels.load(shipped_gpu)
    assert models.hardware == h200 and models.comm is None
    # Measured on the H200 (experiments/results/gpu_h200): one table alone, fwd + bwd, 0.79-1.08 ms from batch 512 to
    # 65536, the host's launches setting the time; the reference CPU's models price it tens of times that at 65536.
    one_table = [[TablePiece.whole(pool[0].model_copy(update={"rows": 100_000, "dim": 64, "pooling_factor": 8.0}))]]
    for batch in (1024, 65536):
        gpu_ms = models.predict_fused_shards(one_table, batch).sum()
        assert 0.5 < gpu_ms < 2.0, (batch, gpu_ms)
    assert CostModels.load(default_cost_model_path()).predict_fused_shards(one_table, 65536).sum() > 10 * gpu_ms
    for devices in (1, 4):
        plan = place("cost_search", pool[:12], Topology(num_devices=devices, memory_bytes=4 * GB), hardware=h200)
        assert plan.estimate.cost_model == str(shipped_gpu)
        assert "the shipped models" in plan.estimate.provenance
        unpriced = [w for w in plan.estimate.warnings if "have no comm model" in w]
        assert bool(unpriced) == (devices > 1), plan.estimate.warnings
        if devices > 1:
            assert "NVLink 4" in unpriced[0]
            links = link_profile(h200)
            for device in plan.estimate.predicted.devices:  # the fixed times, and a few KB at 450 GB/s
                for comm in (device.fwd_comm_ms, device.bwd_comm_ms):
                    assert links.collective_ms + 3 * links.message_ms <= comm < 2 * links.collective_ms
    calibrated = hardware_models_path(h200)
    calibrated.parent.mkdir(parents=True)
    models.save(calibrated)
    assert models_for(h200) == calibrated


def test_model_file_round_trip_and_bad_files(tmp_path, shipped):
    path = tmp_path / "m.pt"
    shipped.save(path)
    again = CostModels.load(path)
    shards = [[TablePiece.whole(TableSpec(name="a", rows=1000, dim=32, pooling_factor=3.0))], []]
    assert np.allclose(again.predict_fused_shards(shards, 1024), shipped.predict_fused_shards(shards, 1024))
    assert again.hardware == shipped.hardware and again.predict_fused_shards(shards, 1024)[1].sum() == 0
    junk = tmp_path / "junk.pt"
    torch.save({"hello": torch.zeros(2)}, junk)
    with pytest.raises(ShardRayError, match="not a shard-ray cost model"):
        CostModels.load(junk)
    with pytest.raises(ShardRayError, match="not found"):
        CostModels.load(tmp_path / "none.pt")


def test_the_input_overhead_is_the_gangs_median_excess_over_the_bytes_price_per_device_and_type(
    tmp_path, shipped, pool
):
    """What the gang measures in a device's input all-to-all beyond its price as one all-to-all of its bytes is fitted
    as its median over devices (a disturbed plan moves it little), kept in the model file, and added to every device
    of a plan of more than one device, once per sharding type."""
    tables, batch = pool[:8], 1024
    bare = dataclasses.replace(shipped, input_overhead_ms=0.0)
    rng = np.random.default_rng(0)
    plans = []
    for i in range(9):
        plan = Plan.from_assignment(table_wise(tables), list(rng.integers(0, 3, len(tables))), 3, "random")
        priced = Simulator(bare).plan_cost(plan, tables, batch).devices
        disturbed = 3.0 if i == 0 else 1.0  # one plan measured on a busy core
        devices = [d.model_copy(update={"input_dist_ms": d.input_dist_ms * disturbed + 0.4}) for d in priced]
        cost = PlanCost(devices=devices, hardware=shipped.hardware, batch_size=batch)
        plans.append(PlanMeasurement(key=str(i), plan=plan, tables=tables, cost=cost))
    assert fit_input_overhead(bare, plans) == pytest.approx(0.4, abs=1e-4)
    assert fit_input_overhead(bare, []) == 0.0
    assert evaluate_input_dist(bare, plans[1:])["mape"] > 0.01

    fitted = dataclasses.replace(bare, input_overhead_ms=fit_input_overhead(bare, plans))
    assert evaluate_input_dist(fitted, plans[1:])["mape"] < 1e-4
    fitted.save(tmp_path / "m.pt")
    again = CostModels.load(tmp_path / "m.pt")
    assert again.input_overhead_ms == pytest.approx(0.4, abs=1e-4)
    two_types = Plan.from_assignment(
        table_wise(tables[:4])
        + [TablePiece(table=t, columns=c) for t in tables[4:] for c in ((0, t.dim // 2), (t.dim // 2, t.dim))],
        [0, 1, 2, 0] + [1, 2] * 4,
        3,
        "mixed",
    )
    for plan, types in ((plans[1].plan, 1), (two_types, 2)):
        before = Simulator(bare).plan_cost(plan, tables, batch).devices
        after = Simulator(again).plan_cost(plan, tables, batch).devices
        for b, a in zip(before, after):
            assert a.input_dist_ms - b.input_dist_ms == pytest.approx(0.4 * types, abs=1e-4)
    alone = Plan.from_assignment(table_wise(tables), [0] * len(tables), 1, "one device")
    assert Simulator(again).plan_cost(alone, tables, batch).devices[0].input_dist_ms == 0.0


def test_collect_replicates_small_tables_of_a_share_of_its_compute_shards_reproducibly(pool):
    """`--replicated` turns 1 to 3 tables of at most REPLICA_ROWS rows of a shard into replicas, with a generator of its
    own: the same draw twice, the other shards and every table's spec unchanged, none at share 0."""
    shards = draw_augmented_fused_shards(pool, 60, 12, (8, 16, 64), seed=4)
    drawn = [replicate_some(s, 0.5, np.random.default_rng([4, i])) for i, s in enumerate(shards)]
    assert drawn == [replicate_some(s, 0.5, np.random.default_rng([4, i])) for i, s in enumerate(shards)]
    assert [replicate_some(s, 0.0, np.random.default_rng([4, i])) for i, s in enumerate(shards)] == shards
    changed = [(before, after) for before, after in zip(shards, drawn) if before != after]
    assert 15 <= len(changed) <= 45
    for before, after in changed:
        assert [p.table for p in before] == [p.table for p in after]
        replicas = [p for p in after if p.replicated]
        assert 1 <= len(replicas) <= 3 and all(p.table.rows <= REPLICA_ROWS and p.replicas == 2 for p in replicas)


def test_each_sharding_type_beyond_the_first_is_the_gangs_median_excess_per_set_and_prices_every_device(
    tmp_path, shipped, pool
):
    """What the gang measures in the all-to-alls of a plan of several sharding types beyond their price is fitted, per
    set of all-to-alls beyond the first, as its median over devices (a disturbed plan moves it little), kept in the
    model file and added to every device of a plan of several sets, none to a plan of one. The comm plans that
    `collect` draws mixed are of several sets, reproducibly, and their column halves come in fours."""
    tables, batch = pool[:8], 1024
    config = CollectConfig(mixed=1.0, dims=(8, 16, 64))
    drawn = draw_comm_plans(pool, 3, 9, config, seed=1)
    assert drawn == draw_comm_plans(pool, 3, 9, config, seed=1)
    table_wise_only = draw_comm_plans(pool, 3, 9, dataclasses.replace(config, mixed=0.0), seed=1)
    assert [t for _, t in table_wise_only] == [t for _, t in drawn]  # the same tables, only sharded otherwise
    bare = dataclasses.replace(shipped, type_overhead_ms=(0.0, 0.0, 0.0))
    plans = []
    for i, (plan, drawn_tables) in enumerate(drawn):
        pieces = [p for shard in plan.pieces(drawn_tables) for p in shard]
        assert all(p.columns[0] % 4 == 0 for p in pieces)
        priced = Simulator(bare).plan_cost(plan, drawn_tables, batch)
        more = collective_sets(PlanMeasurement(key=str(i), plan=plan, tables=drawn_tables, cost=priced)) - 1
        disturbed = 3.0 if i == 0 else 1.0  # one plan measured on a busy core
        devices = [
            d.model_copy(
                update={
                    "input_dist_ms": d.input_dist_ms * disturbed + 0.2 * more,
                    "fwd_comm_ms": d.fwd_comm_ms * disturbed + 0.3 * more,
                    "bwd_comm_ms": d.bwd_comm_ms * disturbed + 0.5 * more,
                }
            )
            for d in priced.devices
        ]
        cost = PlanCost(devices=devices, hardware=shipped.hardware, batch_size=batch)
        plans.append(PlanMeasurement(key=str(i), plan=plan, tables=drawn_tables, cost=cost))
    assert sum(collective_sets(p) >= 2 for p in plans) >= 6
    assert fit_type_overhead(bare, plans) == pytest.approx((0.2, 0.3, 0.5), abs=1e-4)
    assert fit_type_overhead(bare, []) == (0.0, 0.0, 0.0)
    assert evaluate_mixed_comm(bare, plans[1:])["mape"] > 0.01

    fitted = dataclasses.replace(bare, type_overhead_ms=fit_type_overhead(bare, plans))
    assert evaluate_mixed_comm(fitted, plans[1:])["mape"] < 1e-4
    fitted.save(tmp_path / "m.pt")
    again = CostModels.load(tmp_path / "m.pt")
    assert again.type_overhead_ms == pytest.approx((0.2, 0.3, 0.5), abs=1e-4)
    two_types = Plan.from_assignment(
        table_wise(tables[:4])
        + [TablePiece(table=t, columns=c) for t in tables[4:] for c in ((0, t.dim // 2), (t.dim // 2, t.dim))],
        [0, 1, 2, 0] + [1, 2] * 4,
        3,
        "mixed",
    )
    one_type = Plan.from_assignment(table_wise(tables), [0, 1, 2, 0, 1, 2, 0, 1], 3, "table-wise")
    for plan, more in ((one_type, 0), (two_types, 1)):
        before = Simulator(bare).plan_cost(plan, tables, batch).devices
        after = Simulator(again).plan_cost(plan, tables, batch).devices
        for b, a in zip(before, after):
            assert a.input_dist_ms - b.input_dist_ms == pytest.approx(0.2 * more, abs=1e-4)
            assert a.fwd_comm_ms - b.fwd_comm_ms == pytest.approx(0.3 * more, abs=1e-4)
            assert a.bwd_comm_ms - b.bwd_comm_ms == pytest.approx(0.5 * more, abs=1e-4)


def test_the_replicas_all_reduce_is_fitted_as_a_part_and_a_rate_per_bus_mb_and_prices_the_devices_holding_them(
    tmp_path, shipped, pool
):
    """What the gang measures in the backward collectives of devices holding replicas beyond their all-to-alls' price
    is fitted as ms for taking part plus ms per MB of gradient on the ring's bus, kept in the model file, and priced
    on the devices that hold replicas, none on the others; a file without it prices the all-reduce as before."""
    small = [t for t in pool if t.rows <= 100_000][:6]
    whole = [t for t in pool if t.rows > 100_000][:4]
    batch, plans = 1024, []
    bare = dataclasses.replace(shipped, all_reduce_ms=(0.0, 0.0))
    rng = np.random.default_rng(0)
    for i in range(8):
        replicated = small[: 1 + i % len(small)]
        devices = 2 + i % 2
        pieces = table_wise(whole) + [p for t in replicated for p in data_parallel(t, devices)]
        assign = list(rng.integers(0, devices, len(whole))) + [k for _ in replicated for k in range(devices)]
        plan = Plan.from_assignment(pieces, assign, devices, "with replicas")
        tables = whole + replicated
        parts = Simulator(bare).plan_parts(plan, tables, batch)
        mb = sum(t.rows * t.dim * t.bytes_per_element for t in replicated) / 1e6 * 2 * (devices - 1) / devices
        priced = parts.plan_cost(shipped.hardware, batch).devices
        measured = [
            d.model_copy(update={"bwd_comm_ms": parts.comm[k, 1] + parts.host_sums[k, 1] + 0.3 + 0.5 * mb})
            for k, d in enumerate(priced)
        ]
        cost = PlanCost(devices=measured, hardware=shipped.hardware, batch_size=batch)
        plans.append(PlanMeasurement(key=str(i), plan=plan, tables=tables, cost=cost))
    assert evaluate_replica_comm(bare, plans)["mape"] > 0.05
    assert fit_all_reduce(bare, plans) == pytest.approx((0.3, 0.5), rel=1e-4)
    assert fit_all_reduce(bare, plans[:1]) == (0.0, 0.0)  # 2 devices: too few to fit
    fitted = dataclasses.replace(bare, all_reduce_ms=fit_all_reduce(bare, plans))
    assert evaluate_replica_comm(fitted, plans)["mape"] < 1e-4
    fitted.save(tmp_path / "m.pt")
    again = CostModels.load(tmp_path / "m.pt")
    assert again.all_reduce_ms == pytest.approx((0.3, 0.5), rel=1e-4)
    # On 3 devices, one replica on devices 0 and 1 only (a replica pinned where the others are not): device 2 pays none.
    pinned = [replica(small[0], 2, 0), replica(small[0], 2, 1)]
    plan = Plan.from_assignment(table_wise(whole[:3]) + pinned, [0, 1, 2, 0, 1], 3, "pinned")
    before = Simulator(bare).plan_parts(plan, whole[:3] + small[:1], batch)
    after = Simulator(again).plan_parts(plan, whole[:3] + small[:1], batch)
    mb = small[0].rows * small[0].dim * small[0].bytes_per_element / 1e6 * 2 * 2 / 3
    assert after.sync == pytest.approx([0.3 + 0.5 * mb, 0.3 + 0.5 * mb, 0.0], abs=1e-4)
    assert before.sync[:2] == pytest.approx(
        Pricer(bare, Topology(num_devices=3, memory_bytes=GB, batch_size=batch))
        .plan_parts(*plan.assignment(whole[:3] + small[:1]))
        .sync[:2]
    )


def test_the_step_overhead_is_the_gangs_median_excess_over_the_kernels_and_prices_held_devices(tmp_path, shipped, pool):
    """Per phase, what the gang measures on a device beyond the kernels' price is fitted as its median over devices
    (a disturbed device moves it little; empty devices do not count), kept in the model file, added to each
    device holding pieces and to the lower bound."""
    tables, batch = pool[:8], 1024
    kernels = dataclasses.replace(shipped, step_overhead_ms=(0.0, 0.0))
    rng = np.random.default_rng(0)
    plans = []
    for i in range(9):
        plan = Plan.from_assignment(table_wise(tables), list(rng.integers(0, 3, len(tables))), 3, "random")
        priced = kernels.predict_fused_shards(plan.pieces(tables), batch)
        disturbed = 3.0 if i == 0 else 1.0  # one plan measured on a busy core
        devices = [
            DeviceCost(
                device=d,
                fwd_compute_ms=(fwd * disturbed + 0.3) if fwd else 0.0,
                bwd_compute_ms=(bwd * disturbed + 0.2) if bwd else 0.0,
                fwd_comm_ms=0.1,
                bwd_comm_ms=0.1,
            )
            for d, (fwd, bwd) in enumerate(priced)
        ]
        cost = PlanCost(devices=devices, hardware=shipped.hardware, batch_size=batch)
        plans.append(PlanMeasurement(key=str(i), plan=plan, tables=tables, cost=cost))
    assert fit_step_overhead(kernels, plans) == pytest.approx((0.3, 0.2), abs=1e-4)
    assert fit_step_overhead(kernels, []) == (0.0, 0.0)
    # plans of several sharding types do not count: their replicas' backward is more than the kernels price
    replicated = Plan.from_assignment(table_wise(tables[:6]) + [replica(tables[6], 3, k) for k in range(3)],
                                      [0, 1, 2, 0, 1, 2, 0, 1, 2], 3, "mixed")  # fmt: skip
    slow = [DeviceCost(device=d, fwd_compute_ms=5.0, bwd_compute_ms=9.0, fwd_comm_ms=0.1, bwd_comm_ms=0.1)
            for d in range(3)]  # fmt: skip
    mixed = [PlanMeasurement(key=f"m{i}", plan=replicated, tables=tables,
                             cost=PlanCost(devices=slow, hardware=shipped.hardware, batch_size=batch))
             for i in range(20)]  # fmt: skip
    assert fit_step_overhead(kernels, plans + mixed) == pytest.approx((0.3, 0.2), abs=1e-4)
    assert evaluate_device_compute(kernels, plans[1:])["mape"] > 0.01

    fitted = dataclasses.replace(kernels, step_overhead_ms=fit_step_overhead(kernels, plans))
    assert evaluate_device_compute(fitted, plans[1:])["mape"] < 1e-4
    fitted.save(tmp_path / "m.pt")
    again = CostModels.load(tmp_path / "m.pt")
    assert again.step_overhead_ms == pytest.approx((0.3, 0.2), abs=1e-4)
    sums = kernels.encode_tables(table_wise(tables)[:2], batch)
    counts = torch.tensor([1.0, 0.0])
    added = again.compute_from_sums(sums, counts) - kernels.compute_from_sums(sums, counts)
    assert np.allclose(added, [[0.3, 0.2], [0.0, 0.0]], atol=1e-4)
    plan = plans[1].plan
    held = [d for d, pieces in enumerate(plan.pieces(tables)) if pieces]
    before = Simulator(kernels).plan_cost(plan, tables, batch).devices
    after = Simulator(again).plan_cost(plan, tables, batch).devices
    for d in range(3):
        assert after[d].total_ms - before[d].total_ms == pytest.approx(0.5 if d in held else 0.0, abs=1e-3)
    topology = Topology(num_devices=3, memory_bytes=GB, batch_size=batch)
    assert lower_bound_ms(again, tables, topology) == pytest.approx(lower_bound_ms(kernels, tables, topology) + 0.5)


def test_models_lists_the_shipped_and_calibrated_files_and_names_a_damaged_one(tmp_path, monkeypatch, capsys):
    from shard_ray.cli import main

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "cpu-broken.pt").write_bytes(b"not torch")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    from shard_ray.costmodel.models import PRETRAINED_DIR

    assert (
        f"{len(list(PRETRAINED_DIR.glob('*.pt')))} shipped, and 1 calibrated in" in out
        and "cuda-NVIDIA-H200.pt (shipped)" in out
    )
    assert "cuda-NVIDIA-H100-80GB-HBM3.pt (shipped)" in out
    assert "cuda:NVIDIA H200; trained by `costmodel train`, not calibrated on a task; no comm model" in out
    assert "not calibrated on a task; held-out error (MAPE): compute_seen" in out
    assert "cpu-broken.pt\n  cannot be read: cannot read cost model file" in out
    # a file of the user's own, which no folder above holds (`costmodel train --out m.pt`'s: a walk could not see it)
    mine = tmp_path / "m.pt"
    mine.write_bytes(default_cost_model_path().read_bytes())
    assert main(["models", str(mine)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{mine}\n  cpu:AMD EPYC:1thread; trained by `costmodel train`") and "(shipped)" not in out
    assert main(["models", str(mine), str(tmp_path / "models" / "cpu-broken.pt")]) == 2
    assert capsys.readouterr().err.startswith("shard-ray: error: cannot read cost model file")


def test_model_info_is_typed_and_keeps_what_older_and_newer_files_wrote(tmp_path, shipped):
    """A file written before the info was typed (a plain mapping, some fields missing) and one with a key this
    version does not know both load, and saving them again writes back every key they had."""
    blob = torch.load(default_cost_model_path(), weights_only=False)
    assert blob["info"] == shipped.info.to_file()  # the shipped file is itself untyped-era
    assert (
        shipped.info.coverage.max_tables == blob["info"]["coverage"]["max_tables"] and shipped.info.calibrated is None
    )
    for info in (
        {"rows_cap": 7, "from_a_newer_version": {"x": 1}},
        {},
        {**blob["info"], "comm_hosts": 2, "updated_on": {"hardware": "cpu:x", "shards": 3, "plans": 4}},
    ):
        path = tmp_path / "m.pt"
        torch.save({**blob, "info": info}, path)
        models = CostModels.load(path)
        assert models.rows_cap == info.get("rows_cap") and models.comm_devices_per_host == info.get("comm_hosts")
        models.save(tmp_path / "again.pt")
        assert torch.load(tmp_path / "again.pt", weights_only=False)["info"] == info
    torch.save({**blob, "info": {"coverage": {"features": ["x"]}}}, tmp_path / "bad.pt")
    with pytest.raises(ShardRayError, match=r"cost model file .*bad.pt is damaged: .*coverage"):
        CostModels.load(tmp_path / "bad.pt")


@pytest.mark.slow
def test_training_on_a_tiny_measured_data_set(tmp_path, pool):
    """Real fbgemm measurements of tiny shards, then training: the model must learn their order."""
    config = MeasureConfig(batch_size=64, warmup=1, repeats=3)
    shards = draw_augmented_fused_shards(pool, 60, 4, (8, 16, 64, 128), seed=1)
    with MeasurementStore(tmp_path / "m.db") as store:
        for parts in shards:
            store.put_fused_shard(measure_fused_shard(parts, config, "cpu:test", WORKER_BUDGET))
        with pytest.warns(MissingCommModelWarning, match=r"0 multi-device plan measurements.*collect --kind comm"):
            models, report = train_cost_models(
                store, {t.name for t in pool}, TrainConfig(hidden=32, max_epochs=60, patience=60)
            )
    assert models.hardware == "cpu:test" and models.comm is None
    assert report["compute_seen"]["n"] > 0 and report["compute_unseen"]["n"] == 0
    assert models.info.num_shards["train"] > 40
    # a shard of many wide, heavily pooled tables costs more than one narrow table
    big = [TablePiece(table=t.model_copy(update={"pooling_factor": 50.0}), columns=(0, 128)) for t in pool[:4]]
    small = [TablePiece(table=pool[0].model_copy(update={"pooling_factor": 1.0}), columns=(0, 8))]
    predicted = models.predict_fused_shards([big, small], 64).sum(axis=1)
    assert predicted[0] > predicted[1]


def test_training_needs_data(tmp_path):
    with MeasurementStore(tmp_path / "empty.db") as store:
        with pytest.raises(ShardRayError, match="no successful shard measurements"):
            train_cost_models(store, set(), TrainConfig())


def test_split_is_stable_and_mostly_train():
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(2000)]
    splits = [data_split(k) for k in keys]
    assert splits == [data_split(k) for k in keys]
    assert 0.7 < splits.count("train") / len(splits) < 0.9


def test_simulator_prices_plans_with_the_one_cost_definition(shipped, small_tables):
    plan = place("round_robin", small_tables, Topology(num_devices=3, memory_bytes=GB))
    cost = Simulator(shipped).plan_cost(plan, small_tables, 1024)
    assert cost.cost_ms == max(d.total_ms for d in cost.devices)
    assert all(d.fwd_compute_ms > 0 and d.fwd_comm_ms > 0 for d in cost.devices)
    lonely = Plan(
        num_devices=2, algorithm="x", shards=[Shard(table=t.name, device=0, columns=(0, t.dim)) for t in small_tables]
    )
    idle = Simulator(shipped).plan_cost(lonely, small_tables, 1024).devices[1]
    assert idle.fwd_compute_ms == 0 and idle.bwd_compute_ms == 0


@pytest.mark.parametrize(
    "topology",
    [
        Topology(num_devices=16, memory_bytes=64 * GB, devices_per_host=4, inter_host_gbps=0.05, host_link_gbps=0.1),
        Topology(num_devices=2, memory_bytes=64 * GB),
    ],
    ids=["16-over-hosts", "2-on-one-host"],
)
def test_plans_priced_together_are_priced_bit_for_bit_as_alone(shipped, pool, topology):
    """A search prices its candidates in one call (`Pricer.device_parts` of [B, N] assignments): every part of every
    plan is what pricing it alone gives, bit for bit, and the budget counts the call as that many plans' calls, so
    that the searches' plans are what they were with candidates priced one by one. Pieces of every sharding type
    (replicas' all-reduce, table-row-wise sums inside hosts, several sets of all-to-alls), with and without the
    all-reduce's fit."""
    from shard_ray.costmodel.pricing import DeviceParts
    from shard_ray.plan.enumerator import table_options

    pieces = []
    for k, table in enumerate(pool[:15]):
        options = table_options(table, topology)
        pieces += list(options.values())[k % len(options)]
    assert len({p.sharding_type for p in pieces}) == (5 if topology.num_hosts > 1 else 4)
    rng = np.random.default_rng(0)
    assigns = np.array(
        [
            [rng.choice(sorted(p.devices)) if p.devices else rng.integers(topology.num_devices) for p in pieces]
            for _ in range(7)
        ]
    )
    for models in (shipped, dataclasses.replace(shipped, all_reduce_ms=(0.3, 0.5))):
        pricer = Pricer(models, topology)
        enc, sizes = pricer.encodings(pieces), pricer.sizes(pieces)
        together = pricer.device_parts(enc, sizes, assigns)
        counted = pricer.evaluations
        for b, assign in enumerate(assigns):
            alone = pricer.device_parts(enc, sizes, assign)
            for part in dataclasses.fields(DeviceParts):
                assert np.array_equal(getattr(together, part.name)[b], getattr(alone, part.name)), (part.name, b)
        assert pricer.evaluations == 2 * counted  # the seven plans alone counted what the seven together did
    assert together.sync.any() and (together.host_sums.any() or topology.num_hosts == 1)


@pytest.mark.parametrize("algo", ["neuroshard", "cost_search"])
def test_search_plans_are_valid_under_tight_memory(algo, pool):
    tables = pool[:24]
    sizes = [shard_bytes(t, t.dim, "rowwise_adagrad") for t in tables]
    topology = Topology(num_devices=4, memory_bytes=max(sum(sizes) // 4 + sum(sizes) // 20, max(sizes) + 1))
    plan = place(algo, tables, topology)
    plan.check(tables)
    assert max(plan.device_memory_bytes(tables, topology)) <= topology.memory_bytes
    assert plan.estimate.predicted.cost_ms >= plan.estimate.lower_bound_ms
    assert plan.estimate.cost_model.endswith(".pt")


def test_search_refuses_infeasible_memory(pool):
    with pytest.raises(ShardRayError):
        place("neuroshard", pool[:10], Topology(num_devices=2, memory_bytes=1000))


def test_cost_search_is_no_worse_than_neuroshard_under_the_models(pool):
    tables = pool[:20]
    topology = Topology(num_devices=4, memory_bytes=GB)
    # Without a time budget, so that the comparison does not depend on how busy the machine is.
    ours = place("cost_search", tables, topology, settings={"max_evaluations": None})
    theirs = place("neuroshard", tables, topology)
    assert ours.estimate.predicted.cost_ms <= theirs.estimate.predicted.cost_ms + 1e-6


def test_branch_and_bound_matches_brute_force(shipped, pool):
    tables = pool[:6]
    topology = Topology(num_devices=3, memory_bytes=GB)
    pricer = Pricer(shipped, topology)
    candidate, spending = branch_and_bound(pricer, tables)
    assert spending.cut_short() is None
    enc = pricer.encodings(table_wise(tables))
    sizes = pricer.sizes(table_wise(tables))
    brute = min(
        float(pricer.device_costs(enc, sizes, np.array(assign)).max())
        for assign in itertools.product(range(3), repeat=len(tables))
    )
    assert candidate.cost == pytest.approx(brute, rel=1e-5)
    plan = place("optimal", tables, topology)
    assert plan.search.proven_optimal and plan.estimate.predicted.cost_ms == pytest.approx(brute, rel=1e-4)


@pytest.mark.parametrize("hosts", [None, 2])
@pytest.mark.parametrize("huge", [True, False])
def test_branch_and_bound_tries_devices_alike_once_and_still_finds_the_optimum(shipped, pool, hosts, huge):
    """Devices alike to the prices (on one host, holding pieces alike, with the same room) are tried once for a table.
    The optimum is still the brute force's: with a table no device holds whole, its row blocks pinned one a device,
    and over hosts, where empty devices of different hosts are not alike."""
    tables = pool[:5]
    if huge:
        tables = [TableSpec(name="huge", rows=6_000_000, dim=64, pooling_factor=1.0), *pool[:4]]
    topology = Topology(num_devices=4, memory_bytes=GB, devices_per_host=hosts)
    pricer = Pricer(shipped, topology)
    candidate, spending = branch_and_bound(pricer, tables)
    assert spending.cut_short() is None
    pieces = candidate.pieces
    fixed = [k for k, p in enumerate(pieces) if p.devices]
    assert len(fixed) == (4 if huge else 0)  # the table no device holds whole, in row blocks pinned to the devices
    free = [k for k in range(len(pieces)) if k not in fixed]
    plans = np.zeros((4 ** len(free), len(pieces)), dtype=np.int64)
    plans[:, fixed] = [pieces[k].devices[0] for k in fixed]
    plans[:, free] = list(itertools.product(range(4), repeat=len(free)))
    priced = pricer.device_costs(pricer.encodings(pieces), pricer.sizes(pieces), plans).max(axis=1)
    assert candidate.cost == pytest.approx(float(priced.min()), rel=1e-5)


def test_optimal_proves_a_table_no_device_holds_whole_among_few_on_many_devices_in_few_evaluations(pool):
    """A walk's 5 tables, one of 300 million rows, ran 184 s on 64 devices without a proof (5 s on 16): its row
    blocks, pinned one a device, made every device unlike the others to the search, which then tried each."""
    tables = [TableSpec(name="huge", rows=20_000_000, dim=64, pooling_factor=1.0), *pool[:4]]
    topology = Topology(num_devices=16, memory_bytes=GB)
    plan = place("optimal", tables, topology, settings={"max_evaluations": 200_000})
    assert plan.search.proven_optimal, plan.search


def test_optimal_refuses_large_tasks(pool):
    with pytest.raises(ShardRayError, match="at most 14 tables"):
        place("optimal", pool[:20], Topology(num_devices=2, memory_bytes=GB))


def test_lower_bound_is_below_the_optimum(shipped, pool):
    for start in (0, 6, 12):
        tables = pool[start : start + 6]
        topology = Topology(num_devices=2, memory_bytes=GB)
        optimum = place("optimal", tables, topology).estimate.predicted.cost_ms
        assert lower_bound_ms(shipped, tables, topology, column_wise=False) <= optimum + 1e-6
        assert lower_bound_ms(shipped, tables, topology, column_wise=True) <= optimum + 1e-6


# the shipped models without a comm model (a GPU's), whose all-to-alls the links price alone, the bound's too
WITHOUT_COMM = "cuda:NVIDIA H100 80GB HBM3"


def _models_of(shipped: CostModels, hardware: str | None) -> CostModels:
    return shipped if hardware is None else CostModels.load(shipped_models_path(hardware))


@pytest.mark.parametrize("hardware", [None, WITHOUT_COMM])
@pytest.mark.parametrize("devices", [2, 4, 8])
def test_lower_bound_is_below_plans_of_every_sharding_type(shipped, pool, devices, hardware):
    """Random plans mixing table-, column-, row-wise and data-parallel tables never simulate below the bound."""
    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.plan.enumerator import table_options

    shipped = _models_of(shipped, hardware)
    rng = np.random.default_rng(devices)
    tables = pool[:12]
    topology = Topology(num_devices=devices, memory_bytes=1000 * GB)
    bound = lower_bound_ms(shipped, tables, topology)
    for _ in range(20):
        pieces, assign = [], []
        for table in tables:
            options = list(table_options(table, topology).values())
            for piece in options[rng.integers(len(options))]:
                pieces.append(piece)
                assign.append(piece.devices[0] if piece.devices else int(rng.integers(devices)))
        plan = Plan.from_assignment(pieces, assign, devices, "random-types")
        assert Simulator(shipped).plan_cost(plan, tables, topology.batch_size).cost_ms >= bound - 1e-6


def test_the_bound_of_models_without_a_comm_model_counts_the_links_all_to_alls():
    """A GPU's shipped models price the all-to-alls by the links alone: the bound counts the least of that too,
    where it counted none (a walk: MLPerf DLRM-DCNv2 on 8 H100s, a plan of 1.30 ms bounded at 0.05, compute alone)."""
    from shard_ray.costmodel.bounds import least_encodings

    models = CostModels.load(shipped_models_path(WITHOUT_COMM))
    tables = load_tables(Path(__file__).parents[1] / "experiments" / "tables" / "mlperf_dlrm_dcnv2.json")
    topology = Topology(num_devices=8, memory_bytes=70 * GB)
    compute = models.least_compute(least_encodings(models, tables, topology).sum(axis=0), 8)
    assert lower_bound_ms(models, tables, topology) > 2 * compute


@pytest.mark.parametrize("hosts", [None, 4])
def test_the_bound_counts_the_all_to_alls_as_plans_are_priced_past_the_gangs_the_comm_model_measured(shipped, hosts):
    """Past the 2-device gangs the shipped comm model measured, its bare prediction falls to nearly nothing, while
    plans are priced at the links' price scaled by what it learned (`Pricer.one_host_comm`). The bound counted the
    bare prediction: MLPerf DLRM-DCNv2 on 8 devices, 0.006 ms of all-to-alls against 12.5 ms or more on every device
    of `cost_search`'s plan (the bound 4.03 ms against the plan's 21.2). It counts them as plans are priced."""
    tables = load_tables(Path(__file__).parents[1] / "experiments" / "tables" / "mlperf_dlrm_dcnv2.json")
    topology = Topology(num_devices=8, memory_bytes=16 * GB, devices_per_host=hosts)
    bound = lower_bound(shipped, tables, topology)
    predicted = place("cost_search", tables, topology).estimate.predicted
    least_all_to_alls = min(device.fwd_comm_ms + device.bwd_comm_ms for device in predicted.devices)
    assert 0.15 * least_all_to_alls < bound.comm <= least_all_to_alls
    assert bound.ms <= predicted.cost_ms


@pytest.mark.parametrize("hardware", [None, WITHOUT_COMM])
@pytest.mark.parametrize("devices,hosts", [(2, None), (4, None), (8, None), (4, 2)])
def test_lower_bound_is_below_plans_replicating_any_of_the_tables(shipped, pool, devices, hosts, hardware):
    """Plans replicating every subset of a task's tables, the rest table-wise, never simulate below the bound: a plan
    replicating every table pays no all-to-all (a new user's two tables of 1 and 5 rows, which TorchRec's plan
    replicates, were priced 2.5% below the bound that took every plan's columns to cross the all-to-all)."""
    from itertools import combinations

    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.plan.enumerator import table_options

    tiny = [
        TableSpec(name="a", rows=1, dim=16, pooling_factor=1),
        TableSpec(name="b", rows=5, dim=16, pooling_factor=1),
    ]
    topology = Topology(num_devices=devices, memory_bytes=1000 * GB, devices_per_host=hosts)
    shipped = _models_of(shipped, hardware)
    rng = np.random.default_rng(devices)
    for tables in (tiny, tiny + pool[:1], tiny + [pool[5]]):
        bound = lower_bound_ms(shipped, tables, topology)
        priced = []
        for replicated in (set(r) for count in range(len(tables) + 1) for r in combinations(range(len(tables)), count)):
            pieces, assign = [], []
            for index, table in enumerate(tables):
                options = table_options(table, topology)
                for piece in options["data_parallel" if index in replicated else "table_wise"]:
                    pieces.append(piece)
                    assign.append(piece.devices[0] if piece.devices else int(rng.integers(devices)))
            plan = Plan.from_assignment(pieces, assign, devices, "replicating")
            priced.append(Simulator(shipped).plan_cost(plan, tables, topology.batch_size).cost_ms)
        assert min(priced) >= bound - 1e-6, (tables, priced, bound)


@pytest.fixture(scope="module")
def contending(spineless, tmp_path_factory) -> tuple[CostModels, str]:
    """Models of the network-alone form with a strong superadditive (convex) term, saved: fused tables cost more than
    apart. Every unit of the term weighs every table's encoding alike and heavily."""
    compute = spineless.compute.network()
    with torch.no_grad():
        compute.contention = Monotone(compute.hidden, compute.hidden, convex=True)
        compute.contention.w1.fill_(0.0)
        compute.contention.w2.fill_(0.5)
    compute.fusion = "free"
    models = dataclasses.replace(spineless, compute=ComputeModel.of_network(compute), info=spineless.info.model_copy())
    path = tmp_path_factory.mktemp("contending") / "models.pt"
    models.save(path)
    return CostModels.load(path), str(path)


def test_the_compute_model_can_price_fusion_above_and_below_running_apart(shipped, spineless, contending, pool):
    """Subadditive (a concave term alone), superadditive (a convex term) and the spine's kernels and pairs all fit
    the one model form, and either way adding a table never lowers a shard's price."""
    pieces = [TablePiece.whole(t) for t in pool[:20]]
    for models, fused_costs_more in ((spineless, False), (contending[0], True)):
        fused = models.predict_fused_shards([pieces], 512).sum()
        apart = models.predict_fused_shards([[p] for p in pieces], 512).sum()
        assert (fused > apart) == fused_costs_more
    for models in (spineless, contending[0], shipped):
        growing = models.predict_fused_shards([pieces[:k] for k in range(1, 21)], 512).sum(axis=1)
        assert np.all(np.diff(growing) >= -1e-6)
    # the shipped spine: the forward's kernel cost is paid once, so fusing saves there
    fused, apart = shipped.predict_fused_shards([pieces], 512), shipped.predict_fused_shards([[p] for p in pieces], 512)
    assert fused[0, 0] < apart[:, 0].sum()


@pytest.mark.slow
def test_the_compute_model_learns_the_fused_backward_these_cpu_kernels_measured():
    """Recorded real shards (experiments/fusion_measurements.py: 20 fp16 pool tables on this project's
    2-core AMD EPYC, batch 512): fused, their backward took 1.18x what the 20 took apart. Fit to the 20
    alone and the 20 together, the network-alone form and the spine's price the fused backward within 10% and
    above running apart; the subadditive network (the convex term off), which cannot price a shard above its
    tables apart, misses it by more than 15%."""
    recorded = [FusedShardMeasurement.model_validate(m) for m in json.loads((DATA / "fusion_shards.json").read_text())]
    singles, whole = recorded[:20], recorded[-1]
    assert len(whole.tables) == 20 and whole.bwd_ms > 1.1 * sum(m.bwd_ms for m in singles)
    fitted = [*singles, whole]
    data = compute_data(fitted)
    errors, ratios = {}, {}
    for form, fusion, no_spine in (
        ("free", "free", True),
        ("subadditive", "subadditive", True),
        ("spine", "free", False),
    ):
        # the 21 measurements in one batch per epoch: as close as minibatches of 4, in a sixth of the steps
        config = TrainConfig(
            hidden=32, depth=2, fusion=fusion, max_epochs=800, patience=800, minibatch=len(fitted), lr=0.05, seed=0
        )
        model = train_compute_model(data, data, dataclasses.replace(config, no_spine=no_spine))
        with torch.no_grad():
            bwd = torch.exp(model(data.features, data.mask, data.log_batch))[:, 1].numpy()
        errors[form] = abs(bwd[-1] / whole.bwd_ms - 1)
        ratios[form] = bwd[-1] / bwd[:20].sum()
    assert errors["free"] < 0.10 and ratios["free"] > 1.05
    assert errors["subadditive"] > 0.15 and ratios["subadditive"] <= 1.0
    assert errors["spine"] < 0.10 and ratios["spine"] > 1.05  # the spine's fp16 pairs


@pytest.fixture(scope="module")
def spineless(shipped) -> CostModels:
    """Models of the second format's form: the network prices tables alone, no physical spine."""
    torch.manual_seed(0)
    compute = ComputeModel.of_network(ComputeCostNet(hidden=32, depth=2, fusion="subadditive"))
    return dataclasses.replace(shipped, compute=compute, info=shipped.info.model_copy())


def test_first_and_second_format_model_files_load_as_they_priced(spineless, tmp_path):
    """Files `costmodel train` wrote before the physical spine (format 2), and before the convex term too
    (format 1), load and price as they did."""
    spineless.save(tmp_path / "new.pt")
    blob = torch.load(tmp_path / "new.pt", weights_only=True)
    del blob["compute"]["spine"]
    shard = [[TablePiece.whole(t) for t in generate_pool(PoolConfig(num_tables=8, seed=1))]]
    blob["format"] = "shard-ray-costmodels/2"
    torch.save(blob, tmp_path / "second.pt")
    second = CostModels.load(tmp_path / "second.pt")
    assert second.compute.spine is None
    assert second.predict_fused_shards(shard, 1024) == pytest.approx(spineless.predict_fused_shards(shard, 1024))
    blob["format"] = "shard-ray-costmodels/1"
    blob["compute"]["state"] = {k: v for k, v in blob["compute"]["state"].items() if not k.startswith("contention.")}
    torch.save(blob, tmp_path / "first.pt")
    first = CostModels.load(tmp_path / "first.pt")
    with torch.no_grad():
        contention = first.compute.network().contention
        assert float(contention(torch.full((1, first.compute.hidden), 50.0)).max()) < 1e-9
    assert first.compute.fusion == "subadditive" and first.compute.spine is None
    # the first format had no contention term: priced without one, as the second format's switched off prices
    assert first.predict_fused_shards(shard, 1024) == pytest.approx(spineless.predict_fused_shards(shard, 1024))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_no_plan_the_searches_make_is_priced_below_the_bound_when_fusion_costs(contending, pool, devices):
    """With superadditive models the bound is still below every algorithm's plan and the proven optimum,
    and branch and bound still finds the brute-force optimum (its pruning needs only monotone prices)."""
    models, path = contending
    topology = Topology(num_devices=devices, memory_bytes=1000 * GB)
    tables = pool[:12]
    bound = lower_bound_ms(models, tables, topology)
    for name in ("cost_search", "neuroshard", "dreamshard", "size_lookup_greedy", "random"):
        plan = place(name, tables, topology, cost_model=path)
        assert Simulator(models).plan_cost(plan, tables, topology.batch_size).cost_ms >= bound - 1e-6, name
    small = tables[:6]
    pricer = Pricer(models, topology)
    candidate, spending = branch_and_bound(pricer, small)
    enc, sizes = pricer.encodings(table_wise(small)), pricer.sizes(table_wise(small))
    brute = min(
        float(pricer.device_costs(enc, sizes, np.array(assign)).max())
        for assign in itertools.product(range(devices), repeat=len(small))
    )
    assert spending.cut_short() is None and candidate.cost == pytest.approx(brute, rel=1e-5)
    assert lower_bound_ms(models, small, topology, column_wise=False) <= brute + 1e-6
    assert lower_bound_ms(models, small, topology, column_wise=True) <= brute + 1e-6


def test_plan_and_costmodel_commands(tmp_path, capsys, pool, shipped):
    from shard_ray.workload.tables import save_tables

    tables = tmp_path / "t.json"
    save_tables(tables, pool[:12])
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--tables",
                str(tables),
                "--devices",
                "2",
                "--memory-gb",
                "2",
                "--algo",
                "cost_search",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["estimate"]["lower_bound_ms"] > 0 and len(doc["estimate"]["predicted"]["devices"]) == 2
    assert "lower bound on the simulated cost" in capsys.readouterr().out
    # evaluate the shipped model on fresh real measurements of unseen tables
    config = MeasureConfig(batch_size=1024)
    store_path = tmp_path / "held.db"
    unseen = [t.model_copy(update={"name": f"new{t.name}"}) for t in generate_pool(PoolConfig(num_tables=20, seed=9))]
    with MeasurementStore(store_path) as store:
        for parts in draw_augmented_fused_shards(unseen, 6, 3, (16, 64), seed=2):
            # labelled with the model's hardware: this checks the command, not the accuracy
            store.put_fused_shard(measure_fused_shard(parts, config, shipped.hardware, WORKER_BUDGET))
    code = main(
        [
            "costmodel",
            "evaluate",
            "--cost-model",
            str(default_cost_model_path()),
            "--store",
            str(store_path),
            "--no-mlflow",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"mape", "spearman", "n"} and result["unseen"]["n"] == 6 and result["mape"] >= 0
    # measurements of another machine: evaluated all the same, and the output says whose data it is
    other = "cpu:Another CPU:1thread"
    with MeasurementStore(store_path) as store:
        for parts in draw_augmented_fused_shards(unseen, 4, 3, (16, 64), seed=3):
            store.put_fused_shard(measure_fused_shard(parts, config, other, WORKER_BUDGET))
    evaluate = ["costmodel", "evaluate", "--cost-model", str(default_cost_model_path()), "--store", str(store_path)]
    assert main([*evaluate, "--hardware", other, "--no-mlflow"]) == 0
    printed = capsys.readouterr().out
    assert f"models of {shipped.hardware}, evaluated on measurements of {other}" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["hardware"] == {"models": shipped.hardware, "measurements": other} and result["n"] == 4


def test_hosts_price_inter_host_traffic_apart(shipped, pool):
    """Over hosts a device's price keeps what the comm model learned beyond the links' price on one host and pays
    the links over the hosts, its inter-host traffic at the stated bandwidth: the same plan costs more over slower
    links, the simulator and the searches' pricer agree, one host prices as before, and the bound stays below."""
    from shard_ray.costmodel.pricing import link_ms, over_hosts

    models = shipped
    tables = pool[:24]
    widths = np.array([300.0, 100.0, 50.0, 50.0, 0.0, 0.0, 0.0, 0.0])
    links = models.links
    predicted = np.maximum(models.predict_comm(widths, 1024), 1.0)  # a price above the links' on one host
    assert np.array_equal(over_hosts(predicted, widths, 1024, None, 12.5, links), predicted)
    assert np.array_equal(over_hosts(predicted, widths, 1024, 8, 12.5, links), predicted)
    # Hosts of 4 at 1 GB/s, a device waiting for what it receives. Backward, device 0 receives the gradients of its
    # 300 columns for the 7 other devices' 1/8 of the samples: on one host all at the rate inside a host; over hosts
    # 3/8 of them from its host mates at that rate and, at once, 4/8 from host 1 at 1 GB/s, the slower. Its price
    # keeps what the model learned beyond the links' one-host price, fixed costs included, and pays the links over
    # the hosts instead. 4 bytes a float, batch 1024.
    priced = over_hosts(predicted, widths, 1024, 4, 1.0, links)
    ms_per_float = 1024 * 4 / 1e9 * 1e3
    fixed = links.collective_ms + 7 * links.message_ms
    one_host = fixed + 300 * 7 / 8 * ms_per_float / links.intra_host_gbps
    over = fixed + max(300 * 3 / 8 * ms_per_float / links.intra_host_gbps, 300 * 4 / 8 * ms_per_float / 1.0)
    assert priced[0, 1] == pytest.approx(predicted[0, 1] - one_host + over, rel=1e-6)
    # forward, device 4 (holding nothing) receives host 0's 500 columns' 1/8 share from host 0 only
    one_host = fixed + 500 / 8 * ms_per_float / links.intra_host_gbps
    assert priced[4, 0] == pytest.approx(predicted[4, 0] - one_host + fixed + 500 / 8 * ms_per_float / 1.0, rel=1e-6)
    # at the rate inside a host between hosts too, every device keeps its fixed costs: it pays no more than on one
    # host, and less only by what its two link classes carry at once
    inside = links.intra_host_gbps
    level = over_hosts(predicted, widths, 1024, 4, inside, links)
    one, apart = link_ms(widths, 1024, None, inside, links), link_ms(widths, 1024, 4, inside, links)
    assert (level <= predicted + 1e-12).all() and level == pytest.approx(predicted - (one - apart), rel=1e-9)

    costs = {}
    for per_host, gbps in ((None, 12.5), (2, 12.5), (2, 0.5)):
        topology = Topology(num_devices=8, memory_bytes=4 * GB, devices_per_host=per_host, inter_host_gbps=gbps)
        plan = place("size_lookup_greedy", tables, topology)  # one plan, whatever the hosts
        simulated = Simulator(models).plan_cost(plan, tables, 1024).cost_ms
        pieces = [p for shard in plan.pieces(tables) for p in shard]
        assign = np.array([d for d, shard in enumerate(plan.pieces(tables)) for _ in shard])
        assert Pricer(models, topology).plan_cost(pieces, assign) == pytest.approx(simulated, rel=1e-6)
        assert lower_bound_ms(models, tables, topology) <= simulated
        costs[(per_host, gbps)] = simulated
    assert costs[(2, 0.5)] > costs[(2, 12.5)]
    searched = place("cost_search", tables, Topology(num_devices=8, memory_bytes=4 * GB, devices_per_host=2))
    assert searched.settings.devices_per_host == 2 and searched.settings.inter_host_gbps == 12.5
    assert searched.estimate.predicted.cost_ms >= searched.estimate.lower_bound_ms


def test_a_comm_model_calibrated_over_hosts_prices_their_traffic_itself(shipped, pool, tmp_path, monkeypatch):
    """Models whose comm model was fit over hosts of 2 (`calibrate --devices-per-host 2`) price plans
    over such hosts as they predict, with no stated inter-host bandwidth on top; over other hosts, the
    links over the hosts are priced in (`over_hosts`) and the plan says the prices carry inter-host time measured
    elsewhere. `plan` picks such models for their hosts only."""
    from shard_ray.costmodel.models import hardware_models_path, models_for
    from shard_ray.costmodel.pricing import over_hosts

    tables = pool[:24]
    learned = dataclasses.replace(shipped, info=shipped.info.model_copy(update={"comm_devices_per_host": 2}))
    learned_file = tmp_path / "learned.pt"
    learned.save(learned_file)
    for per_host, analytic in ((2, False), (4, True)):
        topology = Topology(num_devices=8, memory_bytes=4 * GB, devices_per_host=per_host, inter_host_gbps=0.5)
        plan = place(
            "cost_search", tables, topology, cost_model=str(learned_file), settings={"sharding_types": ["table_wise"]}
        )
        widths = np.array([sum(s.width for s in plan.shards_on(d)) for d in range(8)], dtype=np.float64)
        pricer = Pricer(learned, topology)
        one_host = pricer.one_host_comm(widths, widths.sum(), widths.max(), 8)
        expected = over_hosts(one_host, widths, 1024, per_host, 0.5, learned.links) if analytic else one_host
        expected = np.maximum(expected, pricer.link_floor(widths))  # never below the links
        predicted = plan.estimate.predicted
        assert np.allclose([[d.fwd_comm_ms, d.bwd_comm_ms] for d in predicted.devices], expected, rtol=1e-5)
        pieces = plan.pieces(tables)
        assign = np.array([d for d, shard in enumerate(pieces) for _ in shard])
        items = [p for shard in pieces for p in shard]
        assert Pricer(learned, topology).plan_cost(items, assign) == pytest.approx(predicted.cost_ms, rel=1e-6)
        assert any("calibrated over hosts of 2" in w for w in plan.estimate.warnings) == analytic
    # The hosts' own file first, then the hardware's one-host file, then the shipped models.
    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    hardware = "cpu:Test CPU:1thread"
    hosts_file, one_host_file = hardware_models_path(hardware, 2), hardware_models_path(hardware)
    hosts_file.parent.mkdir(parents=True)
    learned.save(hosts_file)
    assert models_for(hardware, 2) == hosts_file
    assert models_for(hardware) == models_for(hardware, 4) == default_cost_model_path()
    shipped.save(one_host_file)
    assert models_for(hardware, 4) == models_for(hardware) == one_host_file and models_for(hardware, 2) == hosts_file


def test_models_calibrated_on_a_task_price_that_task_and_say_so_elsewhere(shipped, pool, tmp_path, monkeypatch):
    """A calibration on one task does not reprice another: the task's own file first, then the
    hardware-wide one, with a warning when the models were calibrated on other tables."""
    from shard_ray.costmodel.info import Calibrated
    from shard_ray.costmodel.models import hardware_models_path, models_for
    from shard_ray.workload.tables import task_digest

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    hardware = "cpu:Test CPU:1thread"
    task, other = pool[:12], pool[12:24]
    assert task_digest(task) == task_digest(list(reversed(task))) != task_digest(other)
    record = Calibrated(
        hardware=hardware,
        tables=[t.name for t in task],
        task=task_digest(task),
        at="today",
        chosen="fine-tuned",
        reason="",
    )
    info = shipped.info.model_copy(update={"calibrated": record})
    calibrated = dataclasses.replace(shipped, hardware=hardware, info=info)
    task_file, hardware_wide = hardware_models_path(hardware, tables=task), hardware_models_path(hardware)
    task_file.parent.mkdir(parents=True)
    calibrated.save(task_file)
    assert models_for(hardware, tables=task) == task_file
    assert models_for(hardware, tables=other) == default_cost_model_path()
    calibrated.save(hardware_wide)
    assert models_for(hardware, tables=other) == hardware_wide and models_for(hardware, 2, task) == task_file
    topology = Topology(num_devices=2, memory_bytes=4 * GB)
    own = place("size_greedy", task, topology, hardware=hardware, cost_model=None)
    assert own.estimate is None  # a heuristic loads no models
    own = place("cost_search", task, topology, hardware=hardware)
    assert own.estimate.cost_model == str(task_file)
    assert "calibrated on these 12 tables on today" in own.estimate.provenance
    assert not any("calibrated on other tables" in w for w in own.estimate.warnings)
    elsewhere = place("cost_search", other, topology, hardware=hardware)
    assert elsewhere.estimate.cost_model == str(hardware_wide)
    assert "calibrated on other tables (12: " in elsewhere.estimate.provenance
    assert any("calibrated on other tables than these" in w for w in elsewhere.estimate.warnings)


def _spine_made_with_known_rates() -> Spine:
    spine = Spine(cache_mb=16.0)
    spine.rates[:] = np.random.default_rng(3).random(spine.rates.shape) * 0.05
    spine.rates[:, QUANTITIES.index("touched")] = 0.0  # a rate the fit must find to be none
    spine.kernel_ms[:] = [[0.02, 0.05], [0.03, 0.04]]
    spine.pair_rate[:] = [[0.0, 0.01], [0.07, 0.4]]
    return spine


def test_the_spine_fit_recovers_the_rates_shards_were_made_with(pool):
    """Shards priced by a spine of known rates (a zero one among them) are fitted back to those prices, the cache
    size among the choices found, the same way every time."""
    made = _spine_made_with_known_rates()
    shards = draw_augmented_fused_shards(pool, 200, 12, (4, 16, 64, 256), seed=2)
    features, mask, _ = padded_shards(shards, [200_000] * len(shards))
    log_batch = np.array([9.0, 10.0, 11.0] * 67, dtype=np.float32)[: len(shards)]
    log_ms = np.log(spine_shard_ms(made, features, mask, log_batch))
    fitted = fit_spine(features, mask, log_batch, log_ms)
    assert float(fitted.cache_mb) == 16.0
    assert np.exp(log_ms) == pytest.approx(spine_shard_ms(fitted, features, mask, log_batch), rel=1e-3)
    assert fitted.describe() == fit_spine(features, mask, log_batch, log_ms).describe()


def test_replicas_pay_a_kernel_of_their_own_and_their_dense_update_and_the_fit_finds_both(pool):
    """A device holding data-parallel replicas beside sharded pieces runs two kernels (`FusedShard`): the spine
    prices a second launch of the replicas' precision, as measured on an H200 (docs/gpu.md), and each replica's
    dense update by its whole table's MB; shards made so, some with replicas, are fitted back to their prices."""
    made = _spine_made_with_known_rates()
    shards = draw_augmented_fused_shards(pool, 200, 12, (4, 16, 64, 256), seed=2)
    features, mask, _ = padded_shards(shards, [200_000] * len(shards))
    replicas = np.zeros_like(mask)
    replicas[::3, 0] = 1.0  # every third shard's first table a replica
    log_batch = np.array([9.0, 10.0, 11.0] * 67, dtype=np.float32)[: len(shards)]
    launches = _spine_made_with_known_rates()
    launches.pair_rate[:] = 0.0  # the launches alone: a kernel's pairs are its own tables' (they split with it)
    extra = spine_shard_ms(launches, features, mask, log_batch, replicas) - spine_shard_ms(
        launches, features, mask, log_batch
    )
    fp16 = features[..., TABLE_FEATURES.index("fp16")]
    # A replica whose precision a sharded table of the shard shares: one launch of that precision more.
    shares = (replicas[:, 0] > 0) & ((fp16[:, 1:] == fp16[:, :1]) & (mask[:, 1:] > 0)).any(axis=1)
    dense = QUANTITIES.index("dense")
    rows = 10.0 ** features[:, 0, TABLE_FEATURES.index("log10_rows")].astype(np.float64)
    width = 2.0 ** features[:, 0, TABLE_FEATURES.index("log2_width")].astype(np.float64)
    table_mb = rows * width * (4.0 - 2.0 * fp16[:, 0]) / 1e6 * replicas[:, 0]  # the replica's whole table
    expected = launches.kernel_ms.T[fp16[:, 0].astype(np.int64)] * shares[:, None] + (
        table_mb[:, None] * launches.rates[:, dense]
    ).astype(np.float32)
    assert shares.sum() > 10 and (table_mb > 0).sum() > 60
    assert extra == pytest.approx(expected, rel=1e-4, abs=1e-5)
    log_ms = np.log(spine_shard_ms(made, features, mask, log_batch, replicas))
    fitted = fit_spine(features, mask, log_batch, log_ms, replicas)
    assert np.exp(log_ms) == pytest.approx(spine_shard_ms(fitted, features, mask, log_batch, replicas), rel=1e-3)
    assert fitted.kernel_ms == pytest.approx(made.kernel_ms, rel=1e-3)
    assert fitted.rates[:, dense] == pytest.approx(made.rates[:, dense], rel=1e-2)


def test_a_device_with_replicas_is_priced_alike_by_its_shard_and_by_the_plans_sums(pool):
    """The searches price devices from summed encodings, `predict_fused_shards` a shard of pieces: both see a
    device's replicas in a kernel of their own. On the shipped H200 models that kernel costs a launch: TorchRec's
    plans that replicate measured 2.1-2.4x the price that missed it (docs/gpu.md)."""
    from shard_ray.costmodel.models import PRETRAINED_DIR

    h200 = CostModels.load(PRETRAINED_DIR / "cuda-NVIDIA-H200.pt")
    tables, batch = pool[:4], 65536
    replicas = [replica(t, 8, 0) for t in tables[2:]]
    held = [TablePiece.whole(t) for t in tables[:2]]
    pricer = Pricer(h200, Topology(num_devices=8, memory_bytes=141 * GB, batch_size=batch))
    parts = pricer.plan_parts(held + replicas, np.zeros(4, dtype=np.int64))
    shard = h200.predict_fused_shards([held + replicas], batch)[0] + np.asarray(h200.step_overhead_ms)
    assert parts.compute[0] == pytest.approx(shard, rel=1e-5)
    sharded_alike = [p.model_copy(update={"replicas": 1, "devices": None}) for p in replicas]
    one_kernel = h200.predict_fused_shards([held + sharded_alike], batch)[0].sum()
    launch = float(h200.compute.spine.kernel_ms[:, 0].sum())  # the pool's tables are fp32
    assert shard.sum() - np.sum(h200.step_overhead_ms) > one_kernel + 0.5 * launch


def test_a_table_far_from_the_training_data_is_priced_by_the_spine_within_the_correction_bound(pool):
    """Whatever the network does far from its data (here: weights scaled up a hundredfold), a table's own price
    stays within CORRECTION_BOUND of the spine's physics, and the price says it rests on the bound."""
    network = ComputeCostNet(hidden=16, depth=2, spine=True)
    network.spine.set(_spine_made_with_known_rates())
    with torch.no_grad():
        for parameter in network.encoder.parameters():
            parameter.mul_(100.0)
    model = ComputeModel.of_network(network)
    huge = pool[0].model_copy(
        update={"rows": 10**9, "dim": 1024, "pooling_factor": 500.0, "reuse_histogram": None, "zipf_exponent": 0.2}
    )
    features = pieces_features([TablePiece.whole(huge), TablePiece.whole(pool[1])])
    ratio = model.encode(features, 11.0)[:, :2] / model.spine(features, 11.0)[:, :2]
    assert float(ratio.min()) >= 1 / CORRECTION_BOUND - 1e-6 and float(ratio.max()) <= CORRECTION_BOUND + 1e-6
    assert bool(model.correction_at_bound(features, 11.0)[0])
    models = CostModels(model, None, "cpu:test")
    assert models.at_correction_bound([huge], 2048) == [huge.name]
    (line,) = corrections_at_bound(models, [huge, pool[1]][:1], 2048)
    assert f"for 1 table(s): {huge.name};" in line and "calibrate" in line
    # calibrated on these very tables, the models measured them: their calibration's held-out figures speak instead
    models.info.calibrated = Calibrated(
        hardware="cpu:test", tables=[huge.name], task=task_digest([huge]), chosen="fine-tuned", reason=""
    )
    assert corrections_at_bound(models, [huge], 2048) == [] and corrections_at_bound(models, [huge, pool[1]], 2048)


def test_spine_models_keep_adding_a_table_from_lowering_a_price_and_the_bound_below_every_plan(pool, tmp_path):
    """The spine's kernel and pairs enter the running sums: a device priced from its sum equals the padded
    shard's price, a table added never lowers it, and the lower bound stays below plans of every sharding type."""
    network = ComputeCostNet(hidden=16, depth=2, spine=True)
    network.spine.set(_spine_made_with_known_rates())
    models = CostModels(ComputeModel.of_network(network), None, "cpu:test", ModelInfo(rows_cap=200_000))
    pieces = [TablePiece.whole(t) for t in pool[:12]]
    growing = models.predict_fused_shards([pieces[:k] for k in range(1, 13)], 1024).sum(axis=1)
    assert np.all(np.diff(growing) > 0)
    sums = models.encode_tables(pieces, 1024).sum(axis=0, keepdims=True)
    assert models.compute_from_sums(sums, np.ones(1))[0] == pytest.approx(
        models.predict_fused_shards([pieces], 1024)[0], rel=1e-5
    )
    topology = Topology(num_devices=4, memory_bytes=64 * GB, batch_size=1024)
    bound = lower_bound_ms(models, pool[:12], topology)
    models.save(tmp_path / "spine.pt")
    for algo in ("size_greedy", "cost_search"):
        plan = place(algo, pool[:12], topology, seed=0, cost_model=str(tmp_path / "spine.pt"))
        assert Simulator(models).plan_cost(plan, pool[:12], 1024).cost_ms >= bound - 1e-6


def test_the_links_price_grows_with_the_bytes_and_never_falls_as_devices_are_added(shipped):
    """The shipped comm model, fit to 2-device gangs, prices an all-to-all of 8 devices near 0 ms; the links' price
    (a fixed time, a latency per peer, the bytes received at each link class's rate) is the floor under it, and past
    2 devices it is scaled by what the model learned at 2. With the same columns per device, adding devices never
    lowers a device's price, on one host or over hosts whose links are slower than a host's own (as a NIC is
    beside NVLink); more columns never lower it either."""
    from shard_ray.costmodel.pricing import link_ms

    links = link_profile(shipped.hardware)
    for per_host, gbps in ((None, 12.5), (2, 0.025), (8, 0.5)):
        before = np.zeros(2)
        for devices in (2, 4, 8, 16, 64) if per_host != 8 else (8, 16, 64):
            topology = Topology(num_devices=devices, memory_bytes=GB, devices_per_host=per_host, inter_host_gbps=gbps)
            pricer = Pricer(shipped, topology)
            widths = np.full(devices, 128.0)
            priced = pricer.collectives(widths)
            assert np.allclose(priced, priced[0]) and (priced >= pricer.link_floor(widths) - 1e-12).all()
            assert (priced[0] >= before - 1e-9).all(), (per_host, devices, priced[0], before)
            before = priced[0]
            wider = pricer.collectives(np.full(devices, 256.0))
            assert (wider[0] > priced[0]).all()
            assert pricer.input_dist(widths)[0] >= links.collective_ms
    # 8 devices on one host, 128 columns each, batch 1024: forward a device receives 7/8 of 128 columns for its
    # 128 samples, backward its 128 columns for 7 x 128 samples: 459 KB either way, at the profile's rate.
    received_ms = 7 / 8 * 128 * 1024 * 4 / (links.intra_host_gbps * 1e9) * 1e3
    expected = links.collective_ms + 7 * links.message_ms + received_ms
    assert link_ms(np.full(8, 128.0), 1024, None, 12.5, links) == pytest.approx(np.full((8, 2), expected))
    assert shipped.predict_comm(np.full(8, 128.0), 1024).max() < 0.1 * expected  # what the floor is for


def test_replicas_all_reduce_over_hosts_is_priced_as_a_ring_crossing_the_links(shipped):
    """Over hosts a replica's gradient all-reduce is never priced below a ring's bytes on the links: the bus bytes
    2(D-1)/D of the gradient over a host's L links (a ring per NIC), or all of them over a link its host's devices
    share; with the same gradient it never falls as hosts are added; every device holding a replica pays it, the
    others none; and the lower bound stays below the plan's price."""
    from shard_ray.costmodel.pricing import ring_bus_mb, ring_link_ms

    table = TableSpec(name="dense_ish", rows=400_000, dim=64, pooling_factor=2.0)
    other = TableSpec(name="other", rows=1_000, dim=16, pooling_factor=1.0)
    mb = table.rows * table.dim * table.bytes_per_element / 1e6
    links = link_profile(shipped.hardware)
    before = 0.0
    for devices in (8, 16, 32):
        own = Topology(num_devices=devices, memory_bytes=4 * GB, devices_per_host=4, inter_host_gbps=0.05)
        shared = own.model_copy(update={"host_link_gbps": 0.05})
        pieces = data_parallel(table, devices) + table_wise([other])
        assign = list(range(devices)) + [0]
        sync = {name: Pricer(shipped, t).plan_parts(pieces, np.array(assign)).sync for name, t in
                (("own", own), ("shared", shared))}  # fmt: skip
        bus = ring_bus_mb(mb, devices)
        fixed = links.collective_ms + 2 * (devices - 1) * links.message_ms
        assert ring_link_ms(mb, devices, 4, 0.05, links) == pytest.approx(fixed + bus / 4 / 0.05)
        assert ring_link_ms(mb, devices, 4, 0.05, links, 0.05) == pytest.approx(fixed + bus / 0.05)
        assert (sync["own"] >= fixed + bus / 4 / 0.05 - 1e-9).all() and np.allclose(sync["own"], sync["own"][0])
        assert (sync["shared"] >= fixed + bus / 0.05 - 1e-9).all()
        assert sync["own"][0] >= before
        before = sync["own"][0]
        for topology in (own, shared):
            priced = Pricer(shipped, topology).plan_parts(pieces, np.array(assign)).totals().max()
            assert lower_bound_ms(shipped, [table, other], topology) <= priced
    # a replica held on devices 0 and 1 of 8 only: the other devices take no part
    pinned = [replica(table, 2, 0), replica(table, 2, 1)] + table_wise([other])
    parts = Pricer(shipped, own.model_copy(update={"num_devices": 8})).plan_parts(pinned, np.array([0, 1, 2]))
    assert parts.sync[0] > 0 and (parts.sync[2:] == 0).all()


def test_link_profiles_are_matched_by_hardware_and_say_their_source():
    assert "NVLink 4" in link_profile("cuda:NVIDIA H100 80GB HBM3").source
    assert link_profile("cuda:NVIDIA H100 PCIe").intra_host_gbps == 64.0
    assert link_profile("cuda:NVIDIA A100-SXM4-80GB").intra_host_gbps == 300.0
    assert "PCIe 4.0" in link_profile("cuda:NVIDIA L40S").source
    assert link_profile("cpu:AMD EPYC:1thread") == link_profile(None) and "gloo" in link_profile(None).source


def test_the_link_rate_fitted_to_all_to_alls_measured_across_emulated_hosts_is_the_links_achieved_rate():
    """Recorded gloo all-to-alls between 2 emulated hosts (one device each) joined by links shaped to 200 Mbit/s,
    whose TCP rate measured 193 Mbit/s (experiments/results/comm_over_hosts): the fixed time and rate fitted to
    what each device received and how long it took recover that rate within 15%."""
    import gzip
    import json

    from shard_ray.costmodel.links import fit_link_rate

    path = Path(__file__).parents[1] / "experiments" / "results" / "comm_over_hosts" / "comm_over_hosts.json.gz"
    records = [r for r in json.loads(gzip.open(path).read()) if r["layout"] == "2x1" and 150 < r["link_mbit"] < 300]
    parts = ("input_dist_ms", "fwd_comm_ms", "bwd_comm_ms")
    link_mbit = records[0]["link_mbit"]
    # `received` is the ms at the measured rate: back to MB
    received_mb = np.array([r["received"][p] * link_mbit / 8 / 1e3 for r in records for p in parts])
    measured_ms = np.array([r["measured"][p] for r in records for p in parts])
    fixed_ms, gbps = fit_link_rate(received_mb, measured_ms)
    assert gbps * 8e3 == pytest.approx(link_mbit, rel=0.15) and 0 <= fixed_ms < 5
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        fit_link_rate(received_mb, measured_ms[::-1] * 0 + 1 / (received_mb + 1))


def test_links_are_fitted_only_to_all_to_alls_a_gang_timed_not_to_those_it_priced(small_tables):
    """A gang of more devices than cores prices its all-to-alls with the comm model: calibrating the links on them
    would fit the model to its own prices, so they are left out, and `fit_links` says why it fitted nothing."""
    from shard_ray.costmodel.pricing import measured_collectives
    from shard_ray.plan.cost import PRICED_WHEN_SHARED
    from shard_ray.workflows.calibrate import fit_links

    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=256)
    plan = Plan.from_assignment(table_wise(small_tables), [0, 1, 0, 1, 0], 2, "alternate")
    devices = [
        DeviceCost(
            device=d, input_dist_ms=0.2, fwd_compute_ms=1.0, fwd_comm_ms=0.5, bwd_comm_ms=0.5, bwd_compute_ms=1.0
        )
        for d in range(2)
    ]
    timed = PlanMeasurement(key="t", plan=plan, tables=small_tables, cost=PlanCost(devices=devices, batch_size=256))
    priced = PlanMeasurement(
        key="p",
        plan=plan,
        tables=small_tables,
        cost=PlanCost(devices=devices, batch_size=256, priced_parts=list(PRICED_WHEN_SHARED), priced_by="m.pt"),
    )
    assert len(measured_collectives([timed, priced], None)) == 6 == len(measured_collectives([timed], None))
    assert len(measured_collectives([priced], None)) == 0
    models = CostModels.load(default_cost_model_path())
    profile, said = fit_links([priced] * 10, topology, models, "cpu:x")
    assert profile is None and "the gang priced every plan's all-to-alls" in said


def test_the_link_between_hosts_is_fitted_as_the_kind_that_carried_the_bytes():
    """Collectives timed as a link of 25 Mbit/s carries the bytes, plus noise: as each device's own (what it
    received) or as one its host's 2 devices share (what the host received). The fit names the kind that carried
    them and recovers the rate within 10%; hosts of one device have links of their own."""
    from shard_ray.costmodel.links import fit_link_between_hosts

    rng = np.random.default_rng(0)
    own_mb = rng.uniform(0.05, 2.0, 120)
    host_mb = own_mb + rng.uniform(0.0, 2.0, 120)  # a host mate's bytes on top
    gbps = 25 / 8e3
    for shared, carried in ((False, own_mb), (True, host_mb)):
        measured = (0.5 + carried / gbps) * rng.lognormal(0.0, 0.05, 120)
        _, fitted, found, errors = fit_link_between_hosts(own_mb, host_mb, measured)
        assert found == shared and fitted == pytest.approx(gbps, rel=0.1) and errors[shared] < errors[not shared]
    _, fitted, found, errors = fit_link_between_hosts(own_mb, own_mb, 0.5 + own_mb / gbps)
    assert not found and not errors and fitted == pytest.approx(gbps)


def test_plan_over_hosts_takes_a_shared_link_calibrate_found(capsys, tmp_path):
    """Models whose profile says the hosts' devices share one link (`calibrate` over such hosts): `plan` over hosts
    of 2, given no rate, records that link and prices it as `--host-link-gbps` at that rate would."""
    from console import shard_ray_here

    from shard_ray.plan.plan import load_plan

    models = CostModels.load(default_cost_model_path())
    models.info.links = models.links.model_copy(update={"inter_host_gbps": 0.003, "host_link_gbps": 0.003})
    models.save(tmp_path / "fitted.pt")
    (tmp_path / "tables.json").write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 5_000, "dim": 64, "pooling_factor": 4} for i in range(8)]})
    )
    plan = ["plan", "--tables", str(tmp_path / "tables.json"), "--devices", "4", "--memory-gb", "1"]
    plan += ["--algo", "size_greedy", "--devices-per-host", "2", "--cost-model", str(tmp_path / "fitted.pt")]
    found = shard_ray_here(capsys, *plan, "--out", str(tmp_path / "found.json"))
    assert found.returncode == 0, found.stderr
    assert "between hosts: 0.003 GB/s a host (24 Mbit/s)" in found.stdout
    assert "one link its devices share, as `calibrate` found them" in found.stdout
    given = shard_ray_here(
        capsys, *plan, "--inter-host-gbps", "0.003", "--host-link-gbps", "0.003", "--out", str(tmp_path / "given.json")
    )
    assert given.returncode == 0, given.stderr
    found, given = load_plan(tmp_path / "found.json"), load_plan(tmp_path / "given.json")
    assert found.settings.host_link_gbps == given.settings.host_link_gbps == 0.003
    assert found.estimate.predicted.cost_ms == pytest.approx(given.estimate.predicted.cost_ms, rel=1e-9)


def test_plan_over_hosts_takes_the_rate_calibrate_fitted_unless_given_one(capsys, tmp_path):
    """Models whose link profile has a rate between hosts (as `calibrate` over hosts keeps it): `plan` over such
    hosts with no --inter-host-gbps takes that rate, says so and records it, so its price is the one at that rate;
    a rate given stands, and on one host nothing changes."""
    from console import shard_ray_here

    from shard_ray.plan.plan import load_plan

    models = CostModels.load(default_cost_model_path())
    models.info.links = models.links.model_copy(update={"inter_host_gbps": 0.006})  # 48 Mbit/s
    models.save(tmp_path / "fitted.pt")
    (tmp_path / "tables.json").write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 5_000, "dim": 64, "pooling_factor": 4} for i in range(6)]})
    )
    plan = ["plan", "--tables", str(tmp_path / "tables.json"), "--devices", "4", "--memory-gb", "1"]
    plan += ["--algo", "size_greedy", "--cost-model", str(tmp_path / "fitted.pt")]
    costs = {}
    for name, flags in (("fitted", ["--devices-per-host", "2"]), ("given", ["--devices-per-host", "2"]), ("one", [])):
        flags += ["--inter-host-gbps", "12.5"] if name == "given" else []
        done = shard_ray_here(capsys, *plan, *flags, "--out", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        said = "between hosts: 0.006 GB/s a device (48 Mbit/s), the rate `calibrate` fitted" in done.stdout
        assert said == (name == "fitted"), done.stdout
        # the plan's header says the rate that priced it, given or chosen (a walkthrough found a given one unsaid)
        rate = {"fitted": "; between hosts 0.006 GB/s a device)", "given": "; between hosts 12.5 GB/s a device)"}
        assert (rate[name] in done.stdout) if name in rate else "between hosts " not in done.stdout, done.stdout
        written = load_plan(tmp_path / f"{name}.json")
        costs[name] = written.estimate.predicted.cost_ms
        assert written.settings.inter_host_gbps == {"fitted": 0.006, "given": 12.5, "one": None}[name]
    assert costs["fitted"] > 2 * costs["given"], costs  # the slow links, priced


def test_devices_sharing_their_hosts_link_wait_for_all_their_host_receives(capsys, tmp_path):
    """`--host-link-gbps`: a host's devices share one link to other hosts (the emulated cluster's hosts, a NIC per
    host). A device's bytes from other hosts then also wait for all its host receives over that link: a device
    receiving little pays its host mate's traffic, a host of one device pays as before, and no link shared prices
    as before. `plan` records the link, and its estimate, the simulator and the searches' pricer agree on it."""
    from console import shard_ray_here

    from shard_ray.costmodel.pricing import link_ms, received_floats
    from shard_ray.plan.plan import load_plan

    links = CostModels.load(default_cost_model_path()).links
    widths = np.array([300.0, 100.0, 50.0, 50.0])
    own = link_ms(widths, 1024, 2, 1.0, links)
    assert np.array_equal(link_ms(widths, 1024, 2, 1.0, links, None), own)
    shared = link_ms(widths, 1024, 2, 1.0, links, 0.5)
    _, inter = received_floats(widths, 2)
    fixed = links.collective_ms + 3 * links.message_ms
    ms_per_float = 1024 * 4 / 1e9 * 1e3
    for device in range(4):  # backward: host 0 receives the gradients of devices 0 and 1's columns from host 1
        host = inter[(device // 2) * 2 : (device // 2) * 2 + 2, 1].sum()
        assert shared[device, 1] == pytest.approx(fixed + host * ms_per_float / 0.5, rel=1e-9)
    assert shared[1, 1] > own[1, 1] and (shared >= own).all()  # device 1 waits for device 0's 300 columns too
    alone = link_ms(widths, 1024, 1, 1.0, links)  # a device per host: its link is its own
    assert np.allclose(link_ms(widths, 1024, 1, 1.0, links, 1.0), alone)

    (tmp_path / "tables.json").write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 5_000, "dim": 64, "pooling_factor": 4} for i in range(8)]})
    )
    plan = ["plan", "--tables", str(tmp_path / "tables.json"), "--devices", "4", "--memory-gb", "1"]
    plan += ["--algo", "size_greedy", "--devices-per-host", "2", "--inter-host-gbps", "0.025"]
    written = {}
    for name, flags in (("own", []), ("shared", ["--host-link-gbps", "0.025"])):
        done = shard_ray_here(capsys, *plan, *flags, "--out", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        written[name] = load_plan(tmp_path / f"{name}.json")
    assert written["own"].settings.host_link_gbps is None and written["shared"].settings.host_link_gbps == 0.025
    tables = load_tables(tmp_path / "tables.json")
    here = CostModels.load(models_for(hardware_id(threads=1)))  # the models `plan` picks on this machine
    for made in written.values():  # the file's estimate is the simulator's price of it
        simulated = Simulator(here).plan_cost(made, tables, 1024).cost_ms
        assert made.estimate.predicted.cost_ms == pytest.approx(simulated, rel=1e-6)
    assert written["shared"].estimate.predicted.cost_ms > written["own"].estimate.predicted.cost_ms
    bad = shard_ray_here(capsys, *plan, "--host-link-gbps", "0", "--out", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "--host-link-gbps" in bad.stderr and not (tmp_path / "bad.json").exists()
    assert "must be above 0, got 0" in bad.stderr


def test_the_lower_bound_over_slow_hosts_counts_the_bytes_every_plan_sends_between_them(shipped):
    """Over links slow enough that the bytes between hosts dominate, the bound holds what every plan must send
    across them: below every plan the searches and TorchRec make (TorchRec's replicates small tables, which sends
    their gradients' all-reduce across instead), with each device's own link and with the host's one shared link,
    and within 2x of the best of them, where without it the bound was 0.149 ms against a 68 ms plan."""
    from shard_ray.costmodel.bounds import across_hosts_ms

    tables = load_tables(Path(__file__).parents[1] / "experiments" / "tables" / "criteo_kaggle.json")
    slow = dict(num_devices=16, memory_bytes=4 * GB, devices_per_host=4, inter_host_gbps=0.003)
    for topology in (Topology(**slow), Topology(**slow, host_link_gbps=0.003)):
        bound = lower_bound_ms(shipped, tables, topology)
        costs = [
            Simulator(shipped).plan_cost(place(algo, tables, topology), tables, 1024).cost_ms
            for algo in ("size_greedy", "cost_search", "torchrec")
        ]
        assert bound <= min(costs) and 2 * bound >= min(costs), (bound, costs)
        assert bound == pytest.approx(across_hosts_ms(shipped, tables, topology), rel=1e-9)
    assert across_hosts_ms(shipped, tables, Topology(num_devices=16, memory_bytes=4 * GB)) == 0.0  # one host


def test_plan_over_hosts_with_no_rate_takes_torchrecs_default_capped_at_the_rate_inside_a_host(capsys, tmp_path):
    """No rate between hosts given or fitted: TorchRec's default stands where the links inside a host are faster
    (a GPU's NVLink, or `--intra-host-gbps`), and is capped at their rate where they are slower (CPU's gloo), so
    that the links between hosts are never priced faster than those inside one; the plan records the rate, and a
    plan file without one is priced at the same."""
    from console import shard_ray_here

    from shard_ray.plan.plan import load_plan

    (tmp_path / "tables.json").write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 5_000, "dim": 64, "pooling_factor": 4} for i in range(8)]})
    )
    inside = CostModels.load(default_cost_model_path()).links.intra_host_gbps
    assert inside < 12.5  # the CPU's profile, as shipped
    plan = ["plan", "--tables", str(tmp_path / "tables.json"), "--devices", "4", "--memory-gb", "1"]
    plan += ["--algo", "size_greedy", "--devices-per-host", "2"]
    comm = {}
    for name, flags in (
        ("capped", []),
        ("given", ["--inter-host-gbps", "12.5"]),
        ("fast", ["--intra-host-gbps", "20"]),
    ):
        done = shard_ray_here(capsys, *plan, *flags, "--out", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        written = load_plan(tmp_path / f"{name}.json")
        comm[name] = max(d.fwd_comm_ms + d.bwd_comm_ms for d in written.estimate.predicted.devices)
        assert written.settings.inter_host_gbps == {"capped": inside, "given": 12.5, "fast": 12.5}[name]
        said = {
            "capped": f"between hosts: {inside:.4g} GB/s a device ({inside * 8e3:.0f} Mbit/s), the rate inside a host, "
            "below TorchRec's default",
            "given": None,
            "fast": "between hosts: 12.5 GB/s a device (100000 Mbit/s), TorchRec's default",
        }[name]
        assert (said in done.stdout) if said else "between hosts:" not in done.stdout, done.stdout
    assert comm["capped"] > comm["given"], comm  # the slower rate, priced
    # a plan file that records no rate (an earlier release's, or one written by hand) is priced at the same rate
    from shard_ray.costmodel.simulator import Simulator
    from shard_ray.workload.tables import load_tables

    written = load_plan(tmp_path / "capped.json")
    older = written.model_copy(update={"settings": written.settings.model_copy(update={"inter_host_gbps": None})})
    models = CostModels.load(written.estimate.cost_model)
    repriced = Simulator(models).plan_cost(older, load_tables(tmp_path / "tables.json"), 1024).cost_ms
    assert repriced == pytest.approx(written.estimate.predicted.cost_ms)


def test_a_topologys_own_rate_inside_a_host_prices_the_links_in_place_of_the_profiles(capsys, tmp_path):
    """`--intra-host-gbps` (a host whose links differ from the published figure): the all-to-alls are priced at that
    rate, never below the links' price there, and the plan records it, so `evaluate` prices it alike. Past the
    devices the comm model measured, its correction is taken over the links it learned on, so half the profile's
    rate costs about twice as much (it once cancelled out: 1 GB/s instead of 1.76 added 5%)."""
    from console import shard_ray_here

    from shard_ray.plan.plan import load_plan

    (tmp_path / "tables.json").write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 5_000, "dim": 128, "pooling_factor": 4} for i in range(8)]})
    )
    plan = ["plan", "--tables", str(tmp_path / "tables.json"), "--devices", "4", "--memory-gb", "1"]
    plan += ["--algo", "size_greedy"]
    comm = {}
    half = CostModels.load(default_cost_model_path()).links.intra_host_gbps / 2
    rates = {"profile": None, "half": half, "slow": 0.01}
    for name, rate in rates.items():
        flags = ["--intra-host-gbps", str(rate)] if rate else []
        done = shard_ray_here(capsys, *plan, *flags, "--out", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        written = load_plan(tmp_path / f"{name}.json")
        assert written.settings.intra_host_gbps == pytest.approx(rate)
        comm[name] = max(d.fwd_comm_ms for d in written.estimate.predicted.devices)
        tables = load_tables(tmp_path / "tables.json")
        again = Simulator(CostModels.load(written.estimate.cost_model)).plan_cost(written, tables, 1024)
        assert again.cost_ms == pytest.approx(written.estimate.predicted.cost_ms)
    # forward, each device receives for its 256 samples the 768 columns held elsewhere: 0.79 MB, about 79 ms at 0.01 GB/s
    assert comm["slow"] > 5 * comm["profile"] and comm["slow"] > 10.0 and comm["half"] > 1.5 * comm["profile"], comm


def test_the_comm_models_numpy_forward_prices_as_its_torch_network():
    """`CostModels.comm_ms` runs the network's layers in numpy (a search prices a few rows thousands of times):
    the same prices as the torch module, to float32's rounding."""
    models = CostModels.load(default_cost_model_path())
    features = np.random.default_rng(0).normal(size=(64, len(COMM_FEATURES))).astype(np.float32)
    with torch.no_grad():
        expected = torch.exp(models.comm.network()(torch.from_numpy(features))).numpy()
    assert models.comm_ms(features) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("fusion", ["spine", "free", "subadditive"])
def test_the_compute_models_numpy_forward_prices_as_its_torch_network(pool, fusion):
    """Pricing runs the compute model in numpy on its weights, without torch (`ComputeModel`): the shipped models
    (a spine's) and networks without a spine price shards, tables and devices' sums as the torch network training
    fits does, to float32's rounding, and a network rebuilt from the weights is the same network."""
    shipped = CostModels.load(default_cost_model_path())
    torch.manual_seed(1)
    network = (
        shipped.compute.network() if fusion == "spine" else ComputeCostNet(hidden=32, depth=2, fusion=fusion).eval()
    )
    model = ComputeModel.of_network(network)
    shards = draw_augmented_fused_shards(pool, 30, 12, (4, 16, 64), seed=4) + [
        [replica(pool[0], 4, 0), *(TablePiece.whole(t) for t in pool[1:3])]
    ]
    features, mask, replicas = padded_shards(shards, [200_000] * len(shards))
    log_batch = np.array([9.0, 10.0, 11.0] * 11, dtype=np.float32)[: len(shards)]
    with torch.no_grad():
        tensors = [torch.from_numpy(x) for x in (features, mask, log_batch, replicas)]
        expected = network(*tensors).numpy()
        rows = network.encode(tensors[0], tensors[2].unsqueeze(-1), tensors[3]).numpy()
    encoded = model.encode(features, log_batch[:, None], replicas)
    assert encoded == pytest.approx(rows, rel=1e-5, abs=1e-7)
    assert model.from_sums((encoded * mask[..., None]).sum(axis=1)) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    rebuilt = model.network().state_dict()
    assert (
        all(torch.equal(rebuilt[k], v) for k, v in network.state_dict().items())
        and rebuilt.keys() == network.state_dict().keys()
    )


def test_training_stopped_early_says_so_on_its_bar(capsys):
    """A fit that stops for want of validation gain ends its progress bar short of its epochs: the bar says why,
    where a new user read calibrate's "47/300" as a hang."""
    model = torch.nn.Linear(1, 1)
    inputs = torch.ones(8, 1)
    config = dataclasses.replace(TrainConfig(), max_epochs=50, patience=3)
    history = fit(model, 8, lambda batch: model(inputs[batch]).pow(2).mean(), lambda: 1.0, config, "toy model")
    assert len(history) == 4  # the first epoch sets the best; three without gain end it
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "toy model" in last and "4/50" in last and "stopped=no gain in 3 epochs" in last, last


def test_training_that_reports_each_epoch_itself_draws_no_progress_bar(capsys):
    """A Tune trial reports each epoch (`on_epoch`): its bar reached the sweep's output through Ray, one per trial,
    beside the sweep's own line a trial (from a new user's walk); trained alone, the bar is drawn."""
    recorded = [FusedShardMeasurement.model_validate(m) for m in json.loads((DATA / "fusion_shards.json").read_text())]
    data = compute_data(recorded)
    config = TrainConfig(hidden=8, depth=1, max_epochs=3, patience=3, minibatch=len(recorded), seed=0)
    epochs: list[int] = []
    train_compute_model(data, data, config, on_epoch=lambda epoch, loss, model: epochs.append(epoch))
    assert epochs == [0, 1, 2] and "training compute model" not in capsys.readouterr().err
    train_compute_model(data, data, config)
    assert "training compute model" in capsys.readouterr().err
