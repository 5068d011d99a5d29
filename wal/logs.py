"""Run logs: stdout/stderr chunks per run, capped, read back in order and paged.

Owns the :class:`LogStore` interface (small, so that an object store can replace the local
default later) and its local default, :class:`RocksLogStore`, which keeps chunks in the shard's
RocksDB ``logs`` column family. A run keeps at most ``head_bytes`` of its first output and the
last ``tail_bytes`` of the rest; what falls in between is dropped and a reader sees one ``cut``
marker saying how many bytes were dropped. Must never decide when a run's logs go: the shard
store drops them together with the run (retention), never on its own.

Keys: ``i64 job key | i64 scheduled ms | u32 chunk seq``; seq 0 holds the run's log state
(msgpack), chunks start at 1, so a run's chunks are one contiguous range and dropping a run's
logs (or a whole job's, or a time range of it) is one ``delete_range``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from wal import codec
from wal.errors import StoreUsageError, check_i64, decoded, translate

#: Stream names on the wire, and their one-byte codes in a stored chunk.
STREAMS: Final = ("stdout", "stderr")
_STREAM_CODE: Final = {"stdout": 1, "stderr": 2}
_CODE_STREAM: Final = {1: "stdout", 2: "stderr"}
CUT: Final = "cut"
_HEADER: Final = 5  # stream code (1 byte) + attempt (u32)


@dataclass(frozen=True)
class LogLimits:
    """Per-run caps. Defaults: the first 64 KiB and the last 960 KiB (1 MiB per run)."""

    head_bytes: int = 64 * 1024
    tail_bytes: int = 960 * 1024

    def __post_init__(self) -> None:
        if self.head_bytes < 0 or self.tail_bytes < 1:
            raise StoreUsageError(
                f"log limits need head_bytes >= 0 and tail_bytes >= 1, got {self}"
            )


@dataclass(frozen=True)
class LogChunk:
    """One piece of a run's output, in order. ``stream`` is ``stdout``, ``stderr`` or ``cut``
    (the marker where bytes were dropped: ``dropped`` says how many, ``data`` is empty).
    ``seq`` is the chunk's position (a marker carries the position it stands at)."""

    seq: int
    stream: str
    attempt: int
    data: bytes
    dropped: int = 0


@dataclass(frozen=True)
class LogPage:
    """A page of chunks; ``cursor`` is where the next page starts; ``at_end`` says nothing more
    is stored right now (a running task may still append)."""

    chunks: list[LogChunk]
    cursor: int
    at_end: bool


class LogStore(Protocol):
    """Where run output goes. ``key``/``at`` name a run (job key, scheduled ms)."""

    def append(
        self,
        key: int,
        at: int,
        stream: str,
        data: bytes,
        *,
        attempt: int = 1,
        offset: int | None = None,
    ) -> None:
        """Add ``data`` to the run's output, keeping it within the run's cap. ``offset``: where
        ``data`` starts in the attempt's output (all its streams, in the order sent); bytes
        below what the attempt already has are a resend and are dropped. None: no check."""
        ...

    def read(
        self, key: int, at: int, *, cursor: int = 0, limit: int = 64, max_bytes: int = 1 << 20
    ) -> LogPage:
        """Chunks from ``cursor`` on, in order: at most ``limit`` chunks and about
        ``max_bytes`` (always at least one chunk when any is left)."""
        ...

    def drop(self, key: int, lo: int, hi: int) -> None:
        """Forget the output of job ``key``'s runs scheduled in ``[lo, hi)`` (``hi`` may be
        ``2**63``: everything from ``lo`` on). Idempotent: retention may ask it again."""
        ...

    def close(self) -> None:
        """Let go of what it holds; called once, by the shard store's close."""
        ...


# The run's log state at seq 0: [next seq, total bytes received, head bytes, last head seq,
# tail bytes, first live tail seq (0 until the tail starts), bytes dropped, and (once an append
# carried an offset) a flat list [attempt, bytes of it received, ...]]. States written before
# the last entry existed have 7 entries; they read the same.
_NEXT, _TOTAL, _HEAD, _HEND, _TAIL, _TFIRST, _DROPPED, _RECEIVED = range(8)
_SEQ_MASK: Final = (1 << 32) - 1  # a cursor's seq bits
#: attempts whose received byte count a run's state keeps (the newest ones)
_MAX_TRACKED_ATTEMPTS: Final = 16


def _prefix(key: int, at: int) -> bytes:
    check_i64(key=key, at=at)
    return codec.i64(key) + codec.i64(at)


