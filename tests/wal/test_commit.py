"""Group commit: the pure queue's policy, and the writer thread's acknowledgements."""

from __future__ import annotations

import bisect
import itertools
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.effects import Persist
from tests.wal.records import T0, batch, created, run
from wal.commit import CommitPolicy, CommitQueue, GroupCommitter, Ticket
from wal.errors import StaleEpoch, StoreClosed, StoreError, StoreFailure
from wal.route import PreparedBatch
from wal.store import ShardStore

# ------------------------------------------------------------------------- the pure policy


def test_queue_takes_everything_waiting_in_order() -> None:
    q: CommitQueue[str] = CommitQueue()
    for item in "abc":
        q.push(item, 10)
    assert q.take() == ["a", "b", "c"]
    assert q.take() == [] and len(q) == 0 and q.queued_bytes == 0


def test_queue_cuts_groups_by_count_and_bytes() -> None:
    q: CommitQueue[int] = CommitQueue(CommitPolicy(max_batches=3, max_bytes=100))
    for i in range(5):
        q.push(i, 10)
    assert q.take() == [0, 1, 2]
    assert q.take() == [3, 4]
    q.push(5, 60)
    q.push(6, 60)
    q.push(7, 500)  # larger than a group may be: still goes, alone
    assert q.take() == [5]
    assert q.take() == [6]
    assert q.take() == [7]
    with pytest.raises(ValueError):
        CommitPolicy(max_batches=0)


def reference_take(queue: list[tuple[int, int]], policy: CommitPolicy) -> list[int]:
    """The cut rule, stated simply: FIFO; at least one item; then more while the group stays
    within both bounds."""
    out: list[int] = []
    total = 0
    while queue and len(out) < policy.max_batches:
        item, size = queue[0]
        if out and total + size > policy.max_bytes:
            break
        queue.pop(0)
        out.append(item)
        total += size
    return out


@given(
    st.integers(1, 6),
    st.integers(1, 100),
    st.lists(st.one_of(st.integers(-1, 60), st.none()), max_size=60),
)
def test_queue_cuts_groups_as_the_reference_does(
    max_batches: int, max_bytes: int, steps: list[int | None]
) -> None:
    # None: take a group; -1: take a group and put it back (a write that did not happen);
    # a size: push an item of that size
    policy = CommitPolicy(max_batches=max_batches, max_bytes=max_bytes)
    q: CommitQueue[int] = CommitQueue(policy)
    model: list[tuple[int, int]] = []
    sizes: dict[int, int] = {}
    for i, step in enumerate(steps + [None] * len(steps)):
        if step is None:
            assert q.take() == reference_take(model, policy)
        elif step == -1:
            group = q.take()
            assert group == reference_take(list(model), policy)
            q.push_front([(item, sizes[item]) for item in group])  # the model is unchanged
        else:
            q.push(i, step)
            model.append((i, step))
            sizes[i] = step
        assert len(q) == len(model) and q.queued_bytes == sum(s for _, s in model)


# ------------------------------------------------------------------------- the writer


class CountingStore(ShardStore):
    """A real store that remembers how many batches each write covered."""

    writes: list[int]
    # Set both to hold the writer inside its next write: ``entered`` is set there, and the
    # write goes on once ``gate`` is.
    entered: threading.Event | None = None
    gate: threading.Event | None = None

    def write_prepared(self, prepared: list[PreparedBatch]) -> list[int]:  # type: ignore[override]
        self.writes.append(len(prepared))
        if self.entered is not None and self.gate is not None:
            self.entered.set()
            self.gate.wait(10)
        return super().write_prepared(prepared)


class FailingStore(CountingStore):
    """A store whose every write fails as a disk would."""

    def write_prepared(self, prepared: list[PreparedBatch]) -> list[int]:  # type: ignore[override]
        raise StoreFailure("the disk is on fire", path=self.path)


def open_counting(path: Path, epoch: int = 1) -> CountingStore:
    store = CountingStore.open(path, shard=0, shards=1, epoch=epoch)
    assert isinstance(store, CountingStore)
    store.writes = []
    return store


