"""Log lines about what remote sides do, at most one per kind and interval, with a count of the rest.

    lines = LogLimiter(log)
    lines.log(logging.WARNING, "unknown job", "refused %s of job %.40s from node %s", kind, job, node)
    lines.flush()   # now and then: the last line of each kind held back, with how many there were

The first line of a kind is logged at once; more of that kind within LOG_INTERVAL are
counted, not logged. The next line of the kind (or flush(), once the interval is over)
says how many were left out: "... (4211 more like it in the last 1.0 s)". Kinds are
chosen by the caller from a fixed set ("refused connection", "unknown job"), never from
what a peer sent, so the limiter itself holds a bounded amount. Pure: no trio, a clock
that can be replaced.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from swarm import limits


@dataclass
class _Kind:
    quiet_until: float = float("-inf")  # no line of this kind before then
    last_line: float = 0.0              # when the last line of this kind was logged
    held: int = 0                       # lines of this kind left out since then
    latest: tuple | None = None         # the latest of them: (level, msg, args)


class LogLimiter:
    """One logger's lines about remote sides, limited per kind (see the module's docstring)."""

    def __init__(self, logger: logging.Logger, interval: float = limits.LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._kinds: dict[str, _Kind] = {}

    def log(self, level: int, kind: str, msg: str, *args, exc_info=None) -> bool:
        """Log msg % args now if no line of `kind` went out in the last interval (True), else
        count it (False). exc_info as for logging, only on a line that is logged."""
        now = self.clock()
        state = self._kinds.setdefault(kind, _Kind())
        if now < state.quiet_until:
            state.held += 1
            state.latest = (level, msg, args)
            return False
        self._emit(state, now, level, msg, args, state.held, exc_info)
        return True

    def held(self, kind: str) -> int:
        """Lines of `kind` counted but not logged yet."""
        state = self._kinds.get(kind)
        return state.held if state else 0

    def flush(self) -> None:
        """Log the latest held line of each kind whose interval is over, with the count."""
        now = self.clock()
        for state in self._kinds.values():
            if state.held and now >= state.quiet_until:
                level, msg, args = state.latest
                self._emit(state, now, level, msg, args, state.held - 1, None)

    def _emit(self, state: _Kind, now: float, level: int, msg: str, args: tuple, more: int, exc_info) -> None:
        if more:
            msg, args = msg + " (%d more like it in the last %.1f s)", (*args, more, now - state.last_line)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        state.quiet_until, state.last_line, state.held, state.latest = now + self.interval, now, 0, None
