import gzip
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

from shard_ray.errors import ShardRayError, ShardRayWarning
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
        # read as 1 row and as 1000 before (from a new user's walk): a number must be written as one
        ({"name": "t", "rows": True, "dim": 32, "pooling_factor": 1}, "rows: must be a number, got true"),
        ({"name": "t", "rows": "1000", "dim": 32, "pooling_factor": 1}, 'rows: must be a number, got the text "1000"'),
        ({"name": "t", "rows": 10, "dim": 32, "pooling_factor": "2"}, "pooling_factor: must be a number, got the text"),
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
    "line, message",
    [
        ("{name: a, rows: 2e6, dim: 32, pooling_factor: 1}", 'rows: must be a number, got the text "2e6": YAML reads'),
        # the ways to write it are of its own value (they were of 2e6's whatever was written)
        (
            "{name: a, rows: 1e3, dim: 32, pooling_factor: 1}",
            'got the text "1e3": YAML reads such a number as text: write it 1000 or 1.0e+3',
        ),
        ("{name: on, rows: 20, dim: 32, pooling_factor: 1}", "name: must be text, got true (YAML reads on, off,"),
        ("{name: 123, rows: 20, dim: 32, pooling_factor: 1}", "name: must be text, got 123: quote it"),
    ],
)
def test_what_yaml_reads_otherwise_than_written_is_said_so(tmp_path, line, message):
    """YAML 1.1 reads 2e6 as text, an unquoted `on` as true and 123 as a number: the refusal says how to write
    them, where it said that a number must be a number (a walk)."""
    with pytest.raises(ShardRayError) as refused:
        load_tables(write(tmp_path, f"tables:\n  - {line}\n", "t.yaml"))
    assert message in str(refused.value)
    written = line.replace("2e6", "2.0e+6").replace("1e3", "1.0e+3").replace("on,", '"on",').replace("123", '"123"')
    assert load_tables(write(tmp_path, f"tables:\n  - {written}\n", "t.yaml"))[0].rows in (20, 1000, 2_000_000)


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
    # a table file given by mistake, and a pickle of other objects: torch's first line advised loading them with
    # weights_only=False, which would run what they hold (from a new user's walk)
    mistaken, objects = tmp_path / "tables.json", tmp_path / "objects.pt"
    mistaken.write_text('{"tables": []}')
    torch.save({"kind": type}, objects)
    for path in (mistaken, objects):
        with pytest.raises(ShardRayError, match=r"cannot read dataset file .*: not a file of tensors \(Unsupported "):
            tables_from_dataset(path)


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


def test_more_tables_a_task_than_a_split_holds_is_said(tmp_path):
    """Found by a new user's walkthrough: `tasks --max-tables 900` on a pool splitting into 428 and 428 drew tasks of
    at most a split's tables without a word."""
    pool = generate_pool(PoolConfig(num_tables=40))
    with pytest.warns(ShardRayWarning, match="--max-tables 30 is more than a split holds: .* 20 for training and 20"):
        write_tasks(pool, TaskConfig(num_tasks=4, min_tables=15, max_tables=30), tmp_path / "over")
    assert max(len(load_tables(p)) for p in (tmp_path / "over").glob("t*_00*.json")) <= 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_tasks(pool, TaskConfig(num_tasks=1, min_tables=15, max_tables=20), tmp_path / "within")


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


def test_zipf_histograms_a_command_derived_are_read_back_by_the_next_bit_for_bit(tmp_path):
    """`shard-ray plan` on a table file in the README's minimal format keeps the Zipf histograms it derived in
    shard-ray's home (`KeptHistograms`) at its exit; the next process reads each back, without deriving it, exactly
    as deriving it gives it."""
    import subprocess
    import sys
    from pathlib import Path

    from shard_ray.workload.access import derive_zipf_histogram

    tables = write(tmp_path, json.dumps({"tables": [
        {"name": "users", "rows": 2_000_000, "dim": 64, "pooling_factor": 1.0},
        {"name": "item_id", "rows": 300_000, "dim": 32, "pooling_factor": 20.0},
        {"name": "ads", "rows": 5000, "dim": 16, "pooling_factor": 3.0, "zipf_exponent": 1.2},
    ]}))  # fmt: skip
    env = {**os.environ, "SHARD_RAY_HOME": str(tmp_path / "home")}
    shard_ray = str(Path(sys.executable).parent / "shard-ray")  # the console script `make setup` installs
    plan = [shard_ray, "plan", "--tables", str(tables), "--devices", "2", "--memory-gb", "1", "--algo", "cost_search"]
    done = subprocess.run([*plan, "--out", "plan.json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (kept,) = (tmp_path / "home" / "cache").iterdir()
    assert kept.name.startswith("zipf-histograms-") and kept.suffix == ".npz"
    # the tables, and their data-parallel replicas on 2 devices, as `plan` priced them
    keys = [
        (t.rows, t.effective_zipf_exponent, t.pooling_factor * share) for t in load_tables(tables) for share in (1, 0.5)
    ]
    read_back = (
        "import json, sys\n"
        "import shard_ray.workload.access as access\n"
        "def derive(*key):\n    raise AssertionError(f'derived {key} again')\n"
        "access.derive_zipf_histogram = derive\n"
        "print(json.dumps([access.zipf_reuse_histogram(*key) for key in json.loads(sys.argv[1])]))\n"
    )
    done = subprocess.run([sys.executable, "-c", read_back, json.dumps(keys)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [tuple(h) for h in json.loads(done.stdout)] == [derive_zipf_histogram(*key) for key in keys]
    # the same plan again: nothing new to keep, the file as it was
    before = kept.stat().st_mtime_ns
    done = subprocess.run([*plan, "--out", "again.json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert kept.stat().st_mtime_ns == before
    assert (
        json.loads((tmp_path / "again.json").read_text())["shards"]
        == json.loads((tmp_path / "plan.json").read_text())["shards"]
    )


def test_a_damaged_or_unwritable_file_of_kept_histograms_is_derived_around(tmp_path, monkeypatch):
    """A file of kept histograms that is not one reads as empty and is replaced by a good one; a home that cannot be
    written keeps nothing and fails nothing."""
    from shard_ray.workload.access import KeptHistograms, derive_zipf_histogram

    key = (123_456, 1.05, 7.0)
    histogram = derive_zipf_histogram(*key)
    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    path = KeptHistograms.path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a numpy archive")
    damaged = KeptHistograms()
    assert damaged.get(key) is None
    damaged.add(key, histogram)
    damaged.save()
    assert KeptHistograms().get(key) == histogram
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "a_file" / "home"))
    unwritable = KeptHistograms()
    assert unwritable.get(key) is None
    unwritable.add(key, histogram)
    unwritable.save()
    assert KeptHistograms().get(key) is None
