"""A worker's graceful stop and its command line, with real processes: a real node, a real
``tickwheel worker`` process running real tasks, stopped by SIGTERM (a rolling restart)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.client import Client
from tests.cluster.procs import NodeProc, WorkerProc, in_s, wait_until, with_client

pytestmark = pytest.mark.timeout(120)


class Worker(WorkerProc):
    """``tickwheel worker`` ``ws`` with 4 slots and the options given (``--drain`` among
    them)."""

    def __init__(self, port: int, log: Path, *extra: str) -> None:
        super().__init__(port, log, *extra, slots=4, worker_id="ws")


def create(port: int, *specs: dict[str, Any]) -> None:
    async def body(c: Client) -> None:
        for spec in specs:
            await c.create(spec)

    with_client(port, body)


def runs_of(port: int, job_id: str) -> list[dict[str, Any]]:
    async def body(c: Client) -> list[dict[str, Any]]:
        return await c.history(job_id, last=10)

    return with_client(port, body)


def state(port: int, job_id: str) -> tuple[str, int] | None:
    runs = runs_of(port, job_id)
    return (runs[0]["state"], runs[0]["attempt"]) if runs else None


def logs(port: int, run_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "logs", run_id, "--connect", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout + done.stderr


@pytest.fixture
def node(tmp_path: Path) -> Any:
    # A 5 s lease (reattach grace 10 s): the outcomes below come from the worker's reports,
    # not from its lease lapsing while the test looks.
    proc = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="5s")
    yield proc
    proc.kill()


def _running(port: int, *job_ids: str) -> bool:
    return all(state(port, j) == ("RUNNING", 1) for j in job_ids)


def test_sigterm_drains_then_reports_what_it_stops(tmp_path: Path, node: NodeProc) -> None:
    """A task that ends within the drain is reported as usual (SUCCESS, not killed); one still
    running after it is stopped and reported: at-most-once FAILED (killed), not LOST;
    at-least-once handed back, out again at once as attempt 2 (not FAILED, not waiting for
    the lease). The worker exits 0 once the node has all that."""
    worker = Worker(node.port, tmp_path / "worker.log", "--drain", "3s")
    try:
        create(
            node.port,
            {
                "id": "quick",
                "schedule": in_s(1),
                "task": {"shell": "sleep 2; echo quick-done"},
                "delivery": "at_most_once",
            },
            {
                "id": "amo",
                "schedule": in_s(1),
                "task": {"shell": "echo amo-start; exec sleep 60"},
                "delivery": "at_most_once",
            },
            {
                "id": "alo",
                "schedule": in_s(1),
                "task": {"shell": "echo alo-start; exec sleep 60"},
                "delivery": "at_least_once",
            },
        )
        wait_until(lambda: _running(node.port, "quick", "amo", "alo"))
        stopped_at = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(60) == 0, worker.text()
        took = time.monotonic() - stopped_at
        assert state(node.port, "quick") == ("SUCCESS", 1), worker.text()
        amo = runs_of(node.port, "amo")[0]
        assert (amo["state"], amo["attempt"]) == ("FAILED", 1), (amo, worker.text())
        assert "killed" in (amo.get("why") or ""), amo
        assert "the worker is stopping" in logs(node.port, amo["run_id"])
        # At once: attempt 2 is waiting for a worker well before the lease (5 s) could lapse
        # after the worker's exit (a node-side requeue, not a report).
        alo = runs_of(node.port, "alo")[0]
        assert alo["attempt"] == 2 and alo["state"] == "PENDING", (alo, worker.text())
        assert took >= 3  # the drain was waited out for the tasks still running
        text = worker.text()
        assert "stopping: no new runs" in text and "drain over: stopping 2 runs" in text
    finally:
        worker.kill()


def test_a_second_sigterm_skips_the_drain(tmp_path: Path, node: NodeProc) -> None:
    worker = Worker(node.port, tmp_path / "worker.log", "--drain", "10m")
    try:
        create(
            node.port,
            {
                "id": "amo2",
                "schedule": in_s(1),
                "task": {"shell": "exec sleep 60"},
                "delivery": "at_most_once",
            },
        )
        wait_until(lambda: _running(node.port, "amo2"))
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "stopping: no new runs" in worker.text())
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(60) == 0, worker.text()
        assert state(node.port, "amo2") == ("FAILED", 1)
        assert "drain cut short" in worker.text()
    finally:
        worker.kill()


def test_a_stopping_worker_takes_no_new_run(tmp_path: Path, node: NodeProc) -> None:
    """While it drains, runs that come due go to no one (0 free slots): they wait for
    another worker, attempt 1."""
    worker = Worker(node.port, tmp_path / "worker.log", "--drain", "8s")
    try:
        create(
            node.port,
            {"id": "long", "schedule": in_s(1), "task": {"shell": "sleep 6"}},
        )
        wait_until(lambda: _running(node.port, "long"))
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "stopping: no new runs" in worker.text())
        create(node.port, {"id": "late", "schedule": in_s(0.5), "task": {"shell": "true"}})
        assert worker.proc.wait(60) == 0, worker.text()
        assert state(node.port, "long") == ("SUCCESS", 1)
        assert state(node.port, "late") == ("PENDING", 1)
    finally:
        worker.kill()


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", "worker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--connect", "nohost"], "--connect: not HOST:PORT"),
        (["--connect", "127.0.0.1:1", "--tier", ""], "--tier"),
        (["--connect", "127.0.0.1:1", "--drain", "soon"], "--drain"),
    ],
)
def test_command_line_mistakes_are_one_line_and_status_2(args: list[str], says: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr


def test_a_node_out_of_reach_is_logged_then_given_up(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _cli("--connect", f"127.0.0.1:{port}", "--connect-timeout", "3s")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("cannot connect to") >= 2  # each attempt, then the give-up
    assert "gave up after" in done.stderr.splitlines()[-1]


def _agent_case(port: int, body: Any) -> Any:
    """Runs ``body(agent, started)`` next to a library worker whose payload handler waits
    (``started`` is set at each handler's start)."""
    import trio

    from cluster.worker import WorkerAgent

    async def main() -> Any:
        started = trio.Event()

        async def handler(ticket: Any, out: Any) -> int:
            started.set()
            await out("stdout", b"payload-start\n")
            await trio.sleep(60)
            return 0

        agent = WorkerAgent("127.0.0.1", port, worker_id="lib", slots=2, payload_handler=handler)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                result = await body(agent, started)
                nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


def test_a_library_worker_stops_with_stop(node: NodeProc) -> None:
    """``await agent.stop(drain_s)``: the payload handler is cancelled after the drain, its
    at-most-once run reported killed (FAILED, not LOST), and :meth:`run` ends."""
    import trio

    async def body(agent: Any, started: Any) -> bool:
        async with Client.connect("127.0.0.1", node.port) as c:
            await c.create(
                {
                    "id": "pay",
                    "schedule": in_s(0.5),
                    "task": {"payload": {"x": 1}},
                    "delivery": "at_most_once",
                }
            )
        await started.wait()
        ok: bool = await agent.stop(drain_s=0.5)
        await trio.sleep(0)
        return ok

    assert _agent_case(node.port, body) is True
    assert state(node.port, "pay") == ("FAILED", 1)


def test_dispatches_crossing_the_stop_are_never_started(node: NodeProc) -> None:
    """Dispatches that arrive once the worker is stopping (they crossed its ``worker.pull``
    of 0 slots; here the pull is held back so that they surely cross it) never start: the
    at-most-once one is reported killed (FAILED), the at-least-once one handed back (out
    again as attempt 2, which no one takes: the hello said 0 free slots; or, if that hello
    came first, never sent at all)."""
    import trio

    async def body(agent: Any, started: Any) -> None:
        agent.stopping = True  # as stop() does first, minus the worker.pull
        async with Client.connect("127.0.0.1", node.port) as c:
            for job_id, delivery in (("x-amo", "at_most_once"), ("x-alo", "at_least_once")):
                await c.create(
                    {
                        "id": job_id,
                        "schedule": in_s(0.5),
                        "task": {"payload": {"x": 1}},
                        "delivery": delivery,
                    }
                )
            for _ in range(300):
                amo = await c.history("x-amo", last=1)
                alo = await c.history("x-alo", last=1)
                if (
                    amo
                    and amo[0]["state"] == "FAILED"
                    and alo
                    and (alo[0]["state"], alo[0]["attempt"]) == ("PENDING", 2)
                ):
                    break
                if amo and amo[0]["state"] == "FAILED" and alo and not agent.held:
                    # The at-least-once run was never dispatched: the hello that turned the
                    # other away (0 free slots) came first. Still never started: fine.
                    break
                await trio.sleep(0.1)
        assert not started.is_set()  # no handler ever ran

    _agent_case(node.port, body)
    assert state(node.port, "x-amo") == ("FAILED", 1)
    assert state(node.port, "x-alo") in (("PENDING", 2), ("PENDING", 1))  # never FAILED
