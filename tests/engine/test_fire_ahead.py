"""Fire-ahead (``EngineConfig.fire_ahead_ms``): a job due within the window fires early, so that
its run is PENDING and durable before its time, and goes out at its time without waiting for
a write; nothing is ever handed out before its time; the decisions that depend on what is in
flight at the time (overlap rules) are still taken at the time, and a pause or an update inside
the window takes back the run made ahead. The state machine
(``tests/engine/test_shard_machine.py``, ``FireAheadShardMachine``) checks the promises under
random commands, crashes and worker deaths; these tests pin down each rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.effects import (
    CancelJob,
    GetJob,
    PauseJob,
    Pull,
    ReportFinished,
    ResumeJob,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import EngineUsageError
from engine.jobs import validate_job
from engine.records import expand
from engine.schedules import format_utc
from engine.shard import MAX_FIRE_AHEAD_MS, EngineConfig
from tests.engine.harness import T0, Node

AHEAD = 500
CONFIG = EngineConfig(worker_lease_ms=10**9, reattach_grace_ms=10**9, fire_ahead_ms=AHEAD)


def node_with_worker(**config: object) -> Node:
    node = Node(config=replace(CONFIG, **config), auto_durable=False)  # type: ignore[arg-type]
    node.do(WorkerHello("w1", ("default",), 4))
    return node


def once_at(node: Node, job_id: str, at: int, **extra: object) -> None:
    node.create(id=job_id, schedule={"at": format_utc(at)}, **extra)
    node.flush()


def fired_runs(node: Node) -> list[tuple[str, int]]:
    """(state, time) of every run record in the batches not yet acknowledged."""
    return [
        (r["state"], r["at"])
        for batch in node.unacked
        for rec in batch.records
        for r in expand(rec)
        if r["t"] == "run"
    ]


def made_ahead(*, flush: bool = True, **extra: object) -> tuple[Node, int]:
    """A node with a worker and a one-shot job "x" due 1 s on, moved into its window: its run
    made ahead (checked), made durable unless ``flush`` is False; the node and the run's time."""
    node = node_with_worker()
    at = T0 + 1_000
    once_at(node, "x", at, **extra)
    node.advance(1_000 - AHEAD)
    assert fired_runs(node) == [("PENDING", at)]
    if flush:
        node.flush()
    return node, at


def test_the_run_is_made_durable_ahead_and_goes_out_at_its_time_with_no_write_first() -> None:
    node = node_with_worker()
    at = T0 + 2_000
    once_at(node, "x", at)
    node.advance(2_000 - AHEAD - 1)
    assert node.unacked == []  # not in the window yet
    node.advance(1)
    assert fired_runs(node) == [("PENDING", at)]  # fired ahead: PENDING, at its own time
    node.flush()
    node.advance(AHEAD - 1)
    assert node.tickets() == []  # durable, but never out before its time
    node.advance(1)
    # At its time, at once: its fire is durable already, and an at-least-once claim is
    # recorded in the next batch (still unacknowledged here).
    assert [t.run_id for t in node.tickets()] == [f"x@{at}"]
    assert node.dispatches[0][0] == at
    assert [r[0] for r in fired_runs(node)] == ["CLAIMED"]


def test_the_engine_wakes_ahead_of_the_fire_and_again_at_its_time() -> None:
    node = node_with_worker()
    at = T0 + 10_000
    once_at(node, "x", at)
    wake = node.engine.next_wakeup_mono()
    assert wake == node.mono + 10_000 - AHEAD
    node.advance(10_000 - AHEAD)
    node.flush()
    assert node.engine.next_wakeup_mono() == node.mono + AHEAD  # the run's own time


def test_at_most_once_still_waits_for_its_claim_to_be_durable() -> None:
    node, at = made_ahead(delivery="at_most_once")
    node.advance(AHEAD)
    assert node.tickets() == []  # the claim first
    node.flush()
    assert [t.run_id for t in node.tickets()] == [f"x@{at}"]


def test_a_fire_still_not_durable_at_its_time_holds_its_run_back() -> None:
    # A disk slower than the window: the run waits for its fire's batch, as without it.
    node, at = made_ahead(flush=False)
    node.advance(AHEAD + 200)
    assert node.tickets() == []
    node.flush()
    assert [t.run_id for t in node.tickets()] == [f"x@{at}"]


