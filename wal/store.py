"""The durable store of one shard: RocksDB through rocksdict, one directory per shard.

Owns the on-disk layout and its guarantees: every engine batch is appended to the batch log
and routed to query column families in one atomic, fsynced write; the epoch fence (recorded on
open, checked on every write); the fixed shard count; columnar snapshots and the log tail
after them for recovery; run history retention by range deletes; exact counts of what the
shard holds. Must never decide what a record *means* for the schedule (the engine does, on
recovery, from the log) and never write a batch piecemeal.

Layout (raw mode; ``i64`` = 8 big-endian bytes of a signed int offset by 2**63, so byte order
is numeric order; ``u64``/``u32`` plain big-endian; values msgpack unless said otherwise):

============ ========================================== ==============================================
family       key                                        value
============ ========================================== ==============================================
``log``      u64 seq of the group's last batch          [[batch id, epoch, [records...]], ...]: the
                                                        batches of one write, in log order (one
                                                        batch alone: [batch id, epoch, [records]])
``jobs``     i64 key                                    [version, spec, id] of the newest ``job``
``index``    job id (utf-8)                             i64 key
``pos``      i64 key                                    class byte + the newest ``pos`` record
``runs``     i64 key, i64 scheduled ms                  class byte + the newest ``run`` record
``history``  i64 key, i64 time, u64 epoch, u64 batch,   a ``skip`` (time = lo) or ``note`` record
             u32 index in batch
``bytime``   i64 time, i64 key                          empty: what age retention visits
``nruns``    i64 key                                    u64 number of runs stored for the job, then
                                                        i64 the newest run time it ever stored
                                                        (absent in values of older versions)
``logs``     i64 key, i64 scheduled ms, u32 chunk       run output (:mod:`wal.logs`)
``snapshot`` u64 seq + ``a`` + name + NUL + u32 chunk   raw array bytes, at most 4 MiB each
             u64 seq + ``m``                            {arrays: {name: dtype, shape, ...}, meta}
``meta``     ``format``, ``shards``, ``shard``,         msgpack ints; ``counts``: [jobs, pending,
             ``epoch``, ``counts``                      paused, runs pending, runs in flight]
============ ========================================== ==============================================

The class byte in ``pos`` and ``runs`` lets a write learn what a key held before (for the
counts) from one multi-get per group, without decoding the old record. Most groups need no read
at all: the store remembers the classes it wrote last (bounded caches, exact because it is the
directory's only writer), and a run scheduled after the newest run its job ever stored (kept in
``nruns``) was never held.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import struct
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    DBCompressionType,
    DBRecoveryMode,
    IngestExternalFileOptions,
    Options,
    Rdict,
    ReadOptions,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from engine.effects import Persist
from engine.errors import EngineError
from engine.records import Record
from engine.runs import FINAL_VALUES
from engine.snapshot import Snapshot
from wal import codec
from wal.errors import (
    Corrupt,
    EpochAhead,
    InvalidBatch,
    InvalidSnapshot,
    ShardCountMismatch,
    ShardMismatch,
    StaleEpoch,
    StoreClosed,
    StoreError,
    StoreFailure,
    StoreIOError,
    StoreUsageError,
    check_i64,
    decoded,
    translate,
)
from wal.logs import LogLimits, LogStore, RocksLogStore
from wal.route import ABOVE_EVERY_KEY as _ABOVE_EVERY_KEY
from wal.route import BYTIME as _BYTIME
from wal.route import EMPTY as _EMPTY
from wal.route import HISTORY as _HISTORY
from wal.route import INDEX as _INDEX
from wal.route import JOBS as _JOBS
from wal.route import LOG as _LOG
from wal.route import LOGS as _LOGS
from wal.route import META as _META
from wal.route import NRUNS as _NRUNS
from wal.route import POS as _POS
from wal.route import RUNS as _RUNS
from wal.route import SNAPSHOT as _SNAPSHOT
from wal.route import UNKNOWN_AT as _UNKNOWN_AT
from wal.route import PreparedBatch, account, route
from wal.route import array_header as _array_header
from wal.route import job_runs_state as _job_runs_state
from wal.route import job_runs_value as _job_runs_value

log = logging.getLogger("tickwheel.store")

FORMAT: Final = 1
COLUMN_FAMILIES: Final = (
    "log",
    "jobs",
    "index",
    "pos",
    "runs",
    "history",
    "bytime",
    "nruns",
    "logs",
    "snapshot",
    "meta",
)
#: Largest raw value a snapshot array is cut into. Measured here, reading 80 MB back: 64 MiB
#: values ~190 MB/s, 4 MiB values ~850 MB/s (each get allocates a fresh buffer for its value,
#: and a huge one is fresh pages every time, faulted in one by one).
SNAPSHOT_CHUNK_BYTES: Final = 4 * 1024 * 1024
#: Memtable size of every family (see _cf_options).
MEMTABLE_BYTES: Final = 4 * 1024 * 1024
#: Log entries read per iterator while replaying the tail (an iterator pins the database, so
#: none is kept open between pages). An entry holds a whole group (up to CommitPolicy's bytes).
_TAIL_PAGE: Final = 256

_U64_PACK: Final = struct.Struct(">Q").pack
_FAMILY_AND_KEY: Final = operator.itemgetter(0, 1)
#: Entries each of the store's write caches (position classes, run classes, per-job run count
#: and newest run time) may hold before it is emptied: a few MB per shard, enough for every key
#: a busy shard touches between a run's creation and its end.
CACHE_ENTRIES: Final = 1 << 16


@dataclass(frozen=True)
class StoreCounts:
    """What the shard holds, kept exactly by every write (in the same atomic batch).

    * ``jobs``: jobs with a position that are not cancelled;
    * ``pending_jobs``: of those, not paused and with a next fire time (what the wheel holds);
    * ``paused_jobs``: of those, paused;
    * ``runs_pending``: runs whose newest record is PENDING;
    * ``runs_in_flight``: runs whose newest record is CLAIMED or RUNNING.
    """

    jobs: int = 0
    pending_jobs: int = 0
    paused_jobs: int = 0
    runs_pending: int = 0
    runs_in_flight: int = 0

    def as_list(self) -> list[int]:
        return [
            self.jobs,
            self.pending_jobs,
            self.paused_jobs,
            self.runs_pending,
            self.runs_in_flight,
        ]


@dataclass
class Recovered:
    """What :meth:`ShardStore.load` found.

    ``snapshot`` is the newest snapshot (None without one) and ``snapshot_seq`` the log
    position it reflects (-1 without one); ``tail`` yields, in log order, every record of every
    batch logged after it — lazily, one page of the log at a time, so it must be consumed
    before the store is closed. ``epoch`` is the store's epoch (recorded by this open),
    ``previous_epoch`` the one before (None for a new directory), ``last_seq`` the newest log
    position. ``counts`` are exact (see :class:`StoreCounts`).
    """

    epoch: int
    previous_epoch: int | None
    snapshot: Snapshot | None
    snapshot_seq: int
    last_seq: int
    counts: StoreCounts
    tail: Iterator[Record]


@dataclass(frozen=True)
class StoredJob:
    """A job as stored: its newest spec and version, and its newest position record (None
    before one is durable)."""

    key: int
    id: str
    version: int
    spec: dict[str, Any]
    position: dict[str, Any] | None


@dataclass(frozen=True)
class Retention:
    """How much run history to keep. ``max_age_ms``: runs (and skips, notes and logs) scheduled
    more than this before ``now`` go; ``max_runs_per_job``: only the newest N runs of a job stay
    (N >= 1). None disables either. Runs not in a final state are never removed, and neither is
    each job's newest run (greatest scheduled time), whatever its age: its last status stays
    visible, and a one-shot's time that ran is still known as run (``has_run``), so a create
    naming it again does not owe it twice. Past ``max_age_ms`` that run keeps only its record:
    its logs and notes go as any other's. A skip record (a range of fire times not run) is
    aged by the last time it covers, not its first: the record of a long pause, written at the
    resume, stays while any time of it is within the age. Raises :class:`StoreUsageError` for
    a value that is not an integer (None aside), ``max_runs_per_job`` below 1, or a
    ``max_age_ms`` below 0 or beyond the store's signed 64-bit times."""

    max_age_ms: int | None = 30 * 86_400_000
    max_runs_per_job: int | None = 1000

    def __post_init__(self) -> None:
        # Refused when the policy is made (a node's start), not at each pass: a pass refused
        # every minute would only log, and keep nothing from growing.
        for name in ("max_age_ms", "max_runs_per_job"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                # (A float age, 30 * 86_400e3, failed inside every pass with struct.error.)
                raise StoreUsageError(f"{name} must be an integer or None, got {value!r}")
        if self.max_age_ms is not None and self.max_age_ms > codec.I64_MAX:
            raise StoreUsageError(f"max_age_ms must be at most 2**63 - 1, got {self.max_age_ms}")
        if self.max_runs_per_job is not None and self.max_runs_per_job < 1:
            raise StoreUsageError(
                f"max_runs_per_job must be >= 1 (None: no limit), got {self.max_runs_per_job}"
            )
        if self.max_age_ms is not None and self.max_age_ms < 0:
            raise StoreUsageError(
                f"max_age_ms must be >= 0 (None: no limit), got {self.max_age_ms}"
            )


@dataclass
class RetentionReport:
    """What one :meth:`ShardStore.retain` call removed. ``more``: the age pass stopped at its
    entry limit with expired entries left; call again."""

    runs_deleted: int = 0
    jobs_trimmed: int = 0
    kept_in_flight: int = 0
    #: runs past the policy kept because each is its job's newest
    kept_newest: int = 0
    #: final runs scheduled before the age cutoff kept because they ended after it
    kept_recent: int = 0
    ranges: int = 0
    more: bool = False


class ShardStore:
    """One shard's RocksDB directory. Use :meth:`open`; it implements
    :class:`engine.directory.JobDirectory` (``key_of``, ``keys_of``, ``latest``,
    ``ticket_fields``, ``has_run``).

    Thread-safety: writes (:meth:`write`, :meth:`write_prepared`, :meth:`retain`,
    :meth:`write_snapshot`) are serialised by one lock; reads may come from any thread; they may
    see a group's write a moment before its fsync returns (see :meth:`_commit`), never a
    partial one (but for :meth:`run_count`). The intended writer is the
    group committer (:mod:`wal.commit`), one thread issuing one synced write per group.
    """

    def __init__(self) -> None:  # use ShardStore.open()
        self.path = ""
        self.shard = 0
        self.shards = 0
        self.epoch = 0
        self.previous_epoch: int | None = None
        self.logs: LogStore
        self._db: Rdict | None = None
        self._cf: list[Rdict] = []
        self._h: list[Any] = []
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        self._nosync.sync = False
        # Reentrant: try_write_prepared holds it around write_prepared (which a test double
        # may override), and writes take it again.
        self._lock = threading.RLock()
        self._snapshot_lock = threading.Lock()
        self._last_seq = 0
        self._snapshot_seq = -1
        self._counts = [0, 0, 0, 0, 0]
        self._failed: StoreFailure | None = None
        self._touched: set[int] = set()  # jobs given a new run since the last retain()
        #: a foreign log store's drops of the retention write being made (see _drop_logs)
        self._log_drops: list[tuple[int, int, int]] = []
        #: runs the retention write being made keeps while it drops their logs (job, at):
        #: the local log store leaves each a marker of what went (see _write_retention)
        self._logs_marked: list[tuple[int, int]] = []
        #: ``logs`` when it is this store's own RocksLogStore (open's default), else None
        self._own_logs: RocksLogStore | None = None
        #: where the count pass's sweep of every job's run count goes on, a page a call, once
        #: after each open (None: done): ``_touched`` lives in memory, so a job over the limit
        #: before a restart (or a limit lowered at one) is found by this sweep
        self._count_from: bytes | None = codec.LOW8
        #: where the age pass's sweep of the time index goes on (None: from its start): a
        #: call that stops at ``max_entries`` resumes past what it visited, so the runs it
        #: keeps (in flight, indexed again at their time) do not fill the next call too
        self._age_from: bytes | None = None
        # What this store wrote last, so that a group need not read it back for the counts
        # (exact: the LOCK makes the store the directory's only writer): the class of
        # positions and runs by key, and per job (runs stored, newest run time ever stored).
        self._pos_cls: dict[bytes, int] = {}
        self._run_cls: dict[bytes, int] = {}
        self._job_runs: dict[int, list[int]] = {}
        #: at least every key the positions family ever held (its last key at open, raised by
        #: every write): a position above it was never stored, so a new job's needs no read
        #: for the counts (wal.route.account). Above every key until the store is open.
        self._pos_held_max = _ABOVE_EVERY_KEY
        # A msgpack Packer keeps a buffer between calls: one per thread (prepare() runs in every
        # producer's thread).
        self._packers = threading.local()

    # ================================================================= open and close

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        shard: int,
        shards: int,
        epoch: int,
        log_limits: LogLimits | None = None,
        log_store: Callable[[], LogStore] | None = None,
    ) -> ShardStore:
        """Open (creating if needed) the directory of shard ``shard`` of ``shards`` for
        ``epoch``, and record the epoch durably before anything else can be written.

        Run logs go to the shard's RocksDB (:class:`RocksLogStore`), or to what ``log_store``
        makes (an object store, say: any :class:`LogStore`; ``log_limits`` is then its
        business). Retention drops a foreign store's logs of the runs it deletes just before
        its own write, by :meth:`LogStore.drop` (a crash between the two leaves runs without
        their logs, which the next pass deletes; never logs without their runs).

        Raises :class:`StoreLocked` when another opener holds the directory,
        :class:`ShardCountMismatch` / :class:`ShardMismatch` when it was created for another
        shard count or shard, :class:`StaleEpoch` when it already holds an epoch >= ``epoch``,
        and :class:`ReadOnly`, :class:`DiskFull`, :class:`Corrupt` for disk trouble; on any
        error the directory is left unlocked. Cost: RocksDB's open (replays its log) plus two
        seeks.
        """
        for name, value, low in (("shard", shard, 0), ("shards", shards, 1), ("epoch", epoch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise StoreUsageError(f"{name} must be an int >= {low}, got {value!r}")
        if shard >= shards:
            raise StoreUsageError(f"shard {shard} is not below the shard count {shards}")
        where = os.fspath(path)
        self = cls()
        self.path = where
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as exc:
            raise translate(exc, path=where, doing="creating the shard directory") from exc
        try:
            self._db = Rdict(where, _db_options(), _cf_options(), AccessType.read_write())
        except Exception as exc:
            raise translate(exc, path=where, doing="opening the shard store") from exc
        try:
            self._cf = [self._db.get_column_family(n) for n in COLUMN_FAMILIES]
            self._h = [self._db.get_column_family_handle(n) for n in COLUMN_FAMILIES]
            self._check_meta_and_fence(shard, shards, epoch)
            self._last_seq, self._snapshot_seq = self._find_positions()
            self._pos_held_max = self._last_key(self._cf[_POS]) or b""
            # A snapshot file a crash left before its ingest (its write holds the lock we now
            # hold, so none is being written): never read, it only took disk for good.
            for name in os.listdir(where):
                if name.startswith("snapshot-") and name.endswith(".sst.tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(where, name))
            raw = self._cf[_META].get(b"counts")
            self._counts = (
                [0, 0, 0, 0, 0]
                if raw is None
                else list(decoded(raw, path=where, what="the store's counts"))
            )
            if log_store is None:
                self.logs = self._own_logs = RocksLogStore(
                    self._db,
                    self._cf[_LOGS],
                    where,
                    log_limits or LogLimits(),
                    # refused, as reads and writes are, once the store failed
                    guard=functools.partial(self._check_usable, "run logs"),
                )
            else:
                self.logs = log_store()
        except BaseException as exc:
            # The traceback's frames hold column families in their locals, and rocksdict
            # keeps the database (and its LOCK) open while any is referenced: a caller that
            # keeps the exception would keep the directory locked.
            traceback.clear_frames(exc.__traceback__)
            self._release()
            raise
        return self

    def _check_meta_and_fence(self, shard: int, shards: int, epoch: int) -> None:
        meta = self._cf[_META]
        try:
            stored = {k: meta.get(k) for k in (b"format", b"shards", b"shard", b"epoch")}
        except Exception as exc:
            raise translate(exc, path=self.path, doing="reading the store's meta") from exc
        values = {
            k: None if v is None else decoded(v, path=self.path, what=f"meta {k.decode()}")
            for k, v in stored.items()
        }
        fmt = values[b"format"]
        if fmt is not None and fmt > FORMAT:
            raise Corrupt(
                f"store format {fmt} is newer than this version reads ({FORMAT})", path=self.path
            )
        if values[b"shards"] is not None and values[b"shards"] != shards:
            raise ShardCountMismatch(
                f"the directory was created for {values[b'shards']} shards, "
                f"opened with {shards}; the shard count is fixed when a data directory is created",
                path=self.path,
            )
        if values[b"shard"] is not None and values[b"shard"] != shard:
            raise ShardMismatch(
                f"the directory holds shard {values[b'shard']}, opened as shard {shard}",
                path=self.path,
            )
        previous = values[b"epoch"]
        if previous is not None and epoch <= previous:
            raise StaleEpoch(
                f"the shard is already at epoch {previous}; opening for epoch {epoch} refused "
                "(a newer owner opened it)",
                path=self.path,
            )
        batch = WriteBatch(raw_mode=True)
        h = self._h[_META]
        batch.put(b"format", codec.pack(FORMAT), h)
        batch.put(b"shards", codec.pack(shards), h)
        batch.put(b"shard", codec.pack(shard), h)
        batch.put(b"epoch", codec.pack(epoch), h)
        self._commit(batch, f"recording epoch {epoch}")
        self.shard, self.shards, self.epoch, self.previous_epoch = shard, shards, epoch, previous

    def _find_positions(self) -> tuple[int, int]:
        """(newest log seq, newest snapshot seq or -1): two seeks to the end."""
        snap_seq = -1
        last = self._last_key(self._cf[_SNAPSHOT])
        if last is not None:
            snap_seq = codec.read_u64(last)
        last = self._last_key(self._cf[_LOG])
        log_seq = codec.read_u64(last) if last is not None else 0
        # After a snapshot, the log up to it is deleted: its seq still counts as handed out.
        return max(log_seq, snap_seq, 0), snap_seq

    def _last_key(self, cf: Rdict) -> bytes | None:
        it = cf.iter()
        try:
            it.seek_to_last()
            if it.valid():
                key: bytes = it.key()
                return key
            it.status()
            return None
        except Exception as exc:
            raise translate(exc, path=self.path, doing="seeking the end of a column") from exc
        finally:
            del it

    def close(self) -> None:
        """Close the database and release its LOCK. Idempotent. Every later call raises
        :class:`StoreClosed`. Writes already returned are durable; nothing is lost by closing."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        db = self._db
        if db is None:
            return
        # rocksdict keeps the database open while any column family object, handle or
        # iterator refers to it; drop them all first, so that close() frees the LOCK.
        if hasattr(self, "logs"):
            try:
                self.logs.close()
            except Exception:  # (another store's: the database must still close)
                log.exception("closing the run log store failed")
        cfs, handles = self._cf, self._h
        self._cf, self._h, self._db = [], [], None
        # Emptied in place too, not only replaced: a failed write's exception (kept in
        # _failed, and by every ticket of its group) holds the frames of write_prepared and
        # _account, whose locals name these very lists, and so kept every handle, the
        # database and its LOCK alive after close: a reopen in the same process after a full
        # disk was StoreLocked (found by test_disk_errors' tmpfs test).
        cfs.clear()
        handles.clear()
        # And the kept failure's frames are cleared of their locals: any of them may hold a
        # column family itself (a multi-get's ``cf`` argument, when a read failed inside a
        # write), which no list above reaches (found by review).
        if self._failed is not None:
            _clear_frames_of(self._failed)
        try:
            db.close()
        except Exception:  # closing after a disk failure may report it again; it is known
            pass

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._db is None

    @property
    def last_seq(self) -> int:
        """The newest log position handed out (0 before the first write)."""
        return self._last_seq

    @property
    def counts(self) -> StoreCounts:
        """Exact counts as of the last durable write (see :class:`StoreCounts`)."""
        return StoreCounts(*self._counts)

    # ================================================================= writing batches

    def prepare(self, batch: Persist) -> PreparedBatch:
        """Check and encode ``batch``: its epoch against the store's, every record against the
        record format; route each record to its column families. Pure CPU, no I/O; any thread.

        Raises :class:`StaleEpoch` for an older epoch, :class:`EpochAhead` for a newer one,
        :class:`InvalidBatch` for a record that is not one or cannot be encoded. O(records).
        """
        if not isinstance(batch, Persist):
            raise InvalidBatch(f"expected a Persist batch, got {type(batch).__name__}")
        if batch.epoch != self.epoch:
            if isinstance(batch.epoch, int) and batch.epoch < self.epoch:
                raise StaleEpoch(
                    f"batch {batch.batch_id} is stamped with epoch {batch.epoch}; the store is at "
                    f"epoch {self.epoch}: refused, nothing written",
                    path=self.path,
                )
            raise EpochAhead(
                f"batch {batch.batch_id} is stamped with epoch {batch.epoch!r}; the store was "
                f"opened for epoch {self.epoch}",
                path=self.path,
            )
        if not isinstance(batch.batch_id, int) or not 0 <= batch.batch_id < 1 << 64:
            raise InvalidBatch(f"batch id must be an int in 0..2**64-1, got {batch.batch_id!r}")
        try:
            return self._route(batch)
        except StoreError:
            raise
        except (EngineError, KeyError, TypeError, ValueError, OverflowError, struct.error) as exc:
            raise InvalidBatch(
                f"batch {batch.batch_id} cannot be stored: {type(exc).__name__}: {exc}",
                path=self.path,
            ) from exc

    def _route(self, batch: Persist) -> PreparedBatch:
        packer: msgpack.Packer | None = getattr(self._packers, "packer", None)
        if packer is None:
            packer = self._packers.packer = msgpack.Packer(use_bin_type=True)
        return route(batch, packer.pack)

    def write(self, batches: Sequence[Persist]) -> list[int]:
        """Store ``batches`` in ONE atomic RocksDB write with ONE fsync; return each batch's log
        position, in order. Every batch is checked first: if any is refused
        (:meth:`prepare`'s errors), nothing is written.

        Guarantees: on return, every batch is durable; on an exception, none is acknowledged
        (a :class:`StoreFailure` means the disk failed: the store refuses further writes until
        reopened, and a reopen finds each batch of the failed write whole or absent).
        Cost: O(records) encoding plus one multi-get per group for the counts, one write.
        """
        return self.write_prepared([self.prepare(b) for b in batches])

    def try_write_prepared(self, prepared: Sequence[PreparedBatch]) -> list[int] | None:
        """:meth:`write_prepared`, or None at once, nothing written, when another thread
        holds the store (a retention pass's scan, a snapshot trimming the log): for a caller
        that must not wait for those (an event loop)."""
        if not self._lock.acquire(False):
            return None
        try:
            return self.write_prepared(prepared)  # (the lock is reentrant)
        finally:
            self._lock.release()

    def write_prepared(self, prepared: Sequence[PreparedBatch]) -> list[int]:
        """:meth:`write` for batches already :meth:`prepare`-d (the group committer's path)."""
        if not prepared:
            return []
        with self._lock:
            self._check_writable()
            for p in prepared:
                if p.epoch != self.epoch:  # prepared under an epoch this store is not at
                    raise StaleEpoch(
                        f"batch {p.batch_id} was prepared for epoch {p.epoch}; the store is at "
                        f"{self.epoch}",
                        path=self.path,
                    )
            wb = WriteBatch(raw_mode=True)
            put = wb.put
            h = self._h
            first = self._last_seq + 1
            seq = self._last_seq + len(prepared)
            # One log entry for the whole group, keyed by its last position: one insert, not
            # one a batch (each batch's value is already a whole msgpack array; the group's is
            # an array of them).
            if len(prepared) == 1:
                put(_U64_PACK(seq), prepared[0].log_value, h[_LOG])
            else:
                n = len(prepared)
                header = _array_header(n)
                put(_U64_PACK(seq), b"".join([header, *[p.log_value for p in prepared]]), h[_LOG])
            puts = [e for p in prepared for e in p.puts]
            # In key order per family (stable: a key written twice keeps its order): each
            # insert then starts near the previous one in the memtable's skip list, ~20% less
            # of the write's CPU than inserts at random places.
            puts.sort(key=_FAMILY_AND_KEY)
            for cf, k, v in puts:
                put(k, v, h[cf])
            counts = self._counts.copy()
            try:
                added, pos_top = self._account(wb, prepared, counts)
                if counts != self._counts:
                    put(b"counts", codec.pack(counts), h[_META])
                self._commit(wb, f"writing batches {prepared[0].batch_id}..{prepared[-1].batch_id}")
            except BaseException as exc:
                # The caches already hold what this group would have left; it was not written.
                self._forget()
                # Its traceback goes to every ticket of the group, which a driver may keep:
                # the finished frames' locals (the write batch, a multi-get's column family)
                # must not keep the database open past close() (see _release).
                _clear_frames_of(exc)
                raise
            self._last_seq = seq
            self._counts = counts
            if pos_top > self._pos_held_max:
                self._pos_held_max = pos_top
            if added:
                self._touched.update(added)
            return list(range(first, seq + 1))

    def _account(
        self, wb: WriteBatch, prepared: Sequence[PreparedBatch], counts: list[int]
    ) -> tuple[set[int], bytes]:
        """Update ``counts`` for what the group changes, adding per-job run counts and the
        time index of new runs to ``wb``; the jobs given new runs and the position mark the
        group raises (:func:`wal.route.account`,
        on the write caches, which are emptied first when one grew past its bound;
        :meth:`write_prepared` forgets them all if the group is not written). O(records)."""
        if len(self._pos_cls) > CACHE_ENTRIES:
            self._pos_cls = {}
        if len(self._run_cls) > CACHE_ENTRIES:
            self._run_cls = {}
        if len(self._job_runs) > CACHE_ENTRIES:
            self._job_runs = {}
        added, rows, pos_top = account(
            list(prepared),
            counts,
            self._pos_cls,
            self._run_cls,
            self._job_runs,
            self._read_family,
            self._pos_held_max,
        )
        put, h = wb.put, self._h
        for cf, k, v in rows:
            put(k, v, h[cf])
        return added, pos_top

    def _read_family(self, family: int, keys: list[bytes]) -> list[bytes | None]:
        return self._multiget(self._cf[family], keys)

    def _forget(self) -> None:
        """Empty the write caches (they may hold what a group that failed would have left)."""
        self._pos_cls = {}
        self._run_cls = {}
        self._job_runs = {}

    def _multiget(
        self, cf: Rdict, keys: list[bytes], doing: str = "reading before a write"
    ) -> list[bytes | None]:
        wanted: list[str | int | float | bytes | bool] = list(keys)
        try:
            values: list[bytes | None] = cf.get(wanted)  # type: ignore[assignment]  # a multi-get
        except Exception as exc:
            raise translate(exc, path=self.path, doing=doing) from exc
        return values

    def _check_writable(self) -> None:
        self._check_usable("writes")

    def _check_usable(self, what: str) -> None:
        if self._db is None:
            raise StoreClosed("the shard store is closed", path=self.path)
        if self._failed is not None:
            raise type(self._failed)(
                f"the store failed earlier and refuses {what} until reopened: "
                f"{self._failed.message}",
                path=self.path,
            )

    def _commit(self, wb: WriteBatch, doing: str, *, sync: bool = True) -> None:
        """One RocksDB write; with ``sync``, fsynced before it returns. A failure poisons the
        store: RocksDB stops accepting writes after an I/O error, and so do we."""
        assert self._db is not None
        try:
            # Not write(sync=True): rocksdict holds the GIL through that fsync, freezing every
            # thread of the process (the node's event loop included) for the disk's latency.
            # An unsynced write, then FlushWAL(sync) — which fsyncs the same log and releases
            # the GIL — is the same durability when it returns. Readers may see the write a
            # moment before it is durable; nothing is acknowledged until it is.
            self._db.write(wb, self._nosync)
            if sync:
                self._db.flush_wal(True)
        except Exception as exc:
            failure = translate(exc, path=self.path, doing=doing)
            self._failed = failure
            raise failure from exc
        except BaseException:
            # An interruption (KeyboardInterrupt on the loop's thread, in write_here) between
            # the unsynced write and its fsync leaves the group readable but not durable, and
            # its log position not handed out, so that the next group would overwrite its log
            # entry: the store is failed as after a failed fsync (found by review).
            self._failed = StoreIOError(
                f"{doing}: interrupted before the write was durable", path=self.path
            )
            raise

    # ================================================================= JobDirectory and queries

    def _db_open(self) -> Rdict:
        """The database, for a read. After a failed write, reads are refused as writes are:
        the failed group's write may be in the database without its fsync (an unsynced write
        comes first, see :meth:`_commit`), and an answer must never rest on what was not
        acknowledged durable."""
        if self._db is None:
            raise StoreClosed("the shard store is closed", path=self.path)
        if self._failed is not None:
            raise type(self._failed)(
                f"the store failed earlier and refuses reads until reopened: "
                f"{self._failed.message}",
                path=self.path,
            )
        return self._db

    def _get(self, cf: int, key: bytes) -> bytes | None:
        self._db_open()
        try:
            value: bytes | None = self._cf[cf].get(key)
        except Exception as exc:
            raise translate(exc, path=self.path, doing=f"reading {COLUMN_FAMILIES[cf]}") from exc
        return value

    def _decode(self, raw: bytes) -> Any:
        """A stored value, for a query: one that cannot be decoded is :class:`Corrupt` (typed,
        as every failure of the store), not the codec's own exception."""
        return decoded(raw, path=self.path, what="a stored value")

    def key_of(self, job_id: str) -> int | None:
        """The dense key of ``job_id``, or None when no durable record names it. One get."""
        raw = self._get(_INDEX, job_id.encode())
        return None if raw is None else codec.read_i64(raw)

    def keys_of(self, job_ids: list[str]) -> list[int | None]:
        """:meth:`key_of` of each of ``job_ids``, in order: one multi-get (a bulk create's
        chunk asks once, not once a job)."""
        self._db_open()
        if not job_ids:
            return []
        found = self._multiget(
            self._cf[_INDEX], [job_id.encode() for job_id in job_ids], "reading index"
        )
        read = codec.read_i64
        return [None if raw is None else read(raw) for raw in found]

    def latest(self, key: int) -> tuple[int, Mapping[str, Any]] | None:
        """``(version, spec)`` of the newest durable ``job`` record of ``key``. One get."""
        raw = self._get(_JOBS, codec.i64(key))
        if raw is None:
            return None
        version, spec, _id = self._decode(raw)
        return version, spec

    def ticket_fields(self, key: int) -> tuple[int, str, Any] | None:
        """``(version, spec["id"], spec["task"])`` of :meth:`latest`, or None. One get, and
        only those fields decoded: a claim's every dispatch asks it, and decoding the whole
        spec (policy, schedule, labels: ~20 keys) was about a tenth of the node's CPU in the
        dispatch benchmark."""
        raw = self._get(_JOBS, codec.i64(key))
        if raw is None:
            return None
        try:
            return _job_ticket_fields(raw)
        except Exception as exc:
            raise Corrupt(
                f"job {key}'s value cannot be decoded ({type(exc).__name__}: {exc})",
                path=self.path,
            ) from None

    def has_run(self, key: int, at: int) -> bool:
        """Whether the run of ``key`` at ``at`` is stored as having gone out (claimed at
        least once: a token), not merely fired. Retention keeps each job's newest run (see
        :meth:`retain`), so a one-shot's run stays; an older run of a job may have been
        deleted. One get and a decode."""
        check_i64(key=key, at=at)
        raw = self._get(_RUNS, codec.i64(key) + codec.i64(at))
        return raw is not None and _went_out(self._decode(raw[1:]))

    def job(self, job_id: str) -> StoredJob | None:
        """The job named ``job_id`` with its position, or None. Three gets."""
        key = self.key_of(job_id)
        return None if key is None else self.job_by_key(key)

    def job_by_key(self, key: int) -> StoredJob | None:
        """The job of ``key`` with its position, or None. Two gets."""
        raw = self._get(_JOBS, codec.i64(key))
        if raw is None:
            return None
        version, spec, job_id = self._decode(raw)
        pos = self._get(_POS, codec.i64(key))
        return StoredJob(key, job_id, version, spec, None if pos is None else self._decode(pos[1:]))

    def jobs(self, *, after: int | None = None, limit: int = 100) -> list[StoredJob]:
        """Jobs in key order (creation order), starting after key ``after``; at most ``limit``.
        Page on with ``after=page[-1].key``. One forward scan plus one get per job."""
        check_i64(after=after)
        if after == codec.I64_MAX:
            return []  # nothing is after the greatest key
        lo = codec.I64_MIN if after is None else after + 1
        out: list[StoredJob] = []
        for k, v in self._scan(_JOBS, codec.i64(lo), None, limit=limit):
            version, spec, job_id = self._decode(v)
            key = codec.read_i64(k)
            pos = self._get(_POS, k)
            out.append(
                StoredJob(
                    key, job_id, version, spec, None if pos is None else self._decode(pos[1:])
                )
            )
        return out

    def run(self, key: int, at: int) -> Record | None:
        """The newest record of run ``(key, at)``, or None. One get."""
        check_i64(key=key, at=at)
        raw = self._get(_RUNS, codec.i64(key) + codec.i64(at))
        return None if raw is None else dict(self._decode(raw[1:]))

    def last_runs(self, key: int, n: int = 20, *, before: int | None = None) -> list[Record]:
        """The newest ``n`` runs of job ``key`` scheduled before ``before`` (all when None),
        newest first. One reverse range scan of n entries."""
        check_i64(key=key, before=before)
        hi = _bound(key, codec.I64_MAX + 1 if before is None else before)
        lo = codec.i64(key) + codec.LOW8
        return [self._decode(v[1:]) for _k, v in self._scan(_RUNS, lo, hi, limit=n, reverse=True)]

    def history(self, key: int, n: int = 50, *, before: int | None = None) -> list[Record]:
        """The newest ``n`` history entries (``skip`` records by their first time, ``note``
        records by their run's time) of job ``key`` before ``before``, newest first. One
        reverse range scan."""
        check_i64(key=key, before=before)
        hi = _bound(key, codec.I64_MAX + 1 if before is None else before)
        lo = codec.i64(key) + codec.LOW8
        return [self._decode(v) for _k, v in self._scan(_HISTORY, lo, hi, limit=n, reverse=True)]

    def history_page(
        self, key: int, n: int = 256, *, cursor: bytes | None = None
    ) -> tuple[list[Record], bytes | None]:
        """A page of job ``key``'s history, newest first: up to ``n`` entries stored below
        ``cursor`` (from the newest when None), and the cursor of the next page (None when
        this one reached the oldest entry). One reverse range scan.

        Paged by the stored key, not by time, because many entries share a time (a skip and
        the notes of a run, several notes of one run): a page that ended inside such a group
        and went on "before" its time left the rest of the group out. Raises
        :class:`StoreUsageError` for a cursor that is not one this method returned for
        ``key``.
        """
        check_i64(key=key)
        if n < 1:
            raise StoreUsageError(f"history_page: n must be at least 1, not {n}")
        lo = codec.i64(key) + codec.LOW8
        if cursor is None:
            hi = _bound(key, codec.I64_MAX + 1)
        elif (
            not isinstance(cursor, bytes)
            or len(cursor) != _HISTORY_KEY_BYTES
            or not cursor.startswith(codec.i64(key))
        ):
            raise StoreUsageError(f"history_page: {cursor!r} is not a cursor of job {key}")
        else:
            hi = cursor
        page = self._scan(_HISTORY, lo, hi, limit=n, reverse=True)
        records = [self._decode(v) for _k, v in page]
        return records, (page[-1][0] if len(page) == n else None)

    def run_count(self, key: int) -> int:
        """Runs stored for job ``key`` (what count retention trims). One get. The count is
        updated in place, so a reader on another thread than the writer's may see it a moment
        before the runs of the same write (retention, under the store's lock, never does)."""
        raw = self._get(_NRUNS, codec.i64(key))
        return 0 if raw is None else codec.read_u64(raw)

    def _scan(
        self,
        cf: int,
        lo: bytes,
        hi: bytes | None,
        *,
        limit: int | None = None,
        reverse: bool = False,
    ) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (key, value) pairs with ``lo <= key < hi``, ascending or (with
        ``reverse``) descending. Bounds are checked here: rocksdict's iterator honours only
        the upper bound of its read options."""
        self._db_open()
        opts = ReadOptions()
        if hi is not None:
            opts.set_iterate_upper_bound(hi)
        it = self._cf[cf].iter(opts)
        out: list[tuple[bytes, bytes]] = []
        try:
            if reverse:
                it.seek_to_last()  # the upper bound makes this the last key below hi
                step = it.prev
            else:
                it.seek(lo)
                step = it.next
            while it.valid() and (limit is None or len(out) < limit):
                k: bytes = it.key()
                if k < lo:
                    break
                if hi is not None and k >= hi:
                    break
                out.append((k, it.value()))
                step()
            it.status()  # iterators stop silently on a checksum failure; this raises it
        except Exception as exc:
            raise translate(exc, path=self.path, doing=f"scanning {COLUMN_FAMILIES[cf]}") from exc
        finally:
            del it
        return out

    # ================================================================= recovery

    def load(self) -> Recovered:
        """What recovery needs: the newest snapshot (arrays read in a few large values into
        fresh writable numpy arrays), the log tail after it (lazy, in order), the epoch and the
        counts. Cost: the snapshot's bytes read once and copied once; the tail is read as it
        is consumed, a page of batches at a time.

        Raises :class:`Corrupt` when a snapshot's chunks do not add up to its arrays or a log
        entry cannot be decoded (the tail raises it when it reaches the entry).
        """
        self._db_open()
        try:
            snapshot = self._read_snapshot() if self._snapshot_seq >= 0 else None
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # (column families in locals: see open)
            raise
        return Recovered(
            epoch=self.epoch,
            previous_epoch=self.previous_epoch,
            snapshot=snapshot,
            snapshot_seq=self._snapshot_seq,
            last_seq=self._last_seq,
            counts=self.counts,
            tail=self._tail(self._snapshot_seq + 1),
        )

    def log_batches(self, start: int = 1) -> Iterator[tuple[int, int, int, list[Record]]]:
        """``(seq, batch id, epoch, records)`` of every logged batch from ``start`` on, in
        order; a page of the log per iterator (none stays open between pages). Batches the
        snapshot covers are gone, even those that share a log entry with later ones."""
        start = max(start, self._snapshot_seq + 1, 0)
        seq = start
        while True:
            page = self._scan(_LOG, codec.u64(seq), None, limit=_TAIL_PAGE)
            for k, v in page:
                last = codec.read_u64(k)
                try:
                    entry = codec.unpack(v)
                    # a group: [[id, epoch, records], ...]; one batch: [id, epoch, records]
                    group = entry if isinstance(entry[0], list) else [entry]
                    first = last - len(group) + 1
                    batches = [
                        (s, batch_id, epoch, records)
                        for s, (batch_id, epoch, records) in enumerate(group, first)
                        if s >= start
                    ]
                except Exception as exc:
                    raise Corrupt(
                        f"log entry {last} cannot be decoded: {exc}", path=self.path
                    ) from exc
                yield from batches
            if len(page) < _TAIL_PAGE:
                return
            seq = codec.read_u64(page[-1][0]) + 1

    def _tail(self, start: int) -> Iterator[Record]:
        for _seq, _batch, _epoch, records in self.log_batches(start):
            yield from records

    # ================================================================= snapshots

    def write_snapshot(
        self, log_seq: int, arrays: Mapping[str, np.ndarray[Any, Any]], meta: Mapping[str, Any]
    ) -> int:
        """Store a snapshot reflecting every batch up to log position ``log_seq``, then delete
        the log up to it and every older snapshot (range deletes). Returns the bytes written.

        The arrays go to one SST file (each cut into raw values of at most 4 MiB, with dtype
        and shape in the snapshot's meta value), ingested atomically: a crash leaves either the
        whole snapshot or none. The log range and older snapshots are then deleted in one
        synced write; until then, :meth:`load` ignores log entries the snapshot covers.

        Raises :class:`InvalidSnapshot` for an object (or otherwise unserialisable) array, a
        name that is not a non-empty str without NUL, ``meta`` msgpack cannot encode, or a
        ``log_seq`` beyond the log or not newer than the stored snapshot. Cost: the arrays'
        bytes written once (plus one copy per chunk).
        """
        with self._snapshot_lock:
            self._check_writable()
            if not isinstance(log_seq, int) or not 0 <= log_seq <= self._last_seq:
                raise InvalidSnapshot(
                    f"log position {log_seq!r} was never handed out (last is {self._last_seq})",
                    path=self.path,
                )
            if log_seq <= self._snapshot_seq:
                raise InvalidSnapshot(
                    f"a snapshot at log position {self._snapshot_seq} is stored; {log_seq} is not "
                    "newer",
                    path=self.path,
                )
            entries, doc = _snapshot_entries(log_seq, arrays, meta, self.path)
            tmp = os.path.join(self.path, f"snapshot-{log_seq}.sst.tmp")
            written = 0
            try:
                writer = SstFileWriter(_snapshot_options())
                writer.open(tmp)
                for key, value in entries:
                    writer[key] = value
                    written += len(value)
                writer[codec.u64(log_seq) + b"m"] = doc
                written += len(doc)
                writer.finish()
                del writer
                _fsync_path(tmp)
                ingest = IngestExternalFileOptions()
                ingest.set_move_files(True)
                self._cf[_SNAPSHOT].ingest_external_file([tmp], ingest)
                _fsync_dir(self.path)
            except StoreError:
                raise
            except Exception as exc:
                raise translate(exc, path=self.path, doing=f"writing snapshot {log_seq}") from exc
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            with self._lock:
                self._check_writable()
                self._snapshot_seq = log_seq
                wb = WriteBatch(raw_mode=True)
                wb.delete_range(codec.u64(0), codec.u64(log_seq + 1), self._h[_LOG])
                wb.delete_range(codec.u64(0), codec.u64(log_seq), self._h[_SNAPSHOT])
                self._commit(wb, f"deleting the log up to snapshot {log_seq}")
            return written

    def _read_snapshot(self) -> Snapshot:
        seq = self._snapshot_seq
        cf = self._cf[_SNAPSHOT]
        raw = self._get(_SNAPSHOT, codec.u64(seq) + b"m")
        if raw is None:
            raise Corrupt(f"snapshot {seq} has no meta value", path=self.path)
        try:
            doc = codec.unpack(raw)
            described: dict[str, list[Any]] = doc["arrays"]
            meta: dict[str, Any] = doc["meta"]
        except Exception as exc:
            raise Corrupt(f"snapshot {seq}: meta cannot be decoded: {exc}", path=self.path) from exc
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for name, (descr, shape, nbytes, chunks) in described.items():
            try:
                dtype = descr_to_dtype(descr)
                out = np.empty(tuple(shape), dtype=dtype)
            except Exception as exc:
                raise Corrupt(f"snapshot {seq}, array {name!r}: {exc}", path=self.path) from exc
            flat = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
            if flat.size != nbytes:
                raise Corrupt(
                    f"snapshot {seq}, array {name!r}: shape {shape} is {flat.size} bytes, "
                    f"stored {nbytes}",
                    path=self.path,
                )
            prefix = codec.u64(seq) + b"a" + name.encode() + b"\0"
            offset = 0
            for i in range(chunks):
                try:
                    value = cf.get(prefix + codec.u32(i))
                except Exception as exc:
                    raise translate(exc, path=self.path, doing=f"reading snapshot {seq}") from exc
                if value is None or offset + len(value) > nbytes:
                    raise Corrupt(
                        f"snapshot {seq}, array {name!r}: chunk {i} missing or too long",
                        path=self.path,
                    )
                flat[offset : offset + len(value)] = np.frombuffer(value, np.uint8)
                offset += len(value)
                del value
            if offset != nbytes:
                raise Corrupt(
                    f"snapshot {seq}, array {name!r}: {offset} of {nbytes} bytes stored",
                    path=self.path,
                )
            arrays[name] = out
        return Snapshot(arrays=arrays, meta=meta)

    # ================================================================= retention

    def retain(
        self, now_ms: int, policy: Retention = Retention(), *, max_entries: int = 100_000
    ) -> RetentionReport:
        """Delete old run history by ranges: runs, their skips, notes and logs.

        By age: visits the time index from its start up to ``now_ms - max_age_ms`` (at most
        ``max_entries`` entries: O(expired), never the whole store), and per job found deletes
        its runs, history and logs before the cutoff with a few range deletes. By count: for
        jobs given new runs since the last call, or left over the limit by it, whose stored run
        count exceeds ``max_runs_per_job``, deletes the oldest excess (O(deleted) reads); once
        after each open it also sweeps every job's count, ``max_entries`` a call (``more``
        set until done). Runs not in a final
        state are kept (ranges are split around them), and so is each job's newest run (the
        greatest scheduled time), with its history and logs, whatever its age: a job's last
        status stays visible, and ``has_run`` still knows a one-shot's time that ran (a create
        naming it again must not owe it twice: the run id is the task's idempotency key).

        The time index stays O(expired): an age pass that keeps a job's newest run leaves it
        out of the index (and marks the job's run count so): a job whose last run is old is
        not visited again pass after pass. A newer run of the job indexes it again in its own
        write (:meth:`_account`), so that it ages out as any run once superseded.

        Each pass is one write, not synced (deletion is idempotent: a crash only means it is
        done again). Serialised with writes. Raises :class:`StoreUsageError` for
        ``max_entries`` or ``max_runs_per_job`` below 1 or a negative ``max_age_ms``.
        """
        if max_entries < 1:
            raise StoreUsageError(f"max_entries must be at least 1, got {max_entries}")
        if policy.max_runs_per_job is not None and policy.max_runs_per_job < 1:
            # (the newest run always stays: a cap of 0 would be a promise not kept)
            raise StoreUsageError(
                f"max_runs_per_job must be at least 1, got {policy.max_runs_per_job}"
            )
        if policy.max_age_ms is not None and policy.max_age_ms < 0:
            raise StoreUsageError(f"max_age_ms must be at least 0, got {policy.max_age_ms}")
        report = RetentionReport()
        with self._lock:
            self._check_writable()
            # Each pass its own write: the count pass scans the runs family, which must no
            # longer hold what the age pass deleted (in one write it counted those twice, and
            # left the per-job counts low for good).
            nruns: dict[int, int]
            unindexed: dict[int, int]
            if policy.max_age_ms is not None:
                wb, nruns, unindexed = WriteBatch(raw_mode=True), {}, {}
                self._log_drops, self._logs_marked = [], []
                self._retain_by_age(
                    wb, now_ms - policy.max_age_ms, max_entries, report, nruns, unindexed
                )
                self._write_retention(wb, nruns, unindexed)
            if policy.max_runs_per_job is not None:
                wb, nruns = WriteBatch(raw_mode=True), {}
                self._log_drops, self._logs_marked = [], []
                touched, self._touched = self._touched, set()
                count_from = self._count_from
                try:
                    over = self._retain_by_count(
                        wb, policy.max_runs_per_job, touched, max_entries, report, nruns
                    )
                    self._write_retention(wb, nruns, {})
                except BaseException:
                    # Nothing deleted: its jobs, and its page of the sweep, next call.
                    self._touched |= touched
                    self._count_from = count_from
                    raise
                # Still over the limit (runs kept in flight, which may end any time): again
                # next call, though no new run comes.
                self._touched |= over
        return report

    def _write_retention(
        self, wb: WriteBatch, nruns: dict[int, int], unindexed: dict[int, int]
    ) -> None:
        """One retention pass's deletions and the run counts they leave, in one write.
        ``nruns``: the new run count of jobs that lost runs; ``unindexed``: the newest run
        time of jobs whose newest run the pass left out of the time index."""
        jobs = sorted(nruns.keys() | unindexed.keys())
        if jobs:
            stored = self._multiget(self._cf[_NRUNS], [codec.i64(j) for j in jobs])
            for job, raw in zip(jobs, stored, strict=True):
                n, newest, flag = [0, _UNKNOWN_AT, 0] if raw is None else _job_runs_state(raw)
                if job in nruns:
                    n = max(0, nruns[job])  # (never below zero, whatever went before)
                if job in unindexed:
                    # The newest stored run (never deleted, so also the newest ever stored
                    # but in a store whose older retention deleted newer ones: no run after
                    # it is held, which is all this time promises).
                    newest, flag = unindexed[job], 1
                # else keep the newest run time: deleting runs does not make older times new
                wb.put(codec.i64(job), _job_runs_value(n, newest, flag), self._h[_NRUNS])
        drops, self._log_drops = self._log_drops, []
        marked, self._logs_marked = self._logs_marked, []
        own = self._own_logs
        for job, lo, hi in drops:  # (another store's) first: never logs without their runs
            try:
                self.logs.drop(job, lo, hi)
            except StoreError:
                raise
            except Exception as exc:  # typed, as every failure of a pass
                raise translate(exc, path=self.path, doing="dropping run logs") from exc
        if len(wb):
            if own is not None:
                # Under the log store's lock too (taken after the store's; an append takes
                # only it), for the write alone: an append between its read of a run's log
                # state and its write would otherwise bring a dropped run's logs back (see
                # RocksLogStore.exclusive). Not for the pass: appends come from the node's
                # event loop, which must not wait for a scan.
                with own.exclusive:
                    for job, at in marked:
                        own.mark_dropped_into(wb, job, at)
                    self._commit(wb, "deleting old run history", sync=False)
            else:
                self._commit(wb, "deleting old run history", sync=False)
            # Deleted runs are never held again; forget what the caches say of them.
            self._run_cls = {}
            for job in jobs:
                self._job_runs.pop(job, None)

    def _retain_by_age(
        self,
        wb: WriteBatch,
        cutoff: int,
        max_entries: int,
        report: RetentionReport,
        nruns: dict[int, int],
        unindexed: dict[int, int],
    ) -> None:
        index_from = self._age_from or codec.LOW8 * 2
        self._age_from = None
        entries = self._scan(_BYTIME, index_from, codec.i64(cutoff), limit=max_entries + 1)
        if not entries:
            return
        index_end = codec.i64(cutoff) + codec.LOW8
        if len(entries) > max_entries:
            # Stop here; the index is deleted up to the last entry visited, no further, and
            # the next call goes on from there (found by review: runs kept in flight, indexed
            # again at their own time, filled every call when there were max_entries of
            # them, and the node's loop while ``more`` never ended).
            report.more = True
            entries = entries[:max_entries]
            index_end = entries[-1][0] + b"\0"
            self._age_from = index_end
        jobs = sorted({codec.read_i64(k, 8) for k, _ in entries})
        kept: list[tuple[int, int]] = []
        for job in jobs:
            raw = self._get(_NRUNS, codec.i64(job))
            stored, newest_ever, _flag = (
                [0, _UNKNOWN_AT, 0] if raw is None else _job_runs_state(raw)
            )
            n_before = nruns[job] if job in nruns else stored
            deleted, keep, newest = self._drop_runs(
                wb, job, before=cutoff, max_runs=None, report=report, newest_ever=newest_ever
            )
            if deleted:
                nruns[job] = n_before - deleted
            # (keep: the times to index the kept runs at: in flight, their own; ended after
            # the cutoff, their end, when a later pass finds them of age)
            kept.extend((at, job) for at in keep)
            if newest is not None:
                # Out of the index from now on (the range delete below): see retain().
                unindexed[job] = newest
        # The index up to the cutoff goes in one range; runs still in flight are indexed again
        # (the put follows the range delete in the batch, so it survives it).
        wb.delete_range(index_from, index_end, self._h[_BYTIME])
        for at, job in kept:
            wb.put(codec.i64(at) + codec.i64(job), _EMPTY, self._h[_BYTIME])

    def _retain_by_count(
        self,
        wb: WriteBatch,
        limit: int,
        touched: set[int],
        max_entries: int,
        report: RetentionReport,
        nruns: dict[int, int],
    ) -> set[int]:
        """Trim the jobs of ``touched`` (and of this call's page of the sweep after an open)
        whose run count exceeds ``limit``; returns those left over it."""
        if self._count_from is not None:
            page = self._scan(_NRUNS, self._count_from, None, limit=max_entries + 1)
            if len(page) > max_entries:
                self._count_from = page[max_entries][0]
                page = page[:max_entries]
                report.more = True
            else:
                self._count_from = None
            touched = touched | {codec.read_i64(k) for k, v in page if codec.read_u64(v) > limit}
        over: set[int] = set()
        if not touched:
            return over
        order = sorted(touched)
        stored = self._multiget(self._cf[_NRUNS], [codec.i64(j) for j in order])
        for job, raw in zip(order, stored, strict=True):
            n = nruns.get(job, 0 if raw is None else codec.read_u64(raw))
            if n <= limit:
                continue
            # (the count pass leaves the time index alone: a kept newest keeps its entry, and
            # the deleted runs' entries age out, visiting nothing)
            deleted, _keep, _newest = self._drop_runs(
                wb, job, before=None, max_runs=n - limit, report=report
            )
            if deleted:
                nruns[job] = n - deleted
            if n - deleted > limit:
                over.add(job)
        return over

    def _drop_logs(self, wb: WriteBatch, job: int, lo: int, hi: int) -> None:
        """The logs of job ``job``'s runs in ``[lo, hi)`` go with the pass's write: in it (the
        local store's, atomically), or just before it (another store's)."""
        own = self._own_logs
        if own is not None:
            own.drop_into(wb, job, lo, hi)
        else:
            self._log_drops.append((job, lo, hi))

    def _drop_runs(
        self,
        wb: WriteBatch,
        job: int,
        *,
        before: int | None,
        max_runs: int | None,
        report: RetentionReport,
        newest_ever: int = _UNKNOWN_AT,
    ) -> tuple[int, list[int], int | None]:
        """Delete job ``job``'s oldest runs — those scheduled before ``before`` that ended
        before it too, or the oldest ``max_runs`` — with their history and logs, as ranges
        split around the runs kept: those not in a final state, those that ended at or after
        ``before`` (their record's ``end``: a one-shot long past run now is young), and the
        job's newest run when it is among those visited; counted in ``report``. Returns (runs
        deleted, the times to index the runs kept at: an in-flight run's own, a young run's
        end; the time of the newest run kept or None).
        The age pass keeps only the record of a final newest run: its history and logs go
        (``has_run`` needs the record alone), the logs leaving a marker of their bytes. O(runs visited), plus one seek past them to
        learn whether the last is the newest, unless ``newest_ever`` (the newest time the
        job's run count holds, an upper bound of every stored run's) already says so."""
        job_end = _bound(job, codec.I64_MAX + 1)
        first = codec.i64(job) + codec.LOW8
        if max_runs is not None:
            # One more than asked: when fewer come, the last visited is the job's newest.
            runs = self._scan(_RUNS, first, job_end, limit=max_runs + 1)
            if not runs:
                return 0, [], None
            last_is_newest = len(runs) <= max_runs
            runs = runs[:max_runs]
            end = codec.read_i64(runs[-1][0], 8) + 1  # just past the newest run visited
        else:
            assert before is not None
            runs = self._scan(_RUNS, first, _bound(job, before))
            last_is_newest = bool(runs) and (
                newest_ever < before or not self._scan(_RUNS, _bound(job, before), job_end, limit=1)
            )
            end = before
        keep: list[int] = []
        aged: list[int] = []
        newest: int | None = None
        # Skip records filed before the cutoff (by their first time) that cover a time at or
        # after it: the ranges below delete them, and they are put back after (found by
        # review: the record of a 40-day pause, written at the resume, went at the next pass
        # with the 30 days of it inside the age). Indexed again at their last time.
        young_skips: list[tuple[bytes, bytes]] = []
        if before is not None:
            for k, v in self._scan(_HISTORY, first, _bound(job, before)):
                entry = self._decode(v)
                if entry.get("t") == "skip" and entry["hi"] >= before:
                    young_skips.append((k, v))
                    keep.append(entry["hi"])
        start = codec.I64_MIN
        segments: list[tuple[int, int]] = []
        deleted = 0
        for i, (k, v) in enumerate(runs):
            at = codec.read_i64(k, 8)
            record = None if before is None else self._decode(v[1:])
            ended = None if record is None else record.get("end")
            if isinstance(ended, int) and before is not None and ended >= before:
                keep.append(ended)  # ended within the age: whole, looked at again then
                report.kept_recent += 1
            elif last_is_newest and i == len(runs) - 1:
                if before is None:
                    newest = at  # the count pass: whatever its state, it stays
                elif record is not None and record.get("state") in FINAL_VALUES:
                    newest = at  # past the age: its record stays, its history goes
                    aged.append(at)
                else:
                    keep.append(at)  # in flight: kept and indexed again, as any run in flight
                    report.kept_in_flight += 1
            else:
                state = (record if record is not None else self._decode(v[1:])).get("state")
                if state in FINAL_VALUES:
                    deleted += 1
                    continue
                keep.append(at)
                report.kept_in_flight += 1
            if start < at:
                segments.append((start, at))
            start = at + 1
        if start < end:
            segments.append((start, end))
        for lo, hi_t in segments:
            a, b = _bound(job, lo), _bound(job, hi_t)
            if deleted:
                wb.delete_range(a, b, self._h[_RUNS])
            wb.delete_range(a, b, self._h[_HISTORY])
            self._drop_logs(wb, job, lo, hi_t)
            report.ranges += 1
        for at in aged:
            a, b = _bound(job, at), _bound(job, at + 1)
            wb.delete_range(a, b, self._h[_HISTORY])
            self._drop_logs(wb, job, at, at + 1)
            if self._own_logs is not None:
                self._logs_marked.append((job, at))
        for k, v in young_skips:  # (after the range deletes of this batch: they survive them)
            wb.put(k, v, self._h[_HISTORY])
        report.runs_deleted += deleted
        if deleted:
            report.jobs_trimmed += 1
        if newest is not None:
            report.kept_newest += 1
        return deleted, keep, newest


# ===================================================================== helpers


def _went_out(run: Record) -> bool:
    """A run record of a run that was claimed at least once (its token, or a later attempt)."""
    return bool(run.get("tok")) or run.get("att", 1) > 1


def _job_ticket_fields(raw: bytes) -> tuple[int, str, Any]:
    """``(version, spec["id"], spec["task"])`` of a stored job value (msgpack ``[version,
    spec, id]``), as a full decode would give them: the spec's entries are walked and every
    other value skipped undecoded (a stored spec puts ``id`` and ``task`` among its first
    keys, so the walk usually stops after three). Anything unexpected (not a three-item
    array, a spec that is not a map or lacks a field) falls back to the full decode, which
    raises as :meth:`ShardStore.latest`'s readers would."""
    unpacker = msgpack.Unpacker(None, raw=False, strict_map_key=False)
    unpacker.feed(raw)
    try:
        if unpacker.read_array_header() == 3:
            version = unpacker.unpack()
            job_id: Any = _MISSING
            task: Any = _MISSING
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                if name == "id":
                    job_id = unpacker.unpack()
                elif name == "task":
                    task = unpacker.unpack()
                else:
                    unpacker.skip()
                if job_id is not _MISSING and task is not _MISSING:
                    return version, job_id, task
    except (ValueError, TypeError, msgpack.UnpackException):
        pass  # the full decode below says what is wrong
    version, spec, _id = codec.unpack(raw)
    return version, spec["id"], spec["task"]


_MISSING: Final = object()


# A history key: job key, time, epoch, batch id, record index (wal.route).
_HISTORY_KEY_BYTES: Final = 8 + 8 + 8 + 8 + 4


_bound: Final = codec.job_bound


def _db_options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    # A torn record at the end of RocksDB's log (a crash mid-write of a batch nobody was told
    # about) is dropped; corruption anywhere else refuses to open instead of silently cutting
    # the log short and losing acknowledged batches after it (the default, point-in-time).
    opts.set_wal_recovery_mode(DBRecoveryMode.tolerate_corrupted_tail_records())
    opts.set_paranoid_checks(True)
    opts.set_keep_log_file_num(4)
    # Required by in-place updates (the nruns family, see _cf_options); one thread writes
    # anyway (the group committer, under the store's lock).
    opts.set_allow_concurrent_memtable_write(False)
    return opts


def _snapshot_options() -> Options:
    # Snapshot values are large raw columns: no compression (recovery reads them at memory
    # speed) and no block cache (megabyte values read once would only evict everything else).
    opts = Options(raw_mode=True)
    opts.set_compression_type(DBCompressionType.none())
    table = BlockBasedOptions()
    table.disable_cache()
    opts.set_block_based_table_factory(table)
    return opts


def _cf_options() -> dict[str, Options]:
    out = {name: Options(raw_mode=True) for name in COLUMN_FAMILIES}
    for options in out.values():
        # Memtables of 4 MiB, not 64: every record lands at a random place in the runs,
        # time-index and run-count skip lists, and inserting into a small one (in cache) costs
        # a group's write ~20% less CPU (measured: 10.7 -> 8.5 us a record at 256 a group),
        # held with the GIL; flushing the same bytes in more, smaller files costs no more.
        options.set_write_buffer_size(MEMTABLE_BYTES)
    # Families read by point lookups (the directory, and every write's look at what a key
    # held before) get bloom filters: a new run's lookup is a miss, and a miss should not
    # search every file.
    for name in ("jobs", "index", "pos", "runs", "nruns"):
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        out[name].set_block_based_table_factory(table)
    # A job's run count is rewritten with every new run (once a group): updated in place in
    # the memtable (same size), not stacked as one more version per write, which kept the
    # skip list growing with versions of the same few keys (measured: a group's write ~15%
    # less CPU at 256 one-run batches). The price: a reader may see a count a moment before
    # the runs of its group (see run_count).
    out["nruns"].set_inplace_update_support(True)
    out["snapshot"] = _snapshot_options()
    return out


def _snapshot_entries(
    seq: int, arrays: Mapping[str, np.ndarray[Any, Any]], meta: Mapping[str, Any], path: str
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The sorted chunk entries of a snapshot and its meta value; checks every input."""
    described: dict[str, list[Any]] = {}
    entries: list[tuple[bytes, bytes]] = []
    for name in sorted(arrays, key=lambda n: n.encode() if isinstance(n, str) else b""):
        array = arrays[name]
        if not isinstance(name, str) or not name or "\0" in name:
            raise InvalidSnapshot(f"array name {name!r} must be a non-empty str without NUL")
        if not isinstance(array, np.ndarray):
            raise InvalidSnapshot(f"array {name!r} is a {type(array).__name__}, not an ndarray")
        if array.dtype.hasobject:
            raise InvalidSnapshot(f"array {name!r} holds Python objects ({array.dtype})")
        if not array.flags.c_contiguous:  # (not ascontiguousarray: it makes 0-d arrays 1-d)
            array = array.copy(order="C")
        flat = array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)
        prefix = codec.u64(seq) + b"a" + name.encode() + b"\0"
        chunks = 0
        for start in range(0, flat.size, SNAPSHOT_CHUNK_BYTES):
            entries.append(
                (prefix + codec.u32(chunks), flat[start : start + SNAPSHOT_CHUNK_BYTES].tobytes())
            )
            chunks += 1
        described[name] = [dtype_to_descr(array.dtype), list(array.shape), flat.size, chunks]
    try:
        doc = codec.pack({"seq": seq, "arrays": described, "meta": dict(meta)})
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidSnapshot(f"snapshot meta cannot be encoded: {exc}", path=path) from exc
    return entries, doc


def _clear_frames_of(exc: BaseException) -> None:
    """Drop the locals of the finished frames of ``exc``'s traceback and of the exceptions it
    was raised from (``traceback.clear_frames`` leaves a frame still executing alone)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
