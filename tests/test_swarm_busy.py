"""A run whose devices are all held by another run stops at once and says so."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from swarm.cluster import JobError
from swarm.cluster.remote_job import CoordinatorJob
from swarm.errors import SwarmError
from swarm.execution import launch
from swarm.execution.launch import RosterControl

pytestmark = pytest.mark.trio


class _Events:
    def __aiter__(self):
        return self

    async def __anext__(self):
        await trio.sleep_forever()


class _Handle:
    def __init__(self, refuse: dict[str, str]):
        self.refuse = refuse
        self.started = []

    async def assign(self, node_id, kind, spec):
        if node_id in self.refuse:
            raise JobError(f"{node_id} refused job run-2: {self.refuse[node_id]}")

    async def start(self, node_id):
        self.started.append(node_id)

    assign_and_start = CoordinatorJob.assign_and_start  # the real one, over the fake assign and start

    def data(self, channel, body):
        return body

    async def wait_done(self, node_id):
        await trio.sleep_forever()

    async def receive(self, channel):
        await trio.sleep_forever()


class _Cluster:
    def __init__(self, handle):
        self.handle = handle
        self.credentials = SimpleNamespace(node_id="coordinator")

    def subscribe(self):
        return _Events()

    def job(self, job_id, epoch=0):
        return self.handle

    def device(self, node_id):
        return SimpleNamespace(health="alive")


def _control(refuse, nursery):
    names = {f"dev{i}": SimpleNamespace(node_id=f"n{i}", address="127.0.0.1", port=4750 + i) for i in range(3)}
    handle = _Handle(refuse)
    return RosterControl(_Cluster(handle), "run-2", names, nursery, lambda text: None), handle


def _job():
    return SimpleNamespace(plan=SimpleNamespace(used_devices=lambda: ["dev0", "dev1", "dev2"]))


async def test_every_device_busy_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(launch, "job_spec_dict", lambda job, devices: {})
    busy = {f"n{i}": "busy with job run-1 of coordinator c1" for i in range(3)}
    async with trio.open_nursery() as nursery:
        control, _ = _control(busy, nursery)
        with pytest.raises(SwarmError, match=r"no device could take its part.*dev0: .*busy with job run-1.*swarm status"):
            await control.start_epoch(0, _job())
        nursery.cancel_scope.cancel()


async def test_one_busy_device_is_a_loss_the_run_recovers_from(monkeypatch):
    monkeypatch.setattr(launch, "job_spec_dict", lambda job, devices: {})
    async with trio.open_nursery() as nursery:
        control, handle = _control({"n1": "busy with job run-1 of coordinator c1"}, nursery)
        await control.start_epoch(0, _job())
        assert await control.next_loss() == {"dev1"}
        assert sorted(handle.started) == ["n0", "n2"]
        nursery.cancel_scope.cancel()
