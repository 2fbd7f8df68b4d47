"""Quorum (swarm/agent/quorum.py): the lease, the votes and the fence one by one, then a run of
3, 4 and 5 devices in virtual time cut by every partition there is and healed: never two
coordinators committing at once, and one coordinator once the partition heals."""
from __future__ import annotations

import ast
import heapq
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from swarm.agent import quorum
from swarm.agent.quorum import (Election, Fence, Lease, Vote, VoteAnswer, VoteFileError, VoteRequest, Voter,
                                check_quorums, majority)

NAMES5 = [f"dev{i}" for i in range(5)]


# -- the lease -------------------------------------------------------------------------

def test_majority_is_strict():
    assert [majority(n) for n in range(1, 7)] == [1, 2, 2, 3, 3, 4]


def test_the_lease_holds_while_a_majority_answered_a_recent_ping():
    lease = Lease(NAMES5, "dev0", term=0, lease_s=3.0, began=0.0)
    assert not lease.may_commit(0.0) and not lease.must_stop(2.9)  # a lease to gather a majority first
    assert lease.must_stop(3.0)
    lease.heard_from("dev1", 1.0)
    lease.heard_from("dev2", 2.0)
    lease.heard_from("dev2", 0.5)  # an answer to an older ping does not take the newer one back
    lease.heard_from("dev9", 3.5)  # no device of the run
    assert lease.heard_within(3.5) == ["dev0", "dev1", "dev2"] and lease.may_commit(3.5)
    assert not lease.may_commit(4.0) and lease.must_stop(4.0)  # dev1's ping was sent 3.0 s ago
    assert lease.why(4.0, 17) == ("heard from 2 of 5 devices (a majority is 3) in the last 3.0 s: stopping with "
                                  "the checkpoint of step 17")


def test_half_of_an_even_run_is_no_majority():
    lease = Lease(["a", "b", "c", "d"], "a", term=0, lease_s=3.0, began=0.0)
    lease.heard_from("b", 1.0)
    assert not lease.may_commit(1.5)
    lease.heard_from("c", 1.0)
    assert lease.may_commit(1.5)


def test_a_lease_counts_when_the_ping_was_sent_not_when_its_answer_came():
    lease = Lease(["a", "b", "c"], "a", term=0, lease_s=3.0, began=0.0)
    lease.heard_from("b", 1.0)  # the answer may arrive at 3.9: it still only covers until 4.0
    assert lease.may_commit(3.9) and not lease.may_commit(4.0)


def test_a_coordinator_refused_for_a_newer_term_stops_for_good():
    lease = Lease(["a", "b", "c"], "a", term=1, lease_s=3.0, began=0.0)
    lease.heard_from("b", 1.0)
    lease.refused(1, "not newer")  # a refusal of its own term (a broken vote file, say) fences nothing
    assert lease.may_commit(1.5)
    why = "coordinator of term 1 fenced: term 2 has begun (elected by b, c)"
    lease.refused(2, why)
    lease.heard_from("c", 1.2)
    assert not lease.may_commit(1.5) and lease.must_stop(1.5) and lease.fenced == why
    assert lease.why(1.5, 9) == why + "; stopping with the checkpoint of step 9"


def test_the_fence_names_the_term_that_began_and_its_voters():
    fence = Fence()
    assert fence.refuse(0) is None
    fence.see(2, ["dev4", "dev2", "dev3"])
    fence.see(1, ["dev0"])  # older: changes nothing
    assert fence.refuse(2) is None and fence.refuse(3) is None
    assert fence.refuse(1) == "coordinator of term 1 fenced: term 2 has begun (elected by dev2, dev3, dev4)"


