"""Comparing plans on the hardware: the one procedure behind `compare`, `plan --measure`, `bench` and `demo`.

Rounds. Each round measures every plan once, in a fresh random order, all on the same fresh
batches, so drift on the machine and the luck of a batch fall on every plan alike.

Ratios. For plans a and b, round r gives log(a_r / b_r). Their 20%-trimmed mean m and its standard
error s (from the winsorized variance: Tukey and McLaughlin's trimmed t) give the ratio exp(m) and
its interval exp(m -+ t s). Pairing by round cancels what a round shares; logs make a ratio and its
inverse symmetric; trimming keeps a round disturbed on one plan from deciding or swamping the
ratio. Unlike a rank test it is not floored at p = 2^-n, so a few rounds of a large difference suffice.

Many plans, many looks. Intervals are simultaneous: over every pair of plans (Bonferroni over the
k(k-1)/2 pairs, since the chosen plan is itself picked by the data) and over every look. The race
looks after six rounds growing geometrically from `min_rounds` to the most rounds N (6, 9, 13, 19,
27, 40 by default); the looks up to round n have spent Kim and DeMets' power-family share
alpha (n / N)^1.5 of alpha = 1 - confidence, and a look that ends the race (the budget
spent) spends what is left. By the union bound, the chance that a race makes
any false claim is at most alpha, however many plans and wherever it stops. "Separated" means the
chosen plan's interval with every other plan excludes 1. A/A races (a plan against a copy of itself,
measured as a second plan) check that this holds on the hardware (`experiments/measurement_noise.py`).

The chosen plan. The plan with the lowest trimmed ratio to the others; once it is separated
from every other the race ends. At the end, if it is not separated, the plans tied with it (their
interval includes 1) are equally good as far as the hardware can tell, and the one of them with the
lowest cost (its median round) is chosen, which the result's `rule` says: a measurement, never the
models' order, whose price gaps between such plans are smaller than their error.

The incumbent. Where one plan is what the user runs now (`plan --measure --incumbent`, TorchRec's
plan by default), a race that separates no plan from every other keeps it unless some plans are
separated as faster than it, by the same simultaneous intervals; then the fastest of those (by the
paired ratios) is chosen. So a plan replaces the incumbent only on the hardware's word, never on a
tie's lowest median.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shard_ray.configfile import setting
from shard_ray.errors import InfeasibleError, ShardRayError
from shard_ray.io import write_atomic, write_json
from shard_ray.plan.cost import MeasuredComparison, PlanCost, PlanRatio, RoundsSummary, median_of, median_round
from shard_ray.plan.plan import Plan
from shard_ray.plan.summary import PART_COLUMNS
from shard_ray.plan.topology import Topology
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec

if TYPE_CHECKING:
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.profiling.store import MeasurementStore
    from shard_ray.tracking.mlflow_runs import LoggedComparison


@dataclass(frozen=True)
class CompareConfig:
    rounds: int = setting(40, "most interleaved rounds (every plan measured once a round)", min=2)
    budget_seconds: float = setting(
        120.0, "seconds of measuring: the race ends at the last round that fits, but not before its first look", min=1
    )
    min_rounds: int = 6  # the first look: fewer paired rounds leave t a handful of degrees of freedom
    confidence: float = 0.95
    warmup: int = 3
    repeats: int = 10


def t_quantile(degrees: int, p: float) -> float:
    """Student's t quantile, from scipy.special (what scipy.stats.t.ppf calls, without scipy.stats' second of
    import), imported where a race is judged: commands that only read their flags skip its third of a second."""
    from scipy.special import stdtrit

    return float(stdtrit(degrees, p))


# An interval of a plan's ratio to the chosen one wider than this factor tells nothing (a race cut short, a noisy
# machine): `format_comparison` says so.
WIDE_INTERVAL = 2.0
LOOKS = 6  # looks a full-length race takes, the last at its most rounds


def look_schedule(first: int, most_rounds: int) -> list[int]:
    """The rounds after which the race looks: LOOKS rounds growing geometrically from `first` to `most_rounds`.

    Few looks leave each a larger share of alpha than a look after every round would, and a
    difference that needs n rounds to show is seen by round 1.5 n at the latest."""
    growth = (most_rounds / first) ** (1 / (LOOKS - 1))
    return sorted({min(most_rounds, round(first * growth**k)) for k in range(LOOKS)})


# Kim and DeMets' power family alpha t^rho: rho = 1 spends like Pocock's boundary, rho = 3 like O'Brien and
# Fleming's. The first look is where a trimmed t on a handful of heavy-tailed rounds is least exact: on the
# recorded A/A rounds of the 2-core gang, Lan-DeMets' Pocock-type function (a fifth of alpha by round 6) made
# 1.9% false separations there against the 1.15% it spent, 5.5% in all; 1.5 spends 0.29% there and made 5.0%
# in all, and separated a 5% difference more often (89% against 84%), as later looks keep more.
SPENDING_POWER = 1.5


def alpha_spent(rounds: int, most_rounds: int, alpha: float) -> float:
    """Alpha spent by the looks up to `rounds` of at most `most_rounds`: alpha (rounds / most_rounds)^1.5."""
    return alpha * min(rounds / most_rounds, 1.0) ** SPENDING_POWER


# The share of rounds trimmed from each end of the per-round log ratios (Tukey and McLaughlin's trimmed t):
# a round disturbed on one plan moves neither the ratio nor, beyond its share, the interval.
TRIM = 0.2


def ratio_interval(costs: Sequence[float], reference: Sequence[float], level: float) -> PlanRatio:
    """`costs` over `reference`, paired by round: the trimmed-mean ratio with its two-sided `level` interval.

    The interval is the trimmed t interval of the per-round log ratios (mean of the middle rounds,
    standard error from their winsorized variance, n - 2g - 1 degrees of freedom)."""
    logs = np.sort(np.log(np.asarray(costs, dtype=np.float64)) - np.log(np.asarray(reference, dtype=np.float64)))
    n = len(logs)
    g = int(TRIM * n)
    mean = float(logs[g : n - g].mean())
    if n - 2 * g < 2:
        half = math.inf
    else:
        winsorized = np.clip(logs, logs[g], logs[n - g - 1])
        se = float(winsorized.std(ddof=1)) / ((1 - 2 * g / n) * math.sqrt(n))
        half = t_quantile(n - 2 * g - 1, 1 - level / 2) * se
    low, high = math.exp(mean - half), math.exp(mean + half)
    return PlanRatio(ratio=math.exp(mean), low=low, high=high, separated=low > 1 or high < 1)


@dataclass(frozen=True)
class Verdict:
    chosen: str
    separated: bool  # the chosen plan's interval with every other excludes 1
    ratios: dict[str, PlanRatio]  # every other plan's cost over the chosen one's
    pair_level: float
    rule: str


class Race:
    """The procedure's state: the rounds so far and the alpha the looks have spent (see the module's doc)."""

    def __init__(
        self,
        names: Sequence[str],
        most_rounds: int,
        min_rounds: int = 6,
        confidence: float = 0.95,
        incumbent: str | None = None,
    ) -> None:
        if len(names) < 2:
            raise ShardRayError("a comparison needs two plans or more")
        if incumbent is not None and incumbent not in names:
            raise ShardRayError(f"the incumbent {incumbent!r} is not one of the plans compared ({', '.join(names)})")
        self.names, self.incumbent = list(names), incumbent
        self.most_rounds, self.alpha = most_rounds, 1 - confidence
        self.looks = look_schedule(min(min_rounds, most_rounds), most_rounds)
        self.rounds: dict[str, list[float]] = {name: [] for name in names}
        self.spent = 0.0

    @property
    def count(self) -> int:
        return len(self.rounds[self.names[0]])

    def record(self, costs: Mapping[str, float]) -> None:
        for name in self.names:
            self.rounds[name].append(costs[name])

    def look(self, final: bool) -> Verdict | None:
        """After a round: the verdict when the best plan is separated or `final` says the race ends, else None.

        Among plans tied at the end, the incumbent is kept unless plans are separated as faster than it (then the
        fastest of those is chosen); without an incumbent, the tied plan of the lowest cost (median round)."""
        if self.count not in self.looks and not final:
            return None
        total = self.alpha if final else alpha_spent(self.count, self.most_rounds, self.alpha)
        pairs = len(self.names) * (len(self.names) - 1) // 2
        level = (total - self.spent) / pairs
        self.spent = total
        best = self.fastest()
        ratios = self._ratios(best, level)
        if all(r.separated for r in ratios.values()):
            return Verdict(best, True, ratios, level, f"{best} is separated from every other plan")
        if not final:
            return None
        if self.incumbent is not None:
            return self._against_incumbent(level)
        tied = [best] + [name for name, r in ratios.items() if not r.separated]
        chosen = min(tied, key=lambda name: median_of(self.rounds[name]))  # the first such, on equal costs
        if chosen != best:
            ratios = self._ratios(chosen, level)
        # the fastest by the ratios named first, then the plans within its noise (read the other way, a new user
        # took the plan in brackets for the one within noise)
        rule = (
            f"no plan is separated from every other: the fastest by the paired ratios, {best}, is within noise of "
            f"{len(tied) - 1} other{'s' if len(tied) > 2 else ''} ({', '.join(tied[1:])}); of these {len(tied)}, "
            f"{chosen} has the lowest cost (median round) and is chosen"
        )
        return Verdict(chosen, False, ratios, level, rule)

    def fastest(self, among: Sequence[str] | None = None) -> str:
        """The plan (of `among`, default all) with the lowest trimmed ratio to the first plan (the first such, on
        ties)."""
        anchor = self.names[0]
        ratios = {name: ratio_interval(self.rounds[name], self.rounds[anchor], 1.0).ratio for name in self.names}
        return min(among or self.names, key=ratios.__getitem__)

    def _against_incumbent(self, level: float) -> Verdict:
        """The final verdict where no plan is separated from every other: the incumbent, or the fastest of the plans
        separated as faster than it."""
        incumbent = self.incumbent
        against = self._ratios(incumbent, level)
        # the plans whose cost over the incumbent's is below 1, with the interval
        faster = [name for name, r in against.items() if r.separated and r.ratio < 1]
        if not faster:
            rule = (
                f"no plan is separated as faster than the incumbent ({incumbent}), which is kept: "
                "a plan replaces it only when measured faster"
            )
            # listed above it in the table, such a plan read as a better one passed over without a reason (a walk)
            lower = self._lower_medians(incumbent)
            if lower:
                verb = "is" if len(lower) == 1 else "are"
                kept_ms = median_of(self.rounds[incumbent])
                rule += f"; {self._medians(lower)}, lower than its {kept_ms:.2f}, {verb} within noise"
            return Verdict(incumbent, False, against, level, rule)
        chosen = self.fastest(faster)
        rule = (
            f"no plan is separated from every other; {len(faster)} separated as faster than the incumbent "
            f"({incumbent}), and of these {chosen} is the fastest by the paired ratios and is chosen"
        )
        lower = self._lower_medians(chosen)
        not_faster = [name for name in lower if name not in faster]
        if not_faster:  # listed above the chosen plan in the table (a walk's demo): why it was not chosen
            verb = "is" if len(not_faster) == 1 else "are"
            rule += f"; {self._medians(not_faster)}, lower, {verb} not separated as faster than the incumbent"
        if len(lower) > len(not_faster):
            rule += f"; {self._medians([n for n in lower if n in faster])}, lower, the paired ratios put after it"
        return Verdict(chosen, False, self._ratios(chosen, level), level, rule)

    def _lower_medians(self, name: str) -> list[str]:
        """The plans whose median round is lower than plan `name`'s, lowest first, as the table lists them above it (in
        the order of the plans given, a walk read the line as unordered)."""
        own = median_of(self.rounds[name])
        return sorted(
            (other for other in self.names if median_of(self.rounds[other]) < own),
            key=lambda other: median_of(self.rounds[other]),
        )

    def _medians(self, names: list[str]) -> str:
        """`names`' median rounds, as a rule's line names them: the first three, and how many more."""
        shown = ", ".join(f"{name}'s median {median_of(self.rounds[name]):.2f} ms" for name in names[:3])
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def _ratios(self, chosen: str, level: float) -> dict[str, PlanRatio]:
        return {
            name: ratio_interval(self.rounds[name], self.rounds[chosen], level) for name in self.names if name != chosen
        }


def distinct(named: Sequence[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """Candidates with identical placements merged: (names joined by '=', the first such plan)."""
    merged: dict[tuple, tuple[list[str], Plan]] = {}
    for name, plan in named:
        placement = tuple(sorted((s.table, s.device, s.columns, s.rows or (), s.replicated) for s in plan.shards))
        merged.setdefault(placement, ([], plan))[0].append(name)
    return [("=".join(names), plan) for names, plan in merged.values()]


@dataclass
class ComparedPlans:
    """A comparison's verdict, and per plan (by its name in the verdict) the plan and its median round."""

    result: MeasuredComparison
    plans: dict[str, Plan]
    costs: dict[str, PlanCost]


