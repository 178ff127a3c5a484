"""The command line: happy paths, and bad input refused in one line with exit status 2."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from console import assert_refused, shard_ray_here

from shard_ray.cli import main
from shard_ray.plan.plan import load_plan
from shard_ray.profiling.store import MeasurementStore

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shard_ray.cli", *args], capture_output=True, text=True, timeout=120)


def test_generate_tasks_plan(tmp_path, capsys):
    pool = tmp_path / "pool.json"
    assert main(["generate", "--out", str(pool), "--num-tables", "60", "--seed", "2"]) == 0
    assert len(json.loads(pool.read_text())["tables"]) == 60
    assert (
        main(
            [
                "tasks",
                "--tables",
                str(pool),
                "--out",
                str(tmp_path / "tasks"),
                "--num-tasks",
                "2",
                "--min-tables",
                "4",
                "--max-tables",
                "6",
            ]
        )
        == 0
    )
    task = tmp_path / "tasks" / "test_000.json"
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--tables",
                str(task),
                "--devices",
                "2",
                "--memory-gb",
                "4",
                "--algo",
                "lookup_greedy",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    doc = json.loads(plan.read_text())
    assert doc["algorithm"] == "lookup_greedy" and doc["num_devices"] == 2
    out = capsys.readouterr().out
    assert "plan 'lookup_greedy' on 2 devices" in out
    # a heuristic's plan is priced by the models all the same, and says so and by which
    assert "simulated plan cost: " in out and "lookup_greedy places without the cost models" in out
    assert "priced by the shipped models" in out and doc["estimate"]["provenance"].startswith("priced by")


def test_table_and_plan_files_are_written_in_the_format_their_name_says(tmp_path, capsys):
    """Named .yaml or .yml, a table or plan file is written as YAML, which is how every command reads it back; named
    otherwise than .json, .yaml or .yml (a .csv), refused before anything is written: a pool named .csv had been
    written as JSON."""
    import yaml

    from shard_ray.workload.tables import load_tables

    assert_refused(capsys, ["generate", "--out", "pool.csv", "--num-tables", "5"], "pool.csv: name the file .json")
    assert not list(tmp_path.iterdir())
    assert shard_ray_here(capsys, "generate", "--out", "pool.yaml", "--num-tables", "5", "--seed", "3").returncode == 0
    assert shard_ray_here(capsys, "generate", "--out", "pool.json", "--num-tables", "5", "--seed", "3").returncode == 0
    assert len(yaml.safe_load(Path("pool.yaml").read_text())["tables"]) == 5
    assert not Path("pool.yaml").read_text().lstrip().startswith("{")
    assert load_tables("pool.yaml") == load_tables("pool.json")
    plan = ["plan", "--tables", "pool.yaml", "--devices", "2", "--memory-gb", "4", "--algo", "size_greedy"]
    assert_refused(capsys, [*plan, "--out", "plan"], "plan: name the file .json, .yaml or .yml", Path("plan"))
    assert shard_ray_here(capsys, *plan, "--out", "plan.yml").returncode == 0
    assert yaml.safe_load(Path("plan.yml").read_text())["algorithm"] == "size_greedy"
    assert load_plan("plan.yml").num_devices == 2


def test_a_plan_used_with_tables_of_its_names_but_other_shapes_is_said_so(tmp_path, capsys):
    """A plan keeps a digest of the tables it was made for: given tables of the same names but other rows (a table
    file grown since), `export`, `evaluate` and `compare` say so and which table changed, where they took it without a
    word (a walk); on its own tables, or a plan with no digest (written by hand, or by an earlier release), nothing."""
    first = {"tables": [{"name": "a", "rows": 3, "dim": 16, "pooling_factor": 1}, GOOD]}
    Path("t1.json").write_text(json.dumps(first))
    Path("t2.json").write_text(json.dumps({"tables": [first["tables"][0] | {"rows": 300}, GOOD]}))
    flags = ["--devices", "2", "--memory-gb", "1", "--algo", "size_greedy", "--out", "p.json"]
    assert shard_ray_here(capsys, "plan", "--tables", "t1.json", *flags).returncode == 0
    export = ["export", "--plan", "p.json", "--out", "e.json", "--tables"]
    done = shard_ray_here(capsys, *export, "t2.json")
    said = (
        "warning: p.json was made for tables of these names but other shapes than t2.json's (rows, dims, pooling "
        "factors, precision or access){}; its placement is taken as it is, for these"
    )
    assert done.returncode == 0 and done.stderr.strip() == said.format(": 'a'")
    assert shard_ray_here(capsys, *export, "t1.json").stderr == ""
    # shapes past the cap the plan was made under are refused, as `compare` refuses them: exported, the ranks would run
    # out of memory at their start (a walk)
    Path("t3.json").write_text(json.dumps({"tables": [first["tables"][0] | {"rows": 300_000_000}, GOOD]}))
    refused = assert_refused(capsys, [*export, "t3.json"], "p.json: plan needs ", Path("e3.json"))
    assert "over the cap of 1.000 GiB" in refused
    unrecorded = json.loads(Path("p.json").read_text())
    del unrecorded["settings"]["table_digests"]  # an earlier release's plan: that a table changed, not which
    Path("p.json").write_text(json.dumps(unrecorded))
    assert shard_ray_here(capsys, *export, "t2.json").stderr.strip() == said.format("")
    del unrecorded["settings"]["tables_digest"]
    Path("p.json").write_text(json.dumps(unrecorded))
    assert shard_ray_here(capsys, *export, "t2.json").stderr == ""


def test_algorithms_lists_every_baseline(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for name in ("random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy"):
        assert name in out


GOOD = {"name": "t0", "rows": 1000, "dim": 64, "pooling_factor": 4.0}


def test_table_files_of_windows_editors_and_yaml_merges_are_read_and_a_key_given_twice_is_refused(tmp_path):
    """A byte-order mark (some Windows editors write one) is read past, where JSON's reader refused it with advice
    about Python's codecs; a key given twice in one YAML entry is refused with its line, while a merge (`<<`) may give
    its keys again, which is what it is for."""
    from shard_ray.errors import ShardRayError
    from shard_ray.workload.tables import load_tables

    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps({"tables": [GOOD]}).encode())
    assert load_tables(marked) == load_tables_from([GOOD])
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {rows: 1000, dim: 64, pooling_factor: 4.0}\ntables:\n  - <<: *b\n    name: t0\n")
    assert load_tables(merged) == load_tables_from([GOOD])
    twice = tmp_path / "twice.yaml"
    twice.write_text("tables:\n  - name: t0\n    rows: 1000\n    dim: 64\n    rows: 9\n")
    with pytest.raises(ShardRayError, match=r"'rows' is given twice in one entry \(line 5\)"):
        load_tables(twice)


def load_tables_from(entries: list[dict]) -> list:
    from shard_ray.workload.tables import TableFile

    return TableFile.model_validate({"tables": entries}).tables


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid"),
        (json.dumps({"tables": []}), "tables"),
        (json.dumps({"tables": [GOOD | {"dim": 30}]}), "multiple of 4"),
        (json.dumps({"tables": [GOOD | {"rows": -5}]}), "table 't0': rows: must be more than 0"),
        (json.dumps({"tables": [GOOD | {"pooling_factor": 0}]}), "pooling_factor"),
        (json.dumps({"tables": [GOOD | {"rows": "lots"}]}), "rows"),
        # in shard-ray's words, not pydantic's ("Input should be 'fp32' or 'fp16'", "Unable to parse input string ...")
        (json.dumps({"tables": [GOOD | {"precision": "int8"}]}), "precision: must be 'fp32' or 'fp16', got \"int8\""),
        (json.dumps({"tables": [GOOD | {"rows": 10.5}]}), "table 't0': rows: must be a whole number, got 10.5"),
        (json.dumps({"tables": [GOOD | {"rows": 1e30}]}), "table 't0': rows: 1e+30 is too large a number"),
        (json.dumps({"tables": [GOOD, GOOD]}), "duplicate table name"),
        # an entry whose name another has too is called by its place as well (a walk could not tell which was meant)
        (json.dumps({"tables": [GOOD, GOOD | {"dim": 30}]}), "table 't0' (#2): dim: must be a multiple of 4"),
        # an entry with no name is counted from 1, as its reader counts (pydantic's `tables.1.name` counts from 0)
        (json.dumps({"tables": [GOOD, {"rows": 5, "dim": 8}]}), "table #2: name: missing: it is required"),
        # in shard-ray's words, not pydantic's ("String should have at least 1 character")
        (json.dumps({"tables": [GOOD | {"name": ""}]}), "name: must not be empty"),
        # a key misspelt where the list belongs: the keys found said
        (
            json.dumps({"table": [GOOD]}),
            "expected an object with a 'tables' list (its keys: table; did you mean tables?)",
        ),
        # a plan given where the tables belong, said so
        (json.dumps({"num_devices": 2, "algorithm": "a", "shards": []}), "is a plan file ('shards' on 'num_devices')"),
        # JSON's reader keeps the last of a key given twice: 5 million rows planned, nothing said
        (
            '{"tables": [{"name": "t0", "rows": 1000, "rows": 5000000, "dim": 64}]}',
            "'rows' is given twice in one entry",
        ),
        # read only where its shards are measured, after Ray starts: `profile` stored them as infeasible, status 0
        (
            json.dumps({"tables": [GOOD | {"trace": {"path": "/nonexistent.pt", "table_index": 0}}]}),
            "table 't0': trace file /nonexistent.pt not found",
        ),
        (json.dumps({"tables": [GOOD | {"extra": 1}]}), "extra"),
        (  # every mistake of the file in its one line
            json.dumps({"tables": [GOOD | {"rows": -5}, GOOD | {"name": "t1", "dim": 30}]}),
            "table 't0': rows: must be more than 0; table 't1': dim: must be a multiple of 4",
        ),
    ],
)
def test_plan_refuses_bad_table_files(tmp_path, capsys, content, message):
    tables = tmp_path / "tables.json"
    tables.write_text(content)
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--tables",
        str(tables),
        "--devices",
        "2",
        "--memory-gb",
        "1",
        "--algo",
        "random",
        "--out",
        str(out),
    ]
    assert_refused(capsys, argv, message, leftover=out)


def test_a_misspelt_field_is_named_as_one_not_as_the_field_it_left_missing(tmp_path, capsys):
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"tables": [{k.replace("pooling", "poolin"): v for k, v in GOOD.items()}]}))
    argv = ["plan", "--tables", str(tables), "--devices", "2", "--memory-gb", "1", "--algo", "random"]
    out = tmp_path / "plan.json"
    message = f"table file {tables}: table 't0': poolin_factor: not a field (did you mean "
    err = assert_refused(capsys, [*argv, "--out", str(out)], message, leftover=out)
    assert err.endswith("(did you mean pooling_factor?)") and "missing" not in err


def test_a_misspelt_key_of_an_optional_field_is_named_first_with_the_field_meant(tmp_path, capsys):
    """Found by a new user's walk: a constraints file's `not_type:` (or a top-level `group:`) got pydantic's "Extra
    inputs are not permitted", where the table file names the field meant; and among a table file's many errors the
    misspelling, the one that hides the others, came after "and 2 more"."""
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"tables": [GOOD]}))
    constraints = tmp_path / "c.yaml"
    constraints.write_text("tables:\n  t0: {not_type: [row_wise]}\ngroup: [[t0]]\n")
    argv = ["plan", "--tables", str(tables), "--devices", "2", "--memory-gb", "1", "--algo", "random"]
    out = tmp_path / "plan.json"
    err = assert_refused(capsys, [*argv, "--constraints", str(constraints), "--out", str(out)], "", leftover=out)
    assert err.endswith(
        f"constraints file {constraints}: tables.t0.not_type: not a field (did you mean not_types?); group: not a "
        "field (did you mean groups?)"
    ), err
    bad = {**GOOD, "rows": 0, "dim": 18, "pooling_factor": -1, "zipf_exponnt": 1.1}
    tables.write_text(json.dumps({"tables": [bad]}))
    err = assert_refused(capsys, [*argv, "--out", str(out)], "", leftover=out)
    assert f"table file {tables}: table 't0': zipf_exponnt: not a field (did you mean zipf_exponent?); " in err, err
    constraints.write_text("tables:\n  t0: {types: [row_wise], colour: 1}\n")
    tables.write_text(json.dumps({"tables": [GOOD]}))
    # a key is matched against the fields of its own level (a plan's top-level `colum` was asked whether it meant a
    # shard's `columns`), and one close to none is told the fields it may be
    plan = tmp_path / "mine.json"
    plan.write_text(json.dumps({"num_devices": 2, "algorithm": "mine", "colum": 1,
                                "shards": [{"table": "t0", "device": 0, "columns": [0, 64]}]}))  # fmt: skip
    err = assert_refused(capsys, ["export", "--plan", str(plan), "--tables", str(tables), "--out", "e.json"], "colum")
    assert "did you mean" not in err and "colum: not a field (the fields here: " in err, err
    err = assert_refused(capsys, [*argv, "--constraints", str(constraints), "--out", str(out)], "", leftover=out)
    assert err.endswith("tables.t0.colour: not a field (the fields here: devices, not_types, types)"), err
    # a device written as text, read as a number by pydantic in plans and constraints as in table files: refused alike
    constraints.write_text('tables:\n  t0: {devices: ["0"]}\n')
    err = assert_refused(capsys, [*argv, "--constraints", str(constraints), "--out", str(out)], "", leftover=out)
    assert err.endswith('tables.t0.devices: must be a number, got the text "0": unquote it'), err
    plan.write_text(json.dumps({"num_devices": 2, "algorithm": "mine",
                                "shards": [{"table": "t0", "device": "0", "columns": [0, 64]}]}))  # fmt: skip
    err = assert_refused(capsys, ["export", "--plan", str(plan), "--tables", str(tables), "--out", "e.json"], "")
    assert err.endswith('shard #1: device: must be a number, got the text "0": unquote it'), err
    constraints.write_text("groups: [[]]\n")  # a group that keeps no table together
    assert_refused(capsys, [*argv, "--constraints", str(constraints), "--out", str(out)], "an empty one keeps none")


def test_a_table_file_that_does_not_parse_is_refused_with_where_it_broke(tmp_path, capsys):
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n  - {name: a, rows: 5, dim: 16, pooling_factor: 1\n  - {name: b, rows: 5, dim: 16}\n")
    argv = ["plan", "--tables", str(tables), "--devices", "2", "--memory-gb", "1", "--algo", "random"]
    out = tmp_path / "plan.json"
    message = f"table file {tables} is not valid YAML (expected ',' or '}}', but got '{{': line 3 column 5)"
    assert_refused(capsys, [*argv, "--out", str(out)], message, leftover=out)
    # JSON's message points past a comma with nothing after it, at the next line: the comma's place is named too
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"tables": [GOOD]}, indent=1).replace("}\n ]", "},\n ]"))
    argv[2] = str(tables)
    message = "(Expecting value: line 9 column 2 (char 98); a comma with nothing after it at line 8 column 4?)"
    assert_refused(capsys, [*argv, "--out", str(out)], message, leftover=out)


def test_plan_refuses_missing_file_unknown_algo_and_infeasible_memory(tmp_path, capsys, table_file):
    out = tmp_path / "plan.json"
    base = ["plan", "--devices", "2", "--out", str(out)]
    assert_refused(
        capsys,
        base + ["--tables", str(tmp_path / "nope.json"), "--memory-gb", "1", "--algo", "random"],
        "not found",
        out,
    )
    assert_refused(  # a folder: once called not found, where it is there
        capsys,
        base + ["--tables", str(tmp_path), "--memory-gb", "1", "--algo", "random"],
        f"{tmp_path} is a folder, not a table file: give the file in it",
        out,
    )
    assert_refused(
        capsys, base + ["--tables", str(table_file), "--memory-gb", "1", "--algo", "magic"], "unknown algorithm", out
    )
    misspelt = base + ["--tables", str(table_file), "--memory-gb", "1", "--algo", "neuroshrd"]
    assert assert_refused(capsys, misspelt, "unknown algorithm 'neuroshrd'; known: ", out).endswith(
        "; did you mean neuroshard?"
    )
    assert_refused(
        capsys,
        base + ["--tables", str(table_file), "--memory-gb", "0.000001", "--algo", "size_greedy"],
        "table 'a' needs 0.000615 GiB",
        out,
    )
    assert_refused(
        capsys, base + ["--tables", str(table_file), "--memory-gb", "-1", "--algo", "random"], "--memory-gb", out
    )
    assert_refused(
        capsys, base + ["--tables", str(table_file), "--memory-gb", "nan", "--algo", "random"], "--memory-gb", out
    )


def test_evaluate_refuses_bad_plans_before_starting_ray(tmp_path, capsys, table_file):
    out = tmp_path / "result.json"
    plan = tmp_path / "plan.json"
    cases = [
        (
            {"num_devices": 2, "algorithm": "x", "shards": [{"table": "zz", "device": 0, "columns": [0, 4]}]},
            "not in the table file",
        ),
        (
            {"num_devices": 2, "algorithm": "x", "shards": [{"table": "a", "device": 0, "columns": [0, 6]}]},
            "multiples of 4",
        ),
        ({"num_devices": 0, "algorithm": "x", "shards": []}, "num_devices"),
    ]
    for doc, message in cases:
        plan.write_text(json.dumps(doc))
        assert_refused(
            capsys,
            ["evaluate", "--tables", str(table_file), "--plan", str(plan), "--out", str(out), "--memory-gb", "1"],
            message,
            out,
        )
    plan.write_text(
        json.dumps(
            {
                "num_devices": 1,
                "algorithm": "x",
                "shards": [{"table": n, "device": 0, "columns": [0, d]} for n, d in zip("abcde", (32, 64, 16, 32, 8))],
            }
        )
    )
    assert_refused(
        capsys,
        ["evaluate", "--tables", str(table_file), "--plan", str(plan), "--out", str(out), "--memory-gb", "0.00001"],
        "over the cap",
        out,
    )
    assert_refused(
        capsys, ["evaluate", "--tables", str(table_file), "--plan", str(plan), "--out", str(out)], "--memory-gb", out
    )


def test_console_errors_are_one_line_without_traceback(tmp_path):
    result = run_cli(
        "plan",
        "--tables",
        str(tmp_path / "missing.json"),
        "--devices",
        "2",
        "--memory-gb",
        "1",
        "--algo",
        "random",
        "--out",
        str(tmp_path / "p.json"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"shard-ray: error: table file not found: {tmp_path / 'missing.json'}"
    ]
    result = run_cli("plan", "--devices", "zero")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr and "did you mean" not in result.stderr


@pytest.mark.parametrize(
    "command", ["python -m shard_ray.interop.torchrec_step", "python experiments/gang_fidelity.py"]
)
def test_scripts_run_with_python_refuse_a_bad_flag_in_one_line(command):
    """The docs' `python -m ...` and `python experiments/...` as typed, from the top of the repository: a flag they
    do not know ends them in one line that says where their help is."""
    argv = [sys.executable, *command.split()[1:], "--bogus"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith("shard-ray: error: unrecognized argument --bogus"), done.stderr
    assert line.endswith(f"(see {command} --help)")
    assert "did you mean" not in line  # no flag is like "bogus" once the dashes every flag has are set aside


@pytest.mark.parametrize(
    "script, flags",
    [
        ("random_tasks", ["--out", "afile"]),
        ("planning_scale", ["--out", "afile"]),
        ("policy_against_search", ["--out", "afile"]),
        ("lower_bound", ["--tables", "missing.json", "--tasks", "1"]),
        ("calibration", ["--tables", "missing.json"]),
    ],
)
def test_experiments_refuse_an_out_that_is_a_file_and_a_missing_table_file_in_one_line(tmp_path, script, flags):
    """A new user's walk: an --out naming a file ended three experiments in a FileExistsError traceback, and
    `lower_bound.py` read its table files only after starting Ray and measuring its synthetic task (`calibration.py`
    only after calibrating its synthetic task, 6 minutes). Now each is one line, status 2, before anything is written
    or started."""
    (tmp_path / "afile").write_text("mine\n")
    argv = [sys.executable, str(REPO / "experiments" / f"{script}.py"), *flags]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith("shard-ray: error: "), done.stderr
    assert (
        "afile is a file, not a folder" if "afile" in flags else "--tables: table file not found: missing.json"
    ) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("command", ["models", "plan"])
def test_output_piped_to_a_reader_that_left_ends_quietly(tmp_path, table_file, command):
    """`shard-ray models | head -2`: the reader gone before the output ends, the command printed Python's
    BrokenPipeError traceback (from a new user's walk); now nothing on stderr and the status a closed pipe gives.
    A command given a file to write goes on to write it, output to nowhere (`plan --out p.json | head -2` left no
    p.json, another walk), and ends as it would have."""
    import os

    argv = ["models"]
    if command == "plan":
        argv = ["plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1", "--algo", "size_greedy"]
        argv += ["--out", str(tmp_path / "p.json")]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left before the first line: every write fails, as after `head` exits
    try:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "shard-ray"), *argv], stdout=write_end, stderr=subprocess.PIPE,
            text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == (0 if command == "plan" else 141) and done.stderr == "", done.stderr
    if command == "plan":
        assert json.loads((tmp_path / "p.json").read_text())["algorithm"] == "size_greedy"


def test_an_error_raised_in_an_actor_is_said_in_its_own_words_in_one_line():
    """An error an actor raises reaches the driver inside Ray's, with the worker's traceback (13 lines for an Adam
    plan on fbgemm's CPU kernels, from a new user's walk): the command prints the error's own line."""
    import ray.exceptions

    from shard_ray.cli import _own_words
    from shard_ray.errors import ShardRayError

    cause = ShardRayError("fbgemm's CPU kernels do not support Adam; profile Adam on a GPU")
    # what `ray.get` raises in the driver: Ray's error, made an instance of the cause's class too
    raised = ray.exceptions.RayTaskError("GangMember.run_plan", "Traceback (most recent call last):\n", cause)
    raised = raised.as_instanceof_cause()
    assert isinstance(raised, ShardRayError) and str(raised) != str(cause)  # the worker, its pid, its lines
    assert _own_words(raised) == str(cause) and _own_words(cause) == str(cause)


def test_a_misspelt_flag_or_command_gets_the_closest_known_one_with_the_one_prefix(capsys):
    refused = assert_refused(capsys, ["plan", "--tables", "t.json", "--memroy-gb", "4"], "--memroy-gb")
    assert refused == (
        "shard-ray: error: unrecognized argument --memroy-gb; did you mean --memory-gb? (see shard-ray plan --help)"
    )
    refused = assert_refused(capsys, ["costmodel", "trian"], "invalid choice: 'trian'")
    assert refused.startswith("shard-ray: error: ") and "did you mean train?" in refused
    # a command looked for that is another's work is said where it is, not "did you mean profile?" (a walk)
    refused = assert_refused(capsys, ["refine", "--help"], "invalid choice: 'refine'")
    assert refused.endswith("; refinement is `shard-ray plan --measure --refine`") and "did you mean" not in refused


def test_out_into_a_folder_that_does_not_exist_is_refused(tmp_path, capsys, table_file):
    missing = tmp_path / "no" / "such" / "folder"
    argv = ["plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1", "--algo", "random"]
    message = f"argument --out: folder {missing} does not exist; create it first"
    assert_refused(capsys, [*argv, "--out", str(missing / "plan.json")], message)
    assert not (tmp_path / "no").exists()
    # an output folder is created with its parents: tasks writes its files into it
    tasks = ["tasks", "--tables", str(table_file), "--num-tasks", "1", "--min-tables", "2", "--max-tables", "3"]
    assert main([*tasks, "--out", str(missing)]) == 0
    assert any(missing.iterdir())


def test_generate_from_a_dataset_file(tmp_path):
    import numpy as np
    import torch

    lengths = np.array([[1, 2, 0, 3], [2, 2, 2, 2]], dtype=np.int64)
    indices = torch.arange(int(lengths.sum()), dtype=torch.int64)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths.reshape(-1))]))
    data = tmp_path / "day.pt"
    torch.save((indices, offsets, torch.from_numpy(lengths)), data)
    out = tmp_path / "real.json"
    assert main(["generate", "--from-dataset", str(data), "--dim", "16", "--out", str(out)]) == 0
    tables = json.loads(out.read_text())["tables"]
    assert [t["pooling_factor"] for t in tables] == [1.5, 2.0] and all(t["rows"] == 100 for t in tables)


