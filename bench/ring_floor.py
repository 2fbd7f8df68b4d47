"""The least a ring all-reduce of yolov2-16's gradients costs each testbed device (root).

    sudo python bench/ring_floor.py [--devices 4,8] [--cpu 0.2] [--bandwidth 100mbit]
                                    [--mbytes 13.75] [--repeats 3] [--sealed] [--gloo]

For each N it brings up a namespace testbed of N devices (their agents stay idle) and runs,
in every device's namespace and CPU cgroup, a bare ring all-reduce of --mbytes of float32
(yolov2-16's 3.44 M parameters by default): a reduce-scatter then an all-gather, blocking
sockets, numpy adds, a thread per send, and nothing else — no framing, no event loop, no
tensors. With --sealed it also runs that ring with every megabyte sealed before its send and
opened after its receive (ChaCha20-Poly1305, as swarm seals), in the same threads: what a
sealed transport that moves whole buffers with blocking calls would cost, beside swarm's own
(bench/ring_swarm.py). With --gloo it also sums yolov2-16's five gradient buckets through gloo
(torch.distributed, what DDP under torchrun uses), in the same namespaces and cgroups. It
prints, as medians over the devices of each one's median over --repeats, the process CPU
seconds (and of them the system's) and the wall seconds of one all-reduce.

That is the floor under what summing the gradients costs a tiles or dp device on this
testbed, whatever the runtime does: the bytes through the kernel (both ends of a link,
the bridge and the bandwidth caps run in the context of whichever process is on the CPU)
and the adds. bench/tiles_cpu.py gives the compute beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 4761


RECORD = 1 << 20  # what --sealed seals at a time, as swarm.limits.SEAL_RECORD


def ring_child(me: int, addresses: list[str], nbytes: int, repeats: int, sealed: bool = False) -> None:
    """One device's side: `repeats` all-reduces with its ring neighbours; prints JSON. With
    `sealed`, every RECORD bytes sent are sealed with ChaCha20-Poly1305 (swarm's AEAD) before
    the send and opened after the receive, in the same threads."""
    import numpy as np
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    n = len(addresses)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addresses[me], PORT))
    server.listen()
    deadline = time.monotonic() + 30
    while True:  # the next device may not listen yet
        try:
            out = socket.create_connection((addresses[(me + 1) % n], PORT), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    inc, _ = server.accept()
    data = np.ones(nbytes // 4, np.float32)
    received = np.empty_like(data)
    chunks, landing = np.array_split(data, n), np.array_split(received, n)

    def receive_exactly(view: memoryview) -> None:
        got = 0
        while got < len(view):
            got += inc.recv_into(view[got:])

    aead = ChaCha20Poly1305(bytes(32))  # the cost is measured, not the secrecy
    numbers = {"out": 0, "in": 0}  # each direction's records, the nonce
    out_record, in_record = bytearray(RECORD + 16), bytearray(RECORD + 16)

    def nonce(direction: str) -> bytes:
        numbers[direction] += 1
        return numbers[direction].to_bytes(12, "big")

    def send(view: memoryview) -> None:
        if not sealed:
            out.sendall(view)
            return
        for start in range(0, len(view), RECORD):
            piece = view[start:start + RECORD]
            record = memoryview(out_record)[:len(piece) + 16]
            aead.encrypt_into(nonce("out"), piece, None, record)
            out.sendall(record)

    def receive(view: memoryview) -> None:
        if not sealed:
            receive_exactly(view)
            return
        for start in range(0, len(view), RECORD):
            piece = view[start:start + RECORD]
            record = memoryview(in_record)[:len(piece) + 16]
            receive_exactly(record)
            aead.decrypt_into(nonce("in"), record, None, piece)

    cpu, wall, system = [], [], []
    for _ in range(repeats):
        c0, t0, s0 = time.process_time(), time.monotonic(), os.times().system
        for phase in ("reduce-scatter", "all-gather"):
            for k in range(n - 1):
                if phase == "reduce-scatter":
                    send_idx, recv = (me - k) % n, (me - k - 1) % n
                else:
                    send_idx, recv = (me + 1 - k) % n, (me - k) % n
                sender = threading.Thread(target=send, args=(memoryview(chunks[send_idx]).cast("B"),))
                sender.start()
                receive(memoryview(landing[recv]).cast("B"))
                sender.join()
                if phase == "reduce-scatter":
                    chunks[recv] += landing[recv]
                else:
                    chunks[recv][:] = landing[recv]
        cpu.append(time.process_time() - c0)
        wall.append(time.monotonic() - t0)
        system.append(os.times().system - s0)
    print(json.dumps({"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
                      "system_s": statistics.median(system)}))


def gloo_child(me: int, addresses: list[str], repeats: int) -> None:
    """One device's side through gloo, as DDP sums: yolov2-16's five gradient buckets
    (ring_swarm.BUCKETS), each an asynchronous all_reduce, the top one first, all under way at once."""
    import torch
    import torch.distributed as dist

    from ring_swarm import BUCKETS  # bench/, beside this file
    from swarm.testbed.names import DEVICE_INTERFACE

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=addresses[0], MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=DEVICE_INTERFACE)
    dist.init_process_group("gloo", rank=me, world_size=len(addresses))
    buckets = [torch.ones(size // 4) for size in BUCKETS]
    cpu, wall, system = [], [], []
    for _ in range(repeats + 1):  # the first is left out: gloo's pairs connect on first use
        c0, t0, s0 = time.process_time(), time.monotonic(), os.times().system
        for work in [dist.all_reduce(b, async_op=True) for b in buckets]:
            work.wait()
        cpu.append(time.process_time() - c0)
        wall.append(time.monotonic() - t0)
        system.append(os.times().system - s0)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"cpu_s": statistics.median(cpu[1:]), "wall_s": statistics.median(wall[1:]),
                      "system_s": statistics.median(system[1:])}))


def swarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def measure(n: int, impl: str, args) -> dict:
    from swarm.testbed import cgroups, testbed

    swarm("testbed", "down")
    swarm("testbed", "up", "--devices", str(n), "--cpu", args.cpu, "--mem", "1G", "--bandwidth", args.bandwidth)
    try:
        record = testbed.require()
        addresses = [d.address for d in record.devices]
        children = []
        for k, device in enumerate(record.devices):
            cmd = ["ip", "netns", "exec", device.namespace, sys.executable, __file__, f"--{impl}", str(k),
                   ",".join(addresses), str(int(args.mbytes * 1e6)), str(args.repeats)]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
            cgroups.add_process([Path(c) for c in device.cgroups], child.pid)  # the device's CPU share
            children.append(child)
        results = [json.loads(child.communicate(timeout=600)[0]) for child in children]
    finally:
        swarm("testbed", "down")
    return {"devices": n, "cpu_s": statistics.median(r["cpu_s"] for r in results),
            "cpu_s_range": [min(r["cpu_s"] for r in results), max(r["cpu_s"] for r in results)],
            "wall_s": statistics.median(r["wall_s"] for r in results),
            "system_s": statistics.median(r["system_s"] for r in results)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--bare", "--sealed", "--gloo"):
        me, addresses, nbytes, repeats = sys.argv[2:6]
        if sys.argv[1] in ("--bare", "--sealed"):
            ring_child(int(me), addresses.split(","), int(nbytes), int(repeats), sealed=sys.argv[1] == "--sealed")
        else:
            gloo_child(int(me), addresses.split(","), int(repeats))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="4,8")
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--mbytes", type=float, default=13.75)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gloo", action="store_true", help="also sum yolov2-16's five buckets with gloo (torch.distributed), "
                   "as DDP does, on the same testbed")
    p.add_argument("--sealed", action="store_true", help="also the bare ring with every megabyte sealed and opened "
                   "(ChaCha20-Poly1305, swarm's AEAD) in its sending and receiving threads")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    print(f"ring all-reduce of {args.mbytes:g} MB over testbed devices ({args.cpu} core, {args.bandwidth} each)")
    print(f"{'devices':>8} {'sum':>5} {'CPU s':>7} {'(range)':>13} {'system':>7} {'wall s':>7} {'MB out/in':>10}")
    for n in (int(x) for x in args.devices.split(",")):
        for impl in ("bare",) + ("sealed",) * args.sealed + ("gloo",) * args.gloo:
            r = measure(n, impl, args)
            moved = 2 * (n - 1) / n * args.mbytes
            print(f"{n:>8} {impl:>5} {r['cpu_s']:7.3f} {r['cpu_s_range'][0]:6.3f}-{r['cpu_s_range'][1]:.3f} "
                  f"{r['system_s']:7.3f} {r['wall_s']:7.2f} {moved:10.1f}", flush=True)


if __name__ == "__main__":
    main()
