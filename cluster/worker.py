"""The worker agent: pulls runs from a node, runs them, streams their output, reports, heartbeats.

Owns one worker's side of the protocol: ``worker.hello`` with its tiers, free slots and the runs
it still holds (again after every reconnect, so a restarted node re-attaches them), credits
(riding on each final report), heartbeats, reports (output chunks and the final report,
retried until the node has them; the start report, sent without waiting for its answer, which
carries nothing the worker needs), kills the node asks for, and self-fencing: a worker
that has not had a heartbeat acknowledged for longer than its lease minus a margin kills its
tasks, since the node will treat them as lost or hand them out again (DESIGN.md, "Workers fence
themselves"). Tasks run through :mod:`cluster.runner`; ``payload`` tasks go to a handler given
by user code (a worker built on the client library), or fail with a clear error without one.

Must never decide what the node decides (who gets a run, what a timeout means for the run's
state): it reports what happened, with the run's fencing token, and the node's engine decides.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from functools import partial
from typing import Any

import trio

from cluster.client import Client, ClientError, ConnectionLost, RemoteError
from cluster.runner import RunHandle, TaskNotRunnable, run_task
from engine.effects import RunTicket
from engine.lease import worker_fence_at

log = logging.getLogger("tickwheel.worker")

#: fraction of the lease between heartbeats
HEARTBEAT_FRACTION = 3
#: the worker fences itself this long before its lease could lapse on the node
FENCE_MARGIN_MS = 2_000

PayloadHandler = Callable[[RunTicket, Callable[[str, bytes], Awaitable[None]]], Awaitable[int]]


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

    __slots__ = ("_handle", "outcome", "reporting", "ticket")

    def __init__(self, ticket: RunTicket) -> None:
        self.ticket = ticket
        self._handle: RunHandle | None = None
        #: finished, not yet acknowledged by the node
        self.outcome: tuple[str, int | None] | None = None
        self.reporting = False  # its final report is out, its answer not yet in

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
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.host, self.port = host, port
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.tiers = tiers
        self.slots = slots
        self.kill_grace_s = kill_grace_s
        self.container_runtime = container_runtime
        self.payload_handler = payload_handler
        self.held: dict[str, _Held] = {}  # run id -> run this worker holds
        self.running = 0  # runs of self.held without an outcome yet
        self.waiting: list[RunTicket] = []  # dispatched beyond the free slots (several shards)
        self.lease_ms = 10_000
        # when the newest acknowledged heartbeat (or hello) left: what the fence counts from
        self.acked_sent_ms = 0
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
        """Serve until cancelled. Reconnects whenever the node goes away."""
        async with Client.connect(self.host, self.port, timeout_s=3600) as client:
            self.client = client
            client.on_reconnect = self._hello
            client.on_push = self._on_push  # read inline: no channel, no task per dispatch
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await self._hello()
                nursery.start_soon(self._heartbeats)
                nursery.start_soon(self._reporter)
                task_status.started()

    def _running(self) -> int:
        return self.running

    def _free(self) -> int:
        return max(0, self.slots - self.running - len(self.waiting))

    def _held_list(self) -> list[list[Any]]:
        """Every run this worker holds: running, finished but not yet acknowledged, and
        dispatched but waiting for a slot (the node counts them as this worker's)."""
        held = [[rid, h.ticket.token] for rid, h in self.held.items()]
        return held + [[t.run_id, t.token] for t in self.waiting]

    async def _hello(self) -> None:
        sent = _mono_ms()
        result = await self.client.request(
            "worker.hello",
            {
                "worker_id": self.worker_id,
                "tiers": list(self.tiers),
                "slots": self._free(),
                "held": self._held_list(),
            },
        )
        self.lease_ms = int(result["lease_ms"])
        self.acked_sent_ms = sent
        # Reports the node may have missed while the connection was down.
        for rid, held in list(self.held.items()):
            if held.outcome is not None:
                self.nursery.start_soon(self._report_finished, rid)

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(self.lease_ms / HEARTBEAT_FRACTION / 1000)
            sent = _mono_ms()
            try:
                await self.client.request(
                    "worker.heartbeat",
                    {"held": self._held_list()},
                    timeout_s=self.lease_ms / HEARTBEAT_FRACTION / 1000,
                )
                self.acked_sent_ms = sent
            except ClientError as exc:
                log.warning("heartbeat failed: %s", exc)
            if _mono_ms() >= worker_fence_at(self.acked_sent_ms, self.lease_ms, FENCE_MARGIN_MS):
                self._fence()

    def _fence(self) -> None:
        """The node may already consider this worker gone: stop everything it runs."""
        for held in self.held.values():
            if held.outcome is None:
                held.handle.kill("fenced: no heartbeat acknowledged within the lease")
        self.waiting.clear()

    def _on_push(self, message: dict[str, Any]) -> None:
        """A push from the node, in the order they came (called by the client's reader)."""
        kind = message.get("push")
        if kind == "dispatch":
            ticket = ticket_of(message["run"])
            if ticket.run_id in self.held:
                return  # a repeat of what we hold
            if self.running < self.slots:
                self._start(ticket)
            else:
                self.waiting.append(ticket)
        elif kind == "kill":
            held = self.held.get(message["run_id"])
            if held is not None and held.ticket.token == message["token"]:
                held.handle.kill(str(message.get("reason", "killed by the node")))
            self.waiting = [
                t
                for t in self.waiting
                if not (t.run_id == message["run_id"] and t.token == message["token"])
            ]
        elif kind == "refused":
            log.warning("node refused a report: %s", message.get("message"))
            self.nursery.start_soon(self._hello)

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

        async def on_output(stream: str, data: bytes) -> None:
            await self._send_output(ticket, stream, data)

        # The start report goes with the reporter's next pass, if the task still runs then:
        # the task does not wait for it, and a task that ends in its first step (an instant
        # payload handler) needs none (CLAIMED -> final is a transition of its own).
        self._to_start.append(held)
        self._wake_reporter()
        try:
            if "payload" in ticket.task:
                if self.payload_handler is None:
                    await on_output("stderr", b"tickwheel: this worker runs no payload tasks\n")
                    outcome, code = "failed", None
                else:
                    code = await self.payload_handler(ticket, on_output)
                    outcome = "success" if code == 0 else "failed"
            else:
                # "mark": the node records TIMED_OUT; the task runs on to its own end.
                local = ticket._replace(timeout_ms=None) if ticket.on_timeout == "mark" else ticket
                result = await run_task(
                    local,
                    on_output=on_output,
                    handle=held.handle,
                    kill_grace_s=self.kill_grace_s,
                    container_runtime=self.container_runtime,
                )
                outcome, code = result.outcome, result.exit_code
        except TaskNotRunnable as exc:
            await on_output("stderr", f"tickwheel: {exc}\n".encode())
            outcome, code = "failed", None
        held.outcome = (outcome, code)
        self.running -= 1
        self.completed += 1
        self._send_finished(rid)

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
        announced as held by the hello after the reconnect."""
        starts, self._to_start = self._to_start, []
        for held in starts:
            ticket = held.ticket
            if held.outcome is None and self.held.get(ticket.run_id) is held:
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
            sent = self.client.send_then(
                "worker.finished_many",
                {
                    "reports": [self._report_of(rid, held) for rid, held in batch],
                    "credits": self._free(),
                },
                partial(self._batch_answered, batch),
            )
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
                self.nursery.start_soon(self._hello)
                return
            # The batch was refused whole (a node without worker.finished_many, a report it
            # found malformed): nothing of it was taken, so each report goes again alone, and
            # the node answers each for itself.
            log.warning("worker.finished_many refused (%s): reporting one by one", answer)
            for rid, _held in batch:
                self.nursery.start_soon(self._report_finished, rid)
            return
        for rid, _held in batch:
            self._finished_answered(rid, answer)

    def _finished_answered(self, rid: str, answer: Any) -> None:
        """A batch's answer other than a refusal, for one of its runs."""
        held = self.held.get(rid)
        if held is None:
            return
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
        if done and self.held.pop(rid, None) is not None:
            self.acknowledged(rid)

    async def _send_output(self, ticket: RunTicket, stream: str, data: bytes) -> None:
        await self._report(
            "worker.output",
            {
                "run_id": ticket.run_id,
                "token": ticket.token,
                "stream": stream,
                "data": data,
                "attempt": ticket.attempt,
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
                    await self._hello()
                    continue
                log.warning("%s refused: %s", op, exc)
                return True  # refused is an answer: the node will not want it again
            except ConnectionLost:
                await trio.sleep(0.2)  # the client reconnects and says hello first
            except ClientError as exc:
                log.warning("%s: %s; retrying", op, exc)
                await trio.sleep(0.5)


def _mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000
