"""Protocol errors, named for whose fault they are (the peer's or ours)."""
from __future__ import annotations


class ProtocolError(Exception):
    """The conversation broke the swarm protocol; the connection cannot go on."""

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        # One of: malformed, oversized, version, auth, unexpected, closed, identity.
        self.kind = kind


class RemoteProtocolError(ProtocolError):
    """The peer sent something we refuse: a malformed or oversized frame, the wrong token,
    another protocol version, or a message out of turn. Nothing of it has been acted on."""


class LocalProtocolError(ProtocolError):
    """We tried something the protocol forbids, such as sending work before authentication."""
