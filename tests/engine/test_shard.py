"""The shard engine, transition by transition, handler by handler, policy by policy."""

from __future__ import annotations

import itertools

import pytest

from engine.effects import (
    CancelJob,
    Dispatch,
    GetJob,
    Heartbeat,
    OutboxDelivered,
    PauseJob,
    Persist,
    Pull,
    Reply,
    ReportFinished,
    ReportStarted,
    ResumeJob,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import IllegalTransition, StaleEpoch, TimeWentBackwards
from engine.jobs import validate_job
from engine.records import expand
from engine.runs import TRANSITIONS, RunEvent, RunState, transition
from engine.shard import EngineConfig, ShardEngine
from tests.engine.harness import T0, Node

ISO = "2026-01-01T00:00:{:02d}Z"


def cfg(**overrides: int) -> EngineConfig:
    """A config whose leases outlast the test unless the test sets them."""
    values = {"worker_lease_ms": 10**9, "reattach_grace_ms": 10**9, **overrides}
    return EngineConfig(**values)


def once(node: Node, job_id: str, in_s: int = 1, **extra: object) -> None:
    at = node.wall + in_s * 1000
    from engine.schedules import format_utc

    reply = node.create(id=job_id, schedule={"at": format_utc(at)}, **extra)
    assert (reply is None and not node.auto_durable) or (
        reply is not None and reply.error is None
    ), reply


def worker(
    node: Node, name: str = "w1", credits: int = 4, tiers: tuple[str, ...] = ("default",)
) -> None:
    node.do(WorkerHello(name, tiers, credits))


# ------------------------------------------------------------------------ the state table


def test_transition_table_is_exactly_the_design_table() -> None:
    s = RunState
    assert transition(s.PENDING, RunEvent.CLAIM) is s.CLAIMED
    assert transition(s.CLAIMED, RunEvent.REQUEUE) is s.PENDING
    assert transition(s.FAILED, RunEvent.RETRY) is s.PENDING
    for final in (s.SUCCESS, s.LOST, s.SKIPPED, s.CANCELLED):
        for event in RunEvent:
            with pytest.raises(IllegalTransition):
                transition(final, event)
    # Nothing leaves PENDING for a final outcome without being claimed first.
    assert {e for (st, e) in TRANSITIONS if st is s.PENDING} == {
        RunEvent.CLAIM,
        RunEvent.SKIP,
        RunEvent.CANCEL,
    }


# ------------------------------------------------------------------------ job commands


def test_create_replies_only_after_the_batch_is_durable() -> None:
    node = Node(auto_durable=False)
    reply = node.create(id="a", schedule={"every": "1m", "start": "2026-01-01T00:01:00Z"})
    assert reply is None and len(node.unacked) == 1
    kinds = [r["t"] for r in node.unacked[0].records]
    assert kinds == ["job", "pos"]
    node.flush()
    reply = node.replies[1]
    assert reply.error is None and reply.result is not None
    assert reply.result["next_fire_ms"] == T0 + 60_000


def test_create_twice_is_refused_unless_replace_and_nothing_is_written() -> None:
    node = Node()
    node.create(id="a", schedule={"every": "1m", "start": ISO.format(30)})
    before = len(node.durable_records)
    reply = node.create(id="a", schedule={"every": "1m", "start": ISO.format(30)})
    assert reply is not None and reply.error is not None and reply.error.code == "exists"
    assert len(node.durable_records) == before
    reply = node.create(id="a", schedule={"every": "2m", "start": ISO.format(30)}, replace=True)
    assert reply is not None and reply.error is None and reply.result["version"] == 2


def test_unknown_job_is_a_typed_error() -> None:
    node = Node()
    reply = node.do(PauseJob(node.request(), "nope"))
    assert reply is not None and reply.error is not None and reply.error.code == "not_found"
    assert node.durable_records == []


def test_fire_creates_the_run_and_advances_the_job_in_one_batch() -> None:
    node = Node(auto_durable=False)
    node.create(id="e", schedule={"every": "10s", "start": "2026-01-01T00:00:10Z"})
    node.flush()
    node.advance(10_000)
    batch = node.unacked[-1]
    assert [r["t"] for r in batch.records] == ["fire"]
    run, pos = expand(batch.records[0])
    assert (run["state"], run["at"], run["att"]) == ("PENDING", T0 + 10_000, 1)
    assert pos["next"] == T0 + 20_000 and pos["acct"] == T0 + 19_999


def test_pending_run_is_not_handed_out_before_its_fire_batch_is_durable() -> None:
    node = Node(auto_durable=False)
    worker(node)
    once(node, "x")
    node.flush()
    node.advance(1000)
    assert node.tickets() == []  # the PENDING record is not durable yet
    node.flush(node.unacked[0].batch_id)
    assert [t.run_id for t in node.tickets()] == [f"x@{T0 + 1000}"]


def test_a_fire_and_its_claim_share_a_batch_and_the_run_waits_for_it() -> None:
    # A worker is waiting: the run is claimed in the call that fires it, its claim in the
    # fire's batch, and it goes out (either mode) once that one batch is durable.
    for delivery in ("at_least_once", "at_most_once"):
        node = Node(auto_durable=False)
        worker(node)
        once(node, delivery, delivery=delivery)
        node.flush()
        node.advance(1000)
        batch = node.unacked[-1]
        kinds = [(r["t"], r.get("state")) for r in batch.records]
        assert kinds == [("fire", None), ("run", "CLAIMED")], kinds
        assert node.tickets() == []  # the fire is not durable yet: a crash would forget it
        node.flush(batch.batch_id)
        (ticket,) = node.tickets()
        assert ticket.token == batch.records[1]["tok"] and ticket.attempt == 1


def test_at_least_once_goes_out_at_claim_when_its_fire_is_durable() -> None:
    node = Node(auto_durable=False)
    once(node, "alo")
    node.flush()
    node.advance(1000)  # fired with no worker: PENDING
    node.flush()
    worker(node)
    # Claimed when the worker says hello, and sent in that call, before the claim is durable
    # (at-least-once: the claim follows in the next batch).
    assert len(node.tickets()) == 1
    claim = node.unacked[-1].records[0]
    assert claim["state"] == "CLAIMED" and claim["tok"] == node.tickets()[0].token


def test_at_most_once_claim_is_durable_before_the_run_is_sent() -> None:
    node = Node(auto_durable=False)
    once(node, "amo", delivery="at_most_once")
    node.flush()
    node.advance(1000)
    node.flush()  # the fire is durable, the run PENDING
    worker(node)
    assert node.tickets() == []
    assert node.unacked and node.unacked[-1].records[0]["state"] == "CLAIMED"
    node.flush()
    assert len(node.tickets()) == 1


def test_success_path_and_history() -> None:
    node = Node()
    worker(node)
    once(node, "s")
    node.advance(1000)
    (ticket,) = node.tickets()
    assert ticket.attempt == 1 and ticket.task == {"command": ["true"]}
    node.do(ReportStarted("w1", ticket.run_id, ticket.token))
    assert node.engine.run_state(ticket.run_id) is RunState.RUNNING
    node.do(ReportFinished("w1", ticket.run_id, ticket.token, "success", 0))
    assert node.engine.run_state(ticket.run_id) is None
    states = [r["state"] for r in node.canonical_records() if r["t"] == "run"]
    assert states == ["PENDING", "CLAIMED", "RUNNING", "SUCCESS"]


def test_superseded_report_is_kept_but_changes_nothing() -> None:
    node = Node(config=EngineConfig(worker_lease_ms=2000, reattach_grace_ms=2000))
    worker(node, "w1")
    once(node, "z")
    node.advance(1000)
    (first,) = node.tickets()
    node.advance(1500)  # w1 stops heartbeating: its lease lapses, the run goes out again
    worker(node, "w2")
    second = node.tickets("w2")[0]
    assert second.attempt == 2 and second.token > first.token
    node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))
    assert node.engine.run_state(first.run_id) is RunState.CLAIMED
    notes = [r for r in node.durable_records if r["t"] == "note"]
    assert notes and notes[-1]["tok"] == first.token
    node.do(ReportFinished("w2", second.run_id, second.token, "failed", 3))
    assert node.runs()[(0, T0 + 1000)]["state"] == "FAILED"


