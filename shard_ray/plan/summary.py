"""A per-device table of a plan, in the spirit of TorchRec's planner stats."""

from __future__ import annotations

from collections.abc import Sequence

from shard_ray.plan.cost import PlanCost
from shard_ray.plan.plan import Plan, PlanEstimate
from shard_ray.plan.topology import GB, Topology
from shard_ray.workload.tables import TableSpec

# Printed once under the table: what the cost columns are.
LEGEND = (
    "input: all-to-all of the batch's lookups to their devices; "
    "fwd/bwd ms: the fused embedding kernel, forward / backward with the optimizer update; "
    "fwd/bwd a2a: all-to-all of pooled embeddings (and data-parallel gradients' all-reduce, table-row-wise sums inside a host); total: their sum"
)
# A plan further above the lower bound than this (as a share of it) is said not to be judged by the gap: on many
# devices the bound is loose (the policy's and cost_search's plans of 64 devices sit 2-4x above it, docs/results.md).
LOOSE_BOUND = 1.0
# Consecutive devices whose rows are alike, this many or more, are printed as one row (`_runs_alike`).
ALIKE_RUN = 3
# Where the costs come from, by `cost_label`.
SOURCES = {"measured": "timed on the device gang", "simulated": "priced by the cost models"}


def format_plan_summary(
    plan: Plan,
    tables: list[TableSpec],
    topology: Topology,
    cost: PlanCost | None = None,
    cost_label: str = "measured",
    lower_bound_ms: float | None = None,
) -> str:
    """The per-device table; with `cost`, each device's five parts, the plan cost and the legend.

    `lower_bound_ms`, the task's lower bound on the simulated cost, is printed under it when given.
    """
    memory = plan.device_memory_bytes(tables, topology)
    hosts, links = "", ""
    if topology.num_hosts > 1:  # and the rates that price the traffic between them, given or chosen
        hosts = f" on {topology.num_hosts} hosts of {topology.devices_per_host_or_all}"
        links = f"; between hosts {topology.inter_host_gbps:g} GB/s a device"
        links += f", one link of {topology.host_link_gbps:g} GB/s a host" if topology.host_link_gbps else ""
    costs = {d.device: d for d in cost.devices} if cost is not None else {}
    rows, empty = [], 0  # each device's row but its index; the devices holding nothing
    for device in range(plan.num_devices):
        shards = plan.shards_on(device)
        empty += not shards
        row = (
            f" {len(shards):>6} {sum(s.width for s in shards):>8} "
            f"{memory[device] / GB:>10.3f} {100 * memory[device] / topology.memory_bytes:>5.1f}%"
        )
        if device in costs:
            d = costs[device]
            marker = " <- slowest" if device == cost.bottleneck_device else ""
            row += (
                f" {d.input_dist_ms:>8.3f} {d.fwd_compute_ms:>8.3f} {d.fwd_comm_ms:>8.3f} {d.bwd_comm_ms:>8.3f}"
                f" {d.bwd_compute_ms:>8.3f} {d.total_ms:>9.3f}{marker}"
            )
        rows.append(row)
    runs = _runs_alike(rows)
    width = max(6, *(len(label) for label, _ in runs))
    header = f"{'device':>{width}} {'shards':>6} {'dim sum':>8} {'memory GiB':>10} {'mem %':>6}"
    if cost is not None:
        header += f" {'input':>8} {'fwd ms':>8} {'fwd a2a':>8} {'bwd a2a':>8} {'bwd ms':>8} {'total ms':>9}"
    lines = [
        f"plan '{plan.algorithm}' on {plan.num_devices} device{'s' if plan.num_devices != 1 else ''}{hosts} "
        f"({topology.memory_gb:.2f} GiB each, batch {topology.batch_size}, {topology.optimizer}{links})",
        header,
        *(f"{label:>{width}}{row}" for label, row in runs),
    ]
    if len(runs) < len(rows):
        lines.append("(a row of devices first-last: each of them alike)")
    if empty:  # a few tables on many devices split no further than their splits go
        lines.append(f"{empty} of {plan.num_devices} devices hold no shard: they take part in the all-to-alls only")
    if cost is not None:
        source = f", {SOURCES[cost_label]}" if cost_label in SOURCES else ""
        if cost.priced_parts:  # not all of it was timed: say which
            source = ", compute timed on the device gang, all-to-alls priced by the comm model"
        lines.append(f"{cost_label} plan cost: {cost.cost_ms:.3f} ms (slowest device's step{source})")
        if cost.priced_parts:
            lines.append(priced_note(cost))
        if cost.hosts is not None and len(set(cost.hosts)) > 1:
            lines.append(gang_layout(cost.hosts))
        if lower_bound_ms is not None:
            above = cost.cost_ms / lower_bound_ms - 1 if lower_bound_ms > 0 else None
            if above is not None and -1e-6 < above < 0:  # at the bound (one device), priced a float32 rounding below
                above = 0.0
            gap = "" if above is None else f"; this plan is {above:.1%} above it"
            if above is not None and above > LOOSE_BOUND:  # most plans of many devices sit 2-4x above it
                gap += ": a bound, not a target (a plan far above it need not be a poor one: compare plans with each other)"
            lines.append(
                f"lower bound on the simulated cost: {lower_bound_ms:.3f} ms (no placement of these tables "
                f"simulates below it{gap})"
            )
        lines.append(LEGEND)
    return "\n".join(lines)


