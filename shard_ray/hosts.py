"""Hosts emulated on one machine: network namespaces joined by links of a set rate, a Ray node in each.

Each host is a Linux network namespace (`srh-NAME-I`) with one interface, `eth0` (the same name in every host,
so gloo binds to it wherever a gang member runs: GLOO_SOCKET_IFNAME), at 10.0.0.(I+1). The hosts' links meet
on a bridge in a namespace of its own (`srh-NAME-sw`), so nothing touches the machine's own network; each link
is shaped both ways by a token bucket (tc's `tbf`) to the rate asked for. Every host runs a Ray node
(`ray start --block`, the head in host 0) with its devices as CPUs; the nodes' traffic to each other crosses the
shaped links, and the namespaces' separate network stacks let several such clusters, and other Ray instances,
share the machine without a port in common.

`bring_up` measures what the links achieve (a TCP stream from host 0 to host 1, twice) before anyone trusts a
timing taken over them; `tear_down` stops the processes it started, by their ids, and deletes the namespaces,
which takes their links with them. Commands run on the cluster from host 0 (`command_in_head`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from shard_ray.errors import ShardRayError, first_line
from shard_ray.io import shard_ray_home, write_atomic
from shard_ray.process_groups import group_alive, stop_groups

INTERFACE = "eth0"
# Where `ip netns exec NS` finds the files it puts over those of /etc in NS (iproute2's convention).
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.0.0"
HEAD_PORT = 6379
# Every node's ports, fixed: each host has a network stack of its own, so they never meet another node's, and
# none is left to Ray's pick of a free port, which raced (a raylet once lost its port to its own agent here).
NODE_PORTS = {
    "node-manager-port": 6380,
    "object-manager-port": 6381,
    "dashboard-agent-grpc-port": 6382,
    "dashboard-agent-listen-port": 6383,
    "metrics-export-port": 6384,
    "runtime-env-agent-port": 6385,
}
MAX_HOSTS = 64
# A Ray node's processes (GCS, raylet, agents, the head's monitors) took 0.45-0.9 GB here (Ray 2.60); up
# refuses more hosts than the machine's available memory holds at this much each, with room to run on them.
NODE_MEMORY_BYTES = 700 * 1024**2
MEMORY_SHARE = 0.6
OBJECT_STORE_BYTES = 128 * 1024**2
NODES_TIMEOUT_S = 180.0
# A `ray start --block` told to stop drains for up to 30 s (Ray 2.60). Nothing it would drain outlives the cluster
# (its namespaces and Ray folder are deleted next), so the nodes get this long to end, then are killed; the
# kill's own wait is `STOP_TIMEOUT_S`.
TERM_GRACE_S = 1.0
STOP_TIMEOUT_S = 5.0
# Set in the commands `hosts run` runs: the links' achieved rate (Mbit/s), so that a gang knows its all-to-alls cross
# links and measures them even where its devices outnumber the machine's cores.
EMULATED_LINK_ENV = "SHARD_RAY_EMULATED_LINK_MBIT"
# A measured link rate is steady when two measurements are within this of each other.
STEADY = 0.10
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,11}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class LinkRate(BaseModel):
    """One measurement of a link: a TCP stream of `megabytes` from host `source` to host `sink`."""

    source: int
    sink: int
    megabytes: float
    seconds: float

    @property
    def mbit_per_s(self) -> float:
        return self.megabytes * 8 / self.seconds


class EmulatedHosts(BaseModel):
    """An emulated cluster as `bring_up` made it: what `tear_down` removes and `command_in_head` runs in."""

    name: str
    hosts: int
    devices_per_host: int
    rate_bits: float
    token: str
    namespaces: list[str] = []
    pids: list[int] = []
    temp_dir: str
    link_rates: list[LinkRate] = []
    coming_up: int | None = None  # the `hosts up` process bringing it up, until it is up

    @property
    def address(self) -> str:
        return f"{host_ip(0)}:{HEAD_PORT}"

    def describe(self) -> str:
        rates = ", ".join(f"{r.mbit_per_s:.0f}" for r in self.link_rates)
        measured = f"; measured host 0 -> 1: {rates} Mbit/s" if rates else ""
        return (
            f"{self.name}: {self.hosts} host{'s' if self.hosts > 1 else ''} of {self.devices_per_host} "
            f"device{'s' if self.devices_per_host > 1 else ''}, links of "
            f"{self.rate_bits / 1e6:g} Mbit/s each way{measured}; Ray at {self.address} (from host 0)"
        )


def hosts_dir() -> Path:
    """Where the emulated clusters' state files are: $SHARD_RAY_HOME/hosts, else ~/.shard-ray/hosts."""
    return shard_ray_home() / "hosts"


