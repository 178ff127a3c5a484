"""DreamShard's estimated MDP with TorchRec's splits: place a task's tables one per step, priced by the cost models.

`PlacementState` is one episode on one task. Tables come in order of predicted cost alone (compute, and what each
adds to its device's all-to-alls), largest first, and each step takes one of the current piece's options
(`Option`): the piece whole on one of its candidate devices, or, for a table that dominates the task (its predicted
cost alone at least `SPLIT_SHARE` of the task's lower bound) or that no device holds whole, a split as
TorchRec's vocabulary has it: column-wise (in halves, and on 4 devices or more in quarters, which
the next steps place, never two on one device), row-wise (a block on every device) or
table-row-wise (a block on every device of one host, one option per host of the `SPLIT_HOSTS`
least loaded); where a row-wise set of collectives already runs, the row-wise splits to later
tables too (`PlacementState._splits_offered`). Observations are a row per option, built from the
shared feature extractor (`shard_ray.costmodel.features`) and the cost models' predictions, so no
hardware runs inside the RL loop. The same state drives training
(`PlacementEnv`, drawing a task per episode) and inference (`shard_ray.policy.decode`).

Prices: each sharding type present runs its own set of all-to-alls, as `Pricer.device_parts`
prices a plan (`_collectives`), so a finished plan's cost is its simulated cost.

Rewards are dense and telescoping: step t earns -(C_t - C_{t-1}) / L, where C_t is the
simulated cost of the partial plan (its slowest device) and L the task's lower bound over plans of
any sharding type, so an episode's return is exactly minus the final plan's simulated cost over
the lower bound. The ratio makes returns comparable across tasks of any size. An episode whose
next piece fits nowhere ends early with a penalty of `INFEASIBLE_PENALTY`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from shard_ray.costmodel.bounds import LowerBound
from shard_ray.costmodel.bounds import lower_bound as task_lower_bound
from shard_ray.costmodel.features import NUM_SCALAR_FEATURES, NUM_TABLE_FEATURES, TABLE_FEATURES
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.pricing import Pricer, costs_its_lookups, host_reduce, single_costs
from shard_ray.errors import ShardRayError
from shard_ray.plan.enumerator import pieces_to_place, table_options
from shard_ray.plan.memory import MemoryLedger
from shard_ray.plan.piece import COLLECTIVE_TYPES, TablePiece, row_wise, split_piece, table_row_wise
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology, memory_cap_with_headroom
from shard_ray.workload.tables import TableSpec
from shard_ray.workload.tasks import TaskConfig, draw_task

# How a step may split a whole table, in the order of the observation's split rows.
SPLITS = ("column_wise", "row_wise", "table_row_wise")
# A table is offered the splits when its predicted compute alone is at least this share of the compute the task's
# lower bound holds (`LowerBound.compute`: the least the slowest device carries), or when no device holds it whole:
# splitting a smaller one adds collectives and cannot lower the slowest device much,
# and pricing a row-wise split prices every device, so offering it to every table would make a step cost the devices.
SPLIT_SHARE = 1.0
# Splits are offered to this many of a task's tables at most, its costliest (and to any no device holds whole): each
# offer prices the plan finished greedily once per option (`PlacementState.finish`), a step's cost grows with the task.
# A task of no more tables than devices offers them to every table that dominates it (`split_tables`): there every
# table dominates, and capped, Criteo Kaggle's 26 tables on 64 devices kept 10 whole, 1.41x cost_search's plan.
SPLIT_TABLES = 16
# Table-row-wise is offered on this many hosts, the least loaded (their slowest device the fastest).
SPLIT_HOSTS = 4
MAX_SPLIT_OPTIONS = 3 + SPLIT_HOSTS
# The sets of collectives a table may join by splitting by rows where one already runs (`_splits_offered`).
_ROW_KINDS = [COLLECTIVE_TYPES.index(kind) for kind in ("row_wise", "table_row_wise")]
# The column-wise set, which a task of few tables a device lets any table join (`_splits_offered`).
_COLUMN_KIND = COLLECTIVE_TYPES.index("column_wise")

OPTION_FEATURES = (
    "fwd_compute",  # predicted ms of the device's fused shard, over the lower bound
    "bwd_compute",
    "comm",  # predicted all-to-all ms (pooled embeddings and inputs, every set), over the lower bound
    "total",
    "total_with_table",  # the device's predicted total with the piece there (a split: the largest of its devices')
    "makespan_increase",  # how much the plan's slowest device would grow
    "free_memory",  # share of the cap still free (a split: its devices' least)
    "table_memory",  # the piece's memory over the device's free memory (a split: its pieces' largest such share)
    "width_share",  # the device's columns over the task's
    "log_tables",
    # the shared features of the pieces already there, summed, over the task's tables per device
    *(f"sum_{name}" for name in TABLE_FEATURES[:NUM_SCALAR_FEATURES]),
    "sum_reuse",  # the reuse histograms' mass (the number of pieces), as one number
    # which split the row is, one-hot; all zero: the piece whole on the row's device. A split's device features
    # (all above but the with-table, increase and memory ones) are those of its device that ends slowest.
    *(f"split_{kind}" for kind in SPLITS),
)
NUM_OPTION_FEATURES = len(OPTION_FEATURES)
# The current piece: its shared features, then its predicted cost alone, the share of the
# task's predicted single-table cost still to place after it, the progress, and log2 devices.
NUM_CURRENT_FEATURES = NUM_TABLE_FEATURES + 4
INFEASIBLE_PENALTY = 2.0
# The most devices scored for a piece, so that placing grows with the tables, not tables x devices (docs/policy.md):
# on more devices, those with room for it, half the least loaded by predicted step and the rest the roomiest.
CANDIDATES = 16
# On this many devices or more, decoding scores the later pieces in waves (`PlacementState.wave`): a step a piece costs
# about a millisecond in small calls, which thousands of tables add up to seconds (docs/results.md).
WAVE_DEVICES = 4 * CANDIDATES


def observation_rows(max_devices: int) -> int:
    """The most option rows a step on up to `max_devices` devices has: its candidate devices and the splits."""
    return min(max_devices, CANDIDATES) + MAX_SPLIT_OPTIONS


class Option(NamedTuple):
    """One action of a step: the piece whole on `device`, or the table split as `split` (on `host`, table-row-wise)."""

    device: int = -1
    split: str | None = None
    host: int = -1


class _LaterSplit(NamedTuple):
    """How `_finish` splits the later tables that dominate the task: those costlier alone than the lower bound, or
    with `above_slowest` only those costlier alone than the slowest device once the option is taken (whole, each
    would be the slowest), or with `to_level` too only those costlier alone than the level every device reaches on
    average once every piece is placed, where that is higher (below it, a table whole sets no device's price); in
    column slices, or with `by_rows` one that costs its lookups (`costs_its_lookups`) in row-wise blocks
    (`_finishing_slices`)."""

    above_slowest: bool
    by_rows: bool
    to_level: bool = False


class _FinishStart(NamedTuple):
    """Where `_finish` starts from: every device's load (the sum of its pieces' costs alone) and free memory with the
    option's pieces placed, those pieces described, their costs alone and devices."""

    loads: list[float]
    free: list[int]
    besides: list[_Piece]
    besides_singles: list[float]
    at: list[int]
    pieces: _Pieces  # `besides` as arrays


class _Piece(NamedTuple):
    """What a step needs of a piece, computed once per piece."""

    encoding: np.ndarray
    width: float
    input: float
    host_sum: float
    need: int
    allowed: np.ndarray
    anywhere: bool  # `allowed` holds every device
    kind: int
    features: np.ndarray


class _Pieces(NamedTuple):
    """Described pieces as arrays, row by row: what pricing a set of them on their devices reads."""

    encodings: np.ndarray
    kinds: np.ndarray
    widths: np.ndarray
    inputs: np.ndarray
    host_sums: np.ndarray

    @staticmethod
    def of(described: list[_Piece]) -> _Pieces:
        return _Pieces(
            np.stack([p.encoding for p in described]),
            np.array([p.kind for p in described], dtype=np.int64),
            np.array([p.width for p in described]),
            np.array([p.input for p in described]),
            np.array([p.host_sum for p in described]),
        )

    def charges(self, per_width: np.ndarray, per_input: np.ndarray) -> np.ndarray:
        """What each piece adds to its device's all-to-alls at these rates (`PlacementState._rates_over`)."""
        return per_width[self.kinds] * self.widths + per_input[self.kinds] * self.inputs

    def rows(self, index: np.ndarray) -> _Pieces:
        return _Pieces(
            self.encodings[index], self.kinds[index], self.widths[index], self.inputs[index],
            self.host_sums[index],
        )  # fmt: skip

    @staticmethod
    def joined(parts: list[_Pieces]) -> _Pieces:
        """The rows of `parts`, one after the other."""
        return _Pieces(*(np.concatenate(column) for column in zip(*parts)))


class _Slices(NamedTuple):
    """A later table's slices as `_finish` puts them (`PlacementState._finishing_slices`, `_joining_slices`,
    `_fitting_columns`): the pieces, each one's cost alone, described, and as arrays (None where there are none), made
    once: the finishes put the same slices over and over (with few tables a device, every later table in each)."""

    pieces: list[TablePiece]
    singles: list[float]
    described: list[_Piece]
    rows: _Pieces | None
    at: list[int] | None  # each piece's device, where they are pinned (row blocks)


NO_SLICES = _Slices([], [], [], None, None)


@dataclass
class _Split:
    """A split priced: its pieces on their devices, and every device's state were it taken."""

    pieces: list[TablePiece]
    devices: np.ndarray
    fits: bool
    compute: np.ndarray  # [len(devices), 2] the split's devices' predicted (fwd, bwd) with their piece
    loads: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # widths, inputs, host sums, pieces per type
    priced: tuple[np.ndarray, np.ndarray, np.ndarray]  # `_collectives` of the loads
    totals: np.ndarray  # [D] every device's predicted step were it taken
    finished: float = math.inf  # the predicted cost of the plan finished greedily after it (`PlacementState.finish`)


