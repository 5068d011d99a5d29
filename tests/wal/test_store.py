"""The shard store against a real RocksDB in a temp dir: round trips, routing, queries, the
epoch fence, the LOCK, the fixed shard count, counts, refused batches."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.directory import JobDirectory
from engine.errors import StaleEpoch as EngineStaleEpoch
from engine.records import expand
from tests.wal.records import T0, batch, created, job, note, pos, run, skip
from wal.errors import (
    EpochAhead,
    InvalidBatch,
    ShardCountMismatch,
    ShardMismatch,
    StaleEpoch,
    StoreClosed,
    StoreFailure,
    StoreLocked,
    StoreUsageError,
)
from wal.store import COLUMN_FAMILIES, ShardStore, StoreCounts


def open_store(path: Path, epoch: int = 1, *, shard: int = 0, shards: int = 4) -> ShardStore:
    return ShardStore.open(path, shard=shard, shards=shards, epoch=epoch)


def test_round_trip_across_reopen(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        seqs = store.write([created(0), created(1)])
        assert seqs == [1, 2]
        assert store.write([batch(3, run(0, T0))]) == [3]
    with open_store(tmp_path, epoch=2) as store:
        recovered = store.load()
        assert recovered.epoch == 2 and recovered.previous_epoch == 1
        assert recovered.snapshot is None and recovered.snapshot_seq == -1
        assert recovered.last_seq == 3
        records = list(recovered.tail)
        assert [r["t"] for r in records] == ["job", "pos", "job", "pos", "run"]
        assert records[4]["at"] == T0
        # the log keeps batch ids and epochs for recovery
        assert [(s, b, e) for s, b, e, _ in store.log_batches()] == [
            (1, 0, 1),
            (2, 1, 1),
            (3, 3, 1),
        ]
        # new positions continue after the old ones
        assert store.write([created(2, epoch=2)]) == [4]


def test_one_write_covers_every_batch_and_numbers_them_in_order(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        seqs = store.write([created(k) for k in range(50)])
        assert seqs == list(range(1, 51))
        assert store.last_seq == 50
        assert [s for s, *_ in store.log_batches(start=48)] == [48, 49, 50]


def test_routing_and_queries(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(7, T0 + 60_000)])
        store.write(
            [
                batch(2, run(7, T0), skip(7, T0 - 5000, T0 - 1000, n=4), pos(7, T0 + 120_000)),
                batch(3, run(7, T0, "CLAIMED", tok=5), note(7, T0)),
                batch(4, run(7, T0 + 60_000), run(7, T0 + 120_000, "RUNNING")),
            ]
        )
        assert store.key_of("job-7") == 7
        assert store.key_of("nope") is None
        latest = store.latest(7)
        assert latest is not None and latest[0] == 1 and latest[1]["id"] == "job-7"
        assert store.latest(8) is None
        stored = store.job("job-7")
        assert stored is not None and stored.key == 7 and stored.version == 1
        assert stored.position is not None and stored.position["next"] == T0 + 120_000
        # the run's newest record wins
        first = store.run(7, T0)
        assert first is not None and first["state"] == "CLAIMED" and first["tok"] == 5
        assert store.run(7, T0 + 1) is None
        # last N runs: newest first, one reverse scan, bounded by `before`
        assert [r["at"] for r in store.last_runs(7, 2)] == [T0 + 120_000, T0 + 60_000]
        assert [r["at"] for r in store.last_runs(7, 10, before=T0 + 60_000)] == [T0]
        assert store.last_runs(8) == []
        kinds = [(h["t"], h.get("lo", h.get("at"))) for h in store.history(7)]
        assert kinds == [("note", T0), ("skip", T0 - 5000)]
        assert store.run_count(7) == 3


def test_queries_stay_inside_their_job(tmp_path: Path) -> None:
    # Neighbouring keys (and negative times) must not leak into each other's scans.
    with open_store(tmp_path) as store:
        store.write([created(k) for k in (0, 1, 2)])
        store.write([batch(10, run(0, -5), run(1, -(2**62)), run(1, 2**62), run(2, 0))])
        assert [r["at"] for r in store.last_runs(1)] == [2**62, -(2**62)]
        assert [r["at"] for r in store.last_runs(0)] == [-5]
        assert [r["at"] for r in store.last_runs(2)] == [0]


def test_job_listing_pages_in_key_order(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(k) for k in range(25)])
        seen: list[int] = []
        after = None
        while True:
            page = store.jobs(after=after, limit=10)
            if not page:
                break
            seen.extend(j.key for j in page)
            after = page[-1].key
        assert seen == list(range(25))
        assert store.jobs(after=23)[0].id == "job-24"


def test_a_newer_job_version_replaces_the_spec(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(1)])
        store.write([batch(2, job(1, ver=2, task={"cmd": "new"}))])
        latest = store.latest(1)
        assert latest is not None and latest[0] == 2 and latest[1]["task"] == {"cmd": "new"}


def test_store_is_a_job_directory(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        directory: JobDirectory = store  # type-checks against the engine's protocol
        store.write([created(3)])
        assert directory.key_of("job-3") == 3
        store.write([created(5)])
        ids = ["job-5", "nope", "job-3", "job-5", ""]
        assert directory.keys_of(ids) == [directory.key_of(i) for i in ids] == [5, None, 3, 5, None]
        assert directory.keys_of([]) == []


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@given(
    version=st.integers(1, 2**32 - 1),
    entries=st.lists(
        st.tuples(st.sampled_from(["id", "task", "tier", "schedule", "labels", "x"]), _VALUES),
        max_size=8,
        unique_by=lambda e: e[0],
    ),
    items=st.integers(2, 4),
)
def test_ticket_fields_decode_as_the_whole_value_would(
    version: int, entries: list[tuple[str, Any]], items: int
) -> None:
    """The claim's narrow read against the reference (a full decode), whatever the order of
    the spec's keys, missing fields and malformed values: the same fields, or the same error."""
    from wal import codec
    from wal.store import _job_ticket_fields

    spec = dict(entries)
    value = [version, spec, "job-1", "extra"][:items]
    raw = codec.pack(value)
    try:
        v, whole, _id = codec.unpack(raw)
        expected: Any = (v, whole["id"], whole["task"])
    except (ValueError, KeyError, TypeError) as exc:
        expected = type(exc)
    try:
        got: Any = _job_ticket_fields(raw)
    except (ValueError, KeyError, TypeError) as exc:
        got = type(exc)
    assert got == expected


