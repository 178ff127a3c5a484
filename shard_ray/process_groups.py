"""Process groups started in sessions of their own (a Ray head, a server, an emulated host's Ray node), stopped as a
whole: a group's members end some time after its leader, and a folder they write in cannot be removed before (a
Ray head's temp folder once held a session's logs still being written after `kill` had ended the head)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def signal_group(pid: int, sig: int) -> None:
    """`sig` to every process of the group `pid` leads, where any is left."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pid: int) -> bool:
    """Whether any process of the group `pid` leads is left."""
    # A leader started by this process stays a zombie, and its group alive, until reaped.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_groups(pids: list[int], grace_s: float, timeout_s: float) -> None:
    """SIGTERM to the groups `pids` lead, SIGKILL to what is left of them after `grace_s` seconds; returns when every
    one is gone, or `timeout_s` seconds after the SIGKILL."""
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    for sig, wait_s, poll_s in ((signal.SIGKILL, grace_s, 0.2), (None, timeout_s, 0.1)):
        deadline = time.monotonic() + wait_s
        while any(group_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(poll_s)
        if sig is not None:
            for pid in pids:
                signal_group(pid, sig)


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """End `process`, started in a session of its own (a `ray start --head --block`, a server), and everything it
    started, stopped or not already: SIGTERM to its group, SIGKILL after `grace_s` seconds."""
    stop_groups([process.pid], grace_s, timeout_s=30)
    process.poll()
