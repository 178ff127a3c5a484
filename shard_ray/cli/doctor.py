"""`doctor`: what this machine and the Ray cluster offer shard-ray, and the fix for each problem found."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shard_ray.cli.commands import add_command
from shard_ray.cli.common import RayArgs, add_ray
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.errors import first_line

if TYPE_CHECKING:
    from shard_ray.doctor import Finding


@dataclass(frozen=True)
class DoctorArgs:
    tracking_uri: str | None = setting(
        None, "MLflow tracking URI to check (default: MLFLOW_TRACKING_URI, else ./mlflow.db)"
    )
    this_machine: bool = setting(
        False, "check only this machine's Python environment, without Ray (for a node's setup commands)"
    )


def cmd_doctor(args: argparse.Namespace) -> None:
    from shard_ray.doctor import (
        describe_node,
        format_findings,
        mlflow_finding,
        models_finding,
        node_findings,
        node_report,
        prices_finding,
    )
    from shard_ray.tracking.mlflow_runs import default_tracking_uri

    flags = settings_from(DoctorArgs, args)
    address = settings_from(RayArgs, args).address
    here = node_report()
    print(f"this machine, {describe_node(here)}")
    findings = node_findings(here)
    print("\n".join(format_findings(findings)))
    hardware = {here["hardware"]} - {None}
    if not flags.this_machine:
        summary, nodes, ray_findings = _cluster_findings(
            address, {here["machine"]} if "microbenchmark" in here else set()
        )
        print(f"Ray: {summary}")
        print("\n".join(format_findings(ray_findings)))
        findings += ray_findings
        for name, report in nodes:
            print(f"node {name}, {describe_node(report)}")
            found = node_findings(report)
            print("\n".join(format_findings(found)))
            findings += found
            hardware |= {report["hardware"]} - {None}
        general = [mlflow_finding(flags.tracking_uri or default_tracking_uri())]
        general += [models_finding(h) for h in sorted(hardware)]
        general += [f for f in (prices_finding(r) for r in [here, *(r for _, r in nodes)]) if f is not None]
        print("shard-ray's tracking and models:")
        print("\n".join(format_findings(general)))
        findings += general
    problems = [f for f in findings if f.level == "problem"]
    if problems:
        count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
        print(f"{count} found: " + "; ".join(f.what for f in problems))
        raise SystemExit(1)
    print("no problems found")


def _cluster_findings(
    address: str | None, timed_machines: set[str]
) -> tuple[str, list[tuple[str, dict]], list[Finding]]:
    """The cluster's summary, its nodes' reports (the microbenchmark timed on none of `timed_machines`) and findings
    on Ray itself and its noise floor. With no cluster named, a local Ray is started and runs a task (its one node is
    this machine, reported already)."""
    import ray

    from shard_ray.doctor import Finding, cluster_reports, noise_finding, task_pid
    from shard_ray.errors import ShardRayError
    from shard_ray.runtime import connect_ray, stop_local_ray

    try:
        connected = connect_ray(address)
    except Exception as err:  # noqa: BLE001  any failure to join is what doctor reports
        fix = (
            ""  # shard-ray's own refusals say what to do (start the head, the address to give, RAY_AUTH_MODE)
            if isinstance(err, ShardRayError)
            else "start the cluster (`ray start --head` on its head node) or give its address: --address HOST:PORT, "
            "or leave --address and RAY_ADDRESS out to check a local Ray"
        )
        return "cannot connect", [], [Finding("Ray", "problem", first_line(err), fix)]
    try:
        if connected.startswith("ray: started"):
            ray.get(ray.remote(num_cpus=0)(task_pid).remote(), timeout=120)
            summary, nodes = "a local instance on this machine", []
            found = Finding("Ray", "ok", "a local Ray starts and runs tasks")
        else:
            summary, nodes = cluster_reports(timed_machines)
            found = Finding("Ray", "ok", connected.removeprefix("ray: "))
        return summary, nodes, [found, noise_finding()]
    finally:
        stop_local_ray()


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "doctor")
    add_settings(p, DoctorArgs)
    add_ray(p)
    p.set_defaults(run=cmd_doctor, output_is_the_work=True)
