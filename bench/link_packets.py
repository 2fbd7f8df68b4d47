"""How large the packets are that the testbed's links carry when every device sends and receives at once (root).

    sudo python bench/link_packets.py [--devices 8] [--cpu 0.2] [--bandwidth 100mbit] [--mbytes 100]
                                      [--congestion bbr,cubic]

Brings up a namespace testbed of --devices (their agents idle), and for each congestion control
has every device stream --mbytes to the next (a ring of plain TCP connections, all at once, each
device in its own cgroup), then prints the packets the kernel processed (/proc/net/softnet_stat:
each packet twice, once at each end of the bridge), the bytes a packet averages, the host's
softirq seconds (/proc/stat) and the slowest stream's seconds. One stream between two idle
devices goes in packets of about 18 kB; with every device sending and receiving at once, a cap
that queued a flow's acknowledgements behind the other direction's data made them 1-2.5 kB
(swarm.testbed.netns.cap_bandwidth).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 4798

CHILD = """
import socket, sys, threading, time
me, peer, nbytes, cc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].encode()
server = socket.create_server((me, %d))
def send():
    for _ in range(200):
        try:
            out = socket.socket()
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc)
            out.connect((peer, %d))
            break
        except OSError:
            time.sleep(0.05)
    t0 = time.monotonic()
    out.sendall(bytes(nbytes))
    out.shutdown(socket.SHUT_WR)
    out.recv(1)
    print(time.monotonic() - t0)
sender = threading.Thread(target=send)
sender.start()
inc, _ = server.accept()
got = 0
while got < nbytes:
    got += len(inc.recv(1 << 20))
inc.close()
sender.join()
""" % (PORT, PORT)


def softnet_packets() -> int:
    return sum(int(line.split()[0], 16) for line in Path("/proc/net/softnet_stat").read_text().splitlines())


def softirq_s() -> float:
    return int(Path("/proc/stat").read_text().split()[7]) / os.sysconf("SC_CLK_TCK")


def swarm(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "swarm", *args], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def measure(args, cc: str) -> str:
    from swarm.testbed import cgroups, testbed

    swarm("testbed", "down")
    swarm("testbed", "up", "--devices", str(args.devices), "--cpu", args.cpu, "--mem", "1G", "--bandwidth", args.bandwidth)
    try:
        devices = testbed.require().devices
        nbytes = int(args.mbytes * 1e6)
        packets, softirq = softnet_packets(), softirq_s()
        children = []
        for k, device in enumerate(devices):
            peer = devices[(k + 1) % len(devices)]
            child = subprocess.Popen(["ip", "netns", "exec", device.namespace, sys.executable, "-c", CHILD,
                                      device.address, peer.address, str(nbytes), cc], stdout=subprocess.PIPE, text=True)
            cgroups.add_process([Path(c) for c in device.cgroups], child.pid)
            children.append(child)
        seconds = max(float(child.communicate(timeout=600)[0]) for child in children)
        packets, softirq = softnet_packets() - packets, softirq_s() - softirq
    finally:
        swarm("testbed", "down")
    per_packet = 2 * len(devices) * nbytes / packets  # data and acknowledgements, each counted at both ends
    return f"{cc:>6} {packets:>10} {per_packet / 1e3:>10.1f} {softirq:>9.2f} {seconds:>9.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--mbytes", type=float, default=100.0)
    p.add_argument("--congestion", default="bbr,cubic", help="TCP congestion controls to try, in turn")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    print(f"{args.devices} devices ({args.cpu} core, {args.bandwidth}), each streaming {args.mbytes:g} MB to the next")
    print(f"{'cc':>6} {'packets':>10} {'kB/packet':>10} {'softirq s':>9} {'stream s':>9}")
    for cc in args.congestion.split(","):
        print(measure(args, cc), flush=True)


if __name__ == "__main__":
    main()
