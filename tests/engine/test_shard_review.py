"""Defects found by review of the shard engine, each pinned by the test that first failed on it:
trigger dedupe per target, dispatches held behind the record of their attempt, reports that
carry the current token, stale epochs, node-side timeouts of at-most-once runs, kills held
behind their decision, cancelled versions' runs, paused jobs' triggers."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.effects import (
    CancelJob,
    Dispatch,
    Durable,
    Heartbeat,
    Kill,
    PauseJob,
    Pull,
    ReportFinished,
    ReportStarted,
    TriggerJob,
    WorkerHello,
)
from engine.errors import StaleEpoch
from engine.runs import RunState
from engine.schedules import format_utc
from engine.shard import EngineConfig, ShardEngine
from tests.engine.harness import Node


def cfg(**overrides: int) -> EngineConfig:
    values = {"worker_lease_ms": 10**9, "reattach_grace_ms": 10**9, **overrides}
    return EngineConfig(**values)


def once(node: Node, job_id: str, in_s: int = 1, **extra: object) -> None:
    node.create(id=job_id, schedule={"at": format_utc(node.wall + in_s * 1000)}, **extra)


def repeated_attempts(node: Node) -> dict[tuple[str, int], int]:
    """(run id, attempt) pairs that name more than one dispatch."""
    seen = Counter((t.run_id, t.attempt) for t in node.tickets())
    return {k: n for k, n in seen.items() if n > 1}


# ------------------------------------------------------------------------ A1: trigger dedupe


def test_every_dependent_on_one_shard_runs_after_one_upstream_success() -> None:
    node = Node()
    node.do(WorkerHello("w1", ("default",), 10))
    for down in ("v1", "v4", "v8"):
        node.create(id=down, schedule={"at": "2035-01-01T00:00:00Z"}, after=["vup"])
    node.deliver_registrations()
    once(node, "vup")
    node.advance(1000)
    (up,) = node.tickets()
    node.do(ReportFinished("w1", up.run_id, up.token, "success", 0))
    assert sorted(t.job_id for t in node.triggers) == ["v1", "v4", "v8"]
    for trigger in node.triggers:
        node.do(TriggerJob(node.request(), trigger.job_id, trigger.source_run_id))
    node.advance(1)
    assert sorted(t.job_id for t in node.tickets() if t.job_id != "vup") == ["v1", "v4", "v8"]


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_redelivered_trigger_is_a_repeat_for_its_own_target_only_after_recovery(
    via_snapshot: bool,
) -> None:
    node = Node()
    for down in ("a", "b"):
        node.create(id=down, schedule={"at": "2035-01-01T00:00:00Z"})
    node.do(TriggerJob(node.request(), "a", "up@1"))
    if via_snapshot:
        node.take_snapshot()
    node.crash_and_recover(via_snapshot=via_snapshot)
    repeat = node.do(TriggerJob(node.request(), "a", "up@1"))
    first_for_b = node.do(TriggerJob(node.request(), "b", "up@1"))
    assert repeat is not None and repeat.result == {"duplicate": True}
    assert first_for_b is not None and "run_id" in (first_for_b.result or {})


# ------------------------------------------------------------------------ F1, F2: held dispatches


def test_a_triggered_run_waits_for_its_creating_record_to_be_durable() -> None:
    node = Node(auto_durable=False)
    node.create(id="t", schedule={"at": "2030-01-01T00:00:00Z"})
    node.flush()
    node.do(WorkerHello("w1", ("default",), 1))
    node.flush()
    node.do(TriggerJob(node.request(), "t", "src@1"))  # its run's record: not durable yet
    node.advance(1)  # its time: claimed, but held
    assert node.tickets() == []
    node.flush()
    assert [t.job_id for t in node.tickets()] == ["t"]


def test_a_trigger_redelivered_after_a_crash_runs_under_one_run_id() -> None:
    node = Node(auto_durable=False)
    node.create(id="t", schedule={"at": "2030-01-01T00:00:00Z"})
    node.flush()
    node.do(WorkerHello("w1", ("default",), 1))
    node.flush()
    node.do(TriggerJob(node.request(), "t", "src@1"))
    node.advance(1)
    node.crash_and_recover()  # the run's record was never durable, and it never went out
    node.auto_durable = True
    node.flush()
    node.do(TriggerJob(node.request(), "t", "src@1"))  # the source's outbox redelivers
    node.do(WorkerHello("w2", ("default",), 1))
    node.advance(5)
    assert len({t.run_id for t in node.tickets()}) == 1


def test_an_attempt_set_by_a_requeue_not_durable_is_never_sent() -> None:
    node = Node(config=cfg(worker_lease_ms=5000, reattach_grace_ms=5000), auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 1))
    node.flush()
    once(node, "a")
    node.flush()
    node.advance(1000)
    node.flush()
    node.advance(3000)
    node.do(WorkerHello("w2", ("default",), 1))
    node.flush()
    node.advance(1500)  # w1's lease lapsed: requeued as attempt 2, claimed by w2, not durable
    assert [t.attempt for t in node.tickets()] == [1]
    node.crash_and_recover()  # lost: the run is CLAIMED attempt 1 again, in its grace
    node.auto_durable = True
    node.flush()
    node.run_until(5100, step=500)
    node.do(WorkerHello("w3", ("default",), 1))
    assert [t.attempt for t in node.tickets()] == [1, 2]
    assert repeated_attempts(node) == {}


def test_an_attempt_set_by_a_retry_not_durable_is_never_sent() -> None:
    node = Node(auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 5))
    node.flush()
    once(node, "a", retries={"max": 3, "backoff": "1s"})
    node.flush()
    node.advance(1000)
    node.flush()
    (t1,) = node.tickets("w1")
    node.do(ReportFinished("w1", t1.run_id, t1.token, "failed", 1))  # the retry: not durable
    node.advance(1000)  # its time: claimed, held
    assert [t.attempt for t in node.tickets()] == [1]
    node.crash_and_recover()
    node.auto_durable = True
    node.flush()
    node.do(WorkerHello("w9", ("default",), 5))
    node.do(WorkerHello("w1", ("default",), 5, ()))  # w1 restarted too: holds nothing
    node.run_until(10**9 + 10, step=10**8)
    node.do(WorkerHello("w9", ("default",), 5))
    assert repeated_attempts(node) == {}


def test_an_attempt_raised_by_a_claim_after_recovery_waits_for_that_claim() -> None:
    node = Node(auto_durable=False)
    once(node, "a")
    node.flush()
    node.advance(1000)
    node.flush()  # PENDING, durable
    node.do(WorkerHello("w1", ("default",), 1))  # attempt 1 out; its claim not durable
    node.crash_and_recover()
    node.do(WorkerHello("w2", ("default",), 1))  # maybe sent: attempt 2, held for its claim
    node.crash_and_recover()
    node.do(WorkerHello("w3", ("default",), 1))
    node.flush()
    assert repeated_attempts(node) == {}


# ------------------------------------------------------------------------ F3: the token counts


def test_a_final_report_with_the_current_token_counts_from_a_lapsed_worker() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=10_000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "m", delivery="at_most_once", retries={"max": 2, "backoff": "1s"})
    node.advance(1000)
    (t,) = node.tickets()
    node.advance(2500)  # w1's lease lapsed (a short partition): the run waits its grace
    node.do(ReportStarted("w1", t.run_id, t.token))  # a start report still changes nothing
    assert node.engine.run_state(t.run_id) is RunState.CLAIMED
    node.do(ReportFinished("w1", t.run_id, t.token, "failed", 3))
    assert node.engine.run_state(t.run_id) is RunState.PENDING  # a confirmed failure: retry
    node.do(WorkerHello("w2", ("default",), 1))
    node.advance(1500)  # the retry's backoff (1 s), within w2's lease
    assert [(x.run_id, x.attempt) for x in node.tickets()] == [(t.run_id, 1), (t.run_id, 2)]


# ------------------------------------------------------------------------ F8, F9: stale epochs


def test_a_durable_acknowledgement_of_a_stale_epoch_is_refused() -> None:
    node = Node(auto_durable=False)
    node.crash_and_recover()  # epoch 2
    once(node, "m", delivery="at_most_once")
    node.flush()
    node.do(WorkerHello("w1", ("default",), 1))
    node.flush()
    node.advance(1000)  # fire and claim in one batch, not durable
    (batch,) = node.unacked
    with pytest.raises(StaleEpoch):
        node.engine.handle(Durable(batch.batch_id), node.wall, node.mono, epoch=1)
    with pytest.raises(StaleEpoch):
        node.engine.handle_many([Durable(batch.batch_id)], node.wall, node.mono, epoch=1)
    node.flush()  # nothing was released by them; the real acknowledgement releases it once
    assert len(node.tickets()) == 1


def test_recovery_refuses_records_older_than_an_epoch_opened_before_them() -> None:
    node = Node()
    node.create(id="a", schedule={"at": "2030-01-01T00:00:00Z"})
    node.crash_and_recover()  # epoch 2 opened; its epoch record is durable
    zombie = Node()  # an epoch-1 owner whose write lands after it
    zombie.create(id="z", schedule={"at": "2030-01-01T00:00:00Z"})
    stale = [dict(r, key=5) for r in zombie.durable_records]
    with pytest.raises(StaleEpoch):
        ShardEngine.recover(
            node.durable_records + stale,
            epoch=3,
            wall_ms=node.wall,
            mono_ms=node.mono,
            config=node.config,
        )
    # In order (older epochs first) the same records load.
    ShardEngine.recover(
        stale + node.durable_records,
        epoch=3,
        wall_ms=node.wall,
        mono_ms=node.mono,
        config=node.config,
    )


# ------------------------------------------------------------------------ F5: AMO node timeouts


def test_an_at_most_once_timeout_on_a_live_worker_retries_after_the_confirmed_kill() -> None:
    node = Node(config=cfg(worker_lease_ms=3000, reattach_grace_ms=3000, timeout_grace_ms=1000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "m", delivery="at_most_once", timeout="2s", on_timeout="retry:2")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    for _ in range(4):  # reachable: it heartbeats; the node-side timeout asks it to stop
        node.advance(1000)
        node.do(Heartbeat("w1", ((t.run_id, t.token),)))
    assert [k.reason for k in node.kills] == ["timed out"]
    assert node.engine.run_state(t.run_id) is RunState.RUNNING
    node.do(ReportFinished("w1", t.run_id, t.token, "killed", None))  # the confirmed kill
    node.do(Pull("w1", 1))
    for _ in range(10):  # the retry's backoff, the worker still there
        node.advance(1000)
        node.do(Heartbeat("w1", ()))
    assert [(x.run_id, x.attempt) for x in node.tickets()] == [(t.run_id, 1), (t.run_id, 2)]
    last = node.runs()[(0, t.scheduled_ms)]
    assert (last["tmo"], last["state"]) == (1, "CLAIMED")


def test_an_at_most_once_run_stopping_on_timeout_is_timed_out_when_its_worker_vanishes() -> None:
    node = Node(config=cfg(worker_lease_ms=3000, reattach_grace_ms=3000, timeout_grace_ms=1000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "m", delivery="at_most_once", timeout="2s", on_timeout="retry:2")
    node.advance(1000)
    (t,) = node.tickets()
    for _ in range(4):
        node.advance(1000)
        node.do(Heartbeat("w1", ((t.run_id, t.token),)))
    assert [k.reason for k in node.kills] == ["timed out"]
    node.run_until(20_000, step=500)  # no heartbeat, no report: lease, then grace
    assert node.final_states() == ["TIMED_OUT"] and len(node.tickets()) == 1


# ------------------------------------------------------------------------ F6: kills held


def test_a_timeout_kill_waits_for_the_decision_to_be_durable() -> None:
    node = Node(config=cfg(timeout_grace_ms=1000), auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 1))
    node.flush()
    once(node, "a", timeout="2s", on_timeout="retry:2")
    node.flush()
    node.advance(1000)
    node.flush()
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    node.flush()
    node.advance(3001)  # the node-side timeout: the worker is asked to stop (nothing decided)
    assert [k.reason for k in node.kills] == ["timed out"]
    node.flush()
    # No confirmation within the reattach grace: the timeout is decided (a retry), and its
    # kill waits for that decision to be durable.
    for _ in range(4):
        # The worker heartbeats (its lease holds through the grace) without naming the run:
        # one naming it would say it is still stopping the task, and an at-least-once run
        # then waits on (test_an_unconfirmed_node_side_timeout_retries_at_least_once_...).
        node.do(Heartbeat("w1"))
        node.flush()
        node.advance(node.engine.config.reattach_grace_ms // 4)
    node.advance(1)
    assert len(node.kills) == 1 and node.unacked
    assert node.engine.run_state(t.run_id) is RunState.PENDING  # retry decided, in memory
    node.crash_and_recover()  # the decision is lost, and so is its kill: the task runs on
    node.auto_durable = True
    node.flush()
    node.do(WorkerHello("w1", ("default",), 1, ((t.run_id, t.token),)))
    assert node.engine.run_state(t.run_id) is RunState.RUNNING
    # Past its timeout already at the re-attach: asked to stop at once, nothing decided.
    assert [k.reason for k in node.kills] == ["timed out", "timed out"]


@pytest.mark.parametrize("how", ["cancel", "cancel_previous"])
def test_a_cancel_kill_waits_for_the_cancel_to_be_durable(how: str) -> None:
    node = Node(auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 2))
    node.flush()
    if how == "cancel":
        once(node, "a")
    else:
        node.create(
            id="a",
            schedule={"every": "1s", "start": format_utc(node.wall + 1000)},
            overlap="cancel_previous",
        )
    node.flush()
    node.advance(1000)
    node.flush()
    (t,) = node.tickets()
    if how == "cancel":
        node.do(CancelJob(node.request(), "a", stop_running=True))
    else:
        node.advance(1000)
    assert node.kills == [] and node.unacked
    node.flush()
    assert [(k.run_id, k.reason) for k in node.kills] == [
        (t.run_id, "job cancelled" if how == "cancel" else "cancel_previous")
    ]


# ------------------------------------------------------------------------ F10: cancelled versions


@pytest.mark.parametrize("crash", [False, True])
def test_a_cancelled_versions_failing_run_is_not_retried_after_the_id_is_created_again(
    crash: bool,
) -> None:
    node = Node()
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "r", retries={"max": 2, "backoff": "1s"})
    node.advance(1000)
    (t,) = node.tickets()
    node.do(CancelJob(node.request(), "r"))  # the running run carries on
    node.create(id="r", schedule={"at": "2030-01-01T00:00:00Z"}, task={"shell": "new"})
    if crash:
        node.crash_and_recover()
        node.do(WorkerHello("w1", ("default",), 1, ((t.run_id, t.token),)))
    node.do(ReportFinished("w1", t.run_id, t.token, "failed", 1))
    node.do(Pull("w1", 1))
    node.advance(2000)
    assert len(node.tickets()) == 1 and node.final_states() == ["FAILED"]


def test_a_cancelled_jobs_alo_run_is_not_sent_again_when_its_worker_is_lost() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=2000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "a")
    node.advance(1000)
    assert len(node.tickets()) == 1
    node.do(CancelJob(node.request(), "a"))  # stop_running=False: the run carries on
    node.advance(2500)  # w1 lost
    node.do(WorkerHello("w2", ("default",), 1))
    assert len(node.tickets()) == 1 and node.final_states() == ["CANCELLED"]


# ------------------------------------------------------------------------ F11: paused triggers


def test_a_paused_jobs_trigger_is_skipped_as_paused_and_its_redelivery_recognised() -> None:
    node = Node()
    node.do(WorkerHello("w1", ("default",), 5))
    node.create(id="t", schedule={"at": "2030-01-01T00:00:00Z"})
    node.do(PauseJob(node.request(), "t"))
    reply = node.do(TriggerJob(node.request(), "t", "src@1"))
    assert reply is not None and (reply.result or {}).get("skipped") == "paused"
    node.advance(5)
    assert node.tickets() == []
    assert [(s["why"], s.get("src")) for s in node.skips()] == [("paused", "src@1")]
    node.crash_and_recover()
    again = node.do(TriggerJob(node.request(), "t", "src@1"))
    assert again is not None and again.result == {"duplicate": True}


def test_effects_of_a_stale_durable_change_nothing() -> None:
    # handle() refuses before it moves time or releases anything.
    node = Node(auto_durable=False)
    node.crash_and_recover()
    wall = node.engine.now_ms
    with pytest.raises(StaleEpoch):
        node.engine.handle(Durable(1), node.wall + 10_000, node.mono + 10_000, epoch=1)
    assert node.engine.now_ms == wall
    assert not any(isinstance(e, Dispatch | Kill) for e in node.engine.tick(node.wall, node.mono))


# ------------------------------------------------------------------------ A4: bounded times


@pytest.mark.parametrize(
    "schedule",
    [{"at": "9999-12-31T23:59:59.999Z", "jitter": "1d"}, {"at": "1969-07-20T20:17:00Z"}],
)
def test_a_job_whose_times_cannot_be_represented_is_refused_and_not_stored(
    schedule: dict[str, str],
) -> None:
    from engine.errors import ScheduleError
    from engine.jobs import validate_job

    node = Node()
    with pytest.raises(ScheduleError):
        validate_job(
            {"id": "x", "schedule": schedule, "task": {"command": ["true"]}}, now_ms=node.wall
        )
    assert node.durable_records == []


def test_the_retry_after_a_confirmed_timeout_gets_its_own_timeout() -> None:
    """The attempt stopped on its timeout passes nothing on: its retry is not treated as
    being stopped (killed at the grace, its kill taken as a confirmed timeout)."""
    node = Node(config=cfg(worker_lease_ms=3000, reattach_grace_ms=3000, timeout_grace_ms=1000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "m", delivery="at_most_once", timeout="60s", on_timeout="retry:2")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    for _ in range(62):
        node.advance(1000)
        node.do(Heartbeat("w1", ((t.run_id, t.token),)))
    assert [k.reason for k in node.kills] == ["timed out"]
    node.do(ReportFinished("w1", t.run_id, t.token, "killed", None))
    node.do(Pull("w1", 1))
    second = None
    for _ in range(30):
        node.advance(1000)
        if second is None and len(node.tickets()) == 2:
            second = node.tickets()[1]
            node.do(ReportStarted("w1", second.run_id, second.token))
        node.do(Heartbeat("w1", ((second.run_id, second.token),) if second else ()))
    assert second is not None and second.attempt == 2
    assert len(node.kills) == 1  # 30 s into a 60 s timeout: nothing to stop
    assert node.engine.run_state(second.run_id) is RunState.RUNNING


# ------------------------------------- F4: a replacing create never re-fires a time that ran


@pytest.mark.parametrize("how", ["replace", "cancel-then-create"])
def test_a_one_shot_time_its_id_already_ran_is_not_fired_again(how: str) -> None:
    """The run id (job id + time) is the task's idempotency key, and DESIGN makes a repeated
    creation a no-op: a new version of the id with the same past time owes nothing."""
    node = Node()
    node.do(WorkerHello("w1", ("default",), 5))
    at = format_utc(node.wall + 1000)
    node.create(id="m", schedule={"at": at}, delivery="at_most_once")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    if how == "replace":
        reply = node.create(id="m", schedule={"at": at}, delivery="at_most_once", replace=True)
    else:
        node.do(CancelJob(node.request(), "m"))
        reply = node.create(id="m", schedule={"at": at}, delivery="at_most_once")
    assert reply is not None and reply.result is not None
    assert reply.result["next_fire_ms"] is None
    node.advance(1000)
    assert len(node.tickets()) == 1 and repeated_attempts(node) == {}


def test_a_replacing_create_still_owes_a_past_one_shot_time_that_never_ran() -> None:
    node = Node()
    node.do(WorkerHello("w1", ("default",), 5))
    node.create(id="m", schedule={"at": format_utc(node.wall + 60_000)})
    node.advance(1000)
    past = format_utc(node.wall - 500)  # a time this id has no run at
    node.create(id="m", schedule={"at": past}, replace=True)
    node.advance(1)
    (t,) = node.tickets()
    assert t.run_id.startswith("m@")


def test_the_store_and_the_memory_directory_know_the_same_runs(tmp_path: object) -> None:
    """``has_run``: the RocksDB store and the in-memory directory of the tests and the
    simulation answer alike for fired, finished and never-fired times."""
    import pathlib

    from engine.directory import MemoryDirectory
    from wal.store import ShardStore

    node = Node()
    node.do(WorkerHello("w1", ("default",), 2))
    once(node, "a")
    node.create(id="b", schedule={"every": "1s"})
    node.advance(3000)  # more fires than credits: some only fire
    for t in node.tickets():
        node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    records = node.durable_records
    memory = MemoryDirectory(records)
    store = ShardStore.open(str(pathlib.Path(str(tmp_path)) / "s"), shard=0, shards=1, epoch=1)
    try:
        from engine.effects import Persist

        stamped = [dict(r, e=1) if r.get("e") is not None else r for r in records]
        store.write([Persist(1, 1, tuple(stamped))])
        from engine.records import expand

        fired = {(r["key"], r["at"]) for x in records for r in expand(x) if r["t"] == "run"}
        out = {
            (r["key"], r["at"]) for r in records if r["t"] == "run" and (r["tok"] or r["att"] > 1)
        }
        assert out and fired - out  # runs that went out, and one that only fired
        probes = fired | {(k, at + 1) for k, at in fired} | {(99, 0)}
        for key, at in sorted(probes):
            assert store.has_run(key, at) == memory.has_run(key, at) == ((key, at) in out)
    finally:
        store.close()


# ------------------------------- F7: the node-side timeout resumes its clock at a re-attach


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_the_node_side_timeout_survives_restarts_and_reattaches(via_snapshot: bool) -> None:
    """DESIGN: no final report by start + timeout + grace. The start time is recorded, so a
    run re-attached after every restart still times out then, not never."""
    node = Node(config=cfg(worker_lease_ms=3000, reattach_grace_ms=3000, timeout_grace_ms=1000))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "a", timeout="5s")
    node.advance(1000)
    (t,) = node.tickets()
    held = ((t.run_id, t.token),)
    node.do(ReportStarted("w1", t.run_id, t.token))
    start = node.wall
    for _ in range(3):
        for _ in range(5):
            node.advance(500)
            node.do(Heartbeat("w1", held))
        if via_snapshot:
            node.take_snapshot()
        node.crash_and_recover(via_snapshot=via_snapshot)
        node.do(WorkerHello("w1", ("default",), 0, held))
    assert node.wall - start > 6000  # past start + timeout + grace
    node.advance(1)
    assert node.kills[0].reason == "timed out"  # asked to stop (then "superseded"...)
    node.do(ReportFinished("w1", t.run_id, t.token, "killed", None))  # confirmed
    assert node.engine.run_state(t.run_id) is None  # timed out


def started_with_timeout(node: Node, job_id: str) -> tuple[str, int]:
    """An at-most-once run of ``job_id`` (timeout 2 s, retry:2) started on w1 (instance i1)."""
    node.do(WorkerHello("w1", ("default",), 4, instance="i1"))
    once(node, job_id, timeout="2s", on_timeout="retry:2", delivery="at_most_once")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    return t.run_id, t.token


AFTER_RESTART = cfg(worker_lease_ms=10_000, reattach_grace_ms=20_000, timeout_grace_ms=1000)


@pytest.mark.parametrize("same_call", [False, True])
def test_a_stop_confirmed_after_a_restart_applies_the_timeout_handler(same_call: bool) -> None:
    """Found by review: an at-most-once run timed out, its worker was asked to stop it and did,
    and the node crashed before the "killed" report was durable. The worker's hello and its
    report again can land in one engine call; the stop (not recorded) was asked again only by
    a timer at the next call, so the report read as a plain "killed" failure: no retry, no
    TIMED_OUT. The re-attach asks for the stop at once now."""
    node = Node(config=AFTER_RESTART)
    rid, token = started_with_timeout(node, "t")
    held = ((rid, token),)
    for _ in range(4):
        node.advance(1000)
        node.do(Heartbeat("w1", held))
    assert [k.reason for k in node.kills] == ["timed out"]
    node.crash_and_recover(downtime_ms=500)  # the "killed" report was never durable
    hello = WorkerHello("w1", ("default",), 4, held, instance="i1")
    report = ReportFinished("w1", rid, token, "killed", -15)
    if same_call:
        node.absorb(node.engine.handle_many([hello, report], node.wall, node.mono))
    else:
        node.do(hello)
        node.advance(1)
        node.do(report)
    node.flush()
    assert node.engine.run_state(rid) == "PENDING"  # its first retry, at its backoff
    assert [r.get("why") for r in node.runs().values()] == ["timed out; retry 1"]


def test_a_success_reported_with_the_hello_after_a_lapsed_timeout_counts() -> None:
    """The stop asked at a re-attach decides nothing: a success the worker reports in the same
    call (the task ended before the kill reached it) is the run's outcome."""
    node = Node(config=AFTER_RESTART)
    rid, token = started_with_timeout(node, "s")
    node.crash_and_recover(downtime_ms=4000)  # the timeout lapsed while the node was down
    hello = WorkerHello("w1", ("default",), 4, ((rid, token),), instance="i1")
    report = ReportFinished("w1", rid, token, "success", 0)
    node.absorb(node.engine.handle_many([hello, report], node.wall, node.mono))
    node.flush()
    assert [k.reason for k in node.kills] == ["timed out"]  # asked, but it had ended
    assert node.final_states() == ["SUCCESS"]


