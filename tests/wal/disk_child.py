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
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading

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
    try:
        store.write([created(10**9)])
        say("again written")
    except StoreError as exc:
        say(f"again {type(exc).__name__} {exc}")
    os._exit(0)  # closing would try to flush into the capped files


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
