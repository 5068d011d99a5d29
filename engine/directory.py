"""Where a shard engine looks up what it does not keep in memory: job ids and job specs.

The engine holds per-job columns (version, profile, flags, next fire time) for tens of millions
of jobs; the id string, the task, the payload and the labels stay in the store (DESIGN.md,
"Memory budget"). A :class:`JobDirectory` is the read side of that store as far as the engine
needs it: the key of an id, and the latest *durable* spec of a key. Jobs whose records are not
durable yet are the engine's own business (it keeps them until they are).

Must never be asked for anything the engine decides on the hot path of firing: lookups happen
on commands that name a job, on claims (to fill a run ticket: :meth:`JobDirectory.ticket_fields`)
and on reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from engine.records import Record


class JobDirectory(Protocol):
    """Read access to a shard's durable jobs. Implementations: :class:`MemoryDirectory` (tests,
    simulation) and the RocksDB store (``wal/``)."""

    def key_of(self, job_id: str) -> int | None:
        """The dense key of ``job_id`` in this shard, or None when no durable record names it."""
        ...

    def keys_of(self, job_ids: list[str]) -> list[int | None]:
        """:meth:`key_of` of each of ``job_ids``, in order: one call for a bulk create's
        chunk, which a store answers with one multi-get instead of a lookup a job."""
        ...

    def latest(self, key: int) -> tuple[int, Mapping[str, Any]] | None:
        """``(version, spec dict)`` of the newest durable ``job`` record of ``key``, or None."""
        ...

    def ticket_fields(self, key: int) -> tuple[int, str, Any] | None:
        """``(version, spec["id"], spec["task"])`` of what :meth:`latest` would return, or
        None: all a claim's ticket needs of the spec. Every claim asks it, so a store may
        answer it without decoding the rest of the spec (policy, schedule, labels)."""
        ...

    def has_run(self, key: int, at: int) -> bool:
        """Whether a durable record says the run of ``key`` scheduled at ``at`` went out
        (was claimed at least once; a run that only fired, and was cancelled or skipped
        before any worker had it, did not), and retention has not deleted it (the RocksDB
        store's retention always keeps each job's newest run, so a one-shot's own run stays;
        only a time older than the key's newest run may be forgotten). Asked only when a create
        replaces a job (or reuses a cancelled id) with a one-shot time already past."""
        ...


class MemoryDirectory:
    """A :class:`JobDirectory` kept in memory, fed with durable records in log order.

    What a store would answer after those records were committed. O(1) per lookup; memory is
    one dict entry per job, which is fine for tests and the simulation and is exactly what the
    engine must not hold itself at scale.
    """

    __slots__ = ("_ids", "_runs", "_specs")

    def __init__(self, records: Iterable[Record] = ()) -> None:
        self._ids: dict[str, int] = {}
        self._specs: dict[int, tuple[int, Mapping[str, Any]]] = {}
        self._runs: set[tuple[int, int]] = set()
        self.absorb(records)

    def absorb(self, records: Iterable[Record]) -> None:
        """Take in durable records (``job`` records, and ``run`` records of runs that went
        out)."""
        for r in records:
            kind = r["t"]
            if kind == "job":
                self._ids[r["id"]] = r["key"]
                self._specs[r["key"]] = (r["ver"], r["spec"])
            elif kind == "run" and (r.get("tok") or r.get("att", 1) > 1):
                self._runs.add((r["key"], r["at"]))  # (fires are PENDING: never out yet)

    def key_of(self, job_id: str) -> int | None:
        return self._ids.get(job_id)

    def keys_of(self, job_ids: list[str]) -> list[int | None]:
        ids = self._ids
        return [ids.get(job_id) for job_id in job_ids]

    def latest(self, key: int) -> tuple[int, Mapping[str, Any]] | None:
        return self._specs.get(key)

    def ticket_fields(self, key: int) -> tuple[int, str, Any] | None:
        found = self._specs.get(key)
        if found is None:
            return None
        version, spec = found
        return version, spec["id"], spec["task"]

    def has_run(self, key: int, at: int) -> bool:
        return (key, at) in self._runs

    def __len__(self) -> int:
        return len(self._specs)
