"""MLflow runs for plan evaluations: parameters, per-device metrics, the plan and a bar chart.

Runs carry the same parameter and metric names whatever the algorithm, so the UI's compare
view lines plans of one task up side by side. With an SQLite store, artifacts go to
`mlartifacts/` beside the database (see `use_experiment`), never to a stray `./mlruns/`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from shard_ray.errors import ShardRayError
from shard_ray.io import shard_ray_home
from shard_ray.plan.cost import STEP_PARTS, MeasuredComparison, PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec, task_digest

DEFAULT_EXPERIMENT = "shard-ray"
POLICY_EXPERIMENT = "shard-ray-policy"  # `policy train` and `policy outer-loop` runs
ARTIFACTS_FOLDER = "mlartifacts"  # beside an SQLite store's database file


def default_tracking_uri(directory: str | os.PathLike[str] = ".") -> str:
    """MLFLOW_TRACKING_URI if set, else an SQLite file in `directory` by absolute path.

    The path is absolute because Ray Tune and Ray jobs change a worker's working directory.
    """
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path(directory) / 'mlflow.db').resolve()}"


# The schemes of MLflow's own tracking stores (mlflow/tracking/_tracking_service/utils.py: a path or file:, the
# databases SQLAlchemy opens, a tracking server, Databricks); a plugin adds its own as an `mlflow.tracking_store`
# entry point.
MLFLOW_STORE_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                        "databricks-uc", "uc")  # fmt: skip
SERVER_ANSWER_TIMEOUT_S = 3.0


def check_tracking_uri(tracking_uri: str, given_as: str) -> None:
    """Refuse in a line, before a command's work, a tracking URI its runs could not be logged to: a scheme no MLflow
    store takes, an SQLite database in a folder that does not exist (MLflow would create the folders), or a tracking
    server nothing answers at. Found by MLflow, each came after the measuring as a traceback, or after minutes of
    retries. `given_as` names where the URI came from (the flag, MLFLOW_TRACKING_URI)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(tracking_uri)
    scheme = parsed.scheme.split("+")[0]  # a database's driver: postgresql+psycopg2://...
    if scheme not in MLFLOW_STORE_SCHEMES:
        from importlib.metadata import entry_points

        if scheme not in {point.name for point in entry_points(group="mlflow.tracking_store")}:
            raise ShardRayError(
                f"{given_as} {tracking_uri}: no MLflow store takes {parsed.scheme}:// URIs (sqlite:///PATH, "
                "http(s)://HOST:PORT of a tracking server, a database's URI, or a folder)"
            )
    database = sqlite_database(tracking_uri)
    if database is not None and not database.parent.is_dir():
        raise ShardRayError(f"{given_as} {tracking_uri}: folder {database.parent} does not exist; create it first")
    if not serves_its_ui(tracking_uri):
        ui_port()  # the UI the links printed at the end name: a bad MLFLOW_PORT refused now, not after the work
    if scheme in ("http", "https"):
        port = parsed.port or (443 if scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=SERVER_ANSWER_TIMEOUT_S).close()
        except OSError as err:
            raise ShardRayError(
                f"{given_as} {tracking_uri}: nothing answers there ({err.strerror or err}); start the tracking "
                "server (`mlflow server`, docs/mlflow.md) or give another URI"
            ) from None


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment in an SQLite store keeps its artifacts: `mlartifacts/` beside the database.

    None for other stores: a tracking server decides (`--artifacts-destination`). Left to itself,
    MLflow would put an SQLite store's artifacts in `./mlruns/` of whatever the working directory is.
    """
    database = sqlite_database(tracking_uri)
    return None if database is None else (database.resolve().parent / ARTIFACTS_FOLDER).as_uri()


# MLflow 3's UI opens an experiment on the page its kind says: its runs for model development, its traces for GenAI.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# The runs table as shard-ray's plans are compared: MLflow's shared view of an experiment, kept in the experiment's
# tag `mlflow.sharedViewState.<key>` and opened by `viewStateShareKey=<key>` in the URL (`runs_url`).
PLANS_VIEW = "plans"
PLANS_VIEW_STATE = {
    "searchFilter": "tags.kind = 'plan'",
    "orderByKey": "metrics.`cost_ms`",
    "orderByAsc": True,
    "selectedColumns": [
        "metrics.`cost_ms`",
        "metrics.`ratio_to_chosen`",
        "metrics.`predicted_cost_ms`",
        "metrics.`measured_over_predicted`",
        "tags.`task`",
        "tags.`algorithm`",
        "tags.`verdict`",
    ],
}
# Where `ui_command` serves: MLflow's own default port, or MLFLOW_PORT, which `mlflow ui` reads too (another user's UI
# may hold 5000 on a shared machine, and the links printed named it whatever port the UI was started on: a walk).
DEFAULT_UI_PORT = 5000


def ui_port() -> int:
    """The port of the UI `ui_command` starts: MLFLOW_PORT where set, else MLflow's 5000."""
    given = os.environ.get("MLFLOW_PORT", "").strip()
    if not given:
        return DEFAULT_UI_PORT
    if not given.isdigit() or not 0 < int(given) < 65536:
        raise ShardRayError(f"MLFLOW_PORT={given!r} is not a port number: give one from 1 to 65535, or unset it")
    return int(given)


