"""Frames and tensors on the wire: round trips, splits at every byte, limits before allocation."""
from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest

from swarm.wire import FrameDecoder, LocalProtocolError, RemoteProtocolError, encode_frame
from swarm.wire.frames import INCOMPLETE, LENGTH
from swarm.wire.tensors import TENSOR_EXT, WIRE_DTYPES


def wire_bytes(obj, max_frame=1 << 20) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(obj, max_frame))


def decode_all(data: bytes, pieces=None, max_frame=1 << 20, max_payload=1 << 24) -> list:
    decoder = FrameDecoder(max_frame, max_payload)
    out = []
    for piece in pieces or [data]:
        decoder.feed(piece)
        while (frame := decoder.next_frame()) is not INCOMPLETE:
            out.append(frame)
    return out


def assert_same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_every_wire_dtype_round_trips(dtype):
    rng = np.random.default_rng(0)
    array = (rng.random((3, 4, 5)) * 100).astype(np.dtype(dtype))
    (back,) = decode_all(wire_bytes([7, array]))
    assert_same([7, array], back)
    assert back[1].flags.owndata and back[1].flags.writeable


def test_shapes_layouts_and_nesting():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    obj = {"scalar": np.float32(2.5).reshape(()), "empty": np.zeros((0, 7), np.float64),
           "strided": x[:, ::2, 1:], "fortran": np.asfortranarray(x), "big_endian": x.astype(">f4"),
           "nested": [x, {"again": x[0]}], "numpy_int": np.int64(5), "plain": [1, "two", b"3", None, 4.5]}
    (back,) = decode_all(wire_bytes(obj))
    expected = dict(obj, numpy_int=5, big_endian=x)
    assert_same(expected, back)
    assert back["big_endian"].dtype == np.dtype("<f4")


def test_tensor_bytes_are_sent_from_the_array_itself():
    array = np.arange(1000, dtype=np.float32)
    buffers = encode_frame([1, array], 1 << 20)
    assert len(buffers) == 2
    assert np.shares_memory(np.frombuffer(buffers[1], np.uint8), array)


def test_unsupported_values_are_refused_when_sending():
    with pytest.raises(LocalProtocolError, match="dtype"):
        encode_frame([np.zeros(3, np.complex64)], 1 << 20)
    with pytest.raises(LocalProtocolError, match="object"):
        encode_frame([object()], 1 << 20)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        encode_frame([b"x" * 100], 50)


def test_a_frame_split_at_every_byte_boundary():
    obj = [30, "job", 3, {"w": np.arange(40, dtype=np.int16).reshape(5, 8), "k": "v"}, np.ones(3, np.float64)]
    data = wire_bytes(obj) + wire_bytes([10, 99])
    for cut in range(len(data) + 1):
        frames = decode_all(data, [data[:cut], data[cut:]])
        assert len(frames) == 2, cut
        assert_same(obj, frames[0])
        assert frames[1] == [10, 99]
    frames = decode_all(data, [data[i:i + 1] for i in range(len(data))])  # one byte at a time
    assert_same(obj, frames[0])


def test_tensor_bytes_can_be_received_straight_into_the_array():
    array = np.random.default_rng(1).random((64, 64)).astype(np.float32)
    data = wire_bytes(["t", array])
    body_end = LENGTH.size + LENGTH.unpack_from(data)[0]
    decoder = FrameDecoder(1 << 20, 1 << 24)
    decoder.feed(data[:body_end])
    assert decoder.next_frame() is INCOMPLETE
    offset, direct = body_end, 0
    while (view := decoder.payload_buffer()) is not None:  # what a socket's recv_into would fill
        n = min(len(view), 1000)
        view[:n] = data[offset:offset + n]
        decoder.payload_received(n)
        offset += n
        direct += n
    assert direct == array.nbytes
    frame = decoder.next_frame()
    assert frame[0] == "t" and np.array_equal(frame[1], array)


def test_oversized_frame_is_refused_from_its_length_alone():
    decoder = FrameDecoder(max_frame=1000)
    decoder.feed(LENGTH.pack(1001))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as info:
        decoder.next_frame()
    assert info.value.kind == "oversized"
    ok = FrameDecoder(max_frame=1000)
    ok.feed(LENGTH.pack(1000))
    assert ok.next_frame() is INCOMPLETE  # waits for the body


def huge_tensor_frame(shape, dtype="<f4") -> bytes:
    header = msgpack.ExtType(TENSOR_EXT, msgpack.packb([dtype, list(shape)]))
    body = msgpack.packb([30, header], use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def test_oversized_tensor_is_refused_before_allocation():
    tracemalloc.start()
    try:
        decoder = FrameDecoder(max_frame=1 << 16, max_payload=1 << 20)
        decoder.feed(huge_tensor_frame((1 << 40,)))  # claims 4 TiB
        with pytest.raises(RemoteProtocolError, match="tensor bytes") as info:
            decoder.next_frame()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.kind == "oversized"
    assert peak < 1 << 20
    # several tensors that each fit but together do not
    body = msgpack.packb([30, [msgpack.ExtType(TENSOR_EXT, msgpack.packb(["|u1", [600_000]]))] * 2])
    decoder = FrameDecoder(max_frame=1 << 16, max_payload=1 << 20)
    decoder.feed(LENGTH.pack(len(body)) + body)
    with pytest.raises(RemoteProtocolError, match="tensor bytes"):
        decoder.next_frame()


@pytest.mark.parametrize("header", [["<c8", [2]], ["|O", [1]], ["<f4", [-1]], ["<f4", [1.5]], ["<f4", "x"],
                                    ["<f4", [1] * 40], "junk"])
def test_malformed_tensor_headers_are_refused(header):
    body = msgpack.packb([30, msgpack.ExtType(TENSOR_EXT, msgpack.packb(header))])
    decoder = FrameDecoder(1 << 16, 1 << 20)
    decoder.feed(LENGTH.pack(len(body)) + body)
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_tensors_are_refused_where_not_allowed():
    decoder = FrameDecoder(1 << 16, max_payload=0)
    decoder.feed(wire_bytes([1, np.zeros(2)]))
    with pytest.raises(RemoteProtocolError, match="not allowed"):
        decoder.next_frame()
