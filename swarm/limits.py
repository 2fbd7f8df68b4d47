"""Every bound on what a remote side can make a device hold, wait for or write, in one place.

A swarm shares its LAN with strangers, and even a device that holds the token may be buggy
or compromised: nothing it sends may make another device hold memory, descriptors or log
space without limit. Each constant says why it has its size.
"""
from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# -- the wire (swarm/wire) -----------------------------------------------------------------

# A frame body before both sides have proven the token: Hello, Auth and Goodbye are each
# well under 300 bytes; a stranger may make us buffer no more than this.
HANDSHAKE_FRAME = 1 * KiB

# A frame's msgpack body after authentication. The largest bodies are a JobAssign's plan
# and spec (tens of kB for the full yolov2 over a dozen devices); tensors travel beside the
# body, not in it.
FRAME = 16 * MiB

# Tensor bytes one frame may carry. The largest single message is a stage's weights and
# optimizer state shipped or backed up at once (the full yolov2 with momentum: ~400 MB);
# 2 GiB leaves room for bigger models and is still refused before anything is allocated.
PAYLOAD = 2 * GiB

# Plaintext bytes in one sealed record. A receiver holds one whole record before it can
# check it, so this bounds that buffer; at 1 MiB the per-record cost (a 20-byte header and
# tag, one AEAD call) is lost in the bytes, and a 100 Mbit/s link moves one in ~80 ms.
SEAL_RECORD = 1 * MiB

# -- connections being accepted (swarm/net/peer.py, serve_peers) ----------------------------

# Handshakes in progress at once, from everyone. Each holds a descriptor and a buffer of at
# most HANDSHAKE_FRAME bytes; a handshake on a LAN takes a few round trips (milliseconds),
# so even a job starting on a few dozen devices, each opening its links at once, has far
# fewer in flight. 128 leaves an agent with the default limit of 1024 descriptors nearly
# 900 for its own connections, files and threads, however many connections arrive.
HANDSHAKES = 128

# Handshakes in progress at once from one address (a host's IP, whatever its port). A device
# opens one connection per role it plays (its coordinator's, one per job link); 32 covers a
# loopback testbed of a dozen devices on 127.0.0.1 connecting at once, and one neighbour
# still takes no more than a quarter of HANDSHAKES.
HANDSHAKES_PER_HOST = 32

# Seconds from accepting a connection to the peer's whole Hello. A swarm client sends its
# Hello as soon as its connect() returns, so the Hello arrives right behind the TCP
# handshake's last packet: milliseconds, well under a second on a congested Wi-Fi link. A
# connection that sends nothing, or half a Hello, gives its slot back after this. The rest
# of the handshake (the client's proof) has the full handshake timeout of swarm/net/peer.py
# (5 s), as a client has.
HELLO_TIMEOUT = 2.0

# Seconds a handshake keeps its place without a Hello when the caps are reached: after this
# a newcomer takes the place of the oldest such one. A Hello that is coming arrives within
# milliseconds of the connection; a burst of idle connections then holds the caps for half
# a second, not for all of HELLO_TIMEOUT, and `swarm status` from the same host gets in on
# its first retries.
HELLO_GRACE = 0.5

# Seconds to wait after accept() fails for want of descriptors or memory (EMFILE, ENFILE,
# ENOBUFS, ENOMEM) before trying again: what trio's own listener waits, short enough that
# a status probe is answered soon after descriptors free up.
ACCEPT_RETRY = 0.1

# -- log lines a remote side can cause (swarm/net/ratelimit.py) -----------------------------

# Seconds between two log lines of one kind about what remote sides do (refusals, unknown
# jobs, closed connections, protocol errors): the first is logged at once, the rest are
# counted into one line per interval. At 1 s a flood costs at most a few hundred bytes of
# log a second per kind, and a person reading the log still sees every kind as it starts.
LOG_INTERVAL = 1.0

# -- the agent (swarm/agent/agent.py) -------------------------------------------------------

# Job messages held for an assignment that has not arrived yet. A device's peers may start
# sending as soon as their own assignment lands, a few milliseconds before ours; what
# arrives in that gap is a handful of messages per peer (activations, halos, a stage's
# layers at a re-plan), never hundreds.
EARLY_MESSAGES = 1024

# Bytes (tensors, strings and a small overhead per value) of the messages held for an
# assignment. A message is held only if it arrives whole before our assignment, which lands
# milliseconds after the sender's; the largest that can is a stage's layers pushed by a peer
# at a re-plan: 26 MiB for all of yolov2-16 with momentum, and a 1 GiB device's share of the
# full yolov2 (389 MiB in all with momentum) is less than 256 MiB. No more than a quarter
# of such a device goes to messages that no job has asked for yet.
EARLY_BYTES = 256 * MiB

# Seconds a message may wait for its job's assignment. The coordinator assigns devices one
# after another and waits up to 30 s for each answer (swarm/cluster/remote_job.py); twice that
# covers one device that never answers before ours. Older ones are dropped.
EARLY_AGE = 60.0

# Gradient-sum lanes (swarm/execution/lane.py) held for an assignment that has not arrived
# yet, each an open connection. A run opens one to each other member of each group it sums
# in, at its first sum: on 64 devices in groups of at most 8 a device is sent at most 7 per
# stage it holds. They wait EARLY_AGE, as early messages do.
EARLY_LANES = 64

# Replies (Pong, Info, JobState) queued for one connection. A peer gets one reply per request
# and a coordinator sends a few requests a second at most; 256 waiting means the peer has
# not read for a long while (its socket buffers are full too), and it is disconnected
# rather than buffered for.
OUTBOX = 256

# Hosts whose refused connections are counted one by one between two log lines (the rest
# are counted together): the line names the few that refused most, so 64 is plenty, and
# a flood from many addresses costs a small fixed table.
REFUSAL_HOSTS = 64

# -- detached training runs (swarm/agent/detached.py) ---------------------------------------

# Runs one agent coordinates at once. A coordinator is a `swarm train` process that holds the
# whole model and feeds every step (a few hundred MB for yolov2-16 at its default size); the
# agent's device is usually a worker too, so a handful is already more than it should carry.
DETACHED_RUNNING = 4

# Runs an agent remembers (and keeps the folders of, log and checkpoint) once they ended; the
# oldest ended one goes when another starts beyond this. `swarm jobs` lists this many at most.
DETACHED_KEPT = 32

# Flags of one submitted run, and characters of one flag. `swarm train` has about fifty
# flags, each a word or a path; these bound what a submission can make an agent parse.
DETACH_ARGS = 128
DETACH_ARG_CHARS = 4 * KiB

# Bytes of a log or checkpoint in one answer. A checkpoint of the full yolov2 with momentum
# is ~400 MB: 1 MiB chunks keep every frame small (a link at 20 Mbit/s moves one in half a
# second, so heartbeats are never stuck behind it) at a round trip per MiB.
DETACH_CHUNK = 1 * MiB

# -- coordinator replicas (swarm/agent/failover.py) -----------------------------------------

# Bytes of one coordinator replica an agent keeps (msgpack of its body). A replica is a plan,
# who holds which layers and the run's flags: a few kB for yolov2 over a dozen devices.
REPLICA_BYTES = 256 * KiB

# Jobs whose newest replica (and newest coordinator term, which fences older coordinators) an
# agent keeps at once (the oldest goes): an agent works for one job at a time, and a few more
# cover the jobs it has just left.
REPLICAS = 4
