"""What every sweep shares: the Tuner, its search algorithm, MLflow per trial, resume, the tuned file.

A sweep lives in a folder:

    OUT/tune/<name>/   Ray Tune's experiment state; a sweep started again on OUT resumes it (where that state
                       was cut short, it is moved to OUT/tune/<name>-damaged/ and the sweep starts again)
    OUT/tune/<name>-scored-with.json   what the trials were scored with (`ScoredWith`): a sweep started again with
                       other values is refused, not resumed
    OUT/trials.csv     one row per trial: its configuration and last reported metrics
    OUT/best.json      the best configuration, a tuned-config file (below)

The tuned-config file is what `costmodel train --config`, `plan --search-config` and
`policy train --config` read:

    {"format": "shard-ray-tuned/1", "kind": "costmodel", "config": {...},
     "metric": "val_mape", "mode": "min", "value": 0.061, "trials": 16, "sweep": "OUT/tune/costmodel"}

Every trial is an MLflow run (Tune's MLflowLoggerCallback, which logs from the driver, so a
tracking server bound to the head node's localhost serves a whole cluster), in one experiment
per sweep, tagged with the sweep's kind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickletools
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shard_ray.configfile import Kind, TunedConfig, differences, flags_of, setting
from shard_ray.errors import ShardRayError
from shard_ray.io import write_atomic, write_json

SEARCH_ALGORITHMS = ("optuna", "random")
# The files of Tune's state that resuming a sweep reads back, the newest of each pattern (by name, as Tune picks it):
# pickles but for the experiment's state, which is JSON (the searchers' `*-state-*.json` are cloudpickles despite their
# name: Tune's `_atomic_save`).
TUNE_STATE_FILES = (
    "tuner.pkl",
    "experiment_state-*.json",
    "search_gen_state-*.json",
    "basic-variant-state-*.json",
    "searcher-state-*.pkl",
    "callback-states-*.pkl",
)


@dataclass(frozen=True)
class SweepConfig:
    samples: int = setting(16, "trials in all", min=1)
    search: str = setting(
        "optuna", "how trials are chosen: Optuna's TPE sampler, or random search", choices=SEARCH_ALGORITHMS
    )
    max_concurrent: int = setting(2, "trials at once, one CPU each", min=1)
    max_failures: int = setting(2, "retries of a failed trial before it is left out", min=0)
    seed: int = setting(0, "random seed", min=0)

    def check(self) -> None:
        if self.samples < 1:
            raise ShardRayError(f"samples must be at least 1, got {self.samples}")
        if self.max_concurrent < 1:
            raise ShardRayError(f"max_concurrent must be at least 1, got {self.max_concurrent}")
        if self.max_failures < 0:
            raise ShardRayError(f"max_failures must be 0 or more, got {self.max_failures}")
        if self.search not in SEARCH_ALGORITHMS:
            raise ShardRayError(f"unknown search algorithm {self.search!r}; known: {', '.join(SEARCH_ALGORITHMS)}")


@dataclass(frozen=True)
class ScoredWith:
    """What a sweep's trials are scored with beyond their own drawn settings (the tasks, the data, the models...), by
    name, and the flag that sets each (`labels`; a name without one is shown as it is)."""

    values: dict[str, Any]
    labels: dict[str, str]

    @classmethod
    def of(cls, values: dict[str, Any], *flagged: type, **named: str) -> ScoredWith:
        """`values`, named by the flags of the settings dataclasses `flagged` where one of their fields sets them, and
        by `named` (a value's name: how to say it)."""
        return cls(json.loads(json.dumps(values)), flags_of(*flagged) | named)

    def refuse_other_in(self, out_dir: str | Path, kind: Kind) -> None:
        """Refuse to resume the `kind` sweep in `out_dir` whose trials were scored with other values: its trials'
        scores would be ranked beside new ones scored otherwise (a resumed search sweep on other tasks wrote a
        configuration scored on the old ones). Each that differs is named by its flag."""
        path = scored_with_file(out_dir, kind)
        if not path.is_file():
            return
        differ = differences(json.loads(path.read_text()), self.values, self.labels)
        if differ:
            raise ShardRayError(
                f"{Path(out_dir)} holds a {kind} sweep whose trials were scored otherwise ({'; '.join(differ)}): give "
                "another --out, the same settings, or remove the folder"
            )


def scored_with_file(out_dir: str | Path, kind: Kind) -> Path:
    return Path(out_dir) / "tune" / f"{kind}-scored-with.json"


def run_sweep(
    kind: Kind,
    trainable: Callable[..., None],
    space: dict[str, Any],
    metric: str,
    mode: Literal["min", "max"],
    sweep: SweepConfig,
    out_dir: str | Path,
    tracking_uri: str | None,
    experiment: str,
    tags: dict[str, str],
    scored_with: ScoredWith,
    scheduler: Any = None,
) -> Any:
    """Run (or resume) the sweep into `out_dir`; returns Tune's ResultGrid (needs a connected Ray). A sweep there
    scored with other values than `scored_with` is refused, not resumed.

    Failed trials are retried `sweep.max_failures` times and then left out; the sweep goes on.
    """
    import optuna
    from ray import tune
    from ray.air.integrations.mlflow import MLflowLoggerCallback
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    from shard_ray.profiling.keeper import release_kept_gang
    from shard_ray.tracking.mlflow_runs import use_experiment
    from shard_ray.tuning.progress import TrialProgress

    # Policy trials checkpoint every iteration; Tune warns that its state snapshots follow suit.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Tune's new output engine prints its header box and TensorBoard hint even at verbose=0; the
    # legacy one is silent there, and TrialProgress says what matters.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    sweep.check()
    storage = (Path(out_dir) / "tune").resolve()  # Tune needs an absolute storage path
    path = storage / kind
    resourced = tune.with_resources(trainable, {"cpu": 1})
    damaged = damaged_state(path) if tune.Tuner.can_restore(str(path)) else None
    if damaged is not None:
        aside = path.with_name(f"{kind}-damaged")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        print(
            f"the sweep's saved state in {path} is damaged ({damaged} is cut short: the sweep was stopped while Tune "
            f"saved it); starting the sweep again, its earlier trials moved to {aside}",
            flush=True,
        )
    scored_with.refuse_other_in(out_dir, kind)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its "A new study created", on a resumed sweep too
    if tune.Tuner.can_restore(str(path)):
        print(f"resuming the sweep in {path}", flush=True)
        # The search space again: Tune does not keep it with the sweep, and a sweep killed before its
        # searcher's first checkpoint would resume with a searcher that has none (Optuna then fails).
        tuner = tune.Tuner.restore(str(path), trainable=resourced, param_space=space, resume_errored=True)
    else:
        if sweep.search == "optuna":
            from shard_ray.tuning.optuna_search import ResumableOptunaSearch

            search_alg = ConcurrencyLimiter(ResumableOptunaSearch(seed=sweep.seed), max_concurrent=sweep.max_concurrent)
        else:
            search_alg = BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.max_concurrent)
        callbacks: list[tune.Callback] = [TrialProgress(metric, sweep.samples)]
        if tracking_uri:
            use_experiment(tracking_uri, experiment)  # created here, so its artifacts go where ours do
            callbacks.append(
                MLflowLoggerCallback(
                    tracking_uri=tracking_uri, experiment_name=experiment, tags={"kind": f"tune-{kind}", **tags}
                )
            )
        release_kept_gang()  # its devices to the trials
        tuner = tune.Tuner(
            resourced,
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=metric,
                mode=mode,
                num_samples=sweep.samples,
                search_alg=search_alg,
                scheduler=scheduler,
                trial_name_creator=lambda trial: f"{kind}_{trial.trial_id}",
                trial_dirname_creator=lambda trial: f"{kind}_{trial.trial_id}",
            ),
            run_config=tune.RunConfig(
                name=kind,
                storage_path=str(storage),
                failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                callbacks=callbacks,
                verbose=0,  # TrialProgress prints a line per trial in place of Tune's tables
            ),
        )
        write_json(scored_with_file(out_dir, kind), scored_with.values)
    began = time.perf_counter()
    with _tune_interrupt_noticed() as interrupted:
        results = tuner.fit()
    if interrupted:
        print(f"the sweep's state is saved in {path}: the same command resumes it", flush=True)
        raise KeyboardInterrupt
    print(
        f"sweep finished in {time.perf_counter() - began:.0f} s: {len(results)} trials, {results.num_errors} failed",
        flush=True,
    )
    return results


