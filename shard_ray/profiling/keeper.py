"""Device gangs kept between commands on a running Ray, so that a user running ten commands starts one gang.

A command joined to a Ray it did not start (`ray start --head`, a cluster, `ray job submit`) hands its gang, when it
is done with it, to the cluster's keeper (a named actor of no CPUs), which keeps it for `SHARD_RAY_KEEP_GANG_S`
seconds (60 unless set; 0 keeps none): the next command asking for a gang of the same shape (devices, hosts, threads,
the code that measures) takes its members, already started, joined, pinned and with their memory touched, instead of
starting new ones (docs/commands.md: a 2-device gang's start is most of what `compare` costs beyond its measuring).

Every gang, kept or not, is its own command's: the keeper lends a kept gang to one command at a time, stops it when
its time is up or when a gang or pool of another shape is to start (it would hold the devices that one needs), and
stops the gang of a command whose driver has died (its job ended without handing it back): a kept gang's members
and devices outlive the command that started them (Ray's detached lifetime), and nothing else would stop them. A
command's new gang is not handed to the keeper until the command is done with it (the keeper starts while the
members do, and would import the members' module and torch to take their handles): its placement group and members
are named by the command's job (`gang_group_name`), and the keeper frees every such group of an ended job that it
neither keeps nor lends, its members ending with it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from importlib import resources
from typing import Any

import ray
from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group

from shard_ray import __version__
from shard_ray.errors import ShardRayError

KEEPER_NAME = "gang-keeper"
KEEPER_NAMESPACE = "shard-ray"
KEEP_ENV = "SHARD_RAY_KEEP_GANG_S"
DEFAULT_KEEP_S = 60.0
# How often the keeper looks for a gang whose time is up or whose command's driver is gone.
WATCH_EVERY_S = 0.5
# How long the keeper stays with nothing to keep or watch before it ends.
KEEPER_IDLE_S = 10.0


def keep_seconds() -> float:
    """How long a joined command's gang is kept after it (`SHARD_RAY_KEEP_GANG_S`, seconds; 0: not kept)."""
    given = os.environ.get(KEEP_ENV)
    if given is None or given == "":
        return DEFAULT_KEEP_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ShardRayError(f"{KEEP_ENV}={given!r} is not a number of seconds (0 or more; 0 keeps no gang)")
    return seconds


def _measuring_code_digest() -> str:
    """A digest of the modules a member runs: a gang kept by another release of shard-ray is not taken."""
    digest = hashlib.sha256(__version__.encode())
    package = resources.files("shard_ray.profiling")
    for name in sorted(p.name for p in package.iterdir() if p.name.endswith(".py")):
        digest.update(name.encode() + package.joinpath(name).read_bytes())
    return digest.hexdigest()[:16]


def gang_shape(**settings: Any) -> str:
    """The key a kept gang is taken by: its settings (devices, hosts, threads, ...) and the measuring code's digest."""
    return repr(sorted(settings.items())) + "@" + _measuring_code_digest()


GROUP_PREFIX = "shard-ray-gang"


def gang_group_name(job: str) -> str:
    """A new name for the placement group of a gang `job` starts on a Ray it joined (the keeper frees it after `job`
    should it be left behind)."""
    return f"{GROUP_PREFIX}/{job}/{uuid.uuid4().hex}"


def stop_gang(gang: dict) -> None:
    """Free a gang's devices: its placement group, whose removal ends the members in it."""
    remove_placement_group(gang["group"])


