"""The `shard-ray` command: one module per command group, each with its parser and handlers side by side.

Every flag is generated from a settings dataclass (`shard_ray.cli.flags`), so a command's
defaults live in one place. Only the group of the command being run is imported, and the settings its flags derive
from live in modules without torch, Ray or MLflow (`profiling/procedure.py`, the `settings.py` of costmodel, policy,
workflows and tuning), so help and bad flags answer at once.
User errors print one line, `shard-ray: error: ...`, and exit with status 2; so does, with status 1, a worker
stopped by Ray's memory monitor.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import re
import select
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

from shard_ray.arguments import Parser
from shard_ray.cli.commands import COMMANDS, FOUND_ELSEWHERE
from shard_ray.cli.flags import refuse_writing_over_inputs
from shard_ray.configfile import expand_config
from shard_ray.errors import ShardRayError, ShardRayWarning, Terminated, raise_terminated, sigterm_received
from shard_ray.quiet import quiet_output


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command's flags, or, given `command`, with that command's group only."""
    parser = Parser(
        prog="shard-ray",
        description="Shard embedding tables over devices; measure the plans on Ray.",
        elsewhere=FOUND_ELSEWHERE,
    )
    parser.add_argument("--version", action=_PrintVersion, nargs=0, help="print the installed release and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    groups = dict.fromkeys(c.group for c in COMMANDS.values())
    wanted = {COMMANDS[command].group} if command in COMMANDS else set(groups) if command is None else set()
    for group in groups:
        if group in wanted:
            importlib.import_module(f"shard_ray.cli.{group}").add_commands(sub)
    for name, (group, help) in COMMANDS.items():
        if group not in wanted:
            sub.add_parser(name, help=help)
    return parser


class _PrintVersion(argparse.Action):
    """`--version`: the release pip installed, looked up only when asked (a job run from its working folder, by
    PYTHONPATH, has none: it says so), and, run from a git checkout (`make setup` installs the clone in place), its
    commit: the README and the docs name measured releases by commit, which the release number alone does not tell
    apart."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = version("shard-ray")
        except PackageNotFoundError:
            release = "(not installed: run from its source folder)"
        from pathlib import Path

        commit = _checkout_commit(Path(__file__).resolve().parent.parent.parent)
        print(f"shard-ray {release}" + (f" (commit {commit})" if commit else ""))
        parser.exit()


def _checkout_commit(source: os.PathLike[str]) -> str | None:
    """The short commit of the git checkout at `source`, `+changes` where its tracked files differ from it; None where
    `source` is no checkout (an installed wheel) or git is not at hand."""
    import subprocess

    if not os.path.exists(os.path.join(source, ".git")):
        return None
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        changed = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.returncode == 0 and changed.stdout.strip() else "")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """shard-ray's own warnings as one line, like its errors; others as Python prints them."""
    if issubclass(category, ShardRayWarning):
        print(f"warning: {message}", file=sys.stderr)  # as the commands print theirs (docs/commands.md)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: Sequence[str] | None = None, *, ending: bool = False) -> int:
    """Run the command `argv` (the process's arguments by default); its exit status. `ending`: the process ends with
    the command (the console script), so a signal that comes once it is stopping is ignored, not raised in the middle
    of its stop (a second Ctrl-C had a traceback, and cut short the stop of the command's Ray)."""
    quiet_output()
    warnings.showwarning = _one_line_warning
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(command).parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    # a SIGTERM stops the command as a Ctrl-C does (`Terminated`); the handler before is put back at the end, where
    # `main` runs in a process of its own (a test's): None, where it was not Python's (a driver's of Ray), as the default
    here = threading.current_thread() is threading.main_thread()
    on_sigterm = signal.signal(signal.SIGTERM, raise_terminated) if here else None
    sigterm_received(forget=True)
    stdout = sys.stdout
    if not getattr(args, "output_is_the_work", False):  # it leaves files, models, runs or a cluster: see them made
        sys.stdout = _OutputMayGoUnread(stdout)
    try:
        refuse_writing_over_inputs(args)
        run(args)
    except ShardRayError as err:
        print(f"shard-ray: error: {_own_words(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _reader_left():  # another pipe or socket broke: an error of its own
            raise
        _stdout_to_nowhere()  # the reader of the output left (`| head`): the rest is not wanted, and not an error
        return PIPE_CLOSED
    except KeyboardInterrupt as err:
        if ending and here:
            _ignore_stopping_signals()
        terminated = isinstance(err, Terminated) or sigterm_received()
        _close_progress_bars()
        print(f"shard-ray: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    except Exception as err:
        if not _ran_out_of_memory(err):
            raise
        used = re.search(r"was (\S+) used / (\S+) limit", str(err))
        rows = ", --max-rows" if hasattr(args, "max_rows") else ""  # named only where the command has it
        print(
            "shard-ray: error: the machine ran low on memory and Ray's memory monitor stopped a worker"
            + (f" ({used[1]} of {used[2]} in use)" if used else "")
            + f": free memory, or measure less at once (fewer devices{rows})",
            file=sys.stderr,
        )
        return 1
    finally:
        sys.stdout = stdout
        neighbours = sys.modules.get("shard_ray.neighbours")  # loaded where the command started a local Ray
        if neighbours is not None:
            neighbours.leave()
        if here and not ending:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if on_sigterm is None else on_sigterm)
    return 0


class _OutputMayGoUnread:
    """Standard output of a command whose work is more than what it prints (files, models, MLflow runs, a cluster):
    where its reader leaves (`plan --out p.json | head -2`), the command goes on, its output to nowhere, and finishes
    that work. Stopped at the closed pipe, as a command whose output is its work is (`PIPE_CLOSED`: `models`,
    `algorithms`, `doctor`, `costmodel evaluate`, `hosts list`), `plan` left no p.json, `compare` ended after its first
    round and `calibrate` kept no models (new users' walks)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._unread()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._unread()

    def _unread(self) -> None:
        if not _reader_left():  # another pipe or socket broke: an error of its own
            raise
        _stdout_to_nowhere()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _ignore_stopping_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _close_progress_bars() -> None:
    """Close the progress bars the stop left open (one a loop drove, not a `with`), so that the line after them
    starts a line of its own: it was written after the bar's carriage return, on the bar's line (a walk)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


# The statuses of a process a closed pipe stopped (128 + SIGPIPE), as a shell reports `yes | head -1`'s `yes`, and of
# one stopped by a Ctrl-C (SIGINT) or a SIGTERM, as a shell reports a process those signals ended.
PIPE_CLOSED = 141
INTERRUPTED = 130
TERMINATED = 143


def _own_words(err: ShardRayError) -> str:
    """The error's message: raised in a Ray actor or task, it comes wrapped in Ray's with the worker's traceback
    (13 lines for an Adam plan on fbgemm's CPU kernels), its own words the wrapper's `cause`."""
    cause = getattr(err, "cause", None)
    return str(cause if isinstance(cause, ShardRayError) else err)


def _reader_left() -> bool:
    """Whether standard output is a pipe whose reader has closed it (polling its end reports an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's captured output), or none that polls
        return False


def _stdout_to_nowhere() -> None:
    """Standard output to /dev/null, so that flushing what is left of it at exit does not fail again."""
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, sys.stdout.fileno())
    os.close(nowhere)


def _ran_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is Ray's: a task or an actor's creation stopped by its memory monitor (a 75-line traceback
    otherwise). Not a bug in shard-ray, and not the user's input either: a one-line error and exit status 1."""
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(err, ray.exceptions.OutOfMemoryError)


def console() -> NoReturn:
    """The `shard-ray` console script: `main`, then an exit that skips freeing the interpreter's modules.

    Freeing torch, fbgemm, Ray and MLflow took 0.5 to 1.4 s of every command's exit (docs/commands.md) and leaves
    nothing a later process could see. Signals that would stop the process are ignored from here: it is ending.
    What does leave something still runs, in the interpreter's own order: a local Ray is shut down first (its
    processes stopped, without the 0.5 s its exit hook waits for late log lines), non-daemon threads finish, exit
    handlers run (temporary folders, MLflow, logging), output is flushed.
    A Ray the command joined is left as a driver that ends is: its head ends the command's job, and the actors the
    job owns, when the connection closes. Disconnecting first frees nothing more, and after the command has called
    an actor it took 0.25-0.29 s, a gRPC thread's poll joined (docs/commands.md).
    """
    code = main(ending=True)
    # The command is done: what is left stops what it started. A Ctrl-C or SIGTERM now (a second one, say, while the
    # first one's stop runs) would cut that short, with a traceback (a new user's walk), and leave Ray's processes.
    _ignore_stopping_signals()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from shard_ray.runtime import joined_ray, stop_local_ray

        if joined_ray():
            atexit.unregister(ray.shutdown)
        else:
            stop_local_ray()
    threading._shutdown()  # what the interpreter calls at exit: threads' exit hooks, then joins non-daemon threads
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # what is left of the output, its reader gone (`| head`)
        _stdout_to_nowhere()
        code = code or PIPE_CLOSED
    sys.stderr.flush()
    os._exit(code)


def run_experiment(commands: Callable[[list[str]], list[list[str]]], argv: Sequence[str]) -> int:
    """An experiment's entry point: the `shard-ray` command lines `commands` makes of its arguments (a config
    expanded into flags), run one after the other; the first failing one's exit status, else 0."""
    try:
        lines = commands(list(argv))
    except ShardRayError as err:
        print(f"shard-ray: error: {err}", file=sys.stderr)
        return 2
    for line in lines:
        if len(lines) > 1:
            print(f"== shard-ray {' '.join(line)}", flush=True)
        code = main(line)
        if code:
            return code
    return 0


def config_command(command: list[str]) -> Callable[[list[str]], list[list[str]]]:
    """The `commands` of an experiment that is one `shard-ray <command>` whose flags its config holds."""
    return lambda argv: [[*command, *expand_config(argv)]]
