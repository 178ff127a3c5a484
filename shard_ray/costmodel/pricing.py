"""Pricing placements with the cost models: pieces (a table's column range) on devices.

Shared by the searches and the RL environment. The compute model works on sums of per-table
rows, so a device's running sum plus one piece's row prices the device with that piece in one
small model call; encodings are computed once per piece.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from shard_ray.costmodel.features import NUM_TABLE_FEATURES, lookups_per_sample, pieces_features, replica_flags
from shard_ray.costmodel.links import LinkProfile
from shard_ray.costmodel.models import CostModels, comm_feature_rows
from shard_ray.plan.cost import DeviceCost, PlanCost
from shard_ray.plan.piece import COLLECTIVE_TYPES, TablePiece
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology

if TYPE_CHECKING:
    from shard_ray.profiling.store import PlanMeasurement

# A placement step over many devices prices a piece on this many of them, those cheapest so far:
# the cheapest device with the piece is one of the least loaded, and the step stays linear in devices.
CANDIDATE_DEVICES = 16
# A compute-model call counts as pricing at least this many shards in `Pricer.evaluations`: on the
# AMD EPYC a call of 1 to 32 shards took about 250 us, as long as pricing 64 at 3-4 us a shard in
# larger calls, so the count follows the time a search takes (`shard_ray.placement.budget`).
CALL_EVALUATIONS = 64
# Past the gangs it measured, the comm model's price over the links' scales the links' price by at most this
# (`Pricer.one_host_comm`): on the reference CPU, the 2-device all-to-alls it learned are a median 4.4x the
# links' floor, which prices fixed costs low (docs/cost-models.md).
COMM_CORRECTION_BOUND = 16.0


def added_up(rows: np.ndarray, at: np.ndarray, count: int, repeats: int = 1) -> np.ndarray:
    """[count, C] float32 sums of `rows` [N, C] (repeated `repeats` times, as one [N x repeats, C]) added into the rows
    `at` [N x repeats] names, each sum in the rows' order: every device's sums are its pieces' added one by one, so
    that a device is priced alike whatever else is priced with it."""
    sums = np.zeros((count, rows.shape[1]), dtype=np.float32)
    np.add.at(sums, at, np.tile(rows, (repeats, 1)) if repeats > 1 else rows)
    return sums


class Pricer:
    """Prices devices and plans of pieces with the cost models, reusing piece encodings."""

    def __init__(self, models: CostModels, topology: Topology) -> None:
        self.models = models
        self.topology = topology
        self.links = models.links
        if topology.intra_host_gbps is not None:  # the topology's own figure (`--intra-host-gbps`) over the profile's
            self.links = self.links.model_copy(
                update={
                    "intra_host_gbps": topology.intra_host_gbps,
                    "source": f"{self.links.source}; inside a host {topology.intra_host_gbps:g} GB/s, the topology's",
                }
            )
        # by `TablePiece.priced_key`: a table's row blocks on one host or another are encoded and sized once (the policy
        # prices a table table-row-wise on up to four hosts at every offer, docs/policy.md)
        self._encodings: dict[tuple, np.ndarray] = {}
        self._features: dict[tuple, np.ndarray] = {}  # the pieces' `pieces_features`, made for their encodings
        self._priced_sizes: dict[tuple, tuple] = {}  # `PieceSizes`' fields (`allowed`, which `devices` sets, aside)
        self._sizes: dict[tuple, tuple] = {}  # by `TablePiece.key`, `allowed` in
        # On one host, no link shared with other hosts, a device's links' price is the floor `one_host_comm` keeps
        # already: `comm_rows` and `output_and_input_rows` need not price the links again (the policy's every step).
        self._links_are_floor = topology.num_hosts == 1 and topology.host_link_gbps is None
        # Shards priced by the compute model so far (a call at least `CALL_EVALUATIONS`): the work a
        # search's budget counts.
        self.evaluations = 0

    def encodings(self, pieces: list[TablePiece]) -> np.ndarray:
        """[N, F] the pieces' encodings (`CostModels.encode_tables`), each piece's computed once; [0, F] for none."""
        if not pieces:
            return self.models.encode_tables([], self.topology.batch_size)
        missing = list({p.priced_key: p for p in pieces if p.priced_key not in self._encodings}.values())
        if missing:
            features = pieces_features(missing, self.models.rows_cap)
            encoded = self.models.encode_features(features, replica_flags(missing), self.topology.batch_size)
            for p, e, f in zip(missing, encoded, features):
                self._encodings[p.priced_key] = e
                self._features[p.priced_key] = f
        return np.stack([self._encodings[p.priced_key] for p in pieces])

    def features(self, pieces: list[TablePiece]) -> np.ndarray:
        """[N, F] the pieces' `pieces_features`, each piece's made once, with its encoding (`encodings`)."""
        if not pieces:
            return np.zeros((0, NUM_TABLE_FEATURES), dtype=np.float32)
        self.encodings(pieces)
        return np.stack([self._features[p.priced_key] for p in pieces])

    def sizes(self, pieces: list[TablePiece]) -> PieceSizes:
        """`piece_sizes` of the pieces, each piece's computed once."""
        missing = list({p.key: p for p in pieces if p.key not in self._sizes}.values())
        unsized = list({p.priced_key: p for p in missing if p.priced_key not in self._priced_sizes}.values())
        if unsized:
            computed = piece_sizes(unsized, self.topology, self.models.rows_cap)
            columns = [getattr(computed, f.name) for f in fields(PieceSizes)]
            for k, p in enumerate(unsized):
                self._priced_sizes[p.priced_key] = tuple(column[k] for column in columns)
        for p, allowed in zip(missing, _allowed_devices(missing, self.topology.num_devices)):
            priced = self._priced_sizes[p.priced_key]
            self._sizes[p.key] = (*priced[:_ALLOWED], allowed, *priced[_ALLOWED + 1 :])
        rows = [self._sizes[p.key] for p in pieces]
        columns = zip(*rows) if rows else ([] for _ in fields(PieceSizes))
        return PieceSizes(*(np.array(column) for column in columns))

    def plan_cost(self, pieces: list[TablePiece], assign: np.ndarray) -> float:
        """The simulated cost of the plan putting `pieces` on `assign`: its slowest device's step."""
        return float(self.device_costs(self.encodings(pieces), self.sizes(pieces), assign).max())

    def plan_parts(self, pieces: list[TablePiece], assign: np.ndarray) -> DeviceParts:
        """Every device's predicted step, part by part, with `pieces` on `assign`."""
        return self.device_parts(self.encodings(pieces), self.sizes(pieces), assign)

    def compute(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Predicted fwd + bwd ms of shards given by encoding sums and table counts."""
        return self.compute_parts(sums, counts).sum(axis=1)

    def compute_parts(self, sums: np.ndarray, counts: np.ndarray, plans: int = 1) -> np.ndarray:
        """Predicted (fwd, bwd) ms [n, 2] of shards given by encoding sums and table counts: in the budgets' count,
        `plans` calls of n / `plans` shards (the devices of several plans priced at once count as each plan's own
        call would: a search's budget ends where it did with the plans priced one by one)."""
        self.evaluations += plans * max(len(sums) // plans, CALL_EVALUATIONS)
        return self.models.compute_from_sums(sums, counts)

    def collectives(self, widths: np.ndarray) -> np.ndarray:
        """Predicted (fwd, bwd) ms [..., D, 2] of all-to-alls moving `widths` [..., D] float columns per sample,
        hosts apart: the comm model's price on one host (`one_host_comm`), its links' part priced over the hosts
        (`over_hosts`), never below the links' price (`link_ms`)."""
        widths = np.asarray(widths, dtype=np.float64)
        total, widest = widths.sum(axis=-1, keepdims=True), widths.max(axis=-1, keepdims=True)
        one_host = self.one_host_comm(widths, total, widest, widths.shape[-1])
        floor = self.link_floor(widths)
        return np.maximum(self.over_hosts(one_host, widths, floor=floor), floor)

    def over_hosts(
        self,
        one_host: np.ndarray,
        widths: np.ndarray,
        phases: tuple[int, ...] = (0, 1),
        floor: np.ndarray | None = None,
    ) -> np.ndarray:
        """`over_hosts` on this topology's hosts and links, where the comm model did not price them itself; `floor`,
        the same widths' `link_floor` where the caller has it: their links' price over these hosts already."""
        topology = self.topology
        hosts = analytic_devices_per_host(self.models, topology.devices_per_host)
        return over_hosts(
            one_host, widths, topology.batch_size, hosts, topology.inter_host_gbps, self.links, phases,
            topology.host_link_gbps, hosts_price=floor if hosts == topology.devices_per_host else None,
        )  # fmt: skip

    def link_floor(self, widths: np.ndarray) -> np.ndarray:
        """The links' price (fwd, bwd) [..., D, 2] of an all-to-all of `widths` [..., D] on this topology (`link_ms`)."""
        topology = self.topology
        return link_ms(
            widths,
            topology.batch_size,
            topology.devices_per_host,
            topology.inter_host_gbps,
            self.links,
            topology.host_link_gbps,
        )

    def one_host_comm(
        self,
        width: np.ndarray,
        total: np.ndarray | float,
        max_width: np.ndarray | float,
        devices: int,
        floor_phases: tuple[int, int] | list[tuple[int, int]] = (0, 1),
    ) -> np.ndarray:
        """The comm model's (fwd, bwd) ms [..., n, 2] of devices of `width` [..., n] columns in plans of `total`
        columns (the widest `max_width`; per plan, [..., 1], or numbers) on one host of `devices`, never below the
        links' price there (its `floor_phases` columns: the input all-to-all's ids travel as the backward's
        gradients do; a list, one pair for each of `width`'s stacks [S, n]).

        Past the largest gang the comm model measured it extrapolates to nothing (the shipped one prices 8
        devices at 0.0004 ms). There the links' price is scaled by the comm model's price over the links' at
        that gang size, for the device's own width and the rest of the plan in proportion, bounded to
        [1, COMM_CORRECTION_BOUND]: a collective's price keeps what the model learned and never falls as
        devices are added with the same columns each."""
        width = np.asarray(width, dtype=np.float64)
        batch = self.topology.batch_size
        if devices == 1:
            return np.zeros((*width.shape, 2))
        floor = _columns(self.link_rows(width, total, devices, one_host=True), floor_phases)
        measured = self.models.info.device_counts
        if not measured or devices <= max(measured):
            learned = self.models.comm_ms(comm_feature_rows(width, total, max_width, batch, devices))
            return np.maximum(learned, floor)
        largest = max(measured)
        rest = (total - width) / (devices - 1)
        total_then = width + rest * (largest - 1)
        features = comm_feature_rows(width, total_then, np.maximum(width, rest), batch, largest)
        # over the links the comm model learned on (the models' own profile), not a topology's other rate
        floor_then = self.link_rows(width, total_then, largest, one_host=True, links=self.models.links)
        floor_then = _columns(floor_then, floor_phases)
        return floor * np.clip(self.models.comm_ms(features) / floor_then, 1.0, COMM_CORRECTION_BOUND)

    def comm_rows(
        self, width: np.ndarray, total: float | np.ndarray, max_width: np.ndarray, devices: int
    ) -> np.ndarray:
        """Predicted fwd + bwd all-to-all ms [..., n] of devices of `width` [..., n] columns in plans of `total` columns
        (the widest `max_width`)."""
        one_host = self.one_host_comm(width, total, max_width, devices)
        if self._links_are_floor:
            return one_host.sum(axis=-1)
        return np.maximum(one_host, self.link_rows(width, total, devices)).sum(axis=-1)

    def output_and_input_rows(
        self,
        widths: np.ndarray,
        inputs: np.ndarray,
        totals: tuple[float, float] | np.ndarray,
        most: np.ndarray,
        devices: int,
    ) -> np.ndarray:
        """`comm_rows` of devices of `widths` [n] columns plus the input all-to-all ms of the same devices receiving
        `inputs` [n] float columns per sample: `totals` (columns, inputs) in all (per device: [2, n]), `most` [2, n]
        the widest and the most inputs. One call of the comm model, its two stacks multiplied apart
        (`CostModels.comm_ms`): the same ms as the two priced alone, in half the calls (the policy prices both every
        step)."""
        stacked = np.stack([widths, inputs]).astype(np.float64)
        total = np.asarray(totals, dtype=np.float64)
        total = total[:, None] if total.ndim == 1 else total
        one_host = self.one_host_comm(stacked, total, most, devices, floor_phases=[(0, 1), (1, 1)])
        outputs, received = one_host[0], one_host[1][:, 0]
        if not self._links_are_floor:
            links = self.link_rows(stacked, total, devices)
            outputs, received = np.maximum(outputs, links[0]), np.maximum(received, links[1][:, 1])
        return outputs.sum(axis=-1) + (received + self.input_overhead(devices))

    def input_overhead(self, devices: int) -> float:
        """What a device's input all-to-all costs beyond its bytes' (`CostModels.input_overhead_ms`); none alone."""
        return self.models.input_overhead_ms if devices > 1 else 0.0

    def link_rows(
        self, width: np.ndarray, total: float, devices: int, one_host: bool = False, links: LinkProfile | None = None
    ) -> np.ndarray:
        """`link_ms` (fwd, bwd) [..., n, 2] of devices of `width` columns in plans of `total` columns over `devices`,
        without their places: their peers' columns spread evenly, a share of the peers on their host (none
        off it where `one_host`), their host mates receiving from other hosts what they do where the host's devices
        share its link (`Topology.host_link_gbps`); at `links` where given, else this topology's."""
        width = np.asarray(width, dtype=np.float64)
        if devices == 1:
            return np.zeros((*width.shape, 2))
        floats = two_columns((total - width) / devices, width * (devices - 1) / devices)
        local = devices if one_host else min(self.topology.devices_per_host or devices, devices)
        share = intra_host_share(devices, local)
        topology = self.topology
        intra, inter = floats * share, floats * (1 - share)
        host_inter = None if one_host or topology.host_link_gbps is None else inter * local
        return links_time(
            intra, inter, devices, topology.batch_size, topology.inter_host_gbps, links or self.links,
            host_inter, topology.host_link_gbps,
        )  # fmt: skip

    def input_dist(self, inputs: np.ndarray) -> np.ndarray:
        """Predicted input all-to-all ms [..., D] of devices receiving `inputs` [..., D] float-equivalent columns per
        sample: over hosts, each device receives its pieces' ids for the samples of devices off its host
        (`over_hosts`)."""
        inputs = np.asarray(inputs, dtype=np.float64)
        devices = inputs.shape[-1]
        total, most = inputs.sum(axis=-1, keepdims=True), inputs.max(axis=-1, keepdims=True)
        # a device receives its pieces' ids for the other devices' samples: the backward's direction
        one_host = self.one_host_comm(inputs, total, most, devices, (1, 1))[..., :1]
        floor = self.link_floor(inputs)
        over_links = np.maximum(self.over_hosts(one_host, inputs, (1,), floor)[..., 0], floor[..., 1])
        return over_links + self.input_overhead(devices)

    def all_reduce(self, widths: np.ndarray, gradient_mb: np.ndarray, holds: np.ndarray) -> np.ndarray:
        """The replicas' gradient all-reduce ms [..., D] of devices with `widths` [..., D] of `sync_width` columns,
        `gradient_mb` MB of replicas' gradients and `holds` (whether each holds any): with `all_reduce_ms` fitted, its ms for taking
        part plus its rate over the ring's bus bytes, 2(D-1)/D of the device's; else the comm model's price of the
        all-to-all moving as many bytes. Over hosts never below the ring's price on the links (`ring_link_ms`): the
        fit saw one host's."""
        if any(self.models.all_reduce_ms):
            part, per_mb = self.models.all_reduce_ms
            priced = holds * (part + per_mb * ring_bus_mb(gradient_mb, widths.shape[-1]))
        else:
            priced = self.collectives(widths)[..., 1]
        topology = self.topology
        if topology.devices_per_host_if_spanning is None:
            return priced
        # over hosts the ring's bytes cross the links: every device waits for the ring's slowest link
        ring = ring_link_ms(
            np.max(gradient_mb, axis=-1, initial=0.0, keepdims=True), widths.shape[-1],
            topology.devices_per_host_if_spanning, topology.inter_host_gbps, self.links, topology.host_link_gbps,
        )  # fmt: skip
        return np.maximum(priced, holds * ring)

    def types_overhead(self, kinds: int) -> np.ndarray:
        """What every device pays (input, forward, backward ms) for `kinds` sets of collectives instead of one: it takes
        part in every set, whether it holds pieces of it or not."""
        if kinds <= 1 or self.topology.num_devices == 1:
            return np.zeros(3)
        return (kinds - 1) * np.asarray(self.models.type_overhead_ms)

    def device_costs(self, encodings: np.ndarray, sizes: PieceSizes, assign: np.ndarray) -> np.ndarray:
        """Every device's predicted step [D] (the one cost definition's parts summed) with the pieces on `assign`
        [N]; of several plans [B, D], with the pieces on each row of `assign` [B, N] (`device_parts`)."""
        return self.device_parts(encodings, sizes, assign).totals()

    def device_parts(self, encodings: np.ndarray, sizes: PieceSizes, assign: np.ndarray) -> DeviceParts:
        """Every device's predicted step, part by part, with the pieces on `assign` [N]: the one place a plan is
        priced. Several plans of the same pieces at once with `assign` [B, N] (parts [B, D, ...]): a search's
        candidates in one pass of array operations, not one each, every plan priced bit for bit as alone (each
        device's sums add its pieces in their order, and the networks multiply each plan's rows apart)."""
        d = self.topology.num_devices
        plans = np.atleast_2d(assign)
        b = len(plans)
        # Plan p's device k is row p * D + k of the flattened [B, D] arrays below.
        first_rows = d * np.arange(b)[:, None]
        rows = (plans + first_rows).ravel()

        def per_device(weights: np.ndarray, pieces: np.ndarray | slice = slice(None)) -> np.ndarray:
            """The pieces' `weights` [N] added up on each plan's devices: [B, D]."""
            at = (plans[:, pieces] + first_rows).ravel()
            return np.bincount(at, weights=np.tile(weights[pieces], b), minlength=b * d).reshape(b, d)

        sums = added_up(encodings, rows, b * d, repeats=b)
        counts = np.bincount(rows, minlength=b * d).astype(np.float32)
        # One set of all-to-alls per sharding type the plan uses, each moving its pieces' columns (as TorchRec
        # and the gang run them: `TypeCollectives`); replicas move none.
        comm, input_dist = np.zeros((b, d, 2)), np.zeros((b, d))
        kinds = np.unique(sizes.kinds[sizes.kinds >= 0])
        for kind in kinds:
            of_kind = sizes.kinds == kind
            comm += self.collectives(per_device(sizes.widths, of_kind))
            input_dist += self.input_dist(per_device(sizes.inputs, of_kind))
        if len(kinds) > 1 and d > 1:
            extra = self.types_overhead(len(kinds))
            input_dist += extra[0]
            comm += extra[1:]
        sync, host_sums = np.zeros((b, d)), np.zeros((b, d, 2))
        if sizes.syncs.any():
            sync = self.all_reduce(
                per_device(sizes.syncs), per_device(sizes.gradient_mb), per_device((sizes.syncs > 0) * 1.0) > 0
            )
        if sizes.host_sums.any():
            per_host = self.topology.devices_per_host_or_all
            host_sums = host_reduce(self.models, per_device(sizes.host_sums), self.topology.batch_size, per_host)
        parts = DeviceParts(
            compute=self.compute_parts(sums, counts, plans=b).reshape(b, d, 2),
            comm=comm,
            input_dist=input_dist,
            sync=sync,
            host_sums=host_sums,
        )
        return parts if np.ndim(assign) == 2 else parts.of_plan(0)


@dataclass(frozen=True)
class DeviceParts:
    """Each device's predicted step by the one cost definition's parts (`shard_ray.plan.cost`)."""

    compute: np.ndarray  # [D, 2] the fused lookups, forward and backward
    comm: np.ndarray  # [D, 2] the pooled embeddings' all-to-all, forward and backward
    input_dist: np.ndarray  # [D] the lookups' input all-to-all
    sync: np.ndarray  # [D] data-parallel replicas' gradient all-reduce, in the backward pass
    host_sums: np.ndarray  # [D, 2] table-row-wise partial sums added up inside a host, forward and backward

    def totals(self) -> np.ndarray:
        """Each device's step ms."""
        parts = self.compute.sum(axis=-1) + self.comm.sum(axis=-1)
        return parts + self.input_dist + self.sync + self.host_sums.sum(axis=-1)

    def of_plan(self, index: int) -> DeviceParts:
        """One plan's parts of several priced at once (`Pricer.device_parts`)."""
        return DeviceParts(*(getattr(self, f.name)[index] for f in fields(self)))

    def plan_cost(self, hardware: str, batch_size: int) -> PlanCost:
        """The parts as a plan's predicted costs."""
        return PlanCost(
            devices=[
                DeviceCost(
                    device=d,
                    input_dist_ms=float(self.input_dist[d]),
                    fwd_compute_ms=float(self.compute[d, 0]),
                    fwd_comm_ms=float(self.comm[d, 0] + self.host_sums[d, 0]),
                    bwd_comm_ms=float(self.comm[d, 1] + self.sync[d] + self.host_sums[d, 1]),
                    bwd_compute_ms=float(self.compute[d, 1]),
                )
                for d in range(len(self.input_dist))
            ],
            hardware=hardware,
            batch_size=batch_size,
        )


def host_reduce(models: CostModels, host_sums: np.ndarray, batch_size: int, devices_per_host: int) -> np.ndarray:
    """Each device's (fwd, bwd) ms [..., D, 2] adding up table-row-wise partial sums inside its host and sending the
    gradients back (TorchRec's intra-host reduce-scatter and all-gather), from its `host_sums` columns
    of partial sums per sample: each host's devices priced by the comm model as an all-to-all of
    those widths among them, which moves the same bytes (each device sends (L-1)/L of its sums)."""
    device_sums = np.asarray(host_sums, dtype=np.float64)
    sums = device_sums.reshape(-1, devices_per_host)
    totals = sums.sum(axis=1, keepdims=True)
    widest = sums.max(axis=1, keepdims=True)
    features = comm_feature_rows(sums, totals, widest, batch_size, devices_per_host)
    # each plan's devices priced in one product, as one plan's are (`CostModels.comm_ms`)
    priced = models.comm_ms(features.reshape(*device_sums.shape, -1))
    return np.where(device_sums[..., None] > 0, priced, 0.0)


def over_hosts(
    predicted: np.ndarray,
    widths: np.ndarray,
    batch_size: int,
    devices_per_host: int | None,
    inter_host_gbps: float,
    links: LinkProfile,
    phases: tuple[int, ...] = (0, 1),
    host_link_gbps: float | None = None,
    hosts_price: np.ndarray | None = None,
) -> np.ndarray:
    """All-to-all ms [..., D, len(phases)] of devices on hosts of `devices_per_host`, from the comm model's
    `predicted` ms of the same devices on one host: the links' price on one host in it replaced by their price over the hosts
    (`link_ms`: what a device receives from its host mates and, at `inter_host_gbps`, from other hosts, and where
    a host's devices share one link of `host_link_gbps`, all its host receives over it).

    What the model learned beyond the links' price on one host is kept whole, fixed costs included: only the
    bytes move to their link classes. (Pricing only the share of a device's peers on its host at the model's price,
    as before, dropped the rest of its fixed costs, and priced a plan over hosts at equal rates inside and between
    them at 0.62 ms where the same plan cost 0.96 on one host.) `phases` are the links' columns the model's
    columns stand for: (0, 1) for the pooled all-to-all's forward and backward, (1,) for the input all-to-all,
    whose ids travel as the backward's gradients do.

    The shipped comm model has not measured inter-host links; one calibrated over hosts has, and is
    priced as it is (`analytic_devices_per_host`). Replicas' all-reduce is priced as a ring (`ring_link_ms`).
    `hosts_price`: the links' price over the hosts ([..., D, 2], `link_ms` of these arguments) where the caller has
    it already (a search prices the same widths' `link_floor`).
    """
    d = np.shape(widths)[-1]
    if devices_per_host is None or devices_per_host >= d:
        return predicted
    one_host = link_ms(widths, batch_size, None, inter_host_gbps, links)[..., phases]
    if hosts_price is None:
        hosts_price = link_ms(widths, batch_size, devices_per_host, inter_host_gbps, links, host_link_gbps)
    hosts = hosts_price[..., phases]
    return np.maximum(predicted - one_host, 0.0) + hosts


def received_floats(widths: np.ndarray, devices_per_host: int | None) -> tuple[np.ndarray, np.ndarray]:
    """What an all-to-all of `widths` float columns per sample brings each device, per sample of the batch, from
    its host mates and from other hosts ([..., D, 2] each: forward, backward), the batch split evenly: forward,
    its 1/D of the samples of every column held elsewhere; backward (and an input all-to-all of ids), its own
    columns for the samples of the other devices."""
    widths = np.asarray(widths, dtype=np.float64)
    d = widths.shape[-1]
    local = d if devices_per_host is None else min(devices_per_host, d)
    own_host = host_totals(widths, local)
    intra = two_columns((own_host - widths) / d, widths * (local - 1) / d)
    inter = two_columns((widths.sum(axis=-1, keepdims=True) - own_host) / d, widths * (d - local) / d)
    return intra, inter


def host_totals(values: np.ndarray, devices_per_host: int) -> np.ndarray:
    """Per device [..., D], the sum of `values` [..., D] over its host's devices, added in device order."""
    d = values.shape[-1]
    plans = int(np.prod(values.shape[:-1]))
    hosts = np.arange(d) // devices_per_host
    num_hosts = -(-d // devices_per_host)
    at = (hosts + num_hosts * np.arange(plans)[:, None]).ravel()
    totals = np.bincount(at, weights=values.ravel(), minlength=plans * num_hosts).reshape(plans, num_hosts)
    return totals[:, hosts].reshape(values.shape)


def inter_host_ms(widths: np.ndarray, batch_size: int, devices_per_host: int, inter_host_gbps: float) -> np.ndarray:
    """Each device's time [D, 2] receiving from other hosts at `inter_host_gbps` what an all-to-all of `widths`
    float columns per sample brings it (`received_floats`).

    A device waits for what it receives: what it sends waits in the transport's buffers. Across hosts emulated
    on one machine at 200 Mbit/s, gloo's all-to-all measured 0.73-1.25x this price at 2 to 8 devices, where the
    larger of sending and receiving (this function's form before) priced it about twice too dear
    (docs/clusters.md, "All-to-alls measured across emulated hosts").
    """
    _, inter = received_floats(widths, devices_per_host)
    return receiving_ms(inter, batch_size, inter_host_gbps)


def _columns(rows: np.ndarray, phases: tuple[int, int] | list[tuple[int, int]]) -> np.ndarray:
    """The `phases` columns of (fwd, bwd) `rows` [..., n, 2]; with a list, stack by stack of `rows` [S, n, 2]."""
    if isinstance(phases, tuple):
        return rows[..., phases]
    return np.stack([stack[..., list(pair)] for stack, pair in zip(rows, phases, strict=True)])


def two_columns(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """[..., n, 2] of two [..., n] columns (`first` broadcast to `second`'s shape): `np.stack(axis=-1)`'s result
    without its checks, which cost a search more than the arithmetic (it builds these thousands of times)."""
    out = np.empty((*np.shape(second), 2))
    out[..., 0], out[..., 1] = first, second
    return out


def receiving_ms(floats: np.ndarray, batch_size: int, gbps: float) -> np.ndarray:
    """The ms to receive `floats` float columns per sample of the batch, 4 bytes each, at `gbps` GB/s."""
    return floats * batch_size * 4 / (gbps * 1e9) * 1e3


def links_time(
    intra: np.ndarray,
    inter: np.ndarray,
    devices: int,
    batch_size: int,
    inter_host_gbps: float,
    links: LinkProfile,
    host_inter: np.ndarray | None = None,
    host_link_gbps: float | None = None,
) -> np.ndarray:
    """The links' price [n, 2] of devices in a collective of `devices` receiving `intra` float columns per sample
    from their host mates and `inter` from other hosts: the profile's fixed time and latency per peer, then the
    slower link class's bytes. Where a host's devices share one link of `host_link_gbps` to other hosts, a device
    also waits for `host_inter`, all its host receives from other hosts: over 4 and 8 emulated hosts of 16
    devices sharing a link each, the slowest device's all-to-alls measured 0.95-1.06x this price (docs/clusters.md)."""
    moving = np.maximum(
        receiving_ms(intra, batch_size, links.intra_host_gbps), receiving_ms(inter, batch_size, inter_host_gbps)
    )
    if host_link_gbps is not None and host_inter is not None:
        moving = np.maximum(moving, receiving_ms(host_inter, batch_size, host_link_gbps))
    return links.collective_ms + links.message_ms * (devices - 1) + moving


def link_ms(
    widths: np.ndarray,
    batch_size: int,
    devices_per_host: int | None,
    inter_host_gbps: float,
    links: LinkProfile,
    host_link_gbps: float | None = None,
) -> np.ndarray:
    """The links' price of an all-to-all (fwd, bwd) [..., D, 2] of `widths` [..., D] float columns per sample: the profile's
    fixed time and latency per peer, then the bytes each device receives from its host mates and from other hosts,
    each class at its rate, waiting for the slower (`shard_ray.costmodel.links`), and where a host's devices share
    one link of `host_link_gbps`, for all their host receives over it. It grows with the bytes and with the
    devices: no collective is priced near zero as devices are added."""
    d = np.shape(widths)[-1]
    if d == 1:
        return np.zeros((*np.shape(widths), 2))
    intra, inter = received_floats(widths, devices_per_host)
    host_inter = None
    if host_link_gbps is not None and devices_per_host is not None and devices_per_host < d:
        host_inter = host_received(inter, devices_per_host)
    return links_time(intra, inter, d, batch_size, inter_host_gbps, links, host_inter, host_link_gbps)


def host_received(inter: np.ndarray, devices_per_host: int) -> np.ndarray:
    """Per device [..., D, 2], what its whole host receives from other hosts, from what each device does (`inter`,
    `received_floats`'s second part): what crosses a link the host's devices share."""
    return np.stack([host_totals(inter[..., k], devices_per_host) for k in range(inter.shape[-1])], axis=-1)


def analytic_devices_per_host(models: CostModels, devices_per_host: int | None) -> int | None:
    """The devices per host whose inter-host traffic `over_hosts` prices: none where the comm model was
    fit to all-to-alls over hosts of that size (`calibrate --devices-per-host`), which priced it already."""
    return (
        None if devices_per_host is not None and models.comm_devices_per_host == devices_per_host else devices_per_host
    )


def intra_host_share(num_devices: int, devices_per_host: int | None) -> float:
    """The share of a device's all-to-all peers on its own host."""
    if devices_per_host is None or devices_per_host >= num_devices:
        return 1.0
    return (devices_per_host - 1) / (num_devices - 1)


def input_width(piece: TablePiece) -> float:
    """A piece's input all-to-all per sample, in float columns: its lookups' int64 ids and its bag's
    int64 length. A replica looks up its own samples where they are: nothing."""
    return 0.0 if piece.replicated else 2.0 * (lookups_per_sample(piece) + 1.0)


def output_width(piece: TablePiece) -> float:
    """A piece's columns in the pooled embeddings' all-to-all; a replica's stay on its device, and a
    table-row-wise block sends its share of its host's summed output (its partial sums: `host_sum_width`)."""
    return 0 if piece.replicated else piece.width / piece.within_host


def host_sum_width(piece: TablePiece) -> int:
    """A table-row-wise block's partial-sum columns, added up inside its host (`host_reduce`)."""
    return piece.width if piece.within_host > 1 else 0


def sync_width(piece: TablePiece, batch_size: int, rows_cap: int | None) -> float:
    """A replica's gradient all-reduce, and its dense optimizer step, as the all-to-all moving as many
    bytes per device: a ring all-reduce moves 2(D-1)/D of the gradient, an all-to-all of width w
    moves (D-1)/D of batch x w floats, and the dense update passes over the gradient once more.
    The cost models have not seen either; this keeps their price growing with the table, as it does."""
    if not piece.replicated:
        return 0.0
    return 3.0 * piece.allocated_rows(rows_cap) * piece.width / batch_size


def ring_bus_mb(gradient_mb: np.ndarray | float, devices: int) -> np.ndarray | float:
    """The MB a ring all-reduce of `gradient_mb` moves on each device's link: 2(D-1)/D of it (the one formula the
    all-reduce's price and its fit share)."""
    return 2 * (devices - 1) / devices * gradient_mb


def ring_link_ms(
    gradient_mb: np.ndarray | float,
    devices: int,
    devices_per_host: int,
    inter_host_gbps: float,
    links: LinkProfile,
    host_link_gbps: float | None = None,
) -> np.ndarray:
    """The links' price of a ring all-reduce of `gradient_mb` MB over `devices` on hosts of `devices_per_host`:
    the profile's fixed time, a latency per ring step (2(D-1)), then each link's share of the ring's bus bytes
    (`ring_bus_mb`), waiting for the slowest, as the ring is pipelined. Inside a host a device's ring neighbour
    receives the bus bytes at the rate inside a host. Between hosts, NCCL runs a ring per NIC (a channel each, a
    host's L devices' L NICs), each crossing every host boundary once with 1/L of the gradient: a NIC carries the
    bus bytes / L; where a host's devices share one link (`host_link_gbps`), it carries them all. Hierarchical
    all-reduces (reduce-scatter in the host, all-reduce between hosts, all-gather) move (H-1)/H of that between
    hosts for (D-1)/D: at most 2x fewer, at 2 hosts, and as many as hosts grow. Of several gradients (an array),
    each one's."""
    gradient_mb = np.asarray(gradient_mb, dtype=np.float64)
    if devices < 2:
        return np.zeros_like(gradient_mb)
    bus = ring_bus_mb(gradient_mb, devices)  # MB; MB over GB/s is ms
    moving = bus / inter_host_gbps / devices_per_host
    if host_link_gbps is not None:
        moving = np.maximum(moving, bus / host_link_gbps)
    if devices_per_host > 1:
        moving = np.maximum(moving, bus / links.intra_host_gbps)
    ms = links.collective_ms + links.message_ms * 2 * (devices - 1) + moving
    return np.where(gradient_mb > 0, ms, 0.0)


def gradient_mb(piece: TablePiece, rows_cap: int | None) -> float:
    """MB of a data-parallel replica's dense gradient, which its all-reduce moves (0 for a sharded piece)."""
    if not piece.replicated:
        return 0.0
    return piece.allocated_rows(rows_cap) * piece.width * piece.table.bytes_per_element / 1e6


@dataclass
class Candidate:
    """Pieces on devices with their simulated cost: a plan as the searches hold it."""

    pieces: list[TablePiece]
    assign: np.ndarray
    cost: float

    def plan(self, num_devices: int, algorithm: str) -> Plan:
        return Plan.from_assignment(self.pieces, self.assign, num_devices, algorithm)


@dataclass(frozen=True)
class PieceSizes:
    """Per piece: output all-to-all, input all-to-all, gradient all-reduce and intra-host partial-sum
    widths (float columns), a replica's gradient MB, memory need (bytes), the devices it may go to ([n, D] bools), its
    constraints group (-1: none) and the set of all-to-alls it travels in (its `sharding_type`'s place
    in COLLECTIVE_TYPES; -1: a replica, in none)."""

    widths: np.ndarray
    inputs: np.ndarray
    syncs: np.ndarray
    gradient_mb: np.ndarray
    host_sums: np.ndarray
    need: np.ndarray
    allowed: np.ndarray
    group: np.ndarray
    kinds: np.ndarray

    def take(self, index: slice | np.ndarray) -> PieceSizes:
        """The sizes of the pieces at `index`."""
        return PieceSizes(*(getattr(self, f.name)[index] for f in fields(self)))

    @property
    def restricted(self) -> np.ndarray:
        """Pieces whose device is (partly) decided already: placed first, never moved alone."""
        return (~self.allowed).any(axis=1) | (self.group >= 0)


_ALLOWED = [f.name for f in fields(PieceSizes)].index("allowed")


def piece_sizes(pieces: list[TablePiece], topology: Topology, rows_cap: int | None = None) -> PieceSizes:
    return PieceSizes(
        widths=np.array([output_width(p) for p in pieces], dtype=np.float64),
        inputs=np.array([input_width(p) for p in pieces], dtype=np.float64),
        syncs=np.array([sync_width(p, topology.batch_size, rows_cap) for p in pieces], dtype=np.float64),
        gradient_mb=np.array([gradient_mb(p, rows_cap) for p in pieces], dtype=np.float64),
        host_sums=np.array([host_sum_width(p) for p in pieces], dtype=np.float64),
        need=np.array([p.memory_bytes(topology.optimizer) for p in pieces], dtype=np.int64),
        allowed=_allowed_devices(pieces, topology.num_devices),
        group=np.array([-1 if p.group is None else p.group for p in pieces], dtype=np.int64),
        kinds=np.array([-1 if p.replicated else COLLECTIVE_TYPES.index(p.sharding_type) for p in pieces], np.int64),
    )


def _allowed_devices(pieces: list[TablePiece], num_devices: int) -> np.ndarray:
    allowed = np.ones((len(pieces), num_devices), dtype=bool)
    for k, piece in enumerate(pieces):
        if piece.devices is not None:
            allowed[k] = False
            allowed[k, list(piece.devices)] = True
    return allowed


def single_costs(pricer: Pricer, pieces: list[TablePiece]) -> np.ndarray:
    enc = pricer.encodings(pieces)
    return pricer.compute(enc, np.ones(len(pieces), dtype=np.float32))


# A table whose column slice costs at least this share of it whole costs its lookups: a column slice keeps every lookup
# of the table, which only its rows divide (a narrow table of hundreds of lookups a sample: on a 64-device task of the
# generator's pool, 16 columns and 200 lookups, its quarter 79% of it; docs/results.md).
LOOKUP_BOUND = 0.5


def costs_its_lookups(slice_costs: list[float] | np.ndarray, single: float) -> bool:
    """Whether a table that costs `single` alone costs its lookups, its column slices costing `slice_costs` alone: the
    policy's finish splits such a table by rows (`shard_ray.policy.env`; `cost_search`'s packing of every dominant
    table split at once gained nothing from it, experiments/results/policy_finish_ways/)."""
    return len(slice_costs) > 0 and float(max(slice_costs)) >= LOOKUP_BOUND * single


def measured_collectives(plans: list[PlanMeasurement], devices_per_host: int | None) -> np.ndarray:
    """Every device's measured all-to-alls in plans that run one set of them (one sharding type, no replicas, no
    sums inside hosts) and whose gang timed them (not priced them: more devices than cores), as rows [n, 5]: the MB it received from its host mates, the MB from other hosts
    (`received_floats`), the ms it took, the MB its whole host received from other hosts (`host_received`: what
    a link its host's devices share carried), and the collective's index (one per plan measured and all-to-all,
    as `slowest_of_each` groups them); the input, forward and backward all-to-alls of each device."""
    rows = []
    collectives = 0
    for measured in plans:
        if measured.cost.priced_parts:  # the comm model's own prices: a fit to them would learn nothing
            continue
        num_devices, batch = measured.plan.num_devices, measured.cost.batch_size
        pieces, assign = measured.plan.assignment(measured.tables)
        topology = Topology(
            num_devices=num_devices, memory_bytes=1, batch_size=batch, devices_per_host=devices_per_host
        )
        sizes = piece_sizes(pieces, topology)
        if len(np.unique(sizes.kinds)) != 1 or sizes.kinds[0] < 0 or sizes.host_sums.any():
            continue
        to_mb = batch * 4 / 1e6
        local = devices_per_host or num_devices
        outputs = received_floats(np.bincount(assign, weights=sizes.widths, minlength=num_devices), devices_per_host)
        inputs = received_floats(np.bincount(assign, weights=sizes.inputs, minlength=num_devices), devices_per_host)
        outputs, inputs = (*outputs, host_received(outputs[1], local)), (*inputs, host_received(inputs[1], local))
        for d, device in enumerate(measured.cost.devices):
            for k, (received, phase, ms) in enumerate(
                ((inputs, 1, device.input_dist_ms), (outputs, 0, device.fwd_comm_ms), (outputs, 1, device.bwd_comm_ms))
            ):
                intra, inter, host = (part[d, phase] * to_mb for part in received)
                rows.append((intra, inter, ms, host, collectives + k))
        collectives += 3
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def slowest_of_each(rows: np.ndarray) -> np.ndarray:
    """`measured_collectives`' rows [n, 5] reduced to one per collective [m, 4]: the most any of its devices
    received over each link class and the longest any took. A collective ends with its slowest device, and the
    step waits for it: where devices take turns (more devices than cores), one that joins late finds its bytes
    already sent and times less than the collective took."""
    ids = rows[:, 4].astype(np.int64)
    reduced = np.full((ids.max() + 1 if len(ids) else 0, 4), -np.inf)
    for column in range(4):
        np.maximum.at(reduced[:, column], ids, rows[:, column])
    return reduced[np.isfinite(reduced).all(axis=1)]
