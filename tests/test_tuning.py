"""Ray Tune sweeps: each kind runs for real (few small trials), saves a tuned file the consumers read, and logs to MLflow."""

import json
from pathlib import Path

import pytest

from shard_ray.cli import main
from shard_ray.costmodel.models import CostModels
from shard_ray.placement.search import MAX_EVALUATIONS
from shard_ray.plan.topology import GB
from shard_ray.policy.network import load_policy
from shard_ray.profiling.fused_shard import measure_fused_shard
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.sampling import draw_augmented_fused_shards
from shard_ray.profiling.store import MeasurementStore
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import save_tables

# Clusters, jobs, sweeps and killed runs: minutes each, left out of `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "pool.json"
    save_tables(path, generate_pool(PoolConfig(num_tables=60, seed=5)))
    return path


@pytest.fixture(scope="module")
def store_file(pool_file) -> Path:
    """Real fbgemm measurements of small random shards of the pool's tables."""
    from shard_ray.workload.tables import load_tables

    path = pool_file.parent / "measurements.db"
    with MeasurementStore(path) as store:
        for parts in draw_augmented_fused_shards(load_tables(pool_file), 50, 4, (8, 16, 64), seed=1):
            store.put_fused_shard(
                measure_fused_shard(parts, MeasureConfig(batch_size=64, warmup=1, repeats=3), "cpu:test", budget=GB)
            )
    return path


def _runs(tracking_uri: str, experiment: str):
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.search_runs(experiment_names=[experiment])


