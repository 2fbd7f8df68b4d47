"""Sealed records after the handshake: what a relay without the token can and cannot do.

In memory (sans-IO) each way of meddling is named in the error; over real sockets a relay
between connect_peer and serve_peers cannot inject, replay, reorder or drop a frame
without the server closing the connection before the frame is passed on.
"""
from __future__ import annotations

import numpy as np
import pytest
import trio

from swarm.net import Credentials, connect_peer, serve_peers
from swarm.wire import (CLIENT, NEED_DATA, SERVER, Closed, Connection, JobAssign, JobData, Limits, Ping,
                        RemoteProtocolError, encode_frame, to_wire)
from swarm.wire.frames import LENGTH
from swarm.wire.seal import HEADER, Opener, Sealer, session_keys
from tests.test_protocol import events

TOKEN = b"2f0c9b7e41d35a86c1e04b9d7a62f5e3"


def open_pair(limits: Limits = Limits()) -> tuple[Connection, Connection]:
    client = Connection(CLIENT, "a", TOKEN, limits=limits)
    server = Connection(SERVER, "b", TOKEN, limits=limits)
    for _ in range(3):
        for src, dst in ((client, server), (server, client)):
            for buf in src.data_to_send():
                dst.receive_data(bytes(buf))
        for conn in (server, client):
            while conn.next_event() is not NEED_DATA:
                pass
    assert client.state == server.state == "open"
    return client, server


def records(data: bytes) -> list[bytes]:
    """Split a sealed byte stream into its records."""
    out, at = [], 0
    while at < len(data):
        size, _ = HEADER.unpack_from(data, at)
        out.append(data[at:at + HEADER.size + size])
        at += HEADER.size + size
    return out


def sent(conn: Connection, *messages) -> list[bytes]:
    for message in messages:
        conn.send(message)
    return records(b"".join(bytes(b) for b in conn.data_to_send()))


def delivered(conn: Connection, data: bytes) -> list:
    conn.receive_data(data)
    return events(conn)


MESSAGES = [Ping(1), JobData("job", 3, "act", np.arange(1000, dtype=np.float32)), Ping(2), Ping(3)]


def test_records_pass_unchanged_in_order():
    client, server = open_pair()
    got = delivered(server, b"".join(sent(client, *MESSAGES)))
    assert got[0] == Ping(1) and np.array_equal(got[1].body, MESSAGES[1].body) and got[2:] == [Ping(2), Ping(3)]


@pytest.mark.parametrize("meddle, words", [
    (lambda r: [r[0], r[0]] + r[1:], "replayed or reordered frame: record 0 arrived when 1 was next"),
    (lambda r: [r[0]] + r[2:], "missing or reordered frame: record 2 arrived when 1 was next"),
    (lambda r: [r[0], r[2], r[1]] + r[3:], "missing or reordered frame: record 2 arrived when 1 was next"),
    (lambda r: r[:1] + [r[1][:20] + bytes([r[1][20] ^ 1]) + r[1][21:]] + r[2:],
     "changed or injected frame: record 1 failed its authentication"),
    (lambda r: r[:1] + [r[1][:-1] + bytes([r[1][-1] ^ 0x80])] + r[2:],  # the tag itself
     "changed or injected frame: record 1 failed its authentication"),
])
def test_every_way_of_meddling_is_named_and_nothing_after_it_is_passed_on(meddle, words):
    client, server = open_pair()
    stream = meddle(sent(client, *MESSAGES))
    with pytest.raises(RemoteProtocolError, match=words) as info:
        delivered(server, b"".join(stream))
    assert info.value.kind == "sealed"
    assert server.state == "failed"


