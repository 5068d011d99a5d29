"""Retention of run history: by age and by count per job, by range deletes, never removing a
run still in flight, taking the run's history and logs along."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.wal.records import T0, batch, created, note, run, skip
from wal.store import Retention, ShardStore

DAY = 86_400_000
AGE = Retention(max_age_ms=10 * DAY, max_runs_per_job=None)


def open_store(path: Path, epoch: int = 1) -> ShardStore:
    return ShardStore.open(path, shard=0, shards=1, epoch=epoch)


def ats(store: ShardStore, key: int) -> list[int]:
    return sorted(r["at"] for r in store.last_runs(key, 10_000))


def test_by_age_removes_old_runs_with_their_history_and_logs(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1), created(2)])
        days = list(range(20))
        store.write(
            [batch(10 + d, run(1, T0 + d * DAY, "SUCCESS"), note(1, T0 + d * DAY)) for d in days]
        )
        store.write([batch(40, run(2, T0 + 3 * DAY, "FAILED"), skip(2, T0 + 2 * DAY))])
        for d in (0, 9, 10, 19):
            store.logs.append(1, T0 + d * DAY, "stdout", b"out")
        now = T0 + 20 * DAY  # cutoff: T0 + 10 days
        report = store.retain(now, AGE)
        assert report.runs_deleted == 10 and report.jobs_trimmed == 1 and not report.more
        # job 1's ten runs in one range; job 2's skip in the range before its newest run (and
        # the empty one after it)
        assert report.ranges == 3
        assert ats(store, 1) == [T0 + d * DAY for d in range(10, 20)]
        # job 2's only run is past the cutoff but its newest: it stays, the skip before it goes
        assert ats(store, 2) == [T0 + 3 * DAY] and report.kept_newest == 1
        assert {h["at"] for h in store.history(1, 100)} == {T0 + d * DAY for d in range(10, 20)}
        assert store.history(2) == []
        assert store.logs.read(1, T0).chunks == [] and store.logs.read(1, T0 + 9 * DAY).chunks == []
        assert store.logs.read(1, T0 + 10 * DAY).chunks != []
        assert store.run_count(1) == 10 and store.run_count(2) == 1
        # nothing left to do at the same time
        assert store.retain(now, AGE).runs_deleted == 0


def test_runs_in_flight_are_kept_and_found_again_later(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        states = ["SUCCESS", "RUNNING", "SUCCESS", "PENDING", "CANCELLED"]
        store.write([batch(10 + d, run(1, T0 + d * DAY, s)) for d, s in enumerate(states)])
        store.logs.append(1, T0 + DAY, "stdout", b"still running")
        report = store.retain(T0 + 30 * DAY, AGE)
        assert report.runs_deleted == 2 and report.kept_in_flight == 2
        assert report.kept_newest == 1  # the CANCELLED one: the job's newest
        assert report.ranges == 4  # split around the three runs kept, not one a run deleted
        assert ats(store, 1) == [T0 + DAY, T0 + 3 * DAY, T0 + 4 * DAY]
        assert store.logs.read(1, T0 + DAY).chunks[0].data == b"still running"
        # once they finish, a later pass removes them: the time index still knows them
        store.write([batch(20, run(1, T0 + DAY, "SUCCESS"), run(1, T0 + 3 * DAY, "LOST"))])
        assert store.retain(T0 + 31 * DAY, AGE).runs_deleted == 2
        assert ats(store, 1) == [T0 + 4 * DAY]


def test_by_count_keeps_the_newest_runs_per_job(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1), created(2)])
        store.write([batch(10 + i, run(1, T0 + i, "SUCCESS")) for i in range(30)])
        store.write([batch(50 + i, run(2, T0 + i, "SUCCESS")) for i in range(3)])
        store.write([batch(60, run(1, T0 + 1, "SUCCESS"), note(1, T0 + 2))])  # no new run
        report = store.retain(T0, Retention(max_age_ms=None, max_runs_per_job=5))
        assert report.runs_deleted == 25
        assert ats(store, 1) == [T0 + i for i in range(25, 30)]
        assert ats(store, 2) == [T0, T0 + 1, T0 + 2]
        assert store.history(1) == []  # the note of a deleted run went with it
        assert store.run_count(1) == 5
        # only jobs given new runs since are looked at again
        assert store.retain(T0, Retention(max_age_ms=None, max_runs_per_job=1)).runs_deleted == 0
        store.write([batch(70, run(2, T0 + 3, "SUCCESS"))])
        report = store.retain(T0, Retention(max_age_ms=None, max_runs_per_job=1))
        assert report.runs_deleted == 3 and ats(store, 2) == [T0 + 3]
        assert ats(store, 1) == [T0 + i for i in range(25, 30)]


def test_the_age_pass_is_bounded_and_resumes(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(k) for k in range(10)])
        store.write(
            [batch(20 + k, run(k, T0, "SUCCESS"), run(k, T0 + 1, "SUCCESS")) for k in range(10)]
        )
        report = store.retain(T0 + 11 * DAY, AGE, max_entries=7)
        assert report.more and 0 < report.runs_deleted < 20
        total = report.runs_deleted
        while report.more:
            report = store.retain(T0 + 11 * DAY, AGE, max_entries=7)
            total += report.runs_deleted
        assert total == 10  # each job's newest stays
        assert all(ats(store, k) == [T0 + 1] for k in range(10))


def test_retention_and_counts_survive_reopen(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(10 + i, run(1, T0 + i, "SUCCESS")) for i in range(10)])
        store.write([batch(30, run(1, T0 + 100))])  # pending, counted
        store.retain(T0 + 50 * DAY, AGE)
        counts = store.counts
    with open_store(tmp_path, epoch=2) as store:
        assert ats(store, 1) == [T0 + 100]
        assert store.counts == counts and counts.runs_pending == 1
        assert store.run_count(1) == 1


def test_a_deleted_run_written_again_is_new_again(tmp_path: Path) -> None:
    # The store remembers each job's newest run time so that a later run needs no read; a run
    # at or before it that retention deleted must still count as new when written again.
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(10 + d, run(1, T0 + d * DAY, "SUCCESS")) for d in range(5)])
        assert store.retain(T0 + 12 * DAY, AGE).runs_deleted == 2
        assert store.run_count(1) == 3
        store.write([batch(20, run(1, T0, "PENDING"))])  # deleted above, written again
        assert store.run_count(1) == 4 and store.counts.runs_pending == 1
        assert ats(store, 1) == [T0 + d * DAY for d in (0, 2, 3, 4)]
        # ... and the time index has it again: the next age pass finds it once it is final
        store.write([batch(21, run(1, T0, "SUCCESS"))])
        assert store.counts.runs_pending == 0
        assert store.retain(T0 + 12 * DAY, AGE).runs_deleted == 1
    with open_store(tmp_path, epoch=2) as store:  # no caches: everything read back
        assert store.run_count(1) == 3 and store.counts.runs_pending == 0
        store.write(
            [
                batch(30, run(1, T0 + 2 * DAY, "RUNNING"), epoch=2),
                batch(31, run(1, T0 + 9 * DAY), epoch=2),
            ]
        )
        assert store.run_count(1) == 4
        assert store.counts.runs_in_flight == 1 and store.counts.runs_pending == 1


# Found by review: with both passes in one write, the count pass scanned the runs the age pass
# was deleting, counted them again, left the per-job count low for good (the cap then went
# unenforced) and, once an age pass took the count below zero, every retain raised.
BOTH = Retention(max_age_ms=10 * DAY, max_runs_per_job=24)
HOUR = 3_600_000


def test_age_and_count_in_one_call_count_each_run_once(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(10 + d, run(1, T0 + d * DAY, "SUCCESS")) for d in range(10)])
        report = store.retain(T0 + 15 * DAY, Retention(max_age_ms=10 * DAY, max_runs_per_job=3))
        left = ats(store, 1)
        assert left == [T0 + d * DAY for d in (7, 8, 9)]
        assert store.run_count(1) == 3 and report.runs_deleted == 7


def test_counts_stay_true_through_a_backlog_and_later_age_passes(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        n = 100
        for h in range(15 * 24):  # fifteen days without a retention pass (a node down)
            n += 1
            store.write([batch(n, run(1, T0 + h * HOUR, "SUCCESS"))])
        store.retain(T0 + 15 * DAY, BOTH)
        assert store.run_count(1) == len(ats(store, 1)) == 24
        for h in range(15 * 24, 17 * 24):
            n += 1
            store.write([batch(n, run(1, T0 + h * HOUR, "SUCCESS"))])
            if h % 6 == 5:
                store.retain(T0 + h * HOUR, BOTH)
                assert store.run_count(1) == len(ats(store, 1)) <= 24
        store.retain(T0 + 40 * DAY, BOTH)  # everything aged out but the newest
        assert store.run_count(1) == len(ats(store, 1)) == 1


def test_max_entries_below_one_is_a_usage_error(tmp_path: Path) -> None:
    import pytest

    from wal.errors import StoreUsageError

    with open_store(tmp_path) as store, pytest.raises(StoreUsageError):
        store.retain(T0, AGE, max_entries=0)


def test_an_append_racing_retention_leaves_no_logs_behind(tmp_path: Path) -> None:
    """Found by review: an append that had read a run's log state when retention dropped the
    run wrote the state and its chunk back, and no later pass ever found them (the run and
    its index entry were gone). Retention now holds the log store's lock for its write."""
    import threading

    with open_store(tmp_path) as store:
        store.write([created(1)])
        # (and a newer run: the newest is never deleted)
        store.write([batch(2, run(1, T0, "SUCCESS"), run(1, T0 + 35 * DAY, "SUCCESS"))])
        store.logs.append(1, T0, "stdout", b"its output\n")
        read_state, go_on = threading.Event(), threading.Event()
        real_get = store.logs._get

        def paused_get(key: bytes) -> bytes | None:
            value = real_get(key)
            read_state.set()  # the append has read the state...
            go_on.wait(2)  # ...and retention gets its chance now
            return value

        store.logs._get = paused_get  # type: ignore[method-assign]
        late = threading.Thread(
            target=store.logs.append, args=(1, T0, "stdout", b"late\n"), kwargs={"attempt": 2}
        )
        late.start()
        assert read_state.wait(5)
        retention = threading.Thread(
            target=store.retain, args=(T0 + 40 * DAY, Retention(max_age_ms=30 * DAY))
        )
        retention.start()
        retention.join(0.3)  # it waits for the append to finish (with the fix)
        go_on.set()
        late.join(5)
        retention.join(5)
        del store.logs._get
        assert store.run(1, T0) is None
        assert store.logs.read(1, T0).chunks == []


