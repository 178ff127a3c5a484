"""A device's share of a plan's training step on the gang (`shard_ray.profiling.gang`): its fused shard, its
sharding types' collectives (`TypeCollectives`), table-row-wise sums inside its host (`HostSums`), run as TorchRec
runs them (`PlanStep`). Imported in the gang's members' processes, not in the command that starts the gang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shard_ray.plan.piece import COLLECTIVE_TYPES, TablePiece
from shard_ray.profiling.fused_shard import (
    FusedShard,
    HostBuffers,
    piece_lookups,
    sample_ranges,
    shard_rows_cap,
    table_batch,
)
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec

# Runs one phase of a step: (its ms, its result).
Phase = Callable[[Callable[[], Any]], tuple[float, Any]]


def upstream_gradient(batch_size: int, width: int, seed: int) -> torch.Tensor:
    """The dense part's gradient for every sample's pooled embeddings [batch, sum of table dims]: a step's input."""
    return torch.randn(batch_size, width, generator=torch.Generator().manual_seed(seed))


def _columns(pieces: list[TablePiece], table_start: dict[str, int]) -> torch.Tensor:
    """Where the pieces' output columns go among all tables' columns (tables side by side)."""
    columns = [np.arange(*p.columns) + table_start[p.table.name] for p in pieces]
    return torch.from_numpy(np.concatenate(columns) if columns else np.zeros(0, dtype=np.int64))


