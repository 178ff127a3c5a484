"""Pre-train the cost models on this cluster's hardware, from a YAML config, locally or as a Ray job.

    python experiments/pretrain_costmodels.py --config experiments/configs/pretrain_costmodels.yaml
    ray job submit --working-dir . -- python experiments/pretrain_costmodels.py --config experiments/configs/pretrain_costmodels.yaml

The steps are the CLI's: `generate` the pool, split it into train/test `tasks`, `collect` compute
data (random fused shards on the profiling actors) and comm data (plans on device gangs),
`costmodel train`, `costmodel evaluate`. Each of the config's sections (`generate`, `tasks`,
`collect_compute`, `collect_comm`, `train`, `evaluate`) holds flags of its step; `out` is the
folder everything goes to, or `--out DIR` after the config (give an absolute path on storage
the head keeps for a Ray job, whose working directory is a temporary copy of the repository). A step whose output exists is skipped and the collection
steps resume from the store, so the experiment started again goes on where it stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shard_ray.cli import run_experiment
from shard_ray.configfile import config_to_argv, read_config
from shard_ray.errors import ShardRayError

SECTIONS = ("generate", "tasks", "collect_compute", "collect_comm", "train", "evaluate")
USAGE = "usage: pretrain_costmodels.py --config FILE [--out DIR]"


def out_folder(argv: list[str]) -> Path:
    """Where everything goes: `--out DIR` after the config, else its `out`."""
    return Path(argv[3] if len(argv) == 4 else read_config(argv[1]).get("out", "shard-ray-out/pretrain"))


def commands(argv: list[str]) -> list[list[str]]:
    """The steps' `shard-ray` command lines, less those whose output exists already."""
    flags = section_flags(argv)
    out = out_folder(argv)
    out.mkdir(parents=True, exist_ok=True)  # the steps write their files into it, as `--out FILE` needs
    steps = pipeline(out, flags)
    for output, command in steps:
        if output is not None and output.exists():
            print(f"== shard-ray {command[0]}: {output} exists, skipped", flush=True)
    return [command for output, command in steps if output is None or not output.exists()]


def section_flags(argv: list[str]) -> dict[str, list[str]]:
    """Each section of the config as the flags of its step; a bad command line or section is refused."""
    # `--out DIR` after the config overrides its `out`, as flags after `--config` do for the other entrypoints
    if len(argv) not in (2, 4) or argv[0] != "--config" or (len(argv) == 4 and argv[2] != "--out"):
        raise ShardRayError(USAGE)
    config = read_config(argv[1])
    unknown = sorted(set(config) - {"out", *SECTIONS})
    if unknown:
        raise ShardRayError(f"unknown section(s) {', '.join(unknown)}; known: out, {', '.join(SECTIONS)}")
    return {name: config_to_argv(config.get(name) or {}, name) for name in SECTIONS}


def pipeline(out: Path, flags: dict[str, list[str]]) -> list[tuple[Path | None, list[str]]]:
    """(the output that says a step is done, or None for a step that resumes itself; its command line), in order."""
    pool, tasks, store, models = out / "pool.json", out / "tasks", out / "measurements.db", out / "costmodels.pt"
    train_pool = str(tasks / "train_pool.json")
    return [
        (pool, ["generate", "--out", str(pool), *flags["generate"]]),
        (tasks / "train_pool.json", ["tasks", "--tables", str(pool), "--out", str(tasks), *flags["tasks"]]),
        (None, ["collect", "--kind", "compute", "--tables", train_pool, "--store", str(store), *flags["collect_compute"]]),
        (None, ["collect", "--kind", "comm", "--tables", train_pool, "--store", str(store), *flags["collect_comm"]]),
        (models, ["costmodel", "train", "--store", str(store), "--tables", train_pool, "--out", str(models), *flags["train"]]),
        (None, ["costmodel", "evaluate", "--cost-model", str(models), "--store", str(store), *flags["evaluate"]]),
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    code = run_experiment(commands, argv)
    if code == 0:
        models = out_folder(argv) / "costmodels.pt"
        print(f"cost models: {models} (plan with: shard-ray plan --cost-model {models} ...)")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
