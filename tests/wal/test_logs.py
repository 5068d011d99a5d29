"""Run logs: order, streams, the per-run cap (head, tail, the cut marker), paging, dropping."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rocksdict import WriteBatch

from tests.wal.records import T0
from wal.errors import StoreUsageError
from wal.logs import CUT, LogChunk, LogLimits, LogStore, RocksLogStore
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
    # B was read; C and D were dropped before this reader got to them (A was the head).
    assert rest.chunks[0].stream == CUT and rest.chunks[0].dropped == 20
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


def test_a_chunk_sent_again_with_its_offset_is_stored_once(store: ShardStore) -> None:
    logs = store.logs
    logs.append(8, T0, "stdout", b"first\n", attempt=1, offset=0)
    logs.append(8, T0, "stdout", b"first\n", attempt=1, offset=0)  # its answer was lost
    logs.append(8, T0, "stderr", b"oops\n", attempt=1, offset=6)
    logs.append(8, T0, "stdout", b"abc", attempt=1, offset=11)
    logs.append(8, T0, "stdout", b"bcdef", attempt=1, offset=12)  # overlaps: the rest only
    logs.append(8, T0, "stdout", b"first\n", attempt=2, offset=0)  # another attempt's own
    logs.append(8, T0, "stdout", b"x", attempt=1)  # no offset (an older worker): no check
    chunks = read_all(logs, 8, T0, limit=100)
    assert all(c.stream != CUT for c in chunks)
    got = {a: b"".join(c.data for c in chunks if c.attempt == a) for a in (1, 2)}
    assert got == {1: b"first\noops\nabcdefx", 2: b"first\n"}
    with pytest.raises(StoreUsageError):
        logs.append(8, T0, "stdout", b"y", offset=-1)
    # past 63 bits with its data: an OverflowError (the node's `internal`) before
    for offset in (2**63 - 1, 2**64 - 1):
        with pytest.raises(StoreUsageError):
            logs.append(8, T0, "stdout", b"y", offset=offset)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 25), st.sampled_from(["stdout", "stderr"])),
        st.tuples(st.just("read"), st.integers(0, 2), st.integers(1, 4), st.integers(1, 40)),
        st.tuples(st.just("mark")),
    ),
    max_size=40,
)


_RUNS = iter(range(T0, T0 + 10**9))  # a fresh run per example, in one store


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardStore]:
    with ShardStore.open(tmp_path_factory.mktemp("logs"), shard=0, shards=1, epoch=1) as s:
        yield s


@settings(max_examples=150, deadline=None)
@given(head=st.integers(0, 12), tail=st.integers(1, 30), ops=_OPS)
def test_every_reader_accounts_for_every_byte_with_cuts(
    shared_store: ShardStore, head: int, tail: int, ops: list[tuple[Any, ...]]
) -> None:
    """Against a model (the bytes written, in order): what each of three readers following
    the log page by page gets, data and ``cut`` chunks, is the written bytes in order with a
    gap of exactly ``dropped`` bytes at each cut (one cut per gap: never two in a row in one
    page), and all of it (up to what was written) once a page says ``at_end``. Read from the
    start at the end, it is the head, one cut of everything dropped, and the kept tail."""
    logs = shared_store.logs
    assert isinstance(logs, RocksLogStore)
    logs.limits = LogLimits(head_bytes=head, tail_bytes=tail)
    at = next(_RUNS)
    written = b""
    marked = 0  # bytes written before the last retention mark: all of them dropped
    readers = [[0, 0] for _ in range(3)]  # cursor, position in what was written
    for n, op in enumerate(ops):
        if op[0] == "append":
            piece = bytes((n + i) % 251 for i in range(op[1]))
            logs.append(1, at, op[2], piece)
            written += piece
            continue
        if op[0] == "mark":
            mark_dropped(logs, 1, at)
            if written:  # a run with no output gets no marker
                marked = len(written)
            continue
        reader = readers[op[1]]
        page = logs.read(1, at, cursor=reader[0], limit=op[2], max_bytes=op[3])
        after_cut = False
        for chunk in page.chunks:
            if chunk.stream == CUT:
                assert chunk.dropped > 0 and not after_cut
                reader[1] += chunk.dropped
            else:
                assert written[reader[1] : reader[1] + len(chunk.data)] == chunk.data
                reader[1] += len(chunk.data)
            after_cut = chunk.stream == CUT
        reader[0] = page.cursor
        if page.at_end:
            assert reader[1] == len(written)
    everything = read_all(logs, 1, at, limit=1000)
    kept_head = written[:head] if not marked else b""
    rest = written[len(kept_head) :] if not marked else written[marked:]
    kept = rest[-tail:] if rest else b""
    cuts = [c.dropped for c in everything if c.stream == CUT]
    dropped = marked + len(rest) - len(kept)
    assert cuts == ([dropped] if dropped else [])
    assert b"".join(c.data for c in everything) == kept_head + kept


def mark_dropped(logs: RocksLogStore, key: int, at: int) -> None:
    """What retention does to the newest run of a job past the age limit: drop its logs and
    leave a state saying every byte went (one write, under the store's exclusive lock)."""
    batch = WriteBatch(raw_mode=True)
    with logs.exclusive:
        logs.drop_into(batch, key, at, at + 1)
        logs.mark_dropped_into(batch, key, at)
        logs._write(batch, "marking a run's logs dropped")


def test_a_follower_past_a_retention_mark_gets_a_cut_and_every_chunk_after_it(
    store: ShardStore,
) -> None:
    """A follower whose cursor is deep in a run's log when retention marks it dropped (the run
    is its job's newest and past the age; its task still writes) is told what it missed and
    then gets every chunk appended after the mark: the marked state's seqs go on from the old
    ones (found by review: they restarted at 2, below the follower's cursor)."""
    logs = store.logs
    assert isinstance(logs, RocksLogStore)
    for _ in range(6):
        logs.append(3, T0, "stdout", b"ab")  # 12 bytes: the head (10) and a tail
    page = logs.read(3, T0, limit=100)
    assert text(page.chunks) == "abababababab" and page.at_end
    mark_dropped(logs, 3, T0)
    for piece in (b"x", b"y", b"z"):
        logs.append(3, T0, "stdout", piece)
    page = logs.read(3, T0, cursor=page.cursor, limit=100)
    assert text(page.chunks) == "xyz" and page.at_end  # nothing missed: it had all 12 bytes
    # A reader from the start, and one that had read only the first chunk.
    assert text(read_all(logs, 3, T0)) == "[cut 12]xyz"
    first = logs.read(3, T0, limit=1)  # the cut: the head is gone
    assert first.chunks[0].stream == CUT and first.chunks[0].dropped == 12


def test_a_read_and_a_retention_write_in_a_thread_do_not_interleave(
    store: ShardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention writes from a worker thread. A read that took a run's log state and then
    scanned its chunks after such a write had dropped them returned nothing and no cut, and
    said it was at the end: the reader lost the bytes without being told (found by review).
    Here the write is started from inside the read, between the two; the read must see the
    log either before it or after it, never half."""
    logs = store.logs
    assert isinstance(logs, RocksLogStore)
    logs.append(4, T0, "stdout", b"hello")
    real_get = logs._get
    writer: list[threading.Thread] = []

    def get_then_retain(key: bytes) -> bytes | None:
        value = real_get(key)
        if not writer:
            writer.append(threading.Thread(target=mark_dropped, args=(logs, 4, T0)))
            writer[0].start()
            writer[0].join(0.3)  # long enough for it to finish, unless the read holds it off
        return value

    monkeypatch.setattr(logs, "_get", get_then_retain)
    page = logs.read(4, T0, limit=100)
    monkeypatch.undo()
    writer[0].join()
    assert text(page.chunks) in ("hello", "[cut 5]")
    assert text(read_all(logs, 4, T0)) == "[cut 5]"
    assert logs.read(4, T0, cursor=page.cursor).chunks == []  # had it all, one way or other
