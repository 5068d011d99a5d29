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
