"""The state machine of one shard: jobs, runs, delivery modes, timeouts and policies.

Owns every decision a node makes for a shard: when a job fires, what is persisted before what,
which worker gets which run, when a lease or a timeout has lapsed, what a handler does, what
recovery does with runs that were in flight. Commands, durable-acknowledgements and the time go
in (:meth:`ShardEngine.handle`, :meth:`ShardEngine.tick`); effects come out (records to persist,
runs to dispatch, replies, kills, cross-shard triggers). Must never do I/O, read a clock or draw
randomness: the Trio node and the SimPy harness drive the very same code.

Every state change is written as a record in the same call, and every record passes through
:meth:`ShardEngine._apply`: recovery rebuilds from them alone, so a recovered engine is the fold
of its durable records (DESIGN.md, "Delivery semantics"). Live, a run's fields are set on the
object the record is made from, and ``_apply`` only keeps the bookkeeping; the recovery tests
compare a live engine with one rebuilt from its records.

Memory (DESIGN.md, "Memory budget"): a job is not an object. Its hot fields are columns indexed
by its dense key (version ``uint32``, profile ``int32``, flags ``uint8``) and its next fire time
is its entry in its tier's timing wheel, about 25 bytes a pending job in all. What many jobs
share (schedule, policy, ``after``) is one interned profile. The id, the task and the labels
stay in the store: the engine asks its :class:`~engine.directory.JobDirectory` for them when a
command names a job, when a run is claimed and when a report arrives, never when firing. Only
runs not final, jobs with runs, paused jobs and jobs whose records are not durable yet have
Python objects or dict entries.

The rules, in short (the table of run states is :data:`engine.runs.TRANSITIONS`):

* Firing creates the run PENDING and advances the job in one batch; the run is handed out only
  once that batch is durable, and never before its time. With fire-ahead
  (``EngineConfig.fire_ahead_ms``) a job fires up to that much before its time, so that its
  batch is durable by then; an overlap rule that depends on a run still in flight is decided
  at the time itself (``_deferred``).
* at-most-once: the CLAIMED record is durable before the run is sent. Retries only after a
  confirmed final report. A run whose worker vanished is LOST after the reattach grace.
* at-least-once: sent when claimed, the claim persisted in the same call's batch. Until a final
  state is durable, it goes out again (attempt + 1, a higher token) when its worker's lease
  lapses or after a restart's reattach grace.
* Replies to job commands leave only after their batch is durable.
* Every owed fire time ends up as a run or inside a ``skip`` record with its reason.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from engine import records as rec
from engine.directory import JobDirectory, MemoryDirectory
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
    RunTicket,
    Sync,
    Trigger,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.errors import (
    EngineError,
    EngineStateError,
    EngineUsageError,
    JobExists,
    JobNotFound,
    StaleEpoch,
    TimeWentBackwards,
    VersionConflict,
)
from engine.frozen import rebuilt_by_init
from engine.jobs import (
    POLICY_KEYS,
    JobSpec,
    Policy,
    parse_policy,
    retry_delay_ms,
    stored_policy,
)
from engine.memo import remember
from engine.records import ACCT_EXHAUSTED, Record
from engine.runs import (
    FINAL_VALUES,
    IN_FLIGHT_VALUES,
    RunEvent,
    RunState,
    fencing_token,
    parse_run_id,
    run_id,
    transition,
)
from engine.schedules import AtSchedule, EverySchedule, Schedule, parse_schedule
from engine.snapshot import Snapshot
from engine.wheel import NOT_PENDING, TimingWheel

RunRef = tuple[int, int]  # (job key, scheduled ms)

# The trusted wall-minus-monotonic offset may grow by 1 ms per this many ms (NTP slews at
# most 0.5 ms per s): a real forward correction is followed slowly, a jump never.
_SLEW_DIVISOR = 1000
#: while the wall clock is set back, the engine is woken at least this often (ms): a setback
#: undone lets owed fires go at once
_SETBACK_POLL_MS = 1000
#: ... if it is set back by more than this (ms): reading the two clocks a moment apart, each
#: rounded to the ms, makes their offset wander by a millisecond or so all the time, and the
#: poll is not for that (a correction this small seen late delays a fire by as much)
_SETBACK_NOISE_MS = 50
#: entries of ShardEngine._trigger_at past which those already in the past are dropped
_TRIGGER_AT_PRUNE = 1024
#: entries of ShardEngine._stopping_final past which those past their time are dropped
_STOPPING_PRUNE = 1024
#: milliseconds after now a triggered run's time is looked for in
_TRIGGER_SEARCH_MS = 64
#: how long after the wall clock was set back a step forward back to where it was is taken for
#: a correction rather than a jump (ms)
_SETBACK_MEMORY_MS = 600_000

# Job flags (the uint8 column).
_PAUSED = 1
#: _Run.sent of a dispatch held until its batch is durable: above every Dispatch.seq
_UNSENT = 1 << 63
_GONE = 2  # cancelled; the key stays, so that the id can be created again as a new version
_LATE_PAUSED = 4  # fires missed so far were missed while paused (set by resume)
#: The job's next fire time is a one-shot time already past that a create or update asked
#: for: it runs however late, whatever the catch-up policy (which is about times the scheduler
#: missed, while down or paused, not a time just asked for). Persisted as ``why: "asked"``.
_ASKED = 8
#: A pos record's ``why`` by the job's flags ``& (_ASKED | _LATE_PAUSED)``: the reason late
#: fires would be skipped for, or ``asked`` (they are not).
_POS_WHY: Final = {
    0: "catchup",
    _LATE_PAUSED: "paused",
    _ASKED: "asked",
    _ASKED | _LATE_PAUSED: "asked",
}

#: The engine's guards that :attr:`EngineConfig.mutants` may switch off.
ENGINE_MUTANTS = frozenset(
    {
        "claim-after-fire",
        "no-redispatch",
        "report-ack-before-durable",
        "no-stop-wait",
        "lose-fire",
        "eager-catchup",
        "alo-lost",
        "retry-no-backoff",
        "unpinned",
        "amo-no-grace",
        "no-trigger",
        "trigger-no-dedupe",
    }
)


#: the longest fire-ahead window: its decisions (overlap, pause, update) are taken early, so
#: it stays a short moment, well under any schedule's period a user would notice
MAX_FIRE_AHEAD_MS: Final = 10_000
#: the fire-ahead window a node runs with (and the simulation, which plays nodes): long enough
#: for the fsync stalls of this machine's disk, 50-170 ms a few times a minute (a bare write +
#: fdatasync loop, 2026-12-03), so that they no longer make runs late
NODE_FIRE_AHEAD_MS: Final = 500


@dataclass(frozen=True)
class EngineConfig:
    """Tunables; every duration in ms. Defaults suit a production node, but for
    ``fire_ahead_ms``: 0 here, exact fire times for callers that step time by hand; a node
    sets :data:`NODE_FIRE_AHEAD_MS`."""

    worker_lease_ms: int = 10_000
    #: after a restart, or after an at-most-once run's worker lease lapsed (>= worker lease)
    reattach_grace_ms: int = 20_000
    #: the node's timeout is start + timeout + this, so the worker's own timeout acts first:
    #: the worker's stop sequence (SIGTERM, its 5 s kill grace, SIGKILL) plus a margin for
    #: the report's trip. (It was 5 s, the kill grace itself: a task that ignored SIGTERM was
    #: recorded TIMED_OUT by the node a moment before the worker's report, without its exit.)
    timeout_grace_ms: int = 10_000
    #: a fire more than this late counts as missed: the catch-up policy applies
    misfire_ms: int = 60_000
    #: runs waiting per tier before firing pauses for that tier
    ready_bound: int = 10_000
    #: how far the wall clock may run ahead of the monotonic clock before it is distrusted
    max_clock_jump_ms: int = 5_000
    #: bound on fire times enumerated by one catch-up decision
    max_enumerate: int = 100_000
    #: how long a triggered run's source is remembered to ignore a redelivered trigger; an
    #: outbox redelivers until acknowledged, so this bounds how late a redelivery may come
    trigger_dedupe_ms: int = 86_400_000
    #: the longest chain of triggered runs (``after`` dependencies and ``trigger:`` timeout
    #: handlers alike): a scheduled run has depth 0, a run triggered by a run of depth d has
    #: depth d + 1, and a trigger that would create a run deeper than this is skipped
    #: (``chain_too_deep``) instead. Bounds a cycle (A after B, B after A), which submit
    #: cannot see in general: the jobs may live on different shards.
    max_chain_depth: int = 64
    #: fire-ahead: a job due within this many ms fires now (its run PENDING and durable
    #: ahead of its time) and goes out at its time, so that a slow fsync near the fire time
    #: does not delay its dispatch. Decisions stay those of the time: a job with an overlap
    #: rule is not fired ahead (its time waits in ``_deferred`` and is decided at the time),
    #: and a pause or an update inside the window takes the run made ahead back (CANCELLED,
    #: never sent) and owes its time as before. 0: fire at the due time.
    fire_ahead_ms: int = 0
    #: guards switched off on purpose, so the simulation can prove its checks catch the fault:
    #: "claim-after-fire" (an at-most-once run sent before its claim is durable) and
    #: "no-redispatch" (at-least-once runs of a lapsed worker lease not handed out again),
    #: "report-ack-before-durable" and "no-stop-wait" (a node-side timeout decided, and
    #: retried, without waiting for the worker to confirm the task stopped); "lose-fire" (a
    #: job fired through the slow path records its next time and is never armed for it: it
    #: stops firing, silently), "eager-catchup" (no misfire threshold: a fire late at all is
    #: a missed one, skipped by the catch-up policy) and "alo-lost" (an at-least-once run of
    #: a lost worker waits the grace and ends LOST, as an at-most-once run does),
    #: "retry-no-backoff" (a failed attempt's retry ready at once, its backoff ignored) and
    #: "unpinned" (a run of an older version dispatched with its job's newest task) and
    #: "amo-no-grace" (an at-most-once run of a lost worker LOST at once, no reattach grace),
    #: "no-trigger" (no trigger leaves: an upstream success or a timeout handler's) and
    #: "trigger-no-dedupe" (a redelivered trigger runs its target again).
    #: Empty in production; never set it outside tests.
    mutants: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = self.mutants - ENGINE_MUTANTS
        if unknown:
            raise EngineUsageError(f"unknown mutants {sorted(unknown)}", field="mutants")
        if not 0 <= self.fire_ahead_ms <= MAX_FIRE_AHEAD_MS:
            raise EngineUsageError(
                f"fire_ahead_ms must be in 0..{MAX_FIRE_AHEAD_MS}, got {self.fire_ahead_ms!r}",
                field="fire_ahead_ms",
            )
        if self.reattach_grace_ms < self.worker_lease_ms:
            raise EngineUsageError(
                "reattach grace must be at least the worker lease", field="reattach_grace_ms"
            )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return rebuilt_by_init(self)


#: A snapshot's table of policies, and the schedules of stored specs and snapshot profiles
#: (replay and load alike), parsed, by their stored form (its ``repr``: exact for the plain
#: values they hold, where ``True``, ``1`` and ``1.0`` differ): what loading a snapshot or
#: replaying a log did for every distinct policy and schedule each time, which a process
#: repeats for the same ones (a shard recovered again). Pure functions of their keys, so
#: shared by every engine of the process; bounds (cleared when full), not LRUs, sized for
#: the ~10,000 distinct policies of the large simulation (at most ~16 MB each: an entry is
#: about a kilobyte). A policy's rendered form is :meth:`Policy.to_dict`'s own cache.
_SNAPSHOT_POLICIES: dict[str, Policy] = {}
_STORED_SCHEDULES: dict[tuple[str, str | None], Schedule] = {}
_SNAPSHOT_CACHE_LIMIT: Final = 1 << 14


#: Profiles of stored specs by the text of their fields (see ``ShardEngine._stored_profile``).
_STORED_PROFILES: dict[str, _Profile] = {}
_STORED_PROFILE_LIMIT: Final = 1 << 14


class _Absent:
    """A key missing from a stored spec, in the text :meth:`ShardEngine._stored_profile`
    keeps profiles by (its ``repr`` is no value's)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Final = _Absent()


def _snapshot_policy(stored: Mapping[str, Any]) -> Policy:
    """``parse_policy(stored)``, kept by the stored form's text (an error is not kept)."""
    text = repr(stored)
    policy = _SNAPSHOT_POLICIES.get(text)
    if policy is None:
        policy = remember(_SNAPSHOT_POLICIES, text, parse_policy(stored), _SNAPSHOT_CACHE_LIMIT)
    return policy


def _stored_schedule(
    stored: object, jitter_id: str | None, created_ms: int | None = None
) -> Schedule:
    """``parse_schedule(stored, created_ms=created_ms, job_id=jitter_id)``, kept by the stored
    form's text (a stored form is normalized: it has its ``start``, so ``created_ms`` never
    decides). An error is not kept."""
    key = (repr(stored), jitter_id)
    schedule = _STORED_SCHEDULES.get(key)
    if schedule is None:
        schedule = remember(
            _STORED_SCHEDULES,
            key,
            parse_schedule(stored, created_ms=created_ms, job_id=jitter_id),
            _SNAPSHOT_CACHE_LIMIT,
        )
    return schedule


@dataclass(frozen=True, slots=True)
class _Profile:
    """What decisions need of a job and many jobs share: interned, referenced by number."""

    #: None for a one-shot: after its one time (the job's first next fire) nothing follows,
    #: so one-shot jobs with equal policies share a profile.
    schedule: Schedule | None
    policy: Policy
    after: tuple[str, ...]
    #: a job id the schedule's jitter was drawn for (jitter depends on it), to rebuild it
    jitter_id: str | None

    @classmethod
    def of(cls, spec: JobSpec) -> _Profile:
        if isinstance(spec.schedule, AtSchedule):
            return cls(None, spec.policy, spec.after, None)
        jitter_id = spec.id if spec.schedule.jitter_ms else None
        return cls(spec.schedule, spec.policy, spec.after, jitter_id)

    def identity(self) -> tuple[Any, ...]:
        # The jitter id is not part of it: equal schedules (jitter offset included) are equal.
        return (self.schedule, self.policy, self.after)

    def to_dict(self, policy: int) -> dict[str, Any]:
        """The stored form, naming its policy by ``policy``, its index in the snapshot's
        table of policies."""
        return {
            "schedule": None if self.schedule is None else self.schedule.to_spec(),
            "jitter_id": self.jitter_id,
            "policy": policy,
            "after": list(self.after),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], policies: list[Policy]) -> _Profile:
        """The profile of a stored form: its policy an index into ``policies`` (the snapshot's
        table) or, as snapshots written before that table held, a policy object of its own."""
        schedule = d["schedule"]
        stored = d["policy"]
        if isinstance(stored, int) and not isinstance(stored, bool):
            if not 0 <= stored < len(policies):
                raise EngineStateError(
                    f"snapshot profile names policy {stored}; the table holds {len(policies)}"
                )
            policy = policies[stored]
        else:
            policy = _snapshot_policy(stored)
        return cls(
            None if schedule is None else _stored_schedule(schedule, d["jitter_id"]),
            policy,
            tuple(d["after"]),
            d["jitter_id"],
        )


def _ready_at(run: _Run) -> int:
    """When a PENDING run may go out: its retry's backoff time, else its own time (a run
    fired ahead of it waits for it; any other was made at or after it)."""
    return run.at if run.due is None else run.due


def _recovery_order(run: _Run) -> tuple[int, int]:
    """Where a recovered run stands in the ready queue: see ShardEngine._after_recovery."""
    return (run.at, run.key)


def _asks_stop(policy: Policy) -> bool:
    """Whether a node-side timeout under ``policy`` asks a live worker to stop the task and
    waits for its confirmation (not "mark", which stops nothing: see
    ShardEngine._node_timeout). Whatever the delivery: a worker whose stop outlasts the
    node's grace (a long kill grace, a container still being removed) would otherwise see
    its at-least-once attempt retried beside it."""
    return policy.on_timeout != "mark"


def _spec_missing(key: int, version: int, found: tuple[Any, ...] | None) -> EngineStateError:
    """The error of a spec read (``found``: what the directory gave) that neither memory nor
    the directory can answer at ``version``."""
    return EngineStateError(
        f"job key {key} version {version} is neither in memory nor in the directory "
        f"(the directory has {None if found is None else found[0]})"
    )


def _bare(error: EngineError) -> EngineError:
    """``error`` without its traceback, to be kept in a reply or a result list: a refusal's
    traceback holds the frames it passed through, and they the command (a spec with its
    payload) and the list keeping the error, a reference cycle only the collector frees."""
    return error.with_traceback(None)


