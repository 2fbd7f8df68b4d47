"""How the long-running commands (join, status) log: one line per event on stderr."""
from __future__ import annotations

import logging
import sys


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
