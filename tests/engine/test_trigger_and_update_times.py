"""Run ids of triggered runs and the accounting of an update's past times (found by review).

A run id is the job id and a time, the task's idempotency key: a triggered run takes a time
just after now that names no other run of the job, past or owed, across restarts too; and an
update accounts for each owed time once, as a run or inside a skip record, never both."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.effects import (
    CancelJob,
    Pull,
    ReportFinished,
    ReportStarted,
    ResumeJob,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import JobNotFound
from engine.jobs import validate_job
from engine.schedules import format_utc
from engine.shard import EngineConfig
from tests.engine.harness import T0, Node


def cfg(**overrides: int) -> EngineConfig:
    return EngineConfig(**{"worker_lease_ms": 10**9, "reattach_grace_ms": 10**9, **overrides})


def run_states(node: Node, key: int) -> dict[int, list[str]]:
    """Every state each run of job ``key`` was recorded in, by its time."""
    out: dict[int, list[str]] = {}
    for r in node.canonical_records():
        if r["t"] == "run" and r["key"] == key:
            out.setdefault(r["at"], []).append(r["state"])
    return out


def test_a_trigger_never_takes_a_time_the_schedule_still_owes_behind_a_full_tier() -> None:
    """The tier at its ready bound holds J's fire of +10 s back; a trigger at +19.999 s
    took +20 s, which J's schedule also owes: once the tier had room, +20 s fired again
    under the same run id, a second attempt 1 of one run."""
    node = Node(config=cfg(ready_bound=2))
    node.do(WorkerHello("w1", ("default",), 10))
    for j in ("f1", "f2"):
        node.create(
            id=j, schedule={"at": format_utc(T0 + 1000)}, retries={"max": 1, "backoff": "1h"}
        )
    node.create(id="J", schedule={"every": "10s", "start": format_utc(T0 + 10_000)})
    node.advance(1000)
    for t in node.tickets():
        node.do(ReportFinished("w1", t.run_id, t.token, "failed", 1))  # each waits 1 h
    node.do(Pull("w1", 10))
    node.advance(18_999)  # +19.999 s: J's +10 s fire waits, the tier full
    reply = node.do(TriggerJob(node.request(), "J", "upstream@1"))
    assert reply is not None and reply.result is not None
    triggered = int(reply.result["run_id"].split("@")[1])
    assert triggered != T0 + 20_000 and (triggered - T0) % 10_000 != 0
    node.advance(10)
    for t in [t for t in node.tickets() if t.job_id == "J"]:
        node.do(ReportStarted("w1", t.run_id, t.token))
        node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    node.do(CancelJob(node.request(), "f1"))
    node.do(CancelJob(node.request(), "f2"))
    node.advance(5000)
    dispatched = Counter((t.run_id, t.attempt) for t in node.tickets() if t.job_id == "J")
    assert dispatched and max(dispatched.values()) == 1, dispatched
    for states in run_states(node, 2).values():
        assert states.count("PENDING") == 1  # each run id made once


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_trigger_after_a_restart_takes_no_id_a_finished_triggered_run_had(
    via_snapshot: bool,
) -> None:
    """A burst of triggers in one millisecond hands out the times after now; those that end
    before their time (cancel_previous) leave memory. The times handed out were not kept
    across a restart, and a trigger after one took such an id again."""
    node = Node()
    node.create(id="j", schedule={"every": "1h"}, overlap="cancel_previous")
    for i in range(50):
        node.do(TriggerJob(node.request(), "j", f"up@{i}"))
    used = set(run_states(node, 0))
    node.take_snapshot()
    node.advance(20)
    node.crash_and_recover(downtime_ms=10, via_snapshot=via_snapshot)
    reply = node.do(TriggerJob(node.request(), "j", "up@new"))
    assert reply is not None and reply.result is not None
    assert int(reply.result["run_id"].split("@")[1]) not in used


def test_an_update_of_a_paused_one_shot_past_its_time_owes_it_once() -> None:
    """Paused past its time, then updated (a timeout only) and resumed: the update skipped
    the time as missed while paused, and then owed it again as the past one-shot it names,
    so one time was both skipped and run."""
    node = Node()
    at = T0 + 60_000
    node.create(id="o", schedule={"at": format_utc(at)}, catchup="skip", paused=True)
    node.run_until(120_000, step=10_000)
    raw = {"id": "o", "schedule": {"at": format_utc(at)}, "task": {"command": ["true"]}}
    spec = validate_job({**raw, "catchup": "skip", "timeout": "1m"}, now_ms=node.wall)
    node.do(UpdateJob(node.request(), spec))
    node.do(ResumeJob(node.request(), "o"))
    node.advance(10)
    assert at in run_states(node, 0)
    assert not [s for s in node.skips() if s["lo"] <= at <= s["hi"]]


def test_next_owed_is_a_paused_jobs_kept_time() -> None:
    node = Node()
    at = T0 + 60_000
    node.create(id="o", schedule={"at": format_utc(at)}, paused=True)
    node.run_until(120_000, step=10_000)
    assert node.engine.next_owed("o") == at
    node.do(CancelJob(node.request(), "o"))
    with pytest.raises(JobNotFound):
        node.engine.next_owed("o")


def test_cancel_previous_also_cancels_a_run_an_earlier_buffer_one_left_waiting() -> None:
    """buffer_one leaves a run waiting behind the running one; updated to cancel_previous,
    the next fire cancelled the running one only, and the waiting run was then released to
    run beside the new one (found by review)."""
    from engine.effects import ReportStarted as Started

    node = Node()
    node.do(WorkerHello("w1", ("default",), 10))
    raw = {"id": "j", "schedule": {"every": "10s", "start": format_utc(T0 + 10_000)}}
    node.create(**raw, overlap="buffer_one")
    node.advance(10_000)  # +10 s: A goes out
    (a,) = node.tickets()
    node.do(Started("w1", a.run_id, a.token))
    node.advance(10_000)  # +20 s: B waits behind A
    spec = {**raw, "task": {"command": ["true"]}, "overlap": "cancel_previous"}
    node.do(UpdateJob(node.request(), validate_job(spec, now_ms=node.wall)))
    node.advance(10_000)  # +30 s: C cancels what came before it
    node.do(ReportFinished("w1", a.run_id, a.token, "killed", -15))
    node.advance(100)
    assert [t.run_id for t in node.tickets()] == [a.run_id, f"j@{T0 + 30_000}"]
    states = {at - T0: s[-1] for at, s in run_states(node, 0).items()}
    assert states == {10_000: "CANCELLED", 20_000: "CANCELLED", 30_000: "CLAIMED"}


@pytest.mark.parametrize("how", ["replace", "recreate"])
def test_a_replacing_create_in_the_millisecond_of_a_fire_that_ran_owes_it_no_more(
    how: str,
) -> None:
    """An at-most-once cron job's run at T went out and succeeded; the engine's time still
    at T (the wall clock set back just after), the same spec applied again with ``replace``
    (or the job cancelled and created again) fired T again: one run id sent twice, its
    SUCCESS record overwritten (found by review). Now is owed only if it did not run."""
    from engine.effects import CreateJob

    def spec(replace: bool = False) -> object:
        raw = {"id": "c", "schedule": {"cron": "*/10 * * * * *"}, "task": {"command": ["true"]}}
        return validate_job({**raw, "delivery": "at_most_once", "replace": replace}, now_ms=T0)

    node = Node()
    node.do(WorkerHello("w1", ("default",), 5, (), "i1", 0))
    node.do(CreateJob(node.request(), spec()))  # type: ignore[arg-type]
    node.advance(10_000)
    fired = node.engine.now_ms
    node.advance(5_000, wall_extra=-60_000)  # the engine's time stands still at T
    for t in node.tickets():
        node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    if how == "recreate":
        node.do(CancelJob(node.request(), "c"))
        node.do(CreateJob(node.request(), spec()))  # type: ignore[arg-type]
    else:
        node.do(CreateJob(node.request(), spec(replace=True)))  # type: ignore[arg-type]
    node.advance(1_000)
    assert [t.attempt for t in node.tickets() if t.scheduled_ms == fired] == [1]
    assert run_states(node, 0)[fired] == ["PENDING", "CLAIMED", "SUCCESS"]


def test_a_run_that_ended_before_its_records_were_durable_still_counts_as_run() -> None:
    """An at-least-once one-shot went out and succeeded while its claim's batch was still
    on its way to the disk; a replacing create naming its time asked the directory, which
    knows durable records only, and fired it again as attempt 1 (found by review)."""
    from engine.effects import CreateJob

    def spec(replace: bool = False) -> object:
        raw = {"id": "o", "schedule": {"at": format_utc(T0 + 1000)}}
        return validate_job({**raw, "task": {"command": ["true"]}, "replace": replace}, now_ms=T0)

    node = Node()
    node.do(WorkerHello("w1", ("default",), 0, (), "i1", 0))  # no free slot yet
    node.do(CreateJob(node.request(), spec()))  # type: ignore[arg-type]
    node.advance(1000)  # fired, durable, waiting for a slot
    node.auto_durable = False
    node.do(Pull("w1", 1))  # claimed and sent, its claim in the next batch
    (first,) = node.tickets()
    node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))
    node.do(CreateJob(node.request(), spec(replace=True)))  # type: ignore[arg-type]
    node.auto_durable = True
    node.flush()
    node.do(Pull("w1", 1))
    node.advance(100)
    assert [t.run_id for t in node.tickets()] == [first.run_id]
    assert run_states(node, 0)[T0 + 1000] == ["PENDING", "CLAIMED", "SUCCESS"]


def test_a_trigger_of_a_job_firing_every_millisecond_ends_at_once() -> None:
    """Every millisecond ahead is owed: the search for a free time never ended (found by
    review of the fix above). It is bounded; the scheduled runs are the trigger's."""
    node = Node()
    node.create(id="fast", schedule={"every": "1ms"})
    node.advance(5)
    reply = node.do(TriggerJob(node.request(), "fast", "up@1"))
    assert reply is not None and reply.result == {"run_id": None, "skipped": "no_free_time"}


