"""What the runtime commands (join, status, token, testbed) share: flags, logging, running trio."""
from __future__ import annotations

import argparse
import logging
import sys

from swarm.errors import SwarmError

LOG_FORMAT = "%(asctime)s.%(msecs)03d {who} %(levelname)s %(message)s"
LOG_DATE = "%Y-%m-%d %H:%M:%S"


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {value}")
    return value


def add_network_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interface", metavar="NAME|ADDRESS",
                        help="network interface (or one of its addresses) for discovery and connections "
                             "(default: $SWARM_INTERFACE, else the default route's)")
    parser.add_argument("--peers", metavar="HOST:PORT,...",
                        help="agents to reach directly, where mDNS does not get through (default: $SWARM_PEERS)")


def add_token_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", metavar="DIR",
                        help="state directory (default: $SWARM_STATE_DIR, /var/lib/swarm as root, "
                             "else ~/.local/share/swarm)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the cluster token (default: $SWARM_TOKEN, else STATE_DIR/token)")


def setup_logging(who: str, verbose: bool = False) -> None:
    """One line per event on stderr: time, who, level, message."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(who=who.replace("%", "%%")), LOG_DATE))
    root = logging.getLogger("swarm")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def run_trio(async_fn, *args):
    """trio.run, with a SwarmError raised inside nurseries unwrapped from its exception group
    so that the CLI prints it as a plain message."""
    import trio

    try:
        return trio.run(async_fn, *args)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        user = [e for e in leaves if isinstance(e, SwarmError)]
        if user and all(isinstance(e, (SwarmError, trio.Cancelled)) for e in leaves):
            raise user[0] from None
        if leaves and all(isinstance(e, KeyboardInterrupt) for e in leaves):
            raise KeyboardInterrupt from None
        raise


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