def test_every_batch_is_acknowledged_with_its_position(tmp_path: Path) -> None:
    store = open_counting(tmp_path)
    with GroupCommitter(store) as committer:
        tickets = [committer.submit(created(k)) for k in range(20)]
        seqs = [t.wait(10) for t in tickets]
    assert seqs == sorted(seqs) and len(set(seqs)) == 20
    assert committer.batches == 20 and sum(store.writes) == 20
    for k in range(20):
        assert store.key_of(f"job-{k}") == k
    store.close()


class SyncCounter:
    """A forwarding stand-in for the store's RocksDB handle (``store._db``, an ``Rdict``) that
    counts what makes a write durable: ``flush_wal(True)`` (the fsync of RocksDB's log, how
    :meth:`ShardStore._commit` syncs) and writes with ``sync`` set. Everything goes on to the
    real database. The store serialises its writes, so plain counters do."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.writes = 0
        self.syncs = 0
        #: how many of the writes so far an fsync that has returned covers: it counts only
        #: once the fsync is done, so a ticket resolved during it would see the old value
        self.synced_writes = 0
        self.events: list[str] = []

    def write(self, wb: Any, opts: Any) -> None:
        self._db.write(wb, opts)
        self.writes += 1
        self.events.append("write")
        if opts.sync:
            self._synced(self.writes)

    def flush_wal(self, sync: bool) -> None:
        covered = self.writes  # (before it starts: a write during it would not be covered)
        self._db.flush_wal(sync)
        if sync:
            self._synced(covered)

    def _synced(self, covered: int) -> None:
        self.syncs += 1
        self.synced_writes = covered
        self.events.append("sync")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def test_concurrent_producers_share_fsyncs(tmp_path: Path) -> None:
    store = open_counting(tmp_path)
    real = store._db
    db = SyncCounter(real)
    store._db = db  # type: ignore[assignment]  # (a stand-in: forwards every call)
    producers, each = 32, 20
    n = producers * each
    acked: list[int] = []
    lock = threading.Lock()
    #: log position -> fsynced writes when its ticket resolved (on the writer thread, in
    #: _resolve: the moment the batch is acknowledged, before any waiter wakes)
    synced_at_ack: dict[int, int] = {}

    def on_ack(ticket: Ticket) -> None:
        assert ticket.seq is not None
        synced_at_ack[ticket.seq] = db.synced_writes

    def produce(p: int) -> None:
        for i in range(each):
            key = p * each + i
            seq = committer.submit(batch(key, run(key, T0)), callback=on_ack).wait(30)
            with lock:
                acked.append(seq)

    try:
        with GroupCommitter(store) as committer:
            threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        store._db = real
    assert sorted(acked) == list(range(1, n + 1))
    assert sum(store.writes) == n
    # Every RocksDB write was followed by its fsync before anything else was written ...
    assert db.events == ["write", "sync"] * len(store.writes), db.events[:10]
    # ... one a group: the batches of many producers shared far fewer fsyncs than batches.
    assert db.writes == db.syncs == len(store.writes) == committer.groups
    assert db.syncs < n / 2, store.writes
    assert max(store.writes) > 1
    # No batch was acknowledged before the fsync that covers it: the batch at log position s
    # is in write number g (positions are handed out in write order, ``store.writes`` holds
    # each write's batch count), and when its ticket resolved at least g writes were synced.
    ends = list(itertools.accumulate(store.writes))
    assert sorted(synced_at_ack) == list(range(1, n + 1))
    early = [
        (seq, synced, bisect.bisect_left(ends, seq) + 1)
        for seq, synced in sorted(synced_at_ack.items())
        if synced < bisect.bisect_left(ends, seq) + 1
    ]
    assert not early, (
        f"acknowledged before their fsync (seq, writes synced, its write): {early[:5]}"
    )
    store.close()


def test_acknowledgement_comes_after_the_data_is_readable(tmp_path: Path) -> None:
    # The callback runs after the write returned (after its fsync): what it acknowledges is
    # already visible to readers.
    store = open_counting(tmp_path)
    seen: list[int | None] = []

    def check(ticket: Ticket) -> None:
        seen.append(store.key_of(f"job-{ticket.batch_id}"))

    with GroupCommitter(store) as committer:
        for k in range(10):
            committer.submit(created(k), callback=check)
    assert seen == list(range(10))
    store.close()


def test_a_stale_batch_fails_alone_at_submit(tmp_path: Path) -> None:
    ShardStore.open(tmp_path, shard=0, shards=1, epoch=1).close()
    store = open_counting(tmp_path, epoch=2)
    with GroupCommitter(store) as committer:
        good = committer.submit(created(0, epoch=2))
        with pytest.raises(StaleEpoch):
            committer.submit(created(1, epoch=1))
        assert good.wait(10) == 1
    store.close()


def test_a_failed_write_fails_every_ticket_of_its_group(tmp_path: Path) -> None:
    store = FailingStore.open(tmp_path, shard=0, shards=1, epoch=1)
    errors: list[StoreError | None] = []
    with GroupCommitter(store) as committer:
        tickets = [
            committer.submit(created(k), callback=lambda t: errors.append(t.error))
            for k in range(5)
        ]
        for ticket in tickets:
            with pytest.raises(StoreFailure, match="on fire"):
                ticket.wait(10)
    assert len(errors) == 5 and all(isinstance(e, StoreFailure) for e in errors)
    store.close()


def test_close_writes_what_was_queued_then_refuses(tmp_path: Path) -> None:
    store = open_counting(tmp_path)
    committer = GroupCommitter(store)
    tickets = [committer.submit(created(k)) for k in range(50)]
    committer.close()
    assert all(t.done() and t.error is None for t in tickets)
    with pytest.raises(StoreClosed):
        committer.submit(created(99))
    committer.close()  # idempotent
    store.close()


def test_a_broken_callback_does_not_stop_the_writer(tmp_path: Path) -> None:
    store = open_counting(tmp_path)

    def boom(ticket: Ticket) -> None:
        raise RuntimeError("callback bug")

    with GroupCommitter(store) as committer:
        committer.submit(created(0), callback=boom)
        assert committer.submit(created(1)).wait(10) == 2
    store.close()


def test_one_group_callback_per_write(tmp_path: Path) -> None:
    store = open_counting(tmp_path)
    groups: list[list[tuple[int, int | None]]] = []
    with GroupCommitter(
        store, on_group=lambda ts: groups.append([(t.batch_id, t.seq) for t in ts])
    ) as committer:
        tickets = [committer.submit(created(k)) for k in range(30)]
        assert [t.wait(10) for t in tickets] == list(range(1, 31))
    assert len(groups) == len(store.writes) and [len(g) for g in groups] == store.writes
    assert [b for g in groups for b, _ in g] == list(range(30))
    assert [s for g in groups for _, s in g] == list(range(1, 31))
    store.close()


def test_many_threads_wait_for_one_ticket(tmp_path: Path) -> None:
    store = open_counting(tmp_path)
    with GroupCommitter(store) as committer:
        ticket = committer.submit(created(0))
        seen: list[int] = []
        waiters = [threading.Thread(target=lambda: seen.append(ticket.wait(10))) for _ in range(8)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
    assert seen == [1] * 8 and ticket.wait() == 1
    store.close()


def test_wait_times_out(tmp_path: Path) -> None:
    ticket = Ticket(1, None)
    with pytest.raises(TimeoutError):
        ticket.wait(0.01)
    assert isinstance(created(0), Persist)


def test_a_batch_queued_without_a_wake_waits_for_its_kick(tmp_path: Path) -> None:
    """``wake=False`` leaves an idle writer asleep (the caller's thread keeps the GIL to
    itself until it waits); :meth:`GroupCommitter.kick` then has it written, and a writer in
    a write takes such a batch when that write ends, kicked or not."""
    store = open_counting(tmp_path)
    with GroupCommitter(store) as committer:
        committer.submit(created(0)).wait(10)  # the writer is idle after this
        quiet = committer.submit(created(1), wake=False)
        with pytest.raises(TimeoutError):
            quiet.wait(0.2)  # nobody woke the writer
        assert store.writes == [1]
        committer.kick()
        assert quiet.wait(10) > 0
        committer.kick()  # nothing queued: nothing happens
        assert store.writes == [1, 1]
        # Behind a woken batch: taken by the writer with it or right after it, unkicked.
        woken = committer.submit(created(2))
        behind = committer.submit(created(3), wake=False)
        assert woken.wait(10) < behind.wait(10)
    store.close()


def test_a_batch_queued_unwoken_during_a_write_is_taken_when_it_ends(tmp_path: Path) -> None:
    """``submit(wake=False)`` while the writer is in a write: the writer takes the batch when
    that write ends, with no kick (found by review: it slept on it until a kick, unlike what
    ``submit`` promises; the test above passed only when the two batches happened to share
    a group)."""
    store = open_counting(tmp_path)
    store.entered, store.gate = threading.Event(), threading.Event()
    with GroupCommitter(store) as committer:
        first = committer.submit(created(0))
        assert store.entered.wait(10)  # the writer is in the write of ``first`` alone
        behind = committer.submit(created(1), wake=False)
        store.gate.set()
        assert first.wait(10) < behind.wait(5)  # (never kicked)
        assert store.writes == [1, 1]
    store.close()


# ------------------------------------------------------------------------- write_here


def test_write_here_writes_what_is_queued_on_the_callers_thread(tmp_path: Path) -> None:
    """An idle writer's queued batches are written by the caller, as one group, in order,
    acknowledged there (their callbacks on the caller's thread; no group callback: the caller
    has the tickets); nothing queued gives []."""
    store = open_counting(tmp_path)
    called_on: list[int] = []
    groups: list[int] = []
    with GroupCommitter(store, on_group=lambda ts: groups.append(len(ts))) as committer:
        assert committer.submit(created(0)).wait(10) == 1  # the writer thread's: idle after
        writes_before, groups_before = list(store.writes), list(groups)
        tickets = [
            committer.submit(
                created(k), callback=lambda t: called_on.append(threading.get_ident()), wake=False
            )
            for k in range(1, 4)
        ]
        assert committer.write_here() == tickets
        assert [t.seq for t in tickets] == [2, 3, 4] and all(t.error is None for t in tickets)
        assert called_on == [threading.get_ident()] * 3
        assert store.writes == [*writes_before, 3] and groups == groups_before
        assert committer.groups_here == 1 and committer.batches == 4
        assert committer.recent_write_s > 0
        assert committer.write_here() == []  # nothing queued
        assert committer.submit(created(4)).wait(10) == 5  # the thread's path goes on
    for k in range(5):
        assert store.key_of(f"job-{k}") == k
    store.close()


def test_write_here_leaves_the_batches_to_a_writer_in_a_write(tmp_path: Path) -> None:
    """While the writer thread is in a write, write_here takes nothing (None): the writer
    writes the batch after its group, in queue order; closed, it takes nothing either."""
    store = open_counting(tmp_path)
    store.entered, store.gate = threading.Event(), threading.Event()
    committer = GroupCommitter(store)
    first = committer.submit(created(0))
    assert store.entered.wait(10)  # the writer is in the write of ``first``
    behind = committer.submit(created(1), wake=False)
    assert committer.write_here() is None
    assert not behind.done() and committer.groups_here == 0
    store.gate.set()
    assert first.wait(10) < behind.wait(10)
    assert store.writes == [1, 1]
    committer.close()
    assert committer.write_here() is None
    store.close()


def test_write_here_fails_its_group_with_the_writes_error(tmp_path: Path) -> None:
    store = FailingStore.open(tmp_path, shard=0, shards=1, epoch=1)
    with GroupCommitter(store) as committer:
        tickets = [committer.submit(created(k), wake=False) for k in range(3)]
        assert committer.write_here() == tickets
        assert all(isinstance(t.error, StoreFailure) for t in tickets)
        with pytest.raises(StoreFailure, match="on fire"):
            tickets[0].wait(1)
    store.close()


def test_write_here_and_the_writer_thread_keep_queue_order(tmp_path: Path) -> None:
    """Producers on several threads, the writer thread and a caller of write_here racing:
    every batch is acknowledged exactly once, positions are the queue's order (each
    producer's batches in the order it submitted them), and the store holds them all."""
    store = open_counting(tmp_path)
    producers, each = 4, 60
    done = threading.Event()
    acked: dict[int, list[int]] = {p: [] for p in range(producers)}
    seq_of: dict[int, int] = {}  # batch id -> the position its ticket was given
    here: list[int] = []

    def produce(p: int) -> None:
        for i in range(each):
            # Unwoken batches too: the writer takes them after a write, or the racer does.
            ticket = committer.submit(created(p * each + i), wake=i % 2 == 0)
            acked[p].append(ticket.wait(30))
            seq_of[ticket.batch_id] = acked[p][-1]

    def write_here_often() -> None:
        while not done.is_set():
            got = committer.write_here()
            if got:
                here.extend(t.seq or 0 for t in got)

    with GroupCommitter(store) as committer:
        racer = threading.Thread(target=write_here_often)
        racer.start()
        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        racer.join()
        committer.kick()  # (wake=False batches the racer left: the writer takes them)
    every = sorted(seq for seqs in acked.values() for seq in seqs)
    assert every == list(range(1, producers * each + 1))
    for seqs in acked.values():
        assert seqs == sorted(seqs)
    assert sum(store.writes) == producers * each == committer.batches
    assert len(here) == len(set(here))
    # The log holds each batch at the position its ticket was told: no group overtook one
    # taken before it.
    assert {batch_id: seq for seq, batch_id, _, _ in store.log_batches()} == seq_of
    for k in range(producers * each):
        assert store.key_of(f"job-{k}") == k
    store.close()