def test_cancel_cancels_pending_runs_and_stops_running_ones_only_when_asked() -> None:
    node = Node()
    once(node, "c1")
    once(node, "c2")
    node.advance(1000)
    worker(node, credits=1)  # takes one of the two
    (taken,) = node.tickets()
    other = "c2" if taken.job_id == "c1" else "c1"
    node.do(CancelJob(node.request(), other))
    node.do(CancelJob(node.request(), taken.job_id))
    assert node.engine.run_state(taken.run_id) is RunState.CLAIMED  # keeps running
    once(node, "c3")
    node.advance(1000)
    worker(node, "w9", credits=1)
    ticket = node.tickets("w9")[0]
    node.do(CancelJob(node.request(), "c3", stop_running=True))
    assert node.kills[-1].run_id == ticket.run_id
    assert node.runs()[(2, ticket.scheduled_ms)]["state"] == "CANCELLED"
    states = {r["key"]: r["state"] for r in node.runs().values()}
    assert "CANCELLED" in states.values()


def test_pause_then_resume_skips_missed_times_as_paused_and_runs_the_latest() -> None:
    node = Node()
    node.create(id="p", schedule={"every": "1m", "start": "2026-01-01T00:01:00Z"})
    node.do(PauseJob(node.request(), "p"))
    node.run_until(10 * 60_000, step=10_000)
    assert node.runs() == {}
    node.do(ResumeJob(node.request(), "p"))
    node.advance(1)
    (skip,) = node.skips()
    assert skip["why"] == "paused" and skip["n"] == 9
    (run,) = node.runs().values()
    assert run["at"] == T0 + 10 * 60_000


@pytest.mark.parametrize(
    ("catchup", "runs", "skipped"),
    [("latest", 1, 29), ("skip", 0, 30), ("all", 5, 25)],
)
def test_catchup_policies_after_downtime(catchup: str, runs: int, skipped: int) -> None:
    node = Node()
    node.create(
        id="cu",
        schedule={"every": "1m", "start": "2026-01-01T00:01:00Z"},
        catchup=catchup,
        max_catchup=5,
    )
    node.crash_and_recover(downtime_ms=30 * 60_000 + 30_000)
    node.advance(1)
    assert len(node.runs()) == runs
    assert sum(s["n"] for s in node.skips()) == skipped
    assert all(s["why"] == "catchup" for s in node.skips())
    reply = node.do(GetJob(node.request(), "cu"))
    assert reply is not None and reply.result["next_fire_ms"] == T0 + 31 * 60_000


@pytest.mark.parametrize("overlap", ["allow", "skip", "buffer_one", "cancel_previous"])
def test_overlap_policies(overlap: str) -> None:
    node = Node()
    worker(node, credits=10)
    node.create(id="o", schedule={"every": "10s", "start": ISO.format(10)}, overlap=overlap)
    node.advance(10_000)
    (first,) = node.tickets()
    node.do(ReportStarted("w1", first.run_id, first.token))
    node.advance(10_000)  # the second fire while the first still runs
    node.advance(10_000)  # and a third
    runs = node.runs()
    tickets = node.tickets()
    if overlap == "allow":
        assert len(tickets) == 3
    elif overlap == "skip":
        assert len(tickets) == 1 and [s["why"] for s in node.skips()] == ["overlap", "overlap"]
    elif overlap == "buffer_one":
        assert len(tickets) == 1 and len(runs) == 2 and len(node.skips()) == 1
        node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))
        assert len(node.tickets()) == 2  # the buffered run goes once the first is done
    else:
        assert len(tickets) == 3
        assert node.kills and node.kills[0].run_id == first.run_id
        states = sorted(r["state"] for r in runs.values())
        assert states == ["CANCELLED", "CANCELLED", "CLAIMED"]


# ------------------------------------------------------------------------ timeouts and retries


def test_failure_retries_with_backoff_and_keeps_the_run_id() -> None:
    node = Node()
    worker(node)
    once(node, "r", retries={"max": 2, "backoff": "5s"})
    node.advance(1000)
    t1 = node.tickets()[-1]
    node.do(ReportFinished("w1", t1.run_id, t1.token, "failed", 1))
    node.do(Pull("w1", 4))
    assert len(node.tickets()) == 1  # waits for its backoff
    node.advance(5000)
    t2 = node.tickets()[-1]
    assert (t2.run_id, t2.attempt) == (t1.run_id, 2) and t2.token > t1.token
    node.do(ReportFinished("w1", t2.run_id, t2.token, "failed", 1))
    node.advance(10_000)
    t3 = node.tickets()[-1]
    assert t3.attempt == 3
    node.do(ReportFinished("w1", t3.run_id, t3.token, "failed", 1))
    node.advance(60_000)
    assert len(node.tickets()) == 3
    assert node.final_states() == ["FAILED"]


