"""CPU one sealed message costs its sender and receiver: small messages echoed over loopback.

    PYTHONPATH=. python bench/message_cpu.py [--count 3000] [--channels 512] [--profile]

A client in this process sends a JobData like a group BatchNorm exchange (three float64
arrays: a count and two of --channels values) on an authenticated PeerConnection to an echo
server in its own process, and waits for the echo before sending the next. It prints its own
CPU time per round trip (one message sent, one received: framing, sealing, trio's waits and
the system calls), and with --profile the functions that took it.
"""
from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.net import Credentials, connect_peer, serve_peers  # noqa: E402
from swarm.wire import JobData, Limits  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"
LIMITS = Limits(frame=1 << 20, payload=1 << 31)
WARMUP = 50


def echo_server(ports: multiprocessing.Queue) -> None:
    async def main() -> None:
        async def echo(conn) -> None:
            async for message in conn:
                await conn.send(message)

        async with trio.open_nursery() as nursery:
            ports.put(await nursery.start(serve_peers, echo, Credentials("server", TOKEN, LIMITS), ["127.0.0.1"], 0))
    trio.run(main)


async def client(port: int, count: int, channels: int, profile: bool) -> float:
    conn = await connect_peer("127.0.0.1", port, Credentials("client", TOKEN, LIMITS))
    body = {"k": ["bn", 3, 0, 1, "layers.4", "fwd"],
            "p": {"arrays": [np.ones(1), np.ones(channels), np.ones(channels)]}}
    message = JobData("job", 0, "x", body)
    for _ in range(WARMUP):
        await conn.send(message)
        await conn.receive()
    profiler = cProfile.Profile() if profile else None
    start = time.process_time()
    if profiler:
        profiler.enable()
    for _ in range(count):
        await conn.send(message)
        await conn.receive()
    if profiler:
        profiler.disable()
    spent = time.process_time() - start
    await conn.aclose()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    return spent / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--channels", type=int, default=512)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=echo_server, args=(ports,), daemon=True)
    server.start()
    try:
        per = trio.run(client, ports.get(timeout=30), args.count, args.channels, args.profile)
    finally:
        server.kill()
    print(f"client CPU per round trip: {per * 1e6:.0f} us ({args.count} messages of 3 arrays, "
          f"{args.channels} channels{', profiled' if args.profile else ''})")


if __name__ == "__main__":
    main()
