"""What the runtime commands (join, status, train) share: their log lines, and running trio."""
from __future__ import annotations

import logging
import sys

from swarm.errors import SwarmError

LOG_FORMAT = "%(asctime)s.%(msecs)03d {who} %(levelname)s %(message)s"
LOG_DATE = "%Y-%m-%d %H:%M:%S"


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
