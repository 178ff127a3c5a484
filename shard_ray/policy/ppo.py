"""Training the placement policy with RLlib's PPO on the estimated MDP, top to bottom.

Environment: `PlacementEnv`, a task from the training pool per episode, priced by the cost
models. Module: `DevicePolicyModule`. Algorithm: PPO on RLlib's new API stack, with env runners
and learners on the Ray cluster (none on a small machine: sampling and learning then run in the
driver). Every `checkpoint_every` iterations the algorithm is saved with `save_to_path` (a run
stopped and started again resumes from it) and the policy file `policy.pt` is exported for
placing without Ray. Each iteration is logged to MLflow when a tracking URI is given.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.io import write_json
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.policy.env import EnvConfig, PlacementEnv
from shard_ray.policy.network import OptionScorer, save_policy
from shard_ray.policy.policy_file import (
    DecodingScorer,
    PolicyInfo,
    models_label,
    nothing_to_train,
    refuse_other_training,
)
from shard_ray.policy.settings import PolicyConfig
from shard_ray.threads import one_thread
from shard_ray.tracking.mlflow_runs import POLICY_EXPERIMENT, use_experiment
from shard_ray.workload.tables import TableSpec
from shard_ray.workload.tasks import TaskConfig, draw_task


def env_config(config: PolicyConfig, pool: list[TableSpec], cost_model: str | None) -> EnvConfig:
    return EnvConfig(
        tables=[t.model_dump(mode="json") for t in pool],
        min_tables=config.min_tables,
        max_tables=config.max_tables,
        devices=config.devices,
        max_devices=config.max_devices,
        memory_headroom=config.memory_headroom,
        batch_size=config.batch_size,
        cost_model=Path(cost_model).read_bytes() if cost_model else b"",
    )


def _not_rllibs_own_deprecation(record: logging.LogRecord) -> bool:
    # RLModule.__init__ builds the deprecated RLModuleConfig itself (RLlib 2.60), so every module
    # warns of `RLModule(config=...)`, which no code of ours calls; Ray's other deprecations stay.
    return "RLModule(config=" not in record.getMessage()


def build_algorithm(config: PolicyConfig, pool: list[TableSpec], cost_model: str | None = None) -> Any:
    """A PPO Algorithm on the placement environment (needs a connected Ray)."""
    import torch
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from shard_ray.policy.module import DevicePolicyModule
    from shard_ray.profiling.actors import cluster_has_gpus

    config.check()
    environment = env_config(config, pool, cost_model)
    environment.check()
    # RLlib warns, before `log_level` below applies, about its own API stack: nothing a user of
    # shard-ray can act on. Its errors still show.
    logging.getLogger("ray.rllib").setLevel(logging.ERROR)
    logging.getLogger("ray._common.deprecation").addFilter(_not_rllibs_own_deprecation)
    # Learner actors take a GPU each when the cluster has GPUs; the driver's own learner, when it has one.
    gpus = int(cluster_has_gpus() if config.num_learners > 0 else torch.cuda.is_available())
    ppo = (
        PPOConfig()
        .environment(PlacementEnv, env_config=environment.to_dict())
        .env_runners(num_env_runners=config.num_env_runners, num_envs_per_env_runner=1)
        .learners(num_learners=config.num_learners, num_gpus_per_learner=gpus)
        .rl_module(rl_module_spec=RLModuleSpec(module_class=DevicePolicyModule, model_config={"hidden": config.hidden}))
        .training(
            lr=config.lr,
            gamma=config.gamma,
            lambda_=config.lambda_,
            clip_param=config.clip_param,
            entropy_coeff=config.entropy_coeff,
            vf_loss_coeff=config.vf_loss_coeff,
            train_batch_size_per_learner=config.train_batch_size,
            minibatch_size=config.minibatch_size,
            num_epochs=config.num_epochs,
        )
        # log_sys_usage: no system-usage sampling thread (nor its "install gputil" notice); returns are what is reported
        .debugging(seed=config.seed, log_level="ERROR", log_sys_usage=False)
        .reporting(metrics_num_episodes_for_smoothing=200)
    )
    from shard_ray.profiling.keeper import release_kept_gang

    release_kept_gang()  # its devices to RLlib's workers
    return ppo.build_algo()


def describe_workers(algo: Any) -> str:
    """Where the algorithm samples and learns, as a line: `PPO: sampling in the driver, learning in 1 learner actor on a
    GPU each`."""
    c = algo.config

    def actors(count: int, kind: str) -> str:
        return f"{count} {kind} actor{'s' if count > 1 else ''}" if count else "the driver"

    sampling, learning = actors(c.num_env_runners, "env runner"), actors(c.num_learners, "learner")
    device = ("a GPU each" if c.num_learners else "a GPU") if c.num_gpus_per_learner else "the CPU"
    return f"PPO: sampling in {sampling}, learning in {learning} on {device}"


def policy_network(algo: Any) -> OptionScorer:
    """The trained network, detached from RLlib (a copy on the CPU)."""
    module = algo.get_module()
    network = OptionScorer(module.network.hidden)
    network.load_state_dict({k: v.detach().cpu() for k, v in module.network.state_dict().items()})
    network.eval()
    return network


def episode_return(result: dict[str, Any]) -> float:
    """Mean return of the iteration's episodes: minus the mean simulated cost over the lower bound."""
    return float(result.get("env_runners", {}).get("episode_return_mean", float("nan")))


