"""``tickwheel bench wheel``: the timing wheel beside ``heapq`` and ``sortedcontainers.SortedList``.

Owns the workload and how it is measured. Each structure runs in a fresh subprocess so that its
resident memory is the growth of that process alone (no garbage left by another structure) and
no structure's garbage collection is charged to another. The workload, identical for all three:
``N`` dense keys due uniformly over one hour; schedule them one by one; (wheel only) schedule them
again as one numpy batch, beside ``heapq.heapify`` of a list of tuples; fire the first tenth of
the hour in 100 advances (about N/1000 entries each), then 2,000 advances of 1 ms (a few entries
each, the driver's steady state); cancel a random tenth of what is left.

Must never judge: it prints figures, ratios and the issue's targets as notes.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import Metric, SuiteResult

NOW_MS = 1_800_000_000_000
HORIZON_MS = 3_600_000
COARSE_STEPS = 1000  # the hour in steps of 3.6 s ...
COARSE_MEASURED = 100  # ... of which the first 100 are timed (the structures stay ~full)
FINE_STEPS = 2000  # then 1 ms steps
STRUCTURES = ("wheel", "heapq", "sortedlist")
DEFAULT_PENDING = (1_000_000, 10_000_000)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.enable()


def _workload(n: int, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    keys = rng.permutation(n).astype(np.int64)  # dense keys, scheduled in random order
    dues = NOW_MS + rng.integers(1, HORIZON_MS, n, dtype=np.int64)
    return keys, dues


CHUNK = 1 << 16


def _pairs(keys: np.ndarray[Any, Any], dues: np.ndarray[Any, Any]) -> Any:
    """(key, due) as Python ints, converted a chunk at a time: the ints a structure keeps count
    towards its memory, the conversion buffers (reused chunk after chunk) do not."""
    for a in range(0, keys.size, CHUNK):
        yield from zip(keys[a : a + CHUNK].tolist(), dues[a : a + CHUNK].tolist(), strict=True)


def _measure_fires(
    out: dict[str, float],
    runner: Callable[[list[int]], Callable[[], int]],
    coarse: list[int],
    fine: list[int],
) -> None:
    """Time the structure's fire loop over the coarse steps, then the 1 ms steps."""
    for label, limits in (("coarse", coarse), ("fine", fine)):
        elapsed, fired = _timed(runner(limits))
        out[f"fire_{label}_per_s"] = fired / elapsed
        out[f"fire_{label}_count"] = fired


