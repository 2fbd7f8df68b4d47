"""The trio layer over real sockets: tensors of every size around the worker-thread threshold,
both directions at once, activity while a big tensor arrives, and a send cut off mid-frame."""
from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from swarm.net import ConnectionLost, Credentials, connect_peer, serve_peers
from swarm.net.peer import BULK_BYTES
from swarm.wire import JobData, Limits

pytestmark = pytest.mark.trio

TOKEN = "sockets-test-token-0123456789"
LIMITS = Limits(frame=1 << 20, payload=1 << 30)


async def connected_pair(nursery):
    """(client connection, server connection), authenticated, over 127.0.0.1."""
    accepted = trio.Event()
    holder = {}

    async def handler(conn):
        holder["server"] = conn
        accepted.set()
        await trio.sleep_forever()

    port = await nursery.start(serve_peers, handler, Credentials("server", TOKEN, LIMITS), ["127.0.0.1"], 0)
    client = await connect_peer("127.0.0.1", port, Credentials("client", TOKEN, LIMITS))
    await accepted.wait()
    return client, holder["server"]


def tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, BULK_BYTES - 1, BULK_BYTES, 3 * BULK_BYTES + 7]
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] + [rng.random((512, 1024), dtype=np.float32)]


async def test_tensors_around_the_bulk_threshold_both_ways_at_once():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client, server = await connected_pair(nursery)
            out_a, out_b = tensors(1), tensors(2)
            got = {}

            async def exchange(name, conn, arrays):
                async with trio.open_nursery() as inner:
                    inner.start_soon(conn.send, JobData("j", 0, name, arrays))
                    got[name] = await conn.receive()

            async with trio.open_nursery() as both:
                both.start_soon(exchange, "from-client", client, out_a)
                both.start_soon(exchange, "from-server", server, out_b)
            for sent, message in ((out_b, got["from-client"]), (out_a, got["from-server"])):
                assert len(message.body) == len(sent)
                for a, b in zip(sent, message.body):
                    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
                    assert b.flags.owndata
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_activity_is_reported_while_a_big_tensor_trickles_in():
    """A bulk receive hands control back every BULK_SLICE seconds, so a slow big tensor still
    counts as a sign of life (and can be cancelled) while it arrives."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client, server = await connected_pair(nursery)
            seen = []
            server.on_activity = lambda: seen.append(trio.current_time())
            big = np.arange(4 * BULK_BYTES, dtype=np.uint8)
            from swarm.wire import encode_frame, to_wire

            frame = encode_frame(to_wire(JobData("j", 0, "big", big)), 1 << 20)
            sealed = b"".join(bytes(r) for r in client.protocol._sealer.records(frame))

            async def trickle():
                for start in range(0, len(sealed), BULK_BYTES // 2):  # half a MiB every 0.15 s
                    await client.stream.send_all(sealed[start:start + BULK_BYTES // 2])
                    await trio.sleep(0.15)

            nursery.start_soon(trickle)
            started = trio.current_time()
            message = await server.receive()
            took = trio.current_time() - started
            assert np.array_equal(message.body, big)
            gaps = np.diff([started] + seen)
            assert took > 1.0 and gaps.max() < 0.45, gaps   # never silent for long, though 8 slices long
            nursery.cancel_scope.cancel()


async def test_a_send_cancelled_mid_frame_closes_the_connection_instead_of_corrupting_it():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client, server = await connected_pair(nursery)
            huge = np.zeros(256 * BULK_BYTES, np.uint8)   # the server does not read: the send stalls
            with trio.move_on_after(0.5) as scope:
                await client.send(JobData("j", 0, "huge", huge))
            assert scope.cancelled_caught and client.closed
            with pytest.raises(ConnectionLost):
                await client.send(JobData("j", 0, "after", 1))
            with pytest.raises(ConnectionLost):  # the peer sees the end, never a half frame as a message
                while True:
                    await server.receive()
            nursery.cancel_scope.cancel()


async def test_a_tensor_trickling_in_wakes_the_reader_once_not_at_every_piece():
    """While tensor bytes are awaited the socket's receive low-water mark holds the reader back
    until they are all there; the message after it (a few bytes) is not held back."""
    from swarm.net.peer import LOWAT_MIN
    from swarm.wire import encode_frame, to_wire

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client, server = await connected_pair(nursery)
            halo = np.arange(5 * LOWAT_MIN, dtype=np.uint8)  # read by the event loop, not a thread
            assert halo.nbytes < BULK_BYTES
            frame = encode_frame(to_wire(JobData("j", 0, "halo", halo)), 1 << 20)
            head, payload = (bytes(r) for r in client.protocol._sealer.records(frame))  # the tensor's own record
            reads = []
            received = server.protocol.payload_received
            server.protocol.payload_received = lambda n: (reads.append(n), received(n))

            async def trickle():
                await client.stream.send_all(head)
                await trio.sleep(0.05)
                for start in range(0, len(payload), LOWAT_MIN // 4):  # 20 pieces, 10 ms apart
                    await client.stream.send_all(payload[start:start + LOWAT_MIN // 4])
                    await trio.sleep(0.01)
                await trio.sleep(0.05)
                await client.send(JobData("j", 0, "after", 1))

            nursery.start_soon(trickle)
            message = await server.receive()
            assert np.array_equal(message.body, halo)
            # all but the first piece (which brought the record's header) straight into the record
            assert sum(reads) >= len(payload) - LOWAT_MIN // 4 and len(reads) <= 2, reads
            with trio.fail_after(2):
                assert (await server.receive()).body == 1
            nursery.cancel_scope.cancel()


async def test_a_small_send_cancelled_as_it_starts_leaves_the_connection_whole():
    """A job's heartbeats share the coordinator's connection with the agent's replies. Releasing
    the job cancels its heartbeat task, which may be inside a send, holding the send lock with
    its frame not yet written: the connection must stay usable, and the peer must see whole
    messages only. (A frame cut off by the cancel closed the connection, and the reply to the
    release, queued behind it, was lost.)"""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client, server = await connected_pair(nursery)
            for i in range(50):  # the cancel lands at each point of a send in turn
                scope = trio.CancelScope()

                async def beat(scope=scope, i=i):
                    with scope:
                        await client.send(JobData("j", 0, "beat", i))

                nursery.start_soon(beat)
                for _ in range(i % 5):
                    await trio.lowlevel.checkpoint()
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert not client.closed, i
                await client.send(JobData("j", 0, "after", i))
                while True:
                    got = await server.receive()
                    if got.channel == "after":
                        assert got.body == i
                        break
                    assert got.channel == "beat"
            nursery.cancel_scope.cancel()