def test_every_lease_majority_must_meet_every_election_majority():
    check_quorums(NAMES5, NAMES5[1:])  # every device but the coordinator's holds a replica
    check_quorums(NAMES5, NAMES5)
    check_quorums(["a", "b"], ["b"])
    with pytest.raises(ValueError, match=r"^2 replica holders of 5 devices: .* could miss each other"):
        check_quorums(NAMES5, ["dev1", "dev2"])  # dev0, dev3, dev4 hold a lease while dev1, dev2 elect
    with pytest.raises(ValueError, match="dev9 are not devices of the run"):
        check_quorums(NAMES5, ["dev1", "dev9"])


# -- votes -------------------------------------------------------------------------------

def voter(tmp_path: Path, name: str, now: float = 0.0) -> Voter:
    return Voter(name, tmp_path / f"{name}.vote", election_s=4.0, now=now)


LATER = 100.0  # long after the voters last heard their coordinator


def test_a_vote_is_granted_once_a_term_and_written_down_before_the_answer(tmp_path):
    v = voter(tmp_path, "dev2")
    answer = v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER)
    assert answer == VoteAnswer("dev2", 1, True)
    assert Vote.load(tmp_path / "dev2.vote") == Vote(1, "dev1")
    assert v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER).granted  # the same candidate again
    refused = v.answer(VoteRequest(1, "dev3", (0, 4)), (0, 4), LATER)
    assert not refused.granted and refused.why == "dev2 has voted in term 1 for dev1" and refused.term == 1
    assert v.answer(VoteRequest(2, "dev3", (0, 4)), (0, 4), LATER).granted  # a newer term, a new vote
    assert not v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER).granted  # an older term
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dev2.vote"]  # no temporary file left


def test_a_vote_request_with_an_older_replica_is_refused(tmp_path):
    v = voter(tmp_path, "dev2")
    answer = v.answer(VoteRequest(1, "dev1", (1, 4)), (1, 8), LATER)
    assert not answer.granted
    assert answer.why == "dev1's replica (term 1, step 4) is older than dev2's (term 1, step 8)"
    assert not v.answer(VoteRequest(2, "dev1", (0, 12)), (1, 4), LATER).granted  # a newer term beats a later step
    assert v.answer(VoteRequest(2, "dev1", (1, 8)), (1, 8), LATER).granted
    assert Vote.load(tmp_path / "dev2.vote") == Vote(2, "dev1")  # the refusals wrote nothing


def test_a_holder_that_heard_its_coordinator_lately_does_not_vote(tmp_path):
    v = voter(tmp_path, "dev2")
    assert v.on_coordinator(0, 50.0) is None
    answer = v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), 53.0)
    assert answer.why == "dev2 heard its coordinator 3.0 s ago, less than the 4.0 s election timeout"
    assert not v.may_stand(53.0) and v.may_stand(54.0)
    assert v.on_coordinator(0, 55.0, committing=False) is None  # a stopped coordinator holds nobody back
    assert v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), 55.0).granted


def test_a_poll_changes_nothing(tmp_path):
    v = voter(tmp_path, "dev2")
    poll = v.request((0, 4), poll=True)
    assert poll == VoteRequest(1, "dev2", (0, 4), poll=True)
    assert v.answer(VoteRequest(1, "dev1", (0, 4), poll=True), (0, 4), LATER).granted
    assert not (tmp_path / "dev2.vote").exists() and v.term == 0
    assert v.answer(VoteRequest(1, "dev3", (0, 4)), (0, 4), LATER).granted  # nothing was promised to dev1


def test_a_holder_that_restarts_keeps_its_vote(tmp_path):
    v = voter(tmp_path, "dev2")
    assert v.answer(VoteRequest(3, "dev1", (0, 4)), (0, 4), LATER).granted
    again = voter(tmp_path, "dev2", now=LATER)  # the agent restarted
    assert again.vote == Vote(3, "dev1") and again.term == 3
    # it waits a whole election timeout after starting, as if it had just heard its coordinator
    assert "election timeout" in again.answer(VoteRequest(3, "dev1", (0, 4)), (0, 4), LATER + 1).why
    assert again.answer(VoteRequest(3, "dev3", (0, 4)), (0, 4), LATER + 5).why == "dev2 has voted in term 3 for dev1"
    assert again.answer(VoteRequest(3, "dev1", (0, 4)), (0, 4), LATER + 5).granted
    assert again.on_coordinator(2, LATER + 6) == "coordinator of term 2 fenced: dev2 has voted in term 3"
    assert again.request((0, 4)).term == 4


