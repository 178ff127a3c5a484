"""DreamShard's outer loop: measure the policy's plans for real, update the cost models, train on.

Each round:
  (a) the current policy places `tasks_per_round` tasks from the pool (as `dreamshard` does) on the
      gang's device count; every plan is measured on the device gang and every device's fused
      shard on the profiling actors, all into the measurement store. The cost models' error on
      these plans is measured before the models see them.
  (b) the cost models are trained further on everything in the store (`update_cost_models`)
      and handed to every env runner.
  (c) PPO runs `ppo_iterations_per_round` more iterations on the updated estimated MDP.
Everything is saved as it goes (store, models, RLlib checkpoint, policy file, a state file per
finished round), so a stopped loop started again with the same arguments picks up where it was.
Each round is one step of the MLflow run's metrics: mean measured cost, model error, return.
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shard_ray.costmodel.models import CostModels, models_for
from shard_ray.costmodel.settings import TrainConfig
from shard_ray.costmodel.simulator import Simulator, price_comm
from shard_ray.costmodel.train import mape, update_cost_models
from shard_ray.errors import ShardRayError
from shard_ray.io import write_json
from shard_ray.plan.topology import Topology
from shard_ray.policy.decode import policy_placer
from shard_ray.policy.network import OptionScorer
from shard_ray.policy.policy_file import DecodingScorer, PolicyInfo
from shard_ray.policy.ppo import (
    MlflowIterationLogger,
    build_algorithm,
    policy_network,
    restore_checkpoint,
    set_cost_models,
    train_iterations,
    validation_tasks,
)
from shard_ray.policy.settings import PolicyConfig
from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.gang import DeviceGang
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.profiling.store import MeasurementStore, PlanMeasurement
from shard_ray.tracking.mlflow_runs import POLICY_EXPERIMENT
from shard_ray.workflows.settings import OuterLoopConfig
from shard_ray.workload.tables import TableSpec


def measure_policy_plans(
    network: OptionScorer,
    tasks: list[tuple[list[TableSpec], Topology]],
    models: CostModels,
    gang: DeviceGang,
    profiler: ProfilingPool,
    store: MeasurementStore,
    repeats: int,
    seed: int,
) -> list[tuple[float, float]]:
    """(predicted, measured) plan cost ms of the policy's plan for each task; everything measured lands in the store."""
    pairs = []
    placer = policy_placer(DecodingScorer.of_network(network), models, samples=0, seed=seed)
    for tables, topology in tasks:
        try:
            plan = placer(tables, topology)
        except ShardRayError as err:
            print(f"  a task of {len(tables)} tables is skipped: {err}")
            continue
        config = MeasureConfig.for_topology(topology, repeats=repeats, seed=seed)
        profiler.measure([held for held in plan.pieces(tables) if held], config, store, progress=False)
        key = gang.plan_key(plan, tables, config)
        stored = store.get_plan(key)
        if stored is not None:
            cost = stored.cost
        else:
            cost = gang.evaluate(plan, tables, config)
            store.put_plan(PlanMeasurement(key=key, plan=plan, tables=tables, cost=cost))
        predicted = Simulator(models).plan_cost(plan, tables, topology.batch_size).cost_ms
        pairs.append((predicted, cost.cost_ms))
        print(f"  {len(tables)} tables: predicted {predicted:.2f} ms, measured {cost.cost_ms:.2f} ms", flush=True)
    return pairs


