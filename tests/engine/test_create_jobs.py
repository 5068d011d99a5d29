"""CreateJobs (a driver's bulk create) against the CreateJob commands it stands for: the same
records, the same state and, spec by spec, the same answers, whatever mix of new, existing,
cancelled, replaced, duplicated and dependent jobs a batch holds."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.directory import MemoryDirectory
from engine.effects import CancelJob, CreateJob, CreateJobs, Persist, Reply
from engine.errors import EngineError, JobExists
from engine.jobs import JobSpec, validate_job
from tests.engine.harness import T0, Node

IDS = [f"j{i}" for i in range(6)]

spec_strategy = st.fixed_dictionaries(
    {
        "id": st.sampled_from(IDS),
        "schedule": st.sampled_from(
            [
                {"at": "2026-01-01T01:00:00Z"},
                {"at": "2025-12-31T23:00:00Z"},  # already past: still owed
                {"every": "1h"},
                {"cron": "*/5 * * * *"},
            ]
        ),
        "task": st.sampled_from([{"payload": 1}, {"shell": "true"}]),
    },
    optional={
        "replace": st.booleans(),
        "paused": st.booleans(),
        "after": st.sampled_from([["up-1"], ["up-1", "up-2"]]),
        "delivery": st.sampled_from(["at_most_once", "at_least_once"]),
    },
)


def _answer(reply: Reply | dict[str, Any] | EngineError) -> tuple[str, Any]:
    if isinstance(reply, Reply):
        if reply.error is not None:
            return _answer(reply.error)
        assert reply.result is not None
        return ("ok", reply.result)
    if isinstance(reply, EngineError):
        return (type(reply).__name__, (reply.field, str(reply)))
    return ("ok", reply)


def _prepared(before: list[tuple[str, dict[str, Any]]]) -> Node:
    node = Node()
    for op, raw in before:
        if op == "create":
            node.do(CreateJob(node.request(), validate_job(raw, now_ms=T0)))
        else:
            node.do(CancelJob(node.request(), raw["id"]))
    return node


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.sampled_from(["create", "cancel"]), spec_strategy), max_size=6),
    st.lists(spec_strategy, min_size=1, max_size=12),
)
def test_create_jobs_is_the_create_jobs_one_by_one(
    before: list[tuple[str, dict[str, Any]]], batch: list[dict[str, Any]]
) -> None:
    specs: list[JobSpec] = [validate_job(raw, now_ms=T0) for raw in batch]
    one, many = _prepared(before), _prepared(before)
    one.auto_durable = many.auto_durable = False
    # One by one, as a driver's turn hands them over (one engine call, one batch).
    ids = [one.request() for _ in specs]
    effects_one = one.engine.handle_many(
        [CreateJob(rid, s) for rid, s in zip(ids, specs, strict=True)], one.wall, one.mono
    )
    rid = many.request()
    effects_many = many.engine.handle(CreateJobs(rid, tuple(specs)), many.wall, many.mono)

    def records(effects: list[Any]) -> list[Any]:
        return [r for e in effects if isinstance(e, Persist) for r in e.records]

    assert records(effects_one) == records(effects_many)
    if records(effects_one):  # then nothing is answered before the batch is durable
        assert not [e for e in effects_one + effects_many if isinstance(e, Reply)]
    one.absorb(effects_one)
    many.absorb(effects_many)
    one.flush()
    many.flush()
    answers = many.replies[rid].result
    assert answers is not None
    assert [_answer(a) for a in answers["results"]] == [_answer(one.replies[i]) for i in ids]
    assert one.engine.snapshot() == many.engine.snapshot()
    assert one.registrations == many.registrations


def test_a_refused_spec_leaves_the_others_of_its_batch_alone() -> None:
    node = Node()
    first = validate_job(
        {"id": "a", "schedule": {"every": "1h"}, "task": {"payload": 1}}, now_ms=T0
    )
    second = validate_job(
        {"id": "b", "schedule": {"every": "1h"}, "task": {"payload": 2}}, now_ms=T0
    )
    reply = node.do(CreateJobs(node.request(), (first, first, second)))
    assert reply is not None and reply.result is not None
    a, dup, b = reply.result["results"]
    assert a["id"] == "a" and a["version"] == 1
    assert isinstance(dup, JobExists) and dup.field == "id"
    assert b["id"] == "b" and b["version"] == 1
    reply = node.do(CreateJobs(node.request(), ()))
    assert reply is not None and reply.result == {"results": []}


def test_refused_specs_leave_no_reference_cycle_behind() -> None:
    """A refusal kept in a reply or a result list carries no traceback: one would hold the
    frames it passed through, and they the command's specs (payloads and all), in a cycle
    only the collector frees. With the collector off, the specs must die with their replies.
    (Counted among the collector's objects, not by weak references: a compiled JobSpec
    takes none.)"""
    import gc

    node = Node()

    def specs() -> tuple[JobSpec, ...]:
        raw = [
            {"id": f"j{i}", "schedule": {"every": "1h"}, "task": {"payload": i}} for i in range(8)
        ]
        return tuple(validate_job(r, now_ms=T0) for r in raw)

    def alive() -> int:
        return sum(type(o) is JobSpec for o in gc.get_objects())

    node.do(CreateJobs(node.request(), specs()))  # created: the retries below are all refused
    node.replies.clear()
    gc.collect()
    gc.disable()
    try:
        before = alive()
        for make in (
            lambda ss: [CreateJobs(node.request(), ss)],
            lambda ss: [CreateJob(node.request(), s) for s in ss],
        ):
            again = specs()
            assert alive() == before + len(again)
            for command in make(again):
                node.do(command)
            assert node.replies and all(
                isinstance(r.error, JobExists) or r.result is not None
                for r in node.replies.values()
            )
            node.replies.clear()
            del again, command
            assert alive() == before
    finally:
        gc.enable()


class _CountingDirectory:
    """A directory that records the engine's lookups (around a MemoryDirectory, which is
    compiled and cannot be subclassed here)."""

    def __init__(self) -> None:
        self.inner = MemoryDirectory()
        self.one_by_one: list[str] = []
        self.at_once: list[list[str]] = []

    def absorb(self, records: Any) -> None:
        self.inner.absorb(records)

    def key_of(self, job_id: str) -> int | None:
        self.one_by_one.append(job_id)
        return self.inner.key_of(job_id)

    def keys_of(self, job_ids: list[str]) -> list[int | None]:
        self.at_once.append(list(job_ids))
        return self.inner.keys_of(job_ids)

    def latest(self, key: int) -> Any:
        return self.inner.latest(key)

    def ticket_fields(self, key: int) -> Any:
        return self.inner.ticket_fields(key)

    def has_run(self, key: int, at: int) -> bool:
        return self.inner.has_run(key, at)


def test_a_bulk_create_asks_the_directory_once_for_its_ids() -> None:
    """A chunk's ids are looked up in one call (a store's multi-get) instead of one a job;
    the ids of jobs not yet durable (made earlier, or earlier in the chunk) are the engine's
    own, and the answers are those of creates one by one."""
    node = Node(make_directory=_CountingDirectory)
    directory = node.directory
    assert isinstance(directory, _CountingDirectory)

    def spec(job_id: str, **more: Any) -> JobSpec:
        raw = {"id": job_id, "schedule": {"every": "1h"}, "task": {"payload": job_id}, **more}
        return validate_job(raw, now_ms=T0)

    node.do(CreateJob(node.request(), spec("durable")))  # acknowledged: the directory's
    node.auto_durable = False
    node.do(CreateJob(node.request(), spec("in-flight")))  # not durable yet: the engine's
    directory.one_by_one.clear()
    reply = node.do(
        CreateJobs(
            node.request(),
            (
                spec("durable"),
                spec("in-flight"),
                spec("new"),
                spec("new"),
                spec("durable", replace=True),
            ),
        )
    )
    assert reply is None  # (answered once durable)
    assert directory.at_once == [["durable", "new", "new", "durable"]]
    assert directory.one_by_one == []  # (the replacing create's update path included)
    node.flush()
    (answer,) = [r for r in node.replies.values() if r.result and "results" in r.result]
    assert answer.result is not None
    exists, in_flight, new, again, replaced = answer.result["results"]
    assert isinstance(exists, JobExists) and isinstance(in_flight, JobExists)
    assert new["id"] == "new" and new["version"] == 1
    assert isinstance(again, JobExists)
    assert replaced["id"] == "durable" and replaced["version"] == 2