@pytest.mark.parametrize("content", [b"{not json", b'{"term": "3", "voted_for": null}', b"[]", b"\xff\xfe",
                                     b'{"term": -1, "voted_for": null}', b'{"term": 1}'])
def test_a_corrupt_vote_file_refuses_votes_and_coordinators_in_one_line(tmp_path, content):
    (tmp_path / "dev2.vote").write_bytes(content)
    with pytest.raises(VoteFileError):
        Vote.load(tmp_path / "dev2.vote")
    v = voter(tmp_path, "dev2")
    answer = v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER)
    assert not answer.granted and "\n" not in answer.why
    assert answer.why.startswith(f"dev2 refuses to vote: vote file {tmp_path / 'dev2.vote'} ")
    assert answer.why.endswith("it votes and answers again once the file is removed or repaired")
    assert not v.may_stand(LATER)
    assert v.on_coordinator(0, LATER).startswith("dev2 answers no coordinator: vote file ")
    assert (tmp_path / "dev2.vote").read_bytes() == content  # left for someone to look at


def test_an_unreadable_vote_file_is_no_crash(tmp_path):
    (tmp_path / "dev2.vote").mkdir()  # reading it fails with an OSError
    v = voter(tmp_path, "dev2")
    assert v.broken == (f"vote file {tmp_path / 'dev2.vote'} is unreadable (Is a directory): it votes and "
                        f"answers again once the file is removed or repaired")
    assert not v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER).granted


def test_a_vote_that_cannot_be_written_is_refused_and_the_old_one_kept(tmp_path, monkeypatch):
    v = voter(tmp_path, "dev2")
    assert v.answer(VoteRequest(1, "dev1", (0, 4)), (0, 4), LATER).granted

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quorum.os, "replace", fail)
    answer = v.answer(VoteRequest(2, "dev3", (0, 4)), (0, 4), LATER)
    assert not answer.granted
    assert answer.why == f"dev2 cannot write its vote file {tmp_path / 'dev2.vote'} (No space left on device)"
    assert Vote.load(tmp_path / "dev2.vote") == Vote(1, "dev1") and v.vote == Vote(1, "dev1")


def test_an_election_needs_a_strict_majority_of_the_holders(tmp_path):
    request = VoteRequest(1, "dev0", (0, 4))
    election = Election(request, ["dev0", "dev1", "dev2", "dev3"])
    election.count(VoteAnswer("dev0", 1, True))
    election.count(VoteAnswer("dev1", 1, True))
    election.count(VoteAnswer("dev1", 1, True))  # counted once
    election.count(VoteAnswer("dev9", 1, True))  # no holder
    election.count(VoteAnswer("dev2", 1, True, poll=True))  # an answer to a poll, not to this vote
    election.count(VoteAnswer("dev3", 5, False, "dev3 has voted in term 5 for dev2"))
    assert not election.won and election.highest == 5
    assert election.outcome() == ("dev0's election for term 1: 2 of 4 holders granted (a majority is 3); "
                                  "dev3: dev3 has voted in term 5 for dev2")
    election.count(VoteAnswer("dev2", 1, True))
    assert election.won and election.outcome().endswith(": won, elected by dev0, dev1, dev2")
    with pytest.raises(ValueError, match="dev7 holds no replica"):
        Election(VoteRequest(1, "dev7", (0, 4)), ["dev0"])


