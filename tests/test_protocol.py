"""The sans-IO connection in memory: handshake success and every refusal, splits, closing."""
from __future__ import annotations

import numpy as np
import pytest

from swarm.wire import (CLIENT, NEED_DATA, SERVER, Auth, Authenticated, Closed, Connection, Goodbye, Hello,
                        JobAssign, JobData, LocalProtocolError, Ping, RemoteProtocolError, encode_frame)
from swarm.wire.frames import INCOMPLETE, LENGTH
from swarm.wire.handshake import proof_is_valid
from swarm.wire.messages import MAGIC, PROTOCOL_VERSION

TOKEN = b"a" * 32


def pump(src: Connection, dst: Connection) -> None:
    for buf in src.data_to_send():
        dst.receive_data(bytes(buf))


def events(conn: Connection) -> list:
    out = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
        if isinstance(event, Closed):
            break
    return out


def sent_messages(conn: Connection) -> list:
    """Decode what `conn` queued for its peer (as raw [code, ...] lists)."""
    from swarm.wire import FrameDecoder
    from swarm.wire.frames import INCOMPLETE

    decoder = FrameDecoder(1 << 20, 1 << 20)
    for buf in conn.data_to_send():
        decoder.feed(bytes(buf))
    out = []
    while (frame := decoder.next_frame()) is not INCOMPLETE:
        out.append(frame)
    return out


def sent_frames(data: bytes) -> list:
    """The message codes of the clear frames in `data`."""
    from swarm.wire import FrameDecoder

    decoder = FrameDecoder(1 << 20)
    decoder.feed(data)
    codes = []
    while (frame := decoder.next_frame()) is not INCOMPLETE:
        codes.append(frame[0])
    return codes


def handshake(client: Connection, server: Connection):
    """Hello both ways, the client's proof, the server's proof: three rounds."""
    ev_client, ev_server = [], []
    for _ in range(3):
        pump(client, server)
        pump(server, client)
        ev_server += events(server)
        ev_client += events(client)
    return ev_client, ev_server


def sealed(sender: Connection, data: bytes) -> bytes:
    """`data` as the open connection `sender` would seal it: bytes its peer will open."""
    return b"".join(bytes(r) for r in sender._sealer.records([data]))


def frame(obj) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(obj, 1 << 20))


def test_handshake_succeeds_and_messages_flow_both_ways():
    client, server = Connection(CLIENT, "node-a", TOKEN), Connection(SERVER, "node-b", TOKEN)
    ev_client, ev_server = handshake(client, server)
    assert ev_client == [Authenticated("node-b", PROTOCOL_VERSION)]
    assert ev_server == [Authenticated("node-a", PROTOCOL_VERSION)]
    assert client.state == server.state == "open"
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    client.send(JobData("job", 2, "weights", {"w": weights}))
    server.send(Ping(7))
    pump(client, server)
    pump(server, client)
    (got,) = events(server)
    assert got.channel == "weights" and np.array_equal(got.body["w"], weights)
    assert events(client) == [Ping(7)]


def test_wrong_token_is_refused_on_both_sides_and_nothing_is_passed_on():
    client = Connection(CLIENT, "intruder", b"b" * 32)
    server = Connection(SERVER, "agent", TOKEN)
    pump(client, server)
    pump(server, client)
    assert events(server) == [] and events(client) == []
    pump(client, server)  # the intruder's Auth
    with pytest.raises(RemoteProtocolError, match="cluster token") as info:
        server.next_event()
    assert info.value.kind == "auth"
    to_client = [bytes(b) for b in server.data_to_send()]
    # whatever the intruder sends next is not even read
    server.receive_data(frame([JobAssign.CODE, "j", 1, "bandwidth", {}, 0.25]))
    with pytest.raises(LocalProtocolError):
        server.next_event()
    # the intruder gets no proof to test guesses against: only a Goodbye
    decoded = Connection(SERVER, "x", TOKEN)._decoder
    decoded.feed(b"".join(to_client))
    assert decoded.next_frame() == [Goodbye.CODE, "authentication failed"]
    assert decoded.next_frame() is INCOMPLETE
    for data in to_client:
        client.receive_data(data)
    with pytest.raises(RemoteProtocolError, match="authentication failed"):
        events(client)


