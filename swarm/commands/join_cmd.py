"""`swarm join`: run this device's agent in the foreground until SIGTERM or Ctrl-C."""
from __future__ import annotations

import logging
import os
import signal
import socket

from swarm.commands.flags import add_network_args, add_token_args, byte_size, port_number
from swarm.commands.logs import setup_logging
from swarm.errors import SwarmError, run_trio

log = logging.getLogger("swarm.agent")


def add_parser(sub) -> None:
    from swarm.ports import DEFAULT_PORT

    p = sub.add_parser("join", help="offer this device to the swarm (runs the agent)", description=(
        "Run the agent: advertise this device on the local network, accept work from a coordinator, "
        "and send it heartbeats. Runs in the foreground and logs to stderr (systemd-friendly); "
        "SIGTERM or Ctrl-C stops it cleanly. The first start creates a cluster token in the state "
        "directory unless one is given: copy it to the other devices with `swarm token`."))
    p.add_argument("--port", type=port_number,
                   help=f"TCP port to listen on (default: the config file's, else {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--name", help="name shown in `swarm status` (default: the host name)")
    add_token_args(p)
    add_network_args(p)
    p.add_argument("--no-mdns", action="store_true", default=None,
                   help="do not advertise on mDNS (reach it with --peers)")
    p.add_argument("--config", metavar="FILE",
                   help="settings file (default: $SWARM_CONFIG, else /etc/swarm/swarm.toml if it exists); "
                        "flags and SWARM_* variables override it")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), help="what this device offers to compute on: cpu "
                   "keeps jobs off its GPU (default: cuda on an NVIDIA GPU or a Jetson, else cpu)")
    p.add_argument("--reserve", metavar="SIZE", type=byte_size,
                   help="memory to keep back from plans for the rest of this device, e.g. 300M, 1G or 0. A plan "
                        "gets what the device can spare when it is made: the memory available then (the kernel's "
                        "MemAvailable and, under a cgroup limit, what the cgroup leaves), plus what the agent "
                        "holds, less this. Default: 1/32 of the device's memory, at least 32M and at most 1G "
                        "(32M on a 1 GiB Pi): room for the page cache that running programs' code and a run's "
                        "data keep in use, which MemAvailable counts as free. Keep more where other programs "
                        "grow after a plan is made (a desktop in use, a camera service that buffers: the most "
                        "they take beyond what they hold when idle). The settings file's `reserve` sets it too")
    p.add_argument("--verbose", "-v", action="store_true", help="log debug detail too")
    p.set_defaults(run=run)


def agent_config(args):
    """The AgentConfig the flags ask for; SwarmError for anything the user must fix."""
    from swarm.agent import DEFAULT_PORT, AgentConfig
    from swarm.commands.train_cmd import check_detached_flags
    from swarm.host.config import apply_settings, config_path, read_settings
    from swarm.host.resources import parse_size, usable_memory
    from swarm.host.state import ensure_state_dir, find_token, node_id, state_dir_from
    from swarm.net import parse_peers, resolve_network

    apply_settings(args, read_settings(config_path(args.config)))
    reserve = parse_size(args.reserve) if isinstance(args.reserve, str) else args.reserve  # the file's: a string
    if reserve is not None and reserve >= usable_memory():
        from planner.units import format_bytes

        raise SwarmError(f"the reserve ({format_bytes(reserve)}) keeps back all of this device's "
                         f"{format_bytes(usable_memory())}: keep back less, or do not join this device")
    state_dir = ensure_state_dir(state_dir_from(args.state_dir))
    token, token_from = find_token(args.token_file, state_dir, create=True)
    network = resolve_network(args.interface)
    peers = parse_peers(args.peers or os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    config = AgentConfig(name=args.name or socket.gethostname(), node_id=node_id(state_dir), token=token,
                         network=network, port=DEFAULT_PORT if args.port is None else args.port, peers=tuple(peers),
                         advertise=not args.no_mdns, accelerator=args.accelerator, state_dir=state_dir,
                         check_run_flags=check_detached_flags, reserve=reserve)
    return config, state_dir, token_from


def run(args) -> int:
    from swarm.host.state import STATE_DIR_ENV

    config, state_dir, token_from = agent_config(args)
    setup_logging(f"swarm[{config.name}]", args.verbose)
    log.info("state in %s; cluster token from %s", state_dir, token_from)
    os.environ[STATE_DIR_ENV] = str(state_dir)  # the jobs' too (profiles are cached there)
    run_trio(_serve_until_signalled, config)
    return 0


async def _serve_until_signalled(config) -> None:
    import trio

    from swarm.agent import Agent
    from swarm.service.notify import Notifier, feed_watchdog

    systemd = Notifier.from_environment()  # under a Type=notify unit; inert otherwise
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed_watchdog, systemd)
            agent = await nursery.start(Agent(config).run)  # returns once it listens and is advertised
            systemd.ready(f"serving on port {agent.port}" + ("" if config.advertise else " (mDNS off)"))
            async for signum in signals:
                log.info("%s: saying goodbye and shutting down", signal.Signals(signum).name)
                systemd.stopping("saying goodbye")
                nursery.cancel_scope.cancel()
                break
    systemd.close()
    log.info("stopped")
