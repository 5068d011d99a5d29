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


def test_run_ids_past_64_bit_times_are_refused() -> None:
    """19 digits reach past 2**63-1: such an id named no run, and reached the store's key
    codec as an untyped error (found by review)."""
    from engine.runs import parse_run_id

    assert parse_run_id(f"j@{(1 << 63) - 1}") == ("j", (1 << 63) - 1)
    for text in (f"j@{1 << 63}", "j@9999999999999999999"):
        with pytest.raises(EngineUsageError, match="past 2"):
            parse_run_id(text)


@pytest.mark.parametrize(
    "text", ["j@1\n", "j@1\r", " j@1", "j@1 ", "j@\u0661", "j@1@2", "@1", "j@"]
)
def test_a_run_id_is_matched_whole(text: str) -> None:
    """``$`` matched before a final newline: ``"j@1\\n"`` was taken for ``j@1`` by run.get,
    run.logs and worker reports (found by review)."""
    from engine.runs import parse_run_id

    with pytest.raises(EngineUsageError, match="not a run id"):
        parse_run_id(text)