def test_a_cancel_inside_the_window_cancels_the_run_made_ahead() -> None:
    node, at = made_ahead()
    node.do(CancelJob(node.request(), "x"))
    node.flush()
    node.advance(AHEAD + 1_000)
    node.flush()
    assert node.tickets() == []
    assert node.runs()[(0, at)]["state"] == "CANCELLED"


def test_a_pause_inside_the_window_takes_the_run_back_and_a_resume_before_its_time_runs_it() -> (
    None
):
    node, at = made_ahead()
    node.do(PauseJob(node.request(), "x"))
    node.flush()
    assert node.runs()[(0, at)]["state"] == "CANCELLED"  # never sent: taken back
    node.advance(AHEAD)
    node.flush()
    assert node.tickets() == []  # paused at its time, as without the window
    # Paused again and resumed before the time: it fires and goes out at its time.
    node2, _ = made_ahead()
    node2.do(PauseJob(node2.request(), "x"))
    node2.flush()
    node2.advance(100)
    node2.do(ResumeJob(node2.request(), "x"))
    node2.flush()
    node2.advance(AHEAD - 100)
    node2.flush()
    assert [t.run_id for t in node2.tickets()] == [f"x@{at}"]
    assert node2.runs()[(0, at)]["state"] == "CLAIMED"


def test_an_update_inside_the_window_runs_the_new_version_at_the_time() -> None:
    node, at = made_ahead()
    new = validate_job(
        {"id": "x", "schedule": {"at": format_utc(at)}, "task": {"command": ["echo", "v2"]}},
        now_ms=node.wall,
    )
    node.do(UpdateJob(node.request(), new))
    node.flush()
    reply = node.replies[node.next_request]
    assert reply.result is not None and reply.result["next_fire_ms"] == at
    node.advance(AHEAD)
    node.flush()
    [ticket] = node.tickets()
    assert ticket.run_id == f"x@{at}" and ticket.task == {"command": ["echo", "v2"]}
    assert ticket.version == 2
    assert node.skips() == []


def test_a_trigger_inside_the_window_does_not_cancel_the_later_scheduled_run() -> None:
    # Found by review: with the scheduled run made ahead, a triggered run inside the window
    # counted it as in flight, and cancel_previous cancelled the later, scheduled one.
    node = node_with_worker()
    at = T0 + 10_000
    node.create(
        id="c", schedule={"every": "10s", "start": format_utc(at)}, overlap="cancel_previous"
    )
    node.flush()
    node.run_until(10_000 - AHEAD + 200)
    node.flush()
    node.do(TriggerJob(node.request(), "c", "up@1"))  # a run now, 300 ms before `at`
    node.flush()
    node.run_until(1_000)
    node.flush()
    ids = [t.run_id for t in node.tickets()]
    assert f"c@{at}" in ids and len(ids) == 2, node.runs()
    assert node.runs()[(0, at)]["state"] == "CLAIMED"


def test_deferred_fires_wait_for_room_under_the_ready_bound() -> None:
    # Found by review: deferred fires went past the tier's ready bound at their time.
    node = Node(config=replace(CONFIG, ready_bound=2), auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 5))
    for i in range(5):
        node.create(
            id=f"j{i}",
            schedule={"every": "10s", "start": format_utc(T0 + 1_000)},
            overlap="buffer_one",
        )
    node.flush()
    node.run_until(1_000)
    node.flush()
    assert len(node.tickets()) == 5  # in flight until the end of the test
    node.do(Pull("w1", 0))
    node.run_until(10_000)
    node.flush()
    assert node.engine._pending["default"] == 2
    # The three fires without room wait due in the wheel, as without the window.
    assert node.engine.pending_jobs() == 5


def test_a_crash_inside_the_window_brings_the_run_back_held_until_its_time() -> None:
    for via_snapshot in (False, True):
        node = node_with_worker()
        at = T0 + 2_000
        once_at(node, "x", at)
        node.advance(2_000 - AHEAD)
        assert fired_runs(node) == [("PENDING", at)]
        node.flush()
        if via_snapshot:
            node.take_snapshot()
        node.crash_and_recover(downtime_ms=100, via_snapshot=via_snapshot)
        node.do(WorkerHello("w1", ("default",), 4))
        node.flush()
        node.advance(AHEAD - 100 - 2)
        node.flush()
        assert node.tickets() == [], via_snapshot
        node.advance(2)
        node.flush()
        assert [t.run_id for t in node.tickets()] == [f"x@{at}"], via_snapshot


