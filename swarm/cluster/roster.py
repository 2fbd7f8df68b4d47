"""The roster of agents a coordinator works with: find them (mDNS and --peers), keep a connection to
each, track who is alive, and carry job messages.

    async with open_roster(credentials, network, peers=[("10.0.0.5", 4750)]) as roster:
        devices = await roster.wait_for(4, timeout=10)
        events = roster.subscribe()               # MembershipEvent: joined/suspect/dead/...
        job = roster.job("j1", epoch=0)

Each agent is asked for heartbeats (Watch) on its connection. A broken connection makes
the device suspect at once; the probe is a Ping on the connection or, if it is gone, a
reconnection within the probe timeout; no answer makes it dead.
"""
from __future__ import annotations

import itertools
import logging
import math
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from swarm.cluster.members import Member
from swarm.cluster.membership import Membership, MembershipEvent
from swarm.cluster.remote_job import CoordinatorJob
from swarm.net import (ConnectionLost, Credentials, HandshakeFailed, NetworkChoice, PeerUnavailable, connect_peer,
                       parse_endpoint)
from swarm.net.discovery import DeviceGone, DeviceSeen, browse, open_zeroconf
from swarm.wire import (DetachAnswer, DetachChunk, Heartbeat, Info, InfoRequest, JobState, LeaseAnswer, Ping, Pong,
                        RemoteProtocolError, Watch)

log = logging.getLogger("swarm.cluster")

DEFAULT_AGENT_PORT = 4750
RETRY_MIN, RETRY_MAX, RETRY_REFUSED = 0.1, 2.0, 10.0
MAX_STRANGERS = 256  # other swarms' devices remembered (to log each once), whatever a LAN advertises


