"""DreamShard's estimated MDP: place a task's tables one per step, priced by the cost models.

`PlacementState` is one episode on one task: tables go table-wise, in order of predicted
single-table cost, largest first; the action is the device of the current table. Observations
are built from the shared feature extractor (`shard_ray.costmodel.features`) and the cost
models' predictions, so no hardware runs inside the RL loop. The same state drives training
(`PlacementEnv`, drawing a task per episode) and inference (`shard_ray.policy.decode`).

Rewards are dense and telescoping: step t earns -(C_t - C_{t-1}) / L, where C_t is the
simulated cost of the partial plan (its slowest device) and L the task's lower bound, so an
episode's return is exactly minus the final plan's simulated cost over the lower bound. The
ratio makes returns comparable across tasks of any size. An episode whose next table fits on no
device ends early with a penalty of `INFEASIBLE_PENALTY`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.features import NUM_SCALAR_FEATURES, NUM_TABLE_FEATURES, TABLE_FEATURES, pieces_features
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.pricing import Pricer, single_costs
from shard_ray.errors import ShardRayError
from shard_ray.plan.enumerator import pieces_to_place
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.workload.tables import TableSpec
from shard_ray.workload.tasks import TaskConfig, draw_task

DEVICE_FEATURES = (
    "fwd_compute",  # predicted ms of the device's fused shard, over the lower bound
    "bwd_compute",
    "comm",  # predicted forward + backward all-to-all ms, over the lower bound
    "total",
    "total_with_table",  # the device's predicted total were the current table put there
    "makespan_increase",  # how much the plan's slowest device would grow
    "free_memory",  # share of the cap still free
    "table_memory",  # the current table's memory over the device's free memory
    "width_share",  # the device's columns over the task's
    "log_tables",
    # the shared features of the tables already there, summed, over the task's tables per device
    *(f"sum_{name}" for name in TABLE_FEATURES[:NUM_SCALAR_FEATURES]),
    "sum_reuse",  # the reuse histograms' mass (the number of tables), as one number
)
NUM_DEVICE_FEATURES = len(DEVICE_FEATURES)
# The current table: its shared features, then its predicted cost alone, the share of the
# task's predicted single-table cost still to place after it, the progress, and log2 devices.
NUM_CURRENT_FEATURES = NUM_TABLE_FEATURES + 4
INFEASIBLE_PENALTY = 2.0
# The most devices scored for a table, so that placing grows with the tables, not tables x devices (docs/policy.md):
# on more devices, those with room for it, half the least loaded by predicted step and the rest the roomiest.
CANDIDATES = 16


class PlacementState:
    """One task being placed table by table under the cost models; each step scores `candidates()`."""

    def __init__(
        self, tables: list[TableSpec], topology: Topology, models: CostModels, candidates: int = CANDIDATES
    ) -> None:
        if not tables:
            raise ShardRayError("a placement task needs at least one table")
        self.topology = topology
        self.models = models
        self.pricer = Pricer(models, topology)
        pieces = pieces_to_place(tables, topology)  # tables, or the row ranges of one no device can hold
        singles = single_costs(self.pricer, pieces)
        order = np.lexsort((-singles, [not p.restricted for p in pieces]))  # pieces with fixed devices first
        self.singles = singles[order]
        self.pieces = [pieces[i] for i in order]
        self.encodings = self.pricer.encodings(self.pieces)
        sizes = self.pricer.sizes(self.pieces)
        self.widths, self.inputs, self.need, self.allowed = sizes.widths, sizes.inputs, sizes.need, sizes.allowed
        self.features = pieces_features(self.pieces, models.rows_cap)
        self.lower_bound = lower_bound_ms(models, tables, topology, column_wise=False)
        d = topology.num_devices
        self.sums = torch.zeros(d, self.encodings.shape[1])
        self.counts = torch.zeros(d)
        self.device_widths = np.zeros(d)
        self.device_inputs = np.zeros(d)
        self.ledger = MemoryLedger(topology)
        self.feature_sums = np.zeros((d, NUM_TABLE_FEATURES), dtype=np.float64)
        self.compute_ms = np.zeros((d, 2))
        self.comm_ms = np.zeros(d)
        self.assign: list[int] = []
        self.cost = 0.0
        self.max_candidates = candidates
        self._candidates: np.ndarray | None = None
        self._what_if: np.ndarray | None = None

    @property
    def step_index(self) -> int:
        return len(self.assign)

    @property
    def done(self) -> bool:
        return self.step_index == len(self.pieces)

    def action_mask(self) -> np.ndarray:
        """Devices with room for the current table, among those it may go to (one, for a row-wise block)."""
        return self.ledger.room(self.need[self.step_index]) & self.allowed[self.step_index]

    def _device_totals(self) -> np.ndarray:
        return self.compute_ms.sum(axis=1) + self.comm_ms

    def candidates(self) -> np.ndarray:
        """The devices scored for the current table, ascending: every device, up to `max_candidates` of them; on
        more, among those with room for it, half the least loaded by predicted step and the rest the roomiest
        (each by device index on ties)."""
        if self._candidates is None:
            mask = self.action_mask()
            chosen = np.arange(len(mask))
            if len(mask) > self.max_candidates:
                chosen = np.flatnonzero(mask)
            if len(chosen) > self.max_candidates:
                half = self.max_candidates // 2
                least_loaded = chosen[np.argsort(self._device_totals()[chosen], kind="stable")[:half]]
                rest = np.setdiff1d(chosen, least_loaded, assume_unique=True)
                roomiest = rest[np.argsort(-self.ledger.free[rest], kind="stable")[: self.max_candidates - half]]
                chosen = np.sort(np.concatenate([least_loaded, roomiest]))
            self._candidates = chosen
        return self._candidates

    def what_if(self) -> np.ndarray:
        """Predicted (fwd, bwd, comm) ms of each candidate device were the current table put there."""
        if self._what_if is None:
            self._what_if = self._rows_if(self.candidates())
        return self._what_if

    def _rows_if(self, devices: np.ndarray) -> np.ndarray:
        """Predicted (fwd, bwd, comm) ms of `devices` were the current table put there."""
        i, d = self.step_index, self.topology.num_devices
        at = torch.from_numpy(devices)
        compute = self.models.compute_from_sums(self.sums[at] + self.encodings[i], self.counts[at] + 1)
        widths = self.device_widths[devices] + self.widths[i]
        total = self.device_widths.sum() + self.widths[i]
        widest = np.maximum(self.device_widths.max(), widths)
        comm = np.zeros(len(devices))
        if d > 1:
            inputs = self.device_inputs[devices] + self.inputs[i]
            most = np.maximum(self.device_inputs.max(), inputs)
            comm = self.pricer.comm_rows(widths, total, widest, d)
            comm += self.pricer.input_rows(inputs, self.device_inputs.sum() + self.inputs[i], most, d)
        return np.concatenate([compute, comm[:, None]], axis=1)

    def observation(self) -> dict[str, np.ndarray]:
        """Rows of the candidate devices [C, NUM_DEVICE_FEATURES] (`candidates()`), the current table
        [NUM_CURRENT_FEATURES], the masks."""
        i, d, n = self.step_index, self.topology.num_devices, len(self.pieces)
        c = self.candidates()
        scale = self.lower_bound
        totals = self._device_totals()[c]
        with_table = self.what_if().sum(axis=1)
        per_device_share = max(n / d, 1.0)
        sums = self.feature_sums[c] / per_device_share
        free = self.ledger.free[c]
        devices = np.column_stack(
            [
                self.compute_ms[c] / scale,
                self.comm_ms[c] / scale,
                totals / scale,
                with_table / scale,
                (np.maximum(with_table, self.cost) - self.cost) / scale,
                free / self.topology.memory_bytes,
                np.minimum(self.need[i] / np.maximum(free, 1), 2.0),
                self.device_widths[c] / self.widths.sum(),
                np.log1p(self.counts.numpy()[c]),
                sums[:, :NUM_SCALAR_FEATURES],
                sums[:, NUM_SCALAR_FEATURES:].sum(axis=1),
            ]
        )
        current = np.concatenate(
            [
                self.features[i],
                [self.singles[i] / scale, self.singles[i + 1 :].sum() / self.singles.sum(), i / n, math.log2(d)],
            ]
        )
        return {
            "devices": devices.astype(np.float32),
            "table": current.astype(np.float32),
            "action_mask": self.action_mask()[c].astype(np.float32),
            "valid": np.ones(len(c), dtype=np.float32),
        }

    def place(self, device: int) -> float:
        """Put the current table on `device`; the step's reward."""
        i = self.step_index
        if not self.action_mask()[device]:
            raise ShardRayError(f"device {device} has no room for {self.pieces[i].describe()}")
        c = self.candidates()
        slot = int(np.searchsorted(c, device))
        row = self.what_if()[slot] if slot < len(c) and c[slot] == device else self._rows_if(np.array([device]))[0]
        self.sums[device] += self.encodings[i]
        self.counts[device] += 1
        self.device_widths[device] += self.widths[i]
        self.ledger.take(device, self.need[i])
        self.feature_sums[device] += self.features[i]
        self.compute_ms[device] = row[:2]
        self.device_inputs[device] += self.inputs[i]
        self.assign.append(device)
        # Every device's all-to-alls priced again each step, on up to `max_candidates` devices; on more, every
        # `max_candidates` steps and at the end, and the device placed on takes its what-if price in between: the
        # others' columns did not change, only the plan's total (a step then costs the candidates, not the devices).
        d = self.topology.num_devices
        if d <= self.max_candidates or self.step_index % self.max_candidates == 0 or self.done:
            self.comm_ms = self.pricer.collectives(self.device_widths).sum(axis=1) + self.pricer.input_dist(
                self.device_inputs
            )
        else:
            self.comm_ms[device] = row[2]
        self._candidates = self._what_if = None
        previous, self.cost = self.cost, float(self._device_totals().max())
        return -(self.cost - previous) / self.lower_bound

    def stuck(self) -> bool:
        """True when the next table fits on no device."""
        return not self.done and not self.action_mask().any()

    def plan(self, algorithm: str) -> Plan:
        if not self.done:
            raise ShardRayError(f"the plan is incomplete: {self.step_index} of {len(self.pieces)} tables placed")
        return Plan.from_assignment(self.pieces, self.assign, self.topology.num_devices, algorithm)


