"""The state directory (node id, cluster token), where the token comes from, and how strong it is.

Token, first found wins: --token-file, SWARM_TOKEN, SWARM_TOKEN_FILE, STATE_DIR/token.
State directory: --state-dir, SWARM_STATE_DIR, /var/lib/swarm for root, else the XDG data
directory ($XDG_DATA_HOME/swarm, ~/.local/share/swarm).

A token must carry TOKEN_BITS of entropy: its length times log2 of the alphabet it draws
from (hex 16, digits 10, letters and digits 62, ... the classes of character it uses), and
no obvious pattern that makes it guessable whatever its length (one character or a short
piece repeated, a run like abcdef, too few different characters). The patterns' thresholds
are far from what chance makes: `new_token()`'s tokens never meet them, and a random token of
128 bits does with a chance estimated below one in a billion.
"""
from __future__ import annotations

import math
import os
import secrets
import string
import uuid
from collections import Counter
from pathlib import Path

from swarm.errors import SwarmError

TOKEN_ENV, TOKEN_FILE_ENV, STATE_DIR_ENV = "SWARM_TOKEN", "SWARM_TOKEN_FILE", "SWARM_STATE_DIR"
SYMBOLS = "-_.~+/="                    # base64 and URL-safe base64 use some of these
TOKEN_CHARS = set(string.ascii_letters + string.digits + SYMBOLS)
TOKEN_BITS = 128
MAKE_ONE = "make one with `swarm token --new` and give it to every device of the cluster"
# (name, size, characters) of the classes a token's alphabet is made of
CHAR_CLASSES = (("digits", 10, set(string.digits)), ("lowercase letters", 26, set(string.ascii_lowercase)),
                ("capitals", 26, set(string.ascii_uppercase)), ("symbols", len(SYMBOLS), set(SYMBOLS)))
HEX = (set("0123456789abcdef"), set("0123456789ABCDEF"))
PATTERN_SHARE = 3 / 4    # a lag at which this share of the characters follow one rule is a pattern
RUN_SHARE = 1 / 2        # runs like abcd covering this share of the token are a pattern
RUN_LENGTH = 4           # ... counting runs of at least this many characters


class NoToken(SwarmError):
    """No cluster token where one is looked for (unlike a token that is there but refused)."""


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


def token_alphabet(token: str) -> tuple[str, int]:
    """(name, size) of the alphabet a token draws from: hex digits, or the classes it uses."""
    chars = set(token)
    if chars <= CHAR_CLASSES[0][2]:
        return "digits", 10
    if any(chars <= h for h in HEX):
        return "hex digits", 16
    used = [(name, size) for name, size, members in CHAR_CLASSES if chars & members]
    names = [name for name, _ in used]
    name = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return name, sum(size for _, size in used)


def token_bits(token: str) -> float:
    """What guessing the token takes at most: length x log2(alphabet size)."""
    return len(token) * math.log2(token_alphabet(token)[1])


def token_pattern(token: str) -> str | None:
    """The obvious pattern in a token, said in a few words, or None.

    A pattern is: at some lag p (up to half the length), at least PATTERN_SHARE of the
    characters differ from the one p before by the same amount (0: a repeated piece, 1: a run
    like abcdef, ...); or runs of RUN_LENGTH or more characters, each one after the last,
    covering RUN_SHARE of it; or fewer than half the different characters a random token of
    its alphabet and length would have. A random token of 128 bits meets one of these with a
    chance estimated below one in a billion (tests/test_auth.py draws many)."""
    n = len(token)
    codes = [ord(c) for c in token]
    for lag in range(1, n // 2 + 1):
        steps = Counter(b - a for a, b in zip(codes, codes[lag:]))
        step, count = steps.most_common(1)[0]
        if count >= PATTERN_SHARE * (n - lag):
            if step == 0:
                return "one character repeated" if lag == 1 else f"a {lag}-character piece repeated"
            return "a run like abcdef or 012345" if lag == 1 and abs(step) == 1 else "a regular pattern"
    in_runs, start = 0, 0                   # a run is token[start:i], each step the same +1 or -1
    for i in range(1, n + 1):
        step = codes[i] - codes[i - 1] if i < n else 0
        if abs(step) == 1 and (i - start == 1 or step == codes[start + 1] - codes[start]):
            continue
        in_runs += i - start if i - start >= RUN_LENGTH else 0
        start = i
    if in_runs >= RUN_SHARE * n:
        return "mostly runs like abcdef or 012345"
    size = token_alphabet(token)[1]
    expected = size * (1 - (1 - 1 / size) ** n)    # different characters in a random token
    if len(set(token)) < expected / 2:
        return f"only {len(set(token))} different characters"
    return None


def check_token(token: str, where: str) -> str:
    """The token, stripped; SwarmError (one line, saying how to make a good one) if it is not one."""
    token = token.strip()
    if not token:
        raise SwarmError(f"the cluster token from {where} is empty: copy it from `swarm token` on a device of the "
                         f"cluster, or {MAKE_ONE}")
    if not set(token) <= TOKEN_CHARS:
        raise SwarmError(f"the cluster token from {where} has characters a token never has (spaces or symbols); "
                         f"copy it again from `swarm token`")
    pattern = token_pattern(token) if len(token) >= 8 else None
    if pattern:
        raise SwarmError(f"the cluster token from {where} is too easy to guess ({pattern}): {MAKE_ONE}")
    bits = token_bits(token)
    if bits < TOKEN_BITS:
        name, size = token_alphabet(token)
        need = math.ceil(TOKEN_BITS / math.log2(size))
        raise SwarmError(f"the cluster token from {where} is too short ({len(token)} {name} carry {bits:.0f} bits, "
                         f"a token needs {TOKEN_BITS}: {need} such characters): {MAKE_ONE}")
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
    """A new cluster token: 256 random bits as 64 hex digits."""
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
        raise NoToken(f"no cluster token: none in {path}, no SWARM_TOKEN and no --token-file. Run `swarm token` "
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
