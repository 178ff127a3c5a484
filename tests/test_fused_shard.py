import os

import numpy as np
import pytest
import torch

from shard_ray.costmodel.train import OlderMeasurementsWarning, newest_procedure
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.fused_shard import (
    MAX_WARMUP_STEPS,
    FusedShard,
    HostBuffers,
    KeptBatches,
    measure_fused_shard,
    memory_budget,
    shard_rows_cap,
    time_fused_shard,
    warmed_up,
)
from shard_ray.profiling.procedure import (
    MEASUREMENT_PROCEDURE,
    PROCEDURE_1_CPU_MAX_ROWS,
    WARMUP_BATCHES,
    FusedShardMeasurement,
    MeasureConfig,
    fused_shard_key,
)
from shard_ray.profiling.sampling import draw_fused_shards
from shard_ray.profiling.store import MeasurementStore, read_record
from shard_ray.workload.tables import TableBatch, TableSpec

SMALL = MeasureConfig(batch_size=64, warmup=1, repeats=3)


def manual_pooled(shard: FusedShard, step: int) -> torch.Tensor:
    """Pooled sums computed by hand from the kernels' weights and the prepared batch."""
    columns = {}
    for (members, module), (indices, offsets) in zip(shard.groups, shard.batches[step]):
        weights = module.split_embedding_weights()
        b = shard.config.batch_size
        for k, i in enumerate(members):
            w = weights[k].float()
            bags = offsets[k * b : (k + 1) * b + 1]
            columns[i] = torch.stack([w[indices[bags[j] : bags[j + 1]]].sum(0) for j in range(b)])
    return torch.cat([columns[i] for i in range(len(shard.pieces))], dim=1)


def test_fused_forward_matches_manual_lookup(small_tables):
    parts = [TablePiece.whole(t) for t in small_tables] + [TablePiece(table=small_tables[1], columns=(16, 48))]
    shard = FusedShard(parts, SMALL, torch.device("cpu"))
    assert shard.width == sum(t.dim for t in small_tables) + 32
    assert len(shard.groups) == 2  # fp32 and fp16 kernels
    out, replicated = shard.forward(0)
    assert out.shape == (64, shard.width) and replicated.shape == (0, 0)
    assert torch.allclose(out, manual_pooled(shard, 0), atol=1e-2)


def test_backward_applies_the_optimizer_update(small_tables):
    shard = FusedShard([TablePiece.whole(small_tables[0])], SMALL, torch.device("cpu"))
    module = shard.groups[0][1]
    before = module.split_embedding_weights()[0].clone()
    pooled = shard.forward(0)
    shard.backward(pooled, tuple(torch.ones_like(p) for p in pooled))
    assert not torch.equal(before, module.split_embedding_weights()[0])


def test_column_slices_of_a_table_see_the_same_lookups(small_tables):
    table = small_tables[0]
    a = FusedShard([TablePiece(table=table, columns=(0, 16))], SMALL, torch.device("cpu"))
    b = FusedShard([TablePiece(table=table, columns=(16, 32))], SMALL, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a.batches[0][0], b.batches[0][0]))


def test_every_timed_step_runs_on_a_batch_the_kernel_has_not_run(small_tables):
    """As in training, no timed step finds its rows in cache from an earlier step on the same batch: the timed
    steps take one batch each, the warm-up its own."""
    config = MeasureConfig(batch_size=64, warmup=4, repeats=6)
    assert config.num_batches == 6 + WARMUP_BATCHES
    shard = FusedShard([TablePiece.whole(t) for t in small_tables], config, torch.device("cpu"))
    ran, forward = [], shard.forward
    shard.forward = lambda batch: ran.append(batch) or forward(batch)
    time_fused_shard(shard)
    warmup, timed = ran[: -config.repeats], ran[-config.repeats :]
    assert timed == list(range(config.repeats)) and len(warmup) >= 4 and not set(warmup) & set(timed)
    firsts = [shard.batches[b][0][0] for b in range(config.num_batches)]
    assert len({tuple(indices.tolist()) for indices in firsts}) == config.num_batches  # distinct lookups