def _heap_of(loads: list[float]) -> list[tuple[float, int]]:
    """The devices as a heap of (load, device): the least loaded first, then the lowest index."""
    heap = [(load, k) for k, load in enumerate(loads)]
    heapq.heapify(heap)
    return heap


def _least_loaded_with_room(
    heap: list[tuple[float, int]], loads: list[float], free: list[int], piece: _Piece, room: _Room | None = None
) -> int | None:
    """The device of least load (then lowest index) with room for `piece` among those it may go to, and leaving
    `room`, taken off `heap` (entries (load, device), those of an older load skipped; the others popped on the way
    pushed back); None if none."""
    passed, found = [], None
    while heap:
        load, device = heapq.heappop(heap)
        if load != loads[device]:
            continue
        if (
            free[device] >= piece.need
            and piece.allowed[device]
            and (room is None or not room.crosses(free[device], piece.need) or room.allows(free[device], piece.need))
        ):
            found = device
            break
        passed.append((load, device))
    for entry in passed:
        heapq.heappush(heap, entry)
    return found


def _keeps_room(free: np.ndarray, need: int, later: list[int]) -> np.ndarray:
    """[D] bools: whether a piece of `need` on each device leaves room for pieces of `later` needs (largest first,
    each more than half a device, so no two on one): the k-th largest still has k devices with that much free."""
    needs = np.asarray(later)[:, None]
    fits = free[None, :] >= needs
    lost = fits & (free[None, :] - need < needs)
    return (fits.sum(axis=1)[:, None] - lost >= np.arange(1, len(later) + 1)[:, None]).all(axis=0)


class _Room:
    """The room `_finish` keeps, as the steps do (`_keeps_room`), for the later pieces that need more than half a
    device: their needs, largest first, and how many devices have each much free, counted as the finish takes memory.
    Where they have no such room to begin with, it keeps none."""

    def __init__(self, free: list[int], needs: list[int]) -> None:
        self.needs = sorted(needs, reverse=True)
        self.recount(free)

    def recount(self, free: list[int]) -> None:
        # sorted once, each need's count a binary search: counted in Python, every finish compared each need with
        # every device's free memory (3 million comparisons placing 5,136 tables on 512 devices)
        ascending = np.sort(np.asarray(free, dtype=np.int64))
        self.counts = (len(free) - np.searchsorted(ascending, self.needs, side="left")).tolist()
        self.keeping = bool(self.needs) and all(count > k for k, count in enumerate(self.counts))
        # a device whose free memory stays at least the largest need, or is below the smallest, changes no count
        self.top, self.bottom = (self.needs[0], self.needs[-1]) if self.needs else (0, 0)

    def crosses(self, free: int, need: int) -> bool:
        """Whether a device of `free` taking `need` changes a count (the room kept; `allows` then says whether it may)."""
        return self.keeping and free >= self.bottom and free - need < self.top

    def allows(self, free: int, need: int) -> bool:
        """Whether a device of `free` may take `need` and leave the room."""
        return not self.keeping or all(
            count > k + 1 or not free >= n > free - need for k, (n, count) in enumerate(zip(self.needs, self.counts))
        )

    def take(self, free: int, need: int) -> None:
        """A device of `free` took `need`."""
        self.counts = [count - (free >= n > free - need) for n, count in zip(self.needs, self.counts)]

    def reached(self, need: int, free: list[int]) -> None:
        """The piece of `need` is placing: the room kept for it goes."""
        self.needs.remove(need)
        self.recount(free)


def _whole_table(piece: TablePiece) -> bool:
    """Whether `piece` is its table whole, sharded nowhere yet and free to be split (no constraints file pins it)."""
    return (
        piece.rows is None and piece.columns == (0, piece.table.dim) and not piece.replicated and not piece.restricted
    )


def _distinct_least_loaded(
    heap: list[tuple[float, int]], loads: list[float], free: list[int], pieces: list[_Piece]
) -> list[tuple[_Piece, int]] | None:
    """Each of `pieces` on the least loaded device with room for it, never two on one (`_least_loaded_with_room`:
    the devices found are taken off `heap`); None where one finds none."""
    taken = []
    for piece in pieces:
        device = _least_loaded_with_room(heap, loads, free, piece)
        if device is None:
            return None
        taken.append((piece, device))
    return taken


def _slices_with_room(
    heap: list[tuple[float, int]], loads: list[float], free: list[int], pieces: list[_Piece], at: list[int] | None
) -> list[tuple[_Piece, int]] | None:
    """Where `_finish` puts a later table's slices (`pieces`, described): row-wise blocks each on its own device of
    `at`, column slices on the least loaded devices, one a device (`_distinct_least_loaded`); None where one finds no
    room (or there are none)."""
    if not pieces:
        return None
    if at is not None:
        return list(zip(pieces, at)) if all(free[k] >= p.need for p, k in zip(pieces, at)) else None
    return _distinct_least_loaded(heap, loads, free, pieces)


