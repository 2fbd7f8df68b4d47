"""Detached training runs an agent coordinates: one `swarm train` process per run, in a folder
of the agent's state directory holding its flags, log, metrics and latest checkpoint.

    runs = DetachedRuns(state_dir / "runs", "pi-3", check_flags, command_for)
    record = runs.submit(["--model", "lenet5", "--steps", "50"])   # SwarmError says why not
    await runs.watch(record)                  # in the agent's nursery: until the process ends
    runs.describe()                           # one dict per run, newest first (`swarm jobs`)
    runs.stop(job_id)                         # SIGINT: it stops after its step, with a checkpoint
    runs.read(job_id, "log", offset)          # (version, total, bytes) of its log or checkpoint

A run's process lives no longer than its agent (it is killed when the agent dies): a run is
coordinated by its agent's device, and losing that device loses the run's coordinator like
any other part of it. A folder with no exit record, found when the agent starts, is a run
whose agent ended while it ran: "lost".
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from swarm.errors import SwarmError
from swarm.limits import DETACH_ARG_CHARS, DETACH_ARGS, DETACH_CHUNK, DETACHED_KEPT, DETACHED_RUNNING

FILES = {"log": "train.log", "checkpoint": "checkpoint.pt"}
POLL_S = 0.2  # how often a running process is asked whether it ended
STOP_WAIT_S = 15.0  # an agent that stops gives its runs this long to stop with a checkpoint
PROGRESS = re.compile(rb"step (\d+)/(\d+) ")


@dataclass
class DetachedRun:
    job_id: str
    folder: Path
    args: list[str]
    model: str
    steps: int | None  # as asked (None: --epochs, known once the run says)
    started: float
    term: int = 0  # the coordinator's term (swarm/agent/failover.py): 1 and up for a successor
    state: str = "running"  # running, done, failed, stopped, lost
    detail: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)
    stop_asked: bool = False


class DetachedRuns:
    """The runs of one agent. `check_flags(args)` parses a submitted run's `swarm train` flags
    (SwarmError if it may not run); `command_for(run)` is the (argv, environment) that starts it."""

    def __init__(self, root: Path, node_name: str, check_flags, command_for, kept: int = DETACHED_KEPT,
                 running: int = DETACHED_RUNNING):
        self.root = root
        self.node_name = node_name
        self.check_flags = check_flags
        self.command_for = command_for
        self.kept = kept
        self.running_limit = running
        self.runs: dict[str, DetachedRun] = {}
        self._load()

    def _load(self) -> None:
        if not self.root.is_dir():
            return
        for folder in self.root.iterdir():
            try:
                meta = json.loads((folder / "run.json").read_text())
                run = DetachedRun(folder.name, folder, meta["args"], meta["model"], meta["steps"], meta["started"],
                                  meta.get("term", 0))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            try:
                ended = json.loads((folder / "exit.json").read_text())
                run.state, run.detail = ended["state"], ended["detail"]
            except (OSError, ValueError, KeyError):
                run.state, run.detail = "lost", "its agent ended while it ran"
            self.runs[run.job_id] = run

    def running(self) -> list[DetachedRun]:
        return [r for r in self.runs.values() if r.state == "running"]

    # -- starting and ending ------------------------------------------------------------

    def submit(self, args: list[str]) -> DetachedRun:
        """Start a run of `swarm train` flags `args` in a new folder; SwarmError says why not."""
        if len(args) > DETACH_ARGS or any(len(a) > DETACH_ARG_CHARS for a in args):
            raise SwarmError(f"a run takes at most {DETACH_ARGS} flags of {DETACH_ARG_CHARS} characters")
        parsed = self.check_flags(args)
        if len(self.running()) >= self.running_limit:
            raise SwarmError(f"{self.node_name} already coordinates {self.running_limit} runs; stop one or choose "
                             f"another --coordinator")
        self._forget_old()
        job_id = secrets.token_hex(3)
        while job_id in self.runs:
            job_id = secrets.token_hex(3)
        return self._start(DetachedRun(job_id, self.root / job_id, list(args), parsed.model or "yolov2-16",
                                       parsed.steps, time.time()))

    def take_over(self, replica) -> DetachedRun:
        """Start the successor of a run whose coordinator was lost, from its replica
        (swarm/agent/failover.py): the same run id, the next term."""
        parsed = self.check_flags(replica.flags)
        old = self.runs.get(replica.run_id)
        if old is not None:
            if old.state == "running":
                raise SwarmError(f"run {replica.run_id} is running here already")
            shutil.rmtree(old.folder, ignore_errors=True)  # a term of it this agent coordinated before
        self._forget_old()
        run = DetachedRun(replica.run_id, self.root / replica.run_id, list(replica.flags), parsed.model or "yolov2-16",
                          parsed.steps, time.time(), replica.next_term)
        run.folder.mkdir(parents=True)
        (run.folder / "replica.json").write_text(json.dumps(replica.to_body()))
        return self._start(run)

    def _start(self, run: DetachedRun) -> DetachedRun:
        run.folder.mkdir(parents=True, exist_ok=True)
        (run.folder / "run.json").write_text(json.dumps({"args": run.args, "model": run.model, "steps": run.steps,
                                                         "started": run.started, "term": run.term}))
        argv, env = self.command_for(run)
        with open(run.folder / FILES["log"], "ab") as log:
            run.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                           cwd=run.folder, preexec_fn=_in_the_run_process)
        self.runs[run.job_id] = run
        return run

    def _forget_old(self) -> None:
        ended = sorted((r for r in self.runs.values() if r.state != "running"), key=lambda r: r.started)
        while ended and len(self.runs) >= self.kept:
            old = ended.pop(0)
            shutil.rmtree(old.folder, ignore_errors=True)
            del self.runs[old.job_id]

    async def watch(self, run: DetachedRun) -> None:
        """Wait for the run's process to end and record how it ended. Cancelled (the agent
        stops): the run is asked to stop, and has STOP_WAIT_S to do so with a checkpoint."""
        try:
            while run.process.poll() is None:
                await trio.sleep(POLL_S)
        finally:
            if run.process.poll() is None:
                run.stop_asked = True
                run.process.send_signal(signal.SIGINT)
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(STOP_WAIT_S):
                        while run.process.poll() is None:
                            await trio.sleep(POLL_S)
                    if run.process.poll() is None:
                        run.process.kill()
                        run.process.wait()
            self._ended(run, run.process.returncode)

    def _ended(self, run: DetachedRun, code: int) -> None:
        if code == 0:
            run.state, run.detail = "done", ""
        elif run.stop_asked:
            # Asked to stop, it stopped. A run interrupted while its interpreter was still
            # starting ends with status 1 and a KeyboardInterrupt traceback rather than 130;
            # any other error on the way out is kept as the detail.
            last = _tail(run.folder / FILES["log"], 256).decode("utf-8", "replace").strip().rsplit("\n", 1)[-1]
            interrupted = code in (130, -signal.SIGINT) or last == "KeyboardInterrupt"
            run.state, run.detail = "stopped", "" if interrupted else self._last_error(run)
        else:
            run.state, run.detail = "failed", self._last_error(run) or f"exit status {code}"
        (run.folder / "exit.json").write_text(json.dumps({"state": run.state, "detail": run.detail, "code": code}))

    def _last_error(self, run: DetachedRun) -> str:
        lines = _tail(run.folder / FILES["log"], 4096).decode("utf-8", "replace").splitlines()
        errors = [line for line in lines if "error:" in line or line.startswith("Traceback")]
        return (errors or lines or [""])[-1].strip()[:300]

    def stop(self, job_id: str) -> DetachedRun:
        run = self.get(job_id)
        if run.state == "running" and not run.stop_asked:
            run.stop_asked = True
            run.process.send_signal(signal.SIGINT)
        return run

    # -- reading --------------------------------------------------------------------------

    def get(self, job_id: str) -> DetachedRun:
        run = self.runs.get(job_id)
        if run is None:
            raise SwarmError(f"no run {job_id[:40]} here")
        return run

    def describe(self, job_id: str | None = None) -> list[dict]:
        """One dict per run (or the one asked), newest first: what `swarm jobs` lists."""
        runs = [self.get(job_id)] if job_id else sorted(self.runs.values(), key=lambda r: -r.started)
        return [self._describe(r) for r in runs]

    def _describe(self, run: DetachedRun) -> dict:
        latest: dict = {}
        tail = _tail(run.folder / "metrics.jsonl", 4096).splitlines()
        for line in reversed(tail):
            try:
                latest = json.loads(line)
                break
            except ValueError:
                continue  # the first, cut, line of the tail, or one being written
        steps = run.steps
        said = PROGRESS.findall(_tail(run.folder / FILES["log"], 4096))
        if said:
            steps = int(said[-1][1])
        return {"id": run.job_id, "model": run.model, "step": int(latest.get("step", 0)), "steps": steps,
                "samples_per_s": float(latest.get("samples_per_s", 0.0)), "devices": int(latest.get("devices", 1)),
                "state": run.state + (" (stopping)" if run.stop_asked and run.state == "running" else ""),
                "node": self.node_name, "detail": run.detail, "started": run.started, "term": run.term}

    def read(self, job_id: str, what: str, offset: int) -> tuple[str, int, bytes]:
        """(version, total bytes, up to DETACH_CHUNK bytes from `offset`) of the run's log or
        checkpoint. A checkpoint is replaced whole (atomically): its version is the file's
        identity, and a reader that sees it change starts again."""
        run = self.get(job_id)
        if what not in FILES:
            raise SwarmError(f"a run has a log and a checkpoint, not '{what[:40]}'")
        if offset < 0:
            raise SwarmError("a negative offset")
        try:
            with open(run.folder / FILES[what], "rb") as f:
                st = os.fstat(f.fileno())
                f.seek(offset)
                data = f.read(DETACH_CHUNK)
        except FileNotFoundError:
            if what == "log":
                return "", 0, b""
            raise SwarmError(f"run {job_id} has no checkpoint yet (one is written every 25 steps and at the end)") \
                from None
        return f"{st.st_ino}-{st.st_mtime_ns}", st.st_size, data


def _tail(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read(size)
    except OSError:
        return b""


def _in_the_run_process() -> None:
    """In the run's process before it starts: SIGINT back to its default, since `swarm stop`
    stops a run with it and an agent started in the background by a script has it ignored,
    which the run would inherit; and die with the agent (Linux; elsewhere it outlives a
    killed agent and is found "lost" by the next one)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal(signal.SIGINT, 0)  # SIG_DFL, through libc: this is a child of any thread
    if sys.platform.startswith("linux"):
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
