"""Chaos on the namespace testbed (root): a detached run under seeded faults must end equal to local training.

A seeded schedule of faults, some of them during a recovery, hits a `swarm train --detach` run,
which must end with the weights of the same training on one machine.

    sudo .venv/bin/python bench/chaos.py --seed 1 --faults 6 [--devices 6 --cpu 0.1,0.1,0.2,0.2,0.4,0.6
        --mem 1G] [--strategy auto|dp|pp|tiles|hybrid] [--model yolov2-16 --img-size 64 --batch-size 8
        --microbatches 4 --steps N --backup-every 2] [--coordinator dev5] [--quick] [--json FILE]

One testbed runs on a machine at a time: where others use it too, run this under
`flock /tmp/swarm-testbed.lock ...`.

1. The reference: `swarm train --strategy local` with the run's training flags (float64, seeded),
   on one thread, while the testbed starts.
2. `swarm testbed up` (a fresh one: `down` first), then `swarm train --detach` from dev0. The run's
   coordinator is an agent's `swarm train` process, in that device's namespace and cgroups.
3. The faults. Their kinds and when they fire are drawn from --seed before the run starts
   (`schedule`); the device each one hits is drawn when it fires, from the devices of the plan
   then running (the keys of the newest metrics line), so that it disturbs the run:
     kill              every process of a worker device (its agent) SIGKILLed; some seconds later
                       the device rejoins: its agent started again in its namespace and cgroups,
                       with its state directory (`rejoin`)
     cut               the device's link taken down; healed some seconds later
     stall             the device's agent SIGSTOPped, SIGCONTed 1.5-5 s later (a stall, not a death)
     kill-coordinator  the device of the run's coordinator (its agent and the `swarm train` under
                       it) SIGKILLed; it rejoins some seconds later
   A fault fires once the run has committed its step (when that step was a backup step, during
   the backup), or during a recovery (`recovery`): once the run logs a loss, once it logs its
   re-plan ("rolling back to step", "taking over run"; then the layers migrate), or once it
   commits a replayed step. A fault waits while it would leave half of the devices or fewer up
   (up: not killed, cut or stalled), and a coordinator kill waits for another device of the
   plan to be up (a holder of the run's replica: a run whose holders are all gone with its
   coordinator ends by design, docs/runtime.md).
4. What it prints: each fault and each undo as it happens (seconds since the run was submitted,
   the furthest step committed, the kind, the device, what the run was doing: the recovery
   phase or backup it landed in); each recovery the run logs, and the time from the fault (or
   undo) behind it to the next committed step; at the end, the worst relative difference of the
   final checkpoint's weights from the reference's (per tensor, norm of the difference over the
   norm), and each agent's RSS (psutil) after the first and the last recovery whose plan it was in
   (at the second backup step after it), per role it had there (the stages, shares and backups it
   held: only readings in one role compare).

Exit status: 0 the run finished equal to the reference (within --tolerance); 1 it failed, or
nothing happened for --timeout; 2 it finished with other weights; 3 it finished before every
fault fired.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the agents (and so the runs they coordinate) log every step; the bench process itself never
# discovers anything (mDNS stays on the testbed's bridge: its devices pin swarm0)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "SWARM_PROGRESS_SECONDS": "0",
       "SWARM_INTERFACE": "lo"}
POLL_S = 0.1
KINDS = ("kill", "cut", "stall", "kill-coordinator")
PHASES = ("loss", "re-plan", "replay")  # the moments of a recovery a fault can be aimed at
DISRUPTIVE = ("kill", "cut", "kill-coordinator")  # a fault that brings a recovery (aimed at the plan)
UNDO = {"kill": "rejoin", "kill-coordinator": "rejoin", "cut": "heal", "stall": "cont"}
UNDO_AFTER_S = {"kill": (6.0, 15.0), "kill-coordinator": (6.0, 15.0), "cut": (4.0, 10.0), "stall": (1.5, 5.0)}
UNDO_FLAGS = {"kill": "rejoin_after", "kill-coordinator": "rejoin_after", "cut": "heal_after", "stall": "stall_for"}
NO_PHASE_S = 60.0  # a fault aimed at a recovery phase that has not come by then takes any recovery moment
NO_RECOVERY_S = 120.0  # ... and fires anyway when none has come by then (said so)
PROFILES = "/tmp/swarm-chaos-profiles"  # the devices' profiles, kept between runs (--profiles)

# what the coordinator logs (swarm/execution/launch.py, coordinator.py)
LOSS = re.compile(r"\bis dead\b|the connection to \S+ broke|lost its link to|cannot be reached|could not take its "
                  r"part|taking over run")
REPLAN = re.compile(r"rolling back to step|taking over run")
RECOVERY = re.compile(r"rolling back to step|taking over run|joined: re-planned")
RECOST = re.compile(r"re-planned from step \d+ on the measured speeds")  # a re-plan, not a recovery
# what an agent logs about the run's coordinators (swarm/agent/agent.py)
AGENT_NEWS = re.compile(r"election|fenced|orphan|cannot take over|job failed|coordinating detached run")


# -- the schedule ---------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str                  # one of KINDS
    step: int | None           # fires once this step is committed; None: during a recovery
    phase: str | None          # with step None: the recovery moment it is aimed at (PHASES)
    undo_after_s: float        # the rejoin, heal or SIGCONT comes this long after it fired
    # filled in when it fires
    device: str | None = None
    fired_at: float | None = None
    fired_step: int | None = None
    during: str = ""           # what the run was doing then
    next_commit_s: float | None = None   # from the fault to the next committed step
    note: str = ""


def schedule(seed: int, faults: int, steps: int, undo_after: dict | None = None) -> list[Fault]:
    """The seeded faults of a run of `steps` steps: at least one kill of the coordinator's device
    and (with two or more) at least one aimed at a recovery, right after a fault that brings
    one. Faults at steps come in order, spread over the run, none in its last four steps.
    `undo_after`: {kind: (least, most) seconds} to undo each kind after (UNDO_AFTER_S)."""
    undo_after = {**UNDO_AFTER_S, **(undo_after or {})}
    rng = random.Random(seed)
    kinds = [rng.choices(KINDS, weights=(4, 3, 2, 2))[0] for _ in range(faults)]
    if "kill-coordinator" not in kinds:
        kinds[rng.randrange(faults)] = "kill-coordinator"
    during = [False] * faults
    if faults >= 2:
        first = rng.randrange(1, faults)
        during[first] = True
        for i in range(1, faults):
            if i != first and rng.random() < 0.2:
                during[i] = True
        for i in range(1, faults):
            if during[i] and kinds[i - 1] not in DISRUPTIVE:
                kinds[i - 1] = rng.choice(("kill", "cut"))
        if "kill-coordinator" not in kinds:  # the fix above took it: put it back where nothing follows on it
            free = [i for i in range(faults) if i + 1 == faults or not during[i + 1]]
            kinds[rng.choice(free)] = "kill-coordinator"
    at_steps = sum(not d for d in during)
    lo, hi = 3, max(4, steps - 5)
    candidates = list(range(lo, hi + 1))
    picked = sorted(rng.sample(candidates, min(at_steps, len(candidates))))
    while len(picked) < at_steps:
        picked.append(picked[-1] if picked else lo)
    out, it = [], iter(picked)
    for kind, d in zip(kinds, during):
        low, high = undo_after[kind]
        undo = round(rng.uniform(low, high), 1)
        out.append(Fault(kind, None, rng.choice(PHASES), undo) if d else Fault(kind, next(it), None, undo))
    return out


# -- the testbed's devices --------------------------------------------------------------------

def swarm(*args, check=True, timeout=300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "swarm", *map(str, args)], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    if check and r.returncode:
        sys.exit(f"swarm {' '.join(map(str, args))} failed:\n{r.stdout}{r.stderr}")
    return r


class Bed:
    """The testbed's devices and what the bench does to them."""

    def __init__(self):
        from swarm.testbed import testbed

        self.testbed = testbed
        self.record = testbed.require()
        self.names = [d.name for d in self.record.devices]
        self.restarted: list[subprocess.Popen] = []

    def device(self, name: str):
        return self.record.device(name)

    def processes(self, name: str) -> set[int]:
        """Every process in the device's cgroups (its agent, a coordinator it started)."""
        pids: set[int] = set()
        for directory in self.device(name).cgroups:
            try:
                pids |= {int(x) for x in (Path(directory) / "cgroup.procs").read_text().split()}
            except OSError:
                continue
        return pids | ({self.device(name).pid} if self.testbed._alive(self.device(name).pid) else set())

    def kill(self, name: str) -> None:
        for pid in self.processes(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, name: str) -> None:
        self.testbed.cut(name)

    def heal(self, name: str) -> None:
        self.testbed.heal(name)

    def stop(self, name: str) -> None:
        os.kill(self.device(name).pid, signal.SIGSTOP)

    def cont(self, name: str) -> None:
        os.kill(self.device(name).pid, signal.SIGCONT)

    def rejoin(self, name: str) -> None:
        """Start the device's agent again as `swarm testbed up` did (its namespace, cgroups, state
        directory and log), and record its new pid in the testbed's record."""
        from swarm.testbed import netns
        from swarm.testbed.names import DEVICE_INTERFACE, state_dir

        device = self.device(name)
        if self.testbed._alive(device.pid):
            raise RuntimeError(f"the agent of {name} (pid {device.pid}) is running")
        cmd = netns.in_namespace(device.namespace) + self.testbed._agent_command(
            name, state_dir(), DEVICE_INTERFACE, device.port, None)
        with open(device.log, "ab") as log:
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=self.testbed._environment({}))
        from swarm.testbed import cgroups

        if device.cgroups:
            cgroups.add_process([Path(c) for c in device.cgroups], process.pid)
        device.pid = process.pid
        self.testbed._save(self.record)
        self.restarted.append(process)

    def agent_pids(self) -> dict[str, int]:
        return {d.name: d.pid for d in self.record.devices if self.testbed._alive(d.pid)}

    def reap(self) -> None:
        for p in self.restarted:
            p.poll()


