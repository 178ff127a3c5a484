import gzip
import json
import math

import numpy as np
import pytest
import torch

from shard_ray.errors import ShardRayError
from shard_ray.workload.access import generate_table_batch, zipf_indices
from shard_ray.workload.dlrm_dataset import load_trace, reuse_histogram, tables_from_dataset, trace_batch
from shard_ray.workload.synthetic import PUBLIC_REUSE_HISTOGRAM, PoolConfig, generate_pool
from shard_ray.workload.tables import DEFAULT_ZIPF_EXPONENT, TableSpec, load_tables, save_tables
from shard_ray.workload.tasks import TaskConfig, split_pool, write_tasks


def write(tmp_path, text, name="t.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_table_file_defaults_json_and_yaml(tmp_path):
    doc = {"tables": [{"name": "t0", "rows": 1000, "dim": 64, "pooling_factor": 4.0}]}
    for path in (
        write(tmp_path, json.dumps(doc)),
        write(tmp_path, "tables:\n - {name: t0, rows: 1000, dim: 64, pooling_factor: 4.0}\n", "t.yaml"),
    ):
        (table,) = load_tables(path)
        assert table.precision == "fp32" and table.trace is None
        assert table.effective_zipf_exponent == DEFAULT_ZIPF_EXPONENT


def test_table_file_round_trip(tmp_path, small_tables):
    path = tmp_path / "out.json"
    save_tables(path, small_tables, task="x")
    assert load_tables(path) == small_tables
    assert json.loads(path.read_text())["task"] == "x"


@pytest.mark.parametrize(
    "table, message",
    [
        ({"name": "t", "rows": 10, "dim": 30, "pooling_factor": 1}, "multiple of 4"),
        ({"name": "t", "rows": 0, "dim": 32, "pooling_factor": 1}, "rows"),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": -1}, "pooling_factor"),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": "NaN"}, "pooling_factor"),
        ({"name": "t", "rows": "many", "dim": 32, "pooling_factor": 1}, "rows"),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": 1, "colour": 3}, "colour"),
        (
            {
                "name": "t",
                "rows": 10,
                "dim": 32,
                "pooling_factor": 1,
                "zipf_exponent": 1.0,
                "reuse_histogram": [1.0] + [0] * 16,
            },
            "not both",
        ),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": 1, "reuse_histogram": [1.0]}, "17 bins"),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": 1, "precision": "int3"}, "precision"),
    ],
)
def test_bad_tables_are_refused_with_the_field_named(tmp_path, table, message):
    path = write(tmp_path, json.dumps({"tables": [table]}))
    with pytest.raises(ShardRayError, match=message):
        load_tables(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"tables": []}', "tables"),
        (
            '{"tables": [{"name": "a", "rows": 1, "dim": 4, "pooling_factor": 1}, {"name": "a", "rows": 1, "dim": 4, "pooling_factor": 1}]}',
            "duplicate",
        ),
        ('{"tables": [', "not valid"),
        ("[1, 2]", "tables"),
    ],
)
def test_bad_table_files(tmp_path, text, message):
    with pytest.raises(ShardRayError, match=message):
        load_tables(write(tmp_path, text))


def test_missing_table_file(tmp_path):
    with pytest.raises(ShardRayError, match="not found"):
        load_tables(tmp_path / "nope.json")


def test_zipf_indices_in_range_and_skewed():
    rng = np.random.default_rng(0)
    idx = zipf_indices(1000, 1.2, 50_000, rng)
    assert idx.min() >= 0 and idx.max() < 1000
    counts = np.sort(np.bincount(idx, minlength=1000))[::-1]
    assert counts[0] > 20 * np.median(counts)
    flat = np.sort(np.bincount(zipf_indices(1000, 0.0, 50_000, rng), minlength=1000))[::-1]
    assert flat[0] < 3 * np.median(flat)


def test_batches_follow_pooling_factor_and_are_seeded():
    table = TableSpec(name="t", rows=10_000, dim=16, pooling_factor=6.0)
    a = generate_table_batch(table, 4096, np.random.default_rng(1))
    b = generate_table_batch(table, 4096, np.random.default_rng(1))
    assert np.array_equal(a.indices, b.indices)
    assert a.indices.shape[0] == a.lengths.sum()
    assert abs(a.lengths.mean() - 6.0) < 0.3


def test_reuse_histogram_batches_reproduce_the_histogram():
    hist = tuple(PUBLIC_REUSE_HISTOGRAM)
    table = TableSpec(name="t", rows=10_000_000, dim=16, pooling_factor=20.0, reuse_histogram=hist)
    batch = generate_table_batch(table, 65536, np.random.default_rng(0))
    measured = reuse_histogram(batch.indices)
    # the drawn batch's access-count profile is close to the target, bin by bin
    assert sum(abs(m - h) for m, h in zip(measured, hist)) < 0.35
    assert measured[0] > 0.2 and sum(measured[8:]) < 0.05


def test_histogram_tables_keep_their_hot_rows_from_batch_to_batch():
    """A histogram table's batches sample one traffic: most of a batch's lookups fall on rows the batch before looked
    up too, as a table's hot rows stay hot from one batch to the next (measurement procedure 3; before, every batch
    drew its rows afresh from the table's 10 million, and two batches shared almost none)."""
    table = TableSpec(
        name="t", rows=10_000_000, dim=16, pooling_factor=20.0, reuse_histogram=tuple(PUBLIC_REUSE_HISTOGRAM)
    )
    first, second = (generate_table_batch(table, 1024, np.random.default_rng(seed)).indices for seed in (1, 2))
    assert np.isin(second, first).mean() > 0.3


