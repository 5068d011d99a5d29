"""The client library's read poller: every connection of a Trio run waits for its replies in
one poller (``cluster.client._run_poller``), which reads and hands them out; a connection
leaves it however it ends, and a push callback's bug still ends its client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster import client as client_module
from cluster.client import Client, ConnectionLost
from cluster.codec import FrameDecoder, encode
from cluster.node import Node

pytestmark = pytest.mark.timeout(60)

AT = "2099-01-01T00:00:00Z"
WHO: ContextVar[str] = ContextVar("who", default="nobody")


def spec(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "schedule": {"at": AT}, "task": {"payload": {}}}


def test_the_clients_of_a_run_share_one_poller_that_reads_their_replies(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    async def main() -> None:
        node = Node(tmp_path / "data", shards=2)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(node.run)

            async def one(c: int) -> None:
                async with Client.connect("127.0.0.1", port) as client:
                    for n in range(25):
                        created = await client.create(spec(f"p{c}-{n}"))
                        assert created["job_id"] == f"p{c}-{n}"

            async with trio.open_nursery() as clients:
                for c in range(6):
                    clients.start_soon(one, c)
            poller = client_module._RUN_POLLER.get()
            assert poller is not None
            seen["reads"] = poller.reads
            seen["parked"] = dict(poller.parked)  # every client closed: none left parked
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen["reads"] >= 6 * 25
    assert seen["parked"] == {}


async def _serve_once(
    listeners: list[trio.SocketListener], handler: Any, task_status: trio.TaskStatus[int]
) -> None:
    (listener,) = listeners
    task_status.started(listener.socket.getsockname()[1])
    stream = await listener.accept()
    async with stream:
        try:
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # (the client under test went away first)


async def _requests(stream: trio.SocketStream) -> AsyncIterator[dict[str, Any]]:
    """The requests a test server reads from ``stream``, until its end."""
    decoder = FrameDecoder()
    while data := await stream.receive_some(65536):
        decoder.feed(data)
        while (event := decoder.next_event()) is not None:
            assert isinstance(event, dict)
            yield event


class Boom(Exception):
    pass


class BoomExit(SystemExit):  # (a BaseException: escaping a system task, it crashed the run)
    pass


@pytest.mark.parametrize("raised", [Boom, BoomExit])
def test_a_push_callback_that_raises_ends_its_client_with_that_error(
    raised: type[BaseException],
) -> None:
    """As when its reader task read the push itself: the exception leaves the client's
    block, and nothing of it escapes into the run's poller (the other client goes on)."""
    seen: list[str] = []

    async def push_then_answer(stream: trio.SocketStream) -> None:
        async for request in _requests(stream):
            if request["op"] == "go":
                await stream.send_all(encode({"push": "boom"}))
            await stream.send_all(encode({"id": request["id"], "ok": True, "result": {}}))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ports = []
            for _ in range(2):
                listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
                ports.append(await nursery.start(_serve_once, listeners, push_then_answer))
            async with Client.connect("127.0.0.1", ports[1], reconnect=False) as other:
                token = WHO.set("the caller")
                with pytest.raises(raised):
                    async with Client.connect("127.0.0.1", ports[0], reconnect=False) as bad:

                        def on_push(message: dict[str, Any]) -> None:
                            # run in the context of whoever connected, not the poller's
                            seen.append(WHO.get())
                            raise raised(message["push"])

                        bad.on_push = on_push
                        await bad.request("go", {})
                        await trio.sleep(5)  # (the push's error ends the block first)
                WHO.reset(token)
                # the other client, on the same poller, still works
                assert await other.request("ping", {}) == {}
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen == ["the caller"]


def test_a_connection_the_peer_closes_leaves_the_poller_and_fails_its_requests() -> None:
    async def close_at_once(stream: trio.SocketStream) -> None:
        async for _request in _requests(stream):
            return  # closes without an answer

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = await nursery.start(_serve_once, listeners, close_at_once)
            async with Client.connect("127.0.0.1", port, reconnect=False) as client:
                with pytest.raises(ConnectionLost):
                    await client.request("ping", {}, timeout_s=10)
                poller = client_module._RUN_POLLER.get()
                assert poller is not None and poller.parked == {}
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_closed_while_its_reader_waits_leaves_nothing_parked() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = await nursery.start(_serve_once, listeners, silent)
            async with Client.connect("127.0.0.1", port, reconnect=False) as client:
                poller = client_module._RUN_POLLER.get()
                while poller is None or not poller.parked:
                    await trio.sleep(0.01)
                    poller = client_module._RUN_POLLER.get()
                await client.aclose()
            await trio.sleep(0.05)
            assert poller.parked == {}
            nursery.cancel_scope.cancel()

    trio.run(main)
