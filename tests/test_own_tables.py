"""docs/own-tables.md as a new user runs it: every command on the page, as written, in a folder of their own."""

import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from pages import DOCS, code_blocks

from shard_ray.cli import build_parser
from shard_ray.plan.plan import load_plan
from shard_ray.profiling.store import MeasurementStore
from shard_ray.workload.tables import load_tables

REPO = Path(__file__).resolve().parent.parent
PAGE = "own-tables.md"


def _user_shell(home: Path, folder: Path, command: str) -> subprocess.CompletedProcess:
    """`command` in bash, in `folder`, shard-ray's environment activated as the page says, in a shell of a new
    user: HOME their own, no Ray, MLflow or shard-ray settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "MLFLOW_", "SHARD_RAY_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")
    }
    script = f"source {shlex.quote(str(REPO / '.venv' / 'bin' / 'activate'))}\ncd {shlex.quote(str(folder))}\n{command}"
    return subprocess.run(
        ["bash", "-c", script], env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=900
    )


# The page's commands that read no file the chain calibrate -> plan --measure -> compare -> export writes, and whose
# checks hold whichever models price their plans (the calibrated ones on the page, the shipped ones apart): the page
# runs as two tests, each in a folder and home of its own (each writing the table file it reads), side by side in a
# pytest-xdist pass, where one test of all of it was the suite's longest (docs/install.md).
APART = (
    "shard-ray doctor ",
    "cat > cpu_ranks.yaml",
    "shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --constraints ",
    "shard-ray export --plan cpu_plan.json ",
    "python -m shard_ray.interop.torchrec_step ",
    "shard-ray plan --tables my_model.json --devices 8 ",
)


def page_commands(part: str) -> list[str]:
    """The page's commands of `part`, in its order: "apart" the table file and those starting with one of APART,
    "chain" the others. A file written by hand is one command (its heredoc), every other a line."""
    commands = []
    for block in code_blocks(DOCS / PAGE):
        if block.startswith("cat > "):
            commands.append(block)
        elif block.startswith(("shard-ray ", "python ")) and "--address auto" not in block:
            commands += block.splitlines()
    apart = [c for c in commands if c.startswith(APART)]
    assert len(apart) == len(APART), "every command APART names is on the page, once"
    if part == "apart":
        return [c for c in commands if c.startswith("cat > my_model.json")] + apart
    return [c for c in commands if c not in apart]


@pytest.mark.parametrize(
    "part", [pytest.param("chain", marks=pytest.mark.slow(seconds=100)), pytest.param("apart", marks=pytest.mark.slow)]
)
def test_the_own_tables_guide_runs_as_written(tmp_path, part):
    home, folder = tmp_path / "home", tmp_path / "mine"
    home.mkdir()
    folder.mkdir()
    ran: dict[str, subprocess.CompletedProcess] = {}
    for command in page_commands(part):
        ran[command] = done = _user_shell(home, folder, command)
        assert done.returncode == 0 or command.startswith("shard-ray compare"), f"{command}: {done.stderr}"
    if part == "chain":
        _check_chain(ran, home, folder)
    else:
        _check_apart(ran, folder)


def test_the_own_tables_guides_cluster_commands_parse():
    """The page's commands for a GPU cluster (`--address auto`): no cluster here, so each must parse."""
    blocks = [b for b in code_blocks(DOCS / PAGE) if b.startswith("shard-ray ") and "--address auto" in b]
    assert blocks
    for line in (line for block in blocks for line in block.splitlines()):
        argv = shlex.split(line)[1:]
        build_parser(argv[0]).parse_args(argv)


def _result(ran: dict[str, subprocess.CompletedProcess], prefix: str, may_refuse: str | None = None):
    """The run of the command starting with `prefix`, which succeeded (or refused with `may_refuse` in its line)."""
    (done,) = [r for line, r in ran.items() if line.startswith(prefix)]
    refused = may_refuse is not None and done.returncode == 2 and may_refuse in done.stderr
    assert done.returncode == 0 or refused, f"{prefix}: {done.stderr}"
    return done


def _check_apart(ran: dict[str, subprocess.CompletedProcess], folder: Path) -> None:
    result = functools.partial(_result, ran)
    assert "no problems found" in result("shard-ray doctor").stdout
    result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --constraints")
    assert json.loads((folder / "cpu_sharding_plan.json").read_text())["device_type"] == "cpu"
    step = result("python -m shard_ray.interop.torchrec_step")
    assert (
        step.stdout.startswith("one training step on 2 gloo ranks")
        and "\nrank 0: holds " in step.stdout
        and step.stdout.count("SGD updated its shards: yes") == 2
    )
    eight = result("shard-ray plan --tables my_model.json --devices 8")
    assert "plan 'cost_search' on 8 devices" in eight.stdout


