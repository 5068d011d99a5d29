"""Disk trouble surfaces as typed errors and never costs an acknowledged batch: no space (a
file size limit in a child process, and a really full file system), a read-only directory and
a read-only file system, corrupt files; and RocksDB's error texts for each map to the type."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.wal.records import created
from wal.errors import (
    Corrupt,
    DiskFull,
    ReadOnly,
    StoreError,
    StoreFailure,
    StoreIOError,
    StoreLocked,
)
from wal.store import ShardStore


def child(*args: str, prefix: Sequence[str] = ()) -> list[str]:
    """Run :mod:`tests.wal.disk_child` (under ``prefix``: ``unshare ...``) and return its
    stdout lines."""
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "tests.wal.disk_child", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def open_store(path: Path | str, epoch: int) -> ShardStore:
    return ShardStore.open(path, shard=0, shards=1, epoch=epoch)


# ------------------------------------------------------------------------- no space


def test_a_full_disk_fails_the_write_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    lines = child("fill", str(tmp_path), str(256 * 1024))
    acked = {int(line.split()[1]) for line in lines if line.startswith("ack ")}
    errors = [line for line in lines if line.startswith("error ")]
    assert len(acked) > 50, lines[-5:]
    assert len(errors) == 1 and errors[0].startswith("error DiskFull"), errors
    assert "File too large" in errors[0] and str(tmp_path) in errors[0]
    # after the failure the store refuses writes, with the same type
    again = [line for line in lines if line.startswith("again ")]
    assert again and again[0].startswith("again DiskFull"), again
    with open_store(tmp_path, epoch=2) as store:
        logged = {b: records for _s, b, _e, records in store.log_batches()}
        assert acked <= set(logged)
        for k, records in logged.items():  # whole, or not there at all
            assert [r["t"] for r in records] == ["job", "pos"]
            job = store.job_by_key(k)
            assert job is not None and job.position is not None
        assert store.counts.jobs == len(logged)
        assert store.write([created(10**6, epoch=2)])  # and it works again


def test_no_space_at_open_is_disk_full(tmp_path: Path) -> None:
    lines = child("open-capped", str(tmp_path / "new"), "2048")
    assert lines and lines[0].startswith("error DiskFull"), lines


def test_disk_errors_are_store_failures() -> None:
    for cls in (DiskFull, ReadOnly, Corrupt):
        assert issubclass(cls, StoreFailure) and issubclass(cls, StoreError)


def test_a_store_failed_by_a_full_disk_closes_and_reopens_in_the_same_process(
    tmp_path: Path,
) -> None:
    """Found by the tmpfs test below: the failure a store keeps (and every ticket of the failed
    group) held the frames of the failed write, whose locals held the store's column family
    handles, so close() left the database and its LOCK open and a reopen by the same process
    (a node's, once space is freed) was StoreLocked. The tickets are kept alive here on
    purpose, as a driver may keep them."""
    from wal.commit import GroupCommitter

    store = ShardStore.open(tmp_path, shard=0, shards=1, epoch=1)
    real = store._db
    enospc = (
        "IO error: No space left on device: While appending to file: {}: No space left on device"
    )
    proxy = _FsyncRaises(real, lambda: Exception(enospc.format(tmp_path / "000004.log")))
    try:
        store.write([created(1)])
        store._db = proxy  # type: ignore[assignment]
        with GroupCommitter(store) as committer:
            tickets = [committer.submit(created(k, batch_id=k)) for k in (2, 3)]
            for ticket in tickets:
                with pytest.raises(DiskFull):
                    ticket.wait(5)
    finally:
        store._db = real
        proxy._db = None  # (its frame is in the failure's traceback: it must not hold it)
        store.close()
    del real
    assert all(isinstance(t.error, DiskFull) for t in tickets)
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2) as again:
        batches = [b for _s, b, _e, _r in again.log_batches()]
        assert batches[0] == 1 and set(batches) <= {1, 2, 3}  # the failed group: whole or not
        assert again.write([created(4, epoch=2, batch_id=4)])


class _ReadFailsInWrites(ShardStore):
    """A store whose reads before a write fail (as a read of a damaged table would), inside
    the frame of a multi-get that holds the column family it reads."""

    def _read_family(self, family: int, keys: list[bytes]) -> list[bytes | None]:
        return self._multiget(self._cf[family], [object()])  # type: ignore[list-item]


def test_a_store_whose_read_failed_inside_a_write_closes_and_reopens_in_the_same_process(
    tmp_path: Path,
) -> None:
    """Found by review after the fix above: a read that fails inside a write (the counts'
    look at what a key held) fails the group's tickets with an error whose frames held the
    column family it read (a local of the multi-get, in no list the store empties), so the
    database and its LOCK outlived close() while a ticket was kept."""
    from tests.wal.records import batch, run
    from wal.commit import GroupCommitter

    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as first:
        first.write([created(1)])
    store = _ReadFailsInWrites.open(tmp_path, shard=0, shards=1, epoch=2)
    try:
        # A run's state change after a reopen: the caches are empty, so its old class is read.
        claimed = batch(7, run(1, 0, "CLAIMED", tok=1), epoch=2)
        with GroupCommitter(store) as committer:
            ticket = committer.submit(claimed)
            with pytest.raises(StoreError):
                ticket.wait(5)
    finally:
        store.close()
    assert isinstance(ticket.error, StoreError)  # (kept, as a driver may keep it)
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=3) as again:
        assert again.write([batch(8, run(1, 0, "CLAIMED", tok=1), epoch=3)])


# ------------------------------------------------------------------------- read-only


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged uid can reach (pytest's tmp dirs are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="tickwheel-ro-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for root, _dirs, files in os.walk(path):
            os.chmod(root, 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)
        shutil.rmtree(path)


def make_read_only(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(root, name), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(root, 0o555)


def test_a_read_only_directory_is_read_only(shared_dir: Path) -> None:
    data = shared_dir / "shard-0"
    with open_store(data, epoch=1) as store:
        store.write([created(0)])
    make_read_only(shared_dir)
    lines = child("open-as-nobody", str(data))
    assert lines and lines[0].startswith("error ReadOnly"), lines
    assert "Permission denied" in lines[0] and str(data) in lines[0]


def test_a_shard_directory_that_cannot_be_created_is_read_only(shared_dir: Path) -> None:
    make_read_only(shared_dir)
    lines = child("open-as-nobody", str(shared_dir / "new-shard"))
    assert lines and lines[0].startswith("error ReadOnly"), lines


# ------------------------------------------------------------------------- corrupt files


def flip(path: Path, at: float = 0.5, length: int = 16) -> None:
    data = bytearray(path.read_bytes())
    start = max(0, min(len(data) - length, int(len(data) * at)))
    for i in range(start, min(len(data), start + length)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def written_store(path: Path, n: int = 200) -> None:
    with open_store(path, epoch=1) as store:
        store.write([created(k) for k in range(n)])


def test_a_corrupt_current_file(tmp_path: Path) -> None:
    written_store(tmp_path)
    (tmp_path / "CURRENT").write_text("MANIFEST-999999\n")
    with pytest.raises(Corrupt) as info:
        open_store(tmp_path, epoch=2)
    assert "MANIFEST-999999" in str(info.value) and str(tmp_path) in str(info.value)


def test_a_corrupt_manifest(tmp_path: Path) -> None:
    written_store(tmp_path)
    (manifest,) = tmp_path.glob("MANIFEST-*")
    flip(manifest, 0.3)
    with pytest.raises(Corrupt, match="MANIFEST"):
        open_store(tmp_path, epoch=2)


def test_corrupt_tables_fail_reads_with_a_typed_error(tmp_path: Path) -> None:
    written_store(tmp_path)  # close flushes everything into tables
    tables = sorted(tmp_path.glob("*.sst"))
    assert tables
    for table in tables:
        flip(table, 0.1)
    with pytest.raises(Corrupt, match="checksum"):
        with open_store(tmp_path, epoch=2) as store:
            list(store.load().tail)
            for k in range(200):
                store.job_by_key(k)


def test_a_corrupt_snapshot_fails_recovery(tmp_path: Path) -> None:
    with open_store(tmp_path, epoch=1) as store:
        store.write([created(0)])
        store.write_snapshot(1, {"next": np.arange(200_000, dtype=np.int64)}, {})
    biggest = max(tmp_path.glob("*.sst"), key=lambda p: p.stat().st_size)
    flip(biggest, 0.5)
    # Caught wherever the damaged block is first read: finding the snapshot, or loading it.
    with pytest.raises(Corrupt, match=r"checksum|snapshot"):
        with open_store(tmp_path, epoch=2) as store:
            store.load()


def test_corruption_inside_the_log_refuses_to_open_instead_of_losing_batches(
    tmp_path: Path,
) -> None:
    assert child("write-and-vanish", str(tmp_path), "100") == ["written"]
    (log,) = [p for p in tmp_path.glob("*.log") if p.stat().st_size > 0]
    flip(log, 0.4)
    with pytest.raises(Corrupt):
        open_store(tmp_path, epoch=2)


def test_a_torn_tail_of_the_log_is_a_batch_never_acknowledged(tmp_path: Path) -> None:
    assert child("write-and-vanish", str(tmp_path), "100") == ["written"]
    (log,) = [p for p in tmp_path.glob("*.log") if p.stat().st_size > 0]
    os.truncate(log, log.stat().st_size - 7)  # the last write, cut short by a power loss
    with open_store(tmp_path, epoch=2) as store:
        keys = [b for _s, b, _e, _r in store.log_batches()]
        assert keys == list(range(99))  # the torn batch is gone, whole; the rest is there
        assert store.key_of("job-98") == 98 and store.key_of("job-99") is None


class _FsyncRaises:
    """A stand-in for the store's database whose fsync (``flush_wal``) raises what ``error``
    makes (a fresh exception each time: one kept here would keep its traceback, and through it
    the database, alive after the store's close, and RocksDB's LOCK with it); the rest is the
    real database's."""

    def __init__(self, db: Any, error: Callable[[], BaseException]) -> None:
        self._db = db
        self._error = error

    def flush_wal(self, sync: bool) -> None:
        raise self._error()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def test_after_a_failed_fsync_reads_are_refused_too(tmp_path: Path) -> None:
    """The group's write goes in unsynced before its fsync (see ShardStore._commit); when the
    fsync fails, the ticket fails, and a reader must not be answered with that write either
    (found by review: a job whose create failed was served to readers)."""
    from tests.wal.records import created
    from wal.commit import GroupCommitter
    from wal.errors import StoreFailure
    from wal.store import ShardStore

    store = ShardStore.open(tmp_path, shard=0, shards=1, epoch=1)
    real = store._db
    try:
        store.write([created(1)])
        store._db = _FsyncRaises(
            real, lambda: Exception("IO error: While fdatasync: /x/000004.log: Input/output error")
        )
        with GroupCommitter(store) as committer, pytest.raises(StoreFailure):
            committer.submit(created(2, batch_id=2)).wait(5)
        with pytest.raises(StoreFailure):
            store.job("job-2")
        with pytest.raises(StoreFailure):
            store.job("job-1")  # refused as well: the store is failed until reopened
        # and so are run logs (found by a second review: appends were still taken, and read
        # back, on a failed store)
        with pytest.raises(StoreFailure, match="refuses run logs"):
            store.logs.append(1, 5, "stdout", b"after the failure")
        with pytest.raises(StoreFailure, match="refuses run logs"):
            store.logs.read(1, 5)
        with pytest.raises(StoreFailure, match="refuses run logs"):
            store.logs.drop(1, 0, 10)
    finally:
        store._db = real
        store.close()


def test_an_interruption_before_the_fsync_fails_the_store(tmp_path: Path) -> None:
    """A KeyboardInterrupt (or any BaseException) between the group's unsynced write and its
    fsync: the write is in the database but not durable, and its log position was not handed
    out. The store is failed as after a failed fsync, so that no reader is answered with it
    and no later group overwrites its log entry; a reopen finds it whole or absent (found by
    review)."""
    store = ShardStore.open(tmp_path, shard=0, shards=1, epoch=1)
    real = store._db
    try:
        store.write([created(1)])
        store._db = _FsyncRaises(real, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            store.write([created(2, batch_id=2)])
        store._db = real
        with pytest.raises(StoreFailure, match="interrupted before the write was durable"):
            store.write([created(3, batch_id=3)])
        with pytest.raises(StoreFailure):
            store.job("job-2")
        with pytest.raises(StoreFailure):
            store.keys_of([])
    finally:
        store._db = real
        store.close()
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=2) as store:
        batches = [b for _s, b, _e, _r in store.log_batches()]
        assert batches in ([1], [1, 2])  # whole or absent, and nothing written over it
        assert store.key_of("job-1") == 1 and store.key_of("job-3") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("IO error: While appending to file: /d/MANIFEST-000005: Input/output error", "store_io"),
        ("Corruption: bad record length in MANIFEST-000005", "corrupt"),
        ("IO error: No such file or directory: While opening a file: /d/CURRENT", "corrupt"),
        ("IO error: While fdatasync: /d/000004.log: Input/output error", "store_io"),
    ],
)
def test_rocksdb_errors_are_typed_by_their_cause_not_the_file_they_name(
    text: str, expected: str
) -> None:
    from wal.errors import translate

    assert translate(Exception(text), path="/d", doing="writing").code == expected