@pytest.mark.parametrize("handler", ["kill", "mark", "retry:1", "trigger:other"])
def test_node_side_timeout_handlers(handler: str) -> None:
    node = Node(config=cfg(timeout_grace_ms=1000))
    worker(node)
    once(node, "t", timeout="2s", on_timeout=handler)
    node.advance(1000)
    t1 = node.tickets()[-1]
    node.do(ReportStarted("w1", t1.run_id, t1.token))
    node.run_until(3500, step=500)
    if handler == "mark":
        assert node.kills == []
        assert node.final_states() == ["TIMED_OUT"]
        return
    assert node.kills[0].run_id == t1.run_id
    # A live worker is asked to stop the task, whatever the delivery, and the handler applies
    # on its confirmation (without one: test_an_unconfirmed_node_side_timeout_...).
    assert node.final_states() == ["RUNNING"]
    node.do(ReportFinished("w1", t1.run_id, t1.token, "killed", None))
    if handler == "kill":
        assert node.final_states() == ["TIMED_OUT"]
    elif handler == "retry:1":
        node.run_until(15_000, step=500)
        assert [t.attempt for t in node.tickets()] == [1, 2]
    else:
        assert node.final_states() == ["TIMED_OUT"]
        (trigger,) = node.triggers
        assert (trigger.job_id, trigger.source_run_id) == ("other", t1.run_id)
        node.do(OutboxDelivered(trigger.seq))
        assert node.durable_records[-1]["t"] == "outdone"


def _timed_out_and_asked_to_stop(delivery: str) -> tuple[Node, tuple[tuple[str, int], ...]]:
    """A run of ``delivery`` (timeout 2 s, retry:3) past its node-side timeout on a live
    worker w1 that heartbeats it: asked to stop, waiting for the confirmation. The node, and
    what w1's heartbeats say it holds."""
    node = Node(config=cfg(worker_lease_ms=3000, reattach_grace_ms=5000, timeout_grace_ms=1000))
    worker(node)
    once(node, "t", timeout="2s", on_timeout="retry:3", delivery=delivery)
    node.advance(1000)
    (t1,) = node.tickets()
    held = ((t1.run_id, t1.token),)
    for _ in range(4):  # past the node-side timeout (claim + 2 s + 1 s): asked to stop
        node.advance(1000)
        node.do(Heartbeat("w1", held))
    assert [k.reason for k in node.kills] == ["timed out"]
    assert node.final_states() == ["CLAIMED"]  # waiting for the stop's confirmation
    return node, held


@pytest.mark.parametrize("worker_goes", ["lease lapses", "lets the task go"])
def test_an_unconfirmed_node_side_timeout_retries_at_least_once_after_the_wait(
    worker_goes: str,
) -> None:
    """At-least-once, the node-side timeout also waits for the stop's confirmation (a worker
    still stopping the task, a long kill grace or a container being removed, would otherwise
    have the retry run beside it). It waits for as long as the worker still announces the
    task (a minute here, twelve reattach graces); once the worker lets it go, or its lease
    lapses, the timeout stands unconfirmed and its handler retries it. (It retried after one
    grace while the worker still held the task, beside it: found by the simulation's check 8
    with stops longer than the grace.)"""
    node, held = _timed_out_and_asked_to_stop("at_least_once")
    for _ in range(60):
        node.advance(1000)
        node.do(Heartbeat("w1", held))
    assert len(node.tickets()) == 1 and node.final_states() == ["CLAIMED"]  # still waiting
    if worker_goes == "lets the task go":
        node.do(WorkerHello("w1", ("default",), 1, ()))
    else:
        node.advance(3500)
    assert node.final_states() == ["PENDING"]
    assert node.durable_records[-1]["why"] == "timed out; retry 1"


@pytest.mark.parametrize("worker_goes", ["lease lapses", "heartbeats without confirming"])
def test_at_most_once_is_never_retried_after_an_unconfirmed_node_side_timeout(
    worker_goes: str,
) -> None:
    node, held = _timed_out_and_asked_to_stop("at_most_once")
    for _ in range(12):
        node.advance(1000)
        if worker_goes != "lease lapses":
            node.do(Heartbeat("w1", held))
    assert len(node.tickets()) == 1 and node.final_states() == ["TIMED_OUT"]


def test_at_most_once_retries_after_a_confirmed_timeout() -> None:
    node = Node()
    worker(node)
    once(node, "t", timeout="2s", on_timeout="retry:1", delivery="at_most_once")
    node.advance(1000)
    t1 = node.tickets()[-1]
    node.do(ReportFinished("w1", t1.run_id, t1.token, "timed_out", None))
    node.run_until(15_000, step=500)
    assert [t.attempt for t in node.tickets()] == [1, 2]


# ------------------------------------------------------------------------ leases and restarts


def test_lapsed_worker_lease_at_least_once_goes_out_again_at_most_once_is_lost() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=3000))
    worker(node, "w1")
    once(node, "alo")
    once(node, "amo", delivery="at_most_once")
    node.advance(1000)
    assert len(node.tickets("w1")) == 2
    node.advance(1500)  # lease lapsed
    worker(node, "w2")
    assert [t.job_id for t in node.tickets("w2")] == ["alo"]
    node.run_until(1500, step=250)
    node.do(Heartbeat("w2"))
    node.run_until(1750, step=250)
    node.do(Heartbeat("w2"))
    states = {r["key"]: r["state"] for r in node.runs().values()}
    assert states[1] == "LOST"
    assert len([t for t in node.tickets() if t.job_id == "amo"]) == 1


def test_restart_reattach_keeps_runs_and_grace_decides_the_rest() -> None:
    node = Node(config=cfg(worker_lease_ms=4000, reattach_grace_ms=5000))
    worker(node, "w1", credits=10)
    for name in ("a1", "a2"):
        once(node, name)
    for name in ("m1", "m2"):
        once(node, name, delivery="at_most_once")
    node.advance(1000)
    by_job = {t.job_id: t for t in node.tickets()}
    node.crash_and_recover()
    # w1 comes back holding a1 and m1 only.
    held = tuple((by_job[j].run_id, by_job[j].token) for j in ("a1", "m1"))
    node.do(WorkerHello("w1", ("default",), 0, held))
    node.run_until(3000, step=250)
    node.do(Heartbeat("w1", held))
    node.run_until(2500, step=250)
    node.do(Heartbeat("w1", held))
    assert node.engine.run_state(by_job["a1"].run_id) is RunState.CLAIMED
    assert node.engine.run_state(by_job["m1"].run_id) is RunState.CLAIMED
    states = {r["key"]: r["state"] for r in node.runs().values()}
    assert states[3] == "LOST"  # m2: nobody re-attached it
    assert states[1] == "PENDING"  # a2: out again, waiting for a worker
    worker(node, "w3")
    again = node.tickets("w3")
    assert [(t.job_id, t.attempt) for t in again] == [("a2", 2)]
    assert again[0].token > by_job["a2"].token


