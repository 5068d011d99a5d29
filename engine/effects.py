"""Commands into a shard engine and effects out of it: plain frozen values, no behaviour.

Owns the vocabulary both drivers speak (the Trio node and the SimPy harness). Must never hold
logic: what a command does is decided in :mod:`engine.shard`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.errors import EngineError
from engine.jobs import JobSpec
from engine.records import Record

# ------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class CreateJob:
    request_id: int
    spec: JobSpec


@dataclass(frozen=True)
class CreateJobs:
    """Several creates as one command (a driver's bulk create): the same decisions as a
    :class:`CreateJob` per spec, in order, and one :class:`Reply` whose result is
    ``{"results": [...]}``: per spec, in order, what a CreateJob's reply would hold (the
    job's description) or the :class:`EngineError` it would carry. A refusal of one spec
    changes nothing for the others. The reply waits until every record is durable."""

    request_id: int
    specs: tuple[JobSpec, ...]


@dataclass(frozen=True)
class UpdateJob:
    request_id: int
    spec: JobSpec  # the complete new spec (the driver merges a partial update first)
    #: refused with VersionConflict unless the job's current version is this one: the
    #: version the driver merged the partial update into (None: no check)
    expected_version: int | None = None


@dataclass(frozen=True)
class CancelJob:
    request_id: int
    job_id: str
    stop_running: bool = False  # also stop runs already claimed or running


@dataclass(frozen=True)
class PauseJob:
    request_id: int
    job_id: str


@dataclass(frozen=True)
class ResumeJob:
    request_id: int
    job_id: str


@dataclass(frozen=True)
class GetJob:
    request_id: int
    job_id: str


@dataclass(frozen=True)
class TriggerJob:
    """Fire ``job_id`` now on behalf of ``source_run_id`` (a ``trigger:`` handler or an
    ``after`` dependency); a repeated source is ignored. ``depth`` is the source run's chain
    depth (0: a scheduled run); the triggered run's is one more, and a trigger past
    ``EngineConfig.max_chain_depth`` is skipped (``chain_too_deep``)."""

    request_id: int
    job_id: str
    source_run_id: str
    depth: int = 0


@dataclass(frozen=True)
class RegisterDependent:
    """On the shard of ``upstream``: ``downstream`` runs after each successful run of it
    (``on``), or no longer does. Repeats are harmless. ``seq``: the outbox position of the
    registration on ``downstream``'s shard (:class:`Register`), which only grows: one older
    than a registration already applied for the pair is a late repeat, and ignored (0: not
    ordered, always applied)."""

    request_id: int
    upstream: str
    downstream: str
    on: bool = True
    seq: int = 0


@dataclass(frozen=True)
class OutboxDelivered:
    seq: int


@dataclass(frozen=True)
class WorkerHello:
    """A worker (re)connects, or says hello again: its tiers, free slots, the runs it still
    holds, and how far it has heard this shard.

    ``instance`` names the worker's process (a new one after each restart); ``seen`` is the
    highest :attr:`Dispatch.seq` of this shard that instance received (0: none). A run the
    hello does not announce is lost to the worker only if its dispatch is one the worker had
    when it said hello; one sent later (crossing the hello, or lost with a broken connection)
    is sent again instead. An empty ``instance`` (a driver that keeps no such count) makes
    every run not announced lost, as after a restart of the worker."""

    worker_id: str
    tiers: tuple[str, ...]
    credits: int
    held: tuple[tuple[str, int], ...] = ()  # (run_id, token)
    instance: str = ""
    seen: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """A worker renews its lease, with the runs it holds. With ``instance`` and ``seen`` (as
    in :class:`WorkerHello`, from the process of the worker's last hello), a run it omits
    whose dispatch it had is lost to it, as a hello would say: the worker dropped it without
    a hello (a third-party worker, say). Omitted runs sent after ``seen`` are on their way
    and are left alone; a heartbeat never sends anything again."""

    worker_id: str
    held: tuple[tuple[str, int], ...] = ()
    instance: str = ""
    seen: int = -1  # -1: not given (only the lease is renewed)


@dataclass(frozen=True)
class Pull:
    """The worker has ``credits`` free slots: runs are handed out as they become ready."""

    worker_id: str
    credits: int


@dataclass(frozen=True)
class ReportStarted:
    worker_id: str
    run_id: str
    token: int


@dataclass(frozen=True)
class ReportFinished:
    """A final report. ``outcome``: ``success``, ``failed``, ``timed_out`` (the worker's own
    timeout, a confirmed kill) or ``killed`` (stopped on the node's request)."""

    worker_id: str
    run_id: str
    token: int
    outcome: str
    exit_code: int | None = None


@dataclass(frozen=True)
class Durable:
    """Every batch up to and including ``batch_id`` is durable."""

    batch_id: int


@dataclass(frozen=True)
class Sync:
    """Answered by an empty :class:`Reply` once everything the engine decided before it is
    durable. How a driver acknowledges commands that carry no request id of their own (a
    worker's final reports): a worker forgets a report once it is acknowledged, so an
    acknowledgement the next crash could undo would turn a known outcome into a lost one."""

    request_id: int


Command = (
    CreateJob
    | CreateJobs
    | UpdateJob
    | CancelJob
    | PauseJob
    | ResumeJob
    | GetJob
    | TriggerJob
    | RegisterDependent
    | OutboxDelivered
    | WorkerHello
    | Heartbeat
    | Pull
    | ReportStarted
    | ReportFinished
    | Sync
    | Durable
)

# ------------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Persist:
    """Write ``records`` as one atomic batch, then acknowledge with ``Durable(batch_id)``.
    Batches are acknowledged in order (group commit)."""

    batch_id: int
    epoch: int
    records: tuple[Record, ...]


class RunTicket(NamedTuple):
    """What a worker receives: the run, its attempt and fencing token, and the pinned task.

    A named tuple rather than a frozen dataclass, unlike the other effects: one is built per
    dispatch by the engine and again by the worker, and a frozen dataclass's ``__init__``
    (eleven ``object.__setattr__`` calls) cost ~5 us of each, several per cent of a run's
    CPU on either side (py-spy of ``tickwheel bench dispatch``). Fields read by name as
    before; a changed copy is ``ticket._replace(...)``."""

    run_id: str
    job_id: str
    scheduled_ms: int
    attempt: int
    token: int
    version: int
    delivery: str
    tier: str
    timeout_ms: int | None
    task: dict[str, Any]
    #: the job's timeout handler: "mark" means the worker lets the task run past its timeout
    #: (the node records TIMED_OUT); any other handler, the worker stops it at the timeout
    on_timeout: str = "kill"


class Dispatch(NamedTuple):
    """Send ``run`` to ``worker_id``. A named tuple, like :class:`RunTicket`: one is built
    per claim, and a frozen dataclass's ``__init__`` cost several times as much."""

    worker_id: str
    run: RunTicket
    #: numbers the shard's dispatches in the order they leave the engine (epoch in the high
    #: bits, as a fencing token): a driver delivers them to a worker in that order, so the
    #: highest a worker received says which of them it had (:class:`WorkerHello`)
    seq: int = 0
    #: a repeat of a dispatch the worker may already have (sent again after a hello): it
    #: takes no slot of the worker's that the first did not take
    again: bool = False


@dataclass(frozen=True)
class Kill:
    """Ask ``worker_id`` to stop the attempt ``token`` of ``run_id``."""

    worker_id: str
    run_id: str
    token: int
    reason: str


@dataclass(frozen=True)
class Reply:
    request_id: int
    result: dict[str, Any] | None = None
    error: EngineError | None = None


@dataclass(frozen=True)
class Refused:
    """A worker's command was refused (unknown worker, malformed report): tell the worker."""

    worker_id: str
    error: EngineError


@dataclass(frozen=True)
class Trigger:
    """Deliver ``TriggerJob(job_id, source_run_id)`` to the job's shard (at least once), then
    acknowledge with ``OutboxDelivered(seq)``. ``depth``: the source run's chain depth,
    passed on in the ``TriggerJob``."""

    seq: int
    job_id: str
    source_run_id: str
    depth: int = 0


@dataclass(frozen=True)
class Register:
    """Deliver ``RegisterDependent(upstream, downstream, on)`` to the upstream job's shard (at
    least once), then acknowledge with ``OutboxDelivered(seq)``."""

    seq: int
    upstream: str
    downstream: str
    on: bool


@dataclass(frozen=True)
class ClockJump:
    """The wall clock ran ahead of the monotonic clock by more than the bound; the engine
    keeps following the monotonic clock, so nothing fires early."""

    wall_ms: int
    engine_ms: int


Effect = Persist | Dispatch | Kill | Reply | Refused | Trigger | Register | ClockJump
