"""Retention always keeps each job's newest run (the run with the greatest scheduled time).

The gap it closes: a replacing create (or a create of a cancelled id) naming a one-shot time
that already ran asks the store (``has_run``) whether that run went out; when age retention
had deleted the run, the time fired again and an at-most-once task ran twice under one run
id. Here: that reproduction, through the store and through the engine, and a stateful
property test of retention against a model of dicts."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.effects import Persist, ReportFinished, WorkerHello
from engine.records import Record
from engine.runs import FINAL_VALUES, IN_FLIGHT_VALUES
from engine.schedules import format_utc
from engine.shard import ShardEngine
from tests.engine.harness import Node
from tests.wal.records import T0, batch, created, job, note, pos, run
from wal import codec
from wal.logs import CUT
from wal.store import _BYTIME, _NRUNS, Retention, ShardStore

DAY = 86_400_000
AGE = Retention(max_age_ms=10 * DAY, max_runs_per_job=None)


def open_store(path: Path | str, epoch: int = 1) -> ShardStore:
    return ShardStore.open(path, shard=0, shards=1, epoch=epoch)


def ats(store: ShardStore, key: int) -> list[int]:
    return sorted(r["at"] for r in store.last_runs(key, 10_000))


# ------------------------------------------------------------------ the gap, reproduced


def test_a_one_shot_run_that_went_out_is_still_known_after_age_retention(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(2, run(1, T0, "SUCCESS", tok=7), note(1, T0))])
        store.logs.append(1, T0, "stdout", b"sent the invoice\n")
        assert store.has_run(1, T0)
        report = store.retain(T0 + 40 * DAY, Retention())  # the node's default: 30 days
        assert report.runs_deleted == 0 and report.kept_newest == 1
        assert store.has_run(1, T0)  # before the fix: False, and the time was owed again
        assert ats(store, 1) == [T0] and store.run_count(1) == 1
        # Only its record stays: its logs and notes are past the age as any run's (found by
        # review: a megabyte of output per job, kept for good). A reader of its logs gets one
        # cut marker of every byte it had, not an empty log that reads as a silent task.
        page = store.logs.read(1, T0)
        assert [(c.stream, c.dropped) for c in page.chunks] == [(CUT, 17)] and page.at_end
        assert store.logs.read(1, T0, cursor=page.cursor).chunks == []
        assert store.history(1) == []
        # ... and it stays, pass after pass, its marker too
        for days in (41, 400, 4000):
            store.retain(T0 + days * DAY, Retention(max_runs_per_job=1))
            assert store.has_run(1, T0)
            assert [(c.stream, c.dropped) for c in store.logs.read(1, T0).chunks] == [(CUT, 17)]
        # Output that comes after (an on_timeout=mark task still writing) follows the marker,
        # and a follower at the marker's cursor gets it without the marker again.
        store.logs.append(1, T0, "stderr", b"late\n")
        assert [(c.stream, c.data, c.dropped) for c in store.logs.read(1, T0).chunks] == [
            (CUT, b"", 17),
            ("stderr", b"late\n", 0),
        ]
        assert [c.data for c in store.logs.read(1, T0, cursor=page.cursor).chunks] == [b"late\n"]
        # A run that printed nothing gets no marker.
        store.write([created(2)])
        store.write([batch(3, run(2, T0, "SUCCESS", tok=8))])
        store.retain(T0 + 40 * DAY, Retention())
        assert store.has_run(2, T0) and store.logs.read(2, T0).chunks == []


class _StoreDirectory:
    """The harness node's directory, made the real store: what it absorbs is written."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.batch_id = 0

    def absorb(self, records: Iterable[Record]) -> None:
        self.batch_id += 1
        self.store.write([Persist(self.batch_id, self.store.epoch, tuple(records))])


def test_a_replacing_create_does_not_run_a_one_shot_again_after_retention(
    tmp_path: Path,
) -> None:
    """End to end: the engine asks the real store, after a retention pass 40 days on."""
    with open_store(tmp_path) as store:
        node = Node()
        directory = _StoreDirectory(store)
        node.directory = directory  # type: ignore[assignment]
        node.engine = ShardEngine(
            epoch=node.epoch,
            wall_ms=node.wall,
            mono_ms=node.mono,
            config=node.config,
            directory=store,
        )
        node.do(WorkerHello("w1", ("default",), 5))
        at = format_utc(node.wall + 1000)
        node.create(id="m", schedule={"at": at}, delivery="at_most_once")
        node.advance(1000)
        (ticket,) = node.tickets()
        node.do(ReportFinished("w1", ticket.run_id, ticket.token, "success", 0))
        node.advance(40 * DAY)
        store.retain(node.wall, Retention())
        reply = node.create(id="m", schedule={"at": at}, delivery="at_most_once", replace=True)
        assert reply is not None and reply.result is not None
        assert reply.result["next_fire_ms"] is None  # before the fix: the time, owed again
        node.advance(1000)
        assert len(node.tickets()) == 1