@contextlib.contextmanager
def _tune_interrupt_noticed() -> Iterator[list[bool]]:
    """Whether Tune's own Ctrl-C handler stopped the sweep in the block: it saves the sweep's state and returns as if
    the sweep had ended, and a stopped `tune search` then reported "4 trials, 0 failed", wrote a best.json of two and
    exited 0 (a walk). Tune's handler puts back the one it replaced when it takes a signal, and only then: a handler
    of this block's own, found in place after it, says one came. Off the main thread Tune installs none."""
    noticed: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield noticed
        return
    before = signal.getsignal(signal.SIGINT)

    def marker(signum: int, frame: object) -> None:  # Tune's handler runs in its place while the sweep runs
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, marker)
    try:
        yield noticed
    finally:
        if signal.getsignal(signal.SIGINT) is marker:
            noticed.append(True)
        signal.signal(signal.SIGINT, before)


def damaged_state(path: Path) -> str | None:
    """The first of Tune's state files in the sweep folder `path` (`TUNE_STATE_FILES`) that is not whole, if any.

    Tune writes its state in the driver's staging folder and copies it into the sweep's folder on a thread, not
    atomically: a sweep killed during the copy leaves a file cut short, and resuming it, Tune logs "Failed to restore the
    run state" and starts a sweep of as many trials as its searcher had left to suggest (one of two, killed after the
    first), the earlier trials' results no longer in it."""
    for pattern in TUNE_STATE_FILES:
        newest = max(path.glob(pattern), default=None)
        if newest is None:
            continue
        data = newest.read_bytes()
        try:
            if pattern.startswith("experiment_state"):
                json.loads(data)
            else:
                for _ in pickletools.genops(data):  # every opcode to the end, no object built
                    pass
        except ValueError:  # json.JSONDecodeError is one; a pickle cut short ends before its STOP
            return newest.name
    return None