def test_two_candidates_in_one_term_split_the_votes_and_neither_wins(tmp_path):
    names = ["dev0", "dev1", "dev2", "dev3"]
    voters = {n: voter(tmp_path, n) for n in names}
    a, b = voters["dev0"].request((0, 4)), voters["dev1"].request((0, 4))
    assert a.term == b.term == 1
    count_a, count_b = Election(a, names), Election(b, names)
    for name, request, count in [("dev0", a, count_a), ("dev2", a, count_a), ("dev1", b, count_b),
                                 ("dev3", b, count_b), ("dev2", b, count_b), ("dev3", a, count_a)]:
        count.count(voters[name].answer(request, (0, 4), LATER))
    assert len(count_a.granted) == len(count_b.granted) == 2 and not count_a.won and not count_b.won
    # the next try is in a newer term, and one of them can win it
    retry = voters["dev0"].request((0, 4), above=count_a.highest)
    assert retry.term == 2
    count = Election(retry, names)
    for name in names:
        count.count(voters[name].answer(retry, (0, 4), LATER))
    assert count.won and count.granted == set(names)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_two_candidates_in_one_term_never_both_win(tmp_path, monkeypatch, n):
    """Every order in which each holder (the candidates too) gets the two requests."""
    monkeypatch.setattr(Vote, "save", lambda self, path: None)  # a voter remembers in memory: no thousands of files
    names = [f"dev{i}" for i in range(n)]
    wins = 0
    for orders in itertools.product(["ab", "ba", "a", "b"], repeat=n):
        voters = {name: voter(tmp_path, name) for name in names}
        requests = {"a": VoteRequest(1, "dev0", (0, 4)), "b": VoteRequest(1, "dev1", (0, 4))}
        counts = {k: Election(r, names) for k, r in requests.items()}
        for name, order in zip(names, orders):
            for k in order:
                counts[k].count(voters[name].answer(requests[k], (0, 4), LATER))
        assert not (counts["a"].won and counts["b"].won), orders
        wins += counts["a"].won or counts["b"].won
    assert wins > 0  # and the check is not empty


def test_the_rule_is_pure():
    """No clock, no transport: quorum.py imports the standard library's files and JSON only."""
    tree = ast.parse(Path(quorum.__file__).read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "collections", "dataclasses", "json", "os", "pathlib"}


# -- a run in virtual time ---------------------------------------------------------------

DELAY_S = 0.02      # one message's way between two devices
BEAT_S = 0.5        # a coordinator pings every device this often
STEP_S = 0.25       # a coordinator commits a step at most this often
LEASE_S = 3.0
ELECTION_S = 4.0    # longer than the lease: a lease runs out before a successor can be elected
STAGGER_S = 0.2     # holder i waits ELECTION_S + i * STAGGER_S, so that candidates seldom collide
ANSWER_S = 0.5      # how long a candidate waits for the answers to a poll or a vote
BACKUP_EVERY = 4    # steps between replicas
PARTITION_AT, HEAL_AT, END_AT = 10.0, 40.0, 70.0


@dataclass
class Coordinator:
    device: str
    term: int
    lease: Lease
    step: int
    elected_at: float
    elected_by: tuple[str, ...] = ()
    stopped: str | None = None  # its one line when it stopped committing
    stopped_at: float | None = None
    fenced: str | None = None  # its one line when it found itself fenced (it then ends)


@dataclass
class Device:
    name: str
    rank: int
    offset: float  # its monotonic clock reads the virtual time plus this: only durations may be compared
    voter: Voter
    version: tuple[int, int] = (0, 0)
    election: Election | None = None
    deadline: float = 0.0
    next_try: float = 0.0
    above: int = 0  # the newest term a refusal named
    lines: list[str] = field(default_factory=list)


