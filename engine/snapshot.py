"""A shard engine's state in columns: what recovery loads in bulk instead of replaying a log.

Owns the shape shared by the engine (which exports and imports it) and the store (which writes
it as a few large values), and the rule for when an owner stores the next one
(:class:`SnapshotCadence`). Must never hold behaviour beyond that: what the arrays mean is
:mod:`engine.shard`'s business, how they are stored is ``wal``'s.
"""

from __future__ import annotations

import dataclasses
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


@dataclass
class SnapshotCadence:
    """When a shard owner stores its next snapshot: once replaying the log tail written since
    the last one would take longer than ``replay_budget_ms``, at most as often as keeps the
    time spent snapshotting under ``1 / cost_factor`` of the time.

    Why by replay time and not by a record count: after a crash the shard serves nothing,
    hellos and heartbeats included, until its tail is replayed, and workers fence themselves
    (killing healthy tasks: at-most-once runs become LOST, at-least-once ones run again) once
    no heartbeat was acknowledged for their lease less a margin, 8 s by default. A fixed count
    of 500,000 records meant up to a minute of replay per shard (found by the fifth adversarial
    pass: 100,000 jobs took 15 s to come back after a SIGKILL, against 3 s after a clean stop).
    The cost bounds keep a shard with millions of pending jobs from snapshotting back to back:
    the whole snapshot (export and write) takes at most ``1 / cost_factor`` of the time, and
    its export, which holds the event loop (every shard of the node, and their lateness),
    at most ``1 / loop_factor`` (at 10 million pending jobs an export takes ~130 ms and the
    write ~650 ms: a snapshot every 26 s at most). Its replay budget is then exceeded, by
    the tail written in that time.

    ``replay_us_per_record`` is an estimate, replaced by what the owner measured when it
    recovered a tail of at least ``MEASURE_MIN_RECORDS`` (:meth:`measured`).
    """

    replay_budget_ms: int = 1_000
    #: never a snapshot for fewer records than this: a tiny tail replays in no time anyway
    min_records: int = 5_000
    cost_factor: int = 10
    replay_us_per_record: float = 100.0
    loop_factor: int = 200

    MEASURE_MIN_RECORDS = 1_000

    def __post_init__(self) -> None:
        if self.replay_budget_ms < 0 or self.min_records < 0:
            raise ValueError("replay_budget_ms and min_records must be >= 0")
        if self.cost_factor < 1 or self.loop_factor < 1:
            raise ValueError(
                f"cost_factor and loop_factor must be >= 1, got {self.cost_factor}, "
                f"{self.loop_factor}"
            )
        if not self.replay_us_per_record > 0:
            raise ValueError(f"replay_us_per_record must be > 0, got {self.replay_us_per_record}")

    def due(
        self,
        tail_records: int,
        since_last_ms: float,
        last_cost_ms: float,
        last_export_ms: float = 0.0,
    ) -> bool:
        """Whether to store a snapshot now, with ``tail_records`` logged since the last one,
        ``since_last_ms`` since the last one ended (or since the shard opened),
        ``last_cost_ms`` what the last one took, export and write, and ``last_export_ms``
        its export alone (both 0 before the first)."""
        if tail_records < self.min_records:
            return False
        if tail_records * self.replay_us_per_record < self.replay_budget_ms * 1_000:
            return False
        return since_last_ms >= max(
            self.cost_factor * last_cost_ms, self.loop_factor * last_export_ms
        )

    def measured(self, records: int, replay_ms: float) -> SnapshotCadence:
        """This cadence with the replay cost of a recovery that replayed ``records`` in
        ``replay_ms``; unchanged for a tail too short to measure."""
        if records < self.MEASURE_MIN_RECORDS or replay_ms <= 0:
            return self
        return dataclasses.replace(self, replay_us_per_record=replay_ms * 1_000 / records)


__all__ = ["Snapshot", "SnapshotCadence"]
