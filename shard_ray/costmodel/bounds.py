"""A lower bound on the simulated cost of any plan of a task.

Compute: the slowest device carries at least a 1/D share of what the devices' fused costs add
up to, and the step's overhead of a device that holds pieces (`CostModels.least_compute`); the
compute model bounds that sum from its form alone, whatever fusion it learned
(`ComputeCostNet.least_total`: own costs add, the concave term over the devices adds up to at
least its value at the sum of all tables, the convex term to at least D times its value at the
mean). Each table counts at the least its sharding types can encode it as (`least_encodings`),
and every term is monotone, so this holds for every plan. In a table-wise plan the slowest device
also carries at least the costliest single piece. Input all-to-alls are left out: they only add.

Communication: the slowest device's all-to-alls cost at least the cheapest any device of any plan
of the task is priced on one host as plans are (`Pricer.one_host_comm`: the comm model, never below
the links' price, past the gangs it measured the links' price scaled; the links alone without one),
the minimum over a grid of the device's own width and the widest device's width, up to the grid's
resolution (`least_all_to_all_ms`). Over hosts, at least the least it prices beyond the links'
price on one host, plus the links' fixed time and latency per peer. Data-parallel replicas take
their columns off the all-to-all and pay the gradients' all-reduce instead: the bound is the least
over how wide the replicated tables are, in steps, of the all-to-all of the rest and the all-reduce
of the tables cheapest to replicate (`least_all_reduce_ms`); a plan replicating every table pays
no all-to-all. And the bound is never below the bytes every plan sends between hosts
(`across_hosts_ms`), which the slowest device's step holds whatever its compute.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shard_ray.costmodel.features import spans_features
from shard_ray.costmodel.models import CostModels
from shard_ray.costmodel.pricing import (
    Pricer,
    added_up,
    analytic_devices_per_host,
    gradient_mb,
    input_width,
    receiving_ms,
    ring_bus_mb,
    sync_width,
)
from shard_ray.plan.enumerator import pieces_to_place
from shard_ray.plan.piece import TablePiece, replica, row_block
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec


class LowerBound(NamedTuple):
    """A task's lower bound on the simulated cost of its plans (`ms`), in its parts: the least compute and the least
    collectives the slowest device carries, and the least the links between hosts take it."""

    compute: float
    comm: float
    across_hosts: float = 0.0

    @property
    def ms(self) -> float:
        return max(self.compute + self.comm, self.across_hosts)


def lower_bound(
    models: CostModels, tables: list[TableSpec], topology: Topology, column_wise: bool = True
) -> LowerBound:
    """The bound over every plan the searches can make (`column_wise`: any sharding type per table), or
    over table-wise placements of `pieces_to_place`'s pieces (the RL environment's plans)."""
    d = topology.num_devices
    if column_wise:
        least = least_encodings(models, tables, topology)
        compute = models.least_compute(least.sum(axis=0), d)
    else:
        pieces = pieces_to_place(tables, topology)
        encodings = models.encode_tables(pieces, topology.batch_size)
        single = models.compute_from_sums(encodings, np.ones(len(pieces), dtype=np.float32)).sum(axis=1)
        compute = max(models.least_compute(encodings.sum(axis=0), d), float(single.max()))
    if d == 1:
        return LowerBound(compute, 0.0)
    total = float(sum(t.dim for t in tables))
    pricer = Pricer(models, topology)
    comm = float(least_all_to_all_ms(pricer, np.array([total]))[0])
    if column_wise:  # replicas' columns leave the all-to-all; they pay an all-reduce instead
        comm = least_with_replicas_ms(pricer, tables, comm)
    return LowerBound(compute, comm, across_hosts_ms(models, tables, topology))


def lower_bound_ms(models: CostModels, tables: list[TableSpec], topology: Topology, column_wise: bool = True) -> float:
    """`lower_bound`'s ms."""
    return lower_bound(models, tables, topology, column_wise).ms


# At most this many steps of the tables' width that data-parallel replicas take off the all-to-all
# (`least_with_replicas_ms`); where the tables' widths are multiples of fewer steps, every width a plan can replicate.
REPLICATED_STEPS = 32


