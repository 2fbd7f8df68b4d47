"""Throughput of one 64 MiB tensor over a swarm connection on loopback, as a ratio to a raw
socket sendall of the same bytes (target >= 0.7).

    PYTHONPATH=. python bench/wire_throughput.py [--mib 64] [--reps 7]

The receiver runs in its own process, the sender in this one; one connection of each kind
stays open for the whole run. raw = sendall(memoryview of the array) into recv_into(a
preallocated buffer), then a 1-byte ack; swarm = an authenticated PeerConnection sending
JobData(body=array), the receiver getting a new numpy array filled by recv_into, then a
Pong. Each repetition measures raw then swarm back to back; the ratio of each pair is
reported, the medians, and the ratio of the best times.
"""
from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import threading
import time
import tracemalloc

import numpy as np
import trio

from swarm.net import Credentials, connect_peer, serve_peers
from swarm.wire import JobData, Limits, Pong

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
            ports.put((listener.getsockname()[1], port))

    trio.run(serve)


async def measure(raw_port: int, swarm_port: int, array: np.ndarray, reps: int) -> tuple[list, list, bool]:
    raw_sock = socket.create_connection(("127.0.0.1", raw_port))
    raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = await connect_peer("127.0.0.1", swarm_port, Credentials("sender", TOKEN, LIMITS))
    data = memoryview(array).cast("B")
    message = JobData("bench", 0, "tensor", array)

    def raw_once() -> float:
        start = time.perf_counter()
        raw_sock.sendall(data)
        raw_sock.recv(1)
        return time.perf_counter() - start

    raw, swarm = [], []
    try:
        raw_once()  # warm-up both
        await conn.send(message)
        owns = bool((await conn.receive()).seq)
        for _ in range(reps):
            raw.append(raw_once())
            start = time.perf_counter()
            await conn.send(message)
            assert isinstance(await conn.receive(), Pong)
            swarm.append(time.perf_counter() - start)
    finally:
        await conn.aclose()
        raw_sock.close()
    return raw, swarm, owns


def receive_allocation(array: np.ndarray) -> float:
    """Peak bytes Python allocates to receive one tensor, per tensor byte (in this process)."""
    from swarm.wire import CLIENT, SERVER, Connection

    a, b = Connection(CLIENT, "a", TOKEN, limits=LIMITS), Connection(SERVER, "b", TOKEN, limits=LIMITS)
    for _ in range(2):
        for src, dst in ((a, b), (b, a)):
            for buf in src.data_to_send():
                dst.receive_data(bytes(buf))
        a.next_event(), b.next_event()
    a.send(JobData("bench", 0, "tensor", array))
    buffers = a.data_to_send()
    tracemalloc.start()
    b.receive_data(bytes(buffers[0]))
    b.next_event()
    data = memoryview(buffers[1])
    offset = 0
    while (view := b.payload_buffer()) is not None:  # what recv_into does on a socket
        n = min(len(view), 1 << 20)
        view[:n] = data[offset:offset + n]
        b.payload_received(n)
        offset += n
    received = b.next_event()
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
        raw_port, swarm_port = ports.get(timeout=30)
        raw, swarm, owns = trio.run(measure, raw_port, swarm_port, array, args.reps)
    finally:
        receiver.kill()
        receiver.join()
    allocation = receive_allocation(array)

    ratios = [r / s for r, s in zip(raw, swarm)]
    gib = array.nbytes / 2**30
    print(f"tensor: {array.nbytes / 2**20:.0f} MiB float32 over loopback, sender and receiver in two processes")
    for i, (r, s, q) in enumerate(zip(raw, swarm, ratios)):
        print(f"  rep {i}: raw {gib / r:6.2f} GiB/s   swarm {gib / s:6.2f} GiB/s   ratio {q:.2f}")
    print(f"median: raw {gib / statistics.median(raw):.2f} GiB/s, swarm {gib / statistics.median(swarm):.2f} GiB/s, "
          f"ratio of medians {statistics.median(raw) / statistics.median(swarm):.2f}, "
          f"median of ratios {statistics.median(ratios):.2f} (target >= 0.7)")
    print(f"best: raw {gib / min(raw):.2f} GiB/s, swarm {gib / min(swarm):.2f} GiB/s, "
          f"ratio of best times {min(raw) / min(swarm):.2f} (other load on the machine only ever adds time)")
    print(f"received array owns its buffer: {owns}; receiving allocates {allocation:.2f} x the tensor's size "
          f"(1.00 = straight into the array)")


if __name__ == "__main__":
    main()