def compare_plans(
    named: Sequence[tuple[str, Plan]],
    tables: list[TableSpec],
    topology: Topology,
    gang: DeviceGang,
    config: CompareConfig = CompareConfig(),
    store: MeasurementStore | None = None,
    log: Callable[[str], None] = print,
    merge_identical: bool = True,
    incumbent: str | None = None,
) -> ComparedPlans:
    """Measure the named plans side by side on `gang` in rounds until the procedure decides; its verdict.

    Plans with identical placements are measured once under their joined names (unless not
    `merge_identical`: an A/A race measures a plan against a copy of itself). `incumbent` names the plan the
    user runs now, kept unless another is separated as faster (see the module's doc). With a `store`, every
    round's measurement is kept there for the next calibration."""
    entries = distinct(named) if merge_identical else list(named)
    if len(entries) < 2:
        raise ShardRayError(
            f"{' and '.join(n for n, _ in named)} place the tables identically: nothing to compare"
            if len(named) > 1
            else "a comparison needs two plans or more"
        )
    plans = dict(entries)
    names = list(plans)
    incumbent = next((n for n in names if incumbent in n.split("=")), incumbent) if incumbent else None
    race = Race(names, config.rounds, config.min_rounds, config.confidence, incumbent)
    log(
        f"measuring {len(names)} distinct plans side by side on a gang of {topology.num_devices} devices: "
        f"up to {config.rounds} rounds or {config.budget_seconds:.0f} s, and at least {race.looks[0]} rounds (its first look)"
    )
    verdict, per_plan = _race_in_rounds(race, plans, tables, topology, gang, config, store, log)
    result = MeasuredComparison(
        hardware=gang.hardware,
        chosen=verdict.chosen,
        confidence=config.confidence,
        separated=verdict.separated,
        incumbent=incumbent,
        rule=verdict.rule,
        steps_per_round=config.repeats,
        rounds=race.count,
        pair_level=verdict.pair_level,
        candidates={name: RoundsSummary.of(values, config.confidence) for name, values in race.rounds.items()},
        ratios=verdict.ratios,
        priced_parts=gang.priced_parts,
        predicted_ms={name: plan.estimate.predicted.cost_ms for name, plan in plans.items() if plan.estimate},
    )
    costs = {name: median_round(costs) for name, costs in per_plan.items()}
    said = {w for plan in plans.values() if plan.estimate for w in plan.estimate.warnings} | set(gang.warnings)
    result.warnings = measured_warnings(costs, said)
    return ComparedPlans(result, plans, costs)


