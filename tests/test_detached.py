"""Detached runs without the testbed: the flags an agent accepts, a run's life as its agent
sees it (with a stand-in for `swarm train`), the requests over the wire, and the commands'
one-line errors."""
from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import trio

from swarm.agent import Agent, AgentConfig
from swarm.agent.detached import DetachedRuns
from swarm.cli import build_parser
from swarm.cluster import open_roster
from swarm.commands.jobs_cmd import format_table, least_loaded
from swarm.commands.train_cmd import check_detached_flags, run_flags
from swarm.errors import SwarmError
from swarm.limits import DETACH_ARGS, DETACH_CHUNK
from swarm.net import Credentials, resolve_network
from swarm.wire import DetachList, DetachRead, DetachStop, DetachSubmit, RemoteProtocolError, from_wire, to_wire
from tests.conftest import run_swarm

TOKEN = "test-token-" + "x" * 20

# A stand-in for `swarm train`: logs a progress line and a metrics record per step, then
# ends as the flag after --steps says (or waits, for --steps 1000, until it is interrupted).
STAND_IN = r"""
import json, signal, sys, time
args = sys.argv[1:]
steps = int(args[args.index("--steps") + 1])
metrics = args[args.index("--metrics") + 1]
if "--lr" in args:
    print("swarm train: error: the loss became nan at step 1", file=sys.stderr); sys.exit(2)
if steps >= 999:
    print("waiting", flush=True)
    try: time.sleep(60)
    except KeyboardInterrupt:
        if steps == 999:  # as an interpreter interrupted while it starts: a traceback and status 1
            print("Traceback (most recent call last):\nKeyboardInterrupt", file=sys.stderr); sys.exit(1)
        print("stopped"); sys.exit(130)
for k in range(1, steps + 1):
    print(f"step {k}/{steps} [#] loss 1.0  2.0 samples/s", flush=True)
    open(metrics, "a").write(json.dumps({"step": k, "samples_per_s": 2.0, "devices": 3}) + "\n")
"""


def stand_in(run):
    argv = [sys.executable, "-c", STAND_IN, *run.args, "--metrics", str(run.folder / "metrics.jsonl")]
    return argv, dict(os.environ)


def test_an_agent_takes_the_flags_of_swarm_train_and_no_others():
    parsed = check_detached_flags(["--model", "lenet5", "--steps", "3", "--strategy", "pp"])
    assert (parsed.model, parsed.steps, parsed.strategy) == ("lenet5", 3, "pp")
    for args, says in [(["--steps", "x"], "'x' is not a whole number"), (["--bogus"], "unrecognized arguments"),
                       (["--save", "/etc/passwd"], "--save cannot be given"), (["--help"], "--help is not a run"),
                       (["--state-dir", "/", "--metrics", "m"], "--metrics, --state-dir cannot be given")]:
        with pytest.raises(SwarmError, match=says):
            check_detached_flags(args)


def test_an_agent_parses_no_more_flags_than_it_must(tmp_path):
    runs = DetachedRuns(tmp_path, "pi-3", check_detached_flags, stand_in)
    for args in (["--seed"] * (DETACH_ARGS + 1), ["--data", "x" * 5000]):
        with pytest.raises(SwarmError, match="at most"):
            runs.submit(args)
    assert runs.describe() == []


def test_the_flags_handed_to_a_detached_run_are_the_ones_given():
    args = build_parser().parse_args(["train", "--model", "lenet5", "--steps", "3", "--detach", "--coordinator", "pi",
                                      "--no-eval", "--backup-every", "4", "--lr", "0.01", "--peers", "h:1"])
    flags = run_flags(args)
    assert flags == ["--model", "lenet5", "--steps", "3", "--lr", "0.01", "--backup-every", "4", "--no-eval"]
    again = check_detached_flags(flags)
    assert (again.model, again.steps, again.lr, again.backup_every, again.no_eval) == ("lenet5", 3, 0.01, 4, True)


def test_the_least_loaded_device_coordinates():
    def dev(name, cores, job=None):
        return SimpleNamespace(name=name, node_id=name, cores=cores, memory=1, job_id=job)

    a, b, c = dev("a", 4), dev("b", 8, job="j1"), dev("c", 2)
    assert least_loaded([a, b, c], []) is a  # b is in a job; a has more cores than c
    assert least_loaded([a, b, c], [(a, {"state": "running"})]) is c
    assert least_loaded([a, b, c], [(a, {"state": "done"})]) is a


