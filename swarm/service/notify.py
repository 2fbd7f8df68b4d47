"""systemd's notify protocol in pure Python: READY=1, STATUS=, STOPPING=1 and the WATCHDOG=1 keep-alive.

Under a `Type=notify` unit systemd passes $NOTIFY_SOCKET, a unix datagram socket (a path, or
an abstract name written with a leading '@'); each message is one datagram of `KEY=value`
lines. With `WatchdogSec=` it also passes $WATCHDOG_USEC (and $WATCHDOG_PID, the process it
is meant for), and restarts the service when no WATCHDOG=1 arrives within that time.

    notifier = Notifier.from_environment()       # does nothing where systemd did not ask
    nursery.start_soon(feed_watchdog, notifier)  # from the event loop: a stuck loop stops it
    notifier.send("READY=1", "STATUS=serving")
"""
from __future__ import annotations

import logging
import os
import socket

import trio

log = logging.getLogger("swarm.agent")


def notify_address(value: str | None) -> str | None:
    """The socket address in $NOTIFY_SOCKET, or None if unset or of a kind we do not speak (vsock)."""
    if not value:
        return None
    if value.startswith("@"):  # abstract namespace
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_period(environ, pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None if no watchdog is asked of us."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = environ.get("WATCHDOG_PID")
    if usec <= 0 or (owner and owner != str(pid)):
        return None
    return usec / 2 / 1e6


class Notifier:
    """Sends notifications to systemd; every method is a no-op when there is no $NOTIFY_SOCKET."""

    def __init__(self, address: str | None, watchdog: float | None = None):
        self.address = address
        self.watchdog = watchdog if address else None   # seconds between pings, or None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_environment(cls, environ=None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(notify_address(environ.get("NOTIFY_SOCKET")), watchdog_period(environ, os.getpid()))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send one datagram of KEY=value lines; False if it could not be sent (logged once)."""
        if self.address is None:
            return False
        message = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, socket.MSG_DONTWAIT, self.address)
        except OSError as exc:  # systemd gone or its queue full: never worth stopping the agent for
            if not self._warned:
                log.warning("cannot notify systemd at %s: %s", self.address.replace("\0", "@"), exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def feed_watchdog(notifier: Notifier) -> None:
    """Send WATCHDOG=1 every `notifier.watchdog` seconds until cancelled. It runs on the trio event
    loop on purpose: if the loop stops turning, the pings stop and systemd restarts the agent."""
    if notifier.watchdog is None:
        return
    log.info("systemd watchdog on: a keep-alive every %g s", notifier.watchdog)
    while True:
        notifier.send("WATCHDOG=1")
        await trio.sleep(notifier.watchdog)