def test_a_refused_trigger_takes_no_time_the_schedule_owes() -> None:
    """A trigger refused (chain too deep, or the job paused) is a skip record at its time:
    that time was not checked at all, so the next scheduled fire was both skipped and run."""
    node = Node()
    node.create(id="j", schedule={"every": "1s", "start": format_utc(T0 + 1000)})
    node.advance(999)  # the next scheduled fire is T0 + 1000
    deep = node.engine.config.max_chain_depth + 5
    reply = node.do(TriggerJob(node.request(), "j", "up@1", depth=deep))
    assert reply is not None and reply.result is not None
    assert reply.result["skipped"] == "chain_too_deep"
    assert reply.result["run_id"] != f"j@{T0 + 1000}"
    node.advance(10)
    assert T0 + 1000 in run_states(node, 0)
    assert not [s for s in node.skips() if s["lo"] <= T0 + 1000 <= s["hi"]]


def test_a_burst_of_triggers_keeps_every_time_given() -> None:
    """One upstream run fanning out: thousands of triggers within one millisecond (none of
    the times given is past yet, so none may be forgotten; the pass that forgets runs when
    the map has doubled, not at every trigger past 1,024: found by review)."""
    node = Node()
    for i in range(1500):
        node.create(id=f"d{i}", schedule={"every": "1h"})
    for i in range(1500):
        node.do(TriggerJob(node.request(), f"d{i}", "up@1"))
    assert len(node.engine._trigger_at) == 1500
    # the pass at 1,025 found nothing past and doubled the bound: not one pass per trigger
    assert node.engine._trigger_at_prune >= 2048
    node.advance(10)
    node.do(TriggerJob(node.request(), "d0", "up@2"))
    assert len(node.engine._trigger_at) <= 1500


