"""Snapshots: arbitrary arrays round-trip through a few large values; the log up to the
snapshot is dropped; recovery hands back the snapshot and the tail after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wal.store
from tests.wal.records import batch, created, run
from wal.errors import InvalidSnapshot
from wal.store import ShardStore


def open_store(path: Path, epoch: int = 1) -> ShardStore:
    return ShardStore.open(path, shard=0, shards=1, epoch=epoch)


ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "next": np.arange(-5, 995, dtype=np.int64) * 1000,
    "ver": np.ones(1000, dtype=np.uint32),
    "flags": np.array([1, 0, 3], dtype=np.uint8),
    "grid": np.arange(12, dtype=np.float64).reshape(3, 4),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "empty": np.zeros(0, dtype=np.int32),
    "big-endian": np.arange(4, dtype=">u4"),
    "records": np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
    "scalar": np.array(7, dtype=np.int8),
}


def assert_same(
    got: dict[str, np.ndarray[Any, Any]], want: dict[str, np.ndarray[Any, Any]]
) -> None:
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array)
        assert got[name].flags.writeable, name


def test_snapshot_round_trip_with_the_tail_after_it(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(k) for k in range(3)])  # seqs 1..3
        store.write_snapshot(3, ARRAYS, {"batch": 7, "profiles": [{"tier": "default"}]})
        store.write([batch(10, run(0, 5)), batch(11, run(1, 6))])  # seqs 4, 5
    with open_store(tmp_path, epoch=2) as store:
        got = store.load()
        assert got.snapshot is not None and got.snapshot_seq == 3 and got.last_seq == 5
        assert got.snapshot.meta == {"batch": 7, "profiles": [{"tier": "default"}]}
        assert_same(got.snapshot.arrays, ARRAYS)
        assert [(r["t"], r["key"]) for r in got.tail] == [("run", 0), ("run", 1)]
        # the log up to the snapshot is gone; the query families are not
        assert [s for s, *_ in store.log_batches()] == [4, 5]
        assert store.key_of("job-2") == 2
        assert store.write([created(9, epoch=2)]) == [6]


def test_arrays_larger_than_a_chunk_are_cut_and_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wal.store, "SNAPSHOT_CHUNK_BYTES", 1000)
    arrays = {"a": np.arange(10_001, dtype=np.int64), "b": np.arange(3, dtype=np.int8)}
    with open_store(tmp_path) as store:
        store.write([created(0)])
        written = store.write_snapshot(1, arrays, {})
        assert written >= 10_001 * 8
    with open_store(tmp_path, epoch=2) as store:
        got = store.load().snapshot
        assert got is not None
        assert_same(got.arrays, arrays)


def test_a_newer_snapshot_replaces_the_older(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(k) for k in range(4)])
        store.write_snapshot(2, {"x": np.array([1])}, {"n": 1})
        store.write_snapshot(4, {"y": np.array([2.0])}, {"n": 2})
        with pytest.raises(InvalidSnapshot, match="not newer"):
            store.write_snapshot(3, {}, {})
    with open_store(tmp_path, epoch=2) as store:
        got = store.load()
        assert got.snapshot_seq == 4 and got.snapshot is not None
        assert got.snapshot.meta == {"n": 2} and list(got.snapshot.arrays) == ["y"]
        assert list(got.tail) == [] and got.last_seq == 4


def test_a_snapshot_of_everything_leaves_positions_counting_on(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(0), created(1)])
        store.write_snapshot(2, {}, {})
    with open_store(tmp_path, epoch=2) as store:
        assert store.last_seq == 2
        assert store.write([created(5, epoch=2)]) == [3]


@pytest.mark.parametrize(
    ("arrays", "meta", "seq", "match"),
    [
        ({"o": np.array([object()])}, {}, 1, "Python objects"),
        ({"": np.zeros(1)}, {}, 1, "non-empty str"),
        ({"a\0b": np.zeros(1)}, {}, 1, "without NUL"),
        ({"l": [1, 2]}, {}, 1, "not an ndarray"),
        ({}, {"x": object()}, 1, "meta cannot be encoded"),
        ({}, {}, 2, "never handed out"),
        ({}, {}, -1, "never handed out"),
    ],
)
def test_bad_snapshots_are_refused(
    tmp_path: Path, arrays: dict[str, Any], meta: dict[str, Any], seq: int, match: str
) -> None:
    with open_store(tmp_path) as store:
        store.write([created(0)])
        with pytest.raises(InvalidSnapshot, match=match):
            store.write_snapshot(seq, arrays, meta)
        assert store.load().snapshot is None
        assert list(tmp_path.glob("*.tmp")) == []


def test_a_snapshot_file_a_crash_left_before_its_ingest_is_removed_at_open(
    tmp_path: Path,
) -> None:
    """A SIGKILL while a snapshot is written leaves ``snapshot-N.sst.tmp`` beside RocksDB's
    files; nothing reads it, and it stayed for good (found by review)."""
    with open_store(tmp_path, epoch=1) as store:
        store.write([created(1)])
    left = tmp_path / "snapshot-7.sst.tmp"
    left.write_bytes(b"x" * 4096)
    with open_store(tmp_path, epoch=2) as store:
        assert store.job_by_key(1) is not None
    assert not left.exists()