@dataclass(slots=True)
class _Run:
    key: int
    at: int
    version: int  # the job version this run was created from
    prof: int  # and its profile
    policy: Policy
    state: RunState = RunState.PENDING
    attempt: int = 1
    token: int = 0
    worker: str | None = None
    due: int | None = None  # a retry's ready time
    failures: int = 0
    timeouts: int = 0
    source: str | None = None
    exit: int | None = None
    why: str | None = None
    slot: int = -1  # timer slot, allocated when a timer is first needed
    queued: bool = False  # in a ready queue
    grace: bool = False  # waiting for its worker to re-attach
    job_id: str | None = None  # looked up when first needed
    #: the spec (stored form) of the version this run pins, once the job moved past it
    pinned: dict[str, Any] | None = None
    #: recovered PENDING at-least-once: a claim of this attempt may have left before the
    #: crash without its record becoming durable, so the next claim is a new attempt
    maybe_sent: bool = False
    #: its job version was cancelled while it was in flight (it carries on, without retries
    #: and without going out again); recorded ("cx"), so that it holds after the id is created
    #: again as a new version, and after a restart
    orphan: bool = False
    #: at-most-once: the node-side timeout asked its (live) worker to stop it, and the run
    #: waits for the confirmed report; not recorded (no decision is made until that report)
    stopping: bool = False
    #: the batch holding the record that established this run's current attempt number (its
    #: fire or creation, a requeue, a retry, a claim that raised the attempt), while that
    #: batch may not be durable yet: a claim in the meantime holds its dispatch until the
    #: claim's own batch is durable (0: durable). A crash would otherwise forget a run that is
    #: out, or let one attempt number name two dispatches.
    fired_batch: int = 0
    #: the engine's wall time when this attempt's timeout clock started (its claim, then its
    #: start report); recorded ("st") while it is in flight, so that a re-attach (after a
    #: lease lapse, or a restart) resumes that clock instead of starting it again
    clock_from: int | None = None
    #: the :attr:`Dispatch.seq` of this attempt's newest dispatch (``_UNSENT`` while the
    #: dispatch waits for durability; 0 once its worker announced the run: it has it)
    sent: int = 0
    #: its chain depth: 0 for a scheduled run, one more than its source's for a triggered
    #: one (see :attr:`EngineConfig.max_chain_depth`); recorded ("dp") when not 0
    depth: int = 0
    #: TIMED_OUT under on_timeout=mark while its worker runs the task on: recorded ("mk") in
    #: that final record, so that a restart still lets the task run (see _marked)
    marked: bool = False

    @property
    def ref(self) -> RunRef:
        return (self.key, self.at)


@dataclass(slots=True)
class _Worker:
    worker_id: str
    tiers: tuple[str, ...]
    credits: int
    slot: int
    runs: set[RunRef] = field(default_factory=set)
    #: the process its last hello named (:attr:`WorkerHello.instance`)
    instance: str = ""


