"""The timing wheel against a plain reference model: a dict of key -> due, sorted on advance."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.errors import InvalidDue, InvalidKey, TimeWentBackwards
from engine.wheel import MAX_KEY, NOT_PENDING, TimingWheel

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


class Reference:
    """What the wheel promises, written the obvious way."""

    def __init__(self, now_ms: int) -> None:
        self.now = now_ms
        self.due: dict[int, int] = {}

    def schedule(self, key: int, due: int) -> None:
        self.due[key] = due

    def cancel(self, key: int) -> bool:
        return self.due.pop(key, None) is not None

    def advance(self, now_ms: int, limit: int | None = None) -> list[tuple[int, int]]:
        self.now = now_ms
        fired = sorted((d, k) for k, d in self.due.items() if d <= now_ms)[:limit]
        for _d, k in fired:
            del self.due[k]
        return fired


# Offsets that reach every level: the past, the current tick, each level boundary, and years.
offsets = st.one_of(
    st.integers(-10_000, 10_000),
    st.sampled_from([0, 1, 255, 256, 257, 65_535, 65_536, 65_537, 2**24, 2**24 + 1]),
    st.integers(0, 2**40),
    st.integers(-(2**40), 0),
)
time_steps = st.one_of(
    st.just(0),
    st.integers(1, 300),
    st.integers(300, 100_000),
    st.integers(100_000, 2**36),  # huge jumps: years at once
)
keys = st.integers(0, 60)


class WheelMachine(RuleBasedStateMachine):
    @initialize(
        start=st.integers(0, 2**42),
        tick=st.sampled_from([1, 1, 1, 10, 1000]),
        bits=st.sampled_from([4, 6, 8]),
    )
    def setup(self, start: int, tick: int, bits: int) -> None:
        self.wheel = TimingWheel(start, tick_ms=tick, slot_bits=bits)
        self.model = Reference(start)
        self.tick, self.bits = tick, bits

    def boundary(self, level: int, slots_ahead: int, delta: int) -> int:
        """A time next to the edge of a slot of ``level``: where off-by-ones live."""
        width = self.tick << (self.bits * level)
        return (self.model.now // width + slots_ahead) * width + delta

    @rule(key=keys, offset=offsets)
    def schedule(self, key: int, offset: int) -> None:
        due = self.model.now + offset
        self.wheel.schedule(key, due)
        self.model.schedule(key, due)

    @rule(key=keys, offset=st.sampled_from([0, 1, 256]))
    def schedule_equal_dues(self, key: int, offset: int) -> None:
        # Several keys on one due: fired in key order.
        due = self.model.now + offset
        for k in (key, (key + 7) % 61, (key + 13) % 61):
            self.wheel.schedule(k, due)
            self.model.schedule(k, due)

    @rule(
        pairs=st.lists(st.tuples(st.integers(0, 200), offsets), min_size=1, max_size=120),
    )
    def schedule_many(self, pairs: list[tuple[int, int]]) -> None:
        ks = np.array([k for k, _o in pairs], dtype=np.int64)
        ds = np.array([self.model.now + o for _k, o in pairs], dtype=np.int64)
        self.wheel.schedule_many(ks, ds)
        for k, d in zip(ks.tolist(), ds.tolist(), strict=True):
            self.model.schedule(k, d)

    @rule(
        key=keys,
        level=st.integers(0, 4),
        ahead=st.integers(0, 3),
        delta=st.sampled_from([-1, 0, 1]),
    )
    def schedule_at_slot_edge(self, key: int, level: int, ahead: int, delta: int) -> None:
        due = self.boundary(level, ahead, delta)
        self.wheel.schedule(key, due)
        self.model.schedule(key, due)

    @rule(level=st.integers(0, 4), ahead=st.integers(1, 3), delta=st.sampled_from([-2, -1, 0]))
    def advance_to_slot_edge(self, level: int, ahead: int, delta: int) -> None:
        now = max(self.model.now, self.boundary(level, ahead, delta))
        assert self.wheel.advance(now) == self.model.advance(now)

    @rule(key=st.integers(0, 250))
    def cancel(self, key: int) -> None:
        assert self.wheel.cancel(key) == self.model.cancel(key)

    @rule(step=time_steps)
    def advance(self, step: int) -> None:
        now = self.model.now + step
        assert self.wheel.advance(now) == self.model.advance(now)

    @rule(step=time_steps, limit=st.integers(0, 40))
    def advance_limited(self, step: int, limit: int) -> None:
        # A consumer that can take only `limit` entries: the rest stay due, earliest first.
        now = self.model.now + step
        assert self.wheel.advance(now, limit=limit) == self.model.advance(now, limit)

    @precondition(lambda self: self.model.now > 0)
    @rule(back=st.integers(1, 10_000))
    def time_never_goes_backwards(self, back: int) -> None:
        with pytest.raises(TimeWentBackwards):
            self.wheel.advance(self.model.now - back)

    @rule()
    def advance_to_next_due(self) -> None:
        nd = self.wheel.next_due()
        if nd is not None:
            now = max(nd, self.model.now)
            assert self.wheel.advance(now) == self.model.advance(now)

    @invariant()
    def agrees_with_model(self) -> None:
        assert len(self.wheel) == len(self.model.due)
        nd = self.wheel.next_due()
        if self.model.due:
            assert nd is not None
            assert nd <= min(self.model.due.values())
            if self.wheel._len + self.wheel._stale <= 48:  # every slot is small: exact
                assert nd == min(self.model.due.values())
            assert self.wheel.next_due() == nd  # asking again changes nothing
        else:
            assert nd is None
        self.wheel._check()


TestWheelMachine = WheelMachine.TestCase
TestWheelMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_stress_checks_invariants_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    now = rng.randrange(0, 2**41)
    wheel = TimingWheel(now, tick_ms=rng.choice([1, 1, 13]), slot_bits=rng.choice([4, 6, 8]))
    model = Reference(now)
    for _step in range(150):
        op = rng.random()
        if op < 0.3:
            n = rng.randrange(1, 4000)
            ks = nrng.integers(0, 6000, n)
            spread = rng.choice([10, 1000, 10**6, 10**10])
            ds = model.now + nrng.integers(-spread // 10, spread, n)
            wheel.schedule_many(ks, ds)
            for k, d in zip(ks.tolist(), ds.tolist(), strict=True):
                model.schedule(k, d)
        elif op < 0.5:
            for _ in range(rng.randrange(1, 300)):
                k, d = rng.randrange(6000), model.now + rng.randrange(-1000, 10**8)
                wheel.schedule(k, d)
                model.schedule(k, d)
        elif op < 0.6:
            for k in nrng.integers(0, 6000, 500).tolist():
                assert wheel.cancel(k) == model.cancel(k)
        else:
            now = model.now + rng.choice([0, 1, rng.randrange(100), 10**5, rng.randrange(10**9)])
            limit = rng.choice([None, None, 0, 7, 500, 3000])
            assert wheel.advance(now, limit=limit) == model.advance(now, limit)
        assert len(wheel) == len(model.due)
        wheel._check()


def test_compaction_bounds_stale_entries_under_churn() -> None:
    wheel = TimingWheel(T0)
    for round_ in range(40):
        # Re-schedule the same 5,000 keys far ahead, again and again: every round leaves
        # 5,000 stale entries behind that no advance would visit for a year.
        wheel.schedule_many(np.arange(5000), np.full(5000, T0 + 10**10 + round_))
        wheel._check()
    assert len(wheel) == 5000
    assert wheel.nbytes() < 5000 * 16 + 400_000


def test_fires_in_due_then_key_order_with_equal_dues() -> None:
    wheel = TimingWheel(T0)
    for key in (5, 3, 9, 1):
        wheel.schedule(key, T0 + 500)
    wheel.schedule(7, T0 + 499)
    assert wheel.advance(T0 + 500) == [
        (T0 + 499, 7),
        (T0 + 500, 1),
        (T0 + 500, 3),
        (T0 + 500, 5),
        (T0 + 500, 9),
    ]


def test_replace_moves_the_due_and_past_dues_fire_next() -> None:
    wheel = TimingWheel(T0)
    wheel.schedule(1, T0 + 10_000)
    wheel.schedule(1, T0 - 5)  # replaced with a past due: fires on the next advance
    assert len(wheel) == 1
    assert wheel.next_due() == T0 - 5
    assert wheel.advance(T0) == [(T0 - 5, 1)]
    assert wheel.advance(T0 + 20_000) == []


def test_years_ahead_and_next_due_skips_empty_slots() -> None:
    wheel = TimingWheel(T0)
    far = T0 + 3 * 365 * 86_400_000 + 123
    wheel.schedule(42, far)
    nd = wheel.next_due()
    assert nd is not None and nd <= far
    steps = 0
    while (nd := wheel.next_due()) is not None and nd < far:
        assert wheel.advance(nd) == []
        steps += 1
    # One wake-up per level on the way down, not one per slot.
    assert steps <= 8
    assert wheel.advance(far) == [(far, 42)]


def test_cancel_reports_whether_pending() -> None:
    wheel = TimingWheel(T0)
    assert wheel.cancel(3) is False
    wheel.schedule(3, T0 + 1)
    assert 3 in wheel and wheel.due_of(3) == T0 + 1
    assert wheel.cancel(3) is True
    assert wheel.cancel(3) is False
    assert wheel.advance(T0 + 10) == []


def test_tick_coarser_than_a_millisecond_still_fires_exactly() -> None:
    wheel = TimingWheel(T0, tick_ms=1000)
    wheel.schedule(1, T0 + 1500)
    wheel.schedule(2, T0 + 1200)
    assert wheel.advance(T0 + 1300) == [(T0 + 1200, 2)]
    assert wheel.advance(T0 + 1499) == []
    assert wheel.advance(T0 + 1500) == [(T0 + 1500, 1)]


def test_numpy_scalars_are_accepted_as_ints() -> None:
    wheel = TimingWheel(T0)
    wheel.schedule(np.int64(4), np.int64(T0 + 3))
    assert wheel.advance(T0 + 3) == [(T0 + 3, 4)]


@pytest.mark.parametrize(
    ("key", "due", "error", "field"),
    [
        (-1, T0, InvalidKey, "key"),
        (MAX_KEY + 1, T0, InvalidKey, "key"),
        (1.5, T0, InvalidKey, "key"),
        ("3", T0, InvalidKey, "key"),
        (1, float(T0), InvalidDue, "due_ms"),
        (1, NOT_PENDING, InvalidDue, "due"),
        (1, 2**70, InvalidDue, "due"),
    ],
)
def test_bad_input_is_a_typed_error_and_changes_nothing(
    key: object, due: object, error: type[Exception], field: str
) -> None:
    wheel = TimingWheel(T0)
    wheel.schedule(1, T0 + 5)
    with pytest.raises(error) as info:
        wheel.schedule(key, due)  # type: ignore[arg-type]
    assert info.value.field == field  # type: ignore[attr-defined]
    assert len(wheel) == 1 and wheel.due_of(1) == T0 + 5
    wheel._check()


def test_schedule_many_validates_the_whole_batch_first() -> None:
    wheel = TimingWheel(T0)
    with pytest.raises(InvalidKey):
        wheel.schedule_many(np.array([1, -2]), np.array([T0, T0]))
    with pytest.raises(InvalidKey):
        wheel.schedule_many(np.array([1, 2]), np.array([T0]))
    with pytest.raises(InvalidDue):
        wheel.schedule_many(np.array([1, 2]), np.array([1.0, 2.0]))
    with pytest.raises(InvalidDue):
        wheel.schedule_many(np.array([1, 2]), np.array([T0, NOT_PENDING]))
    assert len(wheel) == 0
    wheel._check()


def test_schedule_many_last_occurrence_wins() -> None:
    wheel = TimingWheel(T0)
    wheel.schedule_many(np.array([5, 2, 5]), np.array([T0 + 9, T0 + 4, T0 + 1]))
    assert len(wheel) == 2
    assert wheel.advance(T0 + 10) == [(T0 + 1, 5), (T0 + 4, 2)]


def test_advance_backwards_is_refused_and_harmless() -> None:
    wheel = TimingWheel(T0)
    wheel.schedule(1, T0 + 100)
    wheel.advance(T0 + 50)
    with pytest.raises(TimeWentBackwards):
        wheel.advance(T0 + 49)
    assert wheel.now_ms == T0 + 50
    assert wheel.advance(T0 + 100) == [(T0 + 100, 1)]


def test_constructor_validates_options() -> None:
    with pytest.raises(InvalidDue):
        TimingWheel(-1)
    with pytest.raises(InvalidDue):
        TimingWheel(T0, tick_ms=0)
    with pytest.raises(InvalidDue):
        TimingWheel(T0, slot_bits=3)


@pytest.mark.parametrize("extra", [0, 58])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_key_moved_to_the_next_slots_first_ms_waits_for_it(level: int, extra: int) -> None:
    # A stale entry left in a slot must not fire the key at the slot's end when its new due is
    # the first millisecond of the following slot.
    wheel = TimingWheel(0, slot_bits=4)
    width = 16**level
    edge = 3 * width
    wheel.schedule(1, edge - 5)  # in the slot [2*width, 3*width) of `level`
    wheel.next_due()  # places what schedule() staged
    wheel.schedule(1, edge)  # now in the next slot; the old entry is stale
    for key in range(2, 2 + extra):  # enough entries to take the vectorised path as well
        wheel.schedule(key, edge - 1 - (key % 3))
    fired = wheel.advance(edge - 1)
    assert (edge, 1) not in fired and len(fired) == extra
    assert wheel.advance(edge) == [(edge, 1)]
    wheel._check()
