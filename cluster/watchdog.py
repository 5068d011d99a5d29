"""The worker's watchdog: a small guard process that kills the worker's tasks once the worker is gone.

Each task runs in a session and process group of its own (so that the stop sequence reaches
all of it), which also means it is not killed with the worker: a SIGKILLed worker would leave
its tasks running as orphans, beside the attempt the node hands out again (at-least-once) or
behind a run the node calls LOST (at-most-once). ``PR_SET_PDEATHSIG`` cannot help: Linux sends
it when the *thread* that forked the task ends, and Trio forks from a thread cache whose
threads end when idle.

So each worker starts one guard (this module, run as a script by :mod:`cluster.watchdog_link`)
whose stdin is a pipe whose write end only the worker holds (non-inheritable, and tasks are
spawned with ``close_fds``). The worker writes one line per event:

- ``A <key> <marker hex> [<runtime hex> <container hex> [<env hex>]]``: a task is about to be
  spawned.
  ``marker`` is NUL-separated ``NAME=value`` entries of the task's environment that identify
  it (its ``TICKWHEEL_RUN_ID`` and ``TICKWHEEL_FENCE``: unique per attempt); a container task
  names its runtime and container, and the NUL-separated ``NAME=value`` entries of the task's
  environment its runtime client reads (``DOCKER_HOST`` and the like), which its ``rm -f``
  needs to reach the same daemon.
- ``S <key> <pgid>``: it was spawned, leader of process group ``pgid``.
- ``D <key>``: its group is over (leader reaped, group empty), or its spawn failed.
- ``F <ms>``: the fence deadline, on ``CLOCK_MONOTONIC`` in milliseconds (the same clock for
  every process of the machine): moved on each heartbeat the node acknowledged
  (:func:`engine.lease.guard_fence_at`, a little after the worker's own fence).

When the pipe reaches end-of-file (the worker exited, however: a clean stop closes it after
its tasks are reaped, a crash or SIGKILL closes it in the kernel), the guard SIGKILLs every
group still registered, hunts the tasks announced but not yet registered (by their marker in
``/proc/PID/environ``), removes their containers (``<runtime> rm -f NAME``, as the runner's kill
path does), and exits. With nothing registered it exits quietly.

When the fence deadline passes with tasks registered, the worker has not fenced itself though
it should have (it is stopped, or its event loop is blocked by synchronous code): the guard
kills them the same way, forgets them and the deadline, and carries on (the worker may run
again; it then finds its tasks gone and fences). Without this, a frozen worker's tasks ran on
past its lease, beside the attempt the node handed out again.

Windows, and what covers them:

- *Spawned, not yet registered* (the worker died between ``A`` and ``S``): the ``A`` line is in
  the pipe before the fork, and the hunt finds the process by its environment, which it has
  from its ``exec`` on. A child still between fork and exec has the worker's environment; the
  hunt is repeated for half a second (:data:`HUNT_ROUNDS_S`), long after such a child execs.
- *pgid reuse* (the worker reaped a group, then died before ``D`` left): the guard records the
  leader's start time (``/proc/PID/stat``) when it hears ``S`` and kills a group only if the
  process with that pid is the same one, or gone (:func:`may_kill`). The kernel does not give a
  pid out again while it is still a live group's id, so a gone leader with a live group is ours.
- *The guard killed*: the worker notices (its child exits) and starts a new one, replaying what
  it holds (:mod:`cluster.watchdog_link`); until then its tasks are unguarded, as before.
- Processes that left their task's group (``setsid``, daemons) are not tracked, as by the
  runner's own stop sequence.

This module must stay standard-library only and must never import the rest of tickwheel: it runs
as ``python -I -S cluster/watchdog.py`` (fast to start, independent of the worker's path). The
decisions (parsing, bookkeeping, what to kill) are the pure functions and :class:`Watch` at the
top; :func:`main` is the thin loop around them. It never signals anything but the groups it
was told about and processes carrying a registered marker.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "COALESCE_S",
    "HUNT_ROUNDS_S",
    "MAX_LINE",
    "Announce",
    "Done",
    "Doom",
    "Fence",
    "MessageError",
    "Spawned",
    "Watch",
    "format_announce",
    "format_done",
    "format_fence",
    "format_spawned",
    "hunt",
    "main",
    "may_kill",
    "parse_line",
    "parse_start_time",
]

#: A line longer than this is malformed (a marker is two short variables).
MAX_LINE: Final = 16 * 1024
#: Delays (from end-of-file) of the rounds of the hunt for announced, unregistered tasks.
HUNT_ROUNDS_S: Final = (0.0, 0.1, 0.5)
#: After each read the guard sleeps this long, so that a busy worker's lines (three per task)
#: come in batches: at most ~50 wake-ups a second, whatever the task rate. Nothing waits on
#: the guard (the pipe buffers), and end-of-file is acted on after at most this delay.
COALESCE_S: Final = 0.02
#: Upper bound on each ``<runtime> rm -f NAME`` after end-of-file.
CONTAINER_RM_S: Final = 10.0


class MessageError(ValueError):
    """A line of the protocol that does not parse (the guard logs and skips it)."""


# --------------------------------------------------------------------------------------------
# Messages


@dataclass(frozen=True, slots=True)
class Announce:
    """A task is about to be spawned: ``marker`` identifies it by its environment entries;
    ``container`` is ``(runtime, name, env)`` for a container task, ``env`` the NUL-joined
    ``NAME=value`` entries its removal runs with on top of the guard's own environment."""

    key: int
    marker: tuple[bytes, ...]
    container: tuple[str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class Spawned:
    """Task ``key`` was spawned as the leader of process group ``pgid``."""

    key: int
    pgid: int


@dataclass(frozen=True, slots=True)
class Done:
    """Task ``key``'s group is over (or its spawn failed): nothing of it to kill."""

    key: int


@dataclass(frozen=True, slots=True)
class Fence:
    """Kill every registered task if the worker has said nothing newer by ``deadline_ms``
    (``CLOCK_MONOTONIC``, milliseconds)."""

    deadline_ms: int


Message = Announce | Spawned | Done | Fence


def format_announce(
    key: int, marker: Iterable[bytes], container: tuple[str, str, str] | None
) -> bytes:
    """The ``A`` line. Raises ValueError for an empty marker or one holding NUL."""
    entries = tuple(marker)
    if not entries or any(not e or b"\0" in e for e in entries):
        raise ValueError("a marker is one or more non-empty entries without NUL")
    line = b"A %d %s" % (key, b"\0".join(entries).hex().encode())
    if container is not None:
        runtime, name, env = container
        line += b" %s %s" % (runtime.encode().hex().encode(), name.encode().hex().encode())
        if env:
            line += b" %s" % env.encode().hex().encode()
    return line + b"\n"


def format_spawned(key: int, pgid: int) -> bytes:
    return b"S %d %d\n" % (key, pgid)


def format_done(key: int) -> bytes:
    return b"D %d\n" % key


def format_fence(deadline_ms: int) -> bytes:
    return b"F %d\n" % deadline_ms


def parse_line(line: bytes) -> Message:
    """One line (without its newline) as a message. Raises :class:`MessageError`."""
    parts = line.split(b" ")
    try:
        kind, key = parts[0], int(parts[1])
        if kind == b"F" and len(parts) == 2:
            return Fence(key)  # (a deadline, not a key: any value of the clock)
        if key < 0:
            raise ValueError(key)
        if kind == b"A" and len(parts) in (3, 5, 6):
            marker = tuple(bytes.fromhex(parts[2].decode("ascii")).split(b"\0"))
            if not all(marker):
                raise ValueError("empty marker entry")
            container = None
            if len(parts) >= 5:
                runtime = bytes.fromhex(parts[3].decode("ascii")).decode()
                name = bytes.fromhex(parts[4].decode("ascii")).decode()
                env = bytes.fromhex(parts[5].decode("ascii")).decode() if len(parts) == 6 else ""
                if not runtime or not name:
                    raise ValueError("empty container")
                container = (runtime, name, env)
            return Announce(key, marker, container)
        if kind == b"S" and len(parts) == 3:
            pgid = int(parts[2])
            if pgid <= 1:
                raise ValueError(pgid)  # 0 and 1 would signal our own group / init
            return Spawned(key, pgid)
        if kind == b"D" and len(parts) == 2:
            return Done(key)
    except (IndexError, ValueError, UnicodeDecodeError) as exc:
        raise MessageError(f"malformed line {line[:80]!r}: {exc}") from None
    raise MessageError(f"malformed line {line[:80]!r}")


# --------------------------------------------------------------------------------------------
# Bookkeeping


@dataclass(frozen=True, slots=True)
class Doom:
    """What to do at end-of-file: SIGKILL ``groups`` (pgid -> the leader's recorded start
    time), hunt the processes carrying one of ``markers``, remove ``containers``."""

    groups: Mapping[int, int | None]
    markers: tuple[tuple[bytes, ...], ...]
    containers: tuple[tuple[str, str, str], ...]

    def __bool__(self) -> bool:
        return bool(self.groups or self.markers or self.containers)


@dataclass
class _Task:
    marker: tuple[bytes, ...]
    container: tuple[str, str, str] | None
    pgid: int | None = None  # None: announced, not registered yet
    start: int | None = None  # the leader's start time, when known


@dataclass
class Watch:
    """The tasks of one worker that the guard would kill: keyed by the worker's task key.

    Every operation is O(1); an operation on an unknown key is a no-op (a ``D`` for a task
    whose ``A`` was lost with a restarted guard, say), and a repeated ``A`` or ``S`` replaces
    what was there (a replay after a restart). The worker keeps a mirror of its guard's Watch
    and replays it (:meth:`lines`) to a new guard."""

    tasks: dict[int, _Task] = field(default_factory=dict)
    #: the newest fence deadline (``F``); None before the first and after it was acted on
    fence_at: int | None = None
    #: containers a fence failed to remove (:meth:`keep_containers`), for end-of-file
    leftover: list[tuple[str, str, str]] = field(default_factory=list)

    def apply(self, message: Message, *, start: int | None = None) -> None:
        """Take one message; ``start`` is the leader's start time read for a ``S``."""
        if isinstance(message, Fence):
            self.fence_at = message.deadline_ms
        elif isinstance(message, Announce):
            self.tasks[message.key] = _Task(message.marker, message.container)
        elif isinstance(message, Spawned):
            task = self.tasks.get(message.key)
            if task is not None:
                task.pgid, task.start = message.pgid, start
        else:
            self.tasks.pop(message.key, None)

    def doom(self) -> Doom:
        """What end-of-file kills: every registered group; the markers of tasks announced but
        not registered (only those are hunted: a registered task is reached by its group);
        every container (a SIGKILLed runtime client leaves its container running)."""
        groups: dict[int, int | None] = {}
        markers: list[tuple[bytes, ...]] = []
        containers: list[tuple[str, str, str]] = []
        for task in self.tasks.values():
            if task.pgid is None:
                markers.append(task.marker)
            else:
                groups[task.pgid] = task.start
            if task.container is not None:
                containers.append(task.container)
        containers.extend(c for c in self.leftover if c not in containers)
        return Doom(groups, tuple(markers), tuple(containers))

    def wait_ms(self, now_ms: int) -> int | None:
        """How long the guard may wait for input before it must act on the fence deadline
        (0: now); None while no deadline applies (none set, or nothing to kill)."""
        if self.fence_at is None or not self.tasks:
            return None
        return max(0, self.fence_at - now_ms)

    def fence_now(self) -> Doom:
        """The deadline passed: what to kill (every task), which is forgotten with it (but
        see :meth:`keep_containers`)."""
        doom = self.doom()
        self.tasks.clear()
        self.fence_at = None
        return doom

    def keep_containers(self, containers: Iterable[tuple[str, str, str]]) -> None:
        """Containers a fence could not remove: removed again at end-of-file (their tasks'
        groups are dead; the worker, whose runs they were, no longer asks)."""
        self.leftover.extend(containers)

    def lines(self) -> list[bytes]:
        """The messages that rebuild this state in a fresh guard (the deadline first, then
        the tasks in key order)."""
        out: list[bytes] = [] if self.fence_at is None else [format_fence(self.fence_at)]
        for key in sorted(self.tasks):
            task = self.tasks[key]
            out.append(format_announce(key, task.marker, task.container))
            if task.pgid is not None:
                out.append(format_spawned(key, task.pgid))
        return out

    def _check(self) -> None:
        for key, task in self.tasks.items():
            assert key >= 0 and task.marker and all(task.marker)
            assert task.pgid is None or task.pgid > 1
            assert task.pgid is not None or task.start is None


def may_kill(recorded: int | None, current: int | None) -> bool:
    """Whether group ``pgid`` may be SIGKILLed, given its leader's start time when it was
    registered (``recorded``) and now (``current``; None: no such process). The same start
    time: the same leader. No leader now: its group, if it still has members, kept the id from
    being given out again, so it is ours. A leader with another start time: the id was reused
    (our group ended unheard): leave it. Unknown at registration but a process now: reused."""
    if current is None:
        return True
    return recorded == current


def parse_start_time(stat: str) -> int | None:
    """Field 22 (start time, in clock ticks since boot) of a ``/proc/PID/stat`` text; None if
    it does not parse. Fields are counted from the command name's last ``)``."""
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def hunt(
    markers: Iterable[tuple[bytes, ...]],
    processes: Iterable[tuple[int, int, bytes]],
) -> set[int]:
    """The pids among ``processes`` (pid, pgid, raw ``environ``) whose environment holds
    every entry of one of ``markers``."""
    wanted = [frozenset(m) for m in markers]
    found: set[int] = set()
    if not wanted:
        return found
    for pid, _pgid, environ in processes:
        entries = set(environ.split(b"\0"))
        if any(m <= entries for m in wanted):
            found.add(pid)
    return found


# --------------------------------------------------------------------------------------------
# The guard process (I/O)


def _log(message: str) -> None:
    try:
        os.write(2, f"tickwheel watchdog[{os.getpid()}]: {message}\n".encode())
    except OSError:
        pass


def _now_ms() -> int:
    """``CLOCK_MONOTONIC`` in ms, as the worker reads it (``time.monotonic_ns``)."""
    return time.monotonic_ns() // 1_000_000


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_start_time(f.read())
    except OSError:
        return None


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, pgid, environ) of every process we may read (others are skipped)."""
    out = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            pgid = os.getpgid(pid)
        except OSError:
            continue
        out.append((pid, pgid, environ))
    return out


def _kill(doom: Doom, why: str) -> list[tuple[str, str, str]]:
    """Carry ``doom`` out; the containers whose removal did not succeed."""
    killed = []
    for pgid, start in doom.groups.items():
        if not may_kill(start, _start_time(pgid)):
            _log(f"group {pgid}: its id was reused, left alone")
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    hunted: set[int] = set()
    if doom.markers:
        began = time.monotonic()
        for at in HUNT_ROUNDS_S:
            time.sleep(max(0.0, began + at - time.monotonic()))
            procs = _processes()
            groups = {pid: pgid for pid, pgid, _ in procs}
            for pid in hunt(doom.markers, procs) - hunted:
                hunted.add(pid)
                # Its group (the task is its leader once spawned), and itself in case it is
                # still the worker's child between fork and setsid.
                for send, target in ((os.killpg, groups[pid]), (os.kill, pid)):
                    if target <= 1:
                        continue  # never init, never "our own group" (killpg(0))
                    try:
                        send(target, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
    rms: list[tuple[subprocess.Popen[bytes], tuple[str, str, str]]] = []
    failed: list[tuple[str, str, str]] = []
    for container in doom.containers:
        runtime, name, env = container
        # The task's runtime settings (DOCKER_HOST...) on top of ours, as the runner's own
        # removal runs with the task's environment: else another daemon would be asked.
        extra = dict(entry.split("=", 1) for entry in env.split("\0") if "=" in entry)
        try:
            rm = subprocess.Popen(
                [runtime, "rm", "-f", name],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, **extra},
            )
        except OSError as exc:
            _log(f"cannot remove container {name}: {exc}")
            failed.append(container)
            continue
        rms.append((rm, container))
    deadline = time.monotonic() + CONTAINER_RM_S
    for rm, container in rms:
        try:
            if rm.wait(max(0.0, deadline - time.monotonic())) != 0:
                failed.append(container)
        except subprocess.TimeoutExpired:
            rm.kill()
            rm.wait()
            failed.append(container)
    _log(
        f"{why}: SIGKILLed task process groups "
        f"{' '.join(map(str, killed)) or '(none)'}"
        + (f", unregistered tasks {' '.join(map(str, sorted(hunted)))}" if hunted else "")
        + (f", removed {len(doom.containers) - len(failed)} containers" if doom.containers else "")
        + (f", could not remove {' '.join(c[1] for c in failed)}" if failed else "")
    )
    return failed


def main() -> int:
    """Read the worker's lines on stdin until end-of-file, then kill what is registered. Exit
    status 0; malformed lines are logged and skipped (the guard never dies of its input)."""
    worker = os.getppid()
    try:
        os.chdir("/")  # hold no directory busy
    except OSError:
        pass
    watch = Watch()
    pending = b""
    while True:
        wait = watch.wait_ms(_now_ms())
        if wait is not None and not select.select([0], [], [], wait / 1000)[0]:
            # Nothing from the worker by its fence deadline (a newer ``F`` would have come
            # with its acknowledged heartbeat): it cannot fence itself, so the guard does.
            doom = watch.fence_now()
            why = f"the worker (pid {worker}) passed its fence deadline"
            watch.keep_containers(_kill(doom, why))
            continue
        try:
            data = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LINE:
            _log("dropped an overlong line")
            pending = b""
        for line in lines:
            try:
                message = parse_line(line)
            except MessageError as exc:
                _log(str(exc))
                continue
            start = _start_time(message.pgid) if isinstance(message, Spawned) else None
            watch.apply(message, start=start)
        time.sleep(COALESCE_S)
    doom = watch.doom()
    if doom:
        _kill(doom, f"the worker (pid {worker}) is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
