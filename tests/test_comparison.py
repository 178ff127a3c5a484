"""The comparison procedure on replayed rounds, and `shard-ray compare` on the gang as a user types it."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from console import assert_refused, shard_ray_here

from shard_ray.cli import main
from shard_ray.costmodel.models import default_cost_model_path, models_for
from shard_ray.errors import ShardRayError
from shard_ray.plan.cost import MeasuredComparison, RoundsSummary, median_of
from shard_ray.plan.plan import Plan, Shard, load_plan, save_plan
from shard_ray.profiling.hardware import hardware_id
from shard_ray.workflows.comparison import (
    CompareConfig,
    Race,
    alpha_spent,
    claim,
    format_comparison,
    ratio_interval,
)
from shard_ray.workload.tables import TableSpec, save_tables

RECORDED_AA = Path(__file__).parent / "data" / "aa_rounds.json"


def noisy_rounds(rng: np.random.Generator, costs: list[float]) -> list[float]:
    """One round of plans of `costs`: a factor the round shares, each plan's own noise, and now and then a
    disturbance on one plan (the machine's hiccups), as seen on the 2-core gang."""
    shared = np.exp(rng.normal(0, 0.05))
    own = np.exp(rng.normal(0, 0.02, len(costs)))
    spikes = np.where(rng.random(len(costs)) < 0.1, rng.uniform(1.1, 1.5, len(costs)), 1.0)
    return list(np.asarray(costs) * shared * own * spikes)


DEFAULTS = CompareConfig()


def race(costs: list[float], rng: np.random.Generator, draw=noisy_rounds, config: CompareConfig = DEFAULTS):
    names = [f"p{i}" for i in range(len(costs))]
    state = Race(names, config.rounds, config.min_rounds, config.confidence)
    while True:
        state.record(dict(zip(names, draw(rng, costs))))
        verdict = state.look(final=state.count >= config.rounds)
        if verdict is not None:
            return verdict, state.count


@pytest.mark.parametrize("plans", [2, 6])
def test_equal_plans_are_rarely_separated(plans):
    """A/A: 200 seeded races of equal plans, looking after every round: separated in at most 5%."""
    rng = np.random.default_rng(plans)
    separated = sum(race([10.0] * plans, rng)[0].separated for _ in range(200))
    assert separated <= 10


def test_equal_plans_replayed_from_recorded_rounds_are_rarely_separated():
    """A/A on this project's recorded gang rounds (a plan against a copy of itself, 2-core CPU)."""
    recorded = json.loads(RECORDED_AA.read_text())
    pairs = [tuple(p) for p in recorded["aa_rounds"]]
    assert len(pairs) >= 40

    def replayed(rng, costs):
        a, b = pairs[rng.integers(len(pairs))]
        return [a, b] if rng.random() < 0.5 else [b, a]  # which copy is which is arbitrary

    rng = np.random.default_rng(7)
    separated = sum(race([1.0, 1.0], rng, replayed)[0].separated for _ in range(200))
    assert separated <= 10


def test_a_planted_five_percent_difference_is_found():
    rng = np.random.default_rng(3)
    found = []
    for _ in range(50):
        verdict, rounds = race([10.0, 10.5], rng)
        if verdict.separated:
            assert verdict.chosen == "p0" and verdict.ratios["p1"].low > 1
            found.append(rounds)
    assert len(found) >= 45 and np.median(found) <= 30


def test_alpha_is_spent_once_over_every_look():
    alpha = 0.05
    assert alpha_spent(40, 40, alpha) == pytest.approx(alpha)
    assert alpha_spent(80, 40, alpha) == pytest.approx(alpha)
    spent = [alpha_spent(n, 40, alpha) for n in range(1, 41)]
    assert all(a < b for a, b in zip(spent, spent[1:]))
    # the look that ends a race early spends what is left, never more than alpha in all
    state = Race(["a", "b"], 40, 6)
    rng = np.random.default_rng(0)
    for _ in range(10):
        state.record(dict(zip("ab", noisy_rounds(rng, [1.0, 1.0]))))
        state.look(final=False)
    state.look(final=True)
    assert state.spent == pytest.approx(alpha)


def test_ratio_interval_is_a_trimmed_t_interval():
    a = [10.0, 10.2, 9.9, 10.1, 10.0, 30.0]  # one disturbed round
    b = [10.0] * 6
    r = ratio_interval(a, b, 0.05)
    assert r.ratio == pytest.approx(np.exp(np.mean(np.log(sorted(np.array(a) / 10)[1:5]))))
    assert r.low < 1 < r.high and not r.separated
    clear = ratio_interval([11.0, 11.1, 10.9, 11.0, 11.05, 10.95], b, 0.05)
    assert clear.separated and 1.0 < clear.low < clear.ratio < clear.high < 1.2


def test_ties_go_to_the_lowest_measured_cost_and_claims_say_within_noise():
    rng = np.random.default_rng(11)
    names = ["heuristic", "searched", "torchrec"]
    state = Race(names, 8, 6)
    for _ in range(8):
        state.record(dict(zip(names, noisy_rounds(rng, [1.0, 1.0, 1.0]))))
        verdict = state.look(final=state.count >= 8)
    assert verdict is not None and not verdict.separated
    lowest = min(names, key=lambda name: sorted(state.rounds[name])[3])  # the median round of 8: the 4th
    assert verdict.chosen == lowest and f"{lowest} has the lowest cost (median round) and is chosen" in verdict.rule
    # the order the plans were given decides nothing: the same rounds given the other way round choose the same
    reversed_race = Race(names[::-1], 8, 6)
    for r in range(8):
        reversed_race.record({name: state.rounds[name][r] for name in names})
        again = reversed_race.look(final=reversed_race.count >= 8)
    assert again is not None and again.chosen == lowest
    result = MeasuredComparison(
        hardware="cpu:test",
        chosen=verdict.chosen,
        confidence=0.95,
        separated=False,
        rule=verdict.rule,
        steps_per_round=10,
        rounds=8,
        candidates={n: RoundsSummary.of(v) for n, v in state.rounds.items()},
        ratios=verdict.ratios,
    )
    other = next(name for name in names if name != verdict.chosen)
    said = claim(result, other, "another plan")
    assert said.startswith("within noise of another plan") and "faster" not in said


def replayed_race(names: list[str], costs: list[float], seed: int, rounds: int = 8, incumbent: str | None = None):
    rng = np.random.default_rng(seed)
    state = Race(names, rounds, 6, incumbent=incumbent)
    while (verdict := state.look(final=state.count >= rounds)) is None:
        state.record(dict(zip(names, noisy_rounds(rng, costs))))
    return state, verdict


def test_a_tie_keeps_the_incumbent_even_where_another_plan_has_the_lower_median():
    """Equal plans: the incumbent is kept in every race but those (at most the procedure's alpha) that separate
    another as faster; without an incumbent, the same rounds go to the lowest median, most often another plan."""
    names = ["incumbent", "searched", "heuristic"]
    replaced, lower_median, said_lower = 0, 0, 0
    for seed in range(40):
        state, verdict = replayed_race(names, [1.0, 1.0, 1.0], seed, incumbent="incumbent")
        if verdict.chosen != "incumbent":
            assert verdict.ratios["incumbent"].low > 1
            replaced += 1
        else:
            assert "(incumbent), which is kept" in verdict.rule or verdict.separated
            assert not any(r.separated and r.ratio < 1 for r in verdict.ratios.values())
            # a plan of a lower median listed above the kept incumbent is said to be within noise of it (a walk)
            lower = [n for n in names if median_of(state.rounds[n]) < median_of(state.rounds["incumbent"])]
            lower.sort(key=lambda n: median_of(state.rounds[n]))  # lowest first, as the table lists them
            said = [verdict.rule.find(f"{name}'s median {median_of(state.rounds[name]):.2f} ms") for name in lower[:3]]
            assert -1 not in said and said == sorted(said), verdict.rule
            if lower:
                said_lower += 1
                assert verdict.rule.endswith(f"lower than its {median_of(state.rounds['incumbent']):.2f}, "
                                             f"{'is' if len(lower) == 1 else 'are'} within noise")  # fmt: skip
        lower_median += replayed_race(names, [1.0, 1.0, 1.0], seed)[1].chosen != "incumbent"
    assert replaced <= 2 and lower_median >= 20 and said_lower >= 20


def test_a_plan_replaces_the_incumbent_only_when_separated_as_faster_than_it():
    """Two plans 15% faster than the incumbent and tied with each other: one of them is chosen, unseparated from
    the other, and its interval with the incumbent excludes 1."""
    names = ["incumbent", "a", "b"]
    state, verdict = replayed_race(names, [1.15, 1.0, 1.0], seed=5, rounds=12, incumbent="incumbent")
    assert verdict.chosen in ("a", "b") and not verdict.separated
    assert verdict.ratios["incumbent"].low > 1 and "separated as faster than the incumbent" in verdict.rule
    # the other, of a lower median where it has one, is said to come after it by the paired ratios (a walk's demo
    # listed such a plan above the chosen one without a word)
    said_lower = 0
    for seed in range(20):
        state, verdict = replayed_race(names, [1.15, 1.0, 1.0], seed=seed, rounds=12, incumbent="incumbent")
        if verdict.chosen == "incumbent":
            continue
        other = "b" if verdict.chosen == "a" else "a"
        lower = median_of(state.rounds[other]) < median_of(state.rounds[verdict.chosen])
        said = f"; {other}'s median {median_of(state.rounds[other]):.2f} ms, lower, the paired ratios put after it"
        assert (said in verdict.rule) == lower, verdict.rule
        said_lower += lower
    assert said_lower >= 2
    with pytest.raises(ShardRayError, match="the incumbent 'c' is not one of the plans compared"):
        Race(names, 8, incumbent="c")


def test_a_sweeps_finalist_replaces_the_shipped_settings_only_when_measured_faster_and_never_slower():
    """`tune search`'s measured step: a finalist faster than the shipped settings by its interval on some task and
    slower on none is chosen (the most such tasks first); within noise everywhere keeps the shipped settings."""
    from shard_ray.plan.cost import PlanRatio
    from shard_ray.tuning.search_sweep import SHIPPED, choose_measured

    def ratio(low: float, high: float) -> PlanRatio:
        return PlanRatio(ratio=(low * high) ** 0.5, low=low, high=high, separated=low > 1 or high < 1)

    noise, faster, slower = ratio(0.7, 1.2), ratio(0.80, 0.95), ratio(1.02, 1.2)
    assert choose_measured({"a": [noise, noise], "b": [ratio(0.5, 1.01), None]}) == SHIPPED  # a lower ratio, in noise
    assert choose_measured({"a": [faster, None], "b": [noise, noise]}) == "a"
    assert choose_measured({"a": [faster, slower], "b": [noise, noise]}) == SHIPPED
    assert choose_measured({"a": [faster, noise], "b": [faster, ratio(0.9, 0.99)]}) == "b"
    assert choose_measured({"a": [ratio(0.5, 0.6), noise], "b": [faster, noise]}) == "a"


def test_old_plan_files_with_a_race_still_read(tmp_path, small_tables):
    document = {
        "num_devices": 1,
        "algorithm": "size_greedy",
        "shards": [{"table": t.name, "device": 0, "columns": [0, t.dim]} for t in small_tables],
        "measured": {
            "hardware": "cpu:x",
            "chosen": "size_greedy",
            "confidence": 0.95,
            "separated": True,
            "steps_per_round": 10,
            "candidates": {"size_greedy": RoundsSummary.of([1.0, 2.0]).model_dump()},
            "p_slower": {},
        },
    }
    (tmp_path / "old.json").write_text(json.dumps(document))
    assert load_plan(tmp_path / "old.json").measured.chosen == "size_greedy"


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A table file in the minimal table format, a plan of it made as docs/commands.md makes one, and the
    plan's twin with devices 0 and 1 swapped (the same cost), both written by hand."""
    folder = tmp_path_factory.mktemp("plans")
    (folder / "tables.json").write_text(
        '{"tables": [\n'
        '  {"name": "user_id", "rows": 2000000, "dim": 64, "pooling_factor": 1},\n'
        '  {"name": "ad_id", "rows": 500000, "dim": 32, "pooling_factor": 4},\n'
        '  {"name": "category", "rows": 300, "dim": 16, "pooling_factor": 2},\n'
        '  {"name": "history", "rows": 100000, "dim": 32, "pooling_factor": 30}\n'
        "]}\n"
    )
    made = main(
        ["plan", "--tables", str(folder / "tables.json"), "--devices", "2", "--memory-gb", "4",
        "--algo", "size_lookup_greedy", "--out", str(folder / "a.json")],
    )  # fmt: skip
    assert made == 0
    document = json.loads((folder / "a.json").read_text())
    for shard in document["shards"]:
        shard["device"] = 1 - shard["device"]
    document.pop("memory_bytes", None)
    (folder / "twin.json").write_text(json.dumps(document))
    return folder / "tables.json", folder / "a.json", folder / "twin.json"


@pytest.mark.slow
@pytest.mark.alone
def test_compare_a_plan_with_its_twin_finds_them_within_noise(ray_session, capsys, monkeypatch, tmp_path, two_plans):
    """A real A/A comparison on the 2-device gang, as a user types it; its files and MLflow run."""
    table_file, plan, twin = two_plans
    here = tmp_path
    monkeypatch.chdir(here)
    argv = ("compare", "--tables", str(table_file), "--plans", str(plan), str(twin),
            "--rounds", "10", "--repeats", "5", "--warmup", "1", "--out", "cmp")  # fmt: skip
    result = shard_ray_here(capsys, *argv)
    assert result.returncode == 0, result.stderr
    if "no plan is separated from every other" not in result.stdout:
        # The race separates an A/A pair falsely at most alpha (5%) of the time, by design (CI met it once). As the docs' claims are, the separation is re-measured in a fresh race (a new gang, new batches);
        # a lean of the devices (a real fault) separates the twin again, a false separation once in 400 runs.
        # It runs in a folder of its own, as a user's second try with its own files and MLflow store (and, as a
        # new process would, without the MLFLOW_TRACKING_URI that MLflow exported in this one).
        here = tmp_path / "remeasured"
        here.mkdir()
        monkeypatch.chdir(here)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        result = shard_ray_here(capsys, *argv)
        assert result.returncode == 0, result.stderr
    assert "within noise" in result.stdout and "no plan is separated from every other" in result.stdout
    written = json.loads((here / "cmp" / "comparison.json").read_text())
    comparison = MeasuredComparison.model_validate(written["comparison"])
    # tied: the lower cost (median round) is chosen, whichever plan was given first
    lower = min(("a", "twin"), key=lambda name: comparison.candidates[name].median_ms)
    assert not comparison.separated and comparison.rounds == 10 and comparison.chosen == lower
    assert f"{lower} has the lowest cost (median round) and is chosen" in result.stdout
    other = "twin" if lower == "a" else "a"
    ratio = comparison.ratios[other]
    assert ratio.low < 1 < ratio.high
    assert set(written["costs"]) == {"a", "twin"} and (here / "cmp" / "comparison.png").stat().st_size > 0
    # one number per plan: the table's cost_ms, the result file's and MLflow's
    rows = [re.match(r"(a|twin) +([0-9.]+) ", line) for line in result.stdout.splitlines()]
    printed = {row.group(1): float(row.group(2)) for row in rows if row}  # the table's cost_ms column
    for name in ("a", "twin"):
        assert written["costs"][name]["cost_ms"] == comparison.candidates[name].median_ms
        assert printed[name] == round(comparison.candidates[name].median_ms, 2)
    from mlflow import MlflowClient

    store = MlflowClient(tracking_uri=f"sqlite:///{here / 'mlflow.db'}")
    experiment = store.get_experiment_by_name("shard-ray")
    runs = {run.data.tags["kind"]: [] for run in store.search_runs([experiment.experiment_id])}
    for run in store.search_runs([experiment.experiment_id]):
        runs[run.data.tags["kind"]].append(run)
    (parent,) = runs["comparison"]
    assert parent.data.params["separated"] == "False" and parent.data.params["chosen"] == lower
    children = {run.data.tags["mlflow.runName"].removeprefix("cmp/").split("/")[-1]: run for run in runs["plan"]}
    assert set(children) == {"a", "twin"}
    for name, run in children.items():
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        logged = run.data.metrics["cost_ms"]  # to the microsecond
        assert logged == round(comparison.candidates[name].median_ms, 3) == parent.data.metrics[f"cost_ms.{name}"]
        assert run.data.tags["verdict"] == ("chosen" if name == lower else "within noise")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "viewStateShareKey=plans" in result.stdout and "compare-runs?runs=" in result.stdout


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "missing.json"),
        ("other_tables", "is not a plan of"),
        ("one_plan", "two plan files or more"),
        ("twice", "given twice"),
        ("copy", "place the tables identically: nothing to compare"),
        ("incumbent_not_given", "--incumbent copy.json is not one of the plan files given to compare"),
        ("no_models", "cost model file not found: nope.pt"),
        ("tables_for_a_plan", "is a table file (a 'tables' list, no 'shards'), not a plan file"),
    ],
)
def test_compare_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, two_plans, case, message
):
    """In this process (the console script's own error path is tests/test_cli.py's): before any Ray starts."""
    table_file, plan, twin = two_plans
    plans = {
        "missing": [str(plan), "missing.json"],
        "other_tables": [str(plan), "other.json"],
        "one_plan": [str(plan)],
        "twice": [str(plan), str(plan)],
        "copy": [str(plan), "copy.json"],
        "incumbent_not_given": [str(plan), "other.json", "--incumbent", "copy.json"],
        "no_models": [str(plan), str(twin), "--cost-model", "nope.pt"],
        "tables_for_a_plan": [str(table_file), str(plan)],  # it was refused field by field, as a plan
    }[case]
    shutil.copy(plan, tmp_path / "copy.json")
    other = load_plan(plan)
    other = other.model_copy(update={"shards": [s.model_copy(update={"table": f"x_{s.table}"}) for s in other.shards]})
    save_plan(tmp_path / "other.json", other)
    monkeypatch.chdir(tmp_path)
    assert_refused(capsys, ["compare", "--tables", str(table_file), "--plans", *plans, "--out", "cmp"], message)
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_second_comparison_in_the_same_folder_says_it_replaced_the_first(
    ray_session, capsys, monkeypatch, tmp_path, two_plans
):
    """`compare`'s default folder is one for every comparison: a second one replaced the first's files without a
    word (a new user's walk). The second says so; the first says nothing of the kind."""
    table_file, plan, twin = two_plans
    monkeypatch.chdir(tmp_path)
    argv = ("compare", "--tables", str(table_file), "--plans", str(plan), str(twin), "--rounds", "2", "--repeats",
            "1", "--warmup", "0", "--no-mlflow")  # fmt: skip
    said = []
    mine = tmp_path / "mine.pt"
    mine.write_bytes(default_cost_model_path().read_bytes())
    for extra in ((), ("--cost-model", str(mine))):
        result = shard_ray_here(capsys, *argv, *extra)
        assert result.returncode == 0, result.stderr
        said.append(next(line for line in result.stdout.splitlines() if line.startswith("wrote comparison.json")))
    assert said[0] == "wrote comparison.json, comparison.md and comparison.png to shard-ray-out/compare"
    assert said[1] == said[0] + " (in place of the comparison there before: --out names a folder of its own)"
    # the race's verdict said once, under the table, not also on its last round's line (a new user's walk)
    rule = json.loads((tmp_path / "shard-ray-out" / "compare" / "comparison.json").read_text())["comparison"]["rule"]
    assert (result.stdout + result.stderr).count(rule) == 1, result.stdout + result.stderr
    # every plan priced by the models given, where a walk's trained ones could not be chosen
    assert f"priced by {mine}" in result.stdout, result.stdout


