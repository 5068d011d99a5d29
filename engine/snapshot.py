"""A shard engine's state in columns: what recovery loads in bulk instead of replaying a log.

Owns the shape shared by the engine (which exports and imports it) and the store (which writes
it as a few large values). Must never hold behaviour: what the arrays mean is
:mod:`engine.shard`'s business, how they are stored is ``wal``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt


@dataclass
class Snapshot:
    """``arrays``: named numpy columns (one element per job key, or per run); ``meta``: small
    msgpack-able values (profiles, runs in flight, outbox, counters)."""

    arrays: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


__all__ = ["Snapshot"]
