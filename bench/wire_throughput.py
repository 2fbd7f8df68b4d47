"""Throughput of one 64 MiB tensor over loopback: sealed swarm connections against clear
frames and a raw socket sendall of the same bytes (target: sealed >= 0.7 of raw).

    PYTHONPATH=. python bench/wire_throughput.py [--mib 64] [--reps 9]

The receiver runs in its own process, the sender in this one; one connection of each kind
stays open for the whole run.
  raw    = sendall(memoryview of the array) into recv_into(a preallocated buffer), then a
           1-byte ack;
  clear  = the same JobData frame with no sealing (frames.py alone, the array's bytes sent
           from its memory and received by recv_into straight into a new array), then a
           1-byte ack: what the wire cost before every frame was sealed;
  sealed = an authenticated PeerConnection sending JobData(body=array) in sealed records,
           the receiver decrypting each record into a new array, then a Pong.
Each repetition measures the three back to back, in a rotating order; the ratios of each
repetition are reported, their medians, and the ratios of the best times.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import socket
import statistics
import threading
import time
import tracemalloc

import numpy as np
import trio

from swarm.net import Credentials, connect_peer, serve_peers
from swarm.wire import FrameDecoder, JobData, Limits, Pong, encode_frame, to_wire
from swarm.wire.frames import INCOMPLETE

TOKEN = "bench-token-0123456789abcdef"
LIMITS = Limits(frame=1 << 20, payload=1 << 31)


def raw_receiver(listener: socket.socket, nbytes: int) -> None:
    """Serve one raw connection: receive nbytes into a preallocated buffer, ack with 1 byte."""
    conn, _ = listener.accept()
    target = bytearray(nbytes)
    with conn, memoryview(target) as view:
        while True:
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")


async def clear_receiver(stream: trio.SocketStream) -> None:
    """Serve one clear-frame connection: each JobData frame into a new array, ack with 1 byte."""
    decoder = FrameDecoder(LIMITS.frame, LIMITS.payload)
    sock = stream.socket
    blocking = socket.socket(fileno=os.dup(sock.fileno()))  # for a worker thread
    blocking.settimeout(3600)  # (a timeout keeps the shared descriptor non-blocking for trio)
    while True:
        view = decoder.payload_buffer()
        if view is not None:
            count = await trio.to_thread.run_sync(blocking.recv_into, view) if len(view) >= 1 << 20 \
                else await sock.recv_into(view)
            if not count:
                return
            decoder.payload_received(count)
        else:
            data = await stream.receive_some(1 << 18)
            if not data:
                return
            decoder.feed(data)
        while (frame := decoder.next_frame()) is not INCOMPLETE:
            await stream.send_all(b"k" if frame[4].flags.owndata else b"n")


async def swarm_receiver(conn) -> None:
    async for message in conn:
        if isinstance(message, JobData):
            await conn.send(Pong(int(message.body.flags.owndata)))


def receiver_process(nbytes: int, ports) -> None:
    """The receiving side, in its own process: a raw server (thread) and a swarm server (trio)."""
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_receiver, args=(listener, nbytes), daemon=True).start()

    async def serve():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_peers, swarm_receiver, Credentials("receiver", TOKEN, LIMITS),
                                       ["127.0.0.1"], 0)
            (clear,) = await nursery.start(functools.partial(trio.serve_tcp, clear_receiver, 0, host="127.0.0.1"))
            ports.put((listener.getsockname()[1], clear.socket.getsockname()[1], port))

    trio.run(serve)


async def measure(raw_port: int, clear_port: int, swarm_port: int, array: np.ndarray,
                  reps: int) -> tuple[dict, bool]:
    raw_sock = socket.create_connection(("127.0.0.1", raw_port))
    raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    clear_stream = await trio.open_tcp_stream("127.0.0.1", clear_port)
    clear_blocking = socket.socket(fileno=os.dup(clear_stream.socket.fileno()))  # for a worker thread
    clear_blocking.settimeout(3600)  # (a timeout keeps the shared descriptor non-blocking for trio)
    conn = await connect_peer("127.0.0.1", swarm_port, Credentials("sender", TOKEN, LIMITS))
    data = memoryview(array).cast("B")
    message = JobData("bench", 0, "tensor", array)

    async def raw_once() -> float:
        start = time.perf_counter()
        raw_sock.sendall(data)
        raw_sock.recv(1)
        return time.perf_counter() - start

    async def clear_once() -> float:
        start = time.perf_counter()
        for buffer in encode_frame(to_wire(message), LIMITS.frame):
            if len(buffer) >= 1 << 20:  # as the swarm layer does: a big buffer from a thread
                await trio.to_thread.run_sync(clear_blocking.sendall, buffer)
            else:
                await clear_stream.send_all(buffer)
        assert await clear_stream.receive_some(1) == b"k"
        return time.perf_counter() - start

    async def sealed_once() -> float:
        start = time.perf_counter()
        await conn.send(message)
        assert isinstance(await conn.receive(), Pong)
        return time.perf_counter() - start

    kinds = {"raw": raw_once, "clear": clear_once, "sealed": sealed_once}
    times = {name: [] for name in kinds}
    try:
        await raw_once(), await clear_once()  # warm-up all three
        await conn.send(message)
        owns = bool((await conn.receive()).seq)
        order = list(kinds)
        for rep in range(reps):
            for name in order[rep % 3:] + order[:rep % 3]:
                times[name].append(await kinds[name]())
    finally:
        await conn.aclose()
        await clear_stream.aclose()
        clear_blocking.close()
        raw_sock.close()
    return times, owns


def receive_allocation(array: np.ndarray) -> float:
    """Peak bytes Python allocates to receive one tensor, per tensor byte (in this process)."""
    from swarm.wire import CLIENT, NEED_DATA, SERVER, Connection

    a, b = Connection(CLIENT, "a", TOKEN, limits=LIMITS), Connection(SERVER, "b", TOKEN, limits=LIMITS)
    for _ in range(3):
        for src, dst in ((a, b), (b, a)):
            for buf in src.data_to_send():
                dst.receive_data(bytes(buf))
        a.next_event(), b.next_event()
    a.send(JobData("bench", 0, "tensor", array))
    tracemalloc.start()
    received = None
    for record in a.data_to_send():  # made one at a time, as a socket takes them
        data, offset = memoryview(record), 0
        while offset < len(data):
            view = b.payload_buffer()  # what recv_into does on a socket, where it can
            n = min(len(data) - offset, 1 << 18 if view is None else len(view))
            if view is None:
                b.receive_data(data[offset:offset + n])
            else:
                view[:n] = data[offset:offset + n]
                b.payload_received(n)
            offset += n
            if (event := b.next_event()) is not NEED_DATA:
                received = event
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert np.array_equal(received.body, array)
    return peak / array.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    array = np.random.default_rng(0).random(args.mib * 2**20 // 4, dtype=np.float32)

    ports = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=receiver_process, args=(array.nbytes, ports), daemon=True)
    receiver.start()
    try:
        raw_port, clear_port, swarm_port = ports.get(timeout=30)
        times, owns = trio.run(measure, raw_port, clear_port, swarm_port, array, args.reps)
    finally:
        receiver.kill()
        receiver.join()
    allocation = receive_allocation(array)

    raw, clear, sealed = times["raw"], times["clear"], times["sealed"]
    gib = array.nbytes / 2**30
    print(f"tensor: {array.nbytes / 2**20:.0f} MiB float32 over loopback, sender and receiver in two processes")
    for i, (r, c, s) in enumerate(zip(raw, clear, sealed)):
        print(f"  rep {i}: raw {gib / r:5.2f} GiB/s   clear {gib / c:5.2f} GiB/s   sealed {gib / s:5.2f} GiB/s   "
              f"sealed/raw {r / s:.2f}   sealed/clear {c / s:.2f}")
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"median: raw {gib / med['raw']:.2f} GiB/s, clear {gib / med['clear']:.2f} GiB/s, "
          f"sealed {gib / med['sealed']:.2f} GiB/s; median of ratios: "
          f"sealed/raw {statistics.median([r / s for r, s in zip(raw, sealed)]):.2f} (target >= 0.7), "
          f"clear/raw {statistics.median([r / c for r, c in zip(raw, clear)]):.2f}, "
          f"sealed/clear {statistics.median([c / s for c, s in zip(clear, sealed)]):.2f}")
    print(f"best: raw {gib / min(raw):.2f} GiB/s, clear {gib / min(clear):.2f} GiB/s, sealed {gib / min(sealed):.2f} "
          f"GiB/s, sealed/raw {min(raw) / min(sealed):.2f} (other load on the machine only ever adds time)")
    print(f"received array owns its buffer: {owns}; receiving a sealed tensor allocates {allocation:.2f} x its size "
          f"(1.00 = decrypted straight into the array)")


if __name__ == "__main__":
    main()
