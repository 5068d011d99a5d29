"""The process the crash test kills: commits batches as fast as it can through group commit,
printing each batch's id once it is acknowledged durable.

``python -m tests.wal.crash_child`` is a small fork server: it imports everything once, then for
each line ``PATH EPOCH FIRST_ID PRODUCERS`` read from stdin it forks a committer and prints
``pid N``; the committer prints ``ready`` once the store is open, then one acknowledged batch id
per line (each line one write(2) of a few bytes to a pipe: never torn), until it is killed; when
it is gone the server prints ``done``. Forking saves each round the interpreter's start and
imports (most of a round's time otherwise); the server itself never opens RocksDB, so a fork
copies no database threads or locks.

Every batch ``i`` holds records routed to several column families (job + index, position, run,
a skip, a note, the log), so a batch applied by half would show.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

from engine import records as rec
from engine.effects import Persist
from wal.commit import GroupCommitter
from wal.store import ShardStore

T0 = 1_767_225_600_000


def batch_records(i: int) -> tuple[rec.Record, ...]:
    return (
        rec.make("job", key=i, id=f"c{i}", ver=1, spec={"id": f"c{i}", "pad": "x" * (i % 300)}),
        rec.make("pos", key=i, next=T0 + i, acct=0, paused=False, gone=False, why="catchup"),
        rec.make(
            "run",
            key=i,
            at=T0 + i,
            state="PENDING",
            att=1,
            tok=0,
            w=None,
            ver=1,
            due=None,
            fail=0,
            tmo=0,
            src=None,
            exit=None,
            why=None,
        ),
        rec.make("skip", key=i, lo=T0 - i, hi=T0 - i, n=1, why="catchup"),
        rec.make("note", key=i, at=T0 + i, tok=0, what="crash test", exit=None),
    )


def commit_forever(path: str, epoch: int, first: int, producers: int) -> None:
    store = ShardStore.open(path, shard=0, shards=1, epoch=epoch)
    committer = GroupCommitter(store)
    out_lock = threading.Lock()
    ids = iter(range(first, first + 10**9))
    ids_lock = threading.Lock()
    os.write(1, b"ready\n")

    def produce() -> None:
        while True:
            with ids_lock:
                i = next(ids)
            committer.submit(Persist(i, epoch, batch_records(i))).wait()
            with out_lock:  # after the ack, never before
                os.write(1, f"{i}\n".encode())

    threads = [threading.Thread(target=produce, daemon=True) for _ in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    for line in sys.stdin:
        path, epoch, first, producers = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                commit_forever(path, int(epoch), int(first), int(producers))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        os.write(1, f"pid {pid}\n".encode())
        os.waitpid(pid, 0)
        os.write(1, b"done\n")


if __name__ == "__main__":
    main()
