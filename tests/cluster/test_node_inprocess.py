"""The node and the client library in one Trio run: payload workers in user code, log follow,
retention, job commands over the wire."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from cluster.commands import _leaves
from cluster.node import Node
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.schedules import format_utc, parse_duration
from engine.shard import EngineConfig
from wal.store import Retention

pytestmark = pytest.mark.timeout(60)


def run_with_node(
    tmp_path: Path,
    body: Callable[[Client, int], Awaitable[None]],
    **node_options: Any,
) -> None:
    async def main() -> None:
        node = Node(
            tmp_path / "data",
            shards=2,
            # (3 s: a worker fences itself max(lease - 2 s, lease / 2) after its newest
            # acknowledged heartbeat, sent every lease / 3; with 1 s a heartbeat answered
            # ~170 ms late, on a loaded machine, killed the tasks of a test's worker)
            config=EngineConfig(worker_lease_ms=3000, reattach_grace_ms=3000),
            **node_options,
        )
        with trio.fail_after(50):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                async with Client.connect("127.0.0.1", port) as client:
                    await body(client, port)
                nursery.cancel_scope.cancel()

    trio.run(main)


def soon(seconds: float) -> dict[str, str]:
    return {"at": format_utc(int((time.time() + seconds) * 1000))}


async def settle(client: Client, job_id: str, n: int = 1) -> list[dict[str, Any]]:
    while True:
        runs = await client.history(job_id, last=100)
        final = [r for r in runs if r["state"] in ("SUCCESS", "FAILED", "TIMED_OUT", "LOST")]
        if len(final) >= n:
            return runs
        await trio.sleep(0.05)


def test_user_code_is_a_worker_for_payload_jobs(tmp_path: Path) -> None:
    seen: list[tuple[str, Any, int]] = []

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        seen.append((ticket.job_id, ticket.task["payload"], ticket.token))
        await out("stdout", f"invoice {ticket.task['payload']['invoice']} sent\n".encode())
        return 0 if ticket.task["payload"]["invoice"] != 13 else 1

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent(
            "127.0.0.1", port, worker_id="billing-1", tiers=("billing",), payload_handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for n in (42, 13):
                await client.create(
                    {
                        "id": f"inv-{n}",
                        "schedule": soon(0.3),
                        "task": {"payload": {"invoice": n}},
                        "tier": "billing",
                    }
                )
            ok = await settle(client, "inv-42")
            bad = await settle(client, "inv-13")
            assert [r["state"] for r in ok] == ["SUCCESS"]
            assert [r["state"] for r in bad] == ["FAILED"]
            chunks = [c async for c in client.follow_logs(ok[0]["run_id"])]
            assert b"".join(c["data"] for c in chunks) == b"invoice 42 sent\n"
            nursery.cancel_scope.cancel()
        assert sorted(p["invoice"] for _j, p, _t in seen) == [13, 42]

    run_with_node(tmp_path, body)


def test_job_commands_over_the_wire(tmp_path: Path) -> None:
    async def body(client: Client, port: int) -> None:
        created = await client.create({"schedule": {"every": "1h"}, "task": {"shell": "true"}})
        job_id = created["job_id"]
        assert len(job_id) >= 16 and created["version"] == 1  # generated, time-sortable
        with pytest.raises(RemoteError) as exists:
            await client.create(
                {"id": job_id, "schedule": {"every": "1h"}, "task": {"shell": "true"}}
            )
        assert exists.value.code == "exists" and exists.value.field == "id"
        updated = await client.update(job_id, {"schedule": {"every": "2h"}})
        assert updated["version"] == 2
        assert (await client.pause(job_id))["paused"] is True
        assert (await client.resume(job_id))["paused"] is False
        got = await client.get(job_id)
        assert got["spec"]["schedule"]["every"] == "2h"
        preview = await client.preview(job_id=job_id, count=2)
        assert len(preview["fires"]) == 2
        await client.cancel(job_id)
        with pytest.raises(RemoteError) as gone:
            await client.get(job_id)
        assert gone.value.code == "not_found"
        with pytest.raises(RemoteError) as bad:
            await client.create(
                {"id": "x", "schedule": {"cron": "61 * * * *"}, "task": {"shell": "true"}}
            )
        assert bad.value.code == "invalid_schedule" and bad.value.field == "schedule.cron"
        results = await client.create_many(
            [
                {"id": f"b{i}", "schedule": {"every": "1h"}, "task": {"shell": "true"}}
                for i in range(50)
            ]
            + [{"id": "b0", "schedule": {}, "task": {}}]
        )
        assert [r["ok"] for r in results] == [True] * 50 + [False]
        listed = [j["job_id"] async for j in client.list_jobs(page=7)]
        assert sorted(listed) == sorted([job_id] + [f"b{i}" for i in range(50)])
        # An `every` without `start` fires at its creation; its preview says so (found by
        # review: it began an interval later), and a create then owes that same first time.
        before = int(time.time() * 1000)
        fires = (await client.preview(schedule={"every": "1h"}, count=2))["fires"]
        made = await client.create({"schedule": {"every": "1h"}, "task": {"shell": "true"}})
        assert 0 <= fires[0]["at_ms"] - before < 5_000
        assert fires[1]["at_ms"] - fires[0]["at_ms"] == 3_600_000
        assert 0 <= made["next_fire_ms"] - fires[0]["at_ms"] < 5_000
        # A paused one-shot past its time fires at the resume, whatever the policy: its
        # preview by id showed no fire at all (found by review).
        past = "2021-01-01T00:00:00Z"
        spec = {"id": "pp", "schedule": {"at": past}, "task": {"shell": "true"}, "paused": True}
        await client.create(spec)
        shown = await client.preview(job_id="pp")
        assert shown["paused"] and [f["utc"] for f in shown["fires"]] == [past]
        assert shown["fires"][0]["note"] == "past: fires at the resume"

    run_with_node(tmp_path, body)


def test_retention_keeps_the_newest_runs_of_a_job(tmp_path: Path) -> None:
    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create(
                {"id": "tick", "schedule": {"every": "100ms"}, "task": {"payload": 1}}
            )
            while agent.completed < 15:
                await trio.sleep(0.05)
            # A retention pass (every 0.2 s) keeps 3, plus those since: polled, since a
            # loaded machine may run the pass late while runs go on coming every 100 ms.
            with trio.fail_after(10):
                while True:
                    runs = await client.history("tick", last=100)
                    if len(runs) <= 8:
                        break
                    await trio.sleep(0.1)
            assert len(runs) >= 1
            nursery.cancel_scope.cancel()

    run_with_node(
        tmp_path,
        body,
        retention=Retention(max_age_ms=None, max_runs_per_job=3),
        retain_every_s=0.2,
    )


def test_client_answers_by_callback_and_takes_back_unsent_notifications(tmp_path: Path) -> None:
    async def body(client: Client, port: int) -> None:
        answers: list[Any] = []
        assert client.send_then("ping", {}, answers.append)
        assert client.send_then("job.get", {"id": "nope"}, answers.append)
        while len(answers) < 2:
            await trio.sleep(0.01)
        assert answers[0]["shards"] == 2
        assert isinstance(answers[1], RemoteError) and answers[1].code == "not_found"

        # Queued and not yet handed to the socket (no checkpoint since): it can be taken back.
        frame = client.notify("ping", {})
        assert frame is not None and client.withdraw(frame)
        # Once the writer has sent it, it cannot.
        frame = client.notify("ping", {})
        assert frame is not None
        await trio.sleep(0.05)
        assert not client.withdraw(frame)
        assert (await client.request("ping"))["shards"] == 2  # the connection is unharmed

    run_with_node(tmp_path, body)


def test_an_instant_payload_run_goes_from_claimed_to_success(tmp_path: Path) -> None:
    """The start report of a task that ended before it left is taken back: the final report
    alone finishes the run (CLAIMED -> SUCCESS is a transition of its own)."""

    async def instant(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-instant", payload_handler=instant)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for n in range(5):
                await client.create(
                    {"id": f"now-{n}", "schedule": soon(0.2), "task": {"payload": n}}
                )
            for n in range(5):
                runs = await settle(client, f"now-{n}")
                assert [r["state"] for r in runs] == ["SUCCESS"]
            while agent.held:  # every final report acknowledged
                await trio.sleep(0.01)
            assert agent.running == 0 and agent.completed == 5
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_run_that_waits_never_holds_up_the_runs_dispatched_with_it(tmp_path: Path) -> None:
    """Runner tasks take each run's first step by hand and go on to the next queued run when it
    ends at once: a run that waits must hand the queue to another runner first. Runs that wait
    for a later run of the same dispatch (in whatever order they come) would hang otherwise;
    one times out inside a cancel scope, so a Cancelled is delivered into a run started by
    hand (Trio sends it as the trap's outcome; the runner's throw path is not reached)."""
    released = trio.Event()
    done: list[str] = []

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        kind = ticket.task["payload"]
        if kind == "wait":
            await released.wait()
        elif kind == "timeout":
            with trio.move_on_after(0.05):
                await trio.sleep(30)
            await released.wait()
        elif kind == "release":
            await trio.sleep(0.05)
            released.set()
        await out("stdout", kind.encode())
        done.append(kind)
        return 0

    kinds = ["wait", "timeout", "instant", "wait", "release", "instant", "instant", "wait"]

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent(
            "127.0.0.1", port, worker_id="w-mixed", slots=len(kinds), payload_handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            at = soon(0.3)
            await client.request(
                "job.create_many",
                {
                    "specs": [
                        {"id": f"mixed-{i}", "schedule": at, "task": {"payload": kind}}
                        for i, kind in enumerate(kinds)
                    ]
                },
            )
            with trio.fail_after(15):
                for i in range(len(kinds)):
                    runs = await settle(client, f"mixed-{i}")
                    assert [r["state"] for r in runs] == ["SUCCESS"]
                while agent.held:
                    await trio.sleep(0.01)
            assert sorted(done) == sorted(kinds)
            assert agent.running == 0 and agent._pickers == 0 and not agent._queue
            assert 1 <= len(agent._idle) <= len(kinds)  # runner tasks, all idle again
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def _bulk_specs() -> list[Any]:
    """A batch longer than a create_many chunk, over both shards: new jobs, a repeat inside
    the batch, jobs that exist (with and without replace), bad specs of every layer."""
    at = {"at": "2031-01-01T00:00:00Z"}
    specs: list[Any] = []
    for i in range(600):
        if i % 97 == 5:
            specs.append({"id": f"bulk-{i}", "schedule": {"cron": "61 * * * *"}, "task": {}})
        elif i % 89 == 7:
            specs.append({"id": f"bulk-{i}", "schedule": at, "task": {"payload": [float("inf")]}})
        elif i % 83 == 3:
            specs.append(["not", "a", "map"])
        elif i % 79 == 2:
            specs.append({"id": "bulk-1", "schedule": at, "task": {"payload": i}})  # repeat
        elif i % 71 == 1:
            specs.append({"id": "pre-1", "schedule": at, "task": {"payload": i}})  # exists
        elif i % 67 == 4:
            specs.append({"id": "pre-2", "schedule": at, "task": {"payload": i}, "replace": True})
        else:
            schedule = at if i % 3 else {"every": "1h", "start": "2031-01-01T00:00:00Z"}
            specs.append({"id": f"bulk-{i}", "schedule": schedule, "task": {"payload": i}})
    return specs


def test_create_many_answers_as_the_creates_one_by_one(tmp_path: Path) -> None:
    # Bulk creates go to the shards as one command per shard and chunk; what each spec gets
    # back must be what a job.create of it, in the batch's order, would have got.
    answers: dict[str, list[Any]] = {}

    async def setup(client: Client) -> None:
        for job_id in ("pre-1", "pre-2"):
            await client.create(
                {"id": job_id, "schedule": {"cron": "0 0 1 1 *"}, "task": {"payload": 0}}
            )

    async def bulk(client: Client, port: int) -> None:
        await setup(client)
        reply = await client.request("job.create_many", {"specs": _bulk_specs()})
        answers["many"] = reply["results"]

    async def one_by_one(client: Client, port: int) -> None:
        await setup(client)
        out: list[Any] = []
        for spec in _bulk_specs():
            try:
                if not isinstance(spec, dict):
                    raise RemoteError("bad_args", "", "")
                result = await client.request("job.create", {"spec": spec})
                out.append({"ok": True, "result": result})
            except RemoteError as exc:
                out.append({"ok": False, "error": [exc.code, exc.message, exc.field]})
        answers["one"] = out

    run_with_node(tmp_path / "bulk", bulk)
    run_with_node(tmp_path / "one", one_by_one)
    many, one = answers["many"], answers["one"]
    assert len(many) == len(one) == 600
    for i, (m, o) in enumerate(zip(many, one, strict=True)):
        assert m["ok"] == o["ok"], (i, m, o)
        if m["ok"]:
            assert m["result"] == o["result"], (i, m, o)
        elif isinstance(_bulk_specs()[i], dict):
            error = m["error"]
            assert [error["code"], error["message"], error["field"]] == o["error"], (i, m, o)
        else:
            assert m["error"]["field"] == f"specs[{i}]"
    assert sum(1 for m in many if m["ok"]) > 500


def test_a_turn_holds_at_most_turn_commands_creates_however_they_came() -> None:
    """A create_many chunk is one command but many creates: the turn's bound counts its specs,
    so a turn never holds more than TURN_COMMANDS creates (fires due meanwhile wait for the
    turn to end)."""
    from cluster.node import CREATE_MANY_CHUNK, TURN_COMMANDS, turn_length
    from engine.effects import CreateJob, CreateJobs, Pull
    from engine.jobs import validate_job

    spec = validate_job(
        {"id": "a", "schedule": {"at": "2031-01-01T00:00:00Z"}, "task": {"payload": 1}}, now_ms=0
    )
    chunk = CreateJobs(1, specs=(spec,) * CREATE_MANY_CHUNK)
    assert turn_length([]) == 0 and turn_length([chunk]) == 1
    many = [chunk] * 10
    per_turn = TURN_COMMANDS // CREATE_MANY_CHUNK
    assert turn_length(many) == per_turn
    assert sum(len(c.specs) for c in many[:per_turn]) <= TURN_COMMANDS
    singles = [CreateJob(i, spec) for i in range(TURN_COMMANDS + 5)]
    assert turn_length(singles) == TURN_COMMANDS
    assert turn_length(singles[:10]) == 10
    mixed = [Pull("w", 1), *[chunk] * 3]
    assert turn_length(mixed) == 1 + per_turn - 1  # the pull, then what fits
    huge = CreateJobs(2, specs=(spec,) * (TURN_COMMANDS + 1))
    assert turn_length([huge, chunk]) == 1  # at least one command, however large


_OUR_CODE = ("cluster/node.py", "cluster/client.py", "engine/")


def test_refused_requests_leave_no_reference_cycles_on_either_side(tmp_path: Path) -> None:
    """A refused create (a retry answered ``exists``) must not leave garbage that only the
    cyclic collector frees: on the node its traceback held the frames holding the command's
    spec; on the client the raising frame held the error. Each such cycle pins the request's
    spec and payload until a collection."""
    import gc
    import types

    async def body(client: Client, port: int) -> None:
        spec = {"id": "again", "schedule": soon(3600), "task": {"payload": "x" * 1000}}
        await client.create(spec)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                with pytest.raises(RemoteError):
                    await client.create(spec)
            await trio.sleep(0.05)
            gc.collect()
            ours = {
                frame.f_code.co_name
                for frame in gc.garbage
                if isinstance(frame, types.FrameType)
                and any(part in frame.f_code.co_filename for part in _OUR_CODE)
            }
            assert ours == set(), ours
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    run_with_node(tmp_path, body)


def test_a_final_report_is_answered_only_once_it_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker forgets a report it is told was taken: answered before its record is
    durable, a crash in between would turn a known outcome into LOST (DESIGN's table)."""
    import threading

    writer_thread_only(monkeypatch)  # (the write waits for this test's own event loop)

    from wal.store import ShardStore

    gate = threading.Event()
    held: list[bool] = []
    write_prepared = ShardStore.write_prepared

    def slow_success_write(self: ShardStore, prepared: Any) -> list[int]:
        if any(b"\xa7SUCCESS" in p.log_value for p in prepared):
            held.append(True)
            gate.wait(20)  # the committer thread: a disk that takes its time
        return write_prepared(self, prepared)

    monkeypatch.setattr(ShardStore, "write_prepared", slow_success_write)
    acked: list[tuple[str, bool]] = []

    class Agent(WorkerAgent):
        def acknowledged(self, rid: str) -> None:
            acked.append((rid, gate.is_set()))

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        return 0

    async def body(client: Client, port: int) -> None:
        agent = Agent("127.0.0.1", port, worker_id="w-durable", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create({"id": "dur-1", "schedule": soon(0.2), "task": {"payload": {}}})
            while not held:
                await trio.sleep(0.02)
            await trio.sleep(0.5)
            assert acked == []  # its SUCCESS record is still being written
            gate.set()
            while not acked:
                await trio.sleep(0.02)
            ((rid, released),) = acked
            assert rid.startswith("dur-1@") and released
            (run,) = await client.history("dur-1")
            assert run["state"] == "SUCCESS"
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_final_report_a_failed_shard_did_not_take_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store failure while the report's batch is written: the node answers with the store's
    code, and the worker keeps the report (to send again to the restarted node) instead of
    treating the answer as final."""
    from wal.errors import StoreIOError
    from wal.store import ShardStore

    write_prepared = ShardStore.write_prepared
    failed: list[bool] = []

    def failing_success_write(self: ShardStore, prepared: Any) -> list[int]:
        if any(b"\xa7SUCCESS" in p.log_value for p in prepared):
            failed.append(True)
            raise StoreIOError("injected: the disk went away", path=self.path)
        return write_prepared(self, prepared)

    monkeypatch.setattr(ShardStore, "write_prepared", failing_success_write)
    acked: list[str] = []

    class Agent(WorkerAgent):
        def acknowledged(self, rid: str) -> None:
            acked.append(rid)

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        return 0

    async def body(client: Client, port: int) -> None:
        agent = Agent("127.0.0.1", port, worker_id="w-kept", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create({"id": "kept-1", "schedule": soon(0.2), "task": {"payload": {}}})
            while not failed:
                await trio.sleep(0.02)
            await trio.sleep(2.5)  # the answers (store_io, then shard_failed) came meanwhile
            assert acked == []
            assert any(rid.startswith("kept-1@") for rid in agent.held)
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_payload_handler_that_raises_fails_its_run_and_the_worker_carries_on(
    tmp_path: Path,
) -> None:
    """User code's exception is the run's failure, never the worker's: the agent keeps
    serving (a raise that ended the agent made each worker taking the run again die too)."""

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        if ticket.task["payload"] == "raise":
            raise ValueError("a bug in user code")
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w-raise", payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create({"id": "boom", "schedule": soon(0.1), "task": {"payload": "raise"}})
            (failed,) = await settle(client, "boom")
            assert failed["state"] == "FAILED"
            page = await client.logs(failed["run_id"])
            assert b"ValueError: a bug in user code" in b"".join(c["data"] for c in page["chunks"])
            await client.create({"id": "after", "schedule": soon(0.1), "task": {"payload": 1}})
            (ok,) = await settle(client, "after")
            assert ok["state"] == "SUCCESS"
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_worker_that_fenced_itself_takes_runs_again(tmp_path: Path) -> None:
    """The tasks a fence kills end unreported: their slots come back with a pull, or the node
    kept the worker at no credits and it stood idle for good."""
    started = trio.Event()

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        if ticket.task["payload"] == "long":
            started.set()
            await trio.sleep(60)
        return 0

    async def body(client: Client, port: int) -> None:
        agent = WorkerAgent(
            "127.0.0.1", port, worker_id="w-fence", slots=1, payload_handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await client.create(  # at-most-once: the run the fence kills does not come back
                {
                    "id": "long",
                    "schedule": soon(0.1),
                    "task": {"payload": "long"},
                    "delivery": "at_most_once",
                }
            )
            await started.wait()
            agent._fence()  # as when no heartbeat was acknowledged within the lease
            await trio.sleep(0.5)
            await client.create({"id": "next", "schedule": soon(0.1), "task": {"payload": 1}})
            with trio.fail_after(10):
                (ok,) = await settle(client, "next")
            assert ok["state"] == "SUCCESS"
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_a_second_live_worker_process_with_the_same_id_is_refused(tmp_path: Path) -> None:
    """Two live processes with one worker id took it from each other at every hello, each
    hello giving up the other's runs, so at-least-once runs executed again and again (found
    by review: five times). The second is refused (``worker_id_in_use``), tries again for
    its patience (here 1.5 s), then gives up; the first keeps the id and its runs run once. Once the first
    is gone, the id is free again."""
    executions: list[str] = []

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        executions.append(ticket.run_id)
        await trio.sleep(0.3)
        return 0

    async def body(client: Client, port: int) -> None:
        first = WorkerAgent("127.0.0.1", port, worker_id="dup", payload_handler=handler)
        second = WorkerAgent(
            "127.0.0.1", port, worker_id="dup", payload_handler=handler, id_in_use_patience_s=1.5
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(first.run)
            for i in range(4):
                await client.create({"id": f"d{i}", "schedule": soon(0.1), "task": {"payload": i}})
            started = trio.current_time()
            with pytest.raises(BaseExceptionGroup) as caught:
                await second.run()
            (refused,) = _leaves(caught.value)
            assert isinstance(refused, RemoteError)
            assert refused.code == "worker_id_in_use" and refused.field == "worker_id"
            assert 1.5 <= trio.current_time() - started < 5
            for i in range(4):
                (run,) = await settle(client, f"d{i}")
                assert run["state"] == "SUCCESS" and run["attempt"] == 1
            nursery.cancel_scope.cancel()
        assert sorted(executions) == sorted(set(executions)) and len(executions) == 4
        # The first has gone (its connection closed): a third process takes the id at once.
        # Its patience 0.5 s: a refusal fails the test at once, instead of being retried until
        # the first's id lapses with its lease (found by review: with the lease at 3 s, the
        # retries got in before the 10 s below, and a node that kept the id went unnoticed).
        third = WorkerAgent(
            "127.0.0.1", port, worker_id="dup", payload_handler=handler, id_in_use_patience_s=0.5
        )
        async with trio.open_nursery() as nursery:
            # (10 s for a loaded machine's connect and durable hello)
            with trio.fail_after(10):
                await nursery.start(third.run)
            nursery.cancel_scope.cancel()

    run_with_node(tmp_path, body)


def test_concurrent_partial_updates_of_one_job_all_count(tmp_path: Path) -> None:
    """Found by me: the node merged each partial update into the job's stored spec, so two
    updates in flight together both merged into the same version and the second undid the
    first's change. Each now applies only on the version it was merged into (the engine
    checks), else it is merged again into the newer one."""

    async def body(client: Client, port: int) -> None:
        await client.create({"id": "multi", "schedule": {"every": "1h"}, "task": {"payload": 1}})
        changes = [{"timeout": "5m"}, {"tier": "gpu"}, {"labels": {"team": "a"}}]
        results: list[dict[str, Any]] = []
        go = trio.Event()

        async def update(change: dict[str, Any], connected: trio.Event) -> None:
            async with Client.connect("127.0.0.1", port) as own:  # a connection each
                connected.set()
                await go.wait()  # all at once: each read happens before any write is durable
                results.append(await own.update("multi", change))

        async with trio.open_nursery() as nursery:
            ready = []
            for change in changes:
                connected = trio.Event()
                ready.append(connected)
                nursery.start_soon(update, change, connected)
            for connected in ready:
                await connected.wait()
            go.set()
        assert sorted(r["version"] for r in results) == [2, 3, 4]
        spec = (await client.get("multi"))["spec"]
        assert spec["timeout"] == "5m" and spec["tier"] == "gpu" and spec["labels"] == {"team": "a"}

        # if_version: the caller's own version must be the current one
        with pytest.raises(RemoteError) as caught:
            await client.update("multi", {"tier": "cpu"}, if_version=3)
        assert caught.value.code == "conflict" and caught.value.field == "if_version"
        done = await client.update("multi", {"tier": "cpu"}, if_version=4)
        assert done["version"] == 5
        # A version nobody made yet is a conflict at once: the node waited 10 s for it, the
        # client's own timeout, which then said `timeout` (found by review).
        started = trio.current_time()
        with pytest.raises(RemoteError) as caught:
            await client.update("multi", {"tier": "cpu"}, if_version=9)
        assert caught.value.code == "conflict" and caught.value.field == "if_version"
        assert trio.current_time() - started < 2
        assert (await client.get("multi"))["version"] == 5
        with pytest.raises(RemoteError) as caught:
            await client.update("multi", {"tier": "x"}, if_version=0)
        assert caught.value.code == "bad_args"

    run_with_node(tmp_path, body)


def test_job_get_answers_a_spec_of_the_version_it_names(tmp_path: Path) -> None:
    """Under a stream of updates of one job, every ``job.get`` answers the spec of the version
    it names: before, the version came from the engine and the spec from the store, read
    after, and an update made durable in between paired them wrongly (found by review)."""

    async def body(client: Client, port: int) -> None:
        await client.create({"id": "g", "schedule": {"every": "1h"}, "task": {"payload": 1}})
        made: dict[int, int | None] = {1: None}  # version -> the timeout its update set, ms
        seen: list[tuple[int, int | None]] = []
        updates_left = [300]

        async def updater() -> None:
            async with Client.connect("127.0.0.1", port) as own:
                while updates_left[0] > 0:
                    updates_left[0] -= 1
                    timeout = 1_000_000 + updates_left[0] * 1000
                    change = {"timeout": f"{timeout}ms"}
                    made[(await own.update("g", change))["version"]] = timeout

        async def getter() -> None:
            async with Client.connect("127.0.0.1", port) as own:
                while updates_left[0] > 0:
                    job = await own.get("g")
                    timeout = job["spec"]["timeout"]
                    seen.append((job["version"], timeout and parse_duration(timeout, field="t")))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(updater)
                nursery.start_soon(getter)
        assert len(made) == 301 and len(seen) > 100
        wrong = [(v, t) for v, t in seen if made[v] != t]
        assert not wrong, f"{len(wrong)} of {len(seen)} gets, e.g. {wrong[:3]}"

    run_with_node(tmp_path, body)


def test_a_lone_create_wakes_the_writer_only_when_the_loop_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone request's batch is queued without waking the committer's writer (which would
    only wait for the GIL this thread holds); the node's kicker wakes it as Trio's loop is
    about to wait, and the create is answered as ever, once durable. Requests in flight
    together are queued without a wake-up too (since 2026-12-03: the loop writes them itself
    when nothing is left to run, or wakes the writer as it waits), and answered."""
    from wal.commit import GroupCommitter

    submitted: list[bool] = []
    kicked: list[bool] = []
    real_submit, real_kick = GroupCommitter.submit, GroupCommitter.kick

    def submit(self: GroupCommitter, batch: Any, callback: Any = None, *, wake: bool = True) -> Any:
        submitted.append(wake)
        return real_submit(self, batch, callback, wake=wake)

    def kick(self: GroupCommitter) -> None:
        kicked.append(bool(self._queue))
        real_kick(self)

    monkeypatch.setattr(GroupCommitter, "submit", submit)
    monkeypatch.setattr(GroupCommitter, "kick", kick)
    writer_thread_only(monkeypatch)  # (the loop's own writes: the tests of commit_here)

    async def body(client: Client, port: int) -> None:
        await trio.sleep(0.2)  # recovery's and the first ticks' batches are done with
        submitted.clear()
        kicked.clear()
        for n in range(3):
            job = await client.create(
                {"id": f"lone-{n}", "schedule": soon(3600), "task": {"payload": {}}}
            )
            assert job["job_id"] == f"lone-{n}"
        assert submitted == [False] * 3
        assert kicked == [True] * 3  # each kicked once, with its batch waiting
        submitted.clear()
        async with trio.open_nursery() as nursery:
            for n in range(8):
                nursery.start_soon(
                    client.create,
                    {"id": f"many-{n}", "schedule": soon(3600), "task": {"payload": {}}},
                )
        assert submitted and True not in submitted  # with others in flight: the same
        for n in range(8):
            assert (await client.get(f"many-{n}"))["job_id"] == f"many-{n}"

    run_with_node(tmp_path, body)