@dataclass
class _Rounds:
    """What every round of the loop works with: the task pool, its settings, RLlib's algorithm, the gang, the
    profiling actors, the store and the MLflow run."""

    pool: list[TableSpec]
    measure_tasks: PolicyConfig
    loop: OuterLoopConfig
    update_config: TrainConfig
    algo: Any
    gang: DeviceGang
    profiler: ProfilingPool
    store: MeasurementStore
    logger: MlflowIterationLogger | None
    out: Path
    info: PolicyInfo

    def play(self, round_index: int, models: CostModels) -> tuple[CostModels, dict[str, Any]]:
        """Round `round_index`: (a) measure the policy's plans, (b) update the models on the store, (c) PPO on
        the updated estimated MDP; the updated models and the round's record."""
        loop = self.loop
        print(f"== round {round_index + 1}/{loop.rounds}: (a) measuring the policy's plans")
        tasks = validation_tasks(
            self.pool, self.measure_tasks, loop.tasks_per_round, loop.seed + 1000 * (round_index + 1)
        )
        pairs = measure_policy_plans(
            policy_network(self.algo), tasks, models, self.gang, self.profiler, self.store, loop.repeats, loop.seed
        )
        print("   (b) updating the cost models on the store")
        models = update_cost_models(models, self.store, self.update_config, hardware=self.profiler.hardware)
        models.save(self.out / "costmodels.pt")
        set_cost_models(self.algo, models)
        print("   (c) PPO on the updated estimated MDP")
        returns = train_iterations(
            self.algo,
            (round_index + 1) * loop.ppo_iterations_per_round,
            self.out / "checkpoint",
            self.out / "policy.pt",
            self.info,
            loop.ppo_iterations_per_round,
            on_iteration=self.logger.log_iteration if self.logger else None,
        )
        record = {
            "round": round_index + 1,
            "plans_measured": len(pairs),
            "mean_measured_cost_ms": statistics.mean(m for _, m in pairs) if pairs else None,
            "model_error": mape(*zip(*pairs)) if pairs else None,
            "policy_episode_return": returns[-1] if returns else None,
        }
        if self.logger:
            self.logger.log_metrics({k: v for k, v in record.items() if isinstance(v, float)}, step=round_index + 1)
        print(f"   round {round_index + 1}: {json.dumps(record)}")
        return models, record


def run_outer_loop(
    pool: list[TableSpec],
    policy_config: PolicyConfig,
    loop: OuterLoopConfig,
    out_dir: str | Path,
    store_path: str | None = None,
    cost_model: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = POLICY_EXPERIMENT,
) -> Path:
    """Run (or resume) the loop into `out_dir`; returns the policy file's path."""
    loop.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models_file, state_file = out / "costmodels.pt", out / "outer_loop.json"
    checkpoint_dir, policy_file = out / "checkpoint", out / "policy.pt"
    history: list[dict[str, Any]] = json.loads(state_file.read_text())["rounds"] if state_file.exists() else []
    update_config = TrainConfig(
        lr=loop.update_lr, max_epochs=loop.update_epochs, patience=loop.update_epochs, seed=loop.seed
    )
    measure_tasks = replace(policy_config, devices=(loop.gang_devices,))

    # Env runners start on the models they can load anywhere, then get the loop's current ones.
    algo = build_algorithm(policy_config, pool, cost_model)
    # Whatever happens, the MLflow run is closed and the gang, the pool and RLlib are stopped (in that order).
    with ExitStack() as resources:
        resources.callback(algo.stop)
        restore_checkpoint(algo, checkpoint_dir, policy_config)
        if history:
            print(f"resuming after round {len(history)} (PPO iteration {algo.iteration})")
        gang = resources.enter_context(DeviceGang(loop.gang_devices, comm_pricer=price_comm))
        profiler = resources.enter_context(ProfilingPool(loop.profiling_actors, gang=gang))
        # A new loop starts from the models `plan` would price this hardware with (`models_for`), not another's.
        models = CostModels.load(models_file if models_file.exists() else cost_model or models_for(profiler.hardware))
        if not models_file.exists():
            models.save(models_file)
        set_cost_models(algo, models)
        info = PolicyInfo(
            cost_model=str(Path(models_file).resolve()),
            hardware=models.hardware,
            config=asdict(policy_config),
            loop=asdict(loop),
        )
        if profiler.hardware != models.hardware:
            print(
                f"note: the cost models were trained on {models.hardware}; the loop adapts them to {profiler.hardware}"
            )
        logger = (
            MlflowIterationLogger(tracking_uri, experiment, "policy/outer-loop", info, out, resumed=bool(history))
            if tracking_uri
            else None
        )
        if logger:
            resources.callback(logger.close, policy_file)
        with MeasurementStore(store_path or out / "measurements.db") as store:
            rounds = _Rounds(pool, measure_tasks, loop, update_config, algo, gang, profiler, store, logger, out, info)
            for round_index in range(len(history), loop.rounds):
                models, record = rounds.play(round_index, models)
                history.append(record)
                write_json(state_file, {"rounds": history})
    return policy_file
