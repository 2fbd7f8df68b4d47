"""`swarm jobs`, `swarm logs`, `swarm stop`, `swarm fetch`: the training runs that agents
coordinate for users who went away (`swarm train --detach`), listed, followed, stopped, and
their checkpoints brought to this machine."""
from __future__ import annotations

import codecs
import json
import os
import sys
import tempfile
from pathlib import Path

from swarm.commands.flags import add_network_args, add_token_args, non_negative_float
from swarm.errors import SwarmError, run_trio

COLUMNS = ("ID", "MODEL", "STEP", "SAMPLES/S", "DEVICES", "STATE", "COORDINATOR")
FOLLOW_S = 0.5  # how often `swarm logs -f` asks for more of the log
STOP_WAIT_S = 60.0  # how long `swarm stop` waits to say the run has stopped
ASK_S = 10.0  # how long an agent has to answer one request
FOLLOW_NEXT_S = 60.0  # how long `swarm logs -f` looks for the next coordinator of a run whose one is gone


def _common(p) -> None:
    p.add_argument("--wait", type=non_negative_float, default=2.0, metavar="SECONDS",
                   help="how long to look for the agents (default: 2)")
    add_network_args(p)
    add_token_args(p)


def add_parser(sub) -> None:
    p = sub.add_parser("jobs", help="list detached training runs", description=(
        "List the training runs the agents coordinate (`swarm train --detach`): id, model, step, "
        "samples/s, devices, state, and the device coordinating each."))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (every agent's record of "
                   "each run: after a fail-over, the older coordinators' too, each with its term)")
    _common(p)
    p.set_defaults(run=run_jobs)

    p = sub.add_parser("logs", help="show a detached run's log", description=(
        "Print the log of a detached training run (its progress lines and events)."))
    p.add_argument("job", metavar="JOB", help="the run's id (as `swarm jobs` lists it)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing what the run logs until it ends")
    _common(p)
    p.set_defaults(run=run_logs)

    p = sub.add_parser("stop", help="stop a detached run, with a final checkpoint", description=(
        "Stop a detached training run after the step under way; its checkpoint then holds that "
        "step (`swarm fetch` brings it here; `swarm train --resume` continues it)."))
    p.add_argument("job", metavar="JOB", help="the run's id")
    _common(p)
    p.set_defaults(run=run_stop)

    p = sub.add_parser("fetch", help="bring a detached run's latest checkpoint here", description=(
        "Copy the latest checkpoint of a detached training run to this machine."))
    p.add_argument("job", metavar="JOB", help="the run's id")
    p.add_argument("--out", metavar="PATH", help="where to write it (default: swarm-JOB.pt)")
    _common(p)
    p.set_defaults(run=run_fetch)


# -- reaching the agents --------------------------------------------------------------------

