"""``tickwheel bench engine``: one shard engine holding N one-shot jobs, no I/O.

Owns the workload. N one-shot jobs due over one hour, half spread over the hour and half due at
its end (a top-of-the-hour burst), are loaded the way recovery loads them: a columnar snapshot
(four arrays) through :meth:`ShardEngine.recover`, with a synthetic store directory that derives
a job's id and spec from its key (the real store answers from RocksDB; the engine never holds
them). The hour then passes in ticks of one simulated second (``mode=steady``) and the last tick
fires the burst (``mode=burst``): each fire is a run created PENDING with its record and the
job's next fire time advanced, each batch acknowledged at once (a disk that never waits).

Reports fires per second, the process's resident memory per pending job after the load, the
load (recovery) rate, and creates per second through ``CreateJob`` commands (validation
included) on a smaller count. The anchor beside the fire rate is the loop teams write first: a
heap of ``(due, job id)`` popped in Python, building a run record per pop, measured in the same
run. Must never judge a figure.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import heapq
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from bench.common import Metric, SuiteResult
from engine.effects import CreateJob, Durable, Persist
from engine.jobs import validate_job
from engine.schedules import format_utc
from engine.shard import EngineConfig, ShardEngine
from engine.snapshot import Snapshot
from engine.wheel import NOT_PENDING

T0 = 1_767_225_600_000
HORIZON_MS = 3_600_000
DEFAULT_PENDING = (1_000_000,)
CREATE_COUNT = 50_000
STEP_MS = 1000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _dues(n: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Half the jobs spread over the hour, half due at its end: a top-of-the-hour burst."""
    i = np.arange(n, dtype=np.int64)
    spread = T0 + 1000 + (i * 7_919) % (HORIZON_MS - 2000)
    return np.where(i % 2 == 1, T0 + HORIZON_MS, spread)


def _job_id(key: int) -> str:
    return f"job-{key:09d}"


class SyntheticDirectory:
    """What the store would answer for the benchmark's jobs, computed from the key."""

    def key_of(self, job_id: str) -> int | None:
        return int(job_id[4:]) if job_id.startswith("job-") else None

    def keys_of(self, job_ids: list[str]) -> list[int | None]:
        return [self.key_of(job_id) for job_id in job_ids]

    def latest(self, key: int) -> tuple[int, Mapping[str, Any]] | None:
        return 1, {"id": _job_id(key), "task": {"payload": key}}

    def ticket_fields(self, key: int) -> tuple[int, str, Any] | None:
        return 1, _job_id(key), {"payload": key}

    def has_run(self, key: int, at: int) -> bool:
        return False  # the benchmark's jobs are created once


def _snapshot(n: int) -> Snapshot:
    """N one-shot jobs of one profile (default policies), as a store would hand them over."""
    template = validate_job(
        {"id": "job-000000000", "schedule": {"at": format_utc(T0 + 1)}, "task": {"payload": 0}},
        now_ms=T0,
    )
    profile: dict[str, Any] = {
        "schedule": None,
        "jitter_id": None,
        "policy": template.policy.to_dict(),
        "after": [],
    }
    return Snapshot(
        arrays={
            "ver": np.ones(n, dtype=np.uint32),
            "prof": np.zeros(n, dtype=np.int32),
            "flags": np.zeros(n, dtype=np.uint8),
            "next": _dues(n),
        },
        meta={
            "format": 1,
            "epoch": 1,
            "batch": 0,
            "next_key": n,
            "profiles": [profile],
            "held_next": [],
            "runs": [],
            "outbox": [],
            "outbox_seq": 0,
            "dependents": {},
            "sources": [],
        },
    )


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so that resident memory counts what is
    live, not the load's temporaries that malloc kept for later."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(n: int) -> dict[str, float]:
    gc.collect()
    _trim()
    rss0 = _rss()
    snap = _snapshot(n)
    start = time.perf_counter()
    engine, _effects = ShardEngine.recover(
        [],
        snapshot=snap,
        directory=SyntheticDirectory(),
        epoch=2,
        wall_ms=T0,
        mono_ms=0,
        config=EngineConfig(ready_bound=n + 1),
    )
    load_s = time.perf_counter() - start
    del snap, _effects
    gc.collect()
    _trim()
    rss1 = _rss()
    assert engine.pending_jobs() == n
    gc.disable()
    try:
        # A driver under load wakes about every second; each tick fires what came due, and
        # the disk acknowledges each batch at once. The last tick is the burst.
        start = time.perf_counter()
        steady = sum(_tick(engine, ms) for ms in range(STEP_MS, HORIZON_MS, STEP_MS))
        steady_s = time.perf_counter() - start
        start = time.perf_counter()
        burst = _tick(engine, HORIZON_MS)
        burst_s = time.perf_counter() - start
    finally:
        gc.enable()
    assert steady + burst == n and burst >= n // 2, (steady, burst, n)
    return {
        "load_per_s": n / load_s,
        "fires_steady_per_s": steady / steady_s,
        "fires_burst_per_s": burst / burst_s,
        "bytes_per_pending": (rss1 - rss0) / n,
    }


