"""The `swarm` command: subcommands, and turning user mistakes into plain messages."""
from __future__ import annotations

import argparse
import sys

from swarm import __version__, malloc
from swarm.errors import SwarmError

# Each subcommand module has add_parser(subparsers) and run(args) -> exit status.
COMMANDS = ("train", "eval", "join", "status", "token", "testbed", "plan", "profile", "service")


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


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="swarm", description="Train convolutional networks across the small devices on your LAN.")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"swarm.commands.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    malloc.tune()
    parser = build_parser()
    args = parser.parse_args(argv)
    from planner.plan import PlanError

    try:
        return int(args.run(args) or 0)
    except (SwarmError, PlanError) as exc:
        print(f"swarm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