def sqlite_database(tracking_uri: str) -> Path | None:
    """The database file of an SQLite store's URI; None for other stores."""
    return Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None


# MLflow builds a new SQLite store by running its schema's migrations one by one: 3.4-3.6 s of CPU on a 2-core
# AMD EPYC (docs/mlflow.md), paid by the first command in every new folder. The empty schema is the same file for
# one MLflow release: it is built once a release under shard-ray's home and copied into each new store.
def create_store(tracking_uri: str) -> None:
    """Give a new SQLite store MLflow's empty schema, copied from the one built for this MLflow release (built now
    if none is). Stores that exist, and other kinds, are MLflow's to open as ever."""
    database = sqlite_database(tracking_uri)
    if database is None or "?" in tracking_uri or database.exists() or not database.parent.is_dir():
        return
    import mlflow

    template = shard_ray_home() / "mlflow" / f"empty-store-mlflow-{mlflow.__version__}.db"
    copy = database.with_name(f".{database.name}.{os.getpid()}.new")
    try:
        if not template.is_file() and not _build_empty_store(template):
            return
        shutil.copyfile(template, copy)
        os.link(copy, database)  # never over a store another command created meanwhile
    except OSError:  # created meanwhile, or a home or folder this user cannot write: MLflow's to open or refuse
        pass
    finally:
        copy.unlink(missing_ok=True)


def _build_empty_store(template: Path) -> bool:
    """MLflow's schema, built by MLflow's own initialisation (tables, then every migration), in `template`; False
    where this MLflow has no such function (the store is then MLflow's to build)."""
    import sqlalchemy

    try:
        from mlflow.store.db.utils import _initialize_tables
    except ImportError:
        return False
    template.parent.mkdir(parents=True, exist_ok=True)
    building = template.with_name(f".{template.name}.{os.getpid()}.new")
    engine = sqlalchemy.create_engine(f"sqlite:///{building}")
    try:
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(building, template)  # whole or not at all, for commands building it at once
    finally:
        building.unlink(missing_ok=True)
    return True


