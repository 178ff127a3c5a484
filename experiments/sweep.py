"""A Ray Tune sweep from a YAML config (`shard-ray tune <kind>`), locally or as a Ray job.

    python experiments/sweep.py --config experiments/configs/sweep_search.yaml
    ray job submit --working-dir . -- python experiments/sweep.py --config experiments/configs/sweep_search.yaml

The config's `kind` (costmodel, search or policy) picks the sweep; its other keys are the flags
of `shard-ray tune <kind>`. Flags after `--config` override the file's.
"""

from __future__ import annotations

import sys

from shard_ray.cli import main as shard_ray
from shard_ray.configfile import expand_config
from shard_ray.errors import ShardRayError

KINDS = ("costmodel", "search", "policy")


def main(argv: list[str]) -> int:
    try:
        flags = expand_config(argv)
    except ShardRayError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "--kind" not in flags[:-1] or flags[flags.index("--kind") + 1] not in KINDS:
        print(f"error: give the sweep's kind ({', '.join(KINDS)}) as `kind:` in the config or --kind", file=sys.stderr)
        return 2
    at = flags.index("--kind")
    kind = flags[at + 1]
    return shard_ray(["tune", kind, *flags[:at], *flags[at + 2 :]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