def marked_run(node: Node, job_id: str) -> tuple[str, int]:
    """A run of ``job_id`` TIMED_OUT under on_timeout=mark, its task running on with w1."""
    node.do(WorkerHello("w1", ("default",), 4, instance="i1"))
    once(node, job_id, timeout="2s", on_timeout="mark")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    for _ in range(4):
        node.advance(1000)
        node.do(Heartbeat("w1", ((t.run_id, t.token),)))
    node.flush()
    assert node.final_states() == ["TIMED_OUT"] and node.engine.marked_running(t.run_id)
    return t.run_id, t.token


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_marked_task_runs_on_across_a_restart(via_snapshot: bool) -> None:
    """Found by review: the mark lived in memory only, so after a restart the worker's hello
    announcing the task got a "superseded" kill, and every restart killed every task that
    on_timeout=mark had let run on. It is recorded now, and ends with the task's report."""
    node = Node(config=cfg(worker_lease_ms=10_000, reattach_grace_ms=20_000))
    rid, token = marked_run(node, "m")
    if via_snapshot:
        node.take_snapshot()
    node.crash_and_recover(downtime_ms=100, via_snapshot=via_snapshot)
    assert node.engine.marked_running(rid)
    node.do(WorkerHello("w1", ("default",), 4, ((rid, token),), instance="i1"))
    for _ in range(3):
        node.advance(1000)
        node.do(Heartbeat("w1", ((rid, token),)))
    assert node.kills == []
    node.do(ReportFinished("w1", rid, token, "success", 0))  # the task's own end
    node.flush()
    assert not node.engine.marked_running(rid)
    assert node.final_states() == ["TIMED_OUT"]  # its outcome stays the timeout's
    node.crash_and_recover(downtime_ms=100)  # the report's note ended the mark for good
    assert not node.engine.marked_running(rid)


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_recovered_mark_whose_worker_never_returns_is_dropped(via_snapshot: bool) -> None:
    """A mark lives while its worker's lease does: after a restart, a worker that does not
    say hello again within the reattach grace and a lease has none, and its marks go, for
    good (recorded: a later restart from records or a snapshot does not bring it back), and a
    later announcement of the task is told to stop it."""
    node = Node(config=cfg(worker_lease_ms=3_000, reattach_grace_ms=5_000))
    rid, token = marked_run(node, "m")
    node.take_snapshot()
    node.crash_and_recover(downtime_ms=100, via_snapshot=True)
    assert node.engine.marked_running(rid)
    node.advance(7_999)
    assert node.engine.marked_running(rid)
    node.advance(2)
    assert not node.engine.marked_running(rid)
    node.flush()
    if via_snapshot:
        node.take_snapshot()
    node.crash_and_recover(downtime_ms=100, via_snapshot=via_snapshot)
    assert not node.engine.marked_running(rid)
    node.do(WorkerHello("w1", ("default",), 4, ((rid, token),), instance="i1"))
    assert [(k.run_id, k.reason) for k in node.kills] == [(rid, "superseded")]


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_mark_ended_by_a_lease_lapse_stays_ended_after_a_restart(via_snapshot: bool) -> None:
    """Found by review: the lease lapse forgot the mark in memory only, so a restart (from
    records, or from a snapshot taken before the lapse) brought it back for a task its worker
    had killed when it fenced itself, and ``logs --follow`` never ended."""
    node = Node(config=cfg(worker_lease_ms=3_000, reattach_grace_ms=5_000))
    rid, _token = marked_run(node, "m")
    if via_snapshot:
        node.take_snapshot()
    node.advance(3_001)  # no heartbeat: the lease lapses (the worker fences itself)
    assert not node.engine.marked_running(rid)
    node.flush()
    node.crash_and_recover(downtime_ms=100, via_snapshot=via_snapshot)
    assert not node.engine.marked_running(rid)