def test_rows_are_capped_where_asked():
    big = TableSpec(name="big", rows=10**9, dim=8, pooling_factor=2.0)
    shard = FusedShard([TablePiece.whole(big)], MeasureConfig(batch_size=16, max_rows=1000), torch.device("cpu"))
    assert shard.groups[0][1].split_embedding_weights()[0].shape == (1000, 8)
    assert int(shard.batches[0][0][0].max()) < 1000


def test_a_shard_is_measured_on_whole_tables_where_memory_holds_them():
    """A 600,000-row table (past the 200,000 rows CPU profiling once allocated) is allocated whole, and its
    lookups reach its last rows; the measurement says so (rows_cap None) and is of today's procedure."""
    table = TableSpec(name="t", rows=600_000, dim=8, pooling_factor=20.0, zipf_exponent=0.0)
    config = MeasureConfig(batch_size=256, warmup=1, repeats=2)
    shard = FusedShard([TablePiece.whole(table)], config, torch.device("cpu"))
    assert shard.cap is None and shard.groups[0][1].split_embedding_weights()[0].shape == (600_000, 8)
    assert int(max(indices.max() for ((indices, _),) in shard.batches)) > 200_000
    measured = measure_fused_shard([TablePiece.whole(table)], config, "cpu:test")
    assert measured.status == "ok" and measured.rows_cap is None and measured.procedure == MEASUREMENT_PROCEDURE


def test_where_memory_cannot_hold_the_shard_only_its_largest_tables_are_capped():
    tables = [
        TableSpec(name="huge", rows=400_000_000, dim=128, pooling_factor=1.0),
        TableSpec(name="large", rows=2_000_000, dim=64, pooling_factor=1.0),
        TableSpec(name="small", rows=5_000, dim=16, pooling_factor=1.0),
    ]
    pieces = [TablePiece.whole(t) for t in tables]
    config = MeasureConfig()
    # Every row costs its weights and row-wise Adagrad's 4 bytes of state.
    whole = 400_000_000 * 516 + 2_000_000 * 260 + 5_000 * 68
    assert shard_rows_cap(pieces, config, whole) is None
    budget = 2 * 2**30
    cap = shard_rows_cap(pieces, config, budget)
    used = sum(min(t.rows, cap) * (t.dim * 4 + 4) for t in tables)
    # the huge table alone is capped, at the largest cap that fits
    assert 2_000_000 < cap < 400_000_000 and used <= budget < used + 516
    assert shard_rows_cap(pieces, config.model_copy(update={"max_rows": 10}), whole) == 10  # asked for: kept
    assert memory_budget(torch.device("cpu"), 4) * 4 == pytest.approx(memory_budget(torch.device("cpu"), 1), rel=1e-6)


def test_measurements_of_the_old_procedure_keep_their_cap_and_are_left_out_of_training(small_tables):
    """Records from before procedures were kept were taken with 200,000 rows at most on CPU; training uses the
    newest procedure's measurements and says how many it left out."""
    parts = [TablePiece.whole(small_tables[0])]
    new = measure_fused_shard(parts, SMALL, "cpu:test")
    old = read_record(FusedShardMeasurement, new.model_dump_json(exclude={"procedure", "rows_cap"}))
    assert old.procedure == 1 and old.rows_cap == PROCEDURE_1_CPU_MAX_ROWS == old.modelled_rows_cap
    assert new.modelled_rows_cap is None
    with pytest.warns(OlderMeasurementsWarning, match="1 shard measurements on cpu:test .* older procedure"):
        assert newest_procedure([old, new]) == [new]


def test_measure_reports_medians_and_infeasible_shards(small_tables):
    parts = [TablePiece.whole(t) for t in small_tables[:3]]
    ok = measure_fused_shard(parts, SMALL, "cpu:test")
    assert ok.status == "ok" and ok.fwd_ms > 0 and ok.bwd_ms > 0
    adam = measure_fused_shard(parts, SMALL.model_copy(update={"optimizer": "adam"}), "cpu:test")
    assert adam.status == "infeasible" and "Adam" in adam.reason and adam.fwd_ms is None


