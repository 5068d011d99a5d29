"""SnapshotCadence: when a shard owner stores its next snapshot (engine/snapshot.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.snapshot import SnapshotCadence

cadences = st.builds(
    SnapshotCadence,
    replay_budget_ms=st.integers(0, 10_000),
    min_records=st.integers(0, 100_000),
    cost_factor=st.integers(1, 100),
    replay_us_per_record=st.floats(0.1, 1_000),
    loop_factor=st.integers(1, 1_000),
)


@given(
    cadences,
    st.integers(0, 10**7),
    st.floats(0, 10**6),
    st.floats(0, 10**4),
    st.floats(0, 10**3),
)
def test_due_is_the_four_conditions_together(
    cadence: SnapshotCadence, tail: int, since_ms: float, cost_ms: float, export_ms: float
) -> None:
    model = (
        tail >= cadence.min_records
        and tail * cadence.replay_us_per_record / 1_000 >= cadence.replay_budget_ms
        and since_ms >= cadence.cost_factor * cost_ms
        and since_ms >= cadence.loop_factor * export_ms
    )
    assert cadence.due(tail, since_ms, cost_ms, export_ms) == model


@given(cadences, st.integers(0, 10**7), st.floats(0, 10**4))
def test_a_longer_tail_is_never_less_due(
    cadence: SnapshotCadence, tail: int, cost_ms: float
) -> None:
    since = cadence.cost_factor * cost_ms
    if cadence.due(tail, since, cost_ms):
        assert cadence.due(tail + 1, since, cost_ms)


def test_the_default_replays_at_most_about_a_second_of_tail() -> None:
    cadence = SnapshotCadence()  # 100 us a record until measured
    assert not cadence.due(9_999, 60_000, 0)
    assert cadence.due(10_000, 60_000, 0)
    # a node that measured a slow replay snapshots sooner, a fast one later
    slow = cadence.measured(2_000, 1_000)  # 500 us a record
    assert slow.due(2_000 * 1, 60_000, 0) is False  # under min_records
    assert slow.due(5_000, 60_000, 0)
    fast = cadence.measured(100_000, 1_000)  # 10 us a record
    assert not fast.due(50_000, 60_000, 0) and fast.due(100_000, 60_000, 0)


def test_a_costly_snapshot_is_not_repeated_back_to_back() -> None:
    cadence = SnapshotCadence(cost_factor=10, loop_factor=200)
    assert not cadence.due(1_000_000, 19_999, 2_000)  # the last one took 2 s: wait 20 s
    assert cadence.due(1_000_000, 20_000, 2_000)
    # 10 million pending: export 130 ms on the event loop, 780 ms in all: every 26 s at most
    assert not cadence.due(1_000_000, 25_999, 780, 130)
    assert cadence.due(1_000_000, 26_000, 780, 130)
    assert cadence.measured(5_000, 1_000).loop_factor == 200  # measuring keeps the rest


def test_a_short_tail_measures_nothing() -> None:
    cadence = SnapshotCadence()
    assert cadence.measured(999, 5_000) is cadence
    assert cadence.measured(5_000, 0) is cadence
    assert cadence.measured(5_000, 500).replay_us_per_record == 100.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cost_factor": 0},
        {"loop_factor": 0},
        {"replay_us_per_record": 0},
        {"replay_us_per_record": float("nan")},
        {"replay_budget_ms": -1},
        {"min_records": -1},
    ],
)
def test_bad_cadences_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SnapshotCadence(**kwargs)  # type: ignore[arg-type]
