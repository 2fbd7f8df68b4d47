"""What summing yolov2-16's gradients would cost on a lane of blocking threads (root).

    sudo python bench/ring_lane.py [--devices 8] [--cpu 0.2] [--bandwidth 100mbit] [--repeats 5]

A measurement of the design in docs/architecture.md ("Gradient sums on a lane of their own"),
not the runtime's code. Each device, in its namespace and CPU cgroup, opens authenticated,
sealed connections to every other (connect_peer and serve_peers, as a run does). Then it
leaves the event loop alone and sums yolov2-16's five gradient buckets (ring_swarm.BUCKETS)
in a worker thread. For each bucket, in each of the g - 1 rounds of each phase, member i
sends to member i + k and receives from member i - k. A second thread sends (the sans-IO
connection's sealed records, blocking `sendall`), while the first receives straight into the
records' buffers and opens them. The shares are summed in member order, as
swarm.execution.collectives sums them, so every member ends with the same bits.

It prints the same columns as bench/ring_swarm.py and bench/ring_floor.py: medians over the
devices of each one's median over --repeats (the first is left out), CPU-s a sum, of them the
system's, and wall seconds. With a testbed already up (`swarm testbed up`), it runs on that
one and leaves it up; otherwise it brings one up and down.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ring_swarm import BUCKETS  # noqa: E402 - bench/ is not a package
from testbed_group import run_on_devices  # noqa: E402

PORT = 4763
TOKEN = "lane-bench-token-0123456789abcdef"


class Lane:
    """One authenticated connection driven from threads with blocking calls."""

    def __init__(self, conn):
        self.conn = conn  # the PeerConnection: its event-loop side is not used while the lane is
        self.protocol = conn.protocol
        self.sock = socket.socket(fileno=os.dup(conn.stream.socket.fileno()))
        self.sock.settimeout(60)

    def send(self, array) -> None:
        from swarm.wire import JobData

        self.protocol.send(JobData("lane", 0, "share", [array]))
        for buffer in self.protocol.data_to_send():  # sealed as they are taken
            self.sock.sendall(buffer)

    def receive(self):
        """The next share's array, received into the records' buffers and opened there."""
        from swarm.wire import NEED_DATA

        while (event := self.protocol.next_event()) is NEED_DATA:
            view = self.protocol.payload_buffer(more=True)
            if view is not None:
                count = self.sock.recv_into(view)
                self.protocol.payload_received(count)
            else:
                data = self.sock.recv(256 * 1024)
                count = len(data)
                self.protocol.receive_data(data)
            if count == 0:
                raise ConnectionError("the peer closed the lane")
        return event.body[0]

    def close(self) -> None:
        self.sock.setblocking(False)  # (the descriptor's flag, shared with the event loop's socket)
        self.sock.close()


def lane_sum(me: int, n: int, out: dict, into: dict, buckets, sender: ThreadPoolExecutor) -> None:
    """All-reduce each bucket in place: reduce-scatter straight to each chunk's owner, then
    all-gather, in rounds of one send and one receive."""
    import numpy as np

    for flat in buckets:
        chunks = np.array_split(flat, n)
        parts = {me: chunks[me].copy()}
        for k in range(1, n):
            sending = sender.submit(out[(me + k) % n].send, chunks[(me + k) % n])
            parts[(me - k) % n] = into[(me - k) % n].receive()
            sending.result()
        total = parts[0].copy()
        for j in range(1, n):  # member order, as collectives._direct
            total += parts[j]
        chunks[me][:] = total
        for k in range(1, n):
            sending = sender.submit(out[(me + k) % n].send, chunks[me])
            src = (me - k) % n
            chunks[src][:] = into[src].receive()
            sending.result()


def lane_child(me: int, addresses: list[str], repeats: int) -> None:
    import numpy as np
    import trio

    from swarm.net import Credentials, connect_peer, serve_peers

    n = len(addresses)
    creds = Credentials(f"lane-node-{me}", TOKEN)
    incoming: dict[int, object] = {}

    async def main() -> dict:
        everyone = trio.Event()

        async def handler(conn) -> None:
            incoming[int(conn.peer_id.rsplit("-", 1)[1])] = conn
            if len(incoming) == n - 1:
                everyone.set()
            await trio.sleep_forever()

        async def connect(k: int):
            deadline = time.monotonic() + 30
            while True:  # the other device may not listen yet
                try:
                    return await connect_peer(addresses[k], PORT, creds)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_peers, handler, creds, [addresses[me]], PORT)
            outgoing = {k: await connect(k) for k in range(n) if k != me}
            await everyone.wait()
            out = {k: Lane(c) for k, c in outgoing.items()}
            into = {k: Lane(c) for k, c in incoming.items()}

            def measure() -> dict:
                cpu, wall, system = [], [], []
                with ThreadPoolExecutor(1) as sender:
                    for r in range(repeats + 1):
                        buckets = [np.full(size // 4, float(me + 1), np.float32) for size in BUCKETS]
                        c0, t0, s0 = time.process_time(), time.monotonic(), os.times().system
                        lane_sum(me, n, out, into, buckets, sender)
                        if r:
                            cpu.append(time.process_time() - c0)
                            wall.append(time.monotonic() - t0)
                            system.append(os.times().system - s0)
                        want = n * (n + 1) / 2
                        assert all(bool((b == want).all()) for b in buckets), "wrong sum"
                return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
                        "system_s": statistics.median(system), "cpus": cpu}

            result = await trio.to_thread.run_sync(measure)
            for lane in (*out.values(), *into.values()):
                lane.close()
            await trio.sleep(2.0)  # the others finish with our connections
            nursery.cancel_scope.cancel()
        return result

    print(json.dumps(trio.run(main)), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        me, addresses, repeats = sys.argv[2:5]
        lane_child(int(me), addresses.split(","), int(repeats))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    mbytes = sum(BUCKETS) / 1e6
    print(f"lane all-reduce of {mbytes:.2f} MB in {len(BUCKETS)} buckets over testbed devices "
          f"({args.cpu} core, {args.bandwidth} each)")
    print(f"{'devices':>8} {'CPU s':>7} {'(range)':>13} {'system':>7} {'wall s':>7} {'MB out/in':>10}")
    results = run_on_devices(__file__, args.devices, args.cpu, args.bandwidth, [str(args.repeats)])
    cpu = [r["cpu_s"] for r in results]
    moved = 2 * (args.devices - 1) / args.devices * mbytes
    print(f"{args.devices:>8} {statistics.median(cpu):7.3f} {min(cpu):6.3f}-{max(cpu):.3f} "
          f"{statistics.median(r['system_s'] for r in results):7.3f} "
          f"{statistics.median(r['wall_s'] for r in results):7.2f} {moved:10.1f}", flush=True)


if __name__ == "__main__":
    main()