def least_with_replicas_ms(pricer: Pricer, tables: list[TableSpec], without: float) -> float:
    """The least the slowest device's all-to-alls and all-reduce cost together in any plan, `without` replicas
    (`least_all_to_all_ms` of every column) or replicating some tables: the replicated width W is a multiple of the
    tables' widths' greatest common divisor g, and a plan replicating between two steps (W_j + g to W_(j+1)) pays
    at least the all-to-all of the width left at W_(j+1) and the all-reduce of W_j + g (`least_all_reduce_ms`):
    exact where the steps are g. Only steps whose all-reduce alone costs less than `without` are priced further, and
    none where an all-reduce of no bytes costs as much."""
    nothing = np.zeros((1, pricer.topology.num_devices))  # an all-reduce's own price, of no bytes, every one pays
    if pricer.all_reduce(nothing, nothing, holds=np.ones_like(nothing, dtype=bool)).min() >= without:
        return without
    dims = [t.dim for t in tables]
    g, total = math.gcd(*dims), sum(dims)
    step = g * math.ceil(total / g / REPLICATED_STEPS)
    replicated = np.minimum(np.arange(0, total + step, step), total).astype(np.float64)
    all_reduce = least_all_reduce_ms(pricer, tables, np.minimum(replicated[:-1] + g, replicated[1:]))
    cheaper = all_reduce < without
    if not cheaper.any():
        return without
    all_to_all = least_all_to_all_ms(pricer, total - replicated[1:][cheaper])
    return min(without, float((all_to_all + all_reduce[cheaper]).min()))


def least_all_to_all_ms(pricer: Pricer, kept: np.ndarray) -> np.ndarray:
    """[n] the least the slowest device's all-to-alls (forward and backward) cost in plans whose all-to-alls move
    `kept` [n] columns in all (0 ms for none): the cheapest the comm model predicts for any device (the minimum over
    a grid of the device's own width and the widest device's width), up to the grid's resolution. Over hosts, the
    least it predicts beyond the links' price on one host, plus the links' fixed time and latency per peer."""
    models, topology = pricer.models, pricer.topology
    d = topology.num_devices
    own, widest, totals, starts = [], [], [], []
    for width in kept:  # each width's feasible grid points, one after another
        own_grid, widest_grid = np.meshgrid(np.linspace(0.0, width, 65), np.linspace(width / d, width, 33))
        feasible = own_grid <= widest_grid
        starts.append(sum(len(o) for o in own))
        own.append(own_grid[feasible])
        widest.append(widest_grid[feasible])
        totals.append(np.full(len(own[-1]), width))
    own_rows, widest_rows, total_rows = np.concatenate(own), np.concatenate(widest), np.concatenate(totals)
    # As plans are priced on one host (`Pricer.one_host_comm`): never below the links' price, and past the gangs the
    # comm model measured, the links' price scaled by what it learned there. Its bare prediction extrapolates to
    # nearly nothing: `cost_search`'s MLPerf plan on 8 devices, priced 21.2 ms, 12.5-13.7 of it every device's
    # all-to-alls, was bounded at 4.03 ms, all-to-alls at 0.006. A GPU's shipped models, without one, at the links.
    learned = pricer.one_host_comm(own_rows, total_rows, widest_rows, d)
    hosts = analytic_devices_per_host(models, topology.devices_per_host)
    if hosts is None or hosts >= d:
        least = np.minimum.reduceat(learned.sum(axis=1), starts)
    else:
        # Over hosts a device pays what the model learned beyond the links' price on one host, then the links'
        # price over the hosts (`over_hosts`), whose fixed time and latency per peer every device pays, forward and
        # backward.
        one_host = pricer.link_rows(own_rows, total_rows, d, one_host=True)
        least = np.minimum.reduceat(np.maximum(learned - one_host, 0.0).sum(axis=1), starts)
        least = least + 2 * (pricer.links.collective_ms + pricer.links.message_ms * (d - 1))
    return np.where(kept > 0, least, 0.0)


def least_all_reduce_ms(pricer: Pricer, tables: list[TableSpec], widths: np.ndarray) -> np.ndarray:
    """[n] the least the replicas' gradient all-reduce costs a device in plans replicating tables of at least
    `widths` [n] columns in all (0 ms for none): the gradients' MB and `sync_width`s of the tables cheapest per
    column, the last taken in part (below any set of whole tables of that width), priced as a plan's all-reduce
    (`Pricer.all_reduce`, which grows with both), every device holding the replicas."""
    models, topology = pricer.models, pricer.topology
    d = topology.num_devices
    replicas = [replica(t, d, 0) for t in tables]
    dims = np.array([t.dim for t in tables], dtype=np.float64)

    def least(per_table: np.ndarray) -> np.ndarray:
        order = np.argsort(per_table / dims, kind="stable")
        reach = np.concatenate([[0.0], np.cumsum(dims[order])])
        return np.interp(widths, reach, np.concatenate([[0.0], np.cumsum(per_table[order])]))

    gradient = least(np.array([gradient_mb(r, models.rows_cap) for r in replicas]))
    sync = least(np.array([sync_width(r, topology.batch_size, models.rows_cap) for r in replicas]))
    every = np.ones((1, d))
    priced = pricer.all_reduce(sync[:, None] * every, gradient[:, None] * every, widths[:, None] > 0)
    return np.where(widths > 0, priced.min(axis=-1), 0.0)