# RLlib's timers of an iteration's two halves: the env runners' episodes, and the learners' SGD on them.
ITERATION_TIMERS = (("sampling", "env_runner_sampling_timer"), ("learning", "learner_update_timer"))


def where_time_went(result: dict[str, Any]) -> str:
    """The first iteration's sampling and learning seconds by RLlib's timers, as ` (sampling 1.9 s, learning 0.4 s)`,
    or "" without them: a learner on a GPU speeds up the second half alone. RLlib keeps them as moving averages that
    start at the first iteration's own figures (coefficient 0.01 in Ray 2.60): a later iteration's would be mostly the
    first's, so only the first is shown."""
    timers = result.get("timers", {})
    parts = [f"{name} {timers[key]:.1f} s" for name, key in ITERATION_TIMERS if key in timers]
    return f" ({', '.join(parts)})" if parts else ""


def _on_every_env(algo: Any, call: Callable[[Any], None]) -> None:
    """`call` on every `PlacementEnv` of every env runner, the local one and the remote ones."""

    def update(runner: Any) -> None:
        for env in runner.env.unwrapped.envs:
            call(env.unwrapped)

    algo.env_runner_group.foreach_env_runner(update)


def set_cost_models(algo: Any, models: CostModels) -> None:
    """Price later episodes on every env runner with `models`."""
    _on_every_env(algo, lambda env: env.set_cost_models(models))


def resume_tasks(algo: Any) -> None:
    """Every env runner's envs draw the tasks of the iterations after the restored `algo.iteration`
    (`PlacementEnv.resume_after`), not those the run before it drew first."""
    done = algo.iteration
    _on_every_env(algo, lambda env: env.resume_after(done))


def save_checkpoint(algo: Any, checkpoint_dir: Path) -> None:
    """`save_to_path` into a fresh folder, then swapped in, so a kill mid-save leaves the last checkpoint whole."""
    checkpoint_dir = checkpoint_dir.resolve()  # RLlib takes a path without a scheme only when absolute
    fresh, old = (
        checkpoint_dir.with_name(checkpoint_dir.name + ".new"),
        checkpoint_dir.with_name(checkpoint_dir.name + ".old"),
    )
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    algo.save_to_path(str(fresh))
    if checkpoint_dir.exists():
        checkpoint_dir.rename(old)
    fresh.rename(checkpoint_dir)
    shutil.rmtree(old, ignore_errors=True)


def restore_checkpoint(algo: Any, checkpoint_dir: Path, config: PolicyConfig | None = None) -> bool:
    """Restore the last whole checkpoint, if any (the previous one when a kill fell between the swap's renames)."""
    checkpoint_dir = checkpoint_dir.resolve()
    for candidate in (checkpoint_dir, checkpoint_dir.with_name(checkpoint_dir.name + ".old")):
        if (candidate / "algorithm_state.pkl").exists():
            try:
                algo.restore_from_path(str(candidate))
            except RuntimeError:  # torch's state_dict mismatch: a network of another shape
                refuse_other_training(candidate, asdict(config) if config is not None else {}, failed=True)
            return True
    return False


