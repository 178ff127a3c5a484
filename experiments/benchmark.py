"""The benchmark report (`shard-ray bench`) from a YAML config, locally or as a Ray job.

    python experiments/benchmark.py --config experiments/configs/benchmark.yaml
    ray job submit --working-dir . -- python experiments/benchmark.py --config experiments/configs/benchmark.yaml --out /srv/runs/benchmark

Every algorithm (the heuristics, torchrec, neuroshard, cost_search, optimal where it handles
the task, dreamshard) plans held-out test tasks and any table files given (`tables:` in the
config, a list), and every plan is measured on the device gang. The config's keys are the flags
of `shard-ray bench`; flags after `--config` override them. The last printed line is JSON.
"""

from __future__ import annotations

import sys

from shard_ray.cli import config_command, run_experiment

commands = config_command(["bench"])

if __name__ == "__main__":
    sys.exit(run_experiment(commands, sys.argv[1:]))