class Run:
    """N devices, every one a replica holder, the term-0 coordinator on one of them; messages
    take DELAY_S and are lost when a partition separates their ends as they arrive."""

    def __init__(self, folder: Path, n: int, coordinator: str, election_s: float = ELECTION_S, broken=()):
        self.now, self.queue, self.seq = 0.0, [], itertools.count()
        self.names = [f"dev{i}" for i in range(n)]
        self.election_s = election_s
        self.sides: dict[str, int] | None = None
        self.devices = {}
        for i, name in enumerate(self.names):
            if name in broken:
                (folder / f"{name}.vote").write_text("{cut sho")
            offset = 1000.0 * i + 0.37 * i
            self.devices[name] = Device(name, i, offset, Voter(name, folder / f"{name}.vote", election_s, offset))
        self.coordinators: list[Coordinator] = []
        self.commits: list[tuple[float, int, int]] = []  # (virtual time, term, step)
        self.start_coordinator(coordinator, 0, (0, 0), ())
        for name in self.names:
            self.at(0.1, self.watch, name)

    # the event queue
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), fn, args))

    def run_until(self, t: float) -> None:
        while self.queue and self.queue[0][0] <= t:
            self.now, _, fn, args = heapq.heappop(self.queue)
            fn(*args)
        self.now = t

    def clock(self, name: str) -> float:
        return self.now + self.devices[name].offset

    def partition(self, side: list[str]) -> None:
        self.sides = {name: int(name in side) for name in self.names}

    def heal(self) -> None:
        self.sides = None

    def send(self, src: str, dst: str, handler, *args) -> None:
        def arrive():
            if src == dst or self.sides is None or self.sides[src] == self.sides[dst]:
                handler(*args)
        self.at(self.now + DELAY_S, arrive)

    # the coordinator
    def start_coordinator(self, name: str, term: int, version: tuple[int, int], elected_by) -> Coordinator:
        c = Coordinator(name, term, Lease(self.names, name, term, LEASE_S, self.clock(name)), version[1], self.now,
                        tuple(elected_by))
        self.coordinators.append(c)
        self.beat(c)
        self.at(self.now + STEP_S, self.tick, c)
        return c

    def beat(self, c: Coordinator) -> None:
        if c.fenced:
            return
        sent_at = self.clock(c.device)
        for name in self.names:
            self.send(c.device, name, self.on_ping, name, c, sent_at)
        self.at(self.now + BEAT_S, self.beat, c)

    def tick(self, c: Coordinator) -> None:
        if c.stopped:
            return
        now = self.clock(c.device)
        if c.lease.must_stop(now):
            c.stopped, c.stopped_at = c.lease.why(now, c.step), self.now
            return
        if c.lease.may_commit(now):
            c.step += 1
            self.commits.append((self.now, c.term, c.step))
            if c.step % BACKUP_EVERY == 0:
                for name in self.names:
                    self.send(c.device, name, self.on_replica, name, (c.term, c.step))
        self.at(self.now + STEP_S, self.tick, c)

    def on_pong(self, c: Coordinator, device: str, sent_at: float) -> None:
        c.lease.heard_from(device, sent_at)

    def on_refused(self, c: Coordinator, term: int, why: str) -> None:
        c.lease.refused(term, why)
        if c.lease.fenced and not c.fenced:
            c.fenced = c.lease.fenced
            if not c.stopped:
                c.stopped, c.stopped_at = c.lease.why(self.clock(c.device), c.step), self.now

    # the replica holders
    def on_ping(self, name: str, c: Coordinator, sent_at: float) -> None:
        d = self.devices[name]
        why = d.voter.on_coordinator(c.term, self.clock(name), committing=not c.stopped, elected_by=c.elected_by)
        if why is None:
            if not c.stopped:
                d.election = None  # a coordinator is at work: no need for a new one
            self.send(name, c.device, self.on_pong, c, name, sent_at)
        else:
            self.send(name, c.device, self.on_refused, c, d.voter.term, why)

    def on_replica(self, name: str, version: tuple[int, int]) -> None:
        d = self.devices[name]
        if d.voter.fence.refuse(version[0]) is None and version > d.version:
            d.version = version

    def watch(self, name: str) -> None:
        d = self.devices[name]
        now = self.clock(name)
        if d.election is not None and self.now >= d.deadline:
            d.lines.append(d.election.outcome())
            d.above = max(d.above, d.election.highest)
            d.election, d.next_try = None, self.now + self.election_s
        if d.election is None and self.now >= d.next_try and d.voter.may_stand(now) \
                and now - d.voter.heard_at >= self.election_s + d.rank * STAGGER_S:
            self.ask(d, d.voter.request(d.version, poll=True, above=d.above))
        self.at(self.now + 0.1, self.watch, name)

    def ask(self, d: Device, request: VoteRequest) -> None:
        d.election, d.deadline = Election(request, self.names), self.now + ANSWER_S
        for name in self.names:
            self.send(d.name, name, self.on_request, name, d.name, request)

    def on_request(self, name: str, candidate: str, request: VoteRequest) -> None:
        d = self.devices[name]
        answer = d.voter.answer(request, d.version, self.clock(name))
        self.send(name, candidate, self.on_answer, candidate, request, answer)

    def on_answer(self, name: str, request: VoteRequest, answer: VoteAnswer) -> None:
        d = self.devices[name]
        if d.election is None or d.election.request != request:
            return  # a late answer to a try given up
        d.election.count(answer)
        if not d.election.won:
            return
        d.lines.append(d.election.outcome())
        if request.poll:
            self.ask(d, d.voter.request(d.version, above=d.above))
        else:
            granted, d.election = d.election.granted, None
            self.start_coordinator(name, request.term, d.version, sorted(granted))

    # what happened
    def active(self, t0: float, t1: float) -> set[int]:
        """The terms that committed a step in (t0, t1]."""
        return {term for t, term, _ in self.commits if t0 < t <= t1}


