"""Connections between swarm processes over trio: the chosen network, connecting, serving.

Never imports torch.
"""
from swarm.net.interfaces import NetworkChoice, parse_endpoint, parse_peers, resolve_network
from swarm.net.peer import (ConnectionLost, Credentials, HandshakeFailed, PeerConnection, PeerUnavailable,
                            connect_peer, serve_peers)

__all__ = ["NetworkChoice", "parse_endpoint", "parse_peers", "resolve_network", "ConnectionLost", "Credentials",
           "HandshakeFailed", "PeerConnection", "PeerUnavailable", "connect_peer", "serve_peers"]