def use_experiment(tracking_uri: str, experiment: str) -> str:
    """Point MLflow at `tracking_uri` and make `experiment` the active one; its id.

    The experiment is created with the artifact location of `artifact_location`; one created
    before keeps the location it has. Either way it carries the tags that open MLflow's UI on its
    runs and the runs table's view of plans (`EXPERIMENT_KIND`, `PLANS_VIEW_STATE`).
    """
    import mlflow

    create_store(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    view = (f"mlflow.sharedViewState.{PLANS_VIEW}", json.dumps(PLANS_VIEW_STATE))
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is not None:
        experiment_id = existing.experiment_id
        for key, value in (EXPERIMENT_KIND, view):
            if existing.tags.get(key) != value:
                mlflow.MlflowClient().set_experiment_tag(experiment_id, key, value)
    else:
        experiment_id = mlflow.create_experiment(
            experiment, artifact_location=artifact_location(tracking_uri), tags=dict((EXPERIMENT_KIND, view))
        )
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def ui_address(tracking_uri: str) -> str:
    """Where the MLflow UI of `tracking_uri` is: a tracking server serves its own; a local store's is `ui_command`'s."""
    return tracking_uri.rstrip("/") if serves_its_ui(tracking_uri) else f"http://127.0.0.1:{ui_port()}"


def serves_its_ui(tracking_uri: str) -> bool:
    """Whether `tracking_uri` is a tracking server, which serves the UI itself: a local store's needs `ui_command`
    (printed for a server at its own address, 127.0.0.1:5000, the command failed on its URI and clashed with it)."""
    return tracking_uri.startswith(("http://", "https://"))


def runs_url(tracking_uri: str, experiment_id: str) -> str:
    """The UI's runs table of an experiment's plans, compared by cost_ms (`PLANS_VIEW_STATE`)."""
    query = urlencode({"workflowType": "machine_learning", "viewStateShareKey": PLANS_VIEW})
    return f"{ui_address(tracking_uri)}/#/experiments/{experiment_id}/runs?{query}"


def comparison_url(tracking_uri: str, experiment_id: str, run_ids: Sequence[str]) -> str:
    """The UI's side-by-side comparison of runs: their metrics and parameters, and a parallel-coordinates plot."""
    compact = {"separators": (",", ":")}
    query = urlencode(
        {
            "runs": json.dumps(list(run_ids), **compact),
            "experiments": json.dumps([experiment_id], **compact),
            "workflowType": "machine_learning",
        }
    )
    return f"{ui_address(tracking_uri)}/#/compare-runs?{query}"


def plan_estimate(plan: Plan) -> tuple[float | None, float | None]:
    """The plan's simulated cost and its task's lower bound in ms, None where the algorithm gave none.

    The one place that knows where plans keep their estimates.
    """
    return (plan.estimate.predicted.cost_ms, plan.estimate.lower_bound_ms) if plan.estimate else (None, None)


def ui_command(tracking_uri: str) -> str:
    """The MLflow UI on `tracking_uri` at `ui_port`, with what it needs only: one worker, and none of MLflow's
    server-side jobs (15 processes become 2)."""
    installed = Path(sys.prefix) / "bin" / "mlflow"  # the one beside this Python (the project's .venv), from anywhere
    mlflow = installed if installed.is_file() else "mlflow"
    return (
        f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {mlflow} ui --backend-store-uri {tracking_uri} "
        f"--host 127.0.0.1 --port {ui_port()} --workers 1"
    )


def device_cost_chart(cost: PlanCost, title: str, path: Path) -> None:
    """Stacked bars of each device's four parts, the slowest device's total marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = [d.device for d in cost.devices]
    fig, ax = plt.subplots(figsize=(max(5.5, 0.6 * len(devices) + 3.5), 3.5))
    bottom = [0.0] * len(devices)
    for part in STEP_PARTS:
        values = [getattr(d, part) for d in cost.devices]
        ax.bar(devices, values, bottom=bottom, label=part.removesuffix("_ms").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(cost.cost_ms, color="black", linestyle="--", linewidth=1, label=f"plan cost {cost.cost_ms:.2f} ms")
    ax.set_xlabel("device")
    ax.set_ylabel("ms per step")
    ax.set_xticks(devices)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _readable(metrics: dict[str, float]) -> dict[str, float]:
    """Milliseconds to the microsecond and ratios to the thousandth, far below the noise of a measurement: the runs
    table shows them whole (its columns cut 2.1607201 to 2.160...). `placement_seconds` is kept as measured."""
    return {key: value if key == "placement_seconds" else round(value, 3) for key, value in metrics.items()}


def _plan_metrics(plan: Plan, cost: PlanCost) -> dict[str, float]:
    """A measured plan's metrics: its cost and parts per device, and beside them what the models predicted."""
    metrics = {"cost_ms": cost.cost_ms, "placement_seconds": plan.placement_seconds}
    for d in cost.devices:
        metrics[f"device_{d.device}_total_ms"] = d.total_ms
        for part in STEP_PARTS:
            metrics[f"device_{d.device}_{part}"] = getattr(d, part)
    for part in STEP_PARTS:
        metrics[f"max_{part}"] = max(getattr(d, part) for d in cost.devices)
    predicted, lower_bound = plan_estimate(plan)
    if predicted is not None:
        metrics["predicted_cost_ms"] = predicted
        metrics["measured_over_predicted"] = cost.cost_ms / predicted
    if lower_bound is not None:
        metrics["lower_bound_ms"] = lower_bound
        metrics["cost_over_lower_bound"] = cost.cost_ms / lower_bound
    if cost.rounds is not None:
        metrics.update({"cost_ci_low_ms": cost.rounds.ci_low_ms, "cost_ci_high_ms": cost.rounds.ci_high_ms})
    return metrics


def log_plan_evaluation(
    plan: Plan,
    cost: PlanCost,
    topology: Topology,
    task: str,
    tables: list[TableSpec],
    tracking_uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    run_name: str | None = None,
    judged: tuple[MeasuredComparison, str] | None = None,
) -> str:
    """Log one measured plan of `tables` (the task named `task`) as an MLflow run; returns the run id.

    Inside an active run (a comparison's, `log_comparison`) it is that run's child. `judged` gives the comparison
    and the plan's name in it: the run then carries its verdict and its cost ratio to the chosen plan."""
    use_experiment(tracking_uri, experiment)
    return _log_plan_run(plan, cost, topology, task, tables, run_name, judged)


def _log_plan_run(
    plan: Plan,
    cost: PlanCost,
    topology: Topology,
    task: str,
    tables: list[TableSpec],
    run_name: str | None,
    judged: tuple[MeasuredComparison, str] | None,
) -> str:
    """`log_plan_evaluation` in the experiment in use."""
    import mlflow

    hardware = cost.hardware
    tags = {
        "kind": "plan",
        "task": task,
        "task_id": task_digest(tables),
        "algorithm": plan.algorithm,
        "devices": str(plan.num_devices),
        "hardware": hardware,
    }
    if plan.estimate is not None:  # which models priced the plan: the file, their hardware, what they were fit to
        provenance = {
            "cost_model": plan.estimate.cost_model,
            "cost_model_hardware": plan.estimate.hardware,
            "cost_model_provenance": plan.estimate.provenance,
        }
        tags.update({key: value for key, value in provenance.items() if value})
    metrics = _plan_metrics(plan, cost)
    if judged is not None:
        comparison, name = judged
        tags["verdict"] = comparison.verdict(name)
        # a plan several algorithms made alike is theirs all, as the comparison names it (`a=b`): tagged by the
        # first alone, a filter on the others found none of its runs (a walk)
        tags["algorithm"] = name if plan.algorithm in name.split("=") else plan.algorithm
        ratio = comparison.ratios.get(name)
        metrics.update(
            {"ratio_to_chosen": ratio.ratio, "ratio_low": ratio.low, "ratio_high": ratio.high}
            if ratio
            else {"ratio_to_chosen": 1.0}
        )
    run_name = run_name or f"{task}/{plan.algorithm}"
    with mlflow.start_run(run_name=run_name, tags=tags, nested=True) as run:
        mlflow.log_params(
            {
                "task": task,
                "algorithm": tags["algorithm"],
                "num_devices": plan.num_devices,
                "num_tables": len(tables),
                "memory_gb": round(topology.memory_gb, 4),
                "batch_size": topology.batch_size,
                "optimizer": topology.optimizer,
                "hardware": hardware,
            }
        )
        mlflow.log_metrics(_readable(metrics))
        warnings = plan.estimate.warnings if plan.estimate else []
        if warnings:  # the models' prices of this plan may be off: say why, beside them
            mlflow.set_tag("model_warnings", f"{len(warnings)}: {warnings[0]}")
            mlflow.log_text("\n".join(warnings) + "\n", "model_warnings.txt")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "plan.json").write_text(json.dumps(plan.model_dump(mode="json"), indent=2))
            (folder / "result.json").write_text(json.dumps(cost.model_dump(mode="json"), indent=2))
            device_cost_chart(cost, run_name, folder / "device_costs.png")
            mlflow.log_artifacts(tmp)
        return run.info.run_id