def test_a_dependency_removed_before_its_records_had_times_is_not_forgotten_at_once() -> None:
    """Dependency records from before they carried their time: a pair turned off a minute
    before a restart counted as turned off at time 0 and was forgotten during the replay,
    and a late repeat of the older "on" registration then restored it (found by review)."""
    from engine.effects import RegisterDependent

    node = Node()
    node.do(RegisterDependent(node.request(), "up", "down", on=True, seq=1))
    node.do(RegisterDependent(node.request(), "up", "down", on=False, seq=2))
    node.flush()
    for r in node.durable_records:  # as written before the time was kept
        if r["t"] == "dep":
            r.pop("at", None)
    node.advance(60_000)
    node.crash_and_recover(downtime_ms=10)
    node.do(RegisterDependent(node.request(), "up", "down", on=True, seq=1))  # a late repeat
    assert "down" not in node.engine._dependents.get("up", set())


def test_a_refused_trigger_of_a_job_firing_every_millisecond_is_still_recorded() -> None:
    """Paused: the trigger is a skip with its source (a redelivery is then a repeat), also
    when no millisecond ahead is free; no_free_time won over the refusal and left nothing,
    and the redelivery after a resume ran (found by review)."""
    from engine.effects import PauseJob

    node = Node()
    node.create(id="fast", schedule={"every": "1ms"})
    node.advance(5)
    node.do(PauseJob(node.request(), "fast"))
    reply = node.do(TriggerJob(node.request(), "fast", "up@1"))
    assert reply is not None and reply.result is not None
    assert reply.result["skipped"] == "paused"
    assert [s["src"] for s in node.skips() if s.get("src")] == ["up@1"]
    node.do(ResumeJob(node.request(), "fast"))
    again = node.do(TriggerJob(node.request(), "fast", "up@1"))
    assert again is not None and again.result == {"duplicate": True}