def test_an_append_does_not_wait_for_a_retention_pass(tmp_path: Path) -> None:
    """Appends come from the node's event loop: retention takes the log store's lock for
    its write alone, never for its scan (found by review: holding it for the pass froze the
    node for as long as a backlog pass took)."""
    import threading
    import time

    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(10 + d, run(1, T0 + d, "SUCCESS")) for d in range(5)])
        scan = store._retain_by_age
        scanning = threading.Event()

        def slow_scan(*args: object, **kwargs: object) -> None:
            scanning.set()
            time.sleep(1.0)  # a long scan: a backlog, a slow disk
            scan(*args, **kwargs)  # type: ignore[arg-type]

        store._retain_by_age = slow_scan  # type: ignore[method-assign]
        retention = threading.Thread(
            target=store.retain, args=(T0 + 10**9, Retention(max_age_ms=1))
        )
        retention.start()
        assert scanning.wait(5)
        started = time.monotonic()
        store.logs.append(2, T0, "stdout", b"x")  # another run's output, meanwhile
        waited = time.monotonic() - started
        retention.join(10)
        assert waited < 0.5


COUNT = Retention(max_age_ms=None, max_runs_per_job=3)


def test_the_count_pass_finds_jobs_over_the_limit_after_a_reopen(tmp_path: Path) -> None:
    """Found by the second review: the count pass visited only jobs given a new run since the
    last pass (kept in memory), so a job over the limit at a restart, or under a limit lowered
    at one, stayed over it for good. Every job's count is swept once after an open, a page
    (``max_entries``) a call, ``more`` set until the sweep is done."""
    with open_store(tmp_path) as store:
        store.write([created(k) for k in range(1, 6)])
        store.write(
            [batch(10 + i, run(k, T0 + i, "SUCCESS")) for k in range(1, 6) for i in range(5)]
        )
    with open_store(tmp_path, epoch=2) as store:
        assert [len(ats(store, k)) for k in range(1, 6)] == [5] * 5
        first = store.retain(T0, COUNT, max_entries=2)
        assert first.more and first.runs_deleted == 4  # two jobs' counts swept, two trimmed
        while store.retain(T0, COUNT, max_entries=2).more:
            pass
        assert [ats(store, k) for k in range(1, 6)] == [[T0 + 2, T0 + 3, T0 + 4]] * 5
        assert [store.run_count(k) for k in range(1, 6)] == [3] * 5
        assert not store.retain(T0, COUNT).more  # swept once an open: done


