"""Ray Tune sweep of the cost-model search's hyperparameters, top to bottom: simulated, then measured.

Space: the dim-sum cap grid (its largest scale and how many steps from 1.0), beam width and
depth, branching, the column splits tried, and the local-search budget in steps, all inside
the budget of model evaluations the user sets (which is not swept: more never hurts).
Objective: over validation tasks drawn from the pool, the mean of each plan's simulated cost
over the task's lower bound (column-wise, so 1.0 is unbeatable). Simulation ranks, the
hardware decides: the `measure_top` best configurations and the shipped `cost_search`
settings then plan the first `measure_tasks` validation tasks, and on each task their plans race side by
side on a device gang by `compare`'s procedure (every race logged to MLflow). A finalist replaces the
shipped settings only where the hardware says so: faster beyond the noise on some task and slower on none
(intervals simultaneous over every task's pairs and looks); that configuration, or the shipped one, is
saved for `plan --algo cost_search --search-config`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from shard_ray.configfile import dataclass_from
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator, price_comm
from shard_ray.placement.search import COST_SEARCH, MAX_EVALUATIONS, SearchConfig, search_placer
from shard_ray.plan.cost import PlanRatio
from shard_ray.plan.topology import Topology
from shard_ray.tuning.settings import SearchSweepConfig
from shard_ray.tuning.sweep import ScoredWith, SweepConfig, ranked_trials, run_sweep, save_best
from shard_ray.workflows.comparison import CompareConfig
from shard_ray.workload.tables import TableSpec

METRIC = "simulated_over_bound"
# The SearchConfig fields a trial sets (`search_config_from`) and best.json keeps; the rest are cost_search's own.
SWEPT = ("scales", "beam_width", "beam_depth", "branching", "split_ways", "local_search_steps")
SHIPPED = "shipped"  # the finalists' rival: cost_search's own settings
SPLITS = {"halves": (2,), "halves+quarters": (2, 4), "halves+quarters+eighths": (2, 4, 8)}
Task = tuple[list[TableSpec], Topology]


def search_space() -> dict[str, Any]:
    from ray import tune

    return {
        "scale_max": tune.uniform(1.0, 2.0),
        "scale_steps": tune.randint(1, 9),
        "beam_width": tune.randint(1, 7),
        "beam_depth": tune.randint(0, 7),
        "branching": tune.randint(1, 6),
        "split_ways": tune.choice(list(SPLITS)),
        "local_search_steps": tune.choice([0, 25, 50, 100, 200, 400, 800]),
    }


def search_config_from(trial: dict[str, Any], max_evaluations: int) -> SearchConfig:
    steps, top = int(trial["scale_steps"]), float(trial["scale_max"])
    scales = tuple(round(1.0 + (top - 1.0) * k / (steps - 1), 3) for k in range(steps)) if steps > 1 else (1.0,)
    values = {
        "scales": scales,
        "beam_width": int(trial["beam_width"]),
        "beam_depth": int(trial["beam_depth"]),
        "branching": int(trial["branching"]),
        "split_ways": SPLITS[trial["split_ways"]],
        "local_search_steps": int(trial["local_search_steps"]),
        "max_evaluations": max_evaluations,
    }
    return dataclass_from(SearchConfig, values, "search trial")


def validation_tasks(pool: list[TableSpec], settings: SearchSweepConfig) -> list[Task]:
    from shard_ray.policy.ppo import validation_tasks as draw
    from shard_ray.policy.settings import PolicyConfig

    shape = PolicyConfig(
        min_tables=settings.min_tables,
        max_tables=settings.max_tables,
        devices=(settings.devices,),
        max_devices=settings.devices,
        memory_headroom=(settings.memory_headroom, settings.memory_headroom),
        batch_size=settings.batch_size,
    )
    return draw(pool, shape, settings.tasks, settings.seed)


def simulated_score(config: SearchConfig, tasks: list[Task], models: CostModels) -> tuple[float, float]:
    """Mean simulated cost over the lower bound, and mean placement seconds, of `config` on `tasks`."""
    from shard_ray.costmodel.bounds import lower_bound_ms

    simulator, placer = Simulator(models), search_placer("cost_search", config, models)
    ratios, seconds = [], []
    for tables, topology in tasks:
        began = time.perf_counter()
        plan = placer(tables, topology)
        seconds.append(time.perf_counter() - began)
        cost = simulator.plan_cost(plan, tables, topology.batch_size).cost_ms
        ratios.append(cost / lower_bound_ms(models, tables, topology, column_wise=True))
    return statistics.mean(ratios), statistics.mean(seconds)


def search_trial(trial: dict[str, Any], tasks: list[Task], models_bytes: bytes, settings: SearchSweepConfig) -> None:
    from ray import tune

    ratio, seconds = simulated_score(
        search_config_from(trial, settings.max_evaluations), tasks, CostModels.from_bytes(models_bytes)
    )
    tune.report({METRIC: ratio, "placement_seconds": seconds})


def race_finalists(
    candidates: dict[str, SearchConfig],
    tasks: list[Task],
    models: CostModels,
    settings: SearchSweepConfig,
    race: CompareConfig,
    tracking_uri: str | None,
    experiment: str,
) -> dict[str, list[PlanRatio | None]]:
    """Every finalist's cost over the shipped settings' on each of `tasks`, with an interval: their plans raced side
    by side on a gang by `compare`'s procedure (`race`, each task's), the shipped settings' plan the incumbent. Each
    race's intervals hold at a share of `race`'s confidence, so that those of every task hold together; None where a
    finalist's plan is the shipped settings' own."""
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.tracking.mlflow_runs import log_comparison
    from shard_ray.workflows.comparison import compare_plans, distinct, ratio_interval

    race = replace(
        race,
        min_rounds=min(race.min_rounds, race.rounds),
        repeats=settings.repeats,
        confidence=1 - (1 - race.confidence) / len(tasks),
    )
    ratios: dict[str, list[PlanRatio | None]] = {label: [] for label in candidates if label != SHIPPED}
    with DeviceGang(settings.devices, comm_pricer=price_comm) as gang:
        for index, (tables, topology) in enumerate(tasks):
            task = f"validation-{index}"
            named = []
            for label, config in candidates.items():
                plan = search_placer(f"cost_search[{label}]", config, models)(tables, topology)
                plan.check(tables)
                plan.check_memory(tables, topology)
                named.append((label, plan))
            if len(distinct(named)) == 1:
                print(f"{task}: every finalist places the tables as the shipped settings do; nothing to measure")
                for values in ratios.values():
                    values.append(None)
                continue
            compared = compare_plans(
                named,
                tables,
                topology,
                gang,
                race,
                log=lambda line, task=task: print(f"{task}: {line}", flush=True),
                incumbent=SHIPPED,
            )
            result = compared.result
            joined = {label: name for name in result.candidates for label in name.split("=")}
            shipped = result.candidates[joined[SHIPPED]].rounds_ms
            for label, values in ratios.items():
                ratio = None
                if joined[label] != joined[SHIPPED]:
                    ratio = ratio_interval(result.candidates[joined[label]].rounds_ms, shipped, result.pair_level)
                values.append(ratio)
                print(
                    f"{task}: {label}'s cost over the shipped settings' {describe_against_shipped(ratio)}", flush=True
                )
            if tracking_uri:
                log_comparison(result, compared.plans, compared.costs, topology, task, tables, tracking_uri, experiment)
    return ratios


def describe_against_shipped(ratio: PlanRatio | None) -> str:
    """A finalist's cost over the shipped settings' on one task, with its interval and what the race can say of it."""
    if ratio is None:
        return "1 (the same plan)"
    verdict = "within noise" if not ratio.separated else ("faster" if ratio.high < 1 else "slower")
    return f"{ratio.describe()}, {verdict}"


def faster_tasks(ratios: list[PlanRatio | None]) -> int:
    """On how many tasks a finalist measured faster than the shipped settings: its interval below 1."""
    return sum(r is not None and r.high < 1 for r in ratios)


def choose_measured(ratios: dict[str, list[PlanRatio | None]]) -> str:
    """The finalist measured faster than the shipped settings (`faster_tasks`) on the most tasks and slower on none,
    the lowest mean ratio among equals; the shipped settings where none is."""

    def mean_log_ratio(label: str) -> float:
        return statistics.mean(math.log(r.ratio) if r is not None else 0.0 for r in ratios[label])

    winners = [
        label
        for label, values in ratios.items()
        if faster_tasks(values) and not any(r is not None and r.low > 1 for r in values)
    ]
    return min(winners, key=lambda label: (-faster_tasks(ratios[label]), mean_log_ratio(label)), default=SHIPPED)


def scored_with(pool: list[TableSpec], settings: SearchSweepConfig, cost_model: str | None) -> ScoredWith:
    """What the search sweep's trials are scored with: the validation tasks' settings, the pool, the models pricing
    them (not the measured step's settings, which score no trial)."""
    from shard_ray.workload.tables import task_digest

    measured = ("measure_top", "measure_tasks", "repeats")
    values = {k: v for k, v in asdict(settings).items() if k not in measured}
    values["max_evaluations"] = settings.max_evaluations or MAX_EVALUATIONS  # as the trials spend it
    values |= {"tables": task_digest(pool), "cost_model": str(cost_model or default_cost_model_path())}
    return ScoredWith.of(
        values, SearchSweepConfig, SweepConfig, tables="the pool (--tables) of digest", cost_model="--cost-model"
    )


def tune_search(
    pool: list[TableSpec],
    sweep: SweepConfig,
    settings: SearchSweepConfig,
    race: CompareConfig,
    out_dir: str | Path,
    tracking_uri: str | None,
    experiment: str,
    cost_model: str | None = None,
) -> Path:
    """Sweep, race the finalists on the gang (`race`, each measured task's), then write OUT/best.json (tuned
    SearchConfig) and OUT/trials.csv."""
    from ray import tune

    settings.check()
    settings = replace(settings, max_evaluations=settings.max_evaluations or MAX_EVALUATIONS)
    model_path = Path(cost_model) if cost_model else default_cost_model_path()
    models = CostModels.load(model_path)
    tasks = validation_tasks(pool, settings)
    print(
        f"search sweep: {len(tasks)} validation tasks of {settings.min_tables}-{settings.max_tables} tables on {settings.devices} devices",
        flush=True,
    )
    results = run_sweep(
        "search",
        tune.with_parameters(search_trial, tasks=tasks, models_bytes=model_path.read_bytes(), settings=settings),
        search_space(),
        METRIC,
        "min",
        sweep,
        out_dir,
        tracking_uri,
        experiment,
        {"hardware": models.hardware},
        scored_with(pool, settings, cost_model),
    )
    finished = ranked_trials(results, METRIC, out_dir)
    shipped = replace(COST_SEARCH, max_evaluations=settings.max_evaluations)
    shipped_ratio, _ = simulated_score(shipped, tasks, models)
    print(f"simulated cost over the lower bound: shipped cost_search settings {shipped_ratio:.4f}")
    for r in finished[:5]:
        print(f"  {r.metrics['trial_id']}: {r.metrics[METRIC]:.4f}, {r.metrics['placement_seconds']:.2f} s a plan")
    finalists = {
        r.metrics["trial_id"]: search_config_from(r.config, settings.max_evaluations)
        for r in finished[: settings.measure_top]
    }
    notes: dict[str, Any] = {"hardware": models.hardware, "shipped_simulated_over_bound": shipped_ratio}
    if finalists:
        measured = race_finalists(
            {SHIPPED: shipped, **finalists}, tasks[: settings.measure_tasks], models, settings, race, tracking_uri,
            experiment,
        )  # fmt: skip
        chosen = choose_measured(measured)
        notes["measured_over_shipped"] = {
            label: [None if ratio is None else ratio.model_dump() for ratio in values]
            for label, values in measured.items()
        }
        # where every finalist placed the measured tasks as the shipped settings do, no measurement chose
        notes["chosen_by"] = (
            "measured" if any(r is not None for rs in measured.values() for r in rs) else "placed alike"
        )
        if chosen == SHIPPED:
            print(
                "no finalist measured faster than the shipped settings beyond the noise (and slower on no task): "
                "the shipped settings are kept as the best configuration"
            )
            config, value = shipped, shipped_ratio
        else:
            wins = faster_tasks(measured[chosen])
            print(f"{chosen} measured faster than the shipped settings on {wins} of {len(measured[chosen])} tasks")
            config = finalists[chosen]
            value = next(r.metrics[METRIC] for r in finished if r.metrics["trial_id"] == chosen)
    elif finished[0].metrics[METRIC] < shipped_ratio:
        config, value, notes["chosen_by"] = (
            search_config_from(finished[0].config, settings.max_evaluations),
            finished[0].metrics[METRIC],
            "simulated",
        )
    else:  # no trial priced below the shipped settings
        print(
            "no trial priced the validation tasks below the shipped settings: they are kept as the best configuration"
        )
        config, value, notes["chosen_by"] = shipped, shipped_ratio, "simulated"
    # The budget is the sweep's, not a setting found: a quick sweep's small one would cut every plan's search short.
    notes["swept_with_max_evaluations"] = settings.max_evaluations
    found = {k: v for k, v in asdict(config).items() if k in SWEPT}
    return save_best("search", found, METRIC, "min", value, results, out_dir, notes)