def _check_chain(ran: dict[str, subprocess.CompletedProcess], home: Path, folder: Path) -> None:
    result = functools.partial(_result, ran)

    assert {t.name for t in load_tables(folder / "my_model_full.yaml")} == {
        "user_id",
        "ad_id",
        "category",
        "history",
        "device_type",
    }
    first = result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --out first")
    assert "priced by the shipped models" in first.stdout
    assert "table device_type: rows 3 (training range" in first.stderr  # a range warning: fewer rows than trained on

    calibrated = result("shard-ray calibrate")
    saved = sorted(p.name for p in (home / ".shard-ray" / "models").glob("*.pt"))
    assert len(saved) == 1 and "logged MLflow run" in calibrated.stdout and (folder / "mlflow.db").is_file()
    assert "1 calibrated in" in result("shard-ray models").stdout

    report = json.loads(calibrated.stdout.strip().splitlines()[-1])
    assert report["noise_floor"]["rounds"] == 8 and report["after"]["compute"]["mape"] is not None
    # the fine-tuned models' held-out figures, named "after" only where they were kept
    tuned = "after" if report["chosen"] == "fine-tuned" else "fine-tuned"
    comm = " (with the starting comm model)" if report["comm_refused"] and report["chosen"] == "fine-tuned" else ""
    assert (
        f"  plan {tuned} " in calibrated.stdout and f"kept the {report['chosen']} models{comm}: " in calibrated.stdout
    )

    measured = result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --measure")
    assert "measured/predicted" in measured.stdout
    assert "TorchRec's plan" in measured.stdout and "cost models are of" not in measured.stderr
    plan = load_plan(folder / "plan.json")
    task_models = home / ".shard-ray" / "models" / saved[0]  # these tables' own
    assert plan.estimate.cost_model == str(task_models) and plan.estimate.hardware == report["hardware"]
    # the held-out split holds enough shards and plans to judge the fit by (the tables make few distinct ones: topped
    # up from the fit, up to a third of them), so the guide's calibration is judged, not kept for want of data
    assert report["shards"]["held_out"] >= 8 and report["plans"]["held_out"] >= 3
    assert "too few held-out measurements" not in calibrated.stdout
    if report["chosen"] == "fine-tuned":  # fitted to these tables: none is outside the models' data any more
        assert "calibrated on these 5 tables" in measured.stdout and not plan.estimate.warnings
    else:  # kept unchanged: said, and the starting models' warnings still fire
        assert "unchanged by a calibration on these 5 tables" in measured.stdout
    with MeasurementStore(folder / "shard-ray-out" / "measurements.db") as store:  # every round, for the next time
        assert store.count("plan_measurements") >= sum(len(c.rounds_ms) for c in plan.measured.candidates.values())
    # the race in MLflow: its run with the written plan, a child run per plan raced, each with the printed cost_ms
    races = mlflow_runs(folder / "mlflow.db", "tags.kind = 'race'")
    assert len(races) == 1 and races[0].data.params["chosen"] == plan.measured.chosen
    assert "plan.json" in {a.path for a in mlflow_client(folder / "mlflow.db").list_artifacts(races[0].info.run_id)}
    raced = mlflow_runs(folder / "mlflow.db", f"tags.mlflow.parentRunId = '{races[0].info.run_id}'")
    assert len(raced) == len(plan.measured.candidates)  # one per distinct plan raced
    # the table's rows: a plan's name, then its cost_ms (the verdict's line also starts with a name: "X is separated")
    rows = (re.match(r"(\S+) +(\d+\.\d+) ", line) for line in measured.stdout.splitlines())
    table = {row[1]: float(row[2]) for row in rows if row and row[1] in plan.measured.candidates}
    for run in raced:
        name = run.data.tags["mlflow.runName"].removeprefix("my_model/")
        assert run.data.metrics["cost_ms"] == round(plan.measured.candidates[name].median_ms, 3)
        assert abs(run.data.metrics["cost_ms"] - table[name]) <= 0.005 + 1e-9
        assert run.data.tags["verdict"] == plan.measured.verdict(name)

    result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo torchrec")
    compared = result("shard-ray compare", may_refuse="place the tables identically: nothing to compare")
    if compared.returncode == 0:
        assert "measured/predicted" in compared.stdout and (folder / "shard-ray-out" / "compare").is_dir()

    assert json.loads((folder / "sharding_plan.json").read_text())["device_type"] == "cuda"


def mlflow_client(database: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{database}")


def mlflow_runs(database: Path, search: str) -> list:
    """The runs of the `shard-ray` experiment in the store `database` that `search` finds."""
    client = mlflow_client(database)
    return client.search_runs([client.get_experiment_by_name("shard-ray").experiment_id], search)