def _subcommands(parser, prefix=()):
    """Every runnable command path, e.g. ("costmodel", "train"), read from the parser itself."""
    import argparse

    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return [prefix]
    return [path for name, sub in actions[0].choices.items() for path in _subcommands(sub, (*prefix, name))]


def test_every_command_has_help_generated_from_its_settings(capsys):
    from shard_ray.cli import build_parser

    commands = _subcommands(build_parser())
    assert len(commands) >= 17
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        assert "usage: shard-ray " + " ".join(command) in capsys.readouterr().out


def test_a_commands_defaults_are_its_settings_dataclass(tmp_path, capsys):
    from dataclasses import replace

    from shard_ray.cli import build_parser
    from shard_ray.cli.flags import settings_from
    from shard_ray.workload.tasks import TaskConfig

    args = build_parser("tasks").parse_args(["tasks", "--tables", "p.json", "--out", "t"])
    assert settings_from(TaskConfig, args) == TaskConfig()
    args = build_parser("tasks").parse_args(["tasks", "--tables", "p.json", "--out", "t", "--num-tasks", "3"])
    assert settings_from(TaskConfig, args) == replace(TaskConfig(), num_tasks=3)
    with pytest.raises(SystemExit):
        main(["tasks", "--help"])
    assert f"tasks per split (default {TaskConfig().num_tasks})" in " ".join(capsys.readouterr().out.split())


