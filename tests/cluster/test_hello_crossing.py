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

import trio

from cluster.client import Client
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.runs import FINAL_VALUES
from tests.cluster.procs import NodeProc
from tests.cluster.test_node_processes import in_s

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
