"""A cluster on one machine: agents in network namespaces on a bridge (root), or on 127.0.0.1 ports.

Namespace form, per device devK:
    namespace swtb-devK: swarm0 (10.213.77.(10+K)) == veth == swtb-K on bridge swtb-br0 (host: 10.213.77.1)
    agent: `swarm join --interface swarm0` under cgroup limits, links capped by tc htb (pure
    acknowledgements first: swarm.testbed.netns.cap_bandwidth).
Loopback form: agents on 127.0.0.1, each told of the others with --peers; no root needed.

The record of what was made lives in names.state_dir() (testbed.json, token, logs);
down() also sweeps anything carrying the prefix, so it works after a crash.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from swarm.errors import SwarmError
from swarm.host import malloc
from swarm.testbed import cgroups, netns
from swarm.testbed.names import (AGENT_PORT, BRIDGE, CGROUP_GROUP, DEVICE_INTERFACE, HOST_ADDRESS, MAX_DEVICES,
                                 device_address, device_name, host_link, namespace, state_dir)

READY_TIMEOUT = 60.0
READY_LINE = "listening on"


@dataclass
class DeviceRecord:
    name: str
    address: str
    port: int
    pid: int
    log: str
    state_dir: str
    namespace: str | None = None     # None in the loopback form
    link: str | None = None          # host end of its link
    cgroups: list[str] = field(default_factory=list)
    cpu: float | None = None         # its own limits (devices may differ)
    memory: int | None = None
    bandwidth: str | None = None


@dataclass
class TestbedRecord:
    kind: str                        # "netns" or "loopback"
    devices: list[DeviceRecord]
    token_file: str
    cpu: float | list[float] | None = None       # as given: one value for every device, or one each
    memory: int | list[int] | None = None
    bandwidth: str | list[str] | None = None

    def device(self, name: str) -> DeviceRecord:
        for d in self.devices:
            if d.name == name:
                return d
        raise SwarmError(f"no device '{name}' in the testbed (devices: {', '.join(d.name for d in self.devices)})")

    def peers(self) -> str:
        return ",".join(f"{d.address}:{d.port}" for d in self.devices)


def record_path() -> Path:
    return state_dir() / "testbed.json"


def load() -> TestbedRecord | None:
    try:
        data = json.loads(record_path().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SwarmError(f"the testbed record {record_path()} is unreadable ({exc}); `swarm testbed down` "
                         f"clears it") from None
    try:
        data["devices"] = [DeviceRecord(**d) for d in data["devices"]]
        return TestbedRecord(**data)
    except (TypeError, KeyError) as exc:  # a record of another swarm release, or a changed file
        raise SwarmError(f"the testbed record {record_path()} is not one this swarm reads ({exc}); "
                         f"`swarm testbed down` clears it") from None


def require() -> TestbedRecord:
    record = load()
    if record is None:
        raise SwarmError("no testbed is up; start one with `swarm testbed up --devices N`")
    return record


def _save(record: TestbedRecord) -> None:
    record_path().write_text(json.dumps(asdict(record), indent=2))


def is_root() -> bool:
    return os.geteuid() == 0


def _swarm_command() -> list[str]:
    return [sys.executable, "-m", "swarm"]


def _environment(extra: dict[str, str]) -> dict[str, str]:
    """The testbed's processes run the same swarm as this one, whatever the caller's setup
    (a `swarm` among them picks its allocator itself; any other program gets the system's)."""
    env = {k: v for k, v in malloc.without_own_preload(dict(os.environ)).items()
           if k not in ("SWARM_TOKEN", "SWARM_TOKEN_FILE", "SWARM_PEERS", "SWARM_STATE_DIR")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _is_agent(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"swarm" in cmdline and b"join" in cmdline


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# -- up -------------------------------------------------------------------------------

def per_device(value, count: int, flag: str) -> list:
    """One value for each of `count` devices from one value for all, or a list of exactly `count`."""
    if not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) == 1:
        return list(value) * count
    if len(value) != count:
        raise SwarmError(f"{flag} gives {len(value)} values for {count} devices: give one for all, or one each")
    return list(value)


def limits_from_cluster(description: dict, where: str) -> tuple[list[str], list[float], list[int], list[str | None]]:
    """The devices of a cluster description (the JSON `swarm plan --devices` reads) as testbed
    limits: (names, CPU shares, memory limits, link rates). A device's share is its "speed"
    relative to "reference": "local" (this machine's profile, one core); its limit is its
    "memory" (what training may use) plus what the runtime and a job take beside it; its rate
    is its "link_mbps", else the cluster's "bandwidth_mbps". SwarmError says what does not fit."""
    from planner.memory import JOB_BYTES
    from planner.memory_fit import RUNTIME_FLOOR
    from planner.units import parse_bytes

    specs = description.get("devices") if isinstance(description, dict) else None
    if not isinstance(specs, list) or not specs:
        raise SwarmError(f"{where}: a cluster description lists its devices (\"devices\": [...])")
    if description.get("reference") != "local":
        raise SwarmError(f"{where}: the testbed rehearses devices whose \"speed\" is relative to \"reference\": "
                         f"\"local\" (a share of one core of this machine)")
    if description.get("links"):
        raise SwarmError(f"{where}: the testbed caps each device's own link; it cannot rehearse \"links\" between "
                         f"pairs (give \"link_mbps\" per device or \"bandwidth_mbps\")")
    names, cpus, memories, rates = [], [], [], []
    for i, spec in enumerate(specs):
        name = str(spec.get("name", i)) if isinstance(spec, dict) else str(i)
        if not isinstance(spec, dict) or not isinstance(spec.get("speed"), (int, float)) or spec["speed"] <= 0:
            raise SwarmError(f"{where}: device {name} needs a positive \"speed\" (its share of one core here)")
        try:
            memory = parse_bytes(spec.get("memory"), f"device {name}: memory")
        except (TypeError, ValueError) as exc:
            raise SwarmError(f"{where}: {exc}") from None
        mbps = spec.get("link_mbps", description.get("bandwidth_mbps"))
        names.append(name)
        cpus.append(float(spec["speed"]))
        memories.append(memory + RUNTIME_FLOOR + JOB_BYTES)
        rates.append(f"{float(mbps):g}mbit" if mbps else None)
    return names, cpus, memories, rates


def up(count: int, *, cpu: float | list[float] | None = None, memory: int | list[int] | None = None,
       bandwidth: str | list[str] | None = None, loopback: bool = False) -> TestbedRecord:
    """Start `count` devices. `cpu` (cores), `memory` (bytes) and `bandwidth` (a tc rate) are one
    value for every device or a list of one each: devices may differ, as the swarm rehearsed does."""
    if not 1 <= count <= MAX_DEVICES:
        raise SwarmError(f"--devices must be 1-{MAX_DEVICES}, got {count}")
    cpus, memories = per_device(cpu, count, "--cpu"), per_device(memory, count, "--mem")
    rates = per_device(bandwidth, count, "--bandwidth")
    if not loopback:
        if not is_root():
            raise SwarmError("the namespace testbed needs root (network namespaces, cgroups, tc): run it with sudo, "
                             "or use --loopback for agents on 127.0.0.1 without root")
        netns.need_tools()
    elif bandwidth:
        raise SwarmError("--bandwidth needs the namespace testbed (links to cap); leave out --loopback (as root)")
    if (cpu or memory) and not is_root():
        raise SwarmError("--cpu and --mem need root (cgroups); run with sudo or leave them out")
    host = None
    if cpu or memory:
        host = cgroups.detect()
        if host is None:
            raise SwarmError("no usable cgroup controllers for cpu and memory on this host (looked in /proc/mounts "
                             "for cgroup2 with cpu+memory, or cgroup v1 cpu and memory)")
    if load() is not None or (not loopback and (netns.namespaces() or netns.links())):
        raise SwarmError("a testbed is already up (or left over from a crash); run `swarm testbed down` first")
    # the devices run the swarm set up here, which fetches jemalloc where it is not installed
    # (swarm.host.malloc): fetch it now, on this host's network, not from a namespace with none
    malloc.jemalloc_library(fetch=True)

    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    from swarm.host.state import new_token

    token_file = directory / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_token() + "\n")
    record = TestbedRecord("loopback" if loopback else "netns", [], str(token_file), cpu, memory, bandwidth)
    _save(record)
    try:
        if loopback:
            _up_loopback(record, count, host, cpus, memories)
        else:
            _up_namespaces(record, count, host, cpus, memories, rates)
        _wait_ready(record)
    except BaseException:
        down()
        raise
    return record


def _agent_command(device: str, directory: Path, interface: str, port: int, peers: str | None) -> list[str]:
    cmd = _swarm_command() + ["join", "--name", device, "--state-dir", str(directory / device), "--token-file",
                              str(directory / "token"), "--interface", interface, "--port", str(port),
                              "--config", os.devnull]  # not the machine's own service settings
    return cmd + (["--peers", peers] if peers else [])


def _launch(record: TestbedRecord, device: DeviceRecord, cmd: list[str], host) -> None:
    device.pid = _start(device, cmd)
    record.devices.append(device)
    _save(record)
    if host is not None:
        dirs = cgroups.create_limits(host, device.name, device.cpu, device.memory)
        device.cgroups = [str(d) for d in dirs]
        _save(record)
        cgroups.add_process(dirs, device.pid)


def _start(device: DeviceRecord, cmd: list[str]) -> int:
    """Start a device's agent, its output appended to the device's log; its pid."""
    with open(device.log, "ab") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=_environment({}))
    return process.pid


