"""`shard-ray` run in the test's own process, for the checks of what it refuses (the console script's own error path
is tested apart, in tests/test_cli.py)."""

from shard_ray.cli import main


def assert_refused(capsys, argv, message, leftover=None) -> str:
    """`shard-ray ARGV` exits 2 with one line naming `message`, and `leftover` is not there; that line."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("shard-ray: error:"), err
    assert message in err
    if leftover is not None:
        assert not leftover.exists()
    return err
