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