@pytest.mark.slow
def test_plan_measure_keeps_an_incumbent_no_plan_is_measured_faster_than(
    ray_session, capsys, monkeypatch, tmp_path, two_plans
):
    """`plan --measure --incumbent FILE`: over 2 rounds (intervals of one degree of freedom) the incumbent, a
    hand-edited plan no algorithm makes, is written whatever the medians say, and the output says so; unless, at
    most at the procedure's alpha, two rounds agree so closely that a plan is separated as faster than it (once in
    the parallel pass of 2026-12-03: cost_search's plan): then that plan is written, its interval with the
    incumbent excluding 1, and the output says that."""
    table_file, _, twin = two_plans
    monkeypatch.chdir(tmp_path)
    result = shard_ray_here(
        capsys, "plan", "--tables", str(table_file), "--devices", "2", "--memory-gb", "4", "--algo", "cost_search",
        "--out", "plan.json", "--measure", "--measure-rounds", "2", "--incumbent", str(twin), "--no-mlflow",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = load_plan(tmp_path / "plan.json")
    measured = written.measured
    assert measured.incumbent is not None and "incumbent" in measured.incumbent.split("=")
    assert measured.rounds == 2, result.stdout
    if measured.chosen == measured.incumbent:
        placement = {(s.table, s.device, s.columns) for s in written.shards}
        assert placement == {(s.table, s.device, s.columns) for s in load_plan(twin).shards}
        assert not measured.separated
        kept = f"no plan is separated as faster than the incumbent ({measured.incumbent}), which is kept"
        assert kept in result.stdout
        assert f"the incumbent ({measured.incumbent}), kept: no plan measured faster than it" in result.stdout
    else:
        assert measured.ratios[measured.incumbent].low > 1, result.stdout
        said = f"separated as faster than the incumbent ({measured.incumbent})", "is separated from every other plan"
        assert any(words in result.stdout for words in said), result.stdout
    # the plan written has its table printed where it is not the placed one's (a walk read cost_search's as it)
    written_said = f"the plan written, {written.algorithm}'s plan"
    another = "cost_search" not in measured.chosen.split("=")
    assert (written_said in result.stdout) == another, result.stdout
    if another:
        assert f"plan '{written.algorithm}' on 2 devices" in result.stdout.split(written_said)[1], result.stdout
    # measured with the others, and priced by the models that priced them
    assert measured.incumbent in measured.predicted_ms and len(measured.candidates) >= 3
    # an incumbent of other devices is refused before anything is measured
    assert_refused(
        capsys,
        ["plan", "--tables", str(table_file), "--devices", "3", "--memory-gb", "4", "--algo", "cost_search",
         "--out", "three.json", "--measure", "--incumbent", str(twin)],
        "is not a plan of",
        tmp_path / "three.json",
    )  # fmt: skip


@pytest.mark.slow
def test_more_devices_than_cores_measure_compute_and_price_the_all_to_alls(
    ray_session, capsys, monkeypatch, tmp_path, table_file
):
    """4 devices on this 2-core machine: compute measured (taking turns), all-to-alls priced and labelled; a plan
    priced by other models than `plan` picks now (as one made before a calibration) says so."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(models_for(hardware_id(threads=1)), tmp_path / "earlier.pt")
    made = shard_ray_here(
        capsys, "plan", "--tables", str(table_file), "--devices", "4", "--memory-gb", "1",
        "--algo", "size_greedy", "--out", "four.json", "--cost-model", "earlier.pt",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = shard_ray_here(
        capsys, "evaluate", "--tables", str(table_file), "--plan", "four.json", "--out", "result.json",
        "--rounds", "1", "--repeats", "3", "--warmup", "1", "--no-mlflow",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    cost = json.loads((tmp_path / "result.json").read_text())
    assert cost["priced_parts"] == ["input_dist_ms", "fwd_comm_ms", "bwd_comm_ms"]
    assert cost["priced_by"].endswith(".pt")
    assert "priced by the comm model" in result.stdout and "measured: fwd ms, bwd ms" in result.stdout
    assert "compute timed on the device gang, all-to-alls priced by the comm model" in result.stdout
    # its measured / predicted is partly the models' against the models' (a walk): said on its line
    assert "(input, fwd a2a, bwd a2a priced by the comm model on both sides: the ratio does not judge" in result.stdout
    # each device's shard timed on its own, as many at once as there are cores, not 4 devices in turns every step
    assert "each device's fused shard is timed on its own" in result.stderr
    # the shipped comm model measured 2-device gangs only: its 4-device prices are said to be extrapolated
    assert "all-to-alls were measured at 2 devices, so its prices at 4 are extrapolated" in result.stderr
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == len(set(warned)), result.stderr  # each once: the models' and the measurement's said alike
    assert all(d["fwd_compute_ms"] > 0 and d["fwd_comm_ms"] > 0 for d in cost["devices"])
    newer = models_for(hardware_id(threads=1))
    made_with = tmp_path / "earlier.pt"  # recorded absolute: given relative, it named another file from elsewhere
    assert f"made with, {made_with}; `shard-ray plan` without --cost-model prices these tables with {newer}" in (
        result.stdout
    )
    # the plan's models gone: what was measured is written all the same, priced by `plan`'s, and said so (a walk's
    # evaluate measured for 40 s, then failed to find them and wrote nothing)
    made_with.rename(tmp_path / "moved.pt")
    (tmp_path / "result.json").unlink()
    again = shard_ray_here(
        capsys, "evaluate", "--tables", str(table_file), "--plan", "four.json", "--out", "result.json",
        "--rounds", "1", "--repeats", "2", "--warmup", "1", "--no-mlflow",
    )  # fmt: skip
    assert again.returncode == 0 and (tmp_path / "result.json").is_file(), again.stderr
    assert (
        f"note: the models this plan was made with, {made_with}, are not there now: priced by {newer}" in again.stdout
    )


def test_the_comparisons_table_keeps_its_columns_under_a_long_joined_name():
    """Plans that place the tables alike are measured once under their names joined by '=', which can be longer than
    the name column: every row's columns still line up under the header's."""
    names = ["lookup_greedy=size_lookup_greedy=random_and_more", "torchrec"]
    state, verdict = replayed_race(names, [1.0, 1.3], seed=3)
    result = MeasuredComparison(
        hardware="cpu:test", chosen=verdict.chosen, confidence=0.95, separated=verdict.separated, rule=verdict.rule,
        steps_per_round=10, rounds=state.count, candidates={n: RoundsSummary.of(v) for n, v in state.rounds.items()},
        ratios=verdict.ratios, predicted_ms=dict.fromkeys(names, 1.0),
    )  # fmt: skip
    lines = format_comparison(result).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    header, rows = lines[at], lines[at + 1 : at + 3]
    assert sorted(row.split()[0] for row in rows) == sorted(names)
    end = header.index("cost_ms") + len("cost_ms")
    for row in rows:  # the numbers end where their headers do, to the last column's
        assert row[end - 1].isdigit() and row[end] == " " and len(row.rstrip()) == len(header.rstrip()), (header, row)


def test_intervals_too_wide_to_tell_plans_apart_are_said_to_be(capsys):
    """Six equal plans raced for 6 rounds: an interval spans more than a factor of 2, which tells nothing of the plans
    (a new user's 3-round race of 6 plans printed [0.005, 48] without a word); the table says so and what narrows it.
    Plans 30% apart raced for 40 rounds are separated, and equal ones give narrow intervals: nothing is said."""

    def table(names: list[str], costs: list[float], rounds: int, *flag: str) -> str:
        state, verdict = replayed_race(names, costs, seed=3, rounds=rounds)
        return format_comparison(
            MeasuredComparison(
                hardware="cpu:test", chosen=verdict.chosen, confidence=0.95, separated=verdict.separated,
                rule=verdict.rule, steps_per_round=10, rounds=state.count,
                candidates={n: RoundsSummary.of(v) for n, v in state.rounds.items()}, ratios=verdict.ratios,
            ),
            *flag,
        )  # fmt: skip

    wide = table(list("abcdef"), [1.0] * 6, 6).splitlines()[-1]
    assert wide.startswith("1 of the 5 intervals (the widest [") and "more rounds (--rounds)" in wide, wide
    # `plan --measure`'s race is set by its own flag, which the line names there (it named compare's)
    assert "more rounds (--measure-rounds)" in table(list("abcdef"), [1.0] * 6, 6, "--measure-rounds")
    assert "more than a factor of 2" not in table(["a", "b"], [1.0, 1.3], 40)
    assert "more than a factor of 2" not in table(["a", "b"], [1.0, 1.0], 40)


def test_the_comparison_names_the_priced_parts_as_the_plan_summary_does():
    """With more devices than cores the all-to-alls are priced, not measured: the comparison's header named them by
    their fields (`input_dist_ms, fwd_comm_ms`), the plan summary by its columns (`input`, `fwd a2a`); both by the
    columns now."""
    state, verdict = replayed_race(["a", "b"], [1.0, 1.3], seed=3)
    result = MeasuredComparison(
        hardware="cpu:test", chosen=verdict.chosen, confidence=0.95, separated=verdict.separated, rule=verdict.rule,
        steps_per_round=10, rounds=state.count, candidates={n: RoundsSummary.of(v) for n, v in state.rounds.items()},
        ratios=verdict.ratios, priced_parts=["input_dist_ms", "fwd_comm_ms", "bwd_comm_ms"],
    )  # fmt: skip
    table = format_comparison(result).splitlines()
    assert "; input, fwd a2a, bwd a2a priced by the comm model;" in table[0]
    # a verdict as firm as a measured one: what its intervals hold is said (a new user's walk, 8 devices on 2 cores)
    assert (
        "the intervals hold the timed parts' noise, not the error of the comm model's prices of input, fwd a2a"
        in (table[table.index(result.rule) + 1])
    )


def test_plan_measure_names_the_algorithms_whose_plan_it_wrote(small_tables):
    """Algorithms that placed the tables alike race as one plan, named by their names joined with `=`: the line
    saying what `plan --measure` wrote named only the first, as if it alone had won (from a new user's walk)."""
    from shard_ray.cli.planning import _whose, _why_written
    from shard_ray.placement import place
    from shard_ray.plan.topology import Topology

    plan = place("cost_search", small_tables, Topology(num_devices=2, memory_bytes=1024**3))
    rounds = RoundsSummary.of([1.0, 1.1, 1.0])
    measured = MeasuredComparison(
        hardware="cpu:test", chosen="cost_search=size_greedy=torchrec", confidence=0.95, separated=True,
        steps_per_round=10, candidates={"cost_search=size_greedy=torchrec": rounds, "random": rounds},
    )  # fmt: skip
    written = plan.model_copy(update={"measured": measured})
    assert _whose(written) + _why_written(measured) == (
        "cost_search's plan, which size_greedy, torchrec placed alike, measured faster than every other plan raced"
    )
    assert _whose(plan) == "cost_search's plan"


def test_compare_says_what_the_gang_found_measuring_each_plan(capsys, small_tables):
    """`compare` printed no warning, where `evaluate` says what its gang found (a table's rows capped, which times
    it optimistically) and the models' warnings: now each once, by plan, the gang's own said at its start not again
    (from a new user's walk through docs/measurement.md)."""
    from shard_ray.cli.common import say_warnings
    from shard_ray.plan.cost import DeviceCost, PlanCost

    devices = [DeviceCost(device=0, fwd_compute_ms=1, fwd_comm_ms=0, bwd_comm_ms=0, bwd_compute_ms=1)]
    capped = "devices 0-1 measured with at most 2,784,860 rows allocated per table"
    costs = {
        "a": PlanCost(devices=devices, warnings=[capped, "the gang's own"]),
        "b=c": PlanCost(devices=devices, warnings=[capped, capped]),
    }
    # a line found of every plan, said once: a line a plan, alike, made a race's output long (a walk)
    say_warnings([], costs, told={"the gang's own"})
    assert capsys.readouterr().err.splitlines() == [f"warning: every plan: {capped}"]
    costs["d"] = PlanCost(devices=devices, warnings=["its own"])
    say_warnings([], costs, told={"the gang's own"})
    assert capsys.readouterr().err.splitlines() == [f"warning: a, b=c: {capped}", "warning: d: its own"]
    say_warnings([], {"a": costs["a"]}, told=set())  # one plan (evaluate): not named
    assert capsys.readouterr().err.splitlines() == [f"warning: {capped}", "warning: the gang's own"]


def test_compare_takes_the_memory_cap_a_later_plan_records(tmp_path, monkeypatch, capsys):
    """A plan written by hand records no settings: given first, beside one `plan` wrote, `compare` asked for
    --memory-gb, which the second recorded (a new user's walk). It takes the second's: here its 1 GiB, which the hand
    plan, both tables on one device, does not keep, refused before any Ray starts."""
    tables = [TableSpec(name=n, rows=2_500_000, dim=64, pooling_factor=1.0) for n in ("a", "b")]
    save_tables(tmp_path / "t.json", tables)
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--tables", "t.json", "--devices", "2", "--memory-gb", "1", "--algo", "size_greedy"]
    assert shard_ray_here(capsys, *argv, "--out", "greedy.json").returncode == 0
    by_hand = Plan(num_devices=2, algorithm="mine", shards=[Shard(table=n, device=0, columns=(0, 64)) for n in "ab"])
    save_plan(tmp_path / "hand.json", by_hand)
    argv = ["compare", "--tables", "t.json", "--plans", "hand.json", "greedy.json", "--out", "cmp"]
    err = assert_refused(capsys, argv, "hand.json: ")
    assert "over the cap of 1.000 GiB" in err, err
