"""One device's fused embedding shard: all its tables in fbgemm's table-batched kernel.

`FusedShard` builds `SplitTableBatchedEmbeddingBagsCodegen` modules for a set of tables (one
per weight precision, as TorchRec groups them) and runs the forward and the backward with
the fused optimizer update on batches drawn from the tables' distributions. The profiling
actors time it alone; the device gang runs it inside the full step with the all-to-alls.
"""

from __future__ import annotations

import collections
import os
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from pydantic import BaseModel

from shard_ray.errors import ShardRayError, first_line
from shard_ray.plan.piece import TablePiece
from shard_ray.profiling.hardware import measurement_device
from shard_ray.profiling.procedure import (
    ADAM_ON_CPU,
    FusedShardMeasurement,
    MeasureConfig,
    content_digest,
    fused_shard_key,
    step_estimate,
)
from shard_ray.workload.access import fold_rows, generate_table_batch
from shard_ray.workload.tables import TableBatch, TableSpec

# The share of a node's memory (a GPU's, on GPUs) its measuring processes fill with tables, optimizer
# state and gradients, split evenly between them: the rest is for Ray, the store and the system.
MEASURING_MEMORY_SHARE = 0.5


def memory_budget(device: torch.device, sharing: int) -> int:
    """Bytes of tables one of `sharing` measuring processes on `device`'s node (or GPU) may allocate: its part of
    MEASURING_MEMORY_SHARE of the memory, the total rather than what is free, so a busy machine measures alike."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(MEASURING_MEMORY_SHARE * total / max(1, sharing))


def shard_rows_cap(pieces: Sequence[TablePiece], config: MeasureConfig, budget: int) -> int | None:
    """The rows allocated per table when measuring `pieces`: `config.max_rows` where given; else every table whole
    (None) when `budget` bytes hold them, or the largest cap that fits, applied to the largest tables only."""
    if config.max_rows is not None:
        return config.max_rows
    # What a row takes while a step runs (`TablePiece.memory_bytes`): weights, optimizer state, a replica's gradient.
    per_row = [(p.row_count, p.memory_bytes(config.optimizer) / p.row_count) for p in pieces]

    def needed(cap: int | None) -> float:
        return sum((rows if cap is None else min(rows, cap)) * size for rows, size in per_row)

    if needed(None) <= budget:
        return None
    low, high = 1, max(rows for rows, _ in per_row)  # needed(high) > budget >= needed(low) unless nothing fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if needed(middle) <= budget else (low, middle - 1)
    return low


def sample_ranges(batch_size: int, num_devices: int) -> list[tuple[int, int]]:
    """The samples [start, end) of the global batch each device trains on: contiguous, sizes differing by at most one."""
    base, extra = divmod(batch_size, num_devices)
    sizes = [base + (1 if d < extra else 0) for d in range(num_devices)]
    ends = np.cumsum(sizes).tolist()
    return [(end - size, end) for size, end in zip(sizes, ends)]


class KeptBatches:
    """The tables' batches a measuring process drew last, up to `most_bytes`, the least recently asked for dropped
    first. A process draws the same batches over and over: a plan's step draws every table's for the lookups it sends
    and its own tables' again for its kernels, every plan of a round on the same seed, every shard of a calibration
    too (docs/measurement.md, "Batches drawn once a process"). A batch kept is the same arrays as one drawn again; its
    callers do not write into them."""

    def __init__(self, most_bytes: int) -> None:
        self.most_bytes = most_bytes
        self._batches: collections.OrderedDict[tuple[str, int], TableBatch] = collections.OrderedDict()
        self._bytes = 0

    def held_bytes(self) -> int:
        return self._bytes

    def batch(self, key: tuple[str, int], draw: Callable[[], TableBatch]) -> TableBatch:
        """The batch of `key`, kept, or drawn by `draw` and kept where it fits."""
        kept = self._batches.get(key)
        if kept is not None:
            self._batches.move_to_end(key)
            return kept
        drawn = draw()
        size = drawn.indices.nbytes + drawn.lengths.nbytes
        if size <= self.most_bytes:
            self._batches[key] = drawn
            self._bytes += size
            while self._bytes > self.most_bytes:
                _, old = self._batches.popitem(last=False)
                self._bytes -= old.indices.nbytes + old.lengths.nbytes
        return drawn


# A round of MLPerf DLRM-DCNv2's 26 tables is 22.5 MiB of batches (12 a table at batch 1,024), Criteo Kaggle's 4.9
KEPT_BATCHES = KeptBatches(most_bytes=64 * 2**20)


def table_batch(table: TableSpec, config: MeasureConfig, batch: int) -> TableBatch:
    """Batch number `batch` of the table's global lookups; every piece of a table sees the same ones (kept in
    `KEPT_BATCHES` for the next piece, shard or plan that asks)."""
    # Seeded by the table's content, less its name and dim, so column slices see the same lookups.
    spec = table.model_dump(mode="json", exclude={"name", "dim"})
    digest = content_digest([spec, config.seed, batch])

    def draw() -> TableBatch:
        return generate_table_batch(table, config.batch_size, np.random.default_rng(int(digest[:15], 16)))

    return KEPT_BATCHES.batch((digest, config.batch_size), draw)


def piece_lookups(piece: TablePiece, batch: TableBatch, samples: tuple[int, int], cap: int | None) -> TableBatch:
    """What `piece` looks up for samples [start, end) of `batch`: the lookups in its row range, bucketized
    as TorchRec's row-wise input distribution does, as ids of its allocated rows."""
    bags = np.concatenate([[0], np.cumsum(batch.lengths)])
    indices = batch.indices[bags[samples[0]] : bags[samples[1]]]
    lengths = batch.lengths[samples[0] : samples[1]]
    if piece.rows is not None:
        start, end = piece.row_range
        inside = (indices >= start) & (indices < end)
        sample_of = np.repeat(np.arange(len(lengths)), lengths)
        lengths = np.bincount(sample_of[inside], minlength=len(lengths)).astype(np.int64)
        indices = indices[inside] - start
    return fold_rows(TableBatch(indices=indices, lengths=lengths), piece.allocated_rows(cap))