def overlap(commits) -> tuple | None:
    """Two coordinators at work at once: a commit of an older term after (or at the instant of)
    a newer term's first."""
    newest, since = -1, None
    for t, term, step in sorted(commits, key=lambda c: (c[0], -c[1])):
        if term > newest:
            newest, since = term, t
        elif term < newest:
            return (t, term, step, newest, since)
    return None


def test_the_overlap_check_can_fail():
    assert overlap([(1.0, 0, 1), (2.0, 1, 1), (3.0, 1, 2)]) is None
    assert overlap([(1.0, 0, 1), (2.0, 1, 1), (2.5, 0, 2)]) == (2.5, 0, 2, 1, 2.0)
    assert overlap([(2.0, 0, 2), (2.0, 1, 1)]) is not None  # at the same instant


def splits(n: int):
    """Every split of n devices into two non-empty groups, with the coordinator in either."""
    names = [f"dev{i}" for i in range(n)]
    for size in range(1, n):
        for group in itertools.combinations(names, size):
            rest = [x for x in names if x not in group]
            if group < tuple(rest):  # each unordered split once
                for side in (list(group), rest):
                    yield pytest.param(n, list(group), rest, side[0],
                                       id=f"{','.join(group)}|{','.join(rest)}-by-{side[0]}")


SPLITS = [p for n in (3, 4, 5) for p in splits(n)]
FENCED = re.compile(r"^coordinator of term 0 fenced: (term \d+ has begun \(elected by dev\d(, dev\d)*\)|"
                    r"dev\d has voted in term \d+)$")


def test_every_split_is_here():
    assert len(SPLITS) == sum(2 * (2 ** (n - 1) - 1) for n in (3, 4, 5)) == 50


