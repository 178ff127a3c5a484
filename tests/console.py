"""`shard-ray` run in the test's own process: the same `main` the console script calls, without a Python and (with
the suite's Ray up) a Ray of its own to start each time. The console script's own path is tested apart, in
tests/test_cli.py."""

import subprocess

from shard_ray.cli import main


def shard_ray_here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`shard-ray ARGV` run here: its exit status and what it printed, as `subprocess.run` gives them."""
    capsys.readouterr()  # what the test printed before is not the command's
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["shard-ray", *argv], code, out, err)


def assert_refused(capsys, argv, message, leftover=None) -> str:
    """`shard-ray ARGV` exits 2 with one line naming `message`, and `leftover` is not there; that line."""
    done = shard_ray_here(capsys, *argv)
    err = done.stderr.strip()
    assert done.returncode == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("shard-ray: error:"), err
    assert message in err
    if leftover is not None:
        assert not leftover.exists()
    return err
