"""The agent behind `swarm join`: serves authenticated connections, answers probes and info
requests, sends heartbeats to watchers, and holds one job at a time for a coordinator.

Job lifecycle (messages from the coordinator; each answered with JobState):

    JobAssign ──> assigned ──JobStart──> running ──(runner returns)──> done | failed
                     ^                      │
                     └─────── JobStop ──────┘ (stopped)          JobRelease: back to idle
    JobAssign of the same job at a newer epoch: the run is cancelled, the job re-assigned.

An agent also coordinates detached training runs (detached.py), keeps the replica of the
coordinator of the job it holds, and with the other holders elects a successor when that
coordinator is gone (failover.py).

What a remote side can make an agent hold is bounded (swarm/limits.py): job messages that
arrive before their assignment by count, bytes and age; replies waiting for a peer that does
not read by count (the peer is disconnected); log lines by kind and second.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import re
import secrets
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import trio

from swarm import __version__
from swarm.agent.detached import DetachedRun, DetachedRuns
from swarm.agent.early import EarlyMessages
from swarm.agent.failover import Replica, elect, term_of
from swarm.agent.quorum import ELECTION_TIMEOUT_S, LEASE_ASK_S, Election, VoteAnswer, Voter, write_json
from swarm.agent.jobs import LANE, JobContext, job_runner
from swarm.errors import SwarmError
from swarm.host import malloc
from swarm.host.accelerator import accelerator, accelerator_memory
from swarm.limits import (EARLY_AGE, EARLY_BYTES, EARLY_LANES, EARLY_MESSAGES, LOG_INTERVAL, OUTBOX, REPLICA_BYTES,
                          REPLICAS)
from swarm.net import ConnectionLost, Credentials, NetworkChoice, PeerConnection, connect_peer, parse_endpoint
from swarm.net.discovery import Advert, advertise, open_zeroconf
from swarm.net.peer import serve_peers
from swarm.net.ratelimit import LogLimiter
from swarm.ports import DEFAULT_PORT
from swarm.wire import (PROTOCOL_VERSION, DetachAnswer, DetachChunk, DetachList, DetachRead, DetachStop, DetachSubmit,
                        Heartbeat, Info, InfoRequest, JobAssign, JobData, JobRelease, JobReplica, JobStart, JobState,
                        JobStop, LeaseAnswer, LeaseAsk, Limits, Ping, Pong, RemoteProtocolError, ReplicaQuery,
                        ReplicaState, VoteAsk, VoteReply, Watch)

log = logging.getLogger("swarm.agent")

MIN_INTERVAL = 0.01      # fastest heartbeat a watcher may ask for
MAX_NAME = 128           # longest job id or job kind
ELECTION_S = 2.0         # how long the other replica holders have to say which replica they hold, or vote
# How long at most an elected agent speaks for its successor run while that starts (a new
# process: Python, torch, the run's devices found again), before the run's coordinator asks
# for its lease itself: without it, the other holders would stand again after an election
# timeout and elect another successor, which fences the first.
HERALD_S = 60.0
# A replica kept in the state directory is read back when the agent starts (a holder killed
# and started again still holds it, and votes with it) unless it is older than this.
REPLICA_KEEP_S = 3600.0


@dataclass
class AgentConfig:
    """How an agent runs. cores/memory default to what this device offers (cgroup-aware)."""
    name: str
    node_id: str
    token: str = field(repr=False)
    network: NetworkChoice
    port: int = DEFAULT_PORT
    peers: tuple[tuple[str, int], ...] = ()
    advertise: bool = True          # publish on mDNS
    orphan_timeout: float = 30.0    # release a job whose coordinator stays away this long
    limits: Limits = Limits()
    cores: int | None = None
    memory: int | None = None
    reserve: int | None = None      # memory kept back from plans (None: swarm.host.resources.default_reserve)
    accelerator: str | None = None  # what to offer: "cpu" opts a GPU out; None: what this device has
    early_messages: int = EARLY_MESSAGES  # job messages held for an assignment not yet here
    early_bytes: int = EARLY_BYTES        # ... and their bytes (held_bytes)
    early_age: float = EARLY_AGE          # seconds one may wait before it is dropped
    outbox: int = OUTBOX                  # replies queued for a peer before it is disconnected
    state_dir: Path | None = None         # holds the folders of detached runs
    check_run_flags: Callable | None = None  # parses a detached run's `swarm train` flags (None: no runs here)
    election_timeout: float = ELECTION_TIMEOUT_S  # a replica holder votes this long after it last followed a coordinator


def describe_failure(exc: BaseException) -> str:
    """'Type: message' of the first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


class Peer:
    """One authenticated connection as the agent sees it: replies go through an outbox of
    `outbox` messages (one sender task), so the reading task never blocks on a send; when
    it is full, `on_full(peer)` is called once (the agent disconnects the peer)."""

    def __init__(self, conn: PeerConnection, outbox: int = OUTBOX,
                 on_full: Callable[["Peer"], None] | None = None):
        self.conn = conn
        self.outbox, self._outbox_out = trio.open_memory_channel(outbox)
        self.on_full = on_full
        self.full = False
        self.scope: trio.CancelScope | None = None  # the conversation's: cancelling it ends the connection
        self.watch_interval = 0.0
        self.watching = False
        self.last_heard = trio.current_time()
        self.heartbeat_seq = 0

    @property
    def node_id(self) -> str:
        return self.conn.peer_id

    def reply(self, message) -> None:
        """Queue a reply; dropped (and on_full called, once) if the outbox is full."""
        try:
            self.outbox.send_nowait(message)
        except trio.WouldBlock:
            if not self.full:
                self.full = True
                if self.on_full is not None:
                    self.on_full(self)

    async def send_replies(self) -> None:
        async for message in self._outbox_out:
            await self.conn.send(message)


class AgentJob:
    """The job an agent holds: identity, coordinator, state, and the current epoch's context."""

    def __init__(self, job_id: str, kind: str, coordinator_id: str, heartbeat_interval: float):
        self.job_id = job_id
        self.kind = kind
        self.coordinator_id = coordinator_id
        self.heartbeat_interval = heartbeat_interval
        self.ctx: JobContext | None = None
        self.state = "assigned"
        self.detail = ""
        self.result: dict | None = None
        self.scope = trio.CancelScope()          # the job's whole stay on this agent
        self.run_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        self.links: list[PeerConnection] = []
        self.coordinator_changed = trio.Event()
        self.run_ended: trio.Event | None = None  # set when the latest run has returned (threads and all)

    @property
    def epoch(self) -> int:
        return self.ctx.epoch


