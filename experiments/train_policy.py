"""Train the DreamShard placement policy (`shard-ray policy train`) from a YAML config, locally or as a Ray job.

    python experiments/train_policy.py --config experiments/configs/train_policy.yaml
    ray job submit --working-dir . -- python experiments/train_policy.py --config experiments/configs/train_policy.yaml

The config's keys are the flags of `shard-ray policy train`; flags after `--config` override them.
"""

from __future__ import annotations

import sys

from shard_ray.cli import config_command, run_experiment

commands = config_command(["policy", "train"])

if __name__ == "__main__":
    sys.exit(run_experiment(commands, sys.argv[1:]))
