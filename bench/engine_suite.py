"""``tickwheel bench engine``: one shard engine loaded with N one-shot jobs, no I/O.

Owns the workload: N one-shot jobs due over one hour are created through the engine (each batch
acknowledged at once, as a disk that never waits), half spread over one hour and half due at
its end. The hour passes in ticks of one simulated second (``mode=steady``), then the last tick
fires the top-of-the-hour burst (``mode=burst``): each fire is a run created with its records and
the job's position advanced. Reports creates and
fires per second, and the process's resident memory per pending job. The anchor beside the fire
rate is the loop teams write first: a heap of ``(due, job id)`` popped in Python, building a run
record per pop, measured in the same run. Must never judge a figure.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import os
import time

from bench.common import Metric, SuiteResult
from engine.effects import CreateJob, Durable, Persist
from engine.jobs import validate_job
from engine.schedules import format_utc
from engine.shard import EngineConfig, ShardEngine

T0 = 1_767_225_600_000
HORIZON_MS = 3_600_000
DEFAULT_PENDING = (100_000,)
STEP_MS = 1000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _due(i: int) -> int:
    """Half the jobs spread over the hour, half due at its end: a top-of-the-hour burst."""
    if i % 2:
        return T0 + HORIZON_MS
    return T0 + 1000 + (i * 7_919) % (HORIZON_MS - 2000)


def measure(n: int) -> dict[str, float]:
    gc.collect()
    rss0 = _rss()
    engine = ShardEngine(epoch=1, wall_ms=T0, mono_ms=0, config=EngineConfig(ready_bound=n + 1))
    start = time.perf_counter()
    for i in range(n):
        spec = validate_job(
            {"id": f"job-{i:09d}", "schedule": {"at": format_utc(_due(i))}, "task": {"payload": i}},
            now_ms=T0,
        )
        effects = engine.handle(CreateJob(i, spec), T0, 0)
        persist = effects[0]
        assert isinstance(persist, Persist)
        engine.handle(Durable(persist.batch_id), T0, 0)
    create_s = time.perf_counter() - start
    gc.collect()
    rss1 = _rss()
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
        "create_per_s": n / create_s,
        "fires_steady_per_s": steady / steady_s,
        "fires_burst_per_s": burst / burst_s,
        "bytes_per_pending": (rss1 - rss0) / n,
    }


def _tick(engine: ShardEngine, ms: int) -> int:
    """One driver wake-up at ``ms`` into the hour; returns the runs it created."""
    runs = 0
    for effect in engine.tick(T0 + ms, ms):
        if isinstance(effect, Persist):
            runs += sum(1 for r in effect.records if r["t"] == "run")
            engine.handle(Durable(effect.batch_id), T0 + ms, ms)
    return runs


def heap_poller(n: int) -> float:
    """The anchor: pop due entries from a heap and build a run record per pop."""
    heap = [(_due(i), f"job-{i:09d}") for i in range(n)]
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
    for n in args.pending or DEFAULT_PENDING:
        figures = measure(n)
        anchor = heap_poller(n)
        p = {"pending": n}
        result.add(Metric("create_per_s", figures["create_per_s"], "jobs/s", p))
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
    result.notes.extend(
        [
            "targets (issue 3): resident_bytes_per_pending <= 40 at 10M; fires_per_s >= 100,000 "
            "(a Redis sorted-set poller driven from Python popped 83,000/s on this machine)",
            "jobs are still Python objects in this version (spec, schedule, policy per job); "
            "the columnar layout of DESIGN.md is what the memory target needs",
        ]
    )
    return result