def test_crash_before_the_at_most_once_claim_is_durable_sends_it_once_after() -> None:
    node = Node(auto_durable=False)
    once(node, "amo", delivery="at_most_once")
    node.flush()
    node.advance(1000)
    node.flush()  # fire durable, no worker yet
    worker(node)  # claim made but not durable
    assert node.tickets() == []
    node.crash_and_recover()
    node.auto_durable = True
    node.flush()
    worker(node, "w2")
    assert [t.job_id for t in node.tickets()] == ["amo"]


def test_crash_before_a_fire_and_claim_batch_is_durable_fires_it_again_once() -> None:
    for delivery in ("at_least_once", "at_most_once"):
        node = Node(auto_durable=False)
        worker(node)
        once(node, delivery, delivery=delivery)
        node.flush()
        node.advance(1000)  # fired and claimed in one batch, not durable
        assert node.tickets() == []
        node.crash_and_recover()  # the fire is forgotten: the job still owes that time
        node.auto_durable = True
        node.flush()
        worker(node, "w2")
        node.advance(10)
        (ticket,) = node.tickets()
        assert (ticket.job_id, ticket.attempt) == (delivery, 1)  # nothing went out before


def test_recovery_reproduces_the_durable_state() -> None:
    node = Node()
    worker(node, credits=2)
    node.create(id="e", schedule={"every": "7s", "start": ISO.format(5)}, retries={"max": 1})
    node.create(id="c", schedule={"cron": "*/1 * * * *"}, delivery="at_most_once")
    once(node, "o", overlap="buffer_one")
    node.run_until(130_000, step=1000)
    t = node.tickets()[0]
    node.do(ReportFinished("w1", t.run_id, t.token, "failed", 2))
    node.create(id="d", schedule={"at": "2030-01-01T00:00:00Z"}, after=["e", "c"])
    node.deliver_registrations()
    live = node.engine.snapshot()
    assert live["dependents"] == {"c": ["d"], "e": ["d"]}
    node.crash_and_recover()
    recovered = node.engine.snapshot()
    assert recovered["jobs"] == live["jobs"]
    assert recovered["runs"] == live["runs"]
    assert recovered["dependents"] == live["dependents"]


def test_a_recovered_buffered_run_waits_for_the_run_before_it() -> None:
    """overlap=buffer_one across a restart: a triggered run buffered behind a running one, at
    a time still ahead when the shard recovers, waits for that run to end, as it does live.
    (Recovery used to arm its ready time as a retry timer, which queued it at that time while
    the run before it still ran, and a claim then left it marked buffered.)"""
    node = Node()
    node.do(WorkerHello("w1", ("default",), 1))
    node.create(id="j", schedule={"at": ISO.format(1)}, overlap="buffer_one")
    node.advance(1000)
    node.flush()
    (first,) = node.tickets()
    node.do(ReportStarted("w1", first.run_id, first.token))
    node.do(TriggerJob(node.request(), "j", "src@1"))  # at wall + 1: buffered behind `first`
    node.flush()
    node.crash_and_recover()
    node.do(WorkerHello("w1", ("default",), 2, ((first.run_id, first.token),)))  # re-attached
    node.advance(50)
    node.flush()
    assert [t.run_id for t in node.tickets()] == [first.run_id]  # the buffered one waits
    node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))
    node.flush()
    node.advance(10)
    node.flush()
    second = node.tickets()[-1]
    assert second.job_id == "j" and second.run_id != first.run_id  # released by the end
    live = node.engine.snapshot()
    snap_meta_runs = node.engine.export_snapshot().meta["runs"]
    assert not any(r.get("buf") for r in snap_meta_runs)  # nothing left marked buffered
    node.crash_and_recover()
    assert node.engine.snapshot()["runs"] == live["runs"]


def test_recover_refuses_an_epoch_not_newer_than_the_records() -> None:
    node = Node()
    once(node, "x")
    node.crash_and_recover()
    with pytest.raises(StaleEpoch):
        ShardEngine.recover(
            node.durable_records, epoch=node.epoch, wall_ms=node.wall, mono_ms=node.mono
        )


def test_fencing_tokens_grow_across_epochs() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=2000))
    worker(node)
    once(node, "f")
    node.advance(1000)
    first = node.tickets()[-1]
    node.crash_and_recover()
    node.run_until(2500, step=250)
    worker(node, "w2")
    second = node.tickets("w2")[-1]
    assert second.token > first.token and second.token >> 32 == node.epoch


# ------------------------------------------------------------------------ triggers, backpressure, time


def test_after_dependency_and_trigger_dedupe() -> None:
    node = Node()
    worker(node)
    once(node, "up")
    node.create(id="down", schedule={"at": "2030-01-01T00:00:00Z"}, after=["up"])
    node.deliver_registrations()  # "down" registers with the shard of "up" (here the same)
    node.advance(1000)
    t = node.tickets()[-1]
    node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    (trigger,) = node.triggers
    assert trigger.job_id == "down"
    for _ in range(2):  # delivered twice: the second is a repeat
        node.do(TriggerJob(node.request(), trigger.job_id, trigger.source_run_id))
    node.advance(1)  # a triggered run is due the millisecond after its trigger
    downs = [tk for tk in node.tickets() if tk.job_id == "down"]
    assert len(downs) == 1


def test_backpressure_pauses_firing_and_memory_stays_bounded() -> None:
    node = Node(config=cfg(ready_bound=5))
    for i in range(20):
        once(node, f"b{i}")
    node.advance(1000)
    assert len(node.runs()) == 5  # the rest wait in the wheel, not as runs
    worker(node, credits=3)
    node.advance(1)
    assert len(node.runs()) == 8
    worker(node, "w2", credits=100)
    node.advance(1)
    assert len(node.runs()) == 20 and len(node.tickets()) == 20


