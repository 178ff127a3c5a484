"""Another commit's code beside this checkout's, for the benchmarks that time two releases side by side
(`command_costs.py --previous`, `planning_scale.py --previous`)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def is_commit(name: str) -> bool:
    """Whether `name` names a commit of this repository."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"], cwd=REPO,
                           capture_output=True)  # fmt: skip
    return found.returncode == 0


def file_at(commit: str, path: str) -> str:
    """The text of `path` at `commit` ("" where it has no such file)."""
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else ""


@contextlib.contextmanager
def checkout_of(commit: str, folder: Path) -> Iterator[Path]:
    """`commit`'s files in a git worktree at `folder`, removed after: its code runs with `folder` first on
    PYTHONPATH, in this checkout's environment."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, capture_output=True)
