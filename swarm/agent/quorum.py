"""Quorum: the majority rule that keeps a detached run to one coordinator at a time (the
coordinator's lease, the replica holders' votes with terms, and the fence), as pure,
transport-free pieces: times are passed in, never read, and nothing here sends a byte.

Raft's majority and terms are the model, reduced to this use (no log to replicate: the
replica of swarm/agent/failover.py is the state, and its version the "log" a voter compares):

    coordinator (term T)                                replica holders
      every beat: Ping(seq, term T) ──────────────────>  Voter.on_coordinator(T, now): None -> Pong(seq)
      Lease.heard_from(device, sent_at of that seq) <──                        a reason -> refused
      before each commit: Lease.may_commit(now)?         (a holder that answers a committing
        no, and Lease.must_stop(now): stop, checkpoint,   coordinator will not vote for
        Lease.why(now, step) as its one line              `election_s` after)
      refused with a higher term: Lease.refused(term, why) -> fenced, stops for good

    coordinator silent for election_s (Voter.may_stand) and `elect` (failover.py) picks this holder:
      poll   Voter.request(version, poll=True)   ──> every holder: Voter.answer(request, version, now)
             Election(request, holders).count(answer) ... won?    (a poll records nothing)
      vote   Voter.request(version)               ──> every holder: Voter.answer records (term, candidate)
             Election(...).won: the new coordinator   in its vote file before it answers
             of the request's term, elected by Election.granted; its Lease starts empty

The safety argument, which the tests check over every split of 3, 4 and 5 devices:
- One winner a term. A holder grants at most one candidate a term, and writes that down
  before answering (`Vote`, a JSON file replaced atomically); a winner needs grants from a
  majority of the holders, and two majorities of one set share a holder.
- Never two coordinators at once. The coordinator counts a device only for `lease_s` after it
  *sent* the ping that device answered (so a slow answer cannot stretch the lease); a holder
  that answered a committing coordinator grants no vote for `election_s` > `lease_s` after,
  and after it voted in a newer term refuses that coordinator. Every lease majority shares a
  device with every election majority (`check_quorums`), so by the time a successor is
  elected, the old coordinator's lease has run out: it committed its last step before.
  Clocks are each party's own monotonic clock; only durations are compared, so they may
  differ by any offset but must run at (nearly) the same rate.
- No disruption. A candidate first polls (Raft's pre-vote): it raises no term anywhere
  unless a majority would vote for it, so the holders cut off with a minority never push the
  term up, and when the partition heals they rejoin the coordinator that kept its majority.

Where each piece is called from (docs/runtime.md, "How it is wired"):
- `Lease`: the coordinator of a detached run (swarm/execution/launch.py `_take_lease` asks
  the term's devices with LeaseAsk and feeds `heard_from` and `refused` from LeaseAnswer;
  swarm/execution/coordinator.py `_may_commit` before each commit, `_watch_lease` to stop).
  The term's devices are fixed when it starts; every one but the coordinator's holds a
  replica, so `check_quorums` holds by construction.
- `Voter`: one per job whose replica an agent holds (swarm/agent/agent.py `_voter`), its vote
  file in the agent's state directory; `on_coordinator` for each LeaseAsk and assignment,
  `may_stand` and `answer` in the election (VoteAsk/VoteReply).
- `Election`: the candidate's count in `Agent._stand`; the run is taken over only when won.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The rule's durations in a run: a coordinator asks its devices every LEASE_ASK_S (LeaseAsk,
# swarm/wire/messages.py) and holds its lease for LEASE_S after an ask that a majority
# answered; a holder votes no sooner than ELECTION_TIMEOUT_S after it last answered one.
# ELECTION_TIMEOUT_S > LEASE_S keeps two coordinators apart (below); LEASE_S leaves a busy
# device on a 0.1-core quota several asks to answer in.
LEASE_ASK_S, LEASE_S, ELECTION_TIMEOUT_S = 1.0, 6.0, 8.0


def majority(n: int) -> int:
    """The fewest of `n` that are more than half of them."""
    return n // 2 + 1


def check_quorums(devices: Iterable[str], holders: Iterable[str]) -> None:
    """ValueError, in one line, unless every majority of `devices` (a coordinator's lease)
    shares a device with every majority of `holders` (an election): the holders must be
    devices of the run, and enough of them."""
    devices, holders = set(devices), set(holders)
    if not holders <= devices:
        raise ValueError(f"replica holders {', '.join(sorted(holders - devices))} are not devices of the run")
    if majority(len(devices)) + majority(len(holders)) <= len(devices):
        raise ValueError(f"{len(holders)} replica holders of {len(devices)} devices: a majority of the holders "
                         f"({majority(len(holders))}) and a majority of the devices ({majority(len(devices))}) "
                         f"could miss each other; every device but the coordinator's must hold a replica")


def _named(names: Iterable[str]) -> str:
    names = sorted(names)
    return f" (elected by {', '.join(names)})" if names else ""


class Fence:
    """The newest term a party knows to have begun, and who elected it: anything of an older
    term is refused. Term 0 is the run's first coordinator, elected by nobody. Kept in memory:
    the voters of a term keep it in their vote files, and any majority holds one of them."""

    def __init__(self, term: int = 0, elected_by: Iterable[str] = ()):
        self.term = term
        self.elected_by = tuple(sorted(elected_by))

    def see(self, term: int, elected_by: Iterable[str] = ()) -> None:
        """A coordinator of `term` was heard from (its messages say who elected it)."""
        if term > self.term or (term == self.term and not self.elected_by):
            self.term, self.elected_by = term, tuple(sorted(elected_by))

    def refuse(self, term: int) -> str | None:
        """Why a coordinator of `term` is refused, in one line, or None if it is not."""
        if term >= self.term:
            return None
        return f"coordinator of term {term} fenced: term {self.term} has begun{_named(self.elected_by)}"


class Lease:
    """A coordinator's right to commit steps: it holds while a strict majority of the run's
    devices (its own always counted) answered a ping it sent less than `lease_s` ago, and is
    lost for good once a device refuses it for a newer term. Times are the coordinator's own
    monotonic clock."""

    def __init__(self, devices: Iterable[str], own: str, term: int, lease_s: float, began: float):
        self.devices = tuple(sorted(set(devices)))
        if own not in self.devices:
            raise ValueError(f"the coordinator's device {own} is not a device of the run")
        self.own, self.term, self.lease_s, self.began = own, term, lease_s, began
        self.heard: dict[str, float] = {}  # device -> when the newest ping it answered was sent
        self.fenced: str | None = None  # the one line of the refusal that ended this term

    def heard_from(self, device: str, sent_at: float) -> None:
        """`device` answered a ping this coordinator sent at `sent_at` (not when the answer
        came: a late answer must not stretch the lease)."""
        if device in self.devices and sent_at > self.heard.get(device, float("-inf")):
            self.heard[device] = sent_at

    def refused(self, term: int, why: str) -> None:
        """A device refused this coordinator, knowing of `term`: above this one's, it is fenced."""
        if term > self.term and self.fenced is None:
            self.fenced = why

    def heard_within(self, now: float) -> list[str]:
        """The devices that count now: its own, and those that answered a recent enough ping."""
        return sorted({self.own} | {d for d, sent in self.heard.items() if now - sent < self.lease_s})

    def may_commit(self, now: float) -> bool:
        return self.fenced is None and len(self.heard_within(now)) >= majority(len(self.devices))

    def must_stop(self, now: float) -> bool:
        """Fenced, or without a majority although it has had a whole lease to gather one."""
        return self.fenced is not None or (not self.may_commit(now) and now - self.began >= self.lease_s)

    def why(self, now: float, step: int) -> str:
        """Why it may not commit, in one line; `step` is the last step it committed."""
        if self.fenced is not None:
            return f"{self.fenced}; stopping with the checkpoint of step {step}"
        heard = len(self.heard_within(now))
        return (f"heard from {heard} of {len(self.devices)} devices (a majority is {majority(len(self.devices))}) "
                f"in the last {self.lease_s:.1f} s: stopping with the checkpoint of step {step}")


class VoteFileError(ValueError):
    """A vote file that exists but cannot be read as one."""


def write_json(path: Path, body) -> None:
    """Write `body` as JSON atomically: a temporary file beside `path`, synced, then renamed
    over it (and the folder synced, on file systems that need it for the rename)."""
    path = Path(path)
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


@dataclass
class Vote:
    """What a replica holder has promised, kept in a small JSON file: the newest term it voted
    in, and for whom (None: it has seen the term but voted in it for nobody)."""
    term: int = 0
    voted_for: str | None = None

    @classmethod
    def load(cls, path: Path) -> "Vote":
        """The vote kept at `path`; no file: no vote yet. VoteFileError (one line) if unreadable."""
        try:
            body = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise VoteFileError(f"vote file {path} is unreadable ({exc.strerror or type(exc).__name__})") from None
        except ValueError:  # UnicodeDecodeError too
            raise VoteFileError(f"vote file {path} is not JSON") from None
        if not (isinstance(body, dict) and set(body) == {"term", "voted_for"}
                and isinstance(body["term"], int) and not isinstance(body["term"], bool) and body["term"] >= 0
                and (body["voted_for"] is None or isinstance(body["voted_for"], str))):
            raise VoteFileError(f"vote file {path} does not hold a vote")
        return cls(body["term"], body["voted_for"])

    def save(self, path: Path) -> None:
        write_json(path, {"term": self.term, "voted_for": self.voted_for})


@dataclass(frozen=True)
class VoteRequest:
    """A candidate asks to coordinate the run in `term`; a poll (pre-vote) asks only whether
    the holder would grant it, and changes nothing there."""
    term: int
    candidate: str
    version: tuple[int, int]  # its replica's (term, backup step): Replica.version
    poll: bool = False


@dataclass(frozen=True)
class VoteAnswer:
    holder: str
    term: int  # the request's when granted; else the newest term the holder knows of
    granted: bool
    why: str = ""  # one line when refused
    poll: bool = False


class Voter:
    """One replica holder's part in elections: its vote file, its fence, and when it last
    answered a committing coordinator. Times are the holder's own monotonic clock; `now` at
    construction counts as hearing the coordinator, so that a holder that restarts waits a
    whole `election_s` before it votes, as it promised before it went down."""

    def __init__(self, node: str, path: Path | None, election_s: float, now: float):
        self.node, self.path, self.election_s = node, Path(path) if path is not None else None, election_s
        self.fence = Fence()
        self.heard_at = now
        self.vote: Vote | None = Vote()  # (no file: an agent without a state directory keeps it in memory)
        self.broken: str | None = None  # why it may not vote (its vote file), one line
        if self.path is not None:
            try:
                self.vote = Vote.load(self.path)
            except VoteFileError as exc:
                self.vote, self.broken = None, f"{exc}: it votes and answers again once the file is removed or repaired"

    @property
    def term(self) -> int:
        """The newest term it knows of: begun, or voted in."""
        return max(self.fence.term, self.vote.term if self.vote else 0)

    def on_coordinator(self, term: int, now: float, committing: bool = True,
                       elected_by: Iterable[str] = ()) -> str | None:
        """A message from a coordinator of `term` (`elected_by` as it says): None to take and
        answer it, or why it is refused, in one line. One that is not stopped (`committing`)
        holds this holder's vote back for `election_s`."""
        why = self.fence.refuse(term)
        if why is None and self.broken is not None:
            why = f"{self.node} answers no coordinator: {self.broken}"
        if why is None and term < self.vote.term:
            why = f"coordinator of term {term} fenced: {self.node} has voted in term {self.vote.term}"
        if why is not None:
            return why
        self.fence.see(term, elected_by)
        if committing:
            self.heard_at = max(self.heard_at, now)
        return None

    def may_stand(self, now: float) -> bool:
        """Whether it may stand for election: its coordinator has been quiet for `election_s`."""
        return self.broken is None and now - self.heard_at >= self.election_s

    def request(self, version: tuple[int, int], poll: bool = False, above: int = 0) -> VoteRequest:
        """Its request to coordinate in the next term (above any term a refusal named); it
        sends it to every holder, itself included, and counts the answers with an Election."""
        return VoteRequest(max(self.term, above) + 1, self.node, tuple(version), poll)

    def answer(self, request: VoteRequest, version: tuple[int, int], now: float) -> VoteAnswer:
        """Grant or refuse `request`, this holder's replica being of `version`. A grant (not a
        poll) is in the vote file before the answer is returned; if it cannot be written, the
        vote is refused."""
        why = self._refusal(request, tuple(version), now)
        if why is None and not request.poll:
            try:
                if self.path is not None:
                    Vote(request.term, request.candidate).save(self.path)
            except OSError as exc:
                why = f"{self.node} cannot write its vote file {self.path} ({exc.strerror or exc})"
            else:
                self.vote = Vote(request.term, request.candidate)
        if why is not None:
            return VoteAnswer(self.node, self.term, False, why, request.poll)
        return VoteAnswer(self.node, request.term, True, "", request.poll)

    def _refusal(self, request: VoteRequest, version: tuple[int, int], now: float) -> str | None:
        if self.broken is not None:
            return f"{self.node} refuses to vote: {self.broken}"
        if request.term <= self.fence.term:
            return f"term {request.term} is too old: term {self.fence.term} has begun{_named(self.fence.elected_by)}"
        voted = self.vote
        if request.term < voted.term or (request.term == voted.term and voted.voted_for not in (None, request.candidate)):
            return f"{self.node} has voted in term {voted.term} for {voted.voted_for}"
        if request.version < version:
            return (f"{request.candidate}'s replica (term {request.version[0]}, step {request.version[1]}) is older "
                    f"than {self.node}'s (term {version[0]}, step {version[1]})")
        if request.candidate != self.node and now - self.heard_at < self.election_s:
            return (f"{self.node} heard its coordinator {now - self.heard_at:.1f} s ago, less than the "
                    f"{self.election_s:.1f} s election timeout")
        return None


class Election:
    """A candidate's count of the answers to one request (poll or vote), over the holders its
    replica lists (itself among them): won with grants from a strict majority of them."""

    def __init__(self, request: VoteRequest, holders: Iterable[str]):
        self.request = request
        self.holders = frozenset(holders)
        if request.candidate not in self.holders:
            raise ValueError(f"candidate {request.candidate} holds no replica of the run")
        self.granted: set[str] = set()
        self.refused: dict[str, str] = {}  # holder -> its one-line reason
        self.highest = 0  # the newest term a refusal named (a later request goes above it)

    def count(self, answer: VoteAnswer) -> None:
        """Take one answer; answers to another request, or from no holder, are ignored."""
        if answer.holder not in self.holders or answer.poll != self.request.poll:
            return
        if answer.granted and answer.term == self.request.term:
            self.refused.pop(answer.holder, None)
            self.granted.add(answer.holder)
        elif not answer.granted and answer.holder not in self.granted:
            self.refused[answer.holder] = answer.why
            self.highest = max(self.highest, answer.term)

    @property
    def won(self) -> bool:
        return len(self.granted) >= majority(len(self.holders))

    def outcome(self) -> str:
        """What came of it, in one line."""
        what = "poll" if self.request.poll else "election"
        head = (f"{self.request.candidate}'s {what} for term {self.request.term}: {len(self.granted)} of "
                f"{len(self.holders)} holders granted (a majority is {majority(len(self.holders))})")
        if self.won:
            return f"{head}: won, elected by {', '.join(sorted(self.granted))}"
        return head + "".join(f"; {h}: {why}" for h, why in sorted(self.refused.items()))
