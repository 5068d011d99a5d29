"""Engine-level regression tests for fixes found by review:

* a schedule ``start`` or ``end`` before 0001-01-01T00:00:00Z in UTC is refused at validation
  (it was stored as year 0, a text the shard could not read back at recovery), while one in
  year 1 itself is still accepted and survives a recovery;
* a run id whose time has a leading zero (``j@01``) is refused: it named run ``j@1`` under
  another string, which caches keyed by the text did not know;
* :meth:`ShardEngine.task_stopping`: true while a run the engine made final (a cancel with
  ``stop_running``) may still have its task running on its worker, false once that ends (the
  worker's report for that token, its lease lapsing, its hello without the run, the reattach
  grace passing) and for a run that never reached a worker;
* the trusted clock offset slews forward at 1 ms a second however often the engine is called
  (called more than once a second, it never moved: forward corrections used up
  ``max_clock_jump_ms`` for good, and every job fired that much late until a restart);
* a pinned run's spec is read back as a stored spec at recovery, so a check added to creates
  since (host-only zones such as ``right/UTC``) does not keep a snapshot from loading.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from engine.effects import (
    CancelJob,
    CreateJob,
    Heartbeat,
    Kill,
    ReportFinished,
    ReportStarted,
    UpdateJob,
    WorkerHello,
)
from engine.errors import EngineUsageError, ScheduleError
from engine.jobs import validate_job
from engine.runs import RunState, parse_run_id
from engine.schedules import format_utc, parse_instant, parse_schedule
from engine.shard import EngineConfig
from tests.engine.harness import T0, Node

#: before year 1 in UTC (0000-12-31T10:00:00Z), though its local year is 1
BEFORE_YEAR_1 = "0001-01-01T00:00:00+14:00"
#: an instant in year 1 itself, in UTC
IN_YEAR_1 = "0001-01-02T00:00:00Z"
#: 0001-01-01T00:00:00Z, the earliest instant format_utc writes as a text parse_instant reads
#: (engine.schedules.EARLIEST_STORABLE_MS; computed here, so that this file also runs against
#: code from before the fix, and fails there test by test)
EARLIEST_STORABLE_MS = parse_instant("0001-01-01T00:00:00Z", field="x")


def cfg(*, worker_lease_ms: int = 10**9, reattach_grace_ms: int = 10**9) -> EngineConfig:
    """A config whose leases outlast the test unless the test sets them."""
    return EngineConfig(worker_lease_ms=worker_lease_ms, reattach_grace_ms=reattach_grace_ms)


# ------------------------------------------------------------------ schedule instants


@pytest.mark.parametrize(
    ("schedule", "field"),
    [
        ({"cron": "0 0 * * *", "end": BEFORE_YEAR_1}, "schedule.end"),
        ({"every": "1h", "start": BEFORE_YEAR_1}, "schedule.start"),
        # one minute before year 1 in UTC: a one-minute offset is enough
        ({"cron": "0 0 * * *", "end": "0001-01-01T00:00:00+00:01"}, "schedule.end"),
    ],
    ids=["cron-end", "every-start", "end-a-minute-early"],
)
def test_a_start_or_end_before_year_1_in_utc_is_refused(
    schedule: dict[str, str], field: str
) -> None:
    """Found by review: accepted, then stored through format_utc as a "0000-..." text that
    parse_instant refuses, so the shard holding the job could not be recovered."""
    text = schedule["end"] if field == "schedule.end" else schedule["start"]
    assert parse_instant(text, field="x") < EARLIEST_STORABLE_MS  # (the case is what it says)
    with pytest.raises(ScheduleError) as refused:
        parse_schedule(schedule, created_ms=T0)
    assert refused.value.field == field and refused.value.code == "invalid_schedule"
    with pytest.raises(ScheduleError) as via_job:
        validate_job({"id": "y0", "schedule": schedule, "task": {"shell": "true"}}, now_ms=T0)
    assert via_job.value.field == field


@pytest.mark.parametrize(
    "schedule",
    [
        {"cron": "0 0 * * *", "end": IN_YEAR_1},
        {"every": "1h", "start": IN_YEAR_1},
        {"every": "1h", "start": "0001-01-01T00:00:00Z"},  # the earliest storable instant
    ],
)
def test_a_start_or_end_in_year_1_is_accepted_and_read_back(schedule: dict[str, str]) -> None:
    """The bound is year 1 in UTC, no later: what is stored is read back as the same time."""
    spec = validate_job({"id": "y1", "schedule": schedule, "task": {"shell": "true"}}, now_ms=T0)
    stored = spec.schedule.to_spec()  # the normalized spec, as the job record keeps it
    for key in ("start", "end"):
        if key in schedule:
            ms = parse_instant(schedule[key], field=key)
            assert ms >= EARLIEST_STORABLE_MS
            # The stored text parses back to the same instant, as recovery parses it.
            assert parse_instant(stored[key], field=key) == ms
            assert parse_schedule(stored, created_ms=T0).to_spec() == stored


def test_a_job_with_a_year_1_end_survives_a_recovery() -> None:
    node = Node()
    reply = node.create(id="y1", schedule={"cron": "0 0 * * *", "end": IN_YEAR_1})
    assert reply is not None and reply.error is None, reply
    node.crash_and_recover(downtime_ms=10)
    assert node.engine.next_owed("y1") is None  # its end is long past: nothing owed


# ------------------------------------------------------------------ run ids


@pytest.mark.parametrize("rid", ["j@01", "j@00", "j@0001577836800000", "j@01577836800000"])
def test_a_run_id_whose_time_has_a_leading_zero_is_refused(rid: str) -> None:
    """Found by review: ``j@01`` was taken for run ``j@1`` under another text."""
    with pytest.raises(EngineUsageError) as refused:
        parse_run_id(rid)
    assert refused.value.field == "run_id" and refused.value.code == "invalid"


@pytest.mark.parametrize(
    ("rid", "parsed"),
    [
        ("j@0", ("j", 0)),
        ("j@1577836800000", ("j", 1_577_836_800_000)),
        ("a.b:c-d_e@10", ("a.b:c-d_e", 10)),
    ],
)
def test_canonical_run_ids_are_accepted(rid: str, parsed: tuple[str, int]) -> None:
    assert parse_run_id(rid) == parsed


# ------------------------------------------------------------------ task_stopping


def running(node: Node, job_id: str = "a", worker_id: str = "w1") -> tuple[str, int]:
    """A one-shot run of ``job_id`` RUNNING on ``worker_id``: (run id, token)."""
    node.do(WorkerHello(worker_id, ("default",), 2, instance="i1"))
    node.create(id=job_id, schedule={"at": format_utc(node.wall + 1000)})
    node.advance(1000)
    (ticket,) = node.tickets(worker_id)
    node.do(ReportStarted(worker_id, ticket.run_id, ticket.token))
    assert node.engine.run_state(ticket.run_id) is RunState.RUNNING
    return ticket.run_id, ticket.token


def cancel_stopping(node: Node, job_id: str = "a") -> None:
    reply = node.do(CancelJob(node.request(), job_id, stop_running=True))
    assert reply is not None and reply.error is None, reply


def assert_cancelled_and_killed(node: Node, rid: str, token: int) -> None:
    assert node.final_states() == ["CANCELLED"]
    assert node.kills == [Kill("w1", rid, token, "job cancelled")]


def test_a_cancel_with_stop_running_of_a_running_run_is_stopping() -> None:
    """Found by review: a follower of the run's logs ended at the CANCELLED record and missed
    what the task wrote through its stop's grace; run.get/run.logs now say it is stopping."""
    node = Node()
    rid, token = running(node)
    assert not node.engine.task_stopping(rid)  # running, not stopping
    cancel_stopping(node)
    assert_cancelled_and_killed(node, rid, token)
    assert node.engine.task_stopping(rid)
    node.advance(100)
    node.do(Heartbeat("w1", ((rid, token),), "i1"))  # the worker still holds it
    assert node.engine.task_stopping(rid)


