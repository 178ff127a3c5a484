"""Command-line output without the libraries' chatter: the CLI's `main` calls `quiet_output()` once.

What goes, and why it is safe to drop:
- MLflow's INFO lines (creating the SQLite database's tables, alembic migrations, "Experiment ...
  does not exist. Creating a new experiment"): routine. Its warnings and errors stay, and
  MLFLOW_LOGGING_LEVEL, when set, wins.
- MLflow's "View run ... at: http://..." and "View experiment at" lines, printed for every run
  on a tracking server (jobs log to one): the commands say which run they logged, and where, once.
  MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT, when set, wins.
- Ray's notice that a new local instance has token authentication on: that is Ray's secure
  default and asks nothing of the user. Ray's warning that authentication is *off* stays.
  RAY_AUTH_MODE is left alone: a driver joining a cluster must use the cluster's mode.
- tqdm's redraws, where stderr is not a terminal (a log file, a Ray job's log, CI): a bar redrawn ten
  times a second fills the log with carriage returns, so there it redraws at most every 30 s, and its
  last state stays. TQDM_MININTERVAL, when set, wins.
- Ray's colour codes around its workers' lines, where stdout is not a terminal (a log file, `hosts run`'s output
  piped on): they are escape sequences there, not colours. RAY_COLOR_PREFIX, when set, wins.
Elsewhere, where the chatter starts: RLlib's own warnings in `policy.ppo.build_algorithm`, Tune's
tables in `tuning.sweep.run_sweep` (one line per trial instead), the trials' own lines that Ray passes on to the
sweep's output (the policy trials' "Checkpoint successfully created" in `tuning.policy_sweep.policy_trial`, the
cost-model trials' progress bars in `costmodel.train.fit`).
"""

from __future__ import annotations

import logging
import os
import sys

_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_TOKEN_AUTH_ON_NOTICE = "Token authentication is enabled"


def _not_the_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_TOKEN_AUTH_ON_NOTICE)


def quiet_output() -> None:
    """Silence the routine library output above, for this process and the Ray workers it starts."""
    # MLflow reads the level once, when it is imported; the environment also reaches Ray's workers.
    level = os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING").upper()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # read at every run's start
    if "mlflow" in sys.modules:  # imported already (a notebook, a test session): set it now
        logging.getLogger("mlflow").setLevel(level)
    if not sys.stderr.isatty():  # tqdm reads its TQDM_ defaults when it is imported, which the commands do later
        os.environ.setdefault("TQDM_MININTERVAL", "30")
    if not sys.stdout.isatty():  # read by the driver each time it prints a worker's line
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    drop_token_auth_notice()


def drop_token_auth_notice() -> None:
    """Drop Ray's notice that a new local instance has token authentication on (also where a script starts its
    local Ray through `connect_ray` without the CLI's `quiet_output`: the experiments)."""
    # A filter on the logger itself survives Ray's own logging set-up at import and at ray.init; added once.
    logging.getLogger(_RAY_AUTH_LOGGER).addFilter(_not_the_token_auth_notice)
