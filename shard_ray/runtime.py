"""Connecting to Ray: an existing cluster when one is named, else a small local instance."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import ray

from shard_ray import neighbours
from shard_ray.errors import ShardRayError, Terminated, raise_terminated
from shard_ray.quiet import drop_token_auth_notice

# Enough object store for shard specs and results; Ray's default takes 30% of memory.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
# The niceness Ray adds to the workers of the nodes shard-ray starts (a command's local Ray, the emulated hosts'
# nodes): none, where Ray adds 15, so that the measuring actors, Tune's trials and RLlib's runners ran below every
# other process. Beside two busy processes on 2 cores a `compare` took 219 s at 15 against 24 s at 0, its steps
# measured at 49 ms against 3.7 (4.3 idle; docs/measurement.md). Ray runs its jobs' drivers at 0 too. On nodes started
# otherwise the measuring actors raise themselves to their command's niceness (`shard_ray.niceness.at_niceness`).
WORKER_NICENESS = 0
# The most a process of the local Ray (the command's driver included) waits at its exit to send its tasks' events to
# the GCS, for Ray's dashboard and state API: Ray's default is 5 s, which a command whose whole process group got a
# SIGTERM (`timeout`, a scheduler) waited out in full, its GCS stopped already (docs/failure-and-recovery.md).
TASK_EVENTS_FLUSH_MS = 500
LOCAL_RAY_CONFIG = {"worker_niceness": WORKER_NICENESS, "task_events_shutdown_flush_timeout_ms": TASK_EVENTS_FLUSH_MS}
# CPU devices a local instance may put on one core: a few share a core faithfully enough for
# tests and demos (the gang takes turns); hundreds would stall the machine.
LOCAL_DEVICES_PER_CORE = 4
# How long a cluster's head may take to accept a connection before the address is refused.
REACH_TIMEOUT_S = 5.0
# How long it may take to answer its first call: milliseconds on an idle machine, so this is for a loaded one.
ANSWER_TIMEOUT_S = 15.0
# The local instance this process started (its node's id, new at every start) and the environment it gave its worker
# processes (`measuring_env`).
_local_ray: tuple[str, dict[str, str]] | None = None
# The GCS address of the Ray this process joined at an address (one it did not start), whose life goes on after it.
_joined_gcs: str | None = None


# Measuring processes back large tensors with transparent huge pages (PyTorch's CPU allocator madvises
# allocations of 2 MB and more when THP_MEM_ALLOC_ENABLE is set; the kernel's default mode is madvise).
# With 4 KB pages a table's random lookups miss the TLB, and how often depends on where each fresh
# allocation lands: on the AMD EPYC a run's rounds of one plan spread by 22% with 4 KB pages and by
# 11% with huge pages (median over 4 MLPerf plans, 3 `evaluate` runs each; experiments/huge_pages.py).
# Whole runs still differ by more than that. GPU memory is not affected. THP_MEM_ALLOC_ENABLE=0 in
# the driver's environment turns it off.
def measuring_env() -> dict[str, str]:
    """What the environment of a process that measures must hold before it loads torch."""
    return {"THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1")}


def measuring_runtime_env() -> dict[str, dict[str, str]]:
    """Ray's `runtime_env` option for an actor that measures: empty where the local Ray this process started
    gave its workers that environment already. An actor with an environment of its own cannot take one of the
    worker processes Ray starts ahead with the instance, and waits for a new one to load Python, Ray and torch
    (docs/commands.md: a 2-device gang's start)."""
    if _local_ray is not None and ray.is_initialized() and _local_ray == (_node_id(), measuring_env()):
        return {}
    return {"runtime_env": {"env_vars": measuring_env()}}


def joined_ray() -> bool:
    """Whether this process joined, at an address, a Ray it did not start (a `ray start` head, a cluster, the Ray of
    a `ray job submit` job): one that goes on after the command, where a gang may be kept for the next one."""
    return ray.is_initialized() and _joined_gcs == ray.get_runtime_context().gcs_address


def stop_local_ray() -> None:
    """Stop the local Ray this process started (`ray.shutdown`; a Ray it joined is only left), its autoscaler's monitor
    killed first. Ray stops its
    processes one after the other, the GCS before that monitor, which then spent the second Ray gives it failing to
    tell the drivers of its end over the stopped GCS: a second of every command's exit, for a monitor that has nothing
    to scale on one machine (docs/commands.md)."""
    node = ray._private.worker._global_node
    for info in node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_MONITOR, []) if node else []:
        if info.process.poll() is None:
            info.process.kill()
    ray.shutdown()


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _resolve(address: str) -> str:
    """`auto` as Ray resolves it (the last `ray start` on this machine, as /tmp/ray/ray_current_cluster records
    it, else a Ray found among the processes), so that its address can be checked; any other address as given."""
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError as err:
        raise ShardRayError(
            f"no Ray cluster at auto ({str(err).splitlines()[0]}); start one (`ray start --head`) or give the head's "
            "HOST:PORT in --address or RAY_ADDRESS"
        ) from None


