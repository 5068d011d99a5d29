"""The records a shard persists: small msgpack-able dicts with a type and a format version.

Owns their shapes and the check that a record is one this version can read. The engine both
emits these records and rebuilds itself by applying them (live, and on recovery), so a record
holds everything recovery needs and nothing it does not. Must never touch storage: the store
(``wal/``) writes batches of them; it does not interpret them.

Shapes (every record also has ``"t"``: its type, ``"v"``: the format version):

* ``job``: ``key, id, ver, spec`` — a job's full normalized spec at version ``ver``.
* ``pos``: ``key, next, acct, paused, gone, why`` — where a job stands: its next fire time (None
  when exhausted), the fire time up to which every owed time is accounted for, paused,
  cancelled, and the reason late fires will be skipped for (``paused`` right after a resume
  whose missed times are still to fire), or ``asked``: the next fire time is a one-shot time
  already past that a create or update named, which runs however late.
* ``fire``: ``keys, ats, vers, next`` — parallel lists, one entry per on-time fire: job
  ``keys[i]`` fired at ``ats[i]``, creating its run PENDING at attempt 1 for version
  ``vers[i]``, and its next fire time is now ``next[i]``. Exactly what a ``run`` record and a
  ``pos`` record per fire would say, at a fraction of the bytes; :func:`expand` gives those.
* ``run``: ``key, at, state, att, tok, w, ver, due, fail, tmo, src, exit, why`` — one run of job
  ``key`` scheduled at ``at``: its state, attempt, fencing token, worker, pinned job version,
  the time a PENDING retry becomes ready, its failure and timeout counts, the source run of a
  triggered run, the last exit code and a reason; ``dp`` (absent: 0) the chain depth of a
  triggered run (``EngineConfig.max_chain_depth``); ``end`` (final states; absent from
  records before it) the engine time it ended, which retention by age counts from.
* ``skip``: ``key, lo, hi, n, why`` — ``n`` fire times in ``[lo, hi]`` not run, and why.
* ``note``: ``key, at, tok, what, exit`` — a report that did not count (a superseded attempt's),
  kept in the run's history.
* ``out`` / ``outdone``: ``seq, job, src`` — a cross-shard trigger in the outbox (``dp``,
  absent: 0, the source run's chain depth), and its delivery; with ``dep`` set (``{"up", "on"}``) instead a registration of ``job`` as a
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
    {"job", "pos", "fire", "run", "skip", "note", "out", "outdone", "dep", "epoch"}
)

#: ``acct`` of a ``pos`` record for a job with no fire time left: every time is accounted for.
ACCT_EXHAUSTED: Final = 2**62


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


def expand(record: Record) -> list[Record]:
    """``record`` in canonical records: a ``fire`` record becomes, per fire, the ``run`` record
    of the new PENDING run and the ``pos`` record of its job; any other record is itself.

    For readers that index runs one by one (the store's run history, tests' checkers).
    """
    if record["t"] != "fire":
        return [record]
    out: list[Record] = []
    epoch = record.get("e")
    for key, at, ver, nxt in zip(
        record["keys"], record["ats"], record["vers"], record["next"], strict=True
    ):
        run = make(
            "run",
            key=key,
            at=at,
            state="PENDING",
            att=1,
            tok=0,
            w=None,
            ver=ver,
            due=None,
            fail=0,
            tmo=0,
            src=None,
            exit=None,
            why=None,
        )
        pos = make(
            "pos",
            key=key,
            next=nxt,
            acct=ACCT_EXHAUSTED if nxt is None else nxt - 1,
            paused=False,
            gone=False,
            why="catchup",
        )
        if epoch is not None:
            run["e"] = pos["e"] = epoch
        out += (run, pos)
    return out
