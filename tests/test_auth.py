"""The cluster token (where it comes from, how strong it must be) and state directory, `swarm token`, and
`swarm join`'s start, mistakes and SIGTERM."""
from __future__ import annotations

import base64
import os
import secrets
import signal
import socket
import stat
import string
import subprocess
import sys
import time

import pytest

from swarm.errors import SwarmError
from swarm.host.state import NoToken, check_token, find_token, new_token, node_id, process_id, token_bits, token_pattern
from tests.conftest import ROOT, run_swarm

# strong tokens, fixed so that a failing run can be repeated
FROM_FILE = "56db2d2f10ef93891894b8e4c8ce31fe3ff7513200179dd66e66f74ec5e5c8de"
FROM_ENV = "3ba7cf4d66e5b306c13ad48d749f34804429c7085da49ffcceac8ce7f7dfa888"
FROM_FLAG = "365fcf68f910ddfb4cb0e3f2f6eab7ae4e8b6e7e2821ace7e28919599da965aa"


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    for name in ("SWARM_TOKEN", "SWARM_TOKEN_FILE", "SWARM_STATE_DIR", "SWARM_PEERS"):
        monkeypatch.delenv(name, raising=False)


def test_token_sources_in_order(tmp_path, monkeypatch):
    state = tmp_path / "state"
    token, where = find_token(None, state, create=True)
    assert where.endswith("(new)") and len(token) == 64
    assert stat.S_IMODE((state / "token").stat().st_mode) == 0o600
    assert find_token(None, state, create=True) == (token, str(state / "token"))  # kept
    other = tmp_path / "other"
    other.write_text(FROM_FILE + "\n")
    monkeypatch.setenv("SWARM_TOKEN_FILE", str(other))
    assert find_token(None, state, create=True)[0] == FROM_FILE
    monkeypatch.setenv("SWARM_TOKEN", FROM_ENV)
    assert find_token(None, state, create=True) == (FROM_ENV, "SWARM_TOKEN")
    flag = tmp_path / "flag"
    flag.write_text(FROM_FLAG)
    assert find_token(str(flag), state, create=True)[0] == FROM_FLAG


def test_token_mistakes_are_explained(tmp_path, monkeypatch):
    with pytest.raises(SwarmError, match="does not exist"):
        find_token(str(tmp_path / "missing"), tmp_path, create=True)
    with pytest.raises(NoToken, match="no cluster token.*swarm token"):
        find_token(None, tmp_path / "empty", create=False)
    monkeypatch.setenv("SWARM_TOKEN", "short")
    with pytest.raises(SwarmError, match="too short"):
        find_token(None, tmp_path, create=True)
    monkeypatch.setenv("SWARM_TOKEN", "has spaces in it, quite long")
    with pytest.raises(SwarmError, match="characters a token never has"):
        find_token(None, tmp_path, create=True)
    (tmp_path / "blank").write_text("\n")
    with pytest.raises(SwarmError, match=f"token from {tmp_path}/blank is empty"):
        find_token(str(tmp_path / "blank"), tmp_path, create=True)


# -- how strong a token must be -------------------------------------------------------------

@pytest.mark.parametrize("token, words", [
    ("t" * 32, "too easy to guess (one character repeated)"),
    ("a" * 64, "too easy to guess (one character repeated)"),
    ("b2" * 17, "too easy to guess (a 2-character piece repeated)"),
    ("secret" * 6, "too easy to guess (a 6-character piece repeated)"),
    ("0123456789abcdef" * 2, "too easy to guess (a run like abcdef or 012345)"),
    ("abcdefghijklmnopqrstuvwxyz012345", "too easy to guess (a run like abcdef or 012345)"),
    ("zyxwvutsrqponmlkjihgfedcba", "too easy to guess (a run like abcdef or 012345)"),
    ("a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6", "too easy to guess (a regular pattern)"),
    ("abcdefghijklmnop" + "9077bb70f023778a", "too easy to guess (mostly runs like abcdef or 012345)"),
    ("bench-token-0123456789abcdef", "too easy to guess (mostly runs like abcdef or 012345)"),
    ("test-token-" + "x" * 20, "too easy to guess (only 8 different characters)"),
    ("x" * 40 + "7f3a9c", "too easy to guess (one character repeated)"),
    ("short", "too short (5 lowercase letters carry 24 bits, a token needs 128: 28 such characters)"),
    ("from-a-file-0123456789", "too short (22 digits, lowercase letters and symbols carry 119 bits"),
    ("c0cd96b355723fb638b65cb06b78b5", "too short (30 hex digits carry 120 bits, a token needs 128: 32 such"),
    ("8046519273" * 3 + "6042", "too easy to guess (a 10-character piece repeated)"),
    ("80465192736015728394", "too short (20 digits carry 66 bits, a token needs 128: 39 such characters)"),
])
def test_weak_tokens_are_refused_saying_why_and_how_to_make_one(token, words):
    with pytest.raises(SwarmError) as info:
        check_token(token, "SWARM_TOKEN")
    message = str(info.value)
    assert message.startswith("the cluster token from SWARM_TOKEN is ") and words in message, message
    assert message.endswith("make one with `swarm token --new` and give it to every device of the cluster")
    assert "\n" not in message and (len(token) < 16 or token[:12] not in message)   # the token is not shown