def test_a_job_kept_over_the_limit_by_a_run_in_flight_is_trimmed_once_it_ends(
    tmp_path: Path,
) -> None:
    """Found by the second review: the run kept in flight ended, no new run came, and the
    job stayed over the limit."""
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write(
            [batch(10 + i, run(1, T0 + i, "RUNNING" if i == 0 else "SUCCESS")) for i in range(5)]
        )
        report = store.retain(T0, COUNT)
        assert report.runs_deleted == 1 and report.kept_in_flight == 1
        assert ats(store, 1) == [T0, T0 + 2, T0 + 3, T0 + 4]
        store.write([batch(20, run(1, T0, "SUCCESS"))])  # it ends: a new state, no new run
        assert store.retain(T0, COUNT).runs_deleted == 1
        assert ats(store, 1) == [T0 + 2, T0 + 3, T0 + 4] and store.run_count(1) == 3


def test_a_count_pass_that_fails_visits_its_jobs_again(tmp_path: Path) -> None:
    import pytest

    from wal.errors import StoreIOError

    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.retain(T0, COUNT)  # the sweep after the open: done
        store.write([batch(10 + i, run(1, T0 + i, "SUCCESS")) for i in range(5)])
        real = store._commit

        def failing(*args: object, **kwargs: object) -> None:
            raise StoreIOError("simulated", path=str(tmp_path))

        store._commit = failing  # type: ignore[method-assign]
        with pytest.raises(StoreIOError):
            store.retain(T0, COUNT)
        store._commit = real  # type: ignore[method-assign]
        assert store.retain(T0, COUNT).runs_deleted == 2
        assert ats(store, 1) == [T0 + 2, T0 + 3, T0 + 4]