def measured_warnings(costs: Mapping[str, PlanCost], said: set[str]) -> list[str]:
    """What the gang found measuring each plan of `costs` (a table's rows capped, which times it optimistically), each
    once, named by the plans it was found of where several were measured (a line a plan, alike, made a race's output
    long: a walk); those `said` already (the gang's own at its start, the models' warnings on the plans, such as the
    comm model's pricing) left out."""
    found: dict[str, list[str]] = {}
    for name, cost in costs.items():
        for line in dict.fromkeys(w for w in cost.warnings if w not in said):
            found.setdefault(line, []).append(name)
    if len(costs) == 1:
        return list(found)
    return [
        f"{'every plan' if len(names) == len(costs) else ', '.join(names)}: {line}" for line, names in found.items()
    ]


def _race_in_rounds(
    race: Race,
    plans: dict[str, Plan],
    tables: list[TableSpec],
    topology: Topology,
    gang: DeviceGang,
    config: CompareConfig,
    store: MeasurementStore | None,
    log: Callable[[str], None],
) -> tuple[Verdict, dict[str, list[PlanCost]]]:
    """Rounds of every plan measured once, in a drawn order, until the race's verdict; each plan's costs."""
    from shard_ray.profiling.store import PlanMeasurement

    names = list(plans)
    order = np.random.default_rng(0)
    per_plan: dict[str, list[PlanCost]] = {name: [] for name in names}
    began = time.monotonic()
    while True:
        round_start = time.monotonic()
        measure = MeasureConfig.for_topology(topology, warmup=config.warmup, repeats=config.repeats, seed=race.count)
        costs = gang.measure_round([plans[n] for n in names], tables, measure, order)
        for name, cost in zip(names, costs):
            per_plan[name].append(cost)
            if store is not None:
                key = gang.plan_key(plans[name], tables, measure)
                store.put_plan(PlanMeasurement(key=key, plan=plans[name], tables=tables, cost=cost))
        race.record({name: cost.cost_ms for name, cost in zip(names, costs)})
        spent = time.monotonic() - began
        # the budget ends a race at its first look at the earliest: fewer rounds than that give no verdict worth
        # the name (one round's interval is [0, inf)), and a machine busy elsewhere must not cut a race to that
        out_of_time = spent + (time.monotonic() - round_start) > config.budget_seconds
        final = race.count >= config.rounds or (out_of_time and race.count >= race.looks[0])
        verdict = race.look(final)
        leader = race.fastest()
        log(
            f"round {race.count}: fastest so far by the paired ratios {leader} (its rounds' median "
            f"{median_of(race.rounds[leader]):.2f} ms); "
            f"{spent:.0f} s" + ("; the race ends here, its verdict under the table" if verdict else "")
        )
        if verdict is not None:
            return verdict, per_plan