class Agent:
    """Run with `await nursery.start(agent.run)`; started() hands back the agent once it listens."""

    def __init__(self, config: AgentConfig):
        from swarm.host.resources import default_reserve, usable_cores, usable_memory

        self.config = config
        self.credentials = Credentials(config.node_id, config.token, config.limits)
        self.cores = config.cores or usable_cores()
        self.memory = config.memory or usable_memory()  # the device's: physical, or its cgroup's limit
        self.reserve = default_reserve(self.memory) if config.reserve is None else config.reserve
        self.accelerator = config.accelerator or accelerator()
        self.accelerator_memory = accelerator_memory(self.accelerator)
        self.port: int | None = None
        # this start of the agent: what it holds for runs (layers, backups) lives in memory and
        # dies with it, so a successor counts a device's old holdings only from the same start
        self.incarnation = secrets.token_hex(8)
        self.job: AgentJob | None = None
        self.refused_messages = 0   # job messages refused (older epoch, no room), for tests and logs
        self.runs_ended = 0         # job runs that have returned on this agent
        self._peers: dict[str, list[Peer]] = {}
        self._nursery: trio.Nursery | None = None
        self._lines = LogLimiter(log, clock=trio.current_time)  # lines about what remote sides do
        # job messages that come before their assignment (a peer's may land a little before ours)
        self._early = EarlyMessages(config.early_messages, config.early_bytes, config.early_age, self._refuse,
                                    self._lines)
        self._early_lanes: list[tuple[float, str, JobData, PeerConnection]] = []  # (arrived, sender, hello, lane)
        # training runs this agent coordinates for users who went away (`swarm train --detach`)
        self.replicas: dict[str, Replica] = {}  # job id -> the newest coordinator replica of that job
        self._replica_stored = trio.Event()  # set (and replaced) whenever one is stored
        self._watched: set[str] = set()  # job ids whose replica a _replica_watch watches over
        self.took_over: dict[str, tuple[int, int]] = {}  # job id -> version of the replica this agent carried on
        self.terms: dict[str, int] = {}  # job id -> the newest coordinator term seen (failover.py fencing)
        self.voters: dict[str, Voter] = {}  # job id -> this holder's votes and fence for it (quorum.py)
        self._asked: dict[int, tuple[trio.Event, list]] = {}  # seq of a ReplicaQuery -> (answered, [answer])
        self._seq = 0
        self.detached = DetachedRuns(Path(config.state_dir) / "runs", config.name, config.check_run_flags,
                                     self._run_command) if config.state_dir and config.check_run_flags else None

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def address(self) -> str:
        return self.config.network.address

    # -- running ----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        network = self.config.network
        async with AsyncExitStack() as stack:
            # zeroconf is entered first so that it closes last, after the advert's goodbye
            zc = await stack.enter_async_context(open_zeroconf(network)) if self.config.advertise else None
            nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery = nursery
            self.port = await nursery.start(serve_peers, self._serve, self.credentials, network.listen_hosts,
                                            self.config.port)
            nursery.start_soon(self._housekeeping)
            self._detached_nursery = await nursery.start(self._hold_detached)
            self._load_replicas()
            if zc is not None:
                await nursery.start(advertise, zc, self.advert())
            log.info("agent %s (node %s) listening on %s port %d, %d cores, %.1f GiB (%.0f MiB to spare, %.0f MiB "
                     "kept back), %s; discovery on %s%s", self.config.name, self.node_id,
                     ",".join(network.listen_hosts), self.port, self.cores, self.memory / 2**30,
                     self.spare_memory() / 2**20, self.reserve / 2**20, self.accelerator, network.interface,
                     "" if self.config.advertise else " (mDNS off)")
            task_status.started(self)

    def advert(self) -> Advert:
        return Advert(node_id=self.node_id, name=self.config.name, address=self.address, port=self.port,
                      cores=self.cores, memory=self.memory, accelerator=self.accelerator,
                      accelerator_memory=self.accelerator_memory, version=__version__, protocol=PROTOCOL_VERSION,
                      cluster=self.credentials.cluster_tag)

    def spare_memory(self) -> int:
        """What this device can spare for a plan now: the memory available, plus what this agent
        holds, less the reserve (swarm.host.resources); within self.memory."""
        from swarm.host.resources import memory_figures

        return memory_figures(self.reserve, total=self.memory).spare

    def info(self) -> Info:
        """What this agent offers, as of now: its spare memory is measured for each answer."""
        job = self.job
        return Info(self.node_id, self.config.name, self.cores, self.memory, self.spare_memory(), self.accelerator,
                    self.accelerator_memory, __version__,
                    self.port or 0, [f"{h}:{p}" for h, p in self.config.peers],
                    job.job_id if job else None, job.state if job else None, self.incarnation)

    # -- connections ------------------------------------------------------------------

    @property
    def early(self) -> tuple[int, int]:
        """(messages, bytes) held for an assignment that has not arrived yet."""
        return self._early.held()

    @property
    def expired_messages(self) -> int:
        """Job messages dropped after waiting config.early_age for their job."""
        return self._early.expired

    async def _housekeeping(self) -> None:
        """Now and then: drop early messages that waited too long, and log the lines held back."""
        period = max(0.01, min(LOG_INTERVAL, self.config.early_age / 4))
        while True:
            await trio.sleep(period)
            if self._early.expire(trio.current_time()):
                malloc.give_back()  # a flood of them may have grown the heap
            due = trio.current_time() - self.config.early_age
            for lane in [lane for lane in self._early_lanes if lane[0] < due]:
                self._early_lanes.remove(lane)
                self._nursery.start_soon(lane[3].aclose, "no such job here")
            self._lines.flush()

    async def _serve(self, conn: PeerConnection) -> None:
        self._lines.log(logging.INFO, "connection", "connection from %s (node %s)", conn.address, conn.peer_id)
        if await self._converse(conn):  # a run's lane now: serve_peers closes it once we return
            await conn.wait_released()

    async def _converse(self, conn: PeerConnection, *, task_status=trio.TASK_STATUS_IGNORED) -> bool:
        """Read one connection until it ends, dispatching each message, or until it turns out
        to be a run's lane (True: handed over, not closed)."""
        peer = Peer(conn, self.config.outbox, self._outbox_full)
        conn.on_activity = lambda: setattr(peer, "last_heard", trio.current_time())  # bytes, not whole messages
        self._peers.setdefault(peer.node_id, []).append(peer)
        job = self.job
        if job is not None and peer.node_id == job.coordinator_id:
            job.coordinator_changed.set()
        task_status.started()
        handed_over = False
        try:
            async with trio.open_nursery() as nursery:
                peer.scope = nursery.cancel_scope
                nursery.start_soon(self._send_replies, peer, nursery.cancel_scope)
                handed_over = await self._read(peer, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._peers[peer.node_id].remove(peer)
            if not self._peers[peer.node_id]:
                del self._peers[peer.node_id]
            job = self.job
            if job is not None and peer.node_id == job.coordinator_id:
                job.coordinator_changed.set()
            if not handed_over:
                await conn.aclose()
        return handed_over

    async def _read(self, peer: Peer, nursery: trio.Nursery) -> bool:
        """Dispatch the connection's messages until it ends (errors end only this connection)
        or it turns out to be a run's gradient-sum lane (True: handed over, not to be closed)."""
        conn = peer.conn
        try:
            async for message in conn:
                if isinstance(message, JobData) and message.channel == LANE:
                    return self._take_lane(peer, message)
                await self._dispatch(peer, message, nursery)
        except RemoteProtocolError as exc:
            self._lines.log(logging.WARNING, "protocol", "closed connection with %s (node %s): %s", conn.address,
                            peer.node_id, exc)
        except Exception:  # a bug must not take the agent down with it
            self._lines.log(logging.ERROR, "bug", "error on the connection with %s (node %s); closed", conn.address,
                            peer.node_id, exc_info=True)
        return False

    def _take_lane(self, peer: Peer, hello: JobData) -> bool:
        """A run's lane to one of ours (swarm/execution/lane.py): hand the connection to our
        run of that job and epoch, or hold it for an assignment not here yet (False: refused,
        to be closed). Nothing else is sent or read on it here from now on."""
        job = self.job
        if job is None or hello.job_id != job.job_id or hello.epoch > job.epoch:
            if len(self._early_lanes) >= EARLY_LANES:
                self._lines.log(logging.WARNING, "refused lane", "refused a lane from node %s: %d are held for "
                                "jobs not here yet", peer.node_id, EARLY_LANES)
                return False
            self._early_lanes.append((trio.current_time(), peer.node_id, hello, peer.conn))
            return True
        if hello.epoch < job.epoch:
            self._refuse(peer.node_id, hello, "stale", f"epoch {hello.epoch} is older than the job's epoch {job.epoch}")
            return False
        job.links.append(peer.conn)  # (closed with the job at the latest)
        job.ctx.deliver_lane(peer.node_id, hello, peer.conn)
        return True

    def _outbox_full(self, peer: Peer) -> None:
        """A peer that leaves our replies unread: disconnect it rather than buffer for it."""
        self._lines.log(logging.WARNING, "outbox", "disconnected %s (node %s): it left %d replies unread",
                        peer.conn.address, peer.node_id, self.config.outbox)
        if peer.scope is not None:
            peer.scope.cancel()

    async def _send_replies(self, peer: Peer, scope: trio.CancelScope) -> None:
        try:
            await peer.send_replies()
        except ConnectionLost:
            scope.cancel()

    async def _dispatch(self, peer: Peer, message, nursery: trio.Nursery) -> None:
        if isinstance(message, Ping):
            if message.seq:  # (0: a beat, nothing to answer)
                peer.reply(Pong(message.seq))
        elif isinstance(message, InfoRequest):
            peer.reply(self.info())
        elif isinstance(message, Watch):
            peer.watch_interval = max(MIN_INTERVAL, message.interval) if message.interval > 0 else 0.0
            if peer.watch_interval and not peer.watching:
                nursery.start_soon(self._watch_heartbeats, peer)
        elif isinstance(message, JobAssign):
            await self._assign(peer, message)
        elif isinstance(message, (JobStart, JobStop, JobRelease)):
            self._lifecycle(peer, message)
        elif getattr(message, "JOB_DATA", False):
            self._deliver(peer.node_id, message)
        elif isinstance(message, (DetachSubmit, DetachList, DetachStop, DetachRead)):
            await self._detached_request(peer, message)
        elif isinstance(message, JobReplica):
            self._keep_replica(peer, message)
        elif isinstance(message, ReplicaQuery):
            held = self.replicas.get(message.job_id)
            if held is not None and self.took_over.get(message.job_id) == held.version:
                held = None  # it carried the run on from this replica once: another holder's turn
            peer.reply(ReplicaState(message.seq, message.job_id[:MAX_NAME], *(held.version if held else (-1, -1))))
        elif isinstance(message, (ReplicaState, VoteReply)):
            asked = self._asked.get(message.seq)
            if asked is not None and not asked[0].is_set():
                asked[1].append((peer.node_id, message))
                asked[0].set()
        elif isinstance(message, LeaseAsk):
            peer.reply(self._lease_answer(peer, message))
        elif isinstance(message, VoteAsk):
            peer.reply(self._vote(peer, message))
        else:
            self._lines.log(logging.DEBUG, "ignored", "ignoring %s from node %s", type(message).__name__, peer.node_id)

    # -- coordinator fail-over (swarm/agent/failover.py) -------------------------------

    def _note_term(self, job_id: str, term: int) -> None:
        """Remember the newest coordinator term of a job, also once it is released here: a
        coordinator of an older term is fenced off for good."""
        self.terms.pop(job_id, None)
        self.terms[job_id] = max(term, self.terms.get(job_id, 0))
        while len(self.terms) > REPLICAS:
            del self.terms[next(iter(self.terms))]

    def _keep_replica(self, peer: Peer, msg: JobReplica) -> None:
        """Keep the newest replica of a job, sent by its coordinator: the coordinator of the
        job held here, or for a job this agent has no part in now, the coordinator the replica
        names (every device of a detached run holds its replica, also when the plan leaves
        it out), and watch over that coordinator (_replica_watch)."""
        import msgpack

        job = self.job
        why = None
        ours = job is not None and job.job_id == msg.job_id
        named = msg.body.get("coordinator") if isinstance(msg.body, dict) else None
        if ours and peer.node_id != job.coordinator_id:
            why = "it does not come from the coordinator of the job held here"
        elif not ours and peer.node_id.split("~")[0] != named:  # (a coordinator's id: its agent's ~ its pid)
            why = "it does not come from the coordinator it names"
        elif len(msgpack.packb(msg.body, default=lambda _: b"")) > REPLICA_BYTES:
            why = f"it is over {REPLICA_BYTES} bytes"
        else:
            try:
                replica = Replica.from_body(msg.body)
            except ValueError as exc:
                why = str(exc)
            else:
                held = self.replicas.get(msg.job_id)
                if replica.version != (msg.term, msg.step) or replica.job_id != msg.job_id:
                    why = "its term or step differs from its body's"
                elif held is None or replica.version >= held.version:
                    voter = self._voter(msg.job_id)
                    voter.fence.see(replica.term, replica.elected_by if replica.elected_term == replica.term else ())
                    self._store_replica(replica)
                    return
                else:
                    why = f"a newer one (term {held.term}, step {held.step}) is held"
        self._lines.log(logging.WARNING, "replica", "refused a replica of job %.40s from node %s: %s", msg.job_id,
                        peer.node_id, why)

    def _voter(self, job_id: str) -> Voter:
        """This holder's part in the elections of a job's coordinators (quorum.Voter), its
        vote kept in the state directory (in memory without one)."""
        voter = self.voters.get(job_id)
        if voter is None:
            path = self._job_file("votes", job_id)
            voter = self.voters[job_id] = Voter(self.node_id, path, self.config.election_timeout, trio.current_time())
            if voter.broken:
                self._lines.log(logging.ERROR, "vote file", "%s", voter.broken)
            while len(self.voters) > REPLICAS:
                del self.voters[next(iter(self.voters))]
        return voter

    def _job_file(self, kind: str, job_id: str) -> Path | None:
        """STATE_DIR/KIND/JOB.json (a job id that is not a plain file name hashed); None without
        a state directory."""
        if not self.config.state_dir:
            return None
        safe = job_id if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", job_id) and not job_id.startswith(".") \
            else hashlib.sha256(job_id.encode()).hexdigest()[:32]
        folder = Path(self.config.state_dir) / kind
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{safe}.json"

    def _store_replica(self, replica: Replica) -> None:
        """Keep `replica` as its job's newest, in memory and (written atomically) in the state
        directory, forgetting the oldest beyond REPLICAS, and watch over its coordinator; or,
        when it says its run finished, forget the job's replica."""
        job_id = replica.job_id
        if replica.finished:  # the run ended: nothing to carry on, nothing to keep
            self._forget_replica(job_id)
            self._replica_stored.set()
            self._replica_stored = trio.Event()
            return
        self.replicas.pop(job_id, None)
        self.replicas[job_id] = replica
        try:
            path = self._job_file("replicas", job_id)
            if path is not None:
                write_json(path, replica.to_body())
        except OSError as exc:
            self._lines.log(logging.ERROR, "replica file", "cannot keep the replica of job %s in the state "
                            "directory (%s): a restart here loses it", job_id, exc.strerror or exc)
        self._replica_stored.set()
        self._replica_stored = trio.Event()
        while len(self.replicas) > REPLICAS:
            self._forget_replica(next(iter(self.replicas)))
        if job_id in self.replicas and job_id not in self._watched and self._nursery is not None:
            self._watched.add(job_id)
            self._nursery.start_soon(self._replica_watch, job_id)

    def _forget_replica(self, job_id: str) -> None:
        self.replicas.pop(job_id, None)
        try:
            path = self._job_file("replicas", job_id)
            if path is not None:
                path.unlink(missing_ok=True)
        except OSError:
            pass

    def _load_replicas(self) -> None:
        """The replicas this agent kept before it was started again (the newest REPLICAS, none
        older than REPLICA_KEEP_S); a file that does not hold one is removed, in one line."""
        import json

        if not self.config.state_dir:
            return
        folder = Path(self.config.state_dir) / "replicas"
        try:
            files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime)
        except OSError:
            return
        for path in files[-REPLICAS:]:
            try:
                if time.time() - path.stat().st_mtime > REPLICA_KEEP_S:
                    raise ValueError(f"older than {REPLICA_KEEP_S:.0f} s")
                replica = Replica.from_body(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                self._lines.log(logging.WARNING, "replica file", "dropped the replica file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            self._store_replica(replica)

    def _lease_answer(self, peer: Peer, msg: LeaseAsk) -> LeaseAnswer:
        """Follow the coordinator asking, or say in one line why not (a newer term has begun,
        or this holder voted in one): a refusal fences it."""
        job_id = msg.job_id[:MAX_NAME]
        voter = self.voters.get(job_id)
        known = self.terms.get(job_id, 0)
        if msg.term < known:
            why = f"coordinator of term {msg.term} fenced: term {known} has begun"
        elif voter is not None:
            why = voter.on_coordinator(msg.term, trio.current_time(), elected_by=msg.elected_by[:REPLICAS * 4])
            known = max(known, voter.term)
        else:
            why = None
        if why:
            self._lines.log(logging.WARNING, "lease", "refused node %s the lease of job %s: %s", peer.node_id, job_id,
                            why)
        return LeaseAnswer(msg.seq, job_id, why is None, known, why or "")

    def _vote(self, peer: Peer, msg: VoteAsk) -> VoteReply:
        """Answer a candidate's poll or vote request (quorum.Voter.answer): only for the node
        it comes from, and only with a replica of the job held here."""
        job_id = msg.job_id[:MAX_NAME]
        voter, held = self.voters.get(job_id), self.replicas.get(job_id)
        if voter is None or held is None:
            return VoteReply(msg.seq, job_id, self.node_id, 0, False, f"{self.node_id} holds no replica of job "
                             f"{job_id}", msg.poll)
        if peer.node_id not in held.holders:
            return VoteReply(msg.seq, job_id, self.node_id, voter.term, False, f"node {peer.node_id} holds no replica "
                             f"of job {job_id}", msg.poll)
        from swarm.agent.quorum import VoteRequest

        request = VoteRequest(msg.term, peer.node_id, (msg.replica_term, msg.replica_step), msg.poll)
        answer = voter.answer(request, held.version, trio.current_time())
        self._lines.log(logging.INFO if answer.granted else logging.WARNING, "vote",
                        "%s node %s's %s for term %d of job %s%s", "granted" if answer.granted else "refused",
                        peer.node_id, "poll" if msg.poll else "vote", msg.term, job_id,
                        f": {answer.why}" if answer.why else "")
        return VoteReply(msg.seq, job_id, self.node_id, answer.term, answer.granted, answer.why, msg.poll)

    async def _replica_watch(self, job_id: str) -> None:
        """While this agent holds a replica of a job's coordinator: once that coordinator (or any
        of a newer term) has been quiet for the election timeout, as its lease asks and
        assignments tell (quorum.Voter.may_stand), elect its successor with the other holders,
        and if it is this agent, start it. Ends when the replica is gone or says its run ended."""
        try:
            while True:
                replica = self.replicas.get(job_id)
                if replica is None:
                    return
                voter = self._voter(job_id)
                if (self.detached is None or self.node_id not in replica.holders
                        or self.took_over.get(job_id) == replica.version):
                    await self._replica_stored.wait()  # nothing to stand with until a newer replica comes
                    continue
                now = trio.current_time()
                if not voter.may_stand(now):
                    await trio.sleep(min(0.5, max(0.05, voter.heard_at + voter.election_s - now)))
                    continue
                await self._elect(job_id, replica)
        finally:
            self._watched.discard(job_id)

    async def _elect(self, job_id: str, replica: Replica) -> bool:
        """Until a coordinator leads the job again: the holders that answer say which replica
        they hold; the one `elect` names polls, then asks for the votes, and takes the run over
        only when a majority of the replica's holders granted them (swarm/agent/quorum.py).
        True if it did."""
        voter = self._voter(job_id)
        above = 0
        holders = {replica.devices[name]["node_id"]: replica.devices[name]["address"]
                   for name in replica.devices if replica.devices[name]["node_id"] in replica.holders}

        def led() -> bool:
            """Whether a coordinator leads the job again (or a newer replica came)."""
            return self.replicas.get(job_id) is not replica or not voter.may_stand(trio.current_time())

        while not led():
            versions = await self._replica_versions(job_id, replica, holders)
            successor = elect(versions)
            self._lines.log(logging.WARNING, "election", "coordinator of job %s (run %s) is gone; replicas held: %s; "
                            "successor: node %s", job_id, replica.run_id,
                            ", ".join(f"{n} {t}/{s}" for n, (t, s) in sorted(versions.items())), successor)
            if successor == self.node_id and not led():
                election = await self._stand(job_id, replica, voter, holders, above)
                above = max(above, election.highest)
                if election.won:
                    self.took_over[job_id] = replica.version
                    self._take_over(dataclasses.replace(replica, elected_term=election.request.term,
                                                        elected_by=sorted(election.granted)))
                    return True
            await trio.sleep(voter.election_s / 2)
        return False

    async def _replica_versions(self, job_id: str, replica: Replica, holders: dict) -> dict:
        """{node id: replica version} of the holders that answer within ELECTION_S, this one's own."""
        versions = {self.node_id: replica.version}

        async def ask(node_id: str, address: str) -> None:
            answer = await self._ask(node_id, address, lambda seq: ReplicaQuery(seq, job_id))
            if answer is not None:
                sender, state = answer
                if (isinstance(state, ReplicaState) and sender == node_id and state.job_id == job_id
                        and state.term >= 0):
                    versions[node_id] = (state.term, state.step)

        async with trio.open_nursery() as nursery:
            for node_id, address in holders.items():
                if node_id != self.node_id:
                    nursery.start_soon(ask, node_id, address)
        return versions

    async def _stand(self, job_id: str, replica: Replica, voter: Voter, holders: dict, above: int) -> Election:
        """A poll, then (if a majority would grant it) the vote itself, both for one term."""
        poll = voter.request(replica.version, poll=True, above=above)
        for request in (poll, dataclasses.replace(poll, poll=False)):
            election = Election(request, replica.holders)
            election.count(voter.answer(request, replica.version, trio.current_time()))

            async def ask(node_id: str, address: str, request=request, election=election) -> None:
                answer = await self._ask(node_id, address, lambda seq: VoteAsk(
                    seq, job_id, request.term, request.candidate, *request.version, request.poll))
                if answer is not None:
                    sender, reply = answer
                    if isinstance(reply, VoteReply) and sender == node_id and reply.job_id == job_id:
                        election.count(VoteAnswer(sender, reply.term, reply.granted, reply.why, reply.poll))

            async with trio.open_nursery() as nursery:
                for node_id, address in holders.items():
                    if node_id != self.node_id:
                        nursery.start_soon(ask, node_id, address)
            self._lines.log(logging.WARNING, "election", "job %s: %s", job_id, election.outcome())
            if not election.won:
                return election
        return election

    async def _ask(self, node_id: str, address: str, make) -> tuple | None:
        """Send `make(seq)` to another agent and wait up to ELECTION_S for the answer with that
        seq: (sender, message), or None."""
        self._seq += 1
        seq = self._seq
        answered, answer = self._asked[seq] = (trio.Event(), [])
        try:
            with trio.move_on_after(ELECTION_S):
                conn = await self.open_link(address, node_id)
                await conn.send(make(seq))
                await answered.wait()
                return answer[0]
        except (OSError, ConnectionLost, SwarmError):
            pass  # a holder that cannot be reached is no survivor
        finally:
            self._asked.pop(seq, None)
        return None

    def _take_over(self, replica: Replica) -> None:
        try:
            run = self.detached.take_over(replica)
        except (SwarmError, OSError) as exc:
            self._lines.log(logging.ERROR, "election", "cannot take over run %s: %s", replica.run_id, exc)
            return
        self._detached_nursery.start_soon(self.detached.watch, run)
        self._detached_nursery.start_soon(self._herald, run, replica)

    async def _herald(self, run: DetachedRun, replica: Replica) -> None:
        """While the successor's process starts (at most HERALD_S, and while it lives): ask the
        other holders for the new term's lease every LEASE_ASK_S in its name, as a Raft leader
        sends its first heartbeats at once. Their answers are not counted here: the asks only
        tell them that the term has a coordinator (quorum.Voter.on_coordinator)."""
        holders = {d["node_id"]: d["address"] for d in replica.devices.values()
                   if d["node_id"] in replica.holders and d["node_id"] != self.node_id}
        asks = itertools.count(1)

        async def ask(node_id: str, address: str) -> None:
            with trio.move_on_after(LEASE_ASK_S):
                try:
                    conn = await self.open_link(address, node_id)
                    await conn.send(LeaseAsk(next(asks), replica.job_id, replica.elected_term, replica.elected_by))
                except (OSError, ConnectionLost, SwarmError):
                    pass  # not reached now: the run's own lease counts it

        with trio.move_on_after(HERALD_S):
            while run.process is not None and run.process.poll() is None:
                async with trio.open_nursery() as nursery:
                    for node_id, address in holders.items():
                        nursery.start_soon(ask, node_id, address)
                await trio.sleep(LEASE_ASK_S)

    # -- detached runs ----------------------------------------------------------------

    async def _hold_detached(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The nursery of the detached runs' watches: cancelled last when the agent stops, and
        each run then has its time to stop with a checkpoint."""
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()

    def _run_command(self, run: DetachedRun) -> tuple[list[str], dict]:
        """`swarm train` with the run's flags, writing into its folder, reaching the swarm as
        this agent does."""
        network = self.config.network
        argv = [sys.executable, "-m", "swarm", "train", *run.args, "--save", str(run.folder / "checkpoint.pt"),
                "--metrics", str(run.folder / "metrics.jsonl"), "--state-dir", str(self.config.state_dir),
                "--run-id", run.job_id]
        if (run.folder / "replica.json").exists():  # a successor (swarm/agent/failover.py)
            argv += ["--take-over", str(run.folder / "replica.json")]
        if network.pinned:
            argv += ["--interface", network.interface]
        if self.config.peers:
            argv += ["--peers", ",".join(f"{h}:{p}" for h, p in self.config.peers)]
        env = {k: v for k, v in os.environ.items() if k != "SWARM_TOKEN_FILE"}
        env["SWARM_TOKEN"] = self.config.token
        root = str(Path(__file__).resolve().parents[2])  # this same swarm, wherever it was started from
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        return argv, env

    async def _detached_request(self, peer: Peer, msg) -> None:
        runs = self.detached
        try:
            if runs is None:
                raise SwarmError(f"{self.config.name} has no state directory to run detached jobs in")
            if isinstance(msg, DetachRead):
                # the state before the read: a run that has ended had written all its log by
                # then, so a reader told it ended has its last lines too (read after, the state
                # of a run that ended meanwhile came with a chunk that stops short of them)
                state = runs.get(msg.job_id).state
                version, total, data = await trio.to_thread.run_sync(runs.read, msg.job_id, msg.what, msg.offset)
                peer.reply(DetachChunk(msg.seq, "", version, msg.offset, total, data, state))
                return
            if isinstance(msg, DetachSubmit):
                run = runs.submit(msg.args)
                self._detached_nursery.start_soon(runs.watch, run)
                self._lines.log(logging.INFO, "detached", "coordinating detached run %s for node %s: swarm train %s",
                                run.job_id, peer.node_id, " ".join(run.args)[:500])
                jobs = runs.describe(run.job_id)
            elif isinstance(msg, DetachStop):
                runs.stop(msg.job_id)
                jobs = runs.describe(msg.job_id)
            else:
                jobs = runs.describe()
            peer.reply(DetachAnswer(msg.seq, "", jobs))
        except (SwarmError, OSError) as exc:
            error = str(exc) if isinstance(exc, SwarmError) else f"{exc.strerror or exc}"
            if isinstance(msg, DetachRead):
                peer.reply(DetachChunk(msg.seq, error, "", msg.offset, 0, b"", ""))
            else:
                peer.reply(DetachAnswer(msg.seq, error, []))

    def _heartbeat(self, seq: int) -> Heartbeat:
        job = self.job
        if job is None:
            return Heartbeat(seq, None, None, None, {})
        return Heartbeat(seq, job.job_id, job.epoch, job.state, dict(job.ctx.progress))

    async def _watch_heartbeats(self, peer: Peer) -> None:
        """A Heartbeat to a watcher whenever nothing else went to it for an interval: any
        message is a sign of life, and the job's own heartbeats carry the same."""
        peer.watching = True
        try:
            while peer.watch_interval:
                quiet = trio.current_time() - peer.conn.last_sent
                if quiet < peer.watch_interval:
                    await trio.sleep(peer.watch_interval - quiet)
                    continue
                if not self._job_beats_to(peer):
                    peer.heartbeat_seq += 1
                    await peer.conn.send(self._heartbeat(peer.heartbeat_seq))
                await trio.sleep(peer.watch_interval)
        except ConnectionLost:
            pass
        finally:
            peer.watching = False

    def _job_beats_to(self, peer: Peer) -> bool:
        """Whether the job's heartbeats go over this connection at least as often as it watches."""
        job = self.job
        return (job is not None and job.state != "released" and job.coordinator_id == peer.node_id
                and job.heartbeat_interval <= peer.watch_interval and self._coordinator(job) is peer)

    def _peer(self, node_id: str) -> Peer | None:
        peers = [p for p in self._peers.get(node_id, ()) if not p.conn.closed]
        return peers[-1] if peers else None

    async def send_to_node(self, node_id: str, message) -> None:
        """Send over the newest open connection to `node_id` (ourselves: deliver locally)."""
        if node_id == self.node_id:
            self._deliver(self.node_id, message)
            return
        peer = self._peer(node_id)
        if peer is None:
            raise ConnectionLost(f"no open connection to node {node_id}")
        await peer.conn.send(message)

    async def open_link(self, address, node_id: str | None = None) -> PeerConnection:
        """An authenticated connection to another agent, read by this agent like any other."""
        if node_id == self.node_id:
            raise ValueError("a job cannot open a connection to its own agent; send to ctx.node_id instead")
        if node_id is not None and (peer := self._peer(node_id)) is not None:
            return peer.conn
        host, port = parse_endpoint(address, DEFAULT_PORT) if isinstance(address, str) else address
        conn = await connect_peer(host, port, self.credentials, source_address=self.config.network.source_address,
                                  expected_peer_id=node_id)
        if self.job is not None:  # (those a run closed itself go: one job opens a few every epoch)
            self.job.links = [link for link in self.job.links if not link.released] + [conn]
        await self._nursery.start(self._converse, conn)
        return conn

    async def open_lane(self, address, node_id: str, hello: JobData) -> PeerConnection:
        """A new authenticated connection to `node_id`'s agent that its first message, `hello`,
        hands over to the run it names (swarm/execution/lane.py); not read here."""
        host, port = parse_endpoint(address, DEFAULT_PORT) if isinstance(address, str) else address
        conn = await connect_peer(host, port, self.credentials, source_address=self.config.network.source_address,
                                  expected_peer_id=node_id)
        if self.job is not None:
            self.job.links = [link for link in self.job.links if not link.released] + [conn]
        try:
            await conn.send(hello)
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise
        return conn

    # -- jobs -------------------------------------------------------------------------

    def _reply_state(self, peer: Peer | None, job_id: str, epoch: int, state: str, detail: str = "",
                     result: dict | None = None) -> None:
        if peer is not None and not peer.conn.closed:
            peer.reply(JobState(job_id, epoch, state, detail, result))

    def _coordinator(self, job: AgentJob) -> Peer | None:
        return self._peer(job.coordinator_id)

    async def _assign(self, peer: Peer, msg: JobAssign) -> None:
        refuse = None
        try:  # a kind's module may be slow to import (torch): not on the event loop
            runner = await trio.to_thread.run_sync(job_runner, msg.kind)
        except Exception as exc:  # noqa: BLE001 - a broken job module refuses the job, not the agent
            self._lines.log(logging.ERROR, "job kind", "cannot load job kind %s", msg.kind, exc_info=True)
            runner, refuse = None, f"job kind '{msg.kind}' cannot be loaded here: {type(exc).__name__}: {exc}"
        job = self.job
        if job is not None and job.job_id != msg.job_id and refuse is None:
            holder = self._coordinator(job)
            if holder is None or holder.conn.closed:  # its coordinator is gone: the new one may have us
                self._release(job, f"its coordinator is gone and node {peer.node_id} assigns job {msg.job_id}")
                job = None
        if not 0 < len(msg.job_id) <= MAX_NAME or not 0 < len(msg.kind) <= MAX_NAME or msg.epoch < 0:
            refuse = f"a job needs an id and a kind of 1-{MAX_NAME} characters and an epoch >= 0"
            msg.job_id = msg.job_id[:MAX_NAME]  # the reply need not carry all of a megabyte-long id back
        elif job is not None and job.job_id != msg.job_id:
            refuse = f"busy with job {job.job_id} of coordinator {job.coordinator_id}"
        elif term_of(msg.epoch) < self.terms.get(msg.job_id, 0):
            refuse = (f"fenced: a coordinator of term {self.terms[msg.job_id]} has taken the job over (this one's "
                      f"term is {term_of(msg.epoch)})")
        elif msg.job_id in self.voters and (why := self.voters[msg.job_id].on_coordinator(term_of(msg.epoch),
                                                                                          trio.current_time())):
            refuse = why
        elif job is not None and msg.epoch < job.epoch:
            refuse = f"epoch {msg.epoch} is older than the job's epoch {job.epoch}"
        elif runner is None and refuse is None:
            refuse = f"unknown job kind '{msg.kind}' (this agent runs swarm {__version__})"
        if refuse:
            self._lines.log(logging.WARNING, "refused job", "refused job %.40s epoch %d from node %s: %s", msg.job_id,
                            msg.epoch, peer.node_id, refuse)
            self._reply_state(peer, msg.job_id, msg.epoch, "refused", refuse)
            return
        interval = max(MIN_INTERVAL, msg.heartbeat_interval)
        self._note_term(msg.job_id, term_of(msg.epoch))
        if job is not None and msg.epoch == job.epoch:  # the same assignment again: re-attach
            job.coordinator_id = peer.node_id
            job.coordinator_changed.set()
            self._reply_state(peer, job.job_id, job.epoch, job.state, job.detail, job.result)
            return
        ctx = JobContext(self, msg.job_id, msg.epoch, msg.kind, msg.spec, peer.node_id)
        if job is None:
            job = AgentJob(msg.job_id, msg.kind, peer.node_id, interval)
            job.ctx = ctx
            self.job = job
            await self._nursery.start(self._job_lifetime, job)
        else:
            if job.run_scope is not None:
                job.run_scope.cancel()
            job.ctx, job.coordinator_id, job.kind, job.heartbeat_interval = ctx, peer.node_id, msg.kind, interval
            job.coordinator_changed.set()
        job.state, job.detail, job.result, job.run_scope = "assigned", "", None, None
        self._lines.log(logging.INFO, "assigned", "assigned job %s epoch %d (%s) by node %s", msg.job_id, msg.epoch,
                        msg.kind, peer.node_id)
        self._reply_state(peer, msg.job_id, msg.epoch, "assigned")
        self._release_early(job)

    def _lifecycle(self, peer: Peer, msg) -> None:
        job = self.job
        if len(msg.job_id) > MAX_NAME:  # no job has such an id: not worth a reply that carries it back
            self._lines.log(logging.WARNING, "long job id", "ignored %s from node %s: a job id of %d characters",
                            type(msg).__name__, peer.node_id, len(msg.job_id))
            return
        if job is None or job.job_id != msg.job_id or job.epoch != msg.epoch:
            held = f"job {job.job_id} epoch {job.epoch}" if job else "no job"
            self._reply_state(peer, msg.job_id, msg.epoch, "refused", f"this agent holds {held}")
            return
        if peer.node_id != job.coordinator_id:
            self._reply_state(peer, msg.job_id, msg.epoch, "refused", f"node {peer.node_id} is not the coordinator "
                                                                      f"of job {job.job_id}")
            return
        if isinstance(msg, JobStart):
            if job.state == "running":
                self._reply_state(peer, job.job_id, job.epoch, "running", "already running")
                return
            job.state, job.detail, job.result = "running", "", None
            job.run_scope = trio.CancelScope()
            job.nursery.start_soon(self._run, job, job.ctx, job.run_scope)
            self._reply_state(peer, job.job_id, job.epoch, "running")
        elif isinstance(msg, JobStop):
            if job.run_scope is not None:
                job.run_scope.cancel()
            if job.state == "running":
                job.state, job.detail = "stopped", msg.reason
            self._reply_state(peer, job.job_id, job.epoch, job.state, job.detail, job.result)
        else:
            self._release(job, f"released by node {peer.node_id}")
            self._reply_state(peer, job.job_id, job.epoch, "released")

    def _release(self, job: AgentJob, why: str) -> None:
        self._lines.log(logging.INFO, "left", "left job %s epoch %d: %s", job.job_id, job.epoch, why)
        job.scope.cancel()
        job.state = "released"
        if self.job is job:
            self.job = None
        self._early.keep(lambda early: early.message.job_id != job.job_id)

    async def _job_lifetime(self, job: AgentJob, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeats to the coordinator and the orphan watch, from assignment to release."""
        try:
            with job.scope:
                async with trio.open_nursery() as nursery:
                    job.nursery = nursery
                    nursery.start_soon(self._job_heartbeats, job)
                    nursery.start_soon(self._orphan_watch, job)
                    task_status.started()
        finally:
            with trio.CancelScope(shield=True):  # all at once: each may wait up to a second on a cut peer
                async with trio.open_nursery() as closing:
                    for link in job.links:
                        closing.start_soon(link.aclose, "job released")
                # The job's activations stayed in the heap for reuse until now. In a thread: a
                # large heap's trim can take seconds, and this loop answers the coordinator.
                await trio.to_thread.run_sync(malloc.release)

    async def _after(self, run_ended: trio.Event | None) -> None:
        """Before a run allocates anything: wait for the job's previous run (an older epoch,
        cancelled by a re-plan) to end, and give back what earlier work left in the heap. A
        cancelled run finishes the layer its compute thread is in (threads cannot be
        interrupted), and its modules, optimizer state and autograd graphs sit in reference
        cycles until collected: started beside it, the new epoch's stages were allocated on
        top of the old ones, and a device planned for one set of stages held two (a
        re-planned 1 GiB device was killed for memory that way). The first run of a job
        follows other jobs (the profile a coordinator asks for first): a 2 GiB device
        started training holding 895 MiB of its profile's heap. (An agent's first run has
        nothing to give back and starts at once.)"""
        if run_ended is not None:
            await run_ended.wait()
        if self.runs_ended:
            await trio.to_thread.run_sync(malloc.release)

    async def _job_heartbeats(self, job: AgentJob) -> None:
        seq = 0
        while True:
            coordinator = self._coordinator(job)
            if coordinator is not None:
                seq += 1
                try:
                    await coordinator.conn.send(self._heartbeat(seq))
                except ConnectionLost:
                    pass
            await trio.sleep(job.heartbeat_interval)

    async def _orphan_watch(self, job: AgentJob) -> None:
        while True:
            if self._coordinator(job) is not None:
                await job.coordinator_changed.wait()
                job.coordinator_changed = trio.Event()
                continue
            self._lines.log(logging.WARNING, "orphan", "coordinator %s of job %s disconnected; waiting %g s for it to "
                            "come back", job.coordinator_id, job.job_id, self.config.orphan_timeout)
            with trio.move_on_after(self.config.orphan_timeout):
                while self._coordinator(job) is None:
                    await job.coordinator_changed.wait()
                    job.coordinator_changed = trio.Event()
                continue
            self._release(job, f"its coordinator stayed away for {self.config.orphan_timeout:g} s")
            return

    async def _run(self, job: AgentJob, ctx: JobContext, scope: trio.CancelScope) -> None:
        runner = job_runner(ctx.kind)
        state, detail, result = "done", "", None
        before, job.run_ended = job.run_ended, trio.Event()
        ended = job.run_ended
        try:
            with scope:
                await self._after(before)
                value = await runner(ctx)
                result = value if isinstance(value, dict) or value is None else {"value": value}
        except Exception as exc:  # the job's own failure: reported, the agent goes on
            self._lines.log(logging.ERROR, "job failed", "job %s epoch %d (%s) failed", ctx.job_id, ctx.epoch, ctx.kind,
                            exc_info=True)
            state, detail = "failed", describe_failure(exc)
        finally:
            self.runs_ended += 1
            ended.set()
        if scope.cancelled_caught:
            state, detail = "stopped", job.detail
        if job.ctx is not ctx or self.job is not job:  # a newer epoch or a release took over
            return
        job.state, job.detail, job.result, job.run_scope = state, detail, result, None
        self._lines.log(logging.INFO, "job ended", "job %s epoch %d %s%s", ctx.job_id, ctx.epoch, state,
                        f": {detail}" if detail else "")
        self._reply_state(self._coordinator(job), ctx.job_id, ctx.epoch, state, detail, result)

    def _deliver(self, sender: str, message) -> None:
        """Route a job-data message to the current job's context, after the epoch check."""
        job = self.job
        if job is None or message.job_id != job.job_id or message.epoch > job.epoch:
            self._early.hold(sender, message, trio.current_time())
            return
        if message.epoch < job.epoch:
            self._refuse(sender, message, "stale", f"epoch {message.epoch} is older than the job's epoch {job.epoch}")
            return
        job.ctx.deliver(sender, message)

    # -- messages that came before their job (held by early.EarlyMessages) -------------

    def _release_early(self, job: AgentJob) -> None:
        for lane in [lane for lane in self._early_lanes if lane[2].job_id == job.job_id and lane[2].epoch <= job.epoch]:
            self._early_lanes.remove(lane)
            _, sender, hello, conn = lane
            if hello.epoch == job.epoch:
                job.links.append(conn)
                job.ctx.deliver_lane(sender, hello, conn)
            else:
                self._nursery.start_soon(conn.aclose, "stale")
        for early in self._early.keep(lambda e: e.message.job_id != job.job_id or e.message.epoch > job.epoch):
            if early.message.epoch == job.epoch:
                job.ctx.deliver(early.sender, early.message)
            else:
                self._refuse(early.sender, early.message, "stale",
                             f"epoch {early.message.epoch} is older than the job's epoch {job.epoch}")

    def _refuse(self, sender: str, message, kind: str, why: str) -> None:
        self.refused_messages += 1
        self._lines.log(logging.WARNING, f"refused {kind}", "refused %s of job %.40s epoch %s from node %s: %s",
                        type(message).__name__, message.job_id, message.epoch, sender, why)
