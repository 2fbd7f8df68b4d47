"""Tensors on the wire: a small (dtype, shape) header in the frame, raw bytes after it."""
from __future__ import annotations

import math

import msgpack
import numpy as np

from swarm.wire.faults import LocalProtocolError, RemoteProtocolError

# msgpack extension type code of a tensor header inside a frame body.
TENSOR_EXT = 1

# Little-endian dtypes a tensor may have on the wire (numpy's dtype.str spelling).
WIRE_DTYPES = frozenset({"|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"})
MAX_DIMS = 32


def wire_array(array: np.ndarray) -> np.ndarray:
    """`array` itself when it can be sent as is (C-contiguous, little-endian, a wire dtype);
    otherwise a contiguous little-endian copy. Raises LocalProtocolError for other dtypes."""
    dtype = array.dtype
    if dtype.str not in WIRE_DTYPES:
        little = dtype.newbyteorder("<")
        if little.str not in WIRE_DTYPES:
            raise LocalProtocolError(f"cannot send a tensor of dtype {dtype}: the wire carries "
                                     f"bool, (u)int8-64 and float16/32/64")
        array = array.astype(little)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def tensor_header(array: np.ndarray) -> msgpack.ExtType:
    """The in-frame header of a wire-ready array (see wire_array)."""
    return msgpack.ExtType(TENSOR_EXT, msgpack.packb([array.dtype.str, list(array.shape)]))


def byte_view(array: np.ndarray) -> memoryview:
    """The array's own memory as flat bytes: no copy. The array must be C-contiguous."""
    return memoryview(array.reshape(-1).view(np.uint8))


def parse_tensor_header(data: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, nbytes) from a header a peer sent; RemoteProtocolError if it is not one."""
    try:
        dtype_str, shape = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # noqa: BLE001 - anything a hostile header makes msgpack raise
        raise RemoteProtocolError(f"malformed tensor header ({exc.__class__.__name__})") from None
    if not isinstance(dtype_str, str) or dtype_str not in WIRE_DTYPES:
        raise RemoteProtocolError(f"tensor dtype {dtype_str!r} is not one the wire carries")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(n) is int and n >= 0 for n in shape):
        raise RemoteProtocolError("malformed tensor shape")
    dtype = np.dtype(dtype_str)
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    return dtype, tuple(shape), nbytes
