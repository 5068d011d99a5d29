"""Fire times missed while paused, and one-shot times already past when asked for.

The reference behaviour (README "Choices", protocol.md ``job.resume`` and section 7):

* On resume, the fire times that fell inside the pause (from the kept time up to the resume)
  go through the job's ``catchup`` policy whatever the pause's length: ``skip`` runs none,
  ``latest`` the newest, ``all`` the newest ``max_catchup`` within ``catchup_window``; the
  others are recorded as skipped with reason ``paused``. The next regular time runs normally.
* A one-shot ``at`` time already past when a create or an update names it runs once, at once,
  whatever the catch-up policy (the policy is about times the scheduler missed, not a time just
  asked for), unless that id already has a run at that time that went out.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.effects import GetJob, PauseJob, ReportFinished, ResumeJob, UpdateJob, WorkerHello
from engine.jobs import validate_job
from engine.schedules import format_utc
from engine.shard import EngineConfig
from tests.engine.harness import T0, Node

MISFIRE = 60_000
WINDOWS = {"10s": 10_000, "30s": 30_000, "1m": 60_000, "1h": 3_600_000}


def node() -> Node:
    return Node(
        config=EngineConfig(worker_lease_ms=10**9, reattach_grace_ms=10**9, misfire_ms=MISFIRE)
    )


def expected_kept(
    missed: list[int], catchup: str, resume: int, max_catchup: int, window: int
) -> list[int]:
    """The reference: which of the times missed while paused run."""
    if catchup == "skip":
        return []
    if catchup == "latest":
        return missed[-1:]
    return [t for t in missed if t >= resume - window][-max_catchup:]


def run_pause_resume(
    *,
    period_ms: int,
    pause_at: int,
    pause_ms: int,
    catchup: str,
    max_catchup: int = 3,
    window: str = "1h",
    after_ms: int | None = None,
    step: int = 250,
) -> tuple[Node, list[int], list[int], int, int]:
    """An every-job (first time T0 + period) paused at T0 + ``pause_at`` for ``pause_ms``, then
    run for ``after_ms`` more. Returns the node, the run times, the times missed while paused
    (by the schedule), the resume time and the end."""
    n = node()
    n.create(
        id="j",
        schedule={"every": f"{period_ms}ms", "start": format_utc(T0 + period_ms)},
        catchup=catchup,
        max_catchup=max_catchup,
        catchup_window=window,
    )
    n.run_until(pause_at, step=step)
    n.do(PauseJob(n.request(), "j"))
    paused = n.wall
    n.run_until(pause_ms, step=max(step, 5_000))
    resume = n.wall
    n.do(ResumeJob(n.request(), "j"))
    end = resume + (after_ms if after_ms is not None else 3 * period_ms)
    n.run_until(end - n.wall, step=step)
    times = list(range(T0 + period_ms, end + 1, period_ms))
    missed = [t for t in times if paused < t <= resume]
    runs = sorted(at for (_k, at) in n.runs())
    return n, runs, missed, resume, end


def check_against_reference(
    period_ms: int,
    pause_at: int,
    pause_ms: int,
    catchup: str,
    max_catchup: int = 3,
    window: str = "1h",
) -> None:
    n, runs, missed, resume, end = run_pause_resume(
        period_ms=period_ms,
        pause_at=pause_at,
        pause_ms=pause_ms,
        catchup=catchup,
        max_catchup=max_catchup,
        window=window,
    )
    times = list(range(T0 + period_ms, end + 1, period_ms))
    kept = expected_kept(missed, catchup, resume, max_catchup, WINDOWS[window])
    before = [t for t in times if t <= resume - pause_ms]
    regular = [t for t in times if t > resume]
    assert runs == before + kept + regular, (missed, kept)
    skips = n.skips()
    assert all(s["why"] == "paused" for s in skips), skips
    assert sum(s["n"] for s in skips) == len(missed) - len(kept)
    covered = {t for s in skips for t in missed if s["lo"] <= t <= s["hi"]}
    assert covered == set(missed) - set(kept)


# ------------------------------------------------------------------ pause, then resume


def test_a_short_pause_with_catchup_skip_runs_none_of_the_missed_times() -> None:
    # The reported case: every 2 s, paused 40 s (< misfire), resumed: 20 times missed, 0 run.
    n, runs, missed, resume, _end = run_pause_resume(
        period_ms=2_000, pause_at=1_000, pause_ms=40_000, catchup="skip"
    )
    assert len(missed) == 20
    assert not [t for t in runs if t in missed]
    assert [t for t in runs if t > resume]  # the regular times after it run
    (skip,) = n.skips()
    assert (skip["why"], skip["n"], skip["lo"], skip["hi"]) == ("paused", 20, missed[0], missed[-1])


def test_a_short_pause_with_catchup_latest_runs_only_the_newest_missed_time() -> None:
    n, runs, missed, _resume, _end = run_pause_resume(
        period_ms=10_000, pause_at=3_000, pause_ms=35_000, catchup="latest"
    )
    assert len(missed) == 3
    assert [t for t in runs if t in missed] == missed[-1:]
    (skip,) = n.skips()
    assert (skip["why"], skip["n"]) == ("paused", 2)


def test_each_policy_for_pauses_shorter_and_longer_than_misfire() -> None:
    for pause_ms in (5_000, 35_000, 59_000, 61_000, 300_000):
        for catchup in ("skip", "latest", "all"):
            check_against_reference(4_000, 9_000, pause_ms, catchup, max_catchup=3, window="1h")
        # all, bounded by its window rather than max_catchup
        check_against_reference(4_000, 9_000, pause_ms, "all", max_catchup=100, window="10s")


def test_a_pause_that_misses_nothing_changes_nothing() -> None:
    # Paused and resumed between two fire times: the next one runs on time, nothing skipped.
    n, runs, missed, _resume, end = run_pause_resume(
        period_ms=10_000, pause_at=11_000, pause_ms=5_000, catchup="skip"
    )
    assert missed == []
    assert runs == list(range(T0 + 10_000, end + 1, 10_000))
    assert n.skips() == []


def test_the_catchup_decision_of_a_resume_survives_a_crash() -> None:
    n = node()
    n.create(
        id="j",
        schedule={"every": "2s", "start": format_utc(T0 + 2_000)},
        catchup="skip",
    )
    n.do(PauseJob(n.request(), "j"))
    n.run_until(20_000, step=5_000)
    n.do(ResumeJob(n.request(), "j"))
    n.crash_and_recover(downtime_ms=1_000)
    n.run_until(5_000, step=250)
    assert all(at > T0 + 21_000 for (_k, at) in n.runs())
    assert [(s["why"], s["n"]) for s in n.skips()] == [("paused", 10)]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    period_s=st.integers(1, 30),
    pause_at_ms=st.integers(0, 40_000),
    pause_s=st.integers(0, 200),
    catchup=st.sampled_from(["skip", "latest", "all"]),
    max_catchup=st.integers(1, 5),
    window=st.sampled_from(sorted(WINDOWS)),
)
def test_runs_after_any_pause_are_what_the_policy_says(
    period_s: int, pause_at_ms: int, pause_s: int, catchup: str, max_catchup: int, window: str
) -> None:
    check_against_reference(
        period_s * 1000, pause_at_ms, pause_s * 1000, catchup, max_catchup, window
    )


# ------------------------------------------------------------------ a past one-shot time


def worker(n: Node) -> None:
    n.do(WorkerHello("w1", ("default",), 8))


def fired_times(n: Node, job_id: str) -> list[int]:
    return [t.scheduled_ms for t in n.tickets() if t.job_id == job_id]


POLICIES = [
    {"catchup": "latest"},
    {"catchup": "skip"},
    {"catchup": "all"},
    {"catchup": "all", "catchup_window": "1m"},
]
AGES = [1, 2 * 60_000, 3 * 86_400_000]


def test_a_past_one_shot_time_on_create_runs_once_whatever_the_catchup_policy() -> None:
    for policy in POLICIES:
        for age in AGES:
            n = node()
            worker(n)
            at = n.wall - age
            reply = n.create(id="o", schedule={"at": format_utc(at)}, **policy)
            assert reply is not None and reply.error is None
            assert reply.result["next_fire_ms"] == at
            n.run_until(2_000)
            assert fired_times(n, "o") == [at], (policy, age)
            assert n.skips() == [], (policy, age)


def update_to(n: Node, at: int, **policy: object) -> dict[str, object]:
    spec = validate_job(
        {"id": "u", "schedule": {"at": format_utc(at)}, "task": {"shell": "x"}, **policy},
        now_ms=n.wall,
    )
    reply = n.do(UpdateJob(n.request(), spec))
    assert reply is not None and reply.error is None, reply
    return reply.result


def test_a_past_one_shot_time_on_update_runs_once_as_on_create() -> None:
    for policy in POLICIES:
        for age in AGES:
            n = node()
            worker(n)
            n.create(id="u", schedule={"every": "1h", "start": format_utc(T0 + 3_600_000)})
            at = n.wall - age
            result = update_to(n, at, **policy)
            assert result["next_fire_ms"] == at, (policy, age)
            n.run_until(2_000)
            assert fired_times(n, "u") == [at], (policy, age)
            assert n.skips() == [], (policy, age)


def test_an_update_to_a_one_shot_time_that_already_went_out_owes_nothing() -> None:
    n = node()
    worker(n)
    at = T0 + 1_000
    n.create(id="u", schedule={"at": format_utc(at)})
    n.run_until(2_000)
    (ticket,) = n.tickets()
    n.do(ReportFinished("w1", ticket.run_id, ticket.token, "success", 0))
    result = update_to(n, at)
    assert result["next_fire_ms"] is None
    n.run_until(2_000)
    assert fired_times(n, "u") == [at]


def test_a_past_one_shot_time_asked_for_survives_a_crash_before_it_fired() -> None:
    n = node()
    n.auto_durable = False
    at = n.wall - 86_400_000
    n.create(id="o", schedule={"at": format_utc(at)}, catchup="skip")
    # The create's batch is durable; the fire's (made at the next turn) is not.
    n.flush(upto=n.unacked[0].batch_id)
    n.crash_and_recover(downtime_ms=5 * 60_000)
    n.auto_durable = True
    n.flush()
    worker(n)
    n.run_until(1_000)
    assert fired_times(n, "o") == [at]
    assert n.skips() == []


def test_a_past_one_shot_created_paused_runs_when_resumed() -> None:
    n = node()
    worker(n)
    at = n.wall - 5_000
    n.create(id="o", schedule={"at": format_utc(at)}, catchup="skip", paused=True)
    n.run_until(120_000, step=10_000)
    assert fired_times(n, "o") == []
    n.do(ResumeJob(n.request(), "o"))
    n.run_until(1_000)
    assert fired_times(n, "o") == [at]


def test_a_future_one_shot_missed_while_paused_goes_through_the_policy() -> None:
    for catchup, runs in (("skip", 0), ("latest", 1)):
        n = node()
        worker(n)
        at = n.wall + 5_000
        n.create(id="o", schedule={"at": format_utc(at)}, catchup=catchup)
        n.do(PauseJob(n.request(), "o"))
        n.run_until(20_000, step=1_000)
        n.do(ResumeJob(n.request(), "o"))
        n.run_until(1_000)
        assert len(fired_times(n, "o")) == runs, catchup
        reply = n.do(GetJob(n.request(), "o"))
        assert reply is not None and reply.result["next_fire_ms"] is None
        if not runs:
            assert [(s["why"], s["n"]) for s in n.skips()] == [("paused", 1)]
