"""Group commit: many producers' batches, one writer, one fsync per group.

Owns the policy of what goes into one durable write (:class:`CommitPolicy`, applied by the pure
:class:`CommitQueue`: FIFO, bounded by batches and bytes, no clocks, no threads) and a thread
driver of it (:class:`GroupCommitter`): producers submit batches from any thread; one writer
thread takes every batch queued while the previous write was being fsynced, writes them with one
:meth:`~wal.store.ShardStore.write_prepared` (one RocksDB write, one fsync), then acknowledges
each. A producer may write what is queued itself when the writer thread is idle
(:meth:`GroupCommitter.write_here`): groups are still taken and written one at a time, in queue
order. The Trio node can drive the same :class:`CommitQueue` with ``trio.to_thread.run_sync``.

Must never acknowledge a batch before the write that holds it returned from its fsync, and never
fsync once per request: a group is everything waiting, up to the policy's bounds.
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.effects import Persist
from wal.errors import StoreClosed, StoreError, StoreIOError
from wal.route import PreparedBatch
from wal.store import ShardStore

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Serialises the creation of a ticket's lock by its first waiters (rare: most tickets are
#: answered by callback, and a waited-for ticket makes its lock once).
_WAITER_LOCK = _thread.allocate_lock()


@dataclass(frozen=True)
class CommitPolicy:
    """How big one group may get. A group is everything queued when the writer becomes free
    (no waiting for more: the fsync in flight is the batching window), cut at ``max_batches``
    batches or ``max_bytes`` encoded bytes (at least one batch, however large)."""

    max_batches: int = 8192
    max_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_batches < 1 or self.max_bytes < 1:
            raise ValueError(f"commit policy bounds must be positive: {self}")


class CommitQueue(Generic[T]):
    """The pure part of group commit: a FIFO of waiting items and the rule that cuts the next
    group. Not thread-safe (the driver locks). push/take are O(1) per item."""

    __slots__ = ("_bytes", "_items", "policy")

    def __init__(self, policy: CommitPolicy | None = None) -> None:
        self.policy = policy or CommitPolicy()
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0

    def push(self, item: T, size: int) -> None:
        """Queue ``item`` of ``size`` encoded bytes behind everything already queued."""
        self._items.append((item, size))
        self._bytes += size

    def take(self) -> list[T]:
        """The next group, in submission order: at least one item when any is queued, then
        more while the group stays within the policy's bounds."""
        items, policy = self._items, self.policy
        if len(items) <= policy.max_batches and self._bytes <= policy.max_bytes:
            # Everything waiting fits (the usual case): one pass in C, not a step per item.
            out = [item for item, _ in items]
            items.clear()
            self._bytes = 0
            return out
        out = []
        total = 0
        while items and len(out) < policy.max_batches:
            item, size = items[0]
            if out and total + size > policy.max_bytes:
                break
            items.popleft()
            out.append(item)
            total += size
        self._bytes -= total
        return out

    def push_front(self, entries: Sequence[tuple[T, int]]) -> None:
        """Put ``entries`` (item, size), a group just taken and not written, back ahead of
        everything queued, in their order."""
        self._items.extendleft(reversed(entries))
        self._bytes += sum(size for _, size in entries)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_bytes(self) -> int:
        return self._bytes


