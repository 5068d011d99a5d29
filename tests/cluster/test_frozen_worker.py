"""A frozen worker's tasks do not outlive its lease: its guard fences them.

A worker process that is stopped (SIGSTOP here; likewise one whose event loop a payload handler
blocks with synchronous code) cannot heartbeat, nor fence itself: its tasks, each in a process
group of its own, ran on past the lease, beside the attempt the node handed out again (found by
review). The guard, a process of its own, holds the fence deadline the worker's acknowledged
heartbeats move (engine.lease.guard_fence_at) and kills the tasks when it passes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.procs import NodeProc, WorkerProc, in_s, wait_until, with_client
from tests.cluster.test_runner import wait_dead

pytestmark = pytest.mark.timeout(90)


def test_a_frozen_workers_tasks_are_killed_by_its_guard_and_it_carries_on(tmp_path: Path) -> None:
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="1s")
    worker = None
    pidfile = tmp_path / "task.pid"
    task_pids: list[int] = []
    try:
        worker = WorkerProc(node.port, tmp_path / "worker.log", slots=1)

        async def create(client: Any) -> None:
            await client.create(
                {
                    "id": "long",
                    "schedule": in_s(0.3),
                    "task": {"shell": f"echo $$ > {pidfile}; exec sleep 60"},
                }
            )

        async def history(client: Any) -> list[dict[str, Any]]:
            return list(await client.history("long", last=5))

        with_client(node.port, create)
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=15)
        task_pids.append(int(pidfile.read_text()))
        pidfile.unlink()
        os.kill(worker.proc.pid, signal.SIGSTOP)  # the worker process only, not its guard
        time.sleep(3.0)  # three leases: the guard's deadline (0.75 s after the last ack) passed
        # (and waits on, the worker still stopped: a SIGKILLed task is not gone the instant
        # the guard's kill returns, and a loaded machine may run the guard late)
        still = not wait_dead(task_pids[0], within_s=10)
        os.kill(worker.proc.pid, signal.SIGCONT)
        assert not still, f"3 s into a 1 s lease, attempt 1 (pid {task_pids[0]}) still runs"
        # The worker runs again: it finds its task gone, says hello, and takes attempt 2.
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=20)
        task_pids.append(int(pidfile.read_text()))
        runs = with_client(node.port, history)
        assert (runs[0]["state"], runs[0]["attempt"]) in (("RUNNING", 2), ("CLAIMED", 2))
        assert worker.proc.poll() is None
        assert "passed its fence deadline" in (tmp_path / "worker.log").read_text()
    finally:
        if worker is not None:
            try:
                os.kill(worker.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            worker.kill()
        for pid in task_pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.kill()
