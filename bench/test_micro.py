"""pytest-benchmark micro-benchmarks (``make bench``): the wheel's operations beside heapq and
SortedList, and cron next-fire times cached and uncached. Figures only, never assertions on
speed; the CLI suites (``tickwheel bench wheel|schedules``) print the ratios."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import pytest
from sortedcontainers import SortedList

from engine.schedules import clear_caches, parse_schedule
from engine.wheel import TimingWheel

NOW = 1_800_000_000_000
N = 100_000
rng = np.random.default_rng(7)
KEYS = rng.permutation(N).astype(np.int64)
DUES = NOW + rng.integers(1, 3_600_000, N, dtype=np.int64)
PAIRS = list(zip(KEYS.tolist(), DUES.tolist(), strict=True))


def _filled_wheel() -> tuple[tuple[TimingWheel], dict[str, Any]]:
    wheel = TimingWheel(NOW)
    wheel.schedule_many(KEYS, DUES)
    return (wheel,), {}


def _filled_heap() -> tuple[tuple[list[tuple[int, int]]], dict[str, Any]]:
    heap = [(d, k) for k, d in PAIRS]
    heapq.heapify(heap)
    return (heap,), {}


def test_wheel_schedule(benchmark: Any) -> None:
    def run(wheel: TimingWheel) -> None:
        schedule = wheel.schedule
        for k, d in PAIRS:
            schedule(k, d)
        wheel.next_due()

    benchmark.pedantic(run, setup=lambda: ((TimingWheel(NOW),), {}), rounds=5)


def test_heapq_push(benchmark: Any) -> None:
    def run(heap: list[tuple[int, int]]) -> None:
        push = heapq.heappush
        for k, d in PAIRS:
            push(heap, (d, k))

    benchmark.pedantic(run, setup=lambda: (([],), {}), rounds=5)


def test_wheel_schedule_many(benchmark: Any) -> None:
    benchmark.pedantic(
        lambda w: w.schedule_many(KEYS, DUES), setup=lambda: ((TimingWheel(NOW),), {}), rounds=5
    )


def test_wheel_fire_all_in_100_steps(benchmark: Any) -> None:
    def run(wheel: TimingWheel) -> None:
        for i in range(1, 101):
            wheel.advance(NOW + i * 36_000)

    benchmark.pedantic(run, setup=_filled_wheel, rounds=5)


def test_heapq_pop_all_in_100_steps(benchmark: Any) -> None:
    def run(heap: list[tuple[int, int]]) -> None:
        for i in range(1, 101):
            limit = NOW + i * 36_000
            while heap and heap[0][0] <= limit:
                heapq.heappop(heap)

    benchmark.pedantic(run, setup=_filled_heap, rounds=5)


def test_wheel_cancel_all(benchmark: Any) -> None:
    def run(wheel: TimingWheel) -> None:
        cancel = wheel.cancel
        for k, _d in PAIRS:
            cancel(k)

    benchmark.pedantic(run, setup=_filled_wheel, rounds=5)


def test_sortedlist_remove_all(benchmark: Any) -> None:
    def setup() -> tuple[tuple[SortedList], dict[str, Any]]:
        return (SortedList((d, k) for k, d in PAIRS),), {}

    def run(sl: SortedList) -> None:
        for k, d in PAIRS:
            sl.remove((d, k))

    benchmark.pedantic(run, setup=setup, rounds=3)


CRONS = [f"{m} {h} * * *" for m in range(0, 60, 7) for h in range(0, 24, 5)]


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_cron_next_fire(benchmark: Any, cached: bool) -> None:
    schedules = [parse_schedule({"cron": c, "tz": "Europe/Berlin"}) for c in CRONS] * 20

    def run() -> None:
        if cached:
            for s in schedules:
                s.next_after(NOW)
        else:
            for s in schedules[: len(CRONS)]:
                s.next_after_uncached(NOW)

    clear_caches()
    benchmark(run)
