"""``cluster.rawio.ReadPoller`` against a reference model (hypothesis): readers parked, handed
back, cancelled, their peers writing at any time and the poller stopped at the end. Every byte
is read once, in order, by whichever side holds the socket; the set holds exactly the readers
the model says are parked; a stopped poller hands every one back."""

from __future__ import annotations

import socket
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.rawio import END_OF_STREAM, ReadPoller, read_ready

SOCKETS = 3

operations = st.lists(
    st.tuples(
        st.sampled_from(["park", "send", "hand_back", "cancel", "bug"]),
        st.integers(0, SOCKETS - 1),
        st.binary(min_size=1, max_size=40),
    ),
    max_size=40,
)


class Reader:
    """Reads what the poller finds into ``got``; raises once when told to (a bug)."""

    def __init__(self, poller: ReadPoller) -> None:
        self.poller = poller
        self.got = bytearray()
        self.explode = False

    def read_parked(self, fd: int) -> None:
        if self.explode:
            self.explode = False
            raise RuntimeError("a bug in read_parked")
        data = read_ready(self.poller, fd)
        if data is not None:
            self.got += data


@settings(max_examples=60, deadline=None)
@given(operations)
def test_the_poller_matches_its_model(ops: list[tuple[str, int, bytes]]) -> None:
    async def main() -> None:
        poller = ReadPoller()
        pairs = [socket.socketpair() for _ in range(SOCKETS)]
        for ours, _peer in pairs:
            ours.setblocking(False)
        readers = [Reader(poller) for _ in range(SOCKETS)]
        sent = [bytearray() for _ in range(SOCKETS)]
        outcomes: list[list[Any]] = [[] for _ in range(SOCKETS)]
        scopes: dict[int, trio.CancelScope] = {}
        parked: set[int] = set()  # the model

        async def park(i: int, task_status: trio.TaskStatus[None]) -> None:
            with trio.CancelScope() as scope:
                scopes[i] = scope
                task_status.started()
                outcomes[i].append(await poller.wait(readers[i], pairs[i][0].fileno()))
            scopes.pop(i, None)
            parked.discard(i)

        polling = trio.CancelScope()

        async def run_poller() -> None:
            with polling:
                await poller.run()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_poller)
            for op, i, data in ops:
                if op == "park" and i not in parked:
                    parked.add(i)
                    await nursery.start(park, i)
                elif op == "send":
                    pairs[i][1].sendall(data)
                    sent[i] += data
                elif op == "hand_back" and i in parked:
                    poller.hand_back(pairs[i][0].fileno(), "back")
                elif op == "cancel" and i in parked:
                    scopes[i].cancel()
                elif op == "bug" and i in parked:
                    readers[i].explode = True
                    pairs[i][1].sendall(data)
                    sent[i] += data
                await trio.testing.wait_all_tasks_blocked()
                assert {poller.parked[fd].reader for fd in poller.parked} == {
                    readers[j] for j in parked
                }
            # Every reader parked again: all that was sent is read, in order.
            for i in range(SOCKETS):
                if i not in parked:
                    parked.add(i)
                    await nursery.start(park, i)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(SOCKETS):
                # what a bug left unread is read once the reader parks again
                assert bytes(readers[i].got) == bytes(sent[i])
            polling.cancel()  # the poller alone stops: it hands every reader back
        assert poller.closed and poller.parked == {} and poller.epoll.closed
        for i in range(SOCKETS):
            # the last wait of each ended with the poller's stop (None)
            assert outcomes[i] and outcomes[i][-1] is None
            assert all(o is None or o == "back" or isinstance(o, RuntimeError) for o in outcomes[i])
        for ours, peer in pairs:
            ours.close()
            peer.close()

    trio.run(main)


def test_a_socket_closed_while_parked_does_not_strand_its_reader() -> None:
    """The owner's rule broken (a socket closed while its reader waits): a new socket with
    the same number, parked, ends the stale reader's wait instead of stranding it."""

    async def main() -> None:
        poller = ReadPoller()
        first, first_peer = socket.socketpair()
        outcome: list[Any] = []

        async def wait(sock: socket.socket, reader: Reader) -> None:
            outcome.append(await poller.wait(reader, sock.fileno()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            fd = first.fileno()
            nursery.start_soon(wait, first, Reader(poller))
            await trio.testing.wait_all_tasks_blocked()
            first.close()  # (without a hand-back)
            second, second_peer = socket.socketpair()
            if second.fileno() != fd:  # (the number is not ours to pick; usually it is)
                second, second_peer = second_peer, second
            nursery.start_soon(wait, second, Reader(poller))
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == [END_OF_STREAM] or second.fileno() != fd
            nursery.cancel_scope.cancel()
        for sock in (first_peer, second, second_peer):
            sock.close()

    trio.run(main)
