"""How far shard-ray's measurements and comparisons can be trusted on this machine.

    OMP_NUM_THREADS=1 python experiments/measurement_noise.py --out experiments/results/measurement_noise

On the 2-device gang, with the public-model table files (Criteo Kaggle and MLPerf DLRM-DCNv2
cardinalities) planned by the heuristics and cost_search:

- Repeatability: every distinct plan of 2 ms or more measured by two separate `shard-ray evaluate`
  runs, as a user types it (a fresh Ray and gang each; every plan once, then every plan again);
  per plan |run 2 / run 1 - 1|, and whether run 1's interval holds run 2's median. Then, on one
  gang, two passes of every plan keeping every timed step, so that the estimators of a part's
  steps (median, mean, 20%-trimmed mean, minimum) are compared on the same data.
- A/A: real comparisons (`compare_plans`, default settings) of a plan against a copy of itself,
  measured as a second plan; then seeded races replayed from their recorded rounds.
- Ranks: each of those plans against its twin with the devices swapped, which would cost the same
  were the gang's ranks alike.
- A/B: the replayed A/A rounds with one side made 5% slower: how often, and after how many rounds,
  the procedure separates them within the default budget; and a real pair of plans from the pool
  whose long-run ratio is nearest 1.05, compared with the defaults.
- Coverage: every real comparison is run twice; how often the second run's ratio falls inside
  the interval the first reported, and each plan's second-pass median inside the first pass's
  interval.

Writes `noise.json` (every number and the recorded A/A rounds) to --out.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_json
from shard_ray.placement import place
from shard_ray.plan.cost import RoundsSummary
from shard_ray.plan.plan import Plan, save_plan
from shard_ray.plan.topology import GB, Topology
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.runtime import connect_ray
from shard_ray.workflows.comparison import CompareConfig, Race, compare_plans, distinct, twin
from shard_ray.workload.tables import load_tables

ALGORITHMS = (
    "size_greedy",
    "dim_greedy",
    "lookup_greedy",
    "size_lookup_greedy",
    "round_robin",
    "random",
    "cost_search",
)
TABLE_FILES = {
    "criteo_kaggle": ("experiments/tables/criteo_kaggle.json", 4.0),
    "mlperf_dlrm_dcnv2": ("experiments/tables/mlperf_dlrm_dcnv2.json", 74.0),
}


def trimmed(values: list[float], share: float = 0.2) -> float:
    x = sorted(values)
    g = int(share * len(x))
    return statistics.fmean(x[g : len(x) - g])


ESTIMATORS = {"median": statistics.median, "mean": statistics.fmean, "trimmed": trimmed, "min": min}


def round_cost(devices: list[dict], estimator: str) -> float:
    """A round's plan cost from every device's timed steps: the slowest device's sum of its parts' estimates
    (`min_step`: the device's fastest whole step instead)."""
    if estimator == "min_step":
        return max(min(map(sum, zip(*d["steps"].values()))) for d in devices)
    estimate = ESTIMATORS[estimator]
    return max(sum(estimate(values) for values in d["steps"].values()) for d in devices)


def measure_pass(gang: DeviceGang, plans: list[tuple[str, Plan, list]], rounds: int, batch: int) -> dict:
    """Every plan as `evaluate` measures it: `rounds` rounds on fresh batches; every estimator's round costs."""
    out = {}
    for name, plan, tables in plans:
        per_round = []
        for r in range(rounds):
            gang.rotate_cores(r)  # as a comparison's rounds do
            per_round.append(gang.run_steps(plan, tables, MeasureConfig(batch_size=batch, seed=r)))
        out[name] = {e: [round_cost(devices, e) for devices in per_round] for e in [*ESTIMATORS, "min_step"]}
    return out


def evaluate_runs(plans: list[tuple[str, Plan, list]], runs: int) -> dict[str, list[dict]]:
    """Every plan measured by `runs` separate `shard-ray evaluate` runs (every plan once, then again): per plan
    each run's median round and interval."""
    shard_ray = str(Path(sys.executable).with_name("shard-ray"))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in plans}
    with tempfile.TemporaryDirectory() as folder:
        for run in range(runs):
            for name, plan, _ in plans:
                task = name.split("/")[0]
                plan_file, out = Path(folder, "plan.json"), Path(folder, "cost.json")
                save_plan(plan_file, plan)
                subprocess.run(
                    [shard_ray, "evaluate", "--tables", TABLE_FILES[task][0], "--plan", str(plan_file),
                     "--out", str(out), "--no-mlflow"],
                    check=True, capture_output=True,
                )  # fmt: skip
                results[name].append(json.loads(out.read_text())["rounds"])
                print(f"evaluate run {run + 1} {name}: {results[name][-1]['median_ms']:.2f} ms", flush=True)
    return results