async def wait_ended(runs, run):
    with trio.fail_after(20):
        await runs.watch(run)


@pytest.mark.trio
async def test_a_run_is_listed_read_and_remembered(tmp_path):
    runs = DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in)
    run = runs.submit(["--model", "lenet5", "--steps", "3"])
    assert runs.describe()[0]["state"] == "running"
    await wait_ended(runs, run)
    (listed,) = runs.describe()
    assert {k: listed[k] for k in ("id", "model", "step", "steps", "samples_per_s", "devices", "state", "node")} == \
        {"id": run.job_id, "model": "lenet5", "step": 3, "steps": 3, "samples_per_s": 2.0, "devices": 3,
         "state": "done", "node": "pi-3"}
    version, total, data = runs.read(run.job_id, "log", 0)
    assert data.decode().splitlines()[-1].startswith("step 3/3") and total == len(data)
    assert runs.read(run.job_id, "log", 10)[2] == data[10:]
    with pytest.raises(SwarmError, match="no checkpoint yet"):
        runs.read(run.job_id, "checkpoint", 0)
    (run.folder / "checkpoint.pt").write_bytes(b"w" * (DETACH_CHUNK + 5))
    version, total, data = runs.read(run.job_id, "checkpoint", 0)
    assert (total, len(data)) == (DETACH_CHUNK + 5, DETACH_CHUNK)
    (run.folder / "checkpoint.pt.new").write_bytes(b"v" * 7)
    os.replace(run.folder / "checkpoint.pt.new", run.folder / "checkpoint.pt")  # as a newer checkpoint lands
    assert runs.read(run.job_id, "checkpoint", 0)[0] != version
    for job_id, what, offset, says in [("nosuch", "log", 0, "no run nosuch"), (run.job_id, "../token", 0, "not"),
                                       (run.job_id, "log", -1, "negative")]:
        with pytest.raises(SwarmError, match=says):
            runs.read(job_id, what, offset)
    again = DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in)  # the agent started again
    assert again.describe()[0]["state"] == "done"


@pytest.mark.trio
async def test_a_run_stops_fails_or_is_lost(tmp_path):
    runs = DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in, running=2)
    waiting = runs.submit(["--steps", "1000"])
    failing = runs.submit(["--steps", "2", "--lr", "1e9"])
    with pytest.raises(SwarmError, match="already coordinates 2 runs"):
        runs.submit(["--steps", "1"])
    await wait_ended(runs, failing)
    assert runs.describe(failing.job_id)[0]["detail"] == "swarm train: error: the loss became nan at step 1"
    while b"waiting" not in runs.read(waiting.job_id, "log", 0)[2]:
        await trio.sleep(0.05)
    runs.stop(waiting.job_id)
    assert runs.describe(waiting.job_id)[0]["state"] == "running (stopping)"
    await wait_ended(runs, waiting)
    assert runs.describe(waiting.job_id)[0]["state"] == "stopped"
    gone = runs.submit(["--steps", "1000"])
    gone.process.kill()  # as when the agent dies: no exit record
    gone.process.wait()
    assert DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in).describe(gone.job_id)[0]["state"] == "lost"


@pytest.mark.trio
async def test_a_run_stopped_while_it_starts_is_stopped_not_failed(tmp_path):
    """`swarm stop` right after `swarm train --detach` interrupts the run's interpreter in its
    imports: status 1 and a KeyboardInterrupt traceback, which is a stop like any other."""
    runs = DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in)
    run = runs.submit(["--steps", "999"])
    while b"waiting" not in runs.read(run.job_id, "log", 0)[2]:
        await trio.sleep(0.05)
    runs.stop(run.job_id)
    await wait_ended(runs, run)
    assert run.process.returncode == 1
    assert (runs.describe(run.job_id)[0]["state"], runs.describe(run.job_id)[0]["detail"]) == ("stopped", "")


@pytest.mark.trio
async def test_a_run_stops_even_when_the_agent_was_started_with_sigint_ignored(tmp_path):
    """As by `swarm join &` in a script: the run must not inherit the ignored SIGINT that
    `swarm stop` sends, even asked to stop before it has started."""
    runs = DetachedRuns(tmp_path / "runs", "pi-3", check_detached_flags, stand_in)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run = runs.submit(["--steps", "1000"])
    finally:
        signal.signal(signal.SIGINT, previous)
    runs.stop(run.job_id)
    await wait_ended(runs, run)
    assert runs.describe(run.job_id)[0]["state"] == "stopped"