def test_a_relay_cannot_inject_a_frame_of_its_own():
    client, server = open_pair()
    delivered(server, b"".join(sent(client, Ping(1))))
    assign = b"".join(bytes(b) for b in encode_frame(to_wire(JobAssign("injected", 1, "echo", {}, 0.25)), 1 << 20))
    for forged in (assign,  # a clear frame
                   HEADER.pack(len(assign) + 16, 1) + assign + bytes(16),  # a record with a made-up tag
                   Sealer(b"k" * 32).seal(assign)):  # a record sealed with a key of its own
        _, fresh = open_pair()
        with pytest.raises(RemoteProtocolError) as info:
            delivered(fresh, forged)
        assert info.value.kind in ("sealed", "oversized"), info.value


def test_records_of_another_connection_or_direction_fail_their_tag():
    client, server = open_pair()
    other_client, other_server = open_pair()  # same token, same node ids, fresh nonces
    with pytest.raises(RemoteProtocolError, match="changed or injected"):
        delivered(server, b"".join(sent(other_client, Ping(1))))
    client, server = open_pair()
    reflected = sent(client, Ping(1))  # the client's own record 0 sent back to it
    with pytest.raises(RemoteProtocolError, match="changed or injected"):
        delivered(client, b"".join(reflected))


def test_nothing_of_a_tensor_is_readable_on_the_wire():
    client, _ = open_pair()
    marker = np.frombuffer(b"private-training-image" * 64, np.uint8)
    stream = b"".join(sent(client, JobData("job", 1, "feed", marker)))
    assert b"private-training-image" not in stream and b"feed" not in stream


def test_a_goodbye_after_the_handshake_is_sealed_too():
    client, server = open_pair()
    client.close("done here")
    (record,) = records(b"".join(bytes(b) for b in client.data_to_send()))
    assert b"done here" not in record
    assert delivered(server, record) == [Closed("done here")]


def test_session_keys_differ_by_direction_nonce_and_token():
    base = session_keys(TOKEN, 2, "a", "b", b"c" * 32, b"s" * 32)
    assert base[0] != base[1]
    assert session_keys(TOKEN, 2, "a", "b", b"d" * 32, b"s" * 32)[0] != base[0]
    assert session_keys(TOKEN[::-1], 2, "a", "b", b"c" * 32, b"s" * 32)[0] != base[0]


def test_a_record_bigger_than_the_limit_is_refused_before_it_is_buffered():
    opener = Opener(b"k" * 32, max_record=1024)
    opener.feed(HEADER.pack(1024 + 17, 0))
    with pytest.raises(RemoteProtocolError, match="outside") as info:
        opener.open_next()
    assert info.value.kind == "oversized"


