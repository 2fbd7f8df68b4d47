"""Length-prefixed msgpack frames, with tensor bytes after the body; sizes checked before allocation.

A frame on the wire:

    +-----------------+------------------------+-------------------------------+
    | body length (4, | msgpack body           | raw bytes of each tensor whose |
    | big-endian)     | (tensor headers inside | header appears in the body,    |
    |                 | as ext type 1)         | in order                       |
    +-----------------+------------------------+-------------------------------+

The body length is checked against a limit before the body is buffered; the tensors'
total size is checked against another limit before any array is allocated. Received
tensors are numpy arrays that own their memory, filled straight from the socket where
the I/O layer can (see FrameDecoder.payload_buffer).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import numpy as np

from swarm import limits as bounds
from swarm.wire.faults import LocalProtocolError, RemoteProtocolError
from swarm.wire.tensors import TENSOR_EXT, byte_view, parse_tensor_header, tensor_header, wire_array

LENGTH = struct.Struct(">I")


class Incomplete:
    """next_frame() needs more bytes (a body may itself be msgpack nil, so not None)."""

    def __repr__(self):
        return "INCOMPLETE"


INCOMPLETE = Incomplete()


@dataclass(frozen=True)
class Limits:
    """How much a peer may make us buffer or allocate (why each size: swarm/limits.py)."""
    handshake_frame: int = bounds.HANDSHAKE_FRAME  # body size before authentication (Hello, Auth, Goodbye)
    frame: int = bounds.FRAME                      # body size after authentication (msgpack part only)
    payload: int = bounds.PAYLOAD                  # tensor bytes carried by one frame
    record: int = bounds.SEAL_RECORD               # plaintext bytes in one sealed record


def encode_frame(obj, max_frame: int) -> list:
    """Buffers to send, in order: length + body as bytes, then each tensor's bytes as a
    memoryview of the array itself (no copy). numpy arrays may appear anywhere in `obj`."""
    arrays: list[np.ndarray] = []

    def default(value):
        if isinstance(value, np.ndarray):
            array = wire_array(value)
            arrays.append(array)
            return tensor_header(array)
        if isinstance(value, np.generic):
            return value.item()
        raise LocalProtocolError(f"cannot send a {type(value).__name__} (only msgpack types and numpy arrays)")

    body = msgpack.packb(obj, default=default, use_bin_type=True)
    if len(body) > max_frame:
        raise LocalProtocolError(f"frame body of {len(body)} bytes exceeds the limit of {max_frame}", "oversized")
    return [LENGTH.pack(len(body)) + body] + [byte_view(a) for a in arrays if a.nbytes]


class FrameDecoder:
    """Sans-IO frame reader: feed() bytes, next_frame() returns decoded bodies (or INCOMPLETE)."""

    def __init__(self, max_frame: int, max_payload: int = 0):
        self.max_frame = max_frame
        self.max_payload = max_payload  # 0: tensors are refused
        self._buffer = bytearray()
        self._start = 0  # first unread byte of _buffer
        self._body = None  # decoded body waiting for its tensors' bytes
        self._targets: list[memoryview] = []  # byte views of the arrays still to fill
        self._filled = 0  # bytes already in _targets[0]
        self._ready = INCOMPLETE  # a whole frame prepare() read ahead, for next_frame()
        self.eof = False

    # -- input ------------------------------------------------------------------------

    def feed(self, data) -> None:
        """Add received bytes; b"" means the peer closed its side."""
        if not data:
            self.eof = True
            return
        view = memoryview(data).cast("B")
        if self._targets and self._start == len(self._buffer):
            view = view[self._fill_from(view):]  # straight into the arrays
        if len(view):
            self._buffer += view

    def payload_buffer(self) -> memoryview | None:
        """Where the next received bytes belong, when they are tensor bytes and nothing is
        buffered: the I/O layer may recv_into() it and then call payload_received()."""
        if self._targets and self._start == len(self._buffer):
            return self._targets[0][self._filled:]
        return None

    def payload_received(self, count: int) -> None:
        """`count` bytes were written into the view payload_buffer() returned."""
        self._advance_target(count)

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived but not all of it."""
        return self._body is not None or self._ready is not INCOMPLETE or self._start < len(self._buffer)

    def take_unread(self) -> bytes:
        """The bytes buffered but not yet read as a frame, removed (they belong to what
        follows the handshake, which another reader takes)."""
        unread = bytes(self._buffer[self._start:])
        self._buffer.clear()
        self._start = 0
        return unread

    # -- output -----------------------------------------------------------------------

    def next_frame(self):
        """The next complete frame's body (tensors filled in), or INCOMPLETE if more bytes
        are needed. Raises RemoteProtocolError for an oversized or malformed frame."""
        if self._ready is not INCOMPLETE:  # read ahead by prepare()
            body, self._ready = self._ready, INCOMPLETE
            return body
        if self._body is not None:  # waiting for tensor bytes
            self._fill_from_buffer()
            if self._targets:
                return INCOMPLETE
            return self._take_body()
        body = self._read_body()
        if body is INCOMPLETE or not self._targets:
            return body
        self._body = body
        return self.next_frame()

    def prepare(self) -> None:
        """Read the next frame's body now if all of it is buffered and no frame is under way,
        so that its tensors are allocated and the bytes that follow can go straight into them
        (payload_buffer). next_frame() returns it. Raises as next_frame() does."""
        if self._body is not None or self._ready is not INCOMPLETE:
            return
        body = self._read_body()
        if body is INCOMPLETE:
            return
        if self._targets:
            self._body = body
            self._fill_from_buffer()
        else:
            self._ready = body

    # -- inside -----------------------------------------------------------------------

    def _read_body(self):
        """The next frame's body from the buffer (its tensors allocated, not filled), or
        INCOMPLETE; the length is checked before the body is waited for."""
        available = len(self._buffer) - self._start
        if available < LENGTH.size:
            return INCOMPLETE
        (length,) = LENGTH.unpack_from(self._buffer, self._start)
        if length > self.max_frame:
            raise RemoteProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_frame}", "oversized")
        if available < LENGTH.size + length:
            return INCOMPLETE
        begin = self._start + LENGTH.size
        with memoryview(self._buffer) as whole, whole[begin:begin + length] as body_bytes:
            body = self._unpack(body_bytes)
        self._start = begin + length
        self._compact()
        return body

    def _unpack(self, body: memoryview):
        total = 0
        arrays: list[np.ndarray] = []

        def ext_hook(code, data):
            nonlocal total
            if code != TENSOR_EXT:
                raise RemoteProtocolError(f"unknown msgpack extension type {code}")
            if not self.max_payload:
                raise RemoteProtocolError("tensors are not allowed here", "unexpected")
            dtype, shape, nbytes = parse_tensor_header(data)
            total += nbytes
            if total > self.max_payload:
                raise RemoteProtocolError(f"frame carries more than the limit of {self.max_payload} tensor bytes",
                                          "oversized")
            array = np.empty(shape, dtype)
            arrays.append(array)
            return array

        try:
            obj = msgpack.unpackb(body, ext_hook=ext_hook, raw=False)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever hostile bytes make msgpack raise
            raise RemoteProtocolError(f"malformed frame body ({exc.__class__.__name__})") from None
        self._targets = [byte_view(a) for a in arrays if a.nbytes]
        self._filled = 0
        return obj

    def _take_body(self):
        body, self._body = self._body, None
        return body

    def _fill_from(self, view: memoryview) -> int:
        used = 0
        while self._targets and used < len(view):
            target = self._targets[0]
            n = min(len(target) - self._filled, len(view) - used)
            target[self._filled:self._filled + n] = view[used:used + n]
            used += n
            self._advance_target(n)
        return used

    def _fill_from_buffer(self) -> None:
        if self._start < len(self._buffer):
            with memoryview(self._buffer) as whole, whole[self._start:] as unread:
                self._start += self._fill_from(unread)
            self._compact()

    def _advance_target(self, count: int) -> None:
        self._filled += count
        if self._filled == len(self._targets[0]):
            self._targets.pop(0)
            self._filled = 0

    def _compact(self) -> None:
        self._start = compact(self._buffer, self._start)


def compact(buffer: bytearray, start: int) -> int:
    """Drop the read bytes before `start` from `buffer` when that is cheap or worth it (all
    of it read, or more than half and over 64 KiB); the new start."""
    if start == len(buffer):
        buffer.clear()
        return 0
    if start > 65536 and start * 2 > len(buffer):
        del buffer[:start]
        return 0
    return start