@asynccontextmanager
async def agent_and_client(tmp_path):
    """An agent on loopback whose detached runs are stand-ins, and a client's roster of it."""
    network = resolve_network("lo")
    config = AgentConfig(name="a0", node_id="node0", token=TOKEN, network=network, port=0, advertise=False,
                         state_dir=tmp_path, check_run_flags=check_detached_flags)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            agent = await nursery.start(Agent(config).run)
            agent.detached.command_for = stand_in
            async with open_roster(Credentials("client", TOKEN), network, peers=[("127.0.0.1", agent.port)],
                                   discover=False) as cluster:
                await cluster.wait_for(1, timeout=10)
                yield agent, cluster
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_requests_over_the_wire(tmp_path):
    async with agent_and_client(tmp_path) as (agent, cluster):
        refused = await cluster.ask("node0", DetachSubmit(0, ["--save", "x"]))
        assert "--save cannot be given" in refused.error and refused.jobs == []
        (run,) = (await cluster.ask("node0", DetachSubmit(0, ["--steps", "1000"]))).jobs
        assert (run["state"], run["node"]) == ("running", "a0")
        listed = await cluster.ask("node0", DetachList(0))
        assert [r["id"] for r in listed.jobs] == [run["id"]]
        unknown = await cluster.ask("node0", DetachRead(0, "nosuch", "log", 0))
        assert unknown.error == "no run nosuch here"
        (stopping,) = (await cluster.ask("node0", DetachStop(0, run["id"]))).jobs
        assert stopping["state"] in ("running (stopping)", "stopped")
        while (ended := (await cluster.ask("node0", DetachList(0))).jobs[0])["state"].startswith("running"):
            await trio.sleep(0.05)
        assert ended["state"] == "stopped", ended


@pytest.mark.trio
async def test_a_log_chunk_says_the_state_from_before_it_was_read(tmp_path):
    """`swarm logs -f` stops once a chunk reaches the log's end and says the run is no longer
    running. A run that ends while the agent reads its log writes its last lines after that
    chunk was taken, so the chunk must carry the state from before the read, or the reader
    stops short of them ("trained ... for N steps" went missing under load)."""
    async with agent_and_client(tmp_path) as (agent, cluster):
        (run,) = (await cluster.ask("node0", DetachSubmit(0, ["--steps", "1000"]))).jobs
        read = agent.detached.read

        def read_as_the_run_ends(job_id, what, offset):
            chunk = read(job_id, what, offset)
            agent.detached.get(job_id).state = "done"  # it ends (and writes on) just after
            return chunk

        agent.detached.read = read_as_the_run_ends
        chunk = await cluster.ask("node0", DetachRead(0, run["id"], "log", 0))
        assert chunk.state == "running", chunk  # so the reader asks again, and gets the rest
        agent.detached.read = read
        again = await cluster.ask("node0", DetachRead(0, run["id"], "log", 0))
        assert again.state == "done"
        agent.detached.get(run["id"]).process.kill()


class DroppingCluster:
    """A roster's stand-in for `swarm logs -f`: agents by name, each listing the runs it
    coordinates ({name: [run, ...]}) and serving a log; `drops` asks to a device fail as a
    closed connection does before the next answers."""

    def __init__(self, runs: dict[str, list[dict]], log: bytes, drops: dict[str, int]):
        self.devices = [SimpleNamespace(node_id=f"node-{name}", name=name) for name in runs]
        self.runs, self.log, self.drops = runs, log, dict(drops)

    def alive(self):
        return list(self.devices)

    async def ask(self, node_id, request, timeout):
        from swarm.net.peer import PeerUnavailable
        from swarm.wire import DetachChunk

        name = node_id.removeprefix("node-")
        if self.drops.get(name, 0) > 0:
            self.drops[name] -= 1
            raise PeerUnavailable(f"{name}'s connection closed before it answered")
        if isinstance(request, DetachList):
            return SimpleNamespace(error="", jobs=self.runs[name])
        (run,) = [r for r in self.runs[name] if r["id"] == request.job_id]
        half = len(self.log) // 2 if request.offset == 0 else len(self.log)  # the log in two chunks
        return DetachChunk(request.seq, "", "v", request.offset, len(self.log), self.log[request.offset:half],
                           run["state"])


def a_run(state, term):
    return {"id": "r1", "state": state, "term": term}


