"""Chains of triggered runs (``after`` dependencies, ``trigger:`` timeout handlers) are bounded
by a depth carried with each trigger; ``job.cancel --stop-running`` also stops the tasks of
runs that timed out under ``on_timeout=mark``."""

from __future__ import annotations

import pytest

from engine.effects import (
    CancelJob,
    OutboxDelivered,
    Pull,
    ReportFinished,
    ReportStarted,
    Trigger,
    TriggerJob,
)
from engine.records import make
from engine.shard import EngineConfig, ShardEngine
from tests.engine.harness import Node
from tests.engine.test_shard import cfg, once, worker

FAR = "2099-01-01T00:00:00Z"


def deliver_triggers(node: Node) -> int:
    """Deliver every trigger in the outbox to this node (all jobs live on it), as a driver
    does, and acknowledge it; how many there were."""
    n = 0
    while node.triggers:
        trig = node.triggers.pop(0)
        node.do(TriggerJob(node.request(), trig.job_id, trig.source_run_id, trig.depth))
        node.do(OutboxDelivered(trig.seq))
        n += 1
    return n


def succeed_all(node: Node, done: set[str]) -> int:
    """Report success for every dispatched run not reported yet; how many."""
    n = 0
    for t in node.tickets():
        if t.run_id not in done:
            done.add(t.run_id)
            node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
            node.do(Pull("w1", 1))  # the slot it freed
            n += 1
    return n


def cycle_node(depth: int) -> Node:
    node = Node(config=cfg(max_chain_depth=depth))
    worker(node, credits=8)
    node.create(id="cyc-a", schedule={"at": FAR}, after=["cyc-b"])
    node.create(id="cyc-b", schedule={"at": FAR}, after=["cyc-a"])
    node.deliver_registrations()
    return node


def test_a_two_job_after_cycle_ends_at_the_chain_limit() -> None:
    node = cycle_node(5)
    done: set[str] = set()
    # One outside trigger of cyc-a (depth 0: as from a scheduled run) starts the cycle.
    node.do(TriggerJob(node.request(), "cyc-a", "kick@1"))
    for _ in range(50):  # bounded: without the limit this would go on for every round
        node.advance(1)
        moved = succeed_all(node, done) + deliver_triggers(node)
        if not moved:
            break
    else:
        pytest.fail("the cycle did not stop")
    # Depths 1..5 ran (a, b, a, b, a); the trigger at depth 6 was skipped.
    assert [t.job_id for t in node.tickets()] == ["cyc-a", "cyc-b", "cyc-a", "cyc-b", "cyc-a"]
    (skip,) = [s for s in node.skips() if s["why"] == "chain_too_deep"]
    assert skip["n"] == 1 and skip["src"] == node.tickets()[-1].run_id
    depths = sorted(r.get("dp", 0) for r in node.runs().values())
    assert depths == [1, 2, 3, 4, 5]


def test_the_default_limit_is_64() -> None:
    assert EngineConfig().max_chain_depth == 64
    node = cycle_node(64)
    done: set[str] = set()
    node.do(TriggerJob(node.request(), "cyc-a", "kick@1"))
    for _ in range(200):
        node.advance(1)
        if not succeed_all(node, done) + deliver_triggers(node):
            break
    assert len(node.tickets()) == 64
    assert [s["why"] for s in node.skips()] == ["chain_too_deep"]


def test_a_chain_too_deep_trigger_redelivered_is_a_duplicate() -> None:
    node = Node(config=cfg(max_chain_depth=3))
    once(node, "t", in_s=3600)
    reply = node.do(TriggerJob(node.request(), "t", "src@1", 3))
    assert reply is not None and reply.result is not None
    assert reply.result["skipped"] == "chain_too_deep"
    node.crash_and_recover()
    again = node.do(TriggerJob(node.request(), "t", "src@1", 3))
    assert again is not None and again.result == {"duplicate": True}
    assert node.runs() == {}


