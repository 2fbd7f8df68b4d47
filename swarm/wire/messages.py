"""Every message of the swarm protocol, its code, and the protocol version.

A message travels as the msgpack array ``[code, field1, field2, ...]`` (fields in the
order declared below); numpy arrays may appear in any field and travel as raw bytes
after the body (see frames.py). Received messages are checked against the declared
field types before anyone sees them.

Codes:
    1-9     handshake (fixed forever: Hello must stay readable by every version)
    10-19   liveness and device information
    20-29   job lifecycle, between a coordinator and an agent; a coordinator's replica,
            and the agents' election of its successor (swarm/agent/failover.py)
    30-39   job data, between the participants of a job (coordinator and agents);
            delivered to the job's per-channel queues after the epoch check
    40-49   detached training runs, between a user's command and the agent coordinating
            one (each request carries a seq that its answer repeats)

To add a message: pick a free code in its range, declare a class here with @message,
and bump PROTOCOL_VERSION if older peers would misread the conversation. A job-data
message (job_data=True) starts with the fields ``job_id: str`` and ``epoch: int``; its
channel is its ``channel`` field if it has one, else its class name.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import numpy as np

from swarm.wire.faults import RemoteProtocolError

PROTOCOL_VERSION = 7  # 2: the server proves itself second; sealed records after the handshake; 3: detached runs;
                      # 4: Info's accelerator memory; 5: coordinator replicas and elections; 6: leases and votes;
                      # 7: Info's incarnation
MAGIC = "swarm"

MESSAGES: dict[int, type] = {}  # code -> message class

# The annotation of a tensor field: a numpy array, sent as raw bytes after the body.
Tensor = np.ndarray


def message(code: int, *, job_data: bool = False):
    """Class decorator: make a message type (a dataclass) with this wire code."""

    def register(cls):
        if code in MESSAGES:
            raise ValueError(f"message code {code} is used by both {MESSAGES[code].__name__} and {cls.__name__}")
        cls = dataclasses.dataclass(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if job_data and names[:2] != ["job_id", "epoch"]:
            raise ValueError(f"job-data message {cls.__name__} must start with the fields job_id and epoch")
        cls.CODE = code
        cls.JOB_DATA = job_data
        cls.FIELDS = tuple(names)
        MESSAGES[code] = cls
        return cls

    return register


# -- handshake ------------------------------------------------------------------------

@message(1)
class Hello:
    """First frame each side sends: who speaks which protocol, and a fresh challenge."""
    magic: str
    version: int
    node_id: str
    nonce: bytes


@message(2)
class Auth:
    """The answer to the peer's challenge: an HMAC of both nonces under the cluster token."""
    proof: bytes


@message(3)
class Goodbye:
    """Sent before closing a connection, saying why (refusal, shutdown, protocol error)."""
    reason: str


# -- liveness and device information --------------------------------------------------

@message(10)
class Ping:
    """A probe: the receiver answers Pong with the same seq at once. Seq 0 is a beat (a
    coordinator's sign of life to a quiet agent) and gets no answer: the agent's own
    heartbeats say it is alive."""
    seq: int


@message(11)
class Pong:
    """The answer to Ping."""
    seq: int


@message(12)
class InfoRequest:
    """Ask an agent to describe itself (answered with Info)."""


@message(13)
class Info:
    """What an agent offers, and what it is doing."""
    node_id: str
    name: str
    cores: int
    memory: int               # bytes: the device's (physical, or its cgroup's limit)
    spare: int                # bytes it can spare for a plan as it answers: available, plus the agent's own,
                              # less what `swarm join --reserve` keeps back (swarm/host/resources.py)
    accelerator: str          # "cpu", "cuda", ...: what it offers to compute on
    accelerator_memory: int   # bytes of the accelerator's own memory; 0: none (a CPU, or shared as on a Jetson); -1: not known
    version: str              # swarm release
    port: int
    peers: list[str]          # static peers it was told about ("host:port"), shared with coordinators
    job_id: str | None
    job_state: str | None
    incarnation: str          # new at each start of the agent: a device killed and started again holds
                              # none of what it held before (a successor must not count its old layers)


@message(14)
class Watch:
    """Ask an agent for a Heartbeat every `interval` seconds on this connection (0 stops)."""
    interval: float


@message(15)
class Heartbeat:
    """Proof of life, sent to watchers and, while in a job, to the job's coordinator."""
    seq: int
    job_id: str | None
    epoch: int | None
    job_state: str | None
    progress: dict


@message(16)
class LeaseAsk:
    """Coordinator of a replicated run -> a device of it: do you still follow me, the
    coordinator of `term` (elected by `elected_by`)? Answered with LeaseAnswer; the lease
    counts the answer from when this was sent (swarm/agent/quorum.py)."""
    seq: int
    job_id: str
    term: int
    elected_by: list[str]


@message(17)
class LeaseAnswer:
    """The answer to LeaseAsk: granted, or refused (`why`, one line) by a device that knows
    of term `term`."""
    seq: int
    job_id: str
    granted: bool
    term: int
    why: str


# -- job lifecycle --------------------------------------------------------------------

@message(20)
class JobAssign:
    """Coordinator -> agent: take part in job `job_id` at `epoch`, running job kind `kind`.
    Assigning a higher epoch of the job an agent holds stops its run and re-assigns it."""
    job_id: str
    epoch: int
    kind: str
    spec: dict
    heartbeat_interval: float