class RocksLogStore:
    """The local :class:`LogStore`: chunks in the shard's RocksDB ``logs`` column family.

    Appends are written without their own fsync (RocksDB's log, so they survive a crash of the
    process but not of the machine) — until the next synced write of the shard: RocksDB's
    write-ahead log is one file, so the group commit that makes a run's final state durable
    makes every chunk appended before it durable too. An append costs O(1) reads and writes
    amortised (an evicted tail chunk is read once to learn its length); a read of a page is one
    forward range scan. Thread-safe: one lock serialises appends, drops and reads.

    Failure modes: :class:`~wal.errors.StoreUsageError` for an unknown stream or a bad cursor;
    a typed :class:`~wal.errors.StoreFailure` when RocksDB fails (nothing half-appended: each
    append is one write batch).
    """

    def __init__(
        self,
        db: Rdict,
        cf: Rdict,
        path: str,
        limits: LogLimits = LogLimits(),
        guard: Callable[[], None] | None = None,
    ) -> None:
        """``guard``, called before every read and write of the database, raises when the
        shard store no longer serves it (closed, or failed: a failed write's data may be in
        the database without its fsync, and nothing may rest on it)."""
        self._guard = guard
        self._db = db
        self._cf = cf
        self._handle = db.get_column_family_handle("logs")
        self._path = path
        self.limits = limits
        self._lock = threading.Lock()
        self._nosync = WriteOptions()
        self._nosync.sync = False

    def close(self) -> None:
        """Drop every reference to RocksDB objects (the store's close releases the LOCK only
        once nothing holds the database)."""
        self._db = self._cf = self._handle = None  # type: ignore[assignment]

    # ------------------------------------------------------------------------ writing

    def append(
        self,
        key: int,
        at: int,
        stream: str,
        data: bytes,
        *,
        attempt: int = 1,
        offset: int | None = None,
    ) -> None:
        code = _STREAM_CODE.get(stream)
        if code is None:
            raise StoreUsageError(f"unknown log stream {stream!r} (expected one of {STREAMS})")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise StoreUsageError(f"log data must be bytes, got {type(data).__name__}")
        if not 0 <= attempt < 1 << 32:
            raise StoreUsageError(f"attempt {attempt} out of range")
        data = bytes(data)
        if offset is not None and not 0 <= offset <= (1 << 63) - 1 - len(data):
            # (past 63 bits the stored counts cannot be encoded: found by review, an
            # OverflowError answered as the node's own bug)
            raise StoreUsageError(
                f"offset {offset} out of range (0..2**63-1 less the data's {len(data)} bytes)"
            )
        if not data:
            return
        head_cap, tail_cap = self.limits.head_bytes, self.limits.tail_bytes
        header = bytes((code,)) + codec.u32(attempt)
        prefix = _prefix(key, at)
        with self._lock:
            raw = self._get(prefix + codec.u32(0))
            state: list[Any] = (
                [1, 0, 0, 0, 0, 0, 0]
                if raw is None
                else decoded(raw, path=self._path, what="a run's log state")
            )
            if offset is not None:
                data = _unseen(state, attempt, offset, data)
                if not data:
                    return  # all of it stored already: a resend whose answer was lost
            batch = WriteBatch(raw_mode=True)
            state[_TOTAL] += len(data)
            if state[_TFIRST] == 0 and state[_HEAD] < head_cap:
                take = min(len(data), head_cap - state[_HEAD])
                batch.put(prefix + codec.u32(state[_NEXT]), header + data[:take], self._handle)
                state[_HEAD] += take
                state[_HEND] = state[_NEXT]
                state[_NEXT] += 1
                data = data[take:]
            if data:
                if state[_TFIRST] == 0:
                    # The tail starts one past the head's next seq: that seq is where the cut
                    # marker stands, so a reader's cursor never confuses it with a chunk.
                    state[_NEXT] = state[_HEND] + 2
                    state[_TFIRST] = state[_NEXT]
                if len(data) > tail_cap:  # the front of this append alone is already cut
                    state[_DROPPED] += len(data) - tail_cap
                    data = data[-tail_cap:]
                new_seq = state[_NEXT]
                batch.put(prefix + codec.u32(new_seq), header + data, self._handle)
                state[_TAIL] += len(data)
                state[_NEXT] += 1
                self._evict(batch, prefix, state, new_seq, tail_cap)
            batch.put(prefix + codec.u32(0), codec.pack(state), self._handle)
            self._write(batch, f"appending to the log of run {key}@{at}")

    def _evict(
        self, batch: WriteBatch, prefix: bytes, state: list[int], newest: int, cap: int
    ) -> None:
        """Drop the oldest tail bytes until the tail fits ``cap``: whole chunks by one range
        delete, the last one by rewriting its remainder. ``newest`` alone always fits."""
        first_gone = state[_TFIRST]
        while state[_TAIL] > cap:
            seq = state[_TFIRST]
            assert seq < newest, "the newest chunk alone fits the tail"
            raw = self._get(prefix + codec.u32(seq))
            if raw is None:  # a hole cannot happen; tolerate it rather than loop forever
                state[_TFIRST] += 1
                continue
            size = len(raw) - _HEADER
            excess = state[_TAIL] - cap
            if size <= excess:
                state[_TAIL] -= size
                state[_DROPPED] += size
                state[_TFIRST] += 1
            else:
                batch.put(
                    prefix + codec.u32(seq), raw[:_HEADER] + raw[_HEADER + excess :], self._handle
                )
                state[_TAIL] -= excess
                state[_DROPPED] += excess
        if state[_TFIRST] > first_gone:
            batch.delete_range(
                prefix + codec.u32(first_gone), prefix + codec.u32(state[_TFIRST]), self._handle
            )

    def drop(self, key: int, lo: int, hi: int) -> None:
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            self.drop_into(batch, key, lo, hi)
            self._write(batch, f"dropping the logs of job {key} runs in [{lo}, {hi})")

    def mark_dropped_into(self, batch: WriteBatch, key: int, at: int) -> None:
        """After :meth:`drop_into` of run ``at`` in ``batch``: leave the run a log state saying
        that every byte it had was dropped, so that a reader gets one ``cut`` marker of them all
        instead of an empty log, which reads as a task that printed nothing. For a run whose
        record stays while its output goes (the newest run of its job, past the age). Call
        under :attr:`exclusive`: the byte count is read here. A run with no output gets
        nothing. Appends after it (a ``mark``-ed task still writing) follow the marker as its
        tail, as after any cut."""
        prefix = _prefix(key, at)
        raw = self._get(prefix + codec.u32(0))
        if raw is None:
            return
        state: list[Any] = decoded(raw, path=self._path, what="a run's log state")
        total = state[_TOTAL]
        if not total:
            return
        # No head; the marker stands at the run's next seq and the tail starts one past it, so
        # seqs only grow: a follower's cursor (at most the old next seq) is never past a chunk
        # appended after the mark (restarting at seq 2 skipped them: found by review). Every
        # byte received counts as dropped. A resend's dedupe stays.
        tail_first = state[_NEXT] + 1
        dropped: list[Any] = [tail_first, total, 0, 0, 0, tail_first, total]
        if len(state) > _RECEIVED:
            dropped.append(state[_RECEIVED])
        batch.put(prefix + codec.u32(0), codec.pack(dropped), self._handle)

    @property
    def exclusive(self) -> threading.Lock:
        """Held by the shard store around a retention write whose batch drops logs: an append
        that read a run's log state before the drop would otherwise write it back after it,
        and no later pass would find that run's logs again."""
        return self._lock

    def drop_into(self, batch: WriteBatch, key: int, lo: int, hi: int) -> None:
        """Add the deletion of job ``key``'s run logs in ``[lo, hi)`` to ``batch`` (the shard
        store's own batch, so that runs and their logs go in one atomic write). ``hi`` may be
        ``2**63`` (everything from ``lo`` on)."""
        batch.delete_range(_run_bound(key, lo), _run_bound(key, hi), self._handle)

    # ------------------------------------------------------------------------ reading

    def read(
        self, key: int, at: int, *, cursor: int = 0, limit: int = 64, max_bytes: int = 1 << 20
    ) -> LogPage:
        """See :class:`LogStore`. A cursor is opaque: its low 32 bits are the next chunk's seq,
        the high 32 bits where that chunk starts in the run's output (every byte the run
        received, dropped ones too), modulo 2**32. A reader whose next chunk was evicted (or
        cut at its front, or dropped by retention's mark) since it got the cursor gets one
        ``cut`` chunk with the bytes it missed: from its position to the first byte still
        kept, which is always the head plus the total dropped (eviction drops a prefix of the
        tail; a mark drops everything and leaves no head). Exact while a reader misses less
        than 4 GiB between two pages.

        Under the lock appends and retention's writes take: the state and the chunks it
        names are read as one (retention's write runs in a thread; between a state read and
        the scan it could evict the chunks the state names, and the reader lose them without
        a cut: found by review)."""
        if cursor < 0 or cursor >= 1 << 64 or limit < 1 or max_bytes < 1:
            raise StoreUsageError(
                f"bad page request: cursor={cursor} limit={limit} max_bytes={max_bytes}"
            )
        prefix = _prefix(key, at)
        with self._lock:
            raw = self._get(prefix + codec.u32(0))
            if raw is None:
                return LogPage([], cursor, True)
            state: list[Any] = decoded(raw, path=self._path, what="a run's log state")
            out: list[LogChunk] = []
            budget = [max_bytes]
            c, pos = max(cursor & _SEQ_MASK, 1), cursor >> 32
            hend, tfirst = state[_HEND], state[_TFIRST]
            kept_front = state[_HEAD] + state[_DROPPED]  # where the kept tail starts
            if c <= hend:
                c = self._scan(prefix, c, hend + 1, limit, budget, out)
                pos += sum(len(chunk.data) for chunk in out)
            if c == hend + 1:
                pos = state[_HEAD]  # at the head's end: the tail's first byte is next
            if tfirst and c <= tfirst and len(out) < limit and budget[0] > 0:
                missed = (kept_front - pos) % (1 << 32)  # a position at or before the front
                if missed:
                    out.append(LogChunk(c, CUT, 0, b"", missed))
                c, pos = tfirst, kept_front
            if tfirst and c >= tfirst and len(out) < limit and budget[0] > 0:
                taken = len(out)
                c = self._scan(prefix, c, state[_NEXT], limit, budget, out)
                pos += sum(len(chunk.data) for chunk in out[taken:])
            return LogPage(out, c | (pos % (1 << 32)) << 32, c >= state[_NEXT])

    def _scan(
        self, prefix: bytes, lo: int, hi: int, limit: int, budget: list[int], out: list[LogChunk]
    ) -> int:
        """Append stored chunks with seq in ``[lo, hi)`` to ``out`` within the limits; return
        the seq after the last one taken."""
        opts = ReadOptions()
        upper = prefix + codec.u32(hi)
        opts.set_iterate_upper_bound(upper)
        it = self._cf.iter(opts)
        try:
            it.seek(prefix + codec.u32(lo))
            while it.valid():
                k: bytes = it.key()
                if k >= upper:
                    break
                if len(out) >= limit or budget[0] <= 0:
                    return codec.read_u32(k, 16)
                v: bytes = it.value()
                stream = _CODE_STREAM.get(v[0], "?")
                out.append(
                    LogChunk(codec.read_u32(k, 16), stream, codec.read_u32(v, 1), v[_HEADER:])
                )
                budget[0] -= len(v) - _HEADER
                it.next()
            it.status()  # an iterator stops silently on a checksum failure; this raises it
            return hi
        except Exception as exc:
            raise translate(exc, path=self._path, doing="reading run logs") from exc
        finally:
            del it

    # ------------------------------------------------------------------------ plumbing

    def _get(self, key: bytes) -> bytes | None:
        if self._guard is not None:
            self._guard()
        try:
            value: bytes | None = self._cf.get(key)
        except Exception as exc:
            raise translate(exc, path=self._path, doing="reading run logs") from exc
        return value

    def _write(self, batch: WriteBatch, doing: str) -> None:
        if self._guard is not None:
            self._guard()
        try:
            self._db.write(batch, self._nosync)
        except Exception as exc:
            raise translate(exc, path=self._path, doing=doing) from exc


def _unseen(state: list[Any], attempt: int, offset: int, data: bytes) -> bytes:
    """The part of ``data`` (at ``offset`` of ``attempt``'s output) past what the run's
    ``state`` says that attempt already has; records the new end in ``state``. A gap (an
    offset past the end: appends lost with a crash of the machine) is accepted as it is."""
    if len(state) <= _RECEIVED:
        state.append([])
    received: list[int] = state[_RECEIVED]
    end = offset + len(data)
    for i in range(0, len(received), 2):
        if received[i] == attempt:
            have = received[i + 1]
            if end <= have:
                return b""
            received[i + 1] = end
            return data[max(0, have - offset) :]
    received += [attempt, end]
    if len(received) > 2 * _MAX_TRACKED_ATTEMPTS:
        # The oldest attempt goes: it ended long ago (attempts of one run do not overlap for
        # long), so a resend of it is not to be expected.
        oldest = min(range(0, len(received), 2), key=lambda i: received[i])
        del received[oldest : oldest + 2]
    return data


_run_bound: Final = codec.job_bound