def claim(result: MeasuredComparison, name: str, label: str) -> str:
    """What the comparison lets one say of the chosen plan against `name` (called `label`): a separated
    margin with its interval, or 'within noise' with the ratio's interval."""
    if name == result.chosen:
        return f"the chosen plan is {label} ({name})"
    r = result.ratios[name]
    if not r.separated:
        return f"within noise of {label} ({name}): its cost over the chosen plan's is {r.describe()}"
    faster = 1 - 1 / r.ratio
    low, high = sorted((1 - 1 / r.low, 1 - 1 / r.high))
    word = "faster" if faster > 0 else "slower"
    return (
        f"{abs(faster):.1%} {word} than {label} ({name}), measured: the saving's interval "
        f"[{low:+.1%}, {high:+.1%}] (cost ratio {r.describe()})"
    )


def claims(result: MeasuredComparison, heuristics: set[str]) -> list[str]:
    """What the comparison lets one say of the chosen plan against the incumbent, TorchRec's plan and the best of
    `heuristics`, each that raced."""
    torchrec = result.best_of({"torchrec"})
    incumbent = result.incumbent if result.incumbent != torchrec else None
    return [
        claim(result, found, label)
        for label, found in (
            ("the incumbent", incumbent),
            ("TorchRec's plan", torchrec),
            ("the best heuristic", result.best_of(heuristics)),
        )
        if found is not None
    ]


