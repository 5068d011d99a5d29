"""A worker's hellos crossing the node's dispatches, with real processes on 127.0.0.1.

A worker says hello again after a fence, a ``refused`` push or ``not_a_worker``; its hello
lists the runs it holds as it leaves. A dispatch on its way at that moment is not listed. The
node used to take such a run as lost: an at-least-once run went out a second time while the
worker ran the first dispatch too (found by the third adversarial pass: 11-19 of ~50,000 runs
under SIGKILLs), and an at-most-once run could become LOST unexecuted. The hello now says
which dispatches the worker had (``instance``, ``seen``), and the node sends the others again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.runs import FINAL_VALUES
from tests.cluster.procs import NodeProc, in_s

JOBS = 400


def test_hellos_crossing_dispatches_neither_repeat_nor_lose_a_run(tmp_path: Path) -> None:
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", shards=2, lease="5s")
    executed: Counter[str] = Counter()
    attempts: set[int] = set()
    try:

        async def handler(ticket: RunTicket, out: Any) -> int:
            executed[ticket.run_id] += 1
            attempts.add(ticket.attempt)
            await trio.sleep(0.02)  # held a moment: many runs out while hellos leave
            return 0

        async def main() -> list[dict[str, Any]]:
            agent = WorkerAgent(
                "127.0.0.1", node.port, worker_id="w", slots=32, payload_handler=handler
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                async with Client.connect("127.0.0.1", node.port) as client:
                    due = in_s(1.5)
                    specs = [
                        {
                            "id": f"j{i}",
                            "schedule": due,
                            "delivery": "at_most_once" if i % 2 else "at_least_once",
                            "task": {"payload": i},
                        }
                        for i in range(JOBS)
                    ]
                    await client.create_many(specs)
                    hellos = 0
                    with trio.fail_after(60):
                        while sum(executed.values()) < JOBS:
                            agent._greet_again()  # one at a time, as a fence's or a refusal's
                            hellos += 1
                            await trio.sleep(0.001)
                        await trio.sleep(1.0)  # a second dispatch would have come by now
                        runs: list[dict[str, Any]] = []
                        for i in range(JOBS):
                            while True:
                                (run,) = await client.history(f"j{i}", last=5)
                                if run["state"] in FINAL_VALUES:
                                    break
                                await trio.sleep(0.05)
                            runs.append(run)
                    assert hellos > 100
                nursery.cancel_scope.cancel()
            return runs

        runs = trio.run(main)
    finally:
        node.terminate()
    assert len(executed) == JOBS
    assert max(executed.values()) == 1, [rid for rid, n in executed.items() if n > 1]
    assert attempts == {1}
    assert Counter(r["state"] for r in runs) == {"SUCCESS": JOBS}


def test_seen_names_shards_the_node_may_not_have_and_repeats_take_no_slot(
    tmp_path: Path,
) -> None:
    """A worker that heard an earlier node at this address (more shards) still gets in; a
    malformed entry is a typed error; a repeated dispatch leaves the worker's free slots."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", shards=2)
    try:

        async def main() -> None:
            async with Client.connect("127.0.0.1", node.port) as client:
                hello = {"worker_id": "w", "tiers": ["default"], "slots": 2, "instance": "p"}
                result = await client.request("worker.hello", {**hello, "seen": [[5, 99]]})
                assert result["shards"] == 2
                await client.request("worker.heartbeat", {"held": [], "seen": [[7, 1]]})
                with pytest.raises(RemoteError) as refused:
                    await client.request("worker.hello", {**hello, "seen": [[0, -1]]})
                assert (refused.value.code, refused.value.field) == ("bad_args", "seen[0]")

        trio.run(main)
    finally:
        node.terminate()


def test_a_repeated_dispatch_takes_no_free_slot(tmp_path: Path) -> None:
    from cluster.node import Node, WorkerSession
    from engine.effects import Dispatch

    pushed: list[dict[str, Any]] = []

    class _Conn:
        worker = None

        def send(self, message: dict[str, Any]) -> None:
            pushed.append(message)

    node = Node(tmp_path / "data", shards=1)
    session = WorkerSession("w", ("default",), 3, _Conn())  # type: ignore[arg-type]
    node.workers["w"] = session
    ticket = RunTicket("j@1", "j", 1, 1, 5, 1, "at_least_once", "default", None, {}, "kill")
    assert node.dispatch(0, Dispatch("w", ticket, 11)) and session.free == 2
    assert not node.dispatch(0, Dispatch("w", ticket, 12, again=True)) and session.free == 2
    assert [(m["seq"], m["shard"]) for m in pushed] == [(11, 0), (12, 0)]