def _up_loopback(record: TestbedRecord, count: int, host, cpus: list, memories: list) -> None:
    directory = state_dir()
    ports = _free_ports(count)
    everyone = ",".join(f"127.0.0.1:{p}" for p in ports)
    for k, port in enumerate(ports):
        name = device_name(k)
        device = DeviceRecord(name, "127.0.0.1", port, 0, str(directory / f"{name}.log"), str(directory / name),
                              cpu=cpus[k], memory=memories[k])
        _launch(record, device, _agent_command(name, directory, "lo", port, everyone), host)


def _up_namespaces(record: TestbedRecord, count: int, host, cpus: list, memories: list, rates: list) -> None:
    run = netns.run
    directory = state_dir()
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    for k in range(count):
        name, ns = device_name(k), namespace(device_name(k))
        link, address = host_link(name), device_address(k)
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", link, "type", "veth", "peer", "name", DEVICE_INTERFACE, "netns", ns)
        run("ip", "link", "set", link, "master", BRIDGE, "up")
        run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", DEVICE_INTERFACE)
        run("ip", "-n", ns, "link", "set", DEVICE_INTERFACE, "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        if rates[k]:
            netns.cap_bandwidth(rates[k], DEVICE_INTERFACE, ns)   # the device's upload
            netns.cap_bandwidth(rates[k], link)                   # its download
        device = DeviceRecord(name, address, AGENT_PORT, 0, str(directory / f"{name}.log"), str(directory / name),
                              namespace=ns, link=link, cpu=cpus[k], memory=memories[k], bandwidth=rates[k])
        cmd = netns.in_namespace(ns) + _agent_command(name, directory, DEVICE_INTERFACE, AGENT_PORT, None)
        _launch(record, device, cmd, host)


def _wait_ready(record: TestbedRecord, since: dict[str, int] | None = None) -> None:
    """Until every agent logs that it listens (and advertises), in its log past `since` (a
    device's offset, for an agent started again); SwarmError with its log if one dies."""
    deadline = time.monotonic() + READY_TIMEOUT
    waiting = list(record.devices)
    since = since or {}
    while waiting:
        for device in list(waiting):
            log = Path(device.log).read_bytes()[since.get(device.name, 0):].decode(errors="replace") \
                if Path(device.log).exists() else ""
            if READY_LINE in log:
                waiting.remove(device)
            elif not _alive(device.pid):
                tail = "\n".join(log.strip().splitlines()[-5:])
                raise SwarmError(f"the agent of {device.name} exited during start-up:\n{tail}")
        if waiting and time.monotonic() > deadline:
            raise SwarmError(f"agents of {', '.join(d.name for d in waiting)} not ready within {READY_TIMEOUT:g} s "
                             f"(logs in {state_dir()})")
        if waiting:
            time.sleep(0.05)


# -- down -----------------------------------------------------------------------------

def down() -> list[str]:
    """Remove every process, namespace, link and cgroup the testbed made; what was removed."""
    removed: list[str] = []
    try:
        record = load()
    except SwarmError:
        record = None
    pids: set[int] = set()
    if record is not None:
        pids |= {d.pid for d in record.devices if d.pid and _alive(d.pid) and _is_agent(d.pid)}
    # Without a record (a crash before it was written, or it was lost), or for the namespace
    # form, sweep everything carrying the prefix; a loopback record covers all it made.
    sweep = is_root() and (record is None or record.kind == "netns")
    namespaces = netns.namespaces() if sweep and shutil.which("ip") else []
    for ns in namespaces:
        pids |= set(netns.namespace_pids(ns))
    host = cgroups.detect() if sweep else None
    recorded = [Path(c) for d in record.devices for c in d.cgroups] if record else []
    cgroup_dirs = _our_cgroups(host) + recorded + [p.parent for p in recorded if p.parent.name == CGROUP_GROUP]
    for directory in cgroup_dirs:
        pids |= set(cgroups.processes(directory))
    pids.discard(os.getpid())
    for pid in sorted(pids):
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid}")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for ns in namespaces:
        netns.run("ip", "netns", "del", ns, check=False)
        removed.append(f"namespace {ns}")
    if sweep and shutil.which("ip"):
        for link in netns.links():
            if netns.run("ip", "link", "del", link, check=False).returncode == 0:
                removed.append(f"link {link}")
    for directory in sorted(set(cgroup_dirs), key=lambda p: -len(p.parts)):
        if directory.exists() and cgroups.remove(directory):
            removed.append(f"cgroup {directory}")
    if state_dir().exists():
        shutil.rmtree(state_dir(), ignore_errors=True)
        removed.append(f"state {state_dir()}")
    return removed