def test_a_value_that_cannot_be_decoded_is_corrupt_not_a_codec_error(tmp_path: Path) -> None:
    """Found by review: a garbage value in the jobs family surfaced as msgpack's own
    exception from the queries; every failure of the store is typed."""
    from tests.wal.records import created
    from wal import codec
    from wal.errors import Corrupt
    from wal.store import ShardStore

    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        store.write([created(1)])
        store._cf[1].put(codec.i64(1), b"\xc1")  # job 1's row in the jobs family; never valid
        with pytest.raises(Corrupt):
            store.job_by_key(1)
        with pytest.raises(Corrupt):
            store.latest(1)


def test_undecodable_values_are_corrupt_on_every_path(tmp_path: Path) -> None:
    """Found by a second review: the store's counts and meta at open, a run's value in a
    retention pass, and a run's log state (read and append) still surfaced msgpack's own
    FormatError, which the node takes for a bug of its own (a shard stopped as a bug; a
    start-up traceback) instead of a corrupt directory."""
    from tests.wal.records import T0, batch, run
    from wal import codec
    from wal.store import _LOGS, _META, _RUNS, Retention

    store = ShardStore.open(tmp_path, shard=0, shards=1, epoch=1)
    try:
        store.write([created(1), batch(2, run(1, T0, "SUCCESS")), batch(3, run(1, T0 + 1))])
        store.logs.append(1, T0, "stdout", b"hi")
        store._cf[_LOGS][codec.i64(1) + codec.i64(T0) + codec.u32(0)] = b"\xc1"
        with pytest.raises(Corrupt, match="log state"):
            store.logs.read(1, T0)
        with pytest.raises(Corrupt, match="log state"):
            store.logs.append(1, T0, "stdout", b"x")
        store._cf[_RUNS][codec.i64(1) + codec.i64(T0)] = b"\x00\xc1"
        with pytest.raises(Corrupt):
            store.retain(T0 + 10**9, Retention(max_age_ms=1, max_runs_per_job=None))
        store._cf[1].put(codec.i64(1), b"\x93\x01\xc1")  # job 1: [1, <never valid>, ...]
        with pytest.raises(Corrupt):
            store.ticket_fields(1)
        store._cf[_META][b"counts"] = b"\xc1"
    finally:
        store.close()
    with pytest.raises(Corrupt, match="counts"):
        ShardStore.open(tmp_path, shard=0, shards=1, epoch=2)
    with ShardStore.open(tmp_path / "b", shard=0, shards=1, epoch=1) as other:
        other._cf[_META][b"shards"] = b"\xc1"
    with pytest.raises(Corrupt, match="meta shards"):
        ShardStore.open(tmp_path / "b", shard=0, shards=1, epoch=2)


