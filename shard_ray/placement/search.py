"""Cost-model search: NeuroShard's greedy grid and column-split beam search, and our refinement.

`neuroshard` (as published): tables sorted by predicted single-table cost, largest first; for
each dim-sum cap scale on a grid 1.0..1.5 a greedy pass puts each table on the allowed device
(dim sum under scale x mean, memory permitting) whose fused shard is predicted cheapest with
it; the best pass by simulated plan cost wins. A beam search over column-wise halvings of the
costliest tables reruns the greedy for each candidate split and keeps the best `beam_width`.

`cost_search` (ours) adds what the published search leaves out: splits into halves and
quarters, and local search (moves and swaps off the slowest device, judged by the simulated
cost of the whole plan) after each greedy pass it keeps.

Pricing is incremental: the compute model sums per-table encodings, so a device's encoding sum
plus one table's encoding prices the device with that table in one small head call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shard_ray.costmodel.models import CostModels, comm_features
from shard_ray.placement.base import Placer, register
from shard_ray.plan.plan import Plan, Shard
from shard_ray.plan.topology import Topology, shard_bytes
from shard_ray.workload.tables import TableSpec

Item = tuple[TableSpec, tuple[int, int]]  # a table and the column range this item covers


@dataclass(frozen=True)
class SearchConfig:
    scales: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)
    beam_width: int = 3
    beam_depth: int = 3
    branching: int = 3  # costliest items tried as split candidates per beam state
    split_ways: tuple[int, ...] = (2,)
    local_search_steps: int = 0


NEUROSHARD = SearchConfig()
COST_SEARCH = SearchConfig(split_ways=(2, 4), local_search_steps=200)


class Pricer:
    """Prices devices and plans of items with the cost models, reusing item encodings."""

    def __init__(self, models: CostModels, topology: Topology) -> None:
        self.models = models
        self.topology = topology
        self._encodings: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}
        self._tables: dict[str, TableSpec] = {}

    def encodings(self, items: list[Item]) -> torch.Tensor:
        missing = [(t, c) for t, c in items if (t.name, c) not in self._encodings]
        if missing:
            encoded = self.models.encode_tables([(t, c[1] - c[0]) for t, c in missing])
            for (t, c), e in zip(missing, encoded):
                self._encodings[(t.name, c)] = e
        return torch.stack([self._encodings[(t.name, c)] for t, c in items])

    def compute(self, sums: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
        """Predicted fwd + bwd ms of shards given by encoding sums and table counts."""
        return self.models.compute_from_sums(sums, counts, self.topology.batch_size).sum(axis=1)

    def comm(self, widths: np.ndarray) -> np.ndarray:
        return self.models.predict_comm(widths, self.topology.batch_size).sum(axis=1)

    def device_costs(self, encodings: torch.Tensor, widths: np.ndarray, assign: np.ndarray) -> np.ndarray:
        d = self.topology.num_devices
        sums = torch.zeros(d, encodings.shape[1]).index_add_(0, torch.from_numpy(assign), encodings)
        counts = torch.from_numpy(np.bincount(assign, minlength=d).astype(np.float32))
        device_widths = np.bincount(assign, weights=widths, minlength=d)
        return self.compute(sums, counts) + self.comm(device_widths)


@dataclass
class Candidate:
    items: list[Item]
    assign: np.ndarray
    cost: float


def single_costs(pricer: Pricer, items: list[Item]) -> np.ndarray:
    enc = pricer.encodings(items)
    return pricer.compute(enc, torch.ones(len(items)))


def greedy_grid(pricer: Pricer, items: list[Item], scales: tuple[float, ...]) -> Candidate:
    """NeuroShard's greedy pass for each dim-sum cap scale; the best by simulated cost."""
    topology = pricer.topology
    d = topology.num_devices
    enc = pricer.encodings(items)
    widths = np.array([c[1] - c[0] for _, c in items], dtype=np.float64)
    need = np.array([shard_bytes(t, c[1] - c[0], topology.optimizer) for t, c in items], dtype=np.int64)
    order = np.argsort(-single_costs(pricer, items), kind="stable")
    cap_base = widths.sum() / d
    best: Candidate | None = None
    for scale in scales:
        sums = torch.zeros(d, enc.shape[1])
        counts = torch.zeros(d)
        dim_sum = np.zeros(d)
        free = np.full(d, topology.memory_bytes, dtype=np.int64)
        assign = np.zeros(len(items), dtype=np.int64)
        for i in order:
            fits = free >= need[i]
            if not fits.any():
                break
            allowed = np.flatnonzero(fits & (dim_sum + widths[i] <= scale * cap_base))
            if allowed.size == 0:
                allowed = np.flatnonzero(fits)
            idx = torch.from_numpy(allowed)
            costs = pricer.compute(sums[idx] + enc[i], counts[idx] + 1)
            device = int(allowed[int(np.argmin(costs))])
            sums[device] += enc[i]
            counts[device] += 1
            dim_sum[device] += widths[i]
            free[device] -= need[i]
            assign[i] = device
        else:
            cost = float(pricer.device_costs(enc, widths, assign).max())
            if best is None or cost < best.cost:
                best = Candidate(items, assign, cost)
    if best is None:
        from shard_ray.errors import ShardRayError

        raise ShardRayError(
            f"the search found no placement within {topology.memory_gb:.3f} GB per device for these tables"
        )
    return best


