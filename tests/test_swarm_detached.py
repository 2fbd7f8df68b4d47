"""Detached runs on the namespace testbed (root): `swarm train --detach` hands the run to an
agent and exits; the run goes on without it. When the coordinator's device is killed or cut
off, the agents elect a successor and `swarm logs -f` follows the run there; the checkpoint,
brought home by `swarm fetch`, holds the weights of the same run on one machine (float64, as
test_swarm_replay.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, LocalRun, namespace_testbed, run_swarm
from tests.test_swarm_replay import worst

pytestmark = [pytest.mark.testbed, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")]

STEPS = 24
FLAGS = ["--model", "yolov2-16", "--img-size", "32", "--batch-size", "4", "--microbatches", "2", "--steps", STEPS,
         "--seed", "7", "--dtype", "float64", "--no-eval", "--backup-every", "2"]


@pytest.fixture(scope="module")
def local_weights(tmp_path_factory):
    """The failure-free run on one machine, started before the first testbed comes up."""
    return LocalRun(tmp_path_factory.mktemp("local") / "local.pt", *FLAGS)


def swarm_on(device: str, *args, timeout=120):
    """A swarm command run on `device`, reaching the agents by --peers too (mDNS answers may
    be slow while the devices train)."""
    from swarm.testbed import testbed

    peers = ",".join(f"{d.address}:{d.port}" for d in testbed.load().devices)
    return run_swarm("testbed", "exec", device, "--", "swarm", *args, "--peers", peers, timeout=timeout)


def records(device: str, job: str) -> list[dict]:
    """Every agent's record of run `job` (one per coordinator term)."""
    r = swarm_on(device, "jobs", "--json", "--wait", "0.5")
    assert r.returncode == 0, r.stderr
    return [run for run in json.loads(r.stdout) if run["id"] == job]


def run_of(device: str, job: str) -> dict | None:
    return max(records(device, job), key=lambda run: run["term"], default=None)


@pytest.fixture
def bed4(monkeypatch):
    monkeypatch.setenv("SWARM_PROGRESS_SECONDS", "0")  # the agents' runs log every step
    yield from namespace_testbed(4)


@pytest.fixture
def bed5(monkeypatch):
    monkeypatch.setenv("SWARM_PROGRESS_SECONDS", "0")
    yield from namespace_testbed(5)