class Ticket:
    """The acknowledgement of one submitted batch. :meth:`wait` returns its log position once
    the batch is durable, or raises the error that kept it from being written."""

    __slots__ = ("_callback", "_lock", "batch_id", "error", "seq")

    def __init__(self, batch_id: int, callback: Callable[[Ticket], None] | None) -> None:
        self.batch_id = batch_id
        self.seq: int | None = None
        self.error: StoreError | None = None
        self._callback = callback
        # The lock a waiter blocks on, made by the first wait(): most tickets are answered by
        # callback and never waited for, and a lock per batch is a measurable part of a
        # batch's cost at hundreds of thousands of batches a second.
        self._lock: _thread.LockType | None = None

    def done(self) -> bool:
        return self.seq is not None or self.error is not None

    def wait(self, timeout: float | None = None) -> int:
        """Block until the batch is durable; its log position. Raises the write's
        :class:`~wal.errors.StoreError`, or :class:`TimeoutError` after ``timeout`` seconds
        (the batch may still become durable later)."""
        if not self.done():
            lock = self._lock
            if lock is None:
                with _WAITER_LOCK:  # two first waiters must not make two locks
                    lock = self._lock
                    if lock is None:
                        lock = _thread.allocate_lock()
                        lock.acquire()  # released by _resolve
                        self._lock = lock
            # _resolve sets the result before it looks for the lock: either it finds this
            # lock and releases it, or the result is already visible here.
            if not self.done():
                if not lock.acquire(True, -1 if timeout is None else timeout):
                    raise TimeoutError(f"batch {self.batch_id} not durable after {timeout} s")
                lock.release()  # for any other waiter of the same ticket
        if self.error is not None:
            raise self.error
        assert self.seq is not None
        return self.seq

    def _resolve(self, seq: int | None, error: StoreError | None) -> None:
        self.seq, self.error = seq, error
        lock = self._lock
        if lock is not None:
            lock.release()
        if self._callback is not None:
            try:
                self._callback(self)
            except Exception:  # a producer's callback must not stop the writer
                log.exception("commit callback of batch %s failed", self.batch_id)