@pytest.mark.parametrize("restart_node", [False, True])
def test_a_hello_without_the_marked_task_ends_its_mark(restart_node: bool) -> None:
    """Found by review: a worker that restarted (a new process) says hello without the task,
    which died with it; the mark stayed for as long as the worker lived."""
    node = Node(config=cfg(worker_lease_ms=10_000, reattach_grace_ms=20_000))
    rid, _token = marked_run(node, "m")
    if restart_node:
        node.crash_and_recover(downtime_ms=100)
        assert node.engine.marked_running(rid)
    node.do(WorkerHello("w1", ("default",), 4, (), instance="i2"))
    assert not node.engine.marked_running(rid)
    node.flush()
    node.crash_and_recover(downtime_ms=100)
    assert not node.engine.marked_running(rid)


def test_a_reattach_within_the_lease_grace_keeps_the_deadline() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=10_000, timeout_grace_ms=0))
    node.do(WorkerHello("w1", ("default",), 1))
    once(node, "b", delivery="at_most_once", timeout="4s", on_timeout="mark")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    node.advance(2500)  # the lease lapsed: the run waits for a re-attach
    node.do(WorkerHello("w1", ("default",), 0, ((t.run_id, t.token),)))
    node.advance(1600)  # 4.1 s after the start
    assert node.engine.run_state(t.run_id) is None


