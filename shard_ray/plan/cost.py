"""The one cost definition: a plan costs as much as its slowest device's embedding step.

cost(plan) = max over devices d of input_dist(d) + fwd_compute(d) + fwd_comm(d) + bwd_comm(d) + bwd_compute(d)

input_dist is the all-to-all of the batch's lookups to the devices that own them (TorchRec's
planner prices it as input_dist_comms); measurements taken before it was measured on its own
carry 0 there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator


def _without(data: Any, derived: str) -> Any:
    # A dump carries its computed total; reading the dump back recomputes it.
    return {k: v for k, v in data.items() if k != derived} if isinstance(data, dict) else data


# The parts of a device's step, in the order it runs them.
STEP_PARTS = ("input_dist_ms", "fwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms", "bwd_compute_ms")
# The collectives: measured on a gang whose devices have cores of their own, priced by the comm model
# where more devices than cores share a machine (they would measure the contention for cores), except across
# hosts emulated on it, whose links bound them.
PRICED_WHEN_SHARED = ("input_dist_ms", "fwd_comm_ms", "bwd_comm_ms")


class DeviceCost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    input_dist_ms: float = Field(default=0.0, ge=0)
    fwd_compute_ms: float = Field(ge=0)
    fwd_comm_ms: float = Field(ge=0)
    bwd_comm_ms: float = Field(ge=0)
    bwd_compute_ms: float = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _drop_total(cls, data: Any) -> Any:
        return _without(data, "total_ms")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_ms(self) -> float:
        return self.input_dist_ms + self.fwd_compute_ms + self.fwd_comm_ms + self.bwd_comm_ms + self.bwd_compute_ms


def median_of(rounds_ms: Sequence[float]) -> float:
    """The median round's cost: the lower middle one for an even count, a round that ran."""
    return sorted(rounds_ms)[(len(rounds_ms) - 1) // 2]


class RoundsSummary(BaseModel):
    """A plan measured in several rounds (each the median of its steps, on fresh batches).

    The median round's plan cost (the lower middle one for an even count: a round that ran, whose devices
    `median_round` keeps, so a plan has one cost wherever it is reported) with a distribution-free
    confidence interval: with n
    rounds, [x_(j), x_(n-j+1)] covers the true median with probability 1 - 2 P(Binomial(n, 1/2)
    < j); j is the largest rank keeping that at least the confidence asked for. Fewer than six
    rounds cannot reach 95%: the interval is then the whole range, and `coverage` says what it
    does reach.
    """

    model_config = ConfigDict(extra="forbid")

    rounds_ms: list[float] = Field(min_length=1)
    median_ms: float
    ci_low_ms: float
    ci_high_ms: float
    coverage: float

    @classmethod
    def of(cls, rounds_ms: list[float], confidence: float = 0.95) -> RoundsSummary:
        x = sorted(rounds_ms)
        n = len(x)

        def at_most(j: int) -> float:  # P(Binomial(n, 1/2) <= j), counted exactly (scipy.stats: 0.4 s to import)
            return sum(math.comb(n, k) for k in range(j + 1)) / 2**n

        j = 1
        while j < n // 2 and 1 - 2 * at_most(j) >= confidence:
            j += 1
        coverage = 1 - 2 * at_most(j - 1)
        median = median_of(x)
        return cls(
            rounds_ms=list(rounds_ms), median_ms=median, ci_low_ms=x[j - 1], ci_high_ms=x[n - j], coverage=coverage
        )

    def describe(self) -> str:
        if len(self.rounds_ms) == 1:
            return f"{self.median_ms:.2f} ms (one round)"
        # a round that ran: of an even count the lower middle one, not their mean (read as a wrong median: a walk)
        lower = " (the lower of the middle two rounds)" if len(self.rounds_ms) % 2 == 0 else ""
        return (
            f"{self.median_ms:.2f} ms{lower}, {self.coverage:.0%} CI [{self.ci_low_ms:.2f}, {self.ci_high_ms:.2f}] "
            f"over {len(self.rounds_ms)} rounds"
        )


class PlanCost(BaseModel):
    """Per-device parts of a plan's step; `cost_ms` is the slowest device's total."""

    model_config = ConfigDict(extra="forbid")

    devices: list[DeviceCost] = Field(min_length=1)
    hardware: str = "unknown"
    batch_size: int | None = None
    # Each device's host, numbered in device order of first appearance (which devices share a
    # host); None where it was not recorded (predictions, measurements before hosts were).
    hosts: list[int] | None = None
    warnings: list[str] = Field(default_factory=list)
    rounds: RoundsSummary | None = None  # measured in rounds: these devices are the median round's
    priced_parts: list[str] = Field(default_factory=list)  # parts priced by `priced_by`'s comm model, not measured
    priced_by: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_cost(cls, data: Any) -> Any:
        return _without(data, "cost_ms")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cost_ms(self) -> float:
        return max(d.total_ms for d in self.devices)

    @property
    def bottleneck_device(self) -> int:
        return max(self.devices, key=lambda d: d.total_ms).device

    @property
    def devices_per_host(self) -> int | None:
        """The devices per host the measurement ran over, when it spanned hosts of equal runs of devices
        (host 0 the first L, host 1 the next, ...); None on one host or where not recorded."""
        if not self.hosts or len(set(self.hosts)) == 1:
            return None
        local = self.hosts.count(self.hosts[0])
        even = len(self.hosts) % local == 0 and self.hosts == [d // local for d in range(len(self.hosts))]
        return local if even else None


def median_round(costs: list[PlanCost], confidence: float = 0.95) -> PlanCost:
    """One plan's rounds as one cost: the median round's (the lower middle one for an even count) with their summary."""
    if len(costs) == 1:
        return costs[0]
    middle = sorted(costs, key=lambda c: c.cost_ms)[(len(costs) - 1) // 2]
    return middle.model_copy(update={"rounds": RoundsSummary.of([c.cost_ms for c in costs], confidence)})


class PlanRatio(BaseModel):
    """One plan's cost over the chosen plan's, from their paired rounds, with the procedure's interval."""

    model_config = ConfigDict(extra="forbid")

    ratio: float  # geometric mean over the rounds of this plan's cost / the chosen plan's
    low: float
    high: float
    separated: bool  # the interval excludes 1: the procedure tells the two apart

    def describe(self) -> str:
        return f"{self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}]"


class MeasuredComparison(BaseModel):
    """Plans measured side by side on the gang and compared by `shard_ray.workflows.comparison`'s procedure.

    Candidates are named by algorithm or file ('='-joined where their placements agree). `ratios`
    holds every other plan's cost over the chosen one's with an interval that is simultaneous over
    all pairs of plans and every look the race took; `separated` says the chosen plan's interval
    with every other plan excludes 1, and `rule` says how the chosen plan was picked (keeping the `incumbent`,
    where there is one, unless another plan is separated as faster than it).
    """

    model_config = ConfigDict(extra="forbid")

    hardware: str
    chosen: str
    confidence: float
    separated: bool
    rule: str = ""
    incumbent: str | None = None  # the plan the user runs now, kept unless another is separated as faster
    steps_per_round: int
    rounds: int = 0
    pair_level: float = 0.0  # each interval's two-sided level at the look that ended the race
    candidates: dict[str, RoundsSummary]
    ratios: dict[str, PlanRatio] = {}
    priced_parts: list[str] = []  # step parts the comm model priced instead of the gang (more devices than cores)
    predicted_ms: dict[str, float] = {}  # the cost models' price of each candidate that has one, beside its median
    # what the gang found measuring the plans (a table's rows capped, which times it optimistically), each once, named
    # by plan where several were measured (`shard_ray.workflows.comparison.measured_warnings`)
    warnings: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _drop_legacy(cls, data: Any) -> Any:
        # Races before the procedure kept one-sided p-values against the leader; they are not verdicts to keep.
        return {k: v for k, v in data.items() if k != "p_slower"} if isinstance(data, dict) else data

    @property
    def cost(self) -> RoundsSummary:
        return self.candidates[self.chosen]

    def verdict(self, name: str) -> str:
        """What the comparison says of plan `name` against the chosen one: chosen, slower, faster or within noise."""
        if name == self.chosen:
            return "chosen"
        r = self.ratios[name]
        return ("slower" if r.ratio > 1 else "faster") if r.separated else "within noise"

    def best_of(self, algorithms: set[str]) -> str | None:
        """The measured best candidate (lowest median) made by any of `algorithms` (e.g. the heuristics), if any."""
        made = [n for n in self.candidates if algorithms & set(n.split("="))]
        return min(made, key=lambda n: self.candidates[n].median_ms) if made else None