class Roster:
    """Use open_roster(); the attributes below are read-only for callers."""

    def __init__(self, credentials: Credentials, network: NetworkChoice, *, peers=(), discover: bool = True,
                 heartbeat_interval: float = 0.25, suspect_after: float | None = None, probe_timeout: float = 0.5,
                 connect_timeout: float = 3.0):
        self.credentials = credentials
        self.network = network
        self.discover = discover
        self.heartbeat_interval = heartbeat_interval
        self.connect_timeout = connect_timeout
        self.membership = Membership(self._probe, interval=heartbeat_interval, suspect_after=suspect_after,
                                     probe_timeout=probe_timeout, in_message=self._in_message)
        # The heartbeats asked of an agent (Watch): every heartbeat interval, but no more than three
        # within the silence that makes it suspect (the default deadline's ratio). A training
        # coordinator (a 0.25 s interval, suspect after 2 s) hears each idle agent every 0.67 s,
        # not four times a second: at 64 agents its receiving them was 5% of a core at rest. The
        # agents of a job beat at the same pace (CoordinatorJob), and its beats to them (_beat)
        # too: a beat costs a device about half a millisecond of CPU to send or take, so four a
        # second each way took about 4% of a 0.1-core device's quota while it trained (its event
        # loop 10% in all: yolov2-16 on the mixed testbed, bench/RESULTS.md 2026-12-05 12:16).
        self.watch_interval = max(heartbeat_interval, self.membership.suspect_after / 3)
        self._static_peers = list(peers)
        self._devices: dict[str, Member] = {}             # node id (or "host:port" before a handshake) -> Member
        self._endpoints: dict[tuple[str, int], tuple[trio.CancelScope, str | None]] = {}  # -> (loop, node id)
        self._jobs: dict[str, CoordinatorJob] = {}
        self._strangers: set[str] = set()  # node ids whose adverts name another cluster
        self._pongs: dict[int, trio.Event] = {}
        self._infos: dict[str, int] = {}  # node id -> Info messages received from it
        self._answers: dict[int, tuple[str, trio.Event, list]] = {}  # request's seq -> (node id, done, [answer])
        self._seq = itertools.count(1)
        self._changed = trio.Event()
        self._assigned = trio.Event()  # set, and replaced, whenever a job of ours is assigned to a device
        self.on_lease_answer = None  # (node id, LeaseAnswer) -> None: a replicated run's lease (launch.py)
        self._nursery: trio.Nursery | None = None

    # -- asking -----------------------------------------------------------------------

    def devices(self) -> list[Member]:
        return sorted(self._devices.values(), key=lambda d: (d.name, d.node_id))

    def device(self, node_id: str) -> Member | None:
        return self._devices.get(node_id)

    def alive(self) -> list[Member]:
        return [d for d in self.devices() if d.health == "alive"]

    async def wait_for(self, count: int, timeout: float) -> list[Member]:
        """Wait until `count` devices are alive or `timeout` passes; the alive devices."""
        with trio.move_on_after(timeout):
            while len(self.alive()) < count:
                await self._changed.wait()
        return self.alive()

    async def refresh(self, node_ids, timeout: float = 2.0) -> None:
        """Ask these devices to describe themselves again (InfoRequest) and wait up to `timeout`
        for their answers, so that what they can spare is as of now (before a plan is made).
        A device that does not answer in time keeps what it said before."""
        asked = {}
        for node_id in node_ids:
            count = self._infos.get(node_id, 0)
            try:
                await self.send(node_id, InfoRequest())
            except (PeerUnavailable, ConnectionLost):
                continue
            asked[node_id] = count

        def waiting() -> bool:
            return any(self._infos.get(n, 0) == count and getattr(self._devices.get(n), "conn", None) is not None
                       for n, count in asked.items())
        with trio.move_on_after(timeout):
            while waiting():
                await self._changed.wait()

    def strangers(self) -> str:
        """A sentence on the devices found on mDNS whose adverts name another cluster ("" if
        none): a device given the wrong token sees its own swarm's devices only as these."""
        n = len(self._strangers)
        if not n:
            return ""
        return (f"{n} device{'s' if n > 1 else ''} on this LAN belong{'' if n > 1 else 's'} to another swarm "
                f"(another cluster token); if {'they are' if n > 1 else 'it is'} meant to be in this one, give "
                f"this command the token that `swarm token` prints there")

    def subscribe(self) -> trio.MemoryReceiveChannel:
        """A channel of every MembershipEvent from now on."""
        return self.membership.subscribe()

    def job(self, job_id: str, epoch: int = 0) -> CoordinatorJob:
        """A handle for driving job `job_id` at `epoch` (replaces an older epoch's handle)."""
        handle = CoordinatorJob(self, job_id, epoch, self.watch_interval)
        self._jobs[job_id] = handle
        return handle

    async def send(self, node_id: str, message) -> None:
        device = self._devices.get(node_id)
        if device is None or device.conn is None or device.conn.closed:
            raise PeerUnavailable(f"{device.name if device else 'node ' + node_id} is not connected")
        await device.conn.send(message)

    async def ask(self, node_id: str, request, timeout: float = 10.0):
        """Send `request` (a message with a `seq`, which this sets) to `node_id` and return the
        answer that repeats its seq; PeerUnavailable if the device is not connected or its
        connection closes first, trio.TooSlowError after `timeout` seconds."""
        request.seq = next(self._seq)
        _, done, answer = self._answers[request.seq] = (node_id, trio.Event(), [])
        try:
            with trio.fail_after(timeout):
                await self.send(node_id, request)
                await done.wait()
            if not answer:
                raise PeerUnavailable(f"{self._devices[node_id].name}'s connection closed before it answered")
            return answer[0]
        except ConnectionLost as exc:
            raise PeerUnavailable(str(exc)) from None
        finally:
            self._answers.pop(request.seq, None)

    # -- running ----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as stack:
            zc = await stack.enter_async_context(open_zeroconf(self.network)) if self.discover else None
            nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery = nursery
            await nursery.start(self.membership.run)
            nursery.start_soon(self._follow_membership, self.membership.subscribe())
            for host, port in self._static_peers:
                self.add_endpoint(host, port, source="peers")
            if zc is not None:
                found_in, found = trio.open_memory_channel(math.inf)
                await nursery.start(browse, zc, found_in)
                nursery.start_soon(self._follow_discovery, found)
            task_status.started(self)

    def add_endpoint(self, host: str, port: int, *, node_id: str | None = None, source: str = "peers") -> None:
        """Connect to an agent at host:port (and keep reconnecting) unless already doing so."""
        known = self._endpoints.get((host, port))
        if known is not None:
            if node_id is None or known[1] in (None, node_id):
                return
            known[0].cancel()  # another agent now answers at this address
        scope = trio.CancelScope()
        self._endpoints[(host, port)] = (scope, node_id)
        self._nursery.start_soon(self._endpoint_loop, host, port, node_id, source, scope)

    async def _follow_discovery(self, found: trio.MemoryReceiveChannel) -> None:
        async for event in found:
            if isinstance(event, DeviceSeen):
                advert = event.advert
                if advert.cluster and advert.cluster != self.credentials.cluster_tag:
                    if advert.node_id not in self._strangers and len(self._strangers) < MAX_STRANGERS:
                        self._strangers.add(advert.node_id)
                        log.info("%s (%s:%d) belongs to another swarm (its advert names cluster %s); leaving it be",
                                 advert.name, advert.address, advert.port, advert.cluster)
                    continue
                device = self._devices.get(advert.node_id)
                if device is None:
                    device = self._devices[advert.node_id] = Member(advert.node_id, advert.address, advert.port)
                for name in ("name", "cores", "memory", "accelerator", "accelerator_memory", "version"):
                    setattr(device, name, getattr(advert, name))
                device.source = "mdns"  # also when another agent's peer list reached it first
                self.add_endpoint(advert.address, advert.port, node_id=advert.node_id, source="mdns")
            elif isinstance(event, DeviceGone):
                device = self._devices.get(event.node_id)
                if device is not None:
                    known = self._endpoints.pop(device.endpoint, None)
                    if known is not None:
                        known[0].cancel()
                    device.health = "left"
                    self.membership.remove(event.node_id, "said goodbye on mDNS")
                    self._touch()

    async def _follow_membership(self, events: trio.MemoryReceiveChannel) -> None:
        async for event in events:
            event: MembershipEvent
            device = self._devices.get(event.node_id)
            if device is not None and event.kind != "left":
                device.health = self.membership.health(event.node_id) or device.health
                if event.kind in ("dead", "suspect"):
                    device.error = event.reason
            if event.kind != "joined":
                log.info("%s %s (%s)", device.name if device else event.node_id, event.kind, event.reason)
            if event.kind in ("dead", "left"):
                for asked_of, done, _ in self._answers.values():
                    if asked_of == event.node_id:
                        done.set()  # no answer will come from it
            for job in self._jobs.values():
                if event.kind in ("dead", "left"):
                    job.on_lost(event.node_id, event.reason)
                elif event.kind == "recovered":
                    job.on_back(event.node_id)
            self._touch()

    async def _endpoint_loop(self, host: str, port: int, node_id: str | None, source: str,
                             scope: trio.CancelScope) -> None:
        where = f"{host}:{port}"
        delay = RETRY_MIN
        with scope:
            while True:
                try:
                    conn = await connect_peer(host, port, self.credentials, source_address=self.network.source_address,
                                              expected_peer_id=node_id, timeout=self.connect_timeout)
                except (PeerUnavailable, HandshakeFailed) as exc:
                    refused = isinstance(exc, HandshakeFailed)
                    if refused and exc.kind == "identity" and source == "peers" and node_id is not None:
                        node_id = None  # the agent at this address was replaced: take the new one
                        continue
                    self._connect_failed(node_id or where, host, port, source, str(exc), refused)
                    await trio.sleep(RETRY_REFUSED if refused else delay)
                    delay = min(RETRY_MAX, delay * 2)
                    continue
                delay = RETRY_MIN
                if node_id is None and where in self._devices:  # a --peers entry now known by its id
                    del self._devices[where]
                node_id = conn.peer_id
                device = self._devices.get(node_id)
                if device is None:
                    device = self._devices[node_id] = Member(node_id, host, port, source=source)
                elif device.conn is not None and not device.conn.closed:  # reached by another address too
                    await conn.aclose("already connected")
                    return
                await self._converse(device, conn)

    def _connect_failed(self, key: str, host: str, port: int, source: str, error: str, refused: bool) -> None:
        device = self._devices.get(key)
        if device is None:
            device = self._devices[key] = Member(key, host, port, source=source)
        if self.membership.health(key) is None:  # never connected: not a member yet
            health = "refused" if refused else "unreachable"
            if (device.health, device.error) != (health, error):  # log changes, not every retry
                log.info("%s: %s", device.name if device.name != "?" else key, error)
            device.health = health
        device.error = error
        self._touch()

    async def _converse(self, device: Member, conn) -> None:
        node_id = device.node_id
        device.conn, device.error = conn, ""
        device.seen()
        conn.on_activity = lambda: (self.membership.heard_from(node_id), device.seen())
        beat = trio.CancelScope()
        try:
            ping = next(self._seq)  # first, so that the round trip is known when Info makes it alive
            self._pongs[ping] = trio.Event()
            sent_at = trio.current_time()
            await conn.send(Ping(ping))
            await conn.send(InfoRequest())
            await conn.send(Watch(self.watch_interval))
            self._nursery.start_soon(self._beat, node_id, conn, beat)
            async for message in conn:
                if isinstance(message, Pong) and message.seq == ping:
                    device.rtt = trio.current_time() - sent_at
                self._on_message(device, message)
        except ConnectionLost:
            pass
        except RemoteProtocolError as exc:
            log.warning("closed connection to %s: %s", conn.address, exc)
        finally:
            beat.cancel()
            device.conn = None
            device.connected = trio.Event()
            for asked_of, done, _ in self._answers.values():
                if asked_of == node_id:
                    done.set()  # no answer will come on this connection
            await conn.aclose()
            self.membership.lost(node_id, "its connection closed")
            self._touch()

    async def _beat(self, node_id: str, conn, scope: trio.CancelScope) -> None:
        """A Ping whenever nothing else went to the agent for a watch interval while a job of
        ours is assigned to it: the agents of a job see that its coordinator is alive
        (swarm/agent/failover.py). An agent of no job of ours is sent none: it watches no
        coordinator, and its own heartbeats say it is alive (a beat to each idle agent of a
        classroom of 64 was 256 sends a second, about half the coordinator's CPU at rest).
        Ends when `scope` is cancelled (the connection ended) or the connection breaks."""
        with scope:
            try:
                while not conn.closed:
                    if not self._in_job(node_id):
                        await self._assigned.wait()
                        continue
                    quiet = trio.current_time() - conn.last_sent
                    if quiet >= self.watch_interval:
                        await conn.send(Ping(0))
                        quiet = 0.0
                    await trio.sleep(self.watch_interval - quiet)
            except ConnectionLost:
                pass

    def _in_job(self, node_id: str) -> bool:
        return any(node_id in job.nodes for job in self._jobs.values())

    def note_assigned(self) -> None:
        """A job of ours was assigned to a device (CoordinatorJob.assign): its beats begin."""
        self._assigned.set()
        self._assigned = trio.Event()

    def _on_message(self, device: Member, message) -> None:
        if isinstance(message, Info):
            first = device.name == "?" or self.membership.health(device.node_id) is None
            for name in ("name", "cores", "memory", "spare", "accelerator", "accelerator_memory", "version", "peers",
                         "job_id", "job_state", "incarnation"):
                setattr(device, name, getattr(message, name))
            self._infos[device.node_id] = self._infos.get(device.node_id, 0) + 1
            device.port = message.port or device.port
            if first:
                self.membership.add(device.node_id, f"connected at {device.address}:{device.port}")
                device.health = self.membership.health(device.node_id)
            device.connected.set()
            for text in message.peers:  # static peers an agent knows of: reach them too
                try:
                    host, port = parse_endpoint(text, DEFAULT_AGENT_PORT)
                except Exception:  # noqa: BLE001 - a malformed entry from an agent is skipped
                    continue
                self.add_endpoint(host, port, source="peers")
        elif isinstance(message, Heartbeat):
            device.job_id, device.job_state = message.job_id, message.job_state
        elif isinstance(message, Pong):
            event = self._pongs.pop(message.seq, None)
            if event is not None:
                event.set()
        elif isinstance(message, (DetachAnswer, DetachChunk)):
            asked = self._answers.get(message.seq)
            if asked is not None and asked[0] == device.node_id and not asked[1].is_set():
                asked[2].append(message)
                asked[1].set()
        elif isinstance(message, LeaseAnswer):
            if self.on_lease_answer is not None:
                self.on_lease_answer(device.node_id, message)
        elif isinstance(message, JobState):
            job = self._jobs.get(message.job_id)
            if job is not None:
                job.on_state(device.node_id, message)
        elif getattr(message, "JOB_DATA", False):
            job = self._jobs.get(message.job_id)
            if job is not None:
                job.deliver(device.node_id, message)
        self._touch()

    async def _probe(self, node_id: str) -> bool:
        """Does `node_id` answer? A Ping on its connection, or a reconnection."""
        device = self._devices.get(node_id)
        if device is None:
            return False
        if device.conn is not None and not device.conn.closed:
            seq = next(self._seq)
            answered = self._pongs[seq] = trio.Event()
            try:
                await device.conn.send(Ping(seq))
                await answered.wait()
                return True
            except ConnectionLost:
                pass
            finally:
                self._pongs.pop(seq, None)
        connected = device.connected
        await connected.wait()
        return True

    def _in_message(self, node_id: str) -> bool:
        """Is a message from `node_id` part-way in on its connection?"""
        device = self._devices.get(node_id)
        conn = device.conn if device is not None else None
        return conn is not None and not conn.closed and conn.protocol.in_message

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


@asynccontextmanager
async def open_roster(credentials: Credentials, network: NetworkChoice, **options):
    """A running Roster for the body of the `async with` (see Roster for options)."""
    cluster = Roster(credentials, network, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(cluster.run)
        try:
            yield cluster
        finally:
            nursery.cancel_scope.cancel()