def run_lone_client(
    tmp_path: Path,
    ask: Callable[[Client, Node], Awaitable[None]],
    *,
    shards: int = 1,
    **node_options: Any,
) -> Node:
    """A node in this thread's Trio run, its one client in a thread of its own (own Trio
    run): the node's loop has nothing else to do between the client's requests, as with a
    client in another process. Returns the node, stopped."""
    node = Node(tmp_path / "data", shards=shards, **node_options)

    def client_side(port: int) -> None:
        async def run() -> None:
            async with Client.connect("127.0.0.1", port) as client:
                await ask(client, node)

        trio.run(run)

    async def main() -> None:
        with trio.fail_after(50):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                await trio.to_thread.run_sync(client_side, port)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return node


def test_a_kick_that_fails_stops_its_shard_without_stalling_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in waking a committer (its kick raises) stops that shard, and the requests
    waiting on it are answered with the failure at once. Found by review: the failure was
    worked through inside the kicker, after Trio's loop had chosen how long its coming wait
    for I/O would last, so the replies made there waited for the next I/O or deadline
    (retention's, 30 s here). The client runs its own Trio loop in a thread, so that the
    node's loop has nothing else to do meanwhile."""
    from wal.commit import GroupCommitter

    armed: list[bool] = []
    real_kick = GroupCommitter.kick

    def kick(self: GroupCommitter) -> None:
        if armed:
            raise RuntimeError("a bug in kick")
        real_kick(self)

    monkeypatch.setattr(GroupCommitter, "kick", kick)
    writer_thread_only(monkeypatch)  # (so that the batch waits for a kick)
    codes: list[str] = []

    async def ask(client: Client, node: Node) -> None:
        # A job due sooner: the shard's loop then sleeps past the next create's time, so
        # that create does not wake it (nothing else runnable then).
        await client.create({"id": "sooner", "schedule": soon(1800), "task": {"shell": "true"}})
        armed.append(True)
        with trio.fail_after(10), pytest.raises(RemoteError) as failed:
            spec = {"id": "kicked", "schedule": soon(3600), "task": {"shell": "true"}}
            await client.create(spec)
        codes.append(failed.value.code)

    run_lone_client(tmp_path, ask, retain_every_s=30.0)
    assert codes == ["shard_failed"]


def test_a_kicker_that_raises_leaves_the_writers_woken_at_each_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the kicker itself (an exception out of before_io_wait): Trio drops the
    instrument, and every batch queued without a wake-up would wait for good. The node falls
    back to waking the writer at each submit (found by review): the creates after it are
    answered and stored."""
    from cluster.node import _Kicker

    armed: list[bool] = []
    real = _Kicker._before_io_wait

    def before_io_wait(self: _Kicker, timeout: float) -> None:
        if armed and self.node.kicks:
            armed.clear()
            raise RuntimeError("a bug in the kicker")
        real(self, timeout)

    monkeypatch.setattr(_Kicker, "_before_io_wait", before_io_wait)
    seen: list[object] = []

    async def ask(client: Client, node: Node) -> None:
        await client.create(lone_spec("before"))
        armed.append(True)
        with trio.fail_after(10):
            for n in range(5):
                await client.create(lone_spec(f"after-{n}"))
            seen.append(node.kicker)
            for name in ["before"] + [f"after-{n}" for n in range(5)]:
                assert (await client.get(name))["job_id"] == name

    run_lone_client(tmp_path, ask)
    assert seen == [None] and not armed  # it raised once, and the node went on without it


def writer_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write on the committer's writer thread, never on the loop's (Node.commit_here):
    for a test whose write waits for something the loop must do meanwhile."""
    monkeypatch.setattr("cluster.node.INLINE_COMMIT_MAX_WRITE_S", -1.0)


def fast_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes on the loop's thread whatever the disk's speed: a test machine's fsync may
    take longer than INLINE_COMMIT_MAX_WRITE_S now and then (its own test sets it to 0)."""
    monkeypatch.setattr("cluster.node.INLINE_COMMIT_MAX_WRITE_S", 60.0)


def lone_spec(name: str) -> dict[str, Any]:
    return {"id": name, "schedule": soon(3600), "task": {"payload": {}}}


def test_a_lone_clients_batches_are_written_on_the_loops_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client with one request at a time gets its creates written by the event loop's
    thread once it has sent INLINE_COMMIT_AFTER_LONE of them (Node.commit_here), each
    answered once durable; requests in flight together are written there too, in groups
    (not one fsync each)."""
    fast_disk(monkeypatch)
    from cluster.node import INLINE_COMMIT_AFTER_LONE

    lone = 20
    here_after_lone: list[int] = []

    async def ask(client: Client, node: Node) -> None:
        for n in range(lone):
            assert (await client.create(lone_spec(f"lone-{n}")))["job_id"] == f"lone-{n}"
        here_after_lone.append(node.hosts[0].committer.groups_here)
        here_after_lone.append(node.hosts[0].committer.groups)
        async with trio.open_nursery() as nursery:
            for n in range(16):
                nursery.start_soon(client.create, lone_spec(f"many-{n}"))
        for name in [f"lone-{n}" for n in range(lone)] + [f"many-{n}" for n in range(16)]:
            assert (await client.get(name))["job_id"] == name

    node = run_lone_client(tmp_path, ask)
    committer = node.hosts[0].committer
    # Every lone create after the first few (its batch alone in a group of its own).
    assert here_after_lone[0] >= lone - INLINE_COMMIT_AFTER_LONE
    # The 16 together: a group or a few, whichever thread wrote them, never one each.
    assert committer.groups - here_after_lone[1] <= 8


def test_a_slow_disk_keeps_a_lone_clients_writes_on_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard whose last write took longer than INLINE_COMMIT_MAX_WRITE_S: the loop never
    stalls for the next one; the writer thread writes it, and the create is answered."""
    monkeypatch.setattr("cluster.node.INLINE_COMMIT_MAX_WRITE_S", 0.0)

    async def ask(client: Client, node: Node) -> None:
        for n in range(20):
            await client.create(lone_spec(f"slow-{n}"))

    node = run_lone_client(tmp_path, ask)
    assert node.hosts[0].committer.groups_here == 0
    assert node.hosts[0].committer.batches >= 20


def test_a_failed_write_on_the_loops_thread_fails_its_shard_and_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's own write of a lone request's batch fails (the disk): the shard stops as
    when its writer thread's write fails, and the request is answered with the failure at
    once (nothing acknowledged); the other shard goes on."""
    fast_disk(monkeypatch)
    import threading

    from cluster.node import INLINE_COMMIT_AFTER_LONE
    from engine.routing import shard_of
    from wal.errors import StoreIOError
    from wal.store import ShardStore

    armed: list[str] = []
    real_write = ShardStore.write_prepared

    def write_prepared(self: ShardStore, prepared: Any) -> list[int]:
        if armed and self.shard == 0:
            armed.append(threading.current_thread().name)
            raise StoreIOError("the disk went away", path=self.path)
        return real_write(self, prepared)

    monkeypatch.setattr(ShardStore, "write_prepared", write_prepared)
    names = [f"job-{n}" for n in range(200)]
    on_0 = [name for name in names if shard_of(name, 2) == 0]
    on_1 = [name for name in names if shard_of(name, 2) == 1]
    codes: list[str] = []

    async def ask(client: Client, node: Node) -> None:
        for name in on_0[: INLINE_COMMIT_AFTER_LONE + 2]:
            await client.create(lone_spec(name))
        armed.append("armed")
        with trio.fail_after(10), pytest.raises(RemoteError) as failed:
            await client.create(lone_spec(on_0[INLINE_COMMIT_AFTER_LONE + 2]))
        codes.append(failed.value.code)
        await client.create(lone_spec(on_1[0]))  # the other shard is unharmed
        assert (await client.get(on_1[0]))["job_id"] == on_1[0]

    run_lone_client(tmp_path, ask, shards=2)
    assert codes == ["store_io"]
    assert armed[1] == threading.main_thread().name  # written (and failed) by the loop's thread


def test_clients_in_flight_together_share_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a lone client's run of inline writes, eight clients on connections of their own,
    a create in flight each: their requests, read in the same passes of the loop, are written
    together (one fsync for many; on the loop's thread or the writer's, whichever is free when
    the loop would sleep) instead of one write each (found by measuring conns64: checked at a
    batch's end, every request read in a pass looked lone, since Trio does not count the rest
    of the pass as runnable, and conns64 fell to one fsync a create). Seen here: 12-17 groups
    for the 80 creates, 26 on a loaded machine."""
    fast_disk(monkeypatch)
    clients, each = 8, 10
    here: list[int] = []

    async def ask(client: Client, node: Node) -> None:
        for n in range(20):
            await client.create(lone_spec(f"lone-{n}"))
        committer = node.hosts[0].committer
        here.append(committer.groups_here)
        groups_before = committer.groups

        async def one_client(c: int) -> None:
            async with Client.connect("127.0.0.1", client.port) as other:
                for n in range(each):
                    await other.create(lone_spec(f"c{c}-{n}"))

        async with trio.open_nursery() as nursery:
            for c in range(clients):
                nursery.start_soon(one_client, c)
        here.append(committer.groups_here)
        here.append(committer.groups - groups_before)

    run_lone_client(tmp_path, ask)
    inline_before, _inline_after, groups = here
    assert inline_before >= 10
    # Some may still come alone (the clients' first or last requests): not most of 80.
    assert groups <= clients * each // 2, here


def test_two_clients_taking_turns_are_written_on_the_loops_thread_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two connections, one request at a time between them (A, B, A, B...): each request is
    alone in flight, and they are not one lone client (Node.lone_requests counts neither
    past one), but with nothing else to run the loop writes each batch itself (until
    2026-12-03 the writer thread wrote them all), and every create is answered and stored."""
    fast_disk(monkeypatch)
    here: list[int] = []

    async def ask(client: Client, node: Node) -> None:
        async with Client.connect("127.0.0.1", client.port) as other:
            for n in range(20):
                await client.create(lone_spec(f"a-{n}"))
                await other.create(lone_spec(f"b-{n}"))
            here.append(node.hosts[0].committer.groups_here)
            assert node.lone_requests <= 1
            for n in range(20):
                assert (await other.get(f"a-{n}"))["job_id"] == f"a-{n}"
                assert (await client.get(f"b-{n}"))["job_id"] == f"b-{n}"

    run_lone_client(tmp_path, ask)
    assert here[0] >= 30  # most of the 40 (a write may find the writer thread busy)


def test_a_lone_request_for_several_shards_is_left_to_their_writer_threads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone client's create_many with jobs on both shards: two fsyncs one after the other
    on the loop's thread would take longer than the two writer threads side by side; they
    write it. Its creates on one shard alone are still written on the loop's thread."""
    fast_disk(monkeypatch)
    from cluster.node import INLINE_COMMIT_AFTER_LONE
    from engine.routing import shard_of

    counts: list[tuple[int, int]] = []
    names = [f"job-{n}" for n in range(400)]
    on_0 = [name for name in names if shard_of(name, 2) == 0]
    on_1 = [name for name in names if shard_of(name, 2) == 1]

    async def ask(client: Client, node: Node) -> None:
        def here() -> tuple[int, int]:
            return (node.hosts[0].committer.groups_here, node.hosts[1].committer.groups_here)

        for name in on_0[: INLINE_COMMIT_AFTER_LONE + 4]:
            await client.create(lone_spec(name))
        counts.append(here())
        for k in range(3):
            both = [on_0[20 + k], on_1[k]]
            results = await client.create_many([lone_spec(name) for name in both])
            assert all(r["ok"] for r in results)
        counts.append(here())
        for name in on_0[30:34]:
            await client.create(lone_spec(name))
        counts.append(here())

    run_lone_client(tmp_path, ask, shards=2)
    lone, after_many, after_one = counts
    assert lone[0] >= 4 and lone[1] == 0
    assert after_many == lone  # nothing of the create_many written on the loop's thread
    # Lone creates on one shard again: written on the loop's thread (not every one: a
    # writer thread still in the hand-off of the group before keeps its write lock a
    # moment, and write_here leaves the batch to it then).
    assert after_one[0] > lone[0] and after_one[1] == 0


def test_a_group_written_here_is_acknowledged_behind_a_group_still_in_trios_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a group the writer thread wrote is still waiting in Trio's queue for its
    acknowledgement (``groups_handed`` ahead of ``groups_taken``), a group written on the
    loop's thread is acknowledged through the same queue, behind it, not at once: the
    lone client's creates are still answered, each once durable."""
    fast_disk(monkeypatch)
    from cluster.node import INLINE_COMMIT_AFTER_LONE, ShardHost

    deferred: list[int] = []
    real_committed = ShardHost._committed

    def committed(self: ShardHost, tickets: Any) -> None:
        if self.groups_handed != self.groups_taken:
            deferred.append(len(tickets))
        real_committed(self, tickets)

    monkeypatch.setattr(ShardHost, "_committed", committed)

    async def ask(client: Client, node: Node) -> None:
        host = node.hosts[0]
        for n in range(INLINE_COMMIT_AFTER_LONE + 2):
            await client.create(lone_spec(f"warm-{n}"))
        # As if a group's acknowledgement were still in Trio's queue (never taken here).
        host.groups_handed += 1
        before = host.committer.groups_here
        for n in range(5):
            await client.create(lone_spec(f"behind-{n}"))
        assert host.committer.groups_here == before + 5  # written on the loop's thread...
        for n in range(5):
            assert (await client.get(f"behind-{n}"))["job_id"] == f"behind-{n}"

    run_lone_client(tmp_path, ask)
    assert deferred == [1] * 5  # ...and acknowledged through Trio's queue
