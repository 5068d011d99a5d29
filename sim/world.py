"""One simulated cluster for one seed: builds the parts, runs them, checks, summarises.

Owns the assembly (kernel, network, coordinator, stores, nodes, workers, clients, faults,
NTP, samplers), the run (workload and faults until the end of the hours, then a drain in
which nothing new goes wrong and the cluster settles) and the result of one seed. Must never
make a decision about the cluster or hold a copy of engine logic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.lease import EpochFence, LeaseConfig
from engine.records import expand
from engine.routing import shard_of
from engine.shard import EngineConfig
from sim.checks import Observer, Violation, final_checks
from sim.client import NAME as CLIENT
from sim.client import Client
from sim.clock import NodeClock
from sim.config import SimConfig
from sim.coordinator import NAME as COORD
from sim.coordinator import Coordinator
from sim.disk import ShardStore, StoredBatch
from sim.faults import FaultInjector
from sim.kernel import Kernel
from sim.net import Network
from sim.node import SimNode
from sim.worker import SimWorker

SAMPLE_EVERY_MS = 5_000


@dataclass
class SeedResult:
    """What one seed produced. ``lateness`` and ``queue`` are samples for plots."""

    seed: int
    trace_hash: str
    violations: list[Violation]
    runs: int
    executions: int
    missed: int
    double_executed: int
    early: int
    stuck: int
    lateness: list[tuple[int, int]] = field(default_factory=list)  # (sim ms, ms late)
    queue: list[tuple[int, int]] = field(default_factory=list)  # (sim ms, runs PENDING)
    faults: list[tuple[int, int, str, str]] = field(default_factory=list)
    excerpt: list[str] = field(default_factory=list)
    burst_at: int | None = None  # sim ms of the top-of-hour burst, when there was one
    elapsed_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)


class World:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.shards = config.shard_count
        self.kernel = Kernel(config.seed, keep=config.trace_keep, focus=config.trace_focus)
        self.engine_config: EngineConfig = config.engine_config()
        self.lease_config: LeaseConfig = config.lease_config()
        self.fence = EpochFence(config.fence_mutants())
        k = self.kernel
        self.net = Network(k, k.rng("net"), loss=config.loss)
        self.coord = Coordinator(k, self.net, self.shards)
        self.stores = [ShardStore(k, s, k.rng(f"disk/{s}"), self.fence) for s in range(self.shards)]
        self.observer = Observer(self)
        clocks = k.rng("clocks")
        self.nodes = [
            SimNode(
                self,
                i,
                NodeClock(
                    mono_start=clocks.randint(10**6, 10**9),
                    wall_error_ms=clocks.randint(-100, 100),
                    wall_ppm=clocks.randint(-50, 50),
                    mono_ppm=clocks.randint(-200, 200),
                ),
            )
            for i in range(config.nodes)
        ]
        self.node_by_name = {n.name: n for n in self.nodes}
        # Every worker runs the default tier; every other one (and the first) the batch tier.
        self.workers = [
            SimWorker(self, i, ("default", "batch") if i % 2 == 0 else ("default",))
            for i in range(config.workers)
        ]
        self.worker_by_name = {w.name: w for w in self.workers}
        self.client = Client(self, k.rng("client"))
        self.faults = FaultInjector(self)
        for node in self.nodes:
            self.coord.watchers.append((node.name, node.on_watch))
        for worker in self.workers:
            self.coord.watchers.append((worker.name, worker.on_watch))
        self._pending: dict[tuple[int, int, int], bool] = {}
        self.queue: list[tuple[int, int]] = []
        if config.samples:
            for store in self.stores:
                store.on_durable = self._count_pending

    def shard_of(self, job_id: str) -> int:
        return shard_of(job_id, self.shards)

    # ---------------------------------------------------------------- running

    def run(self) -> SeedResult:
        started = time.perf_counter()
        k, cfg = self.kernel, self.config
        for node in self.nodes:
            node.start()
        for i, worker in enumerate(self.workers):
            k.later(200 + 37 * i, worker.start)
        self.client.start()
        self.faults.start()
        k.later(cfg.ntp_every_ms, self._ntp)
        if cfg.samples:
            k.later(SAMPLE_EVERY_MS, self._sample)
        k.env.run(until=cfg.stop_ms)
        violations, totals = final_checks(self)
        violations = self.observer.violations + violations
        obs = self.observer
        stats = {
            "events": k.trace.lines,
            "messages": self.net.delivered,
            "dropped": self.net.dropped,
            "client_requests": self.client.sent,
            "exists_answers": self.client.exists_answers,
            "exists_then_lost": self._told_exists_but_lost(),
            "client_gave_up": self.client.gave_up,
            "acked_jobs": len(obs.acks),
            "epochs": len(self.coord.tenures),
            "durable_batches": sum(len(s.batches) for s in self.stores),
        }
        return SeedResult(
            seed=cfg.seed,
            trace_hash=k.trace.digest(),
            violations=violations,
            runs=totals.runs,
            executions=len(obs.executions),
            missed=totals.missed,
            double_executed=totals.double_executed,
            early=obs.early,
            stuck=totals.stuck,
            lateness=obs.lateness,
            queue=self.queue,
            faults=obs.faults,
            excerpt=list(k.trace.focused) or list(k.trace.recent),
            elapsed_s=time.perf_counter() - started,
            burst_at=self.client.burst_at if "burst" in cfg.faults else None,
            stats=stats,
        )

    def _told_exists_but_lost(self) -> int:
        """Jobs a client was told "exists" (on a retried create) that no log holds (check 4
        reports them too; tests/sim/test_engine_findings.py has the finding this was)."""
        told = self.client.told_exists
        if not told:
            return 0
        stored = {r["id"] for s in self.stores for r in s.records if r["t"] == "job"}
        return sum(1 for j in told if j not in stored)

    def _ntp(self) -> None:
        """Every node's wall clock is stepped back to its usual small error, unless a skew
        fault holds it."""
        now = self.kernel.now
        for node in self.nodes:
            if node.skewed_until <= now:
                node.clock.step_wall(now, node.base_wall_error)
        if now + self.config.ntp_every_ms < self.config.stop_ms:
            self.kernel.later(self.config.ntp_every_ms, self._ntp)

    # ---------------------------------------------------------------- samples for plots

    def _count_pending(self, shard: int, batch: StoredBatch) -> None:
        pending = self._pending
        for raw in batch.records:
            if raw["t"] == "fire":
                for key, at in zip(raw["keys"], raw["ats"], strict=True):
                    pending[(shard, key, at)] = True
            elif raw["t"] == "run":
                for r in expand(raw):
                    ref = (shard, r["key"], r["at"])
                    if r["state"] == "PENDING":
                        pending[ref] = True
                    else:
                        pending.pop(ref, None)

    def _sample(self) -> None:
        self.queue.append((self.kernel.now, len(self._pending)))
        if self.kernel.now + SAMPLE_EVERY_MS < self.config.stop_ms:
            self.kernel.later(SAMPLE_EVERY_MS, self._sample)


def run_seed(config: SimConfig) -> SeedResult:
    """Run one seed and check it. Deterministic: the same config gives the same result and
    the same ``trace_hash`` (wall-clock timings in ``elapsed_s`` aside)."""
    return World(config).run()


__all__ = ["CLIENT", "COORD", "SeedResult", "World", "run_seed"]