def _our_cgroups(host) -> list[Path]:
    if host is None:
        return []
    found = []
    for group in host.group_dirs():
        if group.is_dir():
            found += [d for d in group.iterdir() if d.is_dir()]
            found.append(group)
    return found


# -- acting on devices ----------------------------------------------------------------

def kill(name: str) -> DeviceRecord:
    """SIGKILL the device's agent."""
    device = require().device(name)
    if not _alive(device.pid):
        raise SwarmError(f"the agent of {name} (pid {device.pid}) is not running")
    os.kill(device.pid, signal.SIGKILL)
    return device


def restart(name: str) -> DeviceRecord:
    """Start the agent of a device whose agent was killed (or exited) again, as the device
    would after a reboot: the same name, address, state directory, limits and link. Returns
    once it listens."""
    record = require()
    device = record.device(name)
    if _alive(device.pid) and _is_agent(device.pid):
        raise SwarmError(f"the agent of {name} (pid {device.pid}) is running (`swarm testbed kill {name}` first)")
    directory = state_dir()
    if record.kind == "netns":
        cmd = netns.in_namespace(device.namespace) + _agent_command(name, directory, DEVICE_INTERFACE, device.port,
                                                                     None)
    else:
        cmd = _agent_command(name, directory, "lo", device.port, record.peers())
    offset = Path(device.log).stat().st_size if Path(device.log).exists() else 0
    device.pid = _start(device, cmd)
    _save(record)
    if device.cgroups:
        cgroups.add_process([Path(d) for d in device.cgroups], device.pid)
    alone = replace(record, devices=[device])
    _wait_ready(alone, {name: offset})
    return device


