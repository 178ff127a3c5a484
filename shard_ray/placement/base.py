"""The placement interface: tables and topology in, plan out.

Every algorithm is a callable `(tables, topology) -> Plan` built by a factory registered under
its name. A factory takes one `PlacementContext`: the seed, the cost models (loaded on first
use), and the algorithm's own settings, parsed by the settings dataclass it registered. `place`
knows no algorithm: it parses the settings, runs the placer, times and checks the plan, and
records what it was made with; a plan whose algorithm used the cost models carries their
estimate (predicted per-device costs and the task's lower bound), and `priced` gives any other plan one.
"""

from __future__ import annotations

import gc
import operator
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic_core import to_jsonable_python

from shard_ray.configfile import dataclass_from
from shard_ray.errors import InfeasibleError, ShardRayError, UnplaceableError, did_you_mean
from shard_ray.plan.constraints import Constraints
from shard_ray.plan.plan import Plan, PlanEstimate, PlanSettings
from shard_ray.plan.topology import Topology
from shard_ray.threads import one_thread
from shard_ray.workload.tables import TableSpec, validate_tables

if TYPE_CHECKING:
    from shard_ray.costmodel.bounds import LowerBound
    from shard_ray.costmodel.models import CostModels


class Placer(Protocol):
    def __call__(self, tables: list[TableSpec], topology: Topology) -> Plan: ...


@dataclass
class PlacementContext:
    """What a factory gets: the seed, the cost models (loaded from `cost_model` on first use), its settings."""

    seed: int = 0
    cost_model: str | None = None  # a model file; None: those calibrated for `hardware`, else the shipped ones
    hardware: str | None = None  # the hardware the plan is for (a hardware id), if known
    devices_per_host: int | None = None  # of the topology planned for: picks models calibrated over such hosts
    tables: list[TableSpec] | None = None  # the task: picks models calibrated on these tables
    settings: Any = None  # an instance of the algorithm's settings class, or None when it has none
    constraints: Constraints | None = None  # for algorithms registered as taking them
    _models: CostModels | None = field(default=None, repr=False)
    _lower_bounds: dict[str, LowerBound] = field(default_factory=dict, repr=False)  # by topology, of `tables`

    @property
    def models(self) -> CostModels:
        if self._models is None:
            from shard_ray.costmodel.models import CostModels, models_for

            path = self.cost_model or str(models_for(self.hardware, self.devices_per_host, self.tables))
            self._models = CostModels.load(path)
            # absolute, as the plan records it: relative, as given, it named another file from another folder (a
            # walk's `evaluate` measured for 40 s, then failed to find the plan's models)
            self.cost_model = str(Path(path).resolve())
        return self._models

    @property
    def used_models(self) -> bool:
        return self._models is not None

    def lower_bound(self, tables: list[TableSpec], topology: Topology) -> LowerBound:
        """The task's lower bound under the models (`shard_ray.costmodel.bounds.lower_bound`), computed once for
        the context's `tables` on a topology: a placer that reads it and the plan's estimate share it (0.46 s of 5,136
        tables on 512 devices, docs/results.md)."""
        from shard_ray.costmodel.bounds import lower_bound

        if tables is not self.tables:
            return lower_bound(self.models, tables, topology)
        key = topology.model_dump_json()
        if key not in self._lower_bounds:
            self._lower_bounds[key] = lower_bound(self.models, tables, topology)
        return self._lower_bounds[key]


Factory = Callable[[PlacementContext], Placer]


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str
    family: str
    description: str
    factory: Factory
    settings: type | None = None  # the algorithm's own settings dataclass (with a `check()`), if any
    max_tables: int | None = None  # tasks beyond this are refused (exact solvers)
    takes_constraints: bool = False  # honours a constraints file (pins, groups, sharding types)
    draws_progress: bool = False  # draws its own progress bar on a long placing (`place` says nothing for it)

    def handles(self, num_tables: int) -> bool:
        return self.max_tables is None or num_tables <= self.max_tables

    @property
    def uses_models(self) -> bool:
        """Whether it places by the cost models' prices (and so takes a `--cost-model`)."""
        return self.family in MODEL_FAMILIES


