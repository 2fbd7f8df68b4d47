"""Coordinator fail-over without the testbed: the election rule, the replica an agent keeps
(and the ones it refuses), the term epochs that fence a replaced coordinator, and an election
among agents on loopback whose coordinator went away."""
from __future__ import annotations

import dataclasses

import pytest
import trio

from swarm.agent import Agent, AgentConfig
from swarm.agent.failover import TERM_EPOCHS, Replica, elect, first_epoch, term_of
from swarm.agent.quorum import Vote
from swarm.agent.jobs import register_job_kind
from swarm.cluster import JobError, open_roster
from swarm.net import Credentials, resolve_network
from swarm.wire import JobReplica, JobData, RemoteProtocolError, from_wire, to_wire

TOKEN = "test-token-" + "x" * 20


def replica(term=0, step=4, **changes) -> Replica:
    fields = dict(run_id="abc123", job_id="train-1", term=term, epoch=first_epoch(term) + 2, step=step,
                  holdings={"a1": [0, 1], "a2": [2, 3]}, plan={"stages": []},
                  devices={f"a{i}": {"node_id": f"node{i}", "address": f"127.0.0.1:{4750 + i}", "incarnation": f"start{i}"}
                           for i in range(3)},
                  flags=["--steps", "8"], coordinator="node0", holders=["node1", "node2"])
    fields.update(changes)
    return Replica(**fields)


def test_the_successor_is_the_lowest_node_id_holding_the_newest_replica():
    assert elect({"node2": (0, 4), "node1": (0, 4), "node3": (0, 4)}) == "node1"
    assert elect({"node1": (0, 2), "node3": (0, 4), "node2": (0, 4)}) == "node2"  # node1's replica is older
    assert elect({"node1": (0, 8), "node2": (1, 2)}) == "node2"  # a newer term beats a later step
    assert elect({"node5": (0, 4)}) == "node5"
    assert elect({}) is None


def test_terms_split_the_epochs():
    assert term_of(0) == 0 and term_of(TERM_EPOCHS - 1) == 0 and term_of(first_epoch(3) + 7) == 3
    assert first_epoch(1) > first_epoch(0) + 10**6  # more re-plans than any coordinator makes


def test_a_replica_from_the_wire_is_checked():
    r = replica()
    assert Replica.from_body(r.to_body()) == r
    body = r.to_body()
    wire = from_wire(to_wire(JobReplica("train-1", 0, 4, body)))
    assert Replica.from_body(wire.body) == r
    for bad in ({**body, "term": "0"}, {**body, "epoch": first_epoch(1)}, {**body, "devices": {"a0": {"node_id": 1}}},
                {**body, "flags": [1]}, {**body, "extra": 1}, {k: v for k, v in body.items() if k != "plan"},
                {**body, "step": -1}):
        with pytest.raises(ValueError):
            Replica.from_body(bad)
    with pytest.raises(RemoteProtocolError):
        from_wire([25, "train-1", 0, 4, ["not", "a", "dict"]])


def test_a_device_started_again_holds_none_of_its_old_layers():
    from swarm.cluster.members import Member
    from swarm.execution.launch import still_held

    names = {f"a{i}": Member(f"node{i}", "127.0.0.1", 4750 + i, incarnation=f"start{i}") for i in range(3)}
    assert still_held(replica(), names) == {"a1": {0, 1}, "a2": {2, 3}}
    names["a2"].incarnation = "later"  # a2's agent was killed and started again since the replica
    assert still_held(replica(), names) == {"a1": {0, 1}}
    del names["a1"]  # a1 does not answer
    assert still_held(replica(), names) == {}


async def agents_in_a_job(n: int, job_id: str, epoch: int, nursery, cluster_node: str = "coordinator"):
    """n agents on loopback (mDNS off), each holding `job_id` at `epoch` for a roster."""
    network = resolve_network("lo")
    agents = []
    for i in range(n):
        config = AgentConfig(name=f"a{i}", node_id=f"node{i}", token=TOKEN, network=network, port=0,
                             advertise=False)
        agents.append(await nursery.start(Agent(config).run))
    return agents, [("127.0.0.1", a.port) for a in agents]



async def wait_forever(ctx):
    """A job kind that holds the job until it is released."""
    await trio.sleep_forever()


async def handled(roster, node_id: str) -> None:
    """Wait until the agent `node_id` has handled every message this roster sent it: a Ping
    answered on the same connection (an agent handles a connection's messages in order)."""
    conn = roster.device(node_id).conn
    assert await roster._probe(node_id) and roster.device(node_id).conn is conn, "the connection closed"


