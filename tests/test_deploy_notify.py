"""systemd's notify protocol: a real `swarm join` says READY=1 once it serves and is advertised, feeds the
watchdog from its event loop, and on SIGTERM says STOPPING=1, leaves mDNS with a goodbye and exits 0."""
from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time

import pytest
import trio

from swarm.net import resolve_network
from swarm.net.discovery import DeviceGone, DeviceSeen, browse, open_zeroconf
from swarm.service.notify import Notifier, feed_watchdog, notify_address, watchdog_period
from tests.conftest import ROOT


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


def test_environment_decides_what_is_sent():
    env = {"NOTIFY_SOCKET": "@swarm-test", "WATCHDOG_USEC": "30000000"}
    assert notify_address("@swarm-test") == "\0swarm-test"
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("vsock:2:1234") is None and notify_address(None) is None
    assert watchdog_period(env, 42) == 15.0
    assert watchdog_period({**env, "WATCHDOG_PID": "42"}, 42) == 15.0
    assert watchdog_period({**env, "WATCHDOG_PID": "43"}, 42) is None   # meant for another process
    assert watchdog_period({"WATCHDOG_USEC": "soon"}, 42) is None
    assert Notifier.from_environment({"WATCHDOG_USEC": "30000000"}).watchdog is None  # no socket: nothing to feed
    quiet = Notifier.from_environment({})
    assert not quiet.enabled and not quiet.ready("x")


def test_messages_reach_an_abstract_socket_and_a_vanished_one_is_harmless():
    name = f"swarm-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(5)
        notifier = Notifier.from_environment({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("serving on port 1\nsecond line")
        assert fields(server.recv(4096)) == {"READY": "1", "STATUS": "serving on port 1 second line"}
    assert not notifier.send("WATCHDOG=1")  # the socket is gone: logged, not raised
    notifier.close()


@pytest.mark.trio
async def test_watchdog_is_fed_every_half_interval(autojump_clock):
    sent = []

    class Recorder(Notifier):
        def send(self, *fields):
            sent.append((trio.current_time(), fields))
            return True

    notifier = Recorder("/nonexistent", watchdog=watchdog_period({"WATCHDOG_USEC": "2000000"}, 1))
    with trio.move_on_after(3.5):
        await feed_watchdog(notifier)
    assert [t for t, _ in sent] == [0.0, 1.0, 2.0, 3.0]
    assert {f for _, f in sent} == {("WATCHDOG=1",)}


@pytest.mark.trio
async def test_join_under_systemd_notify(tmp_path):
    """READY=1 after it listens and is advertised, WATCHDOG=1 at half WATCHDOG_USEC, STOPPING=1 and exit 0
    on SIGTERM, and an mDNS goodbye that a browser sees."""
    path = str(tmp_path / "notify")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind(path)
    state = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NOTIFY_SOCKET=path, WATCHDOG_USEC="400000", SWARM_CONFIG=os.devnull)
    env.pop("WATCHDOG_PID", None)
    log = open(tmp_path / "agent.log", "w+")

    async def next_message() -> dict[str, str]:
        return fields(await sock.recv(4096))

    with trio.fail_after(40), sock, log:
        async with open_zeroconf(resolve_network("lo")) as zc, trio.open_nursery() as nursery:
            found_in, found = trio.open_memory_channel(math.inf)
            await nursery.start(browse, zc, found_in)
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "swarm", "join", "--interface", "lo", "--port", "0", "--state-dir", str(state),
                 "--name", "notify-test"], env=env, stderr=log)
            try:
                first = await next_message()
                while "READY" not in first:  # only keep-alives may come before it
                    assert first == {"WATCHDOG": "1"}, first
                    first = await next_message()
                port = int(first["STATUS"].split("port ")[1].split()[0])
                assert first["READY"] == "1" and first["STATUS"] == f"serving on port {port}"
                log.seek(0)
                assert "advertising notify-test" in log.read()       # advertised before READY ...
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    pass                                               # ... and serving
                node_id = (state / "node_id").read_text().strip()
                async for event in found:
                    if isinstance(event, DeviceSeen) and event.advert.node_id == node_id:
                        assert event.advert.port == port
                        break

                pings = []
                while len(pings) < 3:
                    message = await next_message()
                    assert message == {"WATCHDOG": "1"}, message
                    pings.append(trio.current_time())
                gaps = [b - a for a, b in zip(pings, pings[1:])]
                assert all(0.1 < g < 1.0 for g in gaps), gaps            # every 0.2 s, from the event loop

                proc.send_signal(signal.SIGTERM)
                message = await next_message()
                while message == {"WATCHDOG": "1"}:
                    message = await next_message()
                assert message == {"STOPPING": "1", "STATUS": "saying goodbye"}
                assert await proc.wait() == 0
                async for event in found:   # the goodbye (TTL 0 records), not a timeout: it comes at once
                    if isinstance(event, DeviceGone) and event.node_id == node_id:
                        break
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            nursery.cancel_scope.cancel()
    text = (tmp_path / "agent.log").read_text()
    assert "systemd watchdog on: a keep-alive every 0.2 s" in text
    assert "SIGTERM: saying goodbye" in text and "stopped" in text and "Traceback" not in text

