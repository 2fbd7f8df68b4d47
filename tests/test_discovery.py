"""mDNS discovery pinned to loopback, interface choice, and proof that nothing leaves on another interface."""
from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time

import pytest
import trio

from swarm.errors import SwarmError
from swarm.net import parse_peers, resolve_network
from swarm.net.discovery import Advert, DeviceGone, DeviceSeen, advertise, browse, open_zeroconf
from swarm.net.interfaces import default_route_interface


def make_advert(node_id="abc123def456", name="pi-1", port=4750) -> Advert:
    return Advert(node_id=node_id, name=name, address="127.0.0.1", port=port, cores=4, memory=2**30,
                  accelerator="cpu", version="0.1.0", protocol=1, cluster="0123abcd")


@pytest.mark.trio
async def test_advert_is_found_with_all_its_properties_and_its_goodbye_seen():
    network = resolve_network("lo")
    advert = make_advert(node_id=f"test{os.getpid()}{time.monotonic_ns() % 10**6}")
    with trio.fail_after(15):
        async with open_zeroconf(network) as zc_agent, open_zeroconf(network) as zc_browser:
            async with trio.open_nursery() as nursery:
                found_in, found = trio.open_memory_channel(math.inf)
                await nursery.start(browse, zc_browser, found_in)
                scope = trio.CancelScope()

                async def advertise_for_a_while(task_status=trio.TASK_STATUS_IGNORED):
                    with scope:
                        await advertise(zc_agent, advert, task_status=task_status)

                started = trio.current_time()
                await nursery.start(advertise_for_a_while)
                async for event in found:  # other swarm processes on this machine may be advertising too
                    if isinstance(event, DeviceSeen) and event.advert.node_id == advert.node_id:
                        break
                assert event.advert == advert
                assert trio.current_time() - started < 5
                scope.cancel()  # the agent leaves: goodbye packets
                async for event in found:
                    if isinstance(event, DeviceGone) and event.node_id == advert.node_id:
                        break
                nursery.cancel_scope.cancel()


def test_malformed_adverts_are_ignored():
    class Info:
        port = 4750
        properties = {b"name": b"x"}  # no id

        def parsed_addresses(self, version):
            return ["127.0.0.1"]

    assert Advert.from_service_info(Info()) is None
    Info.properties = {b"id": b"n1", b"cores": b"many"}
    assert Advert.from_service_info(Info()) is None
    Info.properties = {b"id": b"n1", b"cores": b"2", b"mem": b"1024", b"ver": b"0.1.0", b"proto": b"1"}
    good = Advert.from_service_info(Info())
    assert good is not None and good.cores == 2 and good.memory == 1024 and good.name == "?"
    assert good.accelerator_memory == -1  # an advert without it: not known
    assert good.cluster == ""  # nor its cluster: a roster tries its handshake, as before tags
    Info.properties[b"accmem"] = b"0"
    assert Advert.from_service_info(Info()).accelerator_memory == 0
    Info.port = 0
    assert Advert.from_service_info(Info()) is None