@pytest.mark.trio
async def test_a_follower_that_loses_its_connection_to_a_live_coordinator_reads_on_where_it_was(capsys):
    """A follower whose connection to the coordinator closes (a busy host misses heartbeats)
    while the coordinator lives on, and whose run has no newer term anywhere, goes back to the
    same coordinator and reads on from where it was: every line once, not "no agent knows a run"
    (a CI run's follower failed so at the end of a run), nor the log again from its start."""
    from swarm.commands.jobs_cmd import _logs

    log = b"".join(f"step {k}/6\n".encode() for k in range(1, 7))
    cluster = DroppingCluster({"dev0": [], "dev2": [a_run("done", 1)]}, log, {})
    read = cluster.ask

    async def drop_after_the_first_chunk(node_id, request, timeout):
        if isinstance(request, DetachRead) and request.offset > 0 and not cluster.dropped:
            cluster.drops["dev2"], cluster.dropped = 1, True
        return await read(node_id, request, timeout)

    cluster.dropped, cluster.ask = False, drop_after_the_first_chunk
    assert await _logs(SimpleNamespace(job="r1", wait=1.0, follow=True), cluster) == 0
    out = capsys.readouterr().out
    assert cluster.dropped and "-- dev2 answers again --" in out, out
    assert [line for line in out.splitlines() if line.startswith("step")] == [f"step {k}/6" for k in range(1, 7)], out


@pytest.mark.trio
async def test_a_follower_takes_a_successor_over_the_lost_coordinator_it_can_reach_again(autojump_clock):
    """Back on a new connection, a coordinator's run of the same term counts only while it
    runs or once it is done: one that lost its lease or its agent (failed, stopped, lost) has
    handed the run on, and a newer term, wherever it is, is taken first."""
    from swarm.commands.jobs_cmd import find_run

    for old, successor, found in [("running", None, "dev2"), ("running (stopping)", None, "dev2"),
                                  ("done", None, "dev2"), ("running", a_run("running", 2), "dev3"),
                                  ("lost", a_run("running", 2), "dev3"), ("failed", a_run("running", 2), "dev3")]:
        cluster = DroppingCluster({"dev2": [a_run(old, 1)], "dev3": [successor] if successor else []}, b"", {})
        device, run = await find_run(cluster, "r1", 1.0, newer_than=1, still="node-dev2")
        assert device.name == found, (old, successor)
    for old in ("lost", "failed", "stopped"):
        cluster = DroppingCluster({"dev2": [a_run(old, 1)], "dev3": []}, b"", {})
        with pytest.raises(SwarmError, match="no agent knows a run r1"):
            await find_run(cluster, "r1", 1.0, newer_than=1, still="node-dev2")
    cluster = DroppingCluster({"dev2": [a_run("running", 1)]}, b"", {})
    with pytest.raises(SwarmError, match="no agent knows a run r1"):  # another device's run of that term: not it
        await find_run(cluster, "r1", 1.0, newer_than=1, still="node-dev9")


def test_malformed_requests_are_refused_by_the_wire():
    good = to_wire(DetachRead(1, "abc123", "log", 0))
    assert from_wire(good) == DetachRead(1, "abc123", "log", 0)
    for bad in ([44, 1, "abc123", "log", "0"], [44, 1, "abc123", "log"], [40, 1, ["--steps", 3]], [40, 1, "x"]):
        with pytest.raises(RemoteProtocolError):
            from_wire(bad)


def test_a_jobs_table():
    table = format_table([{"id": "abc123", "model": "lenet5", "step": 3, "steps": None, "samples_per_s": 2.25,
                           "devices": 3, "state": "failed", "detail": "out of memory", "node": "pi-3"}])
    assert table.splitlines()[1].split() == ["abc123", "lenet5", "3/?", "2.2", "3", "failed:", "out", "of", "memory",
                                             "pi-3"]


@pytest.mark.parametrize("args,says", [
    (["logs", "abc123", "--peers", "127.0.0.1:9", "--wait", "0"], "no agent knows a run abc123"),
    (["train", "--detach", "--save", "x.pt"], "--save would be written on the coordinating device"),
    (["train", "--coordinator", "pi"], "add --detach"),
])
def test_mistakes_are_one_line(tmp_path, args, says):
    r = run_swarm(*args, env={"SWARM_TOKEN": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4", "SWARM_STATE_DIR": str(tmp_path)}, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert json.dumps(r.stderr).count("Traceback") == 0