class GroupCommitter:
    """A writer thread committing every queued batch of ``store`` in groups.

    :meth:`submit` checks and encodes the batch in the caller's thread (a bad or stale batch
    fails there, alone, nothing queued) and returns a :class:`Ticket`; the writer resolves
    tickets in submission order after the group's fsync, and calls each ticket's callback (on
    the writer thread), then ``on_group`` once with the whole group's tickets: one hand-off per
    group (an event loop woken once per fsync, not once per batch). A failed write fails every
    ticket of its group with the typed error; after a :class:`~wal.errors.StoreFailure` the
    store refuses writes, so every later group fails fast too. Thread-safe.
    """

    def __init__(
        self,
        store: ShardStore,
        policy: CommitPolicy | None = None,
        *,
        name: str = "wal-commit",
        on_group: Callable[[Sequence[Ticket]], None] | None = None,
    ) -> None:
        self.store = store
        self._on_group = on_group
        self._queue: CommitQueue[tuple[PreparedBatch, Ticket]] = CommitQueue(policy)
        # Raw locks, not a Condition (whose Python-level enter/exit cost ~0.8 us a submit):
        # _mutex guards the queue and _closing; _signal is released exactly when _signalled is
        # True, meaning "the writer may have something to do".
        self._mutex = _thread.allocate_lock()
        self._signal = _thread.allocate_lock()
        self._signal.acquire()
        self._signalled = False
        self._closing = False
        # Held by whoever takes and writes a group, the writer thread or a caller of
        # write_here: one group at a time, each written before the next is taken (queue order
        # is log order).
        self._write_lock = _thread.allocate_lock()
        #: seconds the slowest recent write took, fsync included (either path): each write's
        #: own time, or this decayed by a tenth a write if larger. What a caller of
        #: write_here may expect to wait: a disk that was slow up to ~30 writes ago (50 ms,
        #: against 2 ms) still counts as slow.
        self.recent_write_s = 0.0
        self.groups = 0  # writes issued (one fsync each)
        self.groups_here = 0  # ... of which by callers of write_here
        self.batches = 0  # batches acknowledged durable
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        batch: Persist,
        callback: Callable[[Ticket], None] | None = None,
        *,
        wake: bool = True,
    ) -> Ticket:
        """Queue ``batch`` for the next group; a :class:`Ticket` for its acknowledgement.
        Raises the store's usage errors and :class:`~wal.errors.StaleEpoch` at once.

        ``wake=False`` leaves an idle writer asleep: the caller promises a :meth:`kick` soon
        (a writer in a write takes the batch when that write ends, kicked or not). A caller
        about to give up the GIL anyway (an event loop about to wait) kicks then, so that the
        writer does not wake only to wait for the GIL that the caller still holds."""
        prepared = self.store.prepare(batch)
        ticket = Ticket(batch.batch_id, callback)
        with self._mutex:
            if self._closing:
                raise StoreClosed(
                    f"the group committer is closed; batch {batch.batch_id} not queued",
                    path=self.store.path,
                )
            self._queue.push((prepared, ticket), prepared.size)
            if wake and not self._signalled:
                self._signalled = True
                self._signal.release()
        return ticket

    def kick(self) -> None:
        """Wake the writer if batches wait for it (those :meth:`submit` queued with
        ``wake=False``). Thread-safe; cheap when there is nothing to do."""
        self._wake_if_queued()

    def _wake_if_queued(self) -> None:
        """:meth:`kick`'s work, also done by the writer itself after each write (which is no
        caller's kick)."""
        with self._mutex:
            if self._queue and not self._signalled:
                self._signalled = True
                self._signal.release()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking batches, write everything already queued, stop the writer. Idempotent."""
        with self._mutex:
            self._closing = True
            if not self._signalled:
                self._signalled = True
                self._signal.release()
        self._thread.join(timeout)

    def __enter__(self) -> GroupCommitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_here(self) -> list[Ticket] | None:
        """Write everything queued on the calling thread, now, if nothing else holds the
        store: one group, its tickets resolved, in order, with their callbacks called here
        (``on_group`` is not: the caller has the tickets). [] when nothing was queued. None,
        nothing written, when the writer thread is writing, when another thread holds the
        store (a retention scan, a snapshot's log trim: never waited for), or when the
        committer is closed: the batches stay queued, first, for the writer (a caller that
        queued them with ``wake=False`` kicks it).

        For a caller whose next step is to wait for these very batches (an event loop with a
        lone request in flight): it saves the two thread hand-offs of the writer's path at the
        price of blocking the caller for the write, fsync included (:attr:`recent_write_s`)."""
        if not self._write_lock.acquire(False):
            return None
        try:
            with self._mutex:
                if self._closing:
                    return None
                group = self._queue.take()
            if not group:
                return []
            tickets = self._write_group(group, wait=False)
            if tickets is None:
                with self._mutex:  # back where they were: ahead of anything queued since
                    self._queue.push_front([(item, item[0].size) for item in group])
                return None
            self.groups_here += 1
            return tickets
        finally:
            self._write_lock.release()

    def _run(self) -> None:
        mutex, queue = self._mutex, self._queue
        while True:
            self._signal.acquire()  # until something is queued, or closing
            with self._write_lock:
                with mutex:
                    self._signalled = False
                    group = queue.take()
                    if queue or self._closing:  # come back at once: more queued, or to finish
                        self._signalled = True
                        self._signal.release()
                    if not group:
                        if self._closing:
                            return  # everything queued was written
                        continue
                tickets = self._write_group(group)
                assert tickets is not None  # (it waits for the store)
                # Inside the write lock: a write_here after this group sees its hand-off
                # already made (the node relies on it to keep acknowledgements in order).
                if self._on_group is not None:
                    try:
                        self._on_group(tickets)
                    except Exception:  # like a ticket's callback: must not stop the writer
                        log.exception("group callback failed")

    def _write_group(
        self, group: list[tuple[PreparedBatch, Ticket]], *, wait: bool = True
    ) -> list[Ticket] | None:
        """Write ``group`` (the write lock held), then resolve its tickets in order. Without
        ``wait``: None when another thread holds the store (nothing written or resolved)."""
        error: StoreError | None = None
        seqs: list[int] = []
        started = time.perf_counter()
        try:
            prepared = [p for p, _ in group]
            if wait:
                seqs = self.store.write_prepared(prepared)
            else:
                written = self.store.try_write_prepared(prepared)
                if written is None:
                    return None
                seqs = written
        except StoreError as exc:
            error = exc
        except Exception as exc:  # a bug, not the disk; still, nobody may wait forever
            log.exception("group commit failed unexpectedly")
            error = StoreIOError(f"group commit failed: {exc!r}", path=self.store.path)
        self.recent_write_s = max(time.perf_counter() - started, self.recent_write_s * 0.9)
        # What was queued without a wake-up (submit's wake=False) since the group was taken is
        # the next group's, kicked or not: without this the writer slept on it until a kick
        # (found by review: submit's promise did not hold). Kicked before any ticket of this
        # group resolves: a batch submitted after one did (an idle writer's) waits for its
        # kick, as promised.
        self._wake_if_queued()
        self.groups += 1
        tickets = [ticket for _, ticket in group]
        if error is not None:
            for ticket in tickets:
                ticket._resolve(None, error)
        else:
            self.batches += len(group)
            for ticket, seq in zip(tickets, seqs, strict=True):
                ticket._resolve(seq, None)
        return tickets
