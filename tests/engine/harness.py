"""A tiny in-memory driver for the shard engine: a fake disk that acknowledges batches when told,
crashes that drop what was not acknowledged, and a log of everything the engine asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.directory import MemoryDirectory
from engine.effects import (
    ClockJump,
    Command,
    CreateJob,
    Dispatch,
    Durable,
    Effect,
    Kill,
    Persist,
    Register,
    Reply,
    RunTicket,
    Trigger,
)
from engine.jobs import validate_job
from engine.records import Record, expand
from engine.shard import EngineConfig, ShardEngine
from engine.snapshot import Snapshot

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


@dataclass
class Node:
    """One shard on one fake node. ``auto_durable`` acknowledges every batch at once."""

    # Leases longer than any test, unless a test is about leases: workers here do not heartbeat.
    config: EngineConfig = field(
        default_factory=lambda: EngineConfig(worker_lease_ms=10**9, reattach_grace_ms=10**9)
    )
    auto_durable: bool = True
    wall: int = T0
    mono: int = 1_000_000
    epoch: int = 1
    durable_records: list[Record] = field(default_factory=list)
    unacked: list[Persist] = field(default_factory=list)
    replies: dict[int, Reply] = field(default_factory=dict)
    dispatches: list[tuple[int, Dispatch]] = field(default_factory=list)  # (wall, dispatch)
    kills: list[Kill] = field(default_factory=list)
    triggers: list[Trigger] = field(default_factory=list)
    registrations: list[Register] = field(default_factory=list)
    jumps: list[ClockJump] = field(default_factory=list)
    next_request: int = 0
    #: the newest columnar snapshot and how many durable records it reflects
    snapshot: tuple[Snapshot, int] | None = None
    #: makes the store's view (a MemoryDirectory, or a test's stand-in with its ``absorb``)
    make_directory: Callable[[], Any] = MemoryDirectory

    def __post_init__(self) -> None:
        # The store's view: only what was acknowledged durable, as a real node's directory.
        self.directory = self.make_directory()
        self.engine = ShardEngine(
            epoch=self.epoch,
            wall_ms=self.wall,
            mono_ms=self.mono,
            config=self.config,
            directory=self.directory,
        )

    # ------------------------------------------------------------------ driving

    def absorb(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Persist):
                assert effect.epoch == self.epoch
                self.unacked.append(effect)
            elif isinstance(effect, Reply):
                self.replies[effect.request_id] = effect
            elif isinstance(effect, Dispatch):
                self.dispatches.append((self.engine.now_ms, effect))
            elif isinstance(effect, Kill):
                self.kills.append(effect)
            elif isinstance(effect, Trigger):
                self.triggers.append(effect)
            elif isinstance(effect, Register):
                self.registrations.append(effect)
            elif isinstance(effect, ClockJump):
                self.jumps.append(effect)
        if self.auto_durable:
            self.flush()

    def flush(self, upto: int | None = None) -> None:
        """Acknowledge the in-flight batches (all, or those up to batch ``upto``)."""
        while self.unacked and (upto is None or self.unacked[0].batch_id <= upto):
            batch = self.unacked.pop(0)
            self.durable_records.extend(batch.records)
            self.directory.absorb(batch.records)
            self.absorb(self.engine.handle(Durable(batch.batch_id), self.wall, self.mono))

    def do(self, command: Command) -> Reply | None:
        """Send a command; return its reply if one came out (the reply may wait for a flush)."""
        self.absorb(self.engine.handle(command, self.wall, self.mono))
        request_id = getattr(command, "request_id", None)
        return self.replies.get(request_id) if request_id is not None else None

    def advance(self, ms: int, *, wall_extra: int = 0) -> None:
        """Let ``ms`` pass on both clocks (the wall clock ``wall_extra`` further)."""
        self.wall += ms + wall_extra
        self.mono += ms
        self.absorb(self.engine.tick(self.wall, self.mono))

    def run_until(self, ms: int, step: int = 100) -> None:
        end = self.mono + ms
        while self.mono < end:
            self.advance(min(step, end - self.mono))

    def deliver_registrations(self, to: Node | None = None) -> None:
        """Deliver outbox registrations to the upstream's shard (this one unless ``to``)."""
        from engine.effects import OutboxDelivered, RegisterDependent

        target = to or self
        while self.registrations:
            reg = self.registrations.pop(0)
            target.do(
                RegisterDependent(target.request(), reg.upstream, reg.downstream, reg.on, reg.seq)
            )
            self.do(OutboxDelivered(reg.seq))

    def take_snapshot(self) -> None:
        """Store a columnar snapshot, as a store does once the batch it reflects is durable."""
        snap = self.engine.export_snapshot()
        assert not self.unacked or self.unacked[-1].batch_id <= snap.meta["batch"]
        # It reflects the batches handed out so far: it is stored once they are durable, and
        # covers exactly their records (acknowledging them may fire or claim: later batches).
        upto = snap.meta["batch"]
        covered = len(self.durable_records) + sum(
            len(b.records) for b in self.unacked if b.batch_id <= upto
        )
        self.flush(upto=upto)
        self.snapshot = (snap, covered)

    def crash_and_recover(self, *, downtime_ms: int = 0, via_snapshot: bool = False) -> None:
        """Lose everything not acknowledged, then reopen the shard at the next epoch: from the
        durable records, or (``via_snapshot``) from the last snapshot and the records after it."""
        self.unacked.clear()
        self.wall += downtime_ms
        self.mono += downtime_ms + 1
        self.epoch += 1
        self.directory = MemoryDirectory(self.durable_records)
        snap, tail = None, 0
        if via_snapshot and self.snapshot is not None:
            snap, tail = self.snapshot
        self.engine, effects = ShardEngine.recover(
            list(self.durable_records[tail:]),
            epoch=self.epoch,
            wall_ms=self.wall,
            mono_ms=self.mono,
            config=self.config,
            directory=self.directory,
            snapshot=snap,
        )
        self.absorb(effects)

    # ------------------------------------------------------------------ helpers

    def request(self) -> int:
        self.next_request += 1
        return self.next_request

    def create(self, **spec: Any) -> Reply | None:
        spec.setdefault("task", {"command": ["true"]})
        return self.do(CreateJob(self.request(), validate_job(spec, now_ms=self.wall)))

    def tickets(self, worker: str | None = None) -> list[RunTicket]:
        return [d.run for _t, d in self.dispatches if worker is None or d.worker_id == worker]

    def runs(self) -> dict[tuple[int, int], Record]:
        """The last durable record of each run."""
        out: dict[tuple[int, int], Record] = {}
        for r in self.canonical_records():
            if r["t"] == "run":
                out[(r["key"], r["at"])] = r
        return out

    def canonical_records(self) -> list[Record]:
        """The durable records with each ``fire`` record expanded into its run and pos records."""
        return [c for r in self.durable_records for c in expand(r)]

    def skips(self) -> list[Record]:
        return [r for r in self.durable_records if r["t"] == "skip"]

    def final_states(self) -> list[str]:
        return sorted(r["state"] for r in self.runs().values())