def test_shard_key_is_content_and_order_free(small_tables):
    a, b = small_tables[0], small_tables[1]
    renamed = a.model_copy(update={"name": "other"})
    key = fused_shard_key([TablePiece.whole(a), TablePiece.whole(b)], SMALL, "hw")
    assert key == fused_shard_key([TablePiece.whole(b), TablePiece.whole(renamed)], SMALL, "hw")
    assert key != fused_shard_key([TablePiece.whole(a), TablePiece.whole(b)], SMALL, "other-hw")
    assert key != fused_shard_key(
        [TablePiece.whole(a), TablePiece.whole(b)], SMALL.model_copy(update={"batch_size": 32}), "hw"
    )
    assert key != fused_shard_key([TablePiece(table=a, columns=(0, 16)), TablePiece.whole(b)], SMALL, "hw")


def test_store_keeps_each_key_once_and_persists(tmp_path, small_tables):
    m = measure_fused_shard([TablePiece.whole(small_tables[0])], SMALL, "cpu:test")
    path = tmp_path / "store.db"
    with MeasurementStore(path) as store:
        assert store.put_fused_shard(m) is True
        assert store.put_fused_shard(m) is False
        assert store.known_keys([m.key, "nope"]) == {m.key}
    with MeasurementStore(path) as store:
        assert store.count() == 1
        assert store.get_fused_shard(m.key) == m
        assert store.summary() == {"cpu:test": {"ok": 1}}


def test_store_refuses_a_file_that_is_not_sqlite(tmp_path):
    from shard_ray.errors import ShardRayError

    path = tmp_path / "junk.db"
    path.write_text("this is not a database" * 100)
    with pytest.raises(ShardRayError, match="not a usable SQLite"):
        MeasurementStore(path)


def test_store_leaves_another_programs_database_untouched(tmp_path):
    """Found by a new user's walk: a failed `tune costmodel --store other.db` left the store's tables in that
    database (an MLflow one, given by mistake, would get them too)."""
    import sqlite3

    from shard_ray.errors import ShardRayError

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE experiments (id INTEGER)")
    with pytest.raises(
        ShardRayError, match=r"other.db is not a measurement store: an SQLite database of other tables "
    ):
        MeasurementStore(path)
    with sqlite3.connect(path) as db:
        assert [row[0] for row in db.execute("SELECT name FROM sqlite_master")] == ["experiments"]
    with MeasurementStore(tmp_path / "empty.db") as store:  # a new file, or an empty database, becomes a store
        assert store.count() == 0


def test_draw_shards(small_tables):
    shards = draw_fused_shards(small_tables, count=10, max_tables=3, seed=0)
    assert len(shards) == len(small_tables) + 10
    assert all(len(s) == 1 for s in shards[: len(small_tables)])
    assert all(2 <= len(s) <= 3 for s in shards[len(small_tables) :])
    assert all(len({p.table.name for p in s}) == len(s) for s in shards)
    assert np.array_equal([len(s) for s in draw_fused_shards(small_tables, 10, 3, seed=0)], [len(s) for s in shards])


def test_row_slices_and_replicas_look_up_their_share(small_tables):
    table = small_tables[0]
    config = MeasureConfig(batch_size=64, max_rows=10**6)
    whole = FusedShard([TablePiece.whole(table)], config, torch.device("cpu"))
    low, high = (
        FusedShard([TablePiece(table=table, columns=(0, 32), rows=r)], config, torch.device("cpu"))
        for r in ((0, 1000), (1000, 5000))
    )
    # Row-wise: the two ranges bucketize the table's lookups between them, per sample.
    lookups = [s.batches[0][0] for s in (whole, low, high)]
    assert len(lookups[1][0]) + len(lookups[2][0]) == len(lookups[0][0])
    assert int(lookups[1][0].max()) < 1000 and int(lookups[2][0].max()) < 4000
    # A replica of two looks up its device's half of the samples, in fbgemm's dense kernel.
    replica = FusedShard([TablePiece(table=table, columns=(0, 32), replicas=2)], config, torch.device("cpu"), rank=1)
    sharded, replicated = replica.forward(0)
    assert sharded.shape == (64, 0) and replicated.shape == (32, 32) and replica.samples == (32, 64)
    before = replica.piece_weights()[0].clone()
    replica.backward((sharded, replicated), (torch.zeros(64, 0), torch.ones(32, 32)))
    replica.update_replicas()
    assert not torch.equal(before, replica.piece_weights()[0])


