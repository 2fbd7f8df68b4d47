"""The thin trio layer over the sans-IO connection: connect, serve, send and receive messages.

One task reads a connection (receive() or `async for`); any number of tasks may send
(sends are serialised, whole frames at a time). Tensor bytes are sent from the array's
own memory and, on socket streams, received with recv_into straight into the new array.
Large tensors (BULK_BYTES and up) are moved by a worker thread in slices of BULK_SLICE
seconds: a blocking loop in a thread moves bytes at about twice the rate of the event
loop's wake-up-per-chunk on a busy machine, and between slices the event loop sees the
progress (activity, cancellation).

While tensor bytes are awaited, the socket's receive low-water mark (SO_RCVLOWAT) is the
bytes still to come, up to LOWAT_MAX: the kernel then reports the socket readable once
that much has arrived, not at every segment. On a slow link a 300 kB halo otherwise wakes
the reader some twenty times, each a trip through the event loop.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from swarm import limits
from swarm.errors import SwarmError
from swarm.net.gate import HandshakeGate, Ticket
from swarm.net.ratelimit import LogLimiter
from swarm.wire import (CLIENT, NEED_DATA, SERVER, Authenticated, Closed, Connection, Limits, LocalProtocolError,
                        RemoteProtocolError)

log = logging.getLogger("swarm.net")

RECEIVE_SIZE = 256 * 1024
HANDSHAKE_TIMEOUT = 5.0
BULK_BYTES = 1 << 20   # a tensor buffer at least this big moves in a worker thread
BULK_SLICE = 0.2       # seconds a worker thread moves bytes before reporting back
LOWAT_MIN = 64 * 1024  # tensor bytes still to come for which waking at every segment is not worth it
LOWAT_MAX = 1 << 20    # the most we ask the kernel to hold before waking us


@dataclass(frozen=True)
class Credentials:
    """Who we are on the wire: our node id, the cluster token, and the size limits we enforce."""
    node_id: str
    token: str = field(repr=False)
    limits: Limits = Limits()

    @property
    def cluster_tag(self) -> str:
        """The cluster's name in mDNS adverts: 8 hex digits of an HMAC of the token, so that
        swarms sharing a LAN pass each other by without trying handshakes that must fail.
        It identifies, it does not authenticate (anyone can copy it; the handshake proves the
        token), and a token has at least 128 bits (swarm.host.state), so it gives no guess
        of the token away."""
        return hmac.new(self.token.encode(), b"swarm-cluster-tag", hashlib.sha256).hexdigest()[:8]


class PeerUnavailable(SwarmError):
    """Nothing answered at that address (refused, unreachable, or too slow)."""


class HandshakeFailed(SwarmError):
    """Something answered but the handshake failed: wrong token, other version, not a swarm peer."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class ConnectionLost(Exception):
    """The conversation ended: the peer said Goodbye, closed, or the connection broke."""


