"""The job seam: work kinds the agent runs without knowing them, and the JobContext they get.

A job kind is an async function taking a JobContext and returning a result dict:

    @job_kind("echo")
    async def run_echo(ctx: JobContext) -> dict:
        sender, msg = await ctx.receive("ping")                  # per-channel inbound queue
        await ctx.send(sender, ctx.data("pong", msg.body))       # to the coordinator or a peer
        total = await ctx.run_in_thread(sum, range(10**6))       # compute off the event loop
        return {"total": total}

Kinds are looked up by name in JOB_KINDS, which maps a kind to its function or to a
"module:function" path imported on first use (so an agent never imports torch until a
job needs it). Heartbeats to the coordinator run by themselves while the agent holds a
job; ctx.progress is sent with each one.
"""
from __future__ import annotations

import importlib
import math
import sys
import threading
from typing import Awaitable, Callable, NamedTuple

import trio

from swarm.host import malloc, torch_libs
from swarm.wire import JobData, channel_of

JobRunner = Callable[["JobContext"], Awaitable[dict | None]]

LANE = "lane"  # the job channel whose first message makes a connection a run's lane (swarm.execution.lane)

# kind -> runner, or "module:function" imported when the kind is first run.
JOB_KINDS: dict[str, JobRunner | str] = {
    "bandwidth": "swarm.profiling.bandwidth:run_bandwidth_job",
    "train": "swarm.execution.train_job:run_train_job",
    "profile": "swarm.profiling.profiler:run_profile_job",
}


# kinds whose code imports torch: its native library is loaded first without the interpreter lock
NEEDS_TORCH = frozenset({"train", "profile"})


def register_job_kind(kind: str, runner: JobRunner | str) -> None:
    JOB_KINDS[kind] = runner


def job_kind(kind: str):
    """Decorator form of register_job_kind."""

    def register(runner: JobRunner) -> JobRunner:
        register_job_kind(kind, runner)
        return runner

    return register


def job_runner(kind: str) -> JobRunner | None:
    """The runner of `kind`, importing it if registered by path; None if unknown. Importing
    may take seconds (torch): call it from a worker thread."""
    runner = JOB_KINDS.get(kind)
    if kind in NEEDS_TORCH:
        torch_libs.preload()
    if isinstance(runner, str):
        module, _, name = runner.partition(":")
        first_torch = "torch" not in sys.modules
        with malloc.no_collections():  # an import makes few cycles and walks the rest many times
            runner = getattr(importlib.import_module(module), name)
            if first_torch and "torch" in sys.modules:
                # torch's modules live as long as the agent; no job has held a tensor yet, so
                # nothing a job drops later is frozen with them
                malloc.freeze_imports()
        JOB_KINDS[kind] = runner
    return runner


async def _set_when_cancelled(stop: threading.Event) -> None:
    try:
        await trio.sleep_forever()
    finally:
        stop.set()


class Inbound(NamedTuple):
    """A job message as delivered: who sent it (node id) and the message."""
    sender: str
    message: object


class JobContext:
    """What a job's code sees of the agent for one (job id, epoch).

    Messages of an older epoch never reach it (the agent refuses them); a re-assignment
    at a newer epoch cancels this run and gives the new one a fresh context.
    """

    def __init__(self, agent, job_id: str, epoch: int, kind: str, spec: dict, coordinator_id: str):
        self._agent = agent
        self.job_id = job_id
        self.epoch = epoch
        self.kind = kind
        self.spec = spec
        self.coordinator_id = coordinator_id
        self.progress: dict = {}  # sent with every heartbeat; keep it small
        self.compute_limiter = trio.CapacityLimiter(1)  # one compute thread at a time by default
        self._queues: dict[str, tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]] = {}

    @property
    def node_id(self) -> str:
        return self._agent.node_id

    @property
    def name(self) -> str:
        return self._agent.config.name

    def spare_memory(self) -> int:
        """What the device can spare now, less the agent's reserve (Agent.spare_memory)."""
        return self._agent.spare_memory()

    # -- messages ---------------------------------------------------------------------

    def data(self, channel: str, body=None) -> JobData:
        """A JobData message of this job and epoch (body: any msgpack value, numpy arrays allowed)."""
        return JobData(self.job_id, self.epoch, channel, body)

    async def send(self, node_id: str, message) -> None:
        """Send to a node of this job over any open connection to it (the coordinator, or a
        peer that connected to us or we to it). To ourselves: delivered locally, not copied."""
        await self._agent.send_to_node(node_id, message)

    async def send_to_coordinator(self, message) -> None:
        await self._agent.send_to_node(self.coordinator_id, message)

    async def connect(self, address: str | tuple[str, int], node_id: str | None = None):
        """An authenticated connection to another agent ("host:port"); reused if one to
        `node_id` is open. Messages arriving on it go to this job's channel queues."""
        return await self._agent.open_link(address, node_id)

    async def open_lane(self, address: str | tuple[str, int], node_id: str, body: dict):
        """A new connection to `node_id`'s agent whose first message (on channel "lane", with
        `body`) hands it to this job's run of this epoch there (deliver_lane); not read by our
        agent. For the run's gradient-sum lanes (swarm/execution/lane.py)."""
        return await self._agent.open_lane(address, node_id, self.data(LANE, body))

    def deliver_lane(self, sender: str, hello, conn) -> None:
        """Called by the agent: a lane another run opened to this one, queued on channel
        "lane" as an Inbound of (hello's body, connection)."""
        self._queue(LANE)[0].send_nowait(Inbound(sender, (hello.body, conn)))

    async def receive(self, channel: str) -> Inbound:
        """The next message on `channel` (waits). Use trio.fail_after for a deadline."""
        return await self._queue(channel)[1].receive()

    def receive_nowait(self, channel: str) -> Inbound:
        """The next message on `channel`, or trio.WouldBlock."""
        return self._queue(channel)[1].receive_nowait()

    def deliver(self, sender: str, message) -> None:
        """Called by the agent: queue a message for this context (unbounded queues: the job's
        schedule, not the transport, bounds how much is in flight)."""
        self._queue(channel_of(message))[0].send_nowait(Inbound(sender, message))

    # -- compute ----------------------------------------------------------------------

    async def run_in_thread(self, fn, *args, stop: threading.Event | None = None):
        """fn(*args) in a worker thread while the event loop keeps moving messages and
        heartbeats. A cancelled job waits for fn to return (threads cannot be interrupted);
        with `stop`, cancelling sets it, for a long fn to look at between its pieces of work
        and give up early (whatever fn then returns or raises, the caller sees the cancellation)."""
        if stop is None:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.compute_limiter)
        value, error = None, None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_set_when_cancelled, stop)
            try:  # fn's failure is raised outside the nursery, as itself rather than in a group
                value = await trio.to_thread.run_sync(fn, *args, limiter=self.compute_limiter)
            except Exception as exc:
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            await trio.lowlevel.checkpoint_if_cancelled()  # called off: the caller sees that instead
            raise error
        return value

    def _queue(self, channel: str):
        if channel not in self._queues:
            self._queues[channel] = trio.open_memory_channel(math.inf)
        return self._queues[channel]
