"""How fast a device's collectives move bytes on a kind of hardware: its link profile.

A collective is priced from physics (`shard_ray.costmodel.pricing.link_ms`): a fixed time per collective call,
a latency per peer a device exchanges a message with, and the bytes the device receives over each link class
at that class's rate, waiting for the slower class (a host's links and its network run at once). The comm model
learned from measurement prices above that where it saw more; the links' price is the floor no collective
falls below as devices are added.

The rate between hosts is the topology's (`--inter-host-gbps`: a NIC per GPU, or the emulated links' measured
rate); the profile gives the rest. GPUs' figures are published ones, nominal, not measured here: NCCL's
achieved all-to-all bandwidth is below them, and `calibrate` on the hardware fits what it achieves
(`fit_link_rate`). The CPU's are fitted to measured gloo all-to-alls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from shard_ray.plan.topology import Topology

if TYPE_CHECKING:
    from shard_ray.plan.plan import Plan


class LinkProfile(BaseModel):
    """A device's collectives on one kind of hardware, and where the figures come from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    collective_ms: float = Field(ge=0)  # a collective call's fixed time: launch and synchronisation
    message_ms: float = Field(ge=0)  # per peer a device exchanges a message with
    intra_host_gbps: float = Field(gt=0)  # GB/s a device receives from its host mates
    source: str
    # GB/s between hosts where `calibrate` fitted it over hosts: `plan` takes it where no --inter-host-gbps is given
    inter_host_gbps: float | None = Field(default=None, gt=0)
    # where those hosts' devices were found to share one link (its rate, `inter_host_gbps`): `plan` takes it too
    host_link_gbps: float | None = Field(default=None, gt=0)


# NCCL's small-message all-to-all inside an 8-GPU NVLink host takes tens of microseconds (nccl-tests); assumed,
# not measured here.
_NCCL_MS = 0.02
_NCCL_MESSAGE_MS = 0.002
# Matched in order, by the hardware id's prefix: the first that matches.
PUBLISHED: tuple[tuple[str, LinkProfile], ...] = (
    (
        "cuda:NVIDIA H100 PCIe",
        LinkProfile(
            collective_ms=_NCCL_MS,
            message_ms=_NCCL_MESSAGE_MS,
            intra_host_gbps=64.0,
            source="PCIe 5.0 x16, 64 GB/s each way (NVIDIA H100 PCIe datasheet); nominal",
        ),
    ),
    *(
        (
            f"cuda:NVIDIA {gpu}",
            LinkProfile(
                collective_ms=_NCCL_MS,
                message_ms=_NCCL_MESSAGE_MS,
                intra_host_gbps=450.0,
                source=f"NVLink 4, 900 GB/s per GPU both ways (NVIDIA {gpu} datasheet); nominal",
            ),
        )
        for gpu in ("H100", "H200", "H20", "GH200")
    ),
    (
        "cuda:NVIDIA B200",
        LinkProfile(
            collective_ms=_NCCL_MS,
            message_ms=_NCCL_MESSAGE_MS,
            intra_host_gbps=900.0,
            source="NVLink 5, 1.8 TB/s per GPU both ways (NVIDIA B200 datasheet); nominal",
        ),
    ),
    (
        "cuda:NVIDIA A100",
        LinkProfile(
            collective_ms=_NCCL_MS,
            message_ms=_NCCL_MESSAGE_MS,
            intra_host_gbps=300.0,
            source="NVLink 3, 600 GB/s per GPU both ways (NVIDIA A100 SXM datasheet); nominal",
        ),
    ),
    (
        "cuda:",
        LinkProfile(
            collective_ms=_NCCL_MS,
            message_ms=_NCCL_MESSAGE_MS,
            intra_host_gbps=32.0,
            source="a GPU without its own profile: PCIe 4.0 x16, 32 GB/s each way; nominal",
        ),
    ),
    (
        "",
        LinkProfile(
            collective_ms=0.04,
            message_ms=0.0,
            intra_host_gbps=1.76,
            source=(
                "gloo between processes of one machine: `fit_link_rate` on 900 measured all-to-alls of 150 plans on "
                "the 2-core AMD EPYC (2 devices: the latency per peer is not told apart from the fixed time)"
            ),
        ),
    ),
)


