"""Ray Tune sweep of the PPO hyperparameters of the placement policy, top to bottom.

Space: learning rate, entropy bonus, SGD epochs per iteration, clip range, GAE lambda,
minibatch and network width. The task shape (pool, table counts, devices, tables placed per
iteration) is the user's and is not swept. Each trial trains PPO on the estimated MDP and,
after every iteration, reports the simulated cost of greedy decoding on validation tasks
over their lower bound (the same tasks for every trial); ASHA stops the trials
that trail. Each report carries a checkpoint (RLlib's state and the policy file), so a failed
or resumed trial goes on from it. The best trial's configuration is saved for
`policy train --config`, and its policy as OUT/best_policy.pt for `plan --policy`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shard_ray.configfile import dataclass_from
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.policy.settings import PolicyConfig
from shard_ray.tuning.settings import POLICY_SWEPT, PolicySweepConfig
from shard_ray.tuning.sweep import ScoredWith, SweepConfig, describe_settings, ranked_trials, run_sweep, save_best
from shard_ray.workload.tables import TableSpec

METRIC = "validation_over_bound"


def search_space(base: PolicyConfig) -> dict[str, Any]:
    from ray import tune

    minibatches = [m for m in (64, 128, 256, 512) if m <= base.train_batch_size] or [base.train_batch_size]
    return {
        "lr": tune.loguniform(1e-4, 3e-3),
        "entropy_coeff": tune.loguniform(1e-4, 1e-2),
        "num_epochs": tune.randint(3, 16),
        "clip_param": tune.uniform(0.1, 0.3),
        "lambda_": tune.uniform(0.9, 1.0),
        "minibatch_size": tune.choice(minibatches),
        "hidden": tune.choice([64, 128, 256]),
    }


def policy_config_from(trial: dict[str, Any], base: PolicyConfig) -> PolicyConfig:
    return dataclass_from(PolicyConfig, {**asdict(base), **{k: trial[k] for k in POLICY_SWEPT}}, "policy trial")


def policy_trial(
    trial: dict[str, Any], pool: list[TableSpec], base: PolicyConfig, models_bytes: bytes, settings: PolicySweepConfig
) -> None:
    """One Tune trial: PPO for `base.iterations`, validated and checkpointed after every iteration."""
    from ray import tune

    from shard_ray.policy.network import save_policy
    from shard_ray.policy.policy_file import PolicyInfo
    from shard_ray.policy.ppo import (
        build_algorithm,
        held_out_tasks,
        policy_network,
        restore_checkpoint,
        save_checkpoint,
        validation_score,
    )

    # Ray's "Checkpoint successfully created at ..." after every iteration, in the trial's process, reached the
    # sweep's output through Ray beside its one line a trial
    logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)
    config = policy_config_from(trial, base)
    models = CostModels.from_bytes(models_bytes)
    tasks = held_out_tasks(pool, config, settings.validation_tasks, config.seed + 1)
    scratch = Path(tempfile.mkdtemp(prefix="shard-ray-policy-trial-"))
    (scratch / "costmodels.pt").write_bytes(models_bytes)  # env runners read the models' bytes from here
    algo = build_algorithm(config, pool, str(scratch / "costmodels.pt"))
    try:
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                restore_checkpoint(algo, Path(folder) / "checkpoint")
        while algo.iteration < config.iterations:
            result = algo.train()
            network = policy_network(algo)
            score, stuck = validation_score(network, tasks, models)
            with tempfile.TemporaryDirectory() as folder:
                save_checkpoint(algo, Path(folder) / "checkpoint")
                save_policy(
                    Path(folder) / "policy.pt",
                    network,
                    PolicyInfo(config=asdict(config), iterations=algo.iteration, hardware=models.hardware),
                )
                tune.report(
                    {
                        METRIC: score,
                        "greedy_stuck": stuck,
                        "episode_return": float(result["env_runners"]["episode_return_mean"]),
                    },
                    checkpoint=tune.Checkpoint.from_directory(folder),
                )
    finally:
        algo.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def scored_with(
    pool: list[TableSpec], base: PolicyConfig, settings: PolicySweepConfig, cost_model: str | None
) -> ScoredWith:
    """What the policy sweep's trials are scored with: training's settings but those drawn, the sweep's, the pool and
    the models pricing the tasks."""
    from shard_ray.workload.tables import task_digest

    values = {k: v for k, v in asdict(base).items() if k not in POLICY_SWEPT} | asdict(settings)
    values |= {"tables": task_digest(pool), "cost_model": str(cost_model or default_cost_model_path())}
    return ScoredWith.of(
        values, PolicyConfig, PolicySweepConfig, tables="the pool (--tables) of digest", cost_model="--cost-model"
    )


def tune_policy(
    pool: list[TableSpec],
    base: PolicyConfig,
    sweep: SweepConfig,
    settings: PolicySweepConfig,
    out_dir: str | Path,
    tracking_uri: str | None,
    experiment: str,
    cost_model: str | None = None,
) -> Path:
    """Sweep, then write OUT/best.json (tuned PolicyConfig), OUT/best_policy.pt and OUT/trials.csv."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    settings.check()
    base.check()
    model_path = Path(cost_model) if cost_model else default_cost_model_path()
    models = CostModels.load(model_path)
    scheduler = ASHAScheduler(
        time_attr="training_iteration",
        max_t=base.iterations,
        grace_period=min(settings.grace_iterations, base.iterations),
        reduction_factor=3,
    )
    results = run_sweep(
        "policy",
        tune.with_parameters(
            policy_trial, pool=pool, base=base, models_bytes=model_path.read_bytes(), settings=settings
        ),
        search_space(base),
        METRIC,
        "min",
        sweep,
        out_dir,
        tracking_uri,
        experiment,
        {"hardware": models.hardware},
        scored_with(pool, base, settings, cost_model),
        scheduler,
    )
    finished = ranked_trials(results, METRIC, out_dir)
    print(f"{'trial':<20} {'validation':>10} {'stuck':>6} {'iterations':>10}  settings")
    for r in finished[:5]:
        print(
            f"{r.metrics['trial_id']:<20} {r.metrics[METRIC]:>10.4f} {r.metrics['greedy_stuck']:>6} "
            f"{r.metrics['training_iteration']:>10}  " + describe_settings(r.config, POLICY_SWEPT)
        )
    best = finished[0]
    if best.checkpoint is not None:
        with best.checkpoint.as_directory() as folder:
            shutil.copyfile(Path(folder) / "policy.pt", Path(out_dir) / "best_policy.pt")
    notes = {
        "hardware": models.hardware,
        "greedy_stuck": best.metrics["greedy_stuck"],
        "iterations": best.metrics["training_iteration"],
    }
    config = {k: v for k, v in asdict(policy_config_from(best.config, base)).items() if k in POLICY_SWEPT}
    return save_best("policy", config, METRIC, "min", best.metrics[METRIC], results, out_dir, notes)
