"""`swarm status`: the devices of the swarm, their resources and health (table or JSON)."""
from __future__ import annotations

import json
import os
import sys
import time

from swarm.commands.flags import add_network_args, add_token_args, positive_int
from swarm.commands.logs import setup_logging
from swarm.errors import run_trio

COLUMNS = ("NAME", "ADDRESS", "CORES", "MEMORY", "SPARE", "ACCEL", "VERSION", "LAST SEEN", "HEALTH", "JOB")


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="list the devices of the swarm", description=(
        "Find the agents on the network (mDNS, plus --peers), connect to each, and list them with "
        "their cores, memory (all of it, and what it can spare for a plan now: the memory available beside "
        "everything else that runs there, less the reserve `swarm join --reserve` keeps back), accelerator (and "
        "its own memory, or 'shared' where it shares the device's, as on a Jetson), version, when they were last "
        "heard from, and health."))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--wait", type=float, default=2.0, metavar="SECONDS",
                   help="how long to look for devices (default: 2)")
    p.add_argument("--expect", type=positive_int, metavar="N",
                   help="stop looking as soon as N devices answer")
    p.add_argument("--watch", action="store_true",
                   help="after the list, keep printing health changes (joined, suspect, dead, recovered, left)")
    p.add_argument("--heartbeat", type=float, default=0.25, metavar="SECONDS",
                   help="heartbeat interval asked of the agents while watching (default: 0.25)")
    add_network_args(p)
    add_token_args(p)
    p.add_argument("--no-mdns", action="store_true", help="only use --peers, no mDNS")
    p.add_argument("--verbose", "-v", action="store_true", help="log connection attempts to stderr")
    p.set_defaults(run=run)


def run(args) -> int:
    from swarm.ports import DEFAULT_PORT
    from swarm.errors import SwarmError
    from swarm.host.state import find_token, process_id, state_dir_from
    from swarm.net import Credentials, parse_peers, resolve_network

    if args.wait < 0 or args.heartbeat <= 0:
        raise SwarmError("--wait must not be negative and --heartbeat must be positive")
    state_dir = state_dir_from(args.state_dir)
    token, _ = find_token(args.token_file, state_dir, create=False)
    network = resolve_network(args.interface)
    peers = parse_peers(args.peers or os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    setup_logging("swarm status", args.verbose)
    if not args.verbose:
        import logging
        logging.getLogger("swarm").setLevel(logging.WARNING)
    credentials = Credentials(process_id(state_dir), token)
    return run_trio(_status, args, credentials, network, peers)


async def _status(args, credentials, network, peers) -> int:
    from swarm.cluster import open_roster

    async with open_roster(credentials, network, peers=peers, discover=not args.no_mdns,
                            heartbeat_interval=args.heartbeat) as cluster:
        if args.expect:
            await cluster.wait_for(args.expect, args.wait)
        else:
            import trio
            await trio.sleep(args.wait)
        devices = cluster.devices()
        if args.json:
            print(json.dumps([d.as_dict() for d in devices], indent=None if args.watch else 2), flush=True)
        else:
            print(format_table(devices), flush=True)
        if not devices:
            where = f"interface {network.interface}" + ("" if args.no_mdns else " (mDNS)")
            print(f"swarm status: no devices found on {where} within {args.wait:g} s; is `swarm join` running "
                  f"on them? Where multicast is blocked, name them with --peers.", file=sys.stderr)
        if strangers := cluster.strangers():
            print(f"swarm status: {strangers}", file=sys.stderr)
        if args.watch:
            async for event in cluster.subscribe():  # changes after the listing above
                device = cluster.device(event.node_id)
                name = device.name if device else event.node_id
                if args.json:
                    print(json.dumps({"event": event.kind, "node_id": event.node_id, "name": name,
                                      "time": time.time(), "reason": event.reason}), flush=True)
                else:
                    print(f"{time.strftime('%H:%M:%S')} {name} {event.kind}"
                          + (f" ({event.reason})" if event.reason else ""), flush=True)
    return 0


def _memory(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _spare(d) -> str:
    """What the device could spare when it last said (three figures: 991 MiB, 3.52 GiB)."""
    from planner.units import format_bytes

    return "?" if d.spare is None else format_bytes(d.spare)


def _accelerator(d) -> str:
    """cpu; cuda with its own memory, or shared (a Jetson: the MEMORY column is all of it)."""
    if d.accelerator in ("cpu", "?"):
        return d.accelerator
    if d.accelerator_memory == 0:
        return f"{d.accelerator} (shared)"
    return f"{d.accelerator} {_memory(d.accelerator_memory)}" if d.accelerator_memory > 0 else d.accelerator


def _ago(t: float | None) -> str:
    return "never" if t is None else f"{max(0.0, time.time() - t):.1f} s ago"


def format_table(devices) -> str:
    rows = [COLUMNS]
    for d in devices:
        health = d.health + (f": {d.error}" if d.error and d.health in ("unreachable", "refused", "dead") else "")
        job = f"{d.job_id} ({d.job_state})" if d.job_id else "-"
        rows.append((d.name, f"{d.address}:{d.port}", str(d.cores or "?"), _memory(d.memory), _spare(d),
                     _accelerator(d), d.version, _ago(d.last_seen), health, job))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)
