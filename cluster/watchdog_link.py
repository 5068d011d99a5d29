"""The worker's side of its watchdog (:mod:`cluster.watchdog`): start the guard, tell it each
task's process group, restart it if it dies.

Owns the guard process and the write end of its pipe. The write end is non-inheritable
(``os.pipe`` makes ``O_CLOEXEC`` descriptors, and every task is spawned with ``close_fds``), so
only the worker holds it: when the worker exits, however it exits, the guard reads
end-of-file. The guard runs in a session of its own, so a signal to the worker's process group
(a terminal's Ctrl-C, ``kill -- -PGID``) does not reach it.

Writes are non-blocking and synchronous (one ``write`` of one short line per event, atomic
below ``PIPE_BUF``): the runner tells the guard about a spawn without a checkpoint. When the
pipe is full (a guard slow to read: it reads in batches, and a loaded machine may deschedule
it), lines queue in memory and a flusher task writes them as room appears; a guard that lets
:data:`MAX_BACKLOG` queue is taken for hung: it is SIGKILLed and replaced. A mirror of the guard's :class:`~cluster.watchdog.Watch`
is kept here, so a new guard (after one died, was killed, or hung) is told every task still
running before anything else; until it runs, the tasks are unguarded (logged as an error).

Must never signal anything but its own guard process, and never block the event loop.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import trio

from cluster.watchdog import (
    Announce,
    Done,
    Fence,
    Spawned,
    Watch,
    format_done,
    format_fence,
    format_spawned,
)
from cluster.watchdog import format_announce as _format_announce

__all__ = ["GUARD_ARGV", "WatchdogLink"]

log = logging.getLogger("tickwheel.worker")

#: The guard's command line: isolated (-I: no user site, no environment-variable paths) and
#: without ``site`` (-S): it needs the standard library only, and starts in milliseconds.
GUARD_ARGV: Final = (sys.executable, "-I", "-S", str(Path(__file__).with_name("watchdog.py")))
#: Bounds on restarting a guard that keeps dying: first delay, the largest, and how long a
#: guard must have lived for the next restart to be immediate again.
RESTART_DELAY_S: Final = 0.5
RESTART_DELAY_MAX_S: Final = 30.0
HEALTHY_S: Final = 10.0
#: Lines queued for a guard that is slow to read (its pipe full) before it is taken for hung
#: and replaced: about 7,000 tasks' worth.
MAX_BACKLOG: Final = 1 << 20
#: How long a clean close waits for the guard to exit before SIGKILLing it.
CLOSE_WAIT_S: Final = 5.0
#: How long a task's spawn waits for a guard that is behind (its pipe full) to have read the
#: task's announcement; past it the guard is taken for hung and replaced (the replay to the
#: next one holds the announcement), and the task spawns.
CATCH_UP_S: Final = 5.0


class WatchdogLink:
    """One worker's guard. :meth:`supervise` runs it (start it in the worker's nursery with
    ``nursery.start``); :meth:`announce`, :meth:`spawned` and :meth:`done` are called by the
    runner around each spawn (from the Trio thread, never blocking); :meth:`aclose` ends it
    cleanly once the worker's tasks are reaped.

    :meth:`fence` moves the deadline at which the guard kills the tasks of a worker that did
    not fence itself.

    ``guard_argv`` is the guard's command line (tests may swap it). ``pid`` is the running
    guard's process id (None while there is none); ``starts`` counts the guards started."""

    def __init__(self, guard_argv: tuple[str, ...] = GUARD_ARGV) -> None:
        self.guard_argv = guard_argv
        self.mirror = Watch()
        self.pid: int | None = None
        self.starts = 0
        self._next_key = 0
        self._fd: int | None = None  # the pipe's write end, while a guard runs
        self._backlog: bytearray | None = None  # lines waiting for room in the pipe
        self._proc: trio.Process | None = None
        self._closed = False
        self._replaced = trio.Event()  # set: the guard was killed as hung (supervise restarts)
        self._flush_wake = trio.Event()  # set: there is a backlog to write (_flush)
        self._caught_up = trio.Event()  # set (and replaced) whenever the backlog is written

    # ------------------------------------------------------------------ the runner's calls

    def announce(self, marker: tuple[bytes, ...], container: tuple[str, str, str] | None) -> int:
        """A task is about to be spawned (its environment holds ``marker``): returns its key.
        The line is in the pipe before the fork, so a worker that dies during the spawn still
        leaves the guard able to find the task."""
        key = self._next_key
        self._next_key += 1
        message = Announce(key, marker, container)
        self.mirror.apply(message)
        self._send(_format_announce(key, marker, container))
        return key

    async def announced(self) -> None:
        """Return once every line sent so far is in the pipe (at once, but for a guard behind:
        its pipe full, the lines in this process's backlog). A task is spawned only then: a
        worker that dies with the announcement still in its backlog left the task unknown to
        a guard that was alive, only slow (found by review). A guard that has not caught up
        within :data:`CATCH_UP_S` is replaced as hung; the replay to the next one holds the
        announcement."""
        if self._backlog is None or self._fd is None:
            return
        with trio.move_on_after(CATCH_UP_S):
            while self._backlog is not None and self._fd is not None:
                await self._caught_up.wait()
            return
        self._replace(f"did not read for {CATCH_UP_S:g} s")

    def spawned(self, key: int, pgid: int) -> None:
        """Task ``key`` runs as the leader of group ``pgid``."""
        self.mirror.apply(Spawned(key, pgid))
        self._send(format_spawned(key, pgid))

    def done(self, key: int) -> None:
        """Task ``key``'s group is over (its leader reaped, nothing left in it), or it never
        spawned. Idempotent."""
        if key in self.mirror.tasks:
            self.mirror.apply(Done(key))
            self._send(format_done(key))

    def fence(self, deadline_ms: int) -> None:
        """The guard kills every task still registered at ``deadline_ms`` (``CLOCK_MONOTONIC``
        ms) unless told a later deadline first: the worker's fence, kept by a process that
        runs when the worker cannot (:func:`engine.lease.guard_fence_at`)."""
        if deadline_ms != self.mirror.fence_at:
            self.mirror.apply(Fence(deadline_ms))
            self._send(format_fence(deadline_ms))

    # ------------------------------------------------------------------ the guard's life

    async def supervise(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the guard; start a new one whenever it exits (logged as an error: the tasks are
        unguarded until it runs), with a backoff when it keeps dying. Reports started after
        the first attempt, failed or not (a worker serves without a guard rather than not at
        all). Cancelling this leaves the running guard alone: :meth:`aclose` ends it."""
        delay = RESTART_DELAY_S
        first = True
        while not self._closed:
            began = trio.current_time()
            try:
                await self._start()
            except OSError as exc:
                log.error("watchdog: cannot start the guard (%s): tasks are unguarded", exc)
            if first:
                first = False
                task_status.started()
            proc = self._proc
            if proc is not None:
                self._replaced = trio.Event()
                async with trio.open_nursery() as race:

                    async def on_exit(proc: trio.Process = proc) -> None:
                        await proc.wait()
                        race.cancel_scope.cancel()

                    async def on_replace(replaced: trio.Event = self._replaced) -> None:
                        await replaced.wait()
                        race.cancel_scope.cancel()

                    race.start_soon(on_exit)
                    race.start_soon(on_replace)
                    race.start_soon(self._flush)
                if self._closed:
                    return
                if proc.returncode is None:  # killed as hung: reap it before the next
                    with trio.move_on_after(CLOSE_WAIT_S):
                        await proc.wait()
                self._drop(proc)
                log.error(
                    "watchdog: the guard (pid %d) exited (status %s): starting another; "
                    "tasks are unguarded until it runs",
                    proc.pid,
                    proc.returncode,
                )
            if trio.current_time() - began >= HEALTHY_S:
                delay = RESTART_DELAY_S
            else:
                await trio.sleep(delay)
                delay = min(delay * 2, RESTART_DELAY_MAX_S)

    async def _start(self) -> None:
        """Spawn a guard on a fresh pipe and replay the mirror to it (before any new line: the
        replay is written first, waiting for room if the pipe is full)."""
        read_end, write_end = os.pipe()  # both O_CLOEXEC: no task inherits either
        try:
            proc = await trio.lowlevel.open_process(
                list(self.guard_argv),
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of signals to the worker's group
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._proc, self.pid = proc, proc.pid
        self.starts += 1
        log.info("watchdog: guard pid %d watches this worker's tasks", proc.pid)
        # The replay first, then whatever the runner sends meanwhile, in order: written by
        # the flusher (supervise), which waits for room only if the pipe is full.
        self._backlog = bytearray(b"".join(self.mirror.lines())) or None
        self._fd = write_end

    async def _flush(self) -> None:
        """Write the backlog whenever there is one (a replay, or lines the pipe had no room
        for), waiting for room in the pipe; then lines go straight to the pipe again."""
        while True:
            backlog, fd = self._backlog, self._fd
            if backlog is None or fd is None:
                self._flush_wake = trio.Event()
                await self._flush_wake.wait()
                continue
            try:
                del backlog[: os.write(fd, backlog)]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            except OSError:
                self._close_fd()  # the guard is gone: supervise sees it exit
            if not backlog and self._backlog is backlog:
                self._backlog = None
            if self._backlog is None:
                self._caught_up.set()
                self._caught_up = trio.Event()

    def _send(self, line: bytes) -> None:
        fd = self._fd
        if fd is None:
            return  # no guard now: the mirror has it for the next one
        backlog = self._backlog
        if backlog is not None:  # behind a replay, or the pipe was full: in order
            backlog += line
            if len(backlog) > MAX_BACKLOG:
                self._replace("stopped reading")
            return
        try:
            written = os.write(fd, line)
        except BlockingIOError:
            written = 0
        except OSError:
            self._close_fd()  # it died: supervise starts another and replays
            return
        if written < len(line):
            # The rest waits for room, before any later line. (A line longer than PIPE_BUF, a
            # container task's with its runtime environment, is written in part when the
            # pipe is nearly full: the rest was dropped, and the guard read one malformed
            # line in place of two, the task's announcement lost: found by review.)
            self._backlog = bytearray(line[written:])
            self._flush_wake.set()

    def _replace(self, why: str) -> None:
        log.error("watchdog: the guard (pid %s) %s: replacing it", self.pid, why)
        if self._proc is not None:
            self._proc.kill()  # our own child, by its pid
        self._close_fd()
        self._replaced.set()

    def _close_fd(self) -> None:
        self._backlog = None
        self._caught_up.set()  # (nothing to wait for: announced() returns)
        self._caught_up = trio.Event()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _drop(self, proc: trio.Process) -> None:
        if self._proc is proc:
            self._close_fd()
            self._proc, self.pid = None, None

    async def aclose(self) -> None:
        """End the guard cleanly: close the pipe (the guard kills whatever is still registered,
        normally nothing, and exits) and reap it, SIGKILLing it after :data:`CLOSE_WAIT_S`.
        Shielded from cancellation; idempotent."""
        self._closed = True
        self._replaced.set()
        proc = self._proc
        self._close_fd()
        if proc is None:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLOSE_WAIT_S):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        self._proc, self.pid = None, None
