"""A Ray Tune sweep from a YAML config (`shard-ray tune <kind>`), locally or as a Ray job.

    python experiments/sweep.py --config experiments/configs/sweep_search.yaml
    ray job submit --working-dir . -- python experiments/sweep.py --config experiments/configs/sweep_search.yaml

The config's `kind` (costmodel, search or policy) picks the sweep; its other keys are the flags
of `shard-ray tune <kind>`. Flags after `--config` override the file's.
"""

from __future__ import annotations

import sys

from shard_ray.cli import run_experiment
from shard_ray.configfile import expand_config
from shard_ray.errors import ShardRayError

KINDS = ("costmodel", "search", "policy")


def commands(argv: list[str]) -> list[list[str]]:
    """`shard-ray tune <kind>` with the config's other keys as its flags."""
    flags = expand_config(argv)
    if "--kind" not in flags[:-1] or flags[flags.index("--kind") + 1] not in KINDS:
        raise ShardRayError(f"give the sweep's kind ({', '.join(KINDS)}) as `kind:` in the config or --kind")
    at = flags.index("--kind")
    return [["tune", flags[at + 1], *flags[:at], *flags[at + 2 :]]]


if __name__ == "__main__":
    sys.exit(run_experiment(commands, sys.argv[1:]))