def test_wall_clock_jump_is_reported_and_never_fires_early() -> None:
    node = Node()
    once(node, "j", in_s=3600)
    node.advance(1000, wall_extra=2 * 3600_000)  # the wall clock leaps two hours
    assert node.jumps and node.runs() == {}
    node.advance(3600_000)
    assert len(node.runs()) == 1


def test_monotonic_clock_going_backwards_is_refused() -> None:
    node = Node()
    with pytest.raises(TimeWentBackwards):
        node.engine.tick(node.wall, node.mono - 1)


def test_update_pins_running_runs_to_their_version() -> None:
    node = Node()
    worker(node)
    node.create(
        id="u", schedule={"every": "10s", "start": ISO.format(10)}, task={"shell": "echo 1"}
    )
    node.advance(10_000)
    first = node.tickets()[-1]
    spec = validate_job(
        {
            "id": "u",
            "schedule": {"every": "10s", "start": ISO.format(10)},
            "task": {"shell": "echo 2"},
        },
        now_ms=node.wall,
    )
    reply = node.do(UpdateJob(node.request(), spec))
    assert reply is not None and reply.result["version"] == 2
    assert first.task == {"shell": "echo 1"} and first.version == 1
    node.advance(10_000)
    assert node.tickets()[-1].task == {"shell": "echo 2"}


def test_effects_are_typed_values() -> None:
    node = Node(auto_durable=False)
    once(node, "v")
    assert isinstance(node.unacked[0], Persist)
    assert all(isinstance(d, Dispatch) for _t, d in node.dispatches)


# ------------------------------------------------------------------------ regressions found in review


def test_held_dispatch_is_dropped_when_its_run_is_cancelled() -> None:
    for delivery in ("at_least_once", "at_most_once"):
        node = Node(auto_durable=False)
        worker(node)
        once(node, "j", delivery=delivery)
        node.flush()
        node.advance(1000)  # fired and claimed; the batch is not durable, the run held
        node.do(CancelJob(node.request(), "j", stop_running=True))
        node.flush()
        assert node.tickets() == [], delivery


def test_many_small_forward_wall_steps_do_not_add_up() -> None:
    node = Node()
    once(node, "j", in_s=30)
    for _ in range(10):
        node.advance(0, wall_extra=4000)
    assert node.runs() == {} and node.jumps
    assert node.engine.now_ms <= T0 + EngineConfig().max_clock_jump_ms


def test_start_report_during_the_grace_from_an_unknown_worker_keeps_the_grace() -> None:
    node = Node(config=cfg(worker_lease_ms=2000, reattach_grace_ms=3000))
    worker(node)
    once(node, "amo", delivery="at_most_once")
    node.advance(1000)
    (ticket,) = node.tickets()
    node.crash_and_recover()
    node.do(ReportStarted("w1", ticket.run_id, ticket.token))  # before any hello
    node.run_until(3500, step=250)
    assert node.final_states() == ["LOST"]


def test_hello_without_a_run_it_held_sends_that_run_out_again() -> None:
    node = Node()
    worker(node, credits=1)
    once(node, "a")
    node.advance(1000)
    (first,) = node.tickets()
    node.do(WorkerHello("w1", ("default",), 1, ()))  # restarted: holds nothing
    second = node.tickets()[-1]
    assert (second.run_id, second.attempt) == (first.run_id, 2) and second.token > first.token


def test_a_repeated_trigger_is_answered_only_once_the_original_is_durable() -> None:
    node = Node(auto_durable=False)
    once(node, "t", in_s=3600)
    node.flush()
    node.do(TriggerJob(node.request(), "t", "src@1"))
    reply = node.do(TriggerJob(node.request(), "t", "src@1"))
    assert reply is None
    node.flush()
    assert node.replies[3].result == {"duplicate": True}


def test_trigger_skipped_by_overlap_is_still_recognised_when_redelivered() -> None:
    node = Node()
    worker(node)
    once(node, "o", overlap="skip")
    node.advance(1000)
    node.do(TriggerJob(node.request(), "o", "src@1"))
    node.crash_and_recover()
    node.do(TriggerJob(node.request(), "o", "src@1"))
    assert len(node.runs()) == 1


def test_a_cancelled_jobs_failing_run_is_not_retried() -> None:
    node = Node()
    worker(node)
    once(node, "r", retries={"max": 3, "backoff": "1s"})
    node.advance(1000)
    (ticket,) = node.tickets()
    node.do(CancelJob(node.request(), "r"))
    node.do(ReportFinished("w1", ticket.run_id, ticket.token, "failed", 1))
    node.run_until(10_000, step=500)
    assert len(node.tickets()) == 1 and node.final_states() == ["FAILED"]


def test_an_update_keeps_a_paused_job_paused() -> None:
    node = Node()
    node.create(id="p", schedule={"every": "1s", "start": ISO.format(1)})
    node.do(PauseJob(node.request(), "p"))
    spec = validate_job(
        {"id": "p", "schedule": {"every": "1s", "start": ISO.format(1)}, "task": {"shell": "x"}},
        now_ms=node.wall,
    )
    node.do(UpdateJob(node.request(), spec))
    node.run_until(5000, step=500)
    assert node.runs() == {}


def test_cancel_accounts_for_owed_but_unfired_times() -> None:
    node = Node(config=cfg(ready_bound=1))
    once(node, "a")
    node.create(id="e", schedule={"every": "1s", "start": ISO.format(1)})
    node.advance(3000)  # the tier is full: e's times are owed, not fired
    node.do(CancelJob(node.request(), "e"))
    reasons = {s["why"] for s in node.skips()}
    assert "cancelled" in reasons


def test_skip_reason_survives_a_crash_after_resume() -> None:
    node = Node()
    node.create(id="p", schedule={"every": "1m", "start": "2026-01-01T00:01:00Z"})
    node.do(PauseJob(node.request(), "p"))
    node.run_until(10 * 60_000, step=60_000)
    node.do(ResumeJob(node.request(), "p"))
    node.crash_and_recover()
    node.advance(1)
    assert [s["why"] for s in node.skips()] == ["paused"]


def test_worker_commands_from_unknown_workers_are_refused_not_raised() -> None:
    from engine.effects import Refused

    node = Node()
    effects = node.engine.handle(Heartbeat("ghost"), node.wall, node.mono)
    assert [type(e) for e in effects] == [Refused]
    effects = node.engine.handle(ReportStarted("ghost", "not a run id", 1), node.wall, node.mono)
    assert [type(e) for e in effects] == [Refused]


