"""The one measurement store: an SQLite file of measurements keyed by content and hardware.

It holds fused-shard measurements (from the profiling actors) and whole-plan measurements
(from the device gang), one table each.

Writes are single transactions in WAL mode, so a run killed mid-write leaves the store as it
was before that write; a key is stored at most once, so re-runs skip what is measured.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from shard_ray.errors import ShardRayError
from shard_ray.plan.cost import PlanCost
from shard_ray.plan.plan import Plan
from shard_ray.profiling.procedure import MEASUREMENT_PROCEDURE, FusedShardMeasurement, MeasureConfig, content_digest
from shard_ray.workload.tables import TableSpec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS shard_measurements (
    key TEXT PRIMARY KEY,
    hardware TEXT NOT NULL,
    status TEXT NOT NULL,
    num_tables INTEGER NOT NULL,
    fwd_ms REAL,
    bwd_ms REAL,
    reason TEXT,
    record TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS shard_measurements_hardware ON shard_measurements (hardware);
CREATE TABLE IF NOT EXISTS plan_measurements (
    key TEXT PRIMARY KEY,
    hardware TEXT NOT NULL,
    num_devices INTEGER NOT NULL,
    batch_size INTEGER NOT NULL,
    cost_ms REAL NOT NULL,
    record TEXT NOT NULL,
    created REAL NOT NULL
);
"""


class PlanMeasurement(BaseModel):
    """A plan measured on the device gang, with the tables it placed, and the MEASUREMENT_PROCEDURE it was taken by
    (the store reads records from before it was kept as procedure 1: `read_record`)."""

    key: str
    plan: Plan
    tables: list[TableSpec]
    cost: PlanCost
    procedure: int = MEASUREMENT_PROCEDURE

    @property
    def hardware(self) -> str:
        return self.cost.hardware


def plan_key(
    plan: Plan, tables: list[TableSpec], config: MeasureConfig, hardware: str, hosts: list[int] | None = None
) -> str:
    """The plan's measurement key; `hosts` (each device's host) counts only when the devices span several,
    so one-host measurements keep the keys they had."""
    by_name = {t.name: t for t in tables}
    # A shard's dump less its defaults: table- and column-wise plans keep the keys they had.
    shards = sorted(
        (s.device, s.columns, content_digest(by_name[s.table].model_dump(mode="json", exclude={"name"})))
        + tuple((k, v) for k, v in sorted(s.model_dump(mode="json").items()) if k in ("rows", "replicated"))
        for s in plan.shards
    )
    identity = {
        "shards": shards,
        "devices": plan.num_devices,
        "config": config.model_dump(mode="json"),
        "procedure": MEASUREMENT_PROCEDURE,
    }
    if hosts is not None and len(set(hosts)) > 1:
        identity["hosts"] = hosts
    return content_digest({**identity, "hardware": hardware})


Record = TypeVar("Record", FusedShardMeasurement, PlanMeasurement)


def read_record(kind: type[Record], record: str) -> Record:
    """A stored measurement's JSON record; one kept before measurements carried their procedure is of procedure 1."""
    fields = json.loads(record)
    fields.setdefault("procedure", 1)
    return kind.model_validate(fields)


STORE_TABLES = {"shard_measurements", "plan_measurements"}


def existing_store(path: str | os.PathLike[str]) -> str:
    """`path` where it is a measurement store's file to read; refused in a line naming what it is otherwise."""
    refuse_store_folder(path)
    if not Path(path).is_file():
        raise ShardRayError(f"measurement store not found: {path}")
    return str(path)


def refuse_store_folder(path: str | os.PathLike[str]) -> None:
    """Refuse a folder given as the store, naming the store file in it where there is one: read as a file, a folder
    was 'not found' to one command and 'not a usable SQLite file' to another (a walk)."""
    if Path(path).is_dir():
        inside = sorted(p.name for p in Path(path).glob("*.db"))
        hint = f" ({', '.join(str(Path(path) / name) for name in inside[:3])} in it)" if inside else ""
        raise ShardRayError(f"measurement store {path} is a folder: give the store's file{hint}")


class MeasurementStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        refuse_store_folder(path)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path)
            tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and not tables & STORE_TABLES:  # another program's database (MLflow's, say): left untouched
                self._db.close()
                shown = ", ".join(sorted(tables)[:4]) + (", ..." if len(tables) > 4 else "")
                raise ShardRayError(
                    f"{self.path} is not a measurement store: an SQLite database of other tables ({shown}); give "
                    "the store's file (default shard-ray-out/measurements.db) or a new one"
                )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as err:
            raise ShardRayError(f"measurement store {self.path} is not a usable SQLite file: {err}") from err

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> MeasurementStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def known_keys(self, keys: Iterable[str], table: str = "shard_measurements") -> set[str]:
        assert table in ("shard_measurements", "plan_measurements")
        keys = list(keys)
        found: set[str] = set()
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            rows = self._db.execute(f"SELECT key FROM {table} WHERE key IN ({','.join('?' * len(chunk))})", chunk)
            found.update(row[0] for row in rows)
        return found

    def put_plan(self, measurement: PlanMeasurement) -> bool:
        """Store a plan measurement unless its key is there already; True when it was added."""
        with self._db:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO plan_measurements VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    measurement.key,
                    measurement.hardware,
                    measurement.plan.num_devices,
                    measurement.cost.batch_size or 0,
                    measurement.cost.cost_ms,
                    measurement.model_dump_json(),
                    time.time(),
                ),
            )
        return cursor.rowcount == 1

    def get_plan(self, key: str) -> PlanMeasurement | None:
        row = self._db.execute("SELECT record FROM plan_measurements WHERE key = ?", (key,)).fetchone()
        return None if row is None else read_record(PlanMeasurement, row[0])

    def plan_measurements(self, hardware: str | None = None) -> list[PlanMeasurement]:
        query, args = "SELECT record FROM plan_measurements", ()
        if hardware is not None:
            query, args = query + " WHERE hardware = ?", (hardware,)
        return [read_record(PlanMeasurement, row[0]) for row in self._db.execute(query + " ORDER BY created", args)]

    def put_fused_shard(self, measurement: FusedShardMeasurement) -> bool:
        """Store a measurement unless its key is there already; True when it was added."""
        with self._db:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO shard_measurements VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    measurement.key,
                    measurement.hardware,
                    measurement.status,
                    len(measurement.tables),
                    measurement.fwd_ms,
                    measurement.bwd_ms,
                    measurement.reason,
                    measurement.model_dump_json(),
                    time.time(),
                ),
            )
        return cursor.rowcount == 1

    def get_fused_shard(self, key: str) -> FusedShardMeasurement | None:
        row = self._db.execute("SELECT record FROM shard_measurements WHERE key = ?", (key,)).fetchone()
        return None if row is None else read_record(FusedShardMeasurement, row[0])

    def fused_shard_measurements(self, hardware: str | None = None) -> list[FusedShardMeasurement]:
        query, args = "SELECT record FROM shard_measurements", ()
        if hardware is not None:
            query, args = query + " WHERE hardware = ?", (hardware,)
        return [
            read_record(FusedShardMeasurement, row[0]) for row in self._db.execute(query + " ORDER BY created", args)
        ]

    def count(self, table: str = "shard_measurements") -> int:
        assert table in ("shard_measurements", "plan_measurements")
        return int(self._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

    def summary(self) -> dict[str, dict[str, int]]:
        """Measurement counts per hardware and status."""
        out: dict[str, dict[str, int]] = {}
        for hardware, status, n in self._db.execute(
            "SELECT hardware, status, COUNT(*) FROM shard_measurements GROUP BY hardware, status"
        ):
            out.setdefault(hardware, {})[status] = n
        return out

    def main_hardware(self, hardware: str | None = None) -> str:
        """The hardware whose successful shard measurements the cost models train on: `hardware`, checked, or the one
        with the most (the first by name of a tie). Refused in a line where there are none, before a command imports
        torch."""
        counts = {name: by_status["ok"] for name, by_status in self.summary().items() if by_status.get("ok")}
        if not counts:
            raise ShardRayError("the store has no successful shard measurements to train on")
        if hardware is not None:
            if hardware not in counts:
                raise ShardRayError(
                    f"the store has no shard measurements on {hardware!r}; it has some of {', '.join(sorted(counts))}"
                )
            return hardware
        return min(counts, key=lambda name: (-counts[name], name))
