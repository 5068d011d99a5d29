"""``Sync``: how a driver acknowledges what has no request id of its own (a worker's final
reports) only once it is durable."""

from __future__ import annotations

from engine.effects import ReportFinished, Sync, WorkerHello
from engine.shard import EngineConfig
from tests.engine.harness import Node
from tests.engine.test_shard import once


def _claimed(node: Node) -> tuple[str, int]:
    node.do(WorkerHello("w1", ("default",), 2))
    once(node, "s")
    node.advance(1000)
    node.flush()
    (ticket,) = node.tickets()
    return ticket.run_id, ticket.token


def test_a_sync_after_a_report_is_answered_once_the_report_is_durable() -> None:
    node = Node(auto_durable=False)
    rid, token = _claimed(node)
    node.do(ReportFinished("w1", rid, token, "success", 0))
    assert node.do(Sync(node.request())) is None  # the SUCCESS record is in flight
    node.flush()
    assert node.replies[node.next_request].error is None
    assert node.durable_records[-1]["state"] == "SUCCESS"


def test_a_repeated_report_waits_for_every_batch_in_flight() -> None:
    """A repeat (the worker heard nothing, and sent it again) is answered only once the first
    one's batch is durable as well: a crash before that would lose the outcome the worker was
    just told is safe."""
    node = Node(auto_durable=False)
    rid, token = _claimed(node)
    node.do(ReportFinished("w1", rid, token, "success", 0))
    first = node.unacked[-1].batch_id
    node.do(ReportFinished("w1", rid, token, "success", 0))
    assert node.do(Sync(node.request())) is None
    node.flush(upto=first - 1)
    assert node.next_request not in node.replies
    node.flush()
    assert node.next_request in node.replies
    assert "SUCCESS" in [r.get("state") for r in node.durable_records]


def test_a_sync_with_nothing_in_flight_is_answered_at_once() -> None:
    node = Node(auto_durable=False)
    assert node.do(Sync(node.request())) is not None


def test_the_mutant_answers_before_durability() -> None:
    node = Node(
        auto_durable=False,
        config=EngineConfig(
            worker_lease_ms=10**9,
            reattach_grace_ms=10**9,
            mutants=frozenset({"report-ack-before-durable"}),
        ),
    )
    rid, token = _claimed(node)
    node.do(ReportFinished("w1", rid, token, "success", 0))
    assert node.do(Sync(node.request())) is not None
