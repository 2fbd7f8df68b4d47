"""Broken links and links that come and go: the run recovers every time and ends with the
failure-free weights (float64, as in test_swarm_replay.py), without growing in memory.

- A connection between two workers is reset mid-run (loopback testbed, `ss -K`): the device
  that sees it reports it, the far end counts as lost and is taken in again later, and the
  run equals the local one instead of ending with ConnectionLost.
- A soak on the namespace testbed (root): 5 devices of 0.3 core and 2 GiB training a pipeline
  while one device's link is cut and healed over and over (rotating over dev1-dev4) and one
  device is killed; every surviving agent's memory at the start of its later epochs (resident,
  less the snapshots and backups of the stages it holds) is within a fourth of its earlier
  epochs' since it first held a stage (a tenth in the long form), from at least MIN_READINGS epochs each (two for one agent, cut
  off for a while). SWARM_SOAK=full runs the long form
  (200 steps, a 15 s cut every 45 s).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import ROOT, LocalRun, namespace_testbed, run_swarm
from tests.test_clean_stop import FLAGS, loopback_testbed, train_in
from tests.test_swarm_replay import worst


def reset_connections(pid: int, port: int) -> int:
    """Reset (`ss -K`) the established TCP connections of process `pid` to port `port` on
    127.0.0.1; how many there were."""
    listing = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    killed = 0
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) < 5 or f"pid={pid}," not in line or not fields[3].endswith(f":{port}"):
            continue
        local_port = fields[2].rsplit(":", 1)[1]
        subprocess.run(["ss", "-K", "src", "127.0.0.1", "sport", "=", f":{local_port}", "dst", "127.0.0.1",
                        "dport", "=", f":{port}"], capture_output=True)
        killed += 1
    return killed


@pytest.mark.skipif(os.geteuid() != 0, reason="ss -K needs root")
def test_a_reset_link_between_workers_is_a_lost_device_and_the_run_equals_local(tmp_path):
    """A pipeline over dev0-dev2: after step 3 every connection between dev1 and dev2 is reset."""
    flags = [*FLAGS, "--steps", 8]
    expected = LocalRun(tmp_path / "local.pt", *flags)  # runs beside the testbed
    env, pids = loopback_testbed(tmp_path, 3)
    record = json.loads((tmp_path / "testbed" / "testbed.json").read_text())
    ports = {d["name"]: d["port"] for d in record["devices"]}
    out = tmp_path / "pp.pt"
    proc = train_in(env, *flags, "--strategy", "pp", "--devices", 3, "--wait", 30, "--backup-every", 1,
                    "--save", out)
    lines, reset = [], 0
    try:
        deadline = time.monotonic() + 300
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("step 3/") and not reset:
                reset = reset_connections(pids["dev1"], ports["dev2"]) + reset_connections(pids["dev2"], ports["dev1"])
            assert time.monotonic() < deadline, "".join(lines)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        run_swarm("testbed", "down", env=env)
    log = "".join(lines)
    assert reset >= 1, log
    assert proc.returncode == 0, log
    assert "lost its link to" in log and "rolling back to step" in log, log
    assert "error:" not in log and "Traceback" not in log, log
    assert worst(torch.load(out, weights_only=True)["model"], expected.weights()) < 1e-9


# ---- the soak ------------------------------------------------------------------------------

FULL = os.environ.get("SWARM_SOAK") == "full"
SOAK_STEPS = 200 if FULL else 14
CUT_S, PERIOD_S, CUTS = (15.0, 45.0, 1000) if FULL else (6.0, 12.0, 2)  # full: cuts until near the end
LAST_CUT_BEFORE = 40 if FULL else 5  # no cut starts this close to the end: the last device back is taken in
SOAK_FLAGS = ["--model", "yolov2-16", "--img-size", "128", "--batch-size", "8", "--microbatches", "4",
              "--steps", str(SOAK_STEPS), "--seed", "9", "--dtype", "float64", "--no-eval"]
RECOVERED = re.compile(r"rolling back to step|joined: re-planned")
MIN_READINGS = 3  # epochs after a recovery each surviving agent needs for the memory check


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def keep(rss: dict[str, list[float]], sample: dict[str, float | None]) -> None:
    for device, value in sample.items():
        if value is not None:
            rss[device].append(round(value, 1))


class Faults(threading.Thread):
    """First kill dev0's agent (the coordinator, a process of its own in dev0's namespace,
    goes on); then every PERIOD_S cut the next of dev1-dev4 off for CUT_S and heal it, until
    CUTS cuts or the run is LAST_CUT_BEFORE steps from its end (`step`, kept up to date by
    the reader of the log)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.events: list[tuple[float, str, str]] = []
        self.step = 0

    def act(self, action: str, device: str) -> None:
        r = run_swarm("testbed", action, device, timeout=60)
        assert r.returncode == 0, r.stderr
        self.events.append((time.monotonic(), action, device))

    def run(self) -> None:
        self.act("kill", "dev0")
        cuts = 0
        while (cuts < CUTS and self.step < SOAK_STEPS - LAST_CUT_BEFORE
               and not self.done.wait(PERIOD_S - CUT_S)):
            device = f"dev{1 + cuts % 4}"
            self.act("cut", device)
            cuts += 1
            self.done.wait(CUT_S)
            self.act("heal", device)


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")
def since_first_stage(readings: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """An agent's (epoch, MiB resident, MiB kept) readings from the first that keeps snapshots
    or backups of a stage (all of them for an agent that never does)."""
    first = next((i for i, (_, _, kept) in enumerate(readings) if int(kept) > 0), 0)
    return readings[first:]


def test_soak_flapping_links_and_a_killed_device(tmp_path):
    expected = LocalRun(tmp_path / "local.pt", *SOAK_FLAGS)  # runs beside the testbed
    bed_gen = namespace_testbed(5, "--cpu", "0.3", "--mem", "2G")
    bed = next(bed_gen)
    pids = {d.name: d.pid for d in bed.devices}
    out = tmp_path / "soak.pt"
    cmd = [sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", sys.executable, "-m", "swarm", "train",
           *SOAK_FLAGS, "--strategy", "pp", "--devices", "5", "--wait", "30", "--save", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "SWARM_PROGRESS_SECONDS": "0"}
    faults = Faults()
    rss: dict[str, list[float]] = {d: [] for d in pids}
    lines, started = [], time.monotonic()
    recovered, sample = False, {}  # a recovery came; the agents' RSS at the last step line
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in proc.stderr:
            lines.append(f"[{time.monotonic() - started:7.1f}] {line}")
            if line.startswith("step "):
                faults.step = int(line.split()[1].split("/")[0])
                sample = {device: rss_mib(pid) for device, pid in pids.items()}
            if line.startswith("step 2/") and not faults.is_alive() and not faults.events:
                faults.start()
            if RECOVERED.search(line):  # the RSS an epoch ended with is what its recovery left
                if recovered:
                    keep(rss, sample)
                recovered = True
            assert time.monotonic() - started < 3600, "".join(lines)
        proc.wait(timeout=120)
        if recovered:
            keep(rss, sample)
    finally:
        faults.done.set()
        if proc.poll() is None:
            proc.kill()
        if faults.ident is not None:  # (never started when the run ended before its second step)
            faults.join(timeout=120)
        memory = {d.name: re.findall(r"epoch (\d+): (\d+) MiB resident, (\d+) MiB", open(d.log).read())
                  for d in bed.devices}
        for _ in bed_gen:  # testbed down
            pass
    wall = time.monotonic() - started
    log = "".join(lines)
    diff = worst(torch.load(out, weights_only=True)["model"], expected.weights()) if out.exists() else float("nan")
    recoveries = len(RECOVERED.findall(log))
    cuts = sum(1 for _, action, _ in faults.events if action == "cut")
    killed = [d for _, action, d in faults.events if action == "kill"]
    print(f"\nsoak: {SOAK_STEPS} steps, {cuts} cuts, killed {killed}, {recoveries} recoveries, "
          f"final weight difference {diff:.3g}, wall {wall:.0f} s")
    for device, values in rss.items():
        print(f"  {device} RSS MiB after each recovery: {values}")
    for device, values in memory.items():
        print(f"  {device} at the start of each epoch (epoch, MiB resident, of it MiB kept as snapshots and "
              f"backups): {[tuple(map(int, v)) for v in values]}")
    print("".join(line for line in lines if re.search(r"lost|joined|rolling|could not|stopp", line)))
    assert proc.returncode == 0, log
    assert "Traceback" not in log and "error:" not in log, log
    assert cuts >= min(CUTS, 2) and killed, (faults.events, log)
    assert diff < 1e-9, diff
    # Memory does not grow with the number of re-plans. What a device holds during a step
    # depends on the stage it was given (a device cut off, taken back with the front layers,
    # read 293 then 535 MiB at the last step line, 2026-11-29), so the check reads what each
    # agent logs at the start of every epoch after the first, once its recovery is done: its
    # resident memory less what it keeps as snapshots and backups of the stages it was given.
    # The later half of those readings is held against the earlier half (medians), the short
    # form's few epochs to a fourth, the full form's tens to a tenth.
    # An agent cut off from the run's start reads, until it first trains a stage, the runtime
    # alone (nothing kept: 244 then 336 MiB once it trained, in one CI run): its readings start
    # at the first that keeps a stage's state, the heap of a step held as it is from then on.
    surviving = {device: [float(resident) - float(kept) for epoch, resident, kept in since_first_stage(memory[device])
                          if int(epoch) > 0]
                 for device in rss if device not in killed}
    # An agent cut off for a while misses the epochs planned without it (one read 2 in a loaded
    # CI run): each needs an early and a late reading, and all but one MIN_READINGS.
    assert surviving and all(len(values) >= 2 for values in surviving.values()) and \
        sum(len(values) < MIN_READINGS for values in surviving.values()) <= 1, \
        (f"the memory check needs 2 epochs after a recovery from every surviving agent, {MIN_READINGS} from all but "
         f"one", surviving)
    for device, values in surviving.items():
        half = len(values) // 2
        early, late = statistics.median(values[:half]), statistics.median(values[-half:])
        assert late <= (1.10 if len(values) >= 10 else 1.25) * early, (device, values)