def test_recent_write_time_remembers_a_slow_write_for_a_while(tmp_path: Path) -> None:
    """``recent_write_s``: a slow write (a disk that stalls) counts at once and decays by a
    tenth a write, so that a caller of write_here keeps off a disk that was slow lately."""
    import time

    slow: list[bool] = []

    class StallingStore(CountingStore):
        def write_prepared(self, prepared: list[PreparedBatch]) -> list[int]:  # type: ignore[override]
            if slow:
                slow.clear()
                # (0.2 s: well above what a busy disk's real fsyncs add, so that the bounds
                # below are the stall's and its decay's, not the disk's)
                time.sleep(0.2)
            return super().write_prepared(prepared)

    store = StallingStore.open(tmp_path, shard=0, shards=1, epoch=1)
    assert isinstance(store, StallingStore)
    store.writes = []
    with GroupCommitter(store) as committer:
        committer.submit(created(0)).wait(10)
        slow.append(True)
        committer.submit(created(1)).wait(10)
        assert committer.recent_write_s >= 0.2
        committer.submit(created(2)).wait(10)
        assert committer.recent_write_s >= 0.18  # (0.2 decayed once, at least)
        for k in range(3, 43):
            committer.submit(created(k)).wait(10)
        # 0.2 * 0.9 ** 40 is 0.003: what is left is the recent real writes' (a slow disk's
        # fsync of tens of ms included)
        assert committer.recent_write_s < 0.1
    store.close()


def test_write_here_leaves_the_batches_when_another_thread_holds_the_store(
    tmp_path: Path,
) -> None:
    """A retention scan or a snapshot's log trim holds the store: write_here does not wait
    for it (None, nothing written); the batches stay first in the queue, and once kicked the
    writer writes them, in order, ahead of those queued after."""
    store = open_counting(tmp_path)
    held, release = threading.Event(), threading.Event()

    def hold_the_store() -> None:
        with store._lock:
            held.set()
            release.wait(10)

    with GroupCommitter(store) as committer:
        committer.submit(created(0)).wait(10)
        first = committer.submit(created(1), wake=False)
        holder = threading.Thread(target=hold_the_store)
        holder.start()
        assert held.wait(10)
        assert committer.write_here() is None
        assert not first.done() and committer.groups_here == 0
        second = committer.submit(created(2), wake=False)
        release.set()
        holder.join()
        committer.kick()
        assert first.wait(10) < second.wait(10)
    assert store.writes[0] == 1 and sum(store.writes) == 3
    store.close()