_REGISTRY: dict[str, AlgorithmInfo] = {}
# The algorithm families that place by the cost models' prices.
MODEL_FAMILIES = ("search", "exact", "rl")


def register(
    name: str,
    family: str,
    description: str,
    settings: type | None = None,
    max_tables: int | None = None,
    takes_constraints: bool = False,
    draws_progress: bool = False,
) -> Callable[[Factory], Factory]:
    def decorate(factory: Factory) -> Factory:
        _REGISTRY[name] = AlgorithmInfo(
            name, family, description, factory, settings, max_tables, takes_constraints, draws_progress
        )
        return factory

    return decorate


# A placing still running after this many seconds says so: a bar (`draws_progress`), else a line from `place`.
LONG_PLACING_S = 10.0
# How often `place` says it again, as a progress bar redraws into a log file (`quiet.quiet_output`).
STILL_PLACING_EVERY_S = 30.0

# Families in the order listings show them: baselines first, TorchRec's planner last.
FAMILIES = ("heuristic", "search", "exact", "rl", "planner")


def with_splitting_hint(err: InfeasibleError, why: str) -> InfeasibleError:
    """`err` and what may place the tables, after `why` the algorithm did not: cost_search, which splits any table by
    rows to fit them together; `err` alone where no algorithm places them (`UnplaceableError`: a walk was sent from
    neuroshard to cost_search, which refused the same tables)."""
    if isinstance(err, UnplaceableError):
        return err
    return InfeasibleError(
        f"{err}; {why}: cost_search also splits others by rows to fit them together, and may place them"
    )


def algorithms() -> list[AlgorithmInfo]:
    """Every registered algorithm, by family (unknown families last), in registration order within one."""
    rank = {family: i for i, family in enumerate(FAMILIES)}
    return sorted(_REGISTRY.values(), key=lambda info: rank.get(info.family, len(FAMILIES)))


def algorithm(name: str) -> AlgorithmInfo:
    if name not in _REGISTRY:
        raise ShardRayError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}{did_you_mean(name, _REGISTRY)}"
        )
    return _REGISTRY[name]


def parse_settings(info: AlgorithmInfo, settings: Mapping[str, Any] | None) -> Any:
    """The algorithm's settings object from plain values (its defaults for what is not given)."""
    if info.settings is None:
        if settings:
            takers = ", ".join(i.name for i in _REGISTRY.values() if i.settings is not None)
            raise ShardRayError(
                f"{info.name!r} takes no search settings or others of its own (given: {', '.join(settings)}); "
                f"algorithms with settings: {takers}"
            )
        return None
    return dataclass_from(info.settings, dict(settings or {}), f"{info.name} settings")