def test_the_newest_survives_count_retention_and_goes_once_superseded(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(2, run(1, T0, "SUCCESS"))])
        # a policy keeping nothing is refused: the newest run always stays
        import pytest

        from wal.errors import StoreUsageError

        with pytest.raises(StoreUsageError):  # when the policy is made, not at each pass
            Retention(max_age_ms=None, max_runs_per_job=0)
        with pytest.raises(StoreUsageError):
            Retention(max_age_ms=-1)
        assert store.retain(T0 + 20 * DAY, AGE).kept_newest == 1
        # a newer run supersedes it: once that newer run is there, the old one ages out on
        # the next pass, although the time index no longer had it (it is indexed again)
        store.write([batch(3, run(1, T0 + 15 * DAY, "SUCCESS"))])
        report = store.retain(T0 + 20 * DAY, AGE)
        assert report.runs_deleted == 1 and ats(store, 1) == [T0 + 15 * DAY]
        assert store.run_count(1) == 1
        # the same through a reopen (no write caches: the flag is read from the store)
        assert store.retain(T0 + 40 * DAY, AGE).kept_newest == 1
    with open_store(tmp_path, epoch=2) as store:
        store.write([batch(4, run(1, T0 + 35 * DAY, "FAILED"), epoch=2)])
        assert store.retain(T0 + 50 * DAY, AGE).runs_deleted == 1
        assert ats(store, 1) == [T0 + 35 * DAY] and store.run_count(1) == 1


# ------------------------------------------------------------------ the property test

JOBS = st.integers(0, 3)
DAYS = st.integers(0, 24)
STATES = st.sampled_from(["PENDING", "CLAIMED", "RUNNING", "SUCCESS", "FAILED", "CANCELLED"])


def _index(store: ShardStore) -> set[tuple[int, int]]:
    """Every (job, time) entry of the time index."""
    return {
        (codec.read_i64(k, 8), codec.read_i64(k))
        for k, _v in store._scan(_BYTIME, codec.LOW8 * 2, None)
    }


def _newest_unindexed(store: ShardStore, job: int) -> bool:
    raw = store._get(_NRUNS, codec.i64(job))
    return raw is not None and raw[16:17] == b"\x01"


