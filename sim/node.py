"""A simulated node: the thin driver that hosts shard engines as their leases allow.

Owns the plumbing the real node will have around the same pure parts: per shard a
:class:`engine.lease.ShardLease` (asks the coordinator, says when to start and stop acting)
and, while acting, a :class:`engine.shard.ShardEngine` recovered from the shard's store. It
feeds them commands (clients, workers, other nodes, the store's acknowledgements) and the
time of its own clocks, and carries their effects out: writes to the store, dispatches and
kills to workers, replies, cross-shard deliveries, coordinator requests.

Before every engine call it asks the lease whether it may act (the self-fence). A node can
crash (its unacknowledged writes are resolved by the store, everything in memory is lost,
it restarts as a new incarnation) or pause: frozen right after deciding a step, it carries
that step out when it resumes, as if nothing happened (the zombie the epoch fence is for),
then handles what queued up meanwhile. Must never decide anything the engine or the lease
decides; every decision here is plumbing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import simpy

from engine.effects import (
    CancelJob,
    ClockJump,
    Command,
    CreateJob,
    Dispatch,
    Durable,
    Effect,
    Heartbeat,
    Kill,
    OutboxDelivered,
    PauseJob,
    Persist,
    Refused,
    Register,
    RegisterDependent,
    Reply,
    ReportFinished,
    ResumeJob,
    Sync,
    Trigger,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import EngineError
from engine.lease import (
    LeaseEffect,
    Response,
    ShardLease,
    StartActing,
    StopActing,
    preference,
)
from engine.records import Record
from engine.routing import shard_of
from engine.runs import token_epoch
from engine.shard import ShardEngine
from engine.snapshot import Snapshot
from sim.clock import NodeClock

if TYPE_CHECKING:
    from sim.client import Client
    from sim.worker import SimWorker
    from sim.world import World

#: Resend an undelivered cross-shard trigger or registration this often.
OUTBOX_RETRY_MS = 5_000


@dataclass(slots=True)
class _Hosted:
    """One shard on this node: its lease, and its engine while acting."""

    shard: int
    lease: ShardLease
    engine: ShardEngine | None = None
    epoch: int = 0
    opening: bool = False
    # engine request id -> where the reply goes
    requests: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    outbox: dict[int, Trigger | Register] = field(default_factory=dict)
    lease_next: int | None = None  # when the lease, and the engine, want a tick (mono)
    engine_next: int | None = None
    lease_dirty: bool = True  # the lease was called since lease_next was read
    since_snapshot: int = 0  # durable acknowledgements since the last snapshot
    snapshot: Snapshot | None = None  # exported, waiting for its batch to be durable


def _with_request_id(command: Command, request_id: int) -> Command:
    """A client's command under this node's request id (replies are routed by it)."""
    if isinstance(command, CreateJob):
        return CreateJob(request_id, command.spec)
    if isinstance(command, UpdateJob):
        return UpdateJob(request_id, command.spec)
    if isinstance(command, CancelJob):
        return CancelJob(request_id, command.job_id, command.stop_running)
    if isinstance(command, PauseJob):
        return PauseJob(request_id, command.job_id)
    if isinstance(command, ResumeJob):
        return ResumeJob(request_id, command.job_id)
    raise TypeError(f"not a client command: {type(command).__name__}")


class SimNode:
    def __init__(self, world: World, index: int, clock: NodeClock) -> None:
        self.w = world
        self.k = world.kernel
        self.index = index
        self.name = f"n{index}"
        self.clock = clock
        self.base_wall_error = clock.wall_error(0)
        self.base_wall_ppm = clock.wall_ppm
        self.base_mono_ppm = clock.mono_ppm
        self.skewed_until = 0  # a wall skew fault owns the wall clock until then (NTP leaves it)
        self.alive = False
        self.incarnation = 0
        self.frozen = False
        self.hosted: dict[int, _Hosted] = {}
        self._queue: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._held: tuple[_Hosted | None, list[Effect], int] | None = None
        self._pause_ms: int | None = None
        self._crash_down: int | None = None
        self._wake_at: int | None = None
        self._wake_event: simpy.Event | None = None
        self._rid = 0
        self._worker_inc: dict[str, int] = {}
        self._to_coord: list[LeaseEffect] = []  # the packet to the coordinator of this instant
        self._to_coord_at = -1
        names = [f"n{i}" for i in range(world.config.nodes)]
        self._rank = [preference(s, names).index(self.name) for s in range(world.shards)]

    # ================================================================ life cycle

    def start(self) -> None:
        self.alive, self.frozen = True, False
        self.incarnation += 1
        self._queue, self._held, self._wake_at, self._to_coord = [], None, None, []
        self._wake_event = None
        self._to_coord_at = -1
        self._pause_ms = self._crash_down = None
        self.k.trace("start", self.name, self.incarnation)
        mono = self._mono()
        config = self.w.lease_config
        for shard in range(self.w.shards):
            lease = ShardLease(node=self.name, shard=shard, rank=self._rank[shard], config=config)
            hs = self.hosted[shard] = _Hosted(shard, lease)
            self._lease_effects(hs, lease.want_ownership(mono))
            self._refresh(hs)
        self._schedule_wake()

    def crash(self, downtime_ms: int) -> None:
        """The machine dies now: writes not durable are resolved by the stores, the rest of
        the node's state is gone; it starts again after ``downtime_ms``."""
        if not self.alive:
            return
        self.k.trace("crash", self.name, self.incarnation, downtime_ms)
        for store in self.w.stores:
            store.crash(self, self.incarnation)
        self.alive = False
        self.frozen = False
        self._queue, self._held, self.hosted = [], None, {}
        self._pause_ms = self._crash_down = None
        self.k.later(downtime_ms, self.start)

    def arm_crash(self, downtime_ms: int) -> None:
        """Crash right after the next step that both writes and dispatches or answers (runs
        on their way while their claims are not durable yet, the crash windows of DESIGN.md's
        table; or a client or worker told of something while the step's batch is in flight),
        or in 5 s."""
        if self.alive:
            self._crash_down = downtime_ms
            self.k.later(5_000, self.receive, self.incarnation, self._crash_if_armed)

    def _crash_if_armed(self) -> None:
        if self._crash_down is not None:
            self.crash(self._crash_down)

    def arm_pause(self, duration_ms: int) -> None:
        """Freeze right after deciding the next step that writes or dispatches (or in 2 s,
        idle), for ``duration_ms``; then carry that step out as if nothing happened."""
        if self.alive and not self.frozen:
            self._pause_ms = duration_ms
            self.k.later(2_000, self.receive, self.incarnation, self._pause_if_armed)

    def _pause_if_armed(self) -> None:
        if self._pause_ms is not None:
            self._freeze(None, [])

    def _freeze(self, hs: _Hosted | None, effects: list[Effect]) -> None:
        duration = self._pause_ms or 0
        self._pause_ms = None
        self.frozen = True
        self._held = (hs, effects, self.k.now)
        self.k.trace("pause", self.name, duration, len(effects))
        self.k.later(duration, self._resume, self.incarnation)

    def _resume(self, incarnation: int) -> None:
        if incarnation != self.incarnation or not self.alive or not self.frozen:
            return
        self.frozen = False
        self.k.trace("resume", self.name, len(self._queue))
        held, self._held = self._held, None
        if held is not None and held[0] is not None:
            hs, effects, decided_at = held
            assert hs is not None
            self._deliver(hs, effects, decided_at)  # decided before the pause: stale now
        queue, self._queue = self._queue, []
        for i, (fn, args) in enumerate(queue):
            if not self.alive:
                return
            if self.frozen:
                self._queue = queue[i:] + self._queue
                return
            fn(*args)
        self._schedule_wake()

    # ================================================================ inbound

    def receive(self, incarnation: int | None, fn: Callable[..., Any], *args: Any) -> None:
        """Every message and timer enters here: dropped when addressed to another incarnation
        (its connections died with it) or a dead machine, queued while frozen."""
        if not self.alive or (incarnation is not None and incarnation != self.incarnation):
            return
        if self.frozen:
            self._queue.append((fn, args))
            return
        fn(*args)

    def _mono(self) -> int:
        return self.clock.mono(self.k.now)

    def _wall(self) -> int:
        return self.clock.wall(self.k.now)

    # ---------------------------------------------------------------- leases

    def on_lease_responses(self, responses: tuple[Response, ...]) -> None:
        for response in responses:
            self.on_lease_response(response)
        # A renewal's answer moves its resend time (the wakeup set when it left) later: move
        # the wakeup rather than wake for nothing (one wakeup per renewal instead of two).
        self._schedule_wake(later=True)

    def on_lease_response(self, response: Response) -> None:
        hs = self.hosted.get(response.shard)
        if hs is None:
            return
        effects = hs.lease.on_response(response, self._mono(), self._wall())
        self._lease_effects(hs, effects)
        self._touch(hs, engine=bool(effects))

    def on_watch(self, view: Response) -> None:
        self.receive(None, self.on_lease_response, view)

    def _lease_effects(self, hs: _Hosted, effects: list[LeaseEffect]) -> None:
        hs.lease_dirty = True  # every call into the lease comes through here
        for effect in effects:
            if isinstance(effect, StartActing):
                self._open(hs, effect.epoch)
            elif isinstance(effect, StopActing):
                self._stop(hs, effect.reason)
            elif not self.frozen:
                self._to_coordinator(effect)

    def _to_coordinator(self, request: LeaseEffect) -> None:
        """Requests of one instant go out in one packet: it leaves with the first of them and
        takes the others of the same instant along (it arrives at least 1 ms later, so it is
        the same as sending them together at the end of the instant, without an event)."""
        now = self.k.now
        if self._to_coord_at == now:
            self._to_coord.append(request)
            return
        self._to_coord_at, self._to_coord = now, [request]
        coord = self.w.coord
        self.w.net.send(self.name, "coord", coord.requests, self, self.incarnation, self._to_coord)

    def _open(self, hs: _Hosted, epoch: int) -> None:
        hs.opening, hs.epoch, hs.engine = True, epoch, None
        self.k.trace("opening", self.name, f"s{hs.shard}", f"e{epoch}")
        incarnation, shard = self.incarnation, hs.shard

        def reader(records: list[Record] | None, snap: Snapshot | None) -> None:
            self.receive(incarnation, self._opened, shard, epoch, records, snap)

        self.w.stores[hs.shard].open(epoch, reader)

    def _opened(
        self, shard: int, epoch: int, records: list[Record] | None, snap: Snapshot | None
    ) -> None:
        hs = self.hosted.get(shard)
        if hs is None or not hs.opening or hs.epoch != epoch:
            return
        hs.opening = False
        mono = self._mono()
        if records is None:
            self._lease_effects(hs, hs.lease.store_refused(mono))
            self._touch(hs)
            return
        self._lease_effects(hs, hs.lease.tick(mono))
        if not hs.lease.may_act(mono):
            self._touch(hs)
            return
        try:
            engine, effects = ShardEngine.recover(
                records,
                epoch=epoch,
                wall_ms=self._wall(),
                mono_ms=mono,
                config=self.w.engine_config,
                directory=self.w.stores[shard].directory,
                snapshot=snap,
            )
        except EngineError as error:
            self.k.trace("recover-refused", self.name, f"s{shard}", f"e{epoch}", error.code)
            self._lease_effects(hs, hs.lease.store_refused(mono))
            self._touch(hs)
            return
        hs.engine = engine
        self.k.trace("acting", self.name, f"s{shard}", f"e{epoch}", len(records))
        self._perform(hs, effects)
        self._touch(hs)

    def _stop(self, hs: _Hosted, reason: str) -> None:
        if hs.engine is not None or hs.opening:
            self.k.trace("stop", self.name, f"s{hs.shard}", f"e{hs.epoch}", reason)
        hs.engine, hs.opening, hs.snapshot, hs.since_snapshot = None, False, None, 0
        hs.requests.clear()
        hs.outbox.clear()

    def on_store_refused(self, shard: int) -> None:
        hs = self.hosted.get(shard)
        if hs is not None:
            self._lease_effects(hs, hs.lease.store_refused(self._mono()))
            self._touch(hs)

    # ---------------------------------------------------------------- the engine

    def _acting(self, hs: _Hosted | None) -> ShardEngine | None:
        """The engine, if the lease lets this node act for the shard right now."""
        if hs is None or hs.engine is None:
            return None
        mono = self._mono()
        if hs.lease.may_act(mono):
            return hs.engine
        # Fenced (the deadline passed before the wakeup that would have noticed): let the
        # lease say so now, which stops the engine.
        self._lease_effects(hs, hs.lease.tick(mono))
        return None

    def _call(
        self, hs: _Hosted, command: Command | tuple[Command, ...] | None
    ) -> list[Effect] | None:
        """Time, one command, or several as one batch, if the lease lets this node act."""
        engine = self._acting(hs)
        if engine is None:
            return None
        return self._drive(hs, engine, command)

    def _drive(
        self, hs: _Hosted, engine: ShardEngine, command: Command | tuple[Command, ...] | None
    ) -> list[Effect]:
        """:meth:`_call` once :meth:`_acting` said yes, at this same instant."""
        now = self.k.now
        wall, mono = self.clock.wall(now), self.clock.mono(now)
        if command is None:
            effects = engine.tick(wall, mono)
        elif type(command) is tuple:
            effects = engine.handle_many(command, wall, mono)
        else:
            effects = engine.handle(command, wall, mono)  # type: ignore[arg-type]
        if effects:
            self._perform(hs, effects)
        return effects

    def on_durable(self, shard: int, epoch: int, batch_id: int) -> None:
        hs = self.hosted.get(shard)
        if hs is not None and hs.engine is not None and hs.epoch == epoch:
            self._touch(hs, engine=bool(self._call(hs, Durable(batch_id))))
            self._snapshot(hs, batch_id)

    def _snapshot(self, hs: _Hosted, durable: int) -> None:
        """Every ``snapshot_every`` acknowledgements, export the engine's columns; store them
        once the batch they reflect is durable (as the real node does)."""
        engine = self._acting(hs)
        if engine is None:
            return
        hs.since_snapshot += 1
        if hs.snapshot is None and hs.since_snapshot >= self.w.config.snapshot_every:
            hs.snapshot, hs.since_snapshot = engine.export_snapshot(), 0
        snap = hs.snapshot
        if snap is not None and snap.meta["batch"] <= durable:
            hs.snapshot = None
            self.w.observer.acted(self, hs.shard, hs.epoch, self.k.now, "snapshot")
            self.w.stores[hs.shard].write_snapshot(self, hs.epoch, snap.meta["batch"], snap)

    # ---------------------------------------------------------------- clients

    def on_client(self, client: Client, creq: int, shard: int, command: Command) -> None:
        hs = self.hosted.get(shard)
        if self._acting(hs) is None or hs is None:
            self.w.net.send(self.name, "client", client.on_not_owner, creq)
            return
        self._rid += 1
        hs.requests[self._rid] = ("client", client, creq)
        self._touch(hs, engine=bool(self._call(hs, _with_request_id(command, self._rid))))

    # ---------------------------------------------------------------- workers

    def on_worker(
        self,
        worker: SimWorker,
        worker_incarnation: int,
        parts: tuple[tuple[int, tuple[Command, ...], int], ...],
    ) -> None:
        """A packet from a worker: per shard, its commands in order and a sequence number.
        Answered with one packet: per shard, an acknowledgement (the epoch; ``seq`` when a
        hello or heartbeat was taken, 0 otherwise), or "not owner". The final reports of a
        part are acknowledged apart, once the engine answers the :class:`Sync` that follows
        them, that is once they are durable: the worker forgets a report it is told was
        taken, so that answer must survive the next crash (as the real node's)."""
        self._worker_inc[worker.name] = worker_incarnation
        answers: list[tuple[int, int, int, tuple[tuple[str, int], ...]]] = []
        moved = False
        for shard, commands, seq in parts:
            hs = self.hosted.get(shard)
            engine = self._acting(hs)
            if engine is None or hs is None:
                answers.append((shard, -1, 0, ()))
                continue
            reported = tuple((c.run_id, c.token) for c in commands if type(c) is ReportFinished)
            if reported:
                self._rid += 1
                hs.requests[self._rid] = ("worker", worker, worker_incarnation, reported)
                commands = (*commands, Sync(self._rid))
            # One engine call and one batch for the part, as the real node groups what
            # arrives together (``handle_many``).
            effects = self._drive(hs, engine, commands)
            refused = bool(effects) and any(
                type(e) is Refused and e.worker_id == worker.name for e in effects
            )
            greeted = any(type(c) in (WorkerHello, Heartbeat) for c in commands)
            taken = seq if greeted and not refused else 0
            if taken:
                self.w.observer.contact(shard, worker.name)
                answers.append((shard, hs.epoch, taken, ()))
            moved |= self._refresh(hs, engine=bool(effects))
        if answers:
            self.w.net.send(
                self.name,
                worker.name,
                worker.receive,
                worker_incarnation,
                worker.on_answers,
                tuple(answers),
                on_reset=self._reset_of(worker, worker_incarnation),
            )
        if moved or self._wake_at is None:
            self._schedule_wake()

    # ---------------------------------------------------------------- other nodes

    def on_outbox_message(
        self,
        source: SimNode,
        src_inc: int,
        src_shard: int,
        src_epoch: int,
        effect: Trigger | Register,
    ) -> None:
        if isinstance(effect, Trigger):
            shard = shard_of(effect.job_id, self.w.shards)
        else:
            shard = shard_of(effect.upstream, self.w.shards)
        hs = self.hosted.get(shard)
        if self._acting(hs) is None or hs is None:
            return  # the source resends
        self._rid += 1
        hs.requests[self._rid] = ("node", source, src_inc, src_shard, src_epoch, effect.seq)
        command: Command
        if isinstance(effect, Trigger):
            command = TriggerJob(self._rid, effect.job_id, effect.source_run_id, effect.depth)
        else:
            command = RegisterDependent(
                self._rid, effect.upstream, effect.downstream, effect.on, effect.seq
            )
        self._touch(hs, engine=bool(self._call(hs, command)))

    def on_outbox_done(self, shard: int, epoch: int, seq: int) -> None:
        hs = self.hosted.get(shard)
        if hs is not None and hs.epoch == epoch and hs.outbox.pop(seq, None) is not None:
            self._touch(hs, engine=bool(self._call(hs, OutboxDelivered(seq))))

    def _send_outbox(self, hs: _Hosted, effect: Trigger | Register) -> None:
        job = effect.job_id if isinstance(effect, Trigger) else effect.upstream
        owner = self.w.coord.owner_of(shard_of(job, self.w.shards))
        if owner is not None:
            target = self.w.node_by_name[owner]
            self.w.net.send(
                self.name,
                owner,
                target.receive,
                None,
                target.on_outbox_message,
                self,
                self.incarnation,
                hs.shard,
                hs.epoch,
                effect,
            )
        self.k.later(
            OUTBOX_RETRY_MS,
            self.receive,
            self.incarnation,
            self._outbox_retry,
            hs.shard,
            hs.epoch,
            effect.seq,
        )

    def _outbox_retry(self, shard: int, epoch: int, seq: int) -> None:
        hs = self.hosted.get(shard)
        if hs is not None and hs.epoch == epoch and hs.engine is not None:
            effect = hs.outbox.get(seq)
            if effect is not None and self._acting(hs) is not None:
                self._send_outbox(hs, effect)

    # ================================================================ outbound

    def _perform(self, hs: _Hosted, effects: list[Effect]) -> None:
        if self._pause_ms is not None and any(type(e) in (Persist, Dispatch) for e in effects):
            self._freeze(hs, effects)  # decided, not done: the zombie's pipeline
            return
        self._deliver(hs, effects, self.k.now)

    def _deliver(self, hs: _Hosted, effects: list[Effect], decided_at: int) -> None:
        w, obs = self.w, self.w.observer
        wrote = dispatched = answered = False
        for e in effects:
            kind = type(e)
            if kind is Persist:
                assert isinstance(e, Persist)
                obs.acted(self, hs.shard, e.epoch, decided_at, "write")
                w.stores[hs.shard].submit(self, self.incarnation, e)
                wrote = True
            elif kind is Dispatch:
                assert isinstance(e, Dispatch)
                obs.acted(self, hs.shard, token_epoch(e.run.token), decided_at, "dispatch")
                dispatched = True
                self.k.trace("dispatch", self.name, e.worker_id, e.run.run_id, e.run.token)
                self._to_worker(e.worker_id, "on_dispatch", hs.shard, e.run, e.seq)
            elif kind is Kill:
                assert isinstance(e, Kill)
                self._to_worker(e.worker_id, "on_kill", e.run_id, e.token)
            elif kind is Reply:
                assert isinstance(e, Reply)
                answered = True
                self._reply(hs, e)
            elif kind is Refused:
                assert isinstance(e, Refused)
                self._to_worker(e.worker_id, "on_refused", hs.shard)
            elif kind is Trigger or kind is Register:
                assert isinstance(e, Trigger | Register)
                hs.outbox[e.seq] = e
                self._send_outbox(hs, e)
            elif kind is ClockJump:
                assert isinstance(e, ClockJump)
                self.k.trace("clock-jump", self.name, f"s{hs.shard}", e.wall_ms - e.engine_ms)
        if wrote and (dispatched or answered) and self._crash_down is not None:
            self.crash(self._crash_down)  # with this step's writes in flight, and what it sent

    def _to_worker(self, worker_id: str, handler: str, *args: Any) -> None:
        """Send ``worker.<handler>(*args)`` on the worker's connection (its incarnation the
        one that last spoke to this node; a lost message breaks the connection)."""
        worker = self.w.worker_by_name[worker_id]
        incarnation = self._worker_inc.get(worker_id, 0)
        self.w.net.send(
            self.name,
            worker.name,
            worker.receive,
            incarnation,
            getattr(worker, handler),
            *args,
            on_reset=self._reset_of(worker, incarnation),
        )

    def _reset_of(self, worker: SimWorker, incarnation: int) -> Callable[[], None]:
        """What a broken connection to ``worker`` tells it."""
        return functools.partial(worker.receive, incarnation, worker.on_node_reset, self.name)

    def _reply(self, hs: _Hosted, reply: Reply) -> None:
        route = hs.requests.pop(reply.request_id, None)
        if route is None:
            return
        code = None if reply.error is None else reply.error.code
        if route[0] == "client":
            _kind, client, creq = route
            self.w.net.send(self.name, "client", client.on_reply, creq, reply.result, code)
        elif route[0] == "worker":  # a part's final reports, durable now (see on_worker)
            _kind, worker, incarnation, reported = route
            self.w.net.send(
                self.name,
                worker.name,
                worker.receive,
                incarnation,
                worker.on_answers,
                ((hs.shard, hs.epoch, 0, reported),),
                on_reset=self._reset_of(worker, incarnation),
            )
        else:
            _kind, source, src_inc, src_shard, src_epoch, seq = route
            self.w.net.send(
                self.name,
                source.name,
                source.receive,
                src_inc,
                source.on_outbox_done,
                src_shard,
                src_epoch,
                seq,
            )

    # ================================================================ timers

    def _refresh(self, hs: _Hosted, *, engine: bool = True) -> bool:
        """Cache when the lease and the engine next want a tick; True when either moved
        earlier (a wakeup may have to move). ``engine=False`` after an event the engine did
        not see, or a command that had no effect: anything that arms an earlier timer (a new
        run, a claim, a retry, a fire time) persists a record, so the cached time can only be
        early, never late. The lease is asked only after something called it."""
        earlier = False
        if hs.lease_dirty:
            hs.lease_dirty = False
            old, hs.lease_next = hs.lease_next, hs.lease.next_wakeup_mono()
            earlier = hs.lease_next is not None and (old is None or hs.lease_next < old)
        if engine or hs.engine is None:
            old = hs.engine_next
            hs.engine_next = hs.engine.next_wakeup_mono() if hs.engine is not None else None
            if hs.engine_next is not None and (old is None or hs.engine_next < old):
                earlier = True
        return earlier

    def _touch(self, hs: _Hosted, *, engine: bool = True) -> None:
        # A wakeup already set stays right unless a time moved earlier: one too early only
        # finds nothing due and sets the next.
        if self._refresh(hs, engine=engine) or self._wake_at is None:
            self._schedule_wake()

    def _schedule_wake(self, *, later: bool = False) -> None:
        """Set the wakeup to the earliest time a lease or an engine wants a tick, if that is
        earlier than the wakeup already set (or, ``later``, different from it)."""
        if not self.alive or self.frozen:
            return
        # Engine timers at the tick resolution; lease timers (renewals, resends, polls) on a
        # coarser grid, so that a node's shards renew together, in one packet. Safety does
        # not depend on it: every action asks the lease at that moment (``_acting``).
        tick, grid = self.w.config.tick_ms, self.w.config.lease_tick_ms
        soonest: int | None = None
        for hs in self.hosted.values():
            if hs.engine_next is not None:
                t = -(-hs.engine_next // tick) * tick
                if soonest is None or t < soonest:
                    soonest = t
            if hs.lease_next is not None:
                t = -(-hs.lease_next // grid) * grid
                if soonest is None or t < soonest:
                    soonest = t
        if soonest is None:
            return
        mono = soonest
        now = self.k.now
        at = max(self.clock.true_at_mono(mono), now + 1)
        if self._wake_at is not None and now < self._wake_at:
            if self._wake_at == at or (self._wake_at < at and not later):
                return
        if self._wake_event is not None:
            self.k.cancel(self._wake_event)
        self._wake_at = at
        self._wake_event = self.k.later(at - now, self.receive, self.incarnation, self._on_wake, at)

    def _on_wake(self, at: int) -> None:
        if self._wake_at != at:
            return  # superseded by an earlier wakeup
        self._wake_at = None
        mono = self._mono()
        for hs in list(self.hosted.values()):
            lease_due = hs.lease_next is not None and hs.lease_next <= mono
            engine_due = hs.engine_next is not None and hs.engine_next <= mono
            if lease_due:
                self._lease_effects(hs, hs.lease.tick(mono))
            if engine_due and hs.engine is not None:
                self._call(hs, None)
            if lease_due or engine_due:
                self._refresh(hs, engine=engine_due or hs.engine is None)
            if self.frozen or not self.alive:
                return
        self._schedule_wake()
