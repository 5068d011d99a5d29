"""What a run due but not taken says about why (``ShardEngine.waiting_reason``, shown by
``run.get`` as ``waiting``). Found by the fourth adversarial pass: a run of a tier no worker
serves stayed PENDING for good with nothing to tell the user."""

from __future__ import annotations

from engine.effects import Pull, WorkerHello
from tests.engine.harness import Node
from tests.engine.test_shard import once


def test_a_due_run_says_why_no_worker_takes_it() -> None:
    node = Node()
    once(node, "gpu-job", tier="gpu")
    assert [r for r in node.engine._runs.values()] == []  # not fired yet: nothing to say
    node.advance(1000)
    (run,) = node.engine._runs.values()
    rid = f"gpu-job@{run.at}"
    assert node.engine.waiting_reason(rid) == "no worker serves tier 'gpu'"
    node.do(WorkerHello("w-cpu", ("default",), 4, (), "c", 0))
    assert node.engine.waiting_reason(rid) == "no worker serves tier 'gpu'"
    node.do(WorkerHello("w-gpu", ("gpu",), 0, (), "g", 0))
    assert node.engine.waiting_reason(rid) == "every worker of tier 'gpu' is busy"
    node.do(Pull("w-gpu", 1))
    assert node.engine.waiting_reason(rid) is None  # it went out
    assert node.dispatches[-1][1].run.run_id == rid
    assert node.engine.waiting_reason("gpu-job@1") is None  # no such run


def test_a_fire_held_back_by_the_ready_bound_says_why_in_the_job() -> None:
    """Found by the fifth adversarial pass: a job whose due fire waits in the wheel (its tier
    at the ready bound) showed a next fire in the past, no run, and nothing said why."""
    from engine.effects import GetJob
    from engine.shard import EngineConfig

    node = Node(config=EngineConfig(ready_bound=2))
    for i in range(3):
        once(node, f"gpu-{i}", tier="gpu")
    once(node, "cpu-0")
    node.advance(1000)
    fired = {r.key for r in node.engine._runs.values()}
    assert len(fired) == 3  # two of tier gpu (its bound), and the cpu job

    def described(job_id: str) -> dict[str, object]:
        reply = node.do(GetJob(99, job_id))
        assert reply is not None and reply.error is None
        result: dict[str, object] = reply.result
        return result

    held = [j for j in ("gpu-0", "gpu-1", "gpu-2") if not described(j)["active_runs"]]
    assert len(held) == 1
    assert described(held[0])["waiting"] == (
        "not fired yet: tier 'gpu' holds 2 pending runs, its ready bound; the fire waits for "
        "room (no worker serves tier 'gpu')"
    )
    node.do(WorkerHello("w-gpu", ("gpu",), 0, (), "g", 0))
    assert "(no worker" not in str(described(held[0])["waiting"])
    # a job that fired, or that is not due yet, says nothing
    assert "waiting" not in described("cpu-0")
    once(node, "later", in_s=60, tier="gpu")
    assert "waiting" not in described("later")