def format_comparison(result: MeasuredComparison, rounds_flag: str = "--rounds") -> str:
    """The comparison's table: per plan its median with an interval, its ratio to the chosen plan, the verdict;
    `rounds_flag` is the command's flag for the race's rounds, named where the intervals are too wide."""
    percent = int(round(result.confidence * 100))
    pairs = len(result.candidates) * (len(result.candidates) - 1) // 2
    named = ", ".join(PART_COLUMNS[part] for part in result.priced_parts)  # as the plan summary names them
    priced = f"; {named} priced by the comm model" if result.priced_parts else ""
    width = max(36, *map(len, result.candidates))  # a joined name (plans placing alike) can be longer
    lines = [
        f"measured side by side on {result.hardware}: {result.rounds} interleaved rounds of {result.steps_per_round} "
        f"steps{priced}; a plan's cost_ms is its median round's",
        f"ratios to the chosen plan with intervals simultaneous over {pairs} pair(s) and every look "
        f"({percent}% confidence in all of them together)",
        f"{'plan':<{width}} {'cost_ms':>10}  {'ratio to chosen':>28}  {'verdict':<12}  {'predicted':>9}  "
        f"{'measured/predicted':>18}",
    ]
    for name, c in sorted(result.candidates.items(), key=lambda item: item[1].median_ms):
        ratio = result.ratios[name].describe() if name in result.ratios else "1"
        predicted = result.predicted_ms.get(name)
        priced = f"{predicted:>9.2f}  {c.median_ms / predicted:>18.2f}" if predicted else f"{'-':>9}  {'-':>18}"
        lines.append(f"{name:<{width}} {c.median_ms:>10.2f}  {ratio:>28}  {result.verdict(name):<12}  {priced}")
    lines.append(result.rule)
    if result.priced_parts:  # the same price every round: the intervals hold the measured parts' noise alone
        lines.append(f"the intervals hold the timed parts' noise, not the error of the comm model's prices of {named}")
    wide = [r for r in result.ratios.values() if not r.separated and r.high > WIDE_INTERVAL * r.low]
    if wide:
        widest = max(wide, key=lambda r: r.high / r.low)
        which = (
            "the interval"
            if len(result.ratios) == 1
            else f"{len(wide)} of the {len(result.ratios)} intervals (the widest [{widest.low:.3f}, {widest.high:.3f}])"
        )
        lines.append(
            f"{which} {'spans' if len(wide) == 1 else 'span'} more than a factor of {WIDE_INTERVAL:g} after "
            f"{result.rounds} rounds: too few to tell the plans apart; more rounds ({rounds_flag}) narrow the intervals"
        )
    if result.predicted_ms:
        lines.append("predicted: the cost models' price of each plan (ms); measured/predicted: its cost_ms over it")
    return "\n".join(lines)