@pytest.mark.parametrize("via_snapshot", [False, True])
def test_a_runs_depth_survives_a_restart_and_passes_on(via_snapshot: bool) -> None:
    node = Node()
    worker(node)
    node.create(id="up", schedule={"at": FAR})
    node.create(id="down", schedule={"at": FAR}, after=["up"])
    node.deliver_registrations()
    node.do(TriggerJob(node.request(), "up", "src@1", 7))  # up's run has depth 8
    if via_snapshot:
        node.take_snapshot()
    node.crash_and_recover(via_snapshot=via_snapshot)
    worker(node)
    node.advance(1)
    (t,) = node.tickets()
    node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    (trig,) = node.triggers
    assert (trig.job_id, trig.source_run_id, trig.depth) == ("down", t.run_id, 8)
    # Still in the outbox after a restart: the trigger effect sent again carries the depth.
    node.crash_and_recover(via_snapshot=via_snapshot)
    assert [(tr.job_id, tr.depth) for tr in node.triggers[1:]] == [("down", 8)]


def test_records_and_commands_from_before_depths_mean_depth_0() -> None:
    assert TriggerJob(1, "j", "s@1").depth == 0
    assert Trigger(1, "j", "s@1").depth == 0
    out = make("out", seq=4, job="j", src="s@1")
    assert ShardEngine._outbox_effect(out) == Trigger(4, "j", "s@1", 0)
    # A scheduled run's trigger carries no "dp" at all (nothing added to its bytes).
    node = Node()
    worker(node)
    once(node, "up")
    node.create(id="down", schedule={"at": FAR}, after=["up"])
    node.deliver_registrations()
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportFinished("w1", t.run_id, t.token, "success", 0))
    (out_record,) = [r for r in node.durable_records if r["t"] == "out" and "dep" not in r]
    assert "dp" not in out_record and node.triggers[0].depth == 0
    assert all("dp" not in r for r in node.runs().values())


def test_a_trigger_timeout_handler_counts_in_the_chain() -> None:
    """Two jobs whose timeouts trigger each other: a cycle through the timeout handler,
    bounded the same way (and mixed with ``after``, the depth adds up across both)."""
    node = Node(config=cfg(max_chain_depth=3, timeout_grace_ms=0))
    worker(node, credits=8)
    node.create(id="ta", schedule={"at": FAR}, timeout="1s", on_timeout="trigger:tb")
    node.create(id="tb", schedule={"at": FAR}, timeout="1s", on_timeout="trigger:ta")
    node.do(TriggerJob(node.request(), "ta", "kick@1"))
    confirmed = 0
    for _ in range(40):
        node.advance(600)
        for kill in node.kills[confirmed:]:  # the worker confirms each stop it is asked
            node.do(ReportFinished(kill.worker_id, kill.run_id, kill.token, "killed", None))
        confirmed = len(node.kills)
        node.do(Pull("w1", 8))
        deliver_triggers(node)
        if node.skips():
            break
    assert [t.job_id for t in node.tickets()] == ["ta", "tb", "ta"]
    assert [s["why"] for s in node.skips()] == ["chain_too_deep"]


def test_cancel_stop_running_kills_a_marked_runs_task() -> None:
    node = Node(config=cfg(timeout_grace_ms=1000))
    worker(node)
    once(node, "mk", timeout="1s", on_timeout="mark")
    node.advance(1000)
    (t,) = node.tickets()
    node.do(ReportStarted("w1", t.run_id, t.token))
    node.run_until(3000, step=500)
    assert node.final_states() == ["TIMED_OUT"] and node.kills == []
    assert node.engine.marked_running(t.run_id)
    node.do(CancelJob(node.request(), "mk", stop_running=True))
    assert [(k.worker_id, k.run_id, k.token) for k in node.kills] == [("w1", t.run_id, t.token)]
    # Its report ends the mark; nothing else changes (the run was final already).
    node.do(ReportFinished("w1", t.run_id, t.token, "failed", -9))
    assert not node.engine.marked_running(t.run_id)
    assert node.final_states() == ["TIMED_OUT"]


def test_cancel_without_stop_running_leaves_a_marked_task_alone() -> None:
    node = Node(config=cfg(timeout_grace_ms=1000))
    worker(node)
    once(node, "mk", timeout="1s", on_timeout="mark")
    once(node, "mk2", timeout="1s", on_timeout="mark")
    node.advance(1000)
    for t in node.tickets():
        node.do(ReportStarted("w1", t.run_id, t.token))
    node.run_until(3000, step=500)
    node.do(CancelJob(node.request(), "mk"))
    assert node.kills == []
    node.do(CancelJob(node.request(), "mk2", stop_running=True))
    assert [k.run_id.split("@")[0] for k in node.kills] == ["mk2"]  # not the other job's
