"""``tickwheel logs`` of a run that ran more than once (a real node process on 127.0.0.1, the
CLI as a subprocess, a payload worker in the test's own Trio run): each attempt's output is
marked, so that a retried run's attempts never read as one."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from cluster.client import Client
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.schedules import format_utc
from tests.cluster.procs import NodeProc, with_client
from tests.cluster.test_cli import cli

pytestmark = pytest.mark.timeout(120)


def run_twice(node: NodeProc, job_id: str, tail: bytes) -> str:
    """A payload job whose first attempt writes to both streams and fails, and whose second
    writes ``tail`` to stdout and succeeds; returns its run id once final."""

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        if ticket.attempt == 1:
            await out("stdout", b"connecting\n")
            await out("stderr", b"refused\n")
            await out("stdout", b"no newline")  # the marker must still start its own line
            return 1
        await out("stdout", tail)
        return 0

    async def body(client: Client) -> str:
        agent = WorkerAgent(
            "127.0.0.1", node.port, worker_id="w-att", tiers=(job_id,), payload_handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            at = format_utc(int(time.time() * 1000) + 200)
            await client.create(
                {
                    "id": job_id,
                    "schedule": {"at": at},
                    "task": {"payload": {}},
                    "tier": job_id,
                    "retries": {"max": 1, "backoff": "200ms"},
                }
            )
            for _ in range(400):
                runs = await client.history(job_id)
                if runs and runs[0]["state"] == "SUCCESS":
                    nursery.cancel_scope.cancel()
                    assert runs[0]["attempt"] == 2
                    return str(runs[0]["run_id"])
                await trio.sleep(0.05)
            raise AssertionError(f"{job_id}: no successful second attempt in 20 s")

    return with_client(node.port, body)


def test_logs_of_a_retried_run_mark_where_each_attempt_begins(tmp_path: Path) -> None:
    """Found by the fifth adversarial pass: plain ``logs`` ran the attempts' output together."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        run_id = run_twice(node, "retried", b"connected\n")
        for follow in ((), ("--follow",)):
            done = cli(node, "logs", run_id, *follow)
            assert done.returncode == 0, done.stderr
            # attempt 1 gets no marker (a run that ran once prints its output alone)
            assert done.stdout == "connecting\nno newline\n--- attempt 2 ---\nconnected\n"
            assert done.stderr == "refused\n"
        # --json is unchanged: each chunk has its attempt, and no marker is added
        lines = [
            json.loads(line) for line in cli(node, "logs", run_id, "--json").stdout.splitlines()
        ]
        assert [(c["stream"], c["attempt"]) for c in lines] == [
            ("stdout", 1),
            ("stderr", 1),
            ("stdout", 1),
            ("stdout", 2),
        ]
    finally:
        node.terminate()


def test_a_cut_marker_is_no_attempt_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``cut`` chunk carries attempt 0: the printer took it for an attempt, and a run that
    ran once, its output cut, printed "--- attempt 0 ---" and "--- attempt 1 ---" around
    the marker (found by review)."""
    from cluster.commands import LogPrinter

    def chunk(stream: str, attempt: int, data: bytes = b"", dropped: int = 0) -> dict[str, object]:
        return {"seq": 1, "stream": stream, "attempt": attempt, "data": data, "dropped": dropped}

    printer = LogPrinter(as_json=False)
    for one in (
        chunk("stdout", 1, b"head\n"),
        chunk("cut", 0, dropped=10),
        chunk("stdout", 1, b"tail\n"),
        chunk("cut", 0, dropped=5),
        chunk("stdout", 2, b"again\n"),
    ):
        printer.chunk(one)
    printer.close()
    assert capsys.readouterr().out == (
        "head\n\n[... 10 bytes cut ...]\ntail\n\n[... 5 bytes cut ...]\n--- attempt 2 ---\nagain\n"
    )
    # (a log whose first chunk is a marker, as retention leaves one: the marker alone)
    printer = LogPrinter(as_json=False)
    printer.chunk(chunk("cut", 0, dropped=7))
    printer.close()
    assert capsys.readouterr().out == "\n[... 7 bytes cut ...]\n"