def test_ticket_fields_follow_the_latest_version(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        assert store.ticket_fields(1) is None
        store.write([batch(1, job(1, task={"payload": [1, 2]}, labels={"a": "b"}), pos(1, T0))])
        assert store.ticket_fields(1) == (1, "job-1", {"payload": [1, 2]})
        store.write([batch(2, job(1, ver=2, task={"cmd": "new", "env": {"A": "1"}}, tier="t"))])
        assert store.ticket_fields(1) == (2, "job-1", {"cmd": "new", "env": {"A": "1"}})


def test_counts_follow_every_write_and_survive_reopen(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        assert store.counts == StoreCounts()
        store.write([created(k) for k in range(4)])
        assert store.counts == StoreCounts(jobs=4, pending_jobs=4)
        store.write(
            [
                batch(10, pos(0, T0, paused=True), pos(1, None), pos(2, T0, gone=True)),
                batch(11, run(3, T0), run(3, T0 + 1, "CLAIMED"), run(3, T0 + 2, "RUNNING")),
            ]
        )
        assert store.counts == StoreCounts(
            jobs=3, pending_jobs=1, paused_jobs=1, runs_pending=1, runs_in_flight=2
        )
        # a key written twice in one group counts once, by its last record
        store.write(
            [batch(12, run(3, T0, "CLAIMED")), batch(13, run(3, T0, "RUNNING"), pos(0, T0))]
        )
        assert store.counts == StoreCounts(
            jobs=3, pending_jobs=2, paused_jobs=0, runs_pending=0, runs_in_flight=3
        )
        store.write([batch(14, run(3, T0, "SUCCESS"), run(3, T0 + 1, "FAILED"))])
    with open_store(tmp_path, epoch=2) as store:
        expected = StoreCounts(jobs=3, pending_jobs=2, runs_in_flight=1)
        assert store.counts == expected
        assert store.load().counts == expected


def test_fire_records_index_their_runs_and_positions(tmp_path: Path) -> None:
    fire = {
        "t": "fire",
        "v": 1,
        "keys": [0, 1],
        "ats": [T0, T0 + 5],
        "vers": [1, 1],
        "next": [None, T0 + 65],
        "e": 1,
    }
    with open_store(tmp_path) as store:
        store.write([created(0), created(1)])
        try:
            store.write([batch(3, fire)])
        except InvalidBatch:
            pytest.skip("this engine version has no 'fire' record yet")
        r0 = store.run(0, T0)
        assert r0 is not None and r0["state"] == "PENDING" and r0["att"] == 1
        j1 = store.job("job-1")
        assert j1 is not None and j1.position is not None and j1.position["next"] == T0 + 65
        assert store.counts == StoreCounts(jobs=2, pending_jobs=1, runs_pending=2)
        # the log keeps the compact record itself
        assert list(store.load().tail)[-1]["t"] == "fire"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fires=st.lists(
        st.tuples(
            st.integers(0, 5),  # key
            st.integers(-3, 3),  # at, from T0
            st.integers(1, 3),  # version
            st.one_of(st.none(), st.integers(4, 9)),  # next
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda f: (f[0], f[1]),
    ),
    later=st.lists(
        st.tuples(st.integers(0, 5), st.integers(-3, 3), st.sampled_from(["CLAIMED", "SUCCESS"])),
        max_size=6,
    ),
    stamped=st.booleans(),
)
def test_a_fire_is_stored_as_the_records_it_stands_for(
    tmp_path_factory: pytest.TempPathFactory,
    fires: list[tuple[int, int, int, int | None]],
    later: list[tuple[int, int, str]],
    stamped: bool,
) -> None:
    """A compact fire record (routed from its arrays, a run rewritten later in the batch left
    out) leaves every query family exactly as its expanded records would."""
    fire: dict[str, Any] = {
        "t": "fire",
        "v": 1,
        "keys": [k for k, _, _, _ in fires],
        "ats": [T0 + a for _, a, _, _ in fires],
        "vers": [v for _, _, v, _ in fires],
        "next": [None if n is None else T0 + n for _, _, _, n in fires],
    }
    if stamped:
        fire["e"] = 1
    tail = [run(k, T0 + a, state) for k, a, state in later]
    contents = []
    for records in ([fire, *tail], [*expand(fire), *tail]):
        with open_store(tmp_path_factory.mktemp("fire")) as store:
            store.write([batch(1, *records)])
            families = {
                name: list(store._cf[i].items())
                for i, name in enumerate(COLUMN_FAMILIES)
                if name not in ("log", "meta", "snapshot")
            }
            contents.append((families, store.counts))
    assert contents[0] == contents[1]


# ------------------------------------------------------------------------- refusals


def test_a_stale_batch_refuses_the_whole_write(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.write([created(0)])
    with open_store(tmp_path, epoch=2) as store:
        with pytest.raises(StaleEpoch) as info:
            store.write([created(1, epoch=2), created(2, epoch=1)])
        assert "epoch 1" in str(info.value) and str(tmp_path) in str(info.value)
        assert isinstance(info.value, EngineStaleEpoch) and isinstance(info.value, StoreFailure)
        assert store.key_of("job-1") is None and store.last_seq == 1
        with pytest.raises(EpochAhead):
            store.write([created(1, epoch=3)])
        assert store.write([created(1, epoch=2)]) == [2]


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "nope", "v": 1},
        {"t": "run", "v": 99, "key": 0, "at": 0, "state": "PENDING"},
        {"t": "run", "v": 1, "key": 0},  # no time
        {"t": "job", "v": 1, "key": 0, "id": 5, "ver": 1, "spec": {}},
        {"t": "out", "v": 1, "seq": 1, "job": object(), "src": None},  # not msgpack-able
        "not a record",
    ],
)
def test_an_invalid_record_refuses_the_write(tmp_path: Path, bad: object) -> None:
    with open_store(tmp_path) as store:
        with pytest.raises(InvalidBatch):
            store.write([created(0), batch(2, job(1), bad)])  # type: ignore[arg-type]
        with pytest.raises(InvalidBatch):  # alone in its batch (the one-record path)
            store.write([created(0), batch(2, bad)])  # type: ignore[arg-type]
        assert store.last_seq == 0 and store.key_of("job-0") is None
        assert store.write([created(0)]) == [1]