def across_hosts_ms(models: CostModels, tables: list[TableSpec], topology: Topology) -> float:
    """The least the slowest device's collectives take over the links between hosts, whatever the plan (0 on one
    host): every table's pooled columns reach every device's samples, forward and backward, and its ids come in;
    or, replicated, its gradient's ring all-reduce crosses the hosts (`ring_link_ms`), whichever moves less. A
    sharded table, split any way, brings the devices on average (H - 1)/(H D) of its columns per sample from other
    hosts each way (`received_floats`), a replica its ring's bus bytes over the L devices' links; the slowest device
    receives at least the average, and where a host's devices share its link (`Topology.host_link_gbps`), the host
    L times it.
    Without it, a plan over slow links was priced thousands of times its bound."""
    h, d = topology.num_hosts, topology.num_devices
    if h < 2:
        return 0.0
    off_host = (h - 1) / h
    floats = sum(
        min(
            (2 * t.dim + input_width(TablePiece.whole(t))) * off_host / d,
            ring_inter_host_floats(gradient_mb(replica(t, d, 0), models.rows_cap), topology),
        )
        for t in tables
    )
    batch = topology.batch_size
    moving = receiving_ms(floats, batch, topology.inter_host_gbps)
    if topology.host_link_gbps is not None:
        moving = max(moving, receiving_ms(floats * topology.devices_per_host_or_all, batch, topology.host_link_gbps))
    links = models.links  # its fixed time and latency per peer: the topology changes only the rate inside a host
    return moving + links.collective_ms + links.message_ms * (d - 1)  # at least one collective crosses the hosts


def ring_inter_host_floats(gradient_mb: float, topology: Topology) -> float:
    """A replica's ring all-reduce of `gradient_mb` MB: what it brings each device's link between hosts, in float
    columns per sample of the batch (`ring_link_ms`: the bus bytes over a host's L links)."""
    bus_mb = ring_bus_mb(gradient_mb, topology.num_devices) / topology.devices_per_host_or_all
    return bus_mb * 1e6 / 4 / topology.batch_size


def least_encodings(models: CostModels, tables: list[TableSpec], topology: Topology) -> np.ndarray:
    """Per table [T, 2 + H], the least of each encoding coordinate over the sharding types it may take.

    A plan's encodings add up to at least the sum of these, so, the compute model being monotone in
    every coordinate, they price every plan from below. The types are every one the searches make
    (whole, column halves and quarters, row-wise over the devices or a host's, data-parallel), fitting or not:
    more options only lower the bound. Identical pieces (equal row blocks, replicas, equal column
    slices) are encoded once and counted.
    """
    d = topology.num_devices
    per_host = topology.devices_per_host_or_all
    # each piece as (table, rows, columns, replicas), described without building it (`spans_features`)
    spans, weights, option_of, table_of = [], [], [], []
    for t, table in enumerate(tables):
        options = [[((table, table.rows, table.dim, 1), 1)]]
        for ways in (2, 4):
            if table.dim % (4 * ways) == 0:
                options.append([((table, table.rows, table.dim // ways, 1), ways)])
        if d > 1:
            options.append(_row_blocks(table, d))
            options.append([((table, table.rows, table.dim, d), d)])  # a data-parallel replica on each device
        if topology.num_hosts > 1 and per_host > 1:
            options.append(_row_blocks(table, per_host))
        for option in options:
            for span, weight in option:
                spans.append(span)
                weights.append(float(weight))
                option_of.append(len(table_of))
            table_of.append(t)
    replicated = np.array([float(span[3] > 1) for span in spans], dtype=np.float32)
    features = spans_features(spans, models.rows_cap)
    encodings = models.encode_features(features, replicated, topology.batch_size)
    encodings = encodings * np.asarray(weights, dtype=np.float32)[:, None]
    sums = added_up(encodings, np.asarray(option_of), len(table_of))
    least = np.full((len(tables), sums.shape[1]), np.inf, dtype=np.float32)
    np.minimum.at(least, np.asarray(table_of), sums)
    return least


def _row_blocks(table: TableSpec, ways: int) -> list[tuple[tuple[TableSpec, int, int, int], int]]:
    """The table's row blocks over `ways` devices (`row_block` rows, all full but the last), as ((table, rows,
    columns, replicas), how many alike)."""
    block = row_block(table, ways)
    blocks = -(-table.rows // block)
    last = (table, table.rows - (blocks - 1) * block, table.dim, 1)
    return [((table, block, table.dim, 1), blocks - 1), (last, 1)] if blocks > 1 else [(last, 1)]