def test_the_workers_report_for_that_token_ends_stopping() -> None:
    node = Node()
    rid, token = running(node)
    cancel_stopping(node)
    # A report of another attempt's token is not this task's end.
    node.do(ReportFinished("w1", rid, token + 1, "killed", None))
    assert node.engine.task_stopping(rid)
    # The task's own end, reported after the run is final (a superseded report).
    node.do(ReportFinished("w1", rid, token, "killed", None))
    assert not node.engine.task_stopping(rid)
    assert node.final_states() == ["CANCELLED"]  # the report changes no state


def test_the_workers_lease_lapsing_ends_stopping() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=10_000))
    rid, token = running(node)
    cancel_stopping(node)
    assert_cancelled_and_killed(node, rid, token)
    node.do(Heartbeat("w1", ((rid, token),), "i1"))  # heard at the cancel
    node.advance(1900)
    assert node.engine.task_stopping(rid)  # within the lease, not heard since: still stopping
    node.advance(200)  # no heartbeat for 2.1 s: the lease lapsed (the worker fenced itself)
    assert not node.engine.task_stopping(rid)


@pytest.mark.parametrize("instance", ["i1", "i2"])
def test_a_hello_without_the_run_ends_stopping(instance: str) -> None:
    """The same process (its task ended without a report reaching us) or a new one."""
    node = Node()
    rid, token = running(node)
    cancel_stopping(node)
    # A hello that still announces the task keeps it stopping.
    node.do(WorkerHello("w1", ("default",), 2, ((rid, token),), instance="i1"))
    assert node.engine.task_stopping(rid)
    node.do(WorkerHello("w1", ("default",), 2, (), instance=instance))
    assert not node.engine.task_stopping(rid)


def test_another_workers_hello_does_not_end_stopping() -> None:
    node = Node()
    rid, _token = running(node)
    cancel_stopping(node)
    node.do(WorkerHello("w2", ("default",), 2, (), instance="x"))
    assert node.engine.task_stopping(rid)