def test_server_sends_no_proof_before_the_client_has_proven_itself():
    client, server = Connection(CLIENT, "client", TOKEN), Connection(SERVER, "agent", TOKEN)
    pump(client, server)  # the client's Hello
    assert events(server) == []
    to_client = b"".join(bytes(b) for b in server.data_to_send())
    assert sent_frames(to_client) == [Hello.CODE]  # its Hello; no Auth yet
    assert events(server) == [] and sent_messages(server) == []  # still nothing more
    client.receive_data(to_client)
    assert events(client) == []
    client_to_server = b"".join(bytes(b) for b in client.data_to_send())  # now the client's proof
    server.receive_data(client_to_server)
    assert events(server) == [Authenticated("client", PROTOCOL_VERSION)]
    assert [m[0] for m in sent_messages(server)] == [Auth.CODE]  # only now the server's proof


def test_version_mismatch_is_refused_with_both_versions_named():
    server = Connection(SERVER, "agent", TOKEN)
    server.data_to_send()
    server.receive_data(frame([1, MAGIC, PROTOCOL_VERSION + 1, "future-node", b"n" * 32, "a field of the future"]))
    with pytest.raises(RemoteProtocolError, match=f"we speak {PROTOCOL_VERSION}, the peer speaks "
                                                  f"{PROTOCOL_VERSION + 1}") as info:
        server.next_event()
    assert info.value.kind == "version"
    (goodbye,) = sent_messages(server)
    assert goodbye[0] == Goodbye.CODE and "version mismatch" in goodbye[1]


def test_a_peer_of_the_release_before_sealing_is_told_to_upgrade():
    server = Connection(SERVER, "agent", TOKEN)
    server.receive_data(frame([1, MAGIC, 1, "old-node", b"n" * 32]))
    with pytest.raises(RemoteProtocolError, match=f"we speak {PROTOCOL_VERSION}, the peer speaks 1; run the same "
                                                  f"swarm release on every device") as info:
        server.next_event()
    assert info.value.kind == "version"
    (goodbye,) = sent_messages(server)[1:]  # after our Hello, in the clear: the old peer can read it
    assert goodbye[0] == Goodbye.CODE and "version mismatch" in goodbye[1]


def test_messages_before_authentication_are_refused():
    server = Connection(SERVER, "agent", TOKEN)
    server.receive_data(frame([JobAssign.CODE, "j", 1, "bandwidth", {}, 0.25]))
    with pytest.raises(RemoteProtocolError, match="not a swarm peer"):
        server.next_event()

    server = Connection(SERVER, "agent", TOKEN)
    server.receive_data(frame([1, MAGIC, PROTOCOL_VERSION, "x", b"n" * 32]))
    server.receive_data(frame([JobAssign.CODE, "j", 1, "bandwidth", {}, 0.25]))
    with pytest.raises(RemoteProtocolError, match="not allowed") as info:
        server.next_event()
    assert info.value.kind == "unexpected"

    server = Connection(SERVER, "agent", TOKEN)
    server.receive_data(frame([1, MAGIC, PROTOCOL_VERSION, "x", b"n" * 32, np.zeros(4)]))
    with pytest.raises(RemoteProtocolError, match="not allowed"):
        server.next_event()


def test_handshake_frames_are_small():
    server = Connection(SERVER, "agent", TOKEN)
    server.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as info:
        server.next_event()
    assert info.value.kind == "oversized"


def test_oversized_frame_after_authentication_is_refused():
    from swarm.wire import Limits

    limits = Limits(frame=4096, payload=1 << 16)
    client, server = Connection(CLIENT, "a", TOKEN, limits=limits), Connection(SERVER, "b", TOKEN, limits=limits)
    handshake(client, server)
    server.receive_data(sealed(client, LENGTH.pack(4097)))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit") as info:
        server.next_event()
    assert info.value.kind == "oversized"
    with pytest.raises(LocalProtocolError, match="exceeds"):
        client.send(JobData("j", 0, "c", b"x" * 5000))


def test_identity_checks():
    a, b = Connection(CLIENT, "same", TOKEN), Connection(SERVER, "same", TOKEN)
    pump(a, b)
    with pytest.raises(RemoteProtocolError, match="our own node id") as info:
        b.next_event()
    assert info.value.kind == "identity"
    a, b = Connection(CLIENT, "a", TOKEN, expected_peer_id="c"), Connection(SERVER, "b", TOKEN)
    pump(b, a)
    with pytest.raises(RemoteProtocolError, match="expected node c"):
        a.next_event()