class PeerConnection:
    """An authenticated connection to another swarm process."""

    def __init__(self, stream: trio.abc.Stream, protocol: Connection, address: str):
        self.stream = stream
        self.protocol = protocol
        self.address = address
        self.closed = False  # no more sends
        self._released = False  # the stream closed by aclose()
        self._released_event = trio.Event()
        self.last_received = trio.current_time()
        self.last_sent = trio.current_time()  # when the last whole message went out
        self.on_activity: Callable[[], None] | None = None  # called whenever bytes arrive
        self._send_lock = trio.StrictFIFOLock()
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._bulk_sockets: dict[str, socket.socket] = {}  # "in"/"out": dups for worker threads
        self._bulk_running = 0
        self._lowat = _prime_lowat(self._socket)  # None: the socket has no usable SO_RCVLOWAT

    @property
    def released(self) -> bool:
        """aclose() has closed the stream."""
        return self._released

    async def wait_released(self) -> None:
        """Until aclose() has closed the stream."""
        await self._released_event.wait()

    @property
    def peer_id(self) -> str | None:
        return self.protocol.peer_id

    def __repr__(self):
        return f"<PeerConnection {self.peer_id or '?'} at {self.address}>"

    # -- handshake --------------------------------------------------------------------

    async def handshake(self) -> None:
        """Run the handshake; HandshakeFailed or ConnectionLost if it does not succeed."""
        try:
            await self._flush()
            while True:
                event = self.protocol.next_event()
                await self._flush()
                if isinstance(event, Authenticated):
                    return
                if event is NEED_DATA:
                    await self._read_more()
        except RemoteProtocolError as exc:
            await self.aclose()
            if exc.kind == "closed":
                raise ConnectionLost(str(exc)) from None
            raise HandshakeFailed(str(exc), exc.kind) from None
        except BaseException:
            await self.aclose()
            raise

    # -- messages ---------------------------------------------------------------------

    async def send(self, message) -> None:
        """Send one message; ConnectionLost if the connection is gone."""
        async with self._send_lock:
            if self.closed:
                raise ConnectionLost(f"connection to {self.address} is closed")
            # Taking the lock yields once: a cancel that came then lands here, before the
            # frame is begun, not at its first write, which would cut it off and close a
            # connection other tasks share (a job's heartbeats, released with the job).
            await trio.lowlevel.checkpoint_if_cancelled()
            self.protocol.send(message)
            await self._flush()
            self.last_sent = trio.current_time()

    async def receive(self):
        """The next message; ConnectionLost when the conversation is over; RemoteProtocolError
        (after telling the peer why and closing) if the peer broke the protocol."""
        while True:
            try:
                event = self.protocol.next_event()
            except RemoteProtocolError as exc:
                await self.aclose()
                if exc.kind == "closed":  # it vanished mid-frame (crashed, cut off): a loss, not an offence
                    raise ConnectionLost(str(exc)) from None
                raise
            except LocalProtocolError:
                raise ConnectionLost(f"connection to {self.address} is closed") from None
            if event is NEED_DATA:
                await self._read_more()
            elif isinstance(event, Closed):
                await self.aclose()
                raise ConnectionLost(event.reason)
            else:
                return event

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.receive()
        except ConnectionLost:
            raise StopAsyncIteration from None

    async def aclose(self, reason: str = "closing") -> None:
        """Say Goodbye (if we can within a second) and close the stream (also after a send
        broke, which stops sending but leaves the descriptor to this)."""
        if self._released:
            return
        self._released = True
        self._released_event.set()
        if not self.closed:
            self.closed = True
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    async with self._send_lock:
                        self.protocol.close(reason)
                        await self._flush()
                except ConnectionLost:  # the peer is gone already: nothing to say goodbye to
                    pass
        if self._socket is not None:
            try:  # ends the connection for every descriptor, so bulk threads return at once
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        await trio.aclose_forcefully(self.stream)
        self._close_bulk_sockets()

    # -- inside -----------------------------------------------------------------------

    async def _flush(self) -> None:
        buffers = iter(self.protocol.data_to_send())
        started = False
        try:
            for buffer in buffers:
                started = True
                if self._socket is not None and len(buffer) >= BULK_BYTES:
                    rest = memoryview(buffer)
                    while rest is not None:  # the thread sends this and then the rest of `buffers`
                        rest = await self._bulk(_send_blocking, "out", rest, buffers)
                    break
                await self.stream.send_all(buffer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.closed = True
            raise ConnectionLost(f"connection to {self.address} broke: {exc}") from None
        except BaseException:
            if started:  # cancelled in the middle of a frame: the stream cannot be used again
                self.closed = True
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self.stream)
                self._close_bulk_sockets()
            raise

    async def _read_more(self) -> None:
        view = self.protocol.payload_buffer()
        if self._lowat is not None:
            self._lowat = _set_lowat(self._socket, self._lowat, 0 if view is None else len(view))
        try:
            if view is not None and self._socket is not None and len(view) >= BULK_BYTES:
                count, ended, self._lowat = await self._bulk(_receive_blocking, "in", self.protocol, self._lowat)
                if ended:
                    self.protocol.receive_data(b"")
            elif view is not None and self._socket is not None:
                count = await self._socket.recv_into(view)
                self.protocol.payload_received(count)
            else:
                data = await self.stream.receive_some(RECEIVE_SIZE)
                count = len(data)
                self.protocol.receive_data(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(f"connection to {self.address} broke: {exc}") from None
        if count:
            self.last_received = trio.current_time()
            if self.on_activity is not None:
                self.on_activity()

    async def _bulk(self, move, direction: str, *args):
        """move(socket, *args) in a worker thread, on a duplicate of our socket descriptor."""
        if self.closed and direction == "out":
            raise ConnectionLost(f"connection to {self.address} is closed")
        sock = self._bulk_sockets.get(direction)
        if sock is None:
            sock = self._bulk_sockets[direction] = socket.socket(fileno=os.dup(self._socket.fileno()))
        self._bulk_running += 1
        try:
            return await trio.to_thread.run_sync(move, sock, *args)
        finally:
            self._bulk_running -= 1
            if self.closed:
                self._close_bulk_sockets()

    def _close_bulk_sockets(self) -> None:
        if self._bulk_running == 0:  # never close a descriptor a thread may still be using
            for sock in self._bulk_sockets.values():
                sock.close()
            self._bulk_sockets.clear()


def _prime_lowat(sock: socket.socket | None) -> int | None:
    """Set the receive low-water mark once to LOWAT_MAX and back to 1 (the current mark), or
    None if the socket has none. Linux clamps the receive window to the first mark that grows
    the receive buffer: raising it to the largest mark first keeps a small one from capping it."""
    if sock is None or not hasattr(socket, "SO_RCVLOWAT"):
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, LOWAT_MAX)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    except OSError:
        return None
    return 1


