"""The node: every shard of a data directory on the embedded default, served over TCP with Trio.

Owns the plumbing between sockets, shard engines and shard stores, and nothing that decides:
each shard's loop feeds its :class:`~engine.shard.ShardEngine` commands and the time and routes
the effects that come out (batches to the group committer, replies to the connection that
asked, dispatches and kills to worker connections, cross-shard triggers to the target shard);
queries (a job's spec, run history, logs) are read from the store. Must never decide anything
the engine decides (when to fire, what to persist first, who gets a run, what a timeout does):
the simulation cannot reach this module.

Layout of a data directory: ``cluster.json`` (format, shard count, the embedded lease's epoch)
and one RocksDB directory per shard, ``shard-NNN``. The embedded default owns every shard and
bumps the epoch at each start (DESIGN.md, "Cluster"): records, claims and dispatches of an
older incarnation are fenced.

Failure modes: a store failure (disk full, read-only, corrupt) stops that shard: its commands
are answered with the store's typed error, nothing is acknowledged that is not durable. An
unexpected exception (a bug) in a shard's turn, inline or in its loop, or in any of its
background tasks (retention, snapshots, trigger delivery) stops that shard the same way
(``shard_failed``); a stopped shard decides, dispatches and acknowledges nothing more. Only
cancellation leaves the node's nursery: the node and the other shards carry on. A bad
connection (malformed frames, wrong types, oversized payloads) gets typed errors and never
harms the others; a connection that does not read its replies is held back (the node stops
reading it above ``OUTBOX_HIGH_WATER`` bytes queued) and closed above ``OUTBOX_HARD_CAP``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from cluster.codec import DEFAULT_MAX_FRAME, FrameDecoder, Message, ProtocolError, encode
from cluster.protocol import (
    MAX_BATCH,
    MAX_LIMIT,
    MAX_WORKER_SLOTS,
    REPORT_ARGS,
    BadArgs,
    Request,
    WorkerIdInUse,
    check_report,
    clipped,
    error,
    error_body,
    ok,
    parse_request,
    push,
)
from cluster.rawio import (
    END_OF_STREAM,
    Outbox,
    RawSocketIO,
    ReadPoller,
    SocketFailed,
    read_ready,
    translate_socket_error,
)
from engine.effects import (
    CancelJob,
    ClockJump,
    Command,
    CreateJob,
    CreateJobs,
    Dispatch,
    Durable,
    Effect,
    GetJob,
    Heartbeat,
    Kill,
    OutboxDelivered,
    PauseJob,
    Persist,
    Pull,
    Refused,
    Register,
    RegisterDependent,
    Reply,
    ReportFinished,
    ReportStarted,
    ResumeJob,
    Sync,
    Trigger,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import EngineError, JobNotFound, RunNotFound, VersionConflict
from engine.jobs import JobSpec, apply_update, new_job_id, validate_job, validate_job_id
from engine.records import Record
from engine.routing import shard_of, shard_of_run
from engine.runs import parse_run_id, run_id
from engine.schedules import format_utc, preview
from engine.shard import NODE_FIRE_AHEAD_MS, EngineConfig, ShardEngine
from engine.snapshot import SnapshotCadence
from wal.commit import GroupCommitter, Ticket
from wal.errors import StoreError
from wal.store import Retention, ShardStore

log = logging.getLogger("tickwheel.node")

CLUSTER_FILE = "cluster.json"
DEFAULT_SHARDS = 2
#: requests one connection may have in flight before the node stops reading from it
MAX_IN_FLIGHT = 1024
#: bytes of replies and pushes queued for one connection above which the node reads no more of
#: its requests (and starts no more of its queries) until the peer has read enough of them:
#: TCP back-pressure on a peer that sends without reading
OUTBOX_HIGH_WATER = 4 * 1024 * 1024
#: bytes queued for one connection above which it is closed (a logged reason): reached only by
#: replies already being made when the high-water mark was passed (a single reply is at most
#: a frame, 8 MiB by default) or by pushes to a worker that stopped reading
OUTBOX_HARD_CAP = 64 * 1024 * 1024
#: seconds a connection whose peer stopped sending (EOF, a half-close) is kept open for the
#: replies to the requests it sent before; then it is closed whatever is still unanswered
HALF_CLOSE_GRACE_S = 10.0
#: requests validated between two yields to the rest of the node
YIELD_EVERY = 64
#: specs of a job.create_many validated between two yields, and sent to their shards as one
#: command each: ~10 us of validation a spec, so a few ms between two yields
CREATE_MANY_CHUNK = 256
#: error text (UTF-8 bytes of messages and fields) one job.create_many reply carries in full;
#: past it, messages and fields are cut to the short bounds: with MAX_BATCH errors the reply
#: then stays under ~5 MiB, below the 8 MiB frame limit
CREATE_MANY_ERROR_BYTES = 2 * 1024 * 1024
CREATE_MANY_SHORT_MESSAGE = 60
CREATE_MANY_SHORT_FIELD = 40
#: most commands in one engine call, a job.create_many chunk counting as its specs: bounds a
#: turn's length (and so the wait of a fire or a dispatch behind it) while keeping batches
#: large
TURN_COMMANDS = 512
#: runs out with workers whose shard the node remembers (beyond: computed from the run id)
MAX_REMEMBERED_RUNS = 1_000_000
#: how long a partial update keeps merging into newer versions of its job before it gives
#: up with ``conflict``, and the wait between tries (a newer version is being made durable)
UPDATE_MERGE_S = 10.0
UPDATE_RETRY_S = 0.005
#: a job.list cursor, as it hands them out: SHARD:KEY in ASCII digits
_CURSOR: Final = re.compile(r"[0-9]{1,10}:[0-9]{1,19}")
#: how many times job.get reads a job whose engine description is a version ahead of its
#: stored spec (updates in flight) before it answers the stored pair with the newer one
GET_TRIES = 5
#: the collector's thresholds of a node that owns its process (see Node.run)
NODE_GC_THRESHOLDS: Final = (10_000, 20, 100)
#: a node's engine configuration unless it is given one: the engine's defaults, fire-ahead on
#: (runs PENDING and durable before their time, out at it with no write first)
NODE_ENGINE_CONFIG: Final = EngineConfig(fire_ahead_ms=NODE_FIRE_AHEAD_MS)
#: Batches are written on the event loop's own thread (Node.commit_here)
#: only while the shard's recent writes, fsync included, took at most this long: the longest
#: the loop may stall for one. A slower disk costs more than the thread hand-offs it saves.
INLINE_COMMIT_MAX_WRITE_S: Final = 0.002
#: A lone request (this many in a row came alone: Node.lone_requests) whose batch was queued
#: while something was runnable is left for the next pass of the loop once (_Kicker), which
#: then finds the loop idle and writes it there
INLINE_COMMIT_AFTER_LONE: Final = 8


class NodeError(Exception):
    """The node cannot start or go on (a data directory of another shape, a store failure)."""


class ShardFailed(StoreError):
    """The shard stopped on an unexpected exception (a bug) while it worked: like a store
    failure, every later command on it gets this error until the node restarts; the node and
    its other shards carry on."""

    code = "shard_failed"


async def _ignore_signals(signals: AsyncIterator[int]) -> None:
    async for signum in signals:
        log.info("signal %d: already stopping", signum)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


# =============================================================================== data directory


def prepare_data_dir(data_dir: Path, shards: int | None) -> tuple[int, int]:
    """Create or check ``data_dir``; bump the embedded lease's epoch. Returns (shards, epoch).

    The shard count is fixed when the directory is created; another count is refused. The new
    epoch is durable (written, fsynced, renamed) before any store opens with it.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / CLUSTER_FILE
    if path.exists():
        try:
            meta = json.loads(path.read_text())
            stored_shards, epoch = int(meta["shards"]), int(meta["epoch"])
        except (ValueError, KeyError, TypeError) as exc:
            raise NodeError(f"{path} is unreadable: {exc}") from None
        if shards is not None and shards != stored_shards:
            raise NodeError(
                f"{data_dir} was created with {stored_shards} shards; --shards {shards} is "
                "refused (the shard count of a data directory is fixed)"
            )
        shards = stored_shards
    else:
        if any(data_dir.iterdir()):
            raise NodeError(f"{data_dir} is not empty and has no {CLUSTER_FILE}")
        shards = DEFAULT_SHARDS if shards is None else shards
        if not 1 <= shards <= 1024:
            raise NodeError(f"--shards must be in 1..1024, got {shards}")
        epoch = 0
    epoch += 1
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "shards": shards, "epoch": epoch}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return shards, epoch


# =============================================================================== one shard


ReplyCallback = Callable[["Reply | StoreError"], None]


class _Slot:
    """Where a command's reply lands (or the store failure that stopped the shard): an event
    a task waits on, or a callback (no task needed, and no event made)."""

    __slots__ = ("callback", "event", "failure", "reply")

    def __init__(self, callback: ReplyCallback | None = None) -> None:
        self.event = trio.Event() if callback is None else None
        self.reply: Reply | None = None
        self.failure: StoreError | None = None
        self.callback = callback

    def fill(self, reply: Reply | None, failure: StoreError | None) -> None:
        self.reply, self.failure = reply, failure
        if self.callback is not None:
            outcome = failure if failure is not None else reply
            assert outcome is not None
            try:
                self.callback(outcome)
            except Exception:
                # The callback is a connection's (a bug there): that request is left
                # unanswered, but the shard's own effects after this reply still go out, so
                # the shard does not stop for it.
                log.exception("a reply callback failed")
        else:
            assert self.event is not None
            self.event.set()