def test_tuned_file_is_overridden_by_flags_given(tmp_path):
    from shard_ray.cli import build_parser
    from shard_ray.cli.flags import settings_from
    from shard_ray.costmodel.settings import TrainConfig

    args = build_parser("costmodel").parse_args(
        ["costmodel", "train", "--tables", "p", "--out", "m.pt", "--lr", "0.01"]
    )
    config = settings_from(TrainConfig, args, tuned={"lr": 0.5, "hidden": 32})
    assert (config.lr, config.hidden, config.depth) == (0.01, 32, TrainConfig().depth)


def test_a_sweep_takes_no_flag_for_a_setting_it_draws(capsys):
    """`tune policy` draws PPO's learning rate, width, minibatch... for every trial: a flag for one would be overridden
    without a word, so it has none (nor `--config`, a tuned file of them), while `policy train` has them all."""
    from shard_ray.cli.flags import flag_name
    from shard_ray.policy.settings import PolicyConfig
    from shard_ray.tuning.settings import POLICY_SWEPT

    flags = {f.name: flag_name(f.name, f.metadata) for f in fields(PolicyConfig) if "help" in f.metadata}
    flags = {name: flag for name, flag in flags.items() if name in POLICY_SWEPT}
    assert {"lr", "hidden", "minibatch_size"} <= set(flags)
    for command, offered in ((["policy", "train"], True), (["tune", "policy"], False)):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        shown = capsys.readouterr().out
        for flag in [*flags.values(), "--config"]:
            assert (f"{flag} " in shown) == offered, (command, flag)
    with pytest.raises(SystemExit) as refused:
        main(["tune", "policy", "--tables", "t.json", "--out", "s", flags["hidden"], "64"])
    assert refused.value.code == 2
    assert f"unrecognized argument {flags['hidden']}" in capsys.readouterr().err