def _set_lowat(sock: socket.socket, current: int, remaining: int) -> int:
    """The low-water mark for `remaining` tensor bytes still to come (0: a frame header is
    next, which may be a few bytes): set if it differs from `current`; the mark now."""
    want = min(remaining, LOWAT_MAX) if remaining >= LOWAT_MIN else 1
    if want != current:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        except OSError:
            return current
    return want


def _receive_blocking(sock: socket.socket, protocol: Connection, lowat: int | None) -> tuple[int, bool, int | None]:
    """(bytes received, whether the peer closed, the low-water mark now): receives straight
    into the views protocol.payload_buffer(more=True) gives — the records of a large tensor,
    one after another, each opened as it completes (the AEAD leaves the GIL, so the event
    loop runs meanwhile) — until none is next or BULK_SLICE seconds have passed. Runs in a
    worker thread while the reading task waits for it. `lowat` is the socket's receive
    low-water mark (None: not used), set for the bytes each view still wants."""
    done, end = 0, time.monotonic() + BULK_SLICE
    while (view := protocol.payload_buffer(more=True)) is not None:
        left = end - time.monotonic()
        if left <= 0:
            break
        if lowat is not None:
            lowat = _set_lowat(sock, lowat, len(view))
        sock.settimeout(left)
        try:
            count = sock.recv_into(view)
        except (TimeoutError, BlockingIOError):
            break
        if count == 0:
            return done, True, lowat
        protocol.payload_received(count)
        done += count
    return done, False, lowat


def _send_blocking(sock: socket.socket, view: memoryview, more) -> memoryview | None:
    """Sends view, then each buffer of the iterator `more` (sealed records, made as they are
    taken: the AEAD leaves the GIL), until all are sent (None) or BULK_SLICE seconds have
    passed (what is left of the buffer under way). Runs in a worker thread."""
    end = time.monotonic() + BULK_SLICE
    while True:
        done = 0
        while done < len(view):
            left = end - time.monotonic()
            if left <= 0:
                return view[done:]
            sock.settimeout(left)
            try:
                done += sock.send(view[done:])
            except (TimeoutError, BlockingIOError):
                return view[done:]
        following = next(more, None)
        if following is None:
            return None
        view = memoryview(following)


def _address_of(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError):
        return "?"