def rate_between_hosts(links: LinkProfile, intra_host_gbps: float | None = None) -> tuple[float, str]:
    """The GB/s a device receives from other hosts where none is given, and where it comes from: the rate
    `calibrate` fitted over hosts (kept in `links`), else TorchRec's default capped at the rate inside a host
    (`intra_host_gbps`, else the profile's): a device receives from another host through the same stack as from
    its host mates and no faster (CPU's gloo inside a host is slower than TorchRec's default, which priced a plan
    over hosts below the same plan on one host)."""
    if links.inter_host_gbps is not None:
        return links.inter_host_gbps, "the rate `calibrate` fitted to these models' hosts"
    torchrec = Topology.model_fields["inter_host_gbps"].default  # TorchRec's planner's default
    inside = intra_host_gbps or links.intra_host_gbps
    if inside < torchrec:
        return inside, f"the rate inside a host, below TorchRec's default {torchrec:g}"
    return torchrec, "TorchRec's default"


def plan_links_between_hosts(plan: Plan, links: LinkProfile) -> tuple[float, float | None]:
    """The GB/s between hosts that prices `plan`, and that of a link its hosts' devices share (None: a link each):
    the rates it records, else the ones `plan` would take today (`rate_between_hosts`, and the shared link
    `calibrate` found)."""
    if plan.inter_host_gbps:
        return plan.inter_host_gbps, plan.host_link_gbps
    return rate_between_hosts(links, plan.intra_host_gbps)[0], plan.host_link_gbps or links.host_link_gbps


def link_profile(hardware: str | None) -> LinkProfile:
    """The link profile of `hardware` (a hardware id; None: the reference CPU's)."""
    return next(profile for prefix, profile in PUBLISHED if (hardware or "").startswith(prefix))


# The share of measured collectives a fitted profile may price above their measurement: it is a floor.
FLOOR_QUANTILE = 0.1


def fit_link_rate(received_mb: np.ndarray, measured_ms: np.ndarray) -> tuple[float, float]:
    """The fixed ms and the GB/s of a floor under measured collectives, `fixed + MB received / rate`: the rate by
    least squares (the large transfers set it), the fixed time the `FLOOR_QUANTILE` of what the bytes leave
    unexplained, at least 0 (a shaped link lets its first bytes through at once: tc's burst)."""
    received_mb = np.asarray(received_mb, dtype=np.float64)
    measured_ms = np.asarray(measured_ms, dtype=np.float64)
    design = np.stack([np.ones_like(received_mb), received_mb], axis=1)
    (_, ms_per_mb), *_ = np.linalg.lstsq(design, measured_ms, rcond=None)
    if ms_per_mb <= 0:
        raise ValueError("the measured collectives do not grow with the bytes received: no rate to fit")
    fixed = np.quantile(measured_ms - received_mb * ms_per_mb, FLOOR_QUANTILE)
    return max(float(fixed), 0.0), 1.0 / float(ms_per_mb)


def fit_link_between_hosts(
    own_mb: np.ndarray, host_mb: np.ndarray, measured_ms: np.ndarray
) -> tuple[float, float, bool, dict[bool, float]]:
    """The fixed ms and GB/s between hosts fitted to measured collectives (`fit_link_rate`), and whether a host's
    devices share one link: of a link per device (against `own_mb`, what each collective's slowest device received
    from other hosts) and one per host (`host_mb`, what its host did), the fit whose price is nearer the
    measurements, by the median relative error where the two differ (both errors returned, by `shared`). Where they
    never differ (hosts of one device), a link per device."""
    own_mb, host_mb, measured_ms = (np.asarray(a, dtype=np.float64) for a in (own_mb, host_mb, measured_ms))
    fits, errors = {False: fit_link_rate(own_mb, measured_ms)}, {}
    differ = host_mb > own_mb * 1.01
    if differ.any():
        fits[True] = fit_link_rate(host_mb, measured_ms)
        for shared, mb in ((False, own_mb), (True, host_mb)):
            fixed, gbps = fits[shared]
            errors[shared] = float(np.median(np.abs(fixed + mb / gbps - measured_ms)[differ] / measured_ms[differ]))
    shared = bool(errors) and errors[True] < errors[False]
    return *fits[shared], shared, errors
