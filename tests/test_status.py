"""`swarm status` over the loopback testbed (agents on 127.0.0.1, no root): by --peers and by
mDNS on lo, JSON and table, a killed device reported dead, a frozen one dead then recovered."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from swarm.cluster import Member
from swarm.commands.status_cmd import format_table
from swarm.host.accelerator import accelerator
from tests.conftest import ROOT, run_swarm

DEVICES = ["dev0", "dev1", "dev2"]


@pytest.fixture(scope="module")
def loopback_testbed(tmp_path_factory):
    env = {"SWARM_TESTBED_DIR": str(tmp_path_factory.mktemp("testbed"))}
    up = run_swarm("testbed", "up", "--loopback", "--devices", len(DEVICES), env=env, timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        record = json.loads((ROOT / env["SWARM_TESTBED_DIR"] / "testbed.json").read_text())
        yield env, record
    finally:
        down = run_swarm("testbed", "down", env=env)
        assert down.returncode == 0, down.stderr


def status_json(env, *args):
    r = run_swarm("testbed", "exec", "dev0", "--", "swarm", "status", "--json", *args, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_status_lists_every_device_by_peers(loopback_testbed):
    env, record = loopback_testbed
    devices = status_json(env, "--no-mdns", "--expect", len(DEVICES), "--wait", "10")
    assert sorted(d["name"] for d in devices) == DEVICES
    ports = {d["name"]: d["port"] for d in record["devices"]}
    for d in devices:
        assert d["health"] == "alive" and d["address"] == "127.0.0.1" and d["port"] == ports[d["name"]]
        assert d["cores"] >= 1 and d["memory"] > 0 and d["accelerator"] == accelerator() and d["version"]
        assert 0 < d["spare"] < d["memory"]  # what it can spare: less its reserve at least
        assert d["last_seen_ago"] < 5 and d["rtt"] is not None


def test_status_finds_them_by_mdns_on_loopback_too(loopback_testbed):
    env, _ = loopback_testbed
    token = (ROOT / env["SWARM_TESTBED_DIR"] / "token").read_text().strip()
    r = run_swarm("status", "--json", "--wait", "4", env={"SWARM_TOKEN": token, "SWARM_INTERFACE": "lo",
                                                          "SWARM_PEERS": ""}, timeout=60)
    assert r.returncode == 0, r.stderr
    ours = [d for d in json.loads(r.stdout) if d["name"] in DEVICES and d["health"] == "alive"]
    assert sorted(d["name"] for d in ours) == DEVICES and {d["source"] for d in ours} == {"mdns"}


def test_a_coordinator_with_another_token_sees_them_refuse(loopback_testbed):
    env, record = loopback_testbed
    peer = f"127.0.0.1:{record['devices'][0]['port']}"
    r = run_swarm("status", "--json", "--no-mdns", "--peers", peer, "--wait", "1",
                  env={"SWARM_TOKEN": "not-the-cluster-token-at-all"}, timeout=60)
    assert r.returncode == 0, r.stderr
    (device,) = json.loads(r.stdout)
    assert device["health"] == "refused" and "cluster token" in device["error"]
    log = open(record["devices"][0]["log"]).read()
    assert "refused connection from 127.0.0.1" in log and "cluster token" in log


def test_table_format():
    d = Member("n1", "10.0.0.2", 4750, name="pi-1", cores=4, memory=2**30, spare=700 * 2**20, accelerator="cpu",
               version="0.1.0", health="alive", last_seen=time.time() - 1.2)
    lost = Member("10.0.0.3:4750", "10.0.0.3", 4750, health="unreachable", error="connection refused")
    lines = format_table([d, lost]).splitlines()
    assert lines[0].split() == ["NAME", "ADDRESS", "CORES", "MEMORY", "SPARE", "ACCEL", "VERSION", "LAST", "SEEN",
                                "HEALTH", "JOB"]
    assert lines[1].split()[:9] == ["pi-1", "10.0.0.2:4750", "4", "1.0", "GiB", "700", "MiB", "cpu", "0.1.0"]
    assert "1.2 s ago" in lines[1] and "alive" in lines[1]
    assert "unreachable: connection refused" in lines[2] and "never" in lines[2]


def test_the_accelerator_column_says_where_its_memory_is():
    """A discrete GPU's own memory; a Jetson's GPU shares the device's (the MEMORY column);
    a device that opted out (or has no GPU) computes on its cpu."""
    gpu = Member("n1", "10.0.0.2", 4750, name="box", cores=16, memory=64 * 2**30, accelerator="cuda",
                 accelerator_memory=24 * 2**30, version="0.1.0", health="alive")
    jetson = Member("n2", "10.0.0.3", 4750, name="jetson-1", cores=4, memory=3 * 2**30, accelerator="cuda",
                    accelerator_memory=0, version="0.1.0", health="alive")
    opted_out = Member("n3", "10.0.0.4", 4750, name="jetson-2", cores=4, memory=3 * 2**30, accelerator="cpu",
                       accelerator_memory=0, version="0.1.0", health="alive")
    unknown = Member("n4", "10.0.0.5", 4750, name="gpu-2", cores=8, memory=2**34, accelerator="cuda",
                     version="0.1.0", health="alive")
    lines = format_table([gpu, jetson, opted_out, unknown]).splitlines()
    accel = lines[0].index("ACCEL")
    assert [line[accel:].split("  ")[0].strip() for line in lines[1:]] == ["cuda 24.0 GiB", "cuda (shared)", "cpu",
                                                                           "cuda"]
    assert len({line.index("0.1.0") for line in lines[1:]}) == 1  # the columns stay aligned


def watch(env, device="dev0"):
    cmd = [sys.executable, "-m", "swarm", "testbed", "exec", device, "--", "swarm", "status", "--json", "--watch",
           "--no-mdns", "--expect", str(len(DEVICES)), "--wait", "10"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


def next_event(proc, name, kind, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        if isinstance(event, dict) and event.get("name") == name and event.get("event") == kind:
            return event
    raise AssertionError(f"no '{kind}' event for {name} within {timeout} s")


def test_killed_device_is_dead_and_frozen_one_recovers(loopback_testbed):
    env, _ = loopback_testbed
    proc = watch(env)
    try:
        listing = json.loads(proc.stdout.readline())
        assert sorted(d["name"] for d in listing if d["health"] == "alive") == DEVICES
        # freeze dev2 (loopback "cut"): no heartbeats, no answer to the probe; then thaw it
        assert run_swarm("testbed", "cut", "dev2", env=env).returncode == 0
        cut_at = time.time()
        assert next_event(proc, "dev2", "suspect")["time"] - cut_at < 1.5
        assert next_event(proc, "dev2", "dead")["time"] - cut_at < 2.0
        assert run_swarm("testbed", "heal", "dev2", env=env).returncode == 0
        next_event(proc, "dev2", "recovered")
        # kill dev1
        kill = run_swarm("testbed", "kill", "dev1", env=env)
        killed_at = time.time()
        assert kill.returncode == 0 and "killed the agent of dev1" in kill.stdout
        dead = next_event(proc, "dev1", "dead")
        assert dead["time"] - killed_at < 2.0, dead
    finally:
        proc.kill()
        proc.wait()
