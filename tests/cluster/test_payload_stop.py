"""A payload handler that is stopped is not a success, whatever it returns.

A handler that catches the Cancelled of a stop (a graceful stop, the node's kill) and returns
0 was reported ``success`` (found by review): for a process, a stop by the runner wins over
the exit status (runner.decide_outcome), and so it does for a handler's timeout; now for its
stop too. A stopped at-least-once run is handed back (PENDING again, a new attempt), as a
stopped process is, instead of SUCCESS and never run again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from cluster.client import Client
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from tests.cluster.test_node_inprocess import run_with_node, soon

pytestmark = pytest.mark.timeout(60)

Out = Callable[[str, bytes], Awaitable[None]]


def test_a_stopped_handler_that_swallows_its_cancellation_is_not_a_success(
    tmp_path: Path,
) -> None:
    started = trio.Event()

    async def handler(ticket: RunTicket, out: Out) -> int:
        started.set()
        try:
            await trio.sleep(60)
        except trio.Cancelled:  # "clean up and say all is well"
            return 0
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent(
            "127.0.0.1", port, worker_id="w-swallow", payload_handler=handler, kill_grace_s=0.2
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create({"id": "alo", "schedule": soon(0.1), "task": {"payload": 1}})
            await started.wait()
            await agent.stop(drain_s=0.1, ack_timeout_s=2)
            await trio.sleep(0.5)
            runs = await client.history("alo", last=10)
            nursery.cancel_scope.cancel()
        assert [(r["state"], r["attempt"]) for r in runs] == [("PENDING", 2)], runs

    run_with_node(tmp_path, body)
