"""Job messages that reach an agent before their job is assigned to it (a peer's assignment
may land a little before ours, and its messages with it): held in order of arrival within a
count, a byte budget and an age (swarm/limits.py); what does not fit is refused, what waits
too long is dropped."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from swarm.wire import Tensor

VALUE_BYTES = 64         # what holding one decoded value costs besides its own bytes (CPython object, pointer)


def held_bytes(message) -> int:
    """Roughly the memory a decoded message holds: its tensors' and strings' bytes, plus
    VALUE_BYTES for every value in it (containers, numbers, keys)."""
    total, values = 0, [getattr(message, name, None) for name in message.FIELDS]
    while values:
        value = values.pop()
        total += VALUE_BYTES
        if isinstance(value, Tensor):
            total += value.nbytes
        elif isinstance(value, (str, bytes, bytearray)):
            total += len(value)
        elif isinstance(value, dict):
            values += value.keys()
            values += value.values()
        elif isinstance(value, (list, tuple)):
            values += value
    return total


@dataclass
class EarlyMessage:
    """A job message held until its job is assigned here."""
    arrived: float   # trio time
    sender: str
    message: object
    nbytes: int      # held_bytes(message)


class EarlyMessages:
    """The messages held for a job not assigned yet. `refuse(sender, message, kind, why)` is
    told of each that does not fit; `lines` (a LogLimiter) hears of those that expire."""

    def __init__(self, messages: int, nbytes: int, age: float, refuse: Callable, lines):
        self.messages, self.nbytes, self.age = messages, nbytes, age
        self.refuse = refuse
        self.lines = lines
        self.expired = 0  # dropped after waiting `age` seconds for their job
        self._held: deque[EarlyMessage] = deque()  # in order of arrival
        self._bytes = 0  # sum of their nbytes

    def held(self) -> tuple[int, int]:
        """(messages, bytes) held now."""
        return len(self._held), self._bytes

    def hold(self, sender: str, message, now: float) -> None:
        self.expire(now)
        nbytes = held_bytes(message)
        if len(self._held) >= self.messages:
            self.refuse(sender, message, "no room", f"{self.messages} messages wait for an assignment")
        elif self._bytes + nbytes > self.nbytes:
            self.refuse(sender, message, "no room",
                        f"its {nbytes / 2**20:.1f} MiB would take the messages waiting for an assignment over "
                        f"{self.nbytes / 2**20:.0f} MiB ({self._bytes / 2**20:.1f} MiB now)")
        else:
            self._held.append(EarlyMessage(now, sender, message, nbytes))
            self._bytes += nbytes

    def expire(self, now: float) -> int:
        """Drop the messages older than `age`; how many."""
        dropped = dropped_bytes = 0
        latest = None
        while self._held and now - self._held[0].arrived > self.age:
            latest = self._held.popleft()
            dropped += 1
            dropped_bytes += latest.nbytes
        if dropped:
            self._bytes -= dropped_bytes
            self.expired += dropped
            self.lines.log(logging.WARNING, "expired", "dropped %d message%s (%.1f MiB) that waited more than %g s "
                           "for their job (the last: %s of job %.40s epoch %s from node %s)", dropped,
                           "" if dropped == 1 else "s", dropped_bytes / 2**20, self.age,
                           type(latest.message).__name__, latest.message.job_id, latest.message.epoch,
                           latest.sender)
        return dropped

    def keep(self, keep: Callable[[EarlyMessage], bool]) -> list[EarlyMessage]:
        """Keep the messages `keep` accepts; the others, removed, in order of arrival."""
        kept, taken = deque(), []
        for early in self._held:
            (kept if keep(early) else taken).append(early)
        self._held = kept
        self._bytes = sum(early.nbytes for early in kept)
        return taken