def cut(name: str) -> DeviceRecord:
    """Take the device's link down (loopback form: freeze its agent with SIGSTOP)."""
    return _link(name, up=False)


def heal(name: str) -> DeviceRecord:
    """Bring the device's link back up (loopback form: SIGCONT)."""
    return _link(name, up=True)


def _link(name: str, up: bool) -> DeviceRecord:
    record = require()
    device = record.device(name)
    if record.kind == "netns":
        netns.run("ip", "link", "set", device.link, "up" if up else "down")
    else:
        if not _alive(device.pid):
            raise SwarmError(f"the agent of {name} (pid {device.pid}) is not running")
        os.kill(device.pid, signal.SIGCONT if up else signal.SIGSTOP)
    return device


def partition(*groups: list[str]) -> list[list[str]]:
    """Split the devices into groups that cannot reach each other (each keeps its links within
    its group and to the host); the devices no group names form one more. Blackhole routes in
    each namespace to the other groups' addresses: packets across vanish, as on a split LAN
    (multicast is untouched). Returns the groups."""
    record = require()
    if record.kind != "netns":
        raise SwarmError("a partition needs the namespace testbed (not --loopback)")
    names = [d.name for d in record.devices]
    listed = [n for g in groups for n in g]
    unknown = sorted(set(listed) - set(names))
    if unknown or len(set(listed)) != len(listed):
        raise SwarmError(f"a partition names each device of the testbed once (unknown: {', '.join(unknown) or '-'}; "
                         f"devices: {', '.join(names)})")
    groups = [list(g) for g in groups if g] + ([rest] if (rest := [n for n in names if n not in listed]) else [])
    side = {n: k for k, g in enumerate(groups) for n in g}
    for a in record.devices:
        for b in record.devices:
            if side[a.name] != side[b.name]:
                netns.run("ip", "netns", "exec", a.namespace, "ip", "route", "replace", "blackhole", f"{b.address}/32")
    return groups