def _check_reachable(address: str, given: str) -> None:
    """Refuse at once a HOST:PORT nobody answers on, where what answers is not a Ray head, or whose head refuses this
    client's authentication: ray.init would retry for minutes, or 20 s, and then say only that it failed."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from ray.exceptions import AuthenticationError

    if address.startswith(("http://", "https://")):
        raise ShardRayError(
            f"{address} is a web address, such as the dashboard's that `ray job submit` takes; commands join at the "
            "head's HOST:PORT, the --port of its `ray start --head` (6379 unless given)"
        )
    host, _, port = address.rpartition(":")
    if "://" in address or not host:
        return  # ray:// clients and the like: left to Ray
    if not port.isdigit():  # Ray's own message named an address of its making (192.0.2.2:6391x for 127.0.0.1:6391x)
        raise ShardRayError(
            f"the Ray address {address} has no port number ({port!r} after its last colon): give the head's "
            "HOST:PORT, the --port of its `ray start --head` (6379 unless given)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as err:
        where = address if address == given else f"{address} (which {given} found: a `ray start` since stopped?)"
        raise ShardRayError(
            f"nothing answers at the Ray address {where} ({err.strerror or err}); start the cluster there "
            "(`ray start --head --port PORT`) or give the head's HOST:PORT in --address or RAY_ADDRESS"
        ) from None
    # The first call ray.init makes, through Ray's own channel (its TLS and token settings): a head answers in
    # milliseconds.
    channel = init_grpc_channel(address)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=ANSWER_TIMEOUT_S
        )
    except AuthenticationError as err:
        raise ShardRayError(f"cannot join the cluster at {address}: {str(err).split('. ')[0]}") from None
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNAUTHENTICATED:
            raise ShardRayError(
                f"something answers at {address}, but not as a Ray head does ({err.code().name}); give the head's "
                "HOST:PORT, the --port of its `ray start --head` (6379 unless given), in --address or RAY_ADDRESS"
            ) from None
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            raise ShardRayError(
                f"the cluster at {address} uses token authentication: set RAY_AUTH_MODE=token, with its token in "
                "~/.ray/auth_token or RAY_AUTH_TOKEN (docs/clusters.md)"
            ) from None
        raise ShardRayError(
            f"the cluster at {address} refused this client's token: give the token its head was started with "
            "(its ~/.ray/auth_token) in ~/.ray/auth_token or RAY_AUTH_TOKEN"
        ) from None
    finally:
        channel.close()


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Hold a Ctrl-C (SIGINT), and a SIGTERM where a command stops on it (`raise_terminated`), that comes while the
    block runs, and say after it which came. Interrupted inside `ray.init`, a local Ray half started left its raylet's
    dashboard and runtime-env agents running, orphaned and deaf to SIGTERM, for minutes; held, the Ray is started, then
    stopped whole (a few seconds later). For the block, Ray puts in no SIGTERM handler of its own where one is held:
    `ray.init` puts one in for its length (ending the command with status 15, not a word, those agents left running)
    and a starting local Ray another. The handlers before are put back after it: `ray.init` leaves a handler of its
    own in the driver, which aborts the process with a crash dump. Off the main thread, where Python takes no
    signals, the block runs as it is."""
    pressed: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    held = [signal.SIGINT] + ([signal.SIGTERM] if signal.getsignal(signal.SIGTERM) is raise_terminated else [])
    # a Ctrl-C the process ignores (a background job of a script inherits SIGINT ignored) stays ignored
    held = [signum for signum in held if signal.getsignal(signum) is not signal.SIG_IGN]
    previous = {signum: signal.signal(signum, lambda signum, frame: pressed.append(signum)) for signum in held}
    utils = ray._private.utils
    installing = utils.set_sigterm_handler  # how Ray puts in each of its SIGTERM handlers
    if signal.SIGTERM in held:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield pressed
    finally:
        utils.set_sigterm_handler = installing
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def dashboard_agent_on_any_port() -> Iterator[None]:
    """While a local Ray starts (`ray.init(address="local")`), its dashboard agent listens on a port the kernel picks,
    where Ray gives it 52365 whatever runs on the machine and `ray.init` has no argument for it (`ray start` has
    `--dashboard-agent-listen-port`). With another Ray on the machine holding 52365 (a head, an earlier command's, a
    notebook's), the agent retried it for seconds before giving its HTTP service up, and the raylet waited for it
    (docs/commands.md). The agent serves what it serves on the port it gets (Ray keeps the port where the cluster's
    head finds it)."""
    from ray._private import parameter

    made = parameter.RayParams

    class AgentOnAnyPort(made):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dashboard_agent_listen_port", 0)
            super().__init__(*args, **kwargs)

    parameter.RayParams = AgentOnAnyPort
    try:
        yield
    finally:
        parameter.RayParams = made