@pytest.mark.parametrize("token", [
    "c0cd96b355723fb638b65cb06b78b521",                 # 32 hex digits: exactly 128 bits
    "C0CD96B355723FB638B65CB06B78B521",
    "xxLBeCp_Iyt1IV5Edsv6WQ",                           # secrets.token_urlsafe(16): 22 characters
    "dGhpcyBpcyBub3QgYSByZWFsIHRva2VuIQ==",             # base64 of 26 bytes
    "809372615402918374650192837465019283746",          # 39 digits
    "correct-horse-battery-staple-42",
])
def test_strong_tokens_pass(token):
    assert check_token(f"  {token}\n", "x") == token and token_bits(token) >= 128


def test_every_new_token_passes():
    for _ in range(5000):
        token = new_token()
        assert check_token(token, "new") == token and token_bits(token) == 256


@pytest.mark.parametrize("make", [
    lambda: secrets.token_hex(16),                                    # 128 bits, at the limit
    lambda: secrets.token_hex(16).upper(),
    lambda: secrets.token_urlsafe(32),
    lambda: base64.b64encode(secrets.token_bytes(32)).decode(),       # openssl rand -base64 32
    lambda: "".join(secrets.choice(string.digits) for _ in range(40)),
    lambda: "".join(secrets.choice(string.ascii_lowercase) for _ in range(28)),
], ids=["hex16", "HEX16", "urlsafe32", "base64-32", "digits40", "lower28"])
def test_random_tokens_show_no_pattern(make):
    """Random tokens of 128 bits and more never look like a pattern (the rules are far from chance)."""
    found = [t for t in (make() for _ in range(3000)) if token_pattern(t)]
    assert found == []


def test_swarm_token_new_prints_a_fresh_strong_token_and_stores_nothing(tmp_path):
    a = run_swarm("token", "--new", "--state-dir", tmp_path / "s")
    b = run_swarm("token", "--new", "--state-dir", tmp_path / "s")
    assert a.returncode == b.returncode == 0 and a.stderr == b.stderr == ""
    assert a.stdout != b.stdout and check_token(a.stdout, "x") == a.stdout.strip()
    assert len(a.stdout.strip()) == 64 and not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", [["join"], ["status", "--no-mdns"], ["token"],
                                     ["train", "--strategy", "dp", "--steps", "1", "--wait", "0.1"]])
@pytest.mark.parametrize("source", ["env", "file", "state"])
def test_a_weak_token_is_one_line_from_every_command(tmp_path, command, source):
    weak = "abcdefghijklmnopqrstuvwxyz012345"
    (tmp_path / "s").mkdir()
    (tmp_path / ("s/token" if source == "state" else "weak")).write_text(weak + "\n")
    args = ["--token-file", tmp_path / "weak"] if source == "file" else []
    env = {"SWARM_TOKEN": weak} if source == "env" else {}
    r = run_swarm(*command, "--state-dir", tmp_path / "s", *args, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "too easy to guess (a run like abcdef or 012345)" in error[0], r.stderr
    assert "`swarm token --new`" in error[0]


def test_node_id_is_stable_and_coordinators_get_their_own(tmp_path):
    first = node_id(tmp_path)
    assert node_id(tmp_path) == first and len(first) == 16
    a, b = process_id(tmp_path), process_id(tmp_path)
    assert a != b and a.startswith(first + "~") and a != first


def test_swarm_token_prints_the_same_token_each_time(tmp_path):
    a = run_swarm("token", "--state-dir", tmp_path)
    b = run_swarm("token", "--state-dir", tmp_path)
    assert a.returncode == 0 and b.returncode == 0
    assert "created a new cluster token" in a.stderr and b.stderr == ""
    assert a.stdout == b.stdout == (tmp_path / "token").read_text()


@pytest.mark.parametrize("args, words", [
    (["join", "--token-file", "/nonexistent/token"], "token file /nonexistent/token does not exist"),
    (["join", "--interface", "nope0"], "no network interface named 'nope0'"),
    (["join", "--peers", "10.0.0.1:port"], "not a number"),
    (["status", "--no-mdns"], "no cluster token"),
    (["testbed", "exec", "dev0", "--", "true"], "no testbed is up"),
])
def test_user_mistakes_are_one_line_messages(tmp_path, args, words):
    r = run_swarm(*args, "--state-dir", tmp_path / "s", env={"SWARM_TESTBED_DIR": str(tmp_path / "tb")}) \
        if args[0] != "testbed" else run_swarm(*args, env={"SWARM_TESTBED_DIR": str(tmp_path / "tb")})
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_join_on_a_busy_port_says_so(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_swarm("join", "--state-dir", tmp_path, "--port", port, "--no-mdns", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1 port {port}" in r.stderr and "another --port" in r.stderr


def test_join_runs_until_sigterm_and_says_goodbye(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "join", "--state-dir", str(tmp_path), "--port", "0",
                             "--name", "sigterm-test"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "listening on" in line:
                break
        assert "listening on 127.0.0.1" in lines[-1], lines
        assert "swarm[sigterm-test] INFO" in lines[-1]
        assert (tmp_path / "token").exists() and (tmp_path / "node_id").exists()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=10)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "SIGTERM: saying goodbye" in rest and "stopped" in rest and "Traceback" not in rest


def test_the_agent_starts_without_torch():
    """`swarm join` on a Raspberry Pi must not pay for importing torch until a job needs it."""
    code = ("import sys; from swarm.cli import build_parser; build_parser(); "
            "import swarm.agent, swarm.cluster, swarm.profiling.bandwidth, swarm.testbed.testbed; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "False", out.stderr