class MemoryLogs:
    """A LogStore of its own (what an object store would be): chunks in a dict."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[int, int], list[tuple[str, bytes]]] = {}
        self.drops: list[tuple[int, int, int]] = []
        self.closed = False

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
        self.chunks.setdefault((key, at), []).append((stream, bytes(data)))

    def read(
        self, key: int, at: int, *, cursor: int = 0, limit: int = 64, max_bytes: int = 1 << 20
    ) -> object:
        from wal.logs import LogChunk, LogPage

        items = self.chunks.get((key, at), [])[cursor : cursor + limit]
        chunks = [LogChunk(cursor + i + 1, s, 1, d) for i, (s, d) in enumerate(items)]
        return LogPage(chunks, cursor + len(items), True)

    def drop(self, key: int, lo: int, hi: int) -> None:
        self.drops.append((key, lo, hi))
        for gone in [r for r in self.chunks if r[0] == key and lo <= r[1] < hi]:
            del self.chunks[gone]

    def close(self) -> None:
        self.closed = True


def test_another_log_store_takes_the_runs_logs_and_retention_drops_them(tmp_path: Path) -> None:
    """Found by the second review: the LogStore interface could not be replaced (the store
    made its own, and retention used the local one's batch and lock)."""
    logs = MemoryLogs()
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1, log_store=lambda: logs) as store:
        assert store.logs is logs
        store.write([created(1)])
        days = list(range(12))
        states = {d: "RUNNING" if d == 3 else "SUCCESS" for d in days}
        store.write([batch(10 + d, run(1, T0 + d * DAY, states[d])) for d in days])
        for d in days:
            store.logs.append(1, T0 + d * DAY, "stdout", b"out")
        store.retain(T0 + 21 * DAY, AGE)  # cutoff: day 11, the newest
        # gone with their runs: days 0-10 but day 3 (in flight); day 11 is the newest, kept
        # with its logs (the cutoff does not reach it)
        assert sorted(at for _k, at in logs.chunks) == [T0 + 3 * DAY, T0 + 11 * DAY]
        assert ats(store, 1) == [T0 + 3 * DAY, T0 + 11 * DAY]
        assert all(key == 1 for key, _lo, _hi in logs.drops)
    assert logs.closed


def test_a_failed_pass_keeps_its_page_of_the_sweep(tmp_path: Path) -> None:
    """Found by review: a pass that failed without poisoning the store (here another log
    store's drop) lost its page of the after-open sweep, and the jobs on it stayed over the
    limit until the next open. Another store's own exception is typed."""
    import pytest

    from wal.errors import StoreError

    class FailingOnce(MemoryLogs):
        failed = False

        def drop(self, key: int, lo: int, hi: int) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("the object store said no")
            super().drop(key, lo, hi)

    logs = FailingOnce()
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        store.write([created(1)])
        store.write([batch(10 + i, run(1, T0 + i, "SUCCESS")) for i in range(5)])
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2, log_store=lambda: logs) as store:
        with pytest.raises(StoreError, match="the object store said no"):
            store.retain(T0, COUNT)
        assert store.retain(T0, COUNT).runs_deleted == 2
        assert ats(store, 1) == [T0 + 2, T0 + 3, T0 + 4]