def test_a_snapshot_from_before_removal_times_keeps_removed_pairs_a_window() -> None:
    """A snapshot's dependency entries from before they carried their time (three fields):
    a pair turned off had no time at all, and was kept for ever; it counts from the load."""
    from engine.effects import RegisterDependent

    node = Node(config=cfg(trigger_dedupe_ms=60_000))
    node.do(RegisterDependent(node.request(), "up", "down", on=True, seq=1))
    node.do(RegisterDependent(node.request(), "up", "down", on=False, seq=2))
    node.take_snapshot()
    assert node.snapshot is not None
    snap = node.snapshot[0]
    snap.meta["dep_seq"] = [entry[:3] for entry in snap.meta["dep_seq"]]  # the old form
    node.crash_and_recover(downtime_ms=10, via_snapshot=True)
    assert ("up", "down") in node.engine._dep_off  # kept a window from the load...
    late = node.do(RegisterDependent(node.request(), "up", "down", on=True, seq=1))
    assert late is not None and "down" not in node.engine._dependents.get("up", set())
    node.advance(61_000)
    node.do(RegisterDependent(node.request(), "up", "other", on=True, seq=3))
    assert ("up", "down") not in node.engine._dep_seq  # ...then forgotten


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_trigger_after_a_restart_with_the_clock_behind_takes_no_id_that_ran(
    via_snapshot: bool,
) -> None:
    """A scheduled run went out and ended; the shard restarts on a host whose clock is a few
    ms behind, and a trigger took that run's time again: one run id dispatched twice, both
    attempt 1 (found by review). A time whose run went out is never a trigger's."""
    node = Node()
    node.do(WorkerHello("w1", ("default",), 10))
    node.create(id="j", schedule={"every": "1h", "start": format_utc(T0 + 1000)})
    node.advance(1000)
    node.do(Pull("w1", 10))
    ran = [t for t in node.tickets() if t.job_id == "j"]
    for t in ran:
        node.do(ReportStarted("w1", t.run_id, t.token))
        node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    node.advance(5)
    node.take_snapshot()
    node.wall = T0 + 999  # the clock behind the run that went out
    node.crash_and_recover(via_snapshot=via_snapshot)
    reply = node.do(TriggerJob(node.request(), "j", "up@1"))
    assert reply is not None and reply.result is not None
    assert reply.result["run_id"] not in [t.run_id for t in ran]
