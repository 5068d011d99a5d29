"""Node fixes found by review, over real sockets: a node in process (``trio.run``, a temporary
data directory, a port the OS picks on 127.0.0.1), or a real ``tickwheel serve`` process where
what is fixed shows only across a restart:

* a schedule ``start``/``end`` before year 1 in UTC is ``invalid_schedule`` at ``job.create``
  (it was stored as year 0, and the node could not start on its data directory again); one in
  year 1 itself is kept and read back after a restart;
* ``run.get`` of a run id whose time has a leading zero is ``invalid``;
* ``worker.finished`` with out-of-range ``credits`` is refused before the report is applied;
* a refused ``worker.heartbeat`` does not count as hearing the worker (which kept its id from
  another process past the lease);
* boolean ``held`` tokens and ``seen`` entries are ``bad_args`` in hello and heartbeat;
* ``job.preview`` of a one-shot ``schedule`` whose time is past shows it, ``past: fires at
  once``;
* ``job.update`` of a cancelled job is ``not_found`` whatever its changes;
* (a second review) unknown top-level keys of text and bytes together are ``bad_request``,
  not a closed connection; a msgpack ext value is ``malformed`` on the wire and refused by the
  engine, not stored as another value.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from cluster.codec import Message
from cluster.node import Node
from engine.schedules import format_utc, parse_instant
from engine.shard import EngineConfig
from tests.cluster.procs import NodeProc, Raw, with_client

pytestmark = pytest.mark.timeout(90)

HOST = "127.0.0.1"
TIME_LIMIT_S = 30
TASK = {"shell": "true"}
#: 0000-12-31T10:00:00Z: before year 1 in UTC, though its local year is 1
BEFORE_YEAR_1 = "0001-01-01T00:00:00+14:00"
IN_YEAR_1 = "0001-01-02T00:00:00Z"


def run_with_node(
    tmp_path: Path,
    body: Callable[[Node, int], Awaitable[None]],
    *,
    shards: int = 2,
    config: EngineConfig | None = None,
) -> None:
    """Start a node in process on ``tmp_path``, run ``body(node, port)``, stop the node by
    cancelling it (its stores close as on SIGTERM); bounded in time."""

    async def main() -> None:
        with trio.fail_after(TIME_LIMIT_S):
            async with trio.open_nursery() as nursery:
                node = Node(tmp_path / "data", host=HOST, port=0, shards=shards, config=config)
                port = await nursery.start(node.run)
                await body(node, port)
                nursery.cancel_scope.cancel()

    trio.run(main)


def error_of(reply: Message) -> tuple[str, str | None]:
    assert reply["ok"] is False, reply
    return reply["error"]["code"], reply["error"]["field"]


def hello(worker_id: str, instance: str, **extra: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, "tiers": ["default"], "slots": 1, "instance": instance, **extra}


def past_ms(seconds: float = 60) -> int:
    """A whole second ``seconds`` ago (a one-shot time the node owes at once)."""
    return (int(time.time()) - int(seconds)) * 1000


def stop(node: NodeProc) -> None:
    """SIGTERM, which must stop it cleanly (status 0, no traceback in its log)."""
    try:
        status = node.terminate()
    except subprocess.TimeoutExpired:  # wedged: killed (terminate did), never left running
        raise AssertionError(f"the node did not stop: {node.log.read_text()[-2000:]}") from None
    log = node.log.read_text(errors="replace")
    assert status == 0 and "Traceback" not in log, (status, log[-3000:])


# ============================================================ 1. schedule instants, year 1


def test_a_schedule_instant_before_year_1_is_refused_and_the_node_restarts(
    tmp_path: Path,
) -> None:
    """Found by review: a cron ``end`` of
    0001-01-01T00:00:00+14:00 was accepted and stored as "0000-12-31T10:00:00Z"; the node
    then failed to start on its data directory. It is ``invalid_schedule`` now, nothing is
    stored, and the node starts again."""
    data, log = tmp_path / "data", tmp_path / "node.log"
    node = NodeProc(data, log)
    try:

        async def body(client: Client) -> None:
            for job_id, schedule, field in [
                ("y0-end", {"cron": "0 0 * * *", "end": BEFORE_YEAR_1}, "schedule.end"),
                ("y0-start", {"every": "1h", "start": BEFORE_YEAR_1}, "schedule.start"),
            ]:
                with pytest.raises(RemoteError) as refused:
                    await client.create({"id": job_id, "schedule": schedule, "task": TASK})
                assert (refused.value.code, refused.value.field) == ("invalid_schedule", field)
                with pytest.raises(RemoteError) as gone:
                    await client.get(job_id)
                assert gone.value.code == "not_found"
            # A job beside them, to read back after the restart.
            await client.create({"id": "other", "schedule": {"every": "1h"}, "task": TASK})

        with_client(node.port, body)
        assert node.alive()
    finally:
        stop(node)
    # The same data directory: the node recovers every shard and serves.
    again = NodeProc(data, tmp_path / "node2.log")
    try:

        async def after(client: Client) -> None:
            assert (await client.get("other"))["spec"]["schedule"]["every"] == "1h"
            with pytest.raises(RemoteError) as gone:
                await client.get("y0-end")
            assert gone.value.code == "not_found"

        with_client(again.port, after)
    finally:
        stop(again)


def test_a_schedule_instant_in_year_1_is_kept_across_a_restart(tmp_path: Path) -> None:
    """The bound is year 1 in UTC, not later: a start and an end on 0001-01-02 are accepted,
    stored, and read back by the node started again on the same data directory."""
    data, log = tmp_path / "data", tmp_path / "node.log"
    year_1_ms = parse_instant(IN_YEAR_1, field="x")
    specs = {
        "y1-end": {"cron": "0 0 * * *", "end": IN_YEAR_1},
        "y1-start": {"every": "1h", "start": IN_YEAR_1},
    }

    async def check(client: Client) -> None:
        for job_id, schedule in specs.items():
            stored = (await client.get(job_id))["spec"]["schedule"]
            key = "end" if "end" in schedule else "start"
            assert parse_instant(stored[key], field=key) == year_1_ms, stored

    node = NodeProc(data, log)
    try:

        async def body(client: Client) -> None:
            for job_id, schedule in specs.items():
                await client.create({"id": job_id, "schedule": schedule, "task": TASK})
            await check(client)

        with_client(node.port, body)
    finally:
        stop(node)
    again = NodeProc(data, tmp_path / "node2.log")  # (raises with its log if it cannot start)
    try:
        with_client(again.port, check)
    finally:
        stop(again)


# ============================================================ 2. run ids with a leading zero


def test_run_get_of_a_run_id_with_a_leading_zero_is_invalid(tmp_path: Path) -> None:
    """Found by review: ``j@0<ms>`` was read as run ``j@<ms>`` under another text (and the
    node's caches keyed by the text did not know it). The run exists; only its canonical id
    names it."""
    at = past_ms()

    async def body(node: Node, port: int) -> None:
        raw = await Raw.open(port)
        await raw.ok(
            "job.create", {"spec": {"id": "j", "schedule": {"at": format_utc(at)}, "task": TASK}}
        )
        rid = f"j@{at}"
        with trio.fail_after(10):  # owed at once: its run is created (PENDING, no worker)
            while not (await raw.call("run.get", {"run_id": rid}))["ok"]:
                await trio.sleep(0.02)
        for bad in (f"j@0{at}", f"j@000{at}", "j@01", "j@00"):
            for op in ("run.get", "run.logs"):
                reply = await raw.call(op, {"run_id": bad})
                assert error_of(reply) == ("invalid", "run_id"), (op, bad)
        # The canonical ids: the run, and a time of 0 (a valid id, no such run).
        assert (await raw.ok("run.get", {"run_id": rid}))["run_id"] == rid
        assert error_of(await raw.call("run.get", {"run_id": "j@0"})) == ("not_found", "run_id")
        await raw.aclose()

    run_with_node(tmp_path, body)


# ============================================================ 3. worker.finished credits


def test_a_finished_report_with_bad_credits_is_refused_before_it_is_applied(
    tmp_path: Path,
) -> None:
    """Found by review: the credits were checked after the report was handed to the shard, so
    the run became SUCCESS while the worker was told bad_args (and would send the report
    again). Now nothing changes; the good report then counts."""
    at = past_ms()

    async def body(node: Node, port: int) -> None:
        client, worker = await Raw.open(port), await Raw.open(port)
        await worker.ok("worker.hello", hello("wA", "abc"))
        spec = {"id": "fin1", "schedule": {"at": format_utc(at)}, "task": TASK}
        await client.ok("job.create", {"spec": spec})
        run = (await worker.push("dispatch"))["run"]
        rid, token = run["run_id"], run["token"]
        before = (await client.ok("run.get", {"run_id": rid}))["state"]
        assert before in ("CLAIMED", "RUNNING")
        report = {"run_id": rid, "token": token, "outcome": "success", "exit_code": 0}
        for credits in (99_999, -1):
            reply = await worker.call("worker.finished", {**report, "credits": credits})
            assert error_of(reply) == ("bad_args", "credits")
        # One shard: a create answered (durable) after the refused reports is a barrier, every
        # command the shard got before it is applied and durable by then.
        await client.ok(
            "job.create", {"spec": {"id": "barrier", "schedule": {"every": "1h"}, "task": TASK}}
        )
        assert (await client.ok("run.get", {"run_id": rid}))["state"] == before
        # The worker sends it again with good credits: that one is the run's outcome.
        await worker.ok("worker.finished", {**report, "credits": 1})
        assert (await client.ok("run.get", {"run_id": rid}))["state"] == "SUCCESS"
        await client.aclose()
        await worker.aclose()

    run_with_node(tmp_path, body, shards=1)


# ============================================================ 4. refused heartbeats


#: heartbeats the node refuses (bad_args), each with the field it names
BAD_HEARTBEATS = pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"held": [["not-a-run", 1]]}, "held[0]"),  # the review's repro: not a run id
        ({"held": [["x@1", True]]}, "held[0]"),
        ({"held": [["x@1"]]}, "held[0]"),
        ({"seen": [[0, -1]]}, "seen[0]"),
    ],
    ids=["held-not-a-run", "held-bool-token", "held-short", "seen-negative"],
)


@BAD_HEARTBEATS
def test_a_refused_heartbeat_does_not_count_as_hearing_the_worker(
    tmp_path: Path, args: dict[str, Any], field: str
) -> None:
    """Found by review: the node noted the worker heard before it checked the heartbeat, so a
    worker sending only bad ones kept its id from another process (worker_id_in_use) though
    the engine, which got no heartbeat, let its lease lapse. The session's heard time must not
    move."""

    async def body(node: Node, port: int) -> None:
        a = await Raw.open(port)
        await a.ok("worker.hello", hello("shared", "aaaa"))
        session = node.workers["shared"]
        heard = session.heard_ms
        await trio.sleep(0.05)  # (mono_ms would move: the clock has ms resolution)
        assert error_of(await a.call("worker.heartbeat", args)) == ("bad_args", field)
        assert node.workers["shared"] is session and session.heard_ms == heard
        # A good one does count (so that the check above means something).
        await a.ok("worker.heartbeat", {"held": []})
        assert session.heard_ms > heard
        await a.aclose()

    run_with_node(tmp_path, body)


@BAD_HEARTBEATS
def test_another_process_gets_the_id_of_a_worker_sending_only_refused_heartbeats(
    tmp_path: Path, args: dict[str, Any], field: str
) -> None:
    """The review's repro, in process with a 1 s lease: process A says hello, then sends only
    heartbeats that are refused, for longer than the lease; process B's hello with the same
    worker id is accepted. (Worker C, whose heartbeats are good, keeps its id: the control.)"""
    lease_ms = 1000
    config = EngineConfig(worker_lease_ms=lease_ms, reattach_grace_ms=lease_ms)

    async def body(node: Node, port: int) -> None:
        a, b, c = await Raw.open(port), await Raw.open(port), await Raw.open(port)
        await a.ok("worker.hello", hello("shared", "aaaa"))
        await c.ok("worker.hello", hello("control", "cccc"))
        deadline = trio.current_time() + lease_ms / 1000 * 1.5
        while trio.current_time() < deadline:
            assert error_of(await a.call("worker.heartbeat", args)) == ("bad_args", field)
            await c.ok("worker.heartbeat", {"held": []})
            await trio.sleep(0.2)
        await b.ok("worker.hello", hello("shared", "bbbb"))  # A was not heard for a lease
        reply = await b.call("worker.hello", hello("control", "dddd"))
        assert error_of(reply) == ("worker_id_in_use", "worker_id")  # C was
        for conn in (a, b, c):
            await conn.aclose()

    run_with_node(tmp_path, body, config=config)


# ============================================================ 5. booleans in held and seen


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"held": [["x@1", True]]}, "held[0]"),
        ({"held": [["x@1", 1], ["x@2", False]]}, "held[1]"),
        ({"seen": [[True, 5]]}, "seen[0]"),
        ({"seen": [[0, 1], [1, True]]}, "seen[1]"),
    ],
    ids=["held-token-true", "held-token-false", "seen-shard-bool", "seen-seq-bool"],
)
def test_booleans_in_held_and_seen_are_bad_args(
    tmp_path: Path, extra: dict[str, Any], field: str
) -> None:
    """Found by review: a boolean passed isinstance(int) and was
    taken for token (or shard) 1 or 0. Refused in a hello (which then takes no id) and in a
    heartbeat."""

    async def body(node: Node, port: int) -> None:
        w = await Raw.open(port)
        reply = await w.call("worker.hello", hello("wZ", "zzzz", **extra))
        assert error_of(reply) == ("bad_args", field)
        assert "wZ" not in node.workers  # a refused hello takes nothing
        await w.ok("worker.hello", hello("wZ", "zzzz"))
        reply = await w.call("worker.heartbeat", extra)
        assert error_of(reply) == ("bad_args", field)
        await w.ok("worker.heartbeat", {key: [] for key in extra})  # the same, empty: fine
        await w.aclose()

    run_with_node(tmp_path, body)


# ============================================================ 6. preview of a past one-shot


def test_preview_of_a_past_one_shot_schedule_shows_it_firing_at_once(tmp_path: Path) -> None:
    """Found by review: a create of ``{"at": <past>}`` owes that time
    and fires at once, but its preview showed no fire at all."""
    past = past_ms(3600)
    future = (int(time.time()) + 3600) * 1000

    async def body(node: Node, port: int) -> None:
        raw = await Raw.open(port)
        shown = await raw.ok("job.preview", {"schedule": {"at": format_utc(past)}, "count": 3})
        assert [(f["at_ms"], f["note"]) for f in shown["fires"]] == [(past, "past: fires at once")]
        # 1970 itself, the earliest one-shot time.
        shown = await raw.ok("job.preview", {"schedule": {"at": format_utc(0)}, "count": 1})
        assert [(f["at_ms"], f["note"]) for f in shown["fires"]] == [(0, "past: fires at once")]
        shown = await raw.ok("job.preview", {"schedule": {"at": format_utc(future)}, "count": 3})
        assert [(f["at_ms"], f["note"]) for f in shown["fires"]] == [(future, None)]
        # A recurring schedule has no such note: from now on, as before.
        shown = await raw.ok("job.preview", {"schedule": {"every": "1h"}, "count": 2})
        assert [f["note"] for f in shown["fires"]] == [None, None]
        await raw.aclose()

    run_with_node(tmp_path, body)


# ============================================================ 7. update of a cancelled job


@pytest.mark.parametrize(
    ("changes", "live_code"),
    [
        ({"schedule": {"cron": "bad"}}, "invalid_schedule"),  # what the cancelled job got too
        ({"bogus": 1}, "invalid_job"),  # likewise
        ({"schedule": {"cron": "0 4 * * *"}}, None),  # a valid change: not_found as well
    ],
    ids=["bad-schedule", "unknown-key", "valid"],
)
def test_update_of_a_cancelled_job_is_not_found_whatever_its_changes(
    tmp_path: Path, changes: dict[str, Any], live_code: str | None
) -> None:
    """Found by review: the changes were checked against the cancelled job's stored spec
    before the engine said it was gone, so an invalid change answered invalid_job or
    invalid_schedule instead of not_found."""

    async def body(node: Node, port: int) -> None:
        raw = await Raw.open(port)
        spec = {"id": "u1", "schedule": {"cron": "0 3 * * *"}, "task": TASK}
        await raw.ok("job.create", {"spec": spec})
        await raw.ok("job.cancel", {"id": "u1"})
        reply = await raw.call("job.update", {"id": "u1", "changes": changes})
        assert error_of(reply) == ("not_found", "id")
        if live_code is not None:
            # A live job with the same change still gets the change's own error.
            await raw.ok("job.create", {"spec": {**spec, "id": "u2"}})
            reply = await raw.call("job.update", {"id": "u2", "changes": changes})
            assert error_of(reply)[0] == live_code
        await raw.aclose()

    run_with_node(tmp_path, body)


# ============================================ found by the second review (2026-12-04)


def test_text_and_bytes_unknown_keys_together_are_bad_request_not_a_closed_connection(
    tmp_path: Path,
) -> None:
    """Found by review: the message naming the unknown keys sorted them, and a text key and
    a bytes key do not compare: the TypeError ended the connection, with the replies of
    every request in flight on it (a create pipelined just before was never answered)."""

    async def body(node: Node, port: int) -> None:
        raw = await Raw.open(port)
        spec = {"id": "j1", "schedule": {"every": "1h"}, "task": TASK}
        await raw.send({"id": 1, "op": "job.create", "args": {"spec": spec}})
        await raw.send({"id": 2, "op": "ping", "x": 1, b"y": 2})
        replies = {}
        with trio.fail_after(10):
            while len(replies) < 2:
                reply = await raw.receive()
                replies[reply["id"]] = reply
        assert replies[1]["ok"]
        assert error_of(replies[2])[0] == "bad_request"
        assert "'x'" in replies[2]["error"]["message"] and "b'y'" in replies[2]["error"]["message"]
        assert (await raw.call("ping"))["ok"]  # the connection carries on
        await raw.aclose()

    run_with_node(tmp_path, body)


def test_a_msgpack_ext_value_is_refused_not_stored_as_another_value(tmp_path: Path) -> None:
    """Found by review: an ext value in a payload (a named tuple once decoded) was stored as
    the list ``[code, data]``, a value the client never sent. The wire refuses a frame that
    holds one (``malformed``, with the request's id); the engine refuses one a library caller
    passes (``invalid_job``)."""
    import msgpack

    from engine.errors import JobSpecError
    from engine.jobs import validate_job

    async def body(node: Node, port: int) -> None:
        raw = await Raw.open(port)
        sent = {"ts": msgpack.ExtType(5, b"\x00\x01")}
        spec = {"id": "e", "schedule": {"every": "1h"}, "task": {"payload": sent}}
        reply = await raw.call("job.create", {"spec": spec})
        assert error_of(reply)[0] == "malformed", reply
        assert error_of(await raw.call("job.get", {"id": "e"}))[0] == "not_found"
        assert (await raw.call("ping"))["ok"]
        await raw.aclose()

    run_with_node(tmp_path, body)
    with pytest.raises(JobSpecError, match="ext value") as caught:
        validate_job(
            {
                "id": "e",
                "schedule": {"every": "1h"},
                "task": {"payload": {"ts": msgpack.ExtType(5, b"")}},
            },
            now_ms=0,
        )
    assert caught.value.field == "task.payload.ts"
