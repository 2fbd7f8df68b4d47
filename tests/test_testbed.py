"""The namespace testbed (root): 4 agents that differ in CPU share, memory and link rate find each
other by mDNS with their own limits, status lists them, a process run --in-cgroup shares its
device's cgroup, a killed one is dead within 2 s, a cut one dead then healed, links capped by tc
each at its own rate and keeping TCP's packets large both ways, and down leaves nothing behind.
Also the cgroup v1/v2 logic on fake trees, and the refusal without root."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.errors import SwarmError
from swarm.testbed import cgroups, testbed
from swarm.testbed.names import PREFIX
from tests.conftest import ROOT, run_swarm, bed_in_use

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")
DEVICES = ["dev0", "dev1", "dev2", "dev3"]


def leftovers() -> list[str]:
    found = [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
             .splitlines() if line.startswith(PREFIX)]
    found += [line for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
              .splitlines() if f" {PREFIX}-" in line]
    host = cgroups.detect()
    if host is not None:
        found += [str(p) for p in host.group_dirs() if p.exists()]
    return found


@root_only
@pytest.mark.testbed
class TestNamespaceTestbed:
    @pytest.fixture(scope="class")
    @classmethod
    def bed(cls):
        if bed_in_use() or leftovers():
            pytest.skip("a namespace testbed is already up on this machine")
        up = run_swarm("testbed", "up", "--devices", 4, "--cpu", "0.5,0.5,0.5,1.5", "--mem", "512M,512M,512M,768M",
                       "--bandwidth", "100mbit,100mbit,100mbit,20mbit", timeout=180)
        try:
            assert up.returncode == 0, up.stderr
            yield testbed.load()
        finally:
            down = run_swarm("testbed", "down", timeout=60)
            assert down.returncode == 0, down.stderr
            assert leftovers() == []

    def test_four_agents_found_by_mdns_with_their_limits(self, bed):
        started = time.monotonic()
        r = run_swarm("testbed", "exec", "dev0", "--", "swarm", "status", "--json", "--expect", "4", "--wait", "10",
                      timeout=60)
        took = time.monotonic() - started
        assert r.returncode == 0, r.stderr
        devices = json.loads(r.stdout)
        assert sorted(d["name"] for d in devices) == DEVICES
        assert all(d["health"] == "alive" and d["source"] == "mdns" for d in devices)
        assert {d["address"] for d in devices} == {d.address for d in bed.devices}
        limits = {d["name"]: (d["memory"], d["cores"]) for d in devices}  # each device's own cgroup limits
        assert limits == {"dev0": (512 * 2**20, 1), "dev1": (512 * 2**20, 1), "dev2": (512 * 2**20, 1),
                          "dev3": (768 * 2**20, 2)}
        assert took < 8, took   # found within a few seconds, interpreter start-up included

    def test_links_are_capped(self, bed):
        import trio

        from swarm.cluster import open_roster
        from swarm.net import Credentials, resolve_network
        from swarm.profiling.bandwidth import measure_bandwidth

        async def measure():
            token = Path(bed.token_file).read_text().strip()
            network = resolve_network(testbed.BRIDGE)   # a coordinator on the host, on the bridge only
            async with open_roster(Credentials("host-coordinator", token), network) as cluster:
                devices = {d.name: d for d in await cluster.wait_for(4, timeout=10)}
                fast = [devices["dev0"].node_id, devices["dev1"].node_id]
                slow = [devices["dev0"].node_id, devices["dev3"].node_id]
                return (await measure_bandwidth(cluster, fast, nbytes=2 * 2**20),
                        await measure_bandwidth(cluster, slow, nbytes=2 * 2**20))

        fast, slow = trio.run(measure)
        for r in fast.values():
            assert 6e6 < r["bytes_per_second"] < 13.5e6, r   # 100 Mbit/s = 12.5 MB/s
        for r in slow.values():
            assert 1.2e6 < r["bytes_per_second"] < 2.7e6, r   # dev3's 20 Mbit/s = 2.5 MB/s

    def test_streams_both_ways_keep_tcps_packets_large(self, bed):
        """dev0 and dev1 each stream 8 MB to the other at once, on two connections, as the
        members of a gradient sum do. The caps send each flow's acknowledgements before the
        other flow's data, so TCP keeps sending packets of many segments (21 kB a packet
        received, data and acknowledgements); with one queue that held them behind the data,
        6-9 kB here, and 1-2.5 kB with eight devices summing."""
        zero, one = bed.device("dev0"), bed.device("dev1")
        before = {d.name: tcp_counters(d.namespace) for d in (zero, one)}
        procs = [subprocess.Popen(["ip", "netns", "exec", d.namespace, sys.executable, "-c", TWO_WAY, d.address, peer.address],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for d, peer in ((zero, one), (one, zero))]
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        for d in (zero, one):
            got = {k: v - before[d.name][k] for k, v in tcp_counters(d.namespace).items()}
            # packets in: the peer's data (8 MB) and its acknowledgements of ours
            assert TWO_WAY_BYTES / got["InSegs"] > 14000, (d.name, got)   # 6-9 kB a packet with one queue

    def test_status_shows_each_devices_limits_and_exec_in_cgroup_joins_its_cgroup(self, bed):
        status = json.loads(run_swarm("testbed", "status", "--json").stdout)
        shown = {d["device"]: (d["cpu"], d["memory"], d["bandwidth"]) for d in status["devices"]}
        assert shown["dev1"] == (0.5, 512 * 2**20, "100mbit")
        assert shown["dev3"] == (1.5, 768 * 2**20, "20mbit")
        inside = run_swarm("testbed", "exec", "--in-cgroup", "dev3", "--", "cat", "/proc/self/cgroup", timeout=30)
        assert inside.returncode == 0, inside.stderr
        agent = Path(f"/proc/{bed.device('dev3').pid}/cgroup").read_text()
        assert inside.stdout == agent   # the same cgroups as dev3's agent
        outside = run_swarm("testbed", "exec", "dev3", "--", "cat", "/proc/self/cgroup", timeout=30)
        assert outside.stdout != agent

    def test_a_model_too_big_to_step_whole_in_a_devices_memory_is_profiled_in_pieces(self, bed):
        """The full yolov2 (50.6 M parameters) beside an agent in dev3's 768 MiB: its weights,
        gradients, momentum and torch do not fit together, so a whole step would have the
        kernel kill the process; measured in pieces it finishes, within the limit."""
        r = run_swarm("testbed", "exec", "--in-cgroup", "dev3", "--", "swarm", "profile", "--model", "yolov2",
                      "--img-size", 128, "--batch-sizes", "1,2", "--repeats", 1, "--threads", 1, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "the model being too big to step whole here" in r.stderr, r.stderr
        assert "its layers were measured in pieces" in r.stdout, r.stdout

    def test_killed_agent_is_reported_dead_within_2_seconds_and_cut_link_heals(self, bed):
        cmd = [sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", "swarm", "status", "--json", "--watch",
               "--expect", "4", "--wait", "10"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            listing = json.loads(proc.stdout.readline())
            assert sorted(d["name"] for d in listing if d["health"] == "alive") == DEVICES
            assert run_swarm("testbed", "kill", "dev1").returncode == 0
            killed_at = time.time()
            dead = wait_event(proc, "dev1", "dead")
            assert dead["time"] - killed_at < 2.0, dead
            assert run_swarm("testbed", "cut", "dev2").returncode == 0
            cut_at = time.time()
            assert wait_event(proc, "dev2", "dead")["time"] - cut_at < 2.0
            assert run_swarm("testbed", "heal", "dev2").returncode == 0
            wait_event(proc, "dev2", "recovered")
        finally:
            proc.kill()
            proc.wait()

        status = json.loads(run_swarm("testbed", "status", "--json").stdout)
        agents = {d["device"]: d["agent"] for d in status["devices"]}
        assert agents == {"dev0": "running", "dev1": "dead", "dev2": "running", "dev3": "running"}

    def test_a_killed_agent_restarts_in_its_cgroups_and_is_found_again(self, bed):
        """`swarm testbed restart`: a device whose agent died comes back as after a reboot, with
        its address, limits and cgroups; one whose agent runs is refused in one line."""
        status = json.loads(run_swarm("testbed", "status", "--json").stdout)
        if {d["device"]: d["agent"] for d in status["devices"]}["dev1"] == "running":  # (when run alone)
            assert run_swarm("testbed", "kill", "dev1").returncode == 0
        old = testbed.load().device("dev1").pid
        r = run_swarm("testbed", "restart", "dev1", timeout=120)
        assert r.returncode == 0, r.stderr
        pid = testbed.load().device("dev1").pid
        assert pid != old and f"restarted the agent of dev1 (pid {pid})" in r.stdout
        inside = run_swarm("testbed", "exec", "--in-cgroup", "dev1", "--", "cat", "/proc/self/cgroup", timeout=30)
        assert inside.stdout == Path(f"/proc/{pid}/cgroup").read_text()
        found = run_swarm("testbed", "exec", "dev0", "--", "swarm", "status", "--json", "--expect", "4", "--wait",
                          "10", timeout=60)
        assert found.returncode == 0, found.stderr
        devices = {d["name"]: d for d in json.loads(found.stdout)}
        assert devices["dev1"]["health"] == "alive" and devices["dev1"]["memory"] == 512 * 2**20
        again = run_swarm("testbed", "restart", "dev1")
        assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
        assert f"the agent of dev1 (pid {pid}) is running" in again.stderr


TWO_WAY_BYTES = 8 * 2**20
TWO_WAY = f"""
import socket, sys, threading, time
me, peer = sys.argv[1], sys.argv[2]
server = socket.create_server((me, 4799))
def send():
    for _ in range(100):
        try:
            out = socket.create_connection((peer, 4799), timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    out.sendall(bytes({TWO_WAY_BYTES}))
    out.close()
sender = threading.Thread(target=send)
sender.start()
inc, _ = server.accept()
got = 0
while got < {TWO_WAY_BYTES}:
    n = len(inc.recv(1 << 20))
    assert n, "closed early"
    got += n
sender.join()
"""


def tcp_counters(namespace: str) -> dict[str, int]:
    """The namespace's TCP counters (/proc/net/snmp), as InSegs: segments received as the stack saw them."""
    lines = [line.split() for line in subprocess.run(["ip", "netns", "exec", namespace, "cat", "/proc/net/snmp"],
                                                     capture_output=True, text=True, check=True).stdout.splitlines()
             if line.startswith("Tcp:")]
    return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:])}


