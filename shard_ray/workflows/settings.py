"""The workflows' settings (`calibrate`, `policy outer-loop`, `bench`, `demo`), apart from the workflows so that the
commands taking them build their flags, answer --help and refuse bad input without importing torch, Ray or MLflow."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shard_ray.configfile import differences, flags_of, setting
from shard_ray.errors import ShardRayError, did_you_mean
from shard_ray.plan.topology import (
    MAX_MEMORY_GB,
    check_whole_hosts,
    devices_per_host_setting,
    host_link_gbps_setting,
    inter_host_gbps_setting,
)
from shard_ray.workload.tasks import check_table_counts


@dataclass(frozen=True)
class CalibrateConfig:
    budget_minutes: float = setting(5.0, "time for measuring and fitting; measuring stops in time to fit", min=0.1)
    actors: int = setting(2, "profiling actors, one device each", min=1)
    shards: int = setting(60, "random fused shards of the task's tables, after the candidates' shards", min=0)
    plans: int = setting(16, "random-balance plans measured on the gang, after the candidate plans", min=0)
    warmup: int = setting(2, "untimed steps before each measurement", min=0)
    repeats: int = setting(7, "timed steps per measurement; each part costs the fastest of them", min=1)
    # at most 0.8: the rest fits and validates the fine-tuning (1.5 was taken, a walk's calibration left 4 to fit)
    held_out: float = setting(
        0.2, "share of the measurements held out for the before/after accuracy", min=0.05, max=0.8
    )
    noise_rounds: int = setting(8, "rounds of the noise floor, the first candidate against a copy of itself", min=3)
    lr: float = setting(5e-4, "fine-tuning learning rate", min=0)
    epochs: int = setting(300, "most fine-tuning epochs; early stopping usually ends sooner", min=1)
    fit_share: float = 0.2  # of the budget, kept for fitting
    # Of the measuring time, kept for the plans where a gang measures them: at 8 devices on 2 cores the shards once
    # spent all of it, and the held-out judgement rested on 1 plan (docs/results.md).
    plan_share: float = 0.4
    seed: int = setting(0, "random seed", min=0)


@dataclass(frozen=True)
class OuterLoopConfig:
    rounds: int = setting(5, "rounds of measure / update / train", min=1)
    tasks_per_round: int = setting(4, "policy plans measured per round", min=1)
    ppo_iterations_per_round: int = setting(10, "PPO iterations per round", flag="--ppo-iterations", min=1)
    gang_devices: int = setting(2, "devices of the measuring gang (and of the measured tasks)", min=1)
    profiling_actors: int = setting(2, "profiling actors", flag="--actors", min=1)
    repeats: int = setting(7, "timed steps per measurement; medians are kept", min=1)
    update_epochs: int = setting(40, "most epochs of each cost-model update", min=1)
    update_lr: float = 5e-4
    seed: int = 0

    def check(self) -> None:
        for name in (
            "rounds",
            "tasks_per_round",
            "ppo_iterations_per_round",
            "gang_devices",
            "profiling_actors",
            "repeats",
            "update_epochs",
        ):
            if getattr(self, name) < 1:
                raise ShardRayError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class BenchmarkConfig:
    tasks: int = setting(5, "synthetic test-pool tasks; 0 for only --tables", min=0)
    min_tables: int = setting(20, "fewest tables in a synthetic task", min=1)
    max_tables: int = setting(40, "most tables in a synthetic task", min=1)
    table_files: tuple[str, ...] = setting(
        (),
        "a table file to benchmark as a task of its own; repeat (or comma-separate) for more",
        flag="--tables",
        repeat=True,
    )
    devices: int = setting(2, "devices of the gang", min=1)
    # the plans are made for these hosts and the gang spans them
    devices_per_host: int | None = devices_per_host_setting("one host holds every device")
    inter_host_gbps: float | None = inter_host_gbps_setting("")
    host_link_gbps: float | None = host_link_gbps_setting("")
    batch_size: int = setting(1024, "global batch size", min=1)
    repeats: int = setting(10, "timed steps per plan and round; each part costs the fastest of them", min=1)
    rounds: int = setting(
        12,
        "most interleaved rounds per task (every plan once a round, fresh batches); the comparison stops once it decides",
        min=3,
    )
    budget_seconds: float = setting(120.0, "seconds of measuring per task", min=1)
    memory_headroom: float = setting(1.5, "memory cap over an even split of a task's bytes", min=1)
    memory_gb: float | None = setting(
        None,
        "memory cap per device in GiB, the one the tables will train under (default: --memory-headroom's)",
        min=1e-9,
        max=MAX_MEMORY_GB,
    )
    cost_model: str | None = setting(
        None,
        "cost model file (default: the models calibrated for the gang's hardware, else the shipped ones of its hardware)",
    )
    policy: str | None = setting(None, "policy for dreamshard (default: the shipped one)")
    algorithms: tuple[str, ...] = setting((), "comma-separated names (default: every one that handles the task)")
    seed: int = setting(100, "random seed", min=0)
    out: str = setting("shard-ray-out/benchmark", "report folder; an existing one is resumed", new_folder=True)
    tracking_uri: str | None = None  # None: no MLflow
    experiment: str = "shard-ray-benchmark"

    def recorded(self) -> dict[str, Any]:
        """What a report folder records of the run that measured its tasks: every setting but where runs are logged."""
        kept = {k: v for k, v in asdict(self).items() if k not in ("tracking_uri", "experiment")}
        return json.loads(json.dumps(kept))

    @property
    def settings_file(self) -> Path:
        """Where the report folder records `recorded()`."""
        return Path(self.out) / "tasks" / "settings.json"

    def refuse_other_settings(self) -> None:
        """Refuse to resume a report folder whose tasks were measured with other settings, naming each that differs
        by its flag: a report mixing them would compare what was not measured alike."""
        if not self.settings_file.exists():
            return
        differ = differences(json.loads(self.settings_file.read_text()), self.recorded(), flags_of(BenchmarkConfig))
        if differ:
            raise ShardRayError(
                f"{self.settings_file.parent} holds tasks measured with other settings ({'; '.join(differ)}): give "
                "another --out, the same settings, or remove the folder"
            )

    def check(self) -> None:
        if self.tasks < 0:
            raise ShardRayError(f"tasks must be 0 or more, got {self.tasks}")
        if self.tasks == 0 and not self.table_files:
            raise ShardRayError("nothing to benchmark: give tasks > 0 or table files")
        if self.devices < 1 or self.repeats < 1 or self.batch_size < 1:
            raise ShardRayError("devices, repeats and batch size must be at least 1")
        check_whole_hosts(self.devices, self.devices_per_host, self.inter_host_gbps, self.host_link_gbps)
        check_table_counts(self.min_tables, self.max_tables)
        if not self.memory_headroom >= 1.0:
            raise ShardRayError(f"memory headroom must be at least 1, got {self.memory_headroom}")
        if not self.algorithms:  # every one: the registry, whose placers import the cost models, is not needed
            return
        from shard_ray.placement import algorithms

        known = {a.name for a in algorithms()}
        unknown = [a for a in self.algorithms if a not in known]
        if unknown:
            raise ShardRayError(
                f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                + did_you_mean(unknown[0], known)
            )


@dataclass(frozen=True)
class DemoConfig:
    workdir: Path = setting(
        Path("shard-ray-out/demo"), "where files are written", flag="--out", old_names=("--workdir",)
    )
    num_devices: int = setting(2, "devices in the gang", flag="--devices", min=1)
    num_tables: int = setting(16, "tables in the demo task", min=1)
    profile_shards: int = setting(12, "random multi-table shards to profile", min=0)
    max_tables_per_shard: int = 6
    memory_headroom: float = 1.5  # cap = headroom x (all tables' bytes / devices)
    batch_size: int = 1024
    repeats: int = 10
    rounds: int = setting(12, "most interleaved rounds of every plan (the comparison stops once it decides)", min=3)
    budget_seconds: float = setting(60.0, "seconds of measuring plans", min=1)
    seed: int = setting(0, "random seed", min=0)
    tracking_uri: str | None = None
    experiment: str = "shard-ray"
    address: str | None = None
