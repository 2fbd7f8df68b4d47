"""The settings file `swarm join` reads (/etc/swarm/swarm.toml): port, interface, name, token, state, peers,
the memory kept back for the rest of the device.

Which file: --config FILE, else $SWARM_CONFIG, else /etc/swarm/swarm.toml if it exists.
What wins, first found: a flag, then the environment variable of the same setting
(SWARM_INTERFACE, SWARM_PEERS, SWARM_STATE_DIR, SWARM_TOKEN / SWARM_TOKEN_FILE), then the
file, then the built-in default. An empty string in the file means "not set".
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from swarm.errors import SwarmError
from swarm.host.resources import parse_size

CONFIG_ENV = "SWARM_CONFIG"
DEFAULT_CONFIG = Path("/etc/swarm/swarm.toml")

# setting -> environment variables that, when set, win over the file
ENV_OVERRIDES = {"interface": ("SWARM_INTERFACE",), "peers": ("SWARM_PEERS",), "state_dir": ("SWARM_STATE_DIR",),
                 "token_file": ("SWARM_TOKEN", "SWARM_TOKEN_FILE")}

COMMENTS = {
    "port": "TCP port the agent listens on (open it in the firewall, with 5353/udp for mDNS)",
    "interface": 'network interface or one of its addresses for discovery and connections ("" = the default route\'s)',
    "name": 'name shown by `swarm status` ("" = the host name)',
    "token_file": "the cluster token; print it with `sudo swarm token` to copy it to the other devices",
    "state_dir": "node id, token, profiles, checkpoints (the service may write only under /var/lib/swarm)",
    "peers": 'agents to reach directly where mDNS does not get through: "host:port,..."',
    "mdns": "advertise this device on mDNS",
    "reserve": 'memory kept back from plans for the rest of this device: "300M", "1G" ("" = 1/32 of it, at least 32M)',
}


@dataclass(frozen=True)
class JoinSettings:
    """What the file says; None where it says nothing."""
    port: int | None = None
    interface: str | None = None
    name: str | None = None
    token_file: str | None = None
    state_dir: str | None = None
    peers: str | None = None        # "host:port,..."
    mdns: bool | None = None
    reserve: str | None = None      # a size: "300M", "1G", "0"


def config_path(arg: str | None) -> Path | None:
    """The file to read: --config, $SWARM_CONFIG, or the system one if it exists; None for none."""
    chosen = arg or os.environ.get(CONFIG_ENV)
    if chosen:
        return Path(chosen).expanduser()
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
        return tomllib
    try:
        import tomli
    except ImportError:
        raise SwarmError("reading the config file needs the tomli package on Python 3.10: pip install tomli") from None
    return tomli


def parse_settings(text: str, where: str) -> JoinSettings:
    """The settings in TOML `text`; SwarmError naming the file and the setting for anything wrong."""
    toml = _toml()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise SwarmError(f"{where} is not valid TOML: {exc}") from None
    known = [f.name for f in fields(JoinSettings)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SwarmError(f"{where}: unknown setting {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    values = {}
    for key, value in data.items():
        if key == "port":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise SwarmError(f"{where}: port must be a whole number 0-65535, got {value!r}")
        elif key == "mdns":
            if not isinstance(value, bool):
                raise SwarmError(f"{where}: mdns must be true or false, got {value!r}")
        elif key == "peers" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        elif not isinstance(value, str):
            raise SwarmError(f"{where}: {key} must be a string in quotes, got {value!r}")
        if isinstance(value, str):
            value = value.strip() or None
        if key == "reserve" and value is not None and parse_size(value) is None:
            raise SwarmError(f"{where}: reserve must be a size such as \"300M\" or \"1G\", got {value!r}")
        values[key] = value
    return JoinSettings(**values)


def read_settings(path: Path | None) -> JoinSettings:
    if path is None:
        return JoinSettings()
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        raise SwarmError(f"config file {path} does not exist (given by --config or {CONFIG_ENV})") from None
    except UnicodeDecodeError:
        raise SwarmError(f"config file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise SwarmError(f"cannot read config file {path}: {exc.strerror} (choose another with --config FILE, "
                         f"or none with {CONFIG_ENV}=/dev/null)") from None
    return parse_settings(text, str(path))


def apply_settings(args, settings: JoinSettings, environ=None) -> None:
    """Fill in `args` (the join command's flags) from `settings` where neither a flag nor an
    environment variable gave a value."""
    environ = os.environ if environ is None else environ
    for f in fields(JoinSettings):
        value = getattr(settings, f.name)
        if value is None or any(environ.get(var) for var in ENV_OVERRIDES.get(f.name, ())):
            continue
        if f.name == "mdns":
            if args.no_mdns is None:
                args.no_mdns = not value
        elif getattr(args, f.name) is None:
            setattr(args, f.name, value)


def render_settings(settings: JoinSettings, header: str) -> str:
    """`settings` as a commented TOML file (unset strings written as "")."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for f in fields(JoinSettings):
        value = getattr(settings, f.name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = toml_string(value or "")
        lines += ["", f"# {COMMENTS[f.name]}", f"{f.name} = {text}"]
    return "\n".join(lines) + "\n"


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: quotes, backslashes and control characters escaped."""
    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
                      for c in text)
    return f'"{escaped}"'


def merged(base: JoinSettings, **changes) -> JoinSettings:
    """`base` with the given settings changed; None values leave a setting as it is."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
