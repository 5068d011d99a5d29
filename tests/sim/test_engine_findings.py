"""Engine behaviour the simulation ran into that breaks the contract, as minimal reproductions.

Each test states what the contract promises. A finding is first marked ``xfail(strict=True)``
(it fails until the engine is fixed, and the mark must then go); the ones below are fixed.
"""

from __future__ import annotations

from engine.effects import CreateJob, GetJob, Reply
from engine.jobs import validate_job
from engine.schedules import format_utc
from tests.engine.harness import T0, Node


def test_a_retried_create_is_not_told_exists_before_the_job_is_durable() -> None:
    # DESIGN.md: "the client library generates a time-sortable [id] ... so a retried create
    # is idempotent" and "the reply is sent only after the record is durable". A client whose
    # first reply was lost retries with the same id; whatever it is told must survive a crash.
    node = Node(auto_durable=False)
    spec = validate_job(
        {"id": "j1", "schedule": {"at": format_utc(T0 + 60_000)}, "task": {"command": ["true"]}},
        now_ms=node.wall,
    )
    assert node.do(CreateJob(node.request(), spec)) is None  # waits for durability
    retry = node.do(CreateJob(node.request(), spec))
    told_exists = isinstance(retry, Reply) and retry.error is not None
    described = node.do(GetJob(node.request(), "j1"))
    told_exists = told_exists or (isinstance(described, Reply) and described.error is None)
    node.crash_and_recover()  # the first batch never became durable
    after = node.do(GetJob(node.request(), "j1"))
    exists_now = isinstance(after, Reply) and after.error is None
    assert not told_exists or exists_now, "the client was told the job exists; it is gone"