def train_iterations(
    algo: Any,
    iterations: int,
    checkpoint_dir: Path,
    policy_file: Path,
    info: PolicyInfo,
    checkpoint_every: int,
    on_iteration: Callable[[int, dict[str, Any]], None] | None = None,
    held_out: HeldOut | None = None,
) -> list[float]:
    """Run PPO until the algorithm has done `iterations` in all; saves as it goes. Returns per-iteration returns.
    With `held_out`, the policy file holds the network that has priced its tasks cheapest so far, not the last."""
    returns = []
    with one_thread():  # the driver samples and learns (on a cluster its env runners and learners do)
        while algo.iteration < iterations:
            began = time.perf_counter()
            result = algo.train()
            returns.append(episode_return(result))
            print(
                f"PPO iteration {algo.iteration}/{iterations}: mean return {returns[-1]:.4f} "
                f"(simulated cost {-returns[-1]:.3f}x the lower bound), {time.perf_counter() - began:.1f} s"
                f"{where_time_went(result) if algo.iteration == 1 else ''}",
                flush=True,
            )
            if on_iteration is not None:
                on_iteration(algo.iteration, result)
            if algo.iteration % checkpoint_every == 0 or algo.iteration == iterations:
                save_checkpoint(algo, checkpoint_dir)
                network, update = policy_network(algo), {"iterations": algo.iteration}
                if held_out is not None:
                    print(held_out.judge(network, algo.iteration), flush=True)
                    network, update = held_out.kept(), update | {"validation": held_out.record()}
                save_policy(policy_file, network, info.model_copy(update=update))
    return returns