def replay(rounds: list[tuple[float, float]], slower: float, races: int, config: CompareConfig, seed: int) -> dict:
    """Seeded races drawn (with replacement) from recorded A/A round pairs; the second plan made `slower`."""
    rng = np.random.default_rng(seed)
    separated, needed = 0, []
    for _ in range(races):
        race = Race(["a", "b"], config.rounds, config.min_rounds, config.confidence)
        while True:
            a, b = rounds[rng.integers(len(rounds))]
            race.record({"a": a, "b": b * slower})
            verdict = race.look(race.count >= config.rounds)
            if verdict is not None:
                break
        if verdict.separated:
            separated += 1
            needed.append(race.count)
    return {
        "races": races,
        "separated": separated,
        "rate": separated / races,
        "median_rounds_to_separate": statistics.median(needed) if needed else None,
    }


def earlier_race_separates(rounds: dict[str, list[float]]) -> bool:
    """The race before this procedure (kept here to measure it): from round 6 on, after every round, a plan is
    dropped when a one-sided Wilcoxon test at 5% says it is slower than the leader; 'separated' when one is left."""
    from scipy.stats import wilcoxon

    active = list(rounds)
    for n in range(6, len(next(iter(rounds.values()))) + 1):
        leader = min(active, key=lambda k: np.median(rounds[k][:n]))
        for name in [k for k in active if k != leader]:
            diffs = np.log(rounds[name][:n]) - np.log(rounds[leader][:n])
            if np.any(diffs) and wilcoxon(diffs, alternative="greater").pvalue < 0.05:
                active.remove(name)
        if len(active) == 1:
            return True
    return False