class PlacementState:
    """One task being placed piece by piece under the cost models; each step scores `options()`."""

    def __init__(
        self,
        tables: list[TableSpec],
        topology: Topology,
        models: CostModels,
        candidates: int = CANDIDATES,
        lower_bound: LowerBound | None = None,
    ) -> None:
        """`lower_bound`: the task's (`shard_ray.costmodel.bounds.lower_bound`), where the caller has it."""
        if not tables:
            raise ShardRayError("a placement task needs at least one table")
        self.topology = topology
        self.models = models
        self.pricer = Pricer(models, topology)
        # Each table whole: one no device holds whole comes first, offered the splits while every device has room for
        # them (pre-split by rows, as `pieces_to_place` gives it the searches, five 40M-row tables of MLPerf on 64
        # devices of 16 GB priced 1.39x `cost_search`'s plan, which splits four by columns).
        pieces_to_place(tables, topology)  # refuses a table no split fits, and tables more than the devices hold
        pieces = [TablePiece.whole(table) for table in tables]
        singles = single_costs(self.pricer, pieces)
        self._pieces: dict[tuple, _Piece] = {}
        self._describe(pieces)
        d, kinds = topology.num_devices, len(COLLECTIVE_TYPES)
        # Each sharding type's columns and input columns per device, the table-row-wise partial sums, and the pieces
        # of each type: what every device's collectives are priced from (`_collectives`).
        self.widths = np.zeros((kinds, d))
        self.inputs = np.zeros((kinds, d))
        self.host_sums = np.zeros(d)
        self.of_kind = np.zeros(kinds, dtype=np.int64)
        # Costliest first, a piece's cost being its compute alone and what it adds to its device's all-to-alls
        # (`_rates_over` all the pieces): ordered by compute alone, wide tables of little compute came last, where each
        # made the device it went to the slowest (docs/results.md).
        described = [self._pieces[p.key] for p in pieces]
        per_width, per_input = self._rates_over(described)
        charges = _Pieces.of(described).charges(per_width, per_input)
        cap = topology.memory_bytes
        order = np.lexsort((-(singles + charges), [p.need <= cap for p in described]))  # those no device holds first
        self.queue = [pieces[i] for i in order]  # the pieces in placing order; a column split queues its slices
        self.queue_singles = [float(singles[i]) for i in order]
        self.position = 0  # the current piece's place in the queue
        self.singles_left = float(singles.sum())  # the predicted single costs of the queue from the current piece on
        self.singles_total = self.singles_left
        # `_finishing_slices`' by piece and whether by rows, `_joining_slices`' by piece and host
        self._later_slices: dict[tuple, _Slices] = {}
        self._fitting_slices: dict[tuple, _Slices] = {}  # `_fitting_columns`, by piece
        # the devices holding a piece that dominates the task (`dominance`): no finished plan costs less than they do
        self._dominant_on: set[int] = set()
        self._ways: tuple[int, list[_LaterSplit]] | None = None  # `_later_splits`' at a position
        self.queue_described = [described[i] for i in order]  # the queue's pieces as `_describe` has them
        self._crowding: list[int] = []  # the queue's positions of pieces needing more than half a device
        self._find_crowding()
        self._queue_pieces: _Pieces | None = None  # `queue_described` as arrays, for the finished plans (`_finish`)
        self._queue_needs: tuple[list[int], list[bool]] = ([], [])  # and their needs and `anywhere`, as Python lists
        self.bound = task_lower_bound(models, tables, topology) if lower_bound is None else lower_bound
        self.task_width = float(sum(t.dim for t in tables))
        self.sums = np.zeros((d, described[0].encoding.shape[0]), dtype=np.float32)
        self.counts = np.zeros(d, dtype=np.float32)
        self.ledger = MemoryLedger(topology)
        self.feature_sums = np.zeros((d, NUM_TABLE_FEATURES), dtype=np.float64)
        self.compute_ms = np.zeros((d, 2))
        self.kind_comm = np.zeros((kinds, d))  # each set's all-to-alls (pooled and input) per device, ms
        self.host_ms = np.zeros(d)  # table-row-wise partial sums added up inside the host, ms
        self.comm_ms = np.zeros(d)
        self.holding: dict[str, set[int]] = {}  # the devices holding a piece of each table
        self.placed: list[TablePiece] = []
        self.assign: list[int] = []
        self.cost = 0.0
        self.max_candidates = candidates
        # What a step computes once and reads several times, cleared when the next step begins (`_new_step`).
        self._action_mask: np.ndarray | None = None
        self._option_mask: np.ndarray | None = None
        self._candidates: np.ndarray | None = None
        self._what_if: tuple[np.ndarray, np.ndarray] | None = None
        self._splits: list[tuple[Option, _Split]] | None = None
        # `observe_wave`'s candidates [K, C], their what-if rows [K * C, 3] and its pieces, for `place_wave`
        self._wave: tuple[np.ndarray, np.ndarray, _Pieces] | None = None
        # Where splits are offered: the device the prior prefers for the piece whole (`_best_whole`), and the plan
        # finished greedily after it there (`finish`).
        self._whole: tuple[int | None, float] = (None, math.inf)
        self.split_offers = 0  # the tables offered splits so far
        # at most this many (`SPLIT_TABLES`); every one where there are no more tables than devices (few later pieces to
        # finish, and whole tables would leave devices idle)
        self.few_tables = len(tables) <= topology.num_devices
        self.split_tables = len(tables) if self.few_tables else SPLIT_TABLES

    def _describe(self, pieces: list[TablePiece]) -> None:
        """Encode and size the pieces not yet known, all at once."""
        new = list({p.key: p for p in pieces if p.key not in self._pieces}.values())
        if not new:
            return
        encodings, sizes, features = self.pricer.encodings(new), self.pricer.sizes(new), self.pricer.features(new)
        for k, p in enumerate(new):
            self._pieces[p.key] = _Piece(
                encodings[k], float(sizes.widths[k]), float(sizes.inputs[k]), float(sizes.host_sums[k]),
                int(sizes.need[k]), sizes.allowed[k], bool(sizes.allowed[k].all()), int(sizes.kinds[k]), features[k],
            )  # fmt: skip

    def _find_crowding(self) -> None:
        half = self.topology.memory_bytes / 2
        self._crowding = [k for k, p in enumerate(self.queue_described) if p.need > half]

    def _crowding_needs(self, after: int) -> list[int]:
        """The needs of the queue's pieces past position `after` that need more than half a device."""
        return [self.queue_described[k].need for k in self._crowding[bisect.bisect_right(self._crowding, after) :]]

    @property
    def done(self) -> bool:
        return self.position == len(self.queue)

    @property
    def piece(self) -> TablePiece:
        """The piece the current step places."""
        return self.queue[self.position]

    def _current(self) -> _Piece:
        return self._pieces[self.piece.key]

    def action_mask(self) -> np.ndarray:
        """Devices with room for the current piece, among those it may go to (one, for a row block), holding none of
        its table (two column slices on one device would run its lookups twice); of those, where any do, the ones that
        leave room for the later pieces needing more than half a device (`_keeps_room`)."""
        if self._action_mask is None:
            current = self._current()
            mask = self.ledger.room(current.need) & current.allowed
            holding = self.holding.get(self.piece.table.name)
            if holding:
                mask[list(holding)] = False
            later = self._crowding_needs(self.position)
            if later and mask.any():
                keeping = mask & _keeps_room(self.ledger.free, current.need, sorted(later, reverse=True))
                mask = keeping if keeping.any() else mask
            self._action_mask = mask
        return self._action_mask

    def _device_totals(self) -> np.ndarray:
        return self.compute_ms.sum(axis=1) + self.comm_ms

    def candidates(self) -> np.ndarray:
        """The devices scored for the current piece, ascending: every device, up to `max_candidates` of them; on
        more, among those with room for it, half the least loaded by predicted step and the rest the roomiest
        (each by device index on ties)."""
        if self._candidates is None:
            self._candidates = self._choose_candidates(self.action_mask())
        return self._candidates

    def _choose_candidates(self, mask: np.ndarray, at_least: int = 0) -> np.ndarray:
        """Every device, or on more devices than the candidates, half the most (`max_candidates`, or `at_least` where
        that is more: a split's slices need a device each) among the devices of `mask`, the least loaded, and half the
        roomiest."""
        most = max(self.max_candidates, at_least)
        chosen = np.arange(len(mask))
        if len(mask) > most:
            chosen = np.flatnonzero(mask)
        if len(chosen) > most:
            half = most // 2
            least_loaded = chosen[np.argsort(self._device_totals()[chosen], kind="stable")[:half]]
            others = np.ones(len(mask), dtype=bool)
            others[least_loaded] = False
            rest = chosen[others[chosen]]
            roomiest = rest[np.argsort(-self.ledger.free[rest], kind="stable")[: most - half]]
            chosen = np.sort(np.concatenate([least_loaded, roomiest]))
        return chosen

    def options(self) -> list[Option]:
        """The current step's actions, in the observation's row order: its candidate devices, then the splits offered."""
        return [Option(device=int(c)) for c in self.candidates()] + [option for option, _ in self.splits()]

    def what_if(self) -> np.ndarray:
        """Predicted (fwd, bwd, comm) ms of each candidate device were the current piece put there."""
        if self._what_if is None:
            self._what_if = self._rows_if([self._current()], self.candidates()[None])
        return self._what_if[0]

    def _rows_if(self, pieces: list[_Piece], devices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (fwd, bwd, comm) ms [K * C, 3] of `devices` [K, C] were each of `pieces` [K] (of one sharding type)
        put on the devices of its row, and the comm of its type's set alone [K * C]: every row priced in one call of
        each model."""
        d, k, per = self.topology.num_devices, pieces[0].kind, devices.shape[1]
        flat = devices.reshape(-1)
        encodings = np.repeat(np.stack([p.encoding for p in pieces]), per, axis=0)
        compute = self.models.compute_from_sums(self.sums[flat] + encodings, self.counts[flat] + 1)
        own = comm = np.zeros(len(flat))
        if d > 1:
            width, received = np.array([p.width for p in pieces]), np.array([p.input for p in pieces])
            widths = (self.widths[k, devices] + width[:, None]).reshape(-1)
            inputs = (self.inputs[k, devices] + received[:, None]).reshape(-1)
            widest = np.maximum(self.widths[k].max(), widths)
            most = np.maximum(self.inputs[k].max(), inputs)
            totals = np.repeat([self.widths[k].sum() + width, self.inputs[k].sum() + received], per, axis=1)
            own = self.pricer.output_and_input_rows(widths, inputs, totals, np.stack([widest, most]), d)
            comm = own + self._other_comm(k, flat)
        return np.concatenate([compute, comm[:, None]], axis=1), own

    def _other_comm(self, kind: int, devices: np.ndarray) -> np.ndarray | float:
        """What `devices` pay for collectives besides the set of type `kind`, with a piece of that type added."""
        others = self.of_kind > 0
        sets = int(others.sum()) + (not others[kind])
        others[kind] = False
        if not others.any() and not self.host_sums.any():
            return 0.0
        paid = self.kind_comm[others][:, devices].sum(axis=0) + self.host_ms[devices]
        return paid + self.pricer.types_overhead(sets).sum()

    def _collectives(
        self, widths: np.ndarray, inputs: np.ndarray, host_sums: np.ndarray, of_kind: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every device's all-to-alls [types, D] set by set, its table-row-wise host sums [D] and its comm in all [D],
        as `Pricer.device_parts` prices a plan."""
        d = self.topology.num_devices
        kind_comm, host_ms = np.zeros_like(widths), np.zeros(d)
        present = np.flatnonzero(of_kind)
        if len(present):  # the sets priced together, each as alone (`Pricer.collectives` prices stacks so)
            kind_comm[present] = self.pricer.collectives(widths[present]).sum(axis=-1)
            kind_comm[present] += self.pricer.input_dist(inputs[present])
        if host_sums.any():
            per_host = self.topology.devices_per_host_or_all
            host_ms = host_reduce(self.models, host_sums, self.topology.batch_size, per_host).sum(axis=1)
        comm = kind_comm[present].sum(axis=0) + host_ms + self.pricer.types_overhead(len(present)).sum()
        return kind_comm, host_ms, comm

    def _splits_offered(self) -> tuple[str, ...]:
        """The sharding types the current piece is offered, of `SPLITS`: every one to a table that dominates the
        task or that no device holds whole; where a row-wise set of collectives already runs (a table too big for
        any device went row-wise, say), the row-wise ones, so that a table may join that set rather than keep a set
        of its own going beside it; none to a piece of a table."""
        piece = self.piece
        if self.topology.num_devices == 1 or not _whole_table(piece):
            return ()
        if not self.action_mask().any():
            return SPLITS
        if self.split_offers >= self.split_tables:
            return ()
        if self.queue_singles[self.position] >= self.dominance:
            return SPLITS
        return self._sets_to_join()

    def _sets_to_join(self) -> tuple[str, ...]:
        """The splits by which a whole table that does not dominate the task may join a set of collectives already
        running rather than start one of its own: the row-wise ones where a row-wise set runs; column-wise where a
        column-wise set runs in a task of no more tables than devices (whole, its small tables would pay a
        table-wise set beside it: 6 tables on 16 devices, 1.30x `cost_search`'s plan, which split every one)."""
        rows = ("row_wise", "table_row_wise") if self.of_kind[_ROW_KINDS].any() else ()
        columns = ("column_wise",) if self.few_tables and self.of_kind[_COLUMN_KIND] else ()
        return columns + rows

    @property
    def lower_bound(self) -> float:
        """The task's lower bound, ms: what observations and rewards are divided by."""
        return self.bound.ms

    @property
    def dominance(self) -> float:
        """A piece dominates the task where its predicted cost alone (its compute) is at least this: `SPLIT_SHARE` x
        the lower bound's compute. Whole, it makes its device's compute at least that, and every device pays at least
        the bound's collectives: its device is then at least the bound. (Against the whole bound, which holds the
        all-to-alls since they are priced as plans are, no table of Criteo Kaggle's 26 dominated 64 devices: the
        policy kept them whole, 1.07x `cost_search`'s plan.)"""
        return SPLIT_SHARE * self.bound.compute

    def splits(self) -> list[tuple[Option, _Split]]:
        """The splits offered to the current piece (`_splits_offered`), each priced, and the plan finished greedily
        after it."""
        if self._splits is None:
            self._splits = []
            offered = self._splits_offered()
            if offered:
                self.split_offers += 1
                table, topology = self.piece.table, self.topology
                options = table_options(table, topology, allowed=offered)
                if "column_wise" in options:
                    self._splits.append((Option(split="column_wise"), self._price_slices(options["column_wise"])))
                    quarters = split_piece(self.piece, 4)
                    if quarters is not None and topology.num_devices >= 4 and len(options["column_wise"]) == 2:
                        self._splits.append((Option(split="column_wise"), self._price_slices(quarters)))
                if "row_wise" in options:
                    blocks = options["row_wise"]
                    self._splits.append((Option(split="row_wise"), self._price_split(blocks)))
                if "table_row_wise" in options:
                    per_host = topology.devices_per_host_or_all
                    slowest = self._device_totals().reshape(topology.num_hosts, per_host).max(axis=1)
                    for host in np.argsort(slowest, kind="stable")[:SPLIT_HOSTS]:
                        blocks = table_row_wise(table, per_host, int(host))
                        self._splits.append((Option(split="table_row_wise", host=int(host)), self._price_split(blocks)))
                for _, split in self._splits:
                    if split.fits:
                        split.finished = self.finish(split.pieces, split.devices)
                whole = self._best_whole()
                self._whole = (whole, math.inf if whole is None else self.finish([self.piece], np.array([whole])))
        return self._splits

    def _best_whole(self) -> int | None:
        """The candidate device the prior prefers for the piece whole (the plan's cost raised least, then the device's
        total with it), if any has room."""
        mask = self.action_mask()[self.candidates()]
        if not mask.any():
            return None
        with_table = self.what_if().sum(axis=1)
        raised = np.maximum(with_table, self.cost)
        order = np.lexsort((with_table, raised))
        return int(self.candidates()[next(k for k in order if mask[k])])

    def finish(self, pieces: list[TablePiece], devices: np.ndarray) -> float:
        """The predicted cost of the plan with `pieces` on `devices`, finished greedily (`_finish`): the lowest of the
        later pieces each put whole and, where a later table dominates the task, those tables split in each of the ways
        `_later_splits` lists. Put whole, such a table's cost alone is the finished plan's cost whatever comes before
        it, so that every earlier choice would be priced alike (a table halved where quarters were cheaper, say); split
        always, a later table would pay a set of collectives its own step may not choose (beside a row-wise set,
        say). Ways that split the same later tables the same way finish alike and are priced once."""
        start = self._finish_start(pieces, devices)
        later = np.asarray(self.queue_singles[self.position + 1 :])
        dominant = float(later.max(initial=0.0))
        priced: dict[tuple[bool, bytes], list[tuple[float, bool, bool]]] = {}

        def finished(dominates: float, by_rows: bool, joining: str | None = None) -> list[tuple[float, bool, bool]]:
            # where a later table found room nowhere, finished by rows, also the plan finished with such tables in the
            # column slices their steps are offered (`columns_first`), the lower standing
            ways = [self._finish(start, dominates, by_rows, joining)]
            if ways[0][2]:
                ways.append(self._finish(start, dominates, by_rows, joining, columns_first=True))
            return ways

        def price(threshold: float, by_rows: bool) -> list[tuple[float, bool, bool]]:
            # `_finish` reads its threshold only as which later pieces reach it: those, and the way, are what it prices
            key = (by_rows, np.flatnonzero(later >= threshold).tobytes())
            if key not in priced:
                priced[key] = finished(threshold, by_rows)
            return priced[key]

        # Where there are no more tables than devices, every later table may join a column-wise set (`_sets_to_join`):
        # finished with them all split, a step's choice that starts or joins that set is priced as the steps after it
        # may make it.
        ways = list(price(0.0, by_rows=False)) if self.few_tables else []
        if self.few_tables and self.topology.num_hosts > 1 and self._joins_rows(start):
            ways += finished(0.0, by_rows=False, joining="table_row_wise")
            if self._only_row_wise_runs(start.besides):
                ways += finished(0.0, by_rows=False, joining="row_wise")
        if dominant < self.dominance:
            ways += finished(math.inf, by_rows=False)
        else:
            thresholds = [(way, self._split_threshold(way, start)) for way in self._later_splits()]
            split = [finish for way, at in thresholds if at is not None for finish in price(at, way.by_rows)]
            # Put whole, the costliest later table alone prices the finished plan at least that (the models are
            # monotone in what a device holds): a split finish below it is the lower one, without pricing the other.
            if min((ms for ms, _, _ in split), default=math.inf) >= dominant:
                split += price(math.inf, by_rows=False)
            ways += split
        # Where every way overfilled a device, the steps would find no option for some later table: the price adds
        # what an episode stuck pays (few huge tables on 64 devices of 8 GiB: a split priced lowest got stuck so).
        # Where one way has room, an overfilled way's price stands: the steps may split what this finish does not.
        stuck = INFEASIBLE_PENALTY * self.lower_bound if all(overfilled for _, overfilled, _ in ways) else 0.0
        return min(ms for ms, _, _ in ways) + stuck

    def _later_splits(self) -> list[_LaterSplit]:
        """The ways `finish` splits the later tables that dominate the task (`_LaterSplit`), each way priced and the
        lowest kept: every one in column slices; only those costlier alone than the slowest device, in column slices;
        only those costlier alone than the level the devices reach (`to_level`), likewise; and, where one of those is a
        table of its lookups (`costs_its_lookups`), the last two with that one by rows. The first alone split tables a
        step would keep whole; the second alone, or by rows alone, priced plans of 64 devices higher on one pool or the
        other; without the level, a table's options whose finish starts with few pieces placed (the slowest device far
        below where the plan ends) split every later table above it, a column-wise set on every device
        (docs/results.md)."""
        if self._ways is None or self._ways[0] != self.position:
            ways = [_LaterSplit(above_slowest=False, by_rows=False)]
            by_rows = (False, True) if self._later_by_rows(self.dominance) else (False,)
            ways += [_LaterSplit(True, rows, level) for rows in by_rows for level in (False, True)]
            self._ways = (self.position, ways)
        return self._ways[1]

    def _finish_start(self, pieces: list[TablePiece], devices: np.ndarray) -> _FinishStart:
        """What every way of finishing the plan with `pieces` on `devices` starts from (`_FinishStart`)."""
        loads, free = self._device_totals().tolist(), self.ledger.free.tolist()
        besides = [self._pieces[p.key] for p in pieces]
        rows = _Pieces.of(besides)
        alone = self.models.compute_from_sums(rows.encodings, np.ones(len(besides)))
        besides_singles = alone.sum(axis=1).tolist()
        at = [int(a) for a in devices]
        for described, device, single in zip(besides, at, besides_singles):
            free[device] -= described.need
            loads[device] += single
        return _FinishStart(loads, free, besides, besides_singles, at, rows)

    def _split_threshold(self, way: _LaterSplit, start: _FinishStart) -> float | None:
        """The cost alone from which `way` splits a later table in the finish from `start`: the lower bound's share
        (`dominance`), or with `above_slowest` the slowest device's load, or with `to_level` the devices' mean load
        once the later pieces' costs alone are added; None where the way would split the same tables as another of
        `_later_splits` (no device above the share; the level not above the slowest device; by rows, no such table
        going by rows)."""
        if not way.above_slowest:
            return self.dominance
        threshold = slowest = max(start.loads)
        if way.to_level:
            later = self.singles_left - self.queue_singles[self.position]
            threshold = (sum(start.loads) + later) / self.topology.num_devices
            if threshold <= slowest:
                return None
        if threshold <= self.dominance:
            return None
        if way.by_rows and not self._later_by_rows(threshold):
            return None
        return threshold

    def _later_by_rows(self, bound: float) -> bool:
        """Whether a later table whose cost alone reaches `bound` goes by rows (`_goes_by_rows`), asked of them in the
        queue's order: the costs compared at once, as most of thousands of later pieces are below it."""
        later = self.position + 1
        above = np.flatnonzero(np.asarray(self.queue_singles[later:]) >= bound).tolist()
        return any(self._goes_by_rows(self.queue[later + k], self.queue_singles[later + k]) for k in above)

    def _finish(
        self,
        start: _FinishStart,
        dominates: float,
        by_rows: bool,
        joining: str | None = None,
        columns_first: bool = False,
    ) -> tuple[float, bool, bool]:
        """The predicted cost of the plan begun at `start` (`_finish_start`) and the queue's later pieces each put
        whole, in turn, on the device with room whose pieces' costs alone add up to the least, a table with room
        nowhere by rows (`_blocks_with_room`), and the later tables whose costs alone reach `dominates` split
        (`_finishing_slices`, by rows where `by_rows` allows): a column slice a device, on the least loaded with room,
        or a row-wise block on each device: how a split's price shows past its own step (its sets of collectives every
        device pays, whatever comes next); and whether it overfilled a device (put a table where neither it nor the
        column slices its step would be offered find room), and whether a table found room nowhere whole; with
        `columns_first` such a table goes in the column slices its step is offered where they find room.

        Where at least as many pieces are still to come as there are devices, the plan so finished costs what the
        models price its mean device at, or any device holding a piece that dominates the task, if more; not its
        slowest device. The greedy balances sums of costs alone, while the models price a fused shard below its pieces'
        costs alone and all-to-alls unevenly in width, so its slowest device sits above what the steps reach, each
        placing a piece by the models' own price: on 512 devices 21% above the mean, every option of a dominant table
        at about one price (docs/results.md). A device holding a dominant piece costs at least that piece whatever the
        steps do; with fewer pieces to come than devices, there is too little left to even the devices out, and the
        slowest device is the price. Balancing each piece's all-to-alls too, as this finish did when it priced the
        slowest device, gave the same plans on 68 of 70 tasks in a quarter (512 devices) to three quarters (64) more
        placing time."""
        d = self.topology.num_devices
        # Python numbers, not numpy's: the loop below does a few scalar operations for each of the task's pieces.
        loads, free = list(start.loads), list(start.free)
        # What the plan adds, in order: rows of the queue's pieces (`_queue_pieces`) and, past them, of `besides` (the
        # pieces placed, then any later table split: their arrays part by part), each on its device in `at`.
        queued = len(self.queue)
        besides, besides_singles, at = [start.pieces], list(start.besides_singles), list(start.at)
        rows = list(range(queued, queued + len(besides_singles)))
        later = self.position + 1
        if self._queue_pieces is None:
            self._queue_pieces = _Pieces.of(self.queue_described)
            self._queue_needs = ([p.need for p in self.queue_described], [p.anywhere for p in self.queue_described])
        heap = _heap_of(loads)
        crowding = set(self._crowding[bisect.bisect_right(self._crowding, self.position) :])
        room = _Room(free, self._crowding_needs(self.position)) if crowding else None
        replace, add_row, add_at = heapq.heapreplace, rows.append, at.append  # the loop's calls, looked up once
        overfilled = False  # whether a table went where it has no room
        no_room = False  # whether a whole table found room nowhere

        def add_besides(placed: list[tuple[_Piece, int]], singles: list[float], pieces: _Pieces) -> None:
            # `pieces`: the rows of `placed`'s pieces, in its order
            rows.extend(range(queued + len(besides_singles), queued + len(besides_singles) + len(placed)))
            at.extend(device for _, device in placed)
            besides.append(pieces)
            besides_singles.extend(singles)

        def put_slices(taken: list[tuple[_Piece, int]], slices: _Slices) -> None:
            for (sliced, device), alone in zip(taken, slices.singles):
                loads[device] += alone
                free[device] -= sliced.need
                heapq.heappush(heap, (loads[device], device))
            add_besides(taken, slices.singles, slices.rows)
            if room is not None:
                room.recount(free)

        needs, anywhere = self._queue_needs
        for row, single, need, free_to_go in zip(
            range(later, queued), self.queue_singles[later:], needs[later:], anywhere[later:]
        ):
            if room is not None and row in crowding:
                room.reached(need, free)
                room = room if room.needs else None
            # the common case, as `_least_loaded_with_room` would find it: the least loaded device has room
            load, device = heap[0]
            crossing = room is not None and room.crosses(free[device], need)
            if (
                single < dominates
                and load == loads[device]
                and free[device] >= need
                and (free_to_go or self.queue_described[row].allowed[device])
                and (not crossing or room.allows(free[device], need))
            ):
                if crossing:
                    room.take(free[device], need)
                loads[device] = load = load + single
                free[device] -= need
                replace(heap, (load, device))
                add_row(row)
                add_at(device)
                continue
            piece, described = self.queue[row], self.queue_described[row]
            if single < dominates:
                slices = NO_SLICES
            elif joining:
                slices = self._joining_slices(piece, single, loads, joining)
            else:
                slices = self._finishing_slices(piece, single, by_rows)
            taken = _slices_with_room(heap, loads, free, slices.described, slices.at)
            if taken is not None:
                put_slices(taken, slices)
                continue
            if slices.pieces:  # a slice found no room: the devices taken off the heap go back, the table whole
                heap = _heap_of(loads)
            device = _least_loaded_with_room(heap, loads, free, described, room)
            if device is None and room is not None and room.keeping:  # no device leaves the room: it is given up
                room.keeping = False
                device = _least_loaded_with_room(heap, loads, free, described)
            if device is not None:
                if room is not None and room.crosses(free[device], described.need):
                    room.take(free[device], described.need)
                loads[device] += single
                free[device] -= described.need
                heapq.heappush(heap, (loads[device], device))
                add_row(row)
                add_at(device)
                continue
            # A table with room nowhere goes by rows, as a step would split it to fit: over hosts table-row-wise on
            # the host whose devices' loads add up to the least where its blocks fit there (row-wise beside a
            # table-row-wise set, the finish priced MLPerf DLRM-DCNv2's 40M-row tables table-row-wise over 2 hosts of
            # 8 devices of 8 GiB at 16.3 ms, where `cost_search` reaches 9.84 with them so), else row-wise. Where no
            # blocks fit, on the roomiest device all the same: the finished plan prices what comes after a choice, and
            # whether a later piece finds room depends on choices this greedy finish does not make (steps mask them).
            # Where not even the column slices its step is offered find room, the steps would find no option for it:
            # the finish is overfilled, and priced so below. With `columns_first`, such a table goes in those column
            # slices where they find room (`finish` prices both: by rows alone, MLPerf DLRM-DCNv2's 40M-row tables on
            # 8 devices of 16 GiB finished every option of the first at 21-24 ms, where column quarters lead to 17.3).
            no_room = no_room or _whole_table(piece)  # a piece of a table has no column slices to try
            columns = self._fitting_columns(piece) if columns_first and _whole_table(piece) else NO_SLICES
            taken = _slices_with_room(heap, loads, free, columns.described, columns.at)
            if taken is not None:
                put_slices(taken, columns)
                continue
            if columns.pieces:  # the devices taken off the heap go back
                heap = _heap_of(loads)
            found = self._blocks_with_room(piece, single, heap, loads, free)
            if found is None:
                overfilled = overfilled or not self._column_slices_fit(piece, free)
                device = int(np.argmax(np.where(described.allowed, free, np.iinfo(np.int64).min)))
                loads[device] += single
                free[device] -= described.need
                heap = _heap_of(loads)
                if room is not None:
                    room.recount(free)
                add_row(row)
                add_at(device)
                continue
            placed, blocks = found
            for (block, device), alone in zip(placed, blocks.singles):
                free[device] -= block.need
                loads[device] += alone
            add_besides(placed, blocks.singles, blocks.rows)
            heap = _heap_of(loads)
            if room is not None:
                room.recount(free)
        added = _Pieces.joined([self._queue_pieces, *besides]).rows(np.array(rows, dtype=np.int64))
        devices_at = np.array(at, dtype=np.int64)
        sums = self.sums.copy()
        np.add.at(sums, devices_at, added.encodings)
        counts = self.counts + np.bincount(devices_at, minlength=d)
        _, _, comm = self._collectives(*self._loads_with(added, devices_at))
        totals = self.models.compute_from_sums(sums, counts).sum(axis=1) + comm
        if queued - later < d:
            return float(totals.max()), overfilled, no_room
        singles_at = np.concatenate([self.queue_singles, besides_singles])[rows]
        dominant_on = self._dominant_on.union(devices_at[singles_at >= self.dominance].tolist())
        return float(max(totals.mean(), max((totals[k] for k in dominant_on), default=0.0))), overfilled, no_room

    def _rates_over(self, left: list[_Piece]) -> tuple[np.ndarray, np.ndarray]:
        """Each sharding type's all-to-all ms per float column of width and per input column of a piece on a device:
        how much one device's price rises over the others' (a column more on every device would raise them all alike),
        at the widths and inputs the pieces `left` will bring, spread evenly over the devices (the price is not linear
        in them); by finite differences on device 0."""
        d, kinds = self.topology.num_devices, len(self.widths)
        of_left = np.array([p.kind for p in left], dtype=np.int64)
        widths = self.widths + np.bincount(of_left, [p.width for p in left], kinds)[:, None] / d
        inputs = self.inputs + np.bincount(of_left, [p.input for p in left], kinds)[:, None] / d
        per_width, per_input = np.zeros(kinds), np.zeros(kinds)
        for k in range(kinds):
            of_kind = self.of_kind.copy()
            of_kind[k] = max(of_kind[k], 1)  # the set the piece would join, priced as running
            _, _, before = self._collectives(widths, inputs, self.host_sums, of_kind)
            for rates, loads, least in ((per_width, widths, 64.0), (per_input, inputs, 1.0)):
                step = max(float(loads[k].mean()), least)
                more = loads.copy()
                more[k, 0] += step
                priced = (more, inputs) if loads is widths else (widths, more)
                _, _, after = self._collectives(*priced, self.host_sums, of_kind)
                rise = after - before
                rates[k] = max(rise[0] - (float(np.median(rise[1:])) if d > 1 else 0.0), 0.0) / step
        return per_width, per_input

    def _finishing_slices(self, piece: TablePiece, single: float, by_rows: bool) -> _Slices:
        """How `_finish` splits a later piece that dominates the task (offered the splits when its step comes,
        `_splits_offered`), and each slice's predicted cost alone: a whole table in column quarters on 4 devices or
        more, else halves, described; with `by_rows`, where a column slice costs most of the table alone
        (`costs_its_lookups`), in row-wise blocks, one a device; none for a piece of a table or where its columns do
        not split so."""
        if not _whole_table(piece):
            return NO_SLICES
        if (piece.key, by_rows) not in self._later_slices:
            d = self.topology.num_devices
            slices = (split_piece(piece, 4) if d >= 4 else None) or split_piece(piece, 2) or []
            singles = single_costs(self.pricer, slices).tolist() if slices else []
            if by_rows and costs_its_lookups(singles, single):
                slices = row_wise(piece.table, d)
                singles = single_costs(self.pricer, slices).tolist()
            self._later_slices[(piece.key, by_rows)] = self._slices(slices, singles)
        return self._later_slices[(piece.key, by_rows)]

    def _slices(self, pieces: list[TablePiece], singles: list[float]) -> _Slices:
        """`pieces` with their costs alone `singles`, described (`_Slices`)."""
        self._describe(pieces)
        described = [self._pieces[p.key] for p in pieces]
        at = [p.devices[0] for p in pieces] if pieces and pieces[0].devices else None
        return _Slices(pieces, singles, described, _Pieces.of(described) if described else None, at)

    def _least_loaded_host(self, loads: list[float]) -> int:
        """The host whose devices' `loads` add up to the least (the first of a tie)."""
        per_host = self.topology.devices_per_host_or_all
        return int(np.argmin(np.add.reduceat(loads, np.arange(0, self.topology.num_devices, per_host))))

    def _blocks_with_room(
        self, piece: TablePiece, single: float, heap: list[tuple[float, int]], loads: list[float], free: list[int]
    ) -> tuple[list[tuple[_Piece, int]], _Slices] | None:
        """Where `_finish` puts a later piece that fits no device whole (its cost alone `single`): its table's row
        blocks, one a device (`_slices_with_room`), of the first way whose blocks all find room in `free`: over hosts
        table-row-wise on the host whose devices' `loads` add up to the least, then row-wise (`_joining_blocks`); with
        the blocks; None where neither fits or the piece is a block already."""
        if piece.rows is not None:
            return None
        hosts = [self._least_loaded_host(loads)] if self.topology.num_hosts > 1 else []
        for host in [*hosts, -1]:
            blocks = self._joining_blocks(piece, single, host)
            placed = _slices_with_room(heap, loads, free, blocks.described, blocks.at)
            if placed is not None:
                return placed, blocks
        return None

    def _only_row_wise_runs(self, besides: list[_Piece]) -> bool:
        """Whether a row-wise set of collectives runs and no table-row-wise one once `besides` are placed."""
        kinds = {int(k) for k in np.flatnonzero(self.of_kind)} | {p.kind for p in besides}
        return _ROW_KINDS[0] in kinds and _ROW_KINDS[1] not in kinds

    def _fitting_columns(self, piece: TablePiece) -> _Slices:
        """The column slices a step would offer `piece`, a whole table (`table_options`: the fewest that fit a device),
        with each one's cost alone; none where its columns do not split so."""
        if piece.key not in self._fitting_slices:
            slices = table_options(piece.table, self.topology, allowed=("column_wise",)).get("column_wise", [])
            singles = single_costs(self.pricer, slices).tolist() if slices else []
            self._fitting_slices[piece.key] = self._slices(slices, singles)
        return self._fitting_slices[piece.key]

    def _column_slices_fit(self, piece: TablePiece, free: list[int]) -> bool:
        """Whether the column slices a step would offer `piece` (`_fitting_columns`), a whole table, find devices with
        room for them, one a device, in `free`."""
        if not _whole_table(piece):
            return False
        needs = sorted((s.need for s in self._fitting_columns(piece).described), reverse=True)
        roomiest = sorted(free, reverse=True)[: len(needs)]
        return bool(needs) and len(roomiest) == len(needs) and all(f >= n for f, n in zip(roomiest, needs))

    def _joins_rows(self, start: _FinishStart) -> bool:
        """Whether a row-wise or table-row-wise set runs once the option `start` begins from is taken."""
        return bool(self.of_kind[_ROW_KINDS].any()) or any(p.kind in _ROW_KINDS for p in start.besides)

    def _joining_slices(self, piece: TablePiece, single: float, loads: list[float], by: str) -> _Slices:
        """How `_finish` splits a later table to join the row set every device pays for already over hosts
        (`_joins_rows`), `by` table-row-wise on the host whose devices' loads add up to the least, or row-wise; with
        each block's cost alone. Priced so where there are no more tables than devices, the tables a step keeps whole
        beside a row set are priced as the steps after it may take them: on MLPerf DLRM-DCNv2's tables over 8 hosts of 8
        devices each table's table-row-wise option finished at the price of keeping it whole, the later tables whole,
        and the policy kept most whole, priced 6.55 ms, where every table table-row-wise prices 4.60
        (docs/results.md). Joining a row-wise set table-row-wise adds a set of its own, and `finish` prices both where
        only a row-wise set runs: on few huge tables over 8 hosts of 8 devices of 8 GiB the row-wise options finished
        at 7.90 ms table-row-wise, where every table row-wise prices 6.62; on a few-tables task of the generator's
        pool over hosts of 8, every later table row-wise over 64 devices finished at 12.96 ms, table-row-wise at 8.49.
        On one host, the later tables row-wise changed no plan measured and added a third to the placing time."""
        if not _whole_table(piece):
            return NO_SLICES
        return self._joining_blocks(piece, single, -1 if by == "row_wise" else self._least_loaded_host(loads))

    def _joining_blocks(self, piece: TablePiece, single: float, host: int) -> _Slices:
        """The row blocks of `piece`'s table that `_joining_slices` and `_blocks_with_room` put, row-wise (`host` -1) or
        table-row-wise on `host`, made once, each costing a share of `single`: on a host past the first, the first
        host's blocks moved to its devices (`_moved_to_host`)."""
        key = (piece.key, "joining", host)
        if key not in self._later_slices:
            if host > 0:
                self._later_slices[key] = self._moved_to_host(self._joining_blocks(piece, single, 0), host)
            else:
                per_host = self.topology.devices_per_host_or_all
                blocks = (
                    row_wise(piece.table, self.topology.num_devices)
                    if host < 0
                    else table_row_wise(piece.table, per_host, 0)
                )
                self._later_slices[key] = self._slices(blocks, np.full(len(blocks), single / len(blocks)).tolist())
        return self._later_slices[key]

    def _moved_to_host(self, first: _Slices, host: int) -> _Slices:
        """`first`, a table's table-row-wise blocks on the first host, on `host`'s devices instead, described as
        `_describe` would (only where a piece may go changes) without pricing them again: a finish joins each later
        table to the set on whichever host is least loaded, and describing the blocks anew on every host was a large
        share of placing few tables over many hosts (docs/policy.md)."""
        shift = host * self.topology.devices_per_host_or_all
        pieces, described = [], []
        for block, alike in zip(first.pieces, first.described):
            device = block.devices[0] + shift
            moved = block.model_copy(update={"devices": (device,)})
            if moved.key not in self._pieces:
                allowed = np.zeros(self.topology.num_devices, dtype=bool)
                allowed[device] = True
                self._pieces[moved.key] = alike._replace(allowed=allowed, anywhere=bool(allowed.all()))
            pieces.append(moved)
            described.append(self._pieces[moved.key])
        return _Slices(pieces, first.singles, described, first.rows, [p.devices[0] for p in pieces])

    def _goes_by_rows(self, piece: TablePiece, single: float) -> bool:
        """Whether `_finishing_slices` splits `piece` by rows where the way allows it."""
        slices = self._finishing_slices(piece, single, by_rows=True).pieces
        return bool(slices) and bool(slices[0].devices)

    def _loads_with(self, added: _Pieces, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The collectives' loads (`widths`, `inputs`, `host_sums`, `of_kind`) with the `added` pieces on devices `at`."""
        widths, inputs, host_sums, of_kind = (
            self.widths.copy(),
            self.inputs.copy(),
            self.host_sums.copy(),
            self.of_kind.copy(),
        )
        np.add.at(widths, (added.kinds, at), added.widths)
        np.add.at(inputs, (added.kinds, at), added.inputs)
        np.add.at(host_sums, at, added.host_sums)
        of_kind += np.bincount(added.kinds, minlength=len(of_kind))
        return widths, inputs, host_sums, of_kind

    def _price_slices(self, slices: list[TablePiece]) -> _Split:
        """The column slices on the candidate devices where each slice alone would make the lowest total, one a
        device; where fewer devices have room for one than there are slices, on devices without, priced as not fitting
        (on more devices than the candidates, such a split once failed the step with a traceback)."""
        self._describe(slices)
        one = self._pieces[slices[0].key]
        mask = self.ledger.room(one.need)
        # as many candidates as slices at least: a table cut in 32 columns on 64 devices had 16 (a walk's traceback)
        devices = self._choose_candidates(mask if mask.sum() >= len(slices) else np.ones_like(mask), len(slices))
        rows, _ = self._rows_if([one], devices[None])
        order = np.argsort(np.where(mask[devices], rows.sum(axis=1), np.inf), kind="stable")
        return self._price_split(slices, devices[order[: len(slices)]])

    def _price_split(self, pieces: list[TablePiece], devices: np.ndarray | None = None) -> _Split:
        """Every device's predicted step were `pieces` put on `devices` (default: each pinned one's device), one a
        device, every set of collectives priced again."""
        self._describe(pieces)
        if devices is None:
            devices = np.array([p.devices[0] for p in pieces])
        described = [self._pieces[p.key] for p in pieces]
        added = _Pieces.of(described)
        compute = self.models.compute_from_sums(self.sums[devices] + added.encodings, self.counts[devices] + 1)
        loads = self._loads_with(added, devices.astype(np.int64))
        priced = self._collectives(*loads)
        compute_ms = self.compute_ms.copy()
        compute_ms[devices] = compute
        fits = len(devices) == len(pieces) and bool(
            (self.ledger.free[devices] >= np.array([p.need for p in described])).all()
        )
        return _Split(
            pieces, devices, fits, compute, loads, priced,
            compute_ms.sum(axis=1) + priced[2],
        )  # fmt: skip

    def observation(self) -> dict[str, np.ndarray]:
        """Rows of the options [R, NUM_OPTION_FEATURES] (`options()`), the current piece [NUM_CURRENT_FEATURES], the
        masks."""
        current = self._current()
        c = self.candidates()
        with_table = self.what_if().sum(axis=1)
        free = self.ledger.free
        splits = self.splits()
        # a split's device features are those of its device that ends slowest
        slowest = np.array([s.devices[np.argmax(s.totals[s.devices])] for _, s in splits], dtype=np.int64)
        raised = np.maximum(with_table, self.cost) - self.cost
        split_with, split_raised = self._split_prices(with_table, raised)
        split_free = np.array([free[s.devices].min() for _, s in splits])
        split_memory = [
            max(self._pieces[p.key].need / max(free[a], 1) for p, a in zip(s.pieces, s.devices)) for _, s in splits
        ]
        options = self._option_rows(
            np.concatenate([c, slowest]),
            np.concatenate([with_table, split_with]),
            np.concatenate([raised, split_raised]),
            np.concatenate([free[c], split_free]),
            np.concatenate([current.need / np.maximum(free[c], 1), split_memory]),
        )
        for k, (option, _) in enumerate(splits):
            options[len(c) + k, -len(SPLITS) + SPLITS.index(option.split)] = 1.0
        return {
            "options": options.astype(np.float32),
            "table": self._piece_row(self.position, self.singles_left).astype(np.float32),
            "action_mask": self.option_mask().astype(np.float32),
            "valid": np.ones(len(options), dtype=np.float32),
        }

    def _option_rows(
        self, rows: np.ndarray, with_table: np.ndarray, raised: np.ndarray, free: np.ndarray, memory: np.ndarray
    ) -> np.ndarray:
        """`OPTION_FEATURES` [n, NUM_OPTION_FEATURES] of options whose device features are those of devices `rows`
        [n], given the devices' totals `with_table` with the piece, the plan's cost `raised`, the `free` memory and the
        piece's `memory` over it; the split columns zero."""
        scale = self.lower_bound
        sums = self.feature_sums[rows] / max(len(self.queue) / self.topology.num_devices, 1.0)
        return np.column_stack(
            [
                self.compute_ms[rows] / scale,
                self.comm_ms[rows] / scale,
                self._device_totals()[rows] / scale,
                with_table / scale,
                raised / scale,
                free / self.topology.memory_bytes,
                np.minimum(memory, 2.0),
                self.widths.sum(axis=0)[rows] / self.task_width,
                np.log1p(self.counts[rows]),
                sums[:, :NUM_SCALAR_FEATURES],
                sums[:, NUM_SCALAR_FEATURES:].sum(axis=1),
                np.zeros((len(rows), len(SPLITS))),
            ]
        )

    def _piece_row(self, position: int, singles_left: float) -> np.ndarray:
        """The features [NUM_CURRENT_FEATURES] of the queue's piece at `position`, `singles_left` the predicted single
        costs of the queue from it on."""
        single = self.queue_singles[position]
        return np.concatenate(
            [
                self.queue_described[position].features,
                [
                    single / self.lower_bound,
                    (singles_left - single) / self.singles_total,
                    position / len(self.queue),
                    math.log2(self.topology.num_devices),
                ],
            ]
        )

    def wave(self) -> int:
        """How many pieces from the current one on decoding may score at once, each on candidates of its own
        (`observe_wave`); 0 where the current piece takes a step of its own. On `WAVE_DEVICES` devices or more, a run
        of pieces of distinct tables no device holds yet, of one sharding type, free to go anywhere, none needing more
        than half a device (`observe_wave` keeps the room the steps keep for those to come) and none offered a split,
        up to one a `max_candidates` devices. What a piece's options would see of the others', their devices, is
        theirs alone: only the plan's cost, the sets' total columns and the queue's progress move between them, where
        each step would see them move."""
        d, start = self.topology.num_devices, self.position
        if d < WAVE_DEVICES:
            return 0
        offers_left = self.split_offers < self.split_tables
        joins = bool(self._sets_to_join())
        kind, tables = self.queue_described[start].kind, set()
        end = min(start + d // self.max_candidates, len(self.queue))
        crowding = bisect.bisect_left(self._crowding, start)  # the next piece needing more than half a device
        if crowding < len(self._crowding):
            end = min(end, self._crowding[crowding])
        for k in range(start, end):
            piece, described = self.queue[k], self.queue_described[k]
            name = piece.table.name
            if not described.anywhere or described.kind != kind or name in self.holding or name in tables:
                break
            if offers_left and _whole_table(piece) and (joins or self.queue_singles[k] >= self.dominance):
                break
            tables.add(name)
        return len(tables) if len(tables) > 1 else 0

    def observe_wave(self, size: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The candidates [K, C] and observations (`observation`'s, stacked: options [K, C, F], the pieces [K, F'],
        masks [K, C]) of the next `size` pieces (`wave`), K of them: where fewer devices have room for the largest than
        the wave's candidates take, fewer (one: take a step). Each piece's candidates are as a step's (half the least
        loaded by predicted step, the rest the roomiest), dealt in turn: the wave's first piece gets the least loaded
        device, its second the next, and so on, as each step's least loaded would be."""
        pieces = self.queue_described[self.position : self.position + size]
        need, free = max(p.need for p in pieces), self.ledger.free
        fits = free >= need
        later = sorted(self._crowding_needs(self.position), reverse=True)
        if later:
            # The room the steps keep for the later pieces needing more than half a device (`_keeps_room`), kept
            # whatever the wave's pieces choose: the k-th largest has at least k devices with that much free after
            # them. Where fewer than `size` devices could be spared, the wave is that many, or its candidates only the
            # devices whose free memory stays above every later need or was below them all.
            counts = (free[None, :] >= np.array(later)[:, None]).sum(axis=1)
            spare = int((counts - np.arange(1, len(later) + 1)).min())
            if spare >= 2:
                size = min(size, spare)
            else:
                fits &= (free - need >= later[0]) | (free < later[-1])
        room = np.flatnonzero(fits)
        per, half = self.max_candidates, self.max_candidates // 2
        size = min(size, len(room) // per)
        if size < 2:
            return np.zeros((0, per), dtype=np.int64), {}
        pieces = pieces[:size]
        least_loaded = room[np.argsort(self._device_totals()[room], kind="stable")[: size * half]]
        others = np.ones(self.topology.num_devices, dtype=bool)
        others[least_loaded] = False
        rest = room[others[room]]
        roomiest = rest[np.argsort(-self.ledger.free[rest], kind="stable")[: size * (per - half)]]
        candidates = np.sort(
            np.concatenate([least_loaded.reshape(half, size).T, roomiest.reshape(per - half, size).T], axis=1), axis=1
        )
        flat = candidates.reshape(-1)
        rows, _ = self._rows_if(pieces, candidates)
        self._wave = (candidates, rows, _Pieces.of(pieces))
        with_table = rows.sum(axis=1)
        free_at = free[flat]
        needs = np.repeat([p.need for p in pieces], per)
        options = self._option_rows(
            flat, with_table, np.maximum(with_table, self.cost) - self.cost, free_at, needs / np.maximum(free_at, 1)
        )
        before = np.cumsum([0.0, *self.queue_singles[self.position : self.position + size - 1]])
        table = np.stack([self._piece_row(self.position + k, self.singles_left - before[k]) for k in range(size)])
        ones = np.ones((size, per), dtype=np.float32)
        observation = {
            "options": options.reshape(size, per, -1).astype(np.float32),
            "table": table.astype(np.float32),
            "action_mask": ones,
            "valid": ones,
        }
        return candidates, observation

    def place_wave(self, slots: np.ndarray) -> None:
        """Put each piece of the wave `observe_wave` observed on its candidate `slots` [K], as `place` would one by one;
        every device's all-to-alls priced again after them."""
        candidates, rows, added = self._wave
        size, per = candidates.shape
        chosen = np.arange(size) * per + np.asarray(slots)
        devices = candidates.reshape(-1)[chosen]
        start, end = self.position, self.position + size
        # `_put` and `place`'s updates for all of them at once: one piece a device, so each sum is the one addition
        # `_put` would make
        kind = int(added.kinds[0])
        np.add.at(self.sums, devices, added.encodings)
        self.counts[devices] += 1
        self.ledger.take(devices, np.array([p.need for p in self.queue_described[start:end]]))
        self.feature_sums[devices] += np.stack([p.features for p in self.queue_described[start:end]])
        for piece, device in zip(self.queue[start:end], devices.tolist()):
            self.holding.setdefault(piece.table.name, set()).add(device)
            self.placed.append(piece)
            self.assign.append(device)
        singles = self.queue_singles[start:end]
        self._dominant_on.update(devices[np.array(singles) >= self.dominance].tolist())
        self.widths[kind, devices] += added.widths
        self.inputs[kind, devices] += added.inputs
        self.host_sums[devices] += added.host_sums
        self.of_kind[kind] += size
        for single in singles:  # one by one, as the steps take them off
            self.singles_left -= single
        self.position = end
        self.compute_ms[devices] = rows[chosen, :2]
        self.kind_comm, self.host_ms, self.comm_ms = self._collectives(
            self.widths, self.inputs, self.host_sums, self.of_kind
        )
        self._wave = None
        self._new_step()
        self.cost = float(self._device_totals().max())

    def _split_prices(self, with_table: np.ndarray, raised: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each split's total with the table and raise of the plan's cost, as the prior reads them: the best whole
        placement's (or, with none, the own step's of the split whose finished plan prices lowest: the largest of its
        devices' totals, the plan's cost raised), moved by what the split costs more or less than that once the plan is
        finished greedily (`finish`). A split's price shows later than a whole table's: every device pays its sets of
        collectives from then on. (Each split moved from its own step's figures instead, a split spreading its table
        thin raised the step least and the prior took it over one whose finished plan priced lower: MLPerf
        DLRM-DCNv2's 40M-row tables row-wise over 64 devices of 16 GB, 11.32 ms, where column quarters finish 9.44.)"""
        splits = self.splits()
        own_with = np.array([s.totals[s.devices].max() for _, s in splits])
        own_raised = np.array([max(s.totals.max(), self.cost) - self.cost for _, s in splits])
        finished = np.array([s.finished for _, s in splits])
        if not len(splits) or not np.isfinite(finished).any():
            return own_with, own_raised
        whole, whole_finished = self._whole
        if whole is not None and math.isfinite(whole_finished):
            k = int(np.searchsorted(self.candidates(), whole))
            moved = finished - whole_finished
            with_split, raised_split = with_table[k] + moved, raised[k] + moved
        else:
            best = int(np.argmin(finished))
            moved = finished - finished[best]
            with_split, raised_split = own_with[best] + moved, own_raised[best] + moved
        known = np.isfinite(finished)
        return np.where(known, with_split, own_with), np.where(known, raised_split, own_raised)

    def option_mask(self) -> np.ndarray:
        """Which of `options()` may be taken."""
        if self._option_mask is None:
            fits = [s.fits for _, s in self.splits()]
            self._option_mask = np.concatenate([self.action_mask()[self.candidates()], fits]).astype(bool)
        return self._option_mask

    def take(self, slot: int) -> float:
        """Take option `slot` of `options()`; the step's reward."""
        candidates = self.candidates()
        if slot < len(candidates):
            return self.place(int(candidates[slot]))
        option, split = self.splits()[slot - len(candidates)]
        if not split.fits:
            raise ShardRayError(f"{self.piece.describe()} split {option.split} does not fit beside the rest")
        if option.split == "column_wise":  # the slices are the next steps' pieces
            self._queue_slices(split.pieces)
            return 0.0
        for piece, device in zip(split.pieces, split.devices):
            self._put(piece, int(device))
        singles = single_costs(self.pricer, split.pieces)
        self._dominant_on.update(split.devices[singles >= self.dominance].tolist())
        self.compute_ms[split.devices] = split.compute
        self.widths, self.inputs, self.host_sums, self.of_kind = split.loads
        self.kind_comm, self.host_ms, self.comm_ms = split.priced
        return self._advance()

    def _queue_slices(self, slices: list[TablePiece]) -> None:
        singles = single_costs(self.pricer, slices)
        i = self.position
        self.singles_left += float(singles.sum()) - self.queue_singles[i]
        self.singles_total += float(singles.sum()) - self.queue_singles[i]
        self.queue[i : i + 1] = slices  # described when `_price_slices` priced them
        self.queue_described[i : i + 1] = [self._pieces[p.key] for p in slices]
        self.queue_singles[i : i + 1] = [float(s) for s in singles]
        self._find_crowding()
        self._queue_pieces = None
        self._new_step()

    def _new_step(self) -> None:
        self._action_mask = self._option_mask = self._candidates = self._what_if = self._splits = None

    def _put(self, piece: TablePiece, device: int) -> None:
        """Add `piece` to `device`'s sums, counts and memory (not its prices)."""
        described = self._pieces[piece.key]
        self.sums[device] += described.encoding
        self.counts[device] += 1
        self.ledger.take(device, described.need)
        self.feature_sums[device] += described.features
        self.holding.setdefault(piece.table.name, set()).add(device)
        self.placed.append(piece)
        self.assign.append(device)

    def place(self, device: int) -> float:
        """Put the current piece whole on `device`; the step's reward."""
        if not self.action_mask()[device]:
            raise ShardRayError(f"device {device} has no room for {self.piece.describe()}")
        current = self._current()
        c = self.candidates()
        slot = int(np.searchsorted(c, device))
        if slot < len(c) and c[slot] == device:
            self.what_if()
            row, own = self._what_if[0][slot], self._what_if[1][slot]
        else:
            rows, owns = self._rows_if([current], np.array([[device]]))
            row, own = rows[0], owns[0]
        self._put(self.piece, device)
        if self.queue_singles[self.position] >= self.dominance:
            self._dominant_on.add(device)
        self.compute_ms[device] = row[:2]
        # the collectives' loads with the piece added, in place (`_loads_with` copies them, for what-ifs)
        self.widths[current.kind, device] += current.width
        self.inputs[current.kind, device] += current.input
        self.host_sums[device] += current.host_sum
        self.of_kind[current.kind] += 1
        # Every device's all-to-alls priced again each step, on up to `max_candidates` devices; on more, every
        # `max_candidates` steps and at the end, and the device placed on takes its what-if price in between: the
        # others' columns did not change, only the plan's total (a step then costs the candidates, not the devices).
        d = self.topology.num_devices
        if (
            d <= self.max_candidates
            or (self.position + 1) % self.max_candidates == 0
            or self.position + 1 == len(self.queue)
        ):
            self.kind_comm, self.host_ms, self.comm_ms = self._collectives(
                self.widths, self.inputs, self.host_sums, self.of_kind
            )
        else:
            self.kind_comm[current.kind, device] = own
            self.comm_ms[device] = row[2]
        return self._advance()

    def _advance(self) -> float:
        self.singles_left -= self.queue_singles[self.position]
        self.position += 1
        self._new_step()
        previous, self.cost = self.cost, float(self._device_totals().max())
        return -(self.cost - previous) / self.lower_bound

    def stuck(self) -> bool:
        """True when the current piece fits nowhere, whole or split."""
        return not self.done and not self.option_mask().any()

    def plan(self, algorithm: str) -> Plan:
        if not self.done:
            raise ShardRayError(f"the plan is incomplete: {self.position} of {len(self.queue)} pieces placed")
        return Plan.from_assignment(self.placed, self.assign, self.topology.num_devices, algorithm)


@dataclass
class EnvConfig:
    """What tasks a training environment draws. Plain data, so RLlib can ship it to env runners."""

    tables: list[dict[str, Any]] = field(default_factory=list)  # the pool, as TableSpec dicts
    min_tables: int = 15
    max_tables: int = 25
    dims: tuple[int, ...] = (16, 32, 64, 128)
    devices: tuple[int, ...] = (4,)
    max_devices: int = 8  # observations are padded to this many devices' options (`observation_rows`)
    memory_headroom: tuple[float, float] = (1.3, 2.0)  # drawn per task: cap over an even split
    batch_size: int = 1024
    # The model file's content, so env runners on any node need no access to the file; empty: the shipped models.
    cost_model: bytes = b""

    def check(self) -> None:
        if not self.tables:
            raise ShardRayError("the environment's table pool is empty")
        if max(self.devices) > self.max_devices:
            raise ShardRayError(f"devices {self.devices} exceed max_devices {self.max_devices}")
        TaskConfig(min_tables=self.min_tables, max_tables=self.max_tables, dims=self.dims).check()
        if self.min_tables > len(self.tables):
            raise ShardRayError(
                f"tasks need {self.min_tables} tables but the pool has {len(self.tables)}: lower min_tables and "
                f"max_tables (--min-tables, --max-tables) to at most {len(self.tables)}, or give a bigger pool "
                "(`shard-ray generate`)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pad_observation(obs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pad the option axis to `rows`; padded rows are masked out of actions and of the value."""
    d = obs["options"].shape[0]
    if d > rows:
        raise ShardRayError(f"{d} options exceed the {rows} this environment pads to")
    options = np.zeros((rows, NUM_OPTION_FEATURES), dtype=np.float32)
    options[:d] = obs["options"]
    padded = {"options": options, "table": obs["table"]}
    for key in ("action_mask", "valid"):
        padded[key] = np.zeros(rows, dtype=np.float32)
        padded[key][:d] = obs[key]
    return padded


class PlacementEnv(gym.Env):
    """A new task from the pool every episode; observations padded to `max_devices`' options (`observation_rows`)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = EnvConfig(**(config or {}))
        self.config.check()
        self.pool = [TableSpec.model_validate(t) for t in self.config.tables]
        self.task_config = TaskConfig(
            min_tables=self.config.min_tables, max_tables=self.config.max_tables, dims=self.config.dims
        )
        if self.config.cost_model:
            self.models = CostModels.from_bytes(self.config.cost_model, "the environment's cost models")
        else:
            self.models = CostModels.load(default_cost_model_path())
        m = self.rows = observation_rows(self.config.max_devices)
        self.observation_space = gym.spaces.Dict(
            {
                "options": gym.spaces.Box(-np.inf, np.inf, (m, NUM_OPTION_FEATURES), np.float32),
                "table": gym.spaces.Box(-np.inf, np.inf, (NUM_CURRENT_FEATURES,), np.float32),
                "action_mask": gym.spaces.Box(0.0, 1.0, (m,), np.float32),
                "valid": gym.spaces.Box(0.0, 1.0, (m,), np.float32),
            }
        )
        self.action_space = gym.spaces.Discrete(m)
        self.rng = np.random.default_rng()
        self.seed: int | None = None  # the seed of the last seeded reset (RLlib seeds each env's first)
        self.resumed_after = 0  # the iterations a resumed run had done: they seed its tasks with `seed`
        self.state: PlacementState | None = None

    def set_cost_models(self, models: CostModels) -> None:
        """Price later episodes with `models` (DreamShard's outer loop updates them)."""
        self.models = models

    def resume_after(self, iterations: int) -> None:
        """Draw the tasks of a run resumed after `iterations`, not the first run's again: RLlib seeds every env
        from the algorithm's seed alone, so the tasks are seeded by that seed and the iterations done."""
        self.resumed_after = iterations
        self.rng = np.random.default_rng((self.seed or 0, iterations))

    def draw_task(self) -> tuple[list[TableSpec], Topology]:
        tables = draw_task(self.pool, self.task_config, self.rng)
        d = int(self.rng.choice(self.config.devices))
        headroom = float(self.rng.uniform(*self.config.memory_headroom))
        topology = Topology(
            num_devices=d, memory_bytes=memory_cap_with_headroom(tables, d, headroom), batch_size=self.config.batch_size
        )
        return tables, topology

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.seed = seed
            self.rng = np.random.default_rng((seed, self.resumed_after) if self.resumed_after else seed)
        tables, topology = self.draw_task()
        self.state = PlacementState(tables, topology, self.models)
        return pad_observation(self.state.observation(), self.rows), {}

    def step(self, action: int) -> tuple[dict, float, bool, bool, dict]:
        state = self.state
        assert state is not None, "reset() before step()"
        mask = state.option_mask()
        # a padded or full device is never sampled under the mask; should one come, fall back to a valid one
        slot = int(action) if action < len(mask) and mask[action] else int(np.flatnonzero(mask)[0])
        reward = state.take(slot)
        info: dict[str, Any] = {}
        if state.done:
            info = {"cost_over_lower_bound": state.cost / state.lower_bound, "feasible": True}
            obs = self._final_observation()
            return obs, reward, True, False, info
        if state.stuck():
            info = {"feasible": False}
            return self._final_observation(), reward - INFEASIBLE_PENALTY, True, False, info
        return pad_observation(state.observation(), self.rows), reward, False, False, info

    def _final_observation(self) -> dict[str, np.ndarray]:
        """Terminal observations are never acted on; an all-zero one keeps the spaces' shapes."""
        m = self.rows
        return {
            "options": np.zeros((m, NUM_OPTION_FEATURES), dtype=np.float32),
            "table": np.zeros(NUM_CURRENT_FEATURES, dtype=np.float32),
            "action_mask": np.zeros(m, dtype=np.float32),
            "valid": np.zeros(m, dtype=np.float32),
        }
