"""Flags and argument types the subcommands share: numbers a user can get wrong, ports, and the
network and cluster-token flags, each with a message a user can act on."""
from __future__ import annotations

import argparse

from swarm.host.resources import parse_size


def _number(kind, noun: str, ok, rule: str):
    """An argparse type: `kind` of the text, checked by `ok`, with messages a user can act on."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {value}")
        return value
    return convert


positive_int = _number(int, "a whole number", lambda v: v >= 1, "must be at least 1")
non_negative_int = _number(int, "a whole number", lambda v: v >= 0, "must not be negative")
positive_float = _number(float, "a number", lambda v: v > 0, "must be positive")
non_negative_float = _number(float, "a number", lambda v: v >= 0, "must not be negative")


def image_size(text: str):
    """--img-size: N (a square) or WxH, darknet's width by height (which sizes a model takes
    is the model's to say, once it is known)."""
    from planner.image_size import ImageSize

    try:
        return ImageSize.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


IMG_SIZE_HELP = "N (a square) or WxH, width by height such as 608x352"


def model_name(text: str) -> str:
    """--model: a built-in model's name or a readable .cfg file, checked as the flags are read,
    before torch is loaded (which takes seconds on a small device) for a name mistyped."""
    from swarm.errors import SwarmError
    from swarm.zoo import model_source

    try:
        model_source(text)
    except SwarmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def byte_size(text: str) -> int:
    """An argparse type: a size such as 300M, 1G or 0 (parse_size)."""
    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (e.g. 300M, 1G, 0)")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {value}")
    return value


def add_network_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interface", metavar="NAME|ADDRESS",
                        help="network interface (or one of its addresses) for discovery and connections "
                             "(default: $SWARM_INTERFACE, else the default route's)")
    parser.add_argument("--peers", metavar="HOST:PORT,...",
                        help="agents to reach directly, where mDNS does not get through (default: $SWARM_PEERS)")


def add_token_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", metavar="DIR",
                        help="state directory (default: $SWARM_STATE_DIR, /var/lib/swarm as root, "
                             "else ~/.local/share/swarm)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the cluster token (default: $SWARM_TOKEN, else STATE_DIR/token)")