def test_open_records_the_epoch_first_and_refuses_older_ones(tmp_path: Path) -> None:
    open_store(tmp_path, epoch=5).close()
    for epoch in (5, 4):
        with pytest.raises(StaleEpoch, match="already at epoch 5"):
            open_store(tmp_path, epoch=epoch)
    # the refusal left the directory unlocked and the epoch where it was
    with open_store(tmp_path, epoch=6) as store:
        assert store.previous_epoch == 5


def test_the_shard_count_is_fixed_at_creation(tmp_path: Path) -> None:
    open_store(tmp_path, shards=8, shard=3).close()
    with pytest.raises(ShardCountMismatch, match="created for 8 shards"):
        open_store(tmp_path, epoch=2, shards=16, shard=3)
    with pytest.raises(ShardMismatch, match="holds shard 3"):
        open_store(tmp_path, epoch=2, shards=8, shard=4)
    open_store(tmp_path, epoch=2, shards=8, shard=3).close()


@pytest.mark.parametrize(
    "kwargs", [{"shard": -1}, {"shards": 0}, {"shard": 4}, {"epoch": -1}, {"epoch": True}]
)
def test_bad_open_arguments(tmp_path: Path, kwargs: dict[str, int]) -> None:
    args = {"shard": 0, "shards": 4, "epoch": 1, **kwargs}
    with pytest.raises(StoreUsageError):
        ShardStore.open(tmp_path, **args)