def run_client(args, main, *extra) -> int:
    """main(args, cluster, *extra) with a roster of the swarm's agents, as `swarm status` finds them."""
    import logging

    from swarm.ports import DEFAULT_PORT
    from swarm.host.state import find_token, process_id, state_dir_from
    from swarm.net import Credentials, parse_peers, resolve_network

    state_dir = state_dir_from(args.state_dir)
    token, _ = find_token(args.token_file, state_dir, create=False)
    network = resolve_network(args.interface)
    peers = parse_peers(args.peers or os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    logging.getLogger("swarm").setLevel(logging.WARNING)
    return run_trio(_with_roster, Credentials(process_id(state_dir), token), network, peers, main, args, *extra)


async def _with_roster(credentials, network, peers, main, args, *extra) -> int:
    from swarm.cluster import open_roster

    async with open_roster(credentials, network, peers=peers) as cluster:
        return await main(args, cluster, *extra)


async def ask(cluster, device, request):
    """The agent's answer, or SwarmError in a line (it left, or said why not)."""
    import trio

    try:
        answer = await cluster.ask(device.node_id, request, ASK_S)
    except trio.TooSlowError:
        raise SwarmError(f"{device.name} did not answer within {ASK_S:g} s") from None
    if answer.error:
        raise SwarmError(answer.error)
    return answer


async def list_runs(cluster, devices) -> list[tuple[object, dict]]:
    """(device, run) for every run of every device that answers."""
    import trio

    from swarm.wire import DetachList

    found: list[tuple[object, dict]] = []

    async def one(device) -> None:
        try:
            answer = await ask(cluster, device, DetachList(0))
        except SwarmError:
            return  # an agent that does not answer (or runs no detached jobs) has none to list
        found.extend((device, job) for job in answer.jobs)

    async with trio.open_nursery() as nursery:
        for device in devices:
            nursery.start_soon(one, device)
    return sorted(found, key=lambda f: -f[1].get("started", 0))


async def find_run(cluster, job_id: str, wait: float, newer_than: int = -1, still=None):
    """(device, run) of the agent that coordinates run `job_id` (of the newest term, after a
    fail-over, and newer than term `newer_than`, or of that term on device `still`, running or
    done: the one a follower lost touch with, back on a new connection): each agent is asked
    as it appears, for up to `wait` seconds (at least long enough to reach those known)."""
    import trio

    asked: set[str] = set()
    best = None
    deadline = trio.current_time() + max(wait, 2.0)
    while True:
        if newer_than >= 0 and not best:  # following a run to its next coordinator: it may start any moment
            asked.clear()
            await trio.sleep(FOLLOW_S)
        fresh = [d for d in cluster.alive() if d.node_id not in asked]
        asked |= {d.node_id for d in fresh}
        for device, run in await list_runs(cluster, fresh):
            term, back = run.get("term", 0), device.node_id == still and (run.get("state", "").startswith("running")
                                                                            or run.get("state") == "done")
            if run.get("id") == job_id and (term > newer_than or (term == newer_than and back)) and \
                    (best is None or run.get("term", 0) > best[1].get("term", 0)):
                best = device, run
        if best is not None and not fresh:
            return best
        if trio.current_time() >= deadline:
            names = ", ".join(sorted(d.name for d in cluster.alive())) or "none"
            raise SwarmError(f"no agent knows a run {job_id} (asked: {names}); `swarm jobs` lists the runs")
        await trio.sleep(0.1)


def newest_terms(runs: list[dict]) -> list[dict]:
    """Each run once: the term of its newest coordinator (an older one may be listed by an
    agent that came back after a fail-over)."""
    newest: dict[str, dict] = {}
    for run in runs:
        if run["id"] not in newest or run.get("term", 0) > newest[run["id"]].get("term", 0):
            newest[run["id"]] = run
    return [run for run in runs if newest[run["id"]] is run]


# -- swarm train --detach -------------------------------------------------------------------

def detach(args, flags: list[str]) -> int:
    """Hand the run of `swarm train` flags `flags` to an agent; print its id."""
    return run_client(args, _detach, flags)


async def _detach(args, cluster, flags: list[str]) -> int:
    import trio

    from swarm.wire import DetachSubmit

    wait = args.wait if args.wait is not None else 2.0
    if args.coordinator:
        with trio.move_on_after(max(wait, 2.0)):
            while not any(d.name == args.coordinator for d in cluster.alive()):
                await trio.sleep(0.1)
        named = [d for d in cluster.alive() if d.name == args.coordinator]
        if not named:
            names = ", ".join(sorted(d.name for d in cluster.alive())) or "none"
            raise SwarmError(f"no agent named {args.coordinator} answered within {max(wait, 2.0):g} s (found: "
                             f"{names})")
        device = named[0]
    else:
        await trio.sleep(wait)
        if not cluster.alive():
            raise SwarmError(f"no agent answered within {wait:g} s to coordinate the run; is `swarm join` running "
                             f"on the devices? (--peers names them where mDNS does not get through)")
        device = least_loaded(cluster.alive(), await list_runs(cluster, cluster.alive()))
    (run,) = (await ask(cluster, device, DetachSubmit(0, flags))).jobs
    print(run["id"])
    print(f"run {run['id']} is coordinated by {device.name}: `swarm logs {run['id']} -f` follows it, `swarm stop "
          f"{run['id']}` ends it, `swarm fetch {run['id']}` brings its checkpoint here", file=sys.stderr)
    return 0


def least_loaded(devices, runs: list[tuple[object, dict]]):
    """The device to coordinate a new run: one not in a job before one that is, then the
    fewest runs coordinated, then the most cores and memory (name breaks ties)."""
    coordinating = {}
    for device, run in runs:
        if run["state"].startswith("running"):
            coordinating[device.node_id] = coordinating.get(device.node_id, 0) + 1
    return min(devices, key=lambda d: (d.job_id is not None, coordinating.get(d.node_id, 0), -(d.cores or 0),
                                       -(d.memory or 0), d.name))


# -- swarm jobs ---------------------------------------------------------------------------

def run_jobs(args) -> int:
    return run_client(args, _jobs)


async def _jobs(args, cluster) -> int:
    import trio

    await trio.sleep(args.wait)
    every = [run for _, run in await list_runs(cluster, cluster.alive())]
    runs = newest_terms(every)
    if args.json:
        print(json.dumps(every, indent=2))
    elif runs:
        print(format_table(runs))
    else:
        print(f"no detached runs on the {len(cluster.alive())} device(s) that answered", file=sys.stderr)
    return 0


def format_table(runs: list[dict]) -> str:
    rows = [COLUMNS]
    for r in runs:
        state = r["state"] + (f": {r['detail']}" if r.get("detail") else "")
        rows.append((r["id"], r["model"], f"{r['step']}/{r['steps'] if r['steps'] else '?'}",
                     f"{r['samples_per_s']:.1f}", str(r["devices"]), state, r["node"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


# -- swarm logs -----------------------------------------------------------------------------

def run_logs(args) -> int:
    return run_client(args, _logs)


async def _logs(args, cluster) -> int:
    import trio

    from swarm.wire import DetachRead

    device, run = await find_run(cluster, args.job, args.wait)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offset = 0
    while True:
        try:
            chunk = await ask(cluster, device, DetachRead(0, args.job, "log", offset))
        except SwarmError as exc:
            if not args.follow:
                raise
            # its coordinator's device is gone: follow the run to the successor the agents elect,
            # or back to the same coordinator if only this connection to it was lost
            print(f"-- {device.name}, coordinating run {args.job}, is gone ({exc}); following the run to its next "
                  f"coordinator --", flush=True)
            lost, term = device, run.get("term", 0)
            device, run = await find_run(cluster, args.job, FOLLOW_NEXT_S, newer_than=term, still=lost.node_id)
            if device.node_id == lost.node_id and run.get("term", 0) == term:  # (a new term there: a new log)
                print(f"-- {device.name} answers again --", flush=True)
            else:
                print(f"-- run {args.job} is now coordinated by {device.name} --", flush=True)
                decoder, offset = codecs.getincrementaldecoder("utf-8")("replace"), 0
            continue
        if chunk.data:
            sys.stdout.write(decoder.decode(chunk.data))
            sys.stdout.flush()
            offset += len(chunk.data)
        if offset >= chunk.total:
            if not args.follow or chunk.state != "running":
                break
            await trio.sleep(FOLLOW_S)
    sys.stdout.write(decoder.decode(b"", final=True))
    return 0


# -- swarm stop -----------------------------------------------------------------------------

def run_stop(args) -> int:
    return run_client(args, _stop)


async def _stop(args, cluster) -> int:
    import trio

    from swarm.wire import DetachList, DetachStop

    device, _ = await find_run(cluster, args.job, args.wait)
    (run,) = (await ask(cluster, device, DetachStop(0, args.job))).jobs
    with trio.move_on_after(STOP_WAIT_S):
        while run["state"].startswith("running"):
            await trio.sleep(FOLLOW_S)
            run = next(r for r in (await ask(cluster, device, DetachList(0))).jobs if r["id"] == args.job)
    where = f"step {run['step']}/{run['steps'] or '?'}"
    if run["state"].startswith("running"):
        print(f"asked run {args.job} to stop; it is still finishing its step ({where}); `swarm jobs` shows when "
              f"it has", file=sys.stderr)
    else:
        print(f"run {args.job} {run['state']} at {where}; `swarm fetch {args.job}` brings its checkpoint here",
              file=sys.stderr)
    return 0


# -- swarm fetch ----------------------------------------------------------------------------

def run_fetch(args) -> int:
    return run_client(args, _fetch)


async def _fetch(args, cluster) -> int:
    from swarm.wire import DetachRead

    out = Path(args.out or f"swarm-{args.job}.pt")
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise SwarmError(f"cannot write {out}: folder {out.parent} does not exist")
    device, _ = await find_run(cluster, args.job, args.wait)
    with tempfile.TemporaryFile(dir=out.parent if str(out.parent) else ".") as part:
        version, offset, total = None, 0, 1
        while offset < total:
            chunk = await ask(cluster, device, DetachRead(0, args.job, "checkpoint", offset))
            if chunk.version != version:  # a newer checkpoint replaced it: start again
                version, offset = chunk.version, 0
                part.seek(0)
                part.truncate()
                if chunk.offset != 0:
                    continue
            part.write(chunk.data)
            offset += len(chunk.data)
            total = chunk.total
            if not chunk.data and offset < total:
                raise SwarmError(f"{device.name} sent no more of run {args.job}'s checkpoint at byte {offset} of "
                                 f"{total}")
        part.seek(0)
        from shutil import copyfileobj

        from swarm.local.checkpoint import atomic_write

        try:
            atomic_write(out, lambda f: copyfileobj(part, f))
        except OSError as exc:
            raise SwarmError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"{out}: run {args.job}'s checkpoint from {device.name} ({total / 2**20:.1f} MiB)")
    return 0
