"""A lane: one sealed connection between two agents' runs that carries a gradient sum's
shares one way, moved by blocking calls from threads rather than by the event loop
(swarm/execution/lane.py sums on lanes; swarm/profiling/bandwidth.py measures what a share
costs on one). The connection is the agents' own (handshake, sealed records, limits); its
first message, on job channel LANE, handed it to the run at the far end, and from then on
neither agent's event loop reads or writes it.
"""
from __future__ import annotations

import os
import socket

import numpy as np

from swarm.agent.jobs import LANE
from swarm.net.peer import _set_lowat
from swarm.wire import NEED_DATA, Closed, JobData, ProtocolError

FOREVER_S = 7 * 24 * 3600.0  # a lane's socket timeout where the job has none


def sum_lanes_on() -> bool:
    """Whether this process's runs sum on lanes: SWARM_SUM_LANES=0 sums through the event loop
    as before (for comparisons), and the bandwidth probe then leaves the lanes unmeasured."""
    return os.environ.get("SWARM_SUM_LANES", "1") != "0"


class LaneBroken(Exception):
    """A lane failed: `name` is the far end; `report`: whether to tell the coordinator."""

    def __init__(self, name: str, why: str, report: bool):
        super().__init__(f"the lane to {name}: {why}")
        self.name, self.why, self.report = name, why, report


class Lane:
    """One authenticated connection that carries shares one way, moved by blocking calls on a
    duplicate of its descriptor (the event loop no longer reads or writes it)."""

    def __init__(self, conn, name: str, job_id: str, epoch: int):
        self.conn = conn
        self.name = name
        self.protocol = conn.protocol
        self.job_id, self.epoch = job_id, epoch
        self.sock = socket.socket(fileno=os.dup(conn.stream.socket.fileno()))
        self.lowat = _set_lowat(self.sock, 0, 0)  # the socket's receive low-water mark, from 1

    def send(self, key: list, array: np.ndarray, timeout: float | None) -> None:
        self.protocol.send(JobData(self.job_id, self.epoch, LANE, {"k": key, "arrays": [array]}))
        self.sock.settimeout(timeout)
        try:
            for buffer in self.protocol.data_to_send():  # each record sealed as it is taken
                self.sock.sendall(buffer)
        except TimeoutError:
            raise
        except OSError as exc:
            raise LaneBroken(self.name, f"send failed: {exc}", report=False) from None

    def receive(self, key: list, like: np.ndarray, timeout: float | None) -> np.ndarray:
        """The share keyed `key`, which must be an array of `like`'s shape and dtype."""
        self.sock.settimeout(timeout)
        try:
            while (event := self.protocol.next_event()) is NEED_DATA:
                view = self.protocol.payload_buffer(more=True)
                if view is not None:
                    self.lowat = _set_lowat(self.sock, self.lowat, len(view))
                    count = self.sock.recv_into(view)
                    self.protocol.payload_received(count)
                else:  # a frame's header or a small body next: wake for any byte of it
                    self.lowat = _set_lowat(self.sock, self.lowat, 0)
                    data = self.sock.recv(256 * 1024)
                    count = len(data)
                    self.protocol.receive_data(data)
                if count == 0:
                    raise LaneBroken(self.name, "closed by the far end", report=False)
        except TimeoutError:
            raise
        except ProtocolError as exc:
            if getattr(exc, "kind", "") == "closed":
                raise LaneBroken(self.name, str(exc), report=False) from None
            raise LaneBroken(self.name, f"refused what came: {exc}", report=True) from None
        except OSError as exc:
            raise LaneBroken(self.name, f"receive failed: {exc}", report=False) from None
        if isinstance(event, Closed):
            raise LaneBroken(self.name, f"closed by the far end ({event.reason})", report=False)
        body = event.body if isinstance(event, JobData) and event.channel == LANE else None
        arrays = body.get("arrays") if isinstance(body, dict) else None
        if body is None or body.get("k") != key or not isinstance(arrays, list) or len(arrays) != 1 \
                or not isinstance(arrays[0], np.ndarray) or arrays[0].shape != like.shape \
                or arrays[0].dtype != like.dtype:
            raise LaneBroken(self.name, f"expected share {key} of {like.shape} {like.dtype}, got "
                             f"{type(event).__name__} {body.get('k') if isinstance(body, dict) else ''}", report=True)
        return arrays[0]

    def shutdown(self) -> None:
        """Wake whatever thread is blocked on the lane; it cannot be used again."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