def accuracy_scatter(groups: dict[str, tuple[list[float], list[float]]], title: str, path: Path) -> None:
    """Predicted against measured ms on log axes, one colour per group, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    everything = [v for predicted, measured in groups.values() for v in (*predicted, *measured)]
    for label, (predicted, measured) in groups.items():
        ax.scatter(measured, predicted, s=10, alpha=0.7, label=f"{label} (n={len(measured)})")
    if everything:
        low, high = min(everything), max(everything)
        ax.plot([low, high], [low, high], color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms")
    ax.set_ylabel("predicted ms")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_costmodel_evaluation(
    model_path: str,
    hardware: str,
    metrics: dict[str, float],
    groups: dict[str, tuple[list[float], list[float]]],
    tracking_uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
) -> str:
    """An MLflow run of a cost model's held-out accuracy, with the predicted-vs-measured scatter."""
    import mlflow

    use_experiment(tracking_uri, experiment)
    with mlflow.start_run(
        run_name=f"costmodel/{Path(model_path).name}", tags={"kind": "costmodel", "hardware": hardware}
    ) as run:
        mlflow.log_params({"model": str(model_path), "hardware": hardware})
        mlflow.log_metrics(metrics)
        with tempfile.TemporaryDirectory() as tmp:
            accuracy_scatter(groups, f"compute cost model on {hardware}", Path(tmp) / "predicted_vs_measured.png")
            mlflow.log_artifacts(tmp)
        return run.info.run_id