class RetentionMachine(RuleBasedStateMachine):
    """Runs of a few jobs at random times in random states, retention by age, by count or
    both, reopens; the model: a dict of runs, and retention as its documented rule."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tickwheel-keep-")
        self.epoch = 1
        self.store = open_store(self.dir)
        self.store.write([Persist(0, 1, tuple(r for k in range(4) for r in (job(k), pos(k))))])
        self.batch_id = 0
        self.runs: dict[tuple[int, int], str] = {}  # (job, day) -> state
        # (job, day) -> the chunks a read gives: ("out", bytes) per append, or first a
        # ("cut", bytes) where an age pass dropped the output of a newest run it kept
        self.logs: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self.touched: set[int] = set()  # jobs given a run not stored before, since a count pass
        self.sweep = True  # every job's count is looked at by the first count pass of an open

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -------------------------------------------------------------- the model's retention

    def _newest(self, j: int) -> int | None:
        return max((d for jj, d in self.runs if jj == j), default=None)

    def _model_age(self, now: int, age: int) -> None:
        cutoff = now - age
        newest = {j: self._newest(j) for j, _ in self.runs}
        for (j, d), state in list(self.runs.items()):
            if d < cutoff and state in FINAL_VALUES and d != newest[j]:
                self._model_drop(j, d)
            elif d < cutoff and state in FINAL_VALUES and (j, d) in self.logs:
                # the newest keeps its record; its output goes, counted by one marker
                self.logs[(j, d)] = [("cut", sum(n for _kind, n in self.logs[(j, d)]))]

    def _model_count(self, limit: int) -> None:
        touched, self.touched = self.touched, set()
        if self.sweep:  # (one page: the sweep's max_entries is far above four jobs)
            self.sweep = False
            touched |= {j for j in range(4) if sum(jj == j for jj, _d in self.runs) > limit}
        for j in touched:
            days = sorted(d for jj, d in self.runs if jj == j)
            for d in days[: max(0, len(days) - limit)]:  # the oldest excess, never the newest
                if self.runs[(j, d)] in FINAL_VALUES:
                    self._model_drop(j, d)
            if sum(jj == j for jj, _d in self.runs) > limit:
                self.touched.add(j)  # kept over the limit by runs in flight: next pass too

    def _model_drop(self, j: int, d: int) -> None:
        del self.runs[(j, d)]
        self.logs.pop((j, d), None)

    # -------------------------------------------------------------- rules

    @rule(
        runs=st.lists(st.tuples(JOBS, DAYS, STATES), min_size=1, max_size=6),
        with_logs=st.booleans(),
    )
    def write(self, runs: list[tuple[int, int, str]], with_logs: bool) -> None:
        self.batch_id += 1
        self.store.write(
            [batch(self.batch_id, *(run(j, T0 + d * DAY, s) for j, d, s in runs), epoch=self.epoch)]
        )
        for j, d, s in runs:
            if (j, d) not in self.runs:
                self.touched.add(j)
            self.runs[(j, d)] = s
        if with_logs:
            j, d, _s = runs[0]
            self.store.logs.append(j, T0 + d * DAY, "stdout", b"out")
            self.logs.setdefault((j, d), []).append(("out", 3))

    @rule(now=DAYS, age=st.integers(0, 12), max_entries=st.integers(1, 4))
    def retain_by_age(self, now: int, age: int, max_entries: int) -> None:
        policy = Retention(max_age_ms=age * DAY, max_runs_per_job=None)
        for _ in range(1000):  # bounded: each pass visits at least one entry
            report = self.store.retain(T0 + now * DAY, policy, max_entries=max_entries)
            if not report.more:
                break
        assert not report.more
        self._model_age(now, age)

    @rule(limit=st.integers(1, 4))
    def retain_by_count(self, limit: int) -> None:
        self.store.retain(T0, Retention(max_age_ms=None, max_runs_per_job=limit))
        self._model_count(limit)

    @rule(now=DAYS, age=st.integers(0, 12), limit=st.integers(1, 4))
    def retain_both(self, now: int, age: int, limit: int) -> None:
        policy = Retention(max_age_ms=age * DAY, max_runs_per_job=limit)
        assert not self.store.retain(T0 + now * DAY, policy).more
        self._model_age(now, age)  # the age pass first, in its own write
        self._model_count(limit)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.epoch += 1
        self.store = open_store(self.dir, self.epoch)
        self.touched = set()  # which jobs got new runs is the running store's memory only...
        self.sweep = True  # ...so every job's count is swept again once

    # -------------------------------------------------------------- what must hold

    @invariant()
    def stored_runs_are_the_models(self) -> None:
        for j in range(4):
            stored = {(j, (r["at"] - T0) // DAY): r["state"] for r in self.store.last_runs(j, 1000)}
            assert stored == {k: s for k, s in self.runs.items() if k[0] == j}
            assert self.store.run_count(j) == len(stored)

    @invariant()
    def counts_are_exact(self) -> None:
        counts = self.store.counts
        states = list(self.runs.values())
        assert counts.runs_pending == states.count("PENDING")
        assert counts.runs_in_flight == sum(s in IN_FLIGHT_VALUES for s in states)

    @invariant()
    def logs_go_with_their_runs(self) -> None:
        for j in range(4):
            for d in range(25):
                chunks = self.store.logs.read(j, T0 + d * DAY, limit=1000).chunks
                read = [
                    (c.stream, c.dropped) if c.stream == CUT else ("out", len(c.data))
                    for c in chunks
                ]
                assert read == self.logs.get((j, d), [])

    @invariant()
    def the_time_index_finds_every_run_but_a_newest_it_marked(self) -> None:
        # Every run an age pass may have to delete one day is in the time index: all but
        # each job's newest, which may be out of it only when its job's count says so (it is
        # indexed again when a newer run comes).
        index = _index(self.store)
        for j, d in self.runs:
            if (j, T0 + d * DAY) in index:
                continue
            assert d == self._newest(j) and _newest_unindexed(self.store, j)


# No shrinking: every attempt opens RocksDB directories (~30 ms each), and shrinking a failure
# ran past the suite's 300 s test timeout (which then reads as a confusing "flaky strategy"
# error); the failing example as found, at most 12 steps, is printed instead.
RetentionMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=12,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
test_retention_keeps_each_jobs_newest_run = RetentionMachine.TestCase


def test_runs_kept_in_flight_do_not_hold_up_the_sweep(tmp_path: Path) -> None:
    """An age pass that stops at ``max_entries`` goes on past what it visited: the runs it
    keeps in flight (indexed again at their own time) used to fill every later call, and the
    node's loop while ``more`` never ended (found by review)."""
    with open_store(tmp_path) as store:
        for key in (1, 2, 3):
            store.write([created(key)])
            store.write([batch(1 + key, run(key, T0, "PENDING"))])
        store.write([batch(9, run(3, T0 + DAY, "SUCCESS"), run(3, T0 + 2 * DAY, "SUCCESS"))])
        policy = Retention(max_age_ms=DAY, max_runs_per_job=None)
        calls = 0
        while True:
            calls += 1
            assert calls <= 10
            if not store.retain(T0 + 30 * DAY, policy, max_entries=1).more:
                break
        assert ats(store, 3) == [T0, T0 + 2 * DAY]  # the finished older run went
        # the runs kept in flight are found by the next sweep, once they are final
        store.write([batch(10, run(1, T0, "SUCCESS"), run(1, T0 + 3 * DAY, "SUCCESS"))])
        while store.retain(T0 + 30 * DAY, policy, max_entries=1).more:
            pass
        assert ats(store, 1) == [T0 + 3 * DAY]
