"""A real node and worker: a task that runs on after timing out under ``on_timeout=mark`` is
followed to its end by ``follow_logs`` and stopped by ``job.cancel --stop-running``; a trigger
whose target does not exist is said in the node's log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cluster.client import Client
from tests.cluster.procs import NodeProc, WorkerProc, in_s, wait_until, with_client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node(tmp_path: Path) -> Any:
    proc = NodeProc(tmp_path / "data", tmp_path / "node.log")
    yield proc
    proc.kill()


def marked_run(port: int, job_id: str) -> dict[str, Any] | None:
    """The job's run once it is TIMED_OUT with its task still running under mark."""

    async def body(c: Client) -> dict[str, Any] | None:
        runs = await c.history(job_id)
        if runs and runs[0]["state"] == "TIMED_OUT":
            return await c.run(runs[0]["run_id"])
        return None

    return with_client(port, body)


def test_follow_goes_on_while_a_marked_task_still_runs(tmp_path: Path, node: NodeProc) -> None:
    worker = WorkerProc(node.port, tmp_path / "worker.log")
    try:
        # The node's timeout is start + 1 s + its grace (5 s): the task outlasts it by ~3 s.
        with_client(
            node.port,
            lambda c: c.create(
                {
                    "id": "mk",
                    "schedule": in_s(0.5),
                    "task": {"shell": "echo start; sleep 9; echo finished"},
                    "timeout": "1s",
                    "on_timeout": "mark",
                }
            ),
        )
        run = wait_until(lambda: marked_run(node.port, "mk"), timeout=30)
        assert run["marked_running"] is True  # run.get says so

        async def follow(c: Client) -> bytes:
            out: list[bytes] = []
            async for chunk in c.follow_logs(run["run_id"], poll_s=0.1):
                out.append(chunk["data"])
            return b"".join(out)

        assert with_client(node.port, follow) == b"start\nfinished\n"

        async def get(c: Client) -> dict[str, Any]:
            return await c.run(run["run_id"])

        after = with_client(node.port, get)
        assert after["state"] == "TIMED_OUT" and "marked_running" not in after
    finally:
        worker.terminate()


def test_cancel_stop_running_stops_a_marked_task(tmp_path: Path, node: NodeProc) -> None:
    worker = WorkerProc(node.port, tmp_path / "worker.log")
    pid_file = tmp_path / "task.pid"
    try:
        with_client(
            node.port,
            lambda c: c.create(
                {
                    "id": "mk2",
                    "schedule": in_s(0.5),
                    "task": {"shell": f"echo $$ > {pid_file}; sleep 60; echo survived"},
                    "timeout": "1s",
                    "on_timeout": "mark",
                }
            ),
        )
        wait_until(lambda: marked_run(node.port, "mk2"), timeout=30)
        pid = int(pid_file.read_text())
        os.kill(pid, 0)  # still running after the timeout: that is what mark means
        with_client(node.port, lambda c: c.cancel("mk2", stop_running=True))

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        assert wait_until(gone, timeout=20)
    finally:
        worker.terminate()


def test_a_trigger_of_a_missing_job_is_logged(tmp_path: Path, node: NodeProc) -> None:
    worker = WorkerProc(node.port, tmp_path / "worker.log")
    try:
        with_client(
            node.port,
            lambda c: c.create(
                {
                    "id": "trg-missing",
                    "schedule": in_s(0.5),
                    "task": {"shell": "sleep 30"},
                    "timeout": "1s",
                    "on_timeout": "trigger:does-not-exist",
                }
            ),
        )
        log = tmp_path / "node.log"
        assert wait_until(
            lambda: "trigger of does-not-exist from trg-missing@" in log.read_text(), timeout=30
        )
    finally:
        worker.terminate()