def test_catchup_beyond_the_enumeration_bound_keeps_the_newest() -> None:
    node = Node(config=cfg(max_enumerate=5))
    node.create(id="cu", schedule={"every": "1s", "start": ISO.format(1)}, catchup="latest")
    node.crash_and_recover(downtime_ms=120_000)
    node.advance(1)
    (run,) = node.runs().values()
    assert run["at"] >= node.wall - 1000


def test_credits_come_from_pull_only_so_a_late_report_does_not_overcommit() -> None:
    node = Node()
    worker(node, credits=1)
    once(node, "a")
    once(node, "b")
    once(node, "c")
    node.advance(1000)
    (first,) = node.tickets()
    node.do(Pull("w1", 1))  # finished locally: one slot free again ...
    node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))  # ... report later
    assert len(node.tickets()) == 2


def test_replacing_create_with_a_past_one_shot_time_fires_it() -> None:
    node = Node()
    worker(node)
    once(node, "r", in_s=3600)
    from engine.schedules import format_utc

    reply = node.create(id="r", schedule={"at": format_utc(node.wall - 5000)}, replace=True)
    assert reply is not None and reply.error is None
    node.advance(1)
    assert [t.job_id for t in node.tickets()] == ["r"]


def test_triggered_runs_get_their_own_ids_and_never_go_out_early() -> None:
    node = Node()
    worker(node, credits=10)
    node.create(id="t", schedule={"every": "10s", "start": ISO.format(10)})
    node.advance(9_999)  # the next scheduled fire is 1 ms away
    for n in range(3):  # three triggers in the same millisecond
        node.do(TriggerJob(node.request(), "t", f"src@{n}"))
    node.advance(10)
    tickets = node.tickets()
    ids = [t.run_id for t in tickets]
    assert len(ids) == 4 and len(set(ids)) == 4  # three triggered runs and the scheduled one
    assert f"t@{T0 + 10_000}" in ids  # the scheduled fire kept its own id
    for t in tickets:
        assert t.scheduled_ms <= node.wall
    sent_at = {d.run.run_id: at for at, d in node.dispatches}
    assert all(sent_at[t.run_id] >= t.scheduled_ms for t in tickets)


def test_a_command_stamped_with_an_older_epoch_is_refused_and_changes_nothing() -> None:
    node = Node()
    node.crash_and_recover()
    before = len(node.durable_records)
    spec = validate_job(
        {"id": "s", "schedule": {"at": "2030-01-01T00:00:00Z"}, "task": {"shell": "true"}},
        now_ms=node.wall,
    )
    from engine.effects import CreateJob

    effects = node.engine.handle(CreateJob(99, spec), node.wall, node.mono, epoch=node.epoch - 1)
    (reply,) = effects
    assert isinstance(reply, Reply) and reply.error is not None
    assert reply.error.code == "stale_epoch"
    node.flush()
    assert len(node.durable_records) == before
    ok = node.engine.handle(CreateJob(100, spec), node.wall, node.mono, epoch=node.epoch)
    assert isinstance(ok[0], Persist)


def test_after_across_two_shards_through_both_outboxes() -> None:
    a, b = Node(), Node()  # two shards; "up" lives on a, "down" on b
    worker(a, "wa")
    worker(b, "wb")
    once(a, "up")
    b.create(id="down", schedule={"at": "2030-01-01T00:00:00Z"}, after=["up"])
    assert [(r.upstream, r.downstream, r.on) for r in b.registrations] == [("up", "down", True)]
    b.deliver_registrations(to=a)
    assert b.durable_records[-1]["t"] == "outdone"
    a.crash_and_recover()  # the registration is durable on a
    worker(a, "wa")  # workers say hello again after a restart
    a.advance(1000)
    t = a.tickets("wa")[-1]
    a.do(ReportFinished("wa", t.run_id, t.token, "success", 0))
    (trigger,) = a.triggers
    assert (trigger.job_id, trigger.source_run_id) == ("down", t.run_id)
    b.do(TriggerJob(b.request(), trigger.job_id, trigger.source_run_id))
    b.advance(1)
    assert [tk.job_id for tk in b.tickets("wb")] == ["down"]
    # Cancelling "down" unregisters it: the next success of "up" triggers nothing.
    b.do(CancelJob(b.request(), "down"))
    assert [(r.upstream, r.on) for r in b.registrations] == [("up", False)]
    b.deliver_registrations(to=a)
    a.triggers.clear()
    once(a, "up2")
    a.do(TriggerJob(a.request(), "up", "manual@1"))
    a.advance(1)
    t2 = [tk for tk in a.tickets("wa") if tk.job_id == "up"][-1]
    a.do(ReportFinished("wa", t2.run_id, t2.token, "success", 0))
    assert a.triggers == []


def test_trigger_sources_are_forgotten_after_the_dedupe_window() -> None:
    node = Node(config=cfg(trigger_dedupe_ms=60_000))
    once(node, "t", in_s=10**6)
    node.do(TriggerJob(node.request(), "t", "src@1"))
    node.advance(30_000)
    node.do(TriggerJob(node.request(), "t", "src@2"))
    assert {src for _key, src in node.engine._sources} == {"src@1", "src@2"}
    node.advance(40_000)  # src@1 is now older than the window
    node.do(TriggerJob(node.request(), "t", "src@3"))
    assert {src for _key, src in node.engine._sources} == {"src@2", "src@3"}


def test_a_lost_at_least_once_claim_goes_out_again_as_a_new_attempt() -> None:
    node = Node(auto_durable=False)
    once(node, "alo")
    node.flush()
    node.advance(1000)
    node.flush()  # the PENDING run is durable
    worker(node, credits=1)  # it goes out at its claim,
    (first,) = node.tickets()  # its claim recorded in the next batch
    assert first.attempt == 1 and node.unacked  # the claim record is not durable yet
    node.crash_and_recover()
    worker(node, "w2", credits=1)
    node.flush()
    second = node.tickets("w2")[-1]
    assert (second.run_id, second.attempt) == (first.run_id, 2) and second.token > first.token


def test_a_waiting_at_most_once_run_goes_out_once_after_a_crash_as_attempt_one() -> None:
    node = Node(auto_durable=False)
    once(node, "amo", delivery="at_most_once")
    node.flush()
    node.advance(1000)
    node.flush()  # PENDING durable, no worker yet
    node.crash_and_recover()
    worker(node, credits=1)
    node.flush()
    node.flush()
    (ticket,) = node.tickets()
    assert ticket.attempt == 1


