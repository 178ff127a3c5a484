"""The devices a plan is for: how many, how much memory each, the batch and the optimizer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shard_ray.configfile import setting
from shard_ray.errors import ShardRayError
from shard_ray.workload.tables import TableSpec

Optimizer = Literal["rowwise_adagrad", "sgd", "adam"]
GB = 1024**3


def format_gb(nbytes: float) -> str:
    """Bytes as GiB (as every cap here) to three significant digits, so small tables do not read 0.000 GiB."""
    return f"{nbytes / GB:.3g} GiB"


# The most devices a plan is for, and the most memory a device's cap may give (a million GiB, far above any device's;
# past about 8e9 GiB a cap's bytes no longer fit the 64-bit integers its ledger counts in).
MAX_DEVICES = 4096
MAX_MEMORY_GB = 1e6


class Topology(BaseModel):
    """`memory_bytes` is each device's cap for embedding weights plus optimizer state.

    Devices are numbered host by host, as torch.distributed ranks are: device d is on host
    d // devices_per_host. `devices_per_host` None means one host holds them all.
    `inter_host_gbps` is each device's bandwidth to other hosts in GB/s (a NIC per GPU, as with
    GPUDirect RDMA; TorchRec's planner assumes 12.5), priced only when the devices span hosts.
    `intra_host_gbps`, where given, is the GB/s a device receives from its host mates, in place of the link
    profile of the models' hardware (`shard_ray.costmodel.links`).
    `host_link_gbps`, where given, is the GB/s of the one link a host's devices share to other hosts (a NIC per
    host rather than per GPU; a host of the emulated cluster): a device's traffic from other hosts then also
    waits for all that its host receives over that link. None: each device's own link, nothing shared.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_devices: int = Field(ge=1, le=MAX_DEVICES)
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_GB * GB)
    batch_size: int = Field(default=1024, ge=1)
    optimizer: Optimizer = "rowwise_adagrad"
    devices_per_host: int | None = Field(default=None, ge=1)
    inter_host_gbps: float = Field(default=12.5, gt=0)
    intra_host_gbps: float | None = Field(default=None, gt=0)
    host_link_gbps: float | None = Field(default=None, gt=0)

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _whole_bytes(cls, value: Any) -> Any:
        """`memory_gb * GB`, as the docs write it: a float of bytes rounded to whole bytes (1.3 * GB was refused)."""
        return round(value) if isinstance(value, float) and value == value and abs(value) != float("inf") else value

    @model_validator(mode="after")
    def _whole_hosts(self) -> Topology:
        if self.devices_per_host is not None and self.num_devices % self.devices_per_host:
            raise ValueError(
                f"{self.num_devices} devices do not fill hosts of {self.devices_per_host}: "
                "the device count must be a multiple of the devices per host"
            )
        return self

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    @property
    def devices_per_host_or_all(self) -> int:
        """The devices per host, every device when one host holds them all (torch.distributed's local world size)."""
        return self.devices_per_host or self.num_devices

    @property
    def num_hosts(self) -> int:
        return self.num_devices // self.devices_per_host_or_all

    @property
    def devices_per_host_if_spanning(self) -> int | None:
        """The devices per host when the devices span several hosts; None on one host (as a plan's and a
        measurement's `devices_per_host` say it), whatever `devices_per_host` was set to."""
        return self.devices_per_host if self.num_hosts > 1 else None


def shard_bytes(table: TableSpec, width: int, optimizer: Optimizer, rows: int | None = None) -> int:
    """Bytes `width` columns of `rows` rows (all, by default) of a table take: weights at their precision plus optimizer state.

    Exact row-wise Adagrad keeps one fp32 per row in every shard; Adam keeps two fp32 moments
    per element; SGD keeps nothing.
    """
    rows = table.rows if rows is None else rows
    weights = rows * width * table.bytes_per_element
    if optimizer == "rowwise_adagrad":
        return weights + rows * 4
    if optimizer == "adam":
        return weights + 2 * rows * width * 4
    return weights


def memory_cap_with_headroom(
    tables: list[TableSpec], num_devices: int, headroom: float, optimizer: Optimizer = "rowwise_adagrad"
) -> int:
    """A per-device cap `headroom` times an even split of all tables, and never below the largest table."""
    sizes = [shard_bytes(t, t.dim, optimizer) for t in tables]
    return int(max(headroom * sum(sizes) / num_devices, 1.05 * max(sizes))) + 1


def check_whole_hosts(
    num_devices: int,
    devices_per_host: int | None,
    inter_host_gbps: float | None = None,
    host_link_gbps: float | None = None,
) -> None:
    """Refuse `--devices-per-host` that does not divide the device count, naming the flag (before `Topology`'s own
    check, which a user's flags reach only once the work has started), and a rate of the links between hosts given
    for devices on one host, which nothing would price (a user who left out --devices-per-host)."""
    if devices_per_host and num_devices % devices_per_host:
        raise ShardRayError(
            f"--devices-per-host {devices_per_host} does not divide {num_devices} devices: give a device count that "
            "fills whole hosts"
        )
    links = [
        flag for flag, rate in (("--inter-host-gbps", inter_host_gbps), ("--host-link-gbps", host_link_gbps)) if rate
    ]
    if links and (devices_per_host or num_devices) >= num_devices:
        one_host = (
            f"--devices-per-host {devices_per_host} puts these {num_devices} devices on one host"
            if devices_per_host
            else f"without --devices-per-host these {num_devices} devices are one host"
        )
        raise ShardRayError(
            f"{links[0]} prices the links between hosts, and {one_host}: give --devices-per-host, the devices of a "
            "host, below the device count"
        )


def devices_per_host_setting(default: str) -> Any:
    """`--devices-per-host`, the hosts a topology's devices are on (`default`: what it is when not given)."""
    return setting(
        None,
        "devices on each host (GPUs per node), ranks numbered host by host; it must divide the device count "
        f"(default: {default})",
        min=1,
    )


def inter_host_gbps_setting(default: str) -> Any:
    """`--inter-host-gbps`, each device's rate to other hosts (`default`: what it is when not given)."""
    torchrec = Topology.model_fields["inter_host_gbps"].default
    return setting(
        None,
        "each device's bandwidth to other hosts in GB/s, for the traffic that crosses hosts when "
        f"--devices-per-host splits the devices (default: {default}the rate `calibrate` fitted over such hosts where "
        f"the models have one, else TorchRec's {torchrec}, or the rate inside a host where that is lower)",
        min=1e-9,
    )


def host_link_gbps_setting(default: str) -> Any:
    """`--host-link-gbps`, one link a host's devices share (`default`: what it is when not given)."""
    return setting(
        None,
        "GB/s of the one link a host's devices share to other hosts (a NIC per host, not per GPU; an emulated "
        "cluster's links), where they share one: a device then also waits for all its host receives over it "
        f"(default: {default}none shared: each device's own --inter-host-gbps)",
        min=1e-9,
    )