def test_dense_kernel_gradient_matches_torch_embedding_bag():
    # fbgemm's dense kernel registers no autograd kernel on CPU (torch warns); its gradient must still be right.
    from shard_ray.workload.tables import TableSpec

    table = TableSpec(name="t", rows=50, dim=8, pooling_factor=3.0)
    replica = FusedShard(
        [TablePiece(table=table, columns=(0, 8), replicas=2)], MeasureConfig(batch_size=16), torch.device("cpu")
    )
    indices, offsets = replica.batches[0][0]
    weights = replica.piece_weights()[0].detach().clone().requires_grad_()
    grad = torch.randn(8, 8)
    _, pooled = replica.forward(0)
    replica.backward((torch.zeros(16, 0), pooled), (torch.zeros(16, 0), grad))
    expected = torch.nn.functional.embedding_bag(indices, weights, offsets[:-1], mode="sum")
    expected.backward(grad)
    assert torch.allclose(pooled, expected, atol=1e-6)
    assert torch.allclose(replica.replica_gradients()[0].view(50, 8), weights.grad, atol=1e-6)


def test_replicas_of_one_width_are_updated_together_as_each_table_row_by_row():
    """The replicas' row-wise Adagrad step runs on blocks of side-by-side tables of one width (16, 16, then 32,
    then 16 again: three blocks); every row moves as the step of its own table alone would move it, twice over
    (the state carries over)."""
    from shard_ray.profiling.fused_shard import ADAGRAD_EPS, LEARNING_RATE

    widths = (16, 16, 32, 16)
    pieces = [
        TablePiece(
            table=TableSpec(name=f"t{k}", rows=40 + 10 * k, dim=w, pooling_factor=2.0), columns=(0, w), replicas=2
        )
        for k, w in enumerate(widths)
    ]
    shard = FusedShard(pieces, MeasureConfig(batch_size=32), torch.device("cpu"))
    assert [block[2] for block in shard._replica_blocks[0]] == [16, 32, 16]
    states = [torch.zeros(p.table.rows) for p in pieces]
    for step in range(2):
        before = [w.detach().clone() for w in shard.piece_weights()]
        _, pooled = shard.forward(step)
        shard.backward((torch.zeros(32, 0), pooled), (torch.zeros(32, 0), torch.randn(16, sum(widths))))
        flat = shard.replica_gradients()[0].clone()
        shard.update_replicas()
        offset = 0
        for k, piece in enumerate(pieces):
            g = flat[offset : offset + piece.table.rows * piece.width].view(piece.table.rows, piece.width)
            states[k] += g.pow(2).mean(dim=1)
            expected = before[k] - g * (LEARNING_RATE / (states[k].sqrt() + ADAGRAD_EPS))[:, None]
            assert torch.allclose(shard.piece_weights()[k], expected, atol=1e-6), (step, k)
            offset += piece.table.rows * piece.width