def mend() -> None:
    """Undo `partition`: every device reaches every other again."""
    record = require()
    if record.kind != "netns":
        raise SwarmError("a partition needs the namespace testbed (not --loopback)")
    for a in record.devices:
        for b in record.devices:
            if a is not b:
                netns.run("ip", "netns", "exec", a.namespace, "ip", "route", "del", "blackhole", f"{b.address}/32",
                          check=False)


def exec_in(name: str, argv: list[str], in_cgroup: bool = False) -> None:
    """Become argv, run as a process of device `name` (inside its namespace, and with `in_cgroup`
    inside its cgroups too: its CPU share and memory limit, beside its agent), with the
    testbed's token and interface in its environment; `swarm` means this same swarm. Does not
    return."""
    record = require()
    device = record.device(name)
    if in_cgroup and not device.cgroups:
        raise SwarmError(f"{name} has no cgroup: the testbed was started without --cpu or --mem")
    if not argv:
        raise SwarmError("nothing to run: give a command after --, e.g. `swarm testbed exec dev0 -- swarm status`")
    if argv[0] == "swarm":
        argv = _swarm_command() + argv[1:]
    token = Path(record.token_file).read_text().strip()
    extra = {"SWARM_TOKEN": token, "SWARM_STATE_DIR": device.state_dir,
             "SWARM_INTERFACE": DEVICE_INTERFACE if record.kind == "netns" else "lo"}
    if record.kind == "loopback":
        extra["SWARM_PEERS"] = record.peers()
    argv = (netns.in_namespace(device.namespace) if record.kind == "netns" else []) + argv
    if shutil.which(argv[0]) is None:
        raise SwarmError(f"command not found: {argv[0]}")
    sys.stdout.flush()
    if in_cgroup:
        cgroups.add_process([Path(c) for c in device.cgroups], os.getpid())  # what it becomes stays there
    os.execvpe(argv[0], argv, _environment(extra))  # becomes the command: its signals, its exit status


def status_rows(record: TestbedRecord) -> list[dict]:
    rows = []
    for d in record.devices:
        link = "-" if record.kind != "netns" else ("up" if netns.link_is_up(d.link) else "down (cut)")
        if record.kind == "loopback" and _alive(d.pid):
            state = Path(f"/proc/{d.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            link = "down (stopped)" if state == "T" else "up"
        rows.append({"device": d.name, "address": f"{d.address}:{d.port}", "pid": d.pid,
                     "agent": "running" if _alive(d.pid) else "dead", "link": link,
                     "cpu": d.cpu, "memory": d.memory, "bandwidth": d.bandwidth})
    return rows