def test_mark_records_timed_out_at_the_timeout_and_heartbeats_do_not_stop_the_task() -> None:
    node = Node(config=cfg(timeout_grace_ms=5000))
    worker(node, credits=1)
    once(node, "m", timeout="1s", on_timeout="mark")
    node.advance(1000)
    (ticket,) = node.tickets()
    assert ticket.on_timeout == "mark"
    node.do(ReportStarted("w1", ticket.run_id, ticket.token))
    node.advance(1000)  # the timeout itself, no grace: nothing is stopped under "mark"
    assert node.final_states() == ["TIMED_OUT"] and node.kills == []
    node.do(Heartbeat("w1", ((ticket.run_id, ticket.token),)))
    assert node.kills == []  # the task runs on
    node.do(ReportFinished("w1", ticket.run_id, ticket.token, "success", 0))
    assert node.final_states() == ["TIMED_OUT"]  # the late report is a note
    assert [r["what"] for r in node.durable_records if r["t"] == "note"] == ["success"]
    node.do(Heartbeat("w1", ((ticket.run_id, ticket.token),)))
    assert [k.reason for k in node.kills] == ["superseded"]  # after its end, no longer held


def test_a_recreated_jobs_fire_time_taken_by_a_run_still_in_flight_is_not_owed_again() -> None:
    # Found by fuzzing: cancel leaves the running run; the same id created again names the
    # same time, whose run id (job@ms) is taken. That run accounts for the time: the new
    # version owes nothing there (a repeated creation is a no-op), and fires nothing.
    node = Node()
    worker(node, credits=1)
    from engine.schedules import format_utc

    node.create(id="r", schedule={"at": format_utc(node.wall)})
    assert len(node.tickets()) == 1
    node.do(CancelJob(node.request(), "r"))  # the claimed run carries on
    reply = node.create(id="r", schedule={"at": format_utc(node.wall)})
    assert reply is not None and reply.result is not None
    assert reply.result["next_fire_ms"] is None
    node.advance(1)
    assert node.skips() == []
    assert len(node.tickets()) == 1


def test_a_run_of_a_replaced_job_keeps_its_spec_when_the_id_gets_a_new_version() -> None:
    # Found against a real node: the re-created job's version replaced the spec the old run
    # needed for its ticket, and claiming it failed half-way. (A cancelled job's run no longer
    # goes out again at all: see test_a_cancelled_jobs_alo_run_is_not_sent_again_...; a
    # replacing create pins it the same way.)
    node = Node()
    worker(node, credits=1)
    from engine.schedules import format_utc

    node.create(id="k1", schedule={"at": format_utc(node.wall)}, task={"shell": "echo v1"})
    (first,) = node.tickets()
    node.create(
        id="k1", schedule={"at": format_utc(node.wall + 60_000)}, task={"shell": "v2"}, replace=True
    )
    node.do(WorkerHello("w1", ("default",), 1, ()))  # restarted without it: out again
    again = node.tickets()[-1]
    assert (again.run_id, again.attempt, again.task, again.version) == (
        first.run_id,
        2,
        {"shell": "echo v1"},
        1,
    )
    node.crash_and_recover()
    node.do(WorkerHello("w2", ("default",), 1, ()))
    node.run_until(1000)


# ------------------------------------------------------------------ found by review (clocks)


def every_second(node: Node, job_id: str = "tick") -> None:
    from engine.schedules import format_utc

    node.create(id=job_id, schedule={"every": "1s", "start": format_utc(node.wall + 1000)})


def test_a_wall_clock_set_back_for_a_moment_then_put_right_costs_nothing() -> None:
    """Set back an hour for a second, then put right: the engine follows the wall clock at
    once, reports no jump, and fires every time on time. Before, the correction counted as a
    forward jump and the trusted offset crept back at 1 ms a second: every job an hour late
    for six weeks (found by review)."""
    node = Node()
    every_second(node)
    node.run_until(10_000)
    node.advance(0, wall_extra=-3600_000)  # set back an hour...
    node.advance(1000, wall_extra=3600_000)  # ... and put right a second later
    assert node.jumps == [] and node.engine.now_ms == node.wall
    node.run_until(60_000)
    ats = sorted(r["at"] for r in node.runs().values())
    assert node.wall - ats[-1] <= 1000  # on time, not an hour behind
    assert len(ats) == len(set(ats)) and all(b - a == 1000 for a, b in itertools.pairwise(ats))


def test_a_setback_put_right_while_nothing_is_due_is_still_seen_in_time() -> None:
    """Driven as a node's loop drives it (woken only at next_wakeup_mono): a shard with
    nothing due for half an hour slept through a setback put right a second later, saw it
    only after the setback memory had lapsed, and took it for a jump; the job then fired an
    hour late (found by review). A setback now wakes it once a second while it is
    remembered."""
    node = Node()
    worker(node)
    base, start = node.wall - node.mono, node.mono
    once(node, "j", in_s=1800)
    due = node.wall + 1_800_000
    node.mono += 1000
    node.wall = node.mono + base - 3_600_000  # set back an hour; a command sees it
    once(node, "k", in_s=7200)

    def offset(mono: int) -> int:  # put right a second later
        return base - 3_600_000 if mono < start + 2000 else base

    while not node.dispatches and node.mono < start + 3_600_000:
        wake = node.engine.next_wakeup_mono()
        assert wake is not None
        node.mono = max(wake, node.mono)
        node.wall = node.mono + offset(node.mono)
        node.absorb(node.engine.tick(node.wall, node.mono))
    assert node.jumps == [] and node.engine.now_ms == node.wall
    assert node.dispatches and node.dispatches[0][0] - due < 2000


def test_a_setback_that_stays_is_the_truth_and_a_later_leap_a_jump() -> None:
    """A wall clock set back for longer than the setback memory (ten minutes) is taken for
    the truth: the engine's time stands still until the wall clock is back at it, and a leap
    forward after that is a jump, reported, and never fires early."""
    node = Node()
    once(node, "j", in_s=3600)
    node.advance(0, wall_extra=-1800_000)  # half an hour back, for good
    stood = node.engine.now_ms
    node.run_until(11 * 60_000, step=1000)
    assert node.engine.now_ms == stood and node.jumps == []
    node.advance(1000, wall_extra=2 * 3600_000)  # then two hours forward: a jump
    assert node.jumps and node.runs() == {}
    assert node.engine.now_ms <= stood + 1000 + node.config.max_clock_jump_ms


