"""The commands and their one-line help, known without importing the heavy modules behind them."""

from __future__ import annotations

import argparse
from typing import NamedTuple


class Command(NamedTuple):
    group: str  # the module of shard_ray.cli with its parser and handler
    help: str


COMMANDS: dict[str, Command] = {
    "generate": Command("workload", "write a synthetic DLRM-like table pool, or derive one from a dlrm_datasets file"),
    "tasks": Command("workload", "split a pool into train/test pools and draw task table files from each"),
    "algorithms": Command("planning", "list the placement algorithms"),
    "plan": Command("planning", "place a table file's tables on devices and write a plan"),
    "export": Command("planning", "write a plan as a TorchRec ShardingPlan for DistributedModelParallel"),
    "profile": Command("measure", "measure fused shards of a table file on Ray profiling actors"),
    "collect": Command("measure", "measure cost-model training data: random fused shards (compute) or plans (comm)"),
    "evaluate": Command("measure", "run a plan's real embedding step on a gang of Ray actors"),
    "compare": Command(
        "measure", "measure plans side by side on the gang and say which is faster, with intervals that hold"
    ),
    "costmodel": Command("costmodel", "train or evaluate the neural cost models"),
    "models": Command(
        "costmodel", "list the cost models this machine has: hardware, what they were calibrated on, held-out error"
    ),
    "calibrate": Command(
        "costmodel", "measure a task on this cluster and fit the cost models to this hardware, in minutes"
    ),
    "policy": Command("policy", "train DreamShard placement policies with RLlib"),
    "tune": Command("tune", "Ray Tune sweeps of the cost-model, search and PPO hyperparameters; resumable"),
    "bench": Command(
        "bench", "the benchmark report: every algorithm on test tasks and table files, every plan measured"
    ),
    "doctor": Command(
        "doctor", "what this machine and the Ray cluster offer shard-ray (GPUs, torch, fbgemm, NCCL, MLflow, models)"
    ),
    "hosts": Command(
        "hosts", "emulate hosts on this machine: network namespaces, links of a set rate, a Ray node each"
    ),
    "demo": Command("bench", "the main job end to end: pool, task, profiling, every algorithm, measured plans, MLflow"),
}

# Commands a user may look for that are another command's work: said where `shard-ray NAME` is refused.
FOUND_ELSEWHERE = {
    "refine": "refinement is `shard-ray plan --measure --refine`",
    "measure": "plans are measured by `shard-ray evaluate` (one), `compare` (side by side) or `plan --measure`",
    "train": "`shard-ray costmodel train` trains the cost models, `shard-ray policy train` a placement policy",
    "sweep": "sweeps are `shard-ray tune costmodel`, `tune search` and `tune policy`",
}


def add_command(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=COMMANDS[name].help)