async def connect_peer(host: str, port: int, credentials: Credentials, *, source_address: str | None = None,
                       expected_peer_id: str | None = None, timeout: float = HANDSHAKE_TIMEOUT) -> PeerConnection:
    """Open and authenticate a connection; PeerUnavailable or HandshakeFailed (both SwarmError)."""
    where = f"{host}:{port}"
    with trio.move_on_after(timeout) as scope:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=source_address)
        except OSError as exc:
            raise PeerUnavailable(f"cannot reach {where}: {exc.strerror or exc}") from None
        protocol = Connection(CLIENT, credentials.node_id, credentials.token, limits=credentials.limits,
                              expected_peer_id=expected_peer_id)
        conn = PeerConnection(stream, protocol, where)
        try:
            await conn.handshake()
        except ConnectionLost as exc:
            raise PeerUnavailable(f"{where} closed the connection during the handshake ({exc})") from None
        except HandshakeFailed as exc:
            raise HandshakeFailed(f"{where}: {exc}", exc.kind) from None
        return conn
    assert scope.cancelled_caught
    raise PeerUnavailable(f"{where} did not complete a handshake within {timeout:g} s")


Handler = Callable[[PeerConnection], Awaitable[None]]

# accept() errors that mean this process or the system is out of descriptors or memory
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


