"""Reads and writes on a connected Trio socket with one system call each, and a wait only when
the socket is not ready.

Owns the byte moving of the node's and the client's connections: their outboxes
(:class:`Outbox`: the frames queued for one connection and the writer that sends them), and
the read poller where their readers wait for bytes (:class:`ReadPoller`, :func:`read_ready`:
one wait of Trio's loop for every waiting connection, not one each). ``SocketStream.receive_some``
and ``send_all`` put two schedule points around every call (a pass of Trio's run loop each),
which measured here as about half of a request's round trip on loopback (two processes
ping-ponging 20 bytes: ~210 us a round trip through the streams, ~115 us with this). The stream
stays the owner of the socket: it is opened and closed as before, and closing it (from any task)
wakes a wait here with :class:`trio.ClosedResourceError`, as it would a stream call (a reader
parked in a read poller waits there instead, and is handed back before its socket is
closed). Must never be used by two tasks for the same direction at once (a connection has one
reader and one writer), and never holds bytes of its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
from dataclasses import dataclass
from typing import Final, Protocol

import trio

#: Bytes asked of one read: below glibc's mmap threshold (a read allocates its buffer, and a
#: fresh mapping per read costs more than a second read when more is waiting).
READ_BYTES: Final = 64 * 1024
#: Reads that find data at once, in a row, before one yields anyway: a peer that keeps the
#: socket full must not keep the other tasks from running.
READS_BEFORE_YIELD: Final = 16

#: Errors that mean the socket itself is gone (closed here); any other OSError means the
#: connection broke (reset, unreachable, aborted, timed out): the rule of Trio's own streams.
_CLOSED: Final = frozenset({errno.EBADF, errno.ENOTSOCK})


class RawSocketIO:
    """``receive_some`` and ``send_all`` of ``stream`` without its schedule points.

    Guarantees: bytes come and go in order, as the stream's would; a closed stream raises
    :class:`trio.ClosedResourceError`; a peer that reset or went away, and every other error
    of the socket, raises :class:`trio.BrokenResourceError`; a wait is a checkpoint (cancellable) as the stream's
    calls are. Unlike the stream's, a call that finds the socket ready does not yield (but one
    in :data:`READS_BEFORE_YIELD` reads does).
    """

    __slots__ = ("_drained", "_ready_reads", "_sock")

    def __init__(self, stream: trio.SocketStream) -> None:
        self._sock = stream.socket
        self._ready_reads = 0
        # The last read took less than it asked for: the socket held no more at that moment.
        # The next read then waits for readiness first instead of trying a read that would
        # most likely fail with EAGAIN (a lone request's connection: every read but none).
        self._drained = False

    def fileno(self) -> int:
        """The socket's descriptor now; :class:`trio.ClosedResourceError` once it is closed.
        Ask each time, never keep it: once the stream closes its socket the number may be
        given to another connection."""
        fd = self._sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection is closed")
        return fd

    async def receive_some(self) -> bytes:
        """Some bytes (up to :data:`READ_BYTES`); ``b""`` once the peer closed its side.

        After a read that found less than it asked for, the next call waits for readiness
        before it reads (epoll is level-triggered: bytes that came meanwhile wake it at once,
        one pass of Trio's loop later): a connection carrying one request at a time then
        costs one read per request instead of two (the second failing with EAGAIN, its
        exception and its release of the GIL to the group committer's thread included)."""
        if self._drained:
            self._drained = False
            self._ready_reads = 0
            self.fileno()  # a stream closed meanwhile raises here, as a read of it would
            await trio.lowlevel.wait_readable(self._sock)
        else:
            self._ready_reads += 1
            if self._ready_reads >= READS_BEFORE_YIELD:
                self._ready_reads = 0
                await trio.lowlevel.checkpoint()
        while True:
            try:
                data = os.read(self.fileno(), READ_BYTES)
            except BlockingIOError:
                self._ready_reads = 0
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except OSError as exc:
                raise translate_socket_error(exc) from exc
            if len(data) < READ_BYTES:
                self._drained = True
            return data

    def try_send(self, data: bytes) -> int:
        """Write what fits of ``data`` now, never waiting: the bytes written (0 when the
        socket has no room). Raises as :meth:`send_all` does."""
        try:
            return os.write(self.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise translate_socket_error(exc) from exc

    async def send_all(self, data: bytes) -> None:
        """Write all of ``data``, waiting for room as needed."""
        view = memoryview(data)
        while view:
            try:
                sent = os.write(self.fileno(), view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)
                continue
            except OSError as exc:
                raise translate_socket_error(exc) from exc
            view = view[sent:]


#: Most ready sockets one pass of a :class:`ReadPoller` takes (the rest: its next pass).
POLL_EVENTS: Final = 256


class ParkedReader(Protocol):
    """A connection's reading side while its task waits in a :class:`ReadPoller`."""

    def read_parked(self, fd: int) -> None:
        """Read ``fd`` (ready) once and work through what came, never waiting; hand the
        task back (:meth:`ReadPoller.hand_back`) for anything that needs it."""


#: What a parked reader's read found when its peer closed its side: an outcome to hand back.
END_OF_STREAM: Final = object()


@dataclass(frozen=True)
class SocketFailed:
    """What a parked reader's read met: its socket's error (a reset, ...), an outcome to hand
    back for the task to raise as the stream error it stands for
    (:func:`translate_socket_error`); a bug's exception is handed back bare instead."""

    error: OSError


class _Waiter:
    __slots__ = ("event", "outcome", "reader")

    def __init__(self, reader: ParkedReader) -> None:
        self.reader = reader
        self.event = trio.Event()
        self.outcome: object = None


class ReadPoller:
    """One task that reads every connection whose reader task waits for its next bytes.

    A reader task parks here (:meth:`wait`) between reads; its socket joins this poller's own
    epoll set (level-triggered: bytes that came before it joined wake it at once). Trio's
    loop waits on that set's descriptor: one wait, and one re-arming of it, a pass of the loop
    for all of them, instead of a wait, a re-arming (``epoll_ctl``: Trio's epoll is
    one-shot) and a task's wake-up a read. The poller reads each ready socket once
    (:meth:`ParkedReader.read_parked`), all in one ``batch`` when one is given (the node's:
    what the reads wake is worked through at its end); a reader goes back to its task only
    through :meth:`hand_back`, with an outcome of its choosing.

    Guarantees: a parked socket is read by the poller alone, in order, until it is handed
    back; a waiting task leaves the set however its wait ends (cancelled included); a
    reader's exception (any) is handed back to its task, never raised out of a pass. Not
    thread-safe. The owner of a socket closes it only once its reader is handed back (or
    hands it back first, :meth:`hand_back`): a closed descriptor leaves the set without a
    word, and its task would wait on.
    """

    def __init__(self, batch: contextlib.AbstractContextManager[object] | None = None) -> None:
        self.epoll = select.epoll()
        self.batch: contextlib.AbstractContextManager[object] = batch or contextlib.nullcontext()
        self.parked: dict[int, _Waiter] = {}
        self.closed = False  # run() ended: wait() hands back at once
        self.reads = 0  # reads of parked sockets
        self.handed_back = 0  # waits ended by hand_back

    async def wait(self, reader: ParkedReader, fd: int) -> object:
        """Park ``reader`` (its socket ``fd``) until it is handed back; the outcome given
        then (None, at once, once the poller is closed: the task reads itself). Cancellable;
        never leaves ``fd`` in the set."""
        if self.closed:
            return None
        if fd in self.parked:
            # A socket closed while its reader was parked, its number now another's (the
            # owner broke the rule above): that reader ends, rather than wait forever.
            self.hand_back(fd, END_OF_STREAM)
        waiter = _Waiter(reader)
        self.epoll.register(fd, select.EPOLLIN)
        self.parked[fd] = waiter
        try:
            await waiter.event.wait()
        finally:
            if self.parked.get(fd) is waiter:  # (not handed back: cancelled)
                self._drop(fd)
        return waiter.outcome

    def hand_back(self, fd: int, outcome: object) -> None:
        """End the wait of the reader parked on ``fd`` with ``outcome`` (nothing if none is)."""
        waiter = self.parked.get(fd)
        if waiter is not None:
            self._drop(fd)
            self.handed_back += 1
            waiter.outcome = outcome
            waiter.event.set()

    def _drop(self, fd: int) -> None:
        del self.parked[fd]
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):  # (closed meanwhile: it has left the set by itself)
            pass

    def _pass(self) -> None:
        """Read every ready socket once. (Its own function: a local of the waiting coroutine
        would keep the last reader read, closed or not, alive until the next pass.)"""
        parked = self.parked
        with self.batch:
            for fd, _mask in self.epoll.poll(0, POLL_EVENTS):
                waiter = parked.get(fd)
                if waiter is None:
                    continue
                self.reads += 1
                try:
                    waiter.reader.read_parked(fd)
                except BaseException as exc:  # its task raises it; the others go on
                    # (BaseException: a callback's SystemExit or KeyboardInterrupt too, as if
                    # its own task had read; out of a system task it would crash the run.
                    # Synchronous code cannot be cancelled: nothing of Trio's is caught.)
                    self.hand_back(fd, exc)

    async def run(self) -> None:
        """Serve the parked readers until cancelled; then hand every one back (None) and
        close the set."""
        try:
            while True:
                await trio.lowlevel.wait_readable(self.epoll.fileno())
                self._pass()
        finally:
            self.closed = True
            for fd in list(self.parked):
                self.hand_back(fd, None)
            self.epoll.close()


def read_ready(poller: ReadPoller, fd: int) -> bytes | None:
    """One read of the ready socket ``fd`` of a reader parked in ``poller``: its bytes, or
    None when there is nothing to work through: nothing there after all, or its end of
    stream or its error, handed back to its task (:data:`END_OF_STREAM`,
    :class:`SocketFailed`)."""
    try:
        data = os.read(fd, READ_BYTES)
    except BlockingIOError:
        return None
    except OSError as exc:
        poller.hand_back(fd, SocketFailed(exc))
        return None
    if not data:
        poller.hand_back(fd, END_OF_STREAM)
        return None
    return data


def translate_socket_error(exc: OSError) -> Exception:
    """The stream error an :class:`OSError` of a socket call stands for (Trio's own rule)."""
    if exc.errno in _CLOSED:
        return trio.ClosedResourceError("the connection is closed")
    return trio.BrokenResourceError(f"the connection broke: {exc}")


#: Most bytes one write joins from queued frames (a larger frame goes out alone, unjoined): the
#: writer's copy of what it sends stays this small however much is queued.
WRITE_PIECE: Final = 1024 * 1024


class Outbox:
    """The frames waiting to go out on one connection, for its writer task (:meth:`run`).

    What was queued while a write was in flight leaves in few writes, of at most
    :data:`WRITE_PIECE` bytes joined each (a larger frame alone): many replies or requests
    cost few system calls, nobody waits for a lock, and the join copies a bounded amount.
    :meth:`write_now` writes what is queued at once instead, when the writer is idle (a pass
    of Trio's loop sooner).

    Byte accounting: :attr:`queued` is the bytes queued and not yet written, counted by
    :meth:`put` (or by a caller that appends to :attr:`frames` itself and adds to
    :attr:`queued`, the node's hot path). A caller that appends without counting, or takes a
    frame back, only makes the count approximate (never negative; exact again once the
    outbox empties). :meth:`wait_room` waits until it is at most ``high_water``.
    Not thread-safe: the connection's Trio thread only.
    """

    __slots__ = ("frames", "high_water", "io", "queued", "ready", "room")

    def __init__(self, io: RawSocketIO, high_water: int = 4 * WRITE_PIECE) -> None:
        self.io = io
        self.frames: list[bytes] = []
        self.queued = 0  # bytes in frames (and in the piece being written)
        self.high_water = high_water
        self.ready: trio.Event | None = None  # set while the writer waits for frames
        self.room: trio.Event | None = None  # set once queued falls to high_water

    @property
    def idle(self) -> bool:
        """The writer waits for frames (it is not in a write)."""
        return self.ready is not None

    def wake(self) -> None:
        """Let an idle writer take what is queued."""
        ready = self.ready
        if ready is not None:
            self.ready = None
            ready.set()

    def put(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.queued += len(frame)
        self.wake()

    async def wait_room(self) -> None:
        """Wait until at most ``high_water`` bytes are queued (at once if so already; a
        checkpoint only when it waits). Cancellable."""
        while self.queued > self.high_water:
            room = self.room
            if room is None:
                room = self.room = trio.Event()
            await room.wait()

    def _take(self) -> bytes:
        """The next piece to write, taken off the queue: the first frame alone if it is
        :data:`WRITE_PIECE` or more, else the frames that fit in one joined piece."""
        frames = self.frames
        if len(frames) == 1:
            self.frames = []
            return frames[0]
        if self.queued <= WRITE_PIECE:  # all of it fits (the usual case): no sizes summed
            self.frames = []
            return b"".join(frames)
        size = 0
        count = 0
        for frame in frames:
            size += len(frame)
            if size > WRITE_PIECE and count:
                break
            count += 1
        if count == len(frames):
            self.frames = []
            return b"".join(frames)
        if count == 1:
            return frames.pop(0)
        data = b"".join(frames[:count])
        del frames[:count]
        return data

    def _written(self, sent: int) -> None:
        """``sent`` bytes left: count them, and wake whoever waits for room."""
        self.queued = self.queued - sent if self.frames and self.queued > sent else 0
        room = self.room
        if room is not None and self.queued <= self.high_water:
            self.room = None
            room.set()

    def write_now(self) -> None:
        """If the writer is idle, write what is queued with one system call (one piece); what
        does not fit, and any failure, goes to the writer (which meets the same error and
        ends)."""
        if self.ready is None or not self.frames:
            return  # the writer is in a write, or woken already: it takes the queue
        data = self._take()
        try:
            sent = self.io.try_send(data)
        except Exception:
            sent = 0
        if sent < len(data):
            self.frames.insert(0, data[sent:] if sent else data)
        if sent:
            self._written(sent)
        if self.frames:
            self.wake()

    async def run(self) -> None:
        """The writer: sends what is queued until the connection fails (raising
        :class:`trio.BrokenResourceError` or :class:`trio.ClosedResourceError`)."""
        while True:
            if not self.frames:
                ready = self.ready = trio.Event()
                await ready.wait()
            data = self._take()
            await self.io.send_all(data)
            self._written(len(data))