def test_synthetic_pool_statistics():
    pool = generate_pool()
    assert len(pool) == 856
    assert pool == generate_pool(PoolConfig(seed=0)) and pool != generate_pool(PoolConfig(seed=1))
    pf = np.mean([t.pooling_factor for t in pool])
    assert 10 < pf < 25  # public figure: ~15.8 lookups per table per sample
    assert min(t.rows for t in pool) >= 100
    assert all(t.dim % 4 == 0 and t.reuse_histogram is not None for t in pool)
    mean_hist = np.mean([t.reuse_histogram for t in pool], axis=0)
    assert abs(mean_hist[0] - PUBLIC_REUSE_HISTOGRAM[0]) < 0.05


def _write_dataset(path, lengths, rng, gz=False):
    tables, batch = lengths.shape
    per_bag = [rng.integers(0, 50 * (t + 1), size=int(n)) for t in range(tables) for n in lengths[t]]
    indices = torch.from_numpy(np.concatenate(per_bag).astype(np.int64))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).astype(np.int64))
    content = (indices, offsets, torch.from_numpy(lengths))
    if gz:
        with gzip.open(path, "wb") as handle:
            torch.save(content, handle)
    else:
        torch.save(content, path)
    return indices.numpy(), offsets.numpy()


@pytest.mark.parametrize("gz", [False, True])
def test_dlrm_dataset_loader(tmp_path, gz):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, size=(3, 64)).astype(np.int64)
    path = tmp_path / ("data.pt.gz" if gz else "data.pt")
    indices, offsets = _write_dataset(path, lengths, rng, gz)
    specs = tables_from_dataset(path, dim=32)
    assert [s.name for s in specs] == ["t0", "t1", "t2"]
    for t, spec in enumerate(specs):
        table_idx = indices[offsets[t * 64] : offsets[(t + 1) * 64]]
        assert spec.rows == max(100, int(table_idx.max()) + 1)
        assert math.isclose(spec.pooling_factor, lengths[t].mean())
        assert math.isclose(sum(spec.reuse_histogram), 1.0)
        served = trace_batch(spec.trace, 64)
        assert np.array_equal(served.indices, table_idx) and np.array_equal(served.lengths, lengths[t])
        batch = generate_table_batch(spec, 16, np.random.default_rng(0))
        assert np.array_equal(batch.lengths, lengths[t][:16])
        assert np.array_equal(batch.indices, table_idx[: lengths[t][:16].sum()])
    load_trace.cache_clear()


def test_dlrm_dataset_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save((torch.zeros(3), torch.zeros(2)), bad)
    with pytest.raises(ShardRayError, match="expected"):
        tables_from_dataset(bad)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ShardRayError, match="cannot read"):
        tables_from_dataset(junk)


def test_tasks_are_drawn_from_disjoint_pools(tmp_path):
    pool = generate_pool(PoolConfig(num_tables=100))
    train, test = split_pool(pool, 0.5, seed=3)
    assert not {t.name for t in train} & {t.name for t in test}
    assert len(train) + len(test) == 100
    config = TaskConfig(num_tasks=3, min_tables=5, max_tables=9, dims=(8, 24), seed=3)
    paths = write_tasks(pool, config, tmp_path)
    assert len(paths) == 8
    assert load_tables(tmp_path / "test_pool.json") == test and load_tables(tmp_path / "train_pool.json") == train
    test_names = {t.name for t in test}
    for path in paths[2:]:
        tables = load_tables(path)
        assert 5 <= len(tables) <= 9 and {t.dim for t in tables} <= {8, 24}
        assert ({t.name for t in tables} <= test_names) == path.name.startswith("test")


def test_the_names_torchrec_refuses_are_torchs_own_and_a_table_file_reads_without_torch(tmp_path):
    """The ModuleDict attributes written out in tables.py are those of the torch installed (a torch upgrade that
    adds one fails here), and reading a table file does not import torch: it is what made `tasks` and every
    refusal after reading the tables pay 2 s."""
    import subprocess
    import sys

    import torch

    from shard_ray.workload.tables import MODULE_DICT_ATTRIBUTES

    assert frozenset(dir(torch.nn.ModuleDict)) == MODULE_DICT_ATTRIBUTES
    (tmp_path / "t.json").write_text(
        '{"tables": [{"name": "a", "rows": 100, "dim": 8, "pooling_factor": 1}, {"name": "keys", "rows": 1, "dim": 4, "pooling_factor": 1}]}'
    )
    code = (
        "import sys\n"
        "from shard_ray.workload.tables import load_tables\n"
        "try:\n    load_tables('t.json')\nexcept Exception as err:\n    print(err)\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[-1] == "False" and "'keys' is an attribute of torch.nn.ModuleDict" in done.stdout


def test_a_zipf_histogram_skips_only_the_cdf_values_that_are_one_to_the_last_bit():
    """`zipf_reuse_histogram` sets P(count <= k) to 1 without computing it where the mean is below `_CERTAIN_BELOW`:
    there `pdtr` returns exactly 1.0, so the histograms are those of computing every value."""
    from scipy.special import pdtr

    from shard_ray.workload.access import _BIN_TOPS, _CERTAIN_BELOW

    for top, certain in zip(_BIN_TOPS, _CERTAIN_BELOW):
        means = np.geomspace(1e-14, certain, 5000)
        assert (pdtr(top, means) == 1.0).all(), top