def local_search(pricer: Pricer, candidate: Candidate, steps: int) -> Candidate:
    """Moves and swaps of items off the slowest device while the simulated plan cost drops."""
    topology = pricer.topology
    d = topology.num_devices
    items, assign = candidate.items, candidate.assign.copy()
    enc = pricer.encodings(items)
    widths = np.array([c[1] - c[0] for _, c in items], dtype=np.float64)
    need = np.array([shard_bytes(t, c[1] - c[0], topology.optimizer) for t, c in items], dtype=np.int64)
    cost = candidate.cost
    for _ in range(steps):
        costs = pricer.device_costs(enc, widths, assign)
        slowest = int(np.argmax(costs))
        free = topology.memory_bytes - np.bincount(assign, weights=need, minlength=d)
        on_slowest = np.flatnonzero(assign == slowest)
        # (item leaving the slowest device, item coming back or -1, target device)
        moves = [(i, -1, t) for i in on_slowest for t in range(d) if t != slowest and free[t] >= need[i]]
        moves += [
            (i, j, assign[j])
            for i in on_slowest
            for j in np.flatnonzero(assign != slowest)
            if free[assign[j]] + need[j] >= need[i] and free[slowest] + need[i] >= need[j]
        ]
        if not moves:
            break
        best_move, best_cost = None, cost
        for start in range(0, len(moves), 4096):
            chunk = moves[start : start + 4096]
            trial = np.repeat(assign[None, :], len(chunk), axis=0)
            for row, (i, j, t) in enumerate(chunk):
                trial[row, i] = t
                if j >= 0:
                    trial[row, j] = slowest
            trial_costs = _batch_plan_costs(pricer, enc, widths, trial)
            k = int(np.argmin(trial_costs))
            if trial_costs[k] < best_cost - 1e-6:
                best_move, best_cost = trial[k], float(trial_costs[k])
        if best_move is None:
            break
        assign, cost = best_move, best_cost
    return Candidate(items, assign, cost)


def _batch_plan_costs(pricer: Pricer, enc: torch.Tensor, widths: np.ndarray, assigns: np.ndarray) -> np.ndarray:
    """Simulated plan cost of each row of `assigns` [C, N], in one batched model call."""
    c, _ = assigns.shape
    d = pricer.topology.num_devices
    flat = torch.from_numpy((assigns + d * np.arange(c)[:, None]).reshape(-1))
    sums = torch.zeros(c * d, enc.shape[1]).index_add_(0, flat, enc.repeat(c, 1))
    counts = torch.bincount(flat, minlength=c * d).float()
    compute = pricer.compute(sums, counts).reshape(c, d)
    device_widths = np.stack([np.bincount(a, weights=widths, minlength=d) for a in assigns])
    if pricer.models.comm is None or d == 1:
        comm = np.zeros((c, d))
    else:
        features = np.concatenate([comm_features(w, pricer.topology.batch_size) for w in device_widths])
        with torch.no_grad():
            comm = torch.exp(pricer.models.comm(torch.from_numpy(features))).numpy().sum(axis=1).reshape(c, d)
    return (compute + comm).max(axis=1)


def split_item(item: Item, ways: int) -> list[Item] | None:
    """The item's columns in `ways` equal slices, or None when slices would not be multiples of 4."""
    table, (start, end) = item
    width = end - start
    if width % (4 * ways):
        return None
    step = width // ways
    return [(table, (start + k * step, start + (k + 1) * step)) for k in range(ways)]


def beam_search(pricer: Pricer, tables: list[TableSpec], config: SearchConfig) -> Candidate:
    """Column-wise split search: each level splits one of the costliest items of each beam state."""

    def place(items: list[Item]) -> Candidate:
        found = greedy_grid(pricer, items, config.scales)
        return local_search(pricer, found, config.local_search_steps) if config.local_search_steps else found

    start = place([(t, (0, t.dim)) for t in tables])
    beam, best, seen = [start], start, {_signature(start.items)}
    for _ in range(config.beam_depth):
        children = []
        for state in beam:
            costs = single_costs(pricer, state.items)
            for i in np.argsort(-costs)[: config.branching]:
                for ways in config.split_ways:
                    pieces = split_item(state.items[i], ways)
                    if pieces is None:
                        continue
                    items = state.items[:i] + pieces + state.items[i + 1 :]
                    signature = _signature(items)
                    if signature in seen:
                        continue
                    seen.add(signature)
                    children.append(place(items))
        if not children:
            break
        beam = sorted(children, key=lambda c: c.cost)[: config.beam_width]
        best = min(best, beam[0], key=lambda c: c.cost)
    return best


def _signature(items: list[Item]) -> frozenset:
    return frozenset((t.name, c) for t, c in items)


def candidate_plan(candidate: Candidate, num_devices: int, algorithm: str) -> Plan:
    shards = [Shard(table=t.name, device=int(dev), columns=c) for (t, c), dev in zip(candidate.items, candidate.assign)]
    return Plan(num_devices=num_devices, algorithm=algorithm, shards=shards)


def search_placer(name: str, config: SearchConfig, models: CostModels) -> Placer:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        best = beam_search(Pricer(models, topology), tables, config)
        return candidate_plan(best, topology.num_devices, name)

    return placer


@register("neuroshard", "search", "NeuroShard: cost-model greedy grid over dim-sum caps, beam search over column halvings", needs_cost_model=True)
def neuroshard(models: CostModels, seed: int = 0) -> Placer:
    return search_placer("neuroshard", NEUROSHARD, models)


@register("cost_search", "search", "ours: NeuroShard's search plus halves and quarters and local search on the simulated cost", needs_cost_model=True)
def cost_search(models: CostModels, seed: int = 0) -> Placer:
    return search_placer("cost_search", COST_SEARCH, models)