def ratio_chart(result: MeasuredComparison, path: Path) -> None:
    """Every plan's cost ratio to the chosen plan with its interval, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(result.candidates, key=lambda n: result.candidates[n].median_ms)
    ratio = [result.ratios[n].ratio if n in result.ratios else 1.0 for n in names]
    low = [r - result.ratios[n].low if n in result.ratios else 0.0 for n, r in zip(names, ratio)]
    high = [result.ratios[n].high - r if n in result.ratios else 0.0 for n, r in zip(names, ratio)]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    ax.errorbar(ratio, range(len(names)), xerr=[low, high], fmt="o", capsize=4)
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"measured cost / the chosen plan's ({result.chosen}); simultaneous intervals")
    ax.set_title(f"{result.rounds} interleaved rounds on {result.hardware}")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, image.getvalue())


def twin(plan: Plan) -> Plan:
    """The plan with every device's shards moved to the next device: the same cost were the gang's ranks alike.
    They need not be (on the 2-core CPU gang the rank that computes an unbalanced plan's heavy share changes its
    cost by about 1.5%, cores rotated), so a plan against its twin checks the ranks, not the procedure."""
    rotated = [s.model_copy(update={"device": (s.device + 1) % plan.num_devices}) for s in plan.shards]
    return plan.model_copy(update={"shards": rotated, "algorithm": f"{plan.algorithm}_twin", "memory_bytes": None})


@dataclass(frozen=True)
class NoiseFloor:
    """A plan measured against a copy of itself in interleaved rounds: how far apart equal plans come out here."""

    rounds: int
    round_spread: float  # median over rounds of |copy / plan - 1|
    resolvable: float  # the smallest ratio - 1 a default two-plan comparison separates with this noise

    def describe(self) -> str:
        return (
            f"a plan against a copy of itself ({self.rounds} rounds): rounds differ by {self.round_spread:.1%} (median); "
            f"a comparison of two plans (up to {CompareConfig().rounds} rounds) separates differences of about "
            f"{self.resolvable:.1%} or more, as this run's {self.rounds} rounds estimate it (it moves from run to run, "
            "and races of more plans or fewer rounds separate less)"
        )


def noise_floor(
    plan: Plan, tables: list[TableSpec], topology: Topology, gang: DeviceGang, measure: MeasureConfig, rounds: int = 8
) -> NoiseFloor:
    """This machine's noise floor: `plan` and a copy of it, measured as two plans in `rounds` interleaved rounds,
    and what that noise lets a default comparison of two plans resolve (`resolvable`)."""
    plans = [plan, plan]
    order = np.random.default_rng(0)
    costs = [
        gang.measure_round(plans, tables, measure.model_copy(update={"seed": measure.seed + r}), order)
        for r in range(rounds)
    ]
    a, b = [c[0].cost_ms for c in costs], [c[1].cost_ms for c in costs]
    return NoiseFloor(
        rounds=rounds,
        round_spread=float(np.median(np.abs(np.asarray(b) / np.asarray(a) - 1))),
        resolvable=resolvable(trimmed_sd(np.log(b) - np.log(a)), CompareConfig()),
    )


def trimmed_sd(logs: Sequence[float]) -> float:
    """The winsorized standard deviation of per-round log ratios, as `ratio_interval` uses it."""
    x = np.sort(np.asarray(logs, dtype=np.float64))
    g = int(TRIM * len(x))
    return float(np.clip(x, x[g], x[len(x) - g - 1]).std(ddof=1))


def resolvable(sd: float, config: CompareConfig, plans: int = 2) -> float:
    """The smallest ratio - 1 that a full-length race of `plans` plans separates at one of its looks, for
    per-round log ratios of winsorized standard deviation `sd`."""
    alpha, spent, smallest = 1 - config.confidence, 0.0, math.inf
    pairs = plans * (plans - 1) // 2
    for n in look_schedule(min(config.min_rounds, config.rounds), config.rounds):
        total = alpha_spent(n, config.rounds, alpha)
        level, spent = (total - spent) / pairs, total
        g = int(TRIM * n)
        if n - 2 * g < 2:
            continue
        crit = t_quantile(n - 2 * g - 1, 1 - level / 2)
        smallest = min(smallest, crit * sd / ((1 - 2 * g / n) * math.sqrt(n)))
    return math.exp(smallest) - 1


@dataclass
class AlgorithmPlans:
    """Every named algorithm's plan of a task, and those that could not plan it, with why."""

    plans: list[Plan]
    failures: dict[str, str]


