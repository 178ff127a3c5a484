"""`bench` and `demo`: every algorithm planned and measured side by side."""

from __future__ import annotations

import argparse
import json

from shard_ray.cli.commands import add_command
from shard_ray.cli.common import add_ray, add_tracking, connect, tracking
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.workflows.settings import BenchmarkConfig, DemoConfig


def cmd_bench(args: argparse.Namespace) -> None:
    from shard_ray.workload.tables import load_tables

    tracking_uri, experiment = tracking(args)
    config = settings_from(BenchmarkConfig, args, tracking_uri=tracking_uri, experiment=experiment)
    for path in config.table_files:  # refuse bad table files before torch loads and Ray starts
        load_tables(path)
    config.check()  # refuse bad settings, and a report folder of other settings, before Ray starts
    config.refuse_other_settings()
    connect(args, min_cpus=config.devices)
    from shard_ray.workflows.benchmark import headline, run_benchmark

    report = run_benchmark(config)
    print(f"wrote benchmark.md, .csv, .png and .json to {config.out}")
    print(json.dumps(headline(report)))


def cmd_demo(args: argparse.Namespace) -> None:
    from shard_ray.workflows.demo import run_demo

    tracking_uri, experiment = tracking(args)
    run_demo(settings_from(DemoConfig, args, tracking_uri=tracking_uri, experiment=experiment, address=args.address))


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "bench")
    add_settings(p, BenchmarkConfig)
    add_ray(p)
    add_tracking(p, "shard-ray-benchmark")
    p.set_defaults(run=cmd_bench)

    p = add_command(sub, "demo")
    add_settings(p, DemoConfig)
    add_ray(p)
    add_tracking(p)
    p.set_defaults(run=cmd_demo)
