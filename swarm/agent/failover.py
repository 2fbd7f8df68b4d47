"""Coordinator fail-over: what the coordinator of a detached run replicates to the agents of
its plan, the rule by which they elect its successor, and the epochs that fence it.

    coordinator ──JobReplica (at each epoch's start and each complete backup)──> agents of the plan
        ✕ its device stops answering
    agents holding a replica ──ReplicaQuery/ReplicaState──> each other: who answers, whose is newest
    elected agent: starts `swarm train --take-over REPLICA` (same run id), which rolls back to the
        replica's complete backup, re-plans over the survivors, and assigns the job at the first
        epoch of the next term

Terms. The coordinators of one run follow each other in terms 0, 1, 2, ...; the job epoch is
term * TERM_EPOCHS + (re-plans within the term). Agents refuse messages and assignments of an
epoch older than the one they hold, so once the successor's first epoch has reached an agent,
nothing of an older coordinator — one cut off that comes back — is taken there: it is fenced,
and with every device of its plan gone it gives up.

Election. Among the replica holders that answer (the survivors), those holding the newest
replica (highest term, then highest backup step) are candidates, and the one with the lowest
node id is the successor. Every holder applies the rule to what it heard; a holder that did
not answer is not a survivor.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

TERM_EPOCHS = 1 << 20  # epochs one coordinator may start (re-plans) before its term's range is used up


def term_of(epoch: int) -> int:
    return epoch // TERM_EPOCHS


def first_epoch(term: int) -> int:
    return term * TERM_EPOCHS


@dataclass
class Replica:
    """What a successor needs to carry a run on without its coordinator's memory."""
    run_id: str                 # the detached run's id (`swarm jobs`), the same on every coordinator
    job_id: str                 # the job the agents hold (their backups are kept under it)
    term: int
    epoch: int                  # the epoch under way when this was sent
    step: int                   # the step of the newest complete backup (the roll-back point); 0: none yet
    holdings: dict[str, list[int]]  # device name -> layers it holds at `step`
    plan: dict                  # the plan of the epoch under way (Plan.to_dict)
    devices: dict[str, dict]    # device name -> {"node_id", "address", "incarnation"} of every device of the run
    flags: list[str]            # the run's `swarm train` flags
    coordinator: str            # node id of the agent whose device ran the coordinator
    holders: list[str] = field(default_factory=list)  # node ids of the agents sent this replica
    # set by the holder that won the election for a successor (swarm/agent/quorum.py): the
    # successor's term and the holders that granted it (-1, []: the next term, elected by nobody)
    elected_term: int = -1
    elected_by: list[str] = field(default_factory=list)
    finished: bool = False      # the run ended (done, or stopped by its user): nobody carries it on

    @property
    def version(self) -> tuple[int, int]:
        """Newer replicas compare greater."""
        return self.term, self.step

    @property
    def next_term(self) -> int:
        """The term of the coordinator that carries the run on from this replica."""
        return self.elected_term if self.elected_term > self.term else self.term + 1

    def to_body(self) -> dict:
        return asdict(self)

    @classmethod
    def from_body(cls, body: dict) -> "Replica":
        """ValueError if `body` is not a replica (it came over the wire)."""
        try:
            replica = cls(**body)
        except TypeError as exc:
            raise ValueError(f"not a replica: {exc}") from None
        checks = [(replica.run_id, str), (replica.job_id, str), (replica.term, int), (replica.epoch, int),
                  (replica.step, int), (replica.holdings, dict), (replica.plan, dict), (replica.devices, dict),
                  (replica.flags, list), (replica.coordinator, str), (replica.holders, list),
                  (replica.elected_term, int), (replica.elected_by, list)]
        if not all(isinstance(value, kind) and not isinstance(value, bool) for value, kind in checks):
            raise ValueError("a replica field has the wrong type")
        if replica.term < 0 or replica.step < 0 or term_of(replica.epoch) != replica.term:
            raise ValueError(f"epoch {replica.epoch} is not of term {replica.term}")
        if not all(isinstance(d, dict) and isinstance(d.get("node_id"), str) and isinstance(d.get("address"), str)
                   for d in replica.devices.values()):
            raise ValueError("a replica's devices need a node id and an address each")
        if not all(isinstance(f, str) for f in replica.flags + replica.holders + replica.elected_by):
            raise ValueError("a replica's flags and holders are strings")
        if not isinstance(replica.finished, bool):
            raise ValueError("a replica's finished is true or false")
        return replica


def elect(versions: dict[str, tuple[int, int]]) -> str | None:
    """The successor among the holders that answered, {node id: replica version}: the lowest
    node id of those holding the newest replica (None if nobody answered)."""
    if not versions:
        return None
    newest = max(versions.values())
    return min(node for node, version in versions.items() if version == newest)
