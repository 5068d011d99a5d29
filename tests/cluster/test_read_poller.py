"""The node's read poller (``cluster.node.ReadPoller``): connections waiting for their next
request are read by one task, and go back to their own task for whatever needs a wait, with
every request answered once, in any slicing of the bytes, and a bad peer harming no one."""

from __future__ import annotations

import gc
import random
import socket
import struct
import time
import weakref
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import cluster.node
from cluster.codec import FrameDecoder, encode
from cluster.node import Node
from tests.cluster.test_node_robustness import with_node

pytestmark = pytest.mark.timeout(60)

AT = "2099-01-01T00:00:00Z"  # nothing fires while the tests run


def create(request_id: int, job_id: str) -> bytes:
    spec = {"id": job_id, "schedule": {"at": AT}, "task": {"payload": {"n": request_id}}}
    return encode({"id": request_id, "op": "job.create", "args": {"spec": spec}})


def ping(request_id: int) -> bytes:
    return encode({"id": request_id, "op": "ping", "args": {}})


async def replies(stream: trio.SocketStream, count: int) -> list[dict[str, Any]]:
    """The next ``count`` replies read from ``stream``."""
    decoder = FrameDecoder()
    out: list[dict[str, Any]] = []
    while len(out) < count:
        data = await stream.receive_some(65536)
        assert data, f"the node closed the connection after {len(out)} of {count} replies"
        decoder.feed(data)
        while (event := decoder.next_event()) is not None:
            assert isinstance(event, dict), event
            out.append(event)
    return out


def test_requests_of_waiting_connections_are_read_by_the_poller(tmp_path: Path) -> None:
    """Eight clients one create at a time each: every request read and answered by the
    poller, no connection's task woken for any of them."""

    async def body(node: Node, port: int) -> None:
        poller = node.poller
        assert poller is not None

        async def client(c: int) -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                for n in range(20):
                    await stream.send_all(create(n, f"c{c}-{n}"))
                    (reply,) = await replies(stream, 1)
                    assert reply["id"] == n and reply["ok"] is True, reply

        async with trio.open_nursery() as nursery:
            for c in range(8):
                nursery.start_soon(client, c)
        assert poller.reads >= 160
        # (a connection goes back to its task at its end of stream only)
        assert poller.handed_back <= 8

    with_node(tmp_path, body)


def test_a_read_of_many_requests_goes_back_to_its_task_and_all_are_answered(
    tmp_path: Path,
) -> None:
    """Far more requests in one read than the poller takes before a yield: the rest are
    the connection's task's, and every one is answered once."""

    async def body(node: Node, port: int) -> None:
        poller = node.poller
        assert poller is not None
        count = cluster.node.YIELD_EVERY * 5
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(ping(0))
            await replies(stream, 1)  # (parked now)
            handed_back = poller.handed_back
            await stream.send_all(b"".join(create(n, f"many-{n}") for n in range(1, count)))
            got = await replies(stream, count - 1)
            assert sorted(r["id"] for r in got) == list(range(1, count))
            assert all(r["ok"] for r in got)
            assert poller.handed_back > handed_back

    with_node(tmp_path, body)


