"""The sans-IO connection: bytes in, events out; handshake first, then sealed messages.

    conn = Connection(CLIENT, node_id="a1", token=b"...")
    sock.send(b"".join(conn.data_to_send()))         # our Hello, queued at once
    conn.receive_data(sock.recv(65536))
    event = conn.next_event()   # NEED_DATA, Authenticated, a message, or Closed

The handshake, in the clear:

    client                                  server
    Hello(version, id, nonce)  ------->
                               <-------  Hello(version, id, nonce)
    Auth(client proof)         ------->  checks it; a wrong one gets Goodbye, no proof
                               <-------  Auth(server proof)
    checks it
    ==========  sealed records both ways (seal.py)  ==========

The server, which strangers reach, proves nothing until the client has proven the token,
so a stranger gets nothing to test guessed tokens against. Nothing a peer sends is passed
on before both sides have proved they hold the cluster token: until then frames are
limited to Limits.handshake_frame bytes, may hold no tensors, and may only be Hello, Auth
or Goodbye. After it every byte travels in sealed records: a record that was changed,
injected, replayed, dropped or reordered fails the connection with a message saying which.
A protocol error raises RemoteProtocolError from next_event() and queues a Goodbye saying
why; the caller sends it and closes.
"""
from __future__ import annotations

from dataclasses import dataclass

from swarm.wire import handshake, seal
from swarm.wire.faults import LocalProtocolError, RemoteProtocolError
from swarm.wire.frames import INCOMPLETE, FrameDecoder, Limits, encode_frame
from swarm.wire.handshake import CLIENT, SERVER
from swarm.wire.messages import MAGIC, PROTOCOL_VERSION, Auth, Goodbye, Hello, from_wire, to_wire


class NeedData:
    """next_event() has nothing until more bytes arrive."""

    def __repr__(self):
        return "NEED_DATA"


NEED_DATA = NeedData()


@dataclass(frozen=True)
class Authenticated:
    """Both sides proved they hold the token; messages may flow."""
    peer_id: str
    peer_version: int


@dataclass(frozen=True)
class Closed:
    """The conversation is over: the peer said Goodbye, or closed its side."""
    reason: str
    by_peer: bool = True


HANDSHAKE_CODES = frozenset({Hello.CODE, Goodbye.CODE})
AUTH_CODES = frozenset({Auth.CODE, Goodbye.CODE})
MAX_REASON = 200
AUTH_FAILED = "authentication failed"  # all a side that failed our check is told