def wait_event(proc, name, kind, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        if isinstance(event, dict) and event.get("name") == name and event.get("event") == kind:
            return event
    raise AssertionError(f"no '{kind}' event for {name} within {timeout} s")


@root_only
@pytest.mark.testbed
def test_down_cleans_up_after_a_crash():
    if bed_in_use() or leftovers():
        pytest.skip("a namespace testbed is already up on this machine")
    up = run_swarm("testbed", "up", "--devices", 2, "--cpu", "0.25", timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        pids = [d.pid for d in testbed.load().devices]
        testbed.record_path().unlink()          # as if `up` had crashed before writing its record
        down = run_swarm("testbed", "down", timeout=60)
        assert down.returncode == 0 and "removed" in down.stdout, down.stderr
        assert leftovers() == []
        assert not any(Path(f"/proc/{p}").exists() and testbed._alive(p) for p in pids)
        again = run_swarm("testbed", "down")
        assert again.returncode == 0 and "nothing to remove" in again.stdout
    finally:
        run_swarm("testbed", "down", timeout=60)


def test_per_device_limits_are_one_for_all_or_one_each():
    assert testbed.per_device(0.25, 3, "--cpu") == [0.25, 0.25, 0.25]
    assert testbed.per_device([0.25], 3, "--cpu") == [0.25, 0.25, 0.25]
    assert testbed.per_device([0.1, 0.2, 0.6], 3, "--cpu") == [0.1, 0.2, 0.6]
    assert testbed.per_device(None, 2, "--mem") == [None, None]
    with pytest.raises(SwarmError, match="--cpu gives 2 values for 3 devices"):
        testbed.per_device([0.1, 0.2], 3, "--cpu")
    r = run_swarm("testbed", "up", "--devices", 3, "--cpu", "0.1,0.2", "--loopback")
    assert r.returncode == 2 and r.stderr.strip().endswith("--cpu gives 2 values for 3 devices: give one for all, "
                                                           "or one each"), r.stderr
    r = run_swarm("testbed", "up", "--devices", 2, "--mem", "1G,lots", "--loopback")
    assert r.returncode == 2 and "'lots' is not a size" in r.stderr, r.stderr


def test_a_described_cluster_becomes_each_devices_limits(tmp_path):
    described = json.loads((ROOT / "examples" / "mixed-testbed-cluster.json").read_text())
    names, cpus, memories, rates = testbed.limits_from_cluster(described, "mixed")
    assert names == [f"dev{k}" for k in range(6)]
    assert cpus == [0.1, 0.1, 0.2, 0.2, 0.4, 0.6]
    assert memories == [2**30] * 5 + [2 * 2**30]   # what training may use, and what the runtime takes beside it
    assert rates == ["100mbit"] * 6
    pairs = dict(described, links=[{"between": ["dev0", "dev1"], "mbps": 20}])
    with pytest.raises(SwarmError, match="cannot rehearse \"links\" between pairs"):
        testbed.limits_from_cluster(pairs, "pairs")
    with pytest.raises(SwarmError, match="relative to \"reference\": \"local\""):
        testbed.limits_from_cluster(dict(described, reference={"gflops": 10}), "gflops")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run_swarm("testbed", "up", "--cluster", bad, "--loopback")
    assert r.returncode == 2 and "is not JSON" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_swarm("testbed", "up", "--cluster", ROOT / "examples" / "mixed-testbed-cluster.json", "--devices", 4,
                  "--loopback")
    assert r.returncode == 2 and "describes 6 devices, not --devices 4" in r.stderr, r.stderr


def test_without_root_the_namespace_testbed_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("SWARM_TESTBED_DIR", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SwarmError, match="needs root.*--loopback"):
        testbed.up(2)
    with pytest.raises(SwarmError, match="--cpu and --mem need root"):
        testbed.up(2, cpu=0.25, loopback=True)
    with pytest.raises(SwarmError, match="--bandwidth needs the namespace testbed"):
        testbed.up(2, bandwidth="10mbit", loopback=True)


def fake_tree(tmp_path: Path, version: int) -> str:
    """A /proc/mounts text and directories standing for a cgroup v1 or v2 host."""
    if version == 2:
        (tmp_path / "v2").mkdir()
        (tmp_path / "v2" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        return f"cgroup2 {tmp_path}/v2 cgroup2 rw,nosuid 0 0\n"
    for c in ("cpu,cpuacct", "memory"):
        (tmp_path / c).mkdir()
    return (f"cgroup {tmp_path}/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n"
            f"cgroup {tmp_path}/memory cgroup rw,memory 0 0\n"
            f"cgroup2 {tmp_path}/unified cgroup2 rw 0 0\n")  # a v2 mount without controllers: not usable


def test_cgroup_v2_limits(tmp_path):
    host = cgroups.detect(fake_tree(tmp_path, 2))
    assert host.version == 2
    dirs = cgroups.create_limits(host, "dev0", cpu=0.25, memory=2**30)
    assert dirs == [tmp_path / "v2" / PREFIX / "dev0"]
    assert (dirs[0] / "cpu.max").read_text() == "2500 10000"  # a quarter of a core, on a 10 ms period
    assert (dirs[0] / "memory.max").read_text() == str(2**30)
    for parent in (tmp_path / "v2", tmp_path / "v2" / PREFIX):
        assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory"
    cgroups.add_process(dirs, 1234)
    assert cgroups.processes(dirs[0]) == [1234]


def test_cgroup_v1_limits(tmp_path):
    host = cgroups.detect(fake_tree(tmp_path, 1))
    assert host.version == 1
    cpu_dir, memory_dir = cgroups.create_limits(host, "dev3", cpu=1.5, memory=512 * 2**20)
    assert cpu_dir == tmp_path / "cpu,cpuacct" / PREFIX / "dev3"
    assert (cpu_dir / "cpu.cfs_quota_us").read_text() == "15000"
    assert (cpu_dir / "cpu.cfs_period_us").read_text() == "10000"
    assert (memory_dir / "memory.limit_in_bytes").read_text() == str(512 * 2**20)
    assert cgroups.detect("") is None


@root_only
def test_this_hosts_cgroups_are_usable():
    host = cgroups.detect()
    assert host is not None and host.version in (1, 2)


def test_a_record_this_swarm_cannot_read_is_a_message(monkeypatch, tmp_path):
    monkeypatch.setenv("SWARM_TESTBED_DIR", str(tmp_path))
    testbed.record_path().write_text(json.dumps({"kind": "netns", "token_file": "t", "devices": [
        {"name": "dev0", "address": "a", "port": 1, "pid": 1, "log": "l", "state_dir": "s", "shape": "round"}]}))
    with pytest.raises(SwarmError, match="not one this swarm reads.*swarm testbed down"):
        testbed.load()
