"""A worker's hello against the dispatches crossing it (``WorkerHello.instance``/``seen``).

A hello lists the runs the worker holds when it leaves; a dispatch the engine sent after that
is not in it. Before ``seen``, the engine took every run missing from a hello as lost: an
at-least-once run went out again while its first dispatch was still on its way to the worker
that then ran it too, twice without any crash (found by the third adversarial pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.effects import (
    Dispatch,
    Heartbeat,
    Pull,
    ReportFinished,
    ReportStarted,
    RunTicket,
    WorkerHello,
)
from engine.shard import EngineConfig
from tests.engine.harness import Node
from tests.engine.test_shard import once


def hello(node: Node, held: tuple[tuple[str, int], ...], seen: int, instance: str = "i1") -> None:
    node.do(WorkerHello("w1", ("default",), 4, held, instance, seen))


def dispatched(node: Node) -> list[Dispatch]:
    return [d for _t, d in node.dispatches]


def one_out() -> tuple[Node, Dispatch]:
    """A worker process (instance "i1") said hello and was sent one run."""
    node = Node()
    hello(node, (), 0)
    once(node, "a")
    node.advance(1000)
    (first,) = dispatched(node)
    return node, first


def test_a_hello_crossing_a_dispatch_keeps_the_run_and_sends_it_again() -> None:
    node, first = one_out()
    hello(node, (), seen=first.seq - 1)  # left before the dispatch arrived
    again = dispatched(node)[-1]
    assert again.run == first.run and again.seq > first.seq  # same attempt, same token
    assert len(dispatched(node)) == 2
    node.do(ReportFinished("w1", first.run.run_id, first.run.token, "success", 0))
    assert node.final_states() == ["SUCCESS"]


def test_a_hello_that_saw_the_dispatch_and_does_not_hold_it_loses_the_run() -> None:
    node, first = one_out()
    hello(node, (), seen=first.seq)  # it had it, and dropped it (fenced)
    second = dispatched(node)[-1].run
    assert (second.run_id, second.attempt) == (first.run.run_id, 2)
    assert second.token > first.run.token


def test_another_process_of_the_worker_loses_what_the_first_was_sent() -> None:
    node = Node()
    hello(node, (), 0, instance="before-restart")
    once(node, "a")
    node.advance(1000)
    (first,) = dispatched(node)
    hello(node, (), seen=0, instance="after-restart")
    assert dispatched(node)[-1].run.attempt == 2
    assert dispatched(node)[-1].run.token > first.run.token


def test_a_hello_without_an_instance_loses_every_run_it_does_not_announce() -> None:
    node = Node()
    hello(node, (), 0, instance="")
    once(node, "a")
    node.advance(1000)
    hello(node, (), seen=0, instance="")
    assert [d.run.attempt for d in dispatched(node)] == [1, 2]


def test_a_dispatch_waiting_for_durability_is_neither_lost_nor_sent_twice() -> None:
    node = Node(auto_durable=False)
    hello(node, (), 0)
    once(node, "amo", delivery="at_most_once")
    node.flush()
    node.advance(1000)  # fired and claimed; the dispatch waits for the claim's batch
    assert dispatched(node) == []
    hello(node, (), seen=0)
    node.flush()
    (only,) = dispatched(node)
    assert only.run.attempt == 1
    node.flush()
    assert len(dispatched(node)) == 1


def test_dispatch_numbers_follow_the_order_they_leave_in() -> None:
    """An at-most-once dispatch held for its claim's batch leaves after an at-least-once one
    claimed later: the numbers follow the leaving, not the claiming."""
    node = Node(auto_durable=False)
    node.do(WorkerHello("w1", ("default",), 0, (), "i1", 0))  # no slots yet
    once(node, "amo", delivery="at_most_once")
    once(node, "alo")
    node.flush()
    node.advance(1000)
    node.flush()  # both fired, their runs durable, waiting for a slot
    node.do(Pull("w1", 2))
    assert [d.run.job_id for d in dispatched(node)] == ["alo"]  # amo waits for its claim
    node.flush()
    assert [d.run.job_id for d in dispatched(node)] == ["alo", "amo"]
    tokens = {d.run.job_id: d.run.token for d in dispatched(node)}
    assert tokens["amo"] < tokens["alo"]  # claimed first, sent second
    seqs = [d.seq for d in dispatched(node)]
    assert seqs[0] < seqs[1]


def test_a_start_report_overtaking_the_hello_keeps_the_run_and_sends_it_again() -> None:
    """The node may take a start report sent after a hello before the hello itself. The run
    is kept, and sent again: the same attempt, which the worker holding it drops as a repeat
    (sent again, it also settles the case where the dispatch numbered after the hello's
    ``seen`` was itself a send again lost with a broken connection: see the next test)."""
    node, first = one_out()
    node.do(ReportStarted("w1", first.run.run_id, first.run.token))
    hello(node, (), seen=first.seq - 1)  # left before the dispatch arrived
    again = dispatched(node)[-1]
    assert len(dispatched(node)) == 2
    assert again.run == first.run and again.seq > first.seq and again.again
    node.do(ReportFinished("w1", first.run.run_id, first.run.token, "success", 0))
    assert node.final_states() == ["SUCCESS"]


def test_a_started_run_whose_send_again_was_lost_is_settled_by_the_next_hello() -> None:
    """A hello that crossed the dispatch got the run sent again; that send went down with a
    broken connection after the worker had started the run from the first dispatch and then
    let it go. Every later hello is numbered before the lost send: each one sends the run
    again, and the hello after a send that arrived loses it (at-most-once: LOST), instead of
    keeping it RUNNING for as long as the worker lives (found by fuzzing)."""
    node = Node(config=EngineConfig(worker_lease_ms=10**6, reattach_grace_ms=10**6))
    hello(node, (), 0)
    once(node, "a", delivery="at_most_once")
    node.advance(1000)
    node.flush()
    (first,) = dispatched(node)
    hello(node, (), seen=0)  # built before the dispatch arrived: the run goes out again
    lost = dispatched(node)[-1]
    assert lost.seq > first.seq
    node.do(ReportStarted("w1", first.run.run_id, first.run.token))
    # the worker lets the run go; the connection breaks with ``lost`` on it; hello again
    hello(node, (), seen=first.seq)
    arrived = dispatched(node)[-1]
    assert arrived.run == first.run and arrived.seq > lost.seq
    assert node.final_states() == ["RUNNING"]
    hello(node, (), seen=arrived.seq)  # the worker dropped the repeat of what it let go
    node.advance(10**6 + 1000)  # the grace for a worker to announce a run let go
    assert node.final_states() == ["LOST"]
    assert [d.run.token for d in dispatched(node)] == [first.run.token] * 3  # one attempt


def test_a_run_being_stopped_gets_the_kill_again_not_the_run() -> None:
    """An at-most-once run timed out while CLAIMED (a kill sent, its confirmation awaited)
    and kept by a hello that did not see its dispatch must not start now (found by review:
    it was sent again and executed after its timeout)."""
    node = Node(config=EngineConfig(worker_lease_ms=60_000, reattach_grace_ms=120_000))
    hello(node, (), 0)
    once(node, "t", delivery="at_most_once", timeout="2s")
    node.advance(1000)
    (first,) = dispatched(node)
    node.run_until(5_000 + EngineConfig().timeout_grace_ms)  # past the timeout and its grace
    kills = len(node.kills)  # (the kill went out)
    assert kills >= 1
    hello(node, (), seen=first.seq - 1)  # a reconnect: the dispatch went down with it
    assert dispatched(node) == [first]
    assert len(node.kills) == kills + 1 and node.kills[-1].token == first.run.token


def test_a_repeat_is_marked_as_taking_no_slot() -> None:
    node = Node()
    hello(node, (), 0)
    once(node, "a")
    node.advance(1000)
    hello(node, (), seen=0)
    first, again = dispatched(node)
    assert not first.again and again.again


def test_a_reattached_run_missing_from_a_later_hello_is_lost() -> None:
    node = Node(config=EngineConfig(worker_lease_ms=10**9, reattach_grace_ms=10**9))
    hello(node, (), 0)
    once(node, "a")
    node.advance(1000)
    (first,) = dispatched(node)
    node.crash_and_recover()
    held = ((first.run.run_id, first.run.token),)
    hello(node, held, seen=first.seq)  # re-attached by its announcement
    hello(node, (), seen=0)  # the same process, without it: it had it, so it is gone
    assert dispatched(node)[-1].run.attempt == 2


def test_a_heartbeat_omitting_a_run_it_had_loses_it() -> None:
    """A worker that dropped a run and kept heartbeating without a hello (a third-party
    worker, say) no longer leaves it RUNNING for good."""
    node, first = one_out()
    node.do(ReportStarted("w1", first.run.run_id, first.run.token))
    node.do(Heartbeat("w1", (), "i1", first.seq))
    assert dispatched(node)[-1].run.attempt == 2


def test_a_heartbeat_leaves_alone_what_it_has_not_seen_and_never_sends_again() -> None:
    node, first = one_out()
    node.do(Heartbeat("w1", (), "i1", first.seq - 1))
    assert dispatched(node) == [first]
    node.do(ReportFinished("w1", first.run.run_id, first.run.token, "success", 0))
    assert node.final_states() == ["SUCCESS"]


def test_a_heartbeat_without_seen_or_from_another_process_only_renews() -> None:
    node, first = one_out()
    node.do(Heartbeat("w1", ()))  # a driver that keeps no count
    node.do(Heartbeat("w1", (), "another", first.seq))
    assert dispatched(node) == [first]


# ------------------------------------------------------------------ a worker on a connection


@dataclass
class _Worker:
    """What the real worker keeps: the runs it holds by id, finished ones included until
    their report is answered (a repeat of the same token is dropped), the highest dispatch
    number it received, and what is on its way to it: dispatches and answers, in order."""

    node: Node
    instance: str = "p1"
    seen: int = 0
    held: dict[str, RunTicket] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)  # held, report sent, not yet answered
    inbound: list[Dispatch | str] = field(default_factory=list)  # FIFO, one connection
    taken: int = 0  # dispatches already moved from node.dispatches to inbound
    executions: list[tuple[str, int, int]] = field(default_factory=list)  # rid, attempt, token
    #: attempts let go (a fence): a repeat of one is never run, as in the real worker
    dropped: dict[str, int] = field(default_factory=dict)
    #: hellos sent, not yet taken by the engine: the reports sent after one may overtake it
    outbound: list[WorkerHello | Heartbeat] = field(default_factory=list)

    def collect(self) -> None:
        fresh = self.node.dispatches[self.taken :]
        self.taken = len(self.node.dispatches)
        self.inbound.extend(d for _t, d in fresh)

    def deliver_one(self) -> None:
        if not self.inbound:
            return
        d = self.inbound.pop(0)
        if isinstance(d, str):  # a report's answer
            self.finished.discard(d)
            self.held.pop(d, None)
            return
        self.seen = max(self.seen, d.seq)
        if self.dropped.get(d.run.run_id, -1) >= d.run.token:
            return
        held = self.held.get(d.run.run_id)
        if held is None or held.token < d.run.token:
            self.held[d.run.run_id] = d.run
            self.finished.discard(d.run.run_id)
            self.executions.append((d.run.run_id, d.run.attempt, d.run.token))

    def drop_one(self) -> None:
        """A fence: a running task killed, unreported, no longer held (a hello follows)."""
        running = [rid for rid in self.held if rid not in self.finished]
        if running:
            ticket = self.held.pop(running[0])
            self.dropped[ticket.run_id] = ticket.token

    def say_hello(self) -> None:
        held = tuple((rid, t.token) for rid, t in self.held.items())
        self.outbound.append(WorkerHello("w1", ("default",), 8, held, self.instance, self.seen))

    def heartbeat(self) -> None:
        held = tuple((rid, t.token) for rid, t in self.held.items())
        self.outbound.append(Heartbeat("w1", held, self.instance, self.seen))

    def hello_lands(self) -> None:
        if self.outbound:
            self.node.do(self.outbound.pop(0))
            self.collect()

    def start_one(self) -> None:
        """A start report, taken by the engine at once (ahead of any hello still out)."""
        for rid, ticket in self.held.items():
            if rid not in self.finished:
                self.node.do(ReportStarted("w1", rid, ticket.token))
                return

    def finish_one(self) -> None:
        running = [rid for rid in self.held if rid not in self.finished]
        if running:
            rid = running[0]
            self.node.do(ReportFinished("w1", rid, self.held[rid].token, "success", 0))
            self.finished.add(rid)
            self.collect()
            self.inbound.append(rid)  # its answer follows what the node sent before it

    def break_connection(self) -> None:
        self.inbound.clear()  # what was on its way is gone; the reconnect says hello
        while self.outbound:
            self.hello_lands()  # sent before the break: taken, or not (then no matter)
        for rid in self.finished:
            # The real worker sends unanswered reports again after its hello; here they
            # were taken, so only their answers were lost.
            self.held.pop(rid, None)
        self.finished.clear()
        self.say_hello()


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.sampled_from(
            [
                "create",
                "tick",
                "deliver",
                "hello",
                "beat",
                "land",
                "start",
                "finish",
                "break",
                "drop",
            ]
        ),
        min_size=1,
        max_size=60,
    ),
    durable_at_once=st.booleans(),
)
# Found by review: a run that arrives after a hello left and is then let go (a fence) is
# kept by that hello and sent again; the repeat must not run, and a later hello loses it.
@example(
    steps=["create", "tick", "hello", "deliver", "drop", "land", "deliver"],
    durable_at_once=True,
)
@example(
    steps=["create", "create", "tick", "hello", "deliver", "start", "drop", "land", "deliver"],
    durable_at_once=False,
)
# Found by fuzzing: a send again (crossing a hello) went down with a broken connection after
# the run was reported started; the worker let the run go (having announced it, or not), and
# every later hello, numbered before that lost send, was taken as crossing it: RUNNING while
# the worker lived.
@example(
    steps=["create", "break", "tick", "deliver", "land", "start", "break", "drop"],
    durable_at_once=False,
)
@example(
    steps=["create", "break", "tick", "deliver", "land", "start", "drop", "break"],
    durable_at_once=False,
)
def test_hellos_at_any_point_never_run_a_run_twice_nor_lose_one(
    steps: list[str], durable_at_once: bool
) -> None:
    """One worker process on one FIFO connection, hellos and heartbeats at random points (a
    fence's, a refused report's, a reconnect's after the connection broke), its start reports
    taken ahead of a hello sent before them (the node may), running tasks let go (a fence):
    without a crash or a lease lapse no attempt is executed twice, an at-most-once run at
    most once, a run handed out again only if it was let go, and once everything is
    delivered and finished every run is final (none stays CLAIMED or RUNNING): SUCCESS
    unless let go (then at-least-once: a later attempt's SUCCESS; at-most-once: LOST)."""
    node = Node(
        auto_durable=durable_at_once,
        config=EngineConfig(worker_lease_ms=10**6, reattach_grace_ms=10**6),
    )
    w = _Worker(node)
    w.say_hello()
    w.hello_lands()
    created = 0
    for step in steps:
        if step == "create":
            created += 1
            delivery = "at_most_once" if created % 2 else "at_least_once"
            once(node, f"j{created}", in_s=1, delivery=delivery)
        elif step == "tick":
            node.advance(1000)
        elif step == "deliver":
            w.deliver_one()
        elif step == "hello":
            w.say_hello()
        elif step == "beat":
            w.heartbeat()
        elif step == "land":
            w.hello_lands()
        elif step == "start":
            w.start_one()
        elif step == "finish":
            w.finish_one()
        elif step == "drop":
            w.drop_one()
        else:
            w.break_connection()
        if step in ("tick", "create") and not durable_at_once:
            node.flush()
        w.collect()
    # Drain: time for every job to fire, every batch durable, everything delivered and done.
    for _ in range(created + 5):
        node.advance(1000)
        node.flush()
        w.collect()
        while w.inbound:
            w.deliver_one()
        while len(w.finished) < len(w.held):
            w.finish_one()
            node.flush()
            w.collect()
            while w.inbound:
                w.deliver_one()
        w.say_hello()
        while w.outbound:
            w.hello_lands()
        node.flush()
        w.collect()
    node.advance(2 * 10**6)  # the grace of runs let go ends (all else is final by now)
    node.flush()
    attempts = [(rid, token) for rid, _attempt, token in w.executions]
    assert len(attempts) == len(set(attempts))  # no attempt twice
    let_go = set(w.dropped)
    by_run: dict[str, list[int]] = {}
    for rid, attempt, _token in w.executions:
        by_run.setdefault(rid, []).append(attempt)
    assert len(by_run) == created
    for rid, tries in by_run.items():
        job = int(rid.split("@")[0][1:])
        if job % 2:  # at-most-once
            assert tries == [1], rid
        elif rid not in let_go:
            assert tries == [1], rid
    states = node.final_states()
    amo_let_go = sum(1 for rid in let_go if int(rid.split("@")[0][1:]) % 2)
    assert states == sorted(["LOST"] * amo_let_go + ["SUCCESS"] * (created - amo_let_go))
