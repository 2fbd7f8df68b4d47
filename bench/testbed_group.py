"""A process on each namespace-testbed device, talking over swarm's own connections (root).

What bench/ring_swarm.py and bench/bn_exchange.py share: `run_on_devices` starts a bench's
`--child` side in the first N devices' namespaces and CPU cgroups (bringing a testbed up and
down when none is up) and gathers the JSON line each prints; `group_endpoint` gives a child the
endpoint training uses (swarm.execution.train_job.WireEndpoint) over authenticated, sealed
connections to the others (serve_peers, RunLinks with connect_peer).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _swarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def run_on_devices(script: str, n: int, cpu: str, bandwidth: str, child_args: list[str]) -> list[dict]:
    """`script --child K ADDRESSES *child_args` in device K's namespace and CPU cgroup, for the
    first `n` devices of the testbed that is up (or of one brought up for it, 1 GiB each, and
    down after); each child's output, one JSON object."""
    from swarm.testbed import cgroups, testbed

    try:
        record = testbed.require()
        own = False
    except Exception:
        record, own = None, True
    if own:
        _swarm("testbed", "up", "--devices", str(n), "--cpu", cpu, "--mem", "1G", "--bandwidth", bandwidth)
        record = testbed.require()
    try:
        devices = record.devices[:n]
        addresses = ",".join(d.address for d in devices)
        children = []
        for k, device in enumerate(devices):
            cmd = ["ip", "netns", "exec", device.namespace, sys.executable, script, "--child", str(k), addresses,
                   *child_args]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            cgroups.add_process([Path(c) for c in device.cgroups], child.pid)  # the device's CPU share
            children.append(child)
        return [json.loads(child.communicate(timeout=900)[0]) for child in children]
    finally:
        if own:
            _swarm("testbed", "down")


@contextlib.asynccontextmanager
async def group_endpoint(me: int, addresses: list[str], port: int, token: str, job: str):
    """Device `me`'s endpoint to devices dev0..devN-1 at `addresses` (each listening on
    `port`), as (endpoint, names). On leaving, it waits a second for the others to finish with
    its connections, then closes them."""
    import trio

    from swarm.execution.channels import send_priority
    from swarm.execution.links import RunLinks
    from swarm.execution.train_job import WireEndpoint
    from swarm.net import Credentials, connect_peer, serve_peers
    from swarm.wire import JobData

    n = len(addresses)
    names = [f"dev{k}" for k in range(n)]
    creds = Credentials(f"{job}-node-{me}", token)
    devices = {names[k]: {"node_id": f"{job}-node-{k}", "address": f"{addresses[k]}:{port}"} for k in range(n)}

    async def connect(address: str):
        host, at = address.rsplit(":", 1)
        deadline = time.monotonic() + 30
        while True:  # the other device may not listen yet
            try:
                return await connect_peer(host, int(at), creds)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await trio.sleep(0.1)

    async def report(name: str, why: str) -> None:
        raise RuntimeError(f"link to {name} broke: {why}")

    links = RunLinks(devices, connect, report)
    by_node = {d["node_id"]: name for name, d in devices.items()}

    async def send_to(node_id: str, body: dict) -> None:
        await links.send(by_node[node_id], JobData(job, 0, "x", body), False, send_priority(tuple(body["k"])))

    ep = WireEndpoint(names[me], {name: d["node_id"] for name, d in devices.items()}, send_to)

    async def handler(incoming) -> None:
        async for message in incoming:
            ep.deliver(message.body)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_peers, handler, creds, [addresses[me]], port)
        yield ep, names
        await trio.sleep(1.0)
        await links.aclose()
        nursery.cancel_scope.cancel()