@dataclass
class EnvConfig:
    """What tasks a training environment draws. Plain data, so RLlib can ship it to env runners."""

    tables: list[dict[str, Any]] = field(default_factory=list)  # the pool, as TableSpec dicts
    min_tables: int = 15
    max_tables: int = 25
    dims: tuple[int, ...] = (16, 32, 64, 128)
    devices: tuple[int, ...] = (4,)
    max_devices: int = 8  # observations are padded to this many devices
    memory_headroom: tuple[float, float] = (1.3, 2.0)  # drawn per task: cap over an even split
    batch_size: int = 1024
    # The model file's content, so env runners on any node need no access to the file; empty: the shipped models.
    cost_model: bytes = b""

    def check(self) -> None:
        if not self.tables:
            raise ShardRayError("the environment's table pool is empty")
        if max(self.devices) > self.max_devices:
            raise ShardRayError(f"devices {self.devices} exceed max_devices {self.max_devices}")
        TaskConfig(min_tables=self.min_tables, max_tables=self.max_tables, dims=self.dims).check()
        if self.min_tables > len(self.tables):
            raise ShardRayError(f"tasks need {self.min_tables} tables but the pool has {len(self.tables)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pad_observation(obs: dict[str, np.ndarray], max_devices: int) -> dict[str, np.ndarray]:
    """Pad the device axis to `max_devices`; padded devices are masked out of actions and of the value."""
    d = obs["devices"].shape[0]
    if d > max_devices:
        raise ShardRayError(f"{d} devices exceed the {max_devices} this environment pads to")
    devices = np.zeros((max_devices, NUM_DEVICE_FEATURES), dtype=np.float32)
    devices[:d] = obs["devices"]
    padded = {"devices": devices, "table": obs["table"]}
    for key in ("action_mask", "valid"):
        padded[key] = np.zeros(max_devices, dtype=np.float32)
        padded[key][:d] = obs[key]
    return padded


class PlacementEnv(gym.Env):
    """A new task from the pool every episode; observations padded to `max_devices`."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = EnvConfig(**(config or {}))
        self.config.check()
        self.pool = [TableSpec.model_validate(t) for t in self.config.tables]
        self.task_config = TaskConfig(
            min_tables=self.config.min_tables, max_tables=self.config.max_tables, dims=self.config.dims
        )
        if self.config.cost_model:
            self.models = CostModels.from_bytes(self.config.cost_model, "the environment's cost models")
        else:
            self.models = CostModels.load(default_cost_model_path())
        m = self.config.max_devices
        self.observation_space = gym.spaces.Dict(
            {
                "devices": gym.spaces.Box(-np.inf, np.inf, (m, NUM_DEVICE_FEATURES), np.float32),
                "table": gym.spaces.Box(-np.inf, np.inf, (NUM_CURRENT_FEATURES,), np.float32),
                "action_mask": gym.spaces.Box(0.0, 1.0, (m,), np.float32),
                "valid": gym.spaces.Box(0.0, 1.0, (m,), np.float32),
            }
        )
        self.action_space = gym.spaces.Discrete(m)
        self.rng = np.random.default_rng()
        self.seed: int | None = None  # the seed of the last seeded reset (RLlib seeds each env's first)
        self.resumed_after = 0  # the iterations a resumed run had done: they seed its tasks with `seed`
        self.state: PlacementState | None = None

    def set_cost_models(self, models: CostModels) -> None:
        """Price later episodes with `models` (DreamShard's outer loop updates them)."""
        self.models = models

    def resume_after(self, iterations: int) -> None:
        """Draw the tasks of a run resumed after `iterations`, not the first run's again: RLlib seeds every env
        from the algorithm's seed alone, so the tasks are seeded by that seed and the iterations done."""
        self.resumed_after = iterations
        self.rng = np.random.default_rng((self.seed or 0, iterations))

    def draw_task(self) -> tuple[list[TableSpec], Topology]:
        tables = draw_task(self.pool, self.task_config, self.rng)
        d = int(self.rng.choice(self.config.devices))
        headroom = float(self.rng.uniform(*self.config.memory_headroom))
        topology = Topology(
            num_devices=d, memory_bytes=memory_cap_with_headroom(tables, d, headroom), batch_size=self.config.batch_size
        )
        return tables, topology

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.seed = seed
            self.rng = np.random.default_rng((seed, self.resumed_after) if self.resumed_after else seed)
        tables, topology = self.draw_task()
        self.state = PlacementState(tables, topology, self.models)
        return pad_observation(self.state.observation(), self.config.max_devices), {}

    def step(self, action: int) -> tuple[dict, float, bool, bool, dict]:
        state = self.state
        assert state is not None, "reset() before step()"
        candidates = state.candidates()
        mask = state.action_mask()[candidates]
        # a padded or full device is never sampled under the mask; should one come, fall back to a valid one
        slot = int(action) if action < len(mask) and mask[action] else int(np.flatnonzero(mask)[0])
        reward = state.place(int(candidates[slot]))
        info: dict[str, Any] = {}
        if state.done:
            info = {"cost_over_lower_bound": state.cost / state.lower_bound, "feasible": True}
            obs = self._final_observation()
            return obs, reward, True, False, info
        if state.stuck():
            info = {"feasible": False}
            return self._final_observation(), reward - INFEASIBLE_PENALTY, True, False, info
        return pad_observation(state.observation(), self.config.max_devices), reward, False, False, info

    def _final_observation(self) -> dict[str, np.ndarray]:
        """Terminal observations are never acted on; an all-zero one keeps the spaces' shapes."""
        m = self.config.max_devices
        return {
            "devices": np.zeros((m, NUM_DEVICE_FEATURES), dtype=np.float32),
            "table": np.zeros(NUM_CURRENT_FEATURES, dtype=np.float32),
            "action_mask": np.zeros(m, dtype=np.float32),
            "valid": np.zeros(m, dtype=np.float32),
        }
