"""Bad input, generated: every command answers one line and exit status 2, never a traceback, and leaves no partial file."""

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_ray.cli import main
from shard_ray.costmodel.models import FORMAT as COSTMODELS_FORMAT
from shard_ray.plan.plan import load_plan
from shard_ray.policy.policy_file import FORMAT as POLICY_FORMAT
from shard_ray.workload.tables import load_tables

FIELDS = {
    "name": st.one_of(st.text(max_size=6), st.integers(), st.none()),
    "rows": st.one_of(
        st.integers(min_value=-10, max_value=2**50), st.sampled_from([0, 1, 2**43, 2**43 + 1]), st.text(max_size=3)
    ),
    "dim": st.one_of(st.integers(min_value=-8, max_value=5000), st.sampled_from([4, 30, 4096, 4100])),
    "pooling_factor": st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e-9, 1e4, 1e5, math.nan, math.inf])
    ),
    "zipf_exponent": st.one_of(st.none(), st.floats(min_value=-2, max_value=20)),
    "precision": st.sampled_from(["fp32", "fp16", "int8", ""]),
}
table = st.fixed_dictionaries({}, optional=FIELDS)
memory_gb = st.one_of(
    st.sampled_from(["0", "-1", "nan", "inf", "1e-9", "abc"]), st.floats(min_value=1e-6, max_value=1e4).map(repr)
)
devices = st.one_of(st.integers(min_value=-2, max_value=300).map(str), st.sampled_from(["x", "1.5"]))


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
    return code, err.getvalue().strip()


def assert_refused_cleanly(code: int, err: str, out: Path) -> None:
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "error" in err, err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), "a temporary file was left behind"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables=st.lists(table, max_size=6),
    devices=devices,
    memory=memory_gb,
    algo=st.sampled_from(["lookup_greedy", "round_robin", "dreamshard", "optimal", "no_such_algo"]),
)
def test_plan_answers_a_plan_or_one_line(tables, devices, memory, algo):
    with tempfile.TemporaryDirectory() as tmp:
        table_file, out = Path(tmp) / "tables.json", Path(tmp) / "plan.json"
        table_file.write_text(json.dumps({"tables": tables}))
        code, err = run(
            [
                "plan",
                "--tables",
                str(table_file),
                "--devices",
                devices,
                "--memory-gb",
                memory,
                "--algo",
                algo,
                "--out",
                str(out),
            ]
        )
        if code == 0:  # extreme but valid: more devices than tables, huge memory, a one-table task
            plan, specs = load_plan(out), load_tables(table_file)
            plan.check(specs)
            assert plan.num_devices == int(devices)
        else:
            assert_refused_cleanly(code, err, out)


def test_plan_shows_and_asks_for_its_memory_cap_as_required(tmp_path, table_file_path, capsys):
    """`plan` has no plan file to read the memory cap from: its usage shows --memory-gb required and a missing one is
    named with what it is, where `evaluate`, which shares the flag, keeps it optional."""
    out = tmp_path / "plan.json"
    code, err = run(
        ["plan", "--tables", str(table_file_path), "--devices", "2", "--algo", "size_greedy", "--out", str(out)]
    )
    assert_refused_cleanly(code, err, out)
    assert "required: --memory-gb (memory cap per device in GiB) (see " in err  # each missing flag said with what it is
    for command, shown in (("plan", " --memory-gb MEMORY_GB"), ("evaluate", " [--memory-gb MEMORY_GB]")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split()), command


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_truncated_table_files_are_refused(cut):
    doc = json.dumps(
        {"tables": [{"name": f"t{i}", "rows": 1000 * (i + 1), "dim": 16, "pooling_factor": 2.0} for i in range(4)]}
    )
    cut = cut % len(doc)  # every proper prefix is broken JSON
    with tempfile.TemporaryDirectory() as tmp:
        table_file, out = Path(tmp) / "tables.json", Path(tmp) / "plan.json"
        table_file.write_text(doc[:cut])
        code, err = run(
            [
                "plan",
                "--tables",
                str(table_file),
                "--devices",
                "2",
                "--memory-gb",
                "1",
                "--algo",
                "size_greedy",
                "--out",
                str(out),
            ]
        )
        assert_refused_cleanly(code, err, out)
        if not doc[:cut].strip():  # nothing at all: said so, not JSON's "Expecting value: line 1 column 1"
            assert err == f"shard-ray: error: table file {table_file} is empty", err