def place(
    name: str,
    tables: list[TableSpec],
    topology: Topology,
    *,
    seed: int = 0,
    cost_model: str | None = None,
    hardware: str | None = None,
    settings: Mapping[str, Any] | None = None,
    settings_source: str | None = None,
    constraints: Constraints | None = None,
) -> Plan:
    """Plan `tables` on `topology` with algorithm `name`; the plan is checked, timed and annotated.

    `settings` are the algorithm's own (e.g. `{"samples": 4}` for dreamshard, a tuned file's values
    for cost_search), read from `settings_source` if given, which the plan records. `hardware`
    (a hardware id) picks the models calibrated for it when `cost_model` is not given. `constraints`
    (a constraints file's) are honoured by the algorithms registered as taking them, refused by the rest.
    """
    info = algorithm(name)
    if not hasattr(seed, "__index__") or operator.index(seed) < 0:  # numpy's own error, from a script's "7"
        raise ShardRayError(f"seed must be a whole number, 0 or more, got {seed!r}")
    tables = validate_tables(tables)
    if not info.handles(len(tables)):
        raise ShardRayError(f"{name!r} is for tasks of at most {info.max_tables} tables; this one has {len(tables)}")
    if constraints is not None:
        if not isinstance(constraints, Constraints):  # a dict from a script, say: an AttributeError deep in the check
            raise ShardRayError(
                "constraints: give a Constraints (shard_ray.plan.constraints: Constraints(tables={...}, groups=[...]), "
                f"or load_constraints(path)), not a {type(constraints).__name__}"
            )
        if not info.takes_constraints:
            takers = ", ".join(i.name for i in _REGISTRY.values() if i.takes_constraints)
            raise ShardRayError(f"{name!r} does not take a constraints file; algorithms that do: {takers}")
        constraints.check(tables, topology)
    context = PlacementContext(
        seed=seed,
        cost_model=cost_model,
        hardware=hardware,
        devices_per_host=topology.devices_per_host_if_spanning,
        tables=tables,
        settings=parse_settings(info, settings),
        constraints=constraints,
    )
    placer = info.factory(context)
    # the search, the lower bound and the estimate price with the models
    with one_thread(), _earlier_objects_unscanned():
        start = time.perf_counter()
        if info.draws_progress:
            plan = placer(tables, topology)
        else:
            task = f"{len(tables):,} table{'s' if len(tables) != 1 else ''} on {topology.num_devices:,} device" + (
                "s" if topology.num_devices != 1 else ""
            )
            with said_while_long(f"{name}: still placing {task}"):
                plan = placer(tables, topology)
        elapsed = time.perf_counter() - start
        # The settings first: they say which hosts the plan spans, which its check and the constraints' need.
        plan = plan.model_copy(update={"settings": _settings(topology, context, settings_source)})
        plan.check(tables)
        plan.check_memory(tables, topology)
        plan = plan.model_copy(
            update={"placement_seconds": elapsed, "memory_bytes": plan.device_memory_bytes(tables, topology)}
        )
        broken = constraints.violations(plan, tables) if constraints is not None else []
        if broken:
            raise ShardRayError(f"{name}'s plan breaks the constraints: {'; '.join(broken)}")
        if context.used_models:
            plan = plan.model_copy(update={"estimate": _estimate(plan, tables, topology, context)})
    return plan


def plan_tables(
    name: str,
    tables: list[TableSpec],
    topology: Topology,
    *,
    seed: int = 0,
    cost_model: str | None = None,
    hardware: str | None = None,
    settings: Mapping[str, Any] | None = None,
    settings_source: str | None = None,
    constraints: Constraints | None = None,
    say: Callable[[str], None] | None = None,
) -> Plan:
    """The plan `shard-ray plan` makes, before any measuring: `place` for the hardware the plan is for (`hardware`,
    checked; by default this machine's, as the profiling actors and the gang name it), so that the models `calibrate`
    saved for it price and place; where `topology` spans hosts and gives no rate between them, the rate
    `with_fitted_links` takes (its line to `say`); a plan placed without the models (a heuristic's, TorchRec's) priced
    by them all the same (`priced`). `place` alone, called from a script, took the shipped models, TorchRec's default
    rate between hosts and left heuristics' plans unpriced (a walk). The plan's topology is `plan.topology()`."""
    from shard_ray.profiling.hardware import check_hardware_id, hardware_id

    if hardware is None:
        hardware = hardware_id(threads=1)
    else:
        check_hardware_id(hardware)
    context = PlacementContext(
        cost_model=cost_model, hardware=hardware, devices_per_host=topology.devices_per_host_if_spanning, tables=tables
    )
    topology, rate_between_hosts = with_fitted_links(topology, context)
    if rate_between_hosts and say is not None:
        say(rate_between_hosts)
    plan = place(
        name,
        tables,
        topology,
        seed=seed,
        cost_model=cost_model,
        hardware=hardware,
        settings=settings,
        settings_source=settings_source,
        constraints=constraints,
    )
    if plan.estimate is None:
        plan = priced(plan, tables, topology, cost_model, hardware)
    return plan