def ranked_trials(results: Any, metric: str, out_dir: str | Path) -> list[Any]:
    """Trials that reported a finite `metric`, lowest first; an error when none did."""
    finished = [
        r
        for r in results
        if r.error is None
        and r.metrics
        and isinstance(r.metrics.get(metric), (int, float))
        and math.isfinite(r.metrics[metric])
    ]
    if not finished:
        raise ShardRayError(f"no trial of the sweep reported {metric}; their errors are under {Path(out_dir) / 'tune'}")
    return sorted(finished, key=lambda r: r.metrics[metric])


def describe_settings(config: dict[str, Any], keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={config[k]:.4g}" if isinstance(config[k], float) else f"{k}={config[k]}" for k in keys)


def write_trials_csv(results: Any, path: Path) -> None:
    frame = results.get_dataframe()
    write_atomic(path, frame.to_csv(index=False))


def save_best(
    kind: Kind,
    config: dict[str, Any],
    metric: str,
    mode: Literal["min", "max"],
    value: float,
    results: Any,
    out_dir: str | Path,
    notes: dict[str, Any] | None = None,
) -> Path:
    """Write OUT/best.json and OUT/trials.csv; returns best.json's path."""
    out = Path(out_dir)
    write_trials_csv(results, out / "trials.csv")
    tuned = TunedConfig(
        kind=kind,
        config=config,
        metric=metric,
        mode=mode,
        value=value,
        trials=len(results),
        sweep=str((out / "tune" / kind).resolve()),
        notes=notes or {},
    )
    path = out / "best.json"
    write_json(path, tuned.model_dump(mode="json"))
    return path
