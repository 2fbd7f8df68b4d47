"""Mutual challenge-response from the cluster token: what each side proves, and how.

Both sides send Hello (protocol version, node id, a fresh 32-byte nonce) at once. Each
then answers the other's nonce with

    HMAC-SHA256(token, "swarm-auth" | version | own role | own id | peer id | peer nonce | own nonce)

The role (the side that opened the TCP connection is the client) and both node ids are
inside the MAC, so a proof cannot be reflected back to its maker or relayed between two
connections of the same device. A side without the token learns only the peer's node id
and protocol version, which mDNS publishes anyway.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
MAX_NODE_ID = 128
CLIENT, SERVER = "client", "server"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, version: int, role: str, own_id: str, peer_id: str, peer_nonce: bytes,
          own_nonce: bytes) -> bytes:
    """What the side in `role` sends to prove it holds `token`."""
    fields = [b"swarm-auth", str(version).encode(), role.encode(), own_id.encode(), peer_id.encode(),
              peer_nonce, own_nonce]
    message = b"".join(len(f).to_bytes(2, "big") + f for f in fields)  # unambiguous concatenation
    return hmac.new(token, message, hashlib.sha256).digest()


def proof_is_valid(token: bytes, version: int, peer_role: str, peer_id: str, own_id: str, own_nonce: bytes,
                   peer_nonce: bytes, received: bytes) -> bool:
    """Whether `received` is the proof the peer (in `peer_role`) owes us."""
    expected = proof(token, version, peer_role, peer_id, own_id, own_nonce, peer_nonce)
    return hmac.compare_digest(expected, received)