def measure(structure: str, n: int, seed: int = 1) -> dict[str, float]:
    """Run the workload on one structure in this process; return its raw figures."""
    keys, dues = _workload(n, seed)
    gc.collect()
    rss_before = _rss_bytes()
    out: dict[str, float] = {}
    step = HORIZON_MS // COARSE_STEPS
    coarse_until = [NOW_MS + i * step for i in range(1, COARSE_MEASURED + 1)]
    fine_start = coarse_until[-1]
    fine_until = [fine_start + i for i in range(1, FINE_STEPS + 1)]
    cancel_rng = np.random.default_rng(seed + 1)

    if structure == "wheel":
        from engine.wheel import TimingWheel

        wheel = TimingWheel(NOW_MS)

        def build() -> None:
            schedule = wheel.schedule
            for k, d in _pairs(keys, dues):
                schedule(k, d)
            wheel.next_due()  # places the staged keys: part of the cost

        elapsed, _ = _timed(build)
        out["schedule_per_s"] = n / elapsed
        gc.collect()
        out["bytes_per_pending"] = (_rss_bytes() - rss_before) / n
        out["nbytes_per_pending"] = wheel.nbytes() / n

        def build_batch() -> None:
            TimingWheel(NOW_MS).schedule_many(keys, dues)

        elapsed, _ = _timed(build_batch)
        out["schedule_batch_per_s"] = n / elapsed

        def fire(limits: list[int]) -> Callable[[], int]:
            def run() -> int:
                advance, fired = wheel.advance, 0
                for limit in limits:
                    fired += len(advance(limit))
                return fired

            return run

        _measure_fires(out, fire, coarse_until, fine_until)
        alive = keys[dues > fine_until[-1]]
        victims = cancel_rng.choice(alive, size=alive.size // 10, replace=False).tolist()

        def cancel() -> None:
            c = wheel.cancel
            for k in victims:
                c(k)

        elapsed, _ = _timed(cancel)
        out["cancel_per_s"] = len(victims) / elapsed
        return out

    if structure == "heapq":
        heap: list[tuple[int, int]] = []

        def build_heap() -> None:
            push = heapq.heappush
            for k, d in _pairs(keys, dues):
                push(heap, (d, k))

        elapsed, _ = _timed(build_heap)
        out["schedule_per_s"] = n / elapsed
        gc.collect()
        out["bytes_per_pending"] = (_rss_bytes() - rss_before) / n

        def heapify_batch() -> None:
            items = list(zip(dues.tolist(), keys.tolist(), strict=True))
            heapq.heapify(items)

        elapsed, _ = _timed(heapify_batch)
        out["schedule_batch_per_s"] = n / elapsed

        def pop(limits: list[int]) -> Callable[[], int]:
            def run() -> int:
                heappop, fired = heapq.heappop, 0
                for limit in limits:
                    while heap and heap[0][0] <= limit:
                        heappop(heap)
                        fired += 1
                return fired

            return run

        _measure_fires(out, pop, coarse_until, fine_until)
        return out

    if structure == "sortedlist":
        from sortedcontainers import SortedList

        sl: SortedList = SortedList()

        def build_sl() -> None:
            add = sl.add
            for k, d in _pairs(keys, dues):
                add((d, k))

        elapsed, _ = _timed(build_sl)
        out["schedule_per_s"] = n / elapsed
        gc.collect()
        out["bytes_per_pending"] = (_rss_bytes() - rss_before) / n

        def pop_sl(limits: list[int]) -> Callable[[], int]:
            def run() -> int:
                fired = 0
                for limit in limits:
                    # pop every due entry from the front, as a poller would
                    cut = sl.bisect_right((limit, 2**63))
                    if cut:
                        del sl[:cut]
                        fired += cut
                return fired

            return run

        _measure_fires(out, pop_sl, coarse_until, fine_until)
        mask = dues > fine_until[-1]
        alive_pairs = np.stack([dues[mask], keys[mask]], axis=1)
        pick = cancel_rng.choice(
            alive_pairs.shape[0], size=alive_pairs.shape[0] // 10, replace=False
        )
        victims_sl = [tuple(p) for p in alive_pairs[pick].tolist()]

        def cancel_sl() -> None:
            remove = sl.remove
            for p in victims_sl:
                remove(p)

        elapsed, _ = _timed(cancel_sl)
        out["cancel_per_s"] = len(victims_sl) / elapsed
        return out

    raise ValueError(f"unknown structure {structure!r}")


def _measure_in_subprocess(structure: str, n: int) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.wheel_suite", structure, str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> SuiteResult:
    sizes: list[int] = list(args.pending or DEFAULT_PENDING)
    result = SuiteResult("wheel")
    for n in sizes:
        figures = {}
        for structure in STRUCTURES:
            if not args.json:
                print(f"measuring {structure} at {n:,} pending ...", file=sys.stderr)
            figures[structure] = _measure_in_subprocess(structure, n)
        wheel, heap, sl = figures["wheel"], figures["heapq"], figures["sortedlist"]
        p = {"pending": n}
        for anchor, ref in (("heapq.heappush", heap), ("SortedList.add", sl)):
            result.add(
                Metric(
                    "schedule_per_s",
                    wheel["schedule_per_s"],
                    "ops/s",
                    {**p, "mode": "single"},
                    anchor,
                    ref["schedule_per_s"],
                )
            )
        result.add(
            Metric(
                "schedule_per_s",
                wheel["schedule_batch_per_s"],
                "ops/s",
                {**p, "mode": "batch"},
                "heapq.heapify",
                heap["schedule_batch_per_s"],
            )
        )
        result.add(
            Metric(
                "schedule_per_s",
                wheel["schedule_batch_per_s"],
                "ops/s",
                {**p, "mode": "batch"},
                "heapq.heappush",
                heap["schedule_per_s"],
            )
        )
        for label, batch in (("coarse", "~N/1000"), ("fine", "1ms")):
            for anchor, ref in (("heapq.heappop", heap), ("SortedList.pop", sl)):
                result.add(
                    Metric(
                        "fire_per_s",
                        wheel[f"fire_{label}_per_s"],
                        "entries/s",
                        {**p, "step": batch, "fired": int(wheel[f"fire_{label}_count"])},
                        anchor,
                        ref[f"fire_{label}_per_s"],
                    )
                )
        result.add(
            Metric(
                "cancel_per_s",
                wheel["cancel_per_s"],
                "ops/s",
                p,
                "SortedList.remove",
                sl["cancel_per_s"],
            )
        )
        for anchor, ref in (("heapq", heap), ("SortedList", sl)):
            result.add(
                Metric(
                    "resident_bytes_per_pending",
                    wheel["bytes_per_pending"],
                    "bytes",
                    p,
                    anchor,
                    ref["bytes_per_pending"],
                )
            )
        result.add(Metric("allocated_bytes_per_pending", wheel["nbytes_per_pending"], "bytes", p))
    result.notes.extend(
        [
            "targets (issue 2): fire_per_s step=~N/1000 >= 10x heapq.heappop at 10M pending; "
            "schedule_per_s >= heapq.heappush; resident_bytes_per_pending <= 24",
            "fire rates: the first tenth of a one-hour horizon in 100 advances (step=~N/1000), "
            "then 2,000 advances of 1 ms; cancel: a random tenth of what remains",
            "resident bytes: growth of the process's RSS while building, one structure per process",
        ]
    )
    return result


def _main() -> None:
    structure, n = sys.argv[1], int(sys.argv[2])
    print(json.dumps(measure(structure, n)))


if __name__ == "__main__":
    _main()