class TypeCollectives:
    """One sharding type's share of a step's collectives, as TorchRec's `EmbeddingSharding` of that type runs
    them: its own input distribution (split sizes, lengths, ids), output all-to-all and backward all-to-all,
    over the pieces of that type on every device. A plan mixing types runs each set (on CPU, a plan of
    table-wise tables and one column-wise table ran 10 all-to-alls a step in TorchRec against 5: docs/results.md,
    "The gang against TorchRec's training step")."""

    def __init__(
        self,
        kind: str,
        step: PlanStep,
        pieces: list[list[TablePiece]],
        mine: list[int],
        tables: list[TableSpec],
        caps: list[int | None],
    ) -> None:
        # No reference to `step` is kept: a cycle would hold a plan's tables in memory until the garbage collector
        # ran, and the next plan's would be allocated beside them.
        self.kind = kind  # the sharding type (`TablePiece.sharding_type`)
        self.mine = mine  # my pieces of this type, as indices of my fused shard's pieces
        world, rank, config = step.world, step.rank, step.config
        self.rank, self.sizes, self.device, self.batch_size = rank, step.sizes, step.device, config.batch_size
        within_host = any(p.within_host > 1 for held in pieces for p in held)
        self.host_sums = HostSums(pieces, rank, step.table_start, step.device) if within_host else None
        # What each device j sends every device: its pieces' columns, or, with table-row-wise tables, its
        # other pieces' and its slices of its host's summed tables (`HostSums`).
        self.sent = (
            self.host_sums.sent_columns
            if self.host_sums is not None
            else [_columns(held, step.table_start) for held in pieces]
        )
        self.widths = [len(columns) for columns in self.sent]
        self.grad_columns = torch.cat(self.sent).to(step.device)
        # Where my pieces of this type sit among my fused shard's output columns; None: all of them, in order.
        starts = np.cumsum([0] + [step.shard.pieces[i].width for i in step.shard.sharded])
        position = {piece: k for k, piece in enumerate(step.shard.sharded)}
        columns = [np.arange(starts[position[i]], starts[position[i] + 1]) for i in mine]
        own = np.concatenate(columns + [np.zeros(0, dtype=np.int64)])
        self.my_columns = None if len(own) == starts[-1] else torch.from_numpy(own).to(step.device)
        # The same as ranges of consecutive columns, [start, end) in my output and where they begin in `own`: the
        # backward writes its gradients into them a range at a time (`PlanStep.grad_dist`), as a scatter of
        # single columns cost about as much as the all-to-all itself (docs/measurement.md).
        self.my_ranges: list[tuple[int, int, int]] = []
        at = 0
        for i in mine:
            first, last = int(starts[position[i]]), int(starts[position[i] + 1])
            if self.my_ranges and self.my_ranges[-1][1] == first:  # joins the range of the piece before
                start, _, begins = self.my_ranges.pop()
                self.my_ranges.append((start, last, begins))
            else:
                self.my_ranges.append((first, last, at))
            at += last - first
        # Input dist, prepared per batch: my samples' lookups for every device's pieces of this type.
        ranges = sample_ranges(config.batch_size, world)
        self.sends = []
        names = {p.table.name for held in pieces for p in held}
        of_type = [t for t in tables if t.name in names]
        for batch in range(config.num_batches):
            batches = {t.name: table_batch(t, config, batch) for t in of_type}
            lookups = [
                [piece_lookups(p, batches[p.table.name], ranges[rank], cap) for p in held]
                for held, cap in zip(pieces, caps)
            ]
            lengths = [np.concatenate([b.lengths for b in looks] + [np.zeros(0, np.int64)]) for looks in lookups]
            indices = [np.concatenate([b.indices for b in looks] + [np.zeros(0, np.int64)]) for looks in lookups]
            self.sends.append(
                _InputSend(
                    lengths=torch.from_numpy(np.concatenate(lengths)).to(step.device),
                    indices=torch.from_numpy(np.concatenate(indices)).to(step.device),
                    index_counts=torch.tensor([len(i) for i in indices], dtype=torch.int64),
                    length_counts=[len(x) for x in lengths],
                )
            )

    def input_dist(self, batch: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """My pieces' lookups of prepared batch `batch` (indices, lengths), gathered from every device, by piece."""
        send, count = self.sends[batch], len(self.mine)
        index_counts = torch.empty(len(self.sizes), dtype=torch.int64)
        dist.all_to_all_single(index_counts, send.index_counts)
        length_counts = [count * n for n in self.sizes]
        lengths = torch.empty(sum(length_counts), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(lengths, send.lengths, length_counts, send.length_counts)
        indices = torch.empty(int(index_counts.sum()), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(indices, send.indices, index_counts.tolist(), send.index_counts.tolist())
        # Source-major [source][piece][its samples] to piece-major, samples in global order.
        by_source = [x.view(count, n) for x, n in zip(lengths.split(length_counts), self.sizes)]
        piece_lengths = torch.cat(by_source, dim=1)
        chunks = indices.split(torch.stack([x.sum(dim=1) for x in by_source]).reshape(-1).tolist()) if count else ()
        return {piece: (torch.cat(chunks[k::count]), piece_lengths[k]) for k, piece in enumerate(self.mine)}

    def output_dist(self, pooled: torch.Tensor) -> list[torch.Tensor]:
        """The blocks [my samples, width_j] of this type's output from every device j, partial sums added up."""
        mine = self.sizes[self.rank]
        outgoing = pooled if self.my_columns is None else pooled.index_select(1, self.my_columns)
        if self.host_sums is not None:
            outgoing = self.host_sums.reduce(outgoing)
        received = torch.empty(mine * sum(self.widths), device=self.device)
        dist.all_to_all_single(
            received,
            outgoing.reshape(-1),
            [mine * w for w in self.widths],
            [n * self.widths[self.rank] for n in self.sizes],
        )
        return [b.view(mine, w) for b, w in zip(received.split([mine * w for w in self.widths]), self.widths)]

    def grad_dist(self, upstream: torch.Tensor) -> torch.Tensor:
        """The gradients of my output of this type over the global batch [batch, my width of this type], from the
        dense part's gradients of my samples' embeddings, `upstream`."""
        mine = self.sizes[self.rank]
        outgoing = upstream.index_select(1, self.grad_columns)
        send = torch.cat([b.reshape(-1) for b in outgoing.split(self.widths, dim=1)])
        width = self.widths[self.rank]
        received = torch.empty(self.batch_size * width, device=self.device)
        dist.all_to_all_single(received, send, [n * width for n in self.sizes], [mine * w for w in self.widths])
        mine_grads = received.view(self.batch_size, width)
        return mine_grads if self.host_sums is None else self.host_sums.gather(mine_grads)


class PlanStep:
    """One device's share of a plan's training step, as TorchRec runs it, phase by phase.

    input_dist: the device starts from its own samples of every table's batch. For each sharding type
      (`TypeCollectives`), an all-to-all of split sizes, then of lengths and of indices, sends every
      device the lookups of its pieces of that type (bucketized by row range for row-wise pieces), and
      each assembles its kernels' inputs.
    forward: the fused kernels over the global batch; replicas over the device's own samples.
    output_dist: for each sharding type, an all-to-all hands each device its samples' columns of every
      piece, and row-wise partial sums of a table are added up there (gloo has no reduce-scatter; this is
      one); table-row-wise partial sums are first added up inside their host (`HostSums`).
    grad_dist: the dense part's gradients go back the same way (every row-wise owner gets its
      table's); data-parallel replicas all-reduce their dense gradients.
    backward: the fused backward with the optimizer update; the replicas' optimizer step.
    """

    def __init__(
        self,
        by_device: list[list[TablePiece]],
        tables: list[TableSpec],
        rank: int,
        config: MeasureConfig,
        device: torch.device,
        budgets: list[int],
        host_buffers: HostBuffers | None = None,
    ) -> None:
        """`budgets`: each rank's memory budget (`memory_budget`); `host_buffers`: where my shard's tables go."""
        self.rank, self.config, self.device = rank, config, device
        self.world = len(by_device)
        self.shard = FusedShard(
            by_device[rank], config, device, rank=rank, budget=budgets[rank], host_buffers=host_buffers
        )
        # Each device's rows allocated per table (`shard_rows_cap`), into which the lookups sent to it are folded.
        caps = [shard_rows_cap(held, config, budget) for held, budget in zip(by_device, budgets)]
        ranges = sample_ranges(config.batch_size, self.world)
        self.sizes = [end - start for start, end in ranges]
        starts = np.cumsum([0] + [t.dim for t in tables]).tolist()
        self.table_start = dict(zip((t.name for t in tables), starts))
        self.total_width = starts[-1]
        start, end = ranges[rank]
        self.upstream = upstream_gradient(config.batch_size, self.total_width, config.seed)[start:end].to(device)
        present = {p.sharding_type for held in by_device for p in held if not p.replicated}
        self.collectives = [
            TypeCollectives(
                kind,
                self,
                [[p for p in held if p.sharding_type == kind] for held in by_device],
                [i for i in self.shard.sharded if by_device[rank][i].sharding_type == kind],
                tables,
                caps,
            )
            for kind in COLLECTIVE_TYPES
            if kind in present
        ]
        replicas = [by_device[rank][i] for i in self.shard.replicated]
        # Output dist: the blocks [my samples, width_j] from every device j, type by type, then my replicas' own.
        self.replica_columns = _columns(replicas, self.table_start).to(device)
        self.received_columns = torch.cat(
            [*(torch.cat(c.sent).to(device) for c in self.collectives), self.replica_columns]
        )

    def input_dist(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kernels' inputs of prepared batch `batch`: my pieces' lookups of it, gathered from every device."""
        lookups = {}
        for collectives in self.collectives:
            lookups.update(collectives.input_dist(batch))
        own = self.shard.batches[batch]
        return self.shard.kernel_inputs(lookups, self.shard.groups) + own[len(self.shard.groups) :]

    def output_dist(self, pooled: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """My samples' pooled embeddings of every table [my samples, sum of dims], partial sums added up."""
        mine = self.sizes[self.rank]
        blocks = [b for c in self.collectives for b in c.output_dist(pooled[0].detach())]
        embeddings = torch.zeros(mine, self.total_width, device=self.device)
        replicas = [pooled[1].detach()] if self.shard.replicated else []
        return embeddings.index_add_(1, self.received_columns, torch.cat([*blocks, *replicas], dim=1))

    def grad_dist(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of my sharded output over the global batch, and of my replicas' over my samples."""
        grads = torch.empty(self.config.batch_size, self.shard.width, device=self.device)
        for collectives in self.collectives:
            received = collectives.grad_dist(self.upstream)
            if collectives.my_columns is None:  # all my columns are of this type (the others' hold none of them)
                grads = received
            else:
                for start, end, at in collectives.my_ranges:
                    grads[:, start:end] = received[:, at : at + end - start]
        return grads, self.upstream.index_select(1, self.replica_columns)

    def sync_replicas(self) -> None:
        """DistributedDataParallel's all-reduce of the replicas' dense gradients (summed over samples, as one table's)."""
        for grad in self.shard.replica_gradients():
            dist.all_reduce(grad)

    def values(self) -> dict:
        """One step from `initial_weights`, in a process group joined: my samples' pooled embeddings (tables side by
        side, in `tables` order) and my pieces' updated weights."""
        self.shard.load_initial_weights()
        _, embeddings = self.train_step(0, _untimed, _untimed)
        weights = [w.detach().float().cpu().clone() for w in self.shard.piece_weights()]
        return {"device": self.rank, "embeddings": embeddings.cpu(), "weights": weights}

    def train_step(self, batch: int, timed: Phase, timed_compute: Phase) -> tuple[tuple[float, ...], torch.Tensor]:
        """One training step on prepared batch `batch`, each phase run through `timed` (collectives) or
        `timed_compute` (kernels), which return (ms, result): the ms of the STEP_PARTS and my samples' pooled
        embeddings."""
        input_ms, inputs = timed(lambda: self.input_dist(batch))
        fwd_ms, pooled = timed_compute(lambda: self.shard.forward_on(inputs))
        fwd_comm_ms, embeddings = timed(lambda: self.output_dist(pooled))
        bwd_comm_ms, grads = timed(self.grad_dist)
        bwd_ms, _ = timed_compute(lambda: self.shard.backward(pooled, grads))
        if self.shard.replicated:
            sync_ms, _ = timed(self.sync_replicas)
            update_ms, _ = timed_compute(self.shard.update_replicas)
            bwd_comm_ms, bwd_ms = bwd_comm_ms + sync_ms, bwd_ms + update_ms
        return (input_ms, fwd_ms, fwd_comm_ms, bwd_comm_ms, bwd_ms), embeddings


# Each process group's hosts' groups, made once: a gang measures many plans in one process group.
_HOST_GROUPS: dict[tuple[int, int, int], list[Any]] = {}


def forget_host_groups() -> None:
    """Drop the host groups made in the process group this member leaves."""
    _HOST_GROUPS.clear()


def _host_groups(world: int, local: int) -> list[Any]:
    """A process group per host of `local` ranks; every rank makes every one, in one order, as torch.distributed requires."""
    key = (id(dist.group.WORLD), world, local)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = [dist.new_group(list(range(first, first + local))) for first in range(0, world, local)]
    return _HOST_GROUPS[key]


class HostSums:
    """Table-row-wise output, as TorchRec's hierarchical collectives run it: each host's devices add up
    the partial sums of its tables' row blocks among themselves (a reduce-scatter, over the host's
    own process group), device k of the host keeping the k-th slice of each table's columns, which
    then goes out in the all-to-all as a column piece would; backward, the slices' gradients are
    gathered back inside the host (an all-gather), so every block gets its table's whole gradient.
    Gloo has neither collective over uneven slices, so both are all-to-alls of the same bytes."""

    def __init__(
        self, sharded: list[list[TablePiece]], rank: int, table_start: dict[str, int], device: torch.device
    ) -> None:
        local = next(p.within_host for held in sharded for p in held if p.within_host > 1)
        world = len(sharded)
        self.rank, self.local, self.device = rank, local, device
        self.group = _host_groups(world, local)[rank // local]
        # Per host, its table-row-wise tables (name, dim), in table order.
        self.tables = []
        for first in range(0, world, local):
            on_host = {
                p.table.name: p.table.dim for held in sharded[first : first + local] for p in held if p.within_host > 1
            }
            self.tables.append(sorted(on_host.items(), key=lambda item: table_start[item[0]]))
        # Per device j: its other pieces' columns, then its slice of each of its host's summed tables.
        self.sent_columns = []
        for j, held in enumerate(sharded):
            slices = [
                np.arange(*self._slice(dim, j % local)) + table_start[name] for name, dim in self.tables[j // local]
            ]
            other = [np.arange(*p.columns) + table_start[p.table.name] for p in held if p.within_host == 1]
            self.sent_columns.append(torch.from_numpy(np.concatenate([*other, *slices, np.zeros(0, dtype=np.int64)])))
        mine = sharded[rank]
        starts = np.cumsum([0] + [p.width for p in mine])
        self.other_positions = torch.from_numpy(
            np.concatenate(
                [np.arange(starts[i], starts[i + 1]) for i, p in enumerate(mine) if p.within_host == 1]
                + [np.zeros(0, dtype=np.int64)]
            )
        ).to(device)
        # Where my blocks of each of my host's tables sit in my output (None: no block of it here).
        held = {p.table.name: starts[i] for i, p in enumerate(mine) if p.within_host > 1}
        self.block_start = [held.get(name) for name, _ in self.tables[rank // local]]
        self.width = int(starts[-1])

    def _slice(self, dim: int, k: int) -> tuple[int, int]:
        """The columns [start, end) of a table the host's device k adds up and sends on."""
        return dim * k // self.local, dim * (k + 1) // self.local

    def reduce(self, pooled: torch.Tensor) -> torch.Tensor:
        """My output to send [batch, my sent width]: my other pieces' columns, then my slices of my host's
        tables summed over the host's blocks."""
        batch = pooled.shape[0]
        tables = self.tables[self.rank // self.local]
        partial = [
            pooled[:, s : s + dim] if s is not None else torch.zeros(batch, dim, device=self.device)
            for s, (_, dim) in zip(self.block_start, tables)
        ]
        to_peer = [
            torch.cat(
                [p[:, slice(*self._slice(dim, k))] for p, (_, dim) in zip(partial, tables)] + [pooled[:, :0]], dim=1
            )
            for k in range(self.local)
        ]
        mine = to_peer[self.rank % self.local].shape[1]
        received = torch.empty(self.local * batch * mine, device=self.device)
        dist.all_to_all_single(
            received,
            torch.cat([t.reshape(-1) for t in to_peer]),
            [batch * mine] * self.local,
            [t.numel() for t in to_peer],
            group=self.group,
        )
        summed = received.view(self.local, batch, mine).sum(dim=0)
        return torch.cat([pooled.index_select(1, self.other_positions), summed], dim=1)

    def gather(self, grads: torch.Tensor) -> torch.Tensor:
        """My pieces' gradients [batch, my width] from those of what I sent: my slices' gathered from the host."""
        batch, others = grads.shape[0], len(self.other_positions)
        tables = self.tables[self.rank // self.local]
        # Device k of the host sent its slices of the host's tables side by side: where each begins.
        slices = [[self._slice(dim, k) for _, dim in tables] for k in range(self.local)]
        widths = [sum(end - start for start, end in row) for row in slices]
        offsets = [np.cumsum([0] + [end - start for start, end in row]) for row in slices]
        mine = grads[:, others:].contiguous().reshape(-1)
        received = torch.empty(batch * sum(widths), device=self.device)
        dist.all_to_all_single(
            received, mine.repeat(self.local), [batch * w for w in widths], [len(mine)] * self.local, group=self.group
        )
        from_peer = [b.view(batch, w) for b, w in zip(received.split([batch * w for w in widths]), widths)]
        out = torch.zeros(batch, self.width, device=self.device)
        out[:, self.other_positions] = grads[:, :others]
        for t, start in enumerate(self.block_start):
            if start is not None:
                whole = [from_peer[k][:, offsets[k][t] : offsets[k][t + 1]] for k in range(self.local)]
                out[:, start : start + tables[t][1]] = torch.cat(whole, dim=1)
        return out


def _untimed(fn: Callable[[], Any]) -> tuple[float, Any]:
    return 0.0, fn()


@dataclass(frozen=True)
class _InputSend:
    lengths: torch.Tensor
    indices: torch.Tensor
    index_counts: torch.Tensor
    length_counts: list[int]
