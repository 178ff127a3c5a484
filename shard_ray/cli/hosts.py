"""`hosts up`, `hosts run`, `hosts down`, `hosts list`: hosts emulated on this machine (`shard_ray.hosts`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass

from shard_ray.arguments import Parser
from shard_ray.cli.commands import add_command
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting

DEFAULT_NAME = "emulated"


@dataclass(frozen=True)
class HostsUpArgs:
    hosts: int = setting(2, "hosts: network namespaces with a Ray node each", min=1)
    devices_per_host: int = setting(1, "devices per host (its Ray node's CPUs)", min=1)
    rate: str = setting("1gbit", "each host's link rate, each way, in kbit, mbit or gbit (200mbit, 1gbit)")
    name: str = setting(DEFAULT_NAME, "the cluster's name (its namespaces are srh-NAME-*)")


def cmd_up(args: argparse.Namespace) -> None:
    from shard_ray.hosts import bring_up, steady

    flags = settings_from(HostsUpArgs, args)
    state = bring_up(flags.name, flags.hosts, flags.devices_per_host, flags.rate, progress=_progress)
    print(f"up: {state.describe()}")
    if state.link_rates and not steady(state.link_rates):
        print("warning: the two measurements of the link differ by more than 10%: timings over it are not steady")
    if state.link_rates:
        mbit = min(r.mbit_per_s for r in state.link_rates)
        # a host's devices share its one link: `--host-link-gbps` prices that (docs/clusters.md)
        gbps = f"{mbit / 8e3:.4g}"
        print(
            f"the links achieve {mbit / (state.rate_bits / 1e6):.0%} of the rate set; price plans for these hosts at "
            f"the measured rate: --devices-per-host {state.devices_per_host} --inter-host-gbps {gbps} "
            f"--host-link-gbps {gbps}"
        )
    name = "" if state.name == DEFAULT_NAME else f" {state.name}"
    print(
        f"run commands on it: shard-ray hosts run{name} -- shard-ray evaluate ...; take it down: shard-ray hosts down{name}"
    )


def cmd_run(args: argparse.Namespace) -> None:
    from shard_ray.errors import ShardRayError
    from shard_ray.hosts import command_in_head, load

    name, command = split_run_words(list(args.words))
    if not command:
        raise ShardRayError("give the command to run after --, for example: shard-ray hosts run -- shard-ray doctor")
    argv, env = command_in_head(load(name), command)
    sys.stdout.flush()
    raise SystemExit(subprocess.run(argv, env=env).returncode)


def split_run_words(words: list[str]) -> tuple[str, list[str]]:
    """`[NAME] -- COMMAND...` -> (the cluster's name, the command): the name is the one word before `--`, if any."""
    from shard_ray.errors import ShardRayError

    if "--" not in words:
        return (words[0] if words else DEFAULT_NAME), []
    cut = words.index("--")
    before, command = words[:cut], words[cut + 1 :]
    if len(before) > 1:
        raise ShardRayError(f"one cluster name before --, got {' '.join(before)}")
    return (before[0] if before else DEFAULT_NAME), command


def cmd_down(args: argparse.Namespace) -> None:
    from shard_ray.hosts import check_down, load, tear_down

    state = load(args.name)
    check_down(state)
    tear_down(state)
    print(
        f"down: {state.name} ({state.hosts} host{'s' if state.hosts > 1 else ''}): its Ray nodes stopped, namespaces and links deleted"
    )


def cmd_list(args: argparse.Namespace) -> None:
    from shard_ray.hosts import bringing_up, hosts_dir, listed

    clusters = listed()
    print(f"{len(clusters)} emulated cluster(s) up (state in {hosts_dir()})")
    for state in clusters:
        pid = bringing_up(state)
        print(f"  {state.describe()}" + (f" (coming up: `shard-ray hosts up`, pid {pid})" if pid is not None else ""))


def _progress(line: str) -> None:
    print(line, flush=True)


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "hosts")
    commands = p.add_subparsers(dest="hosts_command", required=True, parser_class=Parser)
    q = commands.add_parser("up", help="bring up hosts emulated on this machine, joined by links of a set rate")
    add_settings(q, HostsUpArgs)
    q.set_defaults(run=cmd_up)
    q = commands.add_parser("run", help="run a command in host 0, joined to the emulated cluster (RAY_ADDRESS)")
    q.add_argument(
        "words", nargs=argparse.REMAINDER, metavar="[NAME] -- COMMAND", help=f"the cluster (default {DEFAULT_NAME})"
    )
    q.set_defaults(run=cmd_run)
    q = commands.add_parser("down", help="stop an emulated cluster's Ray nodes and delete its namespaces and links")
    q.add_argument("name", nargs="?", default=DEFAULT_NAME, help=f"the cluster (default {DEFAULT_NAME})")
    q.set_defaults(run=cmd_down)
    q = commands.add_parser("list", help="the emulated clusters up on this machine")
    q.set_defaults(run=cmd_list, output_is_the_work=True)