def test_a_second_opener_in_this_process_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path):
        with pytest.raises(StoreLocked, match="LOCK"):
            open_store(tmp_path, epoch=2)
    open_store(tmp_path, epoch=2).close()  # released by close()


def test_a_second_opener_in_another_process_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from wal.store import ShardStore
                store = ShardStore.open({str(tmp_path)!r}, shard=0, shards=4, epoch=1)
                print("open", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        with pytest.raises(StoreLocked) as info:
            open_store(tmp_path, epoch=2)
        assert str(tmp_path) in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    # the kernel drops the lock with its holder
    open_store(tmp_path, epoch=2).close()


def test_a_closed_store_refuses_everything(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosed):
        store.write([created(0)])
    with pytest.raises(StoreClosed):
        store.key_of("job-0")
    with pytest.raises(StoreClosed):
        store.load()


def test_run_counts_of_a_store_written_by_an_older_version(tmp_path: Path) -> None:
    # Older versions kept only the number of runs in `nruns`, not the newest run's time:
    # without it every run of that job is looked up before it is counted as new.
    from wal import codec
    from wal.store import _NRUNS

    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        store.write([created(1), batch(10, run(1, T0 + 10)), batch(11, run(1, T0 + 20))])
        store._cf[_NRUNS][codec.i64(1)] = codec.u64(2)  # as an older version left it
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2) as store:
        store.write(
            [batch(20, run(1, T0 + 10, "CLAIMED"), run(1, T0 + 15), run(1, T0 + 30), epoch=2)]
        )
        assert store.run_count(1) == 4
        assert store.counts.runs_pending == 3 and store.counts.runs_in_flight == 1
        store.write([batch(21, run(1, T0 + 15, "SUCCESS"), run(1, T0 + 5), epoch=2)])
        assert store.run_count(1) == 5 and store.counts.runs_pending == 3