def measure_creates(n: int) -> float:
    """Creates through commands: validation, records and reply, each batch acknowledged."""
    engine = ShardEngine(epoch=1, wall_ms=T0, mono_ms=0)
    dues = _dues(n)
    specs = [
        {"id": _job_id(i), "schedule": {"at": format_utc(int(dues[i]))}, "task": {"payload": i}}
        for i in range(n)
    ]
    start = time.perf_counter()
    for i, raw in enumerate(specs):
        effects = engine.handle(CreateJob(i, validate_job(raw, now_ms=T0)), T0, 0)
        persist = effects[0]
        assert isinstance(persist, Persist)
        engine.handle(Durable(persist.batch_id), T0, 0)
    return n / (time.perf_counter() - start)


def _tick(engine: ShardEngine, ms: int) -> int:
    """One driver wake-up at ``ms`` into the hour; returns the runs it created."""
    runs = 0
    for effect in engine.tick(T0 + ms, ms):
        if isinstance(effect, Persist):
            for r in effect.records:
                if r["t"] == "fire":
                    runs += len(r["keys"])
                elif r["t"] == "run" and r["state"] == "PENDING" and r["att"] == 1:
                    runs += 1
            engine.handle(Durable(effect.batch_id), T0 + ms, ms)
    return runs


def heap_poller(n: int) -> float:
    """The anchor: pop due entries from a heap and build a run record per pop."""
    dues = _dues(n).tolist()
    heap = [(dues[i], _job_id(i)) for i in range(n)]
    heapq.heapify(heap)
    now = T0 + HORIZON_MS
    out = []
    gc.disable()
    try:
        start = time.perf_counter()
        while heap and heap[0][0] <= now:
            due, job_id = heapq.heappop(heap)
            out.append({"t": "run", "job": job_id, "at": due, "state": "PENDING", "att": 1})
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return len(out) / elapsed


def run(args: argparse.Namespace) -> SuiteResult:
    result = SuiteResult("engine")
    creates = args.jobs or CREATE_COUNT
    result.add(Metric("create_per_s", measure_creates(creates), "jobs/s", {"jobs": creates}))
    for n in args.pending or DEFAULT_PENDING:
        figures = measure(n)
        anchor = heap_poller(n)
        p = {"pending": n}
        for mode in ("steady", "burst"):
            result.add(
                Metric(
                    "fires_per_s",
                    figures[f"fires_{mode}_per_s"],
                    "runs/s",
                    {**p, "mode": mode},
                    "heapq poller",
                    anchor,
                )
            )
        result.add(Metric("resident_bytes_per_pending", figures["bytes_per_pending"], "bytes", p))
        result.add(Metric("load_pending_per_s", figures["load_per_s"], "jobs/s", p))
    result.notes.extend(
        [
            "targets (issue 3): resident_bytes_per_pending <= 40 at 10M; fires_per_s >= 100,000 "
            "(a Redis sorted-set poller driven from Python popped 83,000/s on this machine)",
            "jobs are columns (version, profile, flags) beside the tier's timing wheel; ids and "
            f"tasks stay in the store (here a synthetic directory); NOT_PENDING={NOT_PENDING}",
        ]
    )
    return result