def _shipped_search_config() -> dict:
    """The shipped cost_search settings as a `tune search` best.json holds them: those a trial sets, no budget."""
    from dataclasses import asdict

    from shard_ray.placement.search import COST_SEARCH
    from shard_ray.tuning.search_sweep import SWEPT

    return json.loads(json.dumps({k: v for k, v in asdict(COST_SEARCH).items() if k in SWEPT}))


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.xdist_group("measured-store")  # one worker measures the module's store (`store_file`)
def test_costmodel_sweep_saves_a_config_costmodel_train_reads(ray_session, tmp_path, capsys, pool_file, store_file):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "sweep"
    code = main(
        [
            "tune",
            "costmodel",
            "--store",
            str(store_file),
            "--tables",
            str(pool_file),
            "--out",
            str(out),
            "--samples",
            "3",
            "--max-epochs",
            "12",
            "--report-every",
            "3",
            "--grace-reports",
            "1",
            "--tracking-uri",
            uri,
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    best = json.loads((out / "best.json").read_text())
    assert best["kind"] == "costmodel" and best["metric"] == "val_mape" and best["value"] == summary["value"] > 0
    # the trials' table in percent, as `costmodel train` prints MAPE (it showed 0.1846 under "val MAPE")
    (header,) = [line for line in printed.splitlines() if line.startswith("trial ") and "val MAPE" in line]
    rows = printed.splitlines()[printed.splitlines().index(header) + 1 :]
    assert "val MAPE" in header and rows[0].split()[1] == f"{100 * best['value']:.1f}%", printed
    assert best["trials"] == 3 and (out / "trials.csv").read_text().count("\n") == 4
    runs = _runs(uri, "shard-ray-tune-costmodel")
    assert (
        len(runs) == 3 and set(runs["tags.kind"]) == {"tune-costmodel"} and set(runs["tags.hardware"]) == {"cpu:test"}
    )
    assert runs["metrics.val_mape"].notna().all()

    # costmodel train takes the tuned settings; a flag given wins over the file
    model = tmp_path / "tuned.pt"
    assert (
        main(
            [
                "costmodel",
                "train",
                "--store",
                str(store_file),
                "--tables",
                str(pool_file),
                "--out",
                str(model),
                "--config",
                str(out / "best.json"),
                "--epochs",
                "5",
            ]
        )
        == 0
    )
    trained = CostModels.load(model).info.train_config
    for key in ("hidden", "depth", "lr", "loss", "feature_scaling"):
        assert trained[key] == best["config"][key]
    assert trained["max_epochs"] == 5
    # held-out figures of few measurements are said to be indicative, naming them (a walk's comm n=2 went unsaid)
    printed = capsys.readouterr().out
    report = json.loads(printed.strip().splitlines()[-1])
    few = [f"{name} n={m['n']}" for name, m in report.items() if 0 < m["n"] < 10]
    assert few, report  # this small store leaves some figure with few
    assert f"note: few held-out measurements judge {', '.join(few)}: those figures are indicative" in printed


def test_search_sweep_measures_finalists_and_plan_reads_the_result(ray_session, tmp_path, capsys, pool_file):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "sweep"
    sweep = ["tune", "search", "--tables", str(pool_file), "--samples", "2", "--tasks", "2", "--min-tables", "6"]
    sweep += ["--max-tables", "14", "--max-evaluations", "20000"]
    measured = ["--measure-top", "1", "--measure-tasks", "1", "--repeats", "2", "--rounds", "6"]
    code = main([*sweep, "--out", str(out), *measured, "--tracking-uri", uri])
    assert code == 0
    printed = capsys.readouterr().out
    best = json.loads((out / "best.json").read_text())
    assert best["kind"] == "search"
    assert f"MLflow run in the experiment shard-ray-tune-search to {uri}" in printed
    ((finalist, (ratio,)),) = best["notes"]["measured_over_shipped"].items()  # one finalist, one task
    runs = _runs(uri, "shard-ray-tune-search")
    assert len(runs[runs["tags.kind"] == "tune-search"]) == 2
    measured = runs[runs["tags.task"] == "validation-0"] if "tags.task" in runs else runs.iloc[:0]
    assert best["notes"]["chosen_by"] == ("placed alike" if ratio is None else "measured")
    if ratio is None:  # the finalist placed the task as the shipped settings do: no race
        assert "nothing to measure" in printed and measured.empty
    else:  # raced side by side, with an interval, and logged as a comparison with a run per plan
        assert 0 < ratio["low"] <= ratio["ratio"] <= ratio["high"]
        assert f"validation-0: {finalist}'s cost over the shipped settings' {ratio['ratio']:.3f}x" in printed
        assert (measured["tags.kind"] == "comparison").sum() == 1 and len(measured) == 3
    faster = ratio is not None and ratio["high"] < 1
    assert (best["config"] == _shipped_search_config()) != faster  # only a measured gain replaces the shipped

    # resumed with other tasks, its trials' scores would be ranked beside new ones: refused, naming what differs
    other = list(sweep)
    other[other.index("--min-tables") + 1] = "5"
    assert main([*other, "--out", str(out), "--no-mlflow"]) == 2
    assert "scored otherwise (--min-tables 6 there, 5 now): give another --out" in capsys.readouterr().err
    # simulated only (resumed, its trials done): the shipped settings are kept unless a trial priced the tasks below
    assert main([*sweep, "--out", str(out), "--measure-top", "0", "--no-mlflow"]) == 0
    simulated = json.loads((out / "best.json").read_text())
    assert simulated["notes"]["chosen_by"] == "simulated"
    assert simulated["value"] <= simulated["notes"]["shipped_simulated_over_bound"]
    assert (simulated["config"] == _shipped_search_config()) == (
        simulated["value"] == simulated["notes"]["shipped_simulated_over_bound"]
    )

    tables = tmp_path / "t.json"
    save_tables(tables, generate_pool(PoolConfig(num_tables=10, seed=3)))
    plan = tmp_path / "plan.json"
    flags = [
        "plan",
        "--tables",
        str(tables),
        "--devices",
        "2",
        "--memory-gb",
        "64",
        "--out",
        str(plan),
        "--search-config",
        str(out / "best.json"),
    ]
    capsys.readouterr()
    assert main([*flags, "--algo", "cost_search"]) == 0
    assert f"cost_search searched with the settings in {out / 'best.json'}" in capsys.readouterr().out
    settings = json.loads(plan.read_text())["settings"]
    assert settings["source"] == str(out / "best.json")
    # the sweep's own budget (--max-evaluations 20000) is not carried into the plans: they search with cost_search's
    assert settings["algorithm"]["max_evaluations"] == MAX_EVALUATIONS and "max_evaluations" not in best["config"]
    assert best["notes"]["swept_with_max_evaluations"] == 20000
    capsys.readouterr()
    assert main([*flags[:-2], "--algo", "neuroshard", "--search-config", str(out / "best.json")]) == 2
    assert "takes no search settings" in capsys.readouterr().err


def test_policy_sweep_saves_config_and_policy(ray_session, tmp_path, capsys, pool_file):
    out = tmp_path / "sweep"
    code = main(
        [
            "tune",
            "policy",
            "--tables",
            str(pool_file),
            "--out",
            str(out),
            "--samples",
            "2",
            "--iterations",
            "2",
            "--grace-iterations",
            "1",
            "--validation-tasks",
            "2",
            "--train-batch",
            "64",
            "--min-tables",
            "3",
            "--max-tables",
            "5",
            "--devices",
            "2",
            "--no-mlflow",
        ]
    )
    assert code == 0
    best = json.loads((out / "best.json").read_text())
    # greedy decoding placed every held-out task (tasks on 16 devices are priced above 3x their bound)
    assert best["kind"] == "policy" and best["value"] >= 1.0 and best["notes"]["greedy_stuck"] == 0
    network, info = load_policy(out / "best_policy.pt")
    assert network.hidden == best["config"]["hidden"] and info.config["lr"] == best["config"]["lr"]

    # policy train takes the tuned PPO settings
    trained = tmp_path / "trained"
    assert (
        main(
            [
                "policy",
                "train",
                "--tables",
                str(pool_file),
                "--out",
                str(trained),
                "--config",
                str(out / "best.json"),
                "--iterations",
                "1",
                "--train-batch",
                "64",
                "--min-tables",
                "3",
                "--max-tables",
                "5",
                "--devices",
                "2",
                "--no-mlflow",
            ]
        )
        == 0
    )
    _, info = load_policy(trained / "policy.pt")
    for key in ("lr", "entropy_coeff", "num_epochs", "hidden"):
        assert info.config[key] == best["config"][key]


@pytest.mark.xdist_group("measured-store")  # one worker measures the module's store (`store_file`)
def test_tuned_files_of_the_wrong_kind_or_shape_are_refused(tmp_path, capsys, pool_file, store_file):
    wrong = tmp_path / "search.json"
    wrong.write_text(
        json.dumps(
            {
                "format": "shard-ray-tuned/1",
                "kind": "search",
                "config": {},
                "metric": "m",
                "mode": "min",
                "value": 1.0,
                "trials": 1,
                "sweep": "x",
            }
        )
    )
    common = [
        "costmodel",
        "train",
        "--store",
        str(store_file),
        "--tables",
        str(pool_file),
        "--out",
        str(tmp_path / "m.pt"),
    ]
    assert main([*common, "--config", str(wrong)]) == 2
    assert "holds a tuned search configuration" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "format": "shard-ray-tuned/1",
                "kind": "costmodel",
                "config": {"hidden": 8, "colour": "red"},
                "metric": "m",
                "mode": "min",
                "value": 1.0,
                "trials": 1,
                "sweep": "x",
            }
        )
    )
    assert main([*common, "--config", str(bad)]) == 2
    assert "unknown setting(s) colour" in capsys.readouterr().err
    assert main(["tune", "search", "--tables", str(tmp_path / "missing.json"), "--out", str(tmp_path / "s")]) == 2
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "tune",
                "costmodel",
                "--store",
                str(store_file),
                "--tables",
                str(pool_file),
                "--out",
                str(tmp_path / "s"),
                "--search",
                "grid",
            ]
        )
    assert exit.value.code == 2
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "s").exists()


