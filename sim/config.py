"""What one simulated run is made of: sizes, faults, the mutant, and every tunable.

Owns the option values and their validation, and the engine and lease configurations the
simulation runs with. Must never hold behaviour: the world (``sim.world``) builds from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.lease import FENCE_MUTANTS as _FENCE_MUTANTS
from engine.lease import LEASE_MUTANTS as _LEASE_MUTANTS
from engine.lease import WORKER_MUTANTS as _WORKER_MUTANTS
from engine.lease import LeaseConfig
from engine.shard import ENGINE_MUTANTS as _ENGINE_MUTANTS
from engine.shard import NODE_FIRE_AHEAD_MS, EngineConfig
from sim.names import FAULTS, MUTANTS

# Each mutant switches off a guard in the module that owns it; the CLI's list must match.
assert set(MUTANTS) == _ENGINE_MUTANTS | _LEASE_MUTANTS | _FENCE_MUTANTS | _WORKER_MUTANTS

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z: simulated time 0, a top of the hour
HOUR_MS = 3_600_000


class SimConfigError(ValueError):
    """An option out of range or unknown; the message names it."""


@dataclass(frozen=True)
class SimConfig:
    """One run's options. The defaults are the issue's: 3 nodes, 6 workers, 2,000 jobs, 2 hours,
    no faults. Durations in ms unless named otherwise."""

    seed: int = 1
    nodes: int = 3
    workers: int = 6
    jobs: int = 2_000
    hours: float = 2.0
    faults: frozenset[str] = frozenset()
    mutant: str | None = None
    #: shards per cluster (P); 0 means two per node
    shards: int = 0
    #: after ``hours``: no new faults or client operations, the cluster settles, then checks
    drain_ms: int = 10 * 60_000
    #: share of all jobs due in the same second (the top of the first hour) with burst
    burst_share: float = 0.25
    #: share of all jobs updated once over the run (at a random moment)
    update_share: float = 0.06
    #: runs one worker takes from one shard at once
    slots_per_shard: int = 2
    #: how often a worker heartbeats the owner of a shard it holds runs of
    heartbeat_ms: int = 8_000
    #: how often it heartbeats a shard it holds nothing of (within the worker lease: it only
    #: has to stay known there to be handed runs)
    idle_heartbeat_ms: int = 20_000
    #: a worker kills its tasks of a shard once this much of the lease is gone unconfirmed
    worker_fence_margin_ms: int = 3_000
    #: stopping a task (a timeout, the node's kill) takes time, as the real worker's SIGTERM,
    #: kill grace and SIGKILL do: most tasks end at once, ``slow_stop_share`` of them ignore
    #: the SIGTERM and end at the kill grace, and ``stuck_stop_share`` take far longer (a
    #: container whose removal is retried); the report goes out only once the task ended
    kill_grace_ms: int = 5_000
    slow_stop_share: float = 0.2
    stuck_stop_share: float = 0.05
    stuck_stop_max_ms: int = 60_000
    #: the node's timer resolution: engine wakeups are rounded up to this
    tick_ms: int = 10
    #: lease wakeups (renewals, resends, polls) are rounded up to this, so they coincide
    lease_tick_ms: int = 500
    #: chance that a message is lost (a worker connection resets; others are resent)
    loss: float = 0.001
    #: every node's wall clock is stepped back to true time this often (NTP), plus its error
    ntp_every_ms: int = 10 * 60_000
    #: slack on top of the clock bounds for the "never early" check (latencies, ms rounding)
    early_slack_ms: int = 100
    #: an owner stores a columnar snapshot of a shard every this many durable batches
    snapshot_every: int = 1_500
    #: sample the number of runs waiting (for the report's plot)
    samples: bool = True
    #: trace lines to keep for excerpts; strings that name what a re-run should keep
    trace_keep: int = 400
    trace_focus: frozenset[str] = field(default_factory=frozenset)
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(
            worker_lease_ms=30_000,
            reattach_grace_ms=40_000,
            timeout_grace_ms=5_000,
            misfire_ms=60_000,
            ready_bound=200,
            max_clock_jump_ms=2_000,
            # as a node fires: its crashes, partitions and bursts land inside the window too
            fire_ahead_ms=NODE_FIRE_AHEAD_MS,
        )
    )
    lease: LeaseConfig = field(
        default_factory=lambda: LeaseConfig(
            ttl_ms=10_000,
            renew_every_ms=3_000,
            retry_ms=1_000,
            poll_ms=30_000,
            stagger_ms=1_000,
            max_drift_ppm=1_000,
            margin_ms=500,
            clock_bound_ms=1_000,
        )
    )

    def __post_init__(self) -> None:
        unknown = self.faults - set(FAULTS)
        if unknown:
            raise SimConfigError(
                f"unknown faults {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}"
            )
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise SimConfigError(f"unknown mutant {self.mutant!r}; known: {', '.join(MUTANTS)}")
        for name, lo in (("nodes", 1), ("workers", 1), ("jobs", 1), ("slots_per_shard", 1)):
            if getattr(self, name) < lo:
                raise SimConfigError(f"--{name} must be at least {lo}")
        if not 0 < self.hours <= 24 * 7:
            raise SimConfigError("--hours must be in (0, 168]")
        if not 0 <= self.burst_share <= 1 or not 0 <= self.loss < 0.5:
            raise SimConfigError("burst share must be in [0, 1] and loss in [0, 0.5)")
        if not 0 <= self.update_share <= 1:
            raise SimConfigError("update share must be in [0, 1]")
        if not (
            0 <= self.slow_stop_share
            and 0 <= self.stuck_stop_share
            and self.slow_stop_share + self.stuck_stop_share <= 1
            and 0 <= self.kill_grace_ms <= self.stuck_stop_max_ms
        ):
            raise SimConfigError(
                "stop shares must be >= 0 with a sum of at most 1, and 0 <= kill grace <= "
                "the longest stuck stop"
            )

    @property
    def shard_count(self) -> int:
        return self.shards or 2 * self.nodes

    @property
    def end_ms(self) -> int:
        """When faults and client operations stop (simulated ms since T0)."""
        return int(self.hours * HOUR_MS)

    @property
    def stop_ms(self) -> int:
        """When the simulation stops and the checks run."""
        return self.end_ms + self.drain_ms

    @property
    def skew_bound_ms(self) -> int:
        """How early a run may start, at most: a node owns shards only with a wall clock within
        the lease's clock bound of the cluster's (checked at every renewal), and its engine
        follows a forward step of at most ``max_clock_jump_ms`` before the next check."""
        return self.lease.clock_bound_ms + self.engine.max_clock_jump_ms + self.early_slack_ms

    def _mutants(self, owned: frozenset[str]) -> frozenset[str]:
        return frozenset() if self.mutant is None else frozenset({self.mutant}) & owned

    def engine_config(self) -> EngineConfig:
        return replace(self.engine, mutants=self._mutants(_ENGINE_MUTANTS))

    def lease_config(self) -> LeaseConfig:
        return replace(self.lease, mutants=self._mutants(_LEASE_MUTANTS))

    def fence_mutants(self) -> frozenset[str]:
        return self._mutants(_FENCE_MUTANTS)

    def worker_mutants(self) -> frozenset[str]:
        return self._mutants(_WORKER_MUTANTS)


def parse_faults(text: str) -> frozenset[str]:
    """``crash,pause`` -> the set; ``all`` is every fault; empty is none."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if "all" in names:
        return frozenset(FAULTS)
    unknown = names - set(FAULTS)
    if unknown:
        raise SimConfigError(
            f"unknown faults {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}, all"
        )
    return frozenset(names)