def _init_ray(pressed: list[int], **options: Any) -> None:
    """`ray.init(**options)` inside `_signals_held`; where it fails after a held signal came, its error is left to
    `_stop_if_signalled`: a SIGTERM to the command's whole process group (`timeout`) stops Ray's starting processes
    too, and `ray.init` then gave up on them, 15-40 s later, with a traceback."""
    try:
        ray.init(**options)
    except Exception:
        if not pressed:
            raise


def _stop_if_signalled(pressed: list[int]) -> None:
    """After `_signals_held`: where a signal came, leave Ray and stop as it asked."""
    if pressed:
        stop_local_ray()
        raise Terminated if signal.SIGTERM in pressed else KeyboardInterrupt


def connect_ray(address: str | None = None, min_cpus: int = 1, hosts: int = 1) -> str:
    """Join the cluster at `address` (or RAY_ADDRESS); otherwise start a local Ray.

    `min_cpus` is the most devices the command will use at once (a CPU device is one core). A
    local instance gets at least that many logical CPUs so a gang can be placed (the gang warns
    when that exceeds the cores it lands on), up to `LOCAL_DEVICES_PER_CORE` per core: beyond that,
    or beyond what a joined cluster holds, the request is refused before any actor starts. A gang
    of several `hosts` needs a Ray node for each (`gang_bundles`), which a local Ray, one node, is
    not: refused before it starts. Returns a one-line description of what it connected to.
    """
    global _local_ray
    if ray.is_initialized():
        if _local_ray is not None:  # a local Ray an earlier command of this process started (an experiment's)
            neighbours.arrive()
        return "ray: already initialised"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        resolved = _resolve(address)
        _check_reachable(resolved, address)
        try:
            with _signals_held() as pressed:
                _init_ray(pressed, address=resolved, logging_level=logging.WARNING)
        except (ConnectionError, ValueError) as err:  # an address Ray does not answer, or cannot read
            raise ShardRayError(
                f"no Ray cluster at {address} ({str(err).splitlines()[0]}); start one (`ray start --head`) or give "
                "the head's HOST:PORT in --address or RAY_ADDRESS"
            ) from None
        _stop_if_signalled(pressed)
        global _joined_gcs
        _joined_gcs = ray.get_runtime_context().gcs_address
        resources = ray.cluster_resources()
        devices = int(resources.get("GPU", 0) or resources.get("CPU", 0))
        if min_cpus > devices:
            ray.shutdown()
            raise ShardRayError(
                f"this needs {min_cpus} devices at once but the cluster at {address} has {devices}; "
                "give fewer devices or point --address (or RAY_ADDRESS) at a bigger cluster"
            )
        return f"ray: joined cluster at {resolved}" + ("" if resolved == address else f" ({address})")
    if hosts > 1:
        raise ShardRayError(
            f"a gang of {hosts} hosts needs {hosts} Ray nodes, one a host, and a local Ray is one node: join a "
            "cluster of that many (--address, or `shard-ray hosts run -- COMMAND` on hosts emulated by `shard-ray "
            "hosts up`), or plan for one host (no --devices-per-host)"
        )
    cores = os.cpu_count() or 1
    if min_cpus > LOCAL_DEVICES_PER_CORE * cores:
        raise ShardRayError(
            f"this needs {min_cpus} devices at once, more than a local Ray on this machine's {cores} cores can hold "
            f"(at most {LOCAL_DEVICES_PER_CORE} per core); point --address (or RAY_ADDRESS) at a Ray cluster with "
            "that many devices"
        )
    cpus = max(cores, min_cpus)
    drop_token_auth_notice()
    # Its processes inherit the driver's environment: with the measuring one, the workers Ray starts ahead serve actors.
    workers_env = measuring_env()
    added = {name: value for name, value in workers_env.items() if name not in os.environ}
    os.environ.update(added)
    try:
        with _signals_held() as pressed, dashboard_agent_on_any_port():
            # "local": a new instance even when a `ray start` cluster on this machine (live or stale) would be joined
            _init_ray(
                pressed,
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                logging_level=logging.WARNING,
                _system_config=LOCAL_RAY_CONFIG,
            )
    finally:
        for name in added:
            del os.environ[name]
    _stop_if_signalled(pressed)
    _local_ray = (_node_id(), workers_env)
    neighbours.arrive()
    # Ray's logical CPUs, a device each: more than the cores where the gang has more devices than the machine cores
    return f"ray: started a local instance with {cpus} CPUs" + (f" (logical, on {cores} cores)" if cpus > cores else "")