def plan_with_algorithms(
    tables: list[TableSpec],
    topology: Topology,
    hardware: str | None,
    names: list[str] | None = None,
    seed: int = 0,
    cost_model: str | None = None,
    settings: Mapping[str, Mapping[str, object]] | None = None,
) -> AlgorithmPlans:
    """Every named algorithm's plan (all registered ones that handle the task by default).

    `settings` gives algorithms their own settings by name. An algorithm that finds no placement
    within memory is recorded in `failures` and the others go on; any other error stops the run.
    Every plan is priced by the models, those placed without them too.
    """
    from shard_ray.placement import algorithms, place
    from shard_ray.placement.base import priced

    names = names or [info.name for info in algorithms() if info.handles(len(tables))]
    plans, failures = [], {}
    for name in names:
        try:
            plan = place(
                name,
                tables,
                topology,
                seed=seed,
                cost_model=cost_model,
                hardware=hardware,  # picks its calibrated models, or warns that the models are another's
                settings=(settings or {}).get(name),
            )
        except InfeasibleError as err:
            failures[name] = str(err)
            continue
        plans.append(plan if plan.estimate else priced(plan, tables, topology, cost_model, hardware))
    return AlgorithmPlans(plans, failures)


@dataclass
class AlgorithmComparison:
    """Algorithms' plans of one task compared on the gang: per algorithm its plan and its median round (plans
    that agree share one measurement), the comparison (None when every algorithm made the same plan), and
    the algorithms that could not plan the task, with why."""

    plans: dict[str, Plan]
    costs: dict[str, PlanCost]
    result: MeasuredComparison | None
    failures: dict[str, str]
    logged: LoggedComparison | None = None  # the comparison's MLflow runs, where it was logged


