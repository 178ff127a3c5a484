"""How much a search may do, counted in work so that a plan does not depend on the machine's load.

A search stopped by the clock reaches less on a busy machine, so the same tables, models, settings
and seed gave different plans on an idle machine and beside a busy process. The budget counts the
compute model's evaluations instead (`Pricer.evaluations`: shards priced, a model call counting at
least `CALL_EVALUATIONS`), which are the same on every machine and, call overhead included, track
the time a search takes. A wall-clock limit is there for a user who sets one; it is off by default,
and a plan it cut says so (its result depends on the machine's load).

A search divides the budget among its phases by shares of it: `budget.until(share)` is the point a
phase stops at, in both counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

from shard_ray.costmodel.pricing import Pricer
from shard_ray.errors import ShardRayError


@dataclass(frozen=True)
class SearchBudget:
    """A search's limits: compute-model evaluations (None: unlimited) and, optionally, wall-clock seconds."""

    max_evaluations: int | None = None
    time_limit_s: float | None = None
    RETIRED: ClassVar[dict[str, str]] = {
        "time_budget_s": "budgets count model evaluations since this release; use max_evaluations, "
        "or time_limit_s for a wall-clock cap"
    }

    def check(self) -> None:
        if self.max_evaluations is not None and self.max_evaluations < 1:
            raise ShardRayError(f"max_evaluations must be at least 1, got {self.max_evaluations}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ShardRayError(f"time_limit_s must be positive, got {self.time_limit_s}")

    def describe(self) -> str:
        parts = [f"{self.max_evaluations:,} model evaluations"] if self.max_evaluations is not None else []
        if self.time_limit_s is not None:
            parts.append(f"a {self.time_limit_s:g} s time limit")
        return " and ".join(parts) or "no budget"


class Spending:
    """A search's budget as it is spent, from the pricer's evaluation count and the clock."""

    def __init__(self, pricer: Pricer, budget: SearchBudget) -> None:
        self.pricer = pricer
        self.budget = budget
        self.evaluations = math.inf if budget.max_evaluations is None else budget.max_evaluations
        self.seconds = math.inf if budget.time_limit_s is None else budget.time_limit_s
        self.first_evaluation = pricer.evaluations
        self.began = time.perf_counter()
        # What stopped a phase with work left: "evaluations", "time limit", or nothing.
        self.cut_by: set[str] = set()

    def used(self) -> int:
        return self.pricer.evaluations - self.first_evaluation

    def until(self, share: float) -> PhaseEnd:
        return PhaseEnd(self, share)

    def cut_short(self) -> str | None:
        """Why the search ended before it finished, for the plan and the user; None when it finished."""
        if not self.cut_by:
            return None
        if "time limit" in self.cut_by:
            return (
                f"the {self.budget.time_limit_s:g} s time limit ended the search before it finished; a busy "
                "machine reaches less within it, so the plan may differ between runs (`--set time_limit_s=...` "
                "gives more, or leave it unset: the evaluation budget gives the same plan on any machine)"
            )
        ended = f"the budget of {self.budget.max_evaluations:,} model evaluations ended the search before it finished"
        unused = self.budget.max_evaluations - self.used()
        if unused <= 0:
            return f"{ended} (`--set max_evaluations=...` gives it more)"
        # each phase stops at its share: the phase that reached it ended the search with the total not spent (a walk
        # read "the budget ended it" beside "229,896 of its budget of 300,000" as a contradiction)
        return (
            f"{ended}: a phase of it used up its share, {unused:,} evaluations left unused "
            "(`--set max_evaluations=...` gives every phase more)"
        )


class PhaseEnd:
    """The point a phase stops at: `share` of the budget's evaluations or of its seconds, whichever comes first."""

    def __init__(self, spending: Spending, share: float) -> None:
        self.spending = spending
        self.evaluations = share * spending.evaluations
        self.seconds = share * spending.seconds

    def reached(self) -> bool:
        """Whether the phase is over; a phase that asks has work left, so a True is recorded as a cut."""
        spending = self.spending
        if spending.used() >= self.evaluations:
            spending.cut_by.add("evaluations")
            return True
        if time.perf_counter() - spending.began >= self.seconds:
            spending.cut_by.add("time limit")
            return True
        return False

    def mark(self) -> tuple[int, float]:
        """Where the spending stands now, for `would_pass`."""
        return self.spending.used(), time.perf_counter()

    def would_pass(self, mark: tuple[int, float], done: float) -> bool:
        """Whether work begun at `mark`, `done` (a fraction) of it done now, would end past the phase;
        a True is recorded as a cut, as in `reached`."""
        spending = self.spending
        evaluations, began = mark
        if evaluations + (spending.used() - evaluations) / done > self.evaluations:
            spending.cut_by.add("evaluations")
            return True
        now = time.perf_counter()
        if now - spending.began + (now - began) * (1 / done - 1) > self.seconds:
            spending.cut_by.add("time limit")
            return True
        return False
