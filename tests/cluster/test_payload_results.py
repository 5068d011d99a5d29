"""What a payload handler returns becomes its run's known outcome, whatever it is.

Found by the fifth adversarial pass: a handler returning ``True`` or ``0.0`` had its final
report refused by the node as malformed, so the worker dropped the run unreported and the node
took it for lost (at-least-once: out again, forever; at-most-once: LOST although the outcome
was known); one returning ``2**70`` could not be encoded and ended the whole agent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from cluster.client import Client, RequestNotSendable
from cluster.worker import (
    PAYLOAD_EXIT_MAX,
    PAYLOAD_EXIT_MIN,
    WorkerAgent,
    payload_chunk,
    payload_outcome,
)
from engine.effects import RunTicket
from tests.cluster.test_node_inprocess import run_with_node, settle, soon

pytestmark = pytest.mark.timeout(60)

Out = Callable[[str, bytes], Awaitable[None]]


@given(st.integers(PAYLOAD_EXIT_MIN, PAYLOAD_EXIT_MAX))
def test_an_int_within_32_bits_is_the_exit_code(code: int) -> None:
    outcome, exit_code, complaint = payload_outcome(code)
    assert (outcome, exit_code, complaint) == ("success" if code == 0 else "failed", code, None)


@given(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True),
        st.text(),
        st.integers().filter(lambda n: not PAYLOAD_EXIT_MIN <= n <= PAYLOAD_EXIT_MAX),
        st.lists(st.integers(), max_size=3),
    )
)
def test_anything_else_fails_the_run_with_a_complaint(result: object) -> None:
    outcome, exit_code, complaint = payload_outcome(result)
    assert (outcome, exit_code) == ("failed", None)
    assert complaint is not None and "expected an int exit code" in complaint
    assert len(complaint) < 250  # a huge value is shown cut short


RETURNS: dict[str, Any] = {
    "true": True,
    "float0": 0.0,
    "float": 1.5,
    "huge": 2**70,
    "none": None,
    "seven": 7,
    "zero": 0,
}


def test_every_return_value_ends_its_run_in_one_attempt_and_the_agent_carries_on(
    tmp_path: Path,
) -> None:
    calls: Counter[str] = Counter()

    async def handler(ticket: RunTicket, out: Out) -> int:
        name = ticket.task["payload"]
        calls[ticket.job_id] += 1
        result: int = RETURNS[name]  # deliberately the wrong type for most
        return result

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-returns", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for name in RETURNS:
                for delivery in ("at_least_once", "at_most_once"):
                    await client.create(
                        {
                            "id": f"r-{name}-{delivery}",
                            "schedule": soon(0.1),
                            "task": {"payload": name},
                            "delivery": delivery,
                        }
                    )
            for name, value in RETURNS.items():
                for delivery in ("at_least_once", "at_most_once"):
                    job_id = f"r-{name}-{delivery}"
                    (run,) = await settle(client, job_id)
                    assert run["attempt"] == 1
                    if name == "zero":
                        assert (run["state"], run["exit_code"]) == ("SUCCESS", 0)
                    elif name == "seven":
                        assert (run["state"], run["exit_code"]) == ("FAILED", 7)
                    else:
                        assert (run["state"], run["exit_code"]) == ("FAILED", None), value
                        page = await client.logs(run["run_id"])
                        text = b"".join(c["data"] for c in page["chunks"])
                        assert b"expected an int exit code" in text
            # still serving: a later run succeeds on the same agent
            await client.create({"id": "later", "schedule": soon(0.1), "task": {"payload": "zero"}})
            (ok,) = await settle(client, "later")
            assert ok["state"] == "SUCCESS"
            nursery.cancel_scope.cancel()
        # each ran once: none was handed out again as lost
        assert all(n == 1 for n in calls.values()), calls

    run_with_node(tmp_path, body)


class _BadReports(WorkerAgent):
    """An agent whose final reports carry a bad exit code: a refused and an unsendable one
    (what a report could carry before ``payload_outcome``, or a later bug in the agent)."""

    @staticmethod
    def _report_of(rid: str, held: Any) -> dict[str, Any]:
        report = WorkerAgent._report_of(rid, held)
        kind = held.ticket.task["payload"]
        report["exit_code"] = {"refused": True, "unsendable": 2**70}.get(kind, 0)
        return report


def test_a_final_report_the_node_refuses_or_that_cannot_be_sent_is_reported_failed(
    tmp_path: Path,
) -> None:
    async def handler(ticket: RunTicket, out: Out) -> int:
        return 0

    async def body(client: Client, port: int) -> None:
        agent = _BadReports("127.0.0.1", port, worker_id="w-bad", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for kind in ("refused", "unsendable"):
                await client.create({"id": kind, "schedule": soon(0.1), "task": {"payload": kind}})
            for kind in ("refused", "unsendable"):
                (run,) = await settle(client, kind)
                assert (run["state"], run["exit_code"], run["attempt"]) == ("FAILED", None, 1)
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_request_that_cannot_be_framed_is_not_sendable(tmp_path: Path) -> None:
    async def body(client: Client, port: int) -> None:
        with pytest.raises(RequestNotSendable, match=r"job\.get"):
            await client.request("job.get", {"job_id": 2**70})
        await client.request("ping", {})  # the connection lives

    run_with_node(tmp_path, body)


def test_output_is_bytes_or_str_on_stdout_or_stderr() -> None:
    assert payload_chunk("stdout", b"a") == ("stdout", b"a")
    assert payload_chunk("stderr", "é\n") == ("stderr", "é\n".encode())
    assert payload_chunk("stdout", bytearray(b"x")) == ("stdout", b"x")
    assert payload_chunk("stdout", memoryview(b"y")) == ("stdout", b"y")
    with pytest.raises(TypeError, match="bytes or str, got int"):
        payload_chunk("stdout", 5)
    with pytest.raises(ValueError, match="'stdout' or 'stderr'"):
        payload_chunk("logs", b"x")


def test_a_handler_writes_str_output_and_a_wrong_type_fails_in_the_handler(
    tmp_path: Path,
) -> None:
    async def handler(ticket: RunTicket, out: Any) -> int:
        await out("stdout", "text, not bytes\n")
        if ticket.task["payload"] == "bad":
            await out("stdout", 42)
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-out", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for name in ("good", "bad"):
                await client.create({"id": name, "schedule": soon(0.1), "task": {"payload": name}})
            (good,) = await settle(client, "good")
            (bad,) = await settle(client, "bad")
            nursery.cancel_scope.cancel()
        assert good["state"] == "SUCCESS"
        page = await client.logs(good["run_id"])
        assert b"".join(c["data"] for c in page["chunks"]) == b"text, not bytes\n"
        assert bad["state"] == "FAILED"
        page = await client.logs(bad["run_id"])
        text = b"".join(c["data"] for c in page["chunks"])
        assert b"text, not bytes\n" in text and b"TypeError: output data must be bytes" in text

    run_with_node(tmp_path, body)


def test_output_past_the_frame_limit_in_one_call_is_kept_as_a_process_output_is(
    tmp_path: Path,
) -> None:
    """One ``out()`` of 9 MB (past the 8 MiB frame limit) keeps its head, its tail and the cut
    between, as a process's output does: sent whole, it could not be framed, and the run ended
    SUCCESS with no output stored at all (found by review)."""
    big = b"A" * 4_500_000 + b"Z" * 4_500_000

    async def handler(ticket: RunTicket, out: Any) -> int:
        await out("stdout", big)
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-big", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create({"id": "big", "schedule": soon(0.1), "task": {"payload": 1}})
            (run,) = await settle(client, "big")
            nursery.cancel_scope.cancel()
        assert run["state"] == "SUCCESS"
        chunks: list[dict[str, Any]] = []
        cursor = 0
        while True:
            page = await client.logs(run["run_id"], offset=cursor)
            chunks += page["chunks"]
            cursor = page["cursor"]
            if page["at_end"]:
                break
        kept = b"".join(c["data"] for c in chunks)
        cut = sum(c["dropped"] for c in chunks if c["stream"] == "cut")
        assert kept == big[: 64 * 1024] + big[-960 * 1024 :]
        assert cut == len(big) - len(kept)

    run_with_node(tmp_path, body)


def test_the_worker_enforces_a_payload_jobs_timeout(tmp_path: Path) -> None:
    """The handler is cancelled at the job's timeout and the run reported TIMED_OUT by the
    worker, as a process is stopped (before, only the node acted, at timeout + its grace);
    with ``on_timeout: mark`` the handler runs on to its end."""
    finished: list[str] = []

    async def handler(ticket: RunTicket, out: Out) -> int:
        await trio.sleep(1.5 if ticket.job_id == "marked" else 30)
        finished.append(ticket.job_id)
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-timeout", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create(
                {"id": "hangs", "schedule": soon(0.1), "task": {"payload": 1}, "timeout": "1s"}
            )
            await client.create(
                {
                    "id": "marked",
                    "schedule": soon(0.1),
                    "task": {"payload": 1},
                    "timeout": "1s",
                    "on_timeout": "mark",
                }
            )
            (hung,) = await settle(client, "hangs")
            assert hung["state"] == "TIMED_OUT"
            page = await client.logs(hung["run_id"])
            text = b"".join(c["data"] for c in page["chunks"])
            assert b"timed out after 1000 ms): payload handler cancelled" in text
            with trio.fail_after(20):
                while "marked" not in finished:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert finished == ["marked"]

    run_with_node(tmp_path, body)
