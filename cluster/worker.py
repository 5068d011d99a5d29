"""The worker agent: pulls runs from a node, runs them, streams their output, reports, heartbeats.

Owns one worker's side of the protocol: ``worker.hello`` with its tiers, free slots and the runs
it still holds (again after every reconnect, so a restarted node re-attaches them), credits
(riding on each final report), heartbeats, reports (output chunks and the final report,
retried until the node has them; the start report, sent without waiting for its answer, which
carries nothing the worker needs), kills the node asks for, and self-fencing: a worker
that has not had a heartbeat acknowledged for longer than its lease minus a margin kills its
tasks at once (SIGKILL, no grace: :func:`engine.lease.worker_fence_at`), since the node will
treat them as lost or hand them out again (DESIGN.md, "Workers fence themselves"), and says
hello again without them. A timer watches that deadline, moved by every acknowledgement.

A graceful stop (:meth:`WorkerAgent.stop`, the command line's SIGTERM or SIGINT) takes no new
run (the node hears 0 free slots), lets the running tasks finish for a drain period, stops
what is left (SIGTERM, the grace, SIGKILL), then reports it: an at-most-once run as
``killed`` (final, outcome known: not LOST), an at-least-once one handed back by a hello
without it (the node sends it out again at once, a new attempt, as after a lost worker; a
``killed`` report would make it FAILED). Dispatches that still arrive are never started: an
at-least-once one is handed back the same way, an at-most-once one reported ``killed``
(:func:`stop_disposition`). It waits (bounded) for the node to acknowledge all that, then
ends :meth:`WorkerAgent.run`.

A dispatch is keyed by (run id, token): a repeat is ignored, a newer attempt of a run it holds
supersedes the old one (stopped at once, its reports dropped), and one stamped with an epoch
older than the newest this worker has seen for the job's shard is refused
(:class:`engine.lease.EpochFence`, as the simulated worker does). Tasks run through
:mod:`cluster.runner`; ``payload`` tasks go to a handler given by user code (a worker built on
the client library), or fail with a clear error without one.

Must never decide what the node decides (who gets a run, what a timeout means for the run's
state): it reports what happened, with the run's fencing token, and the node's engine decides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from functools import partial
from typing import Any

import trio

from cluster.client import (
    Client,
    ClientError,
    ConnectionLost,
    RemoteError,
    RequestNotSendable,
    connect_reason,
)
from cluster.protocol import MAX_WORKER_SLOTS
from cluster.runner import CHUNK_BYTES, RunHandle, TaskNotRunnable, run_task
from cluster.watchdog_link import WatchdogLink
from engine.effects import RunTicket
from engine.lease import EpochFence, guard_fence_at, stop_disposition, worker_fence_at
from engine.routing import shard_of
from engine.runs import token_epoch
from wal.errors import StoreError

log = logging.getLogger("tickwheel.worker")

#: fraction of the lease between heartbeats
HEARTBEAT_FRACTION = 3
#: a hello refused with ``worker_id_in_use`` is tried again, a second apart, for this many
#: leases before the agent gives up: the node lets a silent worker's id go after a lease, and
#: a worker restarted at once may say hello before the node saw its old connection close
ID_IN_USE_LEASES = 1.5
#: ... and for at least this long: before its first hello is answered the agent does not know
#: the node's lease (its own guess is 10 s; a node may keep a longer one), and a worker
#: restarted after a partition must outwait the node's, not its guess
ID_IN_USE_PATIENCE_S = 60.0
#: the worker fences itself this long before its lease could lapse on the node: the slack for
#: the fence timer's lateness and the SIGKILL's delivery (fencing kills at once, no grace)
FENCE_MARGIN_MS = 2_000
#: attempts a worker remembers having let go (``WorkerAgent._dropped``)
MAX_DROPPED = 65_536
#: why a fenced task was stopped (its output's last line says so)
FENCED = "fenced: no heartbeat acknowledged within the lease"
#: why a task still running at the end of a graceful stop's drain was stopped
STOPPING = "the worker is stopping"
#: a graceful stop's defaults: the drain, and the wait for the node's acknowledgements
DEFAULT_DRAIN_S = 30.0
DEFAULT_ACK_TIMEOUT_S = 10.0
#: how often a graceful stop looks whether what it waits for has happened
STOP_POLL_S = 0.05
#: how long the first connection is tried before the worker gives up (``connect_timeout_s``)
DEFAULT_CONNECT_TIMEOUT_S = 3600.0

#: ``async handler(ticket, out) -> exit code``; ``await out(stream, data)`` sends output
#: (``stream`` "stdout" or "stderr"; ``data`` bytes, or str sent as UTF-8)
PayloadHandler = Callable[
    [RunTicket, Callable[[str, bytes | str], Awaitable[None]]], Awaitable[int]
]
#: the streams a payload handler may write to
PAYLOAD_STREAMS: frozenset[str] = frozenset({"stdout", "stderr"})


def payload_chunk(stream: object, data: object) -> tuple[str, bytes]:
    """What a payload handler's ``out(stream, data)`` sends: ``data`` as bytes (a ``str`` is
    encoded as UTF-8, a bytes-like object copied). Raises ``ValueError`` for another stream
    and ``TypeError`` for data of another type, in the handler, where the mistake is: the
    node refuses such a chunk, and before this the agent only logged that, so the output was
    lost without a word to the handler (found by the fifth adversarial pass)."""
    if stream not in PAYLOAD_STREAMS:
        raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
    if isinstance(data, bytes):
        return stream, data
    if isinstance(data, str):
        return stream, data.encode("utf-8", errors="surrogateescape")
    if isinstance(data, bytearray | memoryview):
        return stream, bytes(data)
    raise TypeError(f"output data must be bytes or str, got {type(data).__name__}")


#: the exit codes a payload handler may return: a 32-bit signed int (a process's are 0-255)
PAYLOAD_EXIT_MIN, PAYLOAD_EXIT_MAX = -(2**31), 2**31 - 1


def payload_outcome(result: object) -> tuple[str, int | None, str | None]:
    """(outcome, exit code, complaint) for what a payload handler returned.

    An ``int`` (not a ``bool``) from ``PAYLOAD_EXIT_MIN`` to ``PAYLOAD_EXIT_MAX`` is the exit
    code: 0 is ``success``, anything else ``failed``. Anything else (``None`` from a handler
    that forgot its ``return``, ``True``, ``0.0``, a huge int) fails the run with no exit code
    and a complaint for its stderr: the run's outcome is still known and reported, never left
    to become LOST or to run again (found by the fifth adversarial pass: ``True`` and ``0.0``
    were refused by the node as reports, so the run was dropped unreported and went out again
    forever; ``2**70`` could not be encoded and ended the agent with every run it held).
    """
    if type(result) is int and PAYLOAD_EXIT_MIN <= result <= PAYLOAD_EXIT_MAX:
        return ("success" if result == 0 else "failed"), result, None
    shown = repr(result)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return (
        "failed",
        None,
        f"tickwheel: payload handler returned {shown} ({type(result).__name__}); "
        "expected an int exit code (0 for success) within 32 bits\n",
    )


class WorkerError(Exception):
    """The worker cannot serve: no connection to the node within ``connect_timeout_s``."""


def ticket_of(run: dict[str, Any]) -> RunTicket:
    return RunTicket(  # positional, in field order (one is built per dispatch)
        run["run_id"],
        run["job_id"],
        run["scheduled_ms"],
        run["attempt"],
        run["token"],
        run["version"],
        run["delivery"],
        run["tier"],
        run["timeout_ms"],
        run["task"],
        run.get("on_timeout", "kill"),
    )


class _Runner:
    """A task of the worker's that runs tasks one after another (:meth:`WorkerAgent._run_tasks`):
    its wake-up while idle."""

    __slots__ = ("ready",)

    def __init__(self) -> None:
        self.ready: trio.Event | None = None


class _Held:
    """A run this worker holds, from its dispatch until the node has its final report."""

    __slots__ = (
        "_handle",
        "gone",
        "hand_back",
        "outcome",
        "reporting",
        "scope",
        "started",
        "ticket",
    )

    def __init__(self, ticket: RunTicket) -> None:
        self.ticket = ticket
        self._handle: RunHandle | None = None
        #: finished, not yet acknowledged by the node
        self.outcome: tuple[str, int | None] | None = None
        self.reporting = False  # its final report is out, its answer not yet in
        #: why this attempt was let go (superseded, fenced): no longer held, nothing reported
        self.gone: str | None = None
        #: a payload run's handler, while it runs (cancelled by a kill or a fence)
        self.scope: trio.CancelScope | None = None
        #: stopped by a graceful stop: if it ends killed, it is handed back, not reported
        self.hand_back = False
        #: its start report went out (on a connection that may since have broken)
        self.started = False

    def stop(self, reason: str, *, at_once: bool = False) -> None:
        """Stop the task (a command's process group; a payload handler is cancelled). One
        not started yet never starts."""
        if self.scope is not None:
            self.scope.cancel()
        self.handle.kill(reason, at_once=at_once)

    @property
    def stopped(self) -> bool:
        """Whether a stop was asked for (before its task started, too)."""
        return self._handle is not None and self._handle.kill_reason is not None

    @property
    def handle(self) -> RunHandle:
        """Made on first use (a kill, or a command task's start): a payload run never needs
        one, and its two Trio events were a measurable part of a busy worker's CPU."""
        if self._handle is None:
            self._handle = RunHandle()
        return self._handle


@types.coroutine
def _carry_on(run: Coroutine[Any, Any, None], step: Any) -> Generator[Any, Any, None]:
    """``await run`` for a coroutine already started by hand, whose first step yielded
    ``step`` (a Trio trap): what ``yield from`` does, entered midway. Trio sees the same
    traps, sent and thrown back in the same task, as if the runner had awaited ``run``."""
    while True:
        try:
            sent = yield step
        except GeneratorExit:
            run.close()
            raise
        except BaseException as exc:
            try:
                step = run.throw(exc)
            except StopIteration:
                return
        else:
            try:
                step = run.send(sent)
            except StopIteration:
                return


def _described(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; of a group, of each error in it (a nursery's group, or
    the one ``except*`` makes of a plain exception, says only how many it holds)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_described(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


class WorkerAgent:
    """One worker process's agent. ``slots``: tasks run at once."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        worker_id: str | None = None,
        tiers: tuple[str, ...] = ("default",),
        slots: int = 4,
        kill_grace_s: float = 5.0,
        container_runtime: str | None = None,
        payload_handler: PayloadHandler | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        watchdog: bool = True,
        id_in_use_patience_s: float | None = None,
    ) -> None:
        if not 1 <= slots <= MAX_WORKER_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_WORKER_SLOTS}, got {slots}")
        if not kill_grace_s >= 0:  # (a NaN too) here, not at the first timeout, ending the agent
            raise ValueError(f"kill_grace_s must be >= 0, got {kill_grace_s}")
        self.host, self.port = host, port
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.tiers = tiers
        self.slots = slots
        self.kill_grace_s = kill_grace_s
        self.container_runtime = container_runtime
        self.payload_handler = payload_handler
        self.connect_timeout_s = connect_timeout_s
        #: how long a hello refused with ``worker_id_in_use`` is tried again before the agent
        #: gives up; None: the larger of ID_IN_USE_PATIENCE_S and ID_IN_USE_LEASES leases
        self.id_in_use_patience_s = id_in_use_patience_s
        #: the guard process that kills this worker's tasks if the worker dies
        #: (:mod:`cluster.watchdog`); started by :meth:`run`, None with ``watchdog=False``
        self.watchdog: WatchdogLink | None = WatchdogLink() if watchdog else None
        #: serving: the first hello was answered (:meth:`run`)
        self.serving = False
        #: a graceful stop is under way (:meth:`stop`): no new run starts, 0 free slots
        self.stopping = False
        self._drain_cut = trio.Event()  # set: the drain ends now (:meth:`skip_drain`)
        self.held: dict[str, _Held] = {}  # run id -> the attempt of it this worker holds
        #: names this process to the node, whose hello answer depends on it: only the process
        #: a run was dispatched to can say whether it received it (``seen``)
        self.instance = secrets.token_hex(8)
        #: shard -> the newest dispatch number received from it (``worker.hello``'s ``seen``)
        self.seen: dict[int, int] = {}
        self.running = 0  # tasks started that have not ended (let-go attempts included)
        self.waiting: list[RunTicket] = []  # dispatched beyond the free slots (several shards)
        self.lease_ms = 10_000
        # when the newest acknowledged heartbeat (or hello) left: what the fence counts from
        self.acked_sent_ms = 0
        #: the node's shard count (from the hello's answer; 0 until then)
        self.shards = 0
        #: shard -> the newest epoch seen in a dispatch's token: older ones are refused
        self.newest_epoch: dict[int, int] = {}
        self.epoch_fence = EpochFence()
        self.fenced = 0  # times this worker fenced itself (tasks killed, hello again)
        self._fence_wake: trio.Event | None = None  # wakes the fence timer (_fence_timer)
        #: (client connection generation, sent ms) of the hello that opened the connection,
        #: until it is answered (:meth:`_on_push`)
        self._opening_hello: tuple[int, int] | None = None
        self._fence_due = True  # the fence deadline has passed: a new task wakes the timer
        self._greeting = False  # a hello again (_greet_again) is under way
        self._greet_after = False  # and another was asked for meanwhile: one more follows
        #: run id -> token of the newest attempt this worker let go or dropped unstarted
        #: (fenced, superseded, killed while waiting): a repeat of it is never run. The node
        #: sends a run again when the hello it crossed was built before its dispatch came,
        #: and this worker may have dropped it since. Bounded: the oldest are forgotten (a
        #: repeat comes within a hello's round trip, long before 65,536 more drops).
        self._dropped: dict[str, int] = {}
        #: send each output chunk's offset (off once a node refuses the argument)
        self.output_offsets = True
        #: send ``instance`` and ``seen`` with hellos and heartbeats (off once a node from
        #: before them refuses the arguments: a rolling upgrade, workers first)
        self.dispatch_numbers = True
        self.client: Client
        self.nursery: trio.Nursery
        self.completed = 0
        # Final reports waiting for the reporter task, which sends all of them as one request:
        # the runs that end in one pass of the loop (a node's turn dispatches many at once)
        # cost one request, one reply and one engine command group, not one each.
        self._to_report: list[str] = []
        self._to_start: list[_Held] = []  # tasks begun since the reporter's last pass
        self._idle: list[_Runner] = []  # runner tasks waiting for a run
        # Runs held (counted as running) that no runner task has taken yet, and the runner
        # tasks awake to take them: woken or spawned for it, and not inside a run that waits.
        self._queue: deque[_Held] = deque()
        self._pickers = 0
        self._report_ready: trio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, or until :meth:`stop` ends it. Reconnects whenever the node
        goes away. The first connection is tried for ``connect_timeout_s``, with a warning
        logged at each failed attempt; then :class:`WorkerError`. A hello the node refuses
        raises its :class:`RemoteError`."""
        await self._reach_node()
        try:
            await self._serve(task_status)
        finally:
            if self.watchdog is not None:
                # After the nursery: every task is reaped (or SIGKILLed and left registered,
                # which the guard kills again); the guard then exits quietly.
                await self.watchdog.aclose()

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        async with Client.connect(self.host, self.port, timeout_s=3600) as client:
            self.client = client
            client.on_reconnect = partial(self._hello, opens=True)
            client.on_push = self._on_push  # read inline: no channel, no task per dispatch
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                if self.watchdog is not None:
                    await nursery.start(self.watchdog.supervise)  # before any task runs
                await self._hello(opens=True)
                nursery.start_soon(self._heartbeats)
                nursery.start_soon(self._fence_timer)
                nursery.start_soon(self._reporter)
                self.serving = True
                log.info(
                    "worker %s serving %s: %d slots, tiers %s",
                    self.worker_id,
                    f"{self.host}:{self.port}",
                    self.slots,
                    ",".join(self.tiers),
                )
                task_status.started()

    async def _reach_node(self) -> None:
        """Wait until a TCP connection to the node can be made (then closed again): each
        failed attempt is logged (the client's own retries are silent), with a backoff up to
        5 s; after ``connect_timeout_s``, :class:`WorkerError`. An unresolvable name is
        retried too: name service can fail for a while as well."""
        deadline = trio.current_time() + self.connect_timeout_s
        delay, attempts = 0.5, 0
        while True:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                attempts += 1
                reason = connect_reason(exc)
                where = f"{self.host}:{self.port}"
                if trio.current_time() + delay > deadline:
                    raise WorkerError(
                        f"cannot connect to {where}: {reason} "
                        f"(gave up after {attempts} attempts in {self.connect_timeout_s:g} s)"
                    ) from None
                log.warning("cannot connect to %s: %s; retrying in %g s", where, reason, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, 5.0)
            else:
                await stream.aclose()
                return

    async def stop(
        self,
        drain_s: float = DEFAULT_DRAIN_S,
        *,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
    ) -> bool:
        """Stop gracefully, then end :meth:`run` (call it from another task while it serves).

        At once: the node is told 0 free slots (``worker.pull``), and no run starts any more
        (the runs waiting for a slot, and dispatches that still arrive, are turned away as
        :func:`stop_disposition` says). The running tasks then have up to ``drain_s`` to end
        on their own, reported as usual (:meth:`skip_drain` cuts the drain short). What still
        runs is stopped the ordinary way (SIGTERM to the group, the kill grace, SIGKILL; a
        payload handler is cancelled: one that ignores its cancellation cannot be stopped
        from inside the process, and :meth:`run` ends only when it returns) and reported or
        handed back (:func:`stop_disposition`).
        Then up to ``ack_timeout_s`` for the node to acknowledge those reports and the hello
        that hands runs back; runs it has not acknowledged by then are left to the node
        (their lease lapses). Every step is logged. Returns whether everything was
        acknowledged. Raises RuntimeError if :meth:`run` is not serving; a second call only
        cuts the drain short."""
        if not self.serving:
            raise RuntimeError("the worker is not serving")
        if self.stopping:
            self.skip_drain()
            return False
        self.stopping = True
        log.info(
            "stopping: no new runs; %d running, drain of up to %g s",
            self._unfinished(),
            drain_s,
        )
        self._tell_free()
        waiting, self.waiting = self.waiting, []
        for ticket in waiting:
            self._turn_away(ticket)
        with trio.move_on_after(drain_s):
            await self._wait_for(lambda: not self._unfinished(), self._drain_cut)
        left = [(rid, h) for rid, h in self.held.items() if h.outcome is None]
        if left:
            log.info("drain over: stopping %d runs: %s", len(left), " ".join(r for r, _ in left))
        elif self.running:
            log.info("drain over")
        for _rid, held in left:
            held.hand_back = stop_disposition(held.ticket.delivery) == "hand_back"
            held.stop(STOPPING)
        # The stop sequence ends within the grace (SIGKILL then), or a little later (a stopped
        # container's removal): bounded, then SIGKILL at once.
        with trio.move_on_after(self.kill_grace_s + 5):
            await self._wait_for(lambda: not self.running)
        if self.running:
            for _rid, held in left:
                held.stop(STOPPING, at_once=True)
            with trio.move_on_after(5):
                await self._wait_for(lambda: not self.running)
        if self.running:
            # Nothing in this process can end a payload handler that ignores its cancellation
            # (a blocking call in a thread, a shielded scope, a caught Cancelled in a loop):
            # run() ends when it returns. A container whose removal keeps failing is left to
            # the guard when run() ends. Said, so that whoever waits knows what for.
            stuck = [rid for rid, h in self.held.items() if h.outcome is None]
            log.error(
                "still running after the stop: %s (a payload handler that ignores its "
                "cancellation: run() ends when it returns; or a container not removed yet: "
                "left to the watchdog)",
                " ".join(stuck) or f"{self.running} tasks",
            )
        with trio.move_on_after(ack_timeout_s):
            await self._wait_for(lambda: not self.held and not self._greeting)
        done = not self.held and not self._greeting and not self.running
        if done:
            log.info("stopped: the node has every report")
        else:
            log.warning(
                "stopped without the node's acknowledgement of %d runs (%s): it learns of "
                "them when the lease lapses",
                len(self.held),
                " ".join(self.held),
            )
        self.nursery.cancel_scope.cancel()
        return done

    def skip_drain(self) -> None:
        """End a graceful stop's drain now (:meth:`stop`): what runs is stopped at once."""
        if not self._drain_cut.is_set():
            log.info("drain cut short")
            self._drain_cut.set()

    def _unfinished(self) -> int:
        return sum(1 for h in self.held.values() if h.outcome is None)

    @staticmethod
    async def _wait_for(done: Callable[[], bool], cut: trio.Event | None = None) -> None:
        """Until ``done()`` (or ``cut`` is set): polled, since it depends on many events."""
        while not done() and not (cut is not None and cut.is_set()):
            await trio.sleep(STOP_POLL_S)

    def _turn_away(self, ticket: RunTicket) -> None:
        """A run this stopping worker will not start (:func:`stop_disposition`): reported
        ``killed`` (at-most-once), or handed back by a hello without it (at-least-once). It
        is never run here, even if its dispatch comes again."""
        rid = ticket.run_id
        self._drop_attempt(rid, ticket.token)
        if stop_disposition(ticket.delivery) == "report":
            log.info("not starting %s (at-most-once): reported killed", rid)
            self._report_unstarted(ticket)
        else:
            log.info("not starting %s (at-least-once): handed back", rid)
            self._greet_again()

    def _report_unstarted(self, ticket: RunTicket) -> None:
        """Report ``ticket`` ``killed``, never started here: for an at-most-once run, the
        confirmed stop the node waits for before it may decide (a retry included)."""
        held = _Held(ticket)
        held.outcome = ("killed", None)
        self.held[ticket.run_id] = held
        self._send_finished(ticket.run_id)

    def _running(self) -> int:
        return self.running

    def _free(self) -> int:
        if self.stopping:
            return 0
        return max(0, self.slots - self.running - len(self.waiting))

    def _id_in_use_patience_s(self) -> float:
        if self.id_in_use_patience_s is not None:
            return self.id_in_use_patience_s
        return max(ID_IN_USE_PATIENCE_S, ID_IN_USE_LEASES * self.lease_ms / 1000)

    def _held_list(self) -> list[list[Any]]:
        """Every run this worker holds: running, finished but not yet acknowledged, and
        dispatched but waiting for a slot (the node counts them as this worker's)."""
        held = [[rid, h.ticket.token] for rid, h in self.held.items()]
        return held + [[t.run_id, t.token] for t in self.waiting]

    def _numbers(self) -> dict[str, Any]:
        """What it has heard, to go with ``held`` (taken at the same moment): a dispatch
        numbered after ``seen`` that ``held`` lacks is one crossing the message (or lost with
        a connection), and the node sends it again rather than give it up."""
        if not self.dispatch_numbers:
            return {}
        return {
            "instance": self.instance,
            "seen": [[shard, seq] for shard, seq in self.seen.items()],
        }

    def _old_node(self, exc: RemoteError) -> bool:
        """Whether ``exc`` refuses the dispatch numbers (a node from before them): they are
        not sent again, and the caller retries without (the node then loses every run a
        hello omits, as it always did)."""
        if self.dispatch_numbers and exc.code == "bad_args" and exc.field in ("instance", "seen"):
            log.warning("the node does not take dispatch numbers (%s); going on without", exc)
            self.dispatch_numbers = False
            return True
        return False

    async def _hello(self, *, opens: bool = False) -> None:
        """Say hello (``opens``: as the first request on a new connection) and take the
        answer: lease, shard count, the fence deadline's acknowledgement."""
        refused_since: float | None = None
        while True:
            # Per attempt: an attempt refused for a minute (worker_id_in_use) must not have
            # the accepted one acknowledged as sent a minute ago, by its answer or by the
            # dispatches the node pushes ahead of it (a fence deadline long past, the run just
            # handed out killed at once: found by review), nor announce the free slots of then.
            sent = _mono_ms()
            if opens:
                self._opening_hello = (self.client.generation, sent)
            slots = self._free()
            args = {
                "worker_id": self.worker_id,
                "tiers": list(self.tiers),
                "slots": slots,
                "held": self._held_list(),
                **self._numbers(),
            }
            try:
                result = await self.client.request("worker.hello", args)
                break
            except RemoteError as exc:
                if exc.code == "worker_id_in_use":
                    # Another live process has this id (a misconfiguration: say so loudly),
                    # or this worker's own old connection, not yet seen closed by the node.
                    now = trio.current_time()
                    refused_since = now if refused_since is None else refused_since
                    log.error("hello refused: %s", exc.message)
                    if now - refused_since > self._id_in_use_patience_s():
                        raise
                    await trio.sleep(1.0)
                    continue
                if not self._old_node(exc):
                    raise
        self._opening_hello = None
        if self._free() != slots:
            # Slots freed (or taken) while the hello was out (the tasks a fence killed end a
            # moment after it; a resent frame can land after a newer hello): the node hears
            # the count now, or it would wait with a stale one until the next report.
            self._tell_free()
        self.lease_ms = int(result["lease_ms"])
        self.shards = int(result.get("shards", 0))
        self._acked(sent)
        self._tell_guard_fence()  # the lease may have changed: the deadlines with it
        self._wake_fence()
        # Reports the node may have missed while the connection was down: final reports, and
        # the start reports of tasks still running (a start report lost with a broken
        # connection left the run CLAIMED for as long as its task ran: found by review). A
        # repeat the node already applied is a no-op for the current attempt.
        for rid, held in list(self.held.items()):
            if held.outcome is not None:
                self.nursery.start_soon(self._report_finished, rid)
            elif held.started and held.gone is None:
                self._to_start.append(held)
        if self._to_start:
            self._wake_reporter()

    def _greet_again(self) -> None:
        """Say hello again, in the background, retrying until the node answers (one at a
        time): after a fence (a heartbeat does not tell the node which runs are gone, a hello
        does), a ``refused`` push, or ``not_a_worker`` (the node does not take this
        connection for the worker, so every heartbeat would fail until the fence)."""
        if not self._greeting:
            self._greeting = True
            self.nursery.start_soon(self._hello_until_answered)
        else:
            # The hello under way was built before whatever asks now (runs dropped since,
            # say): it cannot tell the node, so one more hello follows it.
            self._greet_after = True

    async def _hello_until_answered(self) -> None:
        try:
            while True:
                try:
                    self._greet_after = False
                    await self._hello()
                    if not self._greet_after:
                        return
                except ClientError as exc:
                    log.warning("hello failed: %s; retrying", exc)
                    await trio.sleep(0.5)
        finally:
            self._greeting = False

    def _acked(self, sent_ms: int) -> None:
        """The node acknowledged a heartbeat or hello that left at ``sent_ms``: the fence
        deadline moves (replies may come out of order: only a later send moves it)."""
        if sent_ms > self.acked_sent_ms:
            self.acked_sent_ms = sent_ms
            self._tell_guard_fence()
            if self._fence_due:
                self._wake_fence()

    def _tell_guard_fence(self) -> None:
        """Move the guard's fence deadline (:func:`engine.lease.guard_fence_at`): the guard
        kills the tasks of a worker that cannot fence itself (stopped, its loop blocked)."""
        if self.watchdog is not None and self.acked_sent_ms:
            self.watchdog.fence(guard_fence_at(self.acked_sent_ms, self.lease_ms, FENCE_MARGIN_MS))

    def _wake_fence(self) -> None:
        wake = self._fence_wake
        if wake is not None:
            self._fence_wake = None
            wake.set()

    async def _heartbeats(self) -> None:
        """One heartbeat every lease / 3, counted from when the previous one left. Each waits
        for its answer in a task of its own, up to a lease: an answer that comes late still
        moves the fence deadline (counted from when its heartbeat left), and the next
        heartbeats leave on time meanwhile. (Found by review: each waited at most lease / 3
        and threw a later answer away, so a link slower than that, the node renewing the
        lease at every heartbeat, had the worker fence itself, killing its tasks, once a
        lease.)"""
        next_at = trio.current_time()
        async with trio.open_nursery() as beats:
            while True:
                period_s = self.lease_ms / HEARTBEAT_FRACTION / 1000
                next_at = max(next_at + period_s, trio.current_time())
                await trio.sleep_until(next_at)
                if len(beats.child_tasks) >= HEARTBEAT_FRACTION:
                    continue  # a lease's worth unanswered: one more would add nothing
                beats.start_soon(self._heartbeat, _mono_ms())

    async def _heartbeat(self, sent: int) -> None:
        for _attempt in range(2):
            numbers = self._numbers()
            numbers.pop("instance", None)  # the connection's hello named it
            try:
                await self.client.request(
                    "worker.heartbeat",
                    {"held": self._held_list(), **numbers},
                    timeout_s=self.lease_ms / 1000,
                )
            except RemoteError as exc:
                if self._old_node(exc):
                    sent = _mono_ms()
                    continue  # again now, without them
                log.warning("heartbeat refused: %s", exc)
                if exc.code == "not_a_worker":
                    self._greet_again()
            except ClientError as exc:
                log.warning("heartbeat failed: %s", exc)
            else:
                self._acked(sent)
            return

    async def _fence_timer(self) -> None:
        """Sleeps until the fence deadline (:func:`engine.lease.worker_fence_at` of the newest
        acknowledged heartbeat), waking early when the lease changes; an acknowledgement only
        moves the deadline later, so it is recomputed when the sleep ends. Past the deadline,
        fences (if anything runs) and waits for an acknowledgement or a task started since."""
        while True:
            deadline = worker_fence_at(self.acked_sent_ms, self.lease_ms, FENCE_MARGIN_MS)
            now = _mono_ms()
            wake = self._fence_wake = trio.Event()
            if now < deadline:
                self._fence_due = False
                with trio.move_on_after((deadline - now) / 1000):
                    await wake.wait()
                continue
            self._fence_due = True
            if self.waiting or any(h.outcome is None for h in self.held.values()):
                self._fence()
            await wake.wait()

    def _fence(self) -> None:
        """The node may consider this worker gone once its lease lapses: every task it runs is
        killed at once (SIGKILL: a grace would outlast the lease) and let go unreported, what
        waits for a slot is dropped, and a hello without them tells the node (at-least-once
        runs go out again, at-most-once ones are LOST after the grace). Finished runs whose
        report is not acknowledged stay held: their outcome is known and still counts."""
        doomed = [(rid, h) for rid, h in self.held.items() if h.outcome is None]
        log.warning("fencing: %d tasks killed, %d waiting dropped", len(doomed), len(self.waiting))
        self.fenced += 1
        for rid, held in doomed:
            self._let_go(rid, held, FENCED)
        for ticket in self.waiting:
            self._drop_attempt(ticket.run_id, ticket.token)
        self.waiting.clear()
        self._greet_again()

    def _let_go(self, rid: str, held: _Held, reason: str) -> None:
        """Stop holding ``held`` (superseded or fenced): its task is killed at once and ends
        unreported; it is no longer announced as held."""
        held.gone = reason
        if self.held.get(rid) is held:
            del self.held[rid]
        if held.outcome is None:
            held.stop(reason, at_once=True)
            self._drop_attempt(rid, held.ticket.token)

    def _drop_attempt(self, rid: str, token: int) -> None:
        """Never run attempt ``token`` of ``rid`` (or an older one) again here."""
        dropped = self._dropped
        if token > dropped.get(rid, -1):
            dropped.pop(rid, None)  # renewed: the newest drops are the last forgotten
            if len(dropped) >= MAX_DROPPED:
                del dropped[next(iter(dropped))]  # the oldest
            dropped[rid] = token

    def _accepts(self, ticket: RunTicket) -> bool:
        """Whether a dispatch passes the epoch fence: refused when its token's epoch is older
        than the newest this worker has seen for the job's shard (DESIGN.md: workers refuse
        the dispatches of a stale owner). Before the first hello's answer the shard count is
        unknown, but nothing has been seen yet either: accepted, not recorded."""
        shards = self.shards
        if not shards:
            return True
        shard = shard_of(ticket.job_id, shards)
        epoch = token_epoch(ticket.token)
        newest = self.newest_epoch.get(shard, 0)
        if not self.epoch_fence.accepts(newest, epoch):
            log.warning(
                "refused dispatch of %s: epoch %d, shard %d is at %d",
                ticket.run_id,
                epoch,
                shard,
                newest,
            )
            return False
        if epoch > newest:
            self.newest_epoch[shard] = epoch
        return True

    def _on_dispatch(self, ticket: RunTicket) -> None:
        """A dispatch, keyed by (run id, token): a repeat or an older attempt is ignored; a
        newer attempt of a run held supersedes it (the node hands a run out again, to this
        worker too, once it no longer counts the old attempt: after a restart that undid the
        claim, say); a stale owner's is refused (:meth:`_accepts`). Refused dispatches are not
        answered (as the simulated worker): the stale owner can no longer act on the run."""
        if not self._accepts(ticket):
            return
        rid = ticket.run_id
        if self._dropped and self._dropped.get(rid, -1) >= ticket.token:
            return  # an attempt it let go, sent again: never run twice
        held = self.held.get(rid)
        if held is not None:
            if ticket.token <= held.ticket.token:
                return  # a repeat of what we hold, or an older attempt
            self._let_go(rid, held, f"superseded by attempt {ticket.attempt}")
        for i, waiting in enumerate(self.waiting):
            if waiting.run_id == rid:
                if ticket.token <= waiting.token:
                    return
                del self.waiting[i]  # superseded before it started
                break
        if self.stopping:
            self._turn_away(ticket)  # it crossed the worker.pull that said 0 free slots
        elif self.running < self.slots:
            self._start(ticket)
        else:
            self.waiting.append(ticket)

    def _on_push(self, message: dict[str, Any]) -> None:
        """A push from the node, in the order they came (called as the client reads it)."""
        kind = message.get("push")
        opening = self._opening_hello
        if (
            opening is not None
            and opening[0] == self.client.generation
            and kind in ("dispatch", "kill")
        ):
            # A dispatch or kill on a connection opened by a hello was made after the node
            # took that hello (only a hello binds a worker to a connection), so the node's
            # lease for this worker runs from no earlier than when it left: an
            # acknowledgement, which the hello's own answer may follow (the shards work the
            # hello through, dispatching, before the node writes its answer). Without it,
            # after an outage longer than the lease, the stale fence deadline killed the runs
            # the node had just handed out (the fifth adversarial pass: at-most-once ones
            # became LOST, at-least-once ones ran again).
            self._opening_hello = None
            self._acked(opening[1])
        if kind == "dispatch":
            shard, seq = message.get("shard"), message.get("seq", 0)
            if type(shard) is int and type(seq) is int and seq > self.seen.get(shard, 0):
                self.seen[shard] = seq  # before anything may drop it: it was received
            self._on_dispatch(ticket_of(message["run"]))
        elif kind == "kill":
            rid, token = message["run_id"], message["token"]
            held = self.held.get(rid)
            if held is not None and held.ticket.token == token:
                held.stop(str(message.get("reason", "killed by the node")))
            stopped = [t for t in self.waiting if t.run_id == rid and t.token == token]
            if stopped:
                self.waiting = [t for t in self.waiting if t not in stopped]
                self._drop_attempt(rid, token)
                if stop_disposition(stopped[0].delivery) == "report":
                    # An at-most-once run stopped while it waited for a slot: confirmed
                    # never run, as a task's kill is confirmed by its report. The node then
                    # decides at once (a timeout's handler, retries included) instead of
                    # waiting out the reattach grace for a report that never came, to
                    # record the timeout unconfirmed, without its retry.
                    self._report_unstarted(stopped[0])
        elif kind == "refused":
            log.warning("node refused a report: %s", message.get("message"))
            self._greet_again()

    # ------------------------------------------------------------------ one run

    def _start(self, ticket: RunTicket) -> None:
        """Run ``ticket`` now: held at once, taken by a runner task awake for it (woken or
        spawned when none is)."""
        self._queue.append(self._hold(ticket))
        if not self._pickers:
            self._add_picker()

    def _add_picker(self) -> None:
        self._pickers += 1
        if self._idle:
            runner = self._idle.pop()
            ready, runner.ready = runner.ready, None
            assert ready is not None
            ready.set()
        else:
            self.nursery.start_soon(self._run_tasks, _Runner())

    def _hold(self, ticket: RunTicket) -> _Held:
        held = _Held(ticket)
        self.held[ticket.run_id] = held
        self.running += 1
        if self._fence_due:
            self._wake_fence()  # no acknowledgement within the lease: not even a new task
        return held

    async def _run_tasks(self, runner: _Runner) -> None:
        """Takes queued runs one after another, then idles until :meth:`_start` wakes it: a
        Trio task spawned per run cost about a fifth of a busy worker's CPU (cProfile of the
        dispatch benchmark's workers), and a wake-up per run much of the rest.

        Each run's first step is taken by hand: a run that ends without waiting (an instant
        payload handler) costs no pass of Trio's loop, and the next queued run follows in the
        same step. A run that waits (a process, a slow handler) is then awaited as usual, and
        the runs queued behind it get another runner first, so a slow run never holds up the
        others: as before, every held run runs at once, up to ``slots`` of them. At most about
        ``slots`` runner tasks ever exist."""
        queue = self._queue
        while True:
            while queue:
                run = self._execute(queue.popleft())
                try:
                    step = run.send(None)
                except StopIteration:
                    pass  # ended without waiting
                else:
                    self._pickers -= 1  # inside a run that waits: the queue needs another
                    if queue and not self._pickers:
                        self._add_picker()
                    await _carry_on(run, step)
                    self._pickers += 1
                while self.waiting and self.running < self.slots:
                    queue.append(self._hold(self.waiting.pop(0)))  # queued beyond the slots
            self._pickers -= 1
            ready = runner.ready = trio.Event()
            self._idle.append(runner)
            await ready.wait()

    async def _execute(self, held: _Held) -> None:
        ticket = held.ticket
        rid = ticket.run_id
        sent = 0  # bytes of this attempt's output sent so far: the next chunk's offset

        async def on_output(stream: str, data: bytes) -> None:
            nonlocal sent
            offset, sent = sent, sent + len(data)
            try:
                await self._send_output(ticket, stream, data, offset)
            except trio.Cancelled:
                # A chunk the node has not taken yet (it may be down) is given up: the agent
                # is ending (its stop's bounds are over), or a stopped payload handler was
                # sending it. Said here, since the run's log cannot say it.
                log.warning("%s: output from byte %d on not delivered (cancelled)", rid, offset)
                raise

        # The start report goes with the reporter's next pass, if the task still runs then:
        # the task does not wait for it, and a task that ends in its first step (an instant
        # payload handler) needs none (CLAIMED -> final is a transition of its own).
        self._to_start.append(held)
        self._wake_reporter()
        try:
            if held.gone is not None or held.stopped:
                outcome, code = "killed", None  # let go or stopped before it started
            elif "payload" in ticket.task:
                if self.payload_handler is None:
                    await on_output("stderr", b"tickwheel: this worker runs no payload tasks\n")
                    outcome, code = "failed", None
                else:
                    # One call at a time, as the runner's output goes: a handler's tasks that
                    # write at once while the connection is made again could otherwise have a
                    # later chunk land first, and the node drops a chunk behind what it has.
                    output_lock = trio.Lock()

                    async def handler_output(stream: str, data: bytes | str) -> None:
                        name, raw = payload_chunk(stream, data)
                        # In CHUNK_BYTES pieces, as a process's output goes: one request over
                        # the frame limit could not be sent at all, and the whole of it was
                        # lost without a word (found by review: 9 MB in one call).
                        async with output_lock:
                            for start in range(0, len(raw), CHUNK_BYTES):
                                await on_output(name, raw[start : start + CHUNK_BYTES])

                    # The timeout is the worker's to enforce, as for a process (the node acts
                    # only at timeout + its grace, and only when reachable); "mark" lets the
                    # handler run on while the node records TIMED_OUT.
                    timeout_ms = None if ticket.on_timeout == "mark" else ticket.timeout_ms
                    outcome, code = "killed", None
                    with trio.CancelScope() as stop_scope:  # a kill or a fence cancels it
                        held.scope = stop_scope
                        timing = (
                            trio.move_on_after(timeout_ms / 1000)
                            if timeout_ms is not None
                            else contextlib.nullcontext()  # no scope per run without a timeout
                        )
                        try:
                            with timing as timer:
                                returned = await self.payload_handler(ticket, handler_output)
                                outcome, code, complaint = payload_outcome(returned)
                                if complaint is not None:
                                    log.warning("payload handler on %s: %s", rid, complaint.strip())
                                    await on_output("stderr", complaint.encode(errors="replace"))
                        except* Exception as raised:
                            # User code's failure is the run's, never the worker's: the agent
                            # and its other runs carry on (a raise that ended the agent made
                            # every worker that took the run again die too). except*: what a
                            # handler raised while being cancelled comes in a group with the
                            # Cancelled, which is left to its scope (found by review: such a
                            # group escaped a plain except and ended the whole agent).
                            log.exception("payload handler failed on %s", rid)
                            line = f"tickwheel: payload handler raised {_described(raised)}\n"
                            await on_output("stderr", line.encode(errors="replace"))
                            outcome, code = "failed", None
                        if timer is not None and timer.cancel_called:  # swallowed or not
                            outcome, code = "timed_out", None
                            line = (
                                f"tickwheel: stopped (timed out after {timeout_ms} ms): "
                                "payload handler cancelled\n"
                            )
                            await on_output("stderr", line.encode())
                    held.scope = None
                    if stop_scope.cancel_called and outcome != "timed_out":
                        # Stopped (a kill, a graceful stop): the stop wins over what the
                        # handler returned, as for a process (runner.decide_outcome).
                        outcome, code = "killed", None
            else:
                # ("mark": run_task leaves the task running past its timeout.)
                result = await run_task(
                    ticket,
                    on_output=on_output,
                    handle=held.handle,
                    kill_grace_s=self.kill_grace_s,
                    container_runtime=self.container_runtime,
                    guard=self.watchdog,
                )
                outcome, code = result.outcome, result.exit_code
        except TaskNotRunnable as exc:
            await on_output("stderr", f"tickwheel: {exc}\n".encode())
            outcome, code = "failed", None
        held.outcome = (outcome, code)
        self.running -= 1
        self.completed += 1
        if held.gone is None and held.hand_back and outcome == "killed":
            # Stopped by a graceful stop, at-least-once (stop_disposition): handed back to
            # the node by a hello without it, which sends it out again as a new attempt.
            log.info("stopped %s (at-least-once): handed back", rid)
            held.gone = STOPPING
            if self.held.get(rid) is held:
                del self.held[rid]
            self._drop_attempt(rid, ticket.token)
            self._greet_again()
        elif held.gone is None:
            if self.stopping and outcome == "killed":
                log.info("stopped %s (at-most-once): reported killed", rid)
            self._send_finished(rid)
        else:
            # Superseded or fenced: no longer held, and its report would not count. Its slot
            # is free again, which no report will say: a pull does (else, after a fence, the
            # node kept this worker at no credits and it stood idle).
            self._tell_free()

    def _tell_free(self) -> None:
        """Tell the node this worker's free slots now (``worker.pull``, unanswered); without
        a connection, the hello after the reconnect says it."""
        try:
            self.client.notify("worker.pull", {"credits": self._free()})
        except ClientError as exc:
            log.warning("worker.pull: %s", exc)

    @staticmethod
    def _report_of(rid: str, held: _Held) -> dict[str, Any]:
        """The final report of a run with an outcome (``worker.finished``'s fields)."""
        assert held.outcome is not None
        outcome, code = held.outcome
        return {"run_id": rid, "token": held.ticket.token, "outcome": outcome, "exit_code": code}

    def _finished_args(self, rid: str, held: _Held) -> dict[str, Any]:
        # The free slots ride along: one request per finished run instead of two.
        return {**self._report_of(rid, held), "credits": self._free()}

    def _send_finished(self, rid: str) -> None:
        """Queue the final report for the reporter task (the run's task ends now)."""
        self._to_report.append(rid)
        self._wake_reporter()

    def _wake_reporter(self) -> None:
        ready = self._report_ready
        if ready is not None:
            self._report_ready = None
            ready.set()

    def _send_starts(self) -> None:
        """The start reports of tasks queued since the last pass that still run. Not
        answered: the answer changes nothing here. Each leaves before any later report of its
        run (one connection, in order); lost with a broken connection, the run is still
        sent again after the hello that follows the reconnect (:meth:`_hello`)."""
        starts, self._to_start = self._to_start, []
        for held in starts:
            ticket = held.ticket
            if held.outcome is None and held.gone is None and self.held.get(ticket.run_id) is held:
                held.started = True
                self.client.notify(
                    "worker.started", {"run_id": ticket.run_id, "token": ticket.token}
                )

    async def _reporter(self) -> None:
        """Sends the start reports of tasks that still run (:meth:`_send_starts`), then the
        queued final reports, all of a pass of the loop in one ``worker.finished_many``,
        answered by callback. Without a connection, or when the answer is a lost connection,
        each final report is sent again: by a task that retries, or by the hello after the
        reconnect."""
        while True:
            if not self._to_report and not self._to_start:
                ready = self._report_ready = trio.Event()
                await ready.wait()
            if self._to_start:
                self._send_starts()
            rids, self._to_report = self._to_report, []
            batch: list[tuple[str, _Held]] = []
            for rid in rids:
                held = self.held.get(rid)
                if held is not None and held.outcome is not None and not held.reporting:
                    held.reporting = True
                    batch.append((rid, held))
            if not batch:
                continue
            try:
                sent = self.client.send_then(
                    "worker.finished_many",
                    {
                        "reports": [self._report_of(rid, held) for rid, held in batch],
                        "credits": self._free(),
                    },
                    partial(self._batch_answered, batch),
                )
            except ClientError as exc:
                # A batch that cannot be framed must not end the agent with every run it
                # holds: each report goes alone, where a bad one stays the only one hurt.
                log.warning("worker.finished_many not sent (%s): reporting one by one", exc)
                sent = False
            if not sent:
                for rid, held in batch:
                    held.reporting = False
                    self.nursery.start_soon(self._report_finished, rid)

    def _batch_answered(self, batch: list[tuple[str, _Held]], answer: Any) -> None:
        if isinstance(answer, RemoteError):
            for _rid, held in batch:
                held.reporting = False
            if answer.code == "not_a_worker":
                # The node forgot us: one hello, which reports every finished run again.
                self._greet_again()
                return
            # The batch was refused whole (a node without worker.finished_many, a report it
            # found malformed): nothing of it was taken, so each report goes again alone, and
            # the node answers each for itself.
            log.warning("worker.finished_many refused (%s): reporting one by one", answer)
            for rid, _held in batch:
                self.nursery.start_soon(self._report_finished, rid)
            return
        for rid, held in batch:
            self._finished_answered(rid, held, answer)

    def _finished_answered(self, rid: str, held: _Held, answer: Any) -> None:
        """A batch's answer other than a refusal, for one of its runs."""
        if self.held.get(rid) is not held:
            return  # a newer attempt of the run took its place meanwhile
        held.reporting = False
        if isinstance(answer, ConnectionLost):
            return  # the hello after the reconnect reports it again
        self.held.pop(rid, None)
        self.acknowledged(rid)

    def acknowledged(self, rid: str) -> None:
        """Called once the node has a run's final report (a hook for subclasses)."""

    async def _report_finished(self, rid: str) -> None:
        """The final report by a task that retries until the node has it."""
        held = self.held.get(rid)
        if held is None or held.outcome is None or held.reporting:
            return
        held.reporting = True
        try:
            done = await self._report("worker.finished", self._finished_args(rid, held))
        finally:
            held.reporting = False
        if done and self.held.get(rid) is held:
            del self.held[rid]
            self.acknowledged(rid)

    async def _send_output(self, ticket: RunTicket, stream: str, data: bytes, offset: int) -> None:
        """One chunk of an attempt's output, with its byte offset in that attempt's output:
        a chunk sent again (its answer was lost with the connection) is dropped by the node
        instead of being stored twice."""
        await self._report(
            "worker.output",
            {
                "run_id": ticket.run_id,
                "token": ticket.token,
                "stream": stream,
                "data": data,
                "attempt": ticket.attempt,
                **({"offset": offset} if self.output_offsets else {}),
            },
        )

    async def _report(self, op: str, args: dict[str, Any]) -> bool:
        """Send a report until the node has it. False when the node refused it for good (its
        answer is final: a run it does not know, a superseded token)."""
        while True:
            try:
                await self.client.request(op, args, timeout_s=60)
                return True
            except RemoteError as exc:
                if exc.code == "not_a_worker":  # the node restarted and forgot us: hello first
                    # Through the one hello under way, not a hello of this report's own:
                    # hellos in flight together, each with the runs held when it left, can
                    # cross a dispatch and make the node take a run the worker has for lost.
                    self._greet_again()
                    await trio.sleep(NOT_TAKEN_RETRY_S)
                    continue
                if exc.code in NOT_TAKEN_CODES:
                    # Not taken (a failed shard): a final report kept, then sent again until
                    # a node has it durable, the node restarted.
                    log.warning("%s not taken: %s; retrying", op, exc)
                    await trio.sleep(NOT_TAKEN_RETRY_S)
                    continue
                if exc.field == "offset" and "offset" in args:
                    # A node from before output offsets: this chunk and the rest go without
                    # (a resend may then be stored twice, as before).
                    self.output_offsets = False
                    args = {k: v for k, v in args.items() if k != "offset"}
                    continue
                plain = _plain_failure(op, args) if exc.code == "bad_args" else None
                if plain is not None:
                    log.warning("%s refused: %s; reported as failed", op, exc)
                    args = plain
                    continue
                log.warning("%s refused: %s", op, exc)
                return True  # refused is an answer: the node will not want it again
            except RequestNotSendable as exc:
                plain = _plain_failure(op, args)
                if plain is not None:
                    log.warning("%s not sendable: %s; reported as failed", op, exc)
                    args = plain
                    continue
                log.error("%s dropped: %s", op, exc)  # sending it again fails the same way
                return True
            except ConnectionLost:
                await trio.sleep(0.2)  # the client reconnects and says hello first
            except ClientError as exc:
                log.warning("%s: %s; retrying", op, exc)
                await trio.sleep(0.5)


def _plain_failure(op: str, args: dict[str, Any]) -> dict[str, Any] | None:
    """A final report the node refused as malformed, or that cannot be encoded, as a plain
    failure (``failed``, no exit code) to send instead; None when it is one already or is no
    final report. Such a report must not drop the run unreported: it would go out again, or
    become LOST, though its outcome is known."""
    if op != "worker.finished" or (
        args.get("outcome") == "failed" and args.get("exit_code") is None
    ):
        return None
    return {**args, "outcome": "failed", "exit_code": None}


def _store_codes(cls: type[StoreError] = StoreError) -> frozenset[str]:
    codes = {cls.code}
    for sub in cls.__subclasses__():
        codes |= _store_codes(sub)
    return frozenset(codes)


#: Answers that say a report was *not* taken: the shard's store failed, or the shard stopped
#: (``shard_failed``). The report is kept and sent again: the node answers it once restarted.
NOT_TAKEN_CODES: frozenset[str] = _store_codes() | {"shard_failed"}
NOT_TAKEN_RETRY_S = 1.0


def _mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000
