"""Routing: one engine batch checked and encoded into the store's write of it.

Owns the bytes a batch becomes (its log entry and the rows of the query families, as the
layout in :mod:`wal.store` gives them) and the count classes of the rows it writes. Pure CPU:
never touches the database, a lock or a clock, so that any thread may prepare a batch while
the writer writes another. Compiled with mypyc (``make native``) with the engine: every
create, fire and acknowledgement passes here once, and its lines were a third of the CPU of a
durable one-record batch interpreted.

Must never decide what a record means for the schedule (the engine does) and never drop a
record from the log entry: the query rows may skip what a later record of the same batch
overwrites, the log never does.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack

from engine.effects import Persist
from engine.records import ACCT_EXHAUSTED, FORMAT_VERSION, Record, check
from engine.runs import IN_FLIGHT_VALUES
from wal import codec
from wal.codec import i64
from wal.errors import InvalidBatch

# Column family numbers (indexes into wal.store.COLUMN_FAMILIES), used in prepared batches
# instead of names.
LOG, JOBS, INDEX, POS, RUNS, HISTORY, BYTIME, NRUNS, LOGS, SNAPSHOT, META = range(11)

# Count classes of a job's position and a run's state (the first byte of their stored value).
POS_NONE, POS_PENDING, POS_PAUSED, POS_IDLE = 0, 1, 2, 3
RUN_OTHER, RUN_PENDING, RUN_IN_FLIGHT = 0, 1, 2
POS_BYTES: Final = tuple(bytes((c,)) for c in range(4))
RUN_BYTES: Final = tuple(bytes((c,)) for c in range(3))
RUN_CLASS: Final = {"PENDING": RUN_PENDING, **{s: RUN_IN_FLIGHT for s in IN_FLIGHT_VALUES}}
EMPTY: Final = b""

_I64_PAIR: Final = struct.Struct(">QQ")  # a run's key: job key and time, as two codec.i64
_I64_OFFSET: Final = 1 << 63
_FIXARRAY: Final = tuple(bytes((0x90 | n,)) for n in range(16))

#: (column family, key, value) rows of one batch
Rows = list[tuple[int, bytes, bytes]]
Pack = Callable[[Any], bytes]


class PreparedBatch:
    """A batch checked and encoded, ready for :meth:`wal.store.ShardStore.write_prepared`.
    Built by :func:`route` in the caller's thread, so that a bad batch fails its own caller
    and the writer only copies bytes."""

    __slots__ = ("batch_id", "epoch", "log_value", "pos", "puts", "runs", "size")

    def __init__(
        self,
        batch_id: int,
        epoch: int,
        log_value: bytes,
        puts: Rows,
        pos: list[tuple[bytes, int]],
        runs: list[tuple[bytes, int, int, int]],
        size: int,
    ) -> None:
        self.batch_id = batch_id
        self.epoch = epoch
        self.log_value = log_value
        self.puts = puts  # (column family, key, value)
        self.pos = pos  # (pos key, class)
        self.runs = runs  # (run key, class, job key, scheduled ms)
        self.size = size

    def __repr__(self) -> str:
        return (
            f"PreparedBatch(batch_id={self.batch_id}, epoch={self.epoch}, "
            f"{len(self.puts)} rows, {len(self.log_value)} log bytes)"
        )


def route(batch: Persist, pack: Pack) -> PreparedBatch:
    """``batch`` encoded: its log value (msgpack ``[batch id, epoch, [records]]``, each record
    encoded once) and its rows. The caller has checked the epoch and the batch id; raises
    :class:`~engine.records.UnknownRecord` (an :class:`~engine.errors.EngineError`),
    :class:`InvalidBatch`, or what msgpack and struct raise for a value that cannot be
    encoded (the store wraps those). O(records)."""
    records = batch.records
    puts: Rows = []
    pos: list[tuple[bytes, int]] = []
    runs: list[tuple[bytes, int, int, int]] = []
    head = b"".join((b"\x93", pack(batch.batch_id), pack(batch.epoch)))
    if len(records) == 1 and check(records[0])["t"] == "run":
        # The commonest batch (a claim, a start, an end, one fire's run): no loop, no list
        # of encodings.
        record = records[0]
        data = pack(record)
        _route_run(record, data, puts, runs)
        log_value = b"".join((head, b"\x91", data))
        return PreparedBatch(
            batch.batch_id, batch.epoch, log_value, puts, pos, runs, 2 * len(log_value)
        )
    encoded: list[bytes] = [head, array_header(len(records))]
    # Runs a later record of this batch writes again (a fired run claimed in its fire's
    # batch, the usual case under load): their PENDING row would be overwritten in the
    # same atomic write, so it is not made at all. The log keeps every record.
    rewritten: dict[tuple[int, int], int] | None = None
    for index, record in enumerate(records):
        check(record)
        data = pack(record)
        encoded.append(data)
        kind = record["t"]
        if kind == "run":
            _route_run(record, data, puts, runs)
        elif kind == "pos":
            _route_pos(record, data, puts, pos)
        elif kind == "fire":
            # Many fires in one compact record: the log keeps it as it is; the query
            # families get the run and position records it stands for.
            if rewritten is None:
                rewritten = {
                    (r["key"], r["at"]): i for i, r in enumerate(records) if r["t"] == "run"
                }
            _route_fire(record, index, rewritten, pack, puts, runs, pos)
        elif kind == "job":
            _route_job(record, data, pack, puts)
        elif kind == "skip" or kind == "note":
            key = record["key"]
            when = record["lo"] if kind == "skip" else record["at"]
            hk = b"".join(
                (
                    i64(key),
                    i64(when),
                    codec.u64(batch.epoch),
                    codec.u64(batch.batch_id),
                    codec.u32(index),
                )
            )
            puts.append((HISTORY, hk, data))
            puts.append((BYTIME, i64(when) + i64(key), EMPTY))
        # Other kinds (out, outdone, dep, epoch) live in the log only: the engine folds
        # them on recovery; no query reads them.
    # The log value is msgpack [batch id, epoch, [records]], assembled from the records'
    # bytes already encoded above instead of encoding every record twice.
    log_value = b"".join(encoded)
    # The size bounds a group's memory (CommitPolicy.max_bytes): the routed copies are
    # about as large as the log value again.
    return PreparedBatch(
        batch.batch_id, batch.epoch, log_value, puts, pos, runs, 2 * len(log_value)
    )


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return _FIXARRAY[n]
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _route_run(
    record: Record,
    data: bytes,
    puts: Rows,
    runs: list[tuple[bytes, int, int, int]],
) -> None:
    key, at = record["key"], record["at"]
    rk = _I64_PAIR.pack(key + _I64_OFFSET, at + _I64_OFFSET)
    cls = RUN_CLASS.get(record["state"], RUN_OTHER)
    puts.append((RUNS, rk, RUN_BYTES[cls] + data))
    runs.append((rk, cls, key, at))


def _fire_templates() -> tuple[bytes, ...]:
    """The constant stretches of the msgpack maps :func:`engine.records.expand` makes of a
    fire (a PENDING ``run`` record and a ``pos`` record per fire), so that routing a fire
    packs only its numbers; the bytes are the same as packing those records (tested)."""
    p = msgpack.Packer(use_bin_type=True).pack

    def pairs(*items: Any) -> bytes:
        return b"".join(p(item) for item in items)

    head = pairs("t", "run", "v", FORMAT_VERSION, "key")
    mid = pairs("state", "PENDING", "att", 1, "tok", 0, "w", None, "ver")
    tail = pairs("due", None, "fail", 0, "tmo", 0, "src", None, "exit", None, "why", None)
    pos_head = pairs("t", "pos", "v", FORMAT_VERSION, "key")
    pos_tail = pairs("paused", False, "gone", False, "why", "catchup")
    return head, p("at"), mid, tail, pos_head, p("next"), p("acct"), pos_tail, p("e")


(
    _RUN_HEAD,
    _AT,
    _RUN_MID,
    _RUN_TAIL,
    _POS_HEAD,
    _NEXT,
    _ACCT,
    _POS_TAIL,
    _EPOCH_KEY,
) = _fire_templates()
# Map headers: 15 / 8 entries, and 16 / 9 with the epoch stamp.
_RUN_MAP: Final = (b"\x8f", b"\xde\x00\x10")
_POS_MAP: Final = (b"\x88", b"\x89")


def _route_fire(
    record: Record,
    index: int,
    rewritten: dict[tuple[int, int], int],
    pack: Pack,
    puts: Rows,
    runs: list[tuple[bytes, int, int, int]],
    pos: list[tuple[bytes, int]],
) -> None:
    """Route a compact ``fire`` record as :func:`engine.records.expand`'s records would be
    (same keys, same bytes), from its arrays, without making them; a run that a later record
    of the batch (``rewritten``: run -> index of its last record) writes again gets no row."""
    epoch = record.get("e")
    stamped = epoch is not None
    stamp = _EPOCH_KEY + pack(epoch) if stamped else b""
    run_map, pos_map = _RUN_MAP[stamped], _POS_MAP[stamped]
    pending = RUN_BYTES[RUN_PENDING]
    for key, at, ver, nxt in zip(
        record["keys"], record["ats"], record["vers"], record["next"], strict=True
    ):
        if rewritten.get((key, at), -1) <= index:
            rk = _I64_PAIR.pack(key + _I64_OFFSET, at + _I64_OFFSET)
            data = b"".join(
                (
                    run_map,
                    _RUN_HEAD,
                    pack(key),
                    _AT,
                    pack(at),
                    _RUN_MID,
                    pack(ver),
                    _RUN_TAIL,
                    stamp,
                )
            )
            puts.append((RUNS, rk, pending + data))
            runs.append((rk, RUN_PENDING, key, at))
        acct = ACCT_EXHAUSTED if nxt is None else nxt - 1
        cls = POS_IDLE if nxt is None else POS_PENDING
        data = b"".join(
            (pos_map, _POS_HEAD, pack(key), _NEXT, pack(nxt), _ACCT, pack(acct), _POS_TAIL, stamp)
        )
        pk = i64(key)
        puts.append((POS, pk, POS_BYTES[cls] + data))
        pos.append((pk, cls))


#: A job record's keys in the order the engine makes them: its spec then sits at a known place
#: in its encoding (see _route_job).
_JOB_RECORD_KEYS: Final = ("t", "v", "key", "id", "ver", "spec", "e")
_SPEC_KEY: Final = b"\xa4spec"
#: The bytes of a job record before its spec, besides the values of v, key, id and ver: the
#: map header and the pairs' keys, and "t": "job" (1 + 2 + 4 + 2 + 4 + 3 + 4).
_JOB_PREFIX_BYTES: Final = 20


def _route_job(record: Record, data: bytes, pack: Pack, puts: Rows) -> None:
    """The ``jobs`` row ``[version, spec, id]`` and the ``index`` row of a job record whose
    encoding is ``data``. The spec's bytes are taken from ``data`` rather than encoded a second
    time (a spec is most of a create's bytes): in the engine's key order the spec is the
    value between the ``spec`` key and the trailing ``e`` pair, whose sizes are known. Any
    other layout encodes the row from the record, with the same bytes."""
    key, job_id, version = record["key"], record["id"], record["ver"]
    if not isinstance(job_id, str):
        raise InvalidBatch(f"job record of key {key} has a non-str id {job_id!r}")
    packed_id, packed_version = pack(job_id), pack(version)
    spec: bytes | None = None
    if tuple(record) == _JOB_RECORD_KEYS and data[0] == 0x87:  # (0x87: a map of 7)
        start = (
            _JOB_PREFIX_BYTES
            + len(pack(record["v"]))
            + len(pack(key))
            + len(packed_id)
            + len(packed_version)
        )
        tail = _EPOCH_KEY + pack(record["e"])
        if data.startswith(_SPEC_KEY, start) and data.endswith(tail):
            spec = data[start + len(_SPEC_KEY) : len(data) - len(tail)]
    if spec is None:
        spec = pack(record["spec"])
    jk = i64(key)
    puts.append((JOBS, jk, b"".join((b"\x93", packed_version, spec, packed_id))))
    puts.append((INDEX, job_id.encode(), jk))


def _route_pos(record: Record, data: bytes, puts: Rows, pos: list[tuple[bytes, int]]) -> None:
    pk = i64(record["key"])
    if record.get("gone"):
        cls = POS_NONE
    elif record.get("paused"):
        cls = POS_PAUSED
    elif record.get("next") is not None:
        cls = POS_PENDING
    else:
        cls = POS_IDLE
    puts.append((POS, pk, POS_BYTES[cls] + data))
    pos.append((pk, cls))


# What each class adds to the counts: (jobs, pending, paused) and (runs pending, in flight).
_POS_COUNTS: Final = ((0, 0, 0), (1, 1, 0), (1, 0, 1), (1, 0, 0))
_RUN_COUNTS: Final = ((0, 0), (1, 0), (0, 1))
# Count deltas of a run going from class old (-1: never held, counted as other) to class new,
# indexed [old + 1][new].
_RUN_DELTAS: Final = tuple(
    tuple(
        (
            _RUN_COUNTS[new][0] - _RUN_COUNTS[max(old, 0)][0],
            _RUN_COUNTS[new][1] - _RUN_COUNTS[max(old, 0)][1],
        )
        for new in range(3)
    )
    for old in range(-1, 3)
)
#: A job whose newest stored run time is unknown (an ``nruns`` value of an older version).
UNKNOWN_AT: Final = codec.I64_MAX
#: A high mark of position keys above every key (they are 8 bytes; nine 0xff bytes sort after
#: each): what holds before a store knows its own, so that every position the caches miss is
#: read (see :func:`account`).
ABOVE_EVERY_KEY: Final = b"\xff" * 9

#: reads the stored values of keys of one family (a multi-get): (family, keys) -> values
Read = Callable[[int, list[bytes]], list[bytes | None]]


def job_runs_state(raw: bytes) -> list[int]:
    """``[runs stored, newest run time ever stored, 1 if that run is out of the time index]``
    of a job's ``nruns`` value (the time unknown in values of older versions)."""
    if len(raw) < 16:
        return [codec.read_u64(raw), UNKNOWN_AT, 0]
    return [codec.read_u64(raw), codec.read_i64(raw, 8), int(raw[16:17] == b"\x01")]


def job_runs_value(n: int, newest: int, unindexed: int) -> bytes:
    """The ``nruns`` value of :func:`job_runs_state`'s fields."""
    if newest == UNKNOWN_AT:
        return codec.u64(n)
    value = _I64_PAIR.pack(n, newest + _I64_OFFSET)
    return value + b"\x01" if unindexed else value


def account(
    prepared: list[PreparedBatch],
    counts: list[int],
    pos_cls: dict[bytes, int],
    run_cls: dict[bytes, int],
    job_runs: dict[int, list[int]],
    read: Read,
    pos_held_max: bytes = ABOVE_EVERY_KEY,
) -> tuple[set[int], Rows, bytes]:
    """What a group changes in the shard's counts (added to ``counts``), the rows that keep
    the per-job run counts and the time index of new runs, in key order, the jobs given new
    runs, and the highest position key above ``pos_held_max`` the group writes (``b""``:
    none), to which the caller raises its mark once the group is written.

    What a key held before comes from the write caches (``pos_cls``, ``run_cls``,
    ``job_runs``: what the store wrote last, exact because it is the directory's only
    writer), else — a run scheduled after the newest its job ever stored, or a position key
    above ``pos_held_max`` (at least every position key ever stored: the engine's job keys
    only grow, so a new job's is above it), was never held — from one ``read`` per family
    for the keys left. The default ``pos_held_max`` (above every key) reads every position
    the caches miss. The caches are updated as the group goes (a key written twice in the
    group sees its earlier value there); a caller whose write then fails must forget them.
    O(records)."""
    pos_top = b""
    for p in prepared:
        if p.pos:
            top = _account_pos(p.pos, counts, pos_cls, read, pos_held_max)
            if top > pos_top:
                pos_top = top
    runs = [e for p in prepared if p.runs for e in p.runs]
    added: set[int] = set()
    rows: Rows = []
    if not runs:
        return added, rows, pos_top
    missing = [job for _rk, _cls, job, _at in runs if job not in job_runs]
    if missing:
        missing = list(dict.fromkeys(missing))
        stored = read(NRUNS, [i64(j) for j in missing])
        for job, raw in zip(missing, stored, strict=True):
            # nruns is written with a job's first run, in the same atomic write: no value,
            # no run ever stored. A value without the time (an older version's): unknown.
            if raw is None:
                job_runs[job] = [0, codec.I64_MIN, 0]
            else:
                job_runs[job] = job_runs_state(raw)
    new_runs: list[bytes] = []
    unindexed: list[bytes] = []  # former newest runs retention left out of the time index
    unread: list[tuple[bytes, int, list[int], int]] = []
    for rk, cls, job, at in runs:
        state = job_runs[job]
        if at > state[1]:  # after every run the job ever stored: never held
            if state[2]:
                # The newest run until now, which an age pass kept out of the time index
                # (it is never deleted while newest), no longer is: index it again, so the
                # pass that finds it past the cutoff deletes it.
                unindexed.append(_I64_PAIR.pack(job + _I64_OFFSET, state[1] + _I64_OFFSET))
                state[2] = 0
            state[1] = at
            state[0] += 1
            added.add(job)
            new_runs.append(rk)
            if cls:  # (other = 0 counts nothing)
                delta = _RUN_DELTAS[0][cls]
                counts[3] += delta[0]
                counts[4] += delta[1]
        else:
            old = run_cls.get(rk)
            if old is None:  # read below; a later write of the key sees cls
                unread.append((rk, cls, state, job))
            elif old != cls:
                delta = _RUN_DELTAS[old + 1][cls]
                counts[3] += delta[0]
                counts[4] += delta[1]
        run_cls[rk] = cls
    if unread:
        stored = read(RUNS, [rk for rk, _, _, _ in unread])
        for (rk, cls, state, job), raw in zip(unread, stored, strict=True):
            old = -1 if raw is None else raw[0]
            if old == -1:  # never held (or deleted by retention): index and count it
                state[0] += 1
                added.add(job)
                new_runs.append(rk)
            if old != cls:
                delta = _RUN_DELTAS[old + 1][cls]
                counts[3] += delta[0]
                counts[4] += delta[1]
    if unindexed:
        new_runs.extend(unindexed)
    # In key order per family: each insert then starts near the previous one in the
    # memtable's skip list.
    for tk in sorted([rk[8:16] + rk[:8] for rk in new_runs]):
        rows.append((BYTIME, tk, EMPTY))
    for job in sorted(added):
        state = job_runs[job]
        rows.append((NRUNS, i64(job), job_runs_value(state[0], state[1], state[2])))
    return added, rows, pos_top


def _account_pos(
    entries: list[tuple[bytes, int]],
    counts: list[int],
    cache: dict[bytes, int],
    read: Read,
    held_max: bytes,
) -> bytes:
    """Count ``entries``; return the highest key among them above ``held_max`` (``b""``:
    none). A key in the cache above the mark cannot be: the write that cached it raised it."""
    missing: list[bytes] = []
    top = b""
    for k, _ in entries:
        if k not in cache:
            if k > held_max:  # (a new job's: never stored, no read)
                cache[k] = POS_NONE
                if k > top:
                    top = k
            else:
                missing.append(k)
    if missing:
        stored = read(POS, missing)
        for k, raw in zip(missing, stored, strict=True):
            cache[k] = POS_NONE if raw is None else raw[0]  # never held: nothing
    for k, cls in entries:
        old = cache[k]
        if old != cls:
            was, now = _POS_COUNTS[old], _POS_COUNTS[cls]
            counts[0] += now[0] - was[0]
            counts[1] += now[1] - was[1]
            counts[2] += now[2] - was[2]
            cache[k] = cls
    return top