def state_path(name: str) -> Path:
    return hosts_dir() / f"{name}.json"


def host_ip(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def namespace(name: str, host: int | None) -> str:
    """Host `host`'s namespace, or the switch's (None)."""
    return f"srh-{name}-{'sw' if host is None else host}"


def parse_rate(text: str) -> float:
    """'200mbit' -> 2e8 bits per second (kbit, mbit, gbit, as tc writes them)."""
    match = _RATE.match(text.strip().lower())
    if not match or float(match.group(1)) <= 0:
        # tc reads "mbps" as megabytes a second: a user writing it likely means megabits, so neither is guessed
        bytes_unit = re.search(r"[kmg]bps$", text.strip().lower())
        hint = f"; write {text.strip().lower()[:-3]}bit for bits a second (tc reads bps as bytes)" if bytes_unit else ""
        raise ShardRayError(f"link rate {text!r} is not a rate such as 200mbit or 1gbit (kbit, mbit, gbit){hint}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def check_request(name: str, hosts: int, devices_per_host: int, rate: str) -> float:
    """Refuse, in one line and before anything is made, what this machine or user cannot bring up; the rate in
    bits per second."""
    if not _NAME.match(name):
        raise ShardRayError(
            f"cluster name {name!r}: 1 to 12 lower-case letters, digits and '-', starting with a letter or digit"
        )
    if not 1 <= hosts <= MAX_HOSTS:
        raise ShardRayError(f"--hosts must be 1 to {MAX_HOSTS}, got {hosts}")
    if devices_per_host < 1:
        raise ShardRayError(f"--devices-per-host must be at least 1, got {devices_per_host}")
    bits = parse_rate(rate)
    if os.geteuid() != 0:
        raise ShardRayError("emulated hosts are network namespaces, which only root can make; run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ShardRayError(f"{' and '.join(missing)} not found: install iproute2 (Debian: apt-get install iproute2)")
    if state_path(name).exists():
        up = "is up"
        with contextlib.suppress(ValueError, OSError):  # a state file cut short: up all the same, for `down`
            up = "is coming up" if bringing_up(load(name)) else up
        raise ShardRayError(f"an emulated cluster named {name} {up}; `shard-ray hosts down {name}` takes it down")
    taken = set(_run(["ip", "netns", "list"]).split())
    if namespace(name, None) in taken or namespace(name, 0) in taken:
        raise ShardRayError(
            f"network namespaces named {namespace(name, None)} or {namespace(name, 0)} exist but no cluster of "
            f"that name is recorded in {hosts_dir()}; choose another --name or delete them (`ip netns del`)"
        )
    available = _available_memory()
    needed = hosts * NODE_MEMORY_BYTES
    if needed > MEMORY_SHARE * available:
        raise ShardRayError(
            f"{hosts} hosts need about {needed / 1e9:.1f} GB for their Ray nodes and this machine has "
            f"{available / 1e9:.1f} GB available; ask for at most {int(MEMORY_SHARE * available // NODE_MEMORY_BYTES)}"
        )
    return bits


def bring_up(
    name: str, hosts: int, devices_per_host: int, rate: str, progress: Callable[[str], None] = print
) -> EmulatedHosts:
    """Make the namespaces, links and Ray nodes, wait for every node, measure the links; on any failure (or
    Ctrl-C) remove whatever was made and raise."""
    bits = check_request(name, hosts, devices_per_host, rate)
    state = EmulatedHosts(
        name=name,
        hosts=hosts,
        devices_per_host=devices_per_host,
        rate_bits=bits,
        token=secrets.token_hex(16),
        temp_dir=f"/tmp/srh-{name}",
        coming_up=os.getpid(),
    )
    hosts_dir().mkdir(parents=True, exist_ok=True)
    try:
        _save(state)  # first, so that a `down` from another shell finds what is being made
        progress(
            f"making the namespaces and links of {hosts} host{'s' if hosts > 1 else ''} ({bits / 1e6:g} Mbit/s each way)"
        )
        _make_network(state)
        progress(
            f"starting a Ray node in each host ({devices_per_host} device{'s' if devices_per_host > 1 else ''} each)"
        )
        _start_nodes(state)
        _wait_for_nodes(state)
        if hosts > 1:
            progress("measuring the link from host 0 to host 1, twice")
            state.link_rates = [measure_link(state, 0, 1) for _ in range(2)]
        state.coming_up = None
        _save(state)
    except BaseException:
        tear_down(state)
        raise
    return state


def load(name: str) -> EmulatedHosts:
    path = state_path(name)
    if not path.is_file():
        up = ", ".join(sorted(p.stem for p in hosts_dir().glob("*.json"))) or "none"
        raise ShardRayError(f"no emulated cluster named {name} is up (up: {up})")
    return EmulatedHosts.model_validate_json(path.read_text())


def listed() -> list[EmulatedHosts]:
    return [EmulatedHosts.model_validate_json(p.read_text()) for p in sorted(hosts_dir().glob("*.json"))]


def bringing_up(state: EmulatedHosts) -> int | None:
    """The process id of the `hosts up` still bringing the cluster up, if one is (a `hosts up` killed meanwhile left
    its id behind: the id is taken only where it is still a `hosts` command's)."""
    pid = state.coming_up
    if pid is None or pid == os.getpid():
        return None
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if b"hosts" in words and b"up" in words else None


def commands_on(state: EmulatedHosts) -> list[tuple[int, str]]:
    """The commands running on the cluster (`hosts run`'s, in its hosts' namespaces), each its process id and command
    line: the processes in the hosts other than its Ray nodes' (each node leads a session of its own, its workers in
    it) whose parent is not one of them."""
    found: dict[int, int] = {}  # pid: parent
    asking = _this_and_its_ancestors()  # a shell `hosts run` started in the head, say
    for host in range(state.hosts):
        listed = subprocess.run(["ip", "netns", "pids", namespace(state.name, host)], capture_output=True, text=True)
        for pid in map(int, listed.stdout.split()):
            try:
                if os.getsid(pid) in state.pids or pid in asking:
                    continue
                found[pid] = _parent(pid)
            except (OSError, ValueError):  # it ended meanwhile
                continue
    commands = []
    for pid in sorted(p for p, parent in found.items() if parent not in found):
        with contextlib.suppress(OSError):
            line = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
            commands.append((pid, line))
    return commands


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _this_and_its_ancestors() -> set[int]:
    chain, pid = set(), os.getpid()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            pid = _parent(pid)
        except (OSError, ValueError):
            break
    return chain


def check_down(state: EmulatedHosts) -> None:
    """Refuse to take down a cluster still coming up or with commands running on it: taken down under a command, the
    command waited a minute on a Ray gone and ended in Ray's own error, what it had measured lost; under a `hosts up`,
    that failed a minute later pointing at logs gone (a walk)."""
    if (pid := bringing_up(state)) is not None:
        raise ShardRayError(
            f"{state.name} is still coming up (`shard-ray hosts up`, pid {pid}): wait until it is up, or stop that "
            "command (Ctrl-C there), which removes what it made"
        )
    running = commands_on(state)
    if running:
        pid, line = running[0]
        shown = line if len(line) <= 60 else line[:57] + "..."
        if len(running) == 1:
            which, stop = (
                f"1 command still runs on {state.name}: pid {pid} ({shown})",
                "stop it first (Ctrl-C where it runs",
            )
        else:
            which = (
                f"{len(running)} commands still run on {state.name}: pid {pid} ({shown}) and {len(running) - 1} more"
            )
            stop = "stop them first (Ctrl-C where they run"
        raise ShardRayError(
            f"{which}; {stop}, or kill PID): taken down under it, a command waits a minute on a Ray gone and loses "
            "what it measured"
        )


def tear_down(state: EmulatedHosts) -> None:
    """Stop the processes `state` records (their whole process groups: each was started in a session of its own),
    delete its namespaces (and with them its links), its Ray temp folder and its state file."""
    stop_groups(state.pids, TERM_GRACE_S, STOP_TIMEOUT_S)
    for ns in reversed(state.namespaces):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):  # only where no other namespace keeps files there
        NETNS_ETC.rmdir()
    shutil.rmtree(state.temp_dir, ignore_errors=True)
    state_path(state.name).unlink(missing_ok=True)


def command_in_head(state: EmulatedHosts, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `argv` in host 0, joined to the cluster (RAY_ADDRESS)."""
    return ["ip", "netns", "exec", namespace(state.name, 0), *argv], {**os.environ, **_ray_env(state)}


def measure_link(state: EmulatedHosts, source: int, sink: int) -> LinkRate:
    """Time a TCP stream from host `source` to host `sink` of about half a second at the set rate (4 to 256 MB)."""
    size = int(min(256e6, max(4e6, state.rate_bits / 8 / 2)))
    port = 5201
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", namespace(state.name, sink), sys.executable, "-c", _SINK, host_ip(sink), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sent = _run(
            ["ip", "netns", "exec", namespace(state.name, source), sys.executable, "-c", _SOURCE]
            + [host_ip(sink), str(port), str(size)],
            timeout=60 + size * 8 / state.rate_bits * 4,
        )
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    return LinkRate(source=source, sink=sink, megabytes=size / 1e6, seconds=float(sent.strip()))


def steady(rates: list[LinkRate]) -> bool:
    """Whether the measurements of a link agree within STEADY."""
    values = [r.mbit_per_s for r in rates]
    return not values or max(values) <= (1 + STEADY) * min(values)


# A TCP sink: accept one stream, read it to its end, acknowledge with one byte.
_SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])), reuse_port=True)
connection, _ = server.accept()
while connection.recv(1 << 20):
    pass
connection.sendall(b"k")
"""
# A TCP source: stream N bytes and print the seconds until the sink acknowledged all of them.
_SOURCE = """
import socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):
    try:
        connection = socket.create_connection((host, port))
        break
    except OSError:
        time.sleep(0.05)
block, sent, start = b"x" * (1 << 20), 0, time.perf_counter()
while sent < size:
    connection.sendall(block[: size - sent])
    sent += min(len(block), size - sent)
connection.shutdown(socket.SHUT_WR)
connection.recv(1)
print(time.perf_counter() - start)
"""


def _make_network(state: EmulatedHosts) -> None:
    switch = namespace(state.name, None)
    _add_namespace(state, switch)
    _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", switch, "link", "set", "br0", "up"])
    for host in range(state.hosts):
        ns = namespace(state.name, host)
        _add_namespace(state, ns)
        port = f"h{host}"
        _run(["ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", switch])
        _run(["ip", "-n", switch, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", switch, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{host_ip(host)}/24", "dev", INTERFACE])
        _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Both ways: the host's sending on its eth0, its receiving on the switch's port to it.
        _shape(state, ns, INTERFACE)
        _shape(state, switch, port)
    _name_hosts(state)


def _name_hosts(state: EmulatedHosts) -> None:
    """Every host's address under its namespace's name, in the hosts file `ip netns exec` gives each host
    (/etc/netns/NS/hosts over /etc/hosts): gloo looks up its peers' names, and unnamed, c10d warned "the
    hostname of the client socket cannot be retrieved" at every gang's start. `tear_down` removes them."""
    machine = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    # and as the IPv4-mapped IPv6 address a dual-stack socket reports its peer by
    names = "".join(
        f"{address} {namespace(state.name, h)}\n"
        for h in range(state.hosts)
        for address in (host_ip(h), f"::ffff:{host_ip(h)}")
    )
    for host in range(state.hosts):
        folder = NETNS_ETC / namespace(state.name, host)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(machine.rstrip("\n") + "\n" + names)


def _shape(state: EmulatedHosts, ns: str, device: str) -> None:
    # Segments of one packet (a veth otherwise passes segments of up to 64 KiB, and a bucket smaller than one drops
    # it), so the bucket can be small: 1 ms at the rate, at least 16 KiB. A bucket of 128 KiB let the first 128 KiB
    # of every collective through at once, and a link rate fitted to 4 devices' all-to-alls of about 160 KB each
    # at 50 Mbit/s came out 20% high. Packets wait at most 100 ms.
    _run(["ip", "-n", ns, "link", "set", device, "gso_max_size", "1514", "gso_max_segs", "1"])
    burst = max(16 * 1024, int(state.rate_bits / 8 * 0.001))
    rate = f"{int(state.rate_bits)}bit"
    _run(["tc", "-n", ns, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst)]
         + ["latency", "100ms"])  # fmt: skip


def _add_namespace(state: EmulatedHosts, ns: str) -> None:
    _run(["ip", "netns", "add", ns])
    state.namespaces.append(ns)
    _save(state)


def emulated_link_mbit() -> float | None:
    """The achieved rate of the emulated hosts' links this process runs on (`hosts run` says), else None."""
    value = os.environ.get(EMULATED_LINK_ENV)
    return float(value) if value else None


def _ray_env(state: EmulatedHosts) -> dict[str, str]:
    measured = [r.mbit_per_s for r in state.link_rates]
    return {
        "RAY_ADDRESS": state.address,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": state.token,
        "GLOO_SOCKET_IFNAME": INTERFACE,
        EMULATED_LINK_ENV: f"{min(measured) if measured else state.rate_bits / 1e6:.0f}",
    }


def _start_nodes(state: EmulatedHosts) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, **_ray_env(state)}
    env.pop("RAY_ADDRESS")  # the head starts a cluster, the others are given its address
    env.pop(EMULATED_LINK_ENV)  # for the commands run on the cluster, not its nodes
    from shard_ray.runtime import WORKER_NICENESS  # Ray's import, here only: `hosts list` and `down` need none

    env["RAY_worker_niceness"] = str(WORKER_NICENESS)  # as a local Ray's
    Path(state.temp_dir).mkdir(parents=True, exist_ok=True)
    for host in range(state.hosts):
        role = (
            ["--head", "--port", str(HEAD_PORT), "--include-dashboard", "false"]
            if host == 0
            else ["--address", state.address]
        )
        # A Ray folder per node: nodes sharing one name their sockets in it by a count, which two nodes starting
        # at once took alike (their raylets then failed with "Address already in use").
        command = [ray, "start", *role, "--temp-dir", f"{state.temp_dir}/h{host}", "--node-ip-address", host_ip(host)]
        command += ["--num-cpus", str(state.devices_per_host)]
        command += [f"--{name}={port}" for name, port in NODE_PORTS.items()]
        command += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block"]
        log = open(Path(state.temp_dir) / f"host-{host}.log", "w")  # noqa: SIM115 (the node writes it while up)
        process = subprocess.Popen(
            ["ip", "netns", "exec", namespace(state.name, host), *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        state.pids.append(process.pid)
        _save(state)
        if host == 0:
            _wait_for_head(state)


def _wait_for_head(state: EmulatedHosts) -> None:
    probe = f"import socket; socket.create_connection(('{host_ip(0)}', {HEAD_PORT}), timeout=1).close()"
    deadline = time.monotonic() + NODES_TIMEOUT_S
    while time.monotonic() < deadline:
        if not group_alive(state.pids[0]):
            raise ShardRayError(f"the head's Ray node stopped while starting; see {state.temp_dir}/host-0.log")
        probed = subprocess.run(
            ["ip", "netns", "exec", namespace(state.name, 0), sys.executable, "-c", probe], capture_output=True
        )
        if probed.returncode == 0:
            return
        time.sleep(0.5)
    raise ShardRayError(f"the head's Ray node did not answer in {NODES_TIMEOUT_S:.0f} s; see {state.temp_dir}")


def _wait_for_nodes(state: EmulatedHosts) -> None:
    """Until every host's node is alive in the cluster, checked from host 0 as a user's command would join it."""
    check = (
        "import logging, time, ray\n"
        "ray.init(logging_level=logging.ERROR)\n"
        f"deadline = time.monotonic() + {NODES_TIMEOUT_S}\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {state.hosts} and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "print(sum(n['Alive'] for n in ray.nodes()))\n"
    )
    argv, env = command_in_head(state, [sys.executable, "-c", check])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=NODES_TIMEOUT_S + 60)
    alive = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "0"
    if done.returncode != 0 or alive != str(state.hosts):
        dead = [h for h, pid in enumerate(state.pids) if not group_alive(pid)]
        where = f"; stopped: host(s) {dead}, see {state.temp_dir}/host-N.log" if dead else ""
        raise ShardRayError(
            f"{alive} of {state.hosts} Ray nodes came up{where} ({_last_line(done.stderr) or 'no error'})"
        )


def _last_line(text: str) -> str:
    """What a failed Python process said last: a traceback's exception, not its header."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _save(state: EmulatedHosts) -> None:
    write_atomic(state_path(state.name), state.model_dump_json(indent=1))


def _run(argv: list[str], timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        message = first_line(done.stderr.strip() or done.stdout.strip() or f"status {done.returncode}")
        raise ShardRayError(f"`{' '.join(argv[:6])}` failed: {message}")
    return done.stdout


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