def test_while_the_wall_clock_is_set_back_the_engine_wakes_once_a_second() -> None:
    """Not at every millisecond: the deadline at the engine's pace stood still with its time,
    and a node's loop woke every 1-2 ms for as long as the setback lasted (found by review)."""
    node = Node()
    every_second(node)
    node.run_until(5_500)
    node.advance(0, wall_extra=-600_000)
    wakes = 0
    end = node.mono + 60_000
    while node.mono < end:
        wake = node.engine.next_wakeup_mono()
        assert wake is not None and node.mono < wake <= node.mono + 1000
        node.advance(wake - node.mono)
        wakes += 1
    assert wakes <= 61


def test_catchup_latest_runs_the_newest_time_owed_even_far_behind_now() -> None:
    """More times owed than max_enumerate, all long before now (a burst of fires, then none):
    latest runs the newest of them. Halving the range towards now found no time in the newer
    half and ran nothing (found by review)."""
    node = Node(config=cfg(max_enumerate=100))
    # every second of 1 January 2026, 00:01 to 00:09 (T0 is that midnight), then nothing
    node.create(id="burst", schedule={"cron": "* 1-9 0 1 1 *"}, catchup="latest")
    node.crash_and_recover(downtime_ms=10 * 86_400_000)  # down for ten days
    node.advance(1)
    (run,) = node.runs().values()
    assert run["at"] == T0 + 10 * 60_000 - 1000  # 00:09:59, the newest owed
    # every other owed time is skipped, in ranges that meet: the oldest uncounted (beyond
    # the enumeration bound), the rest counted
    skips = [r for r in node.durable_records if r["t"] == "skip"]
    assert {s["why"] for s in skips} == {"catchup"} and skips[0]["n"] == -1
    assert skips[0]["lo"] == T0 + 60_000 and skips[-1]["hi"] == run["at"] - 1000
    assert all(
        b["lo"] > a["hi"] and b["lo"] - a["hi"] <= 1000 for a, b in itertools.pairwise(skips)
    )


# ------------------------------------------------------------------ found by review (after)


def test_late_registrations_never_undo_newer_ones() -> None:
    """Redelivered after a restart, an ``after`` registration and its removal reached the
    upstream's shard in any order, and the last applied won for good: a dependency lost, or
    kept after its removal (found by review). Each carries its outbox position now; an older
    one than the pair's newest applied is ignored, across a restart too."""
    from engine.effects import OutboxDelivered, RegisterDependent

    node = Node()
    every_second(node, "up")
    down = {"id": "down", "schedule": {"at": "2030-01-01T00:00:00Z"}, "task": {"shell": "x"}}
    node.create(**down, after=["up"])

    def update(after: list[str]) -> None:
        spec = validate_job({**down, "after": after}, now_ms=node.wall)
        reply = node.do(UpdateJob(node.request(), spec))
        assert reply is not None and reply.error is None

    for after in ([], ["up"], []):  # on, off, on, off
        update(after)
    regs = list(node.registrations)
    node.registrations.clear()
    assert [r.on for r in regs] == [True, False, True, False]
    for reg in reversed(regs):  # the newest first: each older one is a late repeat
        node.do(RegisterDependent(node.request(), reg.upstream, reg.downstream, reg.on, reg.seq))
        node.do(OutboxDelivered(reg.seq))
    assert node.engine.snapshot()["dependents"] == {}
    # ... and after a restart, from the records, and from a snapshot
    on = regs[2]
    for via_snapshot in (False, True):
        node.take_snapshot()
        node.crash_and_recover(downtime_ms=1, via_snapshot=via_snapshot)
        node.do(RegisterDependent(node.request(), on.upstream, on.downstream, on.on, on.seq))
        assert node.engine.snapshot()["dependents"] == {}
    # a newer one still counts
    update(["up"])
    node.deliver_registrations()
    assert node.engine.snapshot()["dependents"] == {"up": ["down"]}


def test_catchup_all_runs_as_many_as_it_keeps_even_far_behind_now() -> None:
    """More times owed than max_enumerate, all long before now: catchup=all runs the newest
    max_catchup of them. The bisection stopped at the first start with any time after it,
    and all ran fewer than it keeps (found by review)."""
    node = Node(config=cfg(max_enumerate=100))
    node.create(
        id="burst",
        schedule={"cron": "* 1-9 0 1 1 *"},
        catchup="all",
        max_catchup=100,
        catchup_window="720h",
    )
    node.crash_and_recover(downtime_ms=10 * 86_400_000)
    node.advance(1)
    ats = sorted(r["at"] for r in node.runs().values())
    newest = T0 + 10 * 60_000 - 1000  # 00:09:59
    assert ats == [newest - 1000 * i for i in range(99, -1, -1)]


def test_registrations_of_pairs_turned_off_are_forgotten_after_the_dedupe_window() -> None:
    """The newest registration position per (upstream, downstream) pair is kept to ignore
    late repeats; a loop creating and cancelling dependent jobs grew it for ever (found by
    review). A pair turned off is forgotten trigger_dedupe_ms later, across a restart too;
    one turned off within the window still ignores a late repeat."""
    from engine.effects import RegisterDependent

    node = Node(config=cfg(trigger_dedupe_ms=60_000))
    every_second(node, "up")
    regs = []
    for i in range(300):
        node.create(id=f"d{i}", schedule={"at": "2030-01-01T00:00:00Z"}, after=["up"])
        node.do(CancelJob(node.request(), f"d{i}"))
        regs += node.registrations
        node.deliver_registrations()
        node.advance(1000)
    # turned off in the last minute, at most
    assert 0 < len(node.engine._dep_seq) <= 62 and len(node.engine._dep_off) <= 62
    late_on = next(r for r in reversed(regs) if r.on)
    for via_snapshot in (False, True):
        node.take_snapshot()
        node.crash_and_recover(downtime_ms=1, via_snapshot=via_snapshot)
        assert len(node.engine._dep_seq) <= 62
        node.do(
            RegisterDependent(
                node.request(), late_on.upstream, late_on.downstream, late_on.on, late_on.seq
            )
        )
        assert node.engine.snapshot()["dependents"] == {}
    node.advance(61_000)
    node.create(id="last", schedule={"at": "2030-01-01T00:00:00Z"}, after=["up"])
    node.do(CancelJob(node.request(), "last"))
    node.deliver_registrations()
    assert set(node.engine._dep_seq) == {("up", "last")}