def test_stopping_ends_after_the_reattach_grace() -> None:
    grace = 5000
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=grace))
    rid, token = running(node)
    cancel_stopping(node)
    # The worker stays live and keeps announcing the task: only the grace ends the entry.
    for _ in range(grace // 500 - 1):
        node.do(Heartbeat("w1", ((rid, token),), "i1"))
        node.advance(500)
    node.do(Heartbeat("w1", ((rid, token),), "i1"))
    node.advance(499)
    assert node.engine.task_stopping(rid)  # grace - 1 ms after the cancel
    node.advance(1)
    assert not node.engine.task_stopping(rid)


def test_a_run_cancelled_while_pending_is_never_stopping() -> None:
    node = Node()
    node.do(WorkerHello("w1", ("default",), 0, instance="i1"))  # no slot: the run waits
    node.create(id="a", schedule={"at": format_utc(node.wall + 1000)})
    node.advance(1000)
    assert node.tickets() == []
    rid = f"a@{T0 + 1000}"
    assert node.engine.run_state(rid) is RunState.PENDING
    cancel_stopping(node)
    assert node.final_states() == ["CANCELLED"] and node.kills == []
    assert not node.engine.task_stopping(rid)


def test_a_cancel_without_stop_running_is_not_stopping() -> None:
    """The run carries on to its end, not final: nothing is being stopped."""
    node = Node()
    rid, _token = running(node)
    reply = node.do(CancelJob(node.request(), "a", stop_running=False))
    assert reply is not None and reply.error is None
    assert node.kills == [] and not node.engine.task_stopping(rid)


def test_stopping_is_not_recorded_across_a_restart() -> None:
    """As documented: a restarted node does not know it (task_stopping answers False)."""
    node = Node()
    rid, _token = running(node)
    cancel_stopping(node)
    assert node.engine.task_stopping(rid)
    node.crash_and_recover(downtime_ms=10)
    assert not node.engine.task_stopping(rid)


# --------------------------------------------------------------------------------------------
# The clock's slew, called often


def _late_after_two_forward_steps(step_ms: int) -> tuple[int, list[int]]:
    """Two forward corrections of 3 s an hour apart (6 s: past max_clock_jump_ms), an hour
    of ticks every ``step_ms`` after each; then how far the engine's time is behind the wall
    clock, and how late (by the wall clock) the next fires go out."""
    n = Node(config=EngineConfig(worker_lease_ms=10**9, reattach_grace_ms=10**9))
    n.create(id="tick", schedule={"every": "10s"})
    n.do(WorkerHello("w", ("default",), 10**6))
    for _ in range(2):
        n.advance(0, wall_extra=3000)
        n.run_until(3_600_000, step=step_ms)
    seen = len(n.dispatches)
    late: list[int] = []
    for _ in range(25_000 // step_ms):  # (two or more fires of the 10 s schedule)
        n.advance(step_ms)
        late += [n.wall - d.run.scheduled_ms for _t, d in n.dispatches[seen:]]
        seen = len(n.dispatches)
    return n.wall - n.engine.now_ms, late


@pytest.mark.parametrize("step_ms", [1000, 100, 37])
def test_the_offset_slews_forward_however_often_the_engine_is_called(step_ms: int) -> None:
    behind, late = _late_after_two_forward_steps(step_ms)
    # Before the fix: 0 and [0...] at 1000 ms; 1000 ms behind for good at 100 ms and 37 ms.
    assert behind == 0
    assert late and max(late) < step_ms + 10, late


# --------------------------------------------------------------------------------------------
# A pinned run's spec at recovery


@pytest.mark.skipif(
    not os.path.exists("/usr/share/zoneinfo/right/UTC"), reason="needs the host's right/ zones"
)
def test_a_pinned_run_of_a_host_only_zone_recovers_from_a_snapshot() -> None:
    n = Node()
    spec = validate_job(
        {"id": "old", "schedule": {"cron": "* * * * *"}, "task": {"command": ["true"]}},
        now_ms=n.wall,
    )
    # What a node before the create-time check stored: the host-only zone name.
    legacy = dataclasses.replace(
        spec, schedule=parse_schedule({"cron": "* * * * *", "tz": "right/UTC"})
    )
    n.do(CreateJob(n.request(), legacy))
    n.do(WorkerHello("w", ("default",), 4))
    n.run_until(61_000)
    assert n.tickets()
    new = validate_job(
        {
            "id": "old",
            "schedule": {"cron": "* * * * *", "tz": "UTC"},
            "task": {"command": ["true"]},
        },
        now_ms=n.wall,
    )
    n.do(UpdateJob(n.request(), new))  # the run in flight keeps (pins) the old version
    pinned = [r for r in n.durable_records if r["t"] == "run" and "spec" in r]
    assert pinned and pinned[-1]["spec"]["schedule"]["tz"] == "right/UTC"
    n.take_snapshot()
    n.crash_and_recover(via_snapshot=True)  # before the fix: ScheduleError
    n.crash_and_recover(via_snapshot=False)
