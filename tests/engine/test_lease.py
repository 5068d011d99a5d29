"""Shard leases against a reference coordinator, with bounded clock drift, delays and losses.

The reference is etcd's semantics written the obvious way: one owner key per shard attached to
a lease that lapses ``ttl`` after its last grant or renewal reached the coordinator (whose
clock is true time), compare-and-swap on (no owner, epoch). Nodes run :class:`ShardLease`
with monotonic clocks drifting within the configured bound; messages are delayed, reordered
and lost; nodes pause (simply not stepped) and restart. After every step: a node that may act
holds the live lease for its epoch in the coordinator's view, so no two act at once and none
acts past the coordinator-side expiry; no epoch is acted under by two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.errors import EngineUsageError, StaleEpoch
from engine.lease import (
    Acquire,
    Denied,
    EpochFence,
    Granted,
    LeaseConfig,
    LeaseEffect,
    LeaseGone,
    LeaseState,
    ReadShard,
    Renew,
    Renewed,
    Request,
    Response,
    Revoke,
    ShardLease,
    ShardView,
    StartActing,
    StopActing,
    clock_disagreement,
    guard_fence_at,
    preference,
    worker_fence_at,
)
from engine.routing import shard_of

T0 = 1_767_225_600_000
CONFIG = LeaseConfig(
    ttl_ms=3_000,
    renew_every_ms=1_000,
    retry_ms=400,
    poll_ms=2_000,
    stagger_ms=300,
    max_drift_ppm=20_000,  # 2%: far worse than real clocks, to make the margin matter
    margin_ms=50,
    clock_bound_ms=500,
)
NODES = ["n0", "n1", "n2"]
SHARD = 3


# ---------------------------------------------------------------- the reference coordinator


@dataclass
class Coordinator:
    ttl: int
    epoch: int = 0
    owner: tuple[str, int, int] | None = None  # (node, nonce, lease id)
    expiry: dict[int, int] = field(default_factory=dict)  # live lease id -> true expiry
    next_lease: int = 0

    def settle(self, now: int) -> None:
        for lease_id, at in list(self.expiry.items()):
            if now >= at:
                del self.expiry[lease_id]
        if self.owner is not None and self.owner[2] not in self.expiry:
            self.owner = None

    def handle(self, request: Request, now: int) -> Response | None:
        self.settle(now)
        wall = T0 + now
        if isinstance(request, ReadShard):
            return ShardView(request.req, SHARD, self._owner_name(), self.epoch, wall)
        if isinstance(request, Acquire):
            if self.owner is not None and self.owner[:2] == (request.node, request.nonce):
                return Granted(request.req, SHARD, self.epoch, self.owner[2], wall)
            if self.owner is None and self.epoch == request.expected_epoch:
                self.next_lease += 1
                self.epoch += 1
                self.owner = (request.node, request.nonce, self.next_lease)
                self.expiry[self.next_lease] = now + request.ttl_ms
                return Granted(request.req, SHARD, self.epoch, self.next_lease, wall)
            return Denied(request.req, SHARD, self._owner_name(), self.epoch, wall)
        if isinstance(request, Renew):
            if request.lease_id in self.expiry:
                self.expiry[request.lease_id] = now + self.ttl
                return Renewed(request.req, SHARD, request.lease_id, wall)
            return LeaseGone(request.req, SHARD, request.lease_id, wall)
        assert isinstance(request, Revoke)
        self.expiry.pop(request.lease_id, None)
        self.settle(now)
        return None

    def _owner_name(self) -> str | None:
        return None if self.owner is None else self.owner[0]

    def holds(self, node: str, lease_id: int | None, epoch: int, now: int) -> bool:
        self.settle(now)
        return (
            self.owner is not None
            and self.owner[0] == node
            and self.owner[2] == lease_id
            and self.epoch == epoch
        )


# ---------------------------------------------------------------- nodes with drifting clocks


@dataclass
class SimNode:
    name: str
    incarnation: int
    lease: ShardLease
    rate_ppm: int  # monotonic clock rate error relative to true time
    base_true: int
    base_mono: int
    offset: int = 0  # wall clock minus true time

    def mono(self, now: int) -> int:
        return self.base_mono + (now - self.base_true) * (1_000_000 + self.rate_ppm) // 1_000_000

    def wall(self, now: int) -> int:
        return T0 + now + self.offset

    def set_rate(self, now: int, ppm: int) -> None:
        self.base_mono, self.base_true, self.rate_ppm = self.mono(now), now, ppm


class LeaseMachine(RuleBasedStateMachine):
    config = CONFIG

    @initialize(rates=st.lists(st.integers(-20_000, 20_000), min_size=3, max_size=3))
    def setup(self, rates: list[int]) -> None:
        self.now = 0
        self.coord = Coordinator(self.config.ttl_ms)
        order = preference(SHARD, NODES)
        self.nodes = {
            name: SimNode(
                name,
                0,
                ShardLease(node=name, shard=SHARD, rank=order.index(name), config=self.config),
                rate,
                0,
                1_000 * (i + 1),
            )
            for i, (name, rate) in enumerate(zip(NODES, rates, strict=True))
        }
        self.to_coord: list[tuple[str, int, Request]] = []
        self.to_node: list[tuple[str, int, Response]] = []
        self.epoch_actors: dict[int, tuple[str, int]] = {}

    # ---------------------------------------------------------------- helpers

    def absorb(self, node: SimNode, effects: list[LeaseEffect]) -> None:
        for effect in effects:
            if isinstance(effect, StartActing):
                # A node starts acting only after a clock check that passed.
                assert abs(node.offset) <= self.config.clock_bound_ms, node
                actor = (node.name, node.incarnation)
                assert self.epoch_actors.setdefault(effect.epoch, actor) == actor, effect
            elif isinstance(effect, StopActing):
                pass
            else:
                self.to_coord.append((node.name, node.incarnation, effect))
        node.lease._check()

    # ---------------------------------------------------------------- rules

    @rule(node=st.sampled_from(NODES))
    def want(self, node: str) -> None:
        n = self.nodes[node]
        self.absorb(n, n.lease.want_ownership(n.mono(self.now)))

    @rule(node=st.sampled_from(NODES))
    def give_up(self, node: str) -> None:
        n = self.nodes[node]
        self.absorb(n, n.lease.give_up(n.mono(self.now)))

    @rule(node=st.sampled_from(NODES))
    def tick(self, node: str) -> None:
        n = self.nodes[node]
        self.absorb(n, n.lease.tick(n.mono(self.now)))

    @rule(ms=st.sampled_from([1, 50, 300, 700, 1_100, 2_500, 4_000]))
    def advance(self, ms: int) -> None:
        self.now += ms

    @rule(ms=st.sampled_from([1, 100, 500, 1_000]))
    def advance_and_tick_all(self, ms: int) -> None:
        # A well-behaved driver: every node ticks at least this often.
        self.now += ms
        for n in self.nodes.values():
            self.absorb(n, n.lease.tick(n.mono(self.now)))

    @precondition(lambda self: bool(self.to_coord))
    @rule(data=st.data(), lose=st.integers(0, 9))
    def coordinator_receives(self, data: st.DataObject, lose: int) -> None:
        # Any message in flight, so messages are reordered; one in ten is lost.
        i = data.draw(st.integers(0, len(self.to_coord) - 1))
        node, incarnation, request = self.to_coord.pop(i)
        if lose:
            self.coordinator_handles(node, incarnation, request)

    def coordinator_handles(self, node: str, incarnation: int, request: Request) -> None:
        response = self.coord.handle(request, self.now)
        if response is not None:
            self.to_node.append((node, incarnation, response))

    @precondition(lambda self: bool(self.to_node))
    @rule(data=st.data(), lose=st.integers(0, 9))
    def node_receives(self, data: st.DataObject, lose: int) -> None:
        i = data.draw(st.integers(0, len(self.to_node) - 1))
        node, incarnation, response = self.to_node.pop(i)
        if lose:
            self.node_handles(node, incarnation, response)

    def node_handles(self, node: str, incarnation: int, response: Response) -> None:
        n = self.nodes[node]
        if incarnation == n.incarnation:  # a restarted process has new connections
            self.absorb(n, n.lease.on_response(response, n.mono(self.now), n.wall(self.now)))

    @rule(ms=st.sampled_from([100, 300, 1_000]))
    def healthy_round(self, ms: int) -> None:
        # What a working cluster does most of the time: everyone ticks, the network delivers.
        for n in self.nodes.values():
            self.absorb(n, n.lease.tick(n.mono(self.now)))
        self.network_settles()
        self.now += ms

    @rule()
    def network_settles(self) -> None:
        # Everything in flight arrives in order, answers included, with no time passing.
        while self.to_coord or self.to_node:
            if self.to_coord:
                self.coordinator_handles(*self.to_coord.pop(0))
            else:
                self.node_handles(*self.to_node.pop(0))

    @rule(node=st.sampled_from(NODES))
    def watch(self, node: str) -> None:
        n = self.nodes[node]
        self.coord.settle(self.now)
        owner = None if self.coord.owner is None else self.coord.owner[0]
        view = ShardView(0, SHARD, owner, self.coord.epoch, T0 + self.now)
        self.absorb(n, n.lease.on_response(view, n.mono(self.now), n.wall(self.now)))

    @rule(node=st.sampled_from(NODES))
    def store_refuses(self, node: str) -> None:
        n = self.nodes[node]
        self.absorb(n, n.lease.store_refused(n.mono(self.now)))

    @rule(node=st.sampled_from(NODES), ppm=st.integers(-20_000, 20_000))
    def drift_changes(self, node: str, ppm: int) -> None:
        self.nodes[node].set_rate(self.now, ppm)

    @rule(node=st.sampled_from(NODES), offset=st.sampled_from([0, 100, -120, 0, 1_600, -5_000]))
    def wall_clock_set(self, node: str, offset: int) -> None:
        self.nodes[node].offset = offset

    @rule(node=st.sampled_from(NODES))
    def restart(self, node: str) -> None:
        old = self.nodes[node]
        self.nodes[node] = SimNode(
            node,
            old.incarnation + 1,
            ShardLease(node=node, shard=SHARD, rank=old.lease.rank, config=self.config),
            old.rate_ppm,
            self.now,
            old.mono(self.now),
            old.offset,
        )

    # ---------------------------------------------------------------- the promises

    @invariant()
    def acting_only_under_a_live_lease(self) -> None:
        if not hasattr(self, "nodes"):
            return
        actors = []
        for n in self.nodes.values():
            lease = n.lease
            if lease.may_act(n.mono(self.now)):
                assert lease.clock_ok
                assert self.coord.holds(n.name, lease.lease_id, lease.epoch, self.now), (
                    f"{n.name} acts under epoch {lease.epoch} at t={self.now}, but the "
                    f"coordinator holds {self.coord.owner} at epoch {self.coord.epoch}"
                )
                actors.append(n.name)
        assert len(actors) <= 1, actors

    @invariant()
    def at_most_one_active_state_per_epoch(self) -> None:
        if not hasattr(self, "nodes"):
            return
        epochs = [n.lease.epoch for n in self.nodes.values() if n.lease.state is LeaseState.ACTIVE]
        assert len(epochs) == len(set(epochs)), epochs


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = SETTINGS


class NoSelfFenceMachine(LeaseMachine):
    config = LeaseConfig(
        ttl_ms=CONFIG.ttl_ms,
        renew_every_ms=CONFIG.renew_every_ms,
        retry_ms=CONFIG.retry_ms,
        poll_ms=CONFIG.poll_ms,
        stagger_ms=CONFIG.stagger_ms,
        max_drift_ppm=CONFIG.max_drift_ppm,
        margin_ms=CONFIG.margin_ms,
        clock_bound_ms=CONFIG.clock_bound_ms,
        mutants=frozenset({"no-self-fence"}),
    )


def test_the_checker_catches_a_node_that_does_not_fence_itself() -> None:
    # Random draws find it within a few dozen examples; the fixed draw of the ci profile
    # once needed more than 300 when other test modules ran first in the same process (what
    # of Hypothesis's state carries over was not found), so the bound is generous: the search
    # stops at the first violation anyway.
    with pytest.raises(AssertionError, match="acts under epoch"):
        run_state_machine_as_test(
            NoSelfFenceMachine,
            settings=settings(
                SETTINGS, max_examples=2_000, phases=[Phase.generate], print_blob=False
            ),
        )


# ---------------------------------------------------------------- unit tests


def drive_to_active(lease: ShardLease, mono: int = 0) -> tuple[int, int]:
    (read,) = lease.want_ownership(mono)
    assert isinstance(read, ReadShard)
    assert lease.on_response(ShardView(read.req, SHARD, None, 4, T0), mono, T0) == []
    (acquire,) = lease.tick(mono + lease.rank * lease.config.stagger_ms)
    assert isinstance(acquire, Acquire) and acquire.expected_epoch == 4
    effects = lease.on_response(Granted(acquire.req, SHARD, 5, 77, T0), mono + 10, T0 + 10)
    assert effects == [StartActing(SHARD, 5)]
    return acquire.req, mono


def test_safe_time_counts_drift_and_margin() -> None:
    assert LeaseConfig(ttl_ms=10_000, max_drift_ppm=1_000, margin_ms=500).safe_ms == 9_490
    with pytest.raises(EngineUsageError):
        LeaseConfig(ttl_ms=2_000, renew_every_ms=2_000)
    with pytest.raises(EngineUsageError):
        LeaseConfig(mutants=frozenset({"no-epoch-fence"}))  # that one is the fence's


def test_deadline_runs_from_the_first_copy_of_the_acquire() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    (read,) = lease.want_ownership(0)
    lease.on_response(ShardView(read.req, SHARD, None, 0, T0), 5, T0 + 5)
    (first,) = lease.tick(5)
    (second,) = lease.tick(5 + CONFIG.retry_ms)  # no answer: resend, same nonce
    assert isinstance(first, Acquire) and isinstance(second, Acquire)
    assert second.nonce == first.nonce and second.req != first.req
    lease.on_response(Granted(second.req, SHARD, 1, 9, T0 + 500), 600, T0 + 600)
    assert lease.deadline == 5 + CONFIG.safe_ms
    assert lease.may_act(5 + CONFIG.safe_ms - 1)
    assert not lease.may_act(5 + CONFIG.safe_ms)


def test_renewal_extends_from_its_send_time_and_fences_at_the_deadline() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    drive_to_active(lease)
    (renew,) = lease.tick(CONFIG.renew_every_ms)
    assert isinstance(renew, Renew) and renew.lease_id == 77
    lease.on_response(Renewed(renew.req, SHARD, 77, T0 + 1_100), 1_200, T0 + 1_200)
    assert lease.deadline == CONFIG.renew_every_ms + CONFIG.safe_ms
    # No more answers: resends, then stops at the deadline and revokes.
    effects: list[LeaseEffect] = []
    for mono in [*range(1_200, lease.deadline, 100), lease.deadline]:
        effects += lease.tick(mono)
    assert StopActing(SHARD, 5, "lease may have expired") in effects
    assert any(isinstance(e, Revoke) and e.lease_id == 77 for e in effects)
    assert not lease.may_act(lease.deadline)


def test_an_answered_renew_supersedes_a_lost_one() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    drive_to_active(lease)
    (lost,) = lease.tick(CONFIG.renew_every_ms)
    (again,) = lease.tick(CONFIG.renew_every_ms + CONFIG.retry_ms)
    assert isinstance(lost, Renew) and isinstance(again, Renew) and again.req != lost.req
    lease.on_response(Renewed(again.req, SHARD, 77, T0 + 1_400), 1_410, T0 + 1_410)
    # Nothing is in flight any more: no resend, and the next wakeup is the next renewal.
    assert lease.tick(1_410 + CONFIG.retry_ms) == []
    assert lease.next_wakeup_mono() == 2 * CONFIG.renew_every_ms + CONFIG.retry_ms
    lease._check()


def test_no_self_fence_mutant_keeps_acting() -> None:
    config = NoSelfFenceMachine.config
    lease = ShardLease(node="a", shard=SHARD, config=config)
    drive_to_active(lease)
    assert lease.may_act(10**9)
    effects = lease.tick(10**9)
    assert not any(isinstance(e, StopActing) for e in effects)
    # An explicit answer still stops it.
    (renew,) = [e for e in effects if isinstance(e, Renew)]
    stop = lease.on_response(LeaseGone(renew.req, SHARD, 77, T0 + 10**9), 10**9 + 2, T0 + 10**9)
    assert isinstance(stop[0], StopActing) and not lease.may_act(10**9 + 3)


def test_a_wall_clock_off_by_more_than_the_bound_stops_and_refuses() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    drive_to_active(lease)
    (renew,) = lease.tick(CONFIG.renew_every_ms)
    effects = lease.on_response(Renewed(renew.req, SHARD, 77, T0), 1_010, T0 + 1_010 + 2_000)
    assert isinstance(effects[0], StopActing) and "wall clock" in effects[0].reason
    assert not lease.clock_ok and not lease.may_act(1_011)
    # It reads again later; a free shard is not acquired while the clock disagrees.
    (read,) = [e for e in lease.tick(1_010 + CONFIG.poll_ms) if isinstance(e, ReadShard)]
    mono = 1_010 + CONFIG.poll_ms
    lease.on_response(ShardView(read.req, SHARD, None, 5, T0 + mono), mono, T0 + mono + 2_000)
    assert lease.state is LeaseState.IDLE
    # Once it agrees again, it acquires.
    (read,) = lease.tick(mono + CONFIG.poll_ms)
    mono += CONFIG.poll_ms
    assert isinstance(read, ReadShard)
    lease.on_response(ShardView(read.req, SHARD, None, 5, T0 + mono), mono, T0 + mono)
    assert lease.state is LeaseState.WAITING


def test_a_grant_that_cannot_be_used_is_handed_back_without_acting() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    (read,) = lease.want_ownership(0)
    lease.on_response(ShardView(read.req, SHARD, None, 0, T0), 0, T0)
    (acquire,) = lease.tick(0)
    assert lease.give_up(1) == []  # the answer decides
    effects = lease.on_response(Granted(acquire.req, SHARD, 1, 3, T0), 2, T0 + 2)
    assert effects == [Revoke(effects[0].req, SHARD, 3)] and isinstance(effects[0], Revoke)
    assert lease.state is LeaseState.IDLE


def test_too_late_a_grant_is_handed_back() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    (read,) = lease.want_ownership(0)
    lease.on_response(ShardView(read.req, SHARD, None, 0, T0), 0, T0)
    (acquire,) = lease.tick(0)
    late = CONFIG.safe_ms
    effects = lease.on_response(Granted(acquire.req, SHARD, 1, 3, T0 + 1), late, T0 + late)
    assert [type(e) for e in effects] == [Revoke]


def test_denied_and_stale_answers() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    (read,) = lease.want_ownership(0)
    assert lease.on_response(ShardView(read.req + 100, SHARD, None, 0, T0), 0, T0) == []
    assert lease.state is LeaseState.READING  # not an answer to anything we asked
    lease.on_response(ShardView(read.req, SHARD, None, 0, T0), 0, T0)
    (acquire,) = lease.tick(0)
    lease.on_response(Denied(acquire.req, SHARD, "b", 1, T0), 1, T0 + 1)
    assert lease.state is LeaseState.IDLE and lease.epoch == 1
    with pytest.raises(EngineUsageError):
        lease.on_response(ShardView(0, SHARD + 1, None, 0, T0), 1, T0)


def test_a_newer_epoch_seen_while_active_stops_at_once() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    drive_to_active(lease)
    effects = lease.on_response(ShardView(0, SHARD, "b", 6, T0), 20, T0 + 20)
    assert isinstance(effects[0], StopActing) and not lease.may_act(21)


def test_store_refusal_stops_acting() -> None:
    lease = ShardLease(node="a", shard=SHARD, config=CONFIG)
    drive_to_active(lease)
    effects = lease.store_refused(30)
    assert isinstance(effects[0], StopActing) and not lease.may_act(31)


def test_epoch_fence() -> None:
    fence = EpochFence()
    assert fence.accepts(3, 3) and fence.accepts(3, 4) and not fence.accepts(3, 2)
    assert fence.open(3, 4) == 4
    with pytest.raises(StaleEpoch):
        fence.open(4, 4)
    assert EpochFence(frozenset({"no-epoch-fence"})).accepts(3, 2)
    with pytest.raises(EngineUsageError):
        EpochFence(frozenset({"no-self-fence"}))


def test_clock_disagreement_is_an_upper_bound() -> None:
    # Coordinator said 1000 while we were between 990 (send) and 1010 (receive).
    assert clock_disagreement(0, 20, 1_010, 1_000) == 10
    assert clock_disagreement(0, 20, 3_010, 1_000) == 2_010
    assert clock_disagreement(0, 0, 1_000, 1_000) == 0


def test_routing_is_stable_and_spread() -> None:
    assert shard_of("job-1", 8) == shard_of("job-1", 8)
    counts = [0] * 8
    for i in range(8_000):
        counts[shard_of(f"job-{i}", 8)] += 1
    assert min(counts) > 850 and max(counts) < 1_150
    order = preference(2, ["a", "b", "c"])
    assert sorted(order) == ["a", "b", "c"]
    assert preference(2, ["c", "b", "a"]) == order
    # Removing a node keeps the others' relative order (rendezvous hashing).
    assert preference(2, [n for n in order if n != order[0]]) == order[1:]
    with pytest.raises(EngineUsageError):
        shard_of("x", 0)


@settings(max_examples=500, deadline=None)
@given(
    sent=st.integers(0, 2**40),
    lease=st.integers(1, 600_000),
    margin=st.integers(0, 10_000),
)
def test_the_guards_fence_comes_after_the_workers_and_before_the_nodes(
    sent: int, lease: int, margin: int
) -> None:
    """A worker that runs fences first (its tasks end as fenced, not as killed by its guard);
    the guard still kills them before the node can consider the worker gone."""
    own = worker_fence_at(sent, lease, margin)
    guard = guard_fence_at(sent, lease, margin)
    assert own <= guard
    if own < sent + lease:
        assert guard < sent + lease
    if sent + lease - own >= 2:
        assert own < guard