def compare_algorithms(
    tables: list[TableSpec],
    topology: Topology,
    gang: DeviceGang,
    config: CompareConfig,
    task: str,
    names: list[str] | None = None,
    tracking_uri: str | None = None,
    experiment: str = "shard-ray",
    out_dir: Path | None = None,
    seed: int = 0,
    cost_model: str | None = None,
    settings: Mapping[str, Mapping[str, object]] | None = None,
    log: Callable[[str], None] = print,
    incumbent: str | None = None,
) -> AlgorithmComparison:
    """Every named algorithm's plan (`plan_with_algorithms`), compared on the gang by the procedure, the
    `incumbent` algorithm's plan kept unless another is separated as faster (where that algorithm planned the
    task). Each plan and result is written under `out_dir` and logged to MLflow."""
    from shard_ray.costmodel.models import models_for
    from shard_ray.plan.plan import save_plan
    from shard_ray.tracking.mlflow_runs import log_comparison, log_plan_evaluation

    cost_model = cost_model or str(models_for(gang.hardware, topology.devices_per_host, tables))
    planned = plan_with_algorithms(tables, topology, gang.hardware, names, seed, cost_model, settings)
    plans = {p.algorithm: p for p in planned.plans}
    result = compared = None
    if len(distinct(list(plans.items()))) > 1:
        kept = incumbent if incumbent in plans else None
        compared = compare_plans(list(plans.items()), tables, topology, gang, config, log=log, incumbent=kept)
        result = compared.result
        costs = {algorithm: cost for joined, cost in compared.costs.items() for algorithm in joined.split("=")}
    elif plans:
        (cost,) = gang.evaluate_rounds(
            planned.plans[:1], tables, MeasureConfig.for_topology(topology), config.min_rounds
        )
        costs = dict.fromkeys(plans, cost)
    else:
        costs = {}
    for algorithm, plan in plans.items():
        if out_dir is not None:
            save_plan(out_dir / "plans" / f"{algorithm}.json", plan)
            write_json(out_dir / "results" / f"{algorithm}.json", costs[algorithm].model_dump(mode="json"))
    logged = None
    if tracking_uri is not None and compared is not None:  # a run per distinct plan, as measured
        logged = log_comparison(
            result, compared.plans, compared.costs, topology, task, tables, tracking_uri, experiment
        )
    elif tracking_uri is not None:
        for algorithm, plan in plans.items():
            log_plan_evaluation(plan, costs[algorithm], topology, task, tables, tracking_uri, experiment)
    return AlgorithmComparison(plans, costs, result, planned.failures, logged)
