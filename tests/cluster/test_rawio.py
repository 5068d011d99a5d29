"""The raw socket reads and writes against what Trio's own stream promises: order, partial
writes, a closed stream, a peer gone, yielding to other tasks, cancellation."""

from __future__ import annotations

import errno
import os
import socket

import pytest
import trio

from cluster.rawio import READ_BYTES, READS_BEFORE_YIELD, RawSocketIO


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


def test_bytes_arrive_in_order_through_partial_writes() -> None:
    async def main() -> None:
        left, right = await _pair()
        payload = bytes(range(256)) * (40 * 1024)  # 10 MiB: far more than a socket buffer
        got = bytearray()

        async def read_all() -> None:
            io = RawSocketIO(right)
            while len(got) < len(payload):
                chunk = await io.receive_some()
                assert 0 < len(chunk) <= READ_BYTES
                got.extend(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await RawSocketIO(left).send_all(payload)
        assert bytes(got) == payload
        await left.aclose()
        assert await RawSocketIO(right).receive_some() == b""  # the peer closed its side

    trio.run(main)


def test_a_stream_closed_by_another_task_wakes_the_reader() -> None:
    async def main() -> None:
        left, right = await _pair()
        io = RawSocketIO(right)

        async def close_soon() -> None:
            await trio.sleep(0.01)
            await right.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_soon)
            with pytest.raises(trio.ClosedResourceError):
                await io.receive_some()
        with pytest.raises(trio.ClosedResourceError):
            await io.send_all(b"x")  # never the number another connection may have now
        await left.aclose()

    trio.run(main)


def test_a_reset_peer_is_a_broken_resource() -> None:
    async def main() -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = await trio.open_tcp_stream("127.0.0.1", listener.getsockname()[1])
        server_sock, _ = await listener.accept()
        # Close with RST: SO_LINGER on, zero timeout.
        server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        server_sock.close()
        io = RawSocketIO(client)
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):  # the first write may still be taken by the kernel
                await io.send_all(b"x" * 65536)
                await trio.sleep(0.001)
        await client.aclose()
        listener.close()

    trio.run(main)


def test_a_reader_that_always_finds_data_still_lets_others_run() -> None:
    async def main() -> None:
        left, right = await _pair()
        io = RawSocketIO(right)
        other_ran = 0

        async def other() -> None:
            nonlocal other_ran
            while True:
                other_ran += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.lowlevel.checkpoint()  # the other task starts
            before = other_ran
            for _ in range(4 * READS_BEFORE_YIELD):
                os.write(left.socket.fileno(), b"x")  # no schedule point on this side
                assert await io.receive_some() == b"x"
            assert other_ran - before >= 3  # yielded about every READS_BEFORE_YIELD reads
            nursery.cancel_scope.cancel()
        await left.aclose()
        await right.aclose()

    trio.run(main)


def test_a_waiting_read_is_cancellable() -> None:
    async def main() -> None:
        left, right = await _pair()
        with trio.move_on_after(0.02) as scope:
            await RawSocketIO(right).receive_some()
        assert scope.cancelled_caught
        await left.aclose()
        await right.aclose()

    trio.run(main)


def test_any_socket_error_is_a_broken_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    """As Trio's own streams: EBADF and ENOTSOCK mean closed, every other error broken (an
    unreachable host must end the connection, never escape as a bare OSError)."""

    async def main() -> None:
        left, right = await _pair()
        io = RawSocketIO(left)
        for code, expected in (
            (errno.EHOSTUNREACH, trio.BrokenResourceError),
            (errno.ECONNABORTED, trio.BrokenResourceError),
            (errno.ENOTSOCK, trio.ClosedResourceError),
        ):

            def fail(*_args: object, code: int = code) -> int:
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(os, "write", fail)
            with pytest.raises(expected):
                await io.send_all(b"x")
            with pytest.raises(expected):
                io.try_send(b"x")
            monkeypatch.undo()
        await left.aclose()
        await right.aclose()

    trio.run(main)


def test_the_outbox_writes_in_bounded_pieces_and_counts_its_bytes() -> None:
    """Whatever is queued, one write joins at most WRITE_PIECE bytes (a larger frame goes out
    alone, unjoined); the count of queued bytes falls as they are written, and a task
    waiting for room wakes once it is at the high-water mark."""
    from cluster.rawio import WRITE_PIECE, Outbox

    async def main() -> None:
        left, right = await _pair()
        sizes: list[int] = []

        class Counting(RawSocketIO):
            __slots__ = ()

            async def send_all(self, data: bytes) -> None:
                sizes.append(len(data))
                await super().send_all(data)

        io = Counting(left)
        outbox = Outbox(io, high_water=2 * WRITE_PIECE)
        small = b"s" * 1000
        big = b"B" * (3 * WRITE_PIECE)
        for _ in range(5000):  # ~5 MB of small frames
            outbox.put(small)
        outbox.put(big)
        total = 5000 * len(small) + len(big)
        assert outbox.queued == total
        woken: list[int] = []
        got = bytearray()

        async def wait_room() -> None:
            await outbox.wait_room()
            woken.append(outbox.queued)

        async def read_all() -> None:
            reader = RawSocketIO(right)
            while len(got) < total:
                got.extend(await reader.receive_some())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_room)
            nursery.start_soon(outbox.run)
            await read_all()
            with trio.fail_after(5):
                while outbox.queued:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert bytes(got) == small * 5000 + big
        assert sizes[-1] == len(big)  # alone, not joined to the small ones
        assert max(sizes[:-1]) <= WRITE_PIECE
        assert woken and woken[0] <= 2 * WRITE_PIECE
        await left.aclose()
        await right.aclose()

    trio.run(main)


def test_a_lone_request_at_a_time_costs_one_read_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that sends its next bytes only once the last were read (a lone client): after
    a read that drained the socket, the next waits for readiness instead of trying a read
    that fails with EAGAIN (a system call, an exception and a GIL release per request)."""
    real_read = os.read
    calls = {"reads": 0, "eagain": 0}

    def counting(fd: int, n: int) -> bytes:
        calls["reads"] += 1
        try:
            return real_read(fd, n)
        except BlockingIOError:
            calls["eagain"] += 1
            raise

    async def main() -> None:
        left, right = await _pair()
        io = RawSocketIO(right)
        send_go, receive_go = trio.open_memory_channel[None](1)

        async def peer() -> None:
            async for _ in receive_go:
                os.write(left.socket.fileno(), b"request")  # after the reader asked

        monkeypatch.setattr(os, "read", counting)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer)
            for _ in range(20):
                send_go.send_nowait(None)
                assert await io.receive_some() == b"request"
            nursery.cancel_scope.cancel()
        monkeypatch.undo()
        assert calls["reads"] - calls["eagain"] == 20
        assert calls["eagain"] <= 1  # the first read only (nothing was known about the socket)
        await left.aclose()
        await right.aclose()

    trio.run(main)
