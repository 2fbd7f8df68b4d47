"""mDNS discovery of swarm agents (`_swarm._tcp.local.`), bridged into trio.

zeroconf runs its own threads: its blocking calls go through trio.to_thread, and its
browser callbacks come back through trio.from_thread. Zeroconf is bound only to the
addresses of the chosen interface (NetworkChoice), so mDNS never leaves on another one.

    async with open_zeroconf(network) as zc:
        await nursery.start(advertise, zc, advert)
        send, receive = trio.open_memory_channel(math.inf)
        await nursery.start(browse, zc, send)
        async for event in receive: ...   # DeviceSeen(advert) / DeviceGone(node_id)
"""
from __future__ import annotations

import logging
import re
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import trio

from swarm.net.interfaces import NetworkChoice

log = logging.getLogger("swarm.net.discovery")

SERVICE = "_swarm._tcp.local."
RESOLVE_TIMEOUT_MS = 3000


@dataclass(frozen=True)
class Advert:
    """What an agent publishes about itself (the TXT properties, address and port)."""
    node_id: str
    name: str
    address: str
    port: int
    cores: int
    memory: int          # bytes
    accelerator: str
    version: str         # swarm release
    protocol: int        # wire protocol version
    accelerator_memory: int = -1  # bytes of its own (swarm.wire.Info says how)
    cluster: str = ""    # Credentials.cluster_tag of its token; "" in adverts from before there was one

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.address, self.port

    def instance_name(self) -> str:
        label = re.sub(r"[^A-Za-z0-9-]", "-", self.name)[:40].strip("-") or "swarm"
        return f"{label}-{self.node_id[:8]}.{SERVICE}"

    def properties(self) -> dict[str, str]:
        return {"id": self.node_id, "name": self.name, "cores": str(self.cores), "mem": str(self.memory),
                "accel": self.accelerator, "accmem": str(self.accelerator_memory), "ver": self.version, "proto": str(self.protocol), "port": str(self.port),
                "cluster": self.cluster}

    @classmethod
    def from_service_info(cls, info) -> Advert | None:
        """The advert in a resolved zeroconf ServiceInfo; None if it is not a well-formed one."""
        from zeroconf import IPVersion

        try:
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
            addresses = info.parsed_addresses(IPVersion.V4Only)
            port = int(info.port)
            advert = cls(node_id=props["id"], name=props.get("name", "?"), address=addresses[0], port=port,
                         cores=int(props.get("cores", 0)), memory=int(props.get("mem", 0)),
                         accelerator=props.get("accel", "?"), version=props.get("ver", "?"),
                         protocol=int(props.get("proto", 0)), accelerator_memory=int(props.get("accmem", -1)),
                         cluster=props.get("cluster", ""))
        except (KeyError, IndexError, ValueError, UnicodeDecodeError, TypeError, AttributeError):
            return None
        if not advert.node_id or not 0 < port < 65536:
            return None
        return advert


@dataclass(frozen=True)
class DeviceSeen:
    """An agent was found, or its advert changed."""
    advert: Advert


@dataclass(frozen=True)
class DeviceGone:
    """An agent said goodbye on mDNS (or its record expired)."""
    node_id: str


@asynccontextmanager
async def open_zeroconf(network: NetworkChoice):
    """A Zeroconf instance bound to `network`'s addresses only, closed on exit."""
    from zeroconf import IPVersion, Zeroconf

    addresses = list(network.addresses)
    zc = await trio.to_thread.run_sync(
        partial(Zeroconf, interfaces=addresses, ip_version=IPVersion.V4Only, use_asyncio=False))
    try:
        yield zc
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await trio.to_thread.run_sync(zc.close)


async def advertise(zc, advert: Advert, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Publish `advert` until cancelled, then say goodbye (records with TTL 0)."""
    from zeroconf import ServiceInfo

    info = ServiceInfo(SERVICE, advert.instance_name(), addresses=[socket.inet_aton(advert.address)],
                       port=advert.port, properties=advert.properties(), server=f"swarm-{advert.node_id}.local.")
    await trio.to_thread.run_sync(partial(zc.register_service, info, allow_name_change=True))
    log.info("advertising %s on %s:%d", info.name.removesuffix("." + SERVICE), advert.address, advert.port)
    task_status.started(info.name)
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(3):
            await trio.to_thread.run_sync(zc.unregister_service, info)


async def browse(zc, events: trio.MemorySendChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Send DeviceSeen / DeviceGone into `events` as agents come and go, until cancelled."""
    from zeroconf import ServiceBrowser, ServiceStateChange

    trio_token = trio.lowlevel.current_trio_token()
    changes_in, changes = trio.open_memory_channel(1000)
    node_of: dict[str, str] = {}  # instance name -> node id

    def on_change(zeroconf, service_type, name, state_change):  # in zeroconf's thread
        try:
            trio.from_thread.run_sync(changes_in.send_nowait, (state_change, name), trio_token=trio_token)
        except (trio.RunFinishedError, trio.ClosedResourceError, trio.BrokenResourceError, trio.WouldBlock):
            pass

    async def resolve(name: str) -> None:
        info = await trio.to_thread.run_sync(zc.get_service_info, SERVICE, name, RESOLVE_TIMEOUT_MS,
                                             abandon_on_cancel=True)
        advert = Advert.from_service_info(info) if info else None
        if advert is None:
            log.debug("ignoring malformed or unresolved advert %s", name)
            return
        node_of[name] = advert.node_id
        await events.send(DeviceSeen(advert))

    browser = await trio.to_thread.run_sync(lambda: ServiceBrowser(zc, SERVICE, handlers=[on_change]))
    task_status.started()
    try:
        async with trio.open_nursery() as nursery:
            async for state_change, name in changes:
                if state_change is ServiceStateChange.Removed:
                    if name in node_of:
                        await events.send(DeviceGone(node_of.pop(name)))
                else:
                    nursery.start_soon(resolve, name)
    finally:
        changes_in.close()
        with trio.CancelScope(shield=True), trio.move_on_after(3):
            await trio.to_thread.run_sync(browser.cancel)