# -------------------- an every-job's first time, a moment before the turn that creates it


def test_an_every_jobs_start_a_moment_ago_is_owed() -> None:
    """Found by a second adversarial pass: the default start is the node's clock when the
    request arrived, and the shard's turn comes a few ms later; the first fire was dropped
    (neither run nor skipped) for most bulk-created every-jobs."""
    node = Node()
    node.do(WorkerHello("w1", ("default",), 5))
    start = node.wall - 5
    reply = node.create(id="e", schedule={"every": "3s", "start": format_utc(start)})
    assert reply is not None and reply.result is not None
    assert reply.result["next_fire_ms"] == start
    node.advance(1)
    assert [t.scheduled_ms for t in node.tickets()] == [start]


def test_an_every_jobs_start_long_past_is_not_caught_up_at_creation() -> None:
    node = Node()
    start = node.wall - 10 * 60_000  # ten minutes ago: beyond misfire_ms
    reply = node.create(id="e", schedule={"every": "3s", "start": format_utc(start)})
    assert reply is not None and reply.result is not None
    assert reply.result["next_fire_ms"] >= node.wall  # the next time from now on


@pytest.mark.parametrize("durable_before_the_create", [True, False])
def test_a_one_shot_that_only_fired_then_was_cancelled_is_owed_again(
    durable_before_the_create: bool,
) -> None:
    """Found by review: whether the fire's batch was durable decided if a re-created id owed
    the time. A run that never went out ran nothing: the time is owed, either way."""
    node = Node(auto_durable=durable_before_the_create)
    at = format_utc(node.wall + 1000)
    node.create(id="m", schedule={"at": at})
    node.advance(1000)  # fired; no worker
    node.do(CancelJob(node.request(), "m"))
    node.create(id="m", schedule={"at": at})
    node.flush()
    node.do(WorkerHello("w1", ("default",), 1))
    node.advance(1)
    node.flush()
    assert [t.job_id for t in node.tickets()] == ["m"]
