"""Shard routing is stable and spreads ids evenly."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.errors import EngineUsageError
from engine.routing import shard_of, shard_of_run


def test_routing_is_stable_across_processes_and_spreads_evenly() -> None:
    # Fixed values: a change here would move every stored job to another shard.
    assert [shard_of(f"job-{i}", 8) for i in range(6)] == [0, 3, 6, 0, 3, 0]
    counts = Counter(shard_of(f"01J{i:08d}", 4) for i in range(40_000))
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) < 1.05 * min(counts.values())
    assert shard_of_run("job-3@1767225600000", 8) == shard_of("job-3", 8)


def test_bad_counts_and_run_ids_are_typed_errors() -> None:
    with pytest.raises(EngineUsageError):
        shard_of("x", 0)
    with pytest.raises(EngineUsageError):
        shard_of_run("no-at-sign", 4)
