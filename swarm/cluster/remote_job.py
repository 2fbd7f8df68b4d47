"""A job as the coordinator drives it: assign, start, stop and release it on agents, exchange
its messages, and wait for results.

    job = roster.job("train-1", epoch=0)
    await job.assign(node, "bandwidth", spec)      # JobError if the agent refuses
    await job.start(node)
    failed = await job.assign_and_start("bandwidth", {n: spec for n in nodes})  # or many at once
    await job.send(node, job.data("probe", {...}))
    sender, msg = await job.receive("probe-result")
    result = await job.wait_done(node)              # JobError if it failed or its device died
    await job.release_all()

A re-plan makes a new handle for the same job id at a higher epoch (roster.job(id, e+1));
from then on messages of the older epoch are refused here as on the agents.
"""
from __future__ import annotations

import logging
import math

import trio

from swarm.agent.jobs import Inbound
from swarm.errors import SwarmError
from swarm.net.peer import ConnectionLost
from swarm.wire import JobAssign, JobData, JobRelease, JobStart, JobState, JobStop, channel_of

log = logging.getLogger("swarm.cluster")

FINISHED = frozenset({"done", "failed", "stopped", "released", "refused"})


# An assignment is answered once the agent has imported the job's kind, torch with it for
# training: 11 s for a 0.3-core testbed device on a busy host, over 30 s under a test suite's
# load, longer on the smallest boards. A device that dies meanwhile is lost by its heartbeats
# and ends the wait at once; this bounds only a live device that does not answer.
ASSIGN_TIMEOUT_S = 120.0


class JobError(SwarmError):
    """An agent refused or failed a job, or its device died during it."""


class CoordinatorJob:
    def __init__(self, cluster, job_id: str, epoch: int, heartbeat_interval: float):
        self.cluster = cluster
        self.job_id = job_id
        self.epoch = epoch
        self.heartbeat_interval = heartbeat_interval
        self.states: dict[str, JobState] = {}      # latest JobState per node
        self.nodes: set[str] = set()               # nodes assigned at this epoch
        self.lost: dict[str, str] = {}             # node -> why it is gone
        self.refused_messages = 0
        self._changed = trio.Event()
        self._queues: dict[str, tuple] = {}

    # -- lifecycle --------------------------------------------------------------------

    async def assign(self, node_id: str, kind: str, spec: dict, *, timeout: float = ASSIGN_TIMEOUT_S) -> JobState:
        state = await self._request(node_id, JobAssign(self.job_id, self.epoch, kind, spec, self.heartbeat_interval),
                                    timeout)
        if state.state == "refused":
            raise JobError(f"{self._name(node_id)} refused job {self.job_id}: {state.detail}")
        self.nodes.add(node_id)
        self.cluster.note_assigned()
        return state

    async def start(self, node_id: str, *, timeout: float = 10.0) -> JobState:
        return await self._checked(node_id, JobStart(self.job_id, self.epoch), timeout)

    async def assign_and_start(self, kind: str, specs: dict[str, dict], *,
                               all_or_raise: bool = False) -> dict[str, Exception]:
        """Assign `kind` to every node of `specs` ({node id: its spec}) and start it there, all
        at once: a slow device's answers hold up no other's start. {node id: the error} for
        each node that refused, could not be reached or did not answer in time; with
        `all_or_raise`, the first of those errors (in `specs`' order) is raised instead."""
        failed: dict[str, Exception] = {}

        async def one(node_id: str) -> None:
            try:
                await self.assign(node_id, kind, specs[node_id])
                await self.start(node_id)
            except (SwarmError, ConnectionLost, trio.TooSlowError) as exc:
                failed[node_id] = exc

        async with trio.open_nursery() as nursery:
            for node_id in specs:
                nursery.start_soon(one, node_id)
        if failed and all_or_raise:
            raise failed[next(n for n in specs if n in failed)]
        return failed

    async def stop(self, node_id: str, reason: str = "stopped by the coordinator", *, timeout: float = 10.0):
        return await self._checked(node_id, JobStop(self.job_id, self.epoch, reason), timeout)

    async def release(self, node_id: str, *, timeout: float = 10.0) -> JobState:
        state = await self._checked(node_id, JobRelease(self.job_id, self.epoch), timeout)
        self.nodes.discard(node_id)
        return state

    async def release_all(self) -> None:
        """Release every node still assigned (best effort: dead ones are skipped)."""
        for node_id in sorted(self.nodes):
            try:
                await self.release(node_id, timeout=5.0)
            except (JobError, trio.TooSlowError):
                pass

    async def wait_done(self, node_id: str) -> dict:
        """The result of the node's run; JobError if it failed, stopped, or its device died."""
        while True:
            if node_id in self.lost:
                raise JobError(f"{self._name(node_id)} was lost during job {self.job_id}: {self.lost[node_id]}")
            state = self.states.get(node_id)
            if state is not None and state.state in FINISHED:
                if state.state == "done":
                    return state.result or {}
                raise JobError(f"job {self.job_id} on {self._name(node_id)} {state.state}"
                               + (f": {state.detail}" if state.detail else ""))
            await self._changed.wait()

    # -- messages ---------------------------------------------------------------------

    def data(self, channel: str, body=None) -> JobData:
        return JobData(self.job_id, self.epoch, channel, body)

    async def send(self, node_id: str, message) -> None:
        await self.cluster.send(node_id, message)

    async def receive(self, channel: str) -> Inbound:
        return await self._queue(channel)[1].receive()

    # -- called by the cluster --------------------------------------------------------

    def on_state(self, node_id: str, state: JobState) -> None:
        if state.epoch != self.epoch:
            return
        self.states[node_id] = state
        self._notify()

    def deliver(self, node_id: str, message) -> None:
        if message.epoch < self.epoch:
            self.refused_messages += 1
            log.warning("refused %s of job %s from %s: epoch %d is older than %d", type(message).__name__,
                        self.job_id, self._name(node_id), message.epoch, self.epoch)
            return
        self._queue(channel_of(message))[0].send_nowait(Inbound(node_id, message))

    def on_lost(self, node_id: str, why: str) -> None:
        self.lost[node_id] = why
        self._notify()

    def on_back(self, node_id: str) -> None:
        self.lost.pop(node_id, None)

    # -- inside -----------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _name(self, node_id: str) -> str:
        device = self.cluster.device(node_id)
        return device.name if device and device.name != "?" else f"node {node_id}"

    async def _request(self, node_id: str, message, timeout: float) -> JobState:
        """Send a lifecycle message and wait for the JobState that answers it."""
        current = self.cluster._jobs.get(self.job_id)
        if current is not self:
            raise JobError(f"job {self.job_id} epoch {self.epoch} was superseded by epoch "
                           f"{current.epoch if current else '?'}: use the newer handle")
        before = self.states.get(node_id)
        with trio.fail_after(timeout):
            await self.cluster.send(node_id, message)
            while True:
                if node_id in self.lost:
                    raise JobError(f"{self._name(node_id)} was lost: {self.lost[node_id]}")
                state = self.states.get(node_id)
                if state is not None and state is not before:
                    return state
                await self._changed.wait()

    async def _checked(self, node_id: str, message, timeout: float) -> JobState:
        state = await self._request(node_id, message, timeout)
        if state.state == "refused":
            raise JobError(f"{self._name(node_id)} refused {type(message).__name__}: {state.detail}")
        return state

    def _queue(self, channel: str):
        if channel not in self._queues:
            self._queues[channel] = trio.open_memory_channel(math.inf)
        return self._queues[channel]