def test_a_sweep_resumed_with_other_settings_is_refused_naming_them_by_their_flags(tmp_path):
    """Found by a new user's walk: `tune search` resumed with other task settings ranked the old trials' scores,
    priced on other tasks, beside the shipped settings' on the new ones, and wrote a configuration scored worse."""
    from shard_ray.errors import ShardRayError
    from shard_ray.io import write_json
    from shard_ray.policy.settings import PolicyConfig
    from shard_ray.tuning.sweep import ScoredWith, scored_with_file

    earlier = ScoredWith.of({"minibatch_size": 64, "num_epochs": 3, "tables": "abc"}, PolicyConfig, tables="the pool")
    write_json(scored_with_file(tmp_path, "policy"), earlier.values)  # as the first run wrote it
    earlier.refuse_other_in(tmp_path, "policy")  # the same values: resumed
    earlier.refuse_other_in(tmp_path, "search")  # a sweep of another kind: none there
    now = ScoredWith.of({"minibatch_size": 128, "num_epochs": 4, "tables": "abd"}, PolicyConfig, tables="the pool")
    with pytest.raises(ShardRayError) as refused:
        now.refuse_other_in(tmp_path, "policy")
    said = "(--minibatch 64 there, 128 now; num_epochs 3 there, 4 now; the pool abc there, abd now)"
    assert f"holds a policy sweep whose trials were scored otherwise {said}: give another --out" in str(refused.value)