def test_keys_and_times_past_64_bits_are_usage_errors(tmp_path: Path) -> None:
    """Found by the second review: a run time of 2**63 or more (a 19-digit run id) raised the
    key codec's struct.error from the queries, the log store and prepare."""
    from engine.effects import Persist
    from tests.wal.records import T0, run
    from wal.errors import InvalidBatch, StoreUsageError

    big = 1 << 63
    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=1) as store:
        store.write([created(1)])
        for call in (
            lambda: store.run(1, big),
            lambda: store.run(big, T0),
            lambda: store.has_run(1, big),
            lambda: store.last_runs(big),
            lambda: store.last_runs(1, before=big + 1),
            lambda: store.history(-big - 1),
            lambda: store.logs.append(1, big, "stdout", b"x"),
            lambda: store.logs.read(big, T0),
        ):
            with pytest.raises(StoreUsageError, match="signed 64-bit"):
                call()
        with pytest.raises(InvalidBatch):
            store.write([Persist(2, 1, (run(1, big),))])
        assert store.job_by_key(1) is not None and store.last_runs(1) == []  # nothing written


# ------------------------------------------------------------------------- no space, read-only:
# the texts RocksDB (and rocksdict, and Python) give them
#
# rocksdict raises a bare Exception with RocksDB's status text, which wal.errors.translate
# reads. For ENOSPC RocksDB's status carries the NoSpace subcode, whose text it puts first
# ("IO error: No space left on device: <context>: <strerror>"); every other errno comes as
# "IO error: <context>: <strerror>" (EROFS: "Read-only file system"); rocksdict's own file
# writes at open report Rust's "... (os error N)". Those marked (seen) are what the tmpfs
# tests below got from this RocksDB; the rest are the same shapes on other files, chosen so
# that a message naming a MANIFEST or the LOCK is still typed by its cause.