@pytest.mark.trio
async def test_an_agent_keeps_the_newest_replica_of_its_coordinator_only():
    register_job_kind("wait", wait_forever)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            agents, peers = await agents_in_a_job(1, "train-1", 0, nursery)
            agent = agents[0]
            network = resolve_network("lo")
            async with open_roster(Credentials("coordinator", TOKEN), network, peers=peers, discover=False) as c, \
                    open_roster(Credentials("stranger", TOKEN), network, peers=peers, discover=False) as other:
                await c.wait_for(1, timeout=10)
                await other.wait_for(1, timeout=10)
                job = c.job("train-1", epoch=2)
                await job.assign("node0", "wait", {})
                for sender, r in [(c, replica(step=4)), (c, replica(step=2)), (other, replica(step=6)),
                                  (c, replica(step=5, job_id="train-2"))]:
                    await sender.send("node0", JobReplica(r.job_id, r.term, r.step, r.to_body()))
                await c.send("node0", JobReplica("train-1", 0, 9, replica(step=8).to_body()))  # says 9, holds 8
                await c.send("node0", JobReplica("train-1", 0, 8, {"not": "a replica"}))
                await handled(c, "node0")
                await handled(other, "node0")
                assert list(agent.replicas) == ["train-1"] and agent.replicas["train-1"].step == 4
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_replaced_coordinator_is_fenced():
    """Once an agent has held the job at the successor's term, the old coordinator's assignment
    is refused (also after the job ended there), and its data is dropped."""
    register_job_kind("wait", wait_forever)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            agents, peers = await agents_in_a_job(1, "train-1", 0, nursery)
            network = resolve_network("lo")
            async with open_roster(Credentials("old", TOKEN), network, peers=peers, discover=False) as old, \
                    open_roster(Credentials("new", TOKEN), network, peers=peers, discover=False) as new:
                await old.wait_for(1, timeout=10)
                await new.wait_for(1, timeout=10)
                await old.job("train-1", epoch=3).assign("node0", "wait", {})
                await new.job("train-1", epoch=first_epoch(1)).assign("node0", "wait", {})
                with pytest.raises(JobError, match="fenced: a coordinator of term 1 has taken the job over"):
                    await old.job("train-1", epoch=4).assign("node0", "wait", {})
                refused = agents[0].refused_messages
                await old.send("node0", JobData("train-1", 4, "x", {}))
                await handled(old, "node0")
                assert agents[0].refused_messages == refused + 1
                assert agents[0].job.coordinator_id == "new"
                await new.job("train-1", epoch=first_epoch(1)).release("node0")  # the run ended
                assert agents[0].job is None
                with pytest.raises(JobError, match="fenced"):  # the job is gone here, its newest term is not
                    await old.job("train-1", epoch=5).assign("node0", "wait", {})
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_holders_elect_a_successor_when_the_coordinator_goes(tmp_path):
    """Two agents hold the replica of a coordinator that goes away: the lower node id starts
    the run's next term from the replica (its `swarm train --take-over`), the other does not."""
    import sys

    from swarm.agent.jobs import register_job_kind
    from swarm.commands.train_cmd import check_detached_flags

    async def wait_forever(ctx):
        await trio.sleep_forever()

    register_job_kind("wait", wait_forever)
    network = resolve_network("lo")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            agents = []
            for i in (1, 2):
                config = AgentConfig(name=f"a{i}", node_id=f"node{i}", token=TOKEN, network=network, port=0,
                                     advertise=False, state_dir=tmp_path / f"a{i}", check_run_flags=check_detached_flags,
                                     election_timeout=1.0)
                agent = await nursery.start(Agent(config).run)
                real = agent._run_command

                def recorded(run, real=real):  # the command the agent would run, written down instead
                    argv, env = real(run)  # (and alive a while, as a successor starting: while it lives its
                    # agent asks the lease in its name, and the other holder does not stand again)
                    return [sys.executable, "-c", "import sys, time; open('argv', 'w').write(' '.join(sys.argv[1:])); "
                            "time.sleep(10)", *argv[4:]], env
                agent.detached.command_for = recorded
                agents.append(agent)
            devices = {"a0": {"node_id": "node0", "address": "127.0.0.1:9"}}
            devices.update({f"a{i}": {"node_id": a.node_id, "address": f"127.0.0.1:{a.port}"}
                            for i, a in zip((1, 2), agents)})
            r = replica(devices=devices)
            async with open_roster(Credentials("node0~1-a", TOKEN), network, discover=False,
                                   peers=[("127.0.0.1", a.port) for a in agents]) as coordinator:
                await coordinator.wait_for(2, timeout=10)
                job = coordinator.job("train-1", epoch=r.epoch)
                for a in agents:
                    await job.assign(a.node_id, "wait", {})
                    await coordinator.send(a.node_id, JobReplica("train-1", 0, r.step, r.to_body()))
                for a in agents:
                    await handled(coordinator, a.node_id)
                    assert a.replicas == {"train-1": r}
            # the coordinator is gone: its connections closed
            while "abc123" not in agents[0].detached.runs:
                await trio.sleep(0.1)
            run = agents[0].detached.runs["abc123"]
            while not (run.folder / "argv").exists():
                await trio.sleep(0.1)
            argv = (run.folder / "argv").read_text()
            assert argv.startswith("--steps 8 ") and f"--take-over {run.folder / 'replica.json'}" in argv
            assert "--run-id abc123" in argv and run.term == 1
            won = dataclasses.replace(r, elected_term=1, elected_by=["node1", "node2"])  # both voted for node1
            assert Replica.from_body(__import__("json").loads((run.folder / "replica.json").read_text())) == won
            assert agents[1].voters["train-1"].vote == Vote(1, "node1") == Vote.load(tmp_path / "a2/votes/train-1.json")
            assert agents[1].detached.runs == {}
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_holder_follows_its_coordinator_until_it_votes_in_a_newer_term(tmp_path):
    """A holder answers its coordinator's lease asks; refuses a vote while it hears from it;
    grants one (written down) once the election timeout has passed; and from then on refuses
    the old coordinator's lease and assignments, naming the newer term."""
    from swarm.agent.quorum import Vote
    from swarm.net import connect_peer
    from swarm.wire import LeaseAsk, VoteAsk

    register_job_kind("wait", wait_forever)
    network = resolve_network("lo")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            config = AgentConfig(name="a0", node_id="node0", token=TOKEN, network=network, port=0, advertise=False,
                                 state_dir=tmp_path, election_timeout=0.5)
            agent = await nursery.start(Agent(config).run)
            r = replica(holders=["node0", "node1"])
            async with open_roster(Credentials("coordinator", TOKEN), network, peers=[("127.0.0.1", agent.port)],
                                   discover=False) as c:
                await c.wait_for(1, timeout=10)
                await c.job("train-1", epoch=r.epoch).assign("node0", "wait", {})
                await c.send("node0", JobReplica("train-1", 0, r.step, r.to_body()))
                answers = []
                c.on_lease_answer = lambda node, msg: answers.append(msg)

                async def lease_ask(seq):
                    await c.send("node0", LeaseAsk(seq, "train-1", 0, []))
                    await handled(c, "node0")
                    return answers[-1]
                granted = await lease_ask(1)
                assert (granted.seq, granted.granted, granted.term) == (1, True, 0)

                candidate = await connect_peer("127.0.0.1", agent.port, Credentials("node1", TOKEN))
                stranger = await connect_peer("127.0.0.1", agent.port, Credentials("node7", TOKEN))

                async def vote(conn, seq):
                    await conn.send(VoteAsk(seq, "train-1", 1, "node1", 0, r.step, False))
                    async for message in conn:
                        if getattr(message, "seq", None) == seq:
                            return message
                early = await vote(candidate, 1)
                assert not early.granted and "less than the 0.5 s election timeout" in early.why, early
                await trio.sleep(0.6)
                assert (await vote(stranger, 2)).why == "node node7 holds no replica of job train-1"
                won = await vote(candidate, 3)
                assert (won.holder, won.term, won.granted) == ("node0", 1, True), won
                assert Vote.load(tmp_path / "votes" / "train-1.json") == Vote(1, "node1")
                refused = await lease_ask(2)
                assert (refused.granted, refused.term) == (False, 1)
                assert refused.why == "coordinator of term 0 fenced: node0 has voted in term 1", refused
                with pytest.raises(JobError, match="fenced: node0 has voted in term 1"):
                    await c.job("train-1", epoch=r.epoch + 1).assign("node0", "wait", {})
                await candidate.aclose()
                await stranger.aclose()
            nursery.cancel_scope.cancel()