async def serve_peers(handler: Handler, credentials: Credentials, hosts: list[str], port: int, *,
                      handshake_timeout: float = HANDSHAKE_TIMEOUT, hello_timeout: float = limits.HELLO_TIMEOUT,
                      gate: HandshakeGate | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections on `hosts`:`port`, authenticate each, and run `handler` on those
    that pass. Strangers, wrong tokens and protocol errors are logged (one line, at most one
    a second of each kind) and closed; the others are not affected. task_status.started(port
    actually bound).

    Handshakes in progress are capped (`gate`: limits.HANDSHAKES, limits.HANDSHAKES_PER_HOST):
    a connection over a cap takes the place of one that has sent no Hello for
    limits.HELLO_GRACE, or else is closed as soon as it is accepted; the refusals are counted
    into one log line a second. A connection whose Hello is not complete `hello_timeout`
    seconds after it was accepted is closed; the whole handshake has `handshake_timeout`."""
    listeners: list[trio.SocketListener] = []
    try:
        for host in hosts:
            listeners += await trio.open_tcp_listeners(port, host=host)
            port = port or listeners[0].socket.getsockname()[1]
    except OSError as exc:
        for listener in listeners:
            await listener.aclose()
        hint = " (is another swarm join running? pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise SwarmError(f"cannot listen on {','.join(hosts)} port {port}: {exc.strerror or exc}{hint}") from None
    gate = gate or HandshakeGate()
    lines = LogLimiter(log, clock=trio.current_time)

    async def serve(stream: trio.SocketStream, ticket: Ticket) -> None:
        conn = PeerConnection(stream, Connection(SERVER, credentials.node_id, credentials.token,
                                                 limits=credentials.limits), _address_of(stream))
        try:
            try:
                authenticated = await _server_handshake(conn, ticket, handshake_timeout, hello_timeout, lines)
            finally:
                gate.release(ticket)
            if authenticated:
                await _run_handler(handler, conn, lines)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_end_missing_hellos, gate, hello_timeout)
            nursery.start_soon(_report_refusals, gate, lines)
            for listener in listeners:
                nursery.start_soon(_accept_loop, listener, gate, nursery, serve, handshake_timeout, lines, port)
            task_status.started(port)
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()


async def _accept_loop(listener: trio.SocketListener, gate: HandshakeGate, nursery: trio.Nursery, serve,
                       handshake_timeout: float, lines: LogLimiter, port: int) -> None:
    """Accept connections for ever: each one the gate admits is served in `nursery`, the others
    are closed at once. Out of descriptors or memory (EMFILE and the like), wait a little and
    try again, saying so in one line, not a traceback each time."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                raise
            lines.log(logging.ERROR, "accept", "cannot accept connections on port %d: %s (%s); trying again "
                      "every %g s", port, errno.errorcode[exc.errno], os.strerror(exc.errno), limits.ACCEPT_RETRY)
            await trio.sleep(limits.ACCEPT_RETRY)
            continue
        now = trio.current_time()
        ticket, evicted = gate.admit(_host_of(stream), now)
        if evicted is not None:  # counted by the gate, reported by _report_refusals
            evicted.scope.cancel()
        if ticket is None:  # likewise
            await trio.aclose_forcefully(stream)
            continue
        ticket.scope = trio.CancelScope(deadline=now + handshake_timeout)
        nursery.start_soon(serve, stream, ticket)


async def _server_handshake(conn: PeerConnection, ticket: Ticket, handshake_timeout: float,
                            hello_timeout: float, lines: LogLimiter) -> bool:
    """Whether the peer authenticated within the deadlines; if not, it is logged (rate-limited)
    and the connection closed."""
    ticket.conn = conn
    address = conn.address
    try:
        with ticket.scope:
            await conn.handshake()
            return True
    except HandshakeFailed as exc:
        lines.log(logging.WARNING, f"handshake {exc.kind}", "refused connection from %s: %s", address, exc)
        return False
    except ConnectionLost as exc:
        lines.log(logging.INFO, "handshake lost", "connection from %s ended during the handshake (%s)", address, exc)
        return False
    finally:
        if ticket.scope is not None and ticket.scope.cancelled_caught:
            if ticket.evicted:  # counted by the gate, reported by _report_refusals
                pass
            elif ticket.missed_hello:
                lines.log(logging.WARNING, "no hello", "refused connection from %s: no Hello within %g s", address,
                          hello_timeout)
            else:
                lines.log(logging.WARNING, "slow handshake", "refused connection from %s: no handshake within %g s",
                          address, handshake_timeout)
            await conn.aclose()
    return False


async def _run_handler(handler: Handler, conn: PeerConnection, lines: LogLimiter) -> None:
    """handler(conn), which ends only this connection whatever it raises; then close it."""
    try:
        await handler(conn)
    except RemoteProtocolError as exc:
        lines.log(logging.WARNING, "protocol", "closed connection from %s (node %s): %s", conn.address, conn.peer_id,
                  exc)
    except ConnectionLost:
        pass
    except Exception:  # a bug in a handler must not stop the others being served
        lines.log(logging.ERROR, "handler", "error serving %s (node %s); connection closed", conn.address,
                  conn.peer_id, exc_info=True)
    finally:
        await conn.aclose()


async def _end_missing_hellos(gate: HandshakeGate, hello_timeout: float) -> None:
    """Cancel each handshake whose Hello is not complete `hello_timeout` after it was admitted.
    A ticket admitted after this goes to sleep is due no sooner than it wakes up."""
    while True:
        for ticket in gate.hello_due(trio.current_time() - hello_timeout):
            if ticket.conn is None or ticket.conn.peer_id is None:
                ticket.missed_hello = True
                ticket.scope.cancel()
        oldest = gate.next_hello_admitted_at()
        await trio.sleep_until((trio.current_time() if oldest is None else oldest) + hello_timeout)


async def _report_refusals(gate: HandshakeGate, lines: LogLimiter) -> None:
    """Once a second: one line for the connections the gate refused, and the held lines of
    each kind."""
    while True:
        await trio.sleep(limits.LOG_INTERVAL)
        count, hosts, evicted = gate.take_refusals()
        if count:
            top = ", ".join(f"{host}: {n}" for host, n in hosts[:3])
            log.warning("refused %d connection%s in the last %g s: too many handshakes in progress (%d at most, "
                        "%d from one host; from %s)%s", count, "" if count == 1 else "s", limits.LOG_INTERVAL,
                        gate.total, gate.per_host, top,
                        f"; closed {evicted} without a Hello to make room" if evicted else "")
        elif evicted:
            log.warning("closed %d connection%s in the last %g s that sent no Hello for %g s, to make room for "
                        "others", evicted, "" if evicted == 1 else "s", limits.LOG_INTERVAL, gate.hello_grace)
        lines.flush()


def _host_of(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (AttributeError, OSError):
        return "?"
