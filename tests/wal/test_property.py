"""The store against a model made of dicts: random groups of random batches, reopens and
snapshots; after every step, every query answers what the model says."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import wal.store as wal_store
from engine.effects import Persist
from engine.records import Record
from tests.wal.records import job, note, pos, run, skip
from wal.store import ShardStore, StoreCounts

KEYS = st.integers(0, 4)
TIMES = st.integers(-3, 8)
STATES = st.sampled_from(["PENDING", "CLAIMED", "RUNNING", "SUCCESS", "FAILED", "CANCELLED"])

records = st.one_of(
    st.builds(lambda k, v: job(k, f"j{k}", ver=v, note=f"v{v}"), KEYS, st.integers(1, 5)),
    st.builds(
        lambda k, n, p, g: pos(k, n, paused=p, gone=g),
        KEYS,
        st.one_of(st.none(), TIMES),
        st.booleans(),
        st.booleans(),
    ),
    st.builds(lambda k, t, s: run(k, t, s), KEYS, TIMES, STATES),
    st.builds(lambda k, t: skip(k, t, t + 2, n=3), KEYS, TIMES),
    st.builds(lambda k, t: note(k, t), KEYS, TIMES),
    st.just({"t": "dep", "v": 1, "up": "a", "down": "b", "on": True}),  # log only
)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tickwheel-prop-")
        self.epoch = 1
        self.store = ShardStore.open(self.dir, shard=0, shards=1, epoch=self.epoch)
        self.batch_id = 0
        self.seq = 0
        # the model
        self.jobs: dict[int, tuple[int, dict[str, Any], str]] = {}
        self.pos: dict[int, Record] = {}
        self.runs: dict[tuple[int, int], Record] = {}
        self.new_runs: dict[int, int] = {}
        self.history: list[tuple[tuple[int, int, int, int, int], Record]] = []
        self.log: list[tuple[int, int, int, list[Record]]] = []  # seq, batch, epoch, records
        self.snapshot: tuple[int, dict[str, np.ndarray[Any, Any]], dict[str, Any]] | None = None

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(group=st.lists(st.lists(records, min_size=1, max_size=4), min_size=1, max_size=3))
    def write(self, group: list[list[Record]]) -> None:
        batches = []
        for recs in group:
            self.batch_id += 1
            batches.append(Persist(self.batch_id, self.epoch, tuple(recs)))
        seqs = self.store.write(batches)
        assert seqs == list(range(self.seq + 1, self.seq + 1 + len(batches)))
        for b, s in zip(batches, seqs, strict=True):
            self.seq = s
            self.log.append((s, b.batch_id, b.epoch, list(b.records)))
            for i, r in enumerate(b.records):
                self.apply(b, i, r)

    def apply(self, b: Persist, index: int, r: Record) -> None:
        kind = r["t"]
        if kind == "job":
            self.jobs[r["key"]] = (r["ver"], r["spec"], r["id"])
        elif kind == "pos":
            self.pos[r["key"]] = r
        elif kind == "run":
            if (r["key"], r["at"]) not in self.runs:
                self.new_runs[r["key"]] = self.new_runs.get(r["key"], 0) + 1
            self.runs[(r["key"], r["at"])] = r
        elif kind in ("skip", "note"):
            when = r["lo"] if kind == "skip" else r["at"]
            self.history.append(((r["key"], when, b.epoch, b.batch_id, index), r))

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.epoch += 1
        self.store = ShardStore.open(self.dir, shard=0, shards=1, epoch=self.epoch)

    @precondition(lambda self: self.seq > (self.snapshot[0] if self.snapshot else 0))
    @rule(n=st.integers(0, 50), back=st.integers(0, 2))
    def take_snapshot(self, n: int, back: int) -> None:
        floor = self.snapshot[0] + 1 if self.snapshot else 1
        seq = max(floor, self.seq - back)
        arrays = {
            "next": np.arange(n, dtype=np.int64) * seq,
            "flags": np.full(n, seq % 7, np.uint8),
        }
        meta = {"seq": seq, "names": ["a", "b"]}
        self.store.write_snapshot(seq, arrays, meta)
        self.snapshot = (seq, arrays, meta)
        self.log = [entry for entry in self.log if entry[0] > seq]

    @invariant()
    def queries_match_the_model(self) -> None:
        store = self.store
        for key in range(5):
            want = self.jobs.get(key)
            got = store.latest(key)
            assert got == (None if want is None else (want[0], want[1]))
            assert store.key_of(f"j{key}") == (None if want is None else key)
            stored = store.job_by_key(key)
            if want is not None:
                assert stored is not None and stored.position == self.pos.get(key)
            runs = sorted(((at, r) for (k, at), r in self.runs.items() if k == key), reverse=True)
            assert store.last_runs(key, 100) == [r for _, r in runs]
            assert store.last_runs(key, 2) == [r for _, r in runs[:2]]
            for at, r in runs:
                assert store.run(key, at) == r
            hist = sorted((h for h in self.history if h[0][0] == key), reverse=True)
            assert store.history(key, 100) == [r for _, r in hist]
            assert store.run_count(key) == self.new_runs.get(key, 0)
        assert store.counts == self.counts()

    @invariant()
    def recovery_matches_the_model(self) -> None:
        got = self.store.load()
        assert got.epoch == self.epoch and got.last_seq == self.seq
        assert [r for _s, _b, _e, recs in self.log for r in recs] == list(got.tail)
        assert [(s, b, e) for s, b, e, _ in self.store.log_batches()] == [
            (s, b, e) for s, b, e, _ in self.log
        ]
        if self.snapshot is None:
            assert got.snapshot is None and got.snapshot_seq == -1
        else:
            seq, arrays, meta = self.snapshot
            assert got.snapshot is not None and got.snapshot_seq == seq
            assert got.snapshot.meta == meta
            assert set(got.snapshot.arrays) == set(arrays)
            for name, array in arrays.items():
                np.testing.assert_array_equal(got.snapshot.arrays[name], array)
                assert got.snapshot.arrays[name].dtype == array.dtype

    def counts(self) -> StoreCounts:
        live = [p for p in self.pos.values() if not p["gone"]]
        return StoreCounts(
            jobs=len(live),
            pending_jobs=sum(1 for p in live if not p["paused"] and p["next"] is not None),
            paused_jobs=sum(1 for p in live if p["paused"]),
            runs_pending=sum(1 for r in self.runs.values() if r["state"] == "PENDING"),
            runs_in_flight=sum(
                1 for r in self.runs.values() if r["state"] in ("CLAIMED", "RUNNING")
            ),
        )


class UncachedStoreMachine(StoreMachine):
    """The same with the store's write caches emptied before every group: every count then
    rests on what the store reads back, and on its high mark of the positions it ever held (a
    position above it, a new job's, is not read)."""

    def __init__(self) -> None:
        self.cache_entries = wal_store.CACHE_ENTRIES
        wal_store.CACHE_ENTRIES = 0  # (emptied whenever they hold anything)
        try:
            super().__init__()
        except BaseException:
            wal_store.CACHE_ENTRIES = self.cache_entries  # (teardown will not run)
            raise

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            wal_store.CACHE_ENTRIES = self.cache_entries


StoreMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=8, deadline=None)
TestStoreMachine = StoreMachine.TestCase
UncachedStoreMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=8, deadline=None
)
TestUncachedStoreMachine = UncachedStoreMachine.TestCase
