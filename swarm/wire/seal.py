"""Sealed records: every byte after the handshake is encrypted and authenticated.

Once both sides have proven the cluster token, each direction gets its own key,

    HKDF-SHA256(token, salt = client nonce | server nonce,
                info = "swarm-seal" | version | client id | server id)  ->  client key | server key

and the stream becomes a sequence of records:

    +---------------------------+----------------------+--------------------------+
    | length of what follows    | record number        | ChaCha20-Poly1305 of up  |
    | (4, big-endian)           | (8, big-endian)      | to SEAL_RECORD bytes,    |
    |                           |                      | then its 16-byte tag     |
    +---------------------------+----------------------+--------------------------+

The record number counts from 0 in each direction and is the AEAD nonce; the 12-byte
header is the associated data. A frame (frames.py) travels as one or more records; small
buffers of one send share a record. The receiver checks the number before anything else,
so a record out of turn is named for what happened to it (replayed, dropped, reordered),
and then the tag, so a changed or injected record is never decrypted into anything that is
passed on. Fresh nonces from both sides make every connection's keys new: a record from
another connection, or another direction, fails its tag.

ChaCha20-Poly1305 rather than AES-GCM: Raspberry Pis before the 5 have no AES
instructions, where ChaCha20 is several times faster than table-driven AES.
"""
from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.limits import SEAL_RECORD
from swarm.wire.faults import RemoteProtocolError
from swarm.wire.frames import compact

HEADER = struct.Struct(">IQ")  # ciphertext-and-tag length, record number
TAG = 16
COALESCE = 64 * 1024  # buffers up to this size are copied together into one record