@message(21)
class JobStart:
    """Coordinator -> agent: start running the assigned job."""
    job_id: str
    epoch: int


@message(22)
class JobStop:
    """Coordinator -> agent: cancel the run; the agent stays assigned."""
    job_id: str
    epoch: int
    reason: str


@message(23)
class JobRelease:
    """Coordinator -> agent: the agent leaves the job and is free again."""
    job_id: str
    epoch: int


@message(24)
class JobState:
    """Agent -> coordinator: the job's state after each lifecycle message, and when a run
    ends. state: assigned, running, done, failed, stopped, released or refused."""
    job_id: str
    epoch: int
    state: str
    detail: str
    result: dict | None


@message(25)
class JobReplica:
    """Coordinator -> agent: the coordinator's state for a successor (swarm/agent/failover.py
    Replica), at `term` and backup `step`; an agent keeps the newest of each job."""
    job_id: str
    term: int
    step: int
    body: dict


@message(26)
class ReplicaQuery:
    """Agent -> agent, when a job's coordinator is gone: which replica of `job_id` do you hold?"""
    seq: int
    job_id: str


@message(27)
class ReplicaState:
    """The answer to ReplicaQuery: the replica's term and step (-1, -1: none held)."""
    seq: int
    job_id: str
    term: int
    step: int


@message(28)
class VoteAsk:
    """Agent -> replica holder: grant `candidate` the run of job `job_id` in `term` (its replica
    is at `replica_term`, `replica_step`); a poll asks only whether it would, and changes
    nothing (swarm/agent/quorum.py)."""
    seq: int
    job_id: str
    term: int
    candidate: str
    replica_term: int
    replica_step: int
    poll: bool


@message(29)
class VoteReply:
    """The answer to VoteAsk from `holder`: granted for `term`, or refused (`why`, one line),
    `term` then being the newest it knows of."""
    seq: int
    job_id: str
    holder: str
    term: int
    granted: bool
    why: str
    poll: bool


# -- job data -------------------------------------------------------------------------

@message(30, job_data=True)
class JobData:
    """Anything a job's participants send each other on a named channel; `body` is any
    msgpack value and may hold numpy arrays (sent as raw bytes)."""
    job_id: str
    epoch: int
    channel: str
    body: Any


# -- detached training runs ------------------------------------------------------------

@message(40)
class DetachSubmit:
    """Client -> agent: coordinate a training run of `swarm train` flags `args` (answered
    with DetachAnswer listing the new run, or saying why not)."""
    seq: int
    args: list[str]


@message(41)
class DetachList:
    """Client -> agent: the runs this agent coordinates or coordinated (DetachAnswer)."""
    seq: int


@message(42)
class DetachStop:
    """Client -> agent: end run `job_id` after its step under way, with a checkpoint."""
    seq: int
    job_id: str


@message(43)
class DetachAnswer:
    """Agent -> client: `error` (empty if none) and the runs concerned, one dict each (id,
    model, step, steps, samples_per_s, devices, state, node, detail)."""
    seq: int
    error: str
    jobs: list[dict]


@message(44)
class DetachRead:
    """Client -> agent: the bytes of run `job_id`'s log (what="log") or latest checkpoint
    (what="checkpoint") from `offset` on (answered with DetachChunk)."""
    seq: int
    job_id: str
    what: str
    offset: int


@message(45)
class DetachChunk:
    """Agent -> client: at most limits.DETACH_CHUNK bytes of a file from `offset`, of `total`
    bytes in all. `version` changes when the file is replaced (a newer checkpoint): a reader
    starts again. `state` is the run's (running, done, failed, stopped, lost)."""
    seq: int
    error: str
    version: str
    offset: int
    total: int
    data: bytes
    state: str


# -- encoding and checking ------------------------------------------------------------

def to_wire(msg) -> list:
    """The msgpack-able form of a message: [code, field values...]."""
    return [msg.CODE, *(getattr(msg, name) for name in msg.FIELDS)]


def channel_of(msg) -> str:
    """The job channel a job-data message is delivered to."""
    return msg.channel if "channel" in msg.FIELDS else type(msg).__name__


def from_wire(obj, allowed: frozenset[int] | None = None):
    """The message a received frame body holds, its fields checked against the declared
    types; RemoteProtocolError if it is not one (or not one of `allowed` codes)."""
    if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
        raise RemoteProtocolError("frame is not a message ([code, fields...])")
    code, values = obj[0], obj[1:]
    cls = MESSAGES.get(code)
    if cls is None:
        raise RemoteProtocolError(f"unknown message code {code}", "unexpected")
    if allowed is not None and code not in allowed:
        raise RemoteProtocolError(f"{cls.__name__} is not allowed here", "unexpected")
    if len(values) != len(cls.FIELDS):
        raise RemoteProtocolError(f"{cls.__name__} needs {len(cls.FIELDS)} fields, got {len(values)}")
    hints = _hints(cls)
    checked = []
    for name, value in zip(cls.FIELDS, values):
        hint = hints[name]
        if not _conforms(value, hint):
            raise RemoteProtocolError(f"{cls.__name__}.{name} is not a {_describe(hint)}")
        checked.append(float(value) if hint is float else value)
    return cls(*checked)


_HINTS: dict[type, dict] = {}


def _hints(cls) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _conforms(value, hint) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")

