"""The process the crash test kills: reopens the store (a recovery), checks what the round
before it left, then commits batches as fast as it can through group commit, printing each
batch's id once it is acknowledged durable.

``python -m tests.wal.crash_child`` is a small fork server: it imports everything once, then for
each line ``PATH EPOCH FIRST_ID PRODUCERS STATE`` read from stdin it forks a committer and
prints ``pid N``. The committer opens the store; when ``STATE`` is a file (not ``-``) it holds
what the checks so far found (:class:`Verified`) and what the killed round before it
acknowledged, and the committer recovers (:meth:`ShardStore.load`), checks that round
(:func:`check_round`), writes the file back with what it found and prints ``checked`` (or
``failed MESSAGE`` and exits). Then it prints ``ready`` and one acknowledged batch id per line
(each line one write(2) of a few bytes to a pipe: never torn), until it is killed; when it is
gone the server prints ``done``. Forking saves each round the interpreter's start and imports
(most of a round's time otherwise); the server itself never opens RocksDB, so a fork copies no
database threads or locks. Checking in the next round's own process, right after its open,
makes that open the reopen after the kill: one RocksDB open a round, not two (each open flushes
what it recovered, tens of ms here).

Every batch ``i`` holds records routed to several column families (job + index, position, run,
a skip, a note, the log), so a batch applied by half would show.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from engine import records as rec
from engine.effects import Persist
from engine.records import Record
from wal import codec
from wal.commit import GroupCommitter
from wal.route import HISTORY as _HISTORY
from wal.route import INDEX as _INDEX
from wal.route import JOBS as _JOBS
from wal.route import NRUNS as _NRUNS
from wal.route import POS as _POS
from wal.route import RUNS as _RUNS
from wal.store import ShardStore

T0 = 1_767_225_600_000
#: batch ids of round r are r * IDS_PER_ROUND + 0, 1, ...: a batch's id says its round
IDS_PER_ROUND = 1_000_000
#: ids past a round's last logged batch that must have left nothing (more than the producers,
#: each of which may have taken an id that was never written)
IN_FLIGHT_SLACK = 64


def epoch_of(r: int) -> int:
    """The epoch round ``r``'s committer opens the store with (the fence wants each newer)."""
    return r + 1


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


# ------------------------------------------------------------------------- the checks


@dataclass
class Verified:
    """What the checks so far found: how many batches, all whole, and the snapshot the last
    check wrote (log position and round; 0 and -1 before one), which holds those batches' ids
    in log order; ``acked``: what the round to check next acknowledged. Small (the ids are in
    the snapshot, not here): it goes through a file between the test and every round."""

    batches: int = 0
    snapshot_seq: int = 0
    snapshot_round: int = -1
    acked: list[int] = field(default_factory=list)


Decode = Callable[[bytes], object]
#: What each family keyed by the job's key must hold for batch i (from its records), and how
#: its values read (``pos`` and ``runs`` values start with a class byte; ``nruns`` holds the
#: run count first).
ROUTES: dict[str, tuple[int, Decode, Callable[[list[Record]], list[object]]]] = {
    "jobs": (_JOBS, codec.unpack, lambda rs: [[rs[0]["ver"], rs[0]["spec"], rs[0]["id"]]]),
    "pos": (_POS, lambda v: codec.unpack(v[1:]), lambda rs: [rs[1]]),
    "runs": (_RUNS, lambda v: codec.unpack(v[1:]), lambda rs: [rs[2]]),
    "history": (_HISTORY, codec.unpack, lambda rs: [rs[3], rs[4]]),
    "nruns": (_NRUNS, codec.read_u64, lambda rs: [1]),
}


def routed(store: ShardStore, family: int, first: int, decode: Decode) -> dict[int, list[object]]:
    """The rows of ``family`` whose job key is in round ``first // IDS_PER_ROUND``'s range,
    decoded, by job key. One range scan: a round's rows are compared with its log as a whole,
    not read back one get at a time (which cost this test seconds)."""
    out: dict[int, list[object]] = {}
    for k, v in store._scan(family, codec.i64(first), codec.i64(first + IDS_PER_ROUND)):
        out.setdefault(codec.read_i64(k), []).append(decode(v))
    return out


def family_size(store: ShardStore, family: int) -> int:
    # Keys only, no values: a few ms for a whole family at this test's size.
    return sum(1 for _ in store._cf[family].keys())


def check_batch_read(store: ShardStore, i: int) -> None:
    """Batch ``i`` as a reader sees it through the store's queries."""
    assert store.key_of(f"c{i}") == i, i
    job = store.job_by_key(i)
    assert job is not None and job.position is not None and job.position["next"] == T0 + i, i
    run = store.run(i, T0 + i)
    assert run is not None and run["state"] == "PENDING", i
    assert sorted(h["t"] for h in store.history(i)) == ["note", "skip"], i
    assert store.run_count(i) == 1, i