def failover_run(faults, devices=4):
    """Detach a pipeline run over the `devices` devices, coordinated by dev1; follow it with `swarm logs
    -f` from dev0 and do `swarm testbed ACTION DEVICE` for each (when, action, device) in turn
    once a line of the log starts with `when` (or, for "next step", is a step after the run
    moved to a new coordinator). DEVICE "worker" is a device neither dev0, dev1 nor the one
    coordinating now. Action "partition" splits the testbed into DEVICE (a comma-separated
    group) and the rest, "mend" joins it again. Returns (job, log lines, the device
    coordinating at the end)."""
    from swarm.testbed import testbed

    r = swarm_on("dev0", "train", "--detach", "--coordinator", "dev1", *FLAGS, "--strategy", "pp", "--devices", devices,
                 "--wait", "30")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()  # the command has exited: the run is the agents' now
    assert f"run {job} is coordinated by dev1" in r.stderr
    peers = ",".join(f"{d.address}:{d.port}" for d in testbed.load().devices)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    follow = subprocess.Popen([sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", "swarm", "logs", job,
                               "-f", "--peers", peers], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    lines, todo, now, moved = [], list(faults), "dev1", False
    deadline = time.monotonic() + 180
    try:
        for line in follow.stdout:
            lines.append(line)
            if "is now coordinated by" in line:
                now, moved = line.split("coordinated by ")[1].split()[0], True
                continue
            while todo and (line.startswith(todo[0][0]) or (todo[0][0] == "next step" and moved
                                                             and line.startswith("step "))):
                _, action, device = todo.pop(0)
                if device == "worker":
                    device = min({"dev2", "dev3"} - {now})
                if action == "partition":
                    testbed.partition(device.split(","))
                elif action == "mend":
                    testbed.mend()
                else:
                    done = run_swarm("testbed", action, device)
                    assert done.returncode == 0, done.stderr
                moved = False
            assert time.monotonic() < deadline, "".join(lines)
        follow.wait(timeout=30)
    finally:
        if follow.poll() is None:
            follow.kill()
    log = "".join(lines)
    assert not todo, f"the run ended before {todo[0][0]}:\n{log}"
    assert follow.returncode == 0 and "Traceback" not in log, log
    return job, log, now


def check_final_weights(job: str, log: str, coordinator: str, weights, tmp_path) -> None:
    assert f"trained yolov2-16 for {STEPS} steps" in log, log
    run = run_of("dev0", job)
    assert (run["state"], run["node"], run["step"], run["term"]) == ("done", coordinator, STEPS, 1), run
    out = tmp_path / "fetched.pt"
    fetched = swarm_on("dev0", "fetch", job, "--out", out)
    assert fetched.returncode == 0, fetched.stderr
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == STEPS
    assert worst(saved["model"], weights) < 1e-9


def test_a_detached_run_outlives_its_command_its_coordinator_and_a_worker(bed4, local_weights, tmp_path):
    job, log, now = failover_run([("step 2/", "kill", "dev1"), ("next step", "kill", "worker")])
    assert "taking over run" in log and "rolling back to step" in log, log
    assert now != "dev1" and log.count("lost dev") >= 2, log  # dev1 (by the successor), then the worker
    check_final_weights(job, log, now, local_weights.weights(), tmp_path)
    again = swarm_on("dev2", "logs", job)  # the newest coordinator's log, to its end
    assert again.returncode == 0 and again.stdout.rstrip().endswith("checkpoint.pt"), again.stdout + again.stderr
    unknown = swarm_on("dev0", "logs", "0badid", "--wait", "1")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "no agent knows a run 0badid" in unknown.stderr


def test_a_cut_off_coordinator_is_replaced_and_gives_up(bed4, local_weights, tmp_path):
    job, log, now = failover_run([("step 2/", "cut", "dev1"), ("next step", "heal", "dev1")])
    assert now != "dev1", log
    check_final_weights(job, log, now, local_weights.weights(), tmp_path)
    old = next(run for run in records("dev1", job) if run["node"] == "dev1")
    assert (old["term"], old["state"]) == (0, "failed"), old
    # it found itself cut off, or its lease ran out first (swarm/agent/quorum.py)
    assert "this one gives up" in old["detail"] or "heard from 1 of 4 devices" in old["detail"], old


def test_a_partition_leaves_one_coordinator(bed5, local_weights, tmp_path):
    """Five devices split 3 + 2 with the coordinator among the 2: it loses its lease and stops
    with its checkpoint; the 3 elect a successor (a majority of the 4 replica holders), which
    carries the run on and takes the 2 back once the partition heals. One run, equal to local."""
    job, log, now = failover_run([("step 4/", "partition", "dev1,dev4"), ("next step", "mend", "-")], devices=5)
    assert now in ("dev0", "dev2", "dev3") and "taking over run" in log, log
    check_final_weights(job, log, now, local_weights.weights(), tmp_path)
    terms = {run["term"]: run for run in records("dev0", job) + records("dev1", job)}
    old = terms[0]
    assert (old["node"], old["state"]) == ("dev1", "failed"), old
    # it stopped on its lease, or found itself cut off first (the partition's links are not cut
    # all at once: a worker across it may report its link to dev4 broken, and dev4 counts lost
    # too); either way it gave up rather than training on
    assert "heard from 2 of 5 devices (a majority is 3)" in old["detail"] or "this one gives up" in old["detail"], old
    assert [run["state"] for run in terms.values()].count("running") == 0 and sorted(terms) == [0, 1], terms