def initial_weights(piece: TablePiece, cap: int | None) -> torch.Tensor:
    """Weights that are a function of the table and the global (row, column) only, so that every
    sharding of a table starts from the same numbers (used to check sharded steps against one table)."""
    start = piece.row_range[0]
    rows = torch.arange(start, start + piece.allocated_rows(cap), dtype=torch.float64)[:, None]
    columns = torch.arange(*piece.columns, dtype=torch.float64)[None, :]
    phase = int(content_digest(piece.table.name)[:6], 16) / 2**24
    return (0.1 * torch.sin(0.731 * rows + 1.37 * columns + 6.28 * phase)).float()


# fbgemm's dense kernel (data-parallel replicas, as TorchRec runs them) registers no autograd kernel
# for its CPU op and torch warns on every backward; its gradients are checked against torch's own
# embedding_bag in the tests.
warnings.filterwarnings("ignore", message=".*dense_embedding_codegen_lookup_function.*autograd kernel")

_OPTIMIZERS = {"rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "sgd": "EXACT_SGD", "adam": "ADAM"}
_PRECISIONS = {"fp32": "FP32", "fp16": "FP16"}
LEARNING_RATE = 0.01
ADAGRAD_EPS = 1e-8  # fbgemm's default


class HostBuffers:
    """Host memory for fused shards' weights and optimizer state, kept from one shard to the next by a process that
    builds many in turn (a gang member: every plan of every round; a profiling actor: every shard). fbgemm allocates
    and zeroes a shard's tables each time it is built; on CPU, where whole tables are allocated, that zeroing took
    93% of a gang member's busy time over rounds of the ranking model's 2-device plan, and a fresh allocation of
    gigabytes timed its lookups 3-20 times slower in 13 of 46 builds on a virtual machine
    (docs/measurement.md, "Tables kept from shard to shard"). A buffer grows to the largest
    shard asked of it and is reused, its contents whatever the last shard left: the steps time the same kernels
    over resident pages, as training's do. The optimizer state, one value a row, is zeroed as a new shard's is. One
    shard at a time may use it.

    It holds at most a shard's memory budget. Buffers are kept per precision, and before they were bounded a member
    that built an fp32 shard of its whole budget and then an fp16 one held both, twice its budget: collecting comm
    data, two members held 12.1 and 9.4 GB of a 23.5 GB machine and Ray killed one."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def held_bytes(self) -> int:
        return sum(map(self._bytes, self._buffers))

    def _bytes(self, key: tuple[str, torch.dtype]) -> int:
        """The bytes buffer `key` holds, 0 where there is none."""
        buffer = self._buffers.get(key)
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def take_shard(self, requests: dict[str, tuple[int, torch.dtype, bool]], budget: int) -> dict[str, torch.Tensor]:
        """A shard's buffers: `requests` maps a name to (elements, dtype, zeroed: set to 0, as a new shard's
        optimizer state starts). Where they would not fit in `budget` bytes beside the buffers held, the buffers it
        does not ask for are dropped first, largest first, then those of its own larger than it needs (allocated
        again at its size)."""
        need = {(name, dtype): numel * dtype.itemsize for name, (numel, dtype, _) in requests.items()}
        size = self._bytes

        def held() -> int:
            return sum(size(k) for k in self._buffers if k not in need) + sum(max(size(k), n) for k, n in need.items())

        for key in sorted(set(self._buffers) - set(need), key=size, reverse=True):
            if held() <= budget:
                break
            del self._buffers[key]
        for key in sorted(need, key=lambda k: size(k) - need[k], reverse=True):
            if held() <= budget:
                break
            if size(key) > need[key]:
                del self._buffers[key]
        taken = {}
        for name, (numel, dtype, zeroed) in requests.items():
            buffer = self._buffers.pop((name, dtype), None)
            if buffer is None or buffer.numel() < numel:
                del buffer  # freed before the larger one is allocated
                buffer = torch.zeros(numel, dtype=dtype)
            self._buffers[(name, dtype)] = buffer
            taken[name] = buffer[:numel].zero_() if zeroed else buffer[:numel]
        return taken


class FusedShard:
    """The embedding kernels of one device, with its batches prepared.

    Sharded pieces (table-, column- and row-wise) run in fbgemm's table-batched kernels with the
    optimizer fused into the backward, one kernel per weight precision, over the global batch.
    Data-parallel replicas run in fbgemm's dense kernel over the device's own samples (sample
    range `rank` of the replicas'): their backward leaves a dense gradient, which the gang
    all-reduces before `update_replicas` applies the optimizer, as DistributedDataParallel does.
    """

    def __init__(
        self,
        pieces: list[TablePiece],
        config: MeasureConfig,
        device: torch.device | None = None,
        rank: int = 0,
        budget: int | None = None,
        host_buffers: HostBuffers | None = None,
    ) -> None:
        """`host_buffers`: where a CPU shard's tables and optimizer state go (`HostBuffers`); None: fbgemm's own."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            DenseTableBatchedEmbeddingBagsCodegen,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.device = device or measurement_device()
        self.config = config
        self.pieces = pieces
        on_gpu = self.device.type == "cuda"
        if config.optimizer == "adam" and not on_gpu:
            raise ShardRayError(ADAM_ON_CPU)
        location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        # Rows allocated per table (`shard_rows_cap`): None, every table whole, unless `budget` bytes (by default
        # one measuring process's `memory_budget`) cannot hold them.
        budget = memory_budget(self.device, 1) if budget is None else budget
        self.cap = shard_rows_cap(pieces, config, budget)
        self.sharded = [i for i, p in enumerate(pieces) if not p.replicated]
        self.replicated = [i for i, p in enumerate(pieces) if p.replicated]
        self.width = sum(pieces[i].width for i in self.sharded)
        self.replicated_width = sum(pieces[i].width for i in self.replicated)
        replicas = pieces[self.replicated[0]].replicas if self.replicated else 1
        self.samples = sample_ranges(config.batch_size, replicas)[rank] if self.replicated else (0, 0)
        # One kernel per weight precision, sharded and replicated apart; outputs follow `pieces` order.
        self.groups: list[tuple[list[int], torch.nn.Module]] = []
        self.replica_groups: list[tuple[list[int], torch.nn.Module]] = []
        kernels = {}  # the sharded pieces' kernels: their members and fbgemm's embedding specs, per precision
        for precision in ("fp32", "fp16"):
            members = [i for i in self.sharded if pieces[i].table.precision == precision]
            if members:
                specs = [(pieces[i].allocated_rows(self.cap), pieces[i].width, location, compute) for i in members]
                kernels[precision] = (members, specs)
        buffers: dict[str, torch.Tensor] = {}
        if host_buffers is not None and not on_gpu:
            requests = {}
            for precision, (_, specs) in kernels.items():
                rows = sum(rows for rows, *_ in specs)
                weights = sum(rows * width for rows, width, *_ in specs)
                dtype = torch.float16 if precision == "fp16" else torch.float32
                requests[f"{precision} weights"] = (weights, dtype, False)
                if config.optimizer == "rowwise_adagrad":
                    requests[f"{precision} state"] = (rows, torch.float32, True)
            buffers = host_buffers.take_shard(requests, budget)
        for precision in ("fp32", "fp16"):
            if precision in kernels:
                members, specs = kernels[precision]
                preallocated = None
                if buffers:
                    preallocated = {"weights": buffers[f"{precision} weights"]}
                    if config.optimizer == "rowwise_adagrad":
                        preallocated["momentum1"] = buffers[f"{precision} state"]
                module = SplitTableBatchedEmbeddingBagsCodegen(
                    embedding_specs=specs,
                    preallocated_host_buffers=preallocated,
                    optimizer=getattr(EmbOptimType, _OPTIMIZERS[config.optimizer]),
                    learning_rate=LEARNING_RATE,
                    eps=ADAGRAD_EPS,
                    weights_precision=getattr(SparseType, _PRECISIONS[precision]),
                    output_dtype=SparseType.FP32,
                    pooling_mode=PoolingMode.SUM,
                    device=self.device,
                )
                self.groups.append((members, module))
            members = [i for i in self.replicated if pieces[i].table.precision == precision]
            if members:
                module = DenseTableBatchedEmbeddingBagsCodegen(
                    [(pieces[i].allocated_rows(self.cap), pieces[i].width) for i in members],
                    weights_precision=getattr(SparseType, _PRECISIONS[precision]),
                    use_cpu=not on_gpu,
                ).to(self.device)
                self.replica_groups.append((members, module))
        self._adagrad_state = [
            torch.zeros(sum(pieces[i].allocated_rows(self.cap) for i in members), device=self.device)
            for members, _ in self.replica_groups
        ]
        self._replica_blocks = [self._equal_width_blocks(members) for members, _ in self.replica_groups]
        self.batches = [self._own_inputs(b) for b in range(config.num_batches)]

    def _own_inputs(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Kernel inputs from the device's own lookups: the whole batch for sharded pieces, its samples for replicas."""
        everything = (0, self.config.batch_size)
        lookups = {}
        for i, p in enumerate(self.pieces):
            own = piece_lookups(
                p, table_batch(p.table, self.config, batch), self.samples if p.replicated else everything, self.cap
            )
            lookups[i] = (torch.from_numpy(own.indices), torch.from_numpy(own.lengths))
        return self.kernel_inputs(lookups, self.groups + self.replica_groups)

    def kernel_inputs(
        self, lookups: dict[int, tuple[torch.Tensor, torch.Tensor]], groups: list[tuple[list[int], torch.nn.Module]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(indices, offsets) for each of `groups`' kernels from its pieces' (indices, lengths), by piece index."""
        inputs = []
        for members, _ in groups:
            indices = torch.cat([lookups[i][0] for i in members])
            lengths = torch.cat([lookups[i][1] for i in members])
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=lengths.device), torch.cumsum(lengths, 0)])
            inputs.append((indices.to(self.device), offsets.to(self.device)))
        return inputs

    def forward(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled embeddings of prepared batch number `batch` (`MeasureConfig.batch_of_step`); see `forward_on`."""
        return self.forward_on(self.batches[batch])

    def forward_on(self, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sharded [batch, width], replicated [own samples, replicated width]), columns in `pieces` order."""
        outputs = [module(*args) for (_, module), args in zip(self.groups + self.replica_groups, inputs)]
        split = len(self.groups)
        sharded = self._in_pieces_order(self.groups, outputs[:split], self.config.batch_size)
        replicated = self._in_pieces_order(self.replica_groups, outputs[split:], self.samples[1] - self.samples[0])
        return sharded, replicated

    def _in_pieces_order(
        self, groups: list[tuple[list[int], torch.nn.Module]], outputs: list[torch.Tensor], samples: int
    ) -> torch.Tensor:
        if not outputs:
            return torch.zeros(samples, 0, device=self.device, requires_grad=True)
        if len(outputs) == 1:
            return outputs[0]
        order = [i for members, _ in groups for i in members]
        if order == sorted(order):
            return torch.cat(outputs, dim=1)
        columns = torch.cat(outputs, dim=1)
        starts = np.concatenate([[0], np.cumsum([self.pieces[i].width for i in order])])
        position = {piece: k for k, piece in enumerate(order)}
        return torch.cat([columns[:, starts[position[i]] : starts[position[i] + 1]] for i in sorted(order)], dim=1)

    def backward(self, pooled: tuple[torch.Tensor, torch.Tensor], grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Backward through the kernels: sharded kernels apply the optimizer update in place,
        replicas accumulate their dense gradients (`replica_gradients`) for `update_replicas`."""
        outputs = [(out, grad) for out, grad in zip(pooled, grads) if out.grad_fn is not None]
        if outputs:
            torch.autograd.backward([o for o, _ in outputs], [g for _, g in outputs])

    def replica_gradients(self) -> list[torch.Tensor]:
        return [module.weights.grad for _, module in self.replica_groups if module.weights.grad is not None]

    def _equal_width_blocks(self, members: list[int]) -> list[tuple[int, int, int, int]]:
        """The replicas' flat weights as blocks of consecutive tables of one width, each a [rows, width] matrix:
        (offset, rows, width, first row)."""
        blocks: list[tuple[int, int, int, int]] = []
        offset = row = 0
        for i in members:
            width, rows = self.pieces[i].width, self.pieces[i].allocated_rows(self.cap)
            if blocks and blocks[-1][2] == width:
                start, held, _, first = blocks[-1]
                blocks[-1] = (start, held + rows, width, first)
            else:
                blocks.append((offset, rows, width, row))
            offset, row = offset + rows * width, row + rows
        return blocks

    @torch.no_grad()
    def update_replicas(self) -> None:
        """The optimizer step on the replicas' (all-reduced) dense gradients, as the fused kernels apply it."""
        for (_, module), state, blocks in zip(self.replica_groups, self._adagrad_state, self._replica_blocks):
            grad = module.weights.grad
            if grad is None:
                continue
            if self.config.optimizer == "rowwise_adagrad":
                # Row-wise state: the mean squared gradient of each row. Tables of one width side by side are
                # updated as one matrix, as a training job's optimizer steps all its dense parameters in a few
                # operations: table by table, 12 replicas cost an H200 about 1 ms of launches (docs/gpu.md).
                step = torch.empty_like(grad)
                for offset, rows, width, row in blocks:
                    g = grad[offset : offset + rows * width].view(rows, width)
                    s = state[row : row + rows]
                    s += g.pow(2).mean(dim=1)
                    step[offset : offset + rows * width] = (
                        g * (LEARNING_RATE / (s.sqrt() + ADAGRAD_EPS))[:, None]
                    ).reshape(-1)
                module.weights -= step.to(module.weights.dtype)
            else:
                module.weights -= (LEARNING_RATE * grad).to(module.weights.dtype)
            module.weights.grad = None

    def piece_weights(self) -> list[torch.Tensor]:
        """Each piece's weights [allocated rows, width], in `pieces` order (views into the kernels)."""
        views: dict[int, torch.Tensor] = {}
        for members, module in self.groups + self.replica_groups:
            for i, w in zip(members, module.split_embedding_weights()):
                views[i] = w
        return [views[i] for i in range(len(self.pieces))]

    @torch.no_grad()
    def load_initial_weights(self) -> None:
        """Set every piece's weights to `initial_weights` (and so every sharding of a table alike)."""
        for piece, weights in zip(self.pieces, self.piece_weights()):
            weights.copy_(initial_weights(piece, self.cap).to(weights.dtype))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# Warm-up runs until the steps stop getting faster: the mean of the last two steps no more than this below the
# two before.
SETTLE_TOLERANCE = 0.05
MAX_WARMUP_STEPS = 25


def warmed_up(step_ms: list[float], minimum: int) -> bool:
    """Whether warm-up is over after steps taking `step_ms`: at least `minimum` steps (none when 0), at least
    four, and the last two steps' mean no more than SETTLE_TOLERANCE below the two before (caches, the allocator
    and page faults settled: the steps stop getting faster); or MAX_WARMUP_STEPS steps, whatever they do.

    A step slower than the ones before it is the machine's noise, not warm-up, so it does not prolong warm-up:
    asking for two pairs of steps within 5% of each other both ways kept a 2-device gang warming up for a median
    13.5 steps (4-25) on an idle 2-core machine, against 4 (4-10) with this rule, and the plan measured no
    cheaper for the longer warm-up (docs/measurement.md)."""
    if minimum == 0 or len(step_ms) >= MAX_WARMUP_STEPS:
        return True
    if len(step_ms) < max(minimum, 4):
        return False
    return sum(step_ms[-2:]) >= (1 - SETTLE_TOLERANCE) * sum(step_ms[-4:-2])


class ShardTiming(BaseModel):
    fwd_ms: float
    bwd_ms: float


def time_fused_shard(shard: FusedShard) -> ShardTiming:
    """Forward and backward ms of a fused shard (`step_estimate` of `repeats` steps after warm-up, `warmed_up`)."""
    config = shard.config
    grads = (
        torch.randn(config.batch_size, shard.width, device=shard.device),
        torch.randn(shard.samples[1] - shard.samples[0], shard.replicated_width, device=shard.device),
    )
    warmup: list[float] = []
    fwd, bwd = [], []
    while len(fwd) < config.repeats:
        timing = warmed_up(warmup, config.warmup)
        batch = config.batch_of_step(len(fwd) if timing else None, len(warmup))
        shard.synchronize()
        start = time.perf_counter()
        pooled = shard.forward(batch)
        shard.synchronize()
        mid = time.perf_counter()
        shard.backward(pooled, grads)
        shard.update_replicas()
        shard.synchronize()
        end = time.perf_counter()
        if timing:
            fwd.append((mid - start) * 1e3)
            bwd.append((end - mid) * 1e3)
        else:
            warmup.append((end - start) * 1e3)
    return ShardTiming(fwd_ms=step_estimate(fwd), bwd_ms=step_estimate(bwd))


def measure_fused_shard(
    pieces: list[TablePiece],
    config: MeasureConfig,
    hardware: str,
    budget: int | None = None,
    host_buffers: HostBuffers | None = None,
) -> FusedShardMeasurement:
    """Build and time one fused shard within `budget` bytes (`FusedShard`, its tables in `host_buffers` where given:
    a measuring process's own, kept from shard to shard); out-of-memory and kernel errors are recorded, not
    raised."""
    key = fused_shard_key(pieces, config, hardware)
    taken = {"key": key, "hardware": hardware, "tables": pieces, "config": config}
    try:
        shard = FusedShard(pieces, config, budget=budget, host_buffers=host_buffers)
        timing = time_fused_shard(shard)
    except (RuntimeError, MemoryError, ShardRayError) as err:
        reason = f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__
        return FusedShardMeasurement(**taken, status="infeasible", reason=reason)
    return FusedShardMeasurement(**taken, fwd_ms=timing.fwd_ms, bwd_ms=timing.bwd_ms, rows_cap=shard.cap)