def rss_growth(rss: dict[str, list[tuple[int, float, float, str]]]) -> dict[str, float]:
    """Print each agent's RSS at its first and last recovery, per role it had in the plans
    (what it holds: stages, shares, backups; the metrics' "roles"), and return the growth
    from first to last of each (agent, role) read twice or more. A device's RSS follows
    what its plan has it hold (on the mixed testbed one agent read 331-456 MiB over nine
    recoveries, its role changing), so only readings in the same role compare: a leak shows
    as growth within one."""
    print("== agents' RSS at their first and last recovery in each role (MiB; read at the second backup step after "
          "each recovery, for the agents of its plan; an agent started again is another pid)")
    growth = {}
    for device, readings in sorted(rss.items()):
        by_role: dict[tuple[int, str], list] = {}
        for pid, when, mib, role in readings:
            by_role.setdefault((pid, role), []).append((when, mib))
        for (pid, role), values in by_role.items():
            first, last = values[0][1], values[-1][1]
            if len(values) >= 2:
                growth[f"{device}/{pid} ({role})"] = last / first - 1
            print(f"  {device} (pid {pid}) as {role}: {first:.0f} at {values[0][0]:.0f} s, {last:.0f} at "
                  f"{values[-1][0]:.0f} s ({len(values)} recoveries, {100 * (last / first - 1):+.1f}%)")
    return growth


