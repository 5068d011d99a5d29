"""Bounded process-wide memos: the one eviction rule the engine's caches of pure functions share.

A memo is a plain dict that the caller reads with ``dict.get`` (the hit path stays one lookup,
no wrapper); on a miss the caller computes the value and hands it to :func:`remember`, which
empties the dict first when it holds ``limit`` entries. No LRU bookkeeping: the working sets
are small (a node meets few distinct durations, policies, schedules), and the bound only keeps
an unusual process from growing without end. Must never hold anything but values of pure
functions of their keys (shared by every engine of the process), and never an error.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memo: dict[K, V], key: K, value: V, limit: int) -> V:
    """Keep ``value`` under ``key`` in ``memo``, emptied first when it holds ``limit`` entries;
    returns ``value``. O(1), or O(limit) on the call that empties it."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


__all__ = ["remember"]