@pytest.mark.trio
async def test_a_roster_passes_by_another_swarms_devices_on_the_same_lan(caplog):
    from swarm.agent import Agent, AgentConfig
    from swarm.cluster import open_roster
    from swarm.net import Credentials

    ours, theirs = "our-token-" + "x" * 22, "their-token-" + "y" * 22
    assert Credentials("a", ours).cluster_tag != Credentials("a", theirs).cluster_tag
    assert Credentials("a", ours).cluster_tag == Credentials("b", ours).cluster_tag  # the token's, not the node's
    network = resolve_network("lo")
    run = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"  # other swarm processes may be advertising here too
    caplog.set_level("INFO", logger="swarm.cluster")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for name, token in (("ours", ours), ("theirs", theirs)):
                config = AgentConfig(name=name, node_id=f"{name}-{run}", token=token, network=network, port=0)
                await nursery.start(Agent(config).run)
            async with open_roster(Credentials("coordinator", ours), network) as roster:
                while not any("theirs (127.0.0.1:" in r.getMessage() and "another swarm" in r.getMessage()
                              for r in caplog.records):
                    await trio.sleep(0.05)
                await roster.wait_for(1, timeout=10)
                mine = [d for d in roster.devices() if run in d.node_id]
                assert [(d.name, d.health) for d in mine] == [("ours", "alive")]  # not theirs, not "refused"
                # a command given the wrong token would see no device of its own: it is told why
                assert "belong" in roster.strangers() and "another cluster token" in roster.strangers()
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_swarm_status_with_another_token_says_the_devices_it_sees_belong_to_another_swarm(tmp_path):
    import subprocess
    import sys

    from swarm.agent import Agent, AgentConfig

    theirs = "their-token-" + "y" * 22
    config = AgentConfig(name="theirs", node_id=f"theirs-{os.getpid()}", token=theirs, network=resolve_network("lo"),
                         port=0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from swarm.host.state import new_token

    env = {**os.environ, "SWARM_TOKEN": new_token(), "PYTHONPATH": root}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(Agent(config).run)
            status = await trio.run_process([sys.executable, "-m", "swarm", "status", "--wait", "3", "--state-dir",
                                             str(tmp_path)], env=env, capture_stdout=True, capture_stderr=True,
                                            check=False)
            nursery.cancel_scope.cancel()
    out, err = status.stdout.decode(), status.stderr.decode()
    assert status.returncode == 0, err
    assert "theirs" not in out and "refused" not in out
    assert "belongs to another swarm (another cluster token)" in err and "swarm token" in err, err
    assert "Traceback" not in err


def test_interface_choice(monkeypatch):
    lo = resolve_network("lo")
    assert lo.interface == "lo" and lo.addresses == ("127.0.0.1",) and lo.pinned
    assert lo.listen_hosts == ["127.0.0.1"] and lo.source_address == "127.0.0.1"
    by_address = resolve_network("127.0.0.1")
    assert by_address.interface == "lo" and by_address.pinned
    monkeypatch.setenv("SWARM_INTERFACE", "lo")
    assert resolve_network(None) == lo
    with pytest.raises(SwarmError, match="no network interface named 'nope0'.*lo"):
        resolve_network("nope0")
    with pytest.raises(SwarmError, match="no interface of this machine has the address 203.0.113.9"):
        resolve_network("203.0.113.9")
    monkeypatch.delenv("SWARM_INTERFACE")
    default = default_route_interface()
    if default is not None:  # unpinned: the default route's interface, listening everywhere
        chosen = resolve_network(None)
        assert chosen.interface == default and not chosen.pinned and chosen.listen_hosts == ["0.0.0.0"]


def test_peer_lists():
    assert parse_peers("10.0.0.2:4750, pi-3,10.0.0.4:9", 4750) == [("10.0.0.2", 4750), ("pi-3", 4750),
                                                                   ("10.0.0.4", 9)]
    assert parse_peers(None, 4750) == []
    for bad, words in [("host:port", "not a number"), (":4750", "no host"), ("h:70000", "outside")]:
        with pytest.raises(SwarmError, match=words):
            parse_peers(bad, 4750)


class MdnsSniffer:
    """Counts mDNS packets mentioning _swarm on one interface, in either direction (root only)."""

    def __init__(self, interface: str):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.1)
        self.hits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(65536)
            except socket.timeout:
                continue
            if self._is_swarm_mdns(frame):
                self.hits += 1

    @staticmethod
    def _is_swarm_mdns(frame: bytes) -> bool:
        if len(frame) < 42 or frame[12:14] != b"\x08\x00":   # Ethernet (also lo's fake header) + IPv4
            return False
        ihl = (frame[14] & 0x0F) * 4
        if frame[23] != 17:                                  # UDP
            return False
        src, dst = struct.unpack_from("!HH", frame, 14 + ihl)
        return 5353 in (src, dst) and b"_swarm" in frame

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sniffing an interface needs root")
def test_mdns_pinned_to_loopback_never_leaves_on_the_external_interface():
    external = default_route_interface()
    if external is None or external == "lo":
        pytest.skip("no external interface here")

    async def discover_for_a_while():
        network = resolve_network("lo")
        async with open_zeroconf(network) as zc:
            async with trio.open_nursery() as nursery:
                await nursery.start(advertise, zc, make_advert(node_id=f"sniff{os.getpid()}"))
                found_in, _ = trio.open_memory_channel(math.inf)
                await nursery.start(browse, zc, found_in)
                await trio.sleep(1.5)
                nursery.cancel_scope.cancel()

    with MdnsSniffer(external) as outside, MdnsSniffer("lo") as inside:
        trio.run(discover_for_a_while)
        time.sleep(0.3)
    assert inside.hits > 0        # the sniffer works: our mDNS is on loopback
    assert outside.hits == 0      # and none of it went out on the external interface
