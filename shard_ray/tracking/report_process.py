"""A measuring command's report, written by a process of its own that imports its modules while the command starts.

A `compare`, an `evaluate` or a `plan --measure` reports with matplotlib (its charts) and MLflow (its runs): about
2 s of imports on these 2-core machines (docs/commands.md). In the command's own process they took that long between
its start and its measuring whatever the order, on a thread or not: Python's imports hold the interpreter's lock, so
they ran after the command's own imports (torch, Ray), not beside them. `ReportProcess` starts a Python process that
imports them on the other core while the command imports its own and joins Ray; the command waits for it before
measuring (whose cores it must not share) and then hands it the report's calls, each a function of a module and its
arguments.

    with ReportProcess(tracking_uri, [ratio_chart, log_comparison]) as report:
        ...                                  # the command's imports, its gang
        report.wait_until_imported()         # before measuring
        ...                                  # measuring
        logged = report.call(log_comparison, result, ...)

The child's output goes where the command's does. It is in the command's process group (a signal to the group reaches
it), leaves a Ctrl-C to the command, which stops it on the way out, and ends with the command however that ends
(Linux's parent-death signal: a command stopped by SIGTERM or SIGKILL has no way out to run).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, TypeVar

from shard_ray.errors import ShardRayError

T = TypeVar("T")
IMPORTED = "imported"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def report_modules(tracking_uri: str | None) -> list[str]:
    """What a report needs beyond shard-ray's own modules: matplotlib's pyplot and, with a tracking URI, MLflow and
    the store that URI names."""
    modules = ["matplotlib.pyplot"]
    if tracking_uri is not None:
        store = "rest_store" if tracking_uri.startswith(("http://", "https://")) else "sqlalchemy_store"
        modules += ["mlflow", f"mlflow.store.tracking.{store}"]
    return modules


class ReportProcess:
    """A process importing `functions`' modules and what a report with `tracking_uri` needs (`report_modules`) from
    its start, then running the calls it is handed in order (see the module's docstring). Start it on the command's
    main thread: the kernel's parent-death signal follows the thread that started it."""

    def __init__(self, tracking_uri: str | None, functions: Sequence[Callable[..., Any]]) -> None:
        modules = report_modules(tracking_uri) + list(dict.fromkeys(f.__module__ for f in functions))
        calls_read, calls_write = os.pipe()
        answers_read, answers_write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), str(calls_read), str(answers_write), *modules],
            pass_fds=(calls_read, answers_write),
        )
        os.close(calls_read)
        os.close(answers_write)
        self._calls = Connection(calls_write, readable=False)
        self._answers = Connection(answers_read, writable=False)
        self._imported = False

    def wait_until_imported(self) -> None:
        """Return once the process has imported its modules (one that failed fails again, and says why, in the call
        that uses it)."""
        if not self._imported:
            self._answer()
            self._imported = True

    def call(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` run in the process; what it returns, or what it raised raised here."""
        self.wait_until_imported()
        sys.stdout.flush()  # the command's lines before the call's
        sys.stderr.flush()
        self._calls.send((function, args, kwargs))
        raised, value = self._answer()
        if raised:
            raise value
        return value

    def _answer(self) -> tuple[bool, Any]:
        try:
            return self._answers.recv()
        except EOFError:
            code = self._process.wait()
            raise ShardRayError(
                f"the process writing the report ended (exit status {code}) before it answered"
            ) from None

    def close(self) -> None:
        """End the process: once its calls are answered it exits when told; otherwise it is stopped."""
        self._calls.close()
        self._answers.close()
        try:
            self._process.wait(timeout=5 if self._imported else 0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ReportProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _end_with(command: int) -> None:
    """Have the kernel stop this process when the command that started it ends (Linux's PR_SET_PDEATHSIG), and
    leave a Ctrl-C to the command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux: the closed pipe ends it once a call is answered
        pass
    if os.getppid() != command:  # it ended before the signal was asked for
        os._exit(0)


def _raised_as(err: Exception) -> Exception:
    """What the command raises for `err`: a one-line error as it is, MLflow's and a missing module's as one, others (a
    bug) as their type and message, which rebuild in the command whatever the exception's arguments."""
    if isinstance(err, ShardRayError):
        return err
    mlflow_errors = sys.modules.get("mlflow.exceptions")
    if isinstance(err, ImportError) or (mlflow_errors and isinstance(err, mlflow_errors.MlflowException)):
        # a store MLflow cannot open here (a database's driver not installed, say) or that refused the run
        return ShardRayError(f"MLflow could not log the run: {str(err).strip().splitlines()[0]}")
    traceback.print_exc()  # where it was raised, which the command's traceback lacks
    return RuntimeError(f"{type(err).__name__}: {err} (in the process writing the report)")


def _answer_calls(calls: Connection, answers: Connection, modules: list[str]) -> None:
    """The child's side: import `modules`, say so, then run each call received and send back what it returned or
    raised, until the command closes its end."""
    import importlib

    import matplotlib

    from shard_ray.quiet import quiet_output

    quiet_output()
    matplotlib.use("Agg")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # raised again, and said, by the call that uses it
            pass
    answers.send((False, IMPORTED))
    while True:
        try:
            function, args, kwargs = calls.recv()
        except EOFError:
            return
        try:
            answer = (False, function(*args, **kwargs))
        except Exception as err:
            answer = (True, _raised_as(err))
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            answers.send(answer)
        except OSError:  # the command ended while the call ran (a Ctrl-C): nothing to answer
            return


if __name__ == "__main__":
    _end_with(int(sys.argv[1]))
    _answer_calls(
        Connection(int(sys.argv[2]), writable=False), Connection(int(sys.argv[3]), readable=False), sys.argv[4:]
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing to free: the modules it imported would take about a second to tear down