def _every_second(node: Node, overlap: str) -> None:
    node.create(
        id="e",
        schedule={"every": "1s", "start": format_utc(T0 + 1_000)},
        overlap=overlap,
    )
    node.flush()


def test_an_overlap_rule_is_decided_at_the_time_not_when_the_window_opens() -> None:
    # The run at +1 s is in flight when the window of the run at +2 s opens (+1.5 s) and ends
    # before +2 s: without fire-ahead the +2 s run happens, and so it must with it.
    node = node_with_worker()
    _every_second(node, "skip")
    node.advance(1_000 - AHEAD)
    node.flush()
    node.advance(AHEAD)
    node.flush()
    [first] = node.tickets()
    node.advance(AHEAD)  # +1.5 s: the next fire's window opens with the first still running
    node.flush()
    assert node.skips() == []
    node.do(GetJob(node.request(), "e"))
    node.flush()
    described = node.replies[node.next_request]
    assert described.result is not None
    assert described.result["next_fire_ms"] == T0 + 2_000  # still owed, not yet decided
    node.do(ReportFinished("w1", first.run_id, first.token, "success", 0))
    node.flush()
    node.advance(AHEAD)  # +2 s
    node.flush()
    assert [t.run_id for t in node.tickets()] == [f"e@{T0 + 1_000}", f"e@{T0 + 2_000}"]
    assert node.skips() == []


def test_an_overlap_rule_still_skips_when_the_run_before_is_in_flight_at_the_time() -> None:
    node = node_with_worker()
    _every_second(node, "skip")
    node.advance(1_000)
    node.flush()
    node.advance(AHEAD)  # +1.5 s: the window of +2 s opens, the first run in flight: deferred
    node.flush()
    assert node.skips() == [] and fired_runs(node) == []
    node.advance(AHEAD)  # +2 s, the first run still in flight
    node.flush()
    [skip] = node.skips()
    assert (skip["lo"], skip["why"]) == (T0 + 2_000, "overlap")
    assert len(node.tickets()) == 1


def test_a_deferred_fire_time_survives_a_snapshot_and_a_crash() -> None:
    node = node_with_worker()
    _every_second(node, "skip")
    node.advance(1_000)
    node.flush()
    node.advance(AHEAD)  # +1.5 s: +2 s deferred (the first run in flight)
    node.flush()
    assert node.engine.next_owed("e") == T0 + 2_000
    assert node.engine.pending_jobs() == 1  # the deferred time still counts
    node.take_snapshot()
    node.crash_and_recover(downtime_ms=0, via_snapshot=True)
    assert node.engine.next_owed("e") == T0 + 2_000


def test_overlap_allow_fires_ahead_as_usual() -> None:
    node = node_with_worker()
    _every_second(node, "allow")
    node.advance(1_000)
    node.flush()
    node.advance(AHEAD)  # +1.5 s: +2 s fires ahead beside the run in flight
    assert [r for r in fired_runs(node) if r[0] == "PENDING"] == [("PENDING", T0 + 2_000)]


def test_without_a_worker_the_run_made_ahead_waits_like_any_other() -> None:
    node = Node(config=CONFIG, auto_durable=False)
    at = T0 + 1_000
    once_at(node, "x", at)
    node.advance(1_000 - AHEAD)
    assert fired_runs(node) == [("PENDING", at)]
    node.flush()
    node.advance(AHEAD)
    node.flush()
    node.advance(5_000)
    node.do(WorkerHello("w1", ("default",), 0))
    node.do(Pull("w1", 1))
    node.flush()
    assert [t.run_id for t in node.tickets()] == [f"x@{at}"]


@pytest.mark.parametrize("bad", [-1, MAX_FIRE_AHEAD_MS + 1])
def test_a_window_out_of_bounds_is_refused(bad: int) -> None:
    with pytest.raises(EngineUsageError, match="fire_ahead_ms"):
        EngineConfig(fire_ahead_ms=bad)
