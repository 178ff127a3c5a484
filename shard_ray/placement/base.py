"""The placement interface: tables and topology in, plan out.

Every algorithm is a callable `(tables, topology) -> Plan` built by a factory registered
under its name; `place` runs one, times it and checks the plan before handing it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shard_ray.errors import ShardRayError
from shard_ray.plan.plan import Plan, Shard
from shard_ray.plan.topology import GB, Topology, shard_bytes
from shard_ray.workload.tables import TableSpec, validate_tables


class Placer(Protocol):
    def __call__(self, tables: list[TableSpec], topology: Topology) -> Plan: ...


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str
    family: str
    description: str
    factory: Callable[..., Placer]
    needs_cost_model: bool = False
    needs_policy: bool = False  # a trained placement policy (default: the shipped one)
    takes_search_config: bool = False  # search settings, e.g. a sweep's best (default: its own)
    max_tables: int | None = None  # tasks beyond this are refused (exact solvers)

    def handles(self, num_tables: int) -> bool:
        return self.max_tables is None or num_tables <= self.max_tables


_REGISTRY: dict[str, AlgorithmInfo] = {}


def register(
    name: str,
    family: str,
    description: str,
    needs_cost_model: bool = False,
    needs_policy: bool = False,
    max_tables: int | None = None,
    takes_search_config: bool = False,
) -> Callable[[Callable[..., Placer]], Callable[..., Placer]]:
    def decorate(factory: Callable[..., Placer]) -> Callable[..., Placer]:
        _REGISTRY[name] = AlgorithmInfo(
            name, family, description, factory, needs_cost_model, needs_policy, takes_search_config, max_tables
        )
        return factory

    return decorate


def algorithms() -> list[AlgorithmInfo]:
    return list(_REGISTRY.values())


def place(
    name: str,
    tables: list[TableSpec],
    topology: Topology,
    seed: int = 0,
    cost_model: str | None = None,
    policy: str | None = None,
    samples: int = 0,
    search_config: str | None = None,
) -> Plan:
    """Plan `tables` on `topology` with algorithm `name`; the plan is checked and timed.

    Algorithms that search with cost models load `cost_model` (default: the models shipped for
    the reference CPU machine); their plans carry the simulated per-device costs and the task's
    lower bound in their metadata. Policy algorithms load `policy` (default: the shipped one)
    and keep the best of greedy decoding and `samples` sampled plans. `search_config`, a
    tuned-config file from `tune search`, sets the search of algorithms that take one.
    """
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ShardRayError(f"unknown algorithm {name!r}; known: {known}")
    tables = validate_tables(tables)
    info = _REGISTRY[name]
    if not info.handles(len(tables)):
        raise ShardRayError(f"{name!r} is for tasks of at most {info.max_tables} tables; this one has {len(tables)}")
    if search_config is not None and not info.takes_search_config:
        takers = ", ".join(i.name for i in _REGISTRY.values() if i.takes_search_config)
        raise ShardRayError(f"{name!r} takes no search settings; tuned search settings are for {takers}")
    settings: dict[str, Any] = {
        "memory_gb": topology.memory_gb,
        "batch_size": topology.batch_size,
        "optimizer": topology.optimizer,
        "seed": seed,
    }
    models = None
    if info.needs_cost_model:
        from shard_ray.costmodel.models import CostModels, default_cost_model_path

        path = cost_model or str(default_cost_model_path())
        models = CostModels.load(path)
        settings.update({"cost_model": path, "cost_model_hardware": models.hardware})
        if info.needs_policy:
            from shard_ray.policy.network import default_policy_path

            settings.update({"policy": policy or str(default_policy_path()), "samples": samples})
            placer = info.factory(models=models, policy=policy, samples=samples, seed=seed)
        elif search_config is not None:
            from shard_ray.placement.search import SearchConfig
            from shard_ray.tuning.sweep import dataclass_from, load_tuned

            settings["search_config"] = search_config
            config = dataclass_from(
                SearchConfig, load_tuned(search_config, "search"), f"tuned search settings {search_config}"
            )
            placer = info.factory(models=models, seed=seed, config=config)
        else:
            placer = info.factory(models=models, seed=seed)
    else:
        placer = info.factory(seed=seed)
    start = time.perf_counter()
    plan = placer(tables, topology)
    elapsed = time.perf_counter() - start
    plan = plan.model_copy(update={"placement_seconds": elapsed})
    plan.check(tables)
    plan.check_memory(tables, topology)
    plan.metadata["settings"] = settings
    plan.metadata["memory_bytes"] = plan.device_memory_bytes(tables, topology)
    if models is not None:
        from shard_ray.costmodel.bounds import lower_bound_ms
        from shard_ray.costmodel.simulator import Simulator

        predicted = Simulator(models).plan_cost(plan, tables, topology.batch_size)
        plan.metadata["predicted"] = predicted.model_dump(mode="json")
        plan.metadata["predicted_cost_ms"] = predicted.cost_ms
        plan.metadata["lower_bound_ms"] = lower_bound_ms(models, tables, topology, column_wise=True)
    return plan


class MemoryLedger:
    """Free memory per device while an algorithm places tables one at a time."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.free = [topology.memory_bytes] * topology.num_devices

    def need(self, table: TableSpec, width: int | None = None) -> int:
        return shard_bytes(table, table.dim if width is None else width, self.topology.optimizer)

    def fits(self, device: int, table: TableSpec, width: int | None = None) -> bool:
        return self.need(table, width) <= self.free[device]

    def devices_with_room(self, table: TableSpec, width: int | None = None) -> list[int]:
        devices = [d for d in range(self.topology.num_devices) if self.fits(d, table, width)]
        if not devices:
            raise ShardRayError(
                f"table {table.name!r} needs {self.need(table, width) / GB:.3f} GB "
                f"(weights + {self.topology.optimizer} state) but no device has that much free "
                f"(most free: {max(self.free) / GB:.3f} GB of {self.topology.memory_gb:.3f} GB)"
            )
        return devices

    def take(self, device: int, table: TableSpec, width: int | None = None) -> None:
        self.free[device] -= self.need(table, width)


def table_wise_shard(table: TableSpec, device: int) -> Shard:
    return Shard(table=table.name, device=device, columns=(0, table.dim))
