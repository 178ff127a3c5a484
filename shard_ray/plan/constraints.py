"""A constraints file for `plan`: where tables may go and how they may be sharded.

    {"tables": {"t0": {"devices": [0, 1]},                      # every shard of t0 on devices 0 and 1
                "t3": {"types": ["row_wise", "data_parallel"]},  # only these sharding types
                "t4": {"not_types": ["data_parallel"]}},         # any type but these
     "groups": [["t1", "t2"]]}                                   # whole, together on one device

JSON or YAML. Sharding types are TorchRec's names: table_wise, column_wise, row_wise,
table_row_wise (on topologies of several hosts), data_parallel. Row-wise, table-row-wise and
data-parallel tables live on every device or every device of a host, so they do not combine with
`devices`; a group's tables go table-wise. Every error names the table and the constraint.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shard_ray.errors import ShardRayError
from shard_ray.io import read_model
from shard_ray.plan.piece import SHARDING_TYPES, ShardingType
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.workload.tables import TableSpec, written_as_number

# Types whose shards cover every device (of a host): a table limited to some devices cannot take them.
_ON_EVERY_DEVICE = ("row_wise", "table_row_wise", "data_parallel")


class TableConstraint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: list[int] | None = Field(default=None, min_length=1)
    types: list[ShardingType] | None = Field(default=None, min_length=1)
    not_types: list[ShardingType] = []

    @field_validator("devices", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return written_as_number(value)


class Constraints(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tables: dict[str, TableConstraint] = {}
    groups: list[list[str]] = []

    @field_validator("groups")
    @classmethod
    def _no_empty_group(cls, groups: list[list[str]]) -> list[list[str]]:
        if any(not group for group in groups):
            raise ValueError("a group names the tables kept together on one device: an empty one keeps none")
        return groups

    def group_of(self, table: str) -> int | None:
        return next((g for g, members in enumerate(self.groups) if table in members), None)

    def devices_of(self, table: str) -> tuple[int, ...] | None:
        rule = self.tables.get(table)
        return None if rule is None or rule.devices is None else tuple(sorted(set(rule.devices)))

    def allowed_types(self, table: str) -> tuple[str, ...]:
        """The sharding types the table may take, in SHARDING_TYPES order."""
        if self.group_of(table) is not None:
            return ("table_wise",)
        rule = self.tables.get(table, TableConstraint())
        allowed = rule.types or SHARDING_TYPES
        limited = rule.devices is not None
        return tuple(
            t
            for t in SHARDING_TYPES
            if t in allowed and t not in rule.not_types and not (limited and t in _ON_EVERY_DEVICE)
        )

    def check(self, tables: list[TableSpec], topology: Topology) -> None:
        """Refuse constraints that name unknown tables or devices, or leave a table no way to go."""
        names = {t.name for t in tables}
        for name, rule in self.tables.items():
            if name not in names:
                raise ShardRayError(f"constraints name table {name!r}, which is not in the table file")
            beyond = [d for d in rule.devices or [] if not 0 <= d < topology.num_devices]
            if beyond:
                raise ShardRayError(
                    f"constraints put table {name!r} on devices {beyond}, beyond the {topology.num_devices} devices"
                )
            usable = [t for t in self.allowed_types(name) if t != "table_row_wise" or topology.num_hosts > 1]
            if not usable:
                why = []
                if rule.devices:
                    why.append(
                        "row_wise, table_row_wise and data_parallel take every device or a host's, not 'devices'"
                    )
                if topology.num_hosts == 1 and "table_row_wise" in (rule.types or SHARDING_TYPES):
                    why.append("table_row_wise needs several hosts (--devices-per-host)")
                raise ShardRayError(
                    f"constraints leave table {name!r} no sharding type: types {rule.types or 'any'}, not_types "
                    f"{rule.not_types}" + (f" ({'; '.join(why)})" if why else "")
                )
        seen: dict[str, int] = {}
        for g, members in enumerate(self.groups):
            if len(set(members)) < len(members):
                raise ShardRayError(f"constraints group {members} names a table twice")
            for name in members:
                if name not in names:
                    raise ShardRayError(
                        f"constraints group {members} names table {name!r}, which is not in the table file"
                    )
                if name in seen:
                    raise ShardRayError(f"table {name!r} is in two constraints groups; merge them")
                seen[name] = g
                rule = self.tables.get(name)
                if (
                    rule is not None
                    and (rule.types or rule.not_types)
                    and "table_wise" not in (rule.types or SHARDING_TYPES)
                ):
                    raise ShardRayError(
                        f"table {name!r} is in a group, which goes table-wise, but its types exclude table_wise"
                    )
            common = set(range(topology.num_devices))
            for name in members:
                common &= set(self.devices_of(name) or common)
            if not common:
                raise ShardRayError(f"constraints group {members}: its tables' devices have none in common")

    def violations(self, plan: Plan, tables: list[TableSpec]) -> list[str]:
        """What in `plan` breaks these constraints, one line per table and constraint."""
        shardings, of_table = plan.table_shardings(tables), plan.shards_of()
        problems = []
        for name in (t.name for t in tables):
            shards, kind = of_table[name], shardings[name].type
            if kind not in self.allowed_types(name):
                problems.append(
                    f"table {name!r} is {kind}, which its constraints do not allow ({', '.join(self.allowed_types(name))})"
                )
            devices = self.devices_of(name)
            outside = sorted({s.device for s in shards} - set(devices or range(plan.num_devices)))
            if outside:
                problems.append(f"table {name!r} is on devices {outside}, outside its constraint's {list(devices)}")
        for members in self.groups:
            devices = {s.device for s in plan.shards if s.table in members}
            if len(devices) > 1:
                problems.append(f"constraints group {members} is spread over devices {sorted(devices)}")
        return problems


def load_constraints(path: str | os.PathLike[str]) -> Constraints:
    return read_model(path, "constraints", Constraints, "an object with 'tables' and/or 'groups'")