def replay_many(rounds: list[tuple[float, float]], plans: int, races: int, config: CompareConfig, seed: int) -> dict:
    """A/A races of `plans` equal plans, each round built from recorded pairs (plans 2k and 2k+1 from one
    recorded round): how often this procedure, and the earlier race, call one of them separated."""
    rng = np.random.default_rng(seed)
    names = [f"p{i}" for i in range(plans)]
    now = earlier = 0
    for _ in range(races):
        race = Race(names, config.rounds, config.min_rounds, config.confidence)
        while True:
            drawn = [v for _ in range((plans + 1) // 2) for v in rounds[rng.integers(len(rounds))]][:plans]
            race.record(dict(zip(names, drawn)))
            verdict = race.look(race.count >= config.rounds)
            if verdict is not None:
                break
        now += verdict.separated
        full = dict(race.rounds)
        while len(full[names[0]]) < config.rounds:  # the earlier race ran to its 40 rounds unless it separated
            drawn = [v for _ in range((plans + 1) // 2) for v in rounds[rng.integers(len(rounds))]][:plans]
            for name, value in zip(names, drawn):
                full[name] = [*full[name], value]
        earlier += earlier_race_separates(full)
    return {
        "plans": plans,
        "races": races,
        "separated_now": now / races,
        "separated_by_the_earlier_race": earlier / races,
    }


def replays(aa_rounds: list, races: int) -> dict:
    """Every replayed figure from recorded A/A rounds, printed as they come."""
    config = CompareConfig()
    pairs = [tuple(p) for p in aa_rounds]
    found = {
        "replayed_aa": replay(pairs, 1.0, races, config, seed=0),
        "replayed_ab_5pct": replay(pairs, 1.05, races, config, seed=1),
        "replayed_aa_2_plans": replay_many(pairs, 2, races, config, seed=2),
        "replayed_aa_8_plans": replay_many(pairs, 8, races // 2, config, seed=3),
    }
    for name, value in found.items():
        print(f"{name}: {value}")
    return found


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=a_folder_to_write, default="experiments/results/measurement_noise")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per plan and pass, as evaluate's default")
    parser.add_argument("--aa-races", type=int, default=3, help="real A/A comparisons (each run twice)")
    parser.add_argument("--replays", type=int, default=400, help="seeded races replayed from recorded rounds")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument(
        "--replay-from", help="an earlier run's noise.json: replay its recorded rounds, measure nothing"
    )
    args = parser.parse_args()
    if args.replay_from:
        report = json.loads(Path(args.replay_from).read_text())
        write_json(Path(args.out) / "noise.json", {**report, **replays(report["aa_rounds"], args.replays)})
        return
    torch.set_num_threads(1)
    began = time.monotonic()
    plans: list[tuple[str, Plan, list]] = []
    topologies = {}
    for task, (path, memory_gb) in TABLE_FILES.items():
        tables = load_tables(path)
        topology = Topology(num_devices=2, memory_bytes=int(memory_gb * GB), batch_size=args.batch_size)
        topologies[task] = (tables, topology)
        made = [(a, place(a, tables, topology, seed=0)) for a in ALGORITHMS]
        plans += [(f"{task}/{name}", plan, tables) for name, plan in distinct(made)]
    report: dict = {"plans": [name for name, _, _ in plans]}

    # Separate evaluate runs, before this process starts a Ray of its own.
    evaluated = evaluate_runs(plans, runs=2)
    deviations = [abs(b["median_ms"] / a["median_ms"] - 1) for a, b in evaluated.values() if a["median_ms"] >= 2.0]
    held = [a["ci_low_ms"] <= b["median_ms"] <= a["ci_high_ms"] for a, b in evaluated.values()]
    report["evaluate_runs"] = {
        "plans": len(deviations),
        "median_abs_deviation": statistics.median(deviations),
        "max_abs_deviation": max(deviations),
        "interval_holds_next_median": {"checks": len(held), "covered": sum(held)},
        "runs": evaluated,
    }
    print("separate evaluate runs:", {k: v for k, v in report["evaluate_runs"].items() if k != "runs"})
    write_json(Path(args.out) / "noise.json", report)

    print(connect_ray(min_cpus=2))
    with DeviceGang(2) as gang:
        report["hardware"] = gang.hardware
        print(f"{len(plans)} distinct plans on {gang.hardware}; pass 1")
        first = measure_pass(gang, plans, args.rounds, args.batch_size)
        print("pass 2")
        second = measure_pass(gang, plans, args.rounds, args.batch_size)
        repeat = {}
        for estimator in [*ESTIMATORS, "min_step"]:
            deviations = []
            for name, _, _ in plans:
                a = statistics.median(first[name][estimator])
                b = statistics.median(second[name][estimator])
                if statistics.median(first[name]["median"]) >= 2.0:
                    deviations.append(abs(b / a - 1))
            repeat[estimator] = {"plans": len(deviations), "median_abs_deviation": statistics.median(deviations)}
        covered = [
            RoundsSummary.of(first[name]["min"]).ci_low_ms
            <= statistics.median(second[name]["min"])
            <= RoundsSummary.of(first[name]["min"]).ci_high_ms
            for name, _, _ in plans
        ]
        report["repeatability"] = repeat
        report["median_interval_coverage"] = {"checks": len(covered), "covered": sum(covered)}
        report["passes"] = {"first": first, "second": second}
        print("repeatability:", repeat)
        write_json(Path(args.out) / "noise.json", report)

        # Real A/A comparisons (a plan against a copy), each run twice (coverage of the reported ratio interval),
        # rounds recorded; then the plan against its twin (devices swapped): are the ranks alike?
        config = CompareConfig()
        aa_rounds: list[tuple[float, float]] = []
        real_aa, rank_swap = [], []
        coverage_checks = []
        by_cost = sorted(plans, key=lambda p: statistics.median(first[p[0]]["min"]))
        chosen = [by_cost[int(i)] for i in np.linspace(len(by_cost) // 3, len(by_cost) - 1, args.aa_races)]
        for name, plan, tables in chosen:
            task = name.split("/")[0]
            runs, devices = [], []
            for _ in range(2):
                compared = compare_plans(
                    [("a", plan), ("b", plan)], tables, topologies[task][1], gang, config,
                    log=lambda _line: None, merge_identical=False,
                )  # fmt: skip
                runs.append(compared.result)
                devices.append({n: [d.total_ms for d in c.devices] for n, c in compared.costs.items()})
                aa_rounds += list(
                    zip(compared.result.candidates["a"].rounds_ms, compared.result.candidates["b"].rounds_ms)
                )
            other = "b" if runs[0].chosen == "a" else "a"
            second_ratio = runs[1].ratios.get(other)
            point = second_ratio.ratio if second_ratio else 1 / runs[1].ratios[runs[0].chosen].ratio
            first_ratio = runs[0].ratios[other]
            coverage_checks.append(first_ratio.low <= point <= first_ratio.high)
            real_aa += [
                {
                    "plan": name,
                    "separated": r.separated,
                    "rounds": r.rounds,
                    "ratio": next(iter(r.ratios.values())).model_dump(),
                    "rounds_ms": {n: c.rounds_ms for n, c in r.candidates.items()},
                    "device_totals_ms": d,
                }
                for r, d in zip(runs, devices)
            ]
            print(f"A/A {name}: separated {[r.separated for r in runs]}, rounds {[r.rounds for r in runs]}")
            swapped = compare_plans(
                [("plan", plan), ("twin", twin(plan))],
                tables,
                topologies[task][1],
                gang,
                config,
                log=lambda _line: None,
            )
            rank_swap.append(
                {
                    "plan": name,
                    "separated": swapped.result.separated,
                    "rounds": swapped.result.rounds,
                    "chosen": swapped.result.chosen,
                    "other_over_chosen": next(iter(swapped.result.ratios.values())).model_dump(),
                    "device_totals_ms": {n: [d.total_ms for d in c.devices] for n, c in swapped.costs.items()},
                }
            )
            print(f"ranks {name}: {rank_swap[-1]}")
            write_json(
                Path(args.out) / "noise.json",
                {**report, "real_aa": real_aa, "aa_rounds": aa_rounds, "rank_swap": rank_swap},
            )
        report["real_aa"] = real_aa
        report["aa_rounds"] = aa_rounds
        report["rank_swap"] = rank_swap

        # A real A/B: the pair of one task's plans whose long-run ratio is nearest 1.05.
        pairs = []
        for i, (name_i, plan_i, tables_i) in enumerate(plans):
            for name_j, plan_j, _ in plans[i + 1 :]:
                if name_i.split("/")[0] != name_j.split("/")[0]:
                    continue
                ratio = statistics.median(first[name_j]["min"] + second[name_j]["min"]) / statistics.median(
                    first[name_i]["min"] + second[name_i]["min"]
                )
                ratio = max(ratio, 1 / ratio)
                pairs.append((abs(ratio - 1.05), ratio, name_i, plan_i, name_j, plan_j, tables_i))
        _, long_ratio, name_i, plan_i, name_j, plan_j, tables = min(pairs, key=lambda p: p[0])
        task = name_i.split("/")[0]
        ab = []
        for _ in range(2):
            compared = compare_plans(
                [(name_i, plan_i), (name_j, plan_j)], tables, topologies[task][1], gang, config, log=lambda _line: None
            )
            r = compared.result
            ab.append(
                {
                    "separated": r.separated,
                    "rounds": r.rounds,
                    "chosen": r.chosen,
                    "ratio": next(iter(r.ratios.values())).model_dump(),
                }
            )
        first_ab, second_ab = ab
        other_point = (
            second_ab["ratio"]["ratio"]
            if second_ab["chosen"] == first_ab["chosen"]
            else 1 / second_ab["ratio"]["ratio"]
        )
        coverage_checks.append(first_ab["ratio"]["low"] <= other_point <= first_ab["ratio"]["high"])
        report["real_ab"] = {"pair": [name_i, name_j], "long_run_ratio": long_ratio, "runs": ab}
        report["ratio_interval_coverage"] = {"checks": len(coverage_checks), "covered": sum(coverage_checks)}
        print("A/B:", report["real_ab"])

    report.update(replays(aa_rounds, args.replays))
    report["seconds"] = time.monotonic() - began
    write_json(Path(args.out) / "noise.json", report)
    print(f"wrote {Path(args.out) / 'noise.json'} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