def test_a_group_is_one_log_entry_read_back_batch_by_batch(tmp_path: Path) -> None:
    # A write of many batches is one log entry keyed by its last position; readers see the
    # batches one by one, from any position, and a snapshot inside a group hides its front.
    import msgpack

    from wal.store import _array_header

    for n in (0, 15, 16, 65535, 65536, 70000):
        assert _array_header(n) == msgpack.Packer().pack_array_header(n)
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        sizes = [1, 3, 20]
        bid = 0
        for size in sizes:
            store.write([batch(bid + i, run(bid + i, T0)) for i in range(size)])
            bid += size
        got = [(s, b) for s, b, _e, _r in store.log_batches()]
        assert got == [(b + 1, b) for b in range(24)]
        assert [s for s, *_ in store.log_batches(10)] == list(range(10, 25))
        assert [r["key"] for s, _b, _e, rs in store.log_batches(3) for r in rs] == list(
            range(2, 24)
        )
        store.write_snapshot(10, {"x": np.zeros(3)}, {})
        assert [s for s, *_ in store.log_batches()] == list(range(11, 25))
        assert store.last_seq == 24
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2) as store:
        recovered = store.load()
        assert recovered.last_seq == 24 and recovered.snapshot_seq == 10
        assert [r["key"] for r in recovered.tail] == list(range(10, 24))
        assert store.write([batch(99, run(99, T0), epoch=2)]) == [25]


# A job record's ``jobs`` row reuses the spec's bytes from the record's own encoding: it must
# be byte for byte what encoding [version, spec, id] gives, whatever the values' sizes, the
# epoch stamp, or a record whose keys are not in the engine's order.
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.integers(0, 2**62),
    job_id=st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=300),
    ver=st.integers(1, 2**32 - 1),
    spec=st.dictionaries(st.text(max_size=12), _json, max_size=6),
    epoch=st.none() | st.integers(0, 2**64 - 1),
    reorder=st.booleans(),
)
def test_the_jobs_row_is_the_encoding_of_version_spec_id(
    tmp_path_factory: pytest.TempPathFactory,
    key: int,
    job_id: str,
    ver: int,
    spec: dict[str, Any],
    epoch: int | None,
    reorder: bool,
) -> None:
    import msgpack

    from engine.effects import Persist
    from wal.store import _INDEX, _JOBS

    record: dict[str, Any] = {"t": "job", "v": 1, "key": key, "id": job_id, "ver": ver}
    record["spec"] = spec
    if epoch is not None:
        record["e"] = epoch
    if reorder:
        record = dict(reversed(list(record.items())))
    path = tmp_path_factory.mktemp("jobs-row")
    with open_store(path, epoch=1) as store:
        prepared = store.prepare(Persist(1, 1, (record,)))
        rows = {cf: (k, v) for cf, k, v in prepared.puts}
        assert rows[_JOBS][1] == msgpack.packb([ver, spec, job_id], use_bin_type=True)
        assert rows[_INDEX][0] == job_id.encode()
        store.write_prepared([prepared])
        latest = store.latest(key)
        assert latest is not None and latest == (ver, spec)
        assert store.key_of(job_id) == key


def test_a_refused_open_leaves_the_directory_unlocked_while_its_error_lives(
    tmp_path: Path,
) -> None:
    """rocksdict keeps a database (and its LOCK) open while a column family is referenced,
    and the frames of a kept exception held some: a driver that logs or keeps the error
    could not open the directory again (found by review)."""
    from wal.errors import StaleEpoch

    ShardStore.open(tmp_path, shard=0, shards=1, epoch=3).close()
    kept: list[BaseException] = []
    try:
        ShardStore.open(tmp_path, shard=0, shards=1, epoch=2)
    except StaleEpoch as exc:
        kept.append(exc)
    ShardStore.open(tmp_path, shard=0, shards=1, epoch=4).close()
    assert kept


def test_a_failed_load_leaves_the_directory_unlocked_once_closed(tmp_path: Path) -> None:
    import numpy as np

    from wal import codec
    from wal.errors import Corrupt

    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as s:
        s.write([created(1)])
        s.write_snapshot(1, {"a": np.arange(10)}, {})
        s._cf[9].delete(codec.u64(1) + b"a" + b"a\0" + codec.u32(0))  # lose a chunk
    s = ShardStore.open(tmp_path, shard=0, shards=1, epoch=2)
    kept: list[BaseException] = []
    try:
        s.load()
    except Corrupt as exc:
        kept.append(exc)
    s.close()
    ShardStore.open(tmp_path, shard=0, shards=1, epoch=3).close()
    assert kept