class ShardEngine:
    """One shard's jobs and runs. Not thread-safe; one driver calls it.

    Every call takes the wall and monotonic clocks in ms. The engine's own time never goes
    backwards and never follows the wall clock further ahead than the monotonic clock allows
    (plus ``max_clock_jump_ms``): a forward jump is reported as :class:`ClockJump` and nothing
    fires early. A monotonic clock that goes backwards is a :class:`TimeWentBackwards` error.

    ``directory`` answers for jobs whose records are durable (their id and latest spec); the
    driver keeps it in step with what it made durable before acknowledging a batch. Without
    one, the engine keeps a :class:`~engine.directory.MemoryDirectory` itself, fed with its own
    batches as they are acknowledged (tests, the simulation); a node at scale passes its store.
    """

    def __init__(
        self,
        *,
        epoch: int,
        wall_ms: int,
        mono_ms: int,
        config: EngineConfig | None = None,
        directory: JobDirectory | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        #: how late a fire may be and still run as on time (0 under the "eager-catchup" mutant)
        self._misfire_ms = 0 if "eager-catchup" in self.config.mutants else self.config.misfire_ms
        self.epoch = epoch
        self._wall = wall_ms
        self._mono = mono_ms
        self._jumped = False
        self._offset = wall_ms - mono_ms  # wall minus monotonic, as far as it is trusted
        #: the offset trusted before the wall clock was set back (else _offset), kept for
        #: _SETBACK_MEMORY_MS from _setback_mono: a step forward back up to it undoes the
        #: setback, and is no jump (see _clock)
        self._offset_high = self._offset
        self._setback_mono = mono_ms
        self._raw_offset = self._offset  # wall minus monotonic, as the last tick saw it
        #: monotonic ms not yet turned into slew (less than _SLEW_DIVISOR): carried from call
        #: to call, so that calls less than a second apart still slew at 1 ms a second
        self._slew_carry = 0
        self._counter = 0  # fencing tokens handed out in this epoch
        self._sends = 0  # dispatches numbered in this epoch (Dispatch.seq)
        self._batch = 0  # last batch id handed out
        self._durable = 0  # last batch id acknowledged
        # Jobs: columns by key. Version 0 means no job has this key.
        self._ver = array("I")
        self._prof = array("i")
        self._flags = array("B")
        self._next_key = 0
        self._profiles: list[_Profile] = []
        self._profile_ids: dict[tuple[Any, ...], int] = {}
        self._held_next: dict[int, int | None] = {}  # next fire of a paused job
        # key -> the times of its runs not final: one int for the usual single run (a set
        # costs 216 bytes), a set for two or more.
        self._active: dict[int, int | set[int]] = {}
        self._buffered: dict[int, int] = {}  # overlap=buffer_one: key -> time of the waiting run
        # Jobs whose latest record is not durable yet, which the directory cannot answer for:
        # key -> (batch, version, stored spec), id -> (batch, key), in emission order.
        self._own_directory: MemoryDirectory | None = None
        if directory is None:
            directory = self._own_directory = MemoryDirectory()
        self._directory: JobDirectory = directory
        self._recent: dict[int, tuple[int, int, dict[str, Any]]] = {}
        self._recent_ids: dict[str, tuple[int, int]] = {}
        self._recent_order: deque[tuple[int, int, str]] = deque()
        #: runs that went out to a worker and ended, until their final record is durable
        #: (the batch holding it): the directory knows durable records only, and a replacing
        #: create meanwhile fired the time again, attempt 1 once more (found by review)
        self._recent_out: dict[RunRef, int] = {}
        self._recent_out_order: deque[tuple[int, RunRef]] = deque()
        self._runs: dict[RunRef, _Run] = {}
        # Runs claimed at least once, by run id, until final: what workers' reports name.
        self._handed_out: dict[str, _Run] = {}
        # Triggered runs by (target job key, source run id) -> the run's time, to ignore a
        # redelivered trigger. Keyed by the target too: one source run (an upstream's success)
        # triggers every dependent of it, several of them on this shard. Kept for
        # trigger_dedupe_ms after the run's time (insertion order is time order, so the oldest
        # are pruned from the front).
        self._sources: dict[tuple[int, str], int] = {}
        self._trigger_at: dict[int, int] = {}  # the last time given to a triggered run, per job
        self._trigger_at_prune = _TRIGGER_AT_PRUNE
        self._workers: dict[str, _Worker] = {}
        # on_timeout=mark: runs recorded TIMED_OUT whose task runs on, run id -> (token,
        # worker), so that the worker's heartbeat is not told to stop it. Until its report,
        # or its worker's lease lapsing. Recorded ("mk" in the final record; the report's
        # note ends it), so a restart keeps it: while recovering, by run (key, at), turned
        # into run ids once the jobs are known (_after_recovery).
        self._marked: dict[str, tuple[int, str]] = {}
        self._marks_recovered: dict[RunRef, tuple[int, str]] = {}
        # Runs the engine made final while their task still ran (cancelled with
        # stop_running, cancel_previous, a timeout decided unconfirmed) and whose worker was
        # asked to stop it: run id -> (token, worker, until mono ms). The task may write
        # output through its stop's grace, so a follower of its logs goes on until its
        # worker's report ends the entry, or the worker is lost, or says hello without it;
        # at the latest after reattach_grace_ms. Not recorded: after a restart it is unknown
        # (task_stopping answers False), as for a query about a run this engine never had.
        self._stopping_final: dict[str, tuple[int, str, int]] = {}
        # After a restart: when the recovered marks of workers that never said hello again
        # are dropped (a mark lives while its worker's lease does; such a worker has none).
        self._marks_expire_mono: int | None = None
        self._ready: dict[str, deque[RunRef]] = {}
        # PENDING runs in memory per tier (ready, waiting for durability, a retry or a buffer):
        # what backpressure bounds.
        self._pending: dict[str, int] = {}
        self._fire: dict[str, TimingWheel] = {}  # per tier: job key -> next fire (engine time)
        self._fire_order: list[str] = []  # sorted(self._fire): tiers fire in a fixed order
        # Fire-ahead (EngineConfig.fire_ahead_ms): job key -> a fire time taken out of its
        # wheel early whose decision waits for the time itself (an overlap rule with a run in
        # flight). In memory only: the job's durable position still says that time, and it
        # counts as the job's next fire time everywhere (_next_due). The heap orders them,
        # lazily: an entry that no longer matches the dict is dropped when it comes up.
        self._deferred: dict[int, int] = {}
        self._deferred_heap: list[tuple[int, int]] = []
        self._retry = TimingWheel(max(wall_ms, 0))  # run slot -> retry ready time (engine time)
        self._run_timers = TimingWheel(max(mono_ms, 0))  # run slot -> timeout / grace (mono)
        self._run_timer_kind: dict[int, str] = {}
        self._worker_timers = TimingWheel(max(mono_ms, 0))  # worker slot -> lease end (mono)
        self._slot_run: dict[int, RunRef] = {}
        self._slot_worker: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._live_spec: JobSpec | None = None
        # (schedule or None, policy, after, profile id) of the last job created live: see
        # _apply_job. Holds the objects themselves, so that identity stands for equality.
        self._last_profile: tuple[Schedule | None, Policy, tuple[str, ...], int] | None = None
        self._outbox: dict[int, Record] = {}
        # upstream job id -> ids of jobs (on any shard) that run after its successes
        self._dependents: dict[str, set[str]] = {}
        self._outbox_seq = 0
        #: (upstream, downstream) -> the outbox position of the newest registration applied
        #: for the pair (RegisterDependent.seq): redelivered after a restart, registrations
        #: arrive in any order, and an older one must not undo a newer (found by review: a
        #: dependency lost, or kept after its removal, for good). Kept for pairs turned off
        #: for trigger_dedupe_ms after the engine time they were turned off (``_dep_off``, in
        #: that order), then forgotten: a create-and-cancel loop of dependent jobs would
        #: otherwise grow it for ever. (A registration redelivered more than a day late may
        #: then undo a removal: the same bound the trigger dedupe keeps.)
        self._dep_seq: dict[tuple[str, str], int] = {}
        self._dep_off: dict[tuple[str, str], int] = {}
        # Recovery only: the newest epoch a replayed ``epoch`` record (or the snapshot) opened;
        # a record stamped older than it afterwards is a fenced-off owner's write.
        self._replay_epoch = 0
        # Effects waiting for a batch to be durable: batch id -> effects / runs to queue.
        self._held: dict[int, list[Effect]] = {}
        self._held_ready: dict[int, list[RunRef]] = {}
        # Current call's output.
        self._records: list[Record] = []
        self._out: list[Effect] = []
        self._after_durable: list[Effect] = []
        self._ready_after_durable: list[RunRef] = []

    # =============================================================== recovery

    @classmethod
    def recover(
        cls,
        durable_records: Iterable[Record],
        *,
        epoch: int,
        wall_ms: int,
        mono_ms: int,
        config: EngineConfig | None = None,
        directory: JobDirectory | None = None,
        snapshot: Snapshot | None = None,
    ) -> tuple[ShardEngine, list[Effect]]:
        """Rebuild a shard from its durable state and open it for ``epoch``.

        The state is ``snapshot`` (from :meth:`export_snapshot`, loaded in bulk: a few array
        copies and one vectorised wheel load, no object per job) followed by the durable
        records written after it, or the records alone. Returns the engine and the effects of
        opening: a batch with the ``epoch`` record, and the triggers still in the outbox. Runs
        that were in flight wait ``reattach_grace_ms`` for their workers to re-announce them;
        then at-least-once runs go out again and at-most-once runs become LOST. Raises
        :class:`StaleEpoch` when the state carries an epoch at or above ``epoch`` (another
        owner opened the shard since). A snapshot needs ``directory`` (the store's): the
        engine's own directory only knows jobs from records.
        """
        if snapshot is not None and directory is None:
            raise EngineUsageError("recovering from a snapshot needs the store's directory")
        engine = cls(
            epoch=epoch, wall_ms=wall_ms, mono_ms=mono_ms, config=config, directory=directory
        )
        if snapshot is not None:
            engine._load_snapshot(snapshot)
        own = engine._own_directory
        for record in durable_records:
            engine._apply(rec.check(record), recovering=True)
            if own is not None:
                own.absorb((record,))
        engine._after_recovery()
        engine._emit(rec.make("epoch", epoch=epoch))
        for _seq, out in sorted(engine._outbox.items()):
            engine._after_durable.append(engine._outbox_effect(out))
        return engine, engine._finish()

    def _after_recovery(self) -> None:
        if self._marks_recovered:
            for (key, at), mark in sorted(self._marks_recovered.items()):
                try:
                    job_id, _task = self._ticket_fields(key, self._ver[key])
                except EngineStateError:
                    continue  # (no spec to name the run by: its task is stopped, as before)
                self._marked[run_id(str(job_id), at)] = mark
            self._marks_recovered = {}
            # No worker is known yet: a mark lives while its worker's lease does, and a worker
            # that does not say hello again by then has none.
            self._marks_expire_mono = (
                self._mono + self.config.reattach_grace_ms + self.config.worker_lease_ms
            )
        # In scheduled order (the run's time, then its job's key), the order they fired in
        # live: not the order they were loaded, which for a snapshot is (key, time), so the
        # most overdue run of a late job would go out last. The same rule for a log replay.
        for run in sorted(self._runs.values(), key=_recovery_order):
            if run.state is RunState.PENDING:
                self._count_pending(run, +1)
                run.maybe_sent = run.policy.delivery == "at_least_once"
            if run.state._value_ in IN_FLIGHT_VALUES:
                run.worker = None
                run.grace = True
                self._set_run_timer(run, "grace", self._mono + self.config.reattach_grace_ms)
            elif run.state is RunState.PENDING:
                self._queue_or_wait(run)

    # =============================================================== the entry points

    def handle(
        self, command: Command, wall_ms: int, mono_ms: int, *, epoch: int | None = None
    ) -> list[Effect]:
        """Apply ``command`` at the given time; return the effects, in order.

        Time first moves to ``(wall_ms, mono_ms)`` (firing what is due), then the command
        applies. A command the engine refuses is answered by a :class:`Reply` (or, for a
        worker's command, a :class:`Refused`) carrying the typed error, and changes nothing.
        ``epoch``, when the sender stamped one, must be this shard's: a command routed under an
        older owner is refused with :class:`StaleEpoch`. A :class:`Durable` so stamped
        acknowledges another incarnation's batch: nothing answers it, so :class:`StaleEpoch`
        is raised before anything changes (it would release this epoch's held dispatches).
        """
        if isinstance(command, Durable):
            self._check_durable_epoch(epoch)
        self._clock(wall_ms, mono_ms)
        self._run_due()
        if isinstance(command, Durable):
            self._on_durable(command.batch_id)
        else:
            self._command(command, epoch)
            self._dispatch_all()
        return self._finish()

    def handle_many(
        self, commands: Iterable[Command], wall_ms: int, mono_ms: int, *, epoch: int | None = None
    ) -> list[Effect]:
        """:meth:`handle` for several commands at one time, in order, as one batch.

        The same decisions as handling them one by one at ``(wall_ms, mono_ms)``, except that
        waiting runs are handed to workers once, after the last command, and every record goes
        into one :class:`Persist`: a driver under load pays the clock, the timers and the batch
        once per group of commands instead of once per command. A :class:`Durable` among them
        stamped with another epoch raises :class:`StaleEpoch` before anything changes.
        """
        if epoch is not None and epoch != self.epoch:
            commands = list(commands)
            if any(isinstance(command, Durable) for command in commands):
                self._check_durable_epoch(epoch)
        self._clock(wall_ms, mono_ms)
        self._run_due()
        for command in commands:
            if isinstance(command, Durable):
                self._on_durable(command.batch_id)
            else:
                self._command(command, epoch)
        self._dispatch_all()
        return self._finish()

    def _check_durable_epoch(self, epoch: int | None) -> None:
        if epoch is not None and epoch != self.epoch:
            raise StaleEpoch(
                f"durable acknowledgement stamped with epoch {epoch}; the shard is at {self.epoch}",
                field="epoch",
            )

    def _command(self, command: Command, epoch: int | None) -> None:
        handler = _HANDLERS[type(command)]
        try:
            if epoch is not None and epoch != self.epoch:
                raise StaleEpoch(
                    f"command stamped with epoch {epoch}; the shard is at {self.epoch}",
                    field="epoch",
                )
            handler(self, command)
        except EngineError as error:
            # Looked up here, not for every command: a worker's report has no request id,
            # and a getattr that misses raises and catches an AttributeError inside.
            request_id = getattr(command, "request_id", None)
            if request_id is None:
                # A worker's command (no request id): the driver tells the worker, which
                # says hello again; the engine and the other effects are unharmed.
                self._out.append(Refused(getattr(command, "worker_id", ""), _bare(error)))
            else:
                # A refusal may rest on state not durable yet ("exists" for a create still in
                # flight): like any reply, it waits until what it says cannot be undone.
                self._after_durable.append(Reply(request_id, error=_bare(error)))

    def tick(self, wall_ms: int, mono_ms: int) -> list[Effect]:
        """Move time forward: fire due jobs, release retries, expire leases and timeouts."""
        self._clock(wall_ms, mono_ms)
        self._run_due()
        return self._finish()

    def next_wakeup_mono(self) -> int | None:
        """The monotonic time by which :meth:`tick` should next be called (None: nothing
        scheduled). Wall-clock deadlines are converted with the current offset; waking early
        is harmless."""
        # Called after every turn of a driver: a running minimum, no list (each wheel's
        # next_due is cached by the wheel itself).
        pending, bound = self._pending, self.config.ready_bound
        ahead = self.config.fire_ahead_ms
        best: int | None = self._retry.next_due()
        for tier, wheel in self._fire.items():
            if pending.get(tier, 0) < bound:  # (_tier_open)
                due = wheel.next_due()
                if due is not None and (best is None or due - ahead < best):
                    best = due - ahead
        deferred = self._next_deferred()
        if deferred is not None and (best is None or deferred < best):
            best = deferred
        if best is not None:
            # Wall-clock deadlines, in monotonic time: when the engine's time reaches them at
            # its pace. Under a wall clock set back, the engine's time stands still until the
            # wall clock is back at it: the deadline is then when the wall clock reaches it,
            # though no later than a poll away, so that a setback undone is seen soon (the
            # engine's pace alone gave the same small gap at every turn: a wake-up every
            # millisecond for as long as the setback lasted, found by review).
            at_pace = best + self._mono - self._wall
            behind = self._wall - self._mono - self._raw_offset
            if behind > 0:
                best = max(at_pace, min(at_pace + behind, self._mono + _SETBACK_POLL_MS))
            else:
                best = at_pace
        for wheel in (self._run_timers, self._worker_timers):
            due = wheel.next_due()
            if due is not None and (best is None or due < best):
                best = due
        if self._offset_high - self._offset > _SETBACK_NOISE_MS:
            # A setback within its memory: the engine must see the wall clock put right while
            # it still counts as a correction, whatever is due (found by review: a shard with
            # nothing due for half an hour slept through it, and the correction, seen after the
            # memory lapsed, was a jump: every job an hour late again).
            poll = self._mono + _SETBACK_POLL_MS
            best = poll if best is None or poll < best else best
        return None if best is None else max(best, self._mono)

    @property
    def now_ms(self) -> int:
        """The engine's time (wall-clock ms, never backwards, never ahead of the monotonic
        clock's pace by more than the jump bound)."""
        return self._wall

    # =============================================================== clocks and timers

    def _clock(self, wall_ms: int, mono_ms: int) -> None:
        if mono_ms < self._mono:
            raise TimeWentBackwards(
                f"monotonic time {mono_ms} is before {self._mono}", field="mono_ms"
            )
        # The trusted offset between the clocks may move back at once (a wall clock set back
        # only delays firing: the engine's time stands still until the wall clock is back at
        # it) but forward only at a slew rate, so that many small forward steps add up to no
        # more than one: the engine never runs ahead of the monotonic clock's pace by more
        # than max_clock_jump_ms in total. But a step forward that undoes a setback within
        # _SETBACK_MEMORY_MS, back up to the offset trusted before it, is a correction, not a
        # jump. (Found by review: a clock set back an hour for a second, then put right, was a
        # jump, and the offset crept back at 1 ms a second: every job fired an hour late for
        # six weeks.) A setback that stays longer is taken for the truth, as before.
        in_setback = self._offset < self._offset_high
        if in_setback and mono_ms - self._setback_mono > _SETBACK_MEMORY_MS:
            self._offset_high, in_setback = self._offset, False
        high = self._offset_high
        # The slew counts every monotonic ms since the last call, the remainder of the
        # division included (found by review: with calls less than a second apart, as a busy
        # node's are, the allowance was always 0, so forward corrections used up
        # max_clock_jump_ms for good and every job fired that much late until a restart).
        elapsed = self._slew_carry + mono_ms - self._mono
        slewed = high + elapsed // _SLEW_DIVISOR
        if wall_ms - mono_ms > slewed:
            trusted, self._slew_carry = slewed, elapsed % _SLEW_DIVISOR
        else:
            trusted, self._slew_carry = wall_ms - mono_ms, 0  # caught up: nothing to carry
        limit = mono_ms + high + self.config.max_clock_jump_ms
        if wall_ms > limit:
            if not self._jumped:
                self._out.append(ClockJump(wall_ms=wall_ms, engine_ms=limit))
            self._jumped = True
        else:
            self._jumped = False
        if trusted < high and not in_setback:
            self._setback_mono = mono_ms  # a setback begins
        self._offset, self._offset_high = trusted, max(high, trusted)
        self._raw_offset = wall_ms - mono_ms
        self._wall, self._mono = max(self._wall, min(wall_ms, limit)), mono_ms

    def _run_due(self) -> None:
        """Everything that time makes happen, in a fixed order (determinism).

        Every call of the engine starts here, so the common case (nothing due) must cost a
        few cached ``next_due`` reads: a wheel is advanced only when something in it is due.
        """
        mono, wall = self._mono, self._wall
        if self._marks_expire_mono is not None and mono >= self._marks_expire_mono:
            self._marks_expire_mono = None
            for rid in [rid for rid, (_t, w) in self._marked.items() if w not in self._workers]:
                self._end_mark(rid, "its worker did not come back after a restart")
        timers = self._worker_timers
        nd = timers.next_due()
        if nd is not None and nd <= mono:
            for _due, slot in timers.advance(mono):
                self._lease_lapsed(slot)
        timers = self._run_timers
        nd = timers.next_due()
        if nd is not None and nd <= mono:
            for _due, slot in timers.advance(mono):
                self._run_timer_fired(slot)
        timers = self._retry
        nd = timers.next_due()
        if nd is not None and nd <= wall:
            for _due, slot in timers.advance(wall):
                ref = self._slot_run.get(slot)
                run = self._runs.get(ref) if ref is not None else None
                if run is not None and run.state is RunState.PENDING:
                    # ``due`` stays as recorded: a ready time in the past means ready.
                    self._enqueue(run)
        if self._deferred_heap:
            self._fire_deferred(wall)
        fire, horizon = self._fire, wall + self.config.fire_ahead_ms
        for tier in self._fire_order:
            nd = fire[tier].next_due()
            if nd is not None and nd <= horizon:
                self._fire_tier(tier)
        self._dispatch_all()

    def _next_deferred(self) -> int | None:
        """The earliest fire time waiting in :attr:`_deferred` (stale heap entries dropped)."""
        heap, deferred = self._deferred_heap, self._deferred
        while heap:
            due, key = heap[0]
            if deferred.get(key) == due:
                return due
            heapq.heappop(heap)
        return None

    def _fire_deferred(self, wall: int) -> None:
        """Fire the deferred fire times that are due, in (time, key) order, deciding each as
        at its time without fire-ahead (:meth:`_fire_job`: its overlap rule, now)."""
        heap, deferred = self._deferred_heap, self._deferred
        while heap and heap[0][0] <= wall:
            due, key = heapq.heappop(heap)
            if deferred.get(key) == due:
                del deferred[key]
                tier = self._profile(key).policy.tier
                if self._tier_open(tier):
                    self._fire_job(key, due)
                else:
                    # Its tier is full: back in the wheel, due, to wait for room as any fire
                    # does (found by review: deferred fires went past the ready bound).
                    self._fire_wheel(tier).schedule(key, due)

    def _defer_fire(self, key: int, due: int) -> None:
        self._deferred[key] = due
        heapq.heappush(self._deferred_heap, (due, key))

    def _alloc_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _run_slot(self, run: _Run) -> int:
        """The run's timer slot, allocated on first use (most runs never need a timer)."""
        if run.slot < 0:
            run.slot = self._alloc_slot()
            self._slot_run[run.slot] = run.ref
        return run.slot

    def _set_run_timer(self, run: _Run, kind: str, at_mono: int) -> None:
        slot = self._run_slot(run)
        self._run_timers.schedule(slot, at_mono)
        self._run_timer_kind[slot] = kind

    def _clear_run_timer(self, run: _Run) -> None:
        if run.slot >= 0:
            self._run_timers.cancel(run.slot)
            self._run_timer_kind.pop(run.slot, None)

    def _schedule_retry(self, run: _Run, at: int) -> None:
        self._retry.schedule(self._run_slot(run), at)

    def _fire_wheel(self, tier: str) -> TimingWheel:
        wheel = self._fire.get(tier)
        if wheel is None:
            wheel = self._fire[tier] = TimingWheel(max(self._wall, 0))
            self._fire_order = sorted(self._fire)
        return wheel

    def _tier_open(self, tier: str) -> bool:
        return self._pending.get(tier, 0) < self.config.ready_bound

    def _count_pending(self, run: _Run, delta: int) -> None:
        tier = run.policy.tier
        self._pending[tier] = self._pending.get(tier, 0) + delta

    def _move(self, run: _Run, event: RunEvent) -> None:
        """Apply ``event`` to ``run`` by the table, keeping the per-tier PENDING count."""
        old = run.state
        run.state = transition(old, event)
        if old is RunState.PENDING and run.state is not RunState.PENDING:
            self._count_pending(run, -1)
        elif run.state is RunState.PENDING and old is not RunState.PENDING:
            self._count_pending(run, +1)

    # =============================================================== output

    def _emit(self, record: Record) -> None:
        record["e"] = self.epoch
        self._apply(record, recovering=False)
        self._records.append(record)

    def _finish(self) -> list[Effect]:
        """Close the call: its records become one batch; what must wait for durability is
        attached to that batch (or to the last one still in flight, or released at once)."""
        if not self._records and self._batch <= self._durable:
            # Nothing in flight to wait for. Releasing may claim runs, which makes records.
            waiting, self._after_durable = self._after_durable, []
            self._out.extend(self._still_valid(waiting))
            ready, self._ready_after_durable = self._ready_after_durable, []
            for ref in ready:
                run = self._runs.get(ref)
                if run is not None and run.state is RunState.PENDING and self._due_now(run):
                    self._enqueue(run)
            if ready:
                self._dispatch_all()
        out = self._out
        if self._records:
            self._batch += 1
            out.insert(0, Persist(self._batch, self.epoch, tuple(self._records)))
        if self._after_durable:
            self._held.setdefault(self._batch, []).extend(self._after_durable)
        if self._ready_after_durable:
            self._held_ready.setdefault(self._batch, []).extend(self._ready_after_durable)
        self._records, self._out = [], []
        self._after_durable, self._ready_after_durable = [], []
        return out

    def _on_durable(self, batch_id: int) -> None:
        if batch_id > self._batch:
            raise EngineUsageError(
                f"batch {batch_id} was never handed out (last {self._batch})", field="batch_id"
            )
        self._forget_recent(batch_id)
        runs, wall, pending = self._runs, self._wall, RunState.PENDING
        for b in range(self._durable + 1, batch_id + 1):
            held = self._held.pop(b, None)
            if held:
                self._out.extend(self._still_valid(held))
            for ref in self._held_ready.pop(b, ()):
                run = runs.get(ref)
                if run is not None and run.state is pending and _ready_at(run) <= wall:
                    self._enqueue(run, ref)
        self._durable = max(self._durable, batch_id)
        self._dispatch_all()

    def _forget_recent(self, batch_id: int) -> None:
        """Jobs whose records are durable up to ``batch_id`` are the directory's now."""
        order, recent, recent_ids = self._recent_order, self._recent, self._recent_ids
        while order and order[0][0] <= batch_id:
            batch, key, job_id = order.popleft()
            entry = recent.get(key)
            if entry is not None and entry[0] == batch:
                del recent[key]
                if self._own_directory is not None:
                    self._own_directory.absorb(
                        ({"t": "job", "key": key, "id": job_id, "ver": entry[1], "spec": entry[2]},)
                    )
            if recent_ids.get(job_id, (None, None))[0] == batch:
                del recent_ids[job_id]
        out_order, recent_out = self._recent_out_order, self._recent_out
        while out_order and out_order[0][0] <= batch_id:
            batch, ref = out_order.popleft()
            if recent_out.get(ref) == batch:
                del recent_out[ref]

    def _still_valid(self, effects: list[Effect]) -> list[Effect]:
        """Drop a held dispatch whose claim was undone meanwhile (cancelled, killed): an
        at-most-once run must not go out after the engine gave it up."""
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Dispatch):
                run = self._run_by_id(effect.run.run_id)
                if (
                    run is None
                    or run.token != effect.run.token
                    or run.state is not RunState.CLAIMED
                ):
                    continue
                effect = self._numbered(run, effect.worker_id, effect.run)
            out.append(effect)
        return out

    def _reply_after_durable(self, request_id: int, result: dict[str, Any]) -> None:
        self._after_durable.append(Reply(request_id, result=result))

    # =============================================================== jobs: columns and lookups

    def _ensure_key(self, key: int) -> None:
        size = len(self._ver)
        if key >= size:
            # Grow by half, not double: at tens of millions of jobs the slack is the budget.
            more = max(key + 1 - size, size // 2, 1024)
            self._ver.extend(array("I", bytes(4 * more)))
            self._prof.extend(array("i", bytes(4 * more)))
            self._flags.extend(array("B", bytes(more)))
        self._next_key = max(self._next_key, key + 1)

    def _intern(self, profile: _Profile) -> int:
        identity = profile.identity()
        pid = self._profile_ids.get(identity)
        if pid is None:
            pid = self._profile_ids[identity] = len(self._profiles)
            self._profiles.append(profile)
        return pid

    def _profile_dicts(self) -> tuple[list[dict[str, object]], list[dict[str, Any]]]:
        """(policies, profiles) for a snapshot: each distinct policy's dict once, and every
        profile's dict form, in order, naming its policy by index in that table.

        A shard has few policies but, with ``every`` jobs, thousands of profiles: rendering
        each profile's policy at export and parsing it again at recovery was most of both.
        Profiles mostly share one policy object (parsing interns them), so the table is found
        by identity first and by value only for an object not seen yet. O(profiles)."""
        by_object: dict[int, int] = {}
        by_value: dict[Policy, int] = {}
        policies: list[dict[str, object]] = []
        out: list[dict[str, Any]] = []
        for profile in self._profiles:
            policy = profile.policy
            index = by_object.get(id(policy))  # every profile keeps its policy alive meanwhile
            if index is None:
                index = by_value.get(policy)
                if index is None:
                    index = by_value[policy] = len(policies)
                    policies.append(policy.to_dict())
                by_object[id(policy)] = index
            out.append(profile.to_dict(index))
        return policies, out

    def _profile(self, key: int) -> _Profile:
        return self._profiles[self._prof[key]]

    def _exists(self, key: int) -> bool:
        return key < len(self._ver) and self._ver[key] > 0

    def _next_due(self, key: int) -> int | None:
        flags = self._flags[key]
        if flags & _GONE:
            return None
        if flags & _PAUSED:
            return self._held_next.get(key)
        deferred = self._deferred.get(key)
        if deferred is not None:
            return deferred
        wheel = self._fire.get(self._profile(key).policy.tier)
        return wheel.due_of(key) if wheel is not None else None

    def _set_next(self, key: int, nxt: int | None) -> None:
        """Set the job's next fire time, in its tier's wheel unless paused or cancelled."""
        if self._deferred:
            self._deferred.pop(key, None)  # (its heap entry is dropped when it comes up)
        flags = self._flags[key]
        if flags & _GONE:
            self._held_next.pop(key, None)
        elif flags & _PAUSED:
            self._held_next[key] = nxt
        else:
            wheel = self._fire_wheel(self._profile(key).policy.tier)
            if nxt is None:
                wheel.cancel(key)
            else:
                wheel.schedule(key, nxt)

    def _unarm(self, key: int) -> int | None:
        """Take the job out of its wheel; return the next fire time it had."""
        nxt = self._next_due(key)
        if self._deferred:
            self._deferred.pop(key, None)
        if not self._flags[key] & (_PAUSED | _GONE):
            wheel = self._fire.get(self._profile(key).policy.tier)
            if wheel is not None:
                wheel.cancel(key)
        return nxt

    def _key_of(self, job_id: str, known: dict[str, int | None] | None = None) -> int | None:
        """The key of ``job_id``: what the engine knows of ids not yet durable, else the
        directory's (from ``known`` when it was asked beforehand)."""
        recent = self._recent_ids.get(job_id)
        if recent is not None:
            return recent[1]
        if known is not None and job_id in known:
            return known[job_id]
        return self._directory.key_of(job_id)

    def _stored_spec(self, key: int, version: int) -> dict[str, Any]:
        """The stored form of job ``key`` at ``version`` (its latest, durable or not): a copy
        the caller may keep (a pinned spec)."""
        return dict(self._read_spec(key, version))

    def _read_spec(self, key: int, version: int) -> Mapping[str, Any]:
        """:meth:`_stored_spec` to read only, not copied."""
        recent = self._recent.get(key)
        if recent is not None and recent[1] == version:
            return recent[2]
        found = self._directory.latest(key)
        if found is not None and found[0] == version:
            return found[1]
        raise _spec_missing(key, version, found)

    def _ticket_fields(self, key: int, version: int) -> tuple[str, Any]:
        """The job id and task of job ``key`` at ``version`` (its latest, durable or not):
        :meth:`_read_spec` narrowed to what a claim's ticket needs, which the directory may
        answer without decoding the whole spec."""
        recent = self._recent.get(key)
        if recent is not None and recent[1] == version:
            return recent[2]["id"], recent[2]["task"]
        found = self._directory.ticket_fields(key)
        if found is not None and found[0] == version:
            return found[1], found[2]
        raise _spec_missing(key, version, found)

    def _job_key(self, job_id: str) -> int:
        key = self._key_of(job_id)
        if key is None or not self._exists(key) or self._flags[key] & _GONE:
            raise JobNotFound(f"no job {job_id!r}", field="id")
        return key

    def _times(self, key: int) -> tuple[int, ...] | set[int]:
        """The times of job ``key``'s runs not final."""
        times = self._active.get(key)
        if times is None:
            return ()
        return (times,) if isinstance(times, int) else times

    def _add_time(self, key: int, at: int) -> None:
        times = self._active.get(key)
        if times is None:
            self._active[key] = at
        elif isinstance(times, int):
            if times != at:
                self._active[key] = {times, at}
        else:
            times.add(at)

    def _drop_time(self, key: int, at: int) -> None:
        times = self._active.get(key)
        if times is None:
            return
        if isinstance(times, int):
            if times == at:
                del self._active[key]
        else:
            times.discard(at)
            if len(times) == 1:
                self._active[key] = next(iter(times))
            elif not times:
                del self._active[key]

    def _run_job_id(self, run: _Run) -> str:
        if run.job_id is None:
            spec = run.pinned or self._stored_spec(run.key, self._ver[run.key])
            run.job_id = str(spec["id"])
        return run.job_id

    def _run_id(self, run: _Run) -> str:
        return run_id(self._run_job_id(run), run.at)

    # =============================================================== records

    def _apply(self, r: Record, *, recovering: bool) -> None:
        """Apply one record: all of it on recovery; live, what the record's maker has not set
        already (job bookkeeping, indexes)."""
        kind = r["t"]
        if recovering:
            stamped = r.get("e", 0)
            if stamped > self.epoch:
                raise StaleEpoch(f"record of epoch {stamped} is newer than {self.epoch}")
            if stamped < self._replay_epoch and "e" in r:
                # Written by an owner fenced off before the epoch opened earlier in the log:
                # a zombie's write the store should have refused. Its state is not ours.
                raise StaleEpoch(
                    f"record of epoch {stamped} after the shard was opened at epoch "
                    f"{self._replay_epoch}"
                )
        if kind == "fire":
            if recovering:
                self._apply_fire(r)
        elif kind == "job":
            self._apply_job(r, recovering)
        elif kind == "pos":
            if not recovering:
                return  # made from the columns, which are already set
            key = r["key"]
            self._unarm(key)
            flags = self._flags[key] & ~(_PAUSED | _GONE | _LATE_PAUSED | _ASKED)
            if r["paused"]:
                flags |= _PAUSED
            if r["gone"]:
                flags |= _GONE
            why = r.get("why")
            if why == "paused":
                flags |= _LATE_PAUSED
            elif why == "asked":
                flags |= _ASKED
            self._flags[key] = flags
            self._held_next.pop(key, None)
            self._set_next(key, r["next"])
        elif kind == "run":
            self._apply_run(r, recovering)
        elif kind == "out":
            self._outbox[r["seq"]] = r
            self._outbox_seq = max(self._outbox_seq, r["seq"])
        elif kind == "dep":
            if r.get("sq"):  # (absent from records before it)
                # (a record from before `at` existed: turned off no later than now, so kept a
                # whole window from here; with 0 it was forgotten at once: found by review)
                at = r.get("at", self._wall)
                self._note_dep_seq((r["up"], r["down"]), r["sq"], r["on"], at)
            downs = self._dependents.setdefault(r["up"], set())
            if r["on"]:
                downs.add(r["down"])
            else:
                downs.discard(r["down"])
                if not downs:
                    del self._dependents[r["up"]]
        elif kind == "outdone":
            self._outbox.pop(r["seq"], None)
        elif kind == "epoch":
            if recovering and r["epoch"] >= self.epoch:
                raise StaleEpoch(f"shard already opened at epoch {r['epoch']} (>= {self.epoch})")
            if recovering:
                self._replay_epoch = max(self._replay_epoch, r["epoch"])
        elif kind == "skip" and r.get("src") is not None:
            self._remember_source(r["src"], (r["key"], r["lo"]))
            if recovering:
                self._note_trigger_at(r["key"], r["lo"])
        elif kind == "note" and recovering and r.get("what") != "started":
            # A report of a run already final: a marked task's end ends its mark (as live,
            # see _matching).
            ref = (r["key"], r["at"])
            mark = self._marks_recovered.get(ref)
            if mark is not None and mark[0] == r.get("tok"):
                del self._marks_recovered[ref]
        # Otherwise "skip" and "note" are history only: nothing in memory depends on them.

    def _apply_job(self, r: Record, recovering: bool) -> None:
        key = r["key"]
        # Live, the validated spec is at hand; a replay parses only what a profile holds.
        live = self._live_spec
        if live is not None:
            # Jobs created together mostly share one profile (one-shots of one policy, a
            # fleet on one rule): the last one is reused when the spec holds the very same
            # objects, without building and hashing a profile (a policy hashes 14 fields).
            memo = self._last_profile
            schedule = live.schedule
            part = None if type(schedule) is AtSchedule else schedule
            if (
                memo is not None
                and memo[1] is live.policy
                and memo[2] is live.after
                and memo[0] is part
                and (part is None or not part.jitter_ms)
            ):
                pid = memo[3]
            else:
                pid = self._intern(_Profile.of(live))
                self._last_profile = (part, live.policy, live.after, pid)
        else:
            pid = self._stored_profile(r["spec"])
        existed = self._exists(key)
        nxt = self._unarm(key) if existed else None
        self._ensure_key(key)
        self._ver[key] = r["ver"]
        self._prof[key] = pid
        if existed:
            self._set_next(key, nxt)  # where it stood; the pos record that follows moves it
        if not recovering:
            batch = self._batch + 1  # this call's records become the next batch
            self._recent[key] = (batch, r["ver"], r["spec"])
            self._recent_ids[r["id"]] = (batch, key)
            self._recent_order.append((batch, key, r["id"]))

    def _stored_profile(self, spec: Mapping[str, Any]) -> int:
        """:meth:`_stored_profile_parsed`, its profile kept by the text of what it reads.

        Replays meet the same profile many times: a job's every version, jobs created alike,
        and, in one process, the same jobs again when a shard is recovered again (the
        simulation recovers a shard dozens of times). The text of the fields a profile comes
        from (the policy keys, ``after``, the schedule unless it is an ``at``, the id when the
        schedule has jitter) is cheaper than parsing them. ``repr`` tells apart what a dict
        key would not (``True``, ``1`` and ``1.0``); a refused spec is not kept. Profiles are
        values, so the cache is shared by every engine of the process (a bound, cleared when
        full).
        """
        raw = spec.get("schedule")
        is_map = isinstance(raw, Mapping)
        text = repr(
            (
                [spec.get(k, _ABSENT) for k in POLICY_KEYS],
                spec.get("after", _ABSENT),
                ("at",) if is_map and "at" in raw else ("s", raw),  # type: ignore[operator]
                spec.get("id", _ABSENT) if is_map and "jitter" in raw else None,  # type: ignore[operator]
            )
        )
        profile = _STORED_PROFILES.get(text)
        if profile is not None:
            return self._intern(profile)
        pid = self._stored_profile_parsed(spec)
        remember(_STORED_PROFILES, text, self._profiles[pid], _STORED_PROFILE_LIMIT)
        return pid

    def _stored_profile_parsed(self, spec: Mapping[str, Any]) -> int:
        """The interned profile of a stored (validated, normalized) spec.

        Validating a whole spec costs ~100 us and a replay meets thousands, so only what a
        profile holds is parsed: the policy (kept per distinct raw values by
        :func:`~engine.jobs.stored_policy`), ``after``, and the schedule, kept by its text
        (and the id, when its jitter depends on it). An ``at`` schedule is not parsed at all:
        a one-shot's profile holds no schedule.
        """
        policy, after = stored_policy(spec)
        raw = spec.get("schedule")
        if isinstance(raw, Mapping) and "at" in raw:
            return self._intern(_Profile(None, policy, after, None))
        job_id = spec.get("id")
        jitter_id = job_id if isinstance(raw, Mapping) and "jitter" in raw else None
        schedule = _stored_schedule(raw, jitter_id, self._wall)
        return self._intern(
            _Profile(schedule, policy, after, job_id if schedule.jitter_ms else None)
        )

    def _apply_fire(self, r: Record) -> None:
        """Recovery of on-time fires: each is a PENDING run and the job's new position."""
        for key, at, version, nxt in zip(r["keys"], r["ats"], r["vers"], r["next"], strict=True):
            ref = (key, at)
            if ref not in self._runs:
                pid = self._prof[key]
                self._runs[ref] = _Run(key, at, version, pid, self._profiles[pid].policy)
                self._add_time(key, at)
            self._flags[key] &= ~(_LATE_PAUSED | _ASKED)
            self._set_next(key, nxt)

    def _apply_run(self, r: Record, recovering: bool) -> None:
        key, at = r["key"], r["at"]
        ref = (key, at)
        run = self._runs.get(ref)
        if not recovering and run is not None:
            # Live, the run object already holds what the record says (the record was made
            # from it); only the job's bookkeeping follows. The recovery tests compare both.
            state = run.state
        else:
            state = RunState(r["state"])
        if run is None:
            pinned = r.get("spec")
            if pinned is not None:
                # Read as a stored spec, as a job record's is: it was validated when written,
                # and a check added to creates since (host-only zones) must not keep the shard
                # from recovering (found by review: a snapshot with such a pinned run could
                # not be loaded).
                pid = self._stored_profile(pinned)
            else:
                pid = self._prof[key]
            run = _Run(key, at, r["ver"], pid, self._profiles[pid].policy, pinned=pinned)
            self._runs[ref] = run
        if recovering:
            run.state, run.attempt, run.token, run.worker = state, r["att"], r["tok"], r["w"]
            run.due, run.failures, run.timeouts = r["due"], r["fail"], r["tmo"]
            run.source, run.exit, run.why = r["src"], r["exit"], r["why"]
            run.orphan = bool(r.get("cx"))
            run.clock_from = r.get("st")
            run.depth = r.get("dp", 0)  # absent from records before chain depths: 0
            if r.get("spec") is not None:
                run.pinned = r["spec"]
            if run.source is not None:
                self._remember_source(run.source, ref)
                # (a finished triggered run leaves _runs: a trigger after the restart must
                # still not take its id; found by review)
                self._note_trigger_at(key, at)
        if state._value_ in FINAL_VALUES:
            self._drop_time(key, at)
            if self._buffered.get(key) == at:
                del self._buffered[key]
            if not recovering:
                return  # the live path releases the run itself (timers, queues)
            del self._runs[ref]
            if r.get("mk") and r["w"] is not None:
                self._marks_recovered[ref] = (r["tok"], r["w"])
        else:
            self._add_time(key, at)
            if r.get("buf"):
                self._buffered[key] = at
            elif self._buffered.get(key) == at:
                del self._buffered[key]

    def _run_record(self, run: _Run, *, buffered: bool = False) -> Record:
        # A dict literal rather than records.make(): this runs for every state change.
        record: Record = {
            "t": "run",
            "v": rec.FORMAT_VERSION,
            "key": run.key,
            "at": run.at,
            "state": run.state._value_,
            "att": run.attempt,
            "tok": run.token,
            "w": run.worker,
            "ver": run.version,
            "due": run.due,
            "fail": run.failures,
            "tmo": run.timeouts,
            "src": run.source,
            "exit": run.exit,
            "why": run.why,
        }
        if buffered:
            record["buf"] = True
        if run.orphan:
            record["cx"] = True
        if run.depth:
            record["dp"] = run.depth
        if run.marked:
            record["mk"] = True
        if run.clock_from is not None and run.state._value_ in IN_FLIGHT_VALUES:
            record["st"] = run.clock_from
        elif run.state._value_ in FINAL_VALUES:
            # When it ended, in engine time: retention by age counts from it (a one-shot
            # long past, run now, kept its logs a minute when it counted from its time).
            record["end"] = self._wall
        if run.pinned is not None:
            # A run of an older version than the job's: its pinned spec travels with it, so
            # that recovery can rebuild what this run executes.
            record["spec"] = run.pinned
        return record

    def _persist_run(self, run: _Run, *, buffered: bool = False) -> None:
        self._emit(self._run_record(run, buffered=buffered))

    def _emit_job(self, key: int, version: int, spec: JobSpec) -> None:
        self._live_spec = spec
        try:
            # Records are encoded, never changed: the spec's task need not be copied.
            stored = spec.to_dict(copy_task=False)
            self._emit(
                {
                    "t": "job",
                    "v": rec.FORMAT_VERSION,
                    "key": key,
                    "id": spec.id,
                    "ver": version,
                    "spec": stored,
                }
            )
        finally:
            self._live_spec = None

    def _persist_pos(self, key: int) -> None:
        self._persist_pos_at(key, self._next_due(key))

    def _persist_pos_at(self, key: int, nxt: int | None) -> None:
        """:meth:`_persist_pos` when the caller knows the job's next fire time, ``nxt``: what
        ``_next_due(key)`` would say (the caller has just set it)."""
        flags = self._flags[key]
        gone = bool(flags & _GONE)
        # Every owed time before the next fire time is accounted for (by a run or a skip
        # record); a cancelled job owes nothing after now; an exhausted one owes nothing more.
        if gone:
            acct = self._wall
        elif nxt is None:
            acct = ACCT_EXHAUSTED
        else:
            acct = nxt - 1
        # A dict literal rather than records.make(): this runs for every create.
        self._emit(
            {
                "t": "pos",
                "v": rec.FORMAT_VERSION,
                "key": key,
                "next": nxt,
                "acct": acct,
                "paused": bool(flags & _PAUSED),
                "gone": gone,
                "why": _POS_WHY[flags & (_ASKED | _LATE_PAUSED)],
            }
        )

    # =============================================================== job commands

    def _create(self, cmd: CreateJob) -> None:
        self._reply_after_durable(cmd.request_id, self._create_job(cmd.spec))

    def _create_jobs(self, cmd: CreateJobs) -> None:
        # One reply for the lot: under a bulk create, a reply object per job (and the driver's
        # slot and callback for it) was a good part of a create's cost.
        results: list[dict[str, Any] | EngineError] = []
        # The directory's keys of the chunk's ids, asked at once (a store's multi-get, not a
        # lookup a job: ~1 us a create). Exact for the whole chunk: the directory changes only
        # with what the engine already knows as not yet durable (_recent_ids, asked first),
        # which takes in the chunk's own creates as they go.
        recent = self._recent_ids
        asked = [spec.id for spec in cmd.specs if spec.id not in recent]
        known = dict(zip(asked, self._directory.keys_of(asked), strict=True))
        for spec in cmd.specs:
            try:
                results.append(self._create_job(spec, known))
            except EngineError as error:
                results.append(_bare(error))
        self._reply_after_durable(cmd.request_id, {"results": results})

    def _create_job(
        self, spec: JobSpec, known: dict[str, int | None] | None = None
    ) -> dict[str, Any]:
        """Create (or, with ``replace``, update) the job ``spec``; return its description.
        Raises :class:`JobExists` (nothing changed) for a live job without ``replace``.
        ``known``: the directory's keys of ids, asked beforehand (:meth:`_create_jobs`)."""
        existing = self._key_of(spec.id, known)
        live = existing is not None and self._exists(existing) and not self._flags[existing] & _GONE
        if live and not spec.replace:
            raise JobExists(f"job {spec.id!r} exists (set replace to overwrite)", field="id")
        if live:
            assert existing is not None
            return self._update_job(spec, as_create=True, key=existing)
        to_pin: list[tuple[_Run, dict[str, Any]]] = []
        if existing is not None and self._exists(existing):
            # A cancelled job's key: its runs still in flight keep their version's spec.
            key, version = existing, self._ver[existing] + 1
            to_pin = self._runs_to_pin(key)
        else:
            key, version = self._next_key, 1
        self._emit_job(key, version, spec)
        self._pin(key, to_pin, spec.id)
        self._send_registrations(spec.id, (), spec.after)
        self._buffered.pop(key, None)
        nxt = self._first_due(spec, existing)
        self._flags[key] = (_PAUSED if spec.paused else 0) | self._asked(spec, nxt)
        self._held_next.pop(key, None)
        self._set_next(key, nxt)
        # Not cancelled: its next fire time is now nxt, in the wheel or held while paused.
        self._persist_pos_at(key, nxt)
        return self._describe_at(key, spec.id, nxt)

    def _asked(self, spec: JobSpec, nxt: int | None) -> int:
        """``_ASKED`` if ``nxt``, the first time a new version ``spec`` owes, is a one-shot
        time already past (it runs whatever the catch-up policy says); else 0."""
        if nxt is not None and nxt <= self._wall and type(spec.schedule) is AtSchedule:
            return _ASKED
        return 0

    def _runs_to_pin(self, key: int) -> list[tuple[_Run, dict[str, Any]]]:
        """Runs of job ``key`` not final and not pinned yet, with the spec they execute: read
        before a new version replaces it (runs keep executing their own version)."""
        out = []
        for at in sorted(self._times(key)):
            run = self._runs[(key, at)]
            if run.pinned is None:
                out.append((run, self._stored_spec(key, run.version)))
        return out

    def _pin(self, key: int, runs: list[tuple[_Run, dict[str, Any]]], job_id: str) -> None:
        for run, spec in runs:
            run.pinned = spec
            run.job_id = job_id
            self._persist_run(run, buffered=self._buffered.get(key) == run.at)

    def _first_due(self, spec: JobSpec, key: int | None = None) -> int | None:
        """The first fire time a new version owes. ``key``: the job's key when the version
        replaces another (a replacing create, a create of a cancelled id)."""
        schedule = spec.schedule
        if isinstance(schedule, AtSchedule):
            # A one-shot time already past is still owed: the caller asked for that run...
            at = schedule.next_after(-(2**62))
            if at is not None and key is not None and at <= self._wall and self._ran(key, at):
                # ...unless this id already has a run at that time: the run id (job id +
                # time) is the task's idempotency key, and DESIGN makes a repeated creation
                # a no-op. Firing it again would run that key twice (at-most-once included).
                return None
            return at
        if isinstance(schedule, EverySchedule):
            # Its first time a moment ago is owed, as any fire less than misfire_ms late is:
            # the default start is the node's clock when the request arrived, and this turn
            # comes later (dropping it silently lost the first fire of most bulk creates).
            first = schedule.next_after(schedule.start_ms - 1)
            if (
                first is not None
                and first < self._wall
                and self._wall - first <= self.config.misfire_ms
                and not (key is not None and self._ran(key, first))
            ):
                return first
        nxt = schedule.next_after(self._wall - 1)
        if nxt == self._wall and key is not None and self._ran(key, nxt):
            # Now itself is owed only if this id has no run at it that went out: a replacing
            # create (or a cancel and create) in the millisecond of a fire that ran, or with
            # the engine's clock held by a setback, fired it again (found by review).
            return schedule.next_after(self._wall)
        return nxt

    def _ran(self, key: int, at: int) -> bool:
        """The run of ``key`` at ``at`` went out to a worker: in memory past PENDING (or on
        a later attempt), or so recorded in the store. A run that only fired (cancelled or
        skipped before any worker had it) did not: its time may be owed again. (A claim's
        record is durable before, or with, anything the run's worker does.)"""
        run = self._runs.get((key, at))
        if run is not None:
            return run.state is not RunState.PENDING or run.attempt > 1
        return (key, at) in self._recent_out or self._directory.has_run(key, at)

    def _update(self, cmd: UpdateJob) -> None:
        if cmd.expected_version is not None:
            current = self._ver[self._job_key(cmd.spec.id)]
            if current != cmd.expected_version:
                raise VersionConflict(
                    f"job {cmd.spec.id!r} is at version {current}, not "
                    f"{cmd.expected_version}: read it again and redo the update",
                    field="if_version",
                )
        self._reply_after_durable(cmd.request_id, self._update_job(cmd.spec, as_create=False))

    def _update_job(
        self, spec: JobSpec, *, as_create: bool, key: int | None = None
    ) -> dict[str, Any]:
        """The job's new version ``spec``; its description. Raises :class:`JobNotFound`.
        ``key``: the live job's key when the caller has just looked it up (a replacing
        create), else looked up here."""
        if key is None:
            key = self._job_key(spec.id)
        self._take_back_fired_ahead(key, spec.id, "updated")
        # The new version owes its fire times after now (those of the old version up to now
        # were run or skipped); a replacing create owes what a fresh create would. A one-shot
        # time already past is owed by an update as by a create (the caller asked for that
        # run), unless that time already went out (_first_due).
        if as_create or isinstance(spec.schedule, AtSchedule):
            nxt = self._first_due(spec, key)
        else:
            nxt = spec.schedule.next_after(self._wall)
        # The new version replaces the old one's unfired times, but for the one it owes
        # itself: skipped and then run, a one-shot's past time was accounted for twice
        # (found by review).
        self._skip_unfired(key, "updated", keep=nxt)
        old_version = self._ver[key]
        old_after = self._profile(key).after
        to_pin = self._runs_to_pin(key)
        self._unarm(key)
        self._emit_job(key, old_version + 1, spec)
        self._pin(key, to_pin, spec.id)
        self._send_registrations(spec.id, old_after, spec.after)
        self._flags[key] = (self._flags[key] & ~(_ASKED | _LATE_PAUSED)) | self._asked(spec, nxt)
        self._set_next(key, nxt)
        self._persist_pos(key)
        return self._describe(key, spec.id)

    def _cancel(self, cmd: CancelJob) -> None:
        key = self._job_key(cmd.job_id)
        self._send_registrations(cmd.job_id, self._profile(key).after, ())
        self._skip_unfired(key, "cancelled")
        self._unarm(key)
        self._flags[key] |= _GONE
        self._held_next.pop(key, None)
        self._persist_pos(key)
        for at in sorted(self._times(key)):
            run = self._runs[(key, at)]
            run.job_id = cmd.job_id
            if run.state is RunState.PENDING:
                self._finalize(run, RunEvent.CANCEL, why="job cancelled")
            elif cmd.stop_running:
                if run.worker is not None:
                    # After the CANCELLED record is durable: a crash before would bring the
                    # run back in flight, its task killed under it.
                    self._after_durable.append(
                        Kill(run.worker, self._run_id(run), run.token, "job cancelled")
                    )
                    self._note_stopping(run, run.worker)
                self._finalize(run, RunEvent.CANCEL, why="job cancelled")
            else:
                # It carries on to its end, as this version's last run: no retry, and no
                # second dispatch if its worker is lost (see _orphaned).
                run.orphan = True
                self._persist_run(run, buffered=self._buffered.get(key) == run.at)
        if cmd.stop_running and self._marked:
            # Runs final as TIMED_OUT under on_timeout=mark whose tasks still run: the job's
            # too ("kills runs held by workers"). Their outcome is already recorded; the kill
            # only stops the task (its report then ends the mark, see _matching). Sent after
            # this batch, like the other kills, though nothing here depends on it.
            prefix = cmd.job_id + "@"
            for rid, (token, worker_id) in self._marked.items():
                if rid.startswith(prefix):
                    self._after_durable.append(Kill(worker_id, rid, token, "job cancelled"))
        self._reply_after_durable(cmd.request_id, {"id": cmd.job_id, "cancelled": True})

    def _pause(self, cmd: PauseJob) -> None:
        key = self._job_key(cmd.job_id)
        if not self._flags[key] & _PAUSED:
            taken = self._take_back_fired_ahead(key, cmd.job_id, "paused")
            nxt = self._unarm(key)
            if taken is not None and (nxt is None or taken < nxt):
                nxt = taken  # owed again: it fires at the resume, or catch-up decides
            self._flags[key] |= _PAUSED
            self._held_next[key] = nxt
            self._persist_pos(key)
        self._reply_after_durable(cmd.request_id, self._describe(key, cmd.job_id))

    def _take_back_fired_ahead(self, key: int, job_id: str, why: str) -> int | None:
        """Cancel job ``key``'s runs fired ahead and not due yet (PENDING and never sent: a
        run made ahead waits for its time, and only such a run is PENDING at a time after
        now with no ready time of its own), so that a pause or an update inside the
        fire-ahead window decides their times as it would have before they fired (found by
        review: an update's new version skipped the time as an overlap, and its reply
        named it as its next fire). Returns the earliest time taken back (None: none)."""
        wall, earliest = self._wall, None
        for at in sorted(t for t in self._times(key) if t > wall):
            run = self._runs[(key, at)]
            if run.state is RunState.PENDING and run.due is None:
                run.job_id = job_id
                self._finalize(run, RunEvent.CANCEL, why=f"{why} before its time")
                if earliest is None:
                    earliest = at
        return earliest

    def _resume(self, cmd: ResumeJob) -> None:
        key = self._job_key(cmd.job_id)
        flags = self._flags[key]
        if flags & _PAUSED:
            nxt = self._held_next.pop(key, None)
            self._flags[key] = flags & ~(_PAUSED | _LATE_PAUSED)
            if nxt is not None and nxt <= self._wall and not flags & _ASKED:
                # Fire times missed while paused go through the catch-up policy here, however
                # short the pause: left to the wheel, a time less than misfire_ms late would
                # fire as on time, and so would every one after it (a burst of them all).
                # Those kept are armed from the first (the wheel fires the rest, and the
                # backpressure bound still holds); the next regular time runs normally.
                self._flags[key] |= _LATE_PAUSED
                keep, after = self._catch_up(key, nxt)
                if keep:
                    nxt = keep[0]
                else:
                    nxt = after
                    self._flags[key] &= ~_LATE_PAUSED  # nothing missed is left to fire
            self._set_next(key, nxt)
            self._persist_pos(key)
        self._reply_after_durable(cmd.request_id, self._describe(key, cmd.job_id))

    def _get(self, cmd: GetJob) -> None:
        key = self._job_key(cmd.job_id)
        # What it describes may not be durable yet: the answer waits until it is.
        self._reply_after_durable(cmd.request_id, self._describe(key, cmd.job_id))

    def _describe(self, key: int, job_id: str) -> dict[str, Any]:
        return self._describe_at(key, job_id, self._next_due(key))

    def _describe_at(self, key: int, job_id: str, nxt: int | None) -> dict[str, Any]:
        """:meth:`_describe` when the caller knows ``_next_due(key)``: ``nxt``."""
        paused = bool(self._flags[key] & _PAUSED)
        described: dict[str, Any] = {
            "id": job_id,
            "version": self._ver[key],
            "next_fire_ms": None if paused else nxt,
            "paused": paused,
            "active_runs": sorted(run_id(job_id, at) for at in self._times(key))
            if key in self._active
            else [],
        }
        if not paused and nxt is not None and nxt <= self._wall:
            waiting = self._fire_held_reason(key)
            if waiting is not None:
                described["waiting"] = waiting
        return described

    def _fire_held_reason(self, key: int) -> str | None:
        """Why job ``key``'s due fire has not happened, when it is held back in the wheel by
        its tier's ready bound (found by the fifth adversarial pass: a next fire in the past,
        no run, and nothing said why); None when the tier has room (it fires at the next tick)."""
        tier = self._profile(key).policy.tier
        if self._tier_open(tier):
            return None
        why = (
            f"not fired yet: tier {tier!r} holds {self._pending.get(tier, 0)} pending runs, "
            f"its ready bound; the fire waits for room"
        )
        if not any(tier in w.tiers for w in self._workers.values()):
            why += f" (no worker serves tier {tier!r})"
        return why

    # =============================================================== firing

    def _fire_tier(self, tier: str) -> None:
        """Fire what is due in ``tier``, no more than its ready bound leaves room for: the rest
        of a burst stays in the wheel (due, and first in line), not as runs in memory."""
        wheel = self._fire[tier]
        horizon = self._wall + self.config.fire_ahead_ms
        while self._tier_open(tier):
            nd = wheel.next_due()
            if nd is None or nd > horizon:
                return
            room = self.config.ready_bound - self._pending.get(tier, 0)
            fired = wheel.advance(horizon, limit=room)
            if not fired:
                return
            self._fire_many(tier, wheel, fired)

    def _fire_many(self, tier: str, wheel: TimingWheel, fired: list[tuple[int, int]]) -> None:
        """Fire ``fired`` (due, key) pairs of ``tier``'s wheel.

        The common case (on time, no overlap rule to apply) is one run object and four list
        appends per fire, all of them described by one ``fire`` record; the rest goes through
        :meth:`_fire_job`. This loop is the engine's hot path: keep lookups local.
        """
        keys: list[int] = []
        ats: list[int] = []
        vers: list[int] = []
        nexts: list[int | None] = []
        wall, misfire = self._wall, self._misfire_ms
        flags, profs, ver = self._flags, self._prof, self._ver
        profiles, active, runs = self._profiles, self._active, self._runs
        fresh: list[_Run] = []
        for due, key in fired:
            pid = profs[key]
            profile = profiles[pid]
            ref = (key, due)
            if due > wall:
                if profile.policy.overlap != "allow" or ref in runs:
                    # Inside the fire-ahead window, but an overlap rule (or a run of the same
                    # id) is decided with what is in flight at the time: then. Any overlap
                    # rule, even with nothing in flight now: a run made ahead would count as
                    # in flight for a triggered run's rule inside the window (found by
                    # review: a trigger's run cancelled the later scheduled one).
                    self._defer_fire(key, due)
                    continue
            elif (
                wall - due > misfire
                or (key in active and profile.policy.overlap != "allow")
                or ref in runs
            ):
                self._fire_job(key, due)
                continue
            schedule = profile.schedule
            nxt = schedule.next_after(due) if schedule is not None else None
            version = ver[key]
            run = runs[ref] = _Run(key, due, version, pid, profile.policy)
            fresh.append(run)
            times = active.get(key)
            if times is None:
                active[key] = due
            elif type(times) is int:
                active[key] = {times, due}
            else:
                times.add(due)  # type: ignore[union-attr]
            if flags[key] & (_LATE_PAUSED | _ASKED):
                flags[key] &= ~(_LATE_PAUSED | _ASKED)
            if nxt is not None:
                wheel.schedule(key, nxt)
            keys.append(key)
            ats.append(due)
            vers.append(version)
            nexts.append(nxt)
        if keys:
            self._pending[tier] = self._pending.get(tier, 0) + len(keys)
            self._emit(
                {
                    "t": "fire",
                    "v": rec.FORMAT_VERSION,
                    "keys": keys,
                    "ats": ats,
                    "vers": vers,
                    "next": nexts,
                }
            )
            # Ready at once: a claim made before this batch is durable goes into a later
            # batch of the same call or after, and its dispatch waits for that batch (see
            # _claim), so a run is never sent before its fire and its claim are durable, and
            # a fire and its claim usually share one batch: one fsync on the way out, not two.
            batch = self._batch + 1
            for run in fresh:
                run.fired_batch = batch
                if run.at > wall:
                    self._schedule_retry(run, run.at)  # fired ahead: it goes out at its time
                else:
                    self._enqueue(run)

    def _fire_job(self, key: int, due: int) -> None:
        """Fire one job due at ``due``: late (the catch-up policy decides), or with runs of
        its own still in flight (the overlap policy decides)."""
        schedule = self._profile(key).schedule
        # A time asked for (a past one-shot of a create or update) is never a missed one.
        late = self._wall - due > self._misfire_ms and not self._flags[key] & _ASKED
        run_at: list[int] = []
        if not late:
            run_at.append(due)
            nxt = schedule.next_after(due) if schedule is not None else None
            self._flags[key] &= ~(_LATE_PAUSED | _ASKED)
        else:
            keep, nxt = self._catch_up(key, due)
            run_at.extend(keep)
            # Decided: a later miss is the scheduler's (catchup), not the pause's.
            self._flags[key] &= ~_LATE_PAUSED
        for at in run_at:
            self._new_run(key, at)
        if "lose-fire" in self.config.mutants and nxt is not None:
            self._persist_pos_at(key, nxt)  # the mutant: recorded, never armed
            return
        self._set_next(key, nxt)
        self._persist_pos(key)

    def _catch_up(self, key: int, first: int) -> tuple[list[int], int | None]:
        """Apply job ``key``'s catch-up policy to its fire times from ``first`` (missed) up to
        now: record those it does not run as skipped (reason :meth:`_late_reason`); return
        those it runs, oldest first, and the job's next fire time after them all.

        The times kept are always the newest, consecutive fire times (a suffix of those
        owed), so a caller may also arm the first of them and let the wheel fire the rest.
        """
        profile = self._profile(key)
        policy, now = profile.policy, self._wall
        # (how many of the newest owed times the policy may keep: all it needs to see)
        keeps = 0 if policy.catchup == "skip" else 1 if policy.catchup == "latest" else None
        owed, nxt = self._owed(
            key, profile.schedule, first, now, policy.max_catchup if keeps is None else keeps
        )
        if policy.catchup == "skip":
            keep: list[int] = []
        elif policy.catchup == "latest":
            keep = owed[-1:]
        else:
            window = [t for t in owed if t >= now - policy.catchup_window_ms]
            keep = window[-policy.max_catchup :]
        keep_set = set(keep)
        skipped = [t for t in owed if t not in keep_set]
        if skipped:  # always a prefix of owed: the policies keep the newest
            self._skip(key, skipped[0], skipped[-1], len(skipped), self._late_reason(key))
        return keep, nxt

    def _late_reason(self, key: int) -> str:
        return "paused" if self._flags[key] & _LATE_PAUSED else "catchup"

    def _owed(
        self, key: int, schedule: Schedule | None, first: int, now: int, need: int
    ) -> tuple[list[int], int | None]:
        """Fire times from ``first`` up to ``now``, and the next one after them.

        When there are more than ``max_enumerate``, the oldest are recorded as one skip range
        (count unknown) and only the newest are returned, at least ``need`` of them (as many
        as the catch-up policy may keep: it only ever keeps the newest) and at most
        ``max_enumerate``.
        """
        if schedule is None:
            return [first], None  # a one-shot: nothing after its one time
        most = self.config.max_enumerate
        need = min(need, most)
        owed = [first]
        while True:
            t = schedule.next_after(owed[-1])
            if t is None or t > now:
                return owed, t
            if len(owed) >= most:
                break
            owed.append(t)
        # Too many: bisect for a start after which ``need`` (as many as the policy may keep)
        # to max_enumerate times are owed; those are the newest, and the older ones one skip
        # range. (Halving towards now alone, a schedule with no time in the newer half, as a
        # burst of fires long ago, gave none at all, and catchup=latest ran nothing; stopping
        # at the first start with any time after it gave catchup=all fewer than it keeps:
        # both found by review.) Invariant: more than max_enumerate times in (lo, now], fewer
        # than ``need`` in (hi, now]; the two meet only if some millisecond held two times,
        # which no schedule makes.
        lo, hi = first - 1, now
        tail: list[int] = []
        t = None
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            tail = []
            t = schedule.next_after(mid)
            while t is not None and t <= now and len(tail) <= most:
                tail.append(t)
                t = schedule.next_after(t)
            if len(tail) > most:
                lo = mid
            elif len(tail) < max(need, 1):
                hi = mid
            else:
                break  # (t: the first time after now, or None)
        else:  # (unreachable for a schedule whose times are distinct)
            tail, t = [], schedule.next_after(now)
        self._skip(key, first, tail[0] - 1 if tail else now, -1, self._late_reason(key))
        return tail, t

    def _skip(
        self, key: int, lo: int, hi: int, n: int, why: str, source: str | None = None
    ) -> None:
        """Record ``n`` fire times in ``[lo, hi]`` not run (``n=-1``: all of them, uncounted)."""
        record = rec.make("skip", key=key, lo=lo, hi=hi, n=n, why=why)
        if source is not None:
            record["src"] = source  # so a redelivered trigger is still recognised
        self._emit(record)

    def _skip_unfired(self, key: int, why: str, keep: int | None = None) -> None:
        """Account for fire times owed but not fired yet (paused, or the tier was full) when
        the job changes under them; all but ``keep``, a time the job's new version owes."""
        nxt = self._next_due(key)
        if nxt is not None and nxt <= self._wall:
            why = "paused" if self._flags[key] & _PAUSED else why
            if keep is None or not nxt <= keep <= self._wall:
                self._skip(key, nxt, self._wall, -1, why)
                return
            if nxt < keep:
                self._skip(key, nxt, keep - 1, -1, why)
            if keep < self._wall:
                self._skip(key, keep + 1, self._wall, -1, why)

    def _new_run(self, key: int, at: int, source: str | None = None, depth: int = 0) -> _Run | None:
        ref = (key, at)
        if ref in self._runs:
            # A run of this id (job id @ time) is still in flight: an earlier version's, whose
            # job was cancelled or replaced around it. This fire time cannot have a run of its
            # own (the id is the task's idempotency key); it is skipped as an overlap.
            self._skip(key, at, at, 1, "overlap", source)
            return None
        pid = self._prof[key]
        policy = self._profiles[pid].policy
        overlap = policy.overlap
        waiting = self._buffered.get(key)
        active = self._times(key)
        busy = sorted(t for t in active if t != waiting) if active else []
        buffered = False
        if busy and overlap == "skip":
            self._skip(key, at, at, 1, "overlap", source)
            return None
        if busy and overlap == "buffer_one":
            if waiting is not None:
                self._skip(key, at, at, 1, "overlap", source)
                return None
            buffered = True
        if overlap == "cancel_previous" and waiting is not None:
            # A run left waiting by an earlier version's buffer_one: the new run replaces it
            # too (it was released later, and ran beside the new one: found by review).
            busy.append(waiting)
            del self._buffered[key]
        if busy and overlap == "cancel_previous":
            for t in busy:
                prev = self._runs[(key, t)]
                if prev.worker is not None and prev.state._value_ in IN_FLIGHT_VALUES:
                    # After its CANCELLED record is durable (a crash before brings it back).
                    self._after_durable.append(
                        Kill(prev.worker, self._run_id(prev), prev.token, "cancel_previous")
                    )
                    self._note_stopping(prev, prev.worker)
                self._finalize(prev, RunEvent.CANCEL, why="cancel_previous")
        run = _Run(key, at, self._ver[key], pid, policy, source=source, depth=depth)
        # Its creating record is in this call's batch: no dispatch of it before that is durable
        # (a triggered run forgotten by a crash would run again under another run id).
        run.fired_batch = self._batch + 1
        self._count_pending(run, +1)
        self._runs[ref] = run
        if source is not None:
            self._remember_source(source, ref)
        if at > self._wall:
            run.due = at  # a triggered run, ready at its own time
        self._persist_run(run, buffered=buffered)
        if buffered:
            self._buffered[key] = at
        elif run.due is not None:
            self._schedule_retry(run, run.due)
        else:
            self._ready_after_durable.append(ref)
        return run

    # =============================================================== triggers and outbox

    def _trigger(self, cmd: TriggerJob) -> None:
        # A repeat is the same source for the same target job: the other dependents of one
        # upstream run are not repeats. Looked up before the job itself, so that a redelivery
        # to a job cancelled since is still answered as one.
        known = self._key_of(cmd.job_id)
        if (
            known is not None
            and (known, cmd.source_run_id) in self._sources
            and "trigger-no-dedupe" not in self.config.mutants
        ):
            # The original may not be durable yet: the source must not drop its outbox entry
            # before it is.
            self._reply_after_durable(cmd.request_id, {"duplicate": True})
            return
        key = self._job_key(cmd.job_id)
        depth = cmd.depth + 1
        # A chain of triggers this long is a cycle (or as good as one): it ends here. A paused
        # job runs nothing, triggered runs included. Either is accounted for as a skip with its
        # source (so that a redelivery is still recognised).
        refused = (
            "chain_too_deep"
            if depth > self.config.max_chain_depth
            else "paused"
            if self._flags[key] & _PAUSED
            else None
        )
        at = self._trigger_time(key)
        if at is None and refused is None:
            # Every millisecond ahead is a time the schedule owes (an `every 1ms`): the
            # scheduled runs are this trigger's runs; nothing of its own is made or recorded.
            self._reply_after_durable(cmd.request_id, {"run_id": None, "skipped": "no_free_time"})
            return
        if at is None:
            # Refused all the same, and recorded with its source so that a redelivery is a
            # repeat (found by review): its skip shares a time the schedule owes, which is
            # accounted for twice then, never not at all.
            at = self._first_trigger_time(key)
        self._note_trigger_at(key, at)
        if refused is not None:
            self._skip(key, at, at, 1, refused, cmd.source_run_id)
            self._reply_after_durable(
                cmd.request_id, {"run_id": run_id(cmd.job_id, at), "skipped": refused}
            )
            return
        run = self._new_run(key, at, source=cmd.source_run_id, depth=depth)
        if run is not None:
            run.job_id = cmd.job_id
        self._reply_after_durable(cmd.request_id, {"run_id": run_id(cmd.job_id, at)})

    def _trigger_time(self, key: int) -> int | None:
        """The time of a triggered run (or skip) of job ``key``: just after now, after every
        time earlier triggers of the job were given, and never on a time its run id would
        share: a run in flight, the next scheduled fire, nor (with the tier full, the next
        due time past) any later time the schedule owes (a trigger taking one made two runs
        of one run id: found by review). It waits until that millisecond. None when the
        first ``_TRIGGER_SEARCH_MS`` candidates are all taken (only a schedule firing every
        millisecond or two owes so many in a row)."""
        at = self._first_trigger_time(key)
        nxt = self._next_due(key)
        schedule = self._profile(key).schedule
        for _ in range(_TRIGGER_SEARCH_MS):
            if not (
                (key, at) in self._runs
                or at == nxt
                # a run of that id that went out and ended (a clock behind after a restart
                # reaches times that already ran: found by review)
                or self._ran(key, at)
                or (
                    nxt is not None
                    and at > nxt
                    and schedule is not None
                    and schedule.next_after(at - 1) == at
                )
            ):
                return at
            at += 1
        return None

    def _first_trigger_time(self, key: int) -> int:
        """Where the search for a triggered time of job ``key`` starts: just after now, and
        after every time earlier triggers of the job were given."""
        return max(self._wall + 1, self._trigger_at.get(key, 0) + 1)

    def _note_trigger_at(self, key: int, at: int) -> None:
        """Remember ``at`` as the newest time given to a triggered run of job ``key`` (run or
        skipped); forget times already past now, which no new trigger can take anyway (a
        new one starts after now): bounded by the jobs triggered in the last moments. The
        pass that forgets runs when the map has doubled since the last one left it, so a
        burst of triggers within one millisecond (none past yet) costs O(1) each, not a
        scan each (found by review)."""
        self._trigger_at[key] = max(at, self._trigger_at.get(key, 0))
        if len(self._trigger_at) > self._trigger_at_prune:
            wall = self._wall
            self._trigger_at = {k: t for k, t in self._trigger_at.items() if t > wall}
            self._trigger_at_prune = max(_TRIGGER_AT_PRUNE, 2 * len(self._trigger_at))

    def _remember_source(self, source: str, ref: RunRef) -> None:
        """Remember that job ``ref[0]`` ran (or skipped) a trigger from ``source`` at time
        ``ref[1]``; forget what is older than the dedupe window."""
        self._sources[(ref[0], source)] = ref[1]
        horizon = self._wall - self.config.trigger_dedupe_ms
        while self._sources:
            oldest = next(iter(self._sources))
            if self._sources[oldest] >= horizon:
                break
            del self._sources[oldest]

    def _send_trigger(self, target_job: str, source: _Run) -> None:
        if "no-trigger" in self.config.mutants:
            return
        out = rec.make("out", seq=0, job=target_job, src=self._run_id(source))
        if source.depth:
            out["dp"] = source.depth  # the source's chain depth; absent: 0 (a scheduled run)
        self._send(out)

    def _send_registrations(self, job_id: str, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Tell the shards of the jobs ``job_id`` runs after: added ones, and dropped ones."""
        if not old and not new:
            return  # nearly every job: no dependencies, no sets to build
        for up in sorted(set(new) - set(old)):
            self._send(rec.make("out", seq=0, job=job_id, src=None, dep={"up": up, "on": True}))
        for up in sorted(set(old) - set(new)):
            self._send(rec.make("out", seq=0, job=job_id, src=None, dep={"up": up, "on": False}))

    def _send(self, record: Record) -> None:
        """Put ``record`` in the durable outbox; its effect leaves once it is durable."""
        self._outbox_seq += 1
        record["seq"] = self._outbox_seq
        self._emit(record)
        self._after_durable.append(self._outbox_effect(record))

    @staticmethod
    def _outbox_effect(out: Record) -> Effect:
        dep = out.get("dep")
        if dep is not None:
            return Register(out["seq"], dep["up"], out["job"], dep["on"])
        return Trigger(out["seq"], out["job"], out["src"], out.get("dp", 0))

    def _register(self, cmd: RegisterDependent) -> None:
        known = cmd.downstream in self._dependents.get(cmd.upstream, ())
        pair = (cmd.upstream, cmd.downstream)
        if cmd.seq:
            newest = self._dep_seq.get(pair, 0)
            if cmd.seq <= newest:
                # A late repeat of a registration a newer one already superseded.
                self._reply_after_durable(cmd.request_id, {"registered": known, "stale": True})
                return
            # Recorded even when nothing changes: an older registration still on its way
            # (the opposite one) must find this one's position and be ignored.
            self._note_dep_seq(pair, cmd.seq, cmd.on, self._wall)
            self._emit(
                rec.make(
                    "dep",
                    up=cmd.upstream,
                    down=cmd.downstream,
                    on=cmd.on,
                    sq=cmd.seq,
                    at=self._wall,
                )
            )
        elif known != cmd.on:
            self._emit(rec.make("dep", up=cmd.upstream, down=cmd.downstream, on=cmd.on))
        self._reply_after_durable(cmd.request_id, {"registered": cmd.on})

    def _note_dep_seq(self, pair: tuple[str, str], seq: int, on: bool, at: int) -> None:
        """Remember ``seq`` as ``pair``'s newest registration (turned ``on`` or off at engine
        time ``at``); forget pairs turned off longer than trigger_dedupe_ms ago."""
        self._dep_seq[pair] = seq
        self._dep_off.pop(pair, None)
        if not on:
            self._dep_off[pair] = at
        horizon = self._wall - self.config.trigger_dedupe_ms
        while self._dep_off:
            oldest = next(iter(self._dep_off))
            if self._dep_off[oldest] >= horizon:
                break
            del self._dep_off[oldest]
            del self._dep_seq[oldest]

    def _outbox_delivered(self, cmd: OutboxDelivered) -> None:
        if cmd.seq in self._outbox:
            self._emit(rec.make("outdone", seq=cmd.seq))

    # =============================================================== workers

    def _hello(self, cmd: WorkerHello) -> None:
        if cmd.credits < 0 or not cmd.tiers:
            raise EngineUsageError("a worker needs tiers and credits >= 0", field="credits")
        worker = self._workers.get(cmd.worker_id)
        if worker is None:
            slot = self._alloc_slot()
            worker = _Worker(cmd.worker_id, tuple(cmd.tiers), cmd.credits, slot)
            self._workers[cmd.worker_id] = worker
            self._slot_worker[slot] = cmd.worker_id
        worker.tiers, worker.credits = tuple(cmd.tiers), cmd.credits
        # Only the process this engine dispatched to can say what it received.
        same_process = bool(cmd.instance) and cmd.instance == worker.instance
        worker.instance = cmd.instance
        again = self._forget_unheld(worker, cmd.held, cmd.seen if same_process else None)
        if self._marked:
            # A hello names every run its worker holds: a marked task it omits ended (the
            # worker restarted, or fenced itself and killed it) without a report.
            announced = {rid for rid, _token in cmd.held}
            for rid, (_t, w) in list(self._marked.items()):
                if w == worker.worker_id and rid not in announced:
                    self._end_mark(rid, "its worker no longer holds it")
        if self._stopping_final:  # a task it omits ended without a report
            self._forget_stops_of(worker.worker_id, keep={rid for rid, _token in cmd.held})
        self._renew(worker, cmd.held)
        for run in again:
            self._send_again(worker, run)

    def _note_stopping(self, run: _Run, worker_id: str) -> None:
        """``run``, about to be made final, has a task its worker is asked to stop (see
        :attr:`_stopping_final`). Entries past their time are dropped here, so that the map
        holds no more than the stops of the last reattach grace."""
        stopping = self._stopping_final
        if len(stopping) >= _STOPPING_PRUNE:
            mono = self._mono
            for rid in [r for r, (_t, _w, until) in stopping.items() if until <= mono]:
                del stopping[rid]
        until = self._mono + self.config.reattach_grace_ms
        stopping[self._run_id(run)] = (run.token, worker_id, until)

    def _forget_stops_of(
        self, worker_id: str, keep: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Drop the :attr:`_stopping_final` entries of ``worker_id``'s tasks but ``keep``'s:
        the worker is gone, or said hello without them."""
        stopping = self._stopping_final
        for rid in [r for r, (_t, w, _u) in stopping.items() if w == worker_id and r not in keep]:
            del stopping[rid]

    def _end_mark(self, rid: str, why: str) -> None:
        """Forget the mark of ``rid`` (on_timeout=mark), recorded as a note, as the task's
        own report is: a restart must not bring the mark back (see _apply)."""
        mark = self._marked.pop(rid, None)
        if mark is None:
            return
        token, worker_id = mark
        job_id, at = parse_run_id(rid)
        key = self._key_of(job_id)
        if key is not None:
            what = f"mark ended: {why}"
            self._emit(rec.make("note", key=key, at=at, tok=token, what=what, w=worker_id))

    def _forget_unheld(
        self, worker: _Worker, held: tuple[tuple[str, int], ...], seen: int | None
    ) -> list[_Run]:
        """The worker's runs that ``held`` omits are lost to it, except those whose dispatch
        is numbered after ``seen`` (None: the process that was sent them is gone, so all
        are). Returns those of them to send again: the numbered ones (CLAIMED or RUNNING)."""
        announced = {rid for rid, _token in held}
        again: list[_Run] = []
        for ref in sorted(worker.runs):
            run = self._runs.get(ref)
            if run is None or run.worker != worker.worker_id or self._run_id(run) in announced:
                continue
            if seen is not None and run.sent > seen:
                # Sent after the worker's snapshot: the dispatch is crossing it (its start
                # report may even have overtaken it), or went down with a broken connection.
                # The worker keeps it and gets it again if the caller says so (a hello): a
                # repeat of what it holds, or of what it let go, is dropped, and a repeat
                # that arrives numbers the worker's next hello past it, which settles the
                # run one way or the other. A started run too: its only dispatch numbered
                # after ``seen`` may be a send again lost with a broken connection, and
                # without another the run stayed RUNNING for as long as its worker lived
                # (found by fuzzing test_hello_crossing). One still waiting for durability
                # goes out when that comes.
                if run.sent != _UNSENT:
                    again.append(run)
                continue
            # The worker (re)started without it, dropped it (fenced), or never got it.
            worker.runs.discard(ref)
            self._worker_lost_run(run)
        return again

    def _send_again(self, worker: _Worker, run: _Run) -> None:
        """The same attempt (same token) to the same worker, numbered anew. A run whose
        timeout already asked for a kill gets the kill again instead: it must not start now
        (if its dispatch still arrives, the kill follows it)."""
        rid = self._run_id(run)
        if run.stopping:
            self._out.append(Kill(worker.worker_id, rid, run.token, "timed out"))
            return
        job_id, task = self._job_and_task(run)
        ticket = self._ticket(run, rid, run.job_id or str(job_id), task)
        self._out.append(self._numbered(run, worker.worker_id, ticket)._replace(again=True))

    @staticmethod
    def _ticket(run: _Run, rid: str, job_id: str, task: dict[str, Any]) -> RunTicket:
        policy = run.policy
        return RunTicket(  # positional, in field order: a third of the keyword call's cost
            rid,  # run_id
            job_id,
            run.at,  # scheduled_ms
            run.attempt,
            run.token,
            run.version,
            policy.delivery,
            policy.tier,
            policy.timeout_ms,
            task,
            policy.on_timeout,
        )

    def _heartbeat(self, cmd: Heartbeat) -> None:
        worker = self._workers.get(cmd.worker_id)
        if worker is None:
            raise EngineUsageError(
                f"unknown worker {cmd.worker_id!r}: say hello", field="worker_id"
            )
        if cmd.seen >= 0 and cmd.instance and cmd.instance == worker.instance:
            # No sending again: a heartbeat says nothing of a broken connection, and the
            # dispatch of a run it has not seen yet is most likely still on its way.
            self._forget_unheld(worker, cmd.held, cmd.seen)
        self._renew(worker, cmd.held)

    def _renew(self, worker: _Worker, held: tuple[tuple[str, int], ...]) -> None:
        self._worker_timers.schedule(worker.slot, self._mono + self.config.worker_lease_ms)
        for rid, token in held:
            if self._marked.get(rid) == (token, worker.worker_id):
                continue  # timed out under "mark": it runs on to its own end
            run = self._run_by_id(rid)
            if run is None or run.token != token or run.state._value_ not in IN_FLIGHT_VALUES:
                # A superseded or finished attempt: the worker must not carry on with it.
                self._out.append(Kill(worker.worker_id, rid, token, "superseded"))
                continue
            if run.worker != worker.worker_id:
                self._reattach(worker, run)
                continue
            if run.stopping and run.policy.delivery == "at_least_once":
                # Its worker still holds the task it was asked to stop (a long kill grace, a
                # container whose removal is retried): the stop is under way, and a retry
                # decided now would run beside it (found by the simulation's check 8 with
                # stops longer than the grace). It waits on while the worker announces it;
                # the worker's lease lapsing, or a hello without it, ends the wait.
                # (At-most-once never retries an unconfirmed timeout: it need not wait.)
                self._set_run_timer(run, "stop", self._mono + self.config.reattach_grace_ms)
            if run.sent != _UNSENT:
                # Announced by the worker it went to: it has this attempt (as _reattach
                # records it), so a later hello that omits it let it go, whatever send again
                # is still numbered after that hello's ``seen``.
                run.sent = 0

    def _reattach(self, worker: _Worker, run: _Run) -> None:
        run.worker = worker.worker_id
        run.grace = False
        run.sent = 0  # announced: the worker has it
        worker.runs.add(run.ref)
        self._clear_run_timer(run)
        if run.stopping:
            # Timed out while its worker was away: ask again, wait for the confirmation.
            self._out.append(Kill(run.worker, self._run_id(run), run.token, "timed out"))
        elif _asks_stop(run.policy) and self._timeout_left(run) == 0:
            # At-most-once, past its deadline already: the node was down when it lapsed, and
            # a stop asked before the crash is not recorded. Asked now, not by a timer at the
            # next call: the worker's report of that kill may follow this hello in the same
            # call, and must find the stop asked for (the timeout and its handler, retries
            # included), not a plain "killed" failure. (Only the stop: nothing is decided
            # yet, so a success reported in the same call still counts.)
            self._node_timeout(run)
            return
        self._arm_timeout(run)

    def _pull(self, cmd: Pull) -> None:
        worker = self._workers.get(cmd.worker_id)
        if worker is None:
            raise EngineUsageError(
                f"unknown worker {cmd.worker_id!r}: say hello", field="worker_id"
            )
        if cmd.credits < 0:
            raise EngineUsageError("credits must be >= 0", field="credits")
        worker.credits = cmd.credits

    def _lease_lapsed(self, slot: int) -> None:
        worker_id = self._slot_worker.pop(slot, None)
        if worker_id is None:
            return
        worker = self._workers.pop(worker_id)
        self._free_slots.append(slot)
        for rid in [rid for rid, (_t, w) in self._marked.items() if w == worker_id]:
            self._end_mark(rid, "its worker's lease lapsed")
        if self._stopping_final:
            self._forget_stops_of(worker_id)
        for ref in sorted(worker.runs):
            run = self._runs.get(ref)
            if run is not None and run.worker == worker_id:
                self._worker_lost_run(run)

    def _worker_lost_run(self, run: _Run) -> None:
        """The worker holding ``run`` is gone or no longer has it: at-least-once goes out
        again; at-most-once waits the reattach grace, then is LOST."""
        if run.state._value_ not in IN_FLIGHT_VALUES:
            return
        run.worker = None
        self._clear_run_timer(run)
        if run.policy.delivery == "at_least_once" and "alo-lost" not in self.config.mutants:
            if "no-redispatch" in self.config.mutants:
                return  # the mutant: the run stays with its lapsed worker forever
            if run.stopping:
                # Past its timeout, asked to stop, and its worker went: the timeout stands,
                # unconfirmed, with its handler (retries included), not a free new attempt.
                self._timed_out(run, confirmed=False)
                return
            self._requeue(run, "worker lost it")
        else:
            run.grace = True
            grace = 0 if "amo-no-grace" in self.config.mutants else self.config.reattach_grace_ms
            self._set_run_timer(run, "grace", self._mono + grace)

    def _orphaned(self, run: _Run) -> bool:
        """Whether ``run``'s job version was cancelled: no retry, no second dispatch. Its own
        flag, not the key's: the id may have been created again as a new version since. (The
        key's flag still counts for runs recovered from records older than the flag.)"""
        return run.orphan or bool(self._flags[run.key] & _GONE)

    def _requeue(self, run: _Run, why: str) -> None:
        if self._orphaned(run):
            # An at-least-once run of a cancelled job whose worker is gone: its job owes
            # nothing more, so it does not go out again.
            self._finalize(run, RunEvent.CANCEL, why=f"job cancelled; {why}")
            return
        self._move(run, RunEvent.REQUEUE)
        run.attempt += 1
        run.fired_batch = self._batch + 1  # the record below makes this attempt number
        run.worker, run.grace, run.why = None, False, why
        run.stopping = False  # (a new attempt: nobody is stopping it)
        self._persist_run(run)
        self._enqueue(run)

    def _run_timer_fired(self, slot: int) -> None:
        kind = self._run_timer_kind.pop(slot, None)
        ref = self._slot_run.get(slot)
        run = self._runs.get(ref) if ref is not None else None
        if run is None or kind is None or run.state._value_ not in IN_FLIGHT_VALUES:
            return
        if kind == "grace":
            if run.stopping:
                # Timed out and asked to stop, then its worker vanished: the timeout stands,
                # unconfirmed (at-most-once: so no retry).
                self._timed_out(run, confirmed=False)
            elif run.policy.delivery == "at_least_once" and "alo-lost" not in self.config.mutants:
                self._requeue(run, "not re-attached within the grace")
            else:
                self._finalize(run, RunEvent.LOSE, why="outcome unknown: worker gone")
        elif kind == "stop":
            # Its worker was asked to stop it and never confirmed: unconfirmed (at-most-once:
            # no retry).
            self._timed_out(run, confirmed=False)
        else:  # the node-side timeout
            self._node_timeout(run)

    def _node_timeout(self, run: _Run) -> None:
        """The node-side timeout of ``run`` lapsed.

        With a live worker (its lease valid: ``run.worker`` is set) and a handler that stops
        the task (not "mark"): the worker is asked to stop the task and the run stays in
        flight until the confirmed report (``killed`` or ``timed_out``), which applies the
        timeout handler, retries included. Only when no report comes, within the reattach
        grace (at-least-once: counted from its worker's last announcement of the task, since
        a worker that still holds it is still stopping it) or before the worker's lease and
        then the grace lapse, is it TIMED_OUT
        unconfirmed: at-most-once without a retry (DESIGN.md: at-most-once retries follow a
        confirmed final report only), at-least-once with its handler's retries. Waiting for
        the confirmation at-least-once too keeps a retry from starting beside an attempt
        whose worker is still stopping it (its kill grace, a container's removal). Otherwise
        the timeout is decided now.
        """
        if "no-stop-wait" in self.config.mutants:
            # The mutant: decided as if the stop were confirmed, so a retry starts beside a
            # task still being stopped.
            if run.worker is not None:
                self._out.append(Kill(run.worker, self._run_id(run), run.token, "timed out"))
            self._timed_out(run, confirmed=True)
            return
        if run.worker is not None and _asks_stop(run.policy):
            run.stopping = True
            # Nothing is decided yet, so the Kill may leave at once; a crash before the
            # report re-attaches the run with its timeout's clock (clock_from), past already:
            # the worker is asked again at once.
            self._out.append(Kill(run.worker, self._run_id(run), run.token, "timed out"))
            self._set_run_timer(run, "stop", self._mono + self.config.reattach_grace_ms)
            return
        self._timed_out(run, confirmed=False)

    def _timeout_left(self, run: _Run) -> int | None:
        """Wall ms until ``run``'s node-side timeout (0: past), or None without a timeout."""
        timeout = run.policy.timeout_ms
        if timeout is None:
            return None
        # The grace lets the worker's own stop act first; "mark" stops nothing, so the node
        # records TIMED_OUT at the timeout itself. From when the attempt's clock started (a
        # re-attach resumes it).
        grace = 0 if run.policy.on_timeout == "mark" else self.config.timeout_grace_ms
        started = self._wall if run.clock_from is None else run.clock_from
        return max(0, started + timeout + grace - self._wall)

    def _arm_timeout(self, run: _Run) -> None:
        if run.stopping:
            # Past its timeout already: what is left is waiting for the stop's confirmation.
            self._set_run_timer(run, "stop", self._mono + self.config.reattach_grace_ms)
            return
        left = self._timeout_left(run)
        if left is not None:
            # (wall time turned into the monotonic clock the timers run on; a deadline already
            # past fires at once)
            self._set_run_timer(run, "timeout", self._mono + left)

    # =============================================================== dispatch

    def _enqueue(self, run: _Run, ref: RunRef | None = None) -> None:
        if not run.queued:
            run.queued = True
            tier = run.policy.tier
            queue = self._ready.get(tier)
            if queue is None:
                queue = self._ready[tier] = deque()
            queue.append(ref or (run.key, run.at))

    def _due_now(self, run: _Run) -> bool:
        return _ready_at(run) <= self._wall

    def _queue_or_wait(self, run: _Run) -> None:
        if self._buffered.get(run.key) == run.at:
            # overlap=buffer_one: it waits for the run before it, with no timer of its own
            # (as live: _new_run arms none for it, and _forget_run releases it). A retry timer
            # armed here would queue it at its time while the run before it is still active.
            return
        ready = _ready_at(run)
        if ready > self._wall:
            self._schedule_retry(run, ready)  # a retry's backoff, or a run fired ahead
        else:
            self._enqueue(run)

    def _dispatch_all(self) -> None:
        if not any(self._ready.values()):
            return  # the common case: nothing waits for a worker
        for worker_id in sorted(self._workers):
            worker = self._workers[worker_id]
            while worker.credits > 0:
                run = self._next_ready(worker.tiers)
                if run is None:
                    break
                self._claim(worker, run)

    def _next_ready(self, tiers: tuple[str, ...]) -> _Run | None:
        for tier in tiers:
            queue = self._ready.get(tier)
            while queue:
                run = self._runs.get(queue.popleft())
                if run is not None and run.queued and run.state is RunState.PENDING:
                    run.queued = False
                    return run
                if run is not None:
                    run.queued = False
        return None

    def _claim(self, worker: _Worker, run: _Run) -> None:
        # What the ticket needs is read first: a failure must leave the run unclaimed.
        job_id, task = self._job_and_task(run)
        self._move(run, RunEvent.CLAIM)
        if run.maybe_sent:
            # The attempt number must never name two dispatches of one run: the one before
            # the crash may have reached a worker that still runs it.
            run.attempt += 1
            run.maybe_sent = False
            run.fired_batch = self._batch + 1  # this claim's record makes the new number
        self._counter += 1
        run.token = fencing_token(self.epoch, self._counter)
        run.worker = worker.worker_id
        worker.credits -= 1
        worker.runs.add(run.ref)
        run.clock_from = self._wall
        self._persist_run(run)
        self._arm_timeout(run)
        policy = run.policy
        if run.job_id is None:
            run.job_id = str(job_id)
        rid = run_id(run.job_id, run.at)
        self._handed_out[rid] = run
        ticket = self._ticket(run, rid, run.job_id, task)
        if "claim-after-fire" in self.config.mutants:
            self._out.append(self._numbered(run, worker.worker_id, ticket))  # guard off
        elif policy.delivery == "at_most_once" or run.fired_batch > self._durable:
            # At-most-once: the claim first. Either mode: a run whose creation, or the record
            # that set its attempt number, is not durable yet waits for it (a crash would
            # forget the run, or let the attempt number name a second dispatch).
            run.sent = _UNSENT  # numbered when it leaves (_still_valid)
            self._after_durable.append(Dispatch(worker.worker_id, ticket))
        else:
            self._out.append(self._numbered(run, worker.worker_id, ticket))

    def _job_and_task(self, run: _Run) -> tuple[str, Any]:
        """What a ticket needs of the run's job version (the directory's, unless pinned)."""
        pinned = run.pinned
        if pinned:
            if "unpinned" not in self.config.mutants:
                return pinned["id"], pinned["task"]
            return self._ticket_fields(run.key, self._ver[run.key])  # the mutant: the newest
        return self._ticket_fields(run.key, run.version)

    def _numbered(self, run: _Run, worker_id: str, ticket: RunTicket) -> Dispatch:
        """The dispatch of ``ticket``, numbered as it leaves the engine (see
        :class:`WorkerHello`: the order of the numbers must be the order they go out in)."""
        self._sends += 1
        seq = fencing_token(self.epoch, self._sends)
        run.sent = seq
        return Dispatch(worker_id, ticket, seq)

    # =============================================================== reports

    def _run_by_id(self, rid: str) -> _Run | None:
        run = self._handed_out.get(rid)
        if run is not None:
            return run  # a run out with a worker: its reports need no directory lookup
        try:
            job_id, at = parse_run_id(rid)
        except EngineUsageError:
            return None
        key = self._key_of(job_id)
        return self._runs.get((key, at)) if key is not None else None

    def _matching(self, worker_id: str, rid: str, token: int, what: str) -> _Run | None:
        run = self._run_by_id(rid)
        if run is not None and run.token == token and run.state._value_ in IN_FLIGHT_VALUES:
            if run.worker == worker_id:
                return run
            worker = self._workers.get(worker_id)
            if run.worker is None and worker is not None:
                self._reattach(worker, run)  # a known worker reporting during the grace
                return run
            if what != "started":
                # A final report carrying the run's current token counts, whoever sends it
                # (DESIGN.md, "What is fenced"): the token is the proof, and the worker may be
                # one whose lease lapsed (a short partition) while the run waits its grace.
                # A start report from such a worker still changes nothing: the grace decides.
                return run
        # A report of a superseded attempt (or of a run already final): kept in the history,
        # never changes the state.
        if what not in ("started",):
            if self._marked.get(rid, (None, None))[0] == token:
                del self._marked[rid]  # the marked task ended
            stopping = self._stopping_final.get(rid)
            if stopping is not None and stopping[0] == token:
                del self._stopping_final[rid]  # the task stopped
        try:
            job_id, at = parse_run_id(rid)
        except EngineUsageError:
            raise EngineUsageError(f"not a run id: {rid!r}", field="run_id") from None
        key = self._key_of(job_id)
        if key is not None:
            self._emit(rec.make("note", key=key, at=at, tok=token, what=what, w=worker_id))
        return None

    def _started(self, cmd: ReportStarted) -> None:
        run = self._matching(cmd.worker_id, cmd.run_id, cmd.token, "started")
        if run is not None and run.state is RunState.CLAIMED:
            self._move(run, RunEvent.START)
            run.clock_from = self._wall
            self._persist_run(run)
            self._clear_run_timer(run)
            self._arm_timeout(run)

    def _finished(self, cmd: ReportFinished) -> None:
        if cmd.outcome not in ("success", "failed", "timed_out", "killed"):
            raise EngineUsageError(f"unknown outcome {cmd.outcome!r}", field="outcome")
        run = self._matching(cmd.worker_id, cmd.run_id, cmd.token, cmd.outcome)
        # Credits come only from the worker's own Pull (its free slots as it sees them): adding
        # one here as well would over-commit it when its Pull overtakes this report.
        worker = self._workers.get(cmd.worker_id)
        if worker is not None and run is not None:
            worker.runs.discard(run.ref)
        if run is None:
            return
        run.exit = cmd.exit_code
        if cmd.outcome == "success":
            self._finalize(run, RunEvent.SUCCEED, why=None)
            self._after_success(run)
        elif cmd.outcome == "failed":
            run.failures += 1
            if run.failures <= run.policy.retries_max and not self._orphaned(run):
                self._retry_later(run, RunEvent.FAIL, run.failures, "failed")
            else:
                self._finalize(run, RunEvent.FAIL, why="failed")
        elif cmd.outcome == "timed_out" or run.stopping:
            # The worker's own timeout, or its confirmation of the node-side timeout's stop.
            self._timed_out(run, confirmed=True)
        else:  # killed on the node's request without a cancel recorded: a failure
            self._finalize(run, RunEvent.FAIL, why="killed")

    def _sync(self, cmd: Sync) -> None:
        if "report-ack-before-durable" in self.config.mutants:
            self._out.append(Reply(cmd.request_id, result={}))  # the guard switched off
            return
        # Behind every batch still in flight: a report this answers (or one it repeats, which
        # made no record of its own) may sit in any of them.
        self._reply_after_durable(cmd.request_id, {})

    def _timed_out(self, run: _Run, *, confirmed: bool) -> None:
        policy = run.policy
        handler = policy.on_timeout
        if run.worker is not None and handler != "mark" and not confirmed:
            # After the decision below is durable: a crash before it brings the run back in
            # flight with its timeout still to come, and a task killed meanwhile would report
            # "killed", a failure, instead of the timeout's handler.
            self._after_durable.append(Kill(run.worker, self._run_id(run), run.token, "timed out"))
            self._note_stopping(run, run.worker)
        run.timeouts += 1
        retry_ok = confirmed or policy.delivery == "at_least_once"
        gone = self._orphaned(run)
        if (
            handler == "retry"
            and retry_ok
            and not gone
            and run.timeouts <= policy.on_timeout_retries
        ):
            self._retry_later(run, RunEvent.TIME_OUT, run.timeouts, "timed out")
            return
        worker = run.worker
        marked = handler == "mark" and worker is not None and not confirmed
        run.marked = marked
        self._finalize(run, RunEvent.TIME_OUT, why="timed out")
        if marked:
            assert worker is not None
            self._marked[self._run_id(run)] = (run.token, worker)
        if handler == "trigger" and policy.on_timeout_target is not None:
            self._send_trigger(policy.on_timeout_target, run)

    def _retry_later(self, run: _Run, event: RunEvent, nth: int, why: str) -> None:
        self._move(run, event)
        self._move(run, RunEvent.RETRY)
        self._release_worker(run)
        run.attempt += 1
        run.stopping = False  # the attempt stopped on a timeout is over; the next has its own
        run.fired_batch = self._batch + 1  # the record below makes this attempt number
        backoff = (
            0 if "retry-no-backoff" in self.config.mutants else retry_delay_ms(run.policy, nth)
        )
        run.due = self._wall + backoff
        run.why = f"{why}; retry {nth}"
        self._clear_run_timer(run)
        self._persist_run(run)
        self._schedule_retry(run, run.due)

    def _after_success(self, run: _Run) -> None:
        # Dependents registered here by their own shards (this one included), so a success
        # costs a lookup, not a scan of every job.
        if not self._dependents:
            return
        for down in sorted(self._dependents.get(self._run_job_id(run), ())):
            self._send_trigger(down, run)

    def _release_worker(self, run: _Run) -> None:
        if run.worker is not None:
            worker = self._workers.get(run.worker)
            if worker is not None:
                worker.runs.discard(run.ref)
        run.worker = None

    def _finalize(self, run: _Run, event: RunEvent, *, why: str | None) -> None:
        self._move(run, event)
        run.why = why
        self._persist_run(run)
        self._release_worker(run)
        self._clear_run_timer(run)
        run.queued = False
        del self._runs[run.ref]
        if run.token or run.attempt > 1:
            batch = self._batch + 1  # (this call's records: the next batch)
            self._recent_out[run.ref] = batch
            self._recent_out_order.append((batch, run.ref))
        if run.job_id is not None:
            self._handed_out.pop(run_id(run.job_id, run.at), None)
        if run.slot >= 0:
            self._retry.cancel(run.slot)
            self._slot_run.pop(run.slot, None)
            self._free_slots.append(run.slot)
        key = run.key
        waiting = self._buffered.get(key)
        if waiting is not None and not any(t != waiting for t in self._times(key)):
            buffered = self._runs[(key, waiting)]
            del self._buffered[key]
            self._persist_run(buffered)  # no longer marked buffered
            if buffered.due is not None and buffered.due > self._wall:
                self._schedule_retry(buffered, buffered.due)  # a triggered run's own time
            else:
                self._ready_after_durable.append(buffered.ref)

    # =============================================================== columnar state

    def export_snapshot(self) -> Snapshot:
        """The durable state in columns: every record handed out so far, folded.

        ``meta["batch"]`` is the last batch it reflects: the driver stores the snapshot once
        that batch is durable, and recovery then replays only what was written after it. What
        is not durable state (workers, queues, timers) is not in it; recovery rebuilds those
        as it does from records. Cost: a few array copies, plus O(runs not final + paused
        jobs + profiles) Python work.
        """
        n = self._next_key
        nxt = np.full(n, NOT_PENDING, dtype=np.int64)
        for wheel in self._fire.values():
            dues = wheel.dues()[:n]
            armed = dues != NOT_PENDING
            nxt[: len(dues)][armed] = dues[armed]
        for key, due in self._deferred.items():  # (out of the wheel until their time)
            nxt[key] = due
        runs = [
            self._run_record(run, buffered=self._buffered.get(run.key) == run.at)
            for run in sorted(self._runs.values(), key=lambda r: r.ref)
        ]
        policies, profiles = self._profile_dicts()
        return Snapshot(
            arrays={
                "ver": np.frombuffer(self._ver, dtype=np.uint32)[:n].copy(),
                "prof": np.frombuffer(self._prof, dtype=np.int32)[:n].copy(),
                "flags": np.frombuffer(self._flags, dtype=np.uint8)[:n].copy(),
                "next": nxt,
            },
            meta={
                "format": rec.FORMAT_VERSION,
                "epoch": self.epoch,
                "batch": self._batch,
                "next_key": n,
                "policies": policies,
                "profiles": profiles,
                "held_next": sorted(self._held_next.items()),
                "runs": runs,
                "outbox": [self._outbox[seq] for seq in sorted(self._outbox)],
                "outbox_seq": self._outbox_seq,
                "dependents": {up: sorted(d) for up, d in sorted(self._dependents.items())},
                # [upstream, downstream, seq(, engine time turned off)], turned-off pairs last
                # and in the order they were turned off, as _dep_off keeps them
                "dep_seq": [
                    [up, down, sq]
                    for (up, down), sq in sorted(self._dep_seq.items())
                    if (up, down) not in self._dep_off
                ]
                + [
                    [up, down, self._dep_seq[(up, down)], at]
                    for (up, down), at in self._dep_off.items()
                ],
                # [source run id, target job key, time]: the same triple as before the target
                # became part of the key, so snapshots of either form load in both.
                "sources": [[src, key, at] for (key, src), at in self._sources.items()],
                # [job key, newest triggered time] still ahead of now (older ones bind nothing)
                "trigger_at": [[k, t] for k, t in self._trigger_at.items() if t > self._wall],
                # [job key, time, token, worker] of marked runs (_marked), in run order
                "marked": self._marks_for_snapshot(),
            },
        )

    def _marks_for_snapshot(self) -> list[list[Any]]:
        out: list[list[Any]] = []
        for rid, (token, worker_id) in self._marked.items():
            job_id, at = parse_run_id(rid)
            key = self._key_of(job_id)
            if key is not None:
                out.append([key, at, token, worker_id])
        out.sort()
        return out

    def _load_snapshot(self, snap: Snapshot) -> None:
        meta, arrays = snap.meta, snap.arrays
        if meta.get("format") != rec.FORMAT_VERSION:
            raise EngineStateError(f"snapshot format {meta.get('format')!r} is not readable")
        if meta["epoch"] >= self.epoch:
            raise StaleEpoch(f"shard already opened at epoch {meta['epoch']} (>= {self.epoch})")
        self._replay_epoch = int(meta["epoch"])
        # Each distinct policy is parsed once ("policies"; absent from older snapshots, whose
        # profiles carry their policies whole).
        policies = [_snapshot_policy(p) for p in meta.get("policies", ())]
        self._profiles = [_Profile.from_dict(d, policies) for d in meta["profiles"]]
        self._profile_ids = {p.identity(): i for i, p in enumerate(self._profiles)}
        self._last_profile = None
        n = int(meta["next_key"])
        ver = np.ascontiguousarray(arrays["ver"][:n], dtype=np.uint32)
        prof = np.ascontiguousarray(arrays["prof"][:n], dtype=np.int32)
        flags = np.ascontiguousarray(arrays["flags"][:n], dtype=np.uint8)
        nxt = np.ascontiguousarray(arrays["next"][:n], dtype=np.int64)
        self._ver, self._prof, self._flags = array("I"), array("i"), array("B")
        self._ver.frombytes(ver.tobytes())
        self._prof.frombytes(prof.tobytes())
        self._flags.frombytes(flags.tobytes())
        self._next_key = n
        # Every armed job into its tier's wheel, one vectorised load per tier.
        armed = (nxt != NOT_PENDING) & ((flags & (_PAUSED | _GONE)) == 0) & (ver > 0)
        tiers = sorted({p.policy.tier for p in self._profiles})
        if tiers:
            tier_of_profile = np.array(
                [tiers.index(p.policy.tier) for p in self._profiles], dtype=np.int32
            )
            job_tier = tier_of_profile[prof]
            for index, tier in enumerate(tiers):
                keys = np.flatnonzero(armed & (job_tier == index))
                if len(keys):
                    wheel = self._fire.get(tier)
                    if wheel is None:
                        wheel = self._fire[tier] = TimingWheel(max(self._wall, 0), capacity=n)
                        self._fire_order = sorted(self._fire)
                    wheel.schedule_many(keys.astype(np.uint32), nxt[keys])
        self._held_next = {int(k): v for k, v in meta["held_next"]}
        for r in meta["runs"]:
            self._apply_run(r, recovering=True)
        self._outbox = {r["seq"]: r for r in meta["outbox"]}
        self._outbox_seq = meta["outbox_seq"]
        self._dependents = {up: set(downs) for up, downs in meta["dependents"].items()}
        self._dep_seq, self._dep_off = {}, {}
        for entry in meta.get("dep_seq", ()):  # (absent from older snapshots)
            pair = (entry[0], entry[1])
            self._dep_seq[pair] = entry[2]
            if len(entry) > 3:
                self._dep_off[pair] = entry[3]
            elif pair[1] not in self._dependents.get(pair[0], ()):
                # turned off, in a snapshot from before the time was kept: from now on
                self._dep_off[pair] = self._wall
        for key, at in meta.get("trigger_at", ()):  # (absent from older snapshots)
            self._trigger_at[key] = max(at, self._trigger_at.get(key, 0))
        for src, key, at in meta["sources"]:
            self._sources[(key, src)] = at
        for key, at, token, worker_id in meta.get("marked", ()):  # (absent from older ones)
            self._marks_recovered[(key, at)] = (token, worker_id)

    # =============================================================== inspection (tests, sim)

    def marked_running(self, rid: str) -> bool:
        """Whether run ``rid`` is final TIMED_OUT under ``on_timeout=mark`` while its task
        still runs on its worker (as far as this engine knows: until the task's report, the
        worker's lease lapsing, or its hello without the task; the mark is recorded, so a
        restart keeps it while the worker says hello again within the reattach grace and its
        lease)."""
        return rid in self._marked

    def task_stopping(self, rid: str) -> bool:
        """Whether run ``rid`` is final by this engine's decision (cancelled with
        ``stop_running``, by ``cancel_previous``, or timed out without its worker's
        confirmation) while its task, asked to stop, may still run and write output: until
        its worker reports the task's end, is lost, or says hello without it; at most
        ``reattach_grace_ms`` after the decision. Not recorded: False after a restart."""
        entry = self._stopping_final.get(rid)
        return entry is not None and entry[2] > self._mono

    def paused(self, job_id: str) -> bool:
        """Whether job ``job_id`` is paused. Raises :class:`JobNotFound` as ``GetJob`` would
        (never created, or cancelled). What it says may not be durable yet."""
        return bool(self._flags[self._job_key(job_id)] & _PAUSED)

    def next_owed(self, job_id: str) -> int | None:
        """The next fire time job ``job_id`` owes: its wheel's, or the one kept while it is
        paused; None when it owes none. It may be in the past (a paused job's, or one held
        back by a full tier: it goes at the resume, or when the tier has room). Raises
        :class:`JobNotFound` as ``GetJob`` would. What it says may not be durable yet."""
        return self._next_due(self._job_key(job_id))

    def waiting_reason(self, rid: str) -> str | None:
        """Why run ``rid``, PENDING and due, has not gone out, if this engine knows a reason
        a user can act on: no worker it knows serves the run's tier, or every one that does
        has no free slot. None for any other run (not pending, not due yet, unknown)."""
        run = self._run_by_id(rid)
        if run is None or run.state is not RunState.PENDING or not self._due_now(run):
            return None
        tier = run.policy.tier
        serving = [w for w in self._workers.values() if tier in w.tiers]
        if not serving:
            return f"no worker serves tier {tier!r}"
        if all(w.credits <= 0 for w in serving):
            return f"every worker of tier {tier!r} is busy"
        return None

    def run_state(self, rid: str) -> RunState | None:
        """The state of a run still in memory (not final), or None."""
        run = self._run_by_id(rid)
        return run.state if run is not None else None

    def pending_jobs(self) -> int:
        """Jobs with a next fire time (paused ones included)."""
        armed = sum(len(wheel) for wheel in self._fire.values()) + len(self._deferred)
        return armed + sum(1 for nxt in self._held_next.values() if nxt is not None)

    def snapshot(self) -> dict[str, Any]:
        """The durable part of the state, for comparing a live engine with a recovered one."""
        return {
            "jobs": {
                key: (
                    self._ver[key],
                    self._next_due(key),
                    bool(self._flags[key] & _PAUSED),
                    bool(self._flags[key] & _GONE),
                )
                for key in range(self._next_key)
                if self._ver[key] > 0
            },
            "runs": {
                self._run_id(run): (
                    run.state._value_,
                    run.attempt,
                    run.token,
                    run.due,
                    run.failures,
                    run.timeouts,
                )
                for run in self._runs.values()
            },
            "outbox": sorted(self._outbox),
            "dependents": {up: sorted(downs) for up, downs in self._dependents.items()},
        }


_HANDLERS: dict[type[Any], Any] = {
    CreateJob: ShardEngine._create,
    CreateJobs: ShardEngine._create_jobs,
    UpdateJob: ShardEngine._update,
    CancelJob: ShardEngine._cancel,
    PauseJob: ShardEngine._pause,
    ResumeJob: ShardEngine._resume,
    GetJob: ShardEngine._get,
    TriggerJob: ShardEngine._trigger,
    RegisterDependent: ShardEngine._register,
    OutboxDelivered: ShardEngine._outbox_delivered,
    WorkerHello: ShardEngine._hello,
    Heartbeat: ShardEngine._heartbeat,
    Pull: ShardEngine._pull,
    ReportStarted: ShardEngine._started,
    ReportFinished: ShardEngine._finished,
    Sync: ShardEngine._sync,
}