@pytest.mark.slow(seconds=40)
def test_a_sweep_stopped_by_ctrl_c_says_so_and_how_to_resume_and_writes_no_best(tmp_path, pool_file):
    """Tune's own Ctrl-C handler saves the sweep and returns as if it had ended: `tune search` then reported "4
    trials, 0 failed", wrote a best.json of the two that had finished and exited 0 (a walk). Now it says the state is
    saved and how to resume, ends `interrupted` with status 130, and writes no best.json."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    out = tmp_path / "sweep"
    argv = [str(Path(sys.executable).parent / "shard-ray"), "tune", "search", "--tables", str(pool_file), "--out",
            str(out), "--samples", "12", "--tasks", "1", "--min-tables", "20", "--max-tables", "20", "--devices", "2",
            "--max-evaluations", "30000", "--measure-top", "0", "--no-mlflow"]  # fmt: skip
    command = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(command.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any(line.startswith("trial ") for line in printed):  # a trial done: the sweep is under way
        assert command.poll() is None and time.monotonic() < deadline, "".join(printed)
        time.sleep(0.1)
    command.send_signal(signal.SIGINT)
    err = command.stderr.read()
    command.wait(timeout=120)
    reader.join(timeout=10)
    said = "".join(printed)
    assert command.returncode == 130 and err.strip().splitlines()[-1] == "shard-ray: interrupted", said + err
    assert f"the sweep's state is saved in {out / 'tune' / 'search'}: the same command resumes it" in said
    assert "sweep finished" not in said and not (out / "best.json").exists()
