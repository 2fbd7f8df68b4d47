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
