"""docs/own-tables.md as a new user runs it: every command on the page, as written, in a folder of their own."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from pages import DOCS

from shard_ray.cli import build_parser
from shard_ray.workload.tables import load_tables

REPO = Path(__file__).resolve().parent.parent
PAGE = "own-tables.md"


def _blocks(page: str) -> list[str]:
    """The page's indented code blocks, each as the text a user pastes."""
    blocks = (DOCS / page).read_text().split("\n\n")
    return ["\n".join(line[4:] for line in b.splitlines()) for b in blocks if b.startswith("    ")]


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


@pytest.mark.slow
def test_the_own_tables_guide_runs_as_written(tmp_path):
    home, folder = tmp_path / "home", tmp_path / "mine"
    home.mkdir()
    folder.mkdir()
    ran: dict[str, subprocess.CompletedProcess] = {}
    for block in _blocks(PAGE):
        if block.startswith("cat > "):  # a file written by hand
            done = _user_shell(home, folder, block)
            assert done.returncode == 0, done.stderr
        elif block.startswith("from shard_ray"):  # the training script's lines, checked by the step that runs them
            continue
        elif "--address auto" in block:  # the cluster's commands: no cluster here, so each must parse
            for line in block.splitlines():
                argv = shlex.split(line)[1:]
                build_parser(argv[0]).parse_args(argv)
        else:
            for line in block.splitlines():
                ran[line] = _user_shell(home, folder, line)
    _check(ran, home, folder)


def _check(ran: dict[str, subprocess.CompletedProcess], home: Path, folder: Path) -> None:
    def result(prefix: str, *, may_refuse: str | None = None) -> subprocess.CompletedProcess:
        (done,) = [r for line, r in ran.items() if line.startswith(prefix)]
        refused = may_refuse is not None and done.returncode == 2 and may_refuse in done.stderr
        assert done.returncode == 0 or refused, f"{prefix}: {done.stderr}"
        return done

    assert {t.name for t in load_tables(folder / "my_model_full.yaml")} == {"user_id", "ad_id", "category", "history"}
    assert "no problems found" in result("shard-ray doctor").stdout
    first = result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --out first")
    assert "priced by the shipped models" in first.stdout and "outside" in first.stderr  # the range warnings

    calibrated = result("shard-ray calibrate")
    saved = sorted(p.name for p in (home / ".shard-ray" / "models").glob("*.pt"))
    assert len(saved) == 2 and "logged MLflow run" in calibrated.stdout and (folder / "mlflow.db").is_file()
    assert "2 calibrated in" in result("shard-ray models").stdout

    measured = result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo cost_search --measure")
    assert "calibrated on these 4 tables" in measured.stdout and "measured/predicted" in measured.stdout
    assert "TorchRec's plan" in measured.stdout and (folder / "plan.json").is_file()

    result("shard-ray plan --tables my_model.json --devices 2 --memory-gb 4 --algo torchrec")
    compared = result("shard-ray compare", may_refuse="place the tables identically: nothing to compare")
    if compared.returncode == 0:
        assert "measured/predicted" in compared.stdout and (folder / "shard-ray-out" / "compare").is_dir()

    result("shard-ray export")
    step = result("python -m shard_ray.interop.torchrec_step", may_refuse="TorchRec runs row-wise shards on GPUs only")
    if step.returncode == 0:
        assert step.stdout.startswith("rank 0: holds ") and step.stdout.count("SGD updated its shards: yes") == 2

    eight = result("shard-ray plan --tables my_model.json --devices 8")
    assert "plan 'cost_search' on 8 devices" in eight.stdout