@dataclass(eq=False)  # hashed by identity (a key of Node.turn_due)
class ShardHost:
    """One shard: its engine, store and group committer, and the loop that drives them."""

    index: int
    node: Node
    store: ShardStore
    engine: ShardEngine
    token: trio.lowlevel.TrioToken
    committer: GroupCommitter = field(init=False)  # made once the host exists (its callback)
    # The commands waiting for the loop's next turn: a list and a wake-up, not a memory
    # channel (a channel's send costs several times an append, and a busy node makes several
    # commands per run: reports, pulls, acknowledgements).
    pending: list[Command] = field(default_factory=list)
    wakeup: trio.Event | None = None  # set while the loop sleeps with nothing pending
    sleeps_until: float = math.inf  # the engine wake-up (mono ms) the sleeping loop waits for
    # Workers whose free slots changed since this shard last heard (a dispatch by another
    # shard, a worker's own pull): one Pull each per turn, whatever the number of changes.
    credits_changed: dict[str, None] = field(default_factory=dict)
    slots: dict[int, _Slot] = field(default_factory=dict)
    next_request: int = 0
    failed: StoreError | None = None
    stopping: bool = False  # the node stops: no more turns (see Node._close)
    initial: list[Effect] = field(default_factory=list)  # the effects of opening the shard
    since_snapshot: int = 0  # records logged (or replayed at opening) since the snapshot
    snapshot_pending: bool = False
    snapshots: SnapshotCadence = field(default_factory=SnapshotCadence)  # this shard's cadence
    last_snapshot_mono: float = field(default_factory=time.monotonic)  # ended (or opened)
    last_snapshot_cost_s: float = 0.0  # export and write of the last one
    last_export_s: float = 0.0  # its export alone (on the event loop)
    batch_seq: dict[int, int] = field(default_factory=dict)
    # Groups the writer thread handed to Trio's loop (on_group), and those the loop took:
    # unequal while an acknowledgement waits in Trio's queue (Node.commit_here).
    groups_handed: int = 0
    groups_taken: int = 0

    # ------------------------------------------------------------------ commands in

    async def request(self, make: Callable[[int], Command]) -> Reply:
        """Send the command ``make(request_id)`` and wait for its reply (which the engine
        sends only once what it changed is durable)."""
        if self.failed is not None:
            raise self.failed
        self.next_request += 1
        request_id = self.next_request
        slot = self._slot(request_id)
        self._push(make(request_id))
        assert slot.event is not None
        await slot.event.wait()
        if slot.failure is not None:
            raise slot.failure
        assert slot.reply is not None
        return slot.reply

    def _slot(self, request_id: int, callback: ReplyCallback | None = None) -> _Slot:
        slot = self.slots[request_id] = _Slot(callback)
        return slot

    def request_then(self, make: Callable[[int], Command], callback: ReplyCallback) -> None:
        """:meth:`request` without a waiting task: ``callback`` gets the reply (or the store
        failure), called from the shard's loop."""
        if self.failed is not None:
            callback(self.failed)
            return
        self.next_request += 1
        self._slot(self.next_request, callback)
        self._push(make(self.next_request))

    def tell(self, command: Command) -> None:
        """A command without a reply (a worker's report, a durable-acknowledgement)."""
        if self.failed is None:
            self._push(command)

    def credits_changed_for(self, worker_id: str) -> None:
        """The worker's free slots changed: the loop's next turn sends this shard one Pull
        with the node's newest count (:attr:`WorkerSession.free`), however many changes came
        meanwhile. Pulls only set a count, so the newest one alone says the same."""
        if self.failed is None:
            self.credits_changed[worker_id] = None
            self.wake()

    def tell_many(self, commands: list[Command]) -> None:
        """:meth:`tell` for several commands, in order (a worker's batch of final reports):
        one wake-up decision for all of them."""
        if self.failed is None and commands:
            self.pending.extend(commands)
            self._pushed()

    def _push(self, command: Command) -> None:
        self.pending.append(command)
        self._pushed()

    def _pushed(self) -> None:
        if self.wakeup is not None:
            node = self.node
            if node.batching and node.in_flight <= 1:
                # The loop sleeps, the node is in a batch, and no other request is in flight
                # (a lone client, a worker's reports): the batch's end works this through
                # inline (turn_now), a pass of Trio's loop sooner than a wake-up. With other
                # requests in flight, more are likely to arrive in this pass of the loop: the
                # loop's own turn then takes them all as one engine call and one batch.
                node.turn_due[self] = None
            else:
                self.wake()

    # ------------------------------------------------------------------ the loop

    async def loop(self) -> None:
        """Turn while the shard works: returns once it failed (or the node stops)."""
        engine = self.engine
        try:
            self.route(self.initial)
        except Exception as exc:
            self.fail_on_bug(exc, "routing the effects of recovery")
        self.initial = []
        while self.failed is None and not self.stopping:
            if self.pending or self.credits_changed:
                await trio.lowlevel.checkpoint()  # between two busy turns, the others run
            else:
                wake = engine.next_wakeup_mono()
                wakeup = self.wakeup = trio.Event()
                self.sleeps_until = math.inf if wake is None else wake
                if wake is None:
                    await wakeup.wait()
                else:
                    # To the engine's millisecond (epoll rounds its timeout up, never down).
                    timeout = (wake * 1_000_000 - time.monotonic_ns()) / 1e9
                    if timeout > 0:
                        with trio.move_on_after(timeout):
                            await wakeup.wait()
                self.wakeup = None
            with self.node.batch:
                self.turn()

    def turn(self) -> None:
        """One engine call for everything pending (or a tick when nothing is), one batch.

        Never raises: an exception out of the engine or out of routing its effects (a bug: a
        command's own errors are replies) stops the shard (:meth:`fail_on_bug`), since some of
        that call's effects (its records among them) are lost and the engine no longer
        matches what is durable. A failed or stopping shard does nothing (no decision, no
        dispatch)."""
        if self.failed is not None or self.stopping:
            self.pending, self.credits_changed = [], {}
            return
        engine = self.engine
        pending = self.pending
        taken = turn_length(pending)
        if taken < len(pending):
            # A bounded turn: its batch goes to the disk, and its dispatches out, sooner.
            batch, self.pending = pending[:taken], pending[taken:]
        else:
            batch, self.pending = pending, []
        if self.credits_changed and not self.pending:
            # After every command queued (a hello among them): the newest count of them all.
            workers = self.node.workers
            for worker_id in self.credits_changed:
                session = workers.get(worker_id)
                if session is not None:
                    batch.append(Pull(worker_id, session.free))
            self.credits_changed = {}
        try:
            if not batch:
                self.route(engine.tick(wall_ms(), mono_ms()))
                return
            mono = mono_ms()
            wake = engine.next_wakeup_mono()
            if wake is not None and wake <= mono:
                # Something is due: its fire records leave for the disk before the commands
                # are worked through (a turn of hundreds of commands takes milliseconds): with
                # other requests in flight its writer is woken now, not at the end of the
                # pass (as every batch's was with requests in flight until 2026-12-03).
                self.route(engine.tick(wall_ms(), mono), wake_writer=self.node.in_flight > 1)
            # One engine call, one batch for everything that arrived meanwhile.
            self.route(engine.handle_many(batch, wall_ms(), mono_ms()))
        except Exception as exc:
            self.fail_on_bug(exc, "in a turn")
        finally:
            # After every turn, the loop's own or an inline one (turn_now): most turns of a
            # node serving lone requests and worker reports are inline.
            if (
                self.since_snapshot >= self.snapshots.min_records
                and not self.snapshot_pending
                and self.failed is None
                and self.snapshots.due(
                    self.since_snapshot,
                    (time.monotonic() - self.last_snapshot_mono) * 1_000,
                    self.last_snapshot_cost_s * 1_000,
                    self.last_export_s * 1_000,
                )
            ):
                try:
                    self._start_snapshot()
                except RuntimeError:  # the node is stopping: its clean stop stores one
                    log.info("shard %d: snapshot skipped, the node is stopping", self.index)

    def route(self, effects: Iterable[Effect], *, wake_writer: bool = False) -> None:
        node = self.node
        dispatched: dict[str, None] = {}  # workers given runs, in order
        for effect in effects:
            if isinstance(effect, Persist):
                self._persist(effect, wake_writer)
                if self.failed is not None:
                    return  # the shard stopped: nothing it decided goes out any more
            elif isinstance(effect, Reply):
                slot = self.slots.pop(effect.request_id, None)
                if slot is not None:
                    slot.fill(effect, None)
            elif isinstance(effect, Dispatch):
                if node.dispatch(self.index, effect):
                    dispatched[effect.worker_id] = None
            elif isinstance(effect, Kill):
                node.kill(effect)
            elif isinstance(effect, Refused):
                node.refused(effect)
            elif isinstance(effect, Trigger):
                self.start_task(self._deliver_trigger, effect)
            elif isinstance(effect, Register):
                self.start_task(self._deliver_register, effect)
            elif isinstance(effect, ClockJump):
                log.warning(
                    "shard %d: wall clock %s jumped ahead; the engine keeps %s",
                    self.index,
                    format_utc(effect.wall_ms),
                    format_utc(effect.engine_ms),
                )
        if dispatched:
            # This shard counted its credits; the others learn each worker's new free count
            # at their next turn: one notice a worker for the whole batch of dispatches (the
            # notice only marks the worker; the count is read when the Pull is made).
            for host in node.hosts:
                if host is not self:
                    for worker_id in dispatched:
                        host.credits_changed_for(worker_id)

    def _persist(self, batch: Persist, wake_writer: bool = False) -> None:
        if self.failed is not None:
            return
        node = self.node
        try:
            if node.kicker is not None and not wake_writer:
                # The writer is woken just before this thread waits for I/O (Node.kicker),
                # not now, or this thread writes the batch itself then (when nothing is left
                # to run). Woken now, it would take the GIL at this thread's next system call
                # (the reader's epoll registration) and hold it for its own Python (the
                # write's encoding, up to the fsync): this thread would then wait for the
                # GIL, and on these shared cores the holder is often descheduled meanwhile
                # (measured: waits of milliseconds, and ~4 futex calls a request in this
                # thread). With many requests in flight too, since 2026-12-03 (see _Kicker),
                # but for ``wake_writer``: a due fire's batch ahead of a turn's commands.
                self.committer.submit(batch, wake=False)
                node.kicks[self] = None
            else:
                self.committer.submit(batch)
        except StoreError as exc:
            self._fail(exc)
            return
        self.since_snapshot += len(batch.records)

    def on_group(self, tickets: Sequence[Ticket]) -> None:
        """The committer wrote a group (on its thread): one hop to Trio per group, not one per
        batch (each hop is a write to Trio's wake-up socket and a pass of its loop)."""
        self.groups_handed += 1  # (before the hop; this thread alone counts them)
        try:
            self.token.run_sync_soon(self._handed, tickets)
        except trio.RunFinishedError:
            pass

    def _handed(self, tickets: Sequence[Ticket]) -> None:
        self.groups_taken += 1  # (Trio's thread alone counts these)
        self._committed(tickets)

    def _committed(self, tickets: Sequence[Ticket]) -> None:
        batch_seq = self.batch_seq
        for ticket in tickets:
            if ticket.error is not None:
                self._fail(ticket.error)
                return
            assert ticket.seq is not None
            batch_seq[ticket.batch_id] = ticket.seq
        if self.failed is not None or self.stopping:
            # Stopping: the group is durable (its batch counts for the final snapshot), but
            # the engine makes no decision now that could not be committed.
            return
        # The engine releases everything held up to this batch: one command for the group.
        self.pending.append(Durable(tickets[-1].batch_id))
        with self.node.batch:
            self.turn_now()

    def wake(self) -> None:
        """Wake the loop if it sleeps."""
        wakeup = self.wakeup
        if wakeup is not None:
            self.wakeup = None
            wakeup.set()

    def turn_now(self) -> None:
        """If the loop sleeps, its turn runs at once (replies leave now, not after another
        pass of Trio's loop), and the loop wakes only if its deadline went stale meanwhile or
        more is pending. If it is awake or about to run, its next turn takes what is pending."""
        if self.wakeup is None or self.failed is not None or self.stopping:
            return
        self.turn()
        wake = self.engine.next_wakeup_mono()
        if self.pending or self.credits_changed or (wake is not None and wake < self.sleeps_until):
            self.wake()

    def _fail(self, exc: StoreError) -> None:
        """A store failure (or a bug, :meth:`fail_on_bug`) stops the shard: nothing more is
        acknowledged, decided or dispatched; every command waiting gets ``exc``, and every
        later one too (:meth:`request`). Its loop returns; the node and the other shards
        carry on."""
        if self.failed is None:
            log.error("shard %d stops: %s", self.index, exc)
            self.failed = exc
            self.pending, self.credits_changed = [], {}
            slots, self.slots = self.slots, {}
            for slot in slots.values():
                slot.fill(None, exc)
            self.wake()  # its loop sees the failure and returns

    def fail_on_bug(self, exc: Exception, where: str) -> None:
        """An unexpected exception (a bug) met by this shard's work ``where``: logged with
        its traceback, and the shard stops with :class:`ShardFailed`. A store failure met
        there (a read of a store that failed a write a moment ago) is no bug: the shard stops
        with it, and its code (``disk_full``, ``store_io``...) is what clients are told."""
        if isinstance(exc, StoreError):
            log.error("shard %d: store failure %s: %s", self.index, where, exc)
            self._fail(exc)
            return
        log.error("shard %d: unexpected error %s", self.index, where, exc_info=exc)
        self._fail(ShardFailed(f"shard {self.index} stopped on a bug: {type(exc).__name__}"))

    def start_task(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` in the node's nursery as this shard's background task: an
        exception out of it (but cancellation) stops this shard, never the node."""
        self.node.nursery.start_soon(self.guarded, fn, *args)

    async def guarded(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """``fn(*args)``; an exception out of it stops this shard (:meth:`fail_on_bug`)
        instead of cancelling the node's nursery. Cancellation passes."""
        try:
            await fn(*args)
        except Exception as exc:
            self.fail_on_bug(exc, f"in {getattr(fn, '__name__', fn)}")

    # ------------------------------------------------------------------ snapshots

    def _start_snapshot(self) -> None:
        started = time.monotonic()
        snap = self.engine.export_snapshot()
        self.snapshot_pending = True
        covered, self.since_snapshot = self.since_snapshot, 0
        self.start_task(self._write_snapshot, snap, time.monotonic() - started, covered)

    async def _write_snapshot(self, snap: Any, export_s: float = 0.0, covered: int = 0) -> None:
        """Store ``snap`` once the batch it reflects is durable. ``covered``: the records
        since the last snapshot that it stands for; counted again if it is not stored
        (failed, or abandoned by a stop), so that the clean stop still takes its final
        snapshot (it skipped it, and the next start replayed the tail: found by review)."""
        batch = snap.meta["batch"]
        stored = False
        try:
            while batch not in self.batch_seq and self.failed is None:
                await trio.sleep(0.01)  # the batch it reflects is not durable yet
            if self.failed is None:
                seq = self.batch_seq[batch]
                writing = time.monotonic()
                await trio.to_thread.run_sync(
                    self.store.write_snapshot, seq, snap.arrays, snap.meta
                )
                stored = True
                self.batch_seq = {b: s for b, s in self.batch_seq.items() if b > batch}
                # its cost: the export and the write (the wait for the batch's fsync is not)
                ended = time.monotonic()
                self.last_snapshot_cost_s = export_s + (ended - writing)
                self.last_export_s = export_s
                self.last_snapshot_mono = ended
                log.info(
                    "shard %d: snapshot at log position %d stored (%.3f s)",
                    self.index,
                    seq,
                    self.last_snapshot_cost_s,
                )
        except StoreError as exc:
            log.warning("shard %d: snapshot not stored: %s", self.index, exc)
        finally:
            self.snapshot_pending = False
            if not stored:
                self.since_snapshot += covered

    async def final_snapshot(self) -> None:
        """At a clean stop, once the committer is closed (every batch handed to it written):
        a snapshot of everything, so the next start replays nothing. Skipped for a failed
        shard, and (logged) if the last batch is not known durable."""
        if self.failed is None and self.since_snapshot:
            snap = self.engine.export_snapshot()
            if snap.meta["batch"] not in self.batch_seq:
                log.warning(
                    "shard %d: no final snapshot: its last batch is not durable", self.index
                )
                return
            await self._write_snapshot(snap)

    # ------------------------------------------------------------------ outbox delivery

    async def _deliver_trigger(self, trigger: Trigger) -> None:
        target = self.node.host_of(trigger.job_id)
        reply = await self._until_answered(
            target,
            lambda rid: TriggerJob(rid, trigger.job_id, trigger.source_run_id, trigger.depth),
        )
        if isinstance(reply.error, JobNotFound):
            # A trigger target that does not exist (never created, or cancelled and gone):
            # nothing to run, and no retry would change that. Said in the log, so that a
            # misspelt ``trigger:JOB`` or ``after`` is not silent.
            log.warning(
                "trigger of %s from %s dropped: no such job",
                trigger.job_id,
                trigger.source_run_id,
            )
        elif reply.error is not None:
            log.warning("trigger of %s: %s", trigger.job_id, reply.error)
        self.tell(OutboxDelivered(trigger.seq))

    async def _deliver_register(self, reg: Register) -> None:
        target = self.node.host_of(reg.upstream)
        await self._until_answered(
            target,
            lambda rid: RegisterDependent(rid, reg.upstream, reg.downstream, reg.on, reg.seq),
        )
        self.tell(OutboxDelivered(reg.seq))

    @staticmethod
    async def _until_answered(target: ShardHost, make: Callable[[int], Command]) -> Reply:
        delay = 0.05
        while True:
            try:
                return await target.request(make)
            except StoreError:
                await trio.sleep(delay)  # the target shard is down; the outbox keeps it
                delay = min(delay * 2, 5.0)


# =============================================================================== connections


class Connection:
    """One client or worker connection: a reader task, a writer task, requests in between.

    Between requests the reader task is parked in the node's :class:`ReadPoller`, which reads
    the socket and works the requests through itself; the task takes over only for what needs
    a wait (back-pressure, no place in flight, a long run of requests in one read) and at the
    connection's end."""

    def __init__(self, node: Node, stream: trio.SocketStream) -> None:
        self.node = node
        self.stream = stream
        self.io = RawSocketIO(stream)  # the stream's bytes without its schedule points
        self.decoder = FrameDecoder(node.max_frame)
        # Frames waiting for the writer task, bounded in bytes: above OUTBOX_HIGH_WATER the
        # node reads no more of this peer's requests, above OUTBOX_HARD_CAP it closes the
        # connection. A peer that sends without reading must not grow the node's memory.
        self.outbox = Outbox(self.io, OUTBOX_HIGH_WATER)
        self.hard_cap = OUTBOX_HARD_CAP
        self.scope: trio.CancelScope | None = None
        # Requests admitted (_admit) and not answered yet, at most MAX_IN_FLIGHT: a count, not
        # a trio.Semaphore (whose calls cost more than the count; only the reader waits).
        self.in_flight = 0
        self.room: trio.Event | None = None  # set while the reader waits for a place
        self.worker: WorkerSession | None = None
        self.closed = False
        self.nursery: trio.Nursery | None = None  # the connection's (its requests' tasks)
        self.held: Request | None = None  # parsed by the node's poller, waiting for a place

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.scope = nursery.cancel_scope
                nursery.start_soon(self.outbox.run)
                self.nursery = nursery
                await self._reader()
                # The peer sends no more (EOF: it closed, or half-closed its side): the requests
                # it sent are still answered, for a bounded time, before the connection closes.
                with trio.move_on_after(HALF_CLOSE_GRACE_S):
                    await self._answered()
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away or reset: this connection ends, nothing else
        except* Exception:
            # A bug met while serving this connection: it ends, the node and the others go
            # on. (Errors leave the nursery grouped, so a plain except would never match.)
            log.exception("connection failed")
        finally:
            self.closed = True
            if self.node.lone_connection is self:
                self.node.lone_connection = None  # (nothing keeps a closed connection)
            if self.worker is not None and self.node.workers.get(self.worker.worker_id) is (
                self.worker
            ):
                del self.node.workers[self.worker.worker_id]  # its lease lapses in the engines
            with trio.move_on_after(1) as scope:
                scope.shield = True
                await self.stream.aclose()

    def send(self, message: Message) -> None:
        if self.closed:
            return
        try:
            frame = encode(message)
        except ProtocolError as exc:
            # Never leave a request unanswered: say that its reply could not be encoded.
            log.error("cannot encode a reply: %s", exc)
            frame = encode(error(message.get("id"), "internal", "reply could not be encoded"))
        if len(frame) - 4 > DEFAULT_MAX_FRAME:
            # A peer's decoder would drop it and its caller wait out a timeout: say so instead.
            # (Every reply is bounded by its request's limits; this is the net under a bug.)
            log.error("a reply of %d bytes is over the frame limit", len(frame) - 4)
            frame = encode(
                error(
                    message.get("id"),
                    "internal",
                    f"the reply ({len(frame) - 4:,} bytes) is over the frame limit "
                    f"({DEFAULT_MAX_FRAME:,}): ask for less",
                )
            )
        outbox = self.outbox
        queued = outbox.queued + len(frame)
        if queued > self.hard_cap:
            self._overflow(queued)
            return
        outbox.frames.append(frame)
        outbox.queued = queued
        if outbox.idle:
            if self.node.batching:
                self.node.unsent[self] = None  # written when the batch ends (write_now)
            else:
                outbox.wake()

    def _overflow(self, queued: int) -> None:
        """More than the hard cap would wait for this peer: close it (its requests in flight
        are answered nowhere), never grow the node's memory."""
        log.warning(
            "closing a connection that left %d bytes of replies and pushes unread (cap %d)",
            queued,
            self.hard_cap,
        )
        self.closed = True
        self.outbox.frames = []
        self.outbox.queued = 0
        if self.scope is not None:
            self.scope.cancel()

    async def _answered(self) -> None:
        """Wait until every request of this connection is answered and every reply written
        (polled: this runs once, when the peer stopped sending)."""
        while self.in_flight or self.outbox.queued:
            await trio.sleep(0.005)

    def write_now(self) -> None:
        """What is queued, written now if the writer task is idle (one system call, no pass
        of Trio's loop); what does not fit, or any failure, goes to the writer task."""
        if not self.closed:
            self.outbox.write_now()

    async def _reader(self) -> None:
        while True:
            await self.outbox.wait_room()  # TCP back-pressure on a peer that does not read
            poller = self.node.poller
            if poller is not None and not poller.closed:
                # Parked until the poller meets something it leaves to this task: the peer's
                # EOF or a broken socket, or requests that need a wait (see _handle_ready).
                # None: requests it read (in held or the decoder), or a wait for room.
                fd = self.io.fileno()  # (a closed stream raises here, as a read of it would)
                outcome = await poller.wait(self, fd)
                if outcome is END_OF_STREAM:
                    return
                if isinstance(outcome, SocketFailed):
                    raise translate_socket_error(outcome.error) from outcome.error
                if isinstance(outcome, BaseException):
                    raise outcome  # (a bug met by the poller in this connection's requests)
            else:
                data = await self.io.receive_some()
                if not data:
                    return
                self.decoder.feed(data)
            with self.node.batch:
                await self._handle_events()

    def read_parked(self, fd: int) -> None:
        """The node's poller's read of this connection (parked, its socket readable): the
        requests read are worked through here (:meth:`_handle_ready`), in the poller's batch;
        the task is handed back only for what needs it. Never raises."""
        poller = self.node.poller
        assert poller is not None
        scope = self.scope
        if self.closed or (scope is not None and scope.cancel_called):
            # Closed by the node (its outbox over the hard cap) or ending (a failed writer):
            # its task, cancelled, leaves; nothing more of it is read or started.
            poller.hand_back(fd, None)
            return
        if self.outbox.queued > self.outbox.high_water:
            # The peer does not read its replies (or a worker its pushes) as fast as they
            # come: its task reads no more of it until it has (back-pressure, as unparked).
            poller.hand_back(fd, None)
            return
        data = read_ready(poller, fd)
        if data is None:
            return
        try:
            self.decoder.feed(data)
            if not self._handle_ready():
                poller.hand_back(fd, None)
        except Exception as exc:  # a bug: its task raises it, and this connection ends
            poller.hand_back(fd, exc)

    async def _handle_events(self) -> None:
        """Every whole request read so far. Runs inside a batch of the node's
        (:attr:`Node.batch`), which it leaves around each of its waits (:attr:`Node.unbatched`):
        a batch must never span a wait, or the replies other tasks make meanwhile would wait
        for it."""
        node = self.node
        while True:
            held, self.held = self.held, None
            if held is not None:  # no place in flight for it (first: it was read first)
                await self._admit()
                self._start(held)
            if self._handle_ready():
                return
            if self.held is not None:
                continue
            if self.outbox.queued > self.outbox.high_water:
                # The peer does not read its replies as fast as it asks: take no more of its
                # requests (those read already wait here) until it has read enough.
                with node.unbatched:
                    await self.outbox.wait_room()
            else:
                # A read may hold thousands of requests: let the shards' loops (fires,
                # acknowledgements) and the other connections in between.
                with node.unbatched:
                    await trio.lowlevel.checkpoint()

    def _handle_ready(self) -> bool:
        """The requests read so far, taken without waiting (by the read poller; by
        :meth:`_handle_events` between its waits), until one would need a wait: its
        connection's replies above the high-water mark, no place in flight,
        :data:`YIELD_EVERY` requests taken. True when all were taken; False when what is left
        needs a wait first, in :attr:`held` (parsed, waiting for a place) or the decoder."""
        outbox = self.outbox
        handled = 0
        while True:
            if outbox.queued > outbox.high_water:
                return False  # (its task waits for room before it reads or takes any more)
            if handled >= YIELD_EVERY:
                return not self.decoder.has_event()
            event = self.decoder.next_event()
            if event is None:
                return True
            handled += 1
            request = self._parse(event)
            if request is None:
                continue
            if request.op in _QUICK_OPS:
                self._answer_now(request)
                continue
            if self.in_flight >= MAX_IN_FLIGHT:
                self.held = request
                return False
            self._take_place()
            self._start(request)

    def _parse(self, event: Message | ProtocolError) -> Request | None:
        """The request of ``event``; None, the peer told its typed error, for one that is
        malformed."""
        if isinstance(event, ProtocolError):
            self.send(error(event.request_id, event.code, event.message))
            return None
        try:
            return parse_request(event)
        except BadArgs as exc:
            self.send(error(exc.request_id, exc.code, exc.message, exc.field))
        except ProtocolError as exc:
            self.send(error(exc.request_id, exc.code, exc.message))
        except Exception as exc:
            # A bug in the parsing (one was a sort of text and bytes keys together: it ended
            # the connection, every reply in flight on it lost; found by review): this request
            # is answered `internal`, and the connection carries on (docs/protocol.md, 3).
            log.exception("parsing a request failed")
            self.send(error(event.get("id"), "internal", f"internal error: {type(exc).__name__}"))
        return None

    def _start(self, request: Request) -> None:
        """Work through a request given its place in flight (never waits)."""
        if request.op in _REPORT_OPS:
            # Answered by callback once the reports are durable: no task each.
            self._report_now(request)
        elif request.op == "job.create":
            # The commonest request waits for its batch's fsync: a callback answers it, so
            # that thousands in flight cost no task each.
            self._create_now(request)
        else:
            assert self.nursery is not None  # (set before the reader runs)
            self.nursery.start_soon(self._handle, request)

    async def _admit(self) -> None:
        """A place among the requests in flight; waits only when there is none. (An
        ``await acquire()`` always yields: a pass of Trio's loop per request, which doubled
        the cost of a request pipelined behind hundreds of others.) Called inside the
        reader's batch, which it leaves while it waits (the replies that free places are
        written by other batches)."""
        while self.in_flight >= MAX_IN_FLIGHT:
            room = self.room = trio.Event()
            with self.node.unbatched:
                await room.wait()
        self._take_place()

    def _take_place(self) -> None:
        self.in_flight += 1
        node = self.node
        node.in_flight += 1
        if node.in_flight != 1:
            node.lone_requests = 0
        elif node.lone_connection is self:
            node.lone_requests += 1
        else:
            # Another connection's: two clients taking turns (each request read while the
            # other's is written) are not one lone client, and would gain nothing.
            node.lone_connection, node.lone_requests = self, 1

    def _release(self) -> None:
        self.in_flight -= 1
        self.node.in_flight -= 1
        room = self.room
        if room is not None:
            self.room = None
            room.set()

    def _create_now(self, request: Request) -> None:
        def answer(outcome: Reply | StoreError) -> None:
            self._release()
            try:
                if isinstance(outcome, StoreError):
                    raise outcome
                self.send(ok(request.id, _job_result(_unwrap(outcome))))
            except Exception as exc:
                self.send(_error_reply(request, exc))

        try:
            spec = self.node.job_spec(request.args["spec"])
            self.node.host_of(spec.id).request_then(lambda rid: CreateJob(rid, spec), answer)
        except Exception as exc:
            self._release()
            self.send(_error_reply(request, exc))

    def _report_now(self, request: Request) -> None:
        """A worker's final reports: taken now, answered once they are durable (the worker
        forgets a report it is told was taken)."""

        def answer(failure: Exception | None) -> None:
            self._release()
            if failure is None:
                self.send(ok(request.id, {}))
            else:
                self.send(_error_reply(request, failure))

        try:
            self.node.report_now(self, request, answer)
        except Exception as exc:
            self._release()
            self.send(_error_reply(request, exc))

    def _answer_now(self, request: Request) -> None:
        try:
            self.send(ok(request.id, self.node.execute_now(self, request)))
        except Exception as exc:
            self.send(_error_reply(request, exc))

    async def _handle(self, request: Request) -> None:
        try:
            # Its reply would only wait in the outbox: made once the peer has read (a reply
            # may be megabytes, run.logs; many in flight must not all be made).
            await self.outbox.wait_room()
            result = await self.node.execute(self, request)
            self.send(ok(request.id, result))
        except Exception as exc:
            self.send(_error_reply(request, exc))
        finally:
            self._release()


_REPORT_FIELDS: Final = frozenset(REPORT_ARGS)


def _finished_report(worker_id: str, index: int, report: object) -> ReportFinished:
    """Report ``index`` of a ``worker.finished_many``, checked as ``worker.finished``'s args
    are; :class:`BadArgs` naming ``reports[index].field`` otherwise."""
    if type(report) is dict and report.keys() <= _REPORT_FIELDS:
        # The usual report, checked without building anything (one a finished run).
        run_id, token = report.get("run_id"), report.get("token")
        outcome, exit_code = report.get("outcome"), report.get("exit_code")
        if (
            type(run_id) is str
            and type(token) is int
            and type(outcome) is str
            and (exit_code is None or type(exit_code) is int)
        ):
            return ReportFinished(worker_id, run_id, token, outcome, exit_code)
    where = f"reports[{index}]"
    if not isinstance(report, dict):
        raise BadArgs(f"{where}: must be a map", None, where)
    check_report(report, where)
    run_id, token = report["run_id"], report["token"]
    outcome, exit_code = report["outcome"], report.get("exit_code")
    return ReportFinished(worker_id, run_id, token, outcome, exit_code)


def _error_reply(request: Request, exc: Exception) -> Message:
    """The typed error a failed request gets; a bug is logged, and the connection and the
    node carry on. ``exc`` loses its traceback: an engine refusal re-raised by ``_unwrap``
    would otherwise hold the frame holding the reply holding it (a cycle, with the request's
    spec and payload in it, that only the collector frees)."""
    try:
        if isinstance(exc, EngineError):
            return error(request.id, exc.code, str(exc), exc.field)
        if isinstance(exc, StoreError):
            return error(request.id, exc.code, str(exc))
        if isinstance(exc, BadArgs):
            return error(request.id, exc.code, exc.message, exc.field)
        if isinstance(exc, ProtocolError):
            return error(request.id, exc.code, exc.message)
        log.exception("request %s failed", request.op)
        return error(request.id, "internal", f"internal error: {type(exc).__name__}")
    finally:
        exc.__traceback__ = None


@dataclass
class WorkerSession:
    """A connected worker as the node sees it: its tiers and free slots, over every shard."""

    worker_id: str
    tiers: tuple[str, ...]
    free: int
    conn: Connection
    instance: str = ""  # the process that said hello (WorkerHello.instance)
    heard_ms: int = 0  # (monotonic) its last hello or heartbeat

    def holds_id_against(self, conn: Connection, instance: str, now_ms: int, lease_ms: int) -> bool:
        """Whether this session keeps its worker id from a hello of ``instance`` on ``conn``:
        another process (both named, the names differ) while this one's connection is open
        and it was heard within a lease. Two live processes with one id took it from each
        other at every hello, each hello giving up the other's runs (found by review: an
        at-least-once run executed five times). A worker that died or went silent for a
        lease gives it up; so does a process without a name (an older worker library)."""
        return (
            conn is not self.conn
            and not self.conn.closed
            and bool(instance and self.instance)
            and instance != self.instance
            and now_ms - self.heard_ms < lease_ms
        )


# =============================================================================== the node


class _Batch:
    """A node's batch as a context: ``opens`` begins it on entry and ends it on exit; the
    other way round steps out of the caller's batch for a wait."""

    __slots__ = ("_node", "_opens")

    def __init__(self, node: Node, *, opens: bool) -> None:
        self._node, self._opens = node, opens

    def __enter__(self) -> None:
        if self._opens:
            self._node.batching += 1  # begin_batch, inline (twice a request)
        else:
            self._node.end_batch()

    def __exit__(self, *exc: object) -> None:
        if self._opens:
            self._node.end_batch()
        else:
            self._node.begin_batch()


class _Kicker(trio.abc.Instrument):
    """Wakes the group committers that got batches without a wake-up
    (:meth:`ShardHost._persist`) just before Trio's loop waits for I/O, when this thread
    gives up the GIL anyway: the writer then finds the GIL free. Every pass of the loop has
    such a wait (zero timeout when tasks are runnable), so no batch waits past the pass that
    queued it.

    Or, when the loop would otherwise sleep until they are durable (nothing runnable), writes
    them itself (:meth:`Node.commit_here`), however many requests are in flight. Until
    2026-12-03 only for a lone client's request (the only one in flight, after
    :data:`INLINE_COMMIT_AFTER_LONE` such requests in a row on its connection); measured then
    on one shard (a scratch harness of ``bench submit``'s modes, two runs each, alternately):
    ``conns64`` 15,755-16,661 creates/s written here against 14,350-15,067 by the writer
    thread (node CPU 54-59 us a create against 63-64), ``create_many`` 36,603-38,377 against
    36,983-38,370, pipelined ``create`` 22,405-23,055 against 23,421-24,035; on two shards
    the same either way (the batches of both shards wait at once, and those go to their
    writers); 256 producers in lockstep on one shard (``bench store``'s ``node`` driver,
    which does as this class does) ~14% more records a second: the loop has nothing to do
    during the fsync of a group that every producer waits for, and the two thread hand-offs
    are saved. A lone request whose batch is queued while something is runnable is still
    left for the next pass once (below).

    Only here, with nothing runnable: in a task (at a batch's end) the other tasks of the same
    pass of Trio's loop are not counted as runnable, and each request read in a pass was
    written and answered alone before the next was read: conns64 fell to one fsync per create
    (~5,600/s), its requests all "lone". (The lone rule also kept a request alone only for a
    moment among many clients' from being written here, because the first of 64 clients'
    requests back then held the other 63 behind its fsync: conns64 fell to ~3,000/s. Written
    only with nothing runnable, as now, it does not fall: figures above.)"""

    def __init__(self, node: Node) -> None:
        self.node = node
        #: a lone request's batch was left for the next pass once (see below)
        self.deferred = False

    def before_io_wait(self, timeout: float) -> None:
        try:
            self._before_io_wait(timeout)
        except BaseException:
            # Trio drops an instrument that raises (a bug here): every batch queued without a
            # wake-up would then wait for good, and since 2026-12-03 that is every batch
            # (found by review). The node falls back to waking writers at each submit
            # (ShardHost._persist reads node.kicker), and wakes those with batches waiting.
            self.node.kicker = None
            self.node.kick_committers()
            raise

    def _before_io_wait(self, timeout: float) -> None:
        node = self.node
        if node.kicks:
            lone = node.in_flight == 1 and node.lone_requests >= INLINE_COMMIT_AFTER_LONE
            if timeout > 0:  # nothing runnable: the loop would sleep until durable
                node.commit_here()
            elif lone and not self.deferred:
                # Something is runnable (Trio orders a pass's tasks at random: the shard's
                # loop, woken by the request, often runs after the reader that queued the
                # batch): the next pass finds the loop idle. Once only, so a batch waits at
                # most one pass more. (Kicked at once, one lone create in six or so went to
                # the writer thread: found when its test failed now and then.)
                self.deferred = True
                return
            self.deferred = False
            if node.kicks:
                node.kick_committers(in_loop=True)


def _nothing() -> None:
    """Run by Trio's loop to end its wait for I/O early (:meth:`Node.commit_here`)."""


class Node:
    """Every shard of ``data_dir``, served on ``host:port``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        shards: int | None = None,
        config: EngineConfig | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        retention: Retention | None = None,
        retain_every_s: float = 60.0,
        freeze_recovered: bool = False,
        snapshots: SnapshotCadence | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        #: when each shard stores a snapshot (by the replay time of its log tail)
        self.snapshots = snapshots or SnapshotCadence()
        # gc.freeze() once the shards are recovered (the process-wide choice of a node that
        # owns its process): full collections then skip the recovered state, instead of
        # pausing every shard for tens of ms at a time.
        self.freeze_recovered = freeze_recovered
        self.retention = retention or Retention()
        self.retain_every_s = retain_every_s
        self.host = host
        self.port = port
        self.requested_shards = shards
        self.config = config or NODE_ENGINE_CONFIG
        self.max_frame = max_frame
        self.hosts: list[ShardHost] = []
        self.workers: dict[str, WorkerSession] = {}
        self.connections: set[Connection] = set()  # open now (for tests and diagnostics)
        # run id -> shard, for runs out with workers (until their final report)
        self.run_shards: dict[str, int] = {}
        # A batch (begin_batch .. end_batch): a stretch of synchronous work (a connection's
        # read, a shard's turn, a group's acknowledgements) whose wake-ups are worked through
        # at its end instead: the shards whose sleeping loops got commands turn inline, and
        # the replies and pushes for idle writers are written directly. Each would otherwise
        # cost a pass of Trio's loop, about half of a lone request's time on this machine.
        self.batching = 0
        self.in_flight = 0  # requests admitted (Connection._admit) and not answered yet
        #: requests in a row admitted with no other in flight, all on one connection
        #: (:attr:`lone_connection`): a lone client's, one at a time (Node.commit_here), not a
        #: lull among many clients' (reset by the next overlap or another connection's)
        self.lone_requests = 0
        self.lone_connection: Connection | None = None
        self.turn_due: dict[ShardHost, None] = {}
        self.unsent: dict[Connection, None] = {}
        # Shards whose committer got a batch without a wake-up (ShardHost._persist): kicked
        # by the kicker, an instrument of Trio's loop, before its next wait for I/O (every
        # pass of the loop has one, with a zero timeout when tasks are runnable).
        self.kicks: dict[ShardHost, None] = {}
        self.kicker: _Kicker | None = None  # installed while run() runs
        #: reads every connection waiting for its next request (see Connection), once run()
        #: runs
        self.poller: ReadPoller | None = None
        self.batch = _Batch(self, opens=True)  # ``with node.batch:`` begin .. end
        self.unbatched = _Batch(self, opens=False)  # a wait inside a batch: end .. begin
        self.nursery: trio.Nursery
        self.shards = 0
        self.epoch = 0

    # ------------------------------------------------------------------ batches

    def begin_batch(self) -> None:
        """Open a batch (``with node.batch:``); batches nest."""
        self.batching += 1

    def end_batch(self) -> None:
        """Close a batch; the outermost works through what it deferred. Never spans a wait
        (a batch held across one would hold back every reply made meanwhile)."""
        self.batching -= 1
        if self.batching:
            return
        self.batching = 1  # what the work below defers is taken by the loop below
        try:
            while self.turn_due or self.unsent:
                while self.turn_due:
                    hosts, self.turn_due = self.turn_due, {}
                    for host in hosts:
                        try:
                            host.turn_now()
                        except Exception as exc:
                            # A bug (turn itself never raises): the same as in the loop's
                            # turn, the shard stops; every other host and writer still runs.
                            host.fail_on_bug(exc, "in an inline turn")
                conns, self.unsent = self.unsent, {}
                for conn in conns:
                    conn.write_now()  # never raises
        finally:
            self.batching = 0

    def commit_here(self) -> None:
        """Write the batches queued without a wake-up (:attr:`kicks`) on this thread, fsync
        included, and work their acknowledgements through at once, instead of waking the
        shard's writer thread and being woken back by it. Called by the kicker as Trio's loop
        is about to wait for I/O with nothing runnable (see :class:`_Kicker`): for a lone
        client's create the two hand-offs cost more than the write itself here, about
        130 us of a lone create's ~650 us round trip (``single`` went from 1,305-1,417 to
        1,532-1,831 creates/s, alternately).

        Only for one shard's batches: several shards' fsyncs in a row on this thread would
        take longer than their writer threads fsyncing side by side. Not when the shard's
        writer is in a write or another thread holds its store (a retention scan, a
        snapshot's log trim; ``write_here`` waits for neither): its writer takes the batches,
        kicked. Not when its recent writes took longer than :data:`INLINE_COMMIT_MAX_WRITE_S`
        (``recent_write_s``): on a slow disk this thread would stall for each. So the loop
        stalls for at most one slow fsync when a fast disk turns slow, and not again until ~30
        writes in a row were fast. A group written here while an earlier group's
        acknowledgement still waits in Trio's queue (its writer finished it meanwhile) is
        acknowledged behind it, through the same queue: never first (its Durable would
        release the earlier group's replies, which a failed write must not). Never raises
        (an instrument that raises is dropped by Trio): a failed write fails its shard as the
        writer thread's would."""
        if len(self.kicks) != 1:
            return
        (host,) = self.kicks
        woke = False
        try:
            committer = host.committer
            if committer.recent_write_s > INLINE_COMMIT_MAX_WRITE_S:
                return
            tickets = committer.write_here()
            if tickets is None:
                return  # its writer (kicked) takes these
            del self.kicks[host]
            if tickets:
                woke = True
                if host.groups_handed != host.groups_taken:
                    # (read after write_here: the writer hands a group off before it lets go
                    # of the write lock that write_here took after it)
                    host.token.run_sync_soon(host._committed, tickets)
                else:
                    host._committed(tickets)  # a batch: replies written, turns made
        except Exception as exc:  # a bug
            woke = True
            host.fail_on_bug(exc, "committing its batches on the loop's thread")
        if woke and trio.lowlevel.current_statistics().tasks_runnable:
            # Trio chose how long its coming wait for I/O lasts before this ran: a task this
            # woke (a shard's loop, a task started, a request answered with a failure) must
            # not wait for the next I/O or deadline. The wake-up socket cuts the wait short.
            trio.lowlevel.current_trio_token().run_sync_soon(_nothing)

    def kick_committers(self, *, in_loop: bool = False) -> None:
        """Wake the writers of the batches queued without a wake-up (never raises).

        ``in_loop``: called by the kicker, from Trio's loop itself, which has already chosen
        how long its coming wait for I/O lasts: a shard's failure is then handed to the loop
        (``run_sync_soon``, which also cuts that wait short) instead of worked through here,
        where the replies and wake-ups it makes would wait for the next I/O or deadline
        (found by review: a request waited for retention's next pass)."""
        hosts, self.kicks = self.kicks, {}
        for host in hosts:
            try:
                host.committer.kick()
            except Exception as exc:  # a bug; the shard's batch would wait forever
                if in_loop:
                    host.token.run_sync_soon(host.fail_on_bug, exc, "waking its committer")
                else:
                    host.fail_on_bug(exc, "waking its committer")

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Open every shard, recover, serve until cancelled or SIGTERM/SIGINT; then finish the
        batches in flight, store a snapshot per shard and close the stores. ``task_status``
        gets the port actually listened on."""
        self.shards, self.epoch = prepare_data_dir(self.data_dir, self.requested_shards)
        kicker = _Kicker(self)
        trio.lowlevel.add_instrument(kicker)
        self.kicker = kicker
        try:
            await self._run(task_status)
        finally:
            self.kicker = None
            with contextlib.suppress(KeyError):  # (Trio dropped it if it raised)
                trio.lowlevel.remove_instrument(kicker)
            self.kick_committers()  # (closed committers wrote everything queued anyway)

    async def _run(self, task_status: trio.TaskStatus[int]) -> None:
        token = trio.lowlevel.current_trio_token()
        # Open from the start and through the close: a second SIGTERM (an impatient supervisor)
        # while the batches finish and the snapshots are written waits in the receiver
        # instead of killing the process half-way through the close.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:
                for index in range(self.shards):
                    self.hosts.append(await trio.to_thread.run_sync(self._open_shard, index, token))
                if self.freeze_recovered:
                    gc.collect()
                    gc.freeze()
                    # Fewer young collections: a create allocates a dozen short-lived containers
                    # (request, spec, records, reply), so with the default 700 the collector ran
                    # every few dozen creates and, the frozen state left out of its count of old
                    # objects, often went on to a full collection. Measured under create_many
                    # (perf samples of the node): ~17% of its CPU in the collector with the
                    # defaults, ~5% with 50,000. 10,000 costs about as little (node CPU per
                    # create within the noise of 50,000's) and bounds what garbage in a cycle
                    # can pin before a collection: the objects are small, but one may hold a
                    # payload of up to 256 KiB. (Refusals no longer make such cycles: see
                    # _error_reply and engine.shard._bare.)
                    gc.set_threshold(*NODE_GC_THRESHOLDS)
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    self.poller = ReadPoller(self.batch)
                    nursery.start_soon(self.poller.run)
                    for host in self.hosts:
                        # A shard's tasks stop that shard when they fail, never the node.
                        nursery.start_soon(host.guarded, host.loop)
                        nursery.start_soon(host.guarded, self._retain, host)
                    listeners = await nursery.start(
                        partial(trio.serve_tcp, self._serve_connection, self.port, host=self.host)
                    )
                    port = listeners[0].socket.getsockname()[1]
                    log.info(
                        "serving %d shards on %s:%d (epoch %d)",
                        self.shards,
                        self.host,
                        port,
                        self.epoch,
                    )
                    task_status.started(port)
                    async for signum in signals:
                        log.info("signal %d: stopping", signum)
                        break
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as closing:
                        # Consumed, not left queued: the receiver would hand them back to
                        # the default handler (death) as it closes.
                        closing.start_soon(_ignore_signals, signals)
                        await self._close()
                        closing.cancel_scope.cancel()

    def _open_shard(self, index: int, token: trio.lowlevel.TrioToken) -> ShardHost:
        path = self.data_dir / f"shard-{index:03d}"
        try:
            store = ShardStore.open(path, shard=index, shards=self.shards, epoch=self.epoch)
        except StoreError as exc:
            raise NodeError(f"shard {index}: {exc}") from exc
        recovered = store.load()
        replayed = 0
        replay_started = math.inf  # the tail's first record: after the snapshot's load

        def counted(tail: Iterable[Record]) -> Iterator[Record]:
            nonlocal replayed, replay_started
            replay_started = time.monotonic()
            for replayed, record in enumerate(tail, 1):  # noqa: B007 (counted as it goes)
                yield record

        opening = time.monotonic()
        engine, effects = ShardEngine.recover(
            counted(recovered.tail),
            snapshot=recovered.snapshot,
            directory=store,
            epoch=self.epoch,
            wall_ms=wall_ms(),
            mono_ms=mono_ms(),
            config=self.config,
        )
        opened = time.monotonic()
        replay_s = max(0.0, opened - replay_started)
        log.info(
            "shard %d: epoch %d, %d pending jobs, %d runs in flight, %d log records replayed "
            "(%.2f s of %.2f s)",
            index,
            self.epoch,
            recovered.counts.pending_jobs,
            recovered.counts.runs_in_flight,
            replayed,
            replay_s,
            opened - opening,
        )
        host = ShardHost(index, self, store, engine, token)
        # The replayed tail counts towards the next snapshot (else each crash replays it
        # again, and more), and its cost sets the cadence's estimate (the snapshot's load is
        # not counted: it is not the tail's, and the rest of the replay's work after the
        # last record is small).
        host.since_snapshot = replayed
        host.snapshots = self.snapshots.measured(replayed, replay_s * 1_000)
        host.committer = GroupCommitter(store, name=f"wal-commit-{index}", on_group=host.on_group)
        host.initial = effects
        return host

    async def _retain(self, host: ShardHost) -> None:
        """Run history retention (by age and count per job), in the background, by ranges.
        A store error on any pass is logged and retention tries again a period later (it
        deletes only what is past the policy, so a pass cut short loses nothing); the shard
        goes on serving."""
        while True:
            await trio.sleep(self.retain_every_s)
            if host.failed is not None:
                return
            try:
                more = True
                while more:  # a backlog: keep going, one bounded pass at a time
                    report = await trio.to_thread.run_sync(
                        host.store.retain, wall_ms(), self.retention
                    )
                    more = report.more
            except StoreError as exc:
                log.warning("shard %d: retention: %s", host.index, exc)

    async def _close(self) -> None:
        """The clean stop, once every task of the node is done: first every shard stops
        turning (the groups its committer still acknowledges only record their batches as
        durable: a decision made now could not be committed), then each committer writes what
        it holds, then each shard stores its final snapshot and closes its store."""
        for host in self.hosts:
            host.stopping = True
        for host in self.hosts:
            await trio.to_thread.run_sync(host.committer.close)
            await host.final_snapshot()
            await trio.to_thread.run_sync(host.store.close)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        conn = Connection(self, stream)
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    def host_of(self, job_id: str) -> ShardHost:
        return self.hosts[shard_of(job_id, self.shards)]

    # ------------------------------------------------------------------ effects to workers

    def dispatch(self, shard: int, effect: Dispatch) -> bool:
        """Push the run to its worker. True when that took one of the worker's free slots
        (False: the worker is not connected, or the push repeats one it may have); the
        caller then tells the other shards that its free slots changed (once a batch)."""
        session = self.workers.get(effect.worker_id)
        if session is None:
            return False  # gone: its lease lapses in the engine, which decides what follows
        t = effect.run
        if len(self.run_shards) >= MAX_REMEMBERED_RUNS:
            self.run_shards.clear()  # runs whose final report never came: a cache, not a record
        self.run_shards[t.run_id] = shard
        session.conn.send(
            {  # push("dispatch", run=...), built at once: one a run
                "push": "dispatch",
                "shard": shard,
                "seq": effect.seq,
                "run": {
                    "run_id": t.run_id,
                    "job_id": t.job_id,
                    "scheduled_ms": t.scheduled_ms,
                    "attempt": t.attempt,
                    "token": t.token,
                    "version": t.version,
                    "delivery": t.delivery,
                    "tier": t.tier,
                    "timeout_ms": t.timeout_ms,
                    "on_timeout": t.on_timeout,
                    "task": t.task,
                },
            }
        )
        # The shard that dispatched counted the credit; the others learn the new free count
        # (at their next turn, once however many dispatches happen meanwhile).
        if effect.again:
            return False  # a repeat (after a hello it crossed) takes no slot of its own
        session.free = max(0, session.free - 1)
        return True

    def kill(self, effect: Kill) -> None:
        session = self.workers.get(effect.worker_id)
        if session is not None:
            session.conn.send(
                push("kill", run_id=effect.run_id, token=effect.token, reason=effect.reason)
            )

    def refused(self, effect: Refused) -> None:
        session = self.workers.get(effect.worker_id)
        if session is not None:
            session.conn.send(
                push("refused", code=effect.error.code, message=clipped(str(effect.error)))
            )

    # ------------------------------------------------------------------ requests

    async def execute(self, conn: Connection, req: Request) -> Any:
        handler = _OPS.get(req.op)
        if handler is None:
            raise ProtocolError("unknown_op", f"unknown op {req.op!r}", req.id)
        self._check_worker(conn, req)
        return await handler(self, conn, req.args)

    def execute_now(self, conn: Connection, req: Request) -> Any:
        """An op that never waits (a worker's report, a ping): answered inline by the reader,
        without a task of its own (most of a busy worker's traffic)."""
        self._check_worker(conn, req)
        return _QUICK_OPS[req.op](self, conn, req.args)

    def report_now(
        self, conn: Connection, req: Request, answer: Callable[[Exception | None], None]
    ) -> None:
        """Take a worker's final reports now; ``answer`` once they are durable."""
        self._check_worker(conn, req)
        _REPORT_OPS[req.op](self, conn, req.args, answer)

    @staticmethod
    def _check_worker(conn: Connection, req: Request) -> None:
        if req.op.startswith("worker.") and req.op != "worker.hello" and conn.worker is None:
            raise ProtocolError("not_a_worker", "say worker.hello first", req.id)

    def _ping(self, conn: Connection, args: dict[str, Any]) -> Any:
        return {"shards": self.shards, "epoch": self.epoch, "time_ms": wall_ms()}

    # ---- jobs

    def job_spec(self, raw: dict[str, Any]) -> JobSpec:
        if "id" not in raw:
            raw = {**raw, "id": new_job_id(wall_ms(), os.urandom(10))}
        return validate_job(raw, now_ms=wall_ms())

    async def _create(self, conn: Connection, args: dict[str, Any]) -> Any:
        spec = self.job_spec(args["spec"])
        reply = await self.host_of(spec.id).request(lambda rid: CreateJob(rid, spec))
        return _job_result(_unwrap(reply))

    async def _create_many(self, conn: Connection, args: dict[str, Any]) -> Any:
        specs = args["specs"]
        results: list[dict[str, Any] | None] = [None] * len(specs)
        left = [len(specs)]
        all_answered = trio.Event()

        def settle(i: int, result: dict[str, Any]) -> None:
            results[i] = result
            left[0] -= 1
            if not left[0]:
                all_answered.set()

        # Bytes of error text this reply may still carry in full: 10,000 errors of a full
        # message and field each (up to ~4.8 KB in UTF-8) would pass the frame limit, and the
        # whole batch's answer would be lost for an `internal` error (found by review).
        # Beyond it, each error keeps its code and a short message and field.
        error_budget = [CREATE_MANY_ERROR_BYTES]

        def failed(exc: Exception) -> dict[str, Any]:
            field = exc.field if isinstance(exc, EngineError | BadArgs) else None
            message = exc.message if isinstance(exc, BadArgs) else str(exc)
            code = exc.code if isinstance(exc, EngineError | BadArgs | StoreError) else "internal"
            body = error_body(code, message, field)
            if error_budget[0] <= 0:
                body["message"] = clipped(body["message"], CREATE_MANY_SHORT_MESSAGE)
                if body["field"] is not None:
                    body["field"] = clipped(body["field"], CREATE_MANY_SHORT_FIELD)
            else:
                error_budget[0] -= len(body["message"].encode()) + len(
                    (body["field"] or "").encode()
                )
            return {"ok": False, "error": body}

        def answer_for(indices: list[int]) -> ReplyCallback:
            def answer(outcome: Reply | StoreError) -> None:
                try:
                    if isinstance(outcome, StoreError):
                        raise outcome
                    answers = _unwrap(outcome)["results"]
                except (EngineError, StoreError) as exc:
                    for i in indices:
                        settle(i, failed(exc))
                    return
                # (settled here in one go: this runs for every spec of a bulk create)
                for i, one in zip(indices, answers, strict=True):
                    results[i] = (
                        failed(one)
                        if isinstance(one, EngineError)
                        else {"ok": True, "result": _job_result(one)}
                    )
                left[0] -= len(indices)
                if not left[0]:
                    all_answered.set()

            return answer

        # Specs go to their shards a chunk at a time, as one CreateJobs command per shard
        # (in the specs' order within it): the engine makes one reply for the chunk, and the
        # shard's loop answers it by callback (no task per spec, no reply, slot and callback
        # per spec either). Between chunks the rest of the node runs.
        hosts = self.hosts
        groups: dict[int, tuple[list[int], list[JobSpec]]] = {}

        def send() -> None:
            for index, (indices, chunk) in groups.items():
                hosts[index].request_then(
                    partial(CreateJobs, specs=tuple(chunk)), answer_for(indices)
                )
            groups.clear()

        for i, raw in enumerate(specs):
            if i and i % CREATE_MANY_CHUNK == 0:
                send()
                await trio.lowlevel.checkpoint()
            try:
                if not isinstance(raw, dict):
                    raise BadArgs(f"specs[{i}]: must be a map", None, f"specs[{i}]")
                spec = self.job_spec(raw)
                group = groups.get(index := shard_of(spec.id, self.shards))
                if group is None:
                    group = groups[index] = ([], [])
                group[0].append(i)
                group[1].append(spec)
            except (EngineError, BadArgs, StoreError) as exc:
                settle(i, failed(exc))
        send()
        if specs:
            await all_answered.wait()
        return {"results": results}

    async def _update(self, conn: Connection, args: dict[str, Any]) -> Any:
        """A partial update, merged into the job's stored spec and applied only if that is
        still the job's current version (the engine checks): else it is merged again into the
        newer one. Two updates of one job in flight together both count (found by me: each
        merged into the same stored spec, and the second undid the first's change). With
        ``if_version`` the caller's own version must be current, or ``conflict``."""
        job_id = validate_job_id(args["id"])
        if_version = args.get("if_version")
        if if_version is not None and if_version < 1:
            raise BadArgs("if_version: must be >= 1", None, "if_version")
        host = self.host_of(job_id)
        # A cancelled job (its spec still stored) is not_found, as the engine would answer,
        # before its changes are checked: an invalid change to it was answered invalid_job
        # (found by review).
        host.engine.next_owed(job_id)  # raises JobNotFound
        deadline = trio.current_time() + UPDATE_MERGE_S
        while True:
            stored = host.store.job(job_id)
            if stored is None:
                raise JobNotFound(f"no job {job_id!r}", field="id")
            base = stored.version
            if if_version is None or base == if_version:
                current = validate_job(stored.spec, now_ms=wall_ms())
                spec = apply_update(current, args["changes"], now_ms=wall_ms())
                reply = await host.request(partial(UpdateJob, spec=spec, expected_version=base))
                if (
                    not isinstance(reply.error, VersionConflict)
                    or if_version is not None  # the caller's version is not current
                    or trio.current_time() > deadline
                ):
                    return _job_result(_unwrap(reply))
            elif base > if_version or trio.current_time() > deadline:
                # Past the caller's version, or the store never reached it.
                raise VersionConflict(
                    f"job {job_id!r} is at version {base}, not {if_version}",
                    field="if_version",
                )
            else:
                # The store is behind the caller's version: wait for it only if the engine
                # holds that very version (not durable yet; its answer comes once it is). A
                # version nobody made is a conflict at once: waiting UPDATE_MERGE_S for it
                # outlasted the client's own timeout, which then said `timeout` instead
                # (found by review).
                held = _unwrap(await host.request(lambda rid: GetJob(rid, job_id)))["version"]
                if held != if_version:
                    raise VersionConflict(
                        f"job {job_id!r} is at version {held}, not {if_version}",
                        field="if_version",
                    )
                continue  # its write is durable now: merge into it
            # A newer version is on its way to the disk (the store has only durable ones):
            # merge into it once it is there.
            await trio.sleep(UPDATE_RETRY_S)

    async def _cancel(self, conn: Connection, args: dict[str, Any]) -> Any:
        job_id = validate_job_id(args["id"])
        stop = bool(args.get("stop_running", False))
        reply = await self.host_of(job_id).request(lambda rid: CancelJob(rid, job_id, stop))
        return {"job_id": job_id, "cancelled": bool(_unwrap(reply).get("cancelled"))}

    async def _pause(self, conn: Connection, args: dict[str, Any]) -> Any:
        job_id = validate_job_id(args["id"])
        reply = await self.host_of(job_id).request(lambda rid: PauseJob(rid, job_id))
        return _job_result(_unwrap(reply))

    async def _resume(self, conn: Connection, args: dict[str, Any]) -> Any:
        job_id = validate_job_id(args["id"])
        reply = await self.host_of(job_id).request(lambda rid: ResumeJob(rid, job_id))
        return _job_result(_unwrap(reply))

    async def _get(self, conn: Connection, args: dict[str, Any]) -> Any:
        job_id = validate_job_id(args["id"])
        host = self.host_of(job_id)
        # The engine describes the job (version, next fire, paused, runs); the store holds its
        # spec. Read engine first, store after, an update made durable between the two paired
        # one version's description with the next one's spec (found by review: 3% of gets
        # under a stream of updates). So the store is read first: its version and spec are one
        # record, and the engine, asked after, answers once everything it had applied is
        # durable, that version's write included (the store shows a write a moment before its
        # fsync returns). When the engine is a version ahead by then, again, a few times; then
        # the stored pair goes out with the newer description.
        for attempt in range(GET_TRIES):
            stored = host.store.job(job_id)
            reply = await host.request(lambda rid: GetJob(rid, job_id))
            result = _job_result(_unwrap(reply))
            if stored is not None and (
                stored.version == result["version"] or attempt == GET_TRIES - 1
            ):
                result["version"], result["spec"] = stored.version, stored.spec
                return result
        raise JobNotFound(f"job {job_id!r} is not stored yet: read it again", field="id")

    async def _list(self, conn: Connection, args: dict[str, Any]) -> Any:
        limit = args.get("limit", 100)
        shard, after = 0, None
        if "after" in args:
            try:
                # Only what job.list hands out: int() alone took " 1", "1_0", "+1" and other
                # scripts' digits (found by review).
                if _CURSOR.fullmatch(args["after"]) is None:
                    raise ValueError(args["after"])
                text_shard, text_key = args["after"].split(":")
                shard, after = int(text_shard), int(text_key)
                # a shard of this node and a key the store can page on from (key + 1 fits
                # its signed 64-bit keys): no wrap to the last shard, no struct.error
                if not (0 <= shard < self.shards and 0 <= after < 2**63 - 1):
                    raise ValueError(args["after"])
            except ValueError:
                raise BadArgs("after: not a cursor from job.list", None, "after") from None
        jobs: list[dict[str, Any]] = []
        cursor = None
        while shard < self.shards and len(jobs) < limit:
            page = self.hosts[shard].store.jobs(after=after, limit=limit - len(jobs))
            for job in page:
                jobs.append(_stored_job(job))
                cursor = f"{shard}:{job.key}"
            if len(page) < limit - len(jobs) + len(page):
                shard, after = shard + 1, None
        return {"jobs": jobs, "next": cursor if len(jobs) >= limit else None}

    async def _preview(self, conn: Connection, args: dict[str, Any]) -> Any:
        count = args.get("count", 5)
        job_id = args.get("id")
        if "schedule" in args:
            schedule = args["schedule"]
        elif job_id is not None:
            host = self.host_of(validate_job_id(job_id))
            # As job.get (found by the fourth adversarial pass): a cancelled job is not found,
            # and a paused one says so, its fires waiting for a resume.
            paused = host.engine.paused(job_id)
            owed = host.engine.next_owed(job_id)
            stored = host.store.job(job_id)
            if stored is None:
                raise JobNotFound(f"no job {job_id!r}", field="id")
            schedule = stored.spec["schedule"]
        else:
            raise BadArgs("give an id or a schedule", None, "schedule")
        now = wall_ms()
        by_id = job_id is not None and "schedule" not in args
        # A one-shot whose time is past but still owed (paused, or its tier full) fires at
        # the resume, or once there is room, whatever the policy: shown from that time, not
        # from now, where it was missing (found by review). Every other schedule from now on,
        # now included, as a create owes them: an `every` without `start` fires at its
        # creation, which a preview strictly after now left out (found by review).
        past_at = by_id and "at" in schedule and owed is not None and owed < now
        start = owed - 1 if past_at and owed is not None else now - 1
        # A one-shot schedule previewed for a create: a time already past is owed, and fires
        # at once (found by review: shown with no fire at all).
        new_at = not by_id and isinstance(schedule, dict) and "at" in schedule
        if new_at:
            start = -1  # (at is 1970 or later: every one-shot time is after this)
        result = preview(schedule, count, start, job_id=job_id, created_ms=now).to_dict()
        if new_at and result["fires"] and result["fires"][0]["at_ms"] < now:
            result["fires"][0]["note"] = "past: fires at once"
        if by_id:
            result["paused"] = paused
            if past_at and result["fires"]:
                result["fires"][0]["note"] = (
                    "past: fires at the resume" if paused else "past: fires when its tier has room"
                )
        return result

    # ---- runs

    def _run_where(self, rid: str) -> tuple[ShardHost, int, int, str]:
        job_id, at = parse_run_id(rid)
        host = self.host_of(job_id)
        key = host.store.key_of(job_id)
        if key is None:
            raise JobNotFound(f"no job {job_id!r}", field="run_id")
        return host, key, at, job_id

    async def _run_get(self, conn: Connection, args: dict[str, Any]) -> Any:
        host, key, at, job_id = self._run_where(args["run_id"])
        record = host.store.run(key, at)
        if record is None:
            raise RunNotFound(f"no run {args['run_id']!r}", field="run_id")
        result = _run_result(job_id, record)
        if host.engine.marked_running(args["run_id"]):
            result["marked_running"] = True  # final TIMED_OUT, its task still runs (mark)
        if host.engine.task_stopping(args["run_id"]):
            result["stopping"] = True  # final by a stop (a cancel...), its task not ended yet
        waiting = host.engine.waiting_reason(args["run_id"])
        if waiting is not None:
            result["waiting"] = waiting  # found by the fourth adversarial pass: PENDING, no why
        return result

    async def _run_history(self, conn: Connection, args: dict[str, Any]) -> Any:
        job_id = validate_job_id(args["job_id"], field="job_id")
        host = self.host_of(job_id)
        key = host.store.key_of(job_id)
        if key is None:
            raise JobNotFound(f"no job {job_id!r}", field="job_id")
        runs = host.store.last_runs(key, args.get("last", 20))
        results = [_run_result(job_id, r) for r in runs]
        for result in results:
            # As run.get: a PENDING run that is due says why no worker took it (found by the
            # fifth adversarial pass: `tickwheel runs` never showed it). Only PENDING records
            # are asked, so a long history costs one dict lookup per pending run.
            if result["state"] == "PENDING":
                waiting = host.engine.waiting_reason(result["run_id"])
                if waiting is not None:
                    result["waiting"] = waiting
        return {"runs": results}

    async def _run_skips(self, conn: Connection, args: dict[str, Any]) -> Any:
        """Fire times a job owed and did not run, with the reason (DESIGN's SKIPPED): the
        ``skip`` records of its history, newest first (found by the fourth adversarial pass:
        no operation showed them, so a user could not learn why a time did not run)."""
        job_id = validate_job_id(args["job_id"], field="job_id")
        host = self.host_of(job_id)
        key = host.store.key_of(job_id)
        if key is None:
            raise JobNotFound(f"no job {job_id!r}", field="job_id")
        last = args.get("last", 20)
        skips: list[dict[str, Any]] = []
        cursor: bytes | None = None
        while len(skips) < last:  # notes share the family: page past them
            # By stored key, not "before the oldest time seen": entries share times, and a
            # page that ended inside a group left the rest of it out (found by review).
            page, cursor = host.store.history_page(key, 256, cursor=cursor)
            skips += [_skip_result(r) for r in page if r.get("t") == "skip"]
            if cursor is None:
                break
        return {"skips": skips[:last]}

    async def _run_logs(self, conn: Connection, args: dict[str, Any]) -> Any:
        host, key, at, _job_id = self._run_where(args["run_id"])
        page = host.store.logs.read(
            key, at, cursor=args.get("offset", 0), limit=args.get("limit", 256)
        )
        record = host.store.run(key, at)
        if record is None and not page.chunks:
            # As run.get: a run never fired (or removed by retention, its logs with it). Not
            # an empty page, on which a follower would wait for a final state forever.
            raise RunNotFound(f"no run {args['run_id']!r}", field="run_id")
        return {
            "chunks": [
                {
                    "seq": c.seq,
                    "stream": c.stream,
                    "attempt": c.attempt,
                    "data": c.data,
                    "dropped": c.dropped,
                }
                for c in page.chunks
            ],
            "cursor": page.cursor,
            "at_end": page.at_end,
            "state": None if record is None else record["state"],
            # A run final as TIMED_OUT under on_timeout=mark whose task still runs (and
            # writes output): a follower goes on until this turns false.
            "marked_running": host.engine.marked_running(args["run_id"]),
            # Final by the engine's decision (a cancel with stop_running, cancel_previous) and
            # its task asked to stop: it may write through its stop's grace (found by review:
            # a follower ended at the CANCELLED record and missed the task's last lines).
            "stopping": host.engine.task_stopping(args["run_id"]),
        }

    # ---- workers

    async def _hello(self, conn: Connection, args: dict[str, Any]) -> Any:
        worker_id = args["worker_id"]
        tiers = tuple(args["tiers"])
        if not worker_id or len(worker_id) > 200:
            raise BadArgs("worker_id: 1-200 characters", None, "worker_id")
        if not tiers or not all(isinstance(t, str) and t for t in tiers):
            raise BadArgs("tiers: a non-empty list of tier names", None, "tiers")
        slots = args["slots"]
        if not 0 <= slots <= MAX_WORKER_SLOTS:
            raise BadArgs(f"slots: must be in 0..{MAX_WORKER_SLOTS}", None, "slots")
        held = _held(args.get("held", []))
        instance = args.get("instance", "")
        if len(instance) > 200:
            raise BadArgs("instance: at most 200 characters", None, "instance")
        seen = _seen(args.get("seen", []), self.shards)
        # Every argument checked before anything changes: a refused hello must not take the
        # worker id (and its dispatches) from the connection that has it (found by review).
        by_shard = self._by_shard(held)
        now = mono_ms()
        old = self.workers.get(worker_id)
        if old is not None and old.holds_id_against(
            conn, instance, now, self.config.worker_lease_ms
        ):
            raise WorkerIdInUse(
                f"worker_id: {worker_id!r} is another live worker's (its process "
                f"{old.instance!r}, heard {now - old.heard_ms} ms ago): give each worker its "
                "own id",
                None,
                "worker_id",
            )
        if old is not None and old.conn is not conn:
            old.conn.worker = None  # the worker reconnected: the old connection is not it
        session = WorkerSession(worker_id, tiers, slots, conn, instance, now)
        conn.worker = session
        self.workers[worker_id] = session
        for host, mine in zip(self.hosts, by_shard, strict=True):
            host.tell(WorkerHello(worker_id, tiers, slots, mine, instance, seen[host.index]))
        return {"lease_ms": self.config.worker_lease_ms, "shards": self.shards}

    def _by_shard(self, held: tuple[tuple[str, int], ...]) -> list[tuple[tuple[str, int], ...]]:
        """The runs a worker holds, split by the shard each belongs to (index = shard).
        Raises :class:`BadArgs` (field ``held[i]``) for an entry whose run id is not one."""
        split: list[list[tuple[str, int]]] = [[] for _ in self.hosts]
        for i, (rid, token) in enumerate(held):
            try:
                shard = shard_of_run(rid, self.shards)
            except EngineError as exc:
                raise BadArgs(f"held[{i}]: {exc}", None, f"held[{i}]") from exc
            split[shard].append((rid, token))
        return [tuple(runs) for runs in split]

    def _heartbeat(self, conn: Connection, args: dict[str, Any]) -> Any:
        session = conn.worker
        assert session is not None
        held = _held(args.get("held", []))
        raw_seen = args.get("seen")
        seen = _seen(raw_seen, self.shards) if raw_seen is not None else [-1] * self.shards
        by_shard = self._by_shard(held)  # (refuses a held entry that is no run id)
        # Heard only once the heartbeat is known good: one refused renews nothing in the
        # engine, so it must not keep the id held against another process either (found by
        # review: a worker sending only bad heartbeats had its runs lost and its id blocked).
        session.heard_ms = mono_ms()
        for host, mine in zip(self.hosts, by_shard, strict=True):
            host.tell(Heartbeat(session.worker_id, mine, session.instance, seen[host.index]))
        return {"lease_ms": self.config.worker_lease_ms}

    def _pull(self, conn: Connection, args: dict[str, Any]) -> Any:
        session = conn.worker
        assert session is not None
        credits = _checked_credits(args["credits"])
        session.free = credits
        for host in self.hosts:
            host.credits_changed_for(session.worker_id)
        return {}

    def _started(self, conn: Connection, args: dict[str, Any]) -> Any:
        session = conn.worker
        assert session is not None
        rid = args["run_id"]
        self._host_of_run(rid).tell(ReportStarted(session.worker_id, rid, args["token"]))
        return {}

    def _finished(self, conn: Connection, args: dict[str, Any], answer: DurableAnswer) -> None:
        session = conn.worker
        assert session is not None
        rid = args["run_id"]
        # Checked before the report is taken: refused after it, the report would be applied
        # and the worker told it was not, and send it again (found by review).
        if "credits" in args:
            _checked_credits(args["credits"])
        host = self._host_of_run(rid, final=True)
        host.tell(
            ReportFinished(
                session.worker_id, rid, args["token"], args["outcome"], args.get("exit_code")
            )
        )
        if "credits" in args:  # the worker's free slots after this run: a pull in the report
            self._pull(conn, {"credits": args["credits"]})
        self._when_durable([host], answer)

    def _finished_many(self, conn: Connection, args: dict[str, Any], answer: DurableAnswer) -> None:
        """``worker.finished`` for several runs: every report is checked before any is taken
        (a malformed one refuses the whole request, nothing half-applied), then each goes to
        its shard as its own report would; answered once every shard has them durable."""
        session = conn.worker
        assert session is not None
        reports = args["reports"]
        if len(reports) > MAX_BATCH:
            raise BadArgs(f"reports: at most {MAX_BATCH} per request", None, "reports")
        credits = args.get("credits")
        if credits is not None:
            _checked_credits(credits)
        commands = [_finished_report(session.worker_id, i, r) for i, r in enumerate(reports)]
        shards = []
        for i, command in enumerate(commands):
            try:
                shards.append(self._run_shard(command.run_id))
            except EngineError as exc:
                field = f"reports[{i}].run_id"
                raise BadArgs(f"{field}: {exc}", None, field) from None
        # Checked whole: now each report goes to its shard, as its own worker.finished would
        # (in order; each shard's share handed over at once).
        by_shard: list[list[Command]] = [[] for _ in self.hosts]
        run_shards = self.run_shards
        for command, shard in zip(commands, shards, strict=True):
            run_shards.pop(command.run_id, None)
            by_shard[shard].append(command)
        for host, mine in zip(self.hosts, by_shard, strict=True):
            host.tell_many(mine)
        if credits is not None:
            self._pull(conn, {"credits": credits})
        self._when_durable(
            [h for h, mine in zip(self.hosts, by_shard, strict=True) if mine], answer
        )

    @staticmethod
    def _when_durable(hosts: list[ShardHost], answer: DurableAnswer) -> None:
        """``answer(None)`` once what was told to ``hosts`` so far is durable (the engine
        answers a :class:`Sync` only then), or ``answer(failure)`` with the first shard's
        failure: the worker then keeps its reports and sends them again."""
        left = len(hosts)
        failure: Exception | None = None

        def one(outcome: Reply | StoreError) -> None:
            nonlocal left, failure
            left -= 1
            if failure is None:
                if isinstance(outcome, StoreError):
                    failure = outcome
                elif outcome.error is not None:
                    failure = outcome.error
            if not left:
                answer(failure)

        if not hosts:
            answer(None)
        for host in hosts:
            host.request_then(Sync, one)

    def _host_of_run(self, rid: str, *, final: bool = False) -> ShardHost:
        """The shard of a run a worker reports on: known from its dispatch (no parse of the
        run id and hash of the job id per report), else computed (a run dispatched before a
        restart, or a malformed id, which the engine then refuses)."""
        shard = self._run_shard(rid)
        if final:
            self.run_shards.pop(rid, None)
        return self.hosts[shard]

    def _run_shard(self, rid: str) -> int:
        """The shard of run ``rid``: remembered from its dispatch, else computed (raises the
        engine's error for a malformed id)."""
        shard = self.run_shards.get(rid)
        return shard_of_run(rid, self.shards) if shard is None else shard

    def _output(self, conn: Connection, args: dict[str, Any]) -> Any:
        stream = args["stream"]
        if stream not in ("stdout", "stderr"):
            raise BadArgs("stream: must be stdout or stderr", None, "stream")
        rid = args["run_id"]
        host, key, at, _job_id = self._run_where(rid)
        # Only a run that exists gets output (else it would be kept for good: retention drops
        # a run's logs with the run). A run dispatched by this node is known without a read;
        # others (dispatched before a restart) cost one get. A run leaves only once its
        # record is durable, so the store has it.
        if rid not in self.run_shards and host.store.run(key, at) is None:
            raise RunNotFound(f"no run {rid!r}", field="run_id")
        # Output is kept per attempt, whatever the token: a superseded attempt's output is its
        # own history (its reports never change the run's state; its output never mixes with
        # another attempt's, since readers see the attempt of every chunk). With an offset, a
        # chunk sent again after a lost answer is not stored twice.
        # An unsynced RocksDB write of one chunk: cheaper inline than a thread hop.
        host.store.logs.append(
            key,
            at,
            stream,
            args["data"],
            attempt=args.get("attempt", 1),
            offset=args.get("offset"),
        )
        return {}


# Ops answered inline as they are read (by the read poller or the connection's task: they never
# wait).
_QUICK_OPS: dict[str, Callable[[Node, Connection, dict[str, Any]], Any]] = {
    "ping": Node._ping,
    "worker.heartbeat": Node._heartbeat,
    "worker.pull": Node._pull,
    "worker.started": Node._started,
    "worker.output": Node._output,
}

DurableAnswer = Callable[[Exception | None], None]

# A worker's final reports: taken inline as they are read, like the quick ops, but answered only
# once durable (:meth:`Node._when_durable`).
_REPORT_OPS: dict[str, Callable[[Node, Connection, dict[str, Any], DurableAnswer], None]] = {
    "worker.finished": Node._finished,
    "worker.finished_many": Node._finished_many,
}

_OPS: dict[str, Callable[[Node, Connection, dict[str, Any]], Any]] = {
    "job.create": Node._create,
    "job.create_many": Node._create_many,
    "job.update": Node._update,
    "job.cancel": Node._cancel,
    "job.pause": Node._pause,
    "job.resume": Node._resume,
    "job.get": Node._get,
    "job.list": Node._list,
    "job.preview": Node._preview,
    "run.get": Node._run_get,
    "run.history": Node._run_history,
    "run.skips": Node._run_skips,
    "run.logs": Node._run_logs,
    "worker.hello": Node._hello,
}


# =============================================================================== wire shapes


def turn_length(pending: Sequence[Command]) -> int:
    """How many of ``pending`` one turn takes: commands up to :data:`TURN_COMMANDS`, a
    :class:`CreateJobs` counting as its specs (a turn holds at most that many creates however
    they came), and always at least one command. O(commands taken)."""
    if len(pending) <= 1:
        return len(pending)
    weight = 0
    for i, command in enumerate(pending):
        weight += len(command.specs) if type(command) is CreateJobs else 1
        if weight > TURN_COMMANDS:
            return max(1, i)
    return len(pending)


def _unwrap(reply: Reply) -> dict[str, Any]:
    if reply.error is not None:
        raise reply.error
    assert reply.result is not None
    return reply.result


def _job_result(described: dict[str, Any]) -> dict[str, Any]:
    nxt = described.get("next_fire_ms")
    return {
        "job_id": described["id"],
        "version": described.get("version"),
        "next_fire_ms": nxt,
        "next_fire": None if nxt is None else format_utc(nxt),
        "paused": described.get("paused"),
        "active_runs": described.get("active_runs", []),
        **({"waiting": described["waiting"]} if "waiting" in described else {}),
    }


def _stored_job(job: Any) -> dict[str, Any]:
    pos = job.position or {}
    nxt = pos.get("next")
    return {
        "job_id": job.id,
        "version": job.version,
        "schedule": job.spec.get("schedule"),
        "next_fire_ms": nxt,
        "next_fire": None if nxt is None else format_utc(nxt),
        "paused": bool(pos.get("paused")),
        "cancelled": bool(pos.get("gone")),
    }


def _run_result(job_id: str, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run_id(job_id, r["at"]),
        "job_id": job_id,
        "state": r["state"],
        "scheduled_ms": r["at"],
        "scheduled_at": format_utc(r["at"]),
        "attempt": r["att"],
        "token": r["tok"],
        "worker": r["w"],
        "exit_code": r["exit"],
        "why": r["why"],
        "version": r["ver"],
        # (final runs recorded since it; null before, and for a run not final)
        "ended_ms": r.get("end"),
        "ended_at": None if r.get("end") is None else format_utc(r["end"]),
    }


def _skip_result(record: dict[str, Any]) -> dict[str, Any]:
    """A ``skip`` record as ``run.skips`` answers it."""
    count = int(record.get("n", -1))
    return {
        "from_ms": record["lo"],
        "to_ms": record["hi"],
        "from": format_utc(record["lo"]),
        "to": format_utc(record["hi"]),
        "count": None if count < 0 else count,  # -1: every time in the span, not counted
        "reason": record.get("why"),
        "source": record.get("src"),
    }


def _seen(raw: list[Any], shards: int) -> list[int]:
    """A hello's (or heartbeat's) ``seen``: ``[[shard, seq], ...]``, the newest dispatch
    number the worker received of each shard (:class:`engine.effects.WorkerHello`); by
    shard, 0 where absent. Entries for shards this node does not have are ignored: a worker
    that heard an earlier node at this address (another shard count) must still get in."""
    out = [0] * shards
    for i, item in enumerate(raw[:MAX_LIMIT]):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or type(item[0]) is not int  # (not isinstance: a bool is no integer here)
            or type(item[1]) is not int
            or item[1] < 0
        ):
            raise BadArgs(f"seen[{i}]: must be [shard, seq], seq >= 0", None, f"seen[{i}]")
        if 0 <= item[0] < shards:
            out[item[0]] = max(out[item[0]], item[1])
    return out


def _checked_credits(credits: int) -> int:
    """A worker's free slots as a request states them (``worker.pull``, and the pull riding in
    a final report), or :class:`BadArgs` naming ``credits``."""
    if not 0 <= credits <= MAX_WORKER_SLOTS:
        raise BadArgs(f"credits: must be in 0..{MAX_WORKER_SLOTS}", None, "credits")
    return credits


def _held(raw: list[Any]) -> tuple[tuple[str, int], ...]:
    # Read whole (the codec bounds a list): the worker's own list of what it runs. Cut at
    # 10,000, the runs past the cut counted as lost, and a worker holding more had them
    # handed out again at every heartbeat while they ran (found by review).
    out: list[tuple[str, int]] = []
    for i, item in enumerate(raw):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or type(item[1]) is not int  # (not isinstance: a bool is no token)
        ):
            raise BadArgs(f"held[{i}]: must be [run_id, token]", None, f"held[{i}]")
        out.append((item[0], item[1]))
    return tuple(out)