def _runs_alike(rows: list[str]) -> list[tuple[str, str]]:
    """Devices' rows as (label, row): a run of `ALIKE_RUN` or more consecutive devices whose rows are alike (empty
    devices of a plan of few tables, a row-wise table's blocks) as one, labelled `first-last`; 4,096 devices printed
    4,096 rows."""
    runs: list[tuple[str, str]] = []
    start = 0
    for end in range(1, len(rows) + 1):
        if end < len(rows) and rows[end] == rows[start]:
            continue
        if end - start >= ALIKE_RUN:
            runs.append((f"{start}-{end - 1}", rows[start]))
        else:
            runs += [(str(k), rows[k]) for k in range(start, end)]
        start = end
    return runs


def gang_layout(hosts: list[int]) -> str:
    """Which devices shared a Ray node in a measurement, from each device's host index."""
    layout = ", ".join(f"host {h}: devices {[d for d, x in enumerate(hosts) if x == h]}" for h in sorted(set(hosts)))
    return f"the gang spanned {len(set(hosts))} Ray nodes ({layout})"


# The summary's column names of the step parts.
PART_COLUMNS = {
    "input_dist_ms": "input",
    "fwd_compute_ms": "fwd ms",
    "fwd_comm_ms": "fwd a2a",
    "bwd_comm_ms": "bwd a2a",
    "bwd_compute_ms": "bwd ms",
}


def priced_note(cost: PlanCost) -> str:
    """Which parts of a measured cost were priced by the comm model rather than measured, and why."""
    priced = ", ".join(PART_COLUMNS[p] for p in cost.priced_parts)
    measured = ", ".join(column for part, column in PART_COLUMNS.items() if part not in cost.priced_parts)
    return (
        f"measured: {measured}; priced by the comm model {cost.priced_by}: {priced} (more devices than cores on a "
        "machine: all-to-alls there would measure the contention for cores, not the plan)"
    )


def format_prediction(estimate: PlanEstimate, measured_ms: float, priced_parts: Sequence[str] = ()) -> str:
    """The models' price of a plan beside its measured cost, and their ratio, in one line; with the parts of the
    measured cost the comm model priced (`priced_parts`), said, since those parts are the models' on both sides."""
    predicted = estimate.predicted.cost_ms
    line = (
        f"predicted {predicted:.3f} ms by the cost models, measured {measured_ms:.3f} ms: "
        f"measured / predicted = {measured_ms / predicted:.2f}"
    )
    if priced_parts:
        named = ", ".join(PART_COLUMNS[part] for part in priced_parts)
        line += f" ({named} priced by the comm model on both sides: the ratio does not judge their prices)"
    return line


def device_ranges(devices: list[int]) -> str:
    """Sorted devices [0, 1, 2, 5] as '0-2,5'."""
    parts, start = [], None
    for i, d in enumerate(devices):
        if start is None:
            start = d
        if i + 1 == len(devices) or devices[i + 1] != d + 1:
            parts.append(f"{start}" if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)