def check_round(store: ShardStore, r: int, seen: Verified, *, everything: bool = False) -> None:
    """Recover ``store`` (just reopened after round ``r``'s kill) and check what round ``r``
    left: every batch it acknowledged (``seen.acked``) logged, every batch it logged whole in
    the log and in every family, nothing of any other batch of its anywhere, earlier rounds'
    batches still all there, the counts exact. Then record the round in ``seen`` and write a
    snapshot of it, so that the next recovery is snapshot + tail (as a node's is) and the next
    check reads that round's batches alone, O(round), not O(everything). ``everything``: also
    check every family's size and the snapshot's content against them (the last round)."""
    assert store.previous_epoch == epoch_of(r), "the killed committer's epoch was not durable"
    recovered = store.load()
    assert (recovered.epoch, recovered.previous_epoch) == (store.epoch, epoch_of(r))
    verified = np.empty(0, dtype=np.int64)  # the ids of every batch checked before
    if seen.batches:
        assert recovered.snapshot is not None and recovered.snapshot_seq == seen.snapshot_seq
        assert recovered.snapshot.meta == {"round": seen.snapshot_round, "n": seen.batches}
        verified = recovered.snapshot.arrays["ids"]
        assert verified.shape == (seen.batches,), verified.shape
    else:
        assert recovered.snapshot is None and recovered.snapshot_seq == -1
    tail = list(recovered.tail)  # the recovery path's records, consumed while the store is open
    logged = list(store.log_batches())  # round r's batches: the snapshot covers the rest
    # The log has no hole: a group lost between two others would show, acknowledged or not.
    start = seen.snapshot_seq + 1
    assert [s for s, *_ in logged] == list(range(start, recovered.last_seq + 1)), "a hole"
    assert recovered.last_seq == store.last_seq
    assert tail == [record for *_, records in logged for record in records], "load()'s tail"
    ids = [i for _s, i, _e, _r in logged]
    new = set(ids)
    assert len(new) == len(ids), "a batch logged twice"
    first = r * IDS_PER_ROUND
    assert all(first <= i < first + IDS_PER_ROUND for i in ids), "ids of another round"
    missing = set(seen.acked) - new
    assert not missing, f"{len(missing)} acknowledged batches lost, e.g. {sorted(missing)[:5]}"
    # Whole in the log ...
    for _seq, i, epoch, records in logged:
        assert records == list(batch_records(i)), f"batch {i} torn in the log"
        assert epoch == epoch_of(r), (i, epoch)
    # ... and whole in every family it was routed to, and nothing of a batch not logged (those
    # in flight at the kill) in any: each family's rows of the round are exactly the logged
    # batches' rows.
    for name, (family, decode, expect) in ROUTES.items():
        got = routed(store, family, first, decode)
        want = {i: expect(records) for _s, i, _e, records in logged}
        if got != want:
            wrong = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
            raise AssertionError(
                f"{name} differs from the log for {len(wrong)} batches, e.g. (batch, stored, "
                f"logged): {[(k, got.get(k), want.get(k)) for k in wrong[:2]]}"
            )
    # (``index`` is keyed by job id: asked for the logged ids, and for the ids not logged)
    assert store.keys_of([f"c{i}" for i in ids]) == ids, "index"
    gaps = [i for i in range(first, max(ids, default=first) + IN_FLIGHT_SLACK) if i not in new]
    assert store.keys_of([f"c{i}" for i in gaps]) == [None] * len(gaps), "index of a lost batch"
    for i in {min(ids), max(ids)} if ids else ():  # and as the queries read them
        check_batch_read(store, i)
    # Every batch of the earlier rounds (each checked whole in its own) still stored after
    # this recovery: counted every round, in every family in the last.
    total = seen.batches + len(ids)
    assert family_size(store, _JOBS) == total, "jobs of earlier rounds lost"
    all_ids = np.concatenate([verified, np.array(ids, dtype=np.int64)])
    if everything:
        jobs = {codec.read_i64(cast(bytes, k)) for k in store._cf[_JOBS].keys()}
        assert len(jobs) == total and jobs == set(all_ids.tolist()), "jobs differ from the log"
        for family, per_batch in ((_INDEX, 1), (_POS, 1), (_RUNS, 1), (_NRUNS, 1), (_HISTORY, 2)):
            assert family_size(store, family) == per_batch * total, family
    counts = store.counts
    assert counts.jobs == counts.pending_jobs == counts.runs_pending == total, counts
    assert recovered.counts == counts
    seen.batches, seen.acked = total, []
    if ids:
        store.write_snapshot(store.last_seq, {"ids": all_ids}, {"round": r, "n": total})
        seen.snapshot_seq, seen.snapshot_round = store.last_seq, r


def read_state(path: str) -> Verified:
    with open(path) as f:
        return Verified(**json.load(f))


def write_state(path: str, seen: Verified) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(asdict(seen), f)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------- the committer


def commit_forever(path: str, epoch: int, first: int, producers: int, state: str) -> None:
    try:
        store = ShardStore.open(path, shard=0, shards=1, epoch=epoch)
        if state != "-":
            seen = read_state(state)
            check_round(store, first // IDS_PER_ROUND - 1, seen)
            write_state(state, seen)
            os.write(1, b"checked\n")
    except Exception as exc:  # a failed check, or a store that cannot be recovered
        # One line, which the test raises as the round's failure.
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc(limit=-1)
        os.write(1, f"failed {' '.join(detail.split())}\n".encode())
        os._exit(1)
    committer = GroupCommitter(store)
    out_lock = threading.Lock()
    ids = iter(range(first, first + IDS_PER_ROUND))
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
        path, epoch, first, producers, state = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                commit_forever(path, int(epoch), int(first), int(producers), state)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        os.write(1, f"pid {pid}\n".encode())
        os.waitpid(pid, 0)
        os.write(1, b"done\n")


if __name__ == "__main__":
    main()
