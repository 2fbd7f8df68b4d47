"""A classroom on the namespace testbed (root): N agents, each in its own network namespace on
the testbed's bridge, finding each other by mDNS there, as devices on one LAN do.

    sudo .venv/bin/python bench/classroom_testbed.py [--devices 64] [--cpu 0.2] [--mem 512M] [--rounds 2]

One testbed runs on a machine at a time: where others use it too, run this under
`flock /tmp/swarm-testbed.lock ...`. It takes down any testbed up, then:

  up        `swarm testbed up --devices N --cpu C --mem M`: seconds until every agent logged
            that it listens (their start shares this machine's cores);
  status    `swarm testbed exec dev0 -- swarm status --json --expect N --wait 60` (mDNS on the
            bridge, no --peers), --rounds times: seconds to its exit, and the devices it
            listed alive;
  memory    each agent's RSS (psutil), once idle: min, median, max;
and takes the testbed down at the end (and on any failure).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def swarm(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--cpu", default="0.2")
    parser.add_argument("--mem", default="512M")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from swarm.testbed import testbed

    swarm("testbed", "down")
    try:
        t0 = time.monotonic()
        up = swarm("testbed", "up", "--devices", str(args.devices), "--cpu", args.cpu, "--mem", args.mem)
        took_up = time.monotonic() - t0
        if up.returncode != 0:
            print(f"testbed up failed: {up.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        print(f"{args.devices} agents on the testbed's bridge ({args.cpu} core, {args.mem} each): all listening "
              f"{took_up:.1f} s after `swarm testbed up` began")
        for k in range(args.rounds):
            t0 = time.monotonic()
            st = swarm("testbed", "exec", "dev0", "--", "swarm", "status", "--json", "--expect", str(args.devices),
                       "--wait", "60")
            took = time.monotonic() - t0
            alive = sum(d.get("health") == "alive" for d in json.loads(st.stdout)) if st.returncode == 0 else 0
            print(f"  status round {k + 1} (mDNS on the bridge, from dev0): {took:.2f} s, {alive} of "
                  f"{args.devices} listed alive" + ("" if st.returncode == 0 else f"; exit {st.returncode}: "
                                                    f"{st.stderr.strip()[-300:]}"))
        rss = []
        for device in testbed.load().devices:
            try:
                rss.append(psutil.Process(device.pid).memory_info().rss / 2**20)
            except psutil.Error:
                pass
        if rss:
            print(f"  idle agents' RSS: {min(rss):.0f} / {statistics.median(rss):.0f} / {max(rss):.0f} MiB "
                  f"(min / median / max of {len(rss)})")
    finally:
        swarm("testbed", "down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
