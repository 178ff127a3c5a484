"""Other shard-ray commands on this machine, each with a local Ray of its own: they share its cores, and what any of them
measures with them.

Two `compare` runs started side by side on 2 cores each went on without a word, and one measured TorchRec's plan at
8.82 ms against 4.9-5.6 ms alone (a new user's walk). On one head (`ray start --head`, then `--address`) commands take
turns on its devices; with a local Ray each they cannot. So a command that starts a local Ray says which others run
beside it: at its start those already running, at its end those that started meanwhile.

A command's entry is a file in `$SHARD_RAY_HOME/running/` (else ~/.shard-ray/running/) that it holds locked while it
runs: the kernel lets go of the lock when the process ends however it ends, so a file whose lock can be taken is a
stopped command's, removed by whoever finds it. Commands of other users, or with another SHARD_RAY_HOME, are not seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import sys
from pathlib import Path

from shard_ray.io import shard_ray_home

# This process's entry while its command runs (the file, kept open and locked), and its name; the commands running
# when it was made.
_entry: tuple[int, Path] | None = None
_found: list[str] = []


def _others(folder: Path) -> dict[Path, str]:
    """The running commands' entries in `folder` but this process's, with their command lines; stopped ones' removed."""
    found = {}
    for beside in folder.glob("*.beside"):  # a stopped command's, written to as it stopped
        if not beside.with_suffix(".cmd").exists():
            beside.unlink(missing_ok=True)
    for path in sorted(folder.glob("*.cmd")):
        if _entry is not None and path == _entry[1]:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its command holds it: running
                found[path] = os.read(fd, 4096).decode(errors="replace")
                continue
            with contextlib.suppress(OSError):  # its command has stopped
                path.unlink()
                path.with_suffix(".beside").unlink(missing_ok=True)
        finally:
            os.close(fd)
    return found


def _describe(commands: list[str]) -> str:
    shown = "; ".join(f"`{line}`" for line in commands[:2])
    more = f" and {len(commands) - 2} more" if len(commands) > 2 else ""
    return shown + more


ADVICE = (
    "run them one after the other, or start one head on this machine as docs/clusters.md's 'On a new cluster' says "
    "(`ray start --head --port 6379` with RAY_AUTH_MODE=token and RAY_worker_niceness=0) and give each "
    "`--address 127.0.0.1:6379`, so that they take turns on its devices"
)


def _warn(commands: list[str], started: bool) -> None:
    one = len(commands) == 1
    other = "another shard-ray command" if one else f"{len(commands)} other shard-ray commands"
    ran = ("started" if started else "is running" if one else "are running") + " on this machine"
    while_ = " while this one ran" if started else ""
    # said to commands that measure nothing too (`policy train`): what is slowed is whatever of theirs measures
    effect = (
        "they shared its cores, and what any measured was slowed"
        if started
        else "they share its cores, and what any measures is slowed"
    )
    print(
        f"warning: {other} {ran}{while_}, with a Ray of {'its' if one else 'their'} own ({_describe(commands)}): "
        f"{effect}; {ADVICE}",
        file=sys.stderr,
    )


def arrive() -> None:
    """Enter this process's command, which has started a local Ray, among the running ones, and warn of those already
    running (each is told of this one at its end). Where the folder cannot be written, nothing is said."""
    global _entry
    if _entry is not None:
        return
    folder = shard_ray_home() / "running"
    line = shlex.join(["shard-ray", *sys.argv[1:]])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        others = _others(folder)
        path = folder / f"{os.getpid()}.cmd"
        path.with_suffix(".beside").unlink(missing_ok=True)  # an earlier process's of this id
        # locked and written under another name first: an entry found unlocked is a stopped command's, removed
        making = path.with_suffix(".new")
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line.encode())
        os.rename(making, path)
        _entry = (fd, path)
        _found[:] = others.values()
        for other in others:
            with open(other.with_suffix(".beside"), "a", encoding="utf-8") as beside:
                beside.write(line + "\n")
    except OSError:
        return
    if others:
        _warn(list(others.values()), started=False)


def _came() -> list[str]:
    """The commands that started while this one ran, so far."""
    if _entry is None:
        return []
    with contextlib.suppress(OSError):
        return _entry[1].with_suffix(".beside").read_text(encoding="utf-8").splitlines()
    return []


def measured_beside() -> list[str]:
    """For a measurement's record (its warnings): a line naming the commands with local Rays of their own that have run
    beside this one so far, where any has; none where this process entered no command (`arrive`)."""
    commands = list(dict.fromkeys(_found + _came()))
    if not commands:
        return []
    one = len(commands) == 1
    return [
        f"measured while {'another shard-ray command' if one else f'{len(commands)} other shard-ray commands'} ran on "
        f"this machine with a Ray of {'its' if one else 'their'} own ({_describe(commands)}), sharing its cores: "
        "slower than alone"
    ]


def leave() -> None:
    """Take this process's command out of the running ones, warning of those that started while it ran."""
    global _entry
    if _entry is None:
        return
    came = _came()
    fd, path = _entry
    _entry = None
    _found.clear()
    with contextlib.suppress(OSError):
        path.with_suffix(".beside").unlink()
    with contextlib.suppress(OSError):
        path.unlink()
    os.close(fd)
    if came:
        _warn(came, started=True)
