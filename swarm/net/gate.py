"""The door of a listening agent: how many handshakes are in progress, overall and per host,
whether one more may start, whose Hello is due, and who was turned away.

    gate = HandshakeGate(total=128, per_host=32, hello_grace=0.5)
    ticket, evicted = gate.admit("10.0.0.7", now)  # ticket None: over a cap, close the connection
    if evicted: evicted.scope.cancel()             # made room: a handshake without a Hello yet
    ...                                            # the handshake runs
    for t in gate.hello_due(now - 2.0): ...        # admitted 2 s ago or more: no Hello yet? end them
    gate.release(ticket)                           # finished, one way or the other
    count, hosts, evicted = gate.take_refusals()   # for one log line a second

When a cap is reached, a newcomer takes the place of the oldest handshake (of its host, for
the per-host cap) that has had `hello_grace` seconds and still no Hello: a swarm peer's
Hello arrives right behind its connection, so such a connection is almost surely idle, and
a burst of them does not lock others out for the whole Hello deadline. When there is no
such handshake, the newcomer is refused.

Pure bookkeeping: no sockets, no trio, times are passed in. Everything it holds is bounded:
at most `total` tickets, and refusals counted one by one for at most limits.REFUSAL_HOSTS
hosts between two reports (the rest only in the total).
"""
from __future__ import annotations

from swarm import limits


class Ticket:
    """One handshake in progress: its host, when it was admitted, and what the server attaches
    to it (the connection, the cancel scope that ends it)."""

    __slots__ = ("host", "admitted_at", "conn", "scope", "missed_hello", "evicted")

    def __init__(self, host: str, admitted_at: float):
        self.host = host
        self.admitted_at = admitted_at
        self.conn = None           # the PeerConnection, once made
        self.scope = None          # cancelling it ends the handshake
        self.missed_hello = False  # ended because no Hello came in time
        self.evicted = False       # ended to make room for a newcomer (no Hello after the grace)

    def __repr__(self):
        return f"<Ticket {self.host} at {self.admitted_at:.3f}>"

    def has_hello(self) -> bool:
        """Whether the peer's Hello has arrived (its node id is known)."""
        return self.conn is not None and self.conn.peer_id is not None


class HandshakeGate:
    """Handshakes in progress, capped at `total` and at `per_host` from one host."""

    def __init__(self, total: int = limits.HANDSHAKES, per_host: int = limits.HANDSHAKES_PER_HOST,
                 hello_grace: float = limits.HELLO_GRACE):
        self.total = total
        self.per_host = per_host
        self.hello_grace = hello_grace
        self._tickets: set[Ticket] = set()
        self._per_host: dict[str, int] = {}
        self._awaiting_hello: dict[Ticket, None] = {}  # in order of admission
        self._refused = 0
        self._refused_from: dict[str, int] = {}
        self._evicted = 0

    @property
    def in_progress(self) -> int:
        return len(self._tickets)

    def in_progress_from(self, host: str) -> int:
        return self._per_host.get(host, 0)

    def admit(self, host: str, now: float) -> tuple[Ticket | None, Ticket | None]:
        """(a ticket for a new handshake from `host`, the ticket it displaced): (None, None) if
        that would go over a cap and no handshake can make room (counted as refused). A
        displaced ticket no longer counts; the caller ends its handshake (ticket.scope)."""
        evicted = None
        over_host = self._per_host.get(host, 0) >= self.per_host
        if over_host or len(self._tickets) >= self.total:
            evicted = self._idle(now, host if over_host else None)
            if evicted is None:
                self._refused += 1
                if host in self._refused_from or len(self._refused_from) < limits.REFUSAL_HOSTS:
                    self._refused_from[host] = self._refused_from.get(host, 0) + 1
                return None, None
            self._forget(evicted)
            evicted.evicted = True
            self._evicted += 1
        ticket = Ticket(host, now)
        self._tickets.add(ticket)
        self._per_host[host] = self._per_host.get(host, 0) + 1
        self._awaiting_hello[ticket] = None
        return ticket, evicted

    def _idle(self, now: float, host: str | None) -> Ticket | None:
        """The oldest ticket (of `host`, unless None) with no Hello after hello_grace seconds."""
        for ticket in self._awaiting_hello:  # oldest first
            if ticket.admitted_at > now - self.hello_grace:
                return None
            if (host is None or ticket.host == host) and not ticket.has_hello():
                return ticket
        return None

    def release(self, ticket: Ticket) -> None:
        """The handshake is over (authenticated, failed or abandoned); releasing twice is harmless."""
        if ticket in self._tickets:
            self._forget(ticket)
            ticket.conn = ticket.scope = None

    def _forget(self, ticket: Ticket) -> None:
        self._tickets.remove(ticket)
        self._awaiting_hello.pop(ticket, None)
        left = self._per_host[ticket.host] - 1
        if left:
            self._per_host[ticket.host] = left
        else:
            del self._per_host[ticket.host]

    def hello_due(self, admitted_by: float) -> list[Ticket]:
        """Tickets still in progress that were admitted at `admitted_by` or earlier and not yet
        handed out by this call: their Hello is due. Each ticket is handed out once."""
        due = []
        for ticket in self._awaiting_hello:
            if ticket.admitted_at > admitted_by:
                break
            due.append(ticket)
        for ticket in due:
            del self._awaiting_hello[ticket]
        return due

    def next_hello_admitted_at(self) -> float | None:
        """When the oldest ticket whose Hello is not yet due was admitted (None: there is none)."""
        for ticket in self._awaiting_hello:
            return ticket.admitted_at
        return None

    def take_refusals(self) -> tuple[int, list[tuple[str, int]], int]:
        """(connections refused since the last call, [(host, count), ...] most first, handshakes
        displaced since the last call), and start counting again."""
        count, hosts = self._refused, sorted(self._refused_from.items(), key=lambda item: -item[1])
        evicted = self._evicted
        self._refused, self._refused_from, self._evicted = 0, {}, 0
        return count, hosts, evicted