@pytest.mark.parametrize("n, a, b, coordinator", SPLITS)
def test_a_partition_never_leaves_two_coordinators_at_work(tmp_path, n, a, b, coordinator):
    run = Run(tmp_path, n, coordinator)
    old = run.coordinators[0]
    ours, theirs = (a, b) if coordinator in a else (b, a)
    run.at(PARTITION_AT, run.partition, ours)
    run.at(HEAL_AT, run.heal)
    run.run_until(HEAL_AT)
    assert run.active(PARTITION_AT - 1, PARTITION_AT) == {0}  # at work before the cut
    settled = PARTITION_AT + LEASE_S + STEP_S  # the old lease has run out, if it was going to
    successors = [c for c in run.coordinators[1:] if c.elected_at < HEAL_AT]
    if len(ours) >= majority(n):  # the old coordinator's side is a majority: it goes on, alone
        assert run.active(settled, HEAL_AT) == {0} and not old.stopped and not successors
    else:
        assert old.stopped == (f"heard from {len(ours)} of {n} devices (a majority is {majority(n)}) in the last "
                               f"3.0 s: stopping with the checkpoint of step {old.step}")
        assert max(t for t, term, _ in run.commits if term == 0) <= old.stopped_at <= settled
        if len(theirs) >= majority(n):  # the other side elects one successor among itself
            assert len(successors) == 1 and successors[0].device in theirs
            assert set(successors[0].elected_by) <= set(theirs) and len(successors[0].elected_by) >= majority(n)
            assert run.active(settled, HEAL_AT) == {successors[0].term}
        else:  # an even split: nobody may commit
            assert not successors and run.active(settled, HEAL_AT) == set()
    assert overlap(run.commits) is None

    run.run_until(END_AT)  # healed
    assert overlap(run.commits) is None
    at_work = [c for c in run.coordinators if not c.stopped]
    assert len(at_work) == 1 and run.active(END_AT - 10, END_AT) == {at_work[0].term}
    assert all(d.voter.fence.term == at_work[0].term for d in run.devices.values())  # every device follows it
    if len(ours) >= majority(n):
        assert at_work[0] is old and len(run.coordinators) == 1  # the minority rejoined: no new term
    else:
        assert FENCED.match(old.fenced), old.fenced
        assert all(c.fenced for c in run.coordinators if c is not at_work[0])
    assert run.commits[-1][2] > 2 * (END_AT - HEAL_AT)  # the run went on


@pytest.mark.parametrize("n", [3, 4, 5])
def test_the_old_lease_runs_out_before_a_successor_can_be_elected(tmp_path, n):
    """The coordinator cut off alone: its last commit, its stop, the successor's election and
    first commit come in that order, because the election timeout is longer than the lease."""
    assert ELECTION_S > LEASE_S
    run = Run(tmp_path, n, "dev0")
    run.at(PARTITION_AT, run.partition, ["dev0"])
    run.run_until(HEAL_AT)
    old, new = run.coordinators
    # the last ping of the old coordinator that the other side answered, in virtual time
    last_ping = max(old.lease.heard[name] for name in run.names[1:]) - run.devices["dev0"].offset
    assert PARTITION_AT - BEAT_S <= last_ping <= PARTITION_AT
    last_old = max(t for t, term, _ in run.commits if term == 0)
    first_new = min(t for t, term, _ in run.commits if term == new.term)
    assert last_old < last_ping + LEASE_S <= old.stopped_at < last_ping + ELECTION_S <= new.elected_at < first_new


def test_an_election_timeout_shorter_than_the_lease_would_let_two_coordinators_commit(tmp_path):
    """The ordering above is what keeps them apart: with the election timeout shorter than the
    lease, the successor commits while the old coordinator's lease still holds."""
    run = Run(tmp_path, 5, "dev0", election_s=2.0)
    run.at(PARTITION_AT, run.partition, ["dev0"])
    run.run_until(HEAL_AT)
    assert overlap(run.commits) is not None


def test_a_run_goes_on_past_a_holder_whose_vote_file_is_corrupt(tmp_path):
    run = Run(tmp_path, 5, "dev0", broken={"dev4"})
    run.at(PARTITION_AT, run.partition, ["dev0"])
    run.at(HEAL_AT, run.heal)
    run.run_until(END_AT)
    assert overlap(run.commits) is None
    new = run.coordinators[-1]
    assert run.devices["dev4"].voter.broken.startswith(f"vote file {tmp_path / 'dev4.vote'} is not JSON: ")
    assert new.term == 1 and not new.stopped and new.elected_by == ("dev1", "dev2", "dev3")
    assert run.active(END_AT - 10, END_AT) == {1}
