"""The client library (Trio): jobs, runs and logs over the wire protocol, with typed errors.

Owns one connection to a node: request ids, pipelining (any number of requests in flight, the
replies matched by id), timeouts, reconnects with backoff, and the pushes a node sends a worker
connection. Must never decide anything the node decides; it may only retry what is safe to
retry (every request is idempotent by construction or reported as such, see :meth:`request`).

Usage::

    async with Client.connect("127.0.0.1", 7070) as client:
        job = await client.create({"schedule": {"every": "1m"}, "task": {"shell": "date"}})
        runs = await client.history(job["job_id"], last=5)

Failure modes: :class:`RemoteError` (the node refused: ``code``, ``message``, ``field``),
:class:`RequestTimeout`, :class:`ConnectionLost` (the connection broke and ``reconnect`` is
off: at once, for the requests in flight and for every later one; or a reconnect did not
succeed within the request's time).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import trio

from cluster.codec import DEFAULT_MAX_FRAME, FrameDecoder, Message, ProtocolError, encode
from cluster.rawio import (
    END_OF_STREAM,
    Outbox,
    RawSocketIO,
    ReadPoller,
    read_ready,
)
from engine.errors import EngineUsageError
from engine.jobs import new_job_id, validate_job, validate_job_id
from engine.runs import FINAL_VALUES

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
#: set while the reconnect hook runs: its requests go out before anyone else's
_handshake: ContextVar[bool] = ContextVar("tickwheel_handshake", default=False)

#: The read poller of the Trio run (:func:`_run_poller`): every client connection of the run
#: waits for its replies there, one task and one wait for them all.
_RUN_POLLER: trio.lowlevel.RunVar[ReadPoller | None] = trio.lowlevel.RunVar(
    "tickwheel_client_poller", default=None
)


def _run_poller() -> ReadPoller:
    """The run's read poller, started (a system task: it outlives any one client's nursery,
    and is cancelled with the run) by the first connection that waits for bytes. A reader
    never raises out of its pass (:meth:`ReadPoller._pass` hands a bug back to its task), so
    the system task never fails the run."""
    poller = _RUN_POLLER.get()
    if poller is None or poller.closed:
        poller = ReadPoller()
        trio.lowlevel.spawn_system_task(poller.run, name="tickwheel client read poller")
        _RUN_POLLER.set(poller)  # (once spawned: a failed spawn leaves no dead poller)
    return poller


def _hand_back_reader(stream: trio.SocketStream) -> None:
    """Before ``stream`` is closed by any task but its reader: end its reader's wait in the
    run's poller (a closed socket leaves the poller's set without a word, and its reader
    would wait on). Its reader then finds the stream closed."""
    poller = _RUN_POLLER.get()
    fd = stream.socket.fileno()
    if poller is not None and fd >= 0:
        poller.hand_back(fd, END_OF_STREAM)


class _Reading:
    """One connection's reading side: its decoder, and what the run's poller calls when its
    socket is readable while its reader task waits there. Replies and pushes are handed out
    in the reader task's context (a copy), as when that task read them itself: the
    callbacks (``on_push``, ``send_then``'s) and the tasks they start see the context
    variables of whoever connected, not the poller's."""

    __slots__ = ("client", "context", "decoder", "poller")

    def __init__(self, client: Client, decoder: FrameDecoder, poller: ReadPoller) -> None:
        self.client = client
        self.decoder = decoder
        self.poller = poller
        self.context = contextvars.copy_context()

    def read_parked(self, fd: int) -> None:
        data = read_ready(self.poller, fd)
        if data is None:
            return
        self.decoder.feed(data)
        # (a callback's exception goes to the reader task, raised there)
        self.context.run(self.client._deliver, self.decoder)


class ClientError(Exception):
    """Root of the client's errors.

    Raised by :meth:`Client.create` for a spec without an ``id``, it carries the id the
    library generated as ``job_id`` (and by :meth:`Client.create_many`, every spec's id as
    ``job_ids``, in order, None for an entry that is not a map): after a timeout or a lost
    connection the job may exist, and only a retry with that id cannot make a second one.
    Otherwise both are None."""

    code = "client_error"
    job_id: str | None = None
    job_ids: list[str | None] | None = None


class RemoteError(ClientError):
    """The node answered with an error: ``code`` (stable, from docs/protocol.md), ``message``,
    and ``field`` (the argument or spec field at fault, when there is one)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field


class RequestTimeout(ClientError):
    code = "timeout"


class RequestNotSendable(ClientError):
    """The request cannot be framed: a value msgpack cannot encode (an int beyond 64 bits, an
    object), or a frame over the node's limit. Nothing was sent, and sending the same request
    again fails the same way."""

    code = "not_sendable"


class ConnectionLost(ClientError):
    code = "connection_lost"


def _outcome(reply: Message) -> Any | ClientError:
    """A reply's result, or the error standing for it."""
    if "_lost" in reply:
        return ConnectionLost(reply["_lost"])
    if reply.get("ok"):
        return reply.get("result")
    err = reply.get("error") or {}
    return RemoteError(str(err.get("code", "error")), str(err.get("message", "")), err.get("field"))


def same_spec(sent: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether ``stored`` (a job's stored, normalized spec, as ``job.get`` returns it) is the
    job ``sent`` (a spec as given to ``job.create``) creates: both normalized by the engine's
    own validation and compared by value. An ``every`` schedule sent without ``start`` takes
    the stored one (the node fills in its creation time). False when either does not
    validate."""
    schedule = sent.get("schedule")
    stored_schedule = stored.get("schedule")
    if (
        isinstance(schedule, dict)
        and "every" in schedule
        and "start" not in schedule
        and isinstance(stored_schedule, dict)
        and "start" in stored_schedule
    ):
        sent = {**sent, "schedule": {**schedule, "start": stored_schedule["start"]}}
    try:
        return validate_job(sent, now_ms=0) == validate_job(stored, now_ms=0)
    except EngineUsageError:
        return False


def _holds(stored: dict[str, Any], changes: dict[str, Any], *, restart_held: bool) -> bool:
    """Whether the job ``stored`` (a normalized spec) already holds ``changes`` (an update's
    top-level keys): applying them would change nothing (``replace`` is reset by every
    update, so it is not compared).

    An ``every`` schedule without ``start`` in ``changes`` restarts the schedule at the time
    the update is applied, which the stored spec cannot show: any stored start is taken as
    that restart when ``restart_held`` (the caller knows from the version that the change
    was applied, and asks only whether it was this one), never otherwise (a job that has
    the period with its old start does not hold the restart)."""
    schedule = changes.get("schedule")
    if (
        not restart_held
        and isinstance(schedule, dict)
        and "every" in schedule
        and "start" not in schedule
    ):
        return False
    merged = {**stored, **{k: v for k, v in changes.items() if k != "replace"}}
    return same_spec(merged, stored)


def _is_exists(entry: dict[str, Any]) -> bool:
    """Whether a ``create_many`` entry was refused as ``exists``."""
    error = entry.get("error")
    return not entry.get("ok") and isinstance(error, dict) and error.get("code") == "exists"


async def created_as_sent(client: Client, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The job ``spec["id"]`` names, as ``client.get`` describes it less its spec, when the
    stored spec is ``spec`` (:func:`same_spec`): a create of ``spec`` was applied (by an
    earlier attempt whose reply was lost, say); None when another spec is stored. Raises
    :class:`ClientError` when the job cannot be read (``not_found`` among them). What every
    retried create decides an ``exists`` by (:meth:`Client.create`,
    :meth:`Client.create_many`, ``submit --file``)."""
    job = await client.get(spec["id"])
    stored = job.pop("spec", None)
    return job if isinstance(stored, dict) and same_spec(spec, stored) else None


async def job_version(client: Client, job_id: str, *, timeout_s: float | None = None) -> int:
    """The version job ``job_id`` is at now; 0 when there is no such job (never made, or
    cancelled). Raises :class:`ClientError` when it cannot be read."""
    try:
        job = await client.get(job_id, timeout_s=timeout_s)
    except RemoteError as exc:
        if exc.code == "not_found":
            return 0
        raise
    return int(job["version"])


async def in_parallel(
    items: Iterable[T], fn: Callable[[T], Awaitable[None]], *, parallel: int = 64
) -> None:
    """``await fn(item)`` for every item, at most ``parallel`` at once: reads the client makes
    per job (one after another, 10,000 of them took longer than a batch's whole timeout:
    found by review)."""
    limit = trio.Semaphore(parallel)

    async def one(item: T) -> None:
        async with limit:
            await fn(item)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)


async def job_versions(
    client: Client, ids: Iterable[str], *, timeout_s: float | None = None
) -> dict[str, int]:
    """:func:`job_version` of each of ``ids``, read :func:`in_parallel`. Raises the first
    :class:`ClientError` met; the reads still out are abandoned."""
    out: dict[str, int] = {}
    failures: list[ClientError] = []
    with trio.CancelScope() as scope:

        async def read(job_id: str) -> None:
            try:
                out[job_id] = await job_version(client, job_id, timeout_s=timeout_s)
            except ClientError as exc:
                failures.append(exc)
                scope.cancel()

        await in_parallel(dict.fromkeys(ids), read)
    if failures:
        raise failures[0]
    return out


async def replace_applied(
    client: Client, spec: dict[str, Any], before: int, *, timeout_s: float | None = None
) -> dict[str, Any] | None:
    """After a replacing create of ``spec`` whose answer was lost: the job as ``client.get``
    describes it less its spec when the create was applied (the job moved on from version
    ``before`` and holds ``spec``); None when it was not (still at ``before``). Raises
    :class:`ConnectionLost` when the job changed into something else meanwhile (whether
    this create was applied is unknown), :class:`ClientError` when it cannot be read."""
    try:
        job = await client.get(spec["id"], timeout_s=timeout_s)
    except RemoteError as exc:
        if exc.code != "not_found":
            raise
        job = None
    version = 0 if job is None else int(job["version"])
    if version == before:
        return None
    stored = None if job is None else job.pop("spec", None)
    if job is not None and isinstance(stored, dict) and same_spec(spec, stored):
        return job
    raise ConnectionLost(
        f"job.create: the connection broke and job {spec['id']!r} changed meanwhile (version "
        f"{before} -> {version}): whether this replace was applied is unknown"
    )


def _unknown(message: str) -> dict[str, Any]:
    """A ``create_many`` entry whose outcome is unknown, shaped as the node's errors."""
    return {"ok": False, "error": {"code": "connection_lost", "message": message, "field": None}}


def replaces(spec: object) -> bool:
    """Whether ``spec`` is a create that replaces a live job of its id (``replace: true``)
    and names it by a valid job id (any other id is the node's to refuse, alone: read first,
    it failed the whole batch; found by review): such a create is never answered ``exists``,
    so a second attempt would apply it again."""
    if not isinstance(spec, dict) or spec.get("replace") is not True:
        return False
    try:
        validate_job_id(spec.get("id"))
    except EngineUsageError:
        return False
    return True


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), an IPv6 host in brackets (``[::1]:7070``) or bare
    (``::1:7070``, the last colon ends it); raises :class:`ClientError` on anything else."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif "[" in host or "]" in host:
        host = ""  # an unbalanced bracket
    # (isascii: str.isdigit() takes digits such as "²" that int() refuses)
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ClientError(f"not HOST:PORT: {text!r}")
    return host, int(port)


def connect_reason(exc: OSError) -> str:
    """Why a connection attempt failed, in words: Trio's "all attempts to connect to X
    failed" carries each address's error as its cause (refused, unreachable, timed out)."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        reasons = [
            os.strerror(e.errno) if e.errno else str(e)
            for e in cause.exceptions
            if isinstance(e, OSError)
        ]
        if reasons:
            return "; ".join(dict.fromkeys(reasons))  # each distinct reason once, in order
    return exc.strerror or str(exc) or type(exc).__name__


class Client:
    """A connection to one node. Open with ``async with Client.connect(host, port) as client``. Safe to use from many tasks at once."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reconnect: bool = True,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.reconnect = reconnect
        self.max_frame = max_frame
        self._next_id = 0
        # request id -> what its reply wakes: a waiting task's (event, box), or a callback
        self._waiting: dict[int, tuple[trio.Event, list[Message]] | Callable[[Message], None]] = {}
        self._stream: trio.SocketStream | None = None
        self._outbox: Outbox | None = None  # the current connection's
        self._connected = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._closed = False
        #: why there is no connection and will be none (``reconnect`` off, or closed): a
        #: request then fails at once with :class:`ConnectionLost` instead of waiting for a
        #: connection that no one will make (found by the fifth adversarial pass: it waited
        #: out its whole timeout and raised RequestTimeout)
        self._gone: str | None = None
        self.pushes_send, self.pushes = trio.open_memory_channel[Message](math.inf)
        #: when set, pushes are handed to it as they are read, in order, instead of :attr:`pushes`
        #: (no channel, no task: a worker's dispatches cost less). Called by the run's read
        #: poller (a system task), in the connecting task's context: it must not block, and a
        #: Ctrl-C waits until it returns; what it raises ends this client.
        self.on_push: Callable[[Message], None] | None = None
        #: called (awaited) after every reconnect, before requests flow again: a worker says
        #: hello again here
        self.on_reconnect: Callable[[], Awaitable[None]] | None = None
        self.generation = 0  # connections made so far
        #: the error of the last failed connection attempt (None: none failed yet)
        self.last_connect_error: OSError | None = None
        self._on_connect_retry: Callable[[OSError], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reconnect: bool = True,
        on_retry: Callable[[OSError], None] | None = None,
    ) -> AsyncIterator[Client]:
        """Connect (retrying with backoff for up to ``timeout_s``), serve the connection for
        the ``async with`` block, then close it. ``on_retry`` hears the first failed attempt
        (a command line says it is waiting, and why). Raises :class:`ConnectionLost` when no
        connection could be made in time, naming the last attempt's error."""
        client = cls(host, port, timeout_s=timeout_s, reconnect=reconnect)
        client._on_connect_retry = on_retry
        try:
            async with trio.open_nursery() as nursery:
                client._nursery = nursery
                try:
                    with trio.fail_after(timeout_s):
                        await client._open()
                    client._on_connect_retry = None  # about the first connection only
                except trio.TooSlowError:
                    why = client.last_connect_error
                    raise ConnectionLost(
                        f"cannot connect to {host}:{port} within {timeout_s:g} s"
                        + (f": {connect_reason(why)}" if why is not None else "")
                    ) from None
                try:
                    yield client
                finally:
                    await client.aclose()
        except BaseExceptionGroup as group:
            # The block's own exception, not wrapped by the reader's nursery.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def aclose(self) -> None:
        """Close the connection; requests still waiting, and any made later, fail with
        :class:`ConnectionLost`."""
        self._closed = True
        self._gone = self._gone or "client closed"
        # Requests waiting for a reconnect wake and find no connection: ConnectionLost now,
        # not a `timeout` at their deadline (found by review).
        self._outbox = None
        self._connected.set()
        if self._stream is not None:
            _hand_back_reader(self._stream)
            with trio.move_on_after(1) as scope:
                scope.shield = True
                await self._stream.aclose()
        self._fail_waiting(ConnectionLost("client closed"))
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _open(self, *, announce: bool = True) -> None:
        delay = 0.05
        while True:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
                break
            except OSError as exc:
                if self.last_connect_error is None and self._on_connect_retry is not None:
                    self._on_connect_retry(exc)
                self.last_connect_error = exc
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self._stream = stream
        self._outbox = outbox = Outbox(RawSocketIO(stream))
        self.generation += 1
        assert self._nursery is not None
        writing = trio.CancelScope()
        self._nursery.start_soon(self._reader, stream, writing)
        self._nursery.start_soon(self._writer, stream, outbox, writing)
        if announce:
            self._connected.set()

    async def _reader(self, stream: trio.SocketStream, writing: trio.CancelScope) -> None:
        io = RawSocketIO(stream)
        poller = _run_poller()
        reading = _Reading(self, FrameDecoder(self.max_frame), poller)
        try:
            # Parked in the run's poller, which reads the replies and pushes and hands them
            # out; back here only at the end, or once the poller stopped (the run ends): this
            # task then reads itself.
            outcome = await poller.wait(reading, io.fileno())
            if isinstance(outcome, BaseException):
                raise outcome  # (a callback's, met by the poller)
            if outcome is None:
                while data := await io.receive_some():
                    reading.decoder.feed(data)
                    self._deliver(reading.decoder)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        # The connection is done with: its writer and its socket go too (a writer parked for
        # frames that will never come, and a socket in CLOSE-WAIT, per lost connection).
        writing.cancel()
        with trio.move_on_after(1) as scope:
            scope.shield = True
            await stream.aclose()
        if self._stream is stream:
            self._stream = None
            self._outbox = None
            lost = f"connection to {self.host}:{self.port} lost"
            if self.reconnect and not self._closed:
                # Requests wait for the reconnect. A new Event only if the last one was set:
                # a connection that broke again before its reconnect finished (in the hook)
                # keeps the Event its requests already wait on, which the reconnect that
                # succeeds sets (found by review: replaced unset, its waiters slept through
                # the next connection to a `timeout`, never sent).
                if self._connected.is_set():
                    self._connected = trio.Event()
                self._fail_waiting(ConnectionLost(lost))
                assert self._nursery is not None
                self._nursery.start_soon(self._reconnect)
            else:
                # No connection will come: ``_connected`` stays set, so that a request finds
                # no outbox and fails at once (and notify/send_then send nothing).
                self._gone = lost + ("" if self._closed else " (reconnect is off)")
                self._fail_waiting(ConnectionLost(self._gone))

    def _deliver(self, decoder: FrameDecoder) -> None:
        """Every whole message read so far to whom it is for: a push to :attr:`on_push` (or
        :attr:`pushes`), a reply to the request waiting for it. Never waits."""
        while (event := decoder.next_event()) is not None:
            if isinstance(event, ProtocolError):
                continue  # the node sent something unreadable; skip that frame
            if "push" in event:
                if self.on_push is not None:
                    self.on_push(event)
                else:
                    self.pushes_send.send_nowait(event)
                continue
            waiter = self._waiting.pop(event.get("id", -1), None)
            if waiter is None:
                continue
            if isinstance(waiter, tuple):
                waiter[1].append(event)
                waiter[0].set()
            else:
                waiter(event)

    async def _writer(
        self, stream: trio.SocketStream, outbox: Outbox, writing: trio.CancelScope
    ) -> None:
        """Sends what requests queued: everything queued while the previous send was in flight
        leaves in one send (many requests in flight cost few system calls, and a request
        never waits for a lock). A failed send closes the stream: the reader then fails every
        request waiting, which are retried after the reconnect."""
        try:
            with writing:
                await outbox.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            _hand_back_reader(stream)
            with trio.move_on_after(1) as scope:
                scope.shield = True
                await stream.aclose()

    async def _reconnect(self) -> None:
        # Requests wait until the hook (a worker's hello) has run on the new connection: a
        # worker's report must never reach a node that does not know the worker yet.
        await self._open(announce=False)
        mine = self._stream
        if self.on_reconnect is not None:
            token = _handshake.set(True)
            try:
                await self.on_reconnect()
            except ClientError:
                pass  # the connection broke again; the reader schedules the next attempt
            finally:
                _handshake.reset(token)
        # Only the reconnect whose connection is still the current one lets requests go: one
        # whose connection broke during its hook must not release them onto the next, whose
        # own hook (a hello) may not have been answered yet.
        if mine is not None and self._stream is mine:
            self._connected.set()

    def _fail_waiting(self, error: ClientError) -> None:
        waiting, self._waiting = self._waiting, {}
        lost = {"_lost": str(error)}
        for waiter in waiting.values():
            if isinstance(waiter, tuple):
                waiter[1].append(lost)
                waiter[0].set()
            else:
                waiter(lost)

    # ------------------------------------------------------------------ requests

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        sent_on: list[int] | None = None,
        retry: bool = True,
    ) -> Any:
        """Send ``op`` and wait for its result.

        A broken connection is retried (after the reconnect) until the timeout: every op of
        the protocol is safe to repeat (creates carry their id; a repeated create that finds
        its job is reported by :meth:`create` as the job). ``sent_on``, when given, gets the
        :attr:`generation` of each connection the request was written to: more than one
        entry means an earlier attempt may have reached the node before its connection broke.
        ``retry`` False: a broken connection raises :class:`ConnectionLost` at once instead
        (for a caller that decides itself what a second attempt should be).
        Raises :class:`RemoteError`, :class:`RequestTimeout`, :class:`ConnectionLost`.

        A request the caller cancels (a Trio cancel scope), or that times out, may still be
        applied: its frame is written as soon as it is made, before the first checkpoint, and
        the node cannot tell a request nobody waits for any more. Its outcome is unknown, as
        after a lost reply: read the state back before repeating a change (a create of the
        same id sent again may answer ``exists`` for the job the cancelled one made).
        """
        deadline = trio.current_time() + (timeout_s or self.timeout_s)
        while True:
            # A bare cancel scope, not trio.fail_at: its context-manager generator cost a
            # third more per request (~3 us), paid by every request of a busy client.
            with trio.CancelScope(deadline=deadline) as scope:
                try:
                    return await self._request_once(op, args or {}, sent_on)
                except ConnectionLost:
                    if not retry or not self.reconnect or self._closed:
                        raise
                    if trio.current_time() >= deadline:
                        raise
            if scope.cancelled_caught:
                if self._closed:
                    raise ConnectionLost(f"{op}: {self._gone or 'client closed'}") from None
                if self._outbox is None and self.reconnect and not self._closed:
                    # Waiting for a reconnect the whole time left: the connection is what
                    # failed, not the node's answer (found by review: a node that stayed
                    # away gave `timeout`, where the protocol promises `connection_lost`).
                    why = self.last_connect_error
                    raise ConnectionLost(
                        f"{op}: connection to {self.host}:{self.port} lost and not made again "
                        f"within {timeout_s or self.timeout_s:.3g} s"
                        + (f": {connect_reason(why)}" if why is not None else "")
                    ) from None
                raise RequestTimeout(
                    f"{op}: no reply within {timeout_s or self.timeout_s:.3g} s"
                ) from None
            await trio.sleep(0.05)

    def _frame(self, op: str, args: dict[str, Any]) -> tuple[int, bytes]:
        self._next_id += 1
        request_id = self._next_id
        try:
            frame = encode({"id": request_id, "op": op, "args": args})
        except ProtocolError as exc:
            raise RequestNotSendable(f"{op}: {exc.message}") from None
        if len(frame) - 4 > self.max_frame:
            # The node would answer with an error it cannot pair with this request.
            raise RequestNotSendable(
                f"{op}: request of {len(frame) - 4} bytes; the frame limit is {self.max_frame}"
            )
        return request_id, frame

    def notify(self, op: str, args: dict[str, Any]) -> bytes | None:
        """Send ``op`` without waiting for (or reading) its reply: for a report whose answer
        changes nothing for the sender. Returns the frame queued (for :meth:`withdraw`), or
        None when there is no connection right now (nothing was sent); a connection that
        breaks later may lose it too. Raises :class:`ClientError` for a request that cannot
        be encoded."""
        outbox = self._outbox
        if outbox is None or not self._connected.is_set():
            return None
        _request_id, frame = self._frame(op, args)
        outbox.put(frame)  # its reply is dropped when read: no one waits for that id
        return frame

    def withdraw(self, frame: bytes) -> bool:
        """Take back a frame :meth:`notify` queued, if it has not been handed to the socket
        yet; True when it never will be."""
        outbox = self._outbox
        if outbox is None:
            return False
        frames = outbox.frames
        for i in range(len(frames) - 1, -1, -1):  # a recent frame: look from the end
            if frames[i] is frame:
                del frames[i]
                return True
        return False

    def send_then(
        self, op: str, args: dict[str, Any], on_answer: Callable[[Any | ClientError], None]
    ) -> bool:
        """Send ``op`` now; ``on_answer`` later gets its result, or the :class:`RemoteError`
        or :class:`ConnectionLost` in its place (called as the reply is read, so it must
        not block). No task waits and nothing is retried: that is the caller's business. False
        when there is no connection right now (nothing sent, ``on_answer`` never called).
        Raises :class:`ClientError` for a request that cannot be encoded."""
        outbox = self._outbox
        if outbox is None or not self._connected.is_set():
            return False
        request_id, frame = self._frame(op, args)
        self._waiting[request_id] = lambda reply: on_answer(_outcome(reply))
        outbox.put(frame)
        return True

    async def _request_once(
        self, op: str, args: dict[str, Any], sent_on: list[int] | None = None
    ) -> Any:
        if not _handshake.get() and not self._connected.is_set():
            await self._connected.wait()
        outbox = self._outbox
        if outbox is None:
            raise ConnectionLost(self._gone or "not connected")
        request_id, frame = self._frame(op, args)
        if sent_on is not None:
            sent_on.append(self.generation)  # (no wait since outbox was read: its connection)
        event, box = trio.Event(), list[Message]()
        waiting = self._waiting
        waiting[request_id] = (event, box)
        if len(waiting) == 1:
            # Alone in flight on its connection: written at once if the writer is idle. With
            # others in flight the writer gathers them into one write, cheaper than one each.
            outbox.frames.append(frame)
            outbox.write_now()
        else:
            outbox.put(frame)
        try:
            await event.wait()
        finally:
            self._waiting.pop(request_id, None)
        outcome = _outcome(box[0])
        if isinstance(outcome, ClientError):
            try:
                raise outcome
            finally:
                # The traceback holds this frame: without this, the frame would hold the
                # error back (a cycle only the collector frees, with the request's args in it).
                del outcome
        return outcome

    # ------------------------------------------------------------------ jobs

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Create a job. Without an ``id``, one is generated here (time-sortable), so that a
        retry after a lost reply cannot create the job twice.

        ``exists`` is an error, with one exception: when this very request was retried on a
        new connection (an earlier attempt was written to a connection that broke before its
        reply) and the stored job is the spec sent, the earlier attempt created it, and the
        job is returned as the create's result. Any other ``exists`` (another client's job,
        a job of another spec, or a connection re-made before this request was sent) raises
        :class:`RemoteError` ``exists``.

        A spec without an ``id`` gets one here; every error raised then carries it as
        ``job_id`` (:class:`ClientError`): retry with it (``{**spec, "id": exc.job_id}``), not
        with the spec as it was, which would make a new id and, if the first attempt was
        applied, a second job.
        """
        generated = isinstance(spec, dict) and "id" not in spec  # (not a map: node refuses it)
        if generated:
            spec = {**spec, "id": new_job_id(int(time.time() * 1000), os.urandom(10))}
        try:
            return await self._create_with_id(spec)
        except ClientError as exc:
            if generated:
                exc.job_id = spec["id"]
            raise

    async def _create_with_id(self, spec: dict[str, Any]) -> dict[str, Any]:
        if replaces(spec):
            return await self._create_replacing(spec)
        sent_on: list[int] = []
        try:
            result: dict[str, Any] = await self.request(
                "job.create", {"spec": spec}, sent_on=sent_on
            )
        except RemoteError as exc:
            if exc.code != "exists" or len(sent_on) < 2:
                raise
            try:
                job = await created_as_sent(self, spec)
            except ClientError:
                raise exc from None
            if job is None:
                raise
            return job  # our own create, whose reply was lost with its connection
        return result

    async def _create_replacing(self, spec: dict[str, Any]) -> dict[str, Any]:
        """:meth:`create` of a spec with ``replace``: sent once. Sent again after a broken
        connection, an earlier attempt that was applied would be applied twice (one more
        version; an ``every`` without ``start`` restarted, its next fire moved: found by
        review), and a replace never answers ``exists``. So the job's version is read first,
        and after a broken connection again: grown and holding the spec sent, the replace
        was applied (the result); unchanged, it was not (sent again); changed into something
        else, whether it was is unknown (:class:`ConnectionLost`). (An earlier attempt still
        on its way to the node while the job is read back can still land after the retry,
        as for :meth:`update`.) The read first has its own timeout; the create and what
        follows it share one."""
        before = await job_version(self, spec["id"])
        deadline = trio.current_time() + self.timeout_s
        while True:
            try:
                result: dict[str, Any] = await self.request(
                    "job.create",
                    {"spec": spec},
                    timeout_s=max(deadline - trio.current_time(), 0.001),
                    retry=False,
                )
                return result
            except ConnectionLost:
                if not self.reconnect or self._closed:
                    raise
            left = deadline - trio.current_time()
            if left <= 0:
                raise RequestTimeout(f"job.create: no reply within {self.timeout_s} s")
            held = await replace_applied(self, spec, before, timeout_s=left)
            if held is not None:
                return held

    async def create_many(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Create jobs in one request; per spec ``{"ok", "result"}`` or ``{"ok", "error"}``
        (an entry that is not a map is sent as it is: the node answers ``bad_args`` for it).
        A batch holding a spec with ``replace`` is sent again after a broken connection only
        for the specs whose jobs do not hold them yet, as :meth:`create` does for one.
        Specs without an ``id`` get one here; every error raised then carries every entry's
        id as ``job_ids`` (:class:`ClientError`), for a retry that cannot make second jobs."""
        now = int(time.time() * 1000)
        generated = False
        with_ids: list[dict[str, Any]] = []
        for s in specs:
            if isinstance(s, dict) and "id" not in s:
                s = {**s, "id": new_job_id(now, os.urandom(10))}
                generated = True
            with_ids.append(s)
        try:
            return await self._create_many_with_ids(with_ids)
        except ClientError as exc:
            if generated:
                exc.job_ids = [
                    s["id"] if isinstance(s, dict) and isinstance(s.get("id"), str) else None
                    for s in with_ids
                ]
            raise

    async def _create_many_with_ids(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if any(replaces(s) for s in specs):
            return await self._create_many_replacing(specs)
        sent_on: list[int] = []
        result = await self.request("job.create_many", {"specs": specs}, sent_on=sent_on)
        results = list(result["results"])
        if len(sent_on) < 2:
            return results
        # The batch was written to a connection that broke before its reply, then sent again
        # with the same ids: an ``exists`` may be this very batch's earlier attempt, as in
        # :meth:`create` (found by the sixth adversarial pass: every spec of a batch that
        # succeeded was reported ``exists``). Asked one by one: this is the rare path.
        # Per id: whether an earlier entry of this batch created its job or met it (was not
        # refused for itself); then this entry met it too, on the first attempt as well, and
        # its ``exists`` is real. (By id, not by object: one spec object may stand twice.)
        met_earlier: dict[str, bool] = {}
        for i, (spec, entry) in enumerate(zip(specs, results, strict=True)):
            job_id = spec.get("id") if isinstance(spec, dict) else None
            if not isinstance(job_id, str):
                continue
            met = met_earlier.get(job_id, False)
            met_earlier[job_id] = met or bool(entry.get("ok")) or _is_exists(entry)
            if met or not _is_exists(entry):
                continue
            try:
                job = await created_as_sent(self, spec)
            except ClientError:
                continue
            if job is not None:
                results[i] = {"ok": True, "result": job}
        return results

    async def _create_many_replacing(self, specs: list[Any]) -> list[dict[str, Any]]:
        """:meth:`create_many` of a batch with a replacing spec: sent once. The versions of
        the jobs it replaces are read first (in parallel, with a timeout of their own); after
        a broken connection, a replace its job holds with a grown version is settled as
        created, as is the first plain create of an id whose job holds its spec; a replace
        whose job changed into something else, cannot be read back, or whose id stands twice
        in the batch, gets a ``connection_lost`` entry (whether it was applied is unknown);
        the rest are sent again, until the timeout."""
        ids: list[str | None] = [
            s["id"] if isinstance(s, dict) and isinstance(s.get("id"), str) else None for s in specs
        ]
        counts = Counter(i for i in ids if i is not None)
        replaced = [i for s, i in zip(specs, ids, strict=True) if i is not None and replaces(s)]
        twice = {i for i in replaced if counts[i] > 1}
        before = await job_versions(self, [i for i in replaced if i not in twice])
        deadline = trio.current_time() + self.timeout_s
        results: list[dict[str, Any] | None] = [None] * len(specs)
        todo = list(range(len(specs)))
        while todo:
            try:
                reply = await self.request(
                    "job.create_many",
                    {"specs": [specs[i] for i in todo]},
                    timeout_s=max(deadline - trio.current_time(), 0.001),
                    retry=False,
                )
            except ConnectionLost as exc:
                if not self.reconnect or self._closed:
                    raise
                lost = str(exc)
            else:
                for i, entry in zip(todo, reply["results"], strict=True):
                    results[i] = entry
                break
            left: list[int] = []
            read: set[str] = set()  # ids whose plain create was read back (the first only)
            for i in todo:
                spec, job_id = specs[i], ids[i]
                remaining = deadline - trio.current_time()
                if remaining <= 0:
                    raise RequestTimeout(f"job.create_many: no reply within {self.timeout_s} s")
                held: dict[str, Any] | None = None
                if job_id in twice:
                    results[i] = _unknown(f"{lost}; {job_id!r} is replaced twice in the batch")
                    continue
                if job_id is not None and replaces(spec):
                    try:
                        held = await replace_applied(
                            self, spec, before[job_id], timeout_s=remaining
                        )
                    except ClientError as exc:
                        results[i] = _unknown(f"{lost}; {exc}")
                        continue
                elif job_id is not None and job_id not in read:
                    read.add(job_id)
                    with contextlib.suppress(ClientError):  # unknown: sent again (a create)
                        held = await created_as_sent(self, spec)
                if held is not None:
                    results[i] = {"ok": True, "result": held}
                else:
                    left.append(i)
            todo = left
        done = [r for r in results if r is not None]
        assert len(done) == len(results)
        return done

    async def update(
        self, job_id: str, changes: dict[str, Any], *, if_version: int | None = None
    ) -> dict[str, Any]:
        """Merge ``changes`` into the job (a new version). Concurrent updates of one job each
        count (the node merges into the current version). With ``if_version``, only if that
        is the job's current version: else :class:`RemoteError` ``conflict``, nothing
        changed (read the job again and redo the change).

        A request sent again after its connection broke (``reconnect``) may meet its own
        earlier attempt: with ``if_version``, a ``conflict`` then is checked, and when the job
        is at ``if_version + 1`` holding the changes the result is that job (the change
        was made, once). Without it, the job is read back first: if it holds the changes
        already, that is the result (no second version); else the change is sent again with
        ``if_version`` of what was read, and read again on a ``conflict``. (Before, the
        merge was applied twice: one more version, owed times skipped as ``updated`` again,
        an ``every`` without ``start`` restarted; the sixth adversarial pass.) Only an
        earlier attempt still on its way to the node while the job is read back can still
        land after the retry. A change that restarts an ``every`` schedule (no ``start``) is
        never taken as made from the read-back, whose spec cannot show when it restarted: it
        is sent again, and restarts the schedule once more if the earlier attempt had landed
        (rather than reported made when it never was; found by the review of that pass)."""
        if if_version is None:
            return await self._update_merging(job_id, changes)
        args = {"id": job_id, "changes": changes, "if_version": if_version}
        sent_on: list[int] = []
        try:
            result: dict[str, Any] = await self.request("job.update", args, sent_on=sent_on)
        except RemoteError as exc:
            if exc.code != "conflict" or len(sent_on) < 2:
                raise
            # Sent again after a broken connection: the earlier attempt may be what moved the
            # job past ``if_version`` (found by the sixth adversarial pass: ``conflict``,
            # "nothing changed", for an update that was applied). It was if the job is at the
            # very next version and holds the changes.
            try:
                job = await self.get(job_id)
            except ClientError:
                raise exc from None
            stored = job.pop("spec", None)
            if job.get("version") != if_version + 1 or not isinstance(stored, dict):
                raise
            if not _holds(stored, changes, restart_held=True):
                raise
            return job
        return result

    async def _update_merging(self, job_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """:meth:`update` without ``if_version``: sent once; after a broken connection (its
        earlier attempt may have been applied), read back and sent with ``if_version``."""
        args: dict[str, Any] = {"id": job_id, "changes": changes}
        deadline = trio.current_time() + self.timeout_s
        try:
            result: dict[str, Any] = await self.request("job.update", args, retry=False)
            return result
        except ConnectionLost:
            if not self.reconnect or self._closed:
                raise
        while True:
            left = deadline - trio.current_time()
            if left <= 0:
                raise RequestTimeout(f"job.update: no reply within {self.timeout_s} s")
            job = await self.request("job.get", {"id": job_id}, timeout_s=left)
            stored = job.pop("spec", None)
            if isinstance(stored, dict) and _holds(stored, changes, restart_held=False):
                return dict(job)  # the earlier attempt made the change (or nothing was to do)
            try:
                again: dict[str, Any] = await self.request(
                    "job.update",
                    {**args, "if_version": job["version"]},
                    timeout_s=max(deadline - trio.current_time(), 0.001),
                    retry=False,
                )
                return again
            except ConnectionLost:
                if not self.reconnect or self._closed:
                    raise
            except RemoteError as exc:
                if exc.code != "conflict":
                    raise
            # changed meanwhile (the earlier attempt landing late, or someone else): look again

    async def cancel(self, job_id: str, *, stop_running: bool = False) -> dict[str, Any]:
        """Cancel the job (``stop_running``: its runs held by workers too).

        ``not_found`` when no such job exists, or it was cancelled already; with one
        exception: when this very request was sent again on a new connection (an earlier
        attempt was written to a connection that broke before its reply) and the id names a
        job that was cancelled, the earlier attempt may have been the cancel, and the result
        is ``{"job_id", "cancelled": True}``: the job is cancelled, as asked (found by the
        sixth adversarial pass: the retry answered ``not_found`` for the job it cancelled).
        """
        sent_on: list[int] = []
        try:
            result: dict[str, Any] = await self.request(
                "job.cancel", {"id": job_id, "stop_running": stop_running}, sent_on=sent_on
            )
        except RemoteError as exc:
            if exc.code != "not_found" or len(sent_on) < 2:
                raise
            try:
                # A cancelled job keeps its history; an id that never was a job has none.
                await self.request("run.history", {"job_id": job_id, "last": 1})
            except ClientError:
                raise exc from None
            return {"job_id": job_id, "cancelled": True}
        return result

    async def pause(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("job.pause", {"id": job_id})
        return result

    async def resume(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("job.resume", {"id": job_id})
        return result

    async def get(self, job_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("job.get", {"id": job_id}, timeout_s=timeout_s)
        return result

    async def list_jobs(self, *, page: int = 100) -> AsyncIterator[dict[str, Any]]:
        """Every job, page by page."""
        args: dict[str, Any] = {"limit": page}
        while True:
            result = await self.request("job.list", args)
            for job in result["jobs"]:
                yield job
            if not result["next"]:
                return
            args = {"limit": page, "after": result["next"]}

    async def preview(
        self,
        *,
        job_id: str | None = None,
        schedule: dict[str, Any] | None = None,
        count: int = 5,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"count": count}
        if job_id is not None:
            args["id"] = job_id
        if schedule is not None:
            args["schedule"] = schedule
        result: dict[str, Any] = await self.request("job.preview", args)
        return result

    # ------------------------------------------------------------------ runs

    async def run(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("run.get", {"run_id": run_id})
        return result

    async def history(self, job_id: str, *, last: int = 20) -> list[dict[str, Any]]:
        result = await self.request("run.history", {"job_id": job_id, "last": last})
        return list(result["runs"])

    async def skips(self, job_id: str, *, last: int = 20) -> list[dict[str, Any]]:
        """The fire times ``job_id`` owed and did not run, newest first, with their reason
        (``run.skips``)."""
        result = await self.request("run.skips", {"job_id": job_id, "last": last})
        return list(result["skips"])

    async def logs(self, run_id: str, *, offset: int = 0, limit: int = 256) -> dict[str, Any]:
        """One page of a run's output: ``chunks``, ``cursor`` (the next page's offset),
        ``at_end``, and the run's ``state``."""
        result: dict[str, Any] = await self.request(
            "run.logs", {"run_id": run_id, "offset": offset, "limit": limit}
        )
        return result

    async def follow_logs(
        self, run_id: str, *, poll_s: float = 0.2
    ) -> AsyncIterator[dict[str, Any]]:
        """Every chunk of a run's output as it arrives, until the run is final and all its
        output has been read (:meth:`follow_pages`, chunk by chunk)."""
        async for page in self.follow_pages(run_id, poll_s=poll_s):
            for chunk in page["chunks"]:
                yield chunk

    async def follow_pages(
        self, run_id: str, *, offset: int = 0, poll_s: float = 0.2
    ) -> AsyncIterator[dict[str, Any]]:
        """Every page of a run's output from ``offset`` (a page's ``cursor``; 0: the start)
        as it arrives, until the run is final and all its output has been read. Each page is
        a ``run.logs`` result; a page's ``cursor`` is where the next one starts, so a follower
        whose connection broke resumes exactly with ``follow_pages(run_id,
        offset=last_page["cursor"])`` on a new connection: no chunk twice, none skipped (a
        page is one request: it was either received whole or not at all).

        A run final as TIMED_OUT under ``on_timeout=mark`` whose task still runs is followed
        until its task ends (the page's ``marked_running``; a node before that field, or one
        restarted meanwhile, does not know: then it ends at the timeout, as before); so is a
        run made final by a stop (cancelled with ``stop_running``, ``cancel_previous``) while
        its task stops, through its grace (the page's ``stopping``: until the worker reports
        the task's end, at most the node's reattach grace; a node restarted meanwhile does
        not know). Raises :class:`RemoteError` ``not_found`` for a run that does
        not exist (or stops existing: retention), whatever the node's version: a page with no
        state (a node before ``run.logs`` refused such runs itself) is checked with
        ``run.get``, so that a follower never waits for a run that will never end. Raises
        :class:`ConnectionLost` when the connection breaks (``reconnect`` off)."""
        while True:
            page = await self.logs(run_id, offset=offset)
            yield page
            offset = page["cursor"]
            if page["at_end"]:
                state = page["state"]
                if state is None:
                    state = (await self.run(run_id))["state"]  # not_found raises
                if (
                    state in FINAL_VALUES
                    and not page.get("marked_running")
                    and not page.get("stopping")
                ):
                    return
                await trio.sleep(poll_s)
