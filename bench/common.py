"""The shared shape of every benchmark suite: metrics, machine facts, tables and JSON.

Owns how results look (so that every suite prints and serialises alike), how machine facts are
collected and how a rate is timed. Must never judge a figure against a target: suites print
figures and ratios against anchors measured in the same run; people and CI read them.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Metric:
    """One figure: a value with its unit, its parameters, and optionally the anchor beside it."""

    name: str
    value: float
    unit: str
    params: dict[str, Any] = field(default_factory=dict)
    anchor: str | None = None
    anchor_value: float | None = None

    @property
    def ratio(self) -> float | None:
        """value / anchor_value, or None without an anchor (or with a zero anchor)."""
        if self.anchor_value is None or self.anchor_value == 0:
            return None
        return self.value / self.anchor_value

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "value": _round(self.value), "unit": self.unit}
        out.update(self.params)
        if self.anchor is not None:
            out["anchor"] = self.anchor
            out["anchor_value"] = _round(self.anchor_value)
            ratio = self.ratio
            out["ratio"] = None if ratio is None else round(ratio, 3)
        return out


@dataclass
class SuiteResult:
    suite: str
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "machine": machine_info(),
            "metrics": [m.to_json() for m in self.metrics],
        }


def _round(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, int) or float(value).is_integer():
        return int(value)
    return round(float(value), 3)


#: work items of one timing of :func:`host_probe_ns` (7-13 ms a timing here)
PROBE_ITEMS = 2_000
PROBE_TIMINGS = 9


def host_probe_ns() -> float:
    """Nanoseconds one item of a fixed pure-Python workload takes on this host now: a
    job-spec-like dict built, packed and unpacked with msgpack, and walked; the median of
    :data:`PROBE_TIMINGS` timings (the best moves with the host's quickest moment, the median
    with its usual speed); ~0.2 s.

    Why: the same code's figures moved by 2x between two boots of this machine in one day
    (the store's CPU a record 6.4 us in the morning, 13.3 in the afternoon), while the disk
    anchors did not, and on a shared host the speed moves by up to 2x within minutes. The
    probe, taken as a suite's JSON is made (the end of its run), moves with the host's CPU: two
    runs' figures compare when their probes agree. A machine fact, never a figure or a judgement.
    """
    import msgpack

    packb, unpackb = msgpack.packb, msgpack.unpackb
    timings: list[int] = []
    collecting = gc.isenabled()
    for _ in range(PROBE_TIMINGS):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter_ns()
            for i in range(PROBE_ITEMS):
                spec = {
                    "id": f"probe-{i:08d}",
                    "schedule": {"at": "2026-12-04T15:46:23.047Z"},
                    "task": {"payload": {"n": i}},
                    "tier": "default",
                    "retries": {"max": 0, "backoff": "10s", "factor": 2.0},
                    "labels": {},
                }
                for key in unpackb(packb(spec)):
                    spec.pop(key)
            elapsed = time.perf_counter_ns() - start
        finally:
            if collecting:
                gc.enable()
        timings.append(elapsed)
    return statistics.median(timings) / PROBE_ITEMS


def machine_info() -> dict[str, Any]:
    """Facts that make a figure comparable: CPU, cores, memory, Python and numpy versions, and
    how fast the CPU is just now (:func:`host_probe_ns`, as ``python_probe_ns``)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_bytes = None
    try:
        mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": None if mem_bytes is None else round(mem_bytes / 2**30, 1),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "python_probe_ns": round(host_probe_ns(), 1),
    }


def rate(count: int, fn: Callable[[], object], *, repeat: int = 1) -> float:
    """Operations per second of ``fn`` doing ``count`` operations: best of ``repeat`` runs.

    The garbage collector is paused during each run, as it would otherwise charge one
    structure's cost to whichever benchmark happens to trigger the collection.
    """
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        best = min(best, elapsed)
    return count / best if best > 0 else float("inf")


def print_table(result: SuiteResult, *, file: Any = None) -> None:
    """A table for people: one row per metric, parameters folded into one column."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tickwheel bench {result.suite}")
    for col, justify in (
        ("metric", "left"),
        ("params", "left"),
        ("value", "right"),
        ("unit", "left"),
        ("anchor", "left"),
        ("anchor value", "right"),
        ("ratio", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for m in result.metrics:
        ratio = m.ratio
        table.add_row(
            m.name,
            " ".join(f"{k}={v}" for k, v in m.params.items()),
            _fmt(m.value),
            m.unit,
            m.anchor or "",
            "" if m.anchor_value is None else _fmt(m.anchor_value),
            "" if ratio is None else f"{ratio:.2f}x",
        )
    # Wide enough for the parameters column even when piped (rich assumes 80 columns then).
    console = Console(file=file, width=max(Console().width, 150))
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")


def _fmt(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.2f}"


def emit(result: SuiteResult, *, as_json: bool) -> None:
    """Print a suite's result: one JSON object with ``as_json``, else a table."""
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
    else:
        print_table(result)


def progress(items: Iterable[Any], *, enabled: bool, description: str) -> Iterable[Any]:
    """Wrap ``items`` in a rich progress bar on stderr when ``enabled`` (never in JSON mode)."""
    if not enabled:
        return items
    from rich.progress import track

    return track(items, description=description, transient=True)