def test_a_request_with_no_place_in_flight_waits_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poller parses a request the connection has no place for (MAX_IN_FLIGHT): it is
    held for the connection's task, which waits for a place, then starts it."""
    monkeypatch.setattr(cluster.node, "MAX_IN_FLIGHT", 2)

    async def body(node: Node, port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(ping(0))
            await replies(stream, 1)
            await stream.send_all(b"".join(create(n, f"held-{n}") for n in range(1, 21)))
            got = await replies(stream, 20)
            assert sorted(r["id"] for r in got) == list(range(1, 21))
            assert all(r["ok"] for r in got), got

    with_node(tmp_path, body)


def test_any_slicing_of_many_connections_bytes_answers_every_request_once(
    tmp_path: Path,
) -> None:
    """Randomized (seeded): creates, pings and malformed frames from several connections,
    their bytes cut at random places and sent with random pauses. Every request gets
    exactly one reply, typed errors for the malformed ones, and every create made a job."""

    async def body(node: Node, port: int) -> None:
        async def client(c: int, rng: random.Random) -> None:
            frames: list[bytes] = []
            expected: dict[int, bool] = {}  # request id -> answered ok
            for n in range(1, 61):
                kind = rng.random()
                if kind < 0.6:
                    frames.append(create(n, f"s{c}-{n}"))
                    expected[n] = True
                elif kind < 0.85:
                    frames.append(ping(n))
                    expected[n] = True
                else:  # a request whose op is unknown: a typed error, the connection lives
                    frames.append(encode({"id": n, "op": "no.such.op", "args": {}}))
                    expected[n] = False
            data = b"".join(frames)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                at = 0
                while at < len(data):
                    cut = at + rng.randint(1, 400)
                    await stream.send_all(data[at:cut])
                    at = cut
                    if rng.random() < 0.3:
                        await trio.sleep(rng.random() / 200)
                got = await replies(stream, len(expected))
                by_id = {r["id"]: r for r in got}
                assert len(by_id) == len(got) == len(expected)
                for n, fine in expected.items():
                    assert by_id[n]["ok"] is fine, by_id[n]
                    if not fine:
                        assert by_id[n]["error"]["code"] == "unknown_op", by_id[n]

        for seed in range(3):
            async with trio.open_nursery() as nursery:
                for c in range(6):
                    nursery.start_soon(client, seed * 10 + c, random.Random(seed * 100 + c))

    with_node(tmp_path, body)


def test_a_peer_that_resets_while_waiting_harms_no_other(tmp_path: Path) -> None:
    async def body(node: Node, port: int) -> None:
        poller = node.poller
        assert poller is not None
        good = await trio.open_tcp_stream("127.0.0.1", port)
        bad = await trio.open_tcp_stream("127.0.0.1", port)
        async with good:
            for stream in (good, bad):
                await stream.send_all(ping(1))
                await replies(stream, 1)
            while len(poller.parked) < 2:
                await trio.sleep(0.01)
            # A reset: SO_LINGER with a zero timeout, then close.
            bad.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            bad.socket.close()
            while len(node.connections) > 1 or len(poller.parked) > 1:
                await trio.sleep(0.01)
            for n in range(2, 12):
                await good.send_all(create(n, f"good-{n}"))
                (reply,) = await replies(good, 1)
                assert reply["ok"] is True and reply["id"] == n

    with_node(tmp_path, body)


def test_a_peer_that_half_closes_gets_the_replies_to_what_it_sent(tmp_path: Path) -> None:
    async def body(node: Node, port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(ping(0))
            await replies(stream, 1)
            await stream.send_all(b"".join(create(n, f"half-{n}") for n in range(1, 11)))
            await stream.send_eof()
            got = await replies(stream, 10)
            assert sorted(r["id"] for r in got) == list(range(1, 11))
            assert await stream.receive_some(1024) == b""  # then the node closes its side

    with_node(tmp_path, body)


def test_a_frame_that_is_not_msgpack_gets_a_typed_error_from_the_poller(tmp_path: Path) -> None:
    async def body(node: Node, port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(ping(0))
            await replies(stream, 1)
            junk = b"\xc1\xc1\xc1"  # (0xc1 is never used in msgpack)
            await stream.send_all(struct.pack(">I", len(junk)) + junk + ping(7))
            first, second = await replies(stream, 2)
            assert first["ok"] is False and first["error"]["code"] == "malformed"
            assert second == {"id": 7, "ok": True, "result": second["result"]}

    with_node(tmp_path, body)


def test_a_node_stops_cleanly_with_connections_waiting_and_leaves_nothing_parked(
    tmp_path: Path,
) -> None:
    # (plain sockets: they outlive the Trio run, open while the node stops)
    sockets: list[socket.socket] = []
    pollers: list[Any] = []

    def connect(port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(ping(1))
        assert sock.recv(65536)  # (the reply: the connection is parked once it is read)
        return sock

    async def body(node: Node, port: int) -> None:
        for _ in range(5):
            sockets.append(await trio.to_thread.run_sync(connect, port))
        assert node.poller is not None
        while len(node.poller.parked) < 5:
            await trio.sleep(0.01)
        pollers.append(node.poller)

    try:
        node = with_node(tmp_path, body)
        (poller,) = pollers
        assert node.poller is poller and poller.closed
        assert poller.parked == {} and poller.epoll.closed
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("ending", ["eof", "reset"])
def test_a_closed_connection_is_freed_at_once_not_kept_by_the_poller(
    tmp_path: Path, ending: str
) -> None:
    """(Found by review: the poller's coroutine kept the last connection it read, closed or
    not, with its buffers, until some other connection sent something.) The collector is
    off: a closed connection must go by reference counting alone, as without the poller; a
    reset one (whose error's traceback makes a cycle through its frames, poller or not) by
    the first collection."""
    refs: list[weakref.ref[Any]] = []
    alive: list[bool] = []

    async def body(node: Node, port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(ping(1))
        await replies(stream, 1)
        (conn,) = node.connections
        refs.append(weakref.ref(conn))
        del conn
        assert node.poller is not None
        while not node.poller.parked:
            await trio.sleep(0.01)
        if ending == "reset":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stream.socket.close()
        else:
            await stream.aclose()
        while node.connections:
            await trio.sleep(0.01)
        await trio.sleep(0.05)
        if ending == "reset":
            gc.collect()
        alive.append(refs[0]() is not None)

    gc.disable()
    try:
        with_node(tmp_path, body)
    finally:
        gc.enable()
    assert alive == [False]


def test_a_connection_above_its_high_water_mark_is_not_read_while_parked(
    tmp_path: Path,
) -> None:
    """(Found by review: the poller went on reading a parked connection above the mark as
    long as no whole request came.) Back-pressure as unparked: the node reads no more of a
    peer whose replies or pushes wait above the mark until it has read them."""
    held: list[int] = []

    async def body(node: Node, port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(ping(1))
            await replies(stream, 1)
            (conn,) = node.connections
            assert node.poller is not None
            while not node.poller.parked:
                await trio.sleep(0.01)
            # as if pushes to this (worker) connection had piled up above the mark
            conn.outbox.queued = conn.outbox.high_water + 1
            size = 3 * 1024 * 1024  # one frame, sent in part: never a whole request
            with trio.move_on_after(1):
                await stream.send_all(struct.pack(">I", size) + b"\x00" * (size // 2))
            await trio.sleep(0.2)
            held.append(conn.decoder.pending_bytes)
            conn.outbox.queued = 0

    with_node(tmp_path, body)
    assert held[0] <= 64 * 1024, held


def test_a_connection_the_node_closed_is_not_read_by_the_poller_any_more(
    tmp_path: Path,
) -> None:
    """(Found by review: a connection closed by the node, its outbox over the hard cap, was
    still read by the poller until its cancelled task ran, in either order within a pass of
    Trio's loop, and the creates it read were made, their replies dropped.) Its requests
    already in the socket are neither read nor started."""
    started_after_close: list[int] = []

    async def body(node: Node, port: int) -> None:
        for trial in range(10):

            def connect() -> socket.socket:
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(ping(0))
                assert sock.recv(65536)
                return sock

            sock = await trio.to_thread.run_sync(connect)
            assert node.poller is not None
            while not node.poller.parked:
                await trio.sleep(0.005)
            (conn,) = node.connections
            made = conn._create_now
            late = [0]

            def create_now(
                request: Any, conn: Any = conn, made: Any = made, late: list[int] = late
            ) -> None:
                if conn.closed:
                    late[0] += 1
                made(request)

            conn._create_now = create_now  # type: ignore[method-assign]
            # Requests in the socket, then the node closes the connection before its loop's
            # next pass: whichever of the poller and the cancelled task runs first. (The
            # loop is held on purpose, so that the bytes arrive while it does not run.)
            sock.sendall(b"".join(create(n, f"late-{trial}-{n}") for n in range(1, 11)))
            time.sleep(0.02)
            conn._overflow(conn.hard_cap + 1)
            await trio.sleep(0.05)
            started_after_close.append(late[0])
            sock.close()
            while node.connections:
                await trio.sleep(0.005)

    with_node(tmp_path, body)
    assert started_after_close == [0] * 10


def test_the_frames_used_here_are_the_protocols() -> None:
    """(The helpers above build frames by hand: they must decode as the node's own.)"""
    decoder = FrameDecoder()
    decoder.feed(create(3, "x") + ping(4))
    first, second = decoder.next_event(), decoder.next_event()
    assert isinstance(first, dict) and first["op"] == "job.create" and first["id"] == 3
    assert isinstance(second, dict) and second["op"] == "ping"
    assert msgpack.unpackb(ping(4)[4:]) == second