def session_keys(token: bytes, version: int, client_id: str, server_id: str, client_nonce: bytes,
                 server_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) for one connection."""
    info = b"|".join([b"swarm-seal", str(version).encode(), client_id.encode(), server_id.encode()])
    keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=client_nonce + server_nonce, info=info).derive(token)
    return keys[:32], keys[32:]


def _nonce(number: int) -> bytes:
    return b"\0\0\0\0" + number.to_bytes(8, "big")


class Sealer:
    """Our direction: buffers in, sealed records out."""

    def __init__(self, key: bytes, max_record: int = SEAL_RECORD):
        self._aead = ChaCha20Poly1305(key)
        self.max_record = max_record
        self.number = 0  # of the next record

    def seal(self, data) -> bytearray:
        """One record holding `data` (at most max_record bytes)."""
        size = len(data)
        record = bytearray(HEADER.size + size + TAG)
        HEADER.pack_into(record, 0, size + TAG, self.number)
        with memoryview(record) as view:
            self._aead.encrypt_into(_nonce(self.number), data, bytes(view[:HEADER.size]), view[HEADER.size:])
        self.number += 1
        return record

    def records(self, buffers):
        """Sealed records for `buffers`, made as they are taken (one record's memory at a time)."""
        pending, size = [], 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if len(view) <= COALESCE and size + len(view) <= self.max_record:
                pending.append(view)
                size += len(view)
                continue
            if pending:
                yield self.seal(b"".join(pending))
                pending, size = [], 0
            if len(view) <= COALESCE:
                pending, size = [view], len(view)
                continue
            for start in range(0, len(view), self.max_record):
                yield self.seal(view[start:start + self.max_record])
        if pending:
            yield self.seal(b"".join(pending))


class Opener:
    """The peer's direction: sealed bytes in, checked plaintext out.

    feed() takes bytes as they arrive; open_next() gives each whole record's plaintext in
    turn. While the rest of a record (or, if asked, the next header) is awaited and nothing
    else is buffered, record_buffer() is where the I/O layer may receive it directly, telling
    record_received() how much came.
    """

    def __init__(self, key: bytes, max_record: int = SEAL_RECORD):
        self._aead = ChaCha20Poly1305(key)
        self.max_record = max_record
        self.number = 0  # of the next record expected
        self._buffer = bytearray()
        self._start = 0
        self._header: bytes | None = None  # of the record being received
        self._record = bytearray()  # its ciphertext and tag, when received straight into it
        self._size = 0  # bytes the record has (ciphertext and tag)
        self._filled = 0  # of them received into _record
        self._head = bytearray(HEADER.size)  # the next header, when received straight into it
        self._head_filled = 0

    @property
    def in_record(self) -> bool:
        """True while part of a record has arrived but not all of it."""
        return self._header is not None or self._start < len(self._buffer) or self._head_filled > 0

    def feed(self, data) -> None:
        self._buffer += data

    def record_buffer(self, headers: bool = False) -> memoryview | None:
        """Where the next bytes go when nothing is buffered: the rest of the record under way,
        or with `headers` the next record's header."""
        if self._start < len(self._buffer):
            return None
        if self._header is None:
            return memoryview(self._head)[self._head_filled:] if headers else None
        if len(self._record) < self._size:
            self._record = bytearray(self._size)
        return memoryview(self._record)[self._filled:self._size]

    def record_received(self, count: int) -> None:
        if self._header is not None:
            self._filled += count
            return
        self._head_filled += count
        if self._head_filled == HEADER.size:  # a whole header: read like any buffered one
            self._buffer += self._head
            self._head_filled = 0

    def open_next(self, target: memoryview | None = None):
        """The next record's plaintext: written into `target` when it fits there (returns how
        many bytes), else returned as bytes; None until a whole record is here.
        RemoteProtocolError for a record that is out of turn, too big, or fails its tag."""
        if self._header is None and not self._read_header():
            return None
        if self._filled < self._size:  # take what the buffer holds of the record
            take = min(self._size - self._filled, len(self._buffer) - self._start)
            if self._filled == 0 and take == self._size:  # whole record buffered: open it in place
                with memoryview(self._buffer) as whole, whole[self._start:self._start + take] as ciphertext:
                    plain = self._open(ciphertext, target)
                self._start += take
                self._compact()
                return plain
            if take:
                if len(self._record) < self._size:
                    self._record = bytearray(self._size)
                self._record[self._filled:self._filled + take] = self._buffer[self._start:self._start + take]
                self._filled += take
                self._start += take
                self._compact()
            if self._filled < self._size:
                return None
        with memoryview(self._record) as whole, whole[:self._size] as ciphertext:
            return self._open(ciphertext, target)

    def _read_header(self) -> bool:
        if len(self._buffer) - self._start < HEADER.size:
            return False
        header = bytes(self._buffer[self._start:self._start + HEADER.size])
        size, number = HEADER.unpack(header)
        if number != self.number:
            if number < self.number:
                what = "a replayed or reordered frame"
            else:
                what = "a missing or reordered frame"
            raise RemoteProtocolError(f"{what}: record {number} arrived when {self.number} was next", "sealed")
        if not TAG <= size <= self.max_record + TAG:
            raise RemoteProtocolError(f"sealed record of {size} bytes is outside 16..{self.max_record + TAG}",
                                      "oversized")
        self._start += HEADER.size
        self._header, self._size, self._filled = header, size, 0
        return True

    def _open(self, ciphertext: memoryview, target: memoryview | None):
        size = len(ciphertext) - TAG
        try:
            if target is not None and len(target) >= size:
                with target[:size] as into:
                    self._aead.decrypt_into(_nonce(self.number), ciphertext, self._header, into)
                plain = size
            else:
                plain = self._aead.decrypt(_nonce(self.number), ciphertext, self._header)
        except InvalidTag:
            raise RemoteProtocolError(f"a changed or injected frame: record {self.number} failed its "
                                      f"authentication", "sealed") from None
        self.number += 1
        self._header, self._size, self._filled = None, 0, 0
        return plain

    def _compact(self) -> None:
        self._start = compact(self._buffer, self._start)
