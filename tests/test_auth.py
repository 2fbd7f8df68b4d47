"""The cluster token and state directory, `swarm token`, and `swarm join`'s start, mistakes and SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from swarm.errors import SwarmError
from swarm.state import find_token, node_id, process_id
from tests.conftest import ROOT, run_swarm


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
    other.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv("SWARM_TOKEN_FILE", str(other))
    assert find_token(None, state, create=True)[0] == "from-a-file-0123456789"
    monkeypatch.setenv("SWARM_TOKEN", "from-the-environment-42")
    assert find_token(None, state, create=True) == ("from-the-environment-42", "SWARM_TOKEN")
    flag = tmp_path / "flag"
    flag.write_text("from-the-flag-0123456789")
    assert find_token(str(flag), state, create=True)[0] == "from-the-flag-0123456789"


def test_token_mistakes_are_explained(tmp_path, monkeypatch):
    with pytest.raises(SwarmError, match="does not exist"):
        find_token(str(tmp_path / "missing"), tmp_path, create=True)
    with pytest.raises(SwarmError, match="no cluster token.*swarm token"):
        find_token(None, tmp_path / "empty", create=False)
    monkeypatch.setenv("SWARM_TOKEN", "short")
    with pytest.raises(SwarmError, match="too short"):
        find_token(None, tmp_path, create=True)
    monkeypatch.setenv("SWARM_TOKEN", "has spaces in it, quite long")
    with pytest.raises(SwarmError, match="characters a token never has"):
        find_token(None, tmp_path, create=True)


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
            "import swarm.agent, swarm.cluster, swarm.agent.bandwidth_job, swarm.testbed.testbed; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "False", out.stderr