def test_proofs_are_bound_to_role_and_identities():
    args = dict(token=TOKEN, version=1, peer_id="a", own_id="b", own_nonce=b"1" * 32, peer_nonce=b"2" * 32)
    from swarm.wire.handshake import proof

    good = proof(TOKEN, 1, CLIENT, "a", "b", b"1" * 32, b"2" * 32)
    assert proof_is_valid(peer_role=CLIENT, received=good, **args)
    assert not proof_is_valid(peer_role=SERVER, received=good, **args)  # reflected with the other role
    assert not proof_is_valid(peer_role=CLIENT, received=proof(TOKEN, 1, CLIENT, "c", "b", b"1" * 32, b"2" * 32),
                              **args)


def test_whole_conversation_split_at_every_byte_boundary():
    nonces = dict(client=b"c" * 32, server=b"s" * 32)
    client = Connection(CLIENT, "a", TOKEN, nonce=nonces["client"])
    server = Connection(SERVER, "b", TOKEN, nonce=nonces["server"])
    stream = b""  # everything the client sends, recorded

    def client_to_server():
        nonlocal stream
        for buf in client.data_to_send():
            stream += bytes(buf)
            server.receive_data(bytes(buf))

    for _ in range(3):  # Hellos, the client's proof, the server's
        client_to_server()
        pump(server, client)
        events(server), events(client)
    client.send(JobData("job", 1, "x", [np.arange(10, dtype=np.int32), "tail"]))
    client.send(Ping(3))
    client.close("done")
    client_to_server()
    # replay that byte stream into fresh servers (same nonce), cut in two at every byte
    for cut in range(len(stream) + 1):
        server = Connection(SERVER, "b", TOKEN, nonce=nonces["server"])
        got = []
        for piece in (stream[:cut], stream[cut:]):
            if piece:  # b"" would mean end of stream
                server.receive_data(piece)
                got += events(server)
        assert [type(e).__name__ for e in got] == ["Authenticated", "JobData", "Ping", "Closed"], cut
        assert np.array_equal(got[1].body[0], np.arange(10)) and got[3].reason == "done"


def test_end_of_stream():
    client, server = Connection(CLIENT, "a", TOKEN), Connection(SERVER, "b", TOKEN)
    handshake(client, server)
    server.receive_data(b"")
    assert events(server) == [Closed("connection closed by the peer")]
    client2, server2 = Connection(CLIENT, "a", TOKEN), Connection(SERVER, "b", TOKEN)
    handshake(client2, server2)
    server2.receive_data(sealed(client2, frame([10, 1])[:5]))
    server2.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        server2.next_event()
    client3, server3 = Connection(CLIENT, "a", TOKEN), Connection(SERVER, "b", TOKEN)
    handshake(client3, server3)
    server3.receive_data(sealed(client3, frame([10, 1]))[:-3])  # a record cut short
    server3.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        server3.next_event()
    fresh = Connection(SERVER, "b", TOKEN)
    fresh.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="during the handshake"):
        fresh.next_event()


def test_malformed_messages_after_authentication():
    client, server = Connection(CLIENT, "a", TOKEN), Connection(SERVER, "b", TOKEN)
    handshake(client, server)
    for bad, words in [([999], "unknown message code"), ([JobAssign.CODE, "j"], "needs 5 fields"),
                       ([JobAssign.CODE, "j", "one", "k", {}, 0.1], "epoch is not a int"),
                       ({"not": "a list"}, "not a message"), ([1, MAGIC, 1, "x", b"n" * 32], "after the handshake")]:
        c, s = Connection(CLIENT, "a", TOKEN), Connection(SERVER, "b", TOKEN)
        handshake(c, s)
        s.receive_data(sealed(c, frame(bad)))
        with pytest.raises(RemoteProtocolError, match=words):
            s.next_event()


def test_sending_before_the_handshake_is_our_mistake():
    conn = Connection(CLIENT, "a", TOKEN)
    with pytest.raises(LocalProtocolError, match="connection is hello"):
        conn.send(Ping(1))


def test_msgpack_bomb_is_refused():
    server = Connection(SERVER, "agent", TOKEN)
    nested = b"\x91" * 900 + b"\xc0"  # 900 nested one-element arrays within 1 KiB
    server.receive_data(LENGTH.pack(len(nested)) + nested)
    with pytest.raises(RemoteProtocolError):
        server.next_event()
