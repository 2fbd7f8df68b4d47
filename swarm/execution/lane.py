"""Gradient sums on a lane of their own: sealed connections that carry only a group's
gradient shares, driven by blocking calls from worker threads rather than by the event loop.

Where a device is bound by its CPU quota, what a sum costs in CPU is taken from the compute.
Moved by the event loop, each share wakes it about ten times as the send buffer drains, and
the loop's tasks, locks and turns around every wake-up cost more than the kernel and the
sealing together (bench/RESULTS.md, 2026-12-04). A thread that moves a whole share with
blocking calls pays for none of that.

- **The lanes.** For each stage it sums, a run opens one connection to each other member of
  the stage's group (JobContext.open_lane: the agents' handshake and sealed records; the
  blocking end of one is swarm.agent.lane.Lane) and sends its shares on it; the member at
  the far end receives them on it. The first message on a lane, its hello, names the job,
  the epoch, the stage and the sender; the far end's agent hands the connection to that run
  (SumLanes.pump) instead of reading it.
- **The sum** is collectives._direct's: member i sends chunk j to member j, sums its own
  chunk from every member's in member order, and sends the sum to every other. In round k
  member i sends to member i + k and receives from member i - k, so each lane's shares come
  in the order they are read; one thread sends (a pool of one per stage) while the calling
  thread receives, each share straight into the records' buffers, opened there. Every
  member ends with the bits collectives.allreduce_sum gives.
- **Order.** A stage's buckets go on its lanes one after another in the plan's order
  (Stage.sum_order, by default top layer first; GradReducer waits for each turn), and steps
  follow each other, so every share's key is known before it comes: it is checked, not
  looked up.
- **Failures.** A share whose key, shape or seal is wrong breaks the lane: it is reported
  like a broken link (the coordinator handles it as the loss of the far end) and the sum
  waits for the re-plan. A lane closed by the far end (its run ended, or it died, which the
  coordinator sees itself) makes the sum wait too, unreported. A share that does not come
  within the job's timeout raises trio.TooSlowError, as a mailbox would. A cancelled run
  shuts its lanes' sockets down, which wakes its blocked threads at once.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

import trio

from swarm.agent.jobs import LANE  # the job channel of a lane's hello and shares
from swarm.agent.lane import FOREVER_S, Lane, LaneBroken
from swarm.execution.links import LINK_ERRORS

if TYPE_CHECKING:
    import torch

log = logging.getLogger("swarm.execution")


class LaneOffer(NamedTuple):
    """A lane another run opened to this one: its hello's body and the connection."""
    body: dict
    conn: object


def direct_sum(me: int, outs: list[Lane | None], intos: list[Lane | None], key: list, flat: torch.Tensor,
               sender: ThreadPoolExecutor, timeout: float | None, weights: list[int] | None = None) -> None:
    """collectives._direct on lanes, in the calling thread (receiving) and `sender`'s: the
    sum of `flat` over the group, made in `flat`, member j owning the chunk chunk_bounds gives
    it for `weights`. outs[j] and intos[j]: the lanes to and from member j (None for ourselves)."""
    import torch  # (here: the bandwidth probe uses lanes without loading torch)

    from swarm.execution.collectives import chunk_bounds

    n = len(outs)
    data = flat.numpy()
    bounds = chunk_bounds(flat.numel(), n, weights)
    chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(n)]
    arrays = [data[bounds[i]:bounds[i + 1]] for i in range(n)]
    mine = chunks[me]

    def wait(sends) -> None:
        for sending in sends:
            sending.result()

    order = [(me + k) % n for k in range(1, n)]  # round k: to member me + k, from member me - k
    sends = [sender.submit(outs[j].send, [*key, "ds", me], arrays[j], timeout) for j in order]
    parts = {}
    for k in range(1, n):
        src = (me - k) % n
        parts[src] = torch.from_numpy(intos[src].receive([*key, "ds", src], arrays[me], timeout))
    wait(sends)
    # member 0's share, then 1's added, and so on: the order collectives._direct keeps
    total = (mine if me == 0 else parts[0]).clone()
    for src in range(1, n):
        total.add_(mine if src == me else parts[src])
    mine.copy_(total)
    sends = [sender.submit(outs[j].send, [*key, "dg", me], arrays[me], timeout) for j in order]
    for k in range(1, n):
        src = (me - k) % n
        chunks[src].copy_(torch.from_numpy(intos[src].receive([*key, "dg", src], arrays[src], timeout)))
    wait(sends)


