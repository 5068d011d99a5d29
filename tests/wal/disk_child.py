"""Processes the disk-trouble tests run, each doing one thing to a store and printing what
happened, one line each: ``ack N`` per acknowledged batch, ``error CLASS MESSAGE`` for a store
error, ``opened`` / ``written``.

``python -m tests.wal.disk_child MODE PATH [ARG]``:

* ``fill PATH LIMIT``: open the store, then cap file sizes at LIMIT bytes (``RLIMIT_FSIZE``,
  SIGXFSZ ignored, so a write past it fails with EFBIG as on a full disk) and commit through
  group commit until the store fails; then try once more.
* ``open-capped PATH LIMIT``: cap file sizes first, then open.
* ``open-as-nobody PATH``: drop root to uid/gid 65534 if root (so permissions bind), then open.
* ``write-and-vanish PATH N``: write N batches, then ``os._exit`` (RocksDB's log is left as it
  is, not flushed to tables by a close).

Two more run in a private mount namespace (``unshare --mount``, see the tests), where they may
mount a tmpfs of their own at ``MNT`` (it goes with the process; nothing leaks to the host):

* ``tmpfs-full MNT SIZE OUT``: a tmpfs of SIZE bytes at MNT, a store at ``MNT/shard`` filled
  through group commit until the disk is really full (ENOSPC, as RocksDB reports it); then
  once more; then the store closed, the tmpfs grown (space freed) and the store reopened in
  this same process (``reopened``) and written (``written K``); the directory is copied to OUT
  for the test to check (``copied``).
* ``tmpfs-read-only MNT``: a store on a tmpfs at MNT, written; its directory then made
  read-only under it while it is open (a read-only bind mount on top), and a snapshot
  written (``snapshot ...``: RocksDB's own error); the store closed, the whole tmpfs
  remounted read-only, the store opened and a new shard created (an ``error`` line each, or
  ``opened``); remounted read-write and reopened (``reopened N``: the batches logged).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np

from tests.wal.records import created
from wal.commit import GroupCommitter
from wal.errors import StoreError
from wal.store import ShardStore


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def cap(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def open_store(path: str, epoch: int = 1) -> ShardStore | None:
    try:
        return ShardStore.open(path, shard=0, shards=1, epoch=epoch)
    except StoreError as exc:
        say(f"error {type(exc).__name__} {exc}")
        return None


def fill(path: str, limit: int) -> None:
    store = open_store(path)
    assert store is not None
    cap(limit)
    commit_until_failure(store)
    os._exit(0)  # closing would try to flush into the capped files


def commit_until_failure(store: ShardStore) -> None:
    """Group commit from 4 producers until a write fails (``ack`` lines, one ``error``), then
    one more write (``again``)."""
    committer = GroupCommitter(store)
    failed = threading.Event()
    lock = threading.Lock()
    keys = iter(range(10**9))

    def produce() -> None:
        while not failed.is_set():
            with lock:
                k = next(keys)
            try:
                committer.submit(created(k)).wait()
            except StoreError as exc:
                with lock:
                    if not failed.is_set():
                        say(f"error {type(exc).__name__} {exc}")
                    failed.set()
                return
            say(f"ack {k}")

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    committer.close()
    try:
        store.write([created(10**9)])
        say("again written")
    except StoreError as exc:
        say(f"again {type(exc).__name__} {exc}")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


def tmpfs_full(mnt: str, size: int, out: str) -> None:
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt)
    data = os.path.join(mnt, "shard")
    store = open_store(data)
    assert store is not None
    commit_until_failure(store)
    # (about a second here, space freed or not: RocksDB's close waits, likely for its
    # background retry of the ENOSPC, every bgerror_resume_retry_interval, 1 s by default)
    store.close()
    # The operator frees space; the store, failed, closed, is reopened by the same process
    # (as a node does after a failure): nothing of the failed one may still hold the LOCK.
    mount("-t", "tmpfs", "-o", f"remount,size={64 * size}", "tmpfs", mnt)
    store = open_store(data, epoch=2)
    if store is not None:
        say("reopened")
        store.write([created(10**9 + 1, epoch=2)])
        say(f"written {10**9 + 1}")
        store.close()
    shutil.copytree(data, out)
    say("copied")


def tmpfs_read_only(mnt: str) -> None:
    mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", mnt)
    data = os.path.join(mnt, "shard")
    store = open_store(data)
    assert store is not None
    store.write([created(k) for k in range(10)])
    # Read-only under the open store (a bind mount of the directory on itself, then made
    # read-only): RocksDB's files already open still take writes, a new file does not.
    mount("--bind", data, data)
    mount("-o", "remount,bind,ro", data)
    try:
        store.write_snapshot(store.last_seq, {"next": np.arange(10, dtype=np.int64)}, {})
        say("snapshot written")
    except StoreError as exc:
        say(f"snapshot error {type(exc).__name__} {exc}")
    store.close()
    subprocess.run(["umount", data], check=True, capture_output=True, timeout=30)
    mount("-t", "tmpfs", "-o", "remount,ro", "tmpfs", mnt)
    store = open_store(data, epoch=2)
    if store is not None:
        say("opened")
        store.close()
    new = open_store(os.path.join(mnt, "new-shard"), epoch=1)
    if new is not None:
        say("opened")
        new.close()
    mount("-t", "tmpfs", "-o", "remount,rw", "tmpfs", mnt)
    store = open_store(data, epoch=3)
    if store is not None:
        say(f"reopened {len(list(store.log_batches()))}")
        store.close()


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "fill":
        fill(path, int(sys.argv[3]))
    elif mode == "open-capped":
        cap(int(sys.argv[3]))
        if open_store(path) is not None:
            say("opened")
        os._exit(0)
    elif mode == "open-as-nobody":
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        store = open_store(path, epoch=2)
        if store is not None:
            say("opened")
            store.close()
    elif mode == "tmpfs-full":
        tmpfs_full(path, int(sys.argv[3]), sys.argv[4])
    elif mode == "tmpfs-read-only":
        tmpfs_read_only(path)
    elif mode == "write-and-vanish":
        store = open_store(path)
        assert store is not None
        for k in range(int(sys.argv[3])):
            store.write([created(k)])
        say("written")
        os._exit(0)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