@contextmanager
def said_while_long(
    line: str, after_s: float = LONG_PLACING_S, every_s: float = STILL_PLACING_EVERY_S
) -> Iterator[None]:
    """`line` and the seconds so far on stderr once the block has run `after_s`, then every `every_s`, from a thread
    of its own: for placers that draw no bar (TorchRec's planner ran 31 s for 26 tables on 512 devices, and minutes on
    20,000 on 1,024, saying nothing, a walk). What the block does is untouched."""
    done = threading.Event()
    began = time.perf_counter()

    def say() -> None:
        wait = after_s
        while not done.wait(wait):
            print(f"{line} ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr, flush=True)
            wait = every_s

    thread = threading.Thread(target=say, name="still-placing", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def _earlier_objects_unscanned() -> Iterator[None]:
    """Python's collector leaves the objects alive before the placement alone while it runs (`gc.freeze`): a
    placement makes millions of small objects, and each full collection walked every table, module and tensor of the
    process again (0.32-0.40 s of `cost_search`'s and the policy's placing of 5,136 tables on 512 devices,
    docs/results.md). A frozen object still goes when its last reference does; only cycles among them wait for the thaw.
    A placement inside another (or beside one on another thread) finds them frozen and leaves the thaw to the first."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _settings(topology: Topology, context: PlacementContext, source: str | None) -> PlanSettings:
    """What the plan is made for, as its file records it."""
    constraints = context.constraints
    return PlanSettings.for_topology(
        topology,
        seed=context.seed,
        algorithm=to_jsonable_python(asdict(context.settings)) if context.settings is not None else {},
        source=source,
        constraints=constraints.model_dump(mode="json", exclude_defaults=True) if constraints is not None else None,
        tables=context.tables,
    )


def with_fitted_links(topology: Topology, context: PlacementContext) -> tuple[Topology, str | None]:
    """`topology` with the rate between hosts that prices a plan given none (`rate_between_hosts`: the rate
    `calibrate` fitted to the hosts of `context`'s models, else TorchRec's default capped at the rate inside a
    host), where the topology spans hosts and was given no rate of its own; and a line saying which, None where the
    topology gave it or has one host. A rate given (`--inter-host-gbps`, a plan file's) stands."""
    from shard_ray.costmodel.links import rate_between_hosts

    if topology.num_hosts < 2 or "inter_host_gbps" in topology.model_fields_set:
        return topology, None
    links = context.models.links
    gbps, source = rate_between_hosts(links, topology.intra_host_gbps)
    hint = (
        "--inter-host-gbps gives another"
        if links.inter_host_gbps is not None
        else "--inter-host-gbps gives your links' rate; `calibrate` over hosts measures it"
    )
    update: dict[str, float] = {"inter_host_gbps": gbps}
    per, shared = "a device", ""
    if links.host_link_gbps is not None and topology.host_link_gbps is None:
        update["host_link_gbps"] = links.host_link_gbps
        per, shared = "a host", ", one link its devices share, as `calibrate` found them"
    return topology.model_copy(update=update), (
        f"between hosts: {gbps:.4g} GB/s {per} ({gbps * 8e3:.0f} Mbit/s), {source}{shared} ({hint})"
    )


def priced(
    plan: Plan, tables: list[TableSpec], topology: Topology, cost_model: str | None = None, hardware: str | None = None
) -> Plan:
    """`plan` with the cost models' estimate: for a plan made without them (a heuristic's, TorchRec's, a file's),
    so that every plan has a price beside the others. The models are picked as `place` picks them."""
    context = PlacementContext(
        cost_model=cost_model, hardware=hardware, devices_per_host=topology.devices_per_host_if_spanning, tables=tables
    )
    return plan.model_copy(update={"estimate": _estimate(plan, tables, topology, context)})


def _estimate(plan: Plan, tables: list[TableSpec], topology: Topology, context: PlacementContext) -> PlanEstimate:
    from shard_ray.costmodel.coverage import model_warnings
    from shard_ray.costmodel.models import describe_models
    from shard_ray.costmodel.simulator import Simulator

    models = context.models
    most_tables = max(len(shard) for shard in plan.pieces(tables))
    provenance, other_tables = describe_models(context.cost_model, models, tables)
    return PlanEstimate(
        predicted=Simulator(models).plan_cost(plan, tables, topology.batch_size),
        lower_bound_ms=context.lower_bound(tables, topology).ms,
        cost_model=context.cost_model,
        hardware=models.hardware,
        provenance=provenance,
        warnings=model_warnings(
            models,
            tables,
            context.hardware,
            most_tables,
            context.devices_per_host,
            topology.num_devices,
            topology.batch_size,
        )
        + ([other_tables] if other_tables else []),
    )