def train_policy(
    pool: list[TableSpec],
    config: PolicyConfig,
    out_dir: str | Path,
    cost_model: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = POLICY_EXPERIMENT,
) -> Path:
    """Train (or resume training) a policy into `out_dir`; returns the policy file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir, policy_file = out / "checkpoint", out / "policy.pt"
    models = CostModels.load(cost_model or default_cost_model_path())
    info = PolicyInfo(
        cost_model=models_label(cost_model),
        hardware=models.hardware,
        config=asdict(config),
        pool_tables=len(pool),
    )
    if checkpoint_dir.is_dir():  # the command refused this before Ray started; a library caller, here
        refuse_other_training(checkpoint_dir, asdict(config), info.cost_model, len(pool))
    algo = build_algorithm(config, pool, cost_model)
    print(describe_workers(algo), flush=True)
    try:
        resumed = restore_checkpoint(algo, checkpoint_dir, config)
        if resumed:
            print(f"resuming from {checkpoint_dir} after iteration {algo.iteration}")
            resume_tasks(algo)
            if algo.iteration >= config.iterations:  # no held-out check and no MLflow run of no iterations
                print(nothing_to_train(algo.iteration, config.iterations))
                return policy_file
        held_out = None
        if config.validation_tasks:
            seed = config.seed + 1
            tasks = held_out_tasks(pool, config, config.validation_tasks, seed)
            held_out = HeldOut.resumed(policy_file, tasks, seed, models) if resumed else None
            if held_out is None:  # the network as it starts: the untrained one's prior, on a new run
                held_out = HeldOut.starting(policy_network(algo), algo.iteration, tasks, seed, models)
                print(held_out.describe_start(), flush=True)
        logger = (
            MlflowIterationLogger(tracking_uri, experiment, "policy/train", info, out, resumed)
            if tracking_uri
            else None
        )
        try:
            train_iterations(
                algo,
                config.iterations,
                checkpoint_dir,
                policy_file,
                info,
                config.checkpoint_every,
                on_iteration=logger.log_iteration if logger else None,
                held_out=held_out,
            )
        except BaseException as err:
            if logger:  # a Ctrl-C's run was marked FINISHED, as a run that trained every iteration asked
                logger.close(policy_file, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
            raise
        if logger:
            logger.close(policy_file)
    finally:
        algo.stop()
    return policy_file


def validation_tasks(
    pool: list[TableSpec], config: PolicyConfig, count: int, seed: int
) -> list[tuple[list[TableSpec], Topology]]:
    """Tasks like the training ones, with the middle of the headroom range as memory cap."""
    rng = np.random.default_rng(seed)
    tasks = []
    headroom = float(np.mean(config.memory_headroom))
    for _ in range(count):
        tables = draw_task(pool, TaskConfig(min_tables=config.min_tables, max_tables=config.max_tables), rng)
        d = int(rng.choice(config.devices))
        tasks.append(
            (
                tables,
                Topology(
                    num_devices=d,
                    memory_bytes=memory_cap_with_headroom(tables, d, headroom),
                    batch_size=config.batch_size,
                ),
            )
        )
    return tasks


# The held-out check's tasks beyond training's: on these multiples of its most devices, with as many tables a device as
# its largest tasks. A network trained on the shipped recipe (2-8 devices) priced 8 tasks like training's 0.04% below
# its prior and 16-device tasks of tight memory 4% above it (docs/results.md): tasks like training's alone hid that.
BEYOND_DEVICES = (2, 8)


def held_out_tasks(
    pool: list[TableSpec], config: PolicyConfig, count: int, seed: int
) -> list[tuple[list[TableSpec], Topology]]:
    """The held-out check's tasks (`HeldOut`): `count` like training's (`validation_tasks`), and `count` on each of
    `BEYOND_DEVICES` times training's most devices, with as many tables a device as its largest tasks (at most the
    pool's) and memory at the low end of training's headroom range, where a network that learned only training's
    sizes and room shows it."""
    tasks = validation_tasks(pool, config, count, seed)
    most = max(config.devices)
    for times in BEYOND_DEVICES:
        fewest, largest = (min(n * times, len(pool)) for n in (config.min_tables, config.max_tables))
        beyond = replace(
            config,
            devices=(most * times,),
            min_tables=fewest,
            max_tables=largest,
            memory_headroom=(config.memory_headroom[0],) * 2,
        )
        tasks += validation_tasks(pool, beyond, count, seed)
    return tasks


def validation_score(
    network: OptionScorer, tasks: list[tuple[list[TableSpec], Topology]], models: CostModels
) -> tuple[float, int]:
    """Greedy decoding's mean simulated cost over the lower bound on `tasks`, and how often it got stuck.

    A task where it gets stuck (the next table fits nowhere) scores as the environment's return has it: the partial
    plan's cost over the bound plus `INFEASIBLE_PENALTY` (a fixed 3 sat below the finished plans of tasks priced
    above 3x their bound, as 64-device ones are, so that getting stuck there scored better than placing).
    """
    from shard_ray.policy.decode import roll_out
    from shard_ray.policy.env import INFEASIBLE_PENALTY

    scores, stuck, scorer = [], 0, DecodingScorer.of_network(network)
    for tables, topology in tasks:
        state = roll_out(scorer, tables, topology, models)
        stuck += not state.done
        scores.append(state.cost / state.lower_bound + (0.0 if state.done else INFEASIBLE_PENALTY))
    return float(np.mean(scores)), stuck


@dataclass
class HeldOut:
    """Tasks drawn apart from training's (`held_out_tasks`) that judge the network at every save, and the network that
    has priced them cheapest so far (greedy decoding's mean cost over the lower bound, `validation_score`), the network
    training started from among them: PPO's sampled returns moved without a trend on the shipped policy's training,
    and the last iteration's network priced tasks above its untrained prior (docs/results.md), so training keeps what
    the held-out tasks show, and says whether it beat the prior."""

    tasks: list[tuple[list[TableSpec], Topology]]
    seed: int  # the tasks' draw
    models: CostModels
    start: int  # the iteration of the network training started from: 0, the untrained one, on a new run
    prior: float  # its score
    score: float  # the score of the network kept
    iteration: int  # the iteration of the network kept
    state: dict[str, Any]  # its weights
    hidden: int

    @classmethod
    def starting(cls, network: OptionScorer, iteration: int, tasks: list, seed: int, models: CostModels) -> HeldOut:
        score, _ = validation_score(network, tasks, models)
        state = {k: v.clone() for k, v in network.state_dict().items()}
        return cls(tasks, seed, models, iteration, score, score, iteration, state, network.hidden)

    @classmethod
    def resumed(cls, policy_file: Path, tasks: list, seed: int, models: CostModels) -> HeldOut | None:
        """The check a resumed run's policy file records (None: a file written without one, or of other tasks)."""
        from shard_ray.policy.network import load_policy

        if not policy_file.is_file():
            return None
        network, info = load_policy(policy_file)
        record = info.validation
        if (record.get("tasks"), record.get("seed")) != (len(tasks), seed):
            return None
        return cls(tasks, seed, models, record.get("start", 0), record["prior"], record["score"], record["iteration"],
                   network.state_dict(), network.hidden)  # fmt: skip

    def judge(self, network: OptionScorer, iteration: int) -> str:
        """Score `network` and keep it if it prices the tasks below the network kept; a line saying what was kept."""
        score, stuck = validation_score(network, self.tasks, self.models)
        if score < self.score:
            self.score, self.iteration, self.hidden = score, iteration, network.hidden
            self.state = {k: v.clone() for k, v in network.state_dict().items()}
        against = f"{score:.4f}x the bound" + (f", stuck on {stuck}" if stuck else "")
        return f"held-out check, iteration {iteration}: {against}; {self.describe_kept()}"

    def _the_start(self) -> str:
        if self.start == 0:
            return "the untrained network"
        return f"iteration {self.start}'s network, which this run resumed from"

    def describe_start(self) -> str:
        resumed = "" if self.start == 0 else " (policy.pt held no check of these tasks)"
        devices = sorted({topology.num_devices for _, topology in self.tasks})
        on = ", ".join(map(str, devices[:-1])) + (" and " if len(devices) > 1 else "") + str(devices[-1])
        return (
            f"held-out check: {len(self.tasks)} tasks drawn apart from training's (seed {self.seed}), on {on} devices; "
            f"{self._the_start()} prices them at {self.prior:.4f}x the bound{resumed}"
        )

    def describe_kept(self) -> str:
        if self.score >= self.prior:
            return f"policy.pt keeps the start, {self._the_start()} ({self.prior:.4f}x): none priced them lower"
        gain = 1 - self.score / self.prior
        return f"policy.pt keeps iteration {self.iteration}'s ({self.score:.4f}x, {gain:.2%} below the start)"

    def kept(self) -> OptionScorer:
        network = OptionScorer(self.hidden)
        network.load_state_dict(self.state)
        network.eval()
        return network

    def record(self) -> dict[str, Any]:
        return {
            "tasks": len(self.tasks),
            "seed": self.seed,
            "start": self.start,
            "prior": self.prior,
            "score": self.score,
            "iteration": self.iteration,
        }


class MlflowIterationLogger:
    """One MLflow run for a training: its settings, a metric per iteration, the policy file at the end. A training
    resumed in `out` goes on in the run it started (recorded in `out`'s `RUN_FILE`), where that run is still in the
    store and experiment: resumed as a run of its own, it was a second run holding the later iterations alone, beside
    the first one stopped (a walk)."""

    def __init__(
        self, tracking_uri: str, experiment: str, run_name: str, info: PolicyInfo, out: Path, resumed: bool
    ) -> None:
        import mlflow

        self.mlflow, self.tracking_uri = mlflow, tracking_uri
        experiment_id = use_experiment(tracking_uri, experiment)
        record = out / RUN_FILE
        earlier = _run_to_go_on(record, tracking_uri, experiment_id) if resumed else None
        if earlier is not None:
            self.run = mlflow.start_run(run_id=earlier)
            print(f"going on in MLflow run {earlier}")
            return
        self.run = mlflow.start_run(run_name=run_name, tags={"kind": "policy", "hardware": info.hardware})
        mlflow.log_params({"cost_model": info.cost_model, **{k: str(v) for k, v in info.config.items()}})
        write_json(record, {"tracking_uri": tracking_uri, "run_id": self.run.info.run_id})

    def log_iteration(self, iteration: int, result: dict[str, Any]) -> None:
        self.mlflow.log_metric("policy_episode_return", episode_return(result), step=iteration)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self, policy_file: Path, status: str = "FINISHED") -> None:
        """End the run (`status`: KILLED where training was interrupted, FAILED where it failed), the policy file its
        artifact, and say where it is, as every command logging a run does."""
        if policy_file.exists():
            self.mlflow.log_artifact(str(policy_file))
        self.mlflow.end_run(status=status)
        print(f"logged MLflow run {self.run.info.run_id} to {self.tracking_uri}")


# In a training's folder: the MLflow run it logs to, which a resumed training goes on in.
RUN_FILE = "mlflow_run.json"


def _run_to_go_on(record: Path, tracking_uri: str, experiment_id: str) -> str | None:
    """The run `record` names, where it is in this store and experiment and not deleted; else None (a new run)."""
    import mlflow

    try:
        recorded = json.loads(record.read_text())
        if recorded["tracking_uri"] != tracking_uri:
            return None
        run = mlflow.MlflowClient().get_run(recorded["run_id"])
    except (OSError, ValueError, KeyError, mlflow.exceptions.MlflowException):
        return None
    active = run.info.lifecycle_stage == "active" and run.info.experiment_id == experiment_id
    return run.info.run_id if active else None
