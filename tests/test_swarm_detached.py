"""Detached runs on the namespace testbed (root): `swarm train --detach` hands the run to an
agent and exits; the run goes on without it, and its checkpoint, brought home by `swarm
fetch`, holds the weights of the same run on one machine (float64, as test_swarm_replay.py)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.conftest import namespace_testbed, run_swarm
from tests.test_swarm_replay import worst

pytestmark = [pytest.mark.testbed, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")]

STEPS = 4
FLAGS = ["--model", "yolov2-16", "--img-size", "32", "--batch-size", "4", "--microbatches", "2", "--steps", STEPS,
         "--seed", "7", "--dtype", "float64", "--no-eval"]


@pytest.fixture(scope="module")
def local_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "local.pt"
    r = run_swarm("train", "--strategy", "local", *FLAGS, "--save", path, timeout=300)
    assert r.returncode == 0, r.stderr
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture
def bed():
    yield from namespace_testbed(3)


def swarm_on(device: str, *args, timeout=120):
    """A swarm command run on `device`, reaching the agents by --peers too (mDNS answers may
    be slow while the devices train)."""
    from swarm.testbed import testbed

    peers = ",".join(f"{d.address}:{d.port}" for d in testbed.load().devices)
    return run_swarm("testbed", "exec", device, "--", "swarm", *args, "--peers", peers, timeout=timeout)


def run_of(device: str, job: str) -> dict | None:
    r = swarm_on(device, "jobs", "--json", "--wait", "0.5")
    assert r.returncode == 0, r.stderr
    return next((run for run in json.loads(r.stdout) if run["id"] == job), None)


def test_a_detached_run_outlives_its_command_and_ends_with_the_local_weights(bed, local_weights, tmp_path):
    r = swarm_on("dev0", "train", "--detach", "--coordinator", "dev1", *FLAGS, "--strategy", "pp", "--devices", "3",
                 "--wait", "30")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()  # the command has exited: the run is the agent's now
    assert f"run {job} is coordinated by dev1" in r.stderr
    deadline = time.monotonic() + 120
    while (run := run_of("dev2", job))["state"] == "running":
        assert time.monotonic() < deadline, run
        time.sleep(1)
    assert run["state"] == "done", run
    assert (run["node"], run["step"], run["steps"], run["devices"]) == ("dev1", STEPS, STEPS, 3)
    log = swarm_on("dev2", "logs", job)
    assert f"step {STEPS}/{STEPS}" in log.stdout and "Traceback" not in log.stdout, log.stdout + log.stderr
    out = tmp_path / "fetched.pt"
    fetched = swarm_on("dev0", "fetch", job, "--out", out)
    assert fetched.returncode == 0, fetched.stderr
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == STEPS
    assert worst(saved["model"], local_weights) < 1e-9
    unknown = swarm_on("dev0", "logs", "0badid", "--wait", "1")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "no agent knows a run 0badid" in unknown.stderr
