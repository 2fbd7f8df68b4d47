"""Fuzzing the frame decoder, the connection and its sealed records: hostile bytes raise
RemoteProtocolError or nothing, never anything else, and never make us allocate past the
limits; a sealed stream that was flipped, cut, reordered or replayed passes on only the
messages before the damage, unchanged."""
from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.wire import (CLIENT, NEED_DATA, SERVER, Closed, Connection, FrameDecoder, JobData, Limits, Ping,
                        RemoteProtocolError)
from swarm.wire.frames import INCOMPLETE, LENGTH
from swarm.wire.messages import MESSAGES
from swarm.wire.seal import HEADER
from swarm.wire.tensors import TENSOR_EXT, WIRE_DTYPES

TOKEN = b"5d1e8a0c93f7b24e6a0d1c8f37b5e92a"
LIMITS = Limits(handshake_frame=1024, frame=8192, payload=1 << 16, record=1 << 12)
# What the decoder may hold at once: a frame, its tensors, and Python's overhead for them.
ALLOWANCE = LIMITS.frame * 8 + LIMITS.payload * 2 + (1 << 20)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STRUCTURED = settings(SETTINGS, max_examples=150)  # bigger examples: fewer of them

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20) | \
    st.binary(max_size=40)
tensor_headers = st.builds(
    lambda dtype, shape: msgpack.ExtType(TENSOR_EXT, msgpack.packb([dtype, shape])),
    st.sampled_from(sorted(WIRE_DTYPES) + ["<c8", "|O", 3]),
    st.lists(st.integers(-2, 2**40), max_size=4))
exts = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20))
values = st.recursive(
    scalars | tensor_headers | exts,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)
message_bodies = st.builds(lambda code, fields: [code, *fields],
                           st.sampled_from(sorted(MESSAGES)) | st.integers(-5, 200), st.lists(values, max_size=8))


def framed(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def open_pair() -> tuple[Connection, Connection]:
    client = Connection(CLIENT, "a", TOKEN, limits=LIMITS)
    server = Connection(SERVER, "b", TOKEN, limits=LIMITS)
    for _ in range(3):  # Hellos, the client's proof, the server's
        for src, dst in ((client, server), (server, client)):
            for buf in src.data_to_send():
                dst.receive_data(bytes(buf))
        while server.next_event() is not NEED_DATA:
            pass
        while client.next_event() is not NEED_DATA:
            pass
    assert server.state == "open"
    return client, server


def drain(conn: Connection) -> None:
    """Read every event; only RemoteProtocolError may come out."""
    try:
        for _ in range(10_000):
            event = conn.next_event()
            if event is NEED_DATA or isinstance(event, Closed):
                return
    except RemoteProtocolError:
        return


def bounded(run) -> None:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < ALLOWANCE, peak - base


@SETTINGS
@given(st.binary(max_size=4096), st.integers(1, 64))
def test_decoder_survives_arbitrary_bytes(data, chunk):
    def run():
        decoder = FrameDecoder(LIMITS.frame, LIMITS.payload)
        try:
            for i in range(0, len(data), chunk):
                decoder.feed(data[i:i + chunk])
                while decoder.next_frame() is not INCOMPLETE:
                    pass
        except RemoteProtocolError:
            pass
    bounded(run)


@STRUCTURED
@given(st.lists(message_bodies | st.binary(max_size=64).map(lambda b: LENGTH.pack(len(b)) + b), max_size=6),
       st.binary(max_size=64))
def test_decoder_survives_frames_of_arbitrary_content(bodies, tail):
    data = b"".join(b if isinstance(b, bytes) else framed(b) for b in bodies) + tail

    def run():
        decoder = FrameDecoder(LIMITS.frame, LIMITS.payload)
        decoder.feed(data)
        try:
            while decoder.next_frame() is not INCOMPLETE:
                pass
        except RemoteProtocolError:
            pass
    bounded(run)


@SETTINGS
@given(st.binary(max_size=2048))
def test_connection_before_authentication_survives_arbitrary_bytes(data):
    def run():
        server = Connection(SERVER, "b", TOKEN, limits=LIMITS)
        server.receive_data(data)
        drain(server)
        assert server.state in ("hello", "auth", "failed")  # never open without the token
    bounded(run)


@STRUCTURED
@given(st.lists(message_bodies, min_size=1, max_size=4))
def test_connection_before_authentication_survives_arbitrary_messages(bodies):
    server = Connection(SERVER, "b", TOKEN, limits=LIMITS)
    for body in bodies:
        server.receive_data(framed(body))
    drain(server)
    assert server.state in ("hello", "auth", "failed")


@STRUCTURED
@given(st.lists(message_bodies, min_size=1, max_size=6), st.binary(max_size=256))
def test_open_connection_survives_arbitrary_messages(bodies, tail):
    def run():
        _, server = open_pair()
        for body in bodies:
            server.receive_data(framed(body))
        server.receive_data(tail)
        drain(server)
    bounded(run)


def sealed_records(client: Connection, messages) -> list[bytes]:
    for message in messages:
        client.send(message)
    data, out, at = b"".join(bytes(b) for b in client.data_to_send()), [], 0
    while at < len(data):
        out.append(data[at:at + HEADER.size + HEADER.unpack_from(data, at)[0]])
        at += len(out[-1])
    return out


def same(a, b) -> bool:
    if isinstance(a, JobData) and isinstance(b, JobData):
        return (a.job_id, a.epoch, a.channel) == (b.job_id, b.epoch, b.channel) and \
            np.array_equal(a.body, b.body)
    return a == b


sent_messages = st.lists(st.integers(0, 2**31) .map(Ping) | st.binary(max_size=9000).map(
    lambda b: JobData("job", 1, "act", np.frombuffer(b, np.uint8))), min_size=1, max_size=6)
damage = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("swap"), st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.just("replay"), st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.just("drop"), st.integers(0, 40), st.just(0)))


def damaged(records: list[bytes], how) -> bytes:
    kind, a, b = how
    records = list(records)
    if kind == "flip":
        data = bytearray(b"".join(records))
        data[a % len(data)] ^= 1 << b
        return bytes(data)
    if kind == "cut":
        data = b"".join(records)
        return data[:a % len(data)]
    a, b = a % len(records), b % len(records)
    if kind == "swap":
        records[a], records[b] = records[b], records[a]
    elif kind == "replay":
        records.insert(b, records[a])
    else:
        del records[a]
    return b"".join(records)


@STRUCTURED
@given(sent_messages, damage, st.integers(1, 5000))
def test_damaged_sealed_stream_passes_on_only_what_came_before_the_damage(messages, how, chunk):
    client, server = open_pair()
    records = sealed_records(client, messages)
    data = damaged(records, how)
    got, failed = [], False

    def run():
        nonlocal failed
        try:
            for i in range(0, len(data), chunk):
                server.receive_data(data[i:i + chunk])
                while (event := server.next_event()) is not NEED_DATA:
                    got.append(event)
            server.receive_data(b"")  # then the connection ends (a grown length field waits for it)
            while not isinstance(event := server.next_event(), Closed):
                got.append(event)
        except RemoteProtocolError:
            failed = True
    bounded(run)
    assert len(got) <= len(messages) and all(same(g, m) for g, m in zip(got, messages)), (how, got)
    whole = b"".join(records)
    if data == whole:
        assert not failed and len(got) == len(messages)
    elif not whole.startswith(data):  # (losing the end is a connection cut short: a loss, seen as such)
        assert failed  # every other change in the bytes is noticed
