"""After an outage longer than its lease, a worker keeps the runs the node hands it at once.

Found by the fifth adversarial pass: after a 75 s node outage (the worker had fenced, its
deadline long past), the node's dispatches on the new connection arrived before the answer to
the worker's hello (that answer waits for a durable batch; dispatches do not), and starting
the first task woke the fence timer with the stale deadline: the worker killed the runs it had
just been given (at-most-once: LOST; at-least-once: run again). A push on a connection opened
by a hello is made after the node took that hello, so it acknowledges it.

A scripted node over a real socket makes the order certain: it answers the first connection's
hello, drops the connection once the worker's deadline has passed, and on the second
connection sends a dispatch before answering the hello.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio

from cluster.codec import FrameDecoder, encode
from cluster.worker import WorkerAgent
from engine.effects import RunTicket

pytestmark = pytest.mark.timeout(60)

#: the worker fences 1 s after the last acknowledged send (max(lease - 2 s, lease / 2)): the
#: handler's 0.3 s after a dispatch 0.2 s ahead of the hello's answer leaves 0.7 s of it for a
#: loaded machine's stalls (with 1 s of lease, 0.2 s)
LEASE_MS = 2_000


def dispatch(run_id: str) -> dict[str, Any]:
    return {
        "push": "dispatch",
        "shard": 0,
        "seq": 1,
        "run": {
            "run_id": run_id,
            "job_id": run_id.split("@")[0],
            "scheduled_ms": 1,
            "attempt": 1,
            "token": 1 << 32 | 1,
            "version": 1,
            "delivery": "at_most_once",
            "tier": "default",
            "timeout_ms": None,
            "on_timeout": "kill",
            "task": {"payload": 1},
        },
    }


class ScriptedNode:
    """Connections are told apart by their hello: the worker probes the port once before
    its first connection (a connection that says nothing)."""

    def __init__(self) -> None:
        self.greeted = 0  # connections that said hello
        self.finished: list[dict[str, Any]] = []
        self.dropped = trio.Event()

    async def serve(self, stream: trio.SocketStream) -> None:
        decoder = FrameDecoder(1 << 20)
        first: bool | None = None  # the first connection to say hello
        async with trio.open_nursery() as nursery:

            async def drop_later() -> None:
                # past the worker's deadline: it must be stale when the node comes back
                await trio.sleep(LEASE_MS / 1000 * 1.5)
                self.dropped.set()
                await stream.aclose()

            try:
                while True:
                    data = await stream.receive_some()
                    if not data:
                        break
                    decoder.feed(data)
                    while (msg := decoder.next_event()) is not None:
                        if first is None and msg.get("op") == "worker.hello":
                            self.greeted += 1
                            first = self.greeted == 1
                            if first:
                                nursery.start_soon(drop_later)
                        await self.answer(stream, msg, bool(first))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

    async def answer(self, stream: trio.SocketStream, msg: Any, first: bool) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if op == "worker.hello":
            if not first:
                await stream.send_all(encode(dispatch("job@1")))
                await trio.sleep(0.2)  # the hello's answer waits for its durable batch
            result: Any = {"lease_ms": LEASE_MS, "shards": 1}
        elif op in ("worker.finished", "worker.finished_many"):
            self.finished += msg["args"].get("reports", [msg["args"]])
            result = {"results": []} if op == "worker.finished_many" else {}
        else:
            if op == "worker.heartbeat" and first:
                return  # never answered on the first connection: the deadline goes stale
            result = {}
        if rid is not None:
            await stream.send_all(encode({"id": rid, "ok": True, "result": result}))


def test_a_dispatch_before_the_hellos_answer_is_not_killed_by_a_stale_fence() -> None:
    node = ScriptedNode()
    cancelled: list[str] = []

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        try:
            await trio.sleep(0.3)
        except trio.Cancelled:
            cancelled.append(ticket.run_id)
            raise
        return 0

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                partial(trio.serve_tcp, node.serve, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            agent = WorkerAgent(
                "127.0.0.1", port, worker_id="w-outage", payload_handler=handler, watchdog=False
            )
            await nursery.start(agent.run)
            with trio.fail_after(30):
                await node.dropped.wait()
                while not node.finished and not cancelled:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert cancelled == []
        assert [(r["run_id"], r["outcome"]) for r in node.finished] == [("job@1", "success")]

    trio.run(main)
