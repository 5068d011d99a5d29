"""Running one task of a run on a worker machine: spawn, stream output, enforce the timeout, kill.

Owns the local life of one attempt: how a ``command``, ``shell`` or ``container`` task becomes a
process (its argv, environment and working directory), its own process group, streaming its
stdout and stderr in bounded chunks, the stop sequence (SIGTERM to the group, a grace, SIGKILL
to the group) on a timeout or a kill request, and the outcome (:class:`TaskOutcome`). The
decisions (which outcome, what environment, what container command line, which exit code for a
spawn failure) are small pure functions at the top of the module; :func:`run_task` is the thin
Trio driver around them.

Must never talk to the node, decide retries or report anything: the worker agent
(``cluster.worker``) does that with the outcome it gets back. Must never run ``payload`` tasks
(user code handles those through the client library) and never let a process it started outlive
the call, apart from one that left its process group on purpose (``setsid``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol, TypeGuard

import trio

from engine.effects import RunTicket

__all__ = [
    "CHUNK_BYTES",
    "CONTAINER_RUNTIMES",
    "DRAIN_S",
    "GUARD_MARKER_VARS",
    "INHERIT_NEVER_PREFIX",
    "OUTCOMES",
    "RUN_VAR_NAMES",
    "SHELL",
    "Guard",
    "Launch",
    "LaunchRefused",
    "RunHandle",
    "RunnerError",
    "RunnerUsageError",
    "Stop",
    "TaskNotRunnable",
    "TaskOutcome",
    "container_argv",
    "container_client_env",
    "container_name",
    "decide_outcome",
    "format_scheduled_at",
    "guard_marker",
    "parse_proc_stat",
    "pick_runtime",
    "plan_launch",
    "run_task",
    "run_vars",
    "spawn_failure",
    "stop_notice",
    "task_kind",
]

#: The largest piece of output handed to ``on_output`` at once (per read of a pipe).
CHUNK_BYTES: Final = 64 * 1024
#: How long the pipes' end is waited for after the task's process group is gone. A process
#: that left the group (``setsid``) may hold the pipes open forever; we stop reading them after
#: this. It bounds only that wait: what the group wrote is read, and what was read delivered,
#: however long that takes.
DRAIN_S: Final = 2.0
#: Container runtimes in the order auto-detection tries them.
CONTAINER_RUNTIMES: Final = ("docker", "podman")
#: The shell ``shell`` tasks run through.
SHELL: Final = "/bin/sh"
#: Every variable :func:`run_vars` may set. A task's own ``env`` cannot set these (and no
#: inherited ``TICKWHEEL_*`` variable passes: :data:`INHERIT_NEVER_PREFIX`).
RUN_VAR_NAMES: Final = frozenset(
    {
        "TICKWHEEL_RUN_ID",
        "TICKWHEEL_JOB_ID",
        "TICKWHEEL_ATTEMPT",
        "TICKWHEEL_SCHEDULED_AT",
        "TICKWHEEL_SCHEDULED_MS",
        "TICKWHEEL_FENCE",
        "TICKWHEEL_JOB_VERSION",
        "TICKWHEEL_DELIVERY",
        "TICKWHEEL_TIER",
        "TICKWHEEL_TIMEOUT_MS",
    }
)
#: Inherited variables with this prefix never reach a task (:func:`plan_launch`).
INHERIT_NEVER_PREFIX: Final = "TICKWHEEL_"
#: Outcomes, as ``ReportFinished.outcome`` spells them.
OUTCOMES: Final = ("success", "failed", "timed_out", "killed")

# Exit codes for a task that never started, as shells use them: 127 "command not found",
# 126 "found but cannot be executed".
_NOT_FOUND: Final = 127
_CANNOT_EXECUTE: Final = 126
# How often the stop sequence looks whether the process group is empty yet.
_GROUP_POLL_S: Final = 0.05
# Upper bound on the ``<runtime> rm -f`` that removes a stopped container (and on the
# ``container inspect`` that tells a failed removal from a container already gone).
_CONTAINER_RM_S: Final = 10.0
# Waits between attempts to remove a stopped task's container while a removal fails (a busy,
# restarting or unreachable daemon): the attempt is not over, so it is not reported, until the
# container is gone. The last wait repeats.
_CONTAINER_RM_RETRY_S: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
# Upper bound on reaping the leader after a SIGKILL when the call is being cancelled.
_REAP_S: Final = 2.0
log = logging.getLogger("tickwheel.worker")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_NAME_BAD_RE: Final = re.compile(r"[^a-zA-Z0-9_.-]+")


# --------------------------------------------------------------------------------------------
# Errors


class RunnerError(Exception):
    """Root of every exception raised by :mod:`cluster.runner`. ``code`` is stable (for the
    wire and for logs)."""

    code: str = "runner_error"


class RunnerUsageError(RunnerError, ValueError):
    """:func:`run_task` was called wrong (a negative grace, a chunk size below 1). Nothing was
    started."""

    code = "runner_usage"


class TaskNotRunnable(RunnerUsageError):
    """The ticket's task is not one a worker runs: a ``payload`` task (user code takes those
    through the client library), or a task that is not a well-formed ``command``, ``shell`` or
    ``container`` task. ``kind`` is the task's kind when it has exactly one, else None.
    Nothing was started."""

    code = "not_runnable"

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Stop:
    """Why the runner stopped a task that was still running: ``kind`` is ``timeout`` or
    ``kill``; ``reason`` is the human text (the node's kill reason, or the timeout)."""

    kind: str
    reason: str


@dataclass(frozen=True, slots=True)
class Launch:
    """What to start for a runnable task: ``argv`` (program first, never through a shell unless
    the task is a ``shell`` task), the complete environment, the working directory (None: the
    worker's), and for containers the runtime and container name (for the clean-up)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    kind: str
    runtime: str | None = None
    container: str | None = None


@dataclass(frozen=True, slots=True)
class LaunchRefused:
    """A runnable task that cannot start on this machine (no container runtime): the run fails
    with ``exit_code`` and ``message`` (which also goes to the task's stderr)."""

    exit_code: int
    message: str


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """How one attempt ended.

    - ``outcome``: ``success`` (exit status 0), ``failed`` (any other status, a signal from
      outside the runner, or a task that could not start), ``timed_out`` (stopped at
      ``ticket.timeout_ms``) or ``killed`` (stopped by :meth:`RunHandle.kill`).
    - ``exit_code``: the process's exit status, or minus the signal that ended it (``-15``,
      ``-9``); 127/126 when the program or the container runtime was not found / could not be
      executed; None when no process was started because a kill came first.
    - ``started`` / ``finished``: :func:`time.monotonic` readings around the attempt (``started``
      just before the spawn, ``finished`` once the group is stopped and the output drained).
    - ``stdout_bytes`` / ``stderr_bytes``: bytes handed to ``on_output`` per stream, the
      runner's own ``tickwheel:`` notices on stderr included.
    - ``reason``: why it was stopped or could not start (None for a process that ended on its
      own).
    - ``sigkill``: the group had to be SIGKILLed (something in it outlived the grace).
    """

    outcome: str
    exit_code: int | None
    started: float
    finished: float
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    reason: str | None = None
    sigkill: bool = False

    @property
    def duration_s(self) -> float:
        return self.finished - self.started


# --------------------------------------------------------------------------------------------
# Pure decisions


def task_kind(task: Mapping[str, object]) -> str:
    """The kind of ``task``: ``command``, ``shell`` or ``container``.

    Raises :class:`TaskNotRunnable` for a ``payload`` task and for anything that is not exactly
    one known kind with the shape ``engine.jobs`` validates (``command``: a non-empty list of
    strings; ``shell``: a string; ``container``: ``image`` and optional ``args``; optional
    ``env`` of strings and ``cwd`` string)."""
    if not isinstance(task, Mapping):
        raise TaskNotRunnable(f"a task must be an object, got {type(task).__name__}")
    kinds = [k for k in ("command", "shell", "container", "payload") if k in task]
    if len(kinds) != 1:
        raise TaskNotRunnable(f"a task needs exactly one kind, got {kinds or 'none'}")
    kind = kinds[0]
    if kind == "payload":
        raise TaskNotRunnable(
            "payload tasks are handed to client-library workers, not run as processes",
            kind=kind,
        )
    unknown = set(task) - {kind, "env", "cwd"}
    if unknown:
        raise TaskNotRunnable(f"unknown task keys: {sorted(unknown)}", kind=kind)
    value = task[kind]
    if kind == "command":
        if not _is_str_list(value) or not value or not value[0]:
            raise TaskNotRunnable("command must be a non-empty list of strings", kind=kind)
    elif kind == "shell":
        if not isinstance(value, str) or not value.strip():
            raise TaskNotRunnable("shell must be a non-empty string", kind=kind)
    else:
        if not isinstance(value, Mapping) or set(value) - {"image", "args"}:
            raise TaskNotRunnable("container must be an object with image and args", kind=kind)
        image = value.get("image")
        if not isinstance(image, str) or not image or image.startswith("-"):
            raise TaskNotRunnable("container.image must be an image reference", kind=kind)
        if not _is_str_list(value.get("args", [])):
            raise TaskNotRunnable("container.args must be a list of strings", kind=kind)
    env = task.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()
    ):
        raise TaskNotRunnable("env must map variable names to strings", kind=kind)
    cwd = task.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        raise TaskNotRunnable("cwd must be a non-empty string", kind=kind)
    if _holds_nul(task):
        # The OS cannot take it (exec and environ are NUL-terminated); engine.jobs refuses it.
        raise TaskNotRunnable("task strings must not contain NUL characters", kind=kind)
    return kind


def format_scheduled_at(ms: int) -> str:
    """``ms`` (since the Unix epoch) as ISO 8601 UTC with milliseconds:
    ``2026-11-30T12:00:00.000Z``. Exact (no float rounding). Raises OverflowError outside
    years 1-9999."""
    at = _EPOCH + timedelta(milliseconds=ms)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def run_vars(ticket: RunTicket) -> dict[str, str]:
    """The ``TICKWHEEL_*`` variables a task of ``ticket`` sees (docs/tasks.md lists them).

    ``TICKWHEEL_SCHEDULED_AT`` is ISO 8601 UTC with milliseconds and ``TICKWHEEL_SCHEDULED_MS``
    the same instant as integer milliseconds since the epoch (the form the run id carries);
    ``TICKWHEEL_SCHEDULED_AT`` is left out for an instant outside years 1-9999."""
    out = {
        "TICKWHEEL_RUN_ID": ticket.run_id,
        "TICKWHEEL_JOB_ID": ticket.job_id,
        "TICKWHEEL_ATTEMPT": str(ticket.attempt),
        "TICKWHEEL_SCHEDULED_MS": str(ticket.scheduled_ms),
        "TICKWHEEL_FENCE": str(ticket.token),
        "TICKWHEEL_JOB_VERSION": str(ticket.version),
        "TICKWHEEL_DELIVERY": ticket.delivery,
        "TICKWHEEL_TIER": ticket.tier,
    }
    try:
        out["TICKWHEEL_SCHEDULED_AT"] = format_scheduled_at(ticket.scheduled_ms)
    except OverflowError:
        pass
    if ticket.timeout_ms is not None:
        out["TICKWHEEL_TIMEOUT_MS"] = str(ticket.timeout_ms)
    return out


def pick_runtime(
    requested: str | None, which: Callable[..., str | None], *, path: str | None = None
) -> str | None:
    """The container runtime to use: ``requested`` (a name or a path) if ``which`` finds it,
    else None; without a request, the first of :data:`CONTAINER_RUNTIMES` found. ``which`` is
    :func:`shutil.which`-like (``path`` is passed as its ``path`` when given)."""
    candidates = (requested,) if requested else CONTAINER_RUNTIMES
    for name in candidates:
        found = which(name) if path is None else which(name, path=path)
        if found:
            return found
    return None


def container_name(ticket: RunTicket) -> str:
    """A container name unique to this attempt: ``tickwheel-<job id, sanitised>-<hash>``.

    The hash covers the run id and the fencing token, which is unique per claim, so a retry or
    a re-sent attempt never collides with a container of an earlier attempt that is still
    being removed. Matches the runtimes' ``[a-zA-Z0-9][a-zA-Z0-9_.-]*``."""
    slug = _NAME_BAD_RE.sub("-", ticket.job_id).strip("-.")[:40] or "job"
    digest = hashlib.blake2b(f"{ticket.run_id}\0{ticket.token}".encode(), digest_size=6).hexdigest()
    return f"tickwheel-{slug}-{digest}"


def container_argv(
    runtime: str,
    *,
    name: str,
    image: str,
    args: Sequence[str],
    env_names: Sequence[str],
    workdir: str | None = None,
) -> list[str]:
    """The command line that runs a container task in the foreground.

    ``<runtime> run --rm --name NAME [-e VAR]... [--workdir DIR] IMAGE ARGS...``. Variables
    go in by name only (``-e VAR``): the runtime copies their values from its own environment,
    so values never show on a command line (``ps``). ``--rm`` removes the container when it
    ends; the default ``--sig-proxy`` passes the SIGTERM of the stop sequence on to the
    container."""
    argv = [runtime, "run", "--rm", "--name", name]
    for var in env_names:
        argv += ["-e", var]
    if workdir is not None:
        argv += ["--workdir", workdir]
    argv.append(image)
    argv.extend(args)
    return argv


def plan_launch(
    ticket: RunTicket,
    *,
    base_env: Mapping[str, str],
    container_runtime: str | None = None,
    which: Callable[..., str | None] = shutil.which,
) -> Launch | LaunchRefused:
    """What to start for ``ticket``, decided without starting anything.

    Environment, in increasing precedence: ``base_env`` (the worker's) without any
    ``TICKWHEEL_*`` variable, the task's ``env``, then :func:`run_vars` (a task cannot fake
    its run id or fence); names in :data:`RUN_VAR_NAMES` are taken from the ticket only. A
    ``container`` task gets only the task's ``env`` and the run variables inside the
    container; the runtime process itself gets the rest of the environment too. The runtime is looked up on
    ``base_env["PATH"]``.

    Raises :class:`TaskNotRunnable` (payload, malformed task). Returns :class:`LaunchRefused`
    when no container runtime is found."""
    kind = task_kind(ticket.task)
    task = ticket.task
    own_env = {k: v for k, v in task.get("env", {}).items() if k not in RUN_VAR_NAMES}
    system = run_vars(ticket)
    # No TICKWHEEL_* variable of the worker's own environment is passed on: not a run
    # variable (a worker that itself runs under tickwheel), and not the worker's settings
    # (TICKWHEEL_CONNECT): a task that wants one sets it in its own ``env``.
    env = {k: v for k, v in base_env.items() if not k.startswith(INHERIT_NEVER_PREFIX)}
    env.update(own_env)
    env.update(system)
    cwd: str | None = task.get("cwd")
    if kind == "command":
        return Launch(tuple(task["command"]), env, cwd, kind)
    if kind == "shell":
        return Launch((SHELL, "-c", task["shell"]), env, cwd, kind)
    box: Mapping[str, object] = task["container"]
    runtime = pick_runtime(container_runtime, which, path=base_env.get("PATH", os.defpath))
    if runtime is None:
        wanted = container_runtime or " or ".join(CONTAINER_RUNTIMES)
        return LaunchRefused(
            _NOT_FOUND,
            f"container task: no container runtime found ({wanted} is not installed on this "
            "worker, or not on its PATH)",
        )
    name = container_name(ticket)
    image = box["image"]
    args = box.get("args", [])
    assert isinstance(image, str) and _is_str_list(args)  # checked by task_kind
    argv = container_argv(
        runtime,
        name=name,
        image=image,
        args=args,
        env_names=[*own_env, *system],
        workdir=cwd,
    )
    # The runtime runs in the worker's directory; ``cwd`` is the directory inside the container.
    return Launch(tuple(argv), env, None, kind, runtime=runtime, container=name)


def spawn_failure(
    err: OSError,
    program: str,
    cwd: str | None,
    *,
    path: str | None = None,
    exists: Callable[[str], bool] = os.path.exists,
) -> tuple[int, str]:
    """The exit code and message for a process that could not be started: 127 when the program
    does not exist, 126 when it exists but cannot be executed (permissions, not a regular
    executable, a ``#!`` interpreter that does not exist, a missing working directory).
    ``exists`` tells a missing program from a missing interpreter, looked for as the spawn
    looked for it: a path with a ``/`` from ``cwd``, a bare name in each directory of
    ``path`` (the task's ``PATH``; :data:`os.defpath` when None)."""
    reason = err.strerror or str(err)
    if cwd is not None and err.filename == cwd and err.filename != program:
        return _CANNOT_EXECUTE, f"cannot change to the working directory {cwd!r}: {reason}"
    if isinstance(err, FileNotFoundError):
        # (Checked from the worker's directory, and for paths with a "/" only, a script
        # found on PATH or relative to its cwd was "command not found": found by review.)
        # (From the task's cwd, where the child is when it execs: a relative PATH entry too.)
        here = cwd if cwd is not None else ""
        if "/" in program:
            found = exists(os.path.join(here, program))
        else:
            dirs = (os.defpath if path is None else path).split(os.pathsep)
            found = any(exists(os.path.join(here, d, program)) for d in dirs)
        if found:
            # execve says ENOENT for the interpreter of a script, not for the script.
            return _CANNOT_EXECUTE, f"{program}: cannot execute (bad interpreter: {reason})"
        return _NOT_FOUND, f"{program}: command not found ({reason})"
    return _CANNOT_EXECUTE, f"{program}: cannot execute ({reason})"


def decide_outcome(returncode: int | None, stop: Stop | None) -> tuple[str, str | None]:
    """The outcome and reason of an attempt: a stop by the runner wins over the exit status
    (a task that traps SIGTERM and exits 0 after its timeout still timed out); otherwise
    status 0 is ``success`` and anything else, a signal from outside included, ``failed``."""
    if stop is not None:
        return ("timed_out" if stop.kind == "timeout" else "killed"), stop.reason
    if returncode == 0:
        return "success", None
    return "failed", None


def stop_notice(
    stop: Stop, *, grace_s: float, sigkill: bool, returncode: int | None, at_once: bool = False
) -> str:
    """The line the runner adds to the task's stderr after stopping it, so a reader of the logs
    sees why it ended."""
    if at_once:
        how = "SIGKILL to the process group at once"
    elif sigkill:
        how = f"SIGTERM, then SIGKILL after the {grace_s:g} s grace"
    else:
        how = "SIGTERM to the process group"
    status = "" if returncode is None else f"; exit {_describe_status(returncode)}"
    return f"tickwheel: stopped ({stop.reason}): {how}{status}"


def parse_proc_stat(text: str) -> tuple[str, int] | None:
    """``(state, process group id)`` from the text of ``/proc/PID/stat``, or None if it does not
    parse. The command name (field 2) may hold spaces and parentheses, so fields are counted
    from its last ``)``."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 3:
        return None
    try:
        return fields[0], int(fields[2])
    except ValueError:
        return None


def _describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return str(returncode)


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, Mapping):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(v) for v in value)
    return False


def _is_str_list(value: object) -> TypeGuard[list[str] | tuple[str, ...]]:
    return isinstance(value, list | tuple) and all(isinstance(a, str) for a in value)


# --------------------------------------------------------------------------------------------
# Process groups (Linux and other POSIX systems)


def _signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to the group; a group already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        # ESRCH: nothing left. EPERM: only members we may not signal (or zombies on some
        # systems) are left; there is nothing more we can do for those.
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies do not count).

    ``killpg(pgid, 0)`` alone would count zombies: orphans wait for their new parent to reap
    them, which in a container without an init may be never, and the stop sequence would then
    always wait out the grace. Where ``/proc`` exists we look for a live member there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parsed = parse_proc_stat(f.read())
        except OSError:
            continue  # exited meanwhile
        if parsed is not None and parsed[1] == pgid and parsed[0] not in ("Z", "X"):
            return True
    return False


async def _group_alive_async(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False  # the common case after a clean exit: no thread needed
    except PermissionError:
        return True
    # The /proc scan reads one file per process on the machine; in a thread, so that a busy
    # host never stalls the worker's event loop (its heartbeats) while a group winds down.
    return await trio.to_thread.run_sync(_group_alive, pgid)


# --------------------------------------------------------------------------------------------
# The worker's watchdog, as the runner sees it


class Guard(Protocol):
    """What :func:`run_task` tells the worker's watchdog (:mod:`cluster.watchdog_link`). Each
    call returns at once, never raises, never waits, but :meth:`announced`, which waits
    (bounded) until the guard can know of the task announced last."""

    def announce(
        self, marker: tuple[bytes, ...], container: tuple[str, str, str] | None
    ) -> int: ...

    async def announced(self) -> None: ...

    def spawned(self, key: int, pgid: int) -> None: ...

    def done(self, key: int) -> None: ...


#: The run variables that identify one attempt's processes to the watchdog (by their
#: environment): the run id and the fencing token, unique per attempt.
GUARD_MARKER_VARS: Final = ("TICKWHEEL_RUN_ID", "TICKWHEEL_FENCE")


#: What a container runtime's client reads from its environment to find its daemon and
#: settings: the entries the watchdog's ``rm -f`` of a task's container runs with
CONTAINER_ENV_PREFIXES: Final = ("DOCKER_", "CONTAINER_", "CONTAINERS_", "PODMAN_")
CONTAINER_ENV_NAMES: Final = frozenset(
    {"HOME", "PATH", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME"}
    | {"REGISTRY_AUTH_FILE"}
)
#: at most this many bytes of them (the guard's lines are bounded); beyond, the rest is left
#: out and the removal runs with the worker's own values for those
CONTAINER_ENV_MAX: Final = 4096


def container_client_env(env: Mapping[str, str]) -> str:
    """The NUL-joined ``NAME=value`` entries of ``env`` a container runtime's client reads
    (:data:`CONTAINER_ENV_PREFIXES`, :data:`CONTAINER_ENV_NAMES`), for the watchdog to remove
    a task's container the way the runner would, against the same daemon (found by a review:
    a task that set ``DOCKER_HOST`` had its container removal sent to the default daemon).
    Entries holding NUL are left out; at most :data:`CONTAINER_ENV_MAX` bytes, in name order."""
    entries: list[str] = []
    size = 0
    for name in sorted(env):
        if name not in CONTAINER_ENV_NAMES and not name.startswith(CONTAINER_ENV_PREFIXES):
            continue
        entry = f"{name}={env[name]}"
        if "\0" in entry or size + len(entry.encode()) + 1 > CONTAINER_ENV_MAX:
            continue
        entries.append(entry)
        size += len(entry.encode()) + 1
    return "\0".join(entries)


def guard_marker(env: Mapping[str, str]) -> tuple[bytes, ...]:
    """The ``NAME=value`` environment entries (as ``/proc/PID/environ`` holds them) that
    identify a task's processes: :data:`GUARD_MARKER_VARS`, which :func:`plan_launch` always
    sets (a task's own ``env`` cannot change them)."""
    return tuple(f"{name}={env[name]}".encode() for name in GUARD_MARKER_VARS)


# --------------------------------------------------------------------------------------------
# The handle a worker keeps per run


class RunHandle:
    """The worker's hold on one :func:`run_task` call: request a kill, learn the process id.

    Create one per attempt and pass it as ``handle``. Use it from the Trio thread of the call
    only (it holds :class:`trio.Event` objects). A kill requested before the task starts means
    it never starts; one requested after it ended changes nothing.
    """

    def __init__(self) -> None:
        self._kill = trio.Event()
        self._started = trio.Event()
        self.kill_reason: str | None = None
        #: The process id (and group id) of the task's main process, once started.
        self.pid: int | None = None
        #: SIGKILL at once, no SIGTERM and no grace (:meth:`kill` with ``at_once``)
        self.at_once = False
        self._grace: trio.CancelScope | None = None  # the grace being waited out, if any

    def kill(self, reason: str, *, at_once: bool = False) -> None:
        """Stop the task: SIGTERM to its group, the grace, SIGKILL; the outcome is ``killed``
        with ``reason`` (e.g. ``cancelled``, ``superseded``, ``fenced: no heartbeat``). The
        first reason given wins. ``at_once``: SIGKILL to the group now, without SIGTERM or
        grace (a worker fencing itself: the run may be handed out again as soon as its lease
        lapses, so no grace can be afforded); it also cuts short a grace already running.
        Returns at once."""
        if at_once and not self.at_once:
            self.at_once = True
            if self._grace is not None:
                self._grace.cancel()  # the stop sequence goes on to its SIGKILL now
        if self.kill_reason is None:
            self.kill_reason = reason
            self._kill.set()

    async def wait_started(self) -> int:
        """Wait until the process has started; return its pid. Never returns for a task that
        does not start (a refused launch, a kill that came first)."""
        await self._started.wait()
        assert self.pid is not None
        return self.pid

    async def _wait_kill(self) -> str:
        await self._kill.wait()
        assert self.kill_reason is not None
        return self.kill_reason

    def _mark_started(self, pid: int) -> None:
        self.pid = pid
        self._started.set()


# --------------------------------------------------------------------------------------------
# The Trio driver

OnOutput = Callable[[str, bytes], Awaitable[None]]


async def run_task(
    ticket: RunTicket,
    *,
    on_output: OnOutput,
    handle: RunHandle | None = None,
    kill_grace_s: float = 5.0,
    container_runtime: str | None = None,
    base_env: Mapping[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    drain_s: float = DRAIN_S,
    guard: Guard | None = None,
) -> TaskOutcome:
    """Run the task of ``ticket`` to its end and say how it ended.

    The process runs in a new session (its own process group, no controlling terminal), with
    stdin from ``/dev/null`` and the environment of :func:`plan_launch` (``base_env`` defaults
    to ``os.environ``). stdout and stderr go to ``await on_output(stream, data)`` in chunks of
    at most ``chunk_bytes`` as they arrive, in order per stream; calls are never concurrent (a
    lock serialises the two streams), and a slow ``on_output`` slows the task through its full
    pipe rather than costing memory here.

    Stop sequence, on ``ticket.timeout_ms`` (measured from the spawn; not with
    ``on_timeout`` ``mark``, whose task runs on) or ``handle.kill()``:
    SIGTERM to the whole group; once the main process and every other member have exited, or
    after ``kill_grace_s``, SIGKILL to the group. When the main process ends on its own, any
    member of its group still running gets the same sequence (nothing the task started in its
    group outlives the run). Everything the group wrote is then read and handed to
    ``on_output``, however long ``on_output`` takes (the call returns only once it has taken
    the last chunk); the pipes' end is waited for at most ``drain_s`` more (a process that left
    the group may keep them open), and if it does not come, a ``tickwheel:`` notice on stderr
    says that reading stopped. For a container task that was stopped, the
    container is also removed (``<runtime> rm -f NAME``), since a SIGKILLed runtime client
    leaves its container running.

    Returns a :class:`TaskOutcome`; a task that cannot start (missing program, no container
    runtime, missing working directory) is a ``failed`` outcome with a ``tickwheel:`` message on
    its stderr, never an exception. Raises :class:`TaskNotRunnable` for a payload or malformed
    task and :class:`RunnerUsageError` for bad arguments, both before starting anything. If the
    call is cancelled, or ``on_output`` raises, the group is SIGKILLed at once (no grace), the
    container removed, and the exception propagates.

    ``guard`` (the worker's watchdog, :class:`cluster.watchdog_link.WatchdogLink`) hears of the
    task before the spawn (:meth:`Guard.announce`, with the run's ``TICKWHEEL_RUN_ID`` and
    ``TICKWHEEL_FENCE`` as its marker), its group right after (:meth:`Guard.spawned`), and
    the group's end as soon as the leader is reaped and nothing is left in it
    (:meth:`Guard.done`): a guard that outlives the worker kills what is still registered.
    A group whose leader could not be reaped (a cancelled call past its bound) stays
    registered.
    """
    if not kill_grace_s >= 0:
        raise RunnerUsageError(f"kill_grace_s must be >= 0, got {kill_grace_s!r}")
    if chunk_bytes < 1:
        raise RunnerUsageError(f"chunk_bytes must be >= 1, got {chunk_bytes!r}")
    if not drain_s >= 0:
        raise RunnerUsageError(f"drain_s must be >= 0, got {drain_s!r}")
    handle = handle if handle is not None else RunHandle()
    plan = plan_launch(
        ticket,
        base_env=os.environ if base_env is None else base_env,
        container_runtime=container_runtime,
    )
    out = _Output(on_output)
    started = time.monotonic()
    if handle.kill_reason is not None:
        return TaskOutcome("killed", None, started, time.monotonic(), reason=handle.kill_reason)
    if isinstance(plan, LaunchRefused):
        await out.notice(plan.message)
        return out.outcome("failed", plan.exit_code, started, reason=plan.message)
    key = -1
    if guard is not None:
        container = (
            None
            if plan.container is None
            else (plan.runtime or "", plan.container, container_client_env(plan.env))
        )
        key = guard.announce(guard_marker(plan.env), container)
        await guard.announced()  # (at once, unless the guard is behind: then it catches up)
    try:
        proc = await trio.lowlevel.open_process(
            list(plan.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(plan.env),
            cwd=plan.cwd,
            start_new_session=True,
        )
    except OSError as err:
        if guard is not None:
            guard.done(key)
        code, message = spawn_failure(err, plan.argv[0], plan.cwd, path=plan.env.get("PATH"))
        await out.notice(message)
        return out.outcome("failed", code, started, reason=message)
    except BaseException:
        if guard is not None:
            guard.done(key)  # nothing was started (the spawn is not abandoned on cancel)
        raise
    if guard is not None:
        guard.spawned(key, proc.pid)
    handle._mark_started(proc.pid)

    unregistered = guard is None

    def reaped(*, container_left: bool = False) -> None:
        """Tell the guard the task is over, once its leader is reaped; with
        ``container_left`` (its container could not be removed), never: the guard keeps it,
        and removes the container when the worker goes."""
        nonlocal unregistered
        if container_left:
            unregistered = True
        elif not unregistered and proc.returncode is not None:
            unregistered = True
            assert guard is not None
            guard.done(key)

    try:
        return await _supervise(
            proc, plan, ticket, handle, out, started, kill_grace_s, chunk_bytes, drain_s, reaped
        )
    finally:
        reaped()  # the paths that end early (on_output raised, cancelled): if reaped


class _Output:
    """``on_output`` behind a lock, with per-stream byte counts."""

    def __init__(self, sink: OnOutput) -> None:
        self._sink = sink
        self._lock = trio.Lock()
        self.counts = {"stdout": 0, "stderr": 0}

    async def send(self, stream: str, data: bytes) -> None:
        async with self._lock:
            self.counts[stream] += len(data)
            await self._sink(stream, data)

    async def notice(self, message: str) -> None:
        line = message if message.startswith("tickwheel:") else f"tickwheel: {message}"
        await self.send("stderr", line.encode() + b"\n")

    def outcome(
        self,
        outcome: str,
        exit_code: int | None,
        started: float,
        *,
        reason: str | None = None,
        sigkill: bool = False,
    ) -> TaskOutcome:
        return TaskOutcome(
            outcome,
            exit_code,
            started,
            time.monotonic(),
            self.counts["stdout"],
            self.counts["stderr"],
            reason,
            sigkill,
        )


class _Pipe:
    """One output pipe of a task, read in chunks that go to ``on_output`` (:class:`_Output`).

    Reading and delivering are kept apart: :meth:`cut` (the drain's deadline) cancels only a
    wait for more data, never a chunk being delivered, and never before the bytes that were
    in the pipe when the task's group ended (:meth:`group_ended`) are read and delivered too.
    So output the group wrote is never dropped, however long ``on_output`` takes (a worker
    whose node is down retries until the node has the chunk). What a process that left the
    group writes after that may be: ``eof`` stays False when reading stopped before the
    pipe's end."""

    __slots__ = ("_cut", "_owed", "_wait", "eof", "name", "stream")

    def __init__(self, stream: trio.abc.ReceiveStream, name: str) -> None:
        self.stream = stream
        self.name = name
        #: the pipe's end was read (every writer closed it)
        self.eof = False
        #: bytes in the pipe when the group ended not read since (None: it has not ended)
        self._owed: int | None = None
        self._cut = False
        self._wait: trio.CancelScope | None = None  # the wait for data under way, if any

    def group_ended(self) -> None:
        """The task's group has ended: every byte it wrote is in the pipe now, and is owed."""
        self._owed = _pipe_pending(self.stream) or 0

    def cut(self) -> None:
        """Stop reading once what is owed is read: a wait for more data is cancelled."""
        self._cut = True
        if self._done() and self._wait is not None:
            self._wait.cancel()

    def _done(self) -> bool:
        return self._cut and (self._owed or 0) <= 0

    async def pump(self, out: _Output, chunk_bytes: int) -> None:
        """Read to the pipe's end or the cut, each chunk delivered before the next read."""
        while not self._done():
            with trio.CancelScope() as wait:
                self._wait = wait
                # A cancelled receive_some has taken nothing from the pipe (it waits for
                # readiness before it reads), so the cut never loses a byte read.
                data = await self.stream.receive_some(chunk_bytes)
            self._wait = None
            if wait.cancelled_caught:
                break
            if not data:
                self.eof = True
                return
            if self._owed is not None:
                self._owed -= len(data)
            # Pipes hand out bytes already; the conversion is for the interface's bytearray.
            await out.send(self.name, data if isinstance(data, bytes) else bytes(data))
        # Cut: the pipe may well be at its end already (read to the last owed byte, or ended
        # just as the wait was cancelled); only a pipe still open counts as held open.
        self.eof = _pipe_ended(self.stream)


def _pipe_ended(stream: trio.abc.ReceiveStream) -> bool:
    """Whether the pipe behind ``stream`` is at its end now (readable with nothing in it: every
    writer closed it), without waiting and without reading. False when it cannot be told."""
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return False
    try:
        readable, _, _ = select.select([fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(readable) and _pipe_pending(stream) == 0


def _pipe_pending(stream: trio.abc.ReceiveStream) -> int | None:
    """Bytes waiting in the pipe behind ``stream`` (``FIONREAD``); None when it cannot be
    told."""
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return None
    try:
        got = fcntl.ioctl(fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    return int(struct.unpack("i", got)[0])


async def _supervise(
    proc: trio.Process,
    plan: Launch,
    ticket: RunTicket,
    handle: RunHandle,
    out: _Output,
    started: float,
    grace_s: float,
    chunk_bytes: int,
    drain_s: float,
    reaped: Callable[..., None],
) -> TaskOutcome:
    pgid = proc.pid  # start_new_session: the leader's pid is the group's id
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None
    readers_done = trio.Event()
    stop: Stop | None = None
    sigkill = False
    pipes = (_Pipe(stdout, "stdout"), _Pipe(stderr, "stderr"))

    # An exception from on_output (or a pipe) is kept here and re-raised as itself, not
    # wrapped in the ExceptionGroups of our internal nurseries, which callers cannot see.
    failures: list[Exception] = []
    body = trio.CancelScope()

    async def pump(pipe: _Pipe) -> None:
        try:
            await pipe.pump(out, chunk_bytes)
        except Exception as exc:
            failures.append(exc)
            body.cancel()

    async def read_all() -> None:
        async with trio.open_nursery() as readers:
            for pipe in pipes:
                readers.start_soon(pump, pipe)
        readers_done.set()

    try:
        with body:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                # on_timeout "mark": the node records TIMED_OUT; the task runs on to its own
                # end (its environment still says its timeout: TICKWHEEL_TIMEOUT_MS).
                enforced = None if ticket.on_timeout == "mark" else ticket.timeout_ms
                stop = await _wait_exit_or_stop(proc, handle, enforced)
                if stop is not None or await _group_alive_async(pgid):
                    sigkill = await _stop_group(proc, pgid, grace_s, handle)
                returncode = await proc.wait()
                # The group is over (leader reaped, no member left): the guard forgets it
                # now, not after the drain, so its id is never held past its reuse. Not a
                # stopped container's: it outlives its SIGKILLed client until the ``rm -f``
                # below, and the guard must remove it if the worker dies meanwhile (the
                # guard's ``done`` comes from run_task's ``finally``, after the removal).
                if plan.container is None or stop is None:
                    reaped()
                # Everything the group wrote is in the pipes now: that much is read whatever
                # the drain, and what was read is delivered however long on_output takes (it
                # may be waiting out a node's outage). The drain bounds only the wait for the
                # pipes' end, which a process that left the group can put off for ever.
                for pipe in pipes:
                    pipe.group_ended()
                with trio.move_on_after(drain_s):
                    await readers_done.wait()
                for pipe in pipes:
                    pipe.cut()
                await readers_done.wait()
        if failures:
            raise failures[0]
        held_open = [pipe.name for pipe in pipes if not pipe.eof]
        if held_open:
            # Not silent: what such a process writes from now on is not read.
            await out.notice(
                f"stopped reading {' and '.join(held_open)} {drain_s:g} s after the task "
                "ended: a process that left its process group still holds "
                f"{'them' if len(held_open) > 1 else 'it'} open"
            )
        if stop is not None:
            # The removal first: the notice waits for the node (it may be down, as when this
            # worker fences itself), and the container must not run on meanwhile.
            if plan.container is not None:
                await _remove_container_until_gone(plan, out)
            await out.notice(
                stop_notice(
                    stop,
                    grace_s=grace_s,
                    sigkill=sigkill,
                    returncode=returncode,
                    at_once=handle.at_once,
                )
            )
    except BaseException:
        # Cancelled from outside, or on_output raised: nothing we started may outlive us, and
        # there is no time for a grace.
        with trio.CancelScope(shield=True):
            # The leader's group, whether or not the leader is reaped yet: it may have ended
            # (by itself, or of the SIGTERM) while members still had their grace, and those
            # must not outlive the worker either (found by review: a member of a task whose
            # leader had exited ran on after a hard exit, the guard told the task was over).
            # Members alive keep the group id reserved, so it is still this task's.
            if proc.returncode is None or await _group_alive_async(pgid):
                _signal_group(pgid, signal.SIGKILL)
            with trio.move_on_after(_REAP_S):
                await proc.wait()
            if plan.container is not None and await _remove_container(plan) is not None:
                reaped(container_left=True)  # the guard removes it once the worker is gone
        raise
    finally:
        with trio.CancelScope(shield=True):
            await stdout.aclose()
            await stderr.aclose()
    outcome, reason = decide_outcome(returncode, stop)
    return out.outcome(outcome, returncode, started, reason=reason, sigkill=sigkill)


async def _wait_exit_or_stop(
    proc: trio.Process, handle: RunHandle, timeout_ms: int | None
) -> Stop | None:
    """Wait for the main process to exit (None; it is reaped) or for a reason to stop it (the
    first of the timeout and a kill request; it is not reaped, so its group id stays reserved
    for the signals of the stop sequence)."""
    stops: list[Stop] = []
    exited = False

    async with trio.open_nursery() as race:

        async def on_exit() -> None:
            nonlocal exited
            await proc.wait()
            exited = True
            race.cancel_scope.cancel()

        async def on_kill() -> None:
            reason = await handle._wait_kill()
            if not exited:
                stops.append(Stop("kill", reason))
            race.cancel_scope.cancel()

        async def on_timeout(timeout_ms: int) -> None:
            await trio.sleep(max(0, timeout_ms) / 1000)
            if not exited:
                stops.append(Stop("timeout", f"timed out after {timeout_ms} ms"))
            race.cancel_scope.cancel()

        race.start_soon(on_exit)
        race.start_soon(on_kill)
        if timeout_ms is not None:
            race.start_soon(on_timeout, timeout_ms)
    return stops[0] if stops else None


async def _stop_group(
    proc: trio.Process, pgid: int, grace_s: float, handle: RunHandle | None = None
) -> bool:
    """SIGTERM the group; SIGKILL it if the main process or any member is still running after
    ``grace_s``, or at once (no SIGTERM) when ``handle`` asks for it (:meth:`RunHandle.kill`
    with ``at_once``, before or during the grace). Returns whether SIGKILL was needed.
    Returns once the main process is reaped."""
    if handle is not None and handle.at_once:
        _signal_group(pgid, signal.SIGKILL)
        await proc.wait()
        return True
    _signal_group(pgid, signal.SIGTERM)
    with trio.move_on_after(grace_s) as grace:
        if handle is not None:
            handle._grace = grace
        await proc.wait()
        # The leader is reaped; members still running keep the group id reserved, so the
        # signals below cannot reach an unrelated group (once the group is empty the id could
        # be reused in theory, but only after the pid space wraps around).
        while await _group_alive_async(pgid):
            await trio.sleep(_GROUP_POLL_S)
        return False
    _signal_group(pgid, signal.SIGKILL)
    await proc.wait()
    return True


async def _remove_container(plan: Launch) -> str | None:
    """``<runtime> rm -f NAME``, bounded: the container of a stopped task may still run after
    its runtime client was SIGKILLed. None once the container cannot run any more: the
    removal succeeded, or it failed and ``<runtime> container inspect NAME`` says there is no
    such container (a ``--rm`` container that ended by itself) or that it is not running (one
    the daemon cannot remove, "Dead", say: it holds nothing); else what went wrong."""
    assert plan.runtime is not None and plan.container is not None
    problem, _ = await _bounded_runtime_call(plan, ["rm", "-f", plan.container])
    if problem is None:
        return None
    failed, running = await _bounded_runtime_call(
        plan, ["container", "inspect", "--format", "{{.State.Running}}", plan.container]
    )
    if failed is None and running.strip() == "false":
        return None
    if failed is not None and "no such" in failed.lower():
        return None
    return problem


async def _bounded_runtime_call(plan: Launch, args: list[str]) -> tuple[str | None, str]:
    """Run ``<runtime> ARGS`` for at most :data:`_CONTAINER_RM_S` (then SIGKILLed): (None if
    it exited 0, else why not: its exit status and the last line of its stderr, a timeout,
    or a failure to start; its stdout)."""
    assert plan.runtime is not None
    what = f"{plan.runtime} {' '.join(args)}"

    async def kill_now(proc: trio.Process) -> None:
        proc.kill()  # (a runtime client that hangs gets no grace: the bound is the bound)

    done: subprocess.CompletedProcess[bytes] | None = None
    try:
        with trio.move_on_after(_CONTAINER_RM_S):
            done = await trio.run_process(
                [plan.runtime, *args],
                stdin=subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                deliver_cancel=kill_now,
                env=dict(plan.env),
                start_new_session=True,
            )
    except OSError as exc:
        return f"{what}: {exc}", ""
    if done is None:
        return f"{what}: no answer within {_CONTAINER_RM_S:g} s", ""
    said = done.stdout.decode(errors="replace")
    if done.returncode == 0:
        return None, said
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return f"{what}: exit {done.returncode}" + (f": {lines[-1]}" if lines else ""), said


async def _remove_container_until_gone(plan: Launch, out: _Output) -> None:
    """:func:`_remove_container` until the container is gone, waiting
    :data:`_CONTAINER_RM_RETRY_S` between attempts. The run is held meanwhile, and not
    reported: a ``timed_out`` or ``killed`` report tells the node the task is over (an
    at-most-once retry may then start), which is not true while its container may run.

    Nothing here waits for the node: the task's log hears of failed attempts only once the
    container is gone (``out`` waits for a node that is down, and the removal matters most
    then: a fence), and the worker's log at once. Each attempt is shielded; the waits are
    not, so a worker that is ending is not held up (its guard removes the container after
    it, see :mod:`cluster.watchdog`)."""
    assert plan.container is not None
    failures: list[str] = []
    while True:
        with trio.CancelScope(shield=True):
            problem = await _remove_container(plan)
        if problem is None:
            if failures:
                await out.notice(
                    f"removed container {plan.container} after {len(failures) + 1} tries; "
                    f"the first failed: {failures[0]}"
                )
            return
        wait = _CONTAINER_RM_RETRY_S[min(len(failures), len(_CONTAINER_RM_RETRY_S) - 1)]
        log.warning(
            "cannot remove container %s (%s): it may still run, so its run is not reported "
            "until it is removed; trying again in %g s",
            plan.container,
            problem,
            wait,
        )
        failures.append(problem)
        del failures[1:-1]  # (the first and the newest are enough)
        await trio.sleep(wait)