# An agent's RSS is read at the second backup step after a recovery: by then the first
# backup of the new plan is complete and each device keeps only what that plan has it keep
# (DeviceStore.keep_only). Read at the recovery's first step, it still held the snapshots of
# its role before (an agent back from holding the whole network read 491 MiB where it had
# read 386 in the same role before).
RSS_AFTER_BACKUPS = 2


def rss_mib(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


# -- following the run ------------------------------------------------------------------------

@dataclass
class Term:
    """One coordinator's folder of the run (runs/JOB on a device), read as it grows."""
    device: str
    folder: Path
    term: int = -1
    log_at: int = 0
    log_inode: int = 0
    log_rest: bytes = b""
    metrics_at: int = 0
    metrics_inode: int = 0
    exit: dict | None = None
    lines: list[str] = field(default_factory=list)


def read_new(path: Path, at: int, inode: int) -> tuple[bytes, int, int]:
    """(bytes added since `at`, new offset, inode): from the start when the file was replaced."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_ino != inode or st.st_size < at:
                at = 0
            f.seek(at)
            data = f.read()
            return data, at + len(data), st.st_ino
    except OSError:
        return b"", at, inode


class Watch:
    """The run's folders on every device, and the agents' logs: what is new since the last poll,
    as (kind, device, term, payload) with kind "line" (a log line of a coordinator), "commit"
    (a metrics line), "exit" (exit.json) or "agent" (an agent's line about coordinators)."""

    def __init__(self, bed: Bed, job: str):
        self.bed, self.job = bed, job
        self.terms: dict[str, Term] = {}
        self.agent_at: dict[str, tuple[int, int]] = {}  # device -> (offset, inode) in its agent's log
        for d in bed.record.devices:
            try:
                st = os.stat(d.log)
                self.agent_at[d.name] = (st.st_size, st.st_ino)
            except OSError:
                self.agent_at[d.name] = (0, 0)

    def poll(self) -> list[tuple]:
        events = []
        for d in self.bed.record.devices:
            folder = Path(d.state_dir) / "runs" / self.job
            if d.name not in self.terms and (folder / "run.json").exists():
                self.terms[d.name] = Term(d.name, folder)
            t = self.terms.get(d.name)
            if t is not None:
                events += self._poll_term(t)
            data, at, inode = read_new(Path(d.log), *self.agent_at[d.name])
            data = data.decode("utf-8", "replace")
            if data and not data.endswith("\n"):  # a line being written: read it whole next time
                cut = data.rfind("\n") + 1
                at -= len(data[cut:].encode())
                data = data[:cut]
            self.agent_at[d.name] = (at, inode)
            for line in data.splitlines():
                if AGENT_NEWS.search(line):
                    events.append(("agent", d.name, None, line))
        return events

    def _poll_term(self, t: Term) -> list[tuple]:
        events = []
        try:
            term = json.loads((t.folder / "run.json").read_text()).get("term", 0)
        except (OSError, ValueError):
            term = t.term
        if term != t.term:  # a new term of the run on this device: its folder was made again
            t.term, t.log_at, t.metrics_at, t.exit, t.log_rest = term, 0, 0, None, b""
        data, t.log_at, t.log_inode = read_new(t.folder / "train.log", t.log_at, t.log_inode)
        data = t.log_rest + data
        *whole, t.log_rest = data.split(b"\n")
        for raw in whole:
            line = raw.decode("utf-8", "replace")
            t.lines.append(line)
            events.append(("line", t.device, t.term, line))
        data, t.metrics_at, t.metrics_inode = read_new(t.folder / "metrics.jsonl", t.metrics_at, t.metrics_inode)
        text = data.decode("utf-8", "replace")
        if text and not text.endswith("\n"):
            cut = text.rfind("\n") + 1
            t.metrics_at -= len(text[cut:].encode())
            text = text[:cut]
        for line in text.splitlines():
            try:
                events.append(("commit", t.device, t.term, json.loads(line)))
            except ValueError:
                pass
        if t.exit is None and (t.folder / "exit.json").exists():
            try:
                t.exit = json.loads((t.folder / "exit.json").read_text())
                events.append(("exit", t.device, t.term, t.exit))
            except (OSError, ValueError):
                pass
        return events

    def coordinator_pids(self) -> list[int]:
        """The live `swarm train` processes of this run (an agent's, with --run-id JOB)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if b"--run-id" in args and self.job.encode() in args and state not in ("Z", "X"):
                found.append(int(entry.name))
        return found

    def coordinator(self) -> str | None:
        """The device whose term of the run is the newest still at work (no exit record, and it
        has not logged the error it ends with: a process that gave up takes seconds to exit)."""
        running = [t for t in self.terms.values() if t.exit is None and t.term >= 0
                   and not any(line.startswith("swarm train: error:") for line in t.lines[-3:])]
        return max(running, key=lambda t: t.term).device if running else None


# -- the chaos run ------------------------------------------------------------------------------

@dataclass
class Recovery:
    """A recovery the run logged ("rolling back", "taking over", "joined: re-planned")."""
    at: float
    step: int
    device: str          # the coordinator that logged it
    line: str
    cause: str           # the fault or undo behind it
    cause_at: float
    committed_at: float | None = None
    committed_step: int | None = None


class Chaos:
    """One chaos run: follows the run (Watch), fires the faults and their undos, and notes the
    recoveries, their times and the agents' RSS."""

    def __init__(self, args, bed: Bed, job: str, faults: list[Fault], started: float):
        self.args, self.bed, self.job, self.faults = args, bed, job, faults
        self.watch = Watch(bed, job)
        self.t0 = started
        self.rng = random.Random(args.seed * 7919 + 1)  # the devices faults hit, drawn as they fire
        self.next = 0  # the next fault to fire
        self.armed_at: float | None = None  # when the next fault, aimed at a recovery, began to wait
        self.armed_step = 0  # the furthest step committed then
        self.undos: list[tuple[float, str, str, int]] = []  # (when, action, device, fault index)
        self.down: dict[str, str] = {}  # device -> why it is not up (killed, cut, stalled)
        self.actions: list[tuple[float, str, str, int]] = []  # (when, action, device, fault index) done
        self.furthest = 0
        self.plan_devices: set[str] = set()
        self.state = "starting"  # what the run is doing: a recovery phase, a backup, steps
        self.in_recovery = False
        self.recoveries: list[Recovery] = []
        self.phase_seen: list[tuple[float, str]] = []  # (when, phase) of recovery moments
        self.rss: dict[str, list[tuple[int, float, float, str]]] = {}  # device -> (pid, when, MiB, its role)
        self.roles: dict[str, str] = {}  # device -> what it holds in the plan running (the metrics' "roles")
        self.rss_due = 0  # backup steps until the RSS is read (after a recovery)
        self.agent_lines: list[str] = []
        self.done_term = None
        self.ended: str | None = None  # done / failed / lost / hung
        self.last_news = time.monotonic()
        self.no_coordinator_since: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, what: str) -> None:
        print(f"[{self.now():7.1f} s] step {self.furthest:>3}  {what}", flush=True)

    # ---- events ----
    def handle(self, kind: str, device: str, term, payload) -> None:
        self.last_news = time.monotonic()
        if kind == "line":
            self._line(device, term, payload)
        elif kind == "commit":
            self._commit(device, term, payload)
        elif kind == "exit":
            self.say(f"run {self.job} term {term} on {device} ended: {payload['state']}"
                     f"{(' (' + payload['detail'] + ')') if payload.get('detail') else ''}")
            if payload["state"] == "done":
                self.done_term = self.watch.terms[device]
        elif kind == "agent":
            self.agent_lines.append(f"[{self.now():7.1f} s] {device}: {payload}")
            if re.search(r"election|cannot take over|coordinating detached run", payload):
                self.say(f"  agent {device}: {payload.split(' INFO ')[-1].split(' WARNING ')[-1]}")

    def _line(self, device: str, term: int, line: str) -> None:
        if line.startswith("step ") and "/" in line.split()[1]:
            return  # progress lines: the metrics say the same
        self.say(f"  [{device} t{term}] {line}")
        if LOSS.search(line):
            self.in_recovery, self.state = True, "recovery: loss seen"
            self.phase_seen.append((self.now(), "loss"))
        if REPLAN.search(line):
            self.in_recovery, self.state = True, "recovery: re-planned, layers migrating"
            self.phase_seen.append((self.now(), "re-plan"))
        if RECOVERY.search(line):
            if "joined: re-planned" in line:
                self.state = "re-plan taking in a device that came back, layers migrating"
            last = self.recoveries[-1] if self.recoveries else None
            if last is not None and last.device == device and last.committed_at is None and \
                    "taking over run" in last.line and self.now() - last.at < 2.0:
                last.line += " / " + line  # the take-over's own roll-back: one recovery
            else:
                cause = self._cause(line)
                self.recoveries.append(Recovery(self.now(), self.furthest, device, line, cause[0], cause[1]))
        if RECOST.search(line):
            self.state = "re-costed plan starting, layers migrating"

    def _cause(self, line: str) -> tuple[str, float]:
        """The newest fault (for a loss) or undo (for a device taken in) behind a recovery."""
        wanted = ("rejoin", "heal", "cont") if ("joined" in line or "re-planned from" in line) else \
            ("kill", "cut", "stall", "kill-coordinator")
        for when, action, device, index in reversed(self.actions):
            if action in wanted:
                return f"{action} {device} (fault {index + 1})", when
        return "none of the bench's", self.now()

    def _commit(self, device: str, term: int, m: dict) -> None:
        step = int(m["step"])
        self.furthest = max(self.furthest, step)
        self.plan_devices = set(m.get("utilisation", {})) or self.plan_devices
        self.roles = m.get("roles", self.roles)
        replayed, backup = bool(m.get("replayed")), bool(m.get("backup"))
        if replayed:
            self.phase_seen.append((self.now(), "replay"))
        for f in self.faults[:self.next]:
            if f.next_commit_s is None and f.fired_at is not None:
                f.next_commit_s = round(self.now() - f.fired_at, 1)
        if backup and not replayed and self.rss_due:
            self.rss_due -= 1
            if not self.rss_due:
                self._sample_rss()
        for r in self.recoveries:
            if r.committed_at is None:
                r.committed_at, r.committed_step = self.now(), step
                self.rss_due = RSS_AFTER_BACKUPS
                self.say(f"recovered: {r.line[:70]}... -> step {step} committed {r.committed_at - r.cause_at:.1f} s "
                         f"after {r.cause} ({r.committed_at - r.at:.1f} s after the re-plan)")
        if replayed:
            self.state = f"replaying (step {step} replayed)"
        else:
            self.in_recovery = False
            self.state = f"backup of step {step}" if backup else f"training (step {step} committed)"

    def _sample_rss(self) -> None:
        """Each agent's RSS once a recovery has settled (RSS_AFTER_BACKUPS backup steps after its
        first committed step), for the agents the plan uses: one that is not training (or has
        just started again) holds no job's memory."""
        for name, pid in self.bed.agent_pids().items():
            value = rss_mib(pid) if name in self.plan_devices and name not in self.down else None
            if value is not None:
                self.rss.setdefault(name, []).append((pid, self.now(), round(value, 1), self.roles.get(name, "?")))

    # ---- faults ----
    def up(self) -> list[str]:
        return [n for n in self.bed.names if n not in self.down]

    def may_take_down(self) -> bool:
        """Whether one more device down still leaves more than half of them up."""
        return len(self.up()) - 1 > len(self.bed.names) / 2

    def due(self, f: Fault) -> tuple[bool, str]:
        """Whether fault `f` fires now, and why it fires (its trigger)."""
        if f.step is not None:
            return self.furthest >= f.step, f"at step {f.step}"
        if self.armed_at is None:
            self.armed_at, self.armed_step = self.now(), self.furthest
        seen = [p for when, p in self.phase_seen if when >= self.armed_at]
        if f.phase in seen:
            return True, f"aimed at the recovery's {f.phase}"
        if seen and self.furthest > self.armed_step:  # it is over (a replay commits no new step)
            return True, f"aimed at the recovery's {f.phase}; it had none, fired at the first new step after it"
        waited = self.now() - self.armed_at
        if waited > NO_PHASE_S and seen:
            return True, f"aimed at the recovery's {f.phase}; none came in {NO_PHASE_S:g} s, fired at its {seen[-1]}"
        if waited > NO_RECOVERY_S:
            return True, f"aimed at the recovery's {f.phase}; no recovery came in {NO_RECOVERY_S:g} s"
        return False, ""

    def target(self, f: Fault) -> tuple[str | None, str]:
        """The device fault `f` hits now (None: not yet), and why not when None."""
        coordinator = self.watch.coordinator()
        if not self.may_take_down():
            return None, "it would leave half of the devices or fewer up"
        up = self.up()
        if f.kind == "kill-coordinator":
            if coordinator is None or coordinator in self.down:
                return None, "no coordinator at work"
            pool = [coordinator]
        else:
            others = [d for d in up if d != coordinator] if f.kind == "kill" else up
            pool = sorted(d for d in others if d in self.plan_devices) or sorted(others)
        pool = [d for d in pool if self.keeps_a_coordinator(d, f.kind, coordinator)]
        if not pool:
            return None, "it would leave neither the coordinator nor another device of the plan (a replica holder) up"
        return self.rng.choice(pool), ""

    def keeps_a_coordinator(self, device: str, kind: str, coordinator: str | None) -> bool:
        """Whether, with `device` down too, the run keeps its coordinator, or a device of its plan
        besides the coordinator's (a holder of its replica, which can elect a successor). A stall
        stops the agent only: a coordinator the device runs goes on."""
        if kind == "stall":
            return True
        lost = coordinator is None or device == coordinator or self.down.get(coordinator) in DISRUPTIVE
        holders = self.plan_devices - {coordinator, device} - set(self.down)
        return not lost or bool(holders)

    def fire(self, f: Fault, index: int, device: str, why: str) -> None:
        during = self.state
        action = {"kill": self.bed.kill, "kill-coordinator": self.bed.kill, "cut": self.bed.cut,
                  "stall": self.bed.stop}[f.kind]
        action(device)
        f.device, f.fired_at, f.fired_step, f.during, f.note = device, self.now(), self.furthest, during, why
        self.down[device] = f.kind
        self.actions.append((self.now(), f.kind, device, index))
        self.undos.append((self.now() + f.undo_after_s, UNDO[f.kind], device, index))
        if f.kind == "kill-coordinator":
            self.in_recovery, self.state = True, "recovery: coordinator lost, election"
        self.say(f"FAULT {index + 1}/{len(self.faults)}: {f.kind} {device} ({why}; during: {during}; "
                 f"undo in {f.undo_after_s:g} s)")

    def undo_due(self) -> None:
        for item in sorted(self.undos):
            when, action, device, index = item
            if when > self.now():
                continue
            self.undos.remove(item)
            {"rejoin": self.bed.rejoin, "heal": self.bed.heal, "cont": self.bed.cont}[action](device)
            self.down.pop(device, None)
            self.actions.append((self.now(), action, device, index))
            self.say(f"undo of fault {index + 1}: {action} {device} (during: {self.state})")

    def step_faults(self) -> None:
        if self.next >= len(self.faults) or self.ended:
            return
        f = self.faults[self.next]
        fire, why = self.due(f)
        if not fire:
            return
        device, not_yet = self.target(f)
        if device is None:
            if f.note != not_yet:
                f.note = not_yet
                self.say(f"fault {self.next + 1} ({f.kind}) waits: {not_yet}")
            return
        self.fire(f, self.next, device, why)
        self.next += 1
        self.armed_at, self.armed_step = self.now(), self.furthest  # a next fault aimed at a recovery: the one this fault brings

    # ---- the loop ----
    def run(self) -> None:
        deadline_news = self.args.timeout
        while True:
            for event in self.watch.poll():
                self.handle(*event)
            self.undo_due()
            self.step_faults()
            self.bed.reap()
            if self.done_term is not None:
                self.ended = "done"
                return
            if not self.watch.coordinator_pids():
                if self.no_coordinator_since is None:
                    self.no_coordinator_since = time.monotonic()
                elif time.monotonic() - self.no_coordinator_since > self.args.lost_after:
                    self.ended = "lost"
                    self.say(f"no coordinator of run {self.job} for {self.args.lost_after:g} s, and no term done")
                    return
            else:
                self.no_coordinator_since = None
            if time.monotonic() - self.last_news > deadline_news:
                self.ended = "hung"
                self.say(f"nothing new from the run for {deadline_news:g} s")
                return
            time.sleep(POLL_S)

    def restore_all(self) -> None:
        """Undo what is still undone (a cut link, a stopped agent), so the devices can be read."""
        for _, action, device, _ in sorted(self.undos):
            try:
                {"rejoin": lambda d: None, "heal": self.bed.heal, "cont": self.bed.cont}[action](device)
            except Exception:  # noqa: BLE001 (best effort at the end)
                pass


# -- the reference and the comparison ------------------------------------------------------------

def worst_difference(a: dict, b: dict) -> float:
    """The largest relative difference (norm of the difference over the norm) of a tensor of
    `a` from the same one in `b`; integer tensors must be equal (inf if not)."""
    import torch

    out = 0.0
    for k, v in b.items():
        if k not in a:
            return float("inf")
        if v.is_floating_point():
            out = max(out, float((a[k] - v).norm() / v.norm().clamp(min=1e-30)))
        elif not torch.equal(a[k], v):
            return float("inf")
    return out


class Reference(threading.Thread):
    """`swarm train --strategy local` with the run's training flags, on one thread, in the background."""

    def __init__(self, flags: list[str], path: Path):
        super().__init__(daemon=True)
        self.flags, self.path = flags, path
        self.result: subprocess.CompletedProcess | None = None

    def run(self) -> None:
        self.result = subprocess.run([sys.executable, "-m", "swarm", "train", "--strategy", "local", *self.flags,
                                      "--threads", "1", "--save", str(self.path)], capture_output=True, text=True,
                                     env=ENV, timeout=1800)

    def weights(self) -> dict:
        import torch

        self.join()
        if self.result.returncode:
            sys.exit(f"the reference run failed:\n{self.result.stderr}")
        return torch.load(self.path, weights_only=True)["model"]


# -- the command line -------------------------------------------------------------------------------

def seconds_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not MIN,MAX in seconds, e.g. 6,15") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"'{text}': give 0 <= MIN <= MAX")
    return low, high


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--seed", type=int, required=True, help="draws the faults (and the training's seed)")
    p.add_argument("--faults", type=int, default=6, help="how many faults (default 6)")
    p.add_argument("--quick", action="store_true", help="a short run for the test suite: 3 faults (one aimed at a "
                   "recovery, one the coordinator's device) on 5 devices of 0.3 core, a pipeline at 32 px")
    p.add_argument("--devices", type=int, default=6)
    p.add_argument("--cpu", default="0.1,0.1,0.2,0.2,0.4,0.6", help="cores per device, or one each")
    p.add_argument("--mem", default="1G", help="memory per device, or one each")
    p.add_argument("--bandwidth", default=None, help="link cap per device (tc), e.g. 100mbit (default: none)")
    p.add_argument("--strategy", default="auto", choices=("auto", "dp", "pp", "tiles", "hybrid"))
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, help="training steps (default: 10 + 5 per fault)")
    p.add_argument("--backup-every", default="2", help="the run's --backup-every (default 2)")
    p.add_argument("--coordinator", default="dev5", help="the agent that coordinates the run first (default dev5, "
                   "the fastest of the mixed testbed; 'swarm' leaves it to `swarm train --detach`)")
    for flag, kind, what in (("--rejoin-after", "kill", "a killed device's agent starts again"),
                             ("--heal-after", "cut", "a cut link is healed"),
                             ("--stall-for", "stall", "a stopped agent is continued")):
        low, high = UNDO_AFTER_S[kind]
        p.add_argument(flag, type=seconds_range, default=(low, high), metavar="MIN,MAX",
                       help=f"{what} this many seconds after the fault, drawn (default {low:g},{high:g})")
    p.add_argument("--extra", default="", help="more `swarm train` flags for the run and the reference, e.g. "
                   "'--recovery light' (space-separated)")
    p.add_argument("--tolerance", type=float, default=1e-7, help="largest relative difference from the reference")
    p.add_argument("--profiles", default=PROFILES, help="where the devices' profiles are kept between runs and "
                   "given to the next run's devices, as on a swarm whose devices profiled before (a profile is per "
                   f"CPU quota, model and image size; default {PROFILES}; 'none': every run profiles afresh)")
    p.add_argument("--timeout", type=float, default=240, help="give up after this many seconds without news from "
                   "the run: no line logged, no step committed (default 240; the run's own wait is 600 s)")
    p.add_argument("--lost-after", type=float, default=60, help="the run is lost when no coordinator process of it "
                   "has run for this many seconds and none finished it (default 60: an election and a successor's "
                   "start take 10-30 s here)")
    p.add_argument("--json", metavar="FILE", help="also write what happened here")
    p.add_argument("--keep", action="store_true", help="leave the testbed up at the end")
    args = p.parse_args(argv)
    if args.quick:
        quick = {"faults": 3, "devices": 5, "cpu": "0.3", "strategy": "pp", "img_size": 32, "batch_size": 4,
                 "microbatches": 2, "coordinator": "dev4"}
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if args.faults < 1:
        p.error("--faults must be at least 1")
    args.steps = args.steps or 10 + 5 * args.faults
    if args.steps < 12:
        p.error("--steps must be at least 12: faults come at steps 3 and up, none in the last four")
    return args


def training_flags(args) -> list[str]:
    return ["--model", args.model, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size),
            "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--seed", str(args.seed),
            "--dtype", "float64", "--no-eval", *args.extra.split()]


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    faults = schedule(args.seed, args.faults, args.steps,
                      {kind: getattr(args, flag) for kind, flag in UNDO_FLAGS.items()})
    print(f"chaos: seed {args.seed}, {args.faults} faults over {args.steps} steps of {args.model} at "
          f"{args.img_size} px (batch {args.batch_size} in {args.microbatches}, float64), --strategy "
          f"{args.strategy}, {args.devices} devices (cpu {args.cpu}, mem {args.mem})", flush=True)
    for i, f in enumerate(faults):
        when = f"at step {f.step}" if f.step is not None else f"during a recovery ({f.phase})"
        print(f"  fault {i + 1}: {f.kind:16} {when:28} undone after {f.undo_after_s:g} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="swarm-chaos-"))
    reference = Reference(training_flags(args), work / "local.pt")
    reference.start()
    in_use = testbed_in_use()
    if in_use:
        sys.exit(f"a testbed is in use on this machine (agents {in_use} alive): wait for it, or `swarm testbed down` "
                 f"if it is yours")
    swarm("testbed", "down", check=False)  # whatever an earlier run left, its agents gone
    up = ["testbed", "up", "--devices", args.devices, "--cpu", args.cpu, "--mem", args.mem]
    swarm(*up, *(["--bandwidth", args.bandwidth] if args.bandwidth else []))
    chaos = None
    try:
        bed = Bed()
        profiles_in(bed, args.profiles)
        peers = bed.record.peers()
        where = [] if args.coordinator == "swarm" else ["--coordinator", args.coordinator]
        started = time.monotonic()
        r = swarm("testbed", "exec", "dev0", "--", "swarm", "train", "--detach", *where, *training_flags(args),
                  "--strategy", args.strategy, "--devices", args.devices, "--wait", "60", "--backup-every",
                  args.backup_every, "--peers", peers)
        job = r.stdout.strip()
        if not job:
            sys.exit(f"the run was not submitted:\n{r.stdout}{r.stderr}")
        print(f"[{time.monotonic() - started:7.1f} s] run {job} submitted: {r.stderr.strip()}", flush=True)
        chaos = Chaos(args, bed, job, faults, started)
        try:
            chaos.run()
        finally:
            chaos.restore_all()
            profiles_out(bed, args.profiles)
            keep_evidence(bed, job, work)
        return report(args, chaos, reference, work)
    finally:
        if not args.keep:
            swarm("testbed", "down", check=False)


def testbed_in_use() -> list[int]:
    """The live agents of a testbed on this machine (another user's, or one left running)."""
    from swarm.errors import SwarmError
    from swarm.testbed import testbed

    try:
        record = testbed.load()
    except SwarmError:
        return []  # unreadable: nothing can use it; `down` clears it
    return [d.pid for d in record.devices if testbed._alive(d.pid)] if record else []


def profiles_in(bed: Bed, store: str) -> None:
    """Give every device the profiles kept in `store` (each device reads those of its own
    fingerprint: its CPU, quota, threads and torch)."""
    import shutil

    if store == "none" or not (Path(store) / "profiles").is_dir():
        return
    for d in bed.record.devices:
        shutil.copytree(Path(store) / "profiles", Path(d.state_dir) / "profiles", dirs_exist_ok=True)


def profiles_out(bed: Bed, store: str) -> None:
    import shutil

    if store == "none":
        return
    for d in bed.record.devices:
        if (Path(d.state_dir) / "profiles").is_dir():
            shutil.copytree(Path(d.state_dir) / "profiles", Path(store) / "profiles", dirs_exist_ok=True)


def keep_evidence(bed: Bed, job: str, work: Path) -> None:
    """The agents' logs and the run's folders (without checkpoints) into `work`, before `down`."""
    import shutil

    for d in bed.record.devices:
        out = work / d.name
        out.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy(d.log, out / "agent.log")
            folder = Path(d.state_dir) / "runs" / job
            if folder.is_dir():
                shutil.copytree(folder, out / "run", ignore=shutil.ignore_patterns("*.pt"), dirs_exist_ok=True)
        except OSError:
            pass


def report(args, chaos: Chaos, reference: Reference, work: Path) -> int:
    print("\n== faults")
    for i, f in enumerate(chaos.faults):
        if f.fired_at is None:
            print(f"  {i + 1}. {f.kind}: never fired ({f.note or 'the run ended first'})")
            continue
        print(f"  {i + 1}. {f.fired_at:7.1f} s  step {f.fired_step:>3}  {f.kind:16} {f.device}  ({f.note}; during: "
              f"{f.during}); next committed step {f.next_commit_s if f.next_commit_s is not None else '-'} s later")
    print("== recoveries (from the fault or undo behind it to the next committed step)")
    for r in chaos.recoveries:
        took = f"{r.committed_at - r.cause_at:.1f} s" if r.committed_at is not None else "never committed"
        print(f"  {r.at:7.1f} s  [{r.device}] {r.line}\n             after {r.cause}: {took}")
    growth = rss_growth(chaos.rss)
    over = {k: v for k, v in growth.items() if v > 0.10}
    if over:
        print(f"  grew more than 10% in one role: {', '.join(f'{k} {100 * v:+.1f}%' for k, v in over.items())}")
    if chaos.agent_lines:
        print("== the agents on the run's coordinators")
        for line in chaos.agent_lines[-40:]:
            print("  " + line)
    difference, code = None, 1
    if chaos.ended == "done":
        import torch

        saved = torch.load(chaos.done_term.folder / "checkpoint.pt", weights_only=True)
        difference = worst_difference(saved["model"], reference.weights())
        same = saved["step"] == args.steps and difference <= args.tolerance
        code = 0 if same else 2
        if code == 0 and chaos.next < len(chaos.faults):
            code = 3
        print(f"== the run finished at step {saved['step']} of {args.steps} (term {chaos.done_term.term} on "
              f"{chaos.done_term.device}); worst relative difference from local training {difference:.3g} "
              f"({'equal' if same else 'DIFFERENT'} at {args.tolerance:g})")
    else:
        print(f"== the run did not finish: {chaos.ended}")
        for t in sorted(chaos.watch.terms.values(), key=lambda t: t.term):
            print(f"-- term {t.term} on {t.device} ({t.exit or 'no exit record'}), its log's last lines:")
            for line in [x for x in t.lines if not x.startswith("step ")][-25:]:
                print("   " + line)
    if code == 3:
        print(f"== {len(chaos.faults) - chaos.next} fault(s) never fired: the run ended first")
    summary = {"seed": args.seed, "ended": chaos.ended, "exit": code, "difference": difference,
               "faults": [asdict(f) for f in chaos.faults],
               "recoveries": [asdict(r) for r in chaos.recoveries], "rss": chaos.rss,
               "terms": [{"device": t.device, "term": t.term, "exit": t.exit,
                          "log": [x for x in t.lines if not x.startswith("step ")][-25:]}
                         for t in sorted(chaos.watch.terms.values(), key=lambda t: t.term)],
               "wall_s": round(chaos.now(), 1)}
    if code == 0:  # the run equalled the reference: its 50-odd MB of weights tell nothing more
        reference.path.unlink(missing_ok=True)
    print(f"== the agents' logs and the run's folders: {work}")
    print(f"== {'PASS' if code == 0 else 'FAIL'} seed {args.seed}: {chaos.ended}, {chaos.next} of "
          f"{len(chaos.faults)} faults, {len(chaos.recoveries)} recoveries, {chaos.now():.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
