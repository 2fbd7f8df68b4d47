"""Keyed delivery of incoming messages: a receiver waits for the key it needs, whether the
message has already come or not."""
from __future__ import annotations

import math
from typing import Any, Hashable

import trio


class Closed(Exception):
    """The mailbox was closed (the job is stopping); the message will never come."""


class Mailbox:
    def __init__(self) -> None:
        self.waited: dict[str, float] = {}  # seconds spent waiting in get(), by the key's first element
        self._items: dict[Hashable, Any] = {}
        self._waiters: dict[Hashable, trio.Event] = {}
        self._closed: BaseException | None = None

    def put(self, key: Hashable, item: Any) -> None:
        if self._closed is not None:
            return
        if key in self._items:
            raise KeyError(f"message {key!r} delivered twice")
        self._items[key] = item
        event = self._waiters.pop(key, None)
        if event is not None:
            event.set()

    async def get(self, key: Hashable, timeout: float = math.inf) -> Any:
        """The message with `key` (removed from the box); waits up to `timeout` seconds."""
        if key not in self._items:
            if self._closed is not None:
                raise Closed(str(self._closed)) from self._closed
            event = self._waiters.setdefault(key, trio.Event())
            started = trio.current_time()
            with trio.move_on_after(timeout) as scope:
                await event.wait()
            kind = str(key[0]) if isinstance(key, tuple) and key else "?"
            self.waited[kind] = self.waited.get(kind, 0.0) + trio.current_time() - started
            if scope.cancelled_caught:
                self._waiters.pop(key, None)
                raise trio.TooSlowError(f"no message {key!r} within {timeout:g} s")
            if key not in self._items:
                raise Closed(str(self._closed)) from self._closed
        return self._items.pop(key)

    def get_nowait(self, key: Hashable) -> Any:
        """The message with `key` if it has come (removed from the box); KeyError if not."""
        return self._items.pop(key)

    def close(self, reason: BaseException) -> None:
        """Wake every waiter with Closed; later puts are dropped."""
        self._closed = reason
        self._items.clear()
        for event in self._waiters.values():
            event.set()
        self._waiters.clear()

    def discard(self, predicate) -> None:
        """Drop held messages whose key satisfies `predicate` (e.g. an aborted step's)."""
        for key in [k for k in self._items if predicate(k)]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)