def test_old_flag_names_still_work_with_a_note(tmp_path):
    pool = tmp_path / "pool.json"
    assert run_cli("generate", "--out", str(pool), "--num-tables", "30").returncode == 0
    result = run_cli(
        "tasks",
        "--pool",
        str(pool),
        "--out-dir",
        str(tmp_path / "t"),
        "--num-tasks",
        "1",
        "--min-tables",
        "3",
        "--max-tables",
        "5",
    )
    assert result.returncode == 0, result.stderr
    assert "--pool is now --tables" in result.stderr and "--out-dir is now --out" in result.stderr
    assert (tmp_path / "t" / "train_000.json").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--help"],
        ["compare", "--help"],
        ["compare", "--tables", "t.json", "--plans", "missing.json", "other.json"],
        ["profile", "--tables", "missing.json"],
        ["calibrate", "--tables", "missing.json", "--devices", "2"],
        ["costmodel", "train", "--tables", "missing.json", "--out", "m.pt"],
        ["policy", "train", "--tables", "missing.json", "--out", "p"],
        ["policy", "outer-loop", "--tables", "missing.json", "--out", "p"],
        ["tune", "costmodel", "--tables", "missing.json", "--out", "s"],
        ["tune", "costmodel", "--tables", "t.json", "--store", "empty.db", "--no-mlflow", "--out", "s"],
        ["costmodel", "train", "--tables", "t.json", "--store", "empty.db", "--out", "m.pt"],
        ["tune", "search", "--tables", "missing.json", "--out", "s"],
        ["tune", "policy", "--tables", "missing.json", "--out", "s"],
        ["bench", "--tables", "missing.json"],
        ["collect", "--help"],
        ["calibrate", "--help"],
        ["costmodel", "train", "--epochs", "0"],
        ["models", "--bogus"],
        ["policy", "train", "--help"],
        ["policy", "outer-loop", "--rounds", "zero"],
        ["bench", "--devices", "0"],
        ["demo", "--help"],
        ["tune", "search", "--max-evaluations", "0"],
        ["plan", "--devices", "zero"],
        ["plan", "--tables", "missing.json", "--devices", "2", "--memory-gb", "1", "--out", "p.json"],
        ["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "1", "--hardware", "tpu", "--out", "p.json"],
        ["evaluate", "--tables", "t.json", "--plan", "p.json", "--address", "http://127.0.0.1:8265"],
        ["generate", "--out", "pool.json", "--num-tables", "30"],
        ["tasks", "--tables", "t.json", "--out", "tasks", "--num-tasks", "1", "--min-tables", "1", "--max-tables", "1"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_help_and_bad_commands_answer_without_loading_torch_or_ray(argv, tmp_path):
    """Help, refusals of what a user typed and the commands that need neither answer in a fraction of a second: no
    torch, Ray or MLflow (2-4 s of imports each time) before the input is known good."""
    code = (
        "import sys\n"
        "from shard_ray.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'mlflow') if m in sys.modules))"
    )
    tables = [{"name": f"t{i}", "rows": 100, "dim": 8, "pooling_factor": 1.0} for i in range(4)]
    (tmp_path / "t.json").write_text(json.dumps({"tables": tables}))
    with MeasurementStore(tmp_path / "empty.db"):
        pass  # a store of no measurements: nothing to train on, refused before torch loads
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
    if argv[0] in ("generate", "tasks"):
        assert result.stderr == "" and "wrote" in result.stdout, result.stdout + result.stderr
    elif "--help" not in argv:
        assert result.stderr.startswith(("shard-ray: error: ", "usage: ")), result.stderr


@pytest.mark.parametrize("algorithm", ["size_greedy", "cost_search", "neuroshard", "optimal", "dreamshard"])
def test_plan_prices_without_loading_torch(algorithm, tmp_path):
    """`plan` reads the cost models and prices plans in numpy (`shard_ray.costmodel.models`), and a policy's weights
    (`shard_ray.policy.policy_file`): a search, a heuristic or the policy on a hand-written table file plans without
    importing torch (a second of a plan's 1.3 s on the AMD EPYC), and the plan it writes is priced."""
    tables = [
        {"name": f"t{i}", "rows": 1000 * (i + 1), "dim": 16 * (1 + i % 2), "pooling_factor": 2.0} for i in range(6)
    ]
    (tmp_path / "t.json").write_text(json.dumps({"tables": tables}))
    argv = ["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "1", "--algo", algorithm, "--out", "p.json"]
    code = f"import sys\nfrom shard_ray.cli import main\nmain({argv!r})\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout + result.stderr
    assert load_plan(tmp_path / "p.json").estimate.predicted.cost_ms > 0


def test_a_measuring_commands_driver_leaves_torch_to_its_device_actors():
    """The modules a measuring command's own process runs (`compare`, `evaluate`: the gang, the profiling pool, the
    measurement store, the comparison) import no torch: the gang's members and the profiling actors import it, and
    fbgemm, in their own processes."""
    modules = ["shard_ray.cli.measure", "shard_ray.workflows.comparison", "shard_ray.profiling.gang"]
    modules += ["shard_ray.profiling.actors", "shard_ray.profiling.store"]
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


@pytest.mark.parametrize("record", [None, "127.0.0.1:{port}"])
def test_address_auto_with_no_cluster_is_one_line_and_status_2(tmp_path, table_file, record):
    """The clusters page's `--address auto` where no cluster runs, said in a line within seconds: where no `ray
    start` is recorded, and where the one recorded (/tmp/ray/ray_current_cluster) has since stopped, which Ray
    itself would retry for minutes.

    `auto` finds any Ray on the machine by its processes (other tests' among them) and by that record, so the
    command runs in PID and mount namespaces of its own, its /tmp/ray a folder of the test's (`unshare`, as root:
    every machine of this project is)."""
    import os
    import shlex
    import shutil
    import time

    from ports import free_port

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("namespaces of its own need root and unshare(1)")
    plan = _two_device_plan(tmp_path)
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    if record is not None:
        record = record.format(port=free_port())
        (ray_tmp / "ray_current_cluster").write_text(record)
    # Ray reads its record from $RAY_TMPDIR/ray where that is set (a user's, as the docs suggest): the test's is bound
    # at /tmp/ray, so the command looks there (a walk's RAY_TMPDIR failed this test, the command right)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    evaluate = [SHARD_RAY, "evaluate", "--tables", str(table_file), "--plan", str(plan), "--memory-gb", "1"]
    evaluate += ["--address", "auto"]
    inside = (
        f"mkdir -p /tmp/ray && mount --bind {ray_tmp} /tmp/ray && exec {shlex.join([*evaluate, '--out', 'r.json'])}"
    )
    began = time.monotonic()
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private", "sh", "-c", inside],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    if record is None:
        assert lines[0].startswith("shard-ray: error: no Ray cluster at auto"), lines
    else:  # Ray resolves 127.0.0.1 to this node's address
        assert lines[0].startswith("shard-ray: error: nothing answers at the Ray address "), lines
        assert f":{record.rpartition(':')[2]} (which auto found" in lines[0], lines
    assert time.monotonic() - began < 30
    assert not (tmp_path / "r.json").exists()


def test_evaluate_refuses_more_devices_than_the_machine_holds_before_starting_ray(tmp_path, table_file):
    import os
    import time

    plan = tmp_path / "huge.json"
    shards = [
        {"table": n, "device": i, "columns": [0, d]} for i, (n, d) in enumerate(zip("abcde", (32, 64, 16, 32, 8)))
    ]
    plan.write_text(json.dumps({"num_devices": 500, "algorithm": "x", "shards": shards}))
    shard_ray = str(Path(sys.executable).parent / "shard-ray")  # the console script `make setup` installs
    began = time.perf_counter()
    result = subprocess.run(
        [
            shard_ray,
            "evaluate",
            "--tables",
            str(table_file),
            "--plan",
            str(plan),
            "--memory-gb",
            "1",
            "--out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "500 devices" in lines[0] and "--address" in lines[0], lines
    assert time.perf_counter() - began < 60 and not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a local Ray's devices are this machine's GPUs, which run Adam")
def test_plans_of_adam_are_refused_cpu_devices_before_a_local_ray_starts(tmp_path, table_file, capsys):
    """fbgemm's CPU kernels have no Adam: `evaluate`, `compare` and `plan --measure` of Adam plans started a local
    Ray and a gang, and failed in its first step with the actor's traceback, 7-10 s in (from a new user's walk)."""
    import os

    plans = [tmp_path / "a.json", tmp_path / "b.json"]
    for algo, path in zip(("size_greedy", "round_robin"), plans):
        argv = ["plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1", "--optimizer", "adam"]
        assert main([*argv, "--algo", algo, "--out", str(path)]) == 0
    capsys.readouterr()
    shard_ray = str(Path(sys.executable).parent / "shard-ray")
    local = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray, on this machine's CPUs
    out = tmp_path / "r.json"
    for command in (
        ["evaluate", "--tables", str(table_file), "--plan", str(plans[0]), "--out", str(out), "--no-mlflow"],
        ["compare", "--tables", str(table_file), "--plans", *map(str, plans), "--no-mlflow"],
        ["plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1", "--optimizer", "adam",
         "--algo", "size_greedy", "--measure", "--out", str(out)],
    ):  # fmt: skip
        done = subprocess.run([shard_ray, *command], capture_output=True, text=True, timeout=120, env=local)
        assert done.returncode == 2 and done.stderr == (
            "shard-ray: error: fbgemm's CPU kernels do not support Adam; profile Adam on a GPU\n"
        ), done.stderr
        assert "ray:" not in done.stdout and not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--algo", "cost_search", "--set", "local_search_steps=1.5"], "local_search_steps"),
        (["--algo", "cost_search", "--set", "split_ways=7"], "split_ways"),
        (["--algo", "dreamshard", "--set", "samples=abc"], "samples"),
        (["--algo", "cost_search", "--set", "beam_width"], "NAME=VALUE"),
        (["--algo", "random", "--device", "2"], "--devices"),
        (["--algo", "random", "--devices-per-host", "3"], "does not divide 2 devices"),
        (["--algo", "random", "--inter-host-gbps", "1"], "between hosts, and without --devices-per-host these"),
        (["--algo", "random", "--devices-per-host", "2", "--host-link-gbps", "1"], "--devices-per-host 2 puts these 2"),
        (["--algo", "random", "--refine"], "--refine refines the plan --measure chooses: give --measure too"),
        (["--algo", "random", "--incumbent", "x.json"], "--incumbent is the plan --measure races against"),
        (["--algo", "neuroshard", "--set", "max_evaluations=0"], "max_evaluations must be at least 1"),
        (["--algo", "cost_search", "--set", "time_budget_s=3"], "use max_evaluations"),
        (
            ["--algo", "cost_search", "--set", "start=policies"],
            "start: must be 'auto', 'greedy' or 'policy', got \"policies\"",
        ),
        (["--algo", "cost_search", "--set", "start=1"], "start: must be 'auto', 'greedy' or 'policy', got 1"),
        (["--algo", "cost_search", "--set", "start=greedy", "--policy", "runs/policy"], "leave --policy out"),
        (["--algo", "dreamshard", "--samples", "8", "--set", "samples=2"], "--samples 8 and --set samples=2 disagree"),
        (["--algo", "cost_search", "--samples", "4"], "--samples draws plans from dreamshard's policy; 'cost_search'"),
        (["--algo", "cost_search", "--set", "start=policy", "--set", "start=greedy"], "--set start given twice"),
    ],
)
def test_plan_refuses_badly_typed_settings_and_abbreviated_flags(tmp_path, capsys, table_file, flags, message):
    out = tmp_path / "plan.json"
    argv = ["plan", "--tables", str(table_file), "--memory-gb", "1", "--out", str(out), *flags]
    if "--device" not in flags:
        argv += ["--devices", "2"]
    assert_refused(capsys, argv, message, out)


def test_bench_refuses_a_rate_between_hosts_for_devices_on_one_host(tmp_path, capsys, table_file):
    """A link rate without --devices-per-host priced nothing, silently (from a new user's walk)."""
    out = tmp_path / "bench"
    argv = ["bench", "--tasks", "0", "--tables", str(table_file), "--devices", "2", "--out", str(out)]
    assert_refused(capsys, [*argv, "--inter-host-gbps", "1"], "--inter-host-gbps prices the links between hosts", out)


@pytest.mark.slow
def test_calibrate_over_more_hosts_than_nodes_is_refused_before_measuring(tmp_path, capsys, table_file):
    out = tmp_path / "models.pt"
    argv = ["calibrate", "--tables", str(table_file), "--devices", "4", "--devices-per-host", "2", "--out", str(out)]
    # said by the gang where this process's Ray is up (an earlier test's), else before a local one starts
    assert_refused(capsys, argv, "a gang of 2 hosts", out)


def test_a_gang_of_hosts_is_refused_before_a_local_ray_starts(tmp_path, table_file):
    """A local Ray is one node, and a gang of hosts needs one each: refused before the Ray starts, where it started
    and then said so (a few seconds of a Ray for nothing)."""
    plan = tmp_path / "plan.json"
    flags = ["--tables", str(table_file), "--memory-gb", "1"]
    done = run_cli(
        "plan", *flags, "--devices", "4", "--devices-per-host", "2", "--algo", "size_greedy", "--out", str(plan)
    )
    assert done.returncode == 0, done.stderr
    done = run_cli("evaluate", *flags, "--plan", str(plan), "--no-mlflow", "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2 and "ray:" not in done.stdout, done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert "a gang of 2 hosts needs 2 Ray nodes, one a host, and a local Ray is one node" in line


def test_bench_into_a_folder_of_other_settings_names_them_before_a_local_ray_starts(tmp_path, table_file):
    """Found by a new user's walkthrough: a bench resumed with another --rounds was refused only after a local Ray
    started (7-10 s), and without saying which setting differed."""
    from shard_ray.io import write_json
    from shard_ray.workflows.settings import BenchmarkConfig

    out = tmp_path / "bench"
    earlier = BenchmarkConfig(tasks=0, table_files=(str(table_file),), rounds=3, out=str(out))
    write_json(earlier.settings_file, earlier.recorded())  # as the earlier run's gang wrote it
    done = run_cli("bench", "--tasks", "0", "--tables", str(table_file), "--out", str(out), "--no-mlflow")
    assert done.returncode == 2 and "ray:" not in done.stdout, done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert f"holds tasks measured with other settings (--rounds 3 there, {BenchmarkConfig().rounds} now)" in line
    assert sorted(p.name for p in out.rglob("*")) == ["settings.json", "tasks"]


def test_tune_costmodel_on_a_store_without_the_measurements_is_refused_before_a_local_ray_starts(tmp_path, table_file):
    """Found by a new user's walkthrough: a store lacking the hardware asked for was refused after a local Ray had
    started (7-10 s for nothing)."""
    with MeasurementStore(tmp_path / "measurements.db"):
        pass  # a store of no measurements
    flags = ["--store", str(tmp_path / "measurements.db"), "--tables", str(table_file), "--no-mlflow"]
    for extra, said in (([], "no successful shard measurements"), (["--hardware", "tpu"], "no successful shard")):
        done = run_cli("tune", "costmodel", *flags, "--out", str(tmp_path / "sweep"), *extra)
        assert done.returncode == 2 and "ray:" not in done.stdout, done.stdout
        (line,) = done.stderr.strip().splitlines()
        assert said in line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_bench_over_more_hosts_than_nodes_is_refused_and_leaves_nothing_that_refuses_the_next_run(
    tmp_path, capsys, table_file
):
    """Found by a new user's walkthrough: a bench refused for want of Ray nodes wrote its settings first, and the
    corrected command to the same folder was then refused for 'tasks measured with other settings'."""
    out = tmp_path / "bench"
    argv = ["bench", "--tasks", "0", "--tables", str(table_file), "--devices", "2", "--devices-per-host", "1"]
    said = assert_refused(capsys, [*argv, "--no-mlflow", "--out", str(out)], "needs 2 Ray nodes", out / "tasks")
    assert "shard-ray hosts run" in said


SHARD_RAY = str(Path(sys.executable).parent / "shard-ray")  # the console script `make setup` installs


def plan_with(tables: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [SHARD_RAY, "plan", "--tables", str(tables), "--out", str(out), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_version_prints_the_installed_release():
    """`shard-ray --version`, as docs/commands.md gives it: the release pip installed, status 0; after a command it
    is no flag of that command's, refused in one line."""
    from importlib.metadata import version

    done = subprocess.run([SHARD_RAY, "--version"], capture_output=True, text=True, timeout=60)
    # run from this checkout (`make setup` installs it in place): its commit too, as the README names releases by it
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert done.returncode == 0 and done.stdout.startswith(f"shard-ray {version('shard-ray')} (commit {head.strip()}")
    done = subprocess.run([SHARD_RAY, "plan", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done


@pytest.mark.slow
def test_a_search_cut_by_its_budget_plans_alike_beside_a_busy_process(tmp_path):
    """Budgets count model evaluations: the same plan on an idle machine and beside processes
    keeping every core busy, where a wall-clock budget reached less (and planned otherwise)."""
    import os

    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    tables = tmp_path / "pool.json"
    save_tables(tables, generate_pool(PoolConfig(num_tables=120, seed=3)))
    flags = (
        "--devices",
        "8",
        "--memory-gb",
        "12",
        "--algo",
        "cost_search",
        "--seed",
        "4",
        "--set",
        "max_evaluations=60000",
    )
    idle = plan_with(tables, tmp_path / "idle.json", *flags)
    assert idle.returncode == 0, idle.stderr[-2000:]
    assert "the budget of 60,000 model evaluations ended the search" in idle.stderr  # the budget binds
    said = ("of its budget of 60,000 model evaluations", "model evaluations: its budget of 60,000 reached mid-batch")
    assert any(f"{words} (--set max_evaluations=N)" in idle.stdout for words in said), idle.stdout
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        busy = plan_with(tables, tmp_path / "busy.json", *flags)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert busy.returncode == 0, busy.stderr[-2000:]
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("idle", "busy"))
    assert first.pop("placement_seconds") > 0 and second.pop("placement_seconds") > 0
    assert first == second


def test_optimal_cut_by_its_budget_writes_the_best_plan_it_found_and_says_it_is_not_proven(capsys, tmp_path):
    """Branch and bound is exponential in the tables: a walk's 12 tables on 8 devices ran for 10 minutes with no way
    to stop it but a Ctrl-C. Its budget counts model evaluations, as the searches' do: `--set max_evaluations=N`
    ends it at the same plan on any machine, written, with a warning that it is the best found, not proven optimal;
    a small task is proven within the default budget."""
    tables = [
        {"name": f"t{i}", "rows": 5_000 * (i + 1), "dim": 16 * (1 + i % 3), "pooling_factor": 1.0 + i % 4}
        for i in range(12)
    ]
    (tmp_path / "t.json").write_text(json.dumps({"tables": tables}))
    plans = []
    for name in ("a", "b"):
        done = shard_ray_here(
            capsys, "plan", "--tables", str(tmp_path / "t.json"), "--devices", "4", "--memory-gb", "1",
            "--algo", "optimal", "--set", "max_evaluations=20000", "--out", str(tmp_path / f"{name}.json"),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "warning: the budget of 20,000 model evaluations ended the search" in done.stderr
        assert "the plan is the best found, not proven optimal" in done.stderr
        plans.append(load_plan(tmp_path / f"{name}.json"))
    assert plans[0].search.proven_optimal is False and plans[0].shards == plans[1].shards
    (tmp_path / "few.json").write_text(json.dumps({"tables": tables[:5]}))
    done = shard_ray_here(
        capsys, "plan", "--tables", str(tmp_path / "few.json"), "--devices", "2", "--memory-gb", "1",
        "--algo", "optimal", "--out", str(tmp_path / "few_plan.json"),
    )  # fmt: skip
    assert done.returncode == 0 and "not proven" not in done.stderr, done.stderr
    assert "proven the best table-wise plan under these models" in done.stdout
    assert load_plan(tmp_path / "few_plan.json").search.proven_optimal


@pytest.mark.slow
def test_neuroshard_cut_by_a_small_budget_or_time_limit_writes_its_plan(capsys, tmp_path):
    """NeuroShard runs as published with no budget; a budget or time limit a user sets ends it with a
    warning, the plan written and no traceback."""
    from shard_ray.workload.synthetic import PoolConfig, generate_pool
    from shard_ray.workload.tables import save_tables

    tables = tmp_path / "pool.json"
    save_tables(tables, generate_pool(PoolConfig(num_tables=1500, seed=1)))
    for setting, told in (
        ("max_evaluations=5000", "the budget of 5,000 model evaluations ended the search"),
        ("time_limit_s=0.05", "the 0.05 s time limit ended the search"),
    ):
        out = tmp_path / "plan.json"
        done = shard_ray_here(
            capsys, "plan", "--tables", str(tables), "--out", str(out), "--devices", "128", "--memory-gb", "24",
            "--algo", "neuroshard", "--set", setting,
        )  # fmt: skip
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert told in done.stderr
        assert json.loads(out.read_text())["algorithm"] == "neuroshard"
        out.unlink()


NEIGHBOUR = """
import json, sys
from shard_ray import neighbours
neighbours.arrive()
print("arrived", flush=True)
sys.stdin.readline()
print(json.dumps(neighbours.measured_beside()))
neighbours.leave()
"""


def start_neighbour(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process entered among the commands running with a local Ray of their own (as `connect_ray` enters one),
    as `shard-ray ARGV`; it leaves when a line comes on its standard input, or ends with it."""
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert neighbour.stdout.readline() == "arrived\n", neighbour.stderr.read()
    return neighbour


def test_commands_each_with_a_local_ray_of_their_own_are_told_of_one_another(tmp_path, monkeypatch):
    """Two commands measuring at once, each on a local Ray of its own, shared the cores without a word (a walk: a
    `compare` measured 8.82 ms against 4.9-5.6 alone). The one started second is told at its start, the first at its
    end; one that ended without leaving (SIGKILL) is not reported, and its entry is removed."""
    import os

    monkeypatch.setenv("SHARD_RAY_HOME", str(tmp_path / "home"))
    killed = start_neighbour("calibrate", "--tables", "killed.json")
    killed.kill()
    killed.wait()
    first = start_neighbour("compare", "--plans", "a.json", "b.json")
    second = start_neighbour("evaluate", "--plan", "a b.json")
    second_recorded, second_said = second.communicate("\n", timeout=60)
    first_recorded, first_said = first.communicate("\n", timeout=60)
    assert second.returncode == first.returncode == 0, second_said + first_said
    # what a measurement of each records in its warnings: the other, whichever started first
    for recorded, other in ((second_recorded, "compare --plans a.json b.json"), (first_recorded, "evaluate --plan")):
        (line,) = json.loads(recorded)
        assert line.startswith(f"measured while another shard-ray command ran on this machine with a Ray of its own "
                               f"(`shard-ray {other}"), line  # fmt: skip
    (line,) = second_said.splitlines()
    assert line.startswith(
        "warning: another shard-ray command is running on this machine, with a Ray of its own "
        "(`shard-ray compare --plans a.json b.json`): they share its cores, and what any measures is slowed; "
        "run them one after the other, or start one head on this machine as docs/clusters.md's 'On a new cluster' "
        "says (`ray start --head --port 6379` with RAY_AUTH_MODE=token and RAY_worker_niceness=0) and give each "
        "`--address 127.0.0.1:6379`, so that they take turns on its devices"
    ), line
    (line,) = first_said.splitlines()
    assert line.startswith(
        "warning: another shard-ray command started on this machine while this one ran, with a Ray of its own "
        "(`shard-ray evaluate --plan 'a b.json'`): they shared its cores, and what any measured was slowed"
    ), line
    assert os.listdir(tmp_path / "home" / "running") == []  # the killed one's entry too


@pytest.mark.slow
def test_a_command_exits_without_teardown_yet_stops_its_local_ray_and_writes_everything(tmp_path, table_file):
    """The console script ends with `os._exit` after Ray's shutdown, threads and exit handlers
    (`shard_ray.cli.console`): the local Ray it started is gone the moment it exits, its result file and MLflow run
    are whole."""
    import os
    import sqlite3
    import time
    import uuid

    shard_ray = str(Path(sys.executable).parent / "shard-ray")
    tag = uuid.uuid4().hex  # in the environment of every process the command starts, Ray's among them
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"SHARD_RAY_TEST_TAG": tag}
    plan = subprocess.run(
        [shard_ray, "plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "1",
         "--algo", "size_greedy", "--out", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    neighbour = start_neighbour("compare")  # a command with a local Ray of its own, running on
    try:
        done = subprocess.run(
            [shard_ray, "evaluate", "--tables", str(table_file), "--plan", str(tmp_path / "plan.json"),
             "--rounds", "1", "--warmup", "1", "--repeats", "2", "--out", str(tmp_path / "result.json")],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:
        told = neighbour.communicate("\n", timeout=60)[1]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray: started a local instance" in done.stdout
    # told of the other at its start (connect_ray enters it among the commands running with a local Ray of their own)
    assert "warning: another shard-ray command is running on this machine, with a Ray of its own " in done.stderr
    assert neighbour.returncode == 0 and "started on this machine while this one ran" in told, told
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["cost_ms"] > 0
    # and the result says so, for whoever reads it later (a walk: 14.32 ms beside another against 8.84 alone, no word)
    assert any(w.startswith("measured while another shard-ray command ran on this machine") for w in result["warnings"])
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        (finished,) = db.execute("select count(*) from runs where status = 'FINISHED'").fetchone()
    assert finished == 1
    time.sleep(1)  # shutdown waited for Ray's processes; a second for any that were only signalled
    assert not _processes_with(tag), "processes the command started outlived it"


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, moment",
    [
        ("SIGINT", "raylet"),
        ("SIGTERM", "raylet"),
        ("SIGTERM", "ray::GangMember"),
        ("SIGTERM to the group", "ray::GangMember"),
        ("SIGINT twice", "ray::GangMember"),
    ],
    ids=[
        "ctrl-c-as-ray-starts",
        "sigterm-as-ray-starts",
        "sigterm-while-measuring",
        "timeout-while-measuring",
        "ctrl-c-twice-while-measuring",
    ],
)
def test_a_stopped_command_says_so_and_leaves_none_of_its_ray_running(tmp_path, table_file, signum, moment):
    """A Ctrl-C that lands inside `ray.init` of the command's local Ray (its raylet just started): the command still
    says `interrupted` in a line with status 130, and the Ray it had started ends with it, where its raylet's agents
    had run on, orphaned, for minutes (`connect_ray` holds the Ctrl-C until the Ray is up, then stops it). A SIGTERM
    there: the same, with `terminated` and status 143, where the handler `ray.init` puts in for its length ended the
    command with status 15, not a word, and those agents left running. A SIGTERM
    (`timeout`, a scheduler) while its gang measures: `terminated`, status 143, likewise, where Ray's own handler,
    which `ray.init` installs, aborted the command with a crash dump and status 134. A SIGTERM to the command's whole
    process group, as `timeout` sends it (Ray's processes stopping with the command): the same, where the command
    waited on its raylet gone, spinning a core, until Ray aborted it a minute later. A second Ctrl-C as the first
    one's `interrupted` is said, while the command stops its Ray: the same (a new user's walk had a traceback)."""
    import os
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    evaluate = [
        str(Path(sys.executable).parent / "shard-ray"), "evaluate", "--tables", str(table_file), "--plan",
        str(_two_device_plan(tmp_path)), "--memory-gb", "1", "--rounds", "500", "--no-mlflow",
        "--out", str(tmp_path / "r.json"),
    ]  # fmt: skip
    # a session of its own: Ray's processes are in it (their environment is no mark: the agents rewrite theirs). A
    # Ctrl-C as at a terminal: a suite started as a background job of a script (`make test &`) has SIGINT ignored,
    # which its processes inherit, and Python then leaves a Ctrl-C ignored (this test failed so in a fresh clone's run)
    command = subprocess.Popen(
        evaluate, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip

    def in_its_session() -> dict[int, str]:
        """Its session's live processes, each with its name and command line."""
        found = {}
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit():
                    fields = (proc / "stat").read_text().rpartition(")")[2].split()
                    if int(fields[3]) == command.pid and fields[0] != "Z":  # its session, not a zombie
                        line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        found[int(proc.name)] = f"{(proc / 'comm').read_text().strip()} {line}"
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 120
    while not any(moment in seen.split() or f" {moment}" in seen for seen in in_its_session().values()):
        assert command.poll() is None and time.monotonic() < deadline, f"no {moment} started"
        time.sleep(0.05)
    if signum == "SIGTERM to the group":
        os.killpg(command.pid, signal.SIGTERM)  # its session's one group: the command and Ray's processes
    else:
        command.send_signal(getattr(signal, signum.split()[0]))
    said_before = ""
    if signum == "SIGINT twice":
        while not said_before.endswith("shard-ray: interrupted\n"):
            line = command.stderr.readline()
            assert line, said_before
            said_before += line
        command.send_signal(signal.SIGINT)
    out, err = command.communicate(timeout=120)
    err = said_before + err
    code, said = (143, "terminated") if signum.startswith("SIGTERM") else (130, "interrupted")
    assert command.returncode == code and err.strip().splitlines()[-1] == f"shard-ray: {said}", out + err
    assert "Traceback" not in err and "SIGTERM received" not in err and not (tmp_path / "r.json").exists()
    deadline = time.monotonic() + 30
    try:
        while left := in_its_session():
            assert time.monotonic() < deadline, f"the stopped command's Ray outlived it: {left}"
            time.sleep(0.5)
    finally:  # what the assertion found, stopped by its process ids
        for pid in in_its_session():
            os.kill(pid, signal.SIGKILL)


def _processes_with(tag: str) -> list[int]:
    """The live processes whose environment holds `tag`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize(
    "answer",
    # the server that says nothing is waited for (`ANSWER_TIMEOUT_S`, 15 s): not a quick test, it runs in `make test`
    [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n", pytest.param(None, marks=pytest.mark.slow(seconds=16))],
)
def test_an_address_where_something_else_answers_is_refused_in_a_line(tmp_path, table_file, answer):
    """An --address where a server that is not a Ray head listens (one that closes at once, an HTTP/1 server, one
    that says nothing): refused in one line within seconds, where ray.init would retry for minutes."""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(connection)
            if answer is not None:
                connection.recv(1024)
                connection.sendall(answer)
                connection.close()

    threading.Thread(target=serve, daemon=True).start()
    plan = _two_device_plan(tmp_path)
    began = time.monotonic()
    try:
        result = run_cli(
            "evaluate", "--tables", str(table_file), "--plan", str(plan), "--memory-gb", "1",
            "--address", f"127.0.0.1:{port}", "--out", str(tmp_path / "r.json"),
        )  # fmt: skip
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"something answers at 127.0.0.1:{port}, but not as a Ray head does" in lines[0]
    assert time.monotonic() - began < 30 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "address, said",
    [
        ("http://127.0.0.1:8265", "http://127.0.0.1:8265 is a web address, such as the dashboard's"),
        ("nohost", "no Ray cluster at nohost"),
        ("127.0.0.1:6391x", "the Ray address 127.0.0.1:6391x has no port number ('6391x' after its last colon)"),
    ],
)
def test_an_address_that_is_no_ray_address_is_refused_in_a_line(tmp_path, table_file, address, said):
    """The dashboard's address, which the clusters page gives `ray job submit`, an address with no port and one
    whose port is no number: one line, status 2, where Ray raised a ValueError's traceback (or, of the last, named an
    address of its own making)."""
    line, _ = _evaluate_refused(tmp_path, table_file, "--address", address)
    assert said in line


@pytest.mark.parametrize(
    "uri, said",
    [
        ("bogus://nowhere", "--tracking-uri bogus://nowhere: no MLflow store takes bogus:// URIs"),
        ("sqlite:///{tmp}/no/such/mlflow.db", "folder {tmp}/no/such does not exist; create it first"),
        ("http://127.0.0.1:{port}", "--tracking-uri http://127.0.0.1:{port}: nothing answers there"),
    ],
)
def test_a_tracking_uri_runs_could_not_be_logged_to_is_refused_before_measuring(tmp_path, table_file, uri, said):
    """A scheme no MLflow store takes, an SQLite store in a folder that does not exist, a tracking server nothing
    answers at: one line, status 2, before any measuring, where each came after it as a traceback (or minutes of
    MLflow's retries), and no folder made."""
    import socket
    import time

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    uri, said = (text.format(tmp=tmp_path, port=port) for text in (uri, said))
    began = time.monotonic()
    line, printed = _evaluate_refused(tmp_path, table_file, "--tracking-uri", uri)
    assert said in line and "ray:" not in printed and time.monotonic() - began < 30
    assert not (tmp_path / "no").exists()


def test_a_plan_not_measured_logs_nothing_and_checks_no_tracking_uri(tmp_path, table_file):
    """`plan` without --measure writes no MLflow run, so a tracking server that is down (MLFLOW_TRACKING_URI of a
    shell set for other commands) does not stop it; with --measure it is refused before the placing."""
    import os

    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}
    plan = [sys.executable, "-m", "shard_ray.cli", "plan", "--tables", str(table_file), "--devices", "2",
            "--memory-gb", "1", "--algo", "size_greedy", "--out", str(tmp_path / "p.json")]  # fmt: skip
    done = subprocess.run(plan, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "p.json").exists(), done.stderr
    (tmp_path / "p.json").unlink()
    done = subprocess.run([*plan, "--measure"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "MLFLOW_TRACKING_URI http://127.0.0.1:1: nothing answers there" in done.stderr
    assert not (tmp_path / "p.json").exists() and "placed" not in done.stdout


def _evaluate_refused(tmp_path: Path, table_file: Path, *flags: str) -> tuple[str, str]:
    """`evaluate` of a hand-written plan (`_two_device_plan`) with `flags`, refused: its one line of error (status
    2, no result written) and what it printed before."""
    result = run_cli(
        "evaluate", "--tables", str(table_file), "--plan", str(_two_device_plan(tmp_path)), "--memory-gb", "1",
        *flags, "--out", str(tmp_path / "r.json"),
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and not (tmp_path / "r.json").exists(), result.stderr
    return lines[0], result.stdout


def _two_device_plan(tmp_path: Path) -> Path:
    """A plan file written by hand for conftest's five tables on 2 devices, for commands refused before they run."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"num_devices": 2, "algorithm": "x", "shards": [
        {"table": n, "device": i % 2, "columns": [0, d]} for i, (n, d) in enumerate(zip("abcde", (32, 64, 16, 32, 8)))
    ]}))  # fmt: skip
    return plan


def test_a_stopped_commands_last_line_starts_a_line_of_its_own_after_an_open_progress_bar():
    """A Ctrl-C in a loop a progress bar drives leaves the bar open: `shard-ray: interrupted` was written after its
    carriage return, on the bar's line of a log file (a walk). The bars are closed first."""
    import io

    from tqdm import tqdm

    from shard_ray.cli import _close_progress_bars

    log = io.StringIO()
    steps = iter(tqdm(range(10), file=log, mininterval=0))
    next(steps), next(steps)
    _close_progress_bars()
    log.write("shard-ray: interrupted\n")
    last = log.getvalue().rsplit("\r", 1)[-1]  # the bar's last state, and what came after it
    assert last.startswith(" 10%|") and last.endswith("\nshard-ray: interrupted\n"), repr(log.getvalue())
