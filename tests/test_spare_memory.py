"""What a device can spare for a plan: MemAvailable, a cgroup's limit less its use (v1 and v2
files faked in a folder), the agent's own memory and the reserve; `swarm join --reserve`;
the figure's way to the coordinator (Info, refreshed before a plan) and what it prints."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from swarm.host import resources
from swarm.host.resources import (MemoryFigures, cgroup_levels, cgroup_memory, default_reserve, memory_figures,
                                  parse_size, spare_memory_of)

MiB, GiB = 2**20, 2**30


def write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(f"{text}\n")


def v2_stat(anon: int, active_file: int, inactive_file: int) -> str:
    return f"anon {anon}\nfile {active_file + inactive_file}\nactive_file {active_file}\ninactive_file {inactive_file}"


def v1_stat(rss: int, active_file: int, inactive_file: int) -> str:
    # the cgroup's own lines first, then the hierarchical totals, as the kernel writes them
    return (f"cache 4096\nrss 4096\nactive_file 0\ninactive_file 0\nhierarchical_memory_limit 1\n"
            f"total_rss {rss}\ntotal_active_file {active_file}\ntotal_inactive_file {inactive_file}")


# -- the cgroup's figures --------------------------------------------------------------------------

def test_a_v2_cgroup_leaves_its_limit_less_what_it_uses_beyond_page_cache(tmp_path):
    """systemd's swarm.service on a 1 GiB Pi: MemoryMax=768M, MemoryHigh=720M; the agent and a
    helper use 300 MiB, 120 MiB of it page cache (torch's libraries, a data set): the room is
    720 - 180 MiB, under the throttle, not the hard limit. A parent without a limit ("max")
    changes nothing; a parent with a tighter room wins."""
    service = tmp_path / "system.slice" / "swarm.service"
    write(tmp_path / "system.slice", memory__max="max", memory__current=900 * MiB,
          memory__stat=v2_stat(700 * MiB, 100 * MiB, 100 * MiB))
    write(service, memory__max=768 * MiB, memory__high=720 * MiB, memory__current=300 * MiB,
          memory__stat=v2_stat(180 * MiB, 70 * MiB, 50 * MiB))
    proc = "0::/system.slice/swarm.service\n"
    assert cgroup_levels(proc, tmp_path) == [(768 * MiB, 720 * MiB, 180 * MiB)]
    assert cgroup_memory(proc, tmp_path) == (768 * MiB, 540 * MiB)
    # the slice limited to 1 GiB, 900 MiB used of it, 200 MiB of that page cache: 324 MiB left there
    (tmp_path / "system.slice" / "memory.max").write_text(f"{GiB}\n")
    assert cgroup_memory(proc, tmp_path) == (768 * MiB, GiB - 700 * MiB)
    # no limit anywhere: nothing to say
    for folder in (service, tmp_path / "system.slice"):
        (folder / "memory.max").write_text("max\n")
        (folder / "memory.high").write_text("max\n")
    assert cgroup_memory(proc, tmp_path) is None


def test_a_v1_cgroup_counts_its_use_with_the_children_and_leaves_out_page_cache(tmp_path):
    """The testbed's device on a cgroup v1 host: memory/swtb/dev1, limited to 1 GiB, its agent
    and a 300 MiB program using 340 MiB beside 60 MiB of page cache; the parent's limit is
    cgroup v1's "unlimited"."""
    write(tmp_path / "memory" / "swtb", memory__limit_in_bytes=9223372036854771712,
          memory__usage_in_bytes=500 * MiB, memory__stat=v1_stat(400 * MiB, 50 * MiB, 50 * MiB))
    write(tmp_path / "memory" / "swtb" / "dev1", memory__limit_in_bytes=GiB, memory__usage_in_bytes=400 * MiB,
          memory__stat=v1_stat(340 * MiB, 20 * MiB, 40 * MiB))
    proc = "4:memory:/swtb/dev1\n1:cpu:/swtb/dev1\n0::/\n"  # a hybrid host: v2 mounted, memory on v1
    assert cgroup_levels(proc, tmp_path) == [(GiB, GiB, 340 * MiB)]
    assert cgroup_memory(proc, tmp_path) == (GiB, GiB - 340 * MiB)
    assert cgroup_memory("4:memory:/swtb\n", tmp_path) is None
    # use that cannot be read: the limit stands, the room is all of it
    (tmp_path / "memory" / "swtb" / "dev1" / "memory.usage_in_bytes").unlink()
    assert cgroup_memory(proc, tmp_path) == (GiB, GiB)


# -- the arithmetic --------------------------------------------------------------------------------

def test_the_default_reserve_is_a_32nd_of_the_memory_within_32_mib_and_1_gib():
    assert default_reserve(512 * MiB) == 32 * MiB
    assert default_reserve(GiB) == 32 * MiB
    assert default_reserve(4 * GiB) == 128 * MiB
    assert default_reserve(8 * GiB) == 256 * MiB
    assert default_reserve(64 * GiB) == GiB


def test_spare_is_what_is_available_and_the_agents_own_less_the_reserve():
    # a Pi with a desktop: 1 GiB, 420 MiB available, the agent holding 250 MiB, 32 MiB kept back
    assert spare_memory_of(GiB, 420 * MiB, 250 * MiB, 32 * MiB) == 638 * MiB
    # nothing else there: all of it less the reserve, never more (the agent's pages counted twice)
    assert spare_memory_of(GiB, 1000 * MiB, 250 * MiB, 32 * MiB) == GiB - 32 * MiB
    # less available than the reserve keeps back: nothing
    assert spare_memory_of(GiB, 10 * MiB, 0, 32 * MiB) == 0
    assert MemoryFigures(GiB, 420 * MiB, 250 * MiB, 0).spare == 670 * MiB


def test_memory_figures_take_the_smaller_of_mem_available_and_the_cgroups_room(monkeypatch):
    import psutil

    available = {"bytes": 3 * GiB}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * GiB, available=available["bytes"]))
    monkeypatch.setattr(resources, "own_memory", lambda: 200 * MiB)
    monkeypatch.setattr(resources, "cgroup_memory", lambda: (GiB, 700 * MiB))  # a 1 GiB cgroup, 324 MiB in use
    figures = memory_figures()
    assert figures == MemoryFigures(GiB, 700 * MiB, 200 * MiB, 32 * MiB)
    assert figures.spare == 868 * MiB
    available["bytes"] = 500 * MiB  # the host itself is short: MemAvailable decides
    assert memory_figures(reserve=100 * MiB).spare == 600 * MiB
    monkeypatch.setattr(resources, "cgroup_memory", lambda: None)  # no cgroup limit: the host's
    available["bytes"] = 9 * GiB
    assert memory_figures().total == 16 * GiB and memory_figures().spare == 9 * GiB + 200 * MiB - 512 * MiB
    assert memory_figures(total=2 * GiB, reserve=0).spare == 2 * GiB  # an agent told its memory: within it