class SumLanes:
    """A run's lanes. `open_lane(address, node_id, hello)` opens one (JobContext.open_lane);
    `offers()` waits for the next lane another run opened to us (an Inbound of a LaneOffer);
    `report(name, why)` reports a broken link."""

    def __init__(self, me: str, devices: dict[str, dict], job_id: str, epoch: int,
                 open_lane: Callable[..., Awaitable], offers: Callable[[], Awaitable],
                 report: Callable[[str, str], Awaitable[None]]):
        self.me = me
        self.devices = devices
        self.job_id, self.epoch = job_id, epoch
        self._open_lane = open_lane
        self._offers = offers
        self._report = report
        self.out: dict[tuple[int, str], Lane] = {}   # (stage, far end) -> the lane we send on
        self.into: dict[tuple[int, str], Lane] = {}  # (stage, far end) -> the lane we receive on
        self._arrived: dict[tuple[int, str], trio.Event] = {}
        self._opening: dict[int, trio.Lock] = {}
        self._senders: dict[int, ThreadPoolExecutor] = {}
        self.broken: LaneBroken | None = None  # the first failure: no lane is used after it
        self._closing = False

    async def pump(self) -> None:
        """File the lanes other runs open to us (a task of the run)."""
        while True:
            sender, offer = await self._offers()
            body, conn = offer
            name, stage = (body.get("from"), body.get("stage")) if isinstance(body, dict) else (None, None)
            device = self.devices.get(name) if isinstance(name, str) else None
            if device is None or device["node_id"] != sender or type(stage) is not int \
                    or (stage, name) in self.into or self._closing:
                log.warning("refused a lane from node %s (%.80r)", sender, body)
                await conn.aclose("refused")
                continue
            self.into[(stage, name)] = Lane(conn, name, self.job_id, self.epoch)
            self._arrived.setdefault((stage, name), trio.Event()).set()

    async def _ready(self, stage: int, group: list[str], timeout: float) -> None:
        """Our lanes to the others of `group` open, and theirs to us arrived."""
        others = [name for name in group if name != self.me]
        failed: list[tuple[str, str]] = []
        async with self._opening.setdefault(stage, trio.Lock()):
            async with trio.open_nursery() as nursery:
                for name in others:
                    if (stage, name) not in self.out:
                        nursery.start_soon(self._open, stage, name, failed)
        if failed:
            raise LaneBroken(*failed[0], report=True)
        with trio.fail_after(timeout):
            for name in others:
                await self._arrived.setdefault((stage, name), trio.Event()).wait()
        if stage not in self._senders:
            self._senders[stage] = ThreadPoolExecutor(1, thread_name_prefix=f"lane-{stage}")
            log.info("stage %d: gradient sums on lanes of their own with %s", stage, ", ".join(others))

    async def _open(self, stage: int, name: str, failed: list) -> None:
        device = self.devices[name]
        try:
            conn = await self._open_lane(device["address"], device["node_id"], {"from": self.me, "stage": stage})
        except LINK_ERRORS as exc:
            failed.append((name, f"cannot open it: {type(exc).__name__}: {exc}"))
            return
        self.out[(stage, name)] = Lane(conn, name, self.job_id, self.epoch)

    async def allreduce(self, stage: int, group: list[str], key: tuple, flat: torch.Tensor,
                        timeout: float = math.inf, weights: list[int] | None = None) -> torch.Tensor:
        """The sum of `flat` (1-D, on the host) over `group`, made in `flat`; the same bits as
        collectives.allreduce_sum's direct sum, with chunks owned by `weights` as there. Calls
        for one stage must come one at a time, in the same order on every member."""
        if self.broken is None:
            try:
                await self._ready(stage, group, timeout)
            except LaneBroken as exc:
                self.broken = exc
                await self._lost(exc.name, exc.why)
        if self.broken is not None:
            await trio.sleep_forever()  # the re-plan that a lost member brings cancels us
        me = group.index(self.me)
        outs = [None if name == self.me else self.out[(stage, name)] for name in group]
        intos = [None if name == self.me else self.into[(stage, name)] for name in group]
        sender = self._senders[stage]
        wait = timeout if timeout < FOREVER_S else FOREVER_S  # (never None: that would make the socket blocking)
        finished, failure = False, None

        async def shut_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                if not finished:
                    self._closing = True
                    self.shutdown()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(shut_when_cancelled)
            try:
                await trio.to_thread.run_sync(direct_sum, me, outs, intos, [*key], flat, sender, wait, weights)
            except (LaneBroken, TimeoutError) as exc:
                failure = exc
            finished = True
            nursery.cancel_scope.cancel()
        await trio.lowlevel.checkpoint_if_cancelled()
        if isinstance(failure, TimeoutError):
            raise trio.TooSlowError(f"no share of {key!r} within {timeout:g} s")
        if failure is not None:
            self.broken = failure
            if failure.report and not self._closing:
                await self._lost(failure.name, failure.why)
            else:
                log.info("%s; waiting for the re-plan", failure)
            await trio.sleep_forever()
        return flat

    async def _lost(self, name: str, why: str) -> None:
        log.warning("lane to %s broke (%s); telling the coordinator", name, why)
        await self._report(name, f"lane: {why}")

    def shutdown(self) -> None:
        for lane in (*self.out.values(), *self.into.values()):
            lane.shutdown()

    async def aclose(self) -> None:
        """Shut every lane down and close it (the threads wake and return at once)."""
        self._closing = True
        self.shutdown()
        lanes = [*self.out.values(), *self.into.values()]
        self.out, self.into = {}, {}
        with trio.CancelScope(shield=True):
            for sender in self._senders.values():  # (a descriptor is closed only once no thread uses it)
                await trio.to_thread.run_sync(lambda s=sender: s.shutdown(wait=True, cancel_futures=True))
            for lane in lanes:
                lane.sock.close()
                await lane.conn.aclose("the run ended")