class Connection:
    """One side of one swarm connection, as a state machine.

    States: "hello" (waiting for the peer's Hello), "auth" (waiting for its proof; the
    client has sent its own, the server sends its own once the client's checks out),
    "open", "closed" (Goodbye or end of stream), "failed" (protocol error).
    """

    def __init__(self, role: str, node_id: str, token: bytes | str, *, limits: Limits = Limits(),
                 expected_peer_id: str | None = None, nonce: bytes | None = None):
        if role not in (CLIENT, SERVER):
            raise ValueError(f"role must be {CLIENT!r} or {SERVER!r}")
        self.role = role
        self.node_id = node_id
        self.limits = limits
        self.expected_peer_id = expected_peer_id
        self.peer_id: str | None = None
        self.peer_version: int | None = None
        self.state = "hello"
        self._token = token.encode() if isinstance(token, str) else bytes(token)
        self._nonce = nonce or handshake.new_nonce()
        self._peer_nonce = b""
        self._closed: Closed | None = None
        self._out: list = []  # (buffers of one frame, whether they go sealed)
        self._decoder = FrameDecoder(limits.handshake_frame)
        self._sealer: seal.Sealer | None = None  # ours and the peer's direction, once open
        self._opener: seal.Opener | None = None
        self._pending_error: RemoteProtocolError | None = None  # found by payload_received
        self._queue(Hello(MAGIC, PROTOCOL_VERSION, node_id, self._nonce), limits.handshake_frame)

    @property
    def peer_role(self) -> str:
        return SERVER if self.role == CLIENT else CLIENT

    # -- bytes in and out -------------------------------------------------------------

    def data_to_send(self):
        """Buffers to write to the peer, in order: an iterable whose sealed records are made
        as they are taken, so that a large message is never held twice. Take them all, in
        order, before calling again."""
        out, self._out = self._out, []
        return self._emit(out)

    def _emit(self, out: list):
        for buffers, sealed in out:
            if sealed:
                yield from self._sealer.records(buffers)
            else:
                yield from buffers

    def receive_data(self, data) -> None:
        """Bytes from the peer; b"" when it closed its side."""
        if self.state in ("closed", "failed"):
            return
        if self._opener is not None and data:
            self._opener.feed(data)
        else:
            self._decoder.feed(data)

    @property
    def in_message(self) -> bool:
        """Has part of a message (a frame or a sealed record) arrived, and not the rest?"""
        return self._decoder.in_frame or (self._opener is not None and self._opener.in_record)

    def payload_buffer(self, *, more: bool = False) -> memoryview | None:
        """A view to recv_into() directly when the rest of a sealed record is next; with
        `more`, also the next record's header while a tensor is being filled, so that a
        worker thread may receive a large tensor record after record, decrypted as each
        completes (payload_received), without coming back for each."""
        if self._opener is None or self.state != "open" or self._pending_error is not None:
            return None
        return self._opener.record_buffer(more and self._decoder.payload_buffer() is not None)

    def payload_received(self, count: int) -> None:
        """`count` bytes were written into the view payload_buffer() returned (0: end of
        stream). A record this completes is opened at once; what is wrong with it is raised
        by the next next_event()."""
        if count == 0:
            self.receive_data(b"")
            return
        self._opener.record_received(count)
        try:
            self._open_records()
        except RemoteProtocolError as exc:
            self._pending_error = exc

    # -- events -----------------------------------------------------------------------

    def next_event(self):
        """NEED_DATA, Authenticated, a message object, or Closed (repeated once closed)."""
        if self._closed is not None:
            return self._closed
        if self.state == "failed":
            raise LocalProtocolError("the connection already failed")
        try:
            return self._next_event()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def _next_event(self):
        if self._pending_error is not None:
            raise self._pending_error
        while True:
            if self._opener is not None:
                self._open_records()
            try:
                body = self._decoder.next_frame()
            except RemoteProtocolError as exc:
                if exc.kind == "oversized" and self.state != "open":
                    raise RemoteProtocolError(f"not a swarm peer ({exc} before authentication)", exc.kind) from None
                raise
            if body is INCOMPLETE:
                if not self._decoder.eof:
                    return NEED_DATA
                if self._decoder.in_frame or (self._opener is not None and self._opener.in_record):
                    raise RemoteProtocolError("connection closed in the middle of a frame", "closed")
                if self.state != "open":
                    raise RemoteProtocolError("connection closed during the handshake", "closed")
                return self._close(Closed("connection closed by the peer"))
            if self.state == "hello":
                self._on_hello(body)
            elif self.state == "auth":
                msg = from_wire(body, AUTH_CODES)
                if isinstance(msg, Goodbye):
                    if msg.reason == AUTH_FAILED:  # it checked our proof first, and refused it
                        raise RemoteProtocolError("authentication failed: the peer does not hold our cluster token "
                                                  "(it refused our proof)", "refused")
                    raise RemoteProtocolError(f"refused during the handshake: {msg.reason}", "refused")
                self._on_auth(msg)
                return Authenticated(self.peer_id, self.peer_version)
            else:
                msg = from_wire(body)
                if isinstance(msg, (Hello, Auth)):
                    raise RemoteProtocolError(f"{type(msg).__name__} after the handshake", "unexpected")
                if isinstance(msg, Goodbye):
                    return self._close(Closed(msg.reason))
                return msg

    def _on_hello(self, body) -> None:
        if not (isinstance(body, list) and len(body) >= 3 and body[0] == Hello.CODE):
            if isinstance(body, list) and body and body[0] == Goodbye.CODE:
                reason = body[1] if len(body) > 1 and isinstance(body[1], str) else "?"
                raise RemoteProtocolError(f"refused during the handshake: {reason[:MAX_REASON]}", "refused")
            raise RemoteProtocolError("not a swarm peer (its first frame is not a Hello)")
        if body[1] != MAGIC:
            raise RemoteProtocolError("not a swarm peer (wrong magic in Hello)")
        if body[2] != PROTOCOL_VERSION:
            version = body[2] if type(body[2]) is int else "?"
            raise RemoteProtocolError(f"protocol version mismatch: we speak {PROTOCOL_VERSION}, the peer speaks "
                                      f"{version}; run the same swarm release on every device", "version")
        hello = from_wire(body, HANDSHAKE_CODES)
        if not 0 < len(hello.node_id) <= handshake.MAX_NODE_ID or len(hello.nonce) != handshake.NONCE_BYTES:
            raise RemoteProtocolError("malformed Hello (node id or nonce)")
        if hello.node_id == self.node_id:
            raise RemoteProtocolError(f"the peer claims our own node id {self.node_id}; if this device's state "
                                      f"directory was copied from another, delete the node_id file in one of them",
                                      "identity")
        if self.expected_peer_id is not None and hello.node_id != self.expected_peer_id:
            raise RemoteProtocolError(f"expected node {self.expected_peer_id} at this address, found {hello.node_id}",
                                      "identity")
        self.peer_id, self.peer_version, self._peer_nonce = hello.node_id, hello.version, hello.nonce
        if self.role == CLIENT:  # the client proves first; the server only once it has checked that
            self._send_proof()
        self.state = "auth"

    def _send_proof(self) -> None:
        own = handshake.proof(self._token, PROTOCOL_VERSION, self.role, self.node_id, self.peer_id,
                              self._peer_nonce, self._nonce)
        self._queue(Auth(own), self.limits.handshake_frame)

    def _on_auth(self, msg: Auth) -> None:
        if not handshake.proof_is_valid(self._token, PROTOCOL_VERSION, self.peer_role, self.peer_id, self.node_id,
                                        self._nonce, self._peer_nonce, msg.proof):
            raise RemoteProtocolError("authentication failed: the peer does not hold our cluster token", "auth")
        if self.role == SERVER:
            self._send_proof()
        client_nonce, server_nonce = ((self._nonce, self._peer_nonce) if self.role == CLIENT
                                      else (self._peer_nonce, self._nonce))
        client_id, server_id = ((self.node_id, self.peer_id) if self.role == CLIENT
                                else (self.peer_id, self.node_id))
        to_server, to_client = seal.session_keys(self._token, PROTOCOL_VERSION, client_id, server_id,
                                                 client_nonce, server_nonce)
        ours, theirs = (to_server, to_client) if self.role == CLIENT else (to_client, to_server)
        self._sealer = seal.Sealer(ours, self.limits.record)
        self._opener = seal.Opener(theirs, self.limits.record)
        self._opener.feed(self._decoder.take_unread())  # what followed the proof is sealed
        self.state = "open"
        self._decoder.max_frame = self.limits.frame
        self._decoder.max_payload = self.limits.payload

    def _open_records(self) -> None:
        """Move every whole sealed record that has arrived into the frame decoder, decrypting
        straight into the tensor being filled where one is."""
        while (plain := self._opener.open_next(self._decoder.payload_buffer())) is not None:
            if isinstance(plain, int):
                self._decoder.payload_received(plain)
            elif plain:  # (an empty record is no end of stream)
                self._decoder.feed(plain)
                self._decoder.prepare()  # a tensor's records that are here already open straight into it

    # -- sending ----------------------------------------------------------------------

    def send(self, msg) -> None:
        """Queue a message (see data_to_send). Only once the connection is open."""
        if self.state != "open":
            raise LocalProtocolError(f"cannot send {type(msg).__name__}: the connection is {self.state}")
        if isinstance(msg, (Hello, Auth)):
            raise LocalProtocolError(f"{type(msg).__name__} is sent by the handshake itself")
        self._queue(msg, self.limits.frame)

    def close(self, reason: str = "closing") -> None:
        """Queue a Goodbye (if the conversation is still going) and stop reading."""
        if self.state not in ("closed", "failed"):
            self._queue(Goodbye(reason[:MAX_REASON]), self.limits.handshake_frame)
            self._close(Closed(reason, by_peer=False))

    # -- inside -----------------------------------------------------------------------

    def _queue(self, msg, max_frame: int) -> None:
        self._out.append((encode_frame(to_wire(msg), max_frame), self._sealer is not None))

    def _close(self, closed: Closed) -> Closed:
        self.state = "closed"
        self._closed = closed
        return closed

    def _fail(self, exc: RemoteProtocolError) -> None:
        if exc.kind not in ("closed", "refused"):
            told = AUTH_FAILED if exc.kind == "auth" else str(exc)
            self._queue(Goodbye(told[:MAX_REASON]), self.limits.handshake_frame)
        self.state = "failed"
