"""Many seeds: run them, stop at the first violation when a mutant is on, summarise.

Owns the loop over seeds, the re-run of a violating seed that collects a trace excerpt about
what the violation names (the simulation is deterministic, so the re-run is the same run
with a focused trace), and the aggregate every output is made from (:class:`Summary`). Must
never judge a run itself: the checks are ``sim.checks``'s.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from sim.config import SimConfig
from sim.world import SeedResult, run_seed

#: Trace lines kept per violation in the excerpt.
EXCERPT_LINES = 40


@dataclass
class Summary:
    """Everything the CLI prints or writes, over all seeds run."""

    config: SimConfig
    seeds_run: int = 0
    first_seed: int = 0
    trace_hash: str = ""  # of the first seed
    runs: int = 0
    executions: int = 0
    missed: int = 0
    double_executed: int = 0
    early: int = 0
    stuck: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: int | None = None  # the seed a mutant run stopped at
    elapsed_s: float = 0.0
    seed_seconds: list[float] = field(default_factory=list)
    lateness: array[int] = field(default_factory=lambda: array("q"))
    first: SeedResult | None = None  # the first seed's result, with its samples, for plots
    stats: dict[str, int] = field(default_factory=dict)

    def percentile(self, q: float) -> int | None:
        if not self.lateness:
            return None
        ordered = sorted(self.lateness)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "seeds": self.seeds_run,
            "first_seed": self.first_seed,
            "violations": self.violations,
            "trace_hash": self.trace_hash,
            "runs": self.runs,
            "executions": self.executions,
            "lateness_ms": {
                "p50": self.percentile(0.50),
                "p99": self.percentile(0.99),
                "max": max(self.lateness) if self.lateness else None,
            },
            "missed": self.missed,
            "double_executed": self.double_executed,
            "early": self.early,
            "stuck": self.stuck,
            "mutant": cfg.mutant,
            "caught_at_seed": self.stopped_at,
            "faults": sorted(cfg.faults),
            "nodes": cfg.nodes,
            "workers": cfg.workers,
            "jobs": cfg.jobs,
            "hours": cfg.hours,
            "elapsed_s": round(self.elapsed_s, 3),
            "seconds_per_seed": {
                "mean": round(sum(self.seed_seconds) / len(self.seed_seconds), 3)
                if self.seed_seconds
                else None,
                "max": round(max(self.seed_seconds), 3) if self.seed_seconds else None,
            },
            "stats": self.stats,
        }


def excerpt(config: SimConfig, result: SeedResult) -> list[str]:
    """The trace lines about the first violations of ``result``, from a re-run of its seed."""
    focus: set[str] = set()
    for violation in result.violations[:3]:
        focus.update(violation.focus)
    if not focus:
        return result.excerpt[-EXCERPT_LINES:]
    again = run_seed(replace(config, trace_focus=frozenset({*focus, "fault "}), samples=False))
    if again.trace_hash != result.trace_hash:  # determinism is itself a promise
        return [f"re-run of seed {config.seed} diverged: {again.trace_hash}", *again.excerpt]
    # The lines about the violation, and the faults within two minutes of them.
    own = [line for line in again.excerpt if any(f in line for f in focus)]
    times = [int(line.split(" ", 1)[0]) for line in own]
    kept = [
        line
        for line in again.excerpt
        if line in own
        or any(abs(int(line.split(" ", 1)[0]) - t) <= 120_000 for t in times[-EXCERPT_LINES:])
    ]
    return kept[-EXCERPT_LINES:]


#: A seed allocates millions of short-lived objects and few reference cycles: with the
#: default thresholds the collector ran ~360 times a seed (6% of the time), 4 like this.
_GC_THRESHOLDS = (50_000, 20, 100)


def run_seeds(
    config: SimConfig,
    count: int,
    *,
    on_seed: Callable[[SeedResult], None] | None = None,
    procs: int = 1,
) -> Summary:
    """Run seeds ``config.seed`` .. ``config.seed + count - 1``. With a mutant, stop at the
    first seed that violates anything (the mutant is caught). Only the first seed keeps its
    samples for plots.

    ``procs`` > 1 runs seeds in that many worker processes at once. Results are still taken
    in seed order (``on_seed`` too), so the summary, the trace hash and the seed a mutant
    stops at are exactly those of ``procs=1``; a mutant run cancels the seeds after the one it
    stops at, and an exception of any seed propagates as it would in order."""
    summary = Summary(config=config, first_seed=config.seed)
    started = time.perf_counter()
    thresholds = gc.get_threshold()
    gc.set_threshold(*_GC_THRESHOLDS)
    try:
        if procs > 1 and count > 1:
            with _pool(min(procs, count)) as pool:
                results = _in_pool(pool, config, count, procs)
                try:
                    _run_all(config, count, summary, on_seed, results)
                finally:
                    results.close()  # cancels the seeds not started (a mutant was caught)
        else:
            _run_all(
                config, count, summary, on_seed, (run_seed(c) for c in _configs(config, count))
            )
    finally:
        gc.set_threshold(*thresholds)
    summary.elapsed_s = time.perf_counter() - started
    return summary


def _configs(config: SimConfig, count: int) -> Iterator[SimConfig]:
    for i in range(count):
        yield replace(config, seed=config.seed + i, samples=config.samples and i == 0)


def _pool(procs: int) -> ProcessPoolExecutor:
    # forkserver, not fork: the caller may have threads (rich's progress bar refreshes from
    # one), and a forked child would inherit any lock they held, stderr's included. Each
    # worker imports the simulation once (a few tenths of a second); a seed builds its world.
    return ProcessPoolExecutor(
        procs, mp_context=multiprocessing.get_context("forkserver"), initializer=_worker_start
    )


def _worker_start() -> None:
    gc.set_threshold(*_GC_THRESHOLDS)


def _in_pool(
    pool: ProcessPoolExecutor, config: SimConfig, count: int, procs: int
) -> Generator[SeedResult, None, None]:
    """Seed results in seed order, with at most ``2 * procs`` seeds submitted ahead (a mutant
    run that stops early wastes no more than that). Closing the generator cancels the seeds
    not started."""
    waiting: deque[Future[SeedResult]] = deque()
    configs = _configs(config, count)
    try:
        for cfg in configs:
            waiting.append(pool.submit(run_seed, cfg))
            if len(waiting) >= 2 * procs:
                yield waiting.popleft().result()
        while waiting:
            yield waiting.popleft().result()
    finally:
        for future in waiting:
            future.cancel()


def _run_all(
    config: SimConfig,
    count: int,
    summary: Summary,
    on_seed: Callable[[SeedResult], None] | None,
    results: Iterator[SeedResult],
) -> None:
    for i, (cfg, result) in enumerate(zip(_configs(config, count), results, strict=True)):
        summary.seeds_run += 1
        summary.seed_seconds.append(result.elapsed_s)
        if i == 0:
            summary.trace_hash = result.trace_hash
            summary.first = result
        summary.runs += result.runs
        summary.executions += result.executions
        summary.missed += result.missed
        summary.double_executed += result.double_executed
        summary.early += result.early
        summary.stuck += result.stuck
        summary.lateness.extend(late for _t, late in result.lateness)
        for key, value in result.stats.items():
            summary.stats[key] = summary.stats.get(key, 0) + int(value)
        if result.violations:
            lines = excerpt(cfg, result)
            for violation in result.violations:
                summary.violations.append(
                    {"seed": cfg.seed, **violation.to_dict(), "trace": lines[-EXCERPT_LINES:]}
                )
                lines = []  # the excerpt once per seed
        if on_seed is not None:
            on_seed(result)
        if result.violations and config.mutant is not None:
            summary.stopped_at = cfg.seed
            break
