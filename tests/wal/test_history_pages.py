"""``ShardStore.history_page``: a job's history paged by stored key, newest first.

The gap it closes: ``run.skips`` paged the history "before the oldest time of the last
page", and entries share times (a skip and the notes of a run at the same fire time, several
notes of one run); a page that ended inside such a group lost the rest of it. Here: the
paging against a model (every entry exactly once, in the order of ``history``), the shared
time at a page boundary, and the typed refusal of a cursor that is not one."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.records import Record
from tests.wal.records import T0, batch, created, note, skip
from wal.errors import StoreUsageError
from wal.store import ShardStore


def open_store(path: Path | str) -> ShardStore:
    return ShardStore.open(path, shard=0, shards=1, epoch=1)


def all_pages(store: ShardStore, key: int, n: int) -> list[Record]:
    out: list[Record] = []
    cursor: bytes | None = None
    while True:
        page, cursor = store.history_page(key, n, cursor=cursor)
        assert len(page) <= n
        out += page
        if cursor is None:
            return out


def test_entries_that_share_a_time_across_a_page_boundary_are_all_returned(
    tmp_path: Path,
) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        # Five entries at one time, then two older: a page of 3 ends inside the group.
        store.write([batch(2, skip(1, T0 + 5), note(1, T0 + 5, tok=1), note(1, T0 + 5, tok=2))])
        store.write([batch(3, note(1, T0 + 5, tok=3), skip(1, T0 + 5, why="catchup"))])
        store.write([batch(4, skip(1, T0 + 1), note(1, T0))])
        store.write([created(2)])
        store.write([batch(6, skip(2, T0 + 5))])  # another job's entry: never in job 1's pages
        got = all_pages(store, 1, 3)
        assert got == store.history(1, 100)
        assert len(got) == 7
        # What the old paging did: the second page asked for "before T0 + 5" and lost two.
        first = store.history(1, 3)
        oldest = min(r.get("lo", r.get("at")) for r in first)
        assert len(first) + len(store.history(1, 100, before=oldest)) == 5


def test_the_last_page_says_there_is_no_next(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        assert store.history_page(1) == ([], None)
        store.write([batch(2, skip(1, T0), skip(1, T0 + 1))])
        page, cursor = store.history_page(1, 5)
        assert [r["lo"] for r in page] == [T0 + 1, T0] and cursor is None
        page, cursor = store.history_page(1, 2)  # exactly full: one more (empty) page
        assert len(page) == 2 and cursor is not None
        assert store.history_page(1, 2, cursor=cursor) == ([], None)


def test_a_cursor_that_is_not_one_is_a_usage_error(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1), created(2)])
        store.write([batch(3, skip(1, T0), skip(1, T0 + 1), skip(2, T0))])
        _page, cursor = store.history_page(1, 1)
        assert cursor is not None
        with pytest.raises(StoreUsageError, match="not a cursor of job 2"):
            store.history_page(2, 1, cursor=cursor)  # job 1's cursor for job 2
        with pytest.raises(StoreUsageError, match="not a cursor"):
            store.history_page(1, 1, cursor=cursor[:-1])
        with pytest.raises(StoreUsageError, match="not a cursor"):
            store.history_page(1, 1, cursor="abc")  # type: ignore[arg-type]
        with pytest.raises(StoreUsageError, match="at least 1"):
            store.history_page(1, 0)


entry = st.tuples(
    st.sampled_from(["skip", "note"]),
    st.integers(min_value=0, max_value=4),  # few distinct times: many shared
    st.integers(min_value=1, max_value=2),  # the job
)


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(entry, min_size=1, max_size=6), min_size=1, max_size=8),
    n=st.integers(min_value=1, max_value=5),
)
def test_paging_returns_every_entry_once_in_history_order(
    batches: list[list[tuple[str, int, int]]], n: int
) -> None:
    path = tempfile.mkdtemp(prefix="tw-hist-")
    try:
        with open_store(path) as store:
            store.write([created(1), created(2, batch_id=2)])
            written = {1: 0, 2: 0}
            for batch_id, entries in enumerate(batches, 10):
                records = [
                    skip(key, T0 + t) if kind == "skip" else note(key, T0 + t, tok=i)
                    for i, (kind, t, key) in enumerate(entries)
                ]
                for _kind, _t, key in entries:
                    written[key] += 1
                store.write([batch(batch_id, *records)])
            for key in (1, 2):
                got = all_pages(store, key, n)
                assert got == store.history(key, 1000)
                assert len(got) == written[key]
                assert all(r["key"] == key for r in got)
    finally:
        shutil.rmtree(path, ignore_errors=True)
