"""``tickwheel bench store``: the shard store — group commit, recovery, bytes on disk.

Owns four workloads, all on a real RocksDB directory in the system's temp dir:

* ``durable_records_per_s``: P producers (1, 16, 256), each submitting a batch of one record
  (a new run of its job created PENDING, as a fire persists it) through group commit and
  waiting for its acknowledgement before the next, for a fixed time (or ``--jobs N`` batches
  per measurement, whichever comes first). Three drivers: ``threads`` (a thread per producer
  blocked on its ticket), ``trio`` (a Trio task per producer; the writer is ``CommitQueue`` +
  ``trio.to_thread``) and ``node`` (the node's pattern: producers are callbacks in a Trio loop,
  acknowledged by the ``GroupCommitter``'s one hand-off per group). The anchor is the loop a team writes first: ``os.write`` + ``os.fdatasync`` of the same
  record bytes, one record per sync, in a file in the same directory, measured just before each
  figure (the disk is shared, so its speed drifts; an anchor measured next to each figure keeps
  the ratio honest).
* ``store_cpu_us_per_record``: the CPU one durable run record costs on the thread holding the
  GIL (made, prepared, written with its group), in parts, and the rate that allows on one
  core: the ceiling of ``durable_records_per_s`` however producers and writer are arranged.
* ``recovery_pending_per_s`` (``--pending N``, default 2M and 10M): a snapshot of N pending
  one-shot jobs in the engine's columns is written and the store closed; timed: reopen (a new
  epoch), load the snapshot into numpy arrays (``scope: store``), and, when the engine can take
  a snapshot back (``ShardEngine.recover(..., snapshot=...)``), rebuild the engine from it
  (``scope: engine``: open + load + rebuild, the whole restart).
* ``disk_bytes_per_pending``: bytes of the shard directory per pending job, for the snapshot
  alone at each N (``scope: snapshot``) and for 100,000 jobs stored as their create records
  (``job`` + ``pos``) plus their snapshot (``scope: records+snapshot``).

Must never judge a figure: the issue's targets are printed as notes.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.common import Metric, SuiteResult
from engine import records as rec
from engine.effects import Persist
from engine.snapshot import Snapshot
from wal import codec
from wal.commit import CommitQueue, GroupCommitter, Ticket
from wal.route import PreparedBatch
from wal.store import ShardStore

DEFAULT_PENDING = (2_000_000, 10_000_000)
PRODUCERS = (1, 16, 256)
DURABLE_SECONDS = 3.0
ANCHOR_SECONDS = 1.5
RECORDS_SCOPE_JOBS = 100_000
T0 = 1_767_225_600_000


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, file=sys.stderr)


def _run_record(key: int, at: int) -> rec.Record:
    return {
        "t": "run",
        "v": rec.FORMAT_VERSION,
        "key": key,
        "at": at,
        "state": "PENDING",
        "att": 1,
        "tok": 0,
        "w": None,
        "ver": 1,
        "due": None,
        "fail": 0,
        "tmo": 0,
        "src": None,
        "exit": None,
        "why": None,
        "e": 1,
    }


_measurements = itertools.count(1)


def _batch_id(m: int, p: int, n: int) -> int:
    """Batch ``n`` of producer ``p`` in measurement ``m``: unique in the run."""
    return (m << 48) | (p << 32) | n


def _producer_run(m: int, p: int, n: int) -> rec.Record:
    """Producer ``p``'s ``n``-th record in measurement ``m``: a new run of job ``p`` (one job
    per producer), later than every run an earlier measurement made, as a fire makes it."""
    return _run_record(p, T0 + (m << 32) + n)


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


# ------------------------------------------------------------------------- durability


def fdatasync_rate(
    directory: str, record: bytes, seconds: float, max_records: int | None = None
) -> float:
    """Records per second of ``write`` + ``fdatasync``, one record per sync (the anchor), for
    ``seconds`` or ``max_records``, whichever ends first."""
    path = os.path.join(directory, "anchor.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        n = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            os.write(fd, record)
            os.fdatasync(fd)
            n += 1
            if n == max_records or (n % 16 == 0 and time.perf_counter() >= deadline):
                break
        return n / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)


def durable_rate(
    committer: GroupCommitter, producers: int, seconds: float, cap: int | None, epoch: int
) -> tuple[float, float]:
    """(acknowledged records per second, batches per fsync) with ``producers`` threads each
    submitting one-record batches and waiting for each acknowledgement."""
    m = next(_measurements)
    counts = [0] * producers
    start_line = threading.Barrier(producers + 1)
    per_thread_cap = None if cap is None else max(1, cap // producers)
    deadline = [0.0]

    def produce(p: int) -> None:
        submit = committer.submit
        n = 0
        start_line.wait()
        end = deadline[0]
        while time.perf_counter() < end and (per_thread_cap is None or n < per_thread_cap):
            submit(Persist(_batch_id(m, p, n), epoch, (_producer_run(m, p, n),))).wait()
            n += 1
        counts[p] = n

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    groups0, batches0 = committer.groups, committer.batches
    deadline[0] = time.perf_counter() + seconds
    start = time.perf_counter()
    start_line.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    groups = committer.groups - groups0
    batches = committer.batches - batches0
    return sum(counts) / elapsed, batches / max(groups, 1)


def trio_durable_rate(
    store: ShardStore, producers: int, seconds: float, cap: int | None, epoch: int
) -> tuple[float, float]:
    """:func:`durable_rate` with Trio tasks as producers instead of threads: a Trio driver of
    the same :class:`~wal.commit.CommitQueue` policy, the write in a worker thread
    (``trio.to_thread.run_sync``), acknowledgements as events in the loop, so a waiting producer
    costs no thread switch (but a task switch: see :func:`node_durable_rate` for the node's
    pattern, which has none)."""
    import trio

    m = next(_measurements)
    queue: CommitQueue[tuple[PreparedBatch, trio.Event]] = CommitQueue()
    counts = [0] * producers
    stats = {"groups": 0, "batches": 0}
    wake = [trio.Event()]
    per_task_cap = None if cap is None else max(1, cap // producers)

    async def writer() -> None:
        while True:
            if not len(queue):
                wake[0] = trio.Event()
                await wake[0].wait()
            group = queue.take()
            await trio.to_thread.run_sync(store.write_prepared, [p for p, _ in group])
            stats["groups"] += 1
            stats["batches"] += len(group)
            for _, done in group:
                done.set()

    async def produce(p: int, end: float) -> None:
        n = 0
        while trio.current_time() < end and (per_task_cap is None or n < per_task_cap):
            prepared = store.prepare(Persist(_batch_id(m, p, n), epoch, (_producer_run(m, p, n),)))
            done = trio.Event()
            queue.push((prepared, done), prepared.size)
            wake[0].set()
            await done.wait()
            n += 1
        counts[p] = n

    async def main() -> float:
        async with trio.open_nursery() as outer:
            outer.start_soon(writer)
            start = trio.current_time()
            async with trio.open_nursery() as inner:
                for p in range(producers):
                    inner.start_soon(produce, p, start + seconds)
            elapsed = trio.current_time() - start
            outer.cancel_scope.cancel()
        return elapsed

    elapsed = trio.run(main)
    return sum(counts) / elapsed, stats["batches"] / max(stats["groups"], 1)


def node_durable_rate(
    store: ShardStore, producers: int, seconds: float, cap: int | None, epoch: int
) -> tuple[float, float]:
    """:func:`durable_rate` in the node's pattern: the producers live in a Trio loop as state
    machines, not tasks (as the node's shard loop, which submits the engine's batches and is
    told ``Durable``), submit through a :class:`~wal.commit.GroupCommitter` without waking its
    writer, and an instrument does as the node's kicker (``cluster.node._Kicker``) as the loop
    is about to wait for I/O: with nothing runnable and the disk fast
    (``INLINE_COMMIT_MAX_WRITE_S``), it writes what is queued on the loop's own thread
    (``write_here``) and works the acknowledgements through there; else it wakes the writer,
    which hands each group's acknowledgements back by one ``run_sync_soon`` (``on_group``).
    New batches queued by acknowledgements worked through in the instrument end the loop's
    coming wait for I/O at once, as the next requests of the node's clients would. Each
    producer still submits a one-record batch and submits its next only once that one is
    durable.
    The collector is set as a node sets it in its own process (``Node.run``: what exists is
    frozen, young collections every ``NODE_GC_THRESHOLDS[0]`` allocations); the process's
    settings are restored after."""
    import trio

    from cluster.node import INLINE_COMMIT_MAX_WRITE_S, NODE_GC_THRESHOLDS, _nothing

    m = next(_measurements)
    counts = [0] * producers
    per_cap = None if cap is None else max(1, cap // producers)
    out = {"elapsed": 0.0, "groups": 0, "batches": 0}

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        live = [producers]
        end = [0.0]
        errors: list[BaseException] = []

        handed = [0, 0]  # groups handed to the loop by the writer thread, and taken there
        queued = [False]  # batches wait without a wake-up

        def on_group(tickets: Sequence[Ticket]) -> None:  # on the writer thread
            handed[0] += 1
            try:
                token.run_sync_soon(committed_handed, tickets)
            except trio.RunFinishedError:
                pass

        committer = GroupCommitter(store, on_group=on_group)
        submit = committer.submit

        def produce(p: int) -> None:
            n = counts[p]
            submit(Persist(_batch_id(m, p, n), epoch, (_producer_run(m, p, n),)), wake=False)
            queued[0] = True

        class Kicker(trio.abc.Instrument):
            def before_io_wait(self, timeout: float) -> None:
                if not queued[0]:
                    return
                queued[0] = False
                if timeout > 0 and committer.recent_write_s <= INLINE_COMMIT_MAX_WRITE_S:
                    tickets = committer.write_here()
                    if tickets:
                        if handed[0] != handed[1]:  # behind a group still in Trio's queue
                            token.run_sync_soon(committed, tickets)
                        else:
                            committed(tickets)
                        if queued[0] or trio.lowlevel.current_statistics().tasks_runnable:
                            token.run_sync_soon(_nothing)
                        return
                    if tickets is not None:
                        return  # nothing was queued
                committer.kick()

        def committed_handed(tickets: Sequence[Ticket]) -> None:
            handed[1] += 1
            committed(tickets)

        def committed(tickets: Sequence[Ticket]) -> None:  # in the loop, once per group
            now = time.perf_counter()
            for ticket in tickets:
                if ticket.error is not None:
                    errors.append(ticket.error)
                p = (ticket.batch_id >> 32) & 0xFFFF
                n = counts[p] = counts[p] + 1
                if now < end[0] and (per_cap is None or n < per_cap) and not errors:
                    produce(p)
                else:
                    live[0] -= 1
            if not live[0]:
                finished.set()

        groups0, batches0 = committer.groups, committer.batches
        kicker = Kicker()
        trio.lowlevel.add_instrument(kicker)
        start = time.perf_counter()
        end[0] = start + seconds
        for p in range(producers):
            produce(p)
        await finished.wait()
        out["elapsed"] = time.perf_counter() - start
        out["groups"] = committer.groups - groups0
        out["batches"] = committer.batches - batches0
        trio.lowlevel.remove_instrument(kicker)
        await trio.to_thread.run_sync(committer.close)
        if errors:
            raise errors[0]

    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*NODE_GC_THRESHOLDS)
    try:
        trio.run(main)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return sum(counts) / out["elapsed"], out["batches"] / max(out["groups"], 1)


def measure_durable(result: SuiteResult, args: argparse.Namespace, root: str) -> None:
    path = os.path.join(root, "durable")
    record = codec.pack(_run_record(1, T0))
    store = ShardStore.open(path, shard=0, shards=1, epoch=1)
    committer = GroupCommitter(store)
    anchor = 0.0
    try:
        for producers in PRODUCERS:
            _say(args, f"fdatasync loop, then {producers} producers ...")
            anchor = fdatasync_rate(root, record, ANCHOR_SECONDS, args.jobs)
            rate, per_fsync = durable_rate(committer, producers, DURABLE_SECONDS, args.jobs, 1)
            result.add(
                Metric(
                    "durable_records_per_s",
                    rate,
                    "records/s",
                    {
                        "producers": producers,
                        "driver": "threads",
                        "record": "run",
                        "batches_per_fsync": round(per_fsync, 1),
                    },
                    "write+fdatasync loop",
                    anchor,
                )
            )
            drivers = (("trio", trio_durable_rate), ("node", node_durable_rate))
            for driver, measure in drivers if producers > 1 else drivers[1:]:
                rate, per_fsync = measure(store, producers, DURABLE_SECONDS, args.jobs, 1)
                result.add(
                    Metric(
                        "durable_records_per_s",
                        rate,
                        "records/s",
                        {
                            "producers": producers,
                            "driver": driver,
                            "record": "run",
                            "batches_per_fsync": round(per_fsync, 1),
                        },
                        "write+fdatasync loop",
                        anchor,
                    )
                )
        measure_cpu_per_record(result, args, store, anchor)
    finally:
        committer.close()
        store.close()
        shutil.rmtree(path, ignore_errors=True)


#: Groups of CPU_GROUP one-record batches per repetition of :func:`measure_cpu_per_record`.
CPU_GROUP = 256
CPU_GROUPS = 40
CPU_REPEATS = 5


def measure_cpu_per_record(
    result: SuiteResult, args: argparse.Namespace, store: ShardStore, anchor: float
) -> None:
    """What one durable record costs in CPU on the thread that holds the GIL, in parts, and
    the rate that cost allows on one core: the ceiling of ``durable_records_per_s`` however
    the producers and the writer are arranged, since every part runs with the GIL held
    (rocksdict releases it only for the fsync). Measured with the thread's own CPU clock, in
    one thread: each group is ``CPU_GROUP`` one-record batches (the 256-producer pattern),
    made, prepared and written in one synced write; best of ``CPU_REPEATS``."""
    _say(args, "CPU per durable record ...")
    groups = max(1, min(CPU_GROUPS, (args.jobs or CPU_GROUP * CPU_GROUPS) // CPU_GROUP))
    best: tuple[float, float, float] | None = None
    for _ in range(CPU_REPEATS):
        m = next(_measurements)
        make = prepare = write = 0.0
        for n in range(groups):
            c0 = time.thread_time()
            batches = [
                Persist(_batch_id(m, p, n), 1, (_producer_run(m, p, n),)) for p in range(CPU_GROUP)
            ]
            c1 = time.thread_time()
            prepared = [store.prepare(b) for b in batches]
            c2 = time.thread_time()
            store.write_prepared(prepared)
            c3 = time.thread_time()
            make, prepare, write = make + c1 - c0, prepare + c2 - c1, write + c3 - c2
        records = groups * CPU_GROUP
        parts = (make / records * 1e6, prepare / records * 1e6, write / records * 1e6)
        if best is None or sum(parts) < sum(best):
            best = parts
    assert best is not None
    total = sum(best)
    ceiling = 1e6 / total if total > 0 else 0.0
    result.add(
        Metric(
            "store_cpu_us_per_record",
            total,
            "us",
            {
                "record": "run",
                "batch": "one record",
                "group": CPU_GROUP,
                "make_us": round(best[0], 2),
                "prepare_us": round(best[1], 2),
                "write_us": round(best[2], 2),
                "ceiling_records_per_s": round(ceiling),
                "ceiling_ratio_to_anchor": round(ceiling / anchor, 2) if anchor else None,
            },
        )
    )


# ------------------------------------------------------------------------- recovery


def _engine_takes_snapshots() -> bool:
    """Whether ``ShardEngine.recover`` takes a snapshot back (it is being written alongside)."""
    from engine.shard import ShardEngine

    params = inspect.signature(ShardEngine.recover).parameters
    return "snapshot" in params and hasattr(ShardEngine, "export_snapshot")


def _pending_snapshot(n: int, with_engine: bool) -> Snapshot:
    """N pending one-shot jobs in the engine's columns: exported by a real engine when it can
    (what a node would store), else the same four columns built directly."""
    from bench.engine_suite import SyntheticDirectory, _snapshot

    synthetic = _snapshot(n)
    if not with_engine:
        return synthetic
    from engine.shard import EngineConfig, ShardEngine

    engine, _ = ShardEngine.recover(
        [],
        snapshot=synthetic,
        directory=SyntheticDirectory(),
        epoch=2,
        wall_ms=T0,
        mono_ms=0,
        config=EngineConfig(ready_bound=n + 1),
    )
    return engine.export_snapshot()


def measure_recovery(
    result: SuiteResult, args: argparse.Namespace, root: str, n: int, with_engine: bool
) -> None:
    path = os.path.join(root, f"recovery-{n}")
    _say(args, f"recovery of {n:,} pending jobs: building the snapshot ...")
    snap = _pending_snapshot(n, with_engine)
    with ShardStore.open(path, shard=0, shards=1, epoch=2) as store:
        store.write_snapshot(0, snap.arrays, snap.meta)
    del snap
    gc.collect()
    disk = _dir_bytes(path)
    _say(args, "... reopening and loading")
    gc.disable()
    try:
        start = time.perf_counter()
        store = ShardStore.open(path, shard=0, shards=1, epoch=3)
        recovered = store.load()
        tail = list(recovered.tail)
        loaded = time.perf_counter()
        assert recovered.snapshot is not None
        assert recovered.snapshot.arrays["next"].shape == (n,)
        engine_s = None
        if with_engine:
            from engine.shard import EngineConfig, ShardEngine

            engine, _ = ShardEngine.recover(
                tail,
                snapshot=recovered.snapshot,
                directory=store,
                epoch=3,
                wall_ms=T0,
                mono_ms=0,
                config=EngineConfig(ready_bound=n + 1),
            )
            engine_s = time.perf_counter() - start
            pending = getattr(engine, "pending_jobs", None)
            assert pending is None or pending() == n
    finally:
        gc.enable()
    store.close()
    load_s = loaded - start
    result.add(
        Metric(
            "recovery_pending_per_s",
            n / load_s,
            "jobs/s",
            {"pending": n, "scope": "store", "seconds": round(load_s, 3)},
        )
    )
    if engine_s is not None:
        result.add(
            Metric(
                "recovery_pending_per_s",
                n / engine_s,
                "jobs/s",
                {"pending": n, "scope": "engine", "seconds": round(engine_s, 3)},
            )
        )
    result.add(
        Metric("disk_bytes_per_pending", disk / n, "bytes", {"pending": n, "scope": "snapshot"})
    )
    shutil.rmtree(path, ignore_errors=True)


def measure_records_disk(result: SuiteResult, args: argparse.Namespace, root: str, n: int) -> None:
    """Bytes per job when every job is stored as its create records plus the snapshot."""
    from bench.engine_suite import _snapshot

    _say(args, f"{n:,} jobs as create records plus their snapshot ...")
    path = os.path.join(root, f"records-{n}")
    spec_template: dict[str, Any] = {
        "schedule": {"at": "2026-01-01T00:30:00Z"},
        "tier": "default",
        "timeout": None,
        "on_timeout": "kill",
        "delivery": "at_least_once",
        "retries": {"max": 0, "backoff": "10s", "factor": 2.0, "max_backoff": "1h"},
        "catchup": "latest",
        "catchup_window": "1d",
        "max_catchup": 100,
        "overlap": "allow",
        "after": [],
        "paused": False,
        "labels": {},
        "replace": False,
    }
    with ShardStore.open(path, shard=0, shards=1, epoch=1) as store:
        group: list[Persist] = []
        for key in range(n):
            job_id = f"job-{key:09d}"
            spec: dict[str, Any] = {"id": job_id, "task": {"payload": key}, **spec_template}
            group.append(
                Persist(
                    key,
                    1,
                    (
                        rec.make("job", key=key, id=job_id, ver=1, spec=spec, e=1),
                        rec.make(
                            "pos",
                            key=key,
                            next=T0 + 1_800_000,
                            acct=T0,
                            paused=False,
                            gone=False,
                            why="catchup",
                            e=1,
                        ),
                    ),
                )
            )
            if len(group) == 1000:
                store.write(group)
                group = []
        if group:
            store.write(group)
        snap = _snapshot(n)
        store.write_snapshot(store.last_seq, snap.arrays, snap.meta)
    result.add(
        Metric(
            "disk_bytes_per_pending",
            _dir_bytes(path) / n,
            "bytes",
            {"pending": n, "scope": "records+snapshot"},
        )
    )
    shutil.rmtree(path, ignore_errors=True)


def run(args: argparse.Namespace) -> SuiteResult:
    sizes: list[int] = list(args.pending or DEFAULT_PENDING)
    result = SuiteResult("store")
    root = tempfile.mkdtemp(prefix="tickwheel-bench-store-")
    try:
        measure_durable(result, args, root)
        with_engine = _engine_takes_snapshots()
        for n in sizes:
            measure_recovery(result, args, root, n, with_engine)
        measure_records_disk(result, args, root, min(RECORDS_SCOPE_JOBS, min(sizes)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result.notes.extend(
        [
            "targets (issue 5): durable_records_per_s at producers=256 >= 20x the "
            "write+fdatasync loop; 10M pending rebuilt in < 5 s (2,000,000 jobs/s)",
            "store_cpu_us_per_record: the CPU one durable run record costs with the GIL held "
            "(make the record and its batch, prepare it, write it: the memtable inserts, the "
            "accounting), in one thread; ceiling_records_per_s = 1e6 / that, the most one "
            "core can commit however the producers are arranged; ceiling_ratio_to_anchor "
            "compares it with the 256-producer run's anchor",
            f"data in {tempfile.gettempdir()} (the anchor's file is in the same directory); "
            "each anchor was measured just before its figure",
            "recovery scope 'store': reopen + snapshot into numpy arrays; 'engine': that plus "
            "ShardEngine.recover from the snapshot (the whole restart)",
        ]
    )
    return result