def test_this_process_is_measured_for_real():
    """The readers on this machine: a figure within the total, the process's own memory resident."""
    figures = memory_figures()
    assert 0 < figures.own < figures.total and 0 <= figures.spare <= figures.total - figures.reserve
    assert figures.available > 0


def test_sizes_as_users_write_them():
    assert [parse_size(t) for t in ("300M", "1G", "0", "1.5GiB", "512MB", "2048", " 64 k ")] == \
        [300 * MiB, GiB, 0, 3 * GiB // 2, 512 * MiB, 2048, 64 * 1024]
    assert [parse_size(t) for t in ("lots", "-1G", "1X", "", "1e3M")] == [None] * 5


# -- what a plan and `swarm status` show -----------------------------------------------------------

def test_a_simulated_plan_says_its_peak_of_what_each_device_can_spare():
    """An `auto` plan: the planner's prediction (its budget is what the device can spare less
    the runtime and the job's reserve; need = spare less what the budget leaves) and the
    `swarm plan` table's columns."""
    import numpy as np

    from planner.cluster import Cluster, Device
    from planner.costs import CostTable
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.memory_fit import describe_room, room_left
    from planner.planners import make_plan
    from planner.report import plan_table
    from swarm.zoo import describe_model

    desc = describe_model("yolov2-16", 160, classes=5)
    costs = CostTable.from_flops(desc, 2.0)
    runtime, job = 270 * MiB, 256 * MiB
    spare = {"dev0": 990 * MiB, "dev1": 800 * MiB}
    devices = [Device(n, costs, s - runtime - job, facts={"spare": s}) for n, s in spare.items()]
    cluster = Cluster(devices, np.full((2, 2), 12.5e6), 1e-3)
    inputs = PlanInputs(desc, MemoryModel.for_devices(desc, "sgd", None, "glibc"), cluster, 8, 1)
    plan = make_plan("dp", inputs)
    timeline = inputs.simulate(plan)
    plan.devices = {n: {"memory": spare[n]} for n in plan.used_devices()}  # as swarm train's facts say
    room = room_left(plan, desc)
    for d in plan.used_devices():
        need, have, predicted = room[d]
        left = timeline.budgets[d] - timeline.peak_memory[d]
        assert predicted and have == spare[d] and need == pytest.approx(spare[d] - left, abs=1)
    assert describe_room(room).startswith("memory at a step's peak, of what each device can spare: dev0 ")
    # what a device's part faults in of its heap before the first step (swarm.host.malloc.reserve)
    from swarm.execution.train_job import planned_peak
    from swarm.local.trainer import TrainConfig

    cfg = TrainConfig(model="yolov2-16", img_size=160, batch_size=8, classes=5)
    assert {d: planned_peak(plan, cfg, None, d) for d in room} == {d: int(room[d][0]) for d in room}
    plan.devices = {n: {"spare": spare[n]} for n in plan.used_devices()}  # as `swarm plan`'s devices say
    header, rule, *rows = plan_table(plan, timeline).split("\n\n")[2].splitlines()
    assert header.split() == ["device", "stages", "busy", "use", "peak", "memory", "budget", "left", "spare", "fits"]
    dev1 = next(r for r in rows if r.startswith("dev1"))
    assert "800 MiB" in dev1 and dev1.split()[-1] == "yes"


def test_status_shows_what_a_device_can_spare_beside_its_memory():
    import time

    from swarm.cluster import Member
    from swarm.commands.status_cmd import format_table

    pi = Member("n1", "10.0.0.2", 4750, name="pi-1", cores=4, memory=GiB, spare=604 * MiB, accelerator="cpu",
                version="0.1.0", health="alive", last_seen=time.time())
    never = Member("10.0.0.3:4750", "10.0.0.3", 4750, health="unreachable", error="connection refused")
    lines = format_table([pi, never]).splitlines()
    assert lines[0].split()[:6] == ["NAME", "ADDRESS", "CORES", "MEMORY", "SPARE", "ACCEL"]
    assert lines[1].split()[:8] == ["pi-1", "10.0.0.2:4750", "4", "1.0", "GiB", "604", "MiB", "cpu"]
    spare = lines[0].index("SPARE")
    assert lines[2][spare:].split()[0] == "?"  # never said


# -- `swarm join --reserve` and the settings file --------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ("lots", "argument --reserve: 'lots' is not a size (e.g. 300M, 1G, 0)"),
    ("-300M", "argument --reserve: '-300M' is not a size (e.g. 300M, 1G, 0)"),
    ("100T", "the reserve (102400 GiB) keeps back all of this device's"),
])
def test_a_bad_reserve_is_one_line(tmp_path, monkeypatch, capsys, value, message):
    from swarm.cli import main

    monkeypatch.setenv("SWARM_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    try:
        code = main(["join", f"--reserve={value}", "--state-dir", str(tmp_path)])
    except SystemExit as stop:  # argparse's errors
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_reserve_comes_from_the_flag_else_the_settings_file(tmp_path, monkeypatch):
    from swarm.commands.join_cmd import agent_config
    from swarm.errors import SwarmError
    from swarm.host.config import parse_settings
    from tests.test_service_install import TOKEN, join_args

    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "swarm.toml"
    config.write_text(f'reserve = "300M"\ntoken_file = "{tmp_path / "token"}"\n')
    monkeypatch.setenv("SWARM_CONFIG", str(config))
    agent, _, _ = agent_config(join_args(state_dir=str(tmp_path)))
    assert agent.reserve == 300 * MiB
    agent, _, _ = agent_config(join_args(state_dir=str(tmp_path), reserve=0))  # the flag wins, 0 included
    assert agent.reserve == 0
    config.write_text(f'reserve = ""\ntoken_file = "{tmp_path / "token"}"\n')
    agent, _, _ = agent_config(join_args(state_dir=str(tmp_path)))
    assert agent.reserve is None  # the default, which the agent works out from its memory
    with pytest.raises(SwarmError, match=r'x.toml: reserve must be a size such as "300M" or "1G", got \'much\''):
        parse_settings('reserve = "much"\n', "x.toml")


# -- the agent reports it, the coordinator asks again before a plan --------------------------------

AGENT_TOKEN = "spare-test-token-" + "s" * 20


def test_the_agent_reports_what_it_can_spare_now(monkeypatch):
    from swarm.agent import Agent, AgentConfig
    from swarm.net import resolve_network

    monkeypatch.setattr(resources, "own_memory", lambda: 100 * MiB)
    monkeypatch.setattr(resources, "cgroup_memory", lambda: (4 * GiB, 1500 * MiB))
    agent = Agent(AgentConfig(name="pi", node_id="n", token=AGENT_TOKEN, network=resolve_network("lo"), port=0,
                              advertise=False, memory=4 * GiB))
    assert agent.reserve == 128 * MiB and agent.memory == 4 * GiB
    info = agent.info()
    assert (info.memory, info.spare) == (4 * GiB, 1500 * MiB + 100 * MiB - 128 * MiB)
    monkeypatch.setattr(resources, "cgroup_memory", lambda: (4 * GiB, 300 * MiB))  # something else took 1.2 GiB
    assert agent.info().spare == 272 * MiB
    told = Agent(AgentConfig(name="pi", node_id="n", token=AGENT_TOKEN, network=resolve_network("lo"), port=0,
                             advertise=False, memory=4 * GiB, reserve=0))
    assert told.reserve == 0 and told.info().spare == 400 * MiB


@pytest.mark.trio
async def test_a_refresh_brings_the_spare_memory_of_now(monkeypatch):
    """The roster learns a device's spare memory when it connects, and again when asked to
    refresh before a plan (`swarm train` and `swarm plan` do): not the figure of long ago."""
    from swarm.agent import Agent, AgentConfig
    from swarm.cluster import open_roster
    from swarm.net import Credentials, resolve_network

    network = resolve_network("lo")
    spare = {"node0": 900 * MiB, "node1": 700 * MiB}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            agents = []
            for i in range(2):
                agent = Agent(AgentConfig(name=f"a{i}", node_id=f"node{i}", token=AGENT_TOKEN, network=network, port=0,
                                          advertise=False, memory=GiB))
                agent.spare_memory = lambda node=f"node{i}": spare[node]
                agents.append(await nursery.start(agent.run))
            peers = [("127.0.0.1", a.port) for a in agents]
            async with open_roster(Credentials("coordinator", AGENT_TOKEN), network, peers=peers,
                                    discover=False) as cluster:
                devices = await cluster.wait_for(2, timeout=10)
                assert [(d.memory, d.spare) for d in devices] == [(GiB, 900 * MiB), (GiB, 700 * MiB)]
                spare["node1"] = 330 * MiB  # a program started beside a1's agent
                await trio.sleep(0.3)
                assert cluster.device("node1").spare == 700 * MiB  # not asked again: the old figure
                started = trio.current_time()
                await cluster.refresh(["node0", "node1"])
                assert trio.current_time() - started < 1.0  # the answers, not the timeout, ended it
                assert [d.spare for d in cluster.devices()] == [900 * MiB, 330 * MiB]
                assert cluster.device("node1").as_dict()["spare"] == 330 * MiB  # `swarm status --json`
            nursery.cancel_scope.cancel()


def test_swarm_train_plans_on_the_spare_memory_and_says_what_is_left():
    """The facts `swarm train` plans with: what each device could spare (all of its memory
    where it never said), and the line under the plan with each device's peak of it."""
    from planner.memory_fit import describe_room, room_left
    from swarm.execution.launch import SwarmOptions, SwarmRunner
    from swarm.local.trainer import TrainConfig
    from swarm.zoo import describe_model

    runner = SwarmRunner(SwarmOptions(strategy="dp"), log=lambda *a: None, fallback=None)
    cfg = TrainConfig(model="yolov2-16", img_size=416, batch_size=8, microbatches=8, classes=5)
    trainer = SimpleNamespace(cfg=cfg, desc=describe_model("yolov2-16", 416, classes=5))
    devices = {"dev0": SimpleNamespace(cores=1, memory=GiB, spare=990 * MiB, address="10.0.0.1", port=4750),
               "dev1": SimpleNamespace(cores=1, memory=GiB, spare=None, address="10.0.0.2", port=4750)}
    plan = runner._make_plan(trainer, ["dev0", "dev1"], devices)
    assert plan.devices["dev0"]["memory"] == 990 * MiB and plan.devices["dev1"]["memory"] == GiB
    room = room_left(plan, trainer.desc, cfg.optimizer)
    assert set(room) == {"dev0", "dev1"} and room["dev0"][1:] == (990 * MiB, False)
    assert room["dev0"][0] == room["dev1"][0] > 300 * MiB  # the same share: the same least need
    from swarm.execution.train_job import planned_peak

    assert planned_peak(plan, cfg, None, "dev0") == 0  # not simulated: no heap faulted in ahead
    line = describe_room(room)
    assert line.startswith("memory at a step's peak (at least), of what each device can spare: dev0 ")
    assert "of 990 MiB" in line and "of 1 GiB" in line
    # a device that can spare less than the plan needs is refused, with its figure
    devices["dev1"].spare = 400 * MiB
    from swarm.errors import SwarmError
    with pytest.raises(SwarmError, match=r"on dev1, which has 400 MiB"):
        runner._make_plan(trainer, ["dev0", "dev1"], devices)