@settings(max_examples=25, deadline=None)
@given(blob=st.binary(max_size=2000), which=st.sampled_from(["--cost-model", "--policy"]))
def test_damaged_model_and_policy_files_are_refused(table_file_path, blob, which):
    with tempfile.TemporaryDirectory() as tmp:
        bad, out = Path(tmp) / "bad.pt", Path(tmp) / "plan.json"
        bad.write_bytes(blob)
        algo = "cost_search" if which == "--cost-model" else "dreamshard"
        code, err = run(
            [
                "plan",
                "--tables",
                str(table_file_path),
                "--devices",
                "2",
                "--memory-gb",
                "1",
                "--algo",
                algo,
                which,
                str(bad),
                "--out",
                str(out),
            ]
        )
        assert_refused_cleanly(code, err, out)
        assert "weights_only=False" not in err  # torch's advice to load untrusted pickles is not ours to give
        assert COSTMODELS_FORMAT in err or POLICY_FORMAT in err, err


def _edited_pickle(path: Path, old: bytes, new: bytes) -> None:
    """`path`, a torch.save archive, with `old` replaced by `new` in its pickle (the other entries as they were)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    (name,) = [n for n in entries if n.endswith("/data.pkl")]
    assert entries[name].count(old) >= 1
    entries[name] = entries[name].replace(old, new, 1)
    with zipfile.ZipFile(path, "w") as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("shape past the storage", "a tensor of shape (200000,) reaches past its storage of 2 items"),
        ("not finite", "is damaged: compute holds numbers that are not finite"),
        ("bfloat16", "it holds a tensor of BFloat16, where the project saves float32"),
        ("legacy", "it is not torch.save's zip archive"),
        ("step overhead", "is damaged: could not convert string to float: 'x'"),
    ],
)
def test_a_model_file_torch_would_refuse_or_that_prices_nothing_is_refused_in_a_line(
    tmp_path, table_file_path, damage, message
):
    """The models' files are read without torch (`read_torch_file`): a tensor whose shape reaches past its storage
    (which read as it stood, past the buffer, crashed the process: a new user's walk), weights that are not finite
    numbers, a dtype the project never saves, torch's legacy format and a field that is not ms are refused in one
    line, as damaged or unreadable files."""
    import torch

    from shard_ray.costmodel.models import default_cost_model_path

    path = tmp_path / "models.pt"
    blob = torch.load(default_cost_model_path(), weights_only=True)
    if damage == "shape past the storage":
        blob["compute"]["state"]["compute"] = torch.zeros(2)
        torch.save(blob, path)
        # a 2-item tensor's pickled shape (K\x02\x85: the tuple (2,)) made (200000,) (BININT 200000)
        _edited_pickle(path, b"K\x02\x85q", b"J\x40\x0d\x03\x00\x85q")
    elif damage == "not finite":
        blob["compute"]["state"]["compute"] = torch.tensor([1.0, float("nan")])
        torch.save(blob, path)
    elif damage == "bfloat16":
        blob["compute"]["state"] = {k: v.to(torch.bfloat16) for k, v in blob["compute"]["state"].items()}
        torch.save(blob, path)
    elif damage == "legacy":
        torch.save(blob, path, _use_new_zipfile_serialization=False)
    else:
        blob["step_overhead_ms"] = "x"
        torch.save(blob, path)
    code, err = run(["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "1", "--algo", "cost_search",
                     "--cost-model", str(path), "--out", str(tmp_path / "plan.json")])  # fmt: skip
    assert_refused_cleanly(code, err, tmp_path / "plan.json")
    assert message in err, err
    if damage in ("bfloat16", "legacy"):
        torch.load(path, weights_only=True)  # files torch reads, which the project does not write


def test_a_big_endian_model_file_prices_as_the_little_endian_one(tmp_path, small_tables):
    """A file whose tensors torch.save wrote big-endian (its `byteorder` entry) is read in that order."""
    import zipfile

    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.plan.piece import TablePiece

    with zipfile.ZipFile(default_cost_model_path()) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    for name in list(entries):
        if "/data/" in name:
            entries[name] = np.frombuffer(entries[name], dtype="<f4").astype(">f4").tobytes()
        if name.endswith("/byteorder"):
            entries[name] = b"big"
    with zipfile.ZipFile(tmp_path / "big.pt", "w") as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)
    shard = [[TablePiece.whole(t) for t in small_tables]]
    shipped, big = CostModels.load(default_cost_model_path()), CostModels.load(tmp_path / "big.pt")
    assert np.array_equal(big.predict_fused_shards(shard, 1024), shipped.predict_fused_shards(shard, 1024))


def test_a_negative_seed_is_refused_and_one_table_is_said_so(tmp_path, table_file_path, capsys):
    """A seed is a non-negative integer: the policy's samples are drawn from numpy's generator, which takes no other
    (`--seed -1` ended in its traceback, from a new user's walk); `--policy` with an algorithm that takes none is
    refused as the flag it is (it read "unknown setting(s) policy"); a one-table plan says "placed 1 table"."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "1", "--algo", "dreamshard"]
    code, err = run([*argv, "--samples", "2", "--seed", "-1", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert "argument --seed: must be at least 0, got -1" in err, err
    code, err = run([*argv[:-1], "neuroshard", "--policy", "p.pt", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert "--policy is the policy dreamshard places with, and cost_search may start from; 'neuroshard'" in err, err
    capsys.readouterr()
    assert main([*argv, "--samples", "2", "--seed", "3", "--out", str(out)]) == 0
    assert "placed 1 table in" in capsys.readouterr().out


def test_a_misspelt_setting_is_named_with_the_one_meant_and_every_setting_listed(tmp_path, table_file_path):
    """`--set` of a setting the algorithm lacks names the setting closest to it and lists the algorithm's settings,
    which no page lists for every algorithm (a walk: `max_evalutions` was refused with no hint); a retired one says
    what replaced it; the class's own constant `RETIRED` is no setting."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "1", "--algo", "cost_search"]
    code, err = run([*argv, "--set", "max_evalutions=1000", "--set", "time_budget_s=3", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert "unknown setting(s) max_evalutions (did you mean max_evaluations?), time_budget_s (budgets count" in err
    assert "; its settings are baselines, beam_depth, beam_width," in err and "RETIRED" not in err
    code, err = run([*argv, "--set", "RETIRED={}", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert "unknown setting(s) RETIRED; its settings are" in err
    code, err = run([*argv[:-1], "dreamshard", "--set", "beam_width=3", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert err.endswith("unknown setting(s) beam_width; its settings are policy, samples"), err


def test_a_policy_path_that_holds_no_policy_is_refused_whatever_reads_it(tmp_path, table_file_path):
    """`--policy` of a missing file with cost_search, whose search starts from the grid alone on this task, was
    taken and recorded in the plan without being read (a walk); a folder of training folders is pointed into."""
    from shard_ray.policy.policy_file import default_policy_path

    out = tmp_path / "plan.json"
    argv = ["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "1", "--out", str(out)]
    code, err = run([*argv, "--algo", "cost_search", "--policy", str(tmp_path / "nope.pt")])
    assert_refused_cleanly(code, err, out)
    assert f"policy file not found: {tmp_path / 'nope.pt'}" in err
    (tmp_path / "runs" / "pol").mkdir(parents=True)
    (tmp_path / "runs" / "pol" / "policy.pt").write_bytes(default_policy_path().read_bytes())
    code, err = run([*argv, "--algo", "dreamshard", "--policy", str(tmp_path / "runs")])
    assert_refused_cleanly(code, err, out)
    assert err.endswith(f"the training folders in {tmp_path / 'runs'} hold {tmp_path / 'runs' / 'pol' / 'policy.pt'}")


def test_a_folder_given_as_a_store_or_a_model_file_is_said_to_be_one(tmp_path, table_file_path):
    """A folder where a store or a model file goes was "not found" to some commands and "not a usable SQLite file"
    to others, after a local Ray had started (a walk): each says it is a folder, naming the store in it, before Ray."""
    from shard_ray.costmodel.models import default_cost_model_path
    from shard_ray.profiling.store import MeasurementStore

    with MeasurementStore(tmp_path / "st" / "measurements.db"):
        pass
    store, tables = str(tmp_path / "st"), str(table_file_path)
    said = f"measurement store {store} is a folder: give the store's file ({tmp_path / 'st' / 'measurements.db'} in it)"
    for argv in (
        ["costmodel", "train", "--store", store, "--tables", tables, "--out", str(tmp_path / "m.pt")],
        ["costmodel", "evaluate", "--store", store, "--cost-model", str(default_cost_model_path())],
        ["profile", "--tables", tables, "--store", store, "--shards", "1"],
        ["collect", "--kind", "compute", "--tables", tables, "--store", store, "--samples", "1"],
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code, err = run(argv)
        assert code == 2 and err == f"shard-ray: error: {said}", (argv, err)
        assert "ray:" not in out.getvalue()
    plan = ["plan", "--tables", tables, "--devices", "2", "--memory-gb", "1", "--algo", "cost_search"]
    code, err = run([*plan, "--cost-model", store, "--out", str(tmp_path / "p.json")])
    assert_refused_cleanly(code, err, tmp_path / "p.json")
    assert f"cost model file {store} is a folder: give the model file (.pt) in it" in err


@pytest.fixture(scope="module")
def table_file_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "tables.json"
    path.write_text(json.dumps({"tables": [{"name": "a", "rows": 1000, "dim": 16, "pooling_factor": 2.0}]}))
    return path


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--min-tables", "9", "--max-tables", "3"], "--min-tables 9 is more than --max-tables 3"),
        (["--lr", "5"], "learning rate"),
        (["--env-runners", "-1"], "env runners"),
        (
            ["--min-tables", "30", "--max-tables", "40"],
            "pool has 1: lower min_tables and max_tables (--min-tables, --max-tables) to at most 1",
        ),
        (["--cost-model", "missing.pt"], "not found"),
    ],
)
def test_policy_train_refuses_bad_settings_before_ray(tmp_path, table_file_path, flags, message):
    out = tmp_path / "policy"
    code, err = run(["policy", "train", "--tables", str(table_file_path), "--out", str(out), *flags])
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (out / "policy.pt").exists()


def test_a_csv_table_file_is_refused_naming_the_formats_read(tmp_path):
    tables, out = tmp_path / "tables.csv", tmp_path / "plan.json"
    tables.write_text("name,rows,dim,pooling_factor\na,1000,16,2.0\n")
    code, err = run(
        [
            "plan",
            "--tables",
            str(tables),
            "--devices",
            "2",
            "--memory-gb",
            "1",
            "--algo",
            "size_greedy",
            "--out",
            str(out),
        ]
    )
    assert_refused_cleanly(code, err, out)
    assert "not valid JSON" in err and "read as JSON, or as YAML when named .yaml or .yml" in err, err


@pytest.mark.parametrize("name", ["user.age", "keys"])
def test_table_names_torchrec_refuses_are_refused_by_plan_and_export(tmp_path, table_file_path, name):
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"tables": [{"name": name, "rows": 1000, "dim": 16, "pooling_factor": 2.0}]}))
    plan, export = tmp_path / "plan.json", tmp_path / "export.json"
    flags = ["--devices", "2", "--memory-gb", "1", "--algo", "size_greedy"]
    code, err = run(["plan", "--tables", str(tables), *flags, "--out", str(plan)])
    assert_refused_cleanly(code, err, plan)
    assert repr(name) in err and "TorchRec" in err, err
    # a plan made for a good name cannot be exported against the bad one either
    assert run(["plan", "--tables", str(table_file_path), *flags, "--out", str(plan)])[0] == 0
    code, err = run(
        ["export", "--plan", str(plan), "--tables", str(tables), "--format", "torchrec", "--out", str(export)]
    )
    assert_refused_cleanly(code, err, export)
    assert repr(name) in err, err


def test_export_refuses_a_plan_of_other_tables_naming_both_files(tmp_path, table_file_path):
    plan, other, export = tmp_path / "plan.json", tmp_path / "other.json", tmp_path / "export.json"
    other.write_text(json.dumps({"tables": [{"name": "b", "rows": 1000, "dim": 16, "pooling_factor": 2.0}]}))
    flags = ["--devices", "2", "--memory-gb", "1", "--algo", "size_greedy"]
    assert run(["plan", "--tables", str(table_file_path), *flags, "--out", str(plan)])[0] == 0
    code, err = run(
        ["export", "--plan", str(plan), "--tables", str(other), "--format", "torchrec", "--out", str(export)]
    )
    assert_refused_cleanly(code, err, export)
    assert f"{plan} is not a plan of {other}: plan places table 'a', which is not in the table file" in err, err


def test_tasks_that_fail_leave_nothing_behind(tmp_path):
    pool, out = tmp_path / "pool.json", tmp_path / "tasks"
    pool.write_text(
        json.dumps({"tables": [{"name": f"t{i}", "rows": 1000, "dim": 16, "pooling_factor": 2.0} for i in range(10)]})
    )
    # the pool splits fine; a 30-table task fits neither 5-table split: said of the splits, not of the pool of 10
    code, err = run(["tasks", "--tables", str(pool), "--out", str(out), "--min-tables", "30", "--max-tables", "40"])
    message = "the pool of 10 splits into 5 for training and 5 for testing: lower --min-tables to at most 5"
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()
    # a flag's bad value named by the flag, with the value (`dims must be positive multiples of 4` named neither)
    for flag, value, said in (
        ("--dims", "30,64", "--dims must be positive multiples of 4, got 30"),
        ("--test-fraction", "1.5", "--test-fraction must be between 0 and 1 (the share of the pool's tables held"),
    ):
        code, err = run(["tasks", "--tables", str(pool), "--out", str(out), flag, value])
        assert code == 2 and len(err.splitlines()) == 1 and said in err and not out.exists(), err
    out.mkdir()
    (out / "mine.json").write_text("{}")
    code, err = run(["tasks", "--tables", str(pool), "--out", str(out), "--min-tables", "30", "--max-tables", "40"])
    assert code == 2 and sorted(p.name for p in out.iterdir()) == ["mine.json"]
    code, err = run(
        [
            "tasks",
            "--tables",
            str(pool),
            "--out",
            str(out),
            "--num-tasks",
            "2",
            "--min-tables",
            "2",
            "--max-tables",
            "3",
        ]
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "mine.json",
            "train_pool.json",
            "test_pool.json",
            "train_000.json",
            "train_001.json",
            "test_000.json",
            "test_001.json",
        ]
    )


def test_a_hardware_id_naming_no_kind_of_device_is_refused(tmp_path, table_file_path):
    """'NVIDIA H100' matched no models and was priced by the reference CPU's without a word; 'cuda:...' is how
    measurements name a GPU."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "4", "--algo", "size_greedy"]
    code, err = run([*argv, "--hardware", "NVIDIA H100", "--out", str(out)])
    assert_refused_cleanly(code, err, out)
    assert "hardware id 'NVIDIA H100' names no kind of device" in err and "'cuda:<GPU name>'" in err
    for nameless in ("cuda:", "cuda:NVIDIA H100 80GB HBM3 "):  # no name; a space the models' ids never have
        code, err = run([*argv, "--hardware", nameless, "--out", str(out)])
        assert_refused_cleanly(code, err, out)
        assert "give the device's name after its kind, with no space around it" in err
    assert run([*argv, "--hardware", "cuda:NVIDIA H100 80GB HBM3", "--out", str(out)])[0] == 0 and out.is_file()


def test_calibrate_refuses_tables_its_memory_cap_cannot_hold_before_ray(tmp_path, table_file_path, monkeypatch):
    """`calibrate --memory-gb` too small for the tables: one line naming the need, exit 2, before Ray starts (it once
    started Ray, printed "0 candidate plans" and ended in a traceback)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "models.pt"
    argv = ["calibrate", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "0.00001"]
    err, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(said):
        code = main([*argv, "--no-mlflow", "--store", str(tmp_path / "m.db"), "--out", str(out)])
    assert_refused_cleanly(code, err.getvalue().strip(), out)
    # before Ray: nothing connected to it ("ray: started ..." or "ray: joined ...") nor planned
    assert "over the cap of 1e-05 GiB per device" in err.getvalue() and said.getvalue() == ""


@pytest.mark.parametrize(
    "command, flags, message",
    [
        ("plan", ["--devices", "4097", "--memory-gb", "4", "--out", "p.json"], "--devices: must be at most 4,096, got"),
        (
            "plan",
            ["--devices", "2", "--memory-gb", "1e10", "--out", "p.json"],
            "--memory-gb: must be at most 1,000,000",
        ),
        ("plan", ["--devices", "2", "--memory-gb", "4", "--out", "made"], "--out: made is a folder; give the file"),
        (
            "plan",
            ["--devices", "2", "--memory-gb", "4", "--out", "/proc/p.json"],
            "--out: no file can be made in folder /proc (No such file or directory)",
        ),
        ("evaluate", ["--plan", "plan.json", "--out", "made"], "--out: made is a folder; give the file to write"),
        ("compare", ["--plans", "plan.json", "plan.json", "--out", "plan.json"], "--out: plan.json is a file, not a"),
        # the folders of `tasks` and `bench` ended in tracebacks (bench's after starting Ray): a second walk
        ("tasks", ["--out", "plan.json"], "--out/--out-dir: plan.json is a file, not a folder"),
        ("tasks", ["--out", "plan.json/sub"], "--out/--out-dir: plan.json is a file, not a folder"),
        ("bench", ["--tasks", "0", "--out", "plan.json", "--no-mlflow"], "--out: plan.json is a file, not a folder"),
        # an empty name was "--out:  is a folder" (Path("") is "."), and a folder to write in the current folder (a walk)
        ("plan", ["--devices", "2", "--memory-gb", "4", "--out", ""], "--out: an empty name; give the file to write"),
        ("compare", ["--plans", "plan.json", "plan.json", "--out", " "], "--out: an empty name; give the folder"),
        # a share above 1 was taken: a walk's calibration held out 24 of 29 shards and replaced a better one's models
        ("calibrate", ["--devices", "2", "--held-out", "1.5", "--no-mlflow"], "--held-out: must be at most 0.8, got"),
    ],
)
def test_outputs_and_sizes_that_cannot_be_are_refused_before_the_command_works(
    tmp_path, table_file_path, command, flags, message
):
    """Where the output cannot go (a folder named as the file, a file as the folder, a folder no file can be made
    in), the command said so only once it had measured, in a traceback, and kept nothing of what it measured; more
    devices than a plan may have, or a cap whose bytes overflow the ledger's integers, ended in tracebacks too. Each is
    refused by its flag in one line, before the command works (the test runs in `tmp_path`, its own folder)."""
    (tmp_path / "made").mkdir()
    (tmp_path / "plan.json").write_text("{}")
    code, err = run([command, "--tables", str(table_file_path), *flags])
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made", "plan.json"] and not any(
        (tmp_path / "made").iterdir()
    )


def test_an_output_naming_an_input_file_is_refused_and_the_input_kept(tmp_path, table_file_path):
    """`plan --tables t.json --out t.json` replaced the table file with the plan, and `export --plan plan.json --out
    plan.json` the plan with TorchRec's (a new user's walk; the next command then refused the file by its fields).
    Refused in one line, whatever the path's spelling, and the file is kept as it was."""
    tables = tmp_path / "t.json"
    tables.write_text(table_file_path.read_text())
    code, err = run(["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "4", "--algo", "size_greedy",
                     "--out", "./t.json"])  # fmt: skip
    assert code == 2 and err == (
        "shard-ray: error: --out ./t.json is the file given to --tables: writing it would replace that file; give "
        "another name"
    ), err
    assert tables.read_text() == table_file_path.read_text()
    made = run(["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "4", "--algo", "size_greedy",
                "--out", "plan.json"])  # fmt: skip
    assert made[0] == 0, made
    plan = (tmp_path / "plan.json").read_text()
    code, err = run(["export", "--plan", "plan.json", "--tables", "t.json", "--format", "torchrec", "--out", str(
        tmp_path / "plan.json")])  # fmt: skip
    assert code == 2 and "is the file given to --plan" in err and (tmp_path / "plan.json").read_text() == plan, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--measure-rounds", "5"], "--measure-rounds is a setting of --measure: give --measure too"),
        (["--measure-budget", "9"], "--measure-budget is a setting of --measure: give --measure too"),
        (["--measure", "--refine-steps", "2"], "--refine-steps is a setting of --refine: give --refine too"),
    ],
)
def test_settings_of_a_flag_not_given_are_refused(tmp_path, table_file_path, flags, message):
    """`plan --measure-rounds 5` without `--measure` planned and measured nothing without a word, where
    `--incumbent` without it was refused (a new user's walk): a setting given without the flag it is a setting of is
    refused in one line, before anything runs."""
    code, err = run(["plan", "--tables", str(table_file_path), "--devices", "2", "--memory-gb", "4", "--algo",
                     "size_greedy", "--out", "p.json", *flags])  # fmt: skip
    assert code == 2 and err == f"shard-ray: error: {message}", err
    assert not (tmp_path / "p.json").exists()


def test_a_policy_stuck_at_every_plan_says_what_it_tried(tmp_path):
    """Greedy decoding and every plan sampled to rescue it left a piece no device holds: the line says so, not an
    unexplained count of tries with `--samples 0`. (Four tables on 2 devices with about 2% to spare, which
    `cost_search` places; the task this test first had, the policy places since its finish knows when it overfills.)
    Priced by the reference CPU's models whatever the machine: the Intel Xeon's let the policy place it."""
    shapes = [("small", 1_000_000, 32, 1.0), ("mid", 5_000_000, 64, 5.0), ("long", 10_000_000, 64, 1.0)]
    shapes += [("pooled", 10_000_000, 64, 20.0)]
    tables = [{"name": n, "rows": r, "dim": d, "pooling_factor": p} for n, r, d, p in shapes]
    (tmp_path / "t.json").write_text(json.dumps({"tables": tables}))
    code, err = run(["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "3.27", "--algo", "dreamshard",
                     "--hardware", "cpu:AMD EPYC:1thread", "--out", "p.json"])  # fmt: skip
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "greedy decoding and 32 sampled plans (32 drawn because every plan before got stuck)" in err, err
    assert "3.27 GiB per device" in err and not (tmp_path / "p.json").exists()
