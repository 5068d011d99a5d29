"""Run logs: order, streams, the per-run cap (head, tail, the cut marker), paging, dropping."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.wal.records import T0
from wal.errors import StoreUsageError
from wal.logs import CUT, LogChunk, LogLimits, LogStore
from wal.store import ShardStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ShardStore]:
    with ShardStore.open(
        tmp_path, shard=0, shards=1, epoch=1, log_limits=LogLimits(head_bytes=10, tail_bytes=20)
    ) as s:
        yield s


def read_all(logs: LogStore, key: int, at: int, *, limit: int = 3) -> list[LogChunk]:
    out: list[LogChunk] = []
    cursor = 0
    for _ in range(1000):
        page = logs.read(key, at, cursor=cursor, limit=limit)
        out.extend(page.chunks)
        cursor = page.cursor
        if page.at_end:
            return out
    raise AssertionError("paging never ended")


def text(chunks: list[LogChunk]) -> str:
    return "".join(f"[cut {c.dropped}]" if c.stream == CUT else c.data.decode() for c in chunks)


def test_chunks_come_back_in_order_with_their_stream(store: ShardStore) -> None:
    logs: LogStore = store.logs
    logs.append(1, T0, "stdout", b"abc")
    logs.append(1, T0, "stderr", b"de", attempt=2)
    logs.append(1, T0, "stdout", b"f")
    chunks = read_all(logs, 1, T0)
    assert [(c.stream, c.attempt, c.data) for c in chunks] == [
        ("stdout", 1, b"abc"),
        ("stderr", 2, b"de"),
        ("stdout", 1, b"f"),
    ]
    assert logs.read(1, T0 + 1).chunks == []  # another run has its own log


def test_under_the_cap_nothing_is_cut(store: ShardStore) -> None:
    for piece in (b"0123456", b"789ab", b"cdefghijklmnopqr"):  # 30 bytes: cap 10 + 20
        store.logs.append(1, T0, "stdout", piece)
    chunks = read_all(store.logs, 1, T0)
    assert text(chunks) == "0123456789abcdefghijklmnopqr"
    assert all(c.stream != CUT for c in chunks)


def test_over_the_cap_head_and_tail_stay_and_the_cut_says_how_much(store: ShardStore) -> None:
    data = bytes(range(48, 48 + 75))  # 75 bytes in pieces of 7
    for i in range(0, len(data), 7):
        store.logs.append(2, T0, "stdout", data[i : i + 7])
    chunks = read_all(store.logs, 2, T0, limit=2)
    cuts = [c for c in chunks if c.stream == CUT]
    assert len(cuts) == 1 and cuts[0].dropped == 75 - 10 - 20
    body = b"".join(c.data for c in chunks)
    assert body == data[:10] + data[-20:]
    marker_at = chunks.index(cuts[0])
    assert b"".join(c.data for c in chunks[:marker_at]) == data[:10]


def test_one_huge_append_keeps_only_what_fits(store: ShardStore) -> None:
    store.logs.append(3, T0, "stderr", b"x" * 5 + b"y" * 1000 + b"z" * 20)
    chunks = read_all(store.logs, 3, T0)
    assert text(chunks) == "xxxxxyyyyy[cut 995]" + "z" * 20


def test_a_reader_that_falls_behind_the_tail_is_told(store: ShardStore) -> None:
    for i in range(3):
        store.logs.append(4, T0, "stdout", bytes([65 + i]) * 10)  # head 10, tail 20 so far
    first = store.logs.read(4, T0, limit=2)  # head chunk and the first tail chunk
    assert [c.data for c in first.chunks] == [b"A" * 10, b"B" * 10]
    for i in range(3, 6):
        store.logs.append(4, T0, "stdout", bytes([65 + i]) * 10)
    rest = store.logs.read(4, T0, cursor=first.cursor, limit=100)
    assert rest.chunks[0].stream == CUT and rest.chunks[0].dropped == 30
    assert b"".join(c.data for c in rest.chunks) == b"E" * 10 + b"F" * 10
    assert rest.at_end


def test_pages_respect_max_bytes(store: ShardStore) -> None:
    for _ in range(3):
        store.logs.append(5, T0, "stdout", b"12345")
    page = store.logs.read(5, T0, limit=100, max_bytes=6)
    assert len(page.chunks) == 2 and not page.at_end


def test_logs_survive_reopen_and_drop_by_range(tmp_path: Path) -> None:
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        for at in (T0, T0 + 1, T0 + 2):
            store.logs.append(6, at, "stdout", b"out")
        store.logs.append(7, T0, "stdout", b"other job")
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2) as store:
        assert text(read_all(store.logs, 6, T0 + 1)) == "out"
        store.logs.drop(6, T0, T0 + 2)
        assert store.logs.read(6, T0).chunks == []
        assert store.logs.read(6, T0 + 1).chunks == []
        assert text(read_all(store.logs, 6, T0 + 2)) == "out"
        assert text(read_all(store.logs, 7, T0)) == "other job"


def test_bad_calls(store: ShardStore) -> None:
    with pytest.raises(StoreUsageError):
        store.logs.append(1, T0, "stdin", b"x")
    with pytest.raises(StoreUsageError):
        store.logs.append(1, T0, "stdout", "text")  # type: ignore[arg-type]
    with pytest.raises(StoreUsageError):
        store.logs.read(1, T0, limit=0)
    with pytest.raises(StoreUsageError):
        LogLimits(tail_bytes=0)
