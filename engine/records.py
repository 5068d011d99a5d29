"""The records a shard persists: small msgpack-able dicts with a type and a format version.

Owns their shapes and the check that a record is one this version can read. The engine both
emits these records and rebuilds itself by applying them (live, and on recovery), so a record
holds everything recovery needs and nothing it does not. Must never touch storage: the store
(``wal/``) writes batches of them; it does not interpret them.

Shapes (every record also has ``"t"``: its type, ``"v"``: the format version):

* ``job``: ``key, id, ver, spec`` — a job's full normalized spec at version ``ver``.
* ``pos``: ``key, next, acct, paused, gone`` — where a job stands: its next fire time (None when
  exhausted), the fire time up to which every owed time is accounted for, paused, cancelled.
* ``run``: ``key, at, state, att, tok, w, ver, due, fail, tmo, src, exit, why`` — one run of job
  ``key`` scheduled at ``at``: its state, attempt, fencing token, worker, pinned job version,
  the time a PENDING retry becomes ready, its failure and timeout counts, the source run of a
  triggered run, the last exit code and a reason.
* ``skip``: ``key, lo, hi, n, why`` — ``n`` fire times in ``[lo, hi]`` not run, and why.
* ``note``: ``key, at, tok, what, exit`` — a report that did not count (a superseded attempt's),
  kept in the run's history.
* ``out`` / ``outdone``: ``seq, job, src`` — a cross-shard trigger in the outbox, and its
  delivery; with ``dep`` set (``{"up", "on"}``) instead a registration of ``job`` as a
  dependent of ``up`` (or its removal), sent to ``up``'s shard.
* ``dep``: ``up, down, on`` — on the upstream's shard: ``down`` runs after each success of
  ``up`` (or no longer does).
* ``epoch``: ``epoch`` — the shard was opened by a new owner or incarnation.
"""

from __future__ import annotations

from typing import Any, Final

from engine.errors import UnknownRecord

FORMAT_VERSION: Final = 1

Record = dict[str, Any]

RECORD_TYPES: Final = frozenset(
    {"job", "pos", "run", "skip", "note", "out", "outdone", "dep", "epoch"}
)


def make(kind: str, **fields: Any) -> Record:
    """A record of ``kind`` with ``fields``, stamped with the format version."""
    record: Record = {"t": kind, "v": FORMAT_VERSION}
    record.update(fields)
    return record


def check(record: object) -> Record:
    """``record`` if this version can read it; :class:`UnknownRecord` otherwise."""
    if not isinstance(record, dict):
        raise UnknownRecord(f"a record must be a map, got {type(record).__name__}")
    kind, version = record.get("t"), record.get("v")
    if kind not in RECORD_TYPES:
        raise UnknownRecord(f"unknown record type {kind!r}")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise UnknownRecord(f"record format {version!r} is not readable (this is {FORMAT_VERSION})")
    return record