@ray.remote(num_cpus=0)
class GangKeeper:
    """The cluster's kept gang (at most one, idle) and the gangs commands hold, each by a token and its driver's job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: tuple[str, dict, float] | None = None  # shape, gang, monotonic deadline
        self._held: dict[str, tuple[str, dict]] = {}  # token: job id, gang
        self._last_call = time.monotonic()
        self._ending = False
        threading.Thread(target=self._watch, daemon=True).start()

    def _called(self) -> None:
        """Every call's start, under the lock: a keeper that is ending answers none (the caller, finding it dead,
        starts a new one)."""
        while self._ending:
            time.sleep(1.0)
        self._last_call = time.monotonic()

    def lend(self, shape: str, token: str, job: str) -> dict | None:
        """The kept gang if it has this shape (then held by `token`); a kept gang of another shape is stopped."""
        with self._lock:
            self._called()
            kept, self._kept = self._kept, None
            if kept is None:
                return None
            if kept[0] != shape:
                stop_gang(kept[1])
                return None
            self._held[token] = (job, kept[1])
            return kept[1]

    def release(self) -> bool:
        """Stop the kept gang, if any (a gang or pool of another shape is to start); whether there was one."""
        with self._lock:
            self._called()
            kept, self._kept = self._kept, None
        if kept is not None:
            stop_gang(kept[1])
        return kept is not None

    def keep(self, token: str, shape: str, gang: dict, seconds: float) -> None:
        """Keep the command's gang for `seconds`; a gang kept before it is stopped (one is kept at a time)."""
        with self._lock:
            self._called()
            self._held.pop(token, None)
            previous, self._kept = self._kept, (shape, gang, time.monotonic() + seconds)
        if previous is not None:
            stop_gang(previous[1])

    def drop(self, token: str) -> None:
        """The command stopped its gang itself."""
        with self._lock:
            self._called()
            self._held.pop(token, None)

    def ready(self) -> None:
        """Answers once the keeper has started."""
        with self._lock:
            self._called()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_EVERY_S)
            try:
                self._stop_expired_and_orphaned()
            except Exception:  # noqa: BLE001  a GCS hiccup: looked at again next time
                pass

    def _stop_expired_and_orphaned(self) -> None:
        jobs = {j["JobID"]: j["IsDead"] for j in ray._private.state.jobs()}
        dead = {job for job, is_dead in jobs.items() if is_dead}
        groups = {
            g["placement_group_id"]: g["name"].split("/")[1]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith(GROUP_PREFIX + "/") and g["state"] != "REMOVED"
        }
        # A node told to stop (`ray stop`, SIGTERM to `ray start --block`) waits for its actors to end, 30 s at most:
        # a kept gang ends at once, and so does the keeper where its own node stops.
        draining = {
            node.hex() if isinstance(node, bytes) else node
            for node in ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=5)
        }
        stopping = []
        with self._lock:
            if self._kept is not None and (time.monotonic() >= self._kept[2] or draining):
                stopping.append(self._kept[1])
                self._kept = None
            for token in [t for t, (job, _) in self._held.items() if job in dead]:
                stopping.append(self._held.pop(token)[1])
            # The new gangs of ended commands (killed before they handed them back): neither kept, lent nor stopped.
            accounted = [gang for _, gang in self._held.values()] + stopping + ([self._kept[1]] if self._kept else [])
            owned = {gang["group"].id.hex() for gang in accounted}
            orphaned = [group for group, job in groups.items() if job in dead and group not in owned]
            running = any(job not in dead for group, job in groups.items() if group not in owned)
        for gang in stopping:
            stop_gang(gang)
        for group in orphaned:  # its members end with it
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group))))
        with self._lock:
            idle = (
                self._kept is None
                and not self._held
                and not running
                and time.monotonic() - self._last_call > KEEPER_IDLE_S
            )
            self._ending = idle or ray.get_runtime_context().get_node_id() in draining
        if self._ending:  # nothing left to keep, or its node stopping: the keeper's own process ends too
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def gang_keeper(create: bool) -> Any | None:
    """The cluster's keeper (started where `create` and there is none yet), or None."""
    try:
        if create:
            return GangKeeper.options(
                name=KEEPER_NAME, namespace=KEEPER_NAMESPACE, lifetime="detached", get_if_exists=True
            ).remote()
        return ray.get_actor(KEEPER_NAME, namespace=KEEPER_NAMESPACE)
    except ValueError:  # none yet
        return None


def release_kept_gang() -> None:
    """Free the devices a kept gang holds, before a gang or pool of another shape, Tune's trials or RLlib's workers
    ask for theirs."""
    if not ray.is_initialized():
        return
    keeper = gang_keeper(create=False)
    if keeper is not None:
        try:
            ray.get(keeper.release.remote())
        except ray.exceptions.RayActorError:
            pass
