"""Tune's Optuna searcher, made safe to resume after a sweep killed outright."""

from __future__ import annotations

from typing import Any

from ray.tune.search.optuna import OptunaSearch


class ResumableOptunaSearch(OptunaSearch):
    """OptunaSearch that passes over results of trials it does not know.

    Tune snapshots its trials and its searcher apart; a sweep killed between the two resumes a trial that the
    restored searcher never suggested, and OptunaSearch then fails the whole sweep with a KeyError on its first
    result (seen in `tests/test_failures.py`'s killed sweep; ray-project/ray issues 14814 and 19113 are the same
    failure in other searchers). Such a trial still runs and counts; the searcher only does not learn from it.
    """

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        if trial_id in self._ot_trials:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if trial_id in self._ot_trials:
            super().on_trial_complete(trial_id, result, error)