def test_the_age_counts_from_a_runs_end_when_its_record_says_it(tmp_path: Path) -> None:
    """A one-shot scheduled long ago (or a job paused for weeks and resumed) runs now: its
    age counted from its scheduled time, so its logs went at the next pass, a minute after it
    ran (found by review). A final record's ``end`` (the engine's time it ended) is what the
    age counts from; records without one go by their scheduled time, as before."""
    with open_store(tmp_path) as store:
        store.write([created(1), created(2)])
        late = {**run(1, T0, "SUCCESS"), "end": T0 + 25 * DAY}  # scheduled T0, ran day 25
        store.write([batch(10, late), batch(11, run(1, T0 + DAY, "SUCCESS"))])
        store.write([batch(12, run(1, T0 + 26 * DAY, "SUCCESS"))])  # the job's newest
        store.logs.append(1, T0, "stdout", b"ran late")
        store.logs.append(1, T0 + DAY, "stdout", b"ran on time")
        report = store.retain(T0 + 30 * DAY, AGE)  # cutoff: day 20
        assert report.runs_deleted == 1 and report.kept_recent == 1
        assert report.kept_in_flight == 0
        assert ats(store, 1) == [T0, T0 + 26 * DAY]
        assert store.logs.read(1, T0).chunks[0].data == b"ran late"
        # indexed again at its end: a pass once it is of age removes it
        assert store.retain(T0 + 34 * DAY, AGE).runs_deleted == 0
        assert store.retain(T0 + 36 * DAY, AGE).runs_deleted == 1
        assert ats(store, 1) == [T0 + 26 * DAY] and store.logs.read(1, T0).chunks == []


# Retention deletes by ranges (ShardStore.retain: "a few range deletes" per job, "split
# around" the runs kept), not one delete a run: deleting K old runs of a job costs the same
# handful of range deletes whatever K is. Checked twice: what the pass reports (``ranges``) and
# what it actually hands RocksDB (the operations in its write batch: puts, deletes and range
# deletes alike), so that an implementation deleting key by key fails even if it reported
# nothing.


def retention_writes(store: ShardStore) -> list[int]:
    """The number of operations in each retention write ``store`` makes from now on."""
    sizes: list[int] = []
    real = store._commit

    def counting(wb: Any, doing: str, *, sync: bool = True) -> None:
        if doing == "deleting old run history":
            sizes.append(len(wb))
        real(wb, doing, sync=sync)

    store._commit = counting  # type: ignore[method-assign]
    return sizes