def test_large_tensors_are_split_into_records_and_decrypted_in_place():
    client, server = open_pair(Limits(frame=1 << 20, payload=1 << 26, record=1 << 16))
    big = np.random.default_rng(0).random(300_000)  # 2.4 MB: 37 records of 64 KiB
    stream = sent(client, JobData("job", 1, "weights", big))
    assert len(stream) == 1 + -(-big.nbytes // (1 << 16))
    (got,) = delivered(server, b"".join(stream))
    assert np.array_equal(got.body, big) and got.body.flags.owndata



def test_a_tensor_that_arrives_with_its_frame_is_decrypted_straight_into_its_array():
    """The frame's body and the tensor's records in one read: each tensor record is opened
    into the new array (no plaintext copy of it is made on the way)."""
    client, server = open_pair(Limits(frame=1 << 20, payload=1 << 26, record=1 << 16))
    big = np.random.default_rng(1).random(100_000)  # 800 kB: 13 records of 64 KiB
    stream = sent(client, JobData("job", 1, "grads", big), Ping(7))
    opener = server._opener
    calls = {"decrypt": 0, "decrypt_into": 0}

    class Counting:
        def __init__(self, aead):
            self.aead = aead

        def decrypt(self, *args):
            calls["decrypt"] += 1
            return self.aead.decrypt(*args)

        def decrypt_into(self, *args):
            calls["decrypt_into"] += 1
            return self.aead.decrypt_into(*args)

    opener._aead = Counting(opener._aead)
    got = delivered(server, b"".join(stream))
    assert np.array_equal(got[0].body, big) and got[1] == Ping(7)
    assert calls == {"decrypt": 2, "decrypt_into": 13}  # the two bodies as bytes; the tensor in place

# -- a relay between two real endpoints -------------------------------------------------

class Relay:
    """Forwards client -> server; from the client's `at`-th sealed record on, does `meddle`
    to the records (a list of bytes) it has gathered. Server -> client is passed as is."""

    def __init__(self, meddle, at: int):
        self.meddle, self.at = meddle, at

    async def run(self, listener: trio.SocketListener, server_port: int) -> None:
        async with listener, await listener.accept() as client, \
                await trio.open_tcp_stream("127.0.0.1", server_port) as server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pass, server, client)
                await self._meddle(client, server)
                nursery.cancel_scope.cancel()

    @staticmethod
    async def _pass(src, dst) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _meddle(self, src, dst) -> None:
        buffer, clear_frames, held = b"", 0, []
        try:
            while data := await src.receive_some(65536):
                buffer += data
                while True:
                    if clear_frames < 2:  # Hello and Auth travel in the clear
                        if len(buffer) < 4 or len(buffer) < 4 + LENGTH.unpack_from(buffer)[0]:
                            break
                        size = 4 + LENGTH.unpack_from(buffer)[0]
                        clear_frames += 1
                        await dst.send_all(buffer[:size])
                    else:
                        if len(buffer) < HEADER.size or len(buffer) < HEADER.size + HEADER.unpack_from(buffer)[0]:
                            break
                        size = HEADER.size + HEADER.unpack_from(buffer)[0]
                        number = HEADER.unpack_from(buffer)[1]
                        if number < self.at:
                            await dst.send_all(buffer[:size])
                        else:
                            held.append(buffer[:size])
                            if len(held) == 3:
                                for record in self.meddle(held):
                                    await dst.send_all(record)
                    buffer = buffer[size:]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


INJECTED = b"".join(bytes(b) for b in encode_frame(to_wire(JobAssign("injected-by-relay", 1, "echo", {}, 0.25)),
                                                      1 << 20))


@pytest.mark.trio
@pytest.mark.parametrize("meddle, words", [
    (lambda held: held, None),  # an honest relay
    (lambda held: [held[0], INJECTED, held[1], held[2]], "missing or reordered"),  # its length word reads as a header
    (lambda held: [held[0], held[0], held[1], held[2]], "replayed"),
    (lambda held: [held[0], held[2]], "missing or reordered"),
    (lambda held: [held[1], held[0], held[2]], "missing or reordered"),
    (lambda held: [held[0], held[1][:30] + bytes([held[1][30] ^ 4]) + held[1][31:], held[2]], "changed or injected"),
])
async def test_a_relay_without_the_token_cannot_meddle_unnoticed(meddle, words, caplog):
    received = []
    done = trio.Event()

    async def handler(conn):
        try:
            async for message in conn:
                received.append(message)
        finally:
            done.set()

    secret = TOKEN.decode()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_peers, handler, Credentials("agent", secret), ["127.0.0.1"], 0)
            (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            relay = Relay(meddle, at=1)
            nursery.start_soon(relay.run, listener, port)
            conn = await connect_peer("127.0.0.1", listener.socket.getsockname()[1], Credentials("status", secret))
            for n in range(4):
                await conn.send(Ping(n))
            await trio.sleep(0.3)
            await conn.aclose("done")
            await done.wait()
            nursery.cancel_scope.cancel()
    if words is None:
        assert received == [Ping(0), Ping(1), Ping(2), Ping(3)]
    else:
        assert all(isinstance(m, Ping) for m in received) and received == [Ping(n) for n in range(len(received))]
        assert len(received) < 4 and not any(isinstance(m, JobAssign) for m in received)
        assert any(words in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
