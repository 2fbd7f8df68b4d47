"""The swarm wire protocol, sans-IO: frames, messages, tensors and the authenticated connection.

Never imports torch: tensors are numpy arrays here.
"""
from swarm.wire.connection import NEED_DATA, Authenticated, Closed, Connection
from swarm.wire.faults import LocalProtocolError, ProtocolError, RemoteProtocolError
from swarm.wire.frames import FrameDecoder, Limits, encode_frame
from swarm.wire.handshake import CLIENT, SERVER
from swarm.wire.messages import (MAGIC, MESSAGES, PROTOCOL_VERSION, Auth, DetachAnswer, DetachChunk, DetachList,
                                 DetachRead, DetachStop, DetachSubmit, Goodbye, Heartbeat, Hello, Info,
                                 InfoRequest, JobAssign, JobData, JobRelease, JobReplica, JobStart, JobState, JobStop,
                                 LeaseAnswer, LeaseAsk, Ping, Pong, ReplicaQuery, ReplicaState, Tensor, VoteAsk,
                                 VoteReply, Watch, channel_of, from_wire, message, to_wire)

__all__ = [
    "NEED_DATA", "Authenticated", "Closed", "Connection", "LocalProtocolError", "ProtocolError",
    "RemoteProtocolError", "FrameDecoder", "Limits", "encode_frame", "CLIENT", "SERVER", "MAGIC", "MESSAGES",
    "PROTOCOL_VERSION", "Auth", "DetachAnswer", "DetachChunk", "DetachList", "DetachRead", "DetachStop",
    "DetachSubmit", "Goodbye", "Heartbeat", "Hello", "Info", "InfoRequest", "JobAssign", "JobData",
    "JobRelease", "JobReplica", "JobStart", "JobState", "JobStop", "LeaseAnswer", "LeaseAsk", "Ping", "Pong", "ReplicaQuery", "ReplicaState", "Tensor", "VoteAsk", "VoteReply", "Watch", "channel_of",
    "from_wire", "message", "to_wire",
]