def many_old_runs(store: ShardStore, k: int, jobs: int = 1, *, in_flight: bool = False) -> None:
    """``jobs`` jobs of ``k`` old final runs an hour apart, each run with a note and every
    tenth with output, and a newest run each far later (kept by every pass below); with
    ``in_flight``, each job's middle run still RUNNING."""
    store.write([created(j) for j in range(1, jobs + 1)])
    for j in range(1, jobs + 1):
        states = ["SUCCESS"] * k
        if in_flight:
            states[k // 2] = "RUNNING"
        store.write(
            [
                batch(j * 10_000 + i, run(j, T0 + i * HOUR, state), note(j, T0 + i * HOUR))
                for i, state in enumerate(states)
            ]
        )
        store.write([batch(j * 10_000 + k, run(j, T0 + 100 * DAY, "SUCCESS"))])
        for i in range(0, k, 10):
            store.logs.append(j, T0 + i * HOUR, "stdout", b"out")


COUNT_KEEP_ONE = Retention(max_age_ms=None, max_runs_per_job=1)


@pytest.mark.parametrize("policy", [AGE, COUNT_KEEP_ONE], ids=["by age", "by count"])
def test_deleting_k_old_runs_costs_a_few_range_deletes_not_k(
    tmp_path: Path, policy: Retention
) -> None:
    costs: dict[int, tuple[int, list[int]]] = {}
    for k in (40, 400):
        with open_store(tmp_path / str(k)) as store:
            many_old_runs(store, k, jobs=3)
            writes = retention_writes(store)
            report = store.retain(T0 + 100 * DAY, policy)
            assert report.runs_deleted == 3 * k and report.jobs_trimmed == 3
            costs[k] = (report.ranges, writes)
            for j in (1, 2, 3):  # all of it gone: runs, their notes, their output
                assert ats(store, j) == [T0 + 100 * DAY]
                assert store.history(j, 1000) == []
                assert store.logs.read(j, T0).chunks == []
    # one range a job, whatever K: 3 ranges, not 3 * K deletes
    assert costs[40][0] == costs[400][0] == 3, costs
    # and the write RocksDB got is as small for 400 runs a job as for 40
    (ops40,) = costs[40][1]
    (ops400,) = costs[400][1]
    # (13 here: per job its runs', history's and logs' ranges and its run count; the time
    # index's one range; key by key it would be over 3 * K)
    assert ops40 == ops400 <= 3 * 5 + 2, costs


@pytest.mark.parametrize("policy", [AGE, COUNT_KEEP_ONE], ids=["by age", "by count"])
def test_a_run_kept_in_flight_splits_the_range_in_two(tmp_path: Path, policy: Retention) -> None:
    costs: dict[int, tuple[int, list[int]]] = {}
    for k in (40, 400):
        with open_store(tmp_path / str(k)) as store:
            many_old_runs(store, k, in_flight=True)
            writes = retention_writes(store)
            report = store.retain(T0 + 100 * DAY, policy)
            assert report.runs_deleted == k - 1 and report.kept_in_flight == 1
            assert ats(store, 1) == [T0 + (k // 2) * HOUR, T0 + 100 * DAY]
            costs[k] = (report.ranges, writes)
    assert costs[40][0] == costs[400][0] == 2, costs  # before the kept run, and after it
    assert costs[40][1] == costs[400][1] and costs[40][1][0] <= 10, costs


# ------------------------------------------------------------- found by review (2026-12-04)


def test_a_skip_range_is_aged_by_its_last_time_not_its_first(tmp_path: Path) -> None:
    """The record of a long pause, written at the resume, covers times from long ago up to
    now: age retention kept it by its first time, and so deleted it at the next pass, with
    every time of the pause inside the age unaccounted for in the history."""
    with open_store(tmp_path) as store:
        store.write([created(1)])
        resumed = T0 + 40 * DAY
        # a job paused 40 days: one skip of every hourly time of the pause, then runs again
        store.write([batch(2, skip(1, T0 + 3_600_000, resumed - 1, n=959, why="paused"))])
        store.write([batch(3, run(1, resumed, "SUCCESS"))])
        store.write([batch(4, skip(1, T0 + DAY, why="overlap"))])  # one old time: it goes
        store.retain(resumed + 60_000, AGE)  # cutoff: 30 days after T0
        kinds = [(h["t"], h["lo"], h["why"]) for h in store.history(1, 100)]
        assert kinds == [("skip", T0 + 3_600_000, "paused")]  # before the fix: []
        # Indexed again at its last time: once that is past the age, the next pass takes it.
        store.retain(resumed + 5 * DAY, AGE)
        assert [h["why"] for h in store.history(1, 100)] == ["paused"]
        store.retain(resumed + 11 * DAY, AGE)
        assert store.history(1, 100) == []
        assert ats(store, 1) == [resumed]  # (the job's newest run stays, as always)


def test_keys_and_policies_at_the_edges_are_typed_errors_not_struct_errors(
    tmp_path: Path,
) -> None:
    from wal import codec
    from wal.errors import StoreUsageError

    top = codec.I64_MAX
    with open_store(tmp_path) as store:
        store.write([created(1), batch(2, run(1, T0, "SUCCESS"))])
        # The greatest key: nothing stored under it, and no overflow of key + 1.
        assert store.last_runs(top) == [] and store.history(top) == []
        assert store.history_page(top) == ([], None)
        assert store.jobs(after=top) == []
        store.logs.drop(top, 0, 2**63)
        with pytest.raises(StoreUsageError):
            store.jobs(after=top + 1)
    for bad in ({"max_age_ms": 30 * 86_400e3}, {"max_runs_per_job": 2.0}, {"max_age_ms": True}):
        with pytest.raises(StoreUsageError, match="integer"):
            Retention(**bad)  # type: ignore[arg-type]
    with pytest.raises(StoreUsageError, match="2\\*\\*63"):
        Retention(max_age_ms=2**63)
