"""The state directory (node id, cluster token) and where the token comes from.

Token, first found wins: --token-file, SWARM_TOKEN, SWARM_TOKEN_FILE, STATE_DIR/token.
State directory: --state-dir, SWARM_STATE_DIR, /var/lib/swarm for root, else the XDG data
directory ($XDG_DATA_HOME/swarm, ~/.local/share/swarm).
"""
from __future__ import annotations

import os
import secrets
import string
import uuid
from pathlib import Path

from swarm.errors import SwarmError

TOKEN_ENV, TOKEN_FILE_ENV, STATE_DIR_ENV = "SWARM_TOKEN", "SWARM_TOKEN_FILE", "SWARM_STATE_DIR"
MIN_TOKEN = 16
TOKEN_CHARS = set(string.ascii_letters + string.digits + "-_.~+/=")


def default_state_dir() -> Path:
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    if os.geteuid() == 0:
        return Path("/var/lib/swarm")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "swarm"


def state_dir_from(arg: str | None) -> Path:
    return Path(arg).expanduser() if arg else default_state_dir()


def ensure_state_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise SwarmError(f"cannot create the state directory {path}: {exc.strerror} (choose another with "
                         f"--state-dir)") from None
    return path


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def check_token(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN:
        raise SwarmError(f"the cluster token from {where} is too short ({len(token)} characters, need at least "
                         f"{MIN_TOKEN}); copy it from `swarm token` on a device of the cluster")
    if not set(token) <= TOKEN_CHARS:
        raise SwarmError(f"the cluster token from {where} has characters a token never has (spaces or symbols); "
                         f"copy it again from `swarm token`")
    return token


def read_token_file(path: str | Path) -> str:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SwarmError(f"token file {path} does not exist") from None
    except OSError as exc:
        raise SwarmError(f"cannot read token file {path}: {exc.strerror}") from None
    return check_token(text, str(path))


def new_token() -> str:
    return secrets.token_hex(32)


def find_token(token_file: str | None, state_dir: Path, *, create: bool) -> tuple[str, str]:
    """(token, where it came from). With create, a new token is made in the state directory
    when none is found; without, SwarmError says how to supply one."""
    if token_file:
        return read_token_file(token_file), str(token_file)
    if os.environ.get(TOKEN_ENV):
        return check_token(os.environ[TOKEN_ENV], TOKEN_ENV), TOKEN_ENV
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV]), os.environ[TOKEN_FILE_ENV]
    path = state_dir / "token"
    if path.exists():
        return read_token_file(path), str(path)
    if not create:
        raise SwarmError(f"no cluster token: none in {path}, no SWARM_TOKEN and no --token-file. Run `swarm token` "
                         f"on a device of the cluster and pass it here with SWARM_TOKEN=... or --token-file")
    ensure_state_dir(state_dir)
    _write_private(path, new_token())
    return read_token_file(path), f"{path} (new)"


def node_id(state_dir: Path, *, create: bool = True) -> str:
    """This device's stable node id, kept in STATE_DIR/node_id."""
    path = state_dir / "node_id"
    try:
        text = path.read_text().strip()
        if text:
            return text
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SwarmError(f"cannot read {path}: {exc.strerror}") from None
    if not create:
        raise SwarmError(f"no node id in {path}")
    ensure_state_dir(state_dir)
    value = uuid.uuid4().hex[:16]
    _write_private(path, value)
    return value


def process_id(state_dir: Path) -> str:
    """A node id for a coordinator process (swarm status, swarm train): unique per process,
    so it never collides with the agent of the same device."""
    base = "c"
    try:
        base = (state_dir / "node_id").read_text().strip() or base
    except OSError:
        pass
    return f"{base}~{os.getpid()}-{secrets.token_hex(3)}"