def log_calibration(
    report: dict[str, Any],
    model_path: str,
    task: str,
    tables: list[TableSpec],
    tracking_uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
) -> str:
    """An MLflow run of one calibration of `tables` (named `task`): held-out accuracy before and after, what was
    measured, the models kept; tagged by task as the plans' runs are, so a filter on the tables finds it too."""
    import mlflow

    use_experiment(tracking_uri, experiment)
    hardware = report["hardware"]
    tags = {"kind": "calibration", "hardware": hardware, "task": task, "task_id": task_digest(tables)}
    with mlflow.start_run(run_name=f"calibrate/{hardware}", tags=tags) as run:
        mlflow.log_params(
            {
                "hardware": hardware,
                "started_from": report["started_from"]["path"],
                "started_from_hardware": report["started_from"]["hardware"],
                "chosen": report["chosen"],
                "reason": report["reason"],
                "model": model_path,
            }
        )
        metrics = {"seconds": report["seconds"], "measuring_seconds": report["measuring_seconds"]}
        for when in ("before", "after", "fine_tuned"):
            for part, scores in report[when].items():
                metrics.update({f"{when}_{part}_{k}": v for k, v in scores.items() if v is not None and k != "n"})
        metrics.update({f"shards_{k}": v for k, v in report["shards"].items()})
        metrics.update({f"plans_{k}": v for k, v in report["plans"].items()})
        if report.get("noise_floor"):
            metrics.update({f"noise_floor_{k}": v for k, v in report["noise_floor"].items()})
        mlflow.log_metrics(metrics)
        mlflow.log_dict(report, "calibration.json")
        return run.info.run_id


@dataclass
class LoggedComparison:
    """A comparison's MLflow runs: its own, and one child per plan by the plan's name in the comparison."""

    experiment_id: str
    run_id: str
    plan_runs: dict[str, str]

    def describe(self, tracking_uri: str) -> str:
        """Where the runs are and how to see the plans side by side."""
        lines = [
            f"logged MLflow run {self.run_id} with a run per plan to {tracking_uri}",
            "the plans side by side: "
            + comparison_url(tracking_uri, self.experiment_id, list(self.plan_runs.values())),
            f"every plan measured, by cost_ms: {runs_url(tracking_uri, self.experiment_id)}",
        ]
        if not serves_its_ui(tracking_uri):
            lines.append(f"(with the UI started: {ui_command(tracking_uri)})")
        return "\n".join(lines)


def log_comparison(
    result: MeasuredComparison,
    plans: Mapping[str, Plan],
    costs: Mapping[str, PlanCost],
    topology: Topology,
    task: str,
    tables: list[TableSpec],
    tracking_uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    files: Sequence[Path] = (),
    kind: str = "comparison",
) -> LoggedComparison:
    """An MLflow run of one comparison (`kind`: a `compare`, a race), with a child run per plan (as
    `log_plan_evaluation`): the verdict, each plan's cost_ms (its median round, as printed) and ratio interval, and `files`.

    `plans` and `costs` are keyed by name: the comparison's candidates, or names within them (a candidate names
    the plans that placed the tables alike, joined by '=')."""
    import re

    import mlflow

    experiment_id = use_experiment(tracking_uri, experiment)
    tags = {"kind": kind, "task": task, "task_id": task_digest(tables), "hardware": result.hardware}
    plan_runs = {}
    with mlflow.start_run(run_name=f"{task}/{kind}", tags=tags) as run:
        mlflow.log_params(
            {
                "task": task,
                "plans": ",".join(result.candidates),
                "chosen": result.chosen,
                "separated": result.separated,
                "incumbent": result.incumbent or "none",
                "rule": result.rule[:500],
                "rounds": result.rounds,
                "confidence": result.confidence,
                "hardware": result.hardware,
                "priced_parts": ",".join(result.priced_parts) or "none",
            }
        )
        metrics = {}
        for name, summary in result.candidates.items():
            key = re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", name)  # MLflow's allowed metric-name characters
            metrics[f"cost_ms.{key}"] = summary.median_ms
            if name in result.ratios:
                r = result.ratios[name]
                metrics.update({f"ratio.{key}": r.ratio, f"ratio_low.{key}": r.low, f"ratio_high.{key}": r.high})
        mlflow.log_metrics(_readable(metrics))
        for path in files:
            if path.is_file():
                mlflow.log_artifact(str(path))
        for name, plan in plans.items():
            candidate = next(c for c in result.candidates if name in (c, *c.split("=")))
            plan_runs[name] = _log_plan_run(
                plan,
                costs[name],
                topology,
                task,
                tables,
                f"{task}/{name}",
                (result, candidate),
            )
        return LoggedComparison(experiment_id, run.info.run_id, plan_runs)
