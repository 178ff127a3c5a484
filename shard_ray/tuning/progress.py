"""A sweep's progress as one line per trial, in place of Tune's tables (the Tuner runs with verbose=0)."""

from __future__ import annotations

from typing import Any

from ray import tune


class TrialProgress(tune.Callback):
    """Prints each trial's metric when it ends, and where a failed trial's error is."""

    def __init__(self, metric: str, samples: int) -> None:
        self.metric = metric
        self.samples = samples
        self.ended = 0

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.ended += 1
        result = trial.last_result or {}
        value = result.get(self.metric)
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "not reported"
        reports = result.get("training_iteration", 0)  # Tune's name for a trial's reports
        print(
            f"trial {trial.trial_id} ({self.ended}/{self.samples}): {self.metric} {shown} "
            f"after {reports} report{'s' * (reports != 1)}",
            flush=True,
        )

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.ended += 1
        print(f"trial {trial.trial_id} ({self.ended}/{self.samples}) failed; its error is in {trial.path}", flush=True)