ENOSPC = "No space left on device"
ROCKSDB_TEXTS = [
    # (seen) the log's append on a full file system
    pytest.param(
        f"IO error: {ENOSPC}: While appending to file: /d/000004.log: {ENOSPC}",
        DiskFull,
        id="enospc-log",
    ),
    # a flush's table, and a MANIFEST (not Corrupt for naming it)
    pytest.param(
        f"IO error: {ENOSPC}: While appending to file: /d/000011.sst: {ENOSPC}",
        DiskFull,
        id="enospc-table",
    ),
    pytest.param(
        f"IO error: {ENOSPC}: While open a file for appending: /d/MANIFEST-000012: {ENOSPC}",
        DiskFull,
        id="enospc-manifest",
    ),
    # a file size limit (EFBIG: seen by the fill test above), and a quota (EDQUOT)
    pytest.param(
        "IO error: While appending to file: /d/000009.log: File too large",
        DiskFull,
        id="efbig-log",
    ),
    pytest.param(
        "IO error: While appending to file: /d/000004.log: Disk quota exceeded",
        DiskFull,
        id="edquot-log",
    ),
    # the shard directory's creation: Python's own OSError
    pytest.param(f"[Errno 28] {ENOSPC}: '/d'", DiskFull, id="enospc-mkdir"),
    # (seen) a snapshot's table on a read-only file system
    pytest.param(
        "IO error: While open a file for appending: /d/snapshot-20.sst.tmp: Read-only file system",
        ReadOnly,
        id="erofs-snapshot",
    ),
    # the LOCK (not StoreLocked for naming it) and a MANIFEST (not Corrupt)
    pytest.param(
        "IO error: While lock file: /d/LOCK: Read-only file system", ReadOnly, id="erofs-lock"
    ),
    pytest.param(
        "IO error: While open a file for appending: /d/MANIFEST-000007: Read-only file system",
        ReadOnly,
        id="erofs-manifest",
    ),
    # (seen) rocksdict's open on a read-only file system, and the directory's creation
    pytest.param("Read-only file system (os error 30)", ReadOnly, id="erofs-rocksdict-open"),
    pytest.param("[Errno 30] Read-only file system: '/d/new-shard'", ReadOnly, id="erofs-mkdir"),
    # the neighbours they must not be taken for
    pytest.param(
        "IO error: While lock file: /d/LOCK: Resource temporarily unavailable",
        StoreLocked,
        id="locked",
    ),
    pytest.param(
        "IO error: While appending to file: /d/000004.log: Input/output error",
        StoreIOError,
        id="eio-log",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ROCKSDB_TEXTS)
def test_rocksdb_no_space_and_read_only_texts_are_typed(
    text: str, expected: type[StoreFailure]
) -> None:
    from wal.errors import translate

    got = translate(Exception(text), path="/d", doing="writing batches 1..2")
    assert type(got) is expected, (text, type(got).__name__)
    assert got.code == expected.code and got.path == "/d"
    assert got.message == f"writing batches 1..2: {text}"  # what failed, and RocksDB's words


def test_an_oserror_is_typed_by_its_text_too() -> None:
    """The directory's creation fails with Python's OSError, not RocksDB's text."""
    from wal.errors import translate

    for code, expected in ((errno.ENOSPC, DiskFull), (errno.EROFS, ReadOnly)):
        exc = OSError(code, os.strerror(code), "/d/shard")
        assert type(translate(exc, path="/d/shard", doing="creating")) is expected, code


# ------------------------------------------------------------------------- a real full or
# read-only file system: a tmpfs of the child's own, in a private mount namespace (no root
# needed where unprivileged user namespaces are allowed; Linux only)

_UNSHARE: tuple[tuple[str, ...], ...] = (
    ("unshare", "--user", "--map-root-user", "--mount"),  # any user, where userns are allowed
    ("unshare", "--mount"),  # root (or CAP_SYS_ADMIN) where they are not
)


@functools.cache
def _private_mounts() -> tuple[str, ...] | str:
    """The command prefix that runs a process in a private mount namespace in which it may
    mount a tmpfs, or why none works here."""
    if sys.platform != "linux":
        return f"a private tmpfs needs Linux mount namespaces; this is {sys.platform}"
    missing = [tool for tool in ("unshare", "mount", "umount") if shutil.which(tool) is None]
    if missing:
        return f"util-linux's {', '.join(missing)} not installed"
    why: list[str] = []
    probe = tempfile.mkdtemp(prefix="tickwheel-probe-")
    try:
        for prefix in _UNSHARE:
            cmd = [*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                return prefix
            why.append(f"`{' '.join(prefix)} mount -t tmpfs ...`: {proc.stderr.strip()}")
    finally:
        os.rmdir(probe)
    return "cannot mount a private tmpfs here: " + "; ".join(why)


@pytest.fixture
def private_mounts() -> tuple[str, ...]:
    got = _private_mounts()
    if isinstance(got, str):
        pytest.skip(got)
    return got


def test_a_really_full_file_system_is_disk_full_and_loses_nothing_acknowledged(
    tmp_path: Path, private_mounts: tuple[str, ...]
) -> None:
    mnt, copy = tmp_path / "mnt", tmp_path / "copy"
    mnt.mkdir()
    lines = child("tmpfs-full", str(mnt), str(2 * 1024 * 1024), str(copy), prefix=private_mounts)
    acked = {int(line.split()[1]) for line in lines if line.startswith("ack ")}
    errors = [line for line in lines if line.startswith("error ")]
    assert len(acked) > 1000, lines[-5:]  # (2 MiB of the log: thousands of batches)
    assert len(errors) == 1 and errors[0].startswith("error DiskFull"), errors
    assert "No space left on device" in errors[0] and str(mnt / "shard") in errors[0]
    again = [line for line in lines if line.startswith("again ")]
    assert again and again[0].startswith("again DiskFull"), again
    # Space freed, the failed store closed and reopened by the same process, and written.
    rest = [line for line in lines if not line.startswith(("ack ", "error ", "again "))]
    assert rest == ["reopened", f"written {10**9 + 1}", "copied"], rest
    with open_store(copy, epoch=3) as store:
        logged = {b: records for _s, b, _e, records in store.log_batches()}
        assert acked <= set(logged), sorted(acked - set(logged))[:5]
        assert 10**9 + 1 in logged
        for k, records in logged.items():  # whole, or not there at all
            assert [r["t"] for r in records] == ["job", "pos"], k
            job = store.job_by_key(k)
            assert job is not None and job.position is not None, k
        assert store.counts.jobs == len(logged)


def test_a_read_only_file_system_is_read_only(
    tmp_path: Path, private_mounts: tuple[str, ...]
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lines = child("tmpfs-read-only", str(mnt), prefix=private_mounts)
    assert len(lines) == 4, lines
    snapshot, opening, creating, reopened = lines
    # the directory gone read-only under an open store: RocksDB's own text, for a new file
    assert snapshot.startswith("snapshot error ReadOnly writing snapshot"), snapshot
    assert "Read-only file system" in snapshot and str(mnt / "shard") in snapshot
    # a store opened, and a shard created, on a read-only file system
    assert opening.startswith("error ReadOnly opening the shard store"), opening
    assert "Read-only file system" in opening
    assert creating.startswith("error ReadOnly creating the shard directory"), creating
    assert "Read-only file system" in creating
    # and nothing lost: writable again, the ten batches are there
    assert reopened == "reopened 10"