@pytest.mark.slow  # a training step of gloo ranks: 13-16 s of `make test-fast`'s 93
def test_gpu_truth_times_each_device_alone_and_inside_a_training_step(tmp_path):
    """`experiments/gpu_truth.py --plans ... --training-step`, as docs/gpu.md runs it on a GPU, here on fbgemm's CPU
    kernels: every device of the plan is timed by the procedure, back to back, inside the DLRM step and as the
    step's dense part alone, and `--report` reads the log."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from shard_ray.placement import place
    from shard_ray.plan.plan import save_plan
    from shard_ray.plan.topology import Topology
    from shard_ray.workload.tables import load_tables

    repo = Path(__file__).resolve().parents[1]
    tables = load_tables(repo / "experiments/tables/many_tiny.json")
    # a small batch: the CPU's dense step (MLPerf's MLPs, 100 steps a device) is what the test waits for
    plan = place("size_greedy", tables, Topology(num_devices=2, memory_bytes=2**30, batch_size=32))
    save_plan(tmp_path / "many_tiny.size_greedy.json", plan)
    script = [sys.executable, "experiments/gpu_truth.py"]
    # one torch thread, as every test's own process has (conftest.py): beside the other workers, the CPU kernels' two
    # threads waited on each other (21 CPU-s where one thread takes 12); on a GPU the threads play no part
    measured = subprocess.run(
        [*script, "--out", str(tmp_path / "out"), "--plans", str(tmp_path / "many_tiny.size_greedy.json"),
         "--rounds", "1", "--training-step"],
        cwd=repo, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert measured.returncode == 0, measured.stderr
    records = [json.loads(line) for line in (tmp_path / "out/gpu_log.jsonl").read_text().splitlines()]
    assert sorted(r["label"] for r in records) == ["plan:many_tiny.size_greedy:0", "plan:many_tiny.size_greedy:1"]
    for r in records:
        assert "reason" not in r, r
        assert min(r["fwd_ms"], r["bwd_ms"], r["back_to_back_ms"], r["dense_step_ms"]) > 0
        # the step and its dense part are timed one after the other: beside the parallel pass's load their order
        # once inverted (25.6 against 65.4 ms), so only that both ran is judged here, their figures on the GPU
        assert r["step_ms"] > 0 and r["dense"] == "fp32"
    report = subprocess.run(
        [*script, "--report", str(tmp_path / "out/gpu_log.jsonl"), "--plans", str(tmp_path / "many_tiny.size_greedy.json")],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0 and "many_tiny.size_greedy: 1 rounds, fp32 dense part" in report.stdout, report


def test_warm_up_ends_when_the_steps_stop_getting_faster_not_when_a_step_is_slow():
    assert not warmed_up([10.0, 9.0, 8.0], 1)  # fewer than four steps
    assert not warmed_up([10.0, 9.0, 8.0, 7.0, 6.0], 1)  # still getting faster: 6.5 is 13% below 8.5
    assert warmed_up([10.0, 9.0, 5.0, 5.1, 5.0, 5.05], 1)  # settled
    assert warmed_up([10.0, 5.0, 5.0, 5.0, 9.0], 1)  # a noisy slow step is not warm-up
    assert not warmed_up([5.0, 5.0, 5.0, 5.0], 6)  # at least --warmup steps
    assert warmed_up([float(MAX_WARMUP_STEPS - i) for i in range(MAX_WARMUP_STEPS)], 1)  # at most 25
    assert warmed_up([], 0)


def test_host_buffers_hold_at_most_a_shards_budget_and_reuse_what_fits():
    """A gang member's buffers, kept per precision from plan to plan, stay within a shard's budget: an fp16 shard
    of the whole budget after an fp32 one drops the fp32 buffer (members once held twice their budget and Ray
    killed one), an oversized buffer of the shard's own is allocated again at its size where the rest would not
    fit, and a buffer that fits is reused, its storage the same."""
    mb = 2**20
    buffers = HostBuffers()
    first = buffers.take_shard({"fp32 weights": (mb, torch.float32, False)}, budget=5 * mb)["fp32 weights"]
    pointer = first.data_ptr()
    del first
    again = buffers.take_shard({"fp32 weights": (mb // 2, torch.float32, False)}, budget=5 * mb)
    assert again["fp32 weights"].data_ptr() == pointer and buffers.held_bytes() == 4 * mb
    del again
    fp16 = buffers.take_shard({"fp16 weights": (2 * mb, torch.float16, False)}, budget=5 * mb)
    assert buffers.held_bytes() == 4 * mb  # the fp32 buffer dropped: 4 + 4 MB would not fit in 5
    del fp16
    state = torch.float32, True
    both = buffers.take_shard(
        {"fp32 weights": (mb // 4, torch.float32, False), "fp32 state": (mb // 4, *state)}, 3 * mb
    )
    assert buffers.held_bytes() == 2 * mb and not both["fp32 state"].any()  # the zeroed state; the fp16 buffer gone
    # within the budget beside the rest: nothing dropped, the fp16 shard's buffer grows
    wide = buffers.take_shard({"fp16 weights": (mb, torch.float16, False)}, budget=5 * mb)
    assert buffers.held_bytes() == 4 * mb and wide["fp16 weights"].numel() == mb
    del both, wide
    # its own fp32 buffer (1 MB) larger than it needs, beside 4 MB of fp16: allocated again at its 0.5 MB
    mixed = {"fp32 weights": (mb // 8, torch.float32, False), "fp32 state": (mb // 8, *state)}
    buffers.take_shard(mixed | {"fp16 weights": (2 * mb, torch.float16, False)}, budget=5 * mb)
    assert buffers.held_bytes() == 5 * mb


def test_a_measuring_process_keeps_its_tables_from_shard_to_shard():
    """A profiling actor measures every shard in the buffers it keeps (`measure_fused_shard` with its
    `HostBuffers`): a fresh allocation of gigabytes for each shard timed its lookups 3-20 times slower in 13 of 46
    builds on a virtual machine (docs/measurement.md, "Tables kept from shard to shard")."""
    buffers = HostBuffers()
    wide = [TablePiece.whole(TableSpec(name=f"t{i}", rows=20_000, dim=32, pooling_factor=2)) for i in range(2)]
    first = measure_fused_shard(wide, SMALL, "", budget=2**30, host_buffers=buffers)
    held = buffers.held_bytes()
    # weights and the row-wise optimizer's state, one value a row
    assert first.status == "ok" and held == 2 * 20_000 * (32 + 1) * 4
    narrow = measure_fused_shard(wide[:1], SMALL.model_copy(update={"seed": 1}), "", budget=2**30, host_buffers=buffers)
    assert narrow.status == "ok" and buffers.held_bytes() == held  # the first shard's buffers, reused


def test_a_measuring_process_draws_each_batch_once_and_keeps_them_within_their_bound(small_tables, monkeypatch):
    """A plan's step draws every table's batches for the lookups it sends and its own tables' again, every plan of a
    round on the same seed: a process draws each (table, seed, batch) once and builds the next shard of the same
    tables, or of their column slices, from the batches it kept, the same lookups; another seed draws anew. The kept
    batches stay within their bytes, the least recently asked for dropped first."""
    import shard_ray.profiling.fused_shard as fused

    drawn = []
    draw = fused.generate_table_batch
    monkeypatch.setattr(fused, "generate_table_batch", lambda *args: drawn.append(args[0].name) or draw(*args))
    monkeypatch.setattr(fused, "KEPT_BATCHES", KeptBatches(most_bytes=2**30))
    config = SMALL.model_copy(update={"seed": 12345})  # batches no other test of this process kept
    pieces = [TablePiece.whole(t) for t in small_tables]
    first = FusedShard(pieces, config, torch.device("cpu"))
    assert sorted(drawn) == sorted(t.name for t in small_tables for _ in range(config.num_batches))
    slices = [TablePiece(table=t, columns=(0, t.dim // 2)) for t in small_tables]
    again = FusedShard(slices, config, torch.device("cpu"))
    assert len(drawn) == len(small_tables) * config.num_batches  # nothing drawn again
    assert all(
        torch.equal(x, y) for b in range(config.num_batches) for x, y in zip(first.batches[b][0], again.batches[b][0])
    )
    FusedShard(pieces, config.model_copy(update={"seed": 12346}), torch.device("cpu"))
    assert len(drawn) == 2 * len(small_tables) * config.num_batches

    def batch_of(size: int) -> TableBatch:
        return TableBatch(indices=np.zeros(size, np.int64), lengths=np.zeros(0, np.int64))

    kept = KeptBatches(most_bytes=3 * 800)
    for key in "abc":
        kept.batch((key, 1), lambda: batch_of(100))  # 800 bytes each: all three kept
    kept.batch(("a", 1), lambda: pytest.fail("a kept batch drawn again"))  # a asked for again: b is the oldest now
    kept.batch(("d", 1), lambda: batch_of(100))
    assert kept.held_bytes() == 3 * 800
    kept.batch(("a", 1), lambda: pytest.fail("a dropped before b"))
    redrawn = []
    kept.batch(("b", 1), lambda: redrawn.append("b") or batch_of(100))
    assert redrawn == ["b"] and kept.held_bytes() == 3 * 800
    kept.batch(("huge", 1), lambda: batch_of(1000))  # more than the bound alone: given, not kept
    assert kept.held_bytes() == 3 * 800