async def detached_agents(nursery, tmp_path, ids, election_timeout: float = 1.0) -> list:
    """Agents on loopback with state directories whose detached runs are written down, not
    started: a run's `swarm train` arguments go to the file `argv` in the run's folder."""
    import sys

    from swarm.commands.train_cmd import check_detached_flags

    agents = []
    for i in ids:
        config = AgentConfig(name=f"a{i}", node_id=f"node{i}", token=TOKEN, network=resolve_network("lo"), port=0,
                             advertise=False, state_dir=tmp_path / f"a{i}", check_run_flags=check_detached_flags,
                             election_timeout=election_timeout)
        agent = await nursery.start(Agent(config).run)
        real = agent._run_command

        def recorded(run, real=real):
            argv, env = real(run)
            return [sys.executable, "-c", "import sys; open('argv', 'w').write(' '.join(sys.argv[1:]))",
                    *argv[4:]], env
        agent.detached.command_for = recorded
        agents.append(agent)
    return agents


@pytest.mark.trio
async def test_devices_the_plan_left_out_hold_the_replica_and_carry_the_run_on_in_turn(tmp_path):
    """Holders that have no part in the job keep the replica its coordinator sends (not one
    another node sends in its name). When the coordinator goes quiet, the lowest holder takes
    the run over; once it has, it names itself no more, so when it too stays quiet the next
    holder takes over in a newer term. A replica that says its run finished is never carried on."""
    network = resolve_network("lo")
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            agents = await detached_agents(nursery, tmp_path, (1, 2, 3))
            devices = {"a0": {"node_id": "node0", "address": "127.0.0.1:9"}}
            devices.update({f"a{i}": {"node_id": a.node_id, "address": f"127.0.0.1:{a.port}"}
                            for i, a in zip((1, 2, 3), agents)})
            r = replica(devices=devices, holders=["node1", "node2"])
            done = replica(job_id="train-2", run_id="def456", devices=devices, holders=["node3"], finished=True)
            peers = [("127.0.0.1", a.port) for a in agents]
            async with open_roster(Credentials("node0~1-a", TOKEN), network, discover=False, peers=peers) as c, \
                    open_roster(Credentials("node7~2-b", TOKEN), network, discover=False, peers=peers) as other:
                await c.wait_for(3, timeout=10)
                await other.wait_for(3, timeout=10)
                forged = replica(step=9, devices=devices, holders=["node1", "node2"])
                for a in agents[:2]:
                    await other.send(a.node_id, JobReplica("train-1", 0, 9, forged.to_body()))
                    await c.send(a.node_id, JobReplica("train-1", 0, r.step, r.to_body()))
                await c.send("node3", JobReplica("train-2", 0, done.step, done.to_body()))
                for a in agents:
                    await handled(c, a.node_id)
                    await handled(other, a.node_id)
                assert agents[0].replicas == agents[1].replicas == {"train-1": r}
                assert agents[2].replicas == {}  # (its run finished)
            for turn, (agent, term) in enumerate([(agents[0], 1), (agents[1], 2)]):
                while "abc123" not in agent.detached.runs:
                    await trio.sleep(0.1)
                run = agent.detached.runs["abc123"]
                assert run.term == term, (turn, run.term)
                while not (run.folder / "argv").exists():
                    await trio.sleep(0.1)
            assert agents[0].detached.runs["abc123"].term == 1  # (the first never stood again)
            assert agents[2].detached.runs == {}
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_holder_started_again_still_holds_its_replica(tmp_path):
    """A replica is kept in the state directory: an agent killed and started again holds it
    (and so still votes), while a file that holds no replica is dropped."""
    network = resolve_network("lo")
    r = replica(holders=["node0"])
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            (agent,) = await detached_agents(nursery, tmp_path, (0,), election_timeout=60.0)
            async with open_roster(Credentials("node0~1-a", TOKEN), network, discover=False,
                                   peers=[("127.0.0.1", agent.port)]) as c:
                await c.wait_for(1, timeout=10)
                await c.send("node0", JobReplica("train-1", 0, r.step, r.to_body()))
                await handled(c, "node0")
            assert agent.replicas == {"train-1": r}
            nursery.cancel_scope.cancel()
        (tmp_path / "a0" / "replicas" / "junk.json").write_text("{not json")
        async with trio.open_nursery() as nursery:
            (again,) = await detached_agents(nursery, tmp_path, (0,), election_timeout=60.0)
            assert again.incarnation != agent.incarnation
            assert again.replicas == {"train-1": r}
            assert sorted(p.name for p in (tmp_path / "a0" / "replicas").iterdir()) == ["train-1.json"]
            nursery.cancel_scope.cancel()
