"""The client and server commands of ``tickwheel``: what each does and how it prints.

Owns turning parsed arguments into requests (through :mod:`cluster.client`), the node and
worker entry points, and the printing (rich tables for people, JSON with ``--json``). Must
never decide anything a node decides; a command is a request and a rendering.
"""

from __future__ import annotations

import argparse
import codecs
import gc
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cluster.client import (
    Client,
    ClientError,
    ConnectionLost,
    RemoteError,
    connect_reason,
    parse_address,
)
from cluster.options import connect_address
from cluster.protocol import MAX_WORKER_SLOTS

# Wide when piped, so that run ids are never cut in a log or a demo transcript.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
# Errors are one line each, never wrapped: a script (or a test) reads them whole.
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


# =============================================================================== arguments


class UsageError(ClientError):
    """The command line itself is wrong (options that do not go together, a value that does
    not parse): exit status 2, as argparse's own usage errors."""


#: Python's JSON reader recurses per level of nesting; the node refuses anything deeper than
#: 32 levels anyway (docs/protocol.md), so deeper input is refused here, without a traceback.
_TOO_DEEP = "nested too deeply (the node takes at most 32 levels)"

#: What a backslash keeps its meaning before inside double quotes (POSIX sh); before
#: anything else there, it is an ordinary character.
_DQUOTE_ESCAPABLE = frozenset('$`"\\\n')


def split_command(line: str) -> list[str]:
    """``line`` split into words as a POSIX shell splits them, then used as an argv without
    one: blanks separate words; single quotes keep everything; inside double quotes a
    backslash escapes only ``$``, a backquote, ``"``, a backslash and a newline (and stays
    otherwise); outside quotes it escapes any character, and a backslash-newline joins lines.
    Nothing is expanded or run: ``$VAR``, backquotes, globs, ``~``, ``;``, ``|``, ``&``,
    redirections and ``#`` are taken literally (``--shell`` is for those).

    (Not ``shlex.split``: inside double quotes it keeps a backslash before ``$`` or a
    backquote, where a shell removes it.) Raises ValueError for an unclosed quote.
    O(len(line)).
    """
    words: list[str] = []
    word: list[str] = []
    in_word = False  # a quoted empty string is a word too
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in " \t\n":
            if in_word:
                words.append("".join(word))
                word, in_word = [], False
            i += 1
        elif c == "'":
            end = line.find("'", i + 1)
            if end < 0:
                raise ValueError("no closing quotation (')")
            word.append(line[i + 1 : end])
            in_word, i = True, end + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    raise ValueError('no closing quotation (")')
                c = line[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and line[i + 1] in _DQUOTE_ESCAPABLE:
                    if line[i + 1] != "\n":  # (backslash-newline: both go)
                        word.append(line[i + 1])
                    i += 2
                else:
                    word.append(c)
                    i += 1
            in_word = True
        elif c == "\\":
            if i + 1 >= n:  # a lone backslash at the end stays, as sh keeps it
                word.append(c)
                in_word, i = True, i + 1
                continue
            if line[i + 1] != "\n":
                word.append(line[i + 1])
                in_word = True
            i += 2
        else:
            word.append(c)
            in_word, i = True, i + 1
    if in_word:
        words.append("".join(word))
    return words


def spec_from_args(args: argparse.Namespace, *, update: bool) -> dict[str, Any]:
    """The (partial, for an update) job spec the options describe."""
    spec: dict[str, Any] = {}
    if args.tz is not None and not args.tz.strip():
        # An empty zone used to vanish (the schedule then got the default, UTC): refused.
        raise UsageError(
            "--tz is empty: give an IANA zone such as Europe/Berlin (UTC is the default)"
        )
    if args.tz is not None and args.cron is None:
        # A zone means something to a cron rule only: an --at instant carries its own offset,
        # --every and --in are durations. Refused rather than silently dropped.
        if args.at is not None or args.every is not None or args.in_ is not None:
            raise UsageError(
                "--tz applies to --cron only (an --at instant carries its own offset, as in "
                "2030-01-01T09:00:00+01:00; --every and --in are durations)"
            )
        if not update:
            raise UsageError("--tz goes with --cron")
        # ``job update ID --tz ZONE``: the job's own expression in a new zone; a partial
        # schedule that merge_update completes from the job (refused there for a job whose
        # schedule is not cron).
        spec["schedule"] = {"tz": args.tz}
    elif args.cron is not None:
        spec["schedule"] = {"cron": args.cron, **({"tz": args.tz} if args.tz is not None else {})}
    elif args.at is not None:
        spec["schedule"] = {"at": args.at}
    elif args.every is not None:
        spec["schedule"] = {"every": args.every}
    elif args.in_ is not None:
        from engine.errors import EngineUsageError
        from engine.schedules import format_utc, parse_duration

        try:
            delay = parse_duration(args.in_, field="--in")
        except EngineUsageError as exc:
            raise UsageError(str(exc)) from None  # (it names --in already)
        spec["schedule"] = {"at": format_utc(_now_ms() + delay)}
    if args.command_line is not None:
        try:
            argv = split_command(args.command_line)
        except ValueError as exc:
            raise UsageError(f"--command: {exc}") from None
        spec["task"] = {"command": argv}
    elif args.shell is not None:
        spec["task"] = {"shell": args.shell}
    elif args.payload is not None:
        try:
            spec["task"] = {"payload": json.loads(args.payload)}
        except json.JSONDecodeError as exc:
            raise UsageError(f"--payload is not JSON: {exc}") from None
        except RecursionError:
            raise UsageError(f"--payload is not usable JSON: {_TOO_DEEP}") from None
    for option, key in (("timeout", "timeout"), ("on_timeout", "on_timeout"), ("tier", "tier")):
        value = getattr(args, option)
        if value is not None:
            spec[key] = value
    if args.delivery is not None:
        spec["delivery"] = args.delivery.replace("-", "_")
    if not update:
        if "schedule" not in spec:
            raise UsageError("give a schedule: --cron, --at, --every or --in")
        if "task" not in spec:
            raise UsageError("give a task: --command, --shell or --payload")
    elif not spec:
        # An update without changes is not a no-op on the node: it makes a new version and
        # records the fire times owed but not fired as skipped. Refused as a usage error.
        raise UsageError(
            "nothing to change: give at least one of --cron, --at, --every, --in, --tz, "
            "--command, --shell, --payload, --timeout, --on-timeout, --delivery, --tier"
        )
    return spec


#: Per-job options of ``submit`` (argparse dest -> flag). With ``--file`` each line is a whole
#: spec, so these would be silently ignored: refused instead.
SUBMIT_JOB_OPTIONS: dict[str, str] = {
    "id": "--id",
    "cron": "--cron",
    "at": "--at",
    "every": "--every",
    "in_": "--in",
    "tz": "--tz",
    "command_line": "--command",
    "shell": "--shell",
    "payload": "--payload",
    "timeout": "--timeout",
    "on_timeout": "--on-timeout",
    "delivery": "--delivery",
    "tier": "--tier",
}

#: A cron schedule's fields whose values here are the defaults the node fills in: dropping
#: them when the kind changes loses nothing, so they are left out of the note that says so.
_CRON_DEFAULTS: dict[str, str] = {"tz": "UTC", "dst_gap": "shift", "dst_fold": "first"}
#: Task fields beside the kind; valid for command, shell and container tasks, not payload.
_TASK_EXTRAS: tuple[str, ...] = ("env", "cwd")


def _schedule_kind(schedule: dict[str, Any]) -> str | None:
    from engine.schedules import KINDS

    return next((k for k in KINDS if k in schedule), None)


def _fields(values: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()
    )


def merge_update(
    job_id: str, current: dict[str, Any], changes: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The ``changes`` of a ``job update`` completed from the job as it is (``current``: a
    ``job.get`` result), and notes for the user on what was kept and what dropped.

    ``job.update`` replaces each top-level key whole, so a new ``--cron`` alone would reset the
    zone to UTC and drop ``dst_gap``/``dst_fold``/``jitter``/``end``, a new ``--every`` its
    ``start``/``end``/``jitter``, a new ``--shell`` the task's ``env``/``cwd``. Guarantees:

    - the schedule kind stays (cron -> cron...): every current field not given again is kept
      (a partial ``{"tz": ZONE}`` from ``--tz`` alone keeps the expression);
    - the kind changes: only the current fields the new kind accepts (engine/schedules.py:
      ``end`` and ``jitter``) are kept, the others dropped and named in a note (cron fields at
      their defaults are not named: they meant nothing);
    - a new command, shell or container task keeps the current ``env`` and ``cwd``; a payload
      task takes neither (named in a note).

    Raises :class:`UsageError` for ``--tz`` alone on a job whose schedule is not cron.
    """
    from engine.schedules import KEYS_BY_KIND, KINDS  # the engine's own table of fields

    merged = dict(changes)
    notes: list[str] = []
    spec = current.get("spec") or {}
    if "schedule" in changes and isinstance(spec.get("schedule"), dict):
        old: dict[str, Any] = spec["schedule"]
        new: dict[str, Any] = changes["schedule"]
        old_kind, new_kind = _schedule_kind(old), _schedule_kind(new)
        if new_kind is None:  # --tz alone
            if old_kind != "cron":
                raise UsageError(
                    f"--tz applies to cron schedules only; job {job_id}'s schedule is "
                    f"{old_kind}: {_fields(old)}"
                )
            new_kind = "cron"
        extras = {k: v for k, v in old.items() if k not in KINDS and k not in new}
        if new_kind == old_kind:
            kept, dropped = extras, {}
        else:
            allowed = KEYS_BY_KIND[new_kind]
            kept = {k: v for k, v in extras.items() if k in allowed}
            dropped = {
                k: v
                for k, v in extras.items()
                if k not in allowed and not (old_kind == "cron" and _CRON_DEFAULTS.get(k) == v)
            }
        merged["schedule"] = {**{k: v for k, v in old.items() if k == new_kind}, **new, **kept}
        # The kind's own key first, as people write a schedule.
        merged["schedule"] = dict(
            sorted(merged["schedule"].items(), key=lambda kv: kv[0] not in KINDS)
        )
        shown = {
            k: v for k, v in kept.items() if not (new_kind == "cron" and _CRON_DEFAULTS.get(k) == v)
        }
        if shown:
            notes.append(f"kept from the current schedule: {_fields(shown)}")
        if dropped:
            notes.append(f"dropped ({new_kind} schedules have no such field): {_fields(dropped)}")
    if "task" in changes and isinstance(spec.get("task"), dict):
        old_task: dict[str, Any] = spec["task"]
        new_task: dict[str, Any] = changes["task"]
        extras = {k: old_task[k] for k in _TASK_EXTRAS if old_task.get(k) and k not in new_task}
        if extras and "payload" in new_task:
            notes.append(f"dropped (a payload task has no such field): {', '.join(extras)}")
        elif extras:
            merged["task"] = {**new_task, **extras}
            notes.append(f"kept from the current task: {', '.join(extras)}")
    return merged, notes


def _now_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


# =============================================================================== output


def emit(args: argparse.Namespace, data: Any, render: Callable[[Any], None]) -> None:
    if args.json:
        print(json.dumps(data, default=_json_default, indent=None))
    else:
        render(data)


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"not JSON: {type(value).__name__}")


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a table. Every cell and the title are plain text, never rich markup: they hold
    what users wrote (a task's shell line, labels, a worker id), and ``[/x]`` in a spec must
    neither crash the command (MarkupError) nor vanish (``[bold]``)."""
    table = Table(title=Text(title), title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(Text("" if v is None else str(v)) for v in row))
    console.print(table)


def render_job(job: dict[str, Any]) -> None:
    rows = [[k, json.dumps(v) if isinstance(v, dict | list) else v] for k, v in job.items()]
    _table(f"job {job.get('job_id')}", ["field", "value"], rows)


def render_runs(runs: list[dict[str, Any]]) -> None:
    _table(
        "runs",
        ["run id", "state", "scheduled at", "ended at", "attempt", "exit", "worker", "why"],
        [
            [
                r["run_id"],
                r["state"],
                r["scheduled_at"],
                r.get("ended_at"),
                r["attempt"],
                r["exit_code"],
                r["worker"],
                r["why"] or r.get("waiting"),  # a run due that no worker takes: why not
            ]
            for r in runs
        ],
    )


# =============================================================================== client commands


async def _with_client(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    address, source = connect_address(args)
    try:
        host, port = parse_address(address)
    except ClientError as exc:  # a command line's fault: status 2, as `worker --connect` gives
        raise UsageError(f"{source}: {exc}") from None

    def waiting(exc: OSError) -> None:  # a node starting up gets the time; a typo a word
        err_console.print(
            escape(f"cannot connect to {host}:{port} ({connect_reason(exc)}); trying for 10 s"),
            highlight=False,
        )

    async with Client.connect(
        host, port, timeout_s=10, reconnect=False, on_retry=waiting
    ) as client:
        return await body(client)


def run_client_command(args: argparse.Namespace) -> int:
    """Run a client subcommand; typed errors become a message and exit status 1 (2 for
    usage)."""
    handler = CLIENT_COMMANDS[args.command]
    try:
        return trio.run(_with_client, args, lambda c: handler(c, args))
    except KeyboardInterrupt:
        return _interrupted(args)  # ^C: the usual way to stop ``logs --follow``
    except BaseExceptionGroup as group:
        # ^C inside a nursery (submit --file's batches, the client's tasks) comes wrapped in
        # a group: the same ^C, not a crash with a traceback (found by review).
        interrupt = (KeyboardInterrupt, trio.Cancelled, BaseExceptionGroup)
        if group.subgroup(lambda e: not isinstance(e, interrupt)) is not None:
            raise
        return _interrupted(args)
    except RemoteError as exc:
        if args.json:
            print(
                json.dumps(
                    {"error": {"code": exc.code, "message": exc.message, "field": exc.field}}
                )
            )
        else:
            err_console.print(f"[red]error[/red] {escape(exc.code)}: {escape(exc.message)}")
        return 1
    except UsageError as exc:
        if args.json:  # (a script reading stdout gets an object, as for every other error)
            print(json.dumps({"error": {"code": "usage", "message": str(exc), "field": None}}))
        else:
            err_console.print(f"[red]error[/red] {escape(str(exc))}")
        return 2
    except ClientError as exc:
        # The client's own errors (timeout, connection_lost, not_sendable) as the node's are:
        # with their code, and as JSON under --json (found by review: plain text, no code).
        if args.json:
            print(json.dumps({"error": {"code": exc.code, "message": str(exc), "field": None}}))
        else:
            err_console.print(f"[red]error[/red] {escape(exc.code)}: {escape(str(exc))}")
        return 1


def _interrupted(args: argparse.Namespace) -> int:
    """Exit status 130 for a ^C, without a traceback; ``submit --file`` says what it leaves."""
    if args.command == "submit" and getattr(args, "file", None) is not None:
        err_console.print(
            "interrupted: jobs of the lines already sent may exist (`tickwheel jobs` lists "
            "them); the file can be submitted again: a line with an `id` whose job holds its "
            "spec counts as created, a line without one makes a new job",
            highlight=False,
        )
    return 130


async def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    if args.file is not None:
        given = [
            flag for dest, flag in SUBMIT_JOB_OPTIONS.items() if getattr(args, dest) is not None
        ]
        if given:
            raise UsageError(
                f"--file takes whole specs, one per line: {', '.join(given)} would be ignored "
                "(put them in the file's lines)"
            )
        return await _submit_file(client, args)
    from cluster.client import RequestTimeout, created_as_sent, replaces
    from engine.jobs import new_job_id

    spec = spec_from_args(args, update=False)
    # The id is made here, not by the library, so that a create whose answer never came can
    # name it: the job may exist, and the same command again (without --id) would make a
    # second one (found by review).
    spec["id"] = args.id if args.id is not None else new_job_id(_now_ms(), os.urandom(10))
    try:
        job = await client.create(spec)
    except (RequestTimeout, ConnectionLost) as exc:
        # The retry named exactly: --in counts from now, so the same command again with --id
        # asked for another time, and a job that was created answered `exists` to it forever
        # (found by review); the time this attempt asked for is given as --at instead.
        again = f"--id {spec['id']}"
        if args.in_ is not None:
            again += f" --at {spec['schedule']['at']} (in place of --in)"
        raise type(exc)(
            f"{exc} (job {spec['id']} may have been created: `tickwheel job get {spec['id']}` "
            f"tells; submit again with {again} to retry without a second job)"
        ) from None
    except RemoteError as exc:
        # The retry the line above recommends: the job exists and holds this very spec, so
        # the command's work is done (answered `exists`, a retry loop in a script never
        # ended: found by review). Any other job of that id stays an error.
        existing = None
        if exc.code == "exists" and args.id is not None and not replaces(spec):
            try:
                existing = await created_as_sent(client, spec)
            except ClientError:
                existing = None
        if existing is None:
            raise
        err_console.print(
            escape(f"job {spec['id']} exists already, with this spec: nothing changed"),
            highlight=False,
        )
        job = existing
    emit(
        args,
        job,
        lambda j: console.print(escape(f"{j['job_id']}  next fire {j['next_fire'] or '-'}")),
    )
    return 0


def read_spec_file(path: str) -> list[tuple[int, dict[str, Any]]]:
    """The job specs of a JSON-lines file, each with its line number (blank lines count as
    lines, and are skipped). Raises :class:`UsageError` (status 2, as for a file argparse
    cannot open) naming the file, and the line where there is one, for a file that cannot be
    read (missing, a directory, no permission), a line that is not UTF-8, not JSON, or not a
    JSON object."""
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    specs: list[tuple[int, dict[str, Any]]] = []
    for number, raw in enumerate(raw_lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path}:{number}: not UTF-8 (byte {exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            spec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not JSON: {exc}") from None
        except RecursionError:
            raise UsageError(f"{path}:{number}: not usable JSON: {_TOO_DEEP}") from None
        if not isinstance(spec, dict):
            kind = {list: "a list", str: "a string", bool: "a boolean"}.get(type(spec), "")
            raise UsageError(
                f"{path}:{number}: a job spec is a JSON object, got "
                f"{kind or ('null' if spec is None else 'a number')}"
            )
        specs.append((number, spec))
    return specs


def refuse_ended(path: str, numbered: list[tuple[int, dict[str, Any]]], now_ms: int) -> None:
    """Raise :class:`UsageError` naming ``FILE:LINE`` for the first spec whose
    ``schedule.end`` is already past at ``now_ms``: the node takes such a job, which then never
    fires; almost always a mistake (a stale file, a wrong year). Nothing is sent then. An
    ``end`` that does not parse is left to the node's typed validation."""
    from engine.errors import EngineUsageError
    from engine.schedules import format_utc, parse_instant

    for number, spec in numbered:
        schedule = spec.get("schedule")
        if not isinstance(schedule, dict) or not isinstance(schedule.get("end"), str):
            continue
        try:
            end_ms = parse_instant(schedule["end"], field="schedule.end")
        except EngineUsageError:
            continue
        if end_ms < now_ms:
            raise UsageError(
                f"{path}:{number}: schedule.end {format_utc(end_ms)} is already past: the job "
                "would never fire (nothing was submitted)"
            )


#: ``submit --file``: specs per ``job.create_many`` request, requests in flight at once (enough
#: to keep the node's shards busy; more only queue on the node and make each reply late),
#: tries per batch, and how long one batch's reply may take
SUBMIT_BATCH = 1000
SUBMIT_IN_FLIGHT = 4
SUBMIT_TRIES = 4
SUBMIT_BATCH_TIMEOUT_S = 30.0
#: with no answer to any batch for this long, the batches not yet answered give up (a node
#: that died: else each batch waited its tries x its timeout, minutes for a big file)
SUBMIT_STALL_S = 30.0
#: whole-request refusals that say the request was too big or complex: the batch is split
SUBMIT_SPLIT_CODES = frozenset({"frame_too_large", "frame_too_complex", "container_too_large"})
#: files from this many specs show a progress bar (on a terminal only)
SUBMIT_PROGRESS_FROM = 5000


class SubmitLine:
    """What became of one spec of a ``submit --file``: ``job_id`` (always known: an id the
    file did not give is made before anything is sent), and ``error`` (None: created) with
    ``unconfirmed`` true when its batch never got a reply (the job may or may not exist);
    ``existed`` when it was answered ``exists`` by a job that holds the line's very spec."""

    __slots__ = ("error", "existed", "generated", "job_id", "number", "spec", "unconfirmed")

    def __init__(self, number: int, spec: dict[str, Any], job_id: str, generated: bool) -> None:
        self.number, self.spec, self.job_id, self.generated = number, spec, job_id, generated
        self.error: str | None = None
        self.unconfirmed = False
        #: the job existed already, holding this very spec (not an error: nothing changed)
        self.existed = False


async def submit_lines(
    client: Client,
    numbered: list[tuple[int, dict[str, Any]]],
    *,
    batch: int = SUBMIT_BATCH,
    in_flight: int = SUBMIT_IN_FLIGHT,
    tries: int = SUBMIT_TRIES,
    timeout_s: float = SUBMIT_BATCH_TIMEOUT_S,
    stall_s: float = SUBMIT_STALL_S,
    on_batch: Callable[[int], None] | None = None,
) -> list[SubmitLine]:
    """Create the jobs of ``numbered`` (line number, spec) with ``job.create_many``, and say
    per line what became of it.

    Guarantees: at most ``in_flight`` batches wait for a reply at once (found by the user:
    50,000 specs all in flight made the late batches miss the CLI's 10 s). Every spec has its
    id before anything is sent (one generated here when the line has none), so a batch whose
    reply timed out or whose connection broke is sent again, up to ``tries`` times, with the
    same ids: it can never create a job twice. On such a repeat, ``exists`` means the earlier
    attempt may have created the job: for an id made here (random, nobody else has it) it did;
    for an id the file gave, it counts as created only when the stored job is the spec sent
    (:func:`cluster.client.created_as_sent`, as :meth:`Client.create` decides) and no earlier line
    of the file has that id; otherwise it stays the ``exists`` error. A batch that never got
    a reply leaves its lines ``unconfirmed``; when no batch has been answered for ``stall_s``
    (the node is gone), the batches not yet answered stop trying, and those never sent say
    so (they do not exist). A batch too big for one frame (refused before it leaves, or by
    the node as too large or complex) is split in halves, down to one spec, whose line then
    carries the refusal; any other refusal of a whole batch is its lines' error. A
    ``job.get`` check that fails leaves its line ``unconfirmed``. ``on_batch`` gets each
    batch's size when it is done. Never raises the client's errors: every line says what
    became of it (found by a review: one oversized batch ended the command with a traceback
    and no word of the 2,000 jobs the other batches had created)."""
    from cluster.client import (
        RequestNotSendable,
        RequestTimeout,
        created_as_sent,
        in_parallel,
        job_versions,
        replace_applied,
        replaces,
    )
    from engine.jobs import new_job_id

    now = _now_ms()
    lines: list[SubmitLine] = []
    first_line_of: dict[str, int] = {}
    for number, spec in numbered:
        given = spec.get("id")
        if isinstance(given, str):
            lines.append(SubmitLine(number, spec, given, False))
        else:
            job_id = given if given is not None else new_job_id(now, os.urandom(10))
            lines.append(SubmitLine(number, {**spec, "id": job_id}, str(job_id), given is None))
        first_line_of.setdefault(lines[-1].job_id, number)

    async def created_before(line: SubmitLine) -> bool | None:
        """Whether ``line``'s job, answered ``exists``, is the line's own: made by this
        command's earlier attempt (an id it made), or holding the line's very spec (an id the
        file gave, on its first line). None: unknown (the job could not be read)."""
        if line.generated:
            return True
        if first_line_of.get(line.job_id) != line.number:
            return False  # a repeated id: the file's earlier line is the one that created it
        try:
            return await created_as_sent(client, line.spec) is not None
        except ClientError:
            return None

    answered_at = trio.current_time()  # the last answer to any batch

    def split(part: list[SubmitLine], why: str) -> list[list[SubmitLine]] | None:
        if len(part) > 1:
            half = len(part) // 2
            return [part[:half], part[half:]]
        part[0].error = why
        return None

    ids_seen = Counter(line.job_id for line in lines)

    async def to_send_again(
        part: list[SubmitLine], before: dict[str, int], budget_s: float
    ) -> list[SubmitLine]:
        """``part`` less its replacing lines that need no second attempt (:func:`settled_
        replace`), read back in parallel within ``budget_s`` (one after another, each with
        its own timeout, a node gone cost a timeout per line: found by review)."""
        settled: set[int] = set()

        async def check(line: SubmitLine) -> None:
            if await settled_replace(line, before, budget_s):
                settled.add(id(line))

        await in_parallel([line for line in part if replaces(line.spec)], check)
        return [line for line in part if id(line) not in settled]

    async def settled_replace(line: SubmitLine, before: dict[str, int], budget_s: float) -> bool:
        """After a broken connection, for a line that replaces a job (``replace: true``):
        True when nothing more is to be sent for it: its job moved on from the version read
        before the first attempt and holds the line's spec (applied), or whether it was
        applied cannot be known (the job changed into something else, its id stands twice in
        the file, or it cannot be read: the line is then unconfirmed)."""
        if line.job_id not in before:
            line.error = (
                "replace: its id stands twice in the file; whether it was applied is unknown"
            )
            line.unconfirmed = True
            return True
        try:
            held = await replace_applied(client, line.spec, before[line.job_id], timeout_s=budget_s)
            return held is not None
        except ClientError as exc:
            line.error, line.unconfirmed = f"{exc.code}: {exc}", True
            return True

    async def attempt(part: list[SubmitLine]) -> None:
        nonlocal answered_at
        # A replacing create is never answered `exists`: sent again after a lost reply, it
        # would be applied twice (one more version, an `every` restarted: found by review).
        # Such a batch is sent once a try, and what an earlier try applied is not sent again.
        replacing = any(replaces(line.spec) for line in part)
        before: dict[str, int] = {}  # replaced jobs' versions before the first attempt
        first = [line.job_id for line in part if replaces(line.spec) and ids_seen[line.job_id] == 1]
        if first:
            try:  # (in parallel: one after another, they outlasted the stall limit)
                before = await job_versions(client, first, timeout_s=timeout_s)
                answered_at = trio.current_time()  # the node answers: it is not stalled
            except ClientError as exc:
                for line in part:
                    if line.job_id in first:
                        line.error = f"not sent (its job could not be read first: {exc})"
                part = [line for line in part if line.error is None]
        specs = [line.spec for line in part]
        maybe_sent = False
        failure = ""
        for _try in range(tries):
            # A try waits no longer than what is left of the stall window: each waiting its
            # whole timeout, a batch whose try began just inside the window tried again once
            # it ended, and the command took two windows to give up (found by review).
            left = stall_s - (trio.current_time() - answered_at)
            if left <= 0:
                failure = failure or f"no answer to any batch for {stall_s:g} s"
                break
            sent_on: list[int] = []
            try:
                reply = await client.request(
                    "job.create_many",
                    {"specs": specs},
                    timeout_s=min(timeout_s, left),
                    sent_on=sent_on,
                    retry=not replacing,
                )
            except (RequestTimeout, ConnectionLost) as exc:
                maybe_sent = maybe_sent or bool(sent_on)
                failure = f"{exc.code}: {exc}"
                if replacing and sent_on:
                    if isinstance(exc, ConnectionLost):
                        await trio.sleep(0.05)  # (a reconnect is under way)
                    left = stall_s - (trio.current_time() - answered_at)
                    part = await to_send_again(part, before, max(0.001, min(timeout_s, left)))
                    specs = [line.spec for line in part]
                    if not part:
                        return
                continue
            except RequestNotSendable as exc:
                halves = split(part, f"{exc.code}: {exc}")
                for half in halves or ():
                    await attempt(half)
                return
            except RemoteError as exc:
                answered_at = trio.current_time()
                if exc.code in SUBMIT_SPLIT_CODES:
                    halves = split(part, f"{exc.code}: {exc.message}")
                    for half in halves or ():
                        await attempt(half)
                    return
                for line in part:  # the whole batch refused: nothing of it was taken
                    line.error = f"{exc.code}: {exc.message}"
                return
            answered_at = trio.current_time()
            maybe_sent = maybe_sent or len(sent_on) > 1
            for line, result in zip(part, reply["results"], strict=True):
                if result.get("ok"):
                    continue
                error = result.get("error") or {}
                if error.get("code") == "exists" and maybe_sent:
                    ours = await created_before(line)
                    if ours:
                        continue  # our own earlier attempt's job, whose reply was lost
                    if ours is None:
                        line.error = "exists, and whether this command created it is unknown"
                        line.unconfirmed = True
                        continue
                if error.get("code") == "exists" and not line.generated:
                    # The file submitted again (after a ^C or a failure: found by review): a
                    # job that holds the line's very spec is that line's work done; any
                    # doubt stays an error.
                    if await created_before(line):
                        line.existed = True
                        continue
                line.error = f"{error.get('code')}: {error.get('message')}"
            return
        for line in part:
            if maybe_sent:
                line.error, line.unconfirmed = failure, True
            else:
                line.error = f"not sent ({failure})"  # never left: the job does not exist

    async def send(part: list[SubmitLine]) -> None:
        await attempt(part)
        if on_batch is not None:
            on_batch(len(part))

    parts = [lines[i : i + batch] for i in range(0, len(lines), batch)]
    limiter = trio.Semaphore(max(1, in_flight))

    async def send_then_release(part: list[SubmitLine]) -> None:
        try:
            await send(part)
        finally:
            limiter.release()

    async with trio.open_nursery() as nursery:
        for part in parts:
            await limiter.acquire()  # in file order, at most in_flight at once
            nursery.start_soon(send_then_release, part)
    return lines


async def _submit_file(client: Client, args: argparse.Namespace) -> int:
    numbered = read_spec_file(args.file)
    refuse_ended(args.file, numbered, _now_ms())
    # A broken connection is made again and the batches in flight sent again with the same
    # ids (submit_lines): for this command a reconnect is safe, and better than leaving the
    # user not knowing which of the jobs exist.
    client.reconnect = True
    progress = None
    if len(numbered) >= SUBMIT_PROGRESS_FROM and err_console.is_terminal:
        from rich.progress import Progress

        progress = Progress(console=err_console, transient=True)
    if progress is not None:
        with progress:
            task = progress.add_task(f"submitting {args.file}", total=len(numbered))
            lines = await submit_lines(
                client, numbered, on_batch=lambda n: progress.advance(task, n)
            )
    else:
        lines = await submit_lines(client, numbered)
    failed = unconfirmed = 0
    for line in lines:
        if line.error is None:
            continue
        failed += 1
        if line.unconfirmed:
            unconfirmed += 1
            message = (
                f"{args.file}:{line.number}: no answer ({line.error}): job {line.job_id} may or "
                "may not exist (check with job get)"
            )
        else:
            message = f"{args.file}:{line.number}: {line.error}"
        err_console.print(escape(message), highlight=False)
    ids = [line.job_id if line.error is None else None for line in lines]
    existed = sum(1 for line in lines if line.existed)
    summary = f"{len(lines) - failed - existed} jobs created, {failed - unconfirmed} not created"
    if existed:
        summary += f", {existed} there already with the same spec"
    if unconfirmed:
        summary += f", {unconfirmed} unconfirmed"
    try:
        emit(args, ids, lambda _v: console.print(summary))
    except OSError:
        # The jobs exist: their ids (generated for lines without one) must reach the user
        # somewhere, or submitting the file again makes a second copy of each (found by
        # review: stdout on a full disk). Then the error, told by cli.main.
        err_console.print(json.dumps(ids), highlight=False, soft_wrap=True)
        err_console.print(summary, highlight=False)
        raise
    return 1 if failed else 0


async def cmd_job(client: Client, args: argparse.Namespace) -> int:
    action, job_id = args.action, args.id
    if action == "get":
        result = await client.get(job_id)
    elif action == "update":
        result = await _update(client, args)
    elif action == "cancel":
        result = await client.cancel(job_id, stop_running=args.stop_running)
    elif action == "pause":
        result = await client.pause(job_id)
    elif action == "resume":
        result = await client.resume(job_id)
    else:  # preview
        result = await client.preview(job_id=job_id, count=args.count)
        emit(
            args,
            result,
            lambda p: _table(
                p["description"]
                + (" (paused: these fire only once it is resumed)" if p.get("paused") else ""),
                ["fire time (UTC)", "local", "note"],
                [[f["utc"], f["local"], f["note"]] for f in p["fires"]],
            ),
        )
        return 0
    emit(args, result, render_job)
    return 0


async def _update(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """``job update``: a schedule or task change is completed from the job as it is (see
    :func:`merge_update`), which takes two requests, a ``job.get`` then the ``job.update``
    with ``if_version`` of what was read, so another update landing between the two is not
    overwritten: the node answers ``conflict`` and nothing changes (run the command again).
    ``--if-version N`` asks the same of the user's own version. Notes go to stderr, so that
    ``--json`` output stays one JSON object."""
    changes = spec_from_args(args, update=True)
    current: dict[str, Any] | None = None
    notes: list[str] = []
    if "schedule" in changes or "task" in changes:
        current = await client.get(args.id)
        changes, notes = merge_update(args.id, current, changes)
    if_version = args.if_version
    if current is not None and if_version is None:
        if_version = int(current["version"])
    try:
        result = await client.update(args.id, changes, if_version=if_version)
    except RemoteError as exc:
        if exc.code == "conflict" and args.if_version is None:
            raise RemoteError(
                exc.code,
                f"{exc.message}: the job changed while this update was made from it; run "
                "the command again",
                exc.field,
            ) from None
        kept = changes.get("schedule", {})
        field = (exc.field or "").removeprefix("schedule.")
        if current is not None and field in kept and field not in _given_schedule_fields(args):
            raise RemoteError(
                exc.code,
                f"{exc.message} ({field} was kept from the job's current schedule)",
                exc.field,
            ) from None
        raise
    for note in notes:
        err_console.print(f"note: {escape(note)}")
    return result


def _given_schedule_fields(args: argparse.Namespace) -> set[str]:
    """The schedule fields the command line itself set."""
    given = {"tz"} if args.tz is not None else set()
    if args.cron is not None:
        given.add("cron")
    if args.at is not None or args.in_ is not None:
        given.add("at")
    if args.every is not None:
        given.add("every")
    return given


async def cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    jobs = [job async for job in client.list_jobs()]
    emit(
        args,
        jobs,
        lambda js: _table(
            "jobs",
            ["job id", "schedule", "next fire", "paused", "cancelled"],
            [
                [
                    j["job_id"],
                    json.dumps(j["schedule"]),
                    j["next_fire"],
                    j["paused"],
                    j["cancelled"],
                ]
                for j in js
            ],
        ),
    )
    return 0


async def _per_job(
    job_ids: list[str], read: Callable[[str], Awaitable[list[dict[str, Any]]]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """``read(job_id)`` for each job, in order: the rows of those that could be read, and the
    jobs that are not there (``not_found``; their rows were dropped with the others' before,
    found by review). Any other error ends the command as usual."""
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for job_id in job_ids:
        try:
            rows.extend(await read(job_id))
        except RemoteError as exc:
            if exc.code != "not_found" or len(job_ids) == 1:
                raise
            missing.append(job_id)
    return rows, missing


def _say_missing(missing: list[str]) -> int:
    for job_id in missing:
        err_console.print(escape(f"error not_found: no job {job_id}"), highlight=False)
    return 1 if missing else 0


async def cmd_runs(client: Client, args: argparse.Namespace) -> int:
    async def read(job_id: str) -> list[dict[str, Any]]:
        return list(await client.history(job_id, last=args.last))

    runs, missing = await _per_job(args.job_ids, read)
    emit(args, runs, render_runs)
    return _say_missing(missing)


async def cmd_skips(client: Client, args: argparse.Namespace) -> int:
    async def read(job_id: str) -> list[dict[str, Any]]:
        return [{"job_id": job_id, **s} for s in await client.skips(job_id, last=args.last)]

    skips, missing = await _per_job(args.job_ids, read)
    emit(
        args,
        skips,
        lambda rows: _table(
            "skipped fire times",
            ["job id", "from", "to", "count", "reason", "source"],
            [
                [s["job_id"], s["from"], s["to"], s["count"] or "all", s["reason"], s["source"]]
                for s in rows
            ],
        ),
    )
    return _say_missing(missing)


async def cmd_run(client: Client, args: argparse.Namespace) -> int:
    run = await client.run(args.run_id)
    emit(args, run, lambda r: render_runs([r]))
    return 0


#: How long ``logs --follow`` tries to connect again after its connection broke (a node
#: restart: the run carries on, its worker reconnects). A node restarting after a crash
#: replays its log tail before it listens, which can take several times the CLI's 10 s.
FOLLOW_RECONNECT_S = 30.0


async def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    printer = LogPrinter(as_json=args.json)
    if args.follow:
        await follow_resuming(client, args.run_id, printer.chunk)
        printer.close()
        return 0
    offset = 0
    while True:
        page = await client.logs(args.run_id, offset=offset)
        for chunk in page["chunks"]:
            printer.chunk(chunk)
        offset = page["cursor"]
        if page["at_end"]:
            printer.close()
            return 0


async def follow_resuming(
    client: Client,
    run_id: str,
    on_chunk: Callable[[dict[str, Any]], None],
    *,
    reconnect_s: float = FOLLOW_RECONNECT_S,
    poll_s: float = 0.2,
) -> None:
    """Follow ``run_id``'s output to its end (:meth:`Client.follow_pages`), handing each chunk
    to ``on_chunk``, and ride out a broken connection: a note on stderr, a new connection to
    the same address (tried for up to ``reconnect_s``), and the follow goes on from the
    cursor of the last page received whole, so that no chunk is handed over twice and none is
    skipped (found by the fifth adversarial pass: a node restart ended the follow with "no
    reply within 10 s", although the run carried on). Raises :class:`ConnectionLost` when no
    connection could be made in time, and what :meth:`Client.follow_pages` raises otherwise.
    """
    from contextlib import AsyncExitStack

    cursor = 0
    current = client
    async with AsyncExitStack() as connections:
        while True:
            try:
                async for page in current.follow_pages(run_id, offset=cursor, poll_s=poll_s):
                    for chunk in page["chunks"]:
                        on_chunk(chunk)
                    cursor = page["cursor"]
                return
            except ConnectionLost as exc:
                where = f"{client.host}:{client.port}"
                # (not the library's "(reconnect is off)": this command connects again itself)
                lost = str(exc).removesuffix(" (reconnect is off)")
                err_console.print(
                    f"note: {escape(lost)}; connecting again to {escape(where)} "
                    f"(for up to {reconnect_s:g} s) to follow on"
                )
                try:
                    current = await connections.enter_async_context(
                        Client.connect(
                            client.host, client.port, timeout_s=reconnect_s, reconnect=False
                        )
                    )
                except ConnectionLost:
                    raise ConnectionLost(
                        f"logs --follow {run_id}: the connection to {where} broke and could "
                        f"not be made again within {reconnect_s:g} s"
                    ) from None
                current.timeout_s = client.timeout_s  # its requests: the CLI's own timeout
                err_console.print("note: connected again; following on")


class LogPrinter:
    """Prints a run's output chunks: stdout's to stdout, stderr's to stderr, as text.

    A chunk ends wherever the worker's read ended, often inside a multi-byte UTF-8
    character; each stream is therefore decoded incrementally, a character split between
    chunks printed whole with the later one. Only bytes that are really invalid UTF-8 become
    U+FFFD: a partial character at the end of an attempt's output, at a ``cut`` (bytes were
    dropped there) or at the end of the output, and invalid sequences. With ``as_json`` one
    JSON object per chunk, its ``data`` the text decoded the same way (so the ``data`` of a
    stream's chunks, joined, is its text).

    Attempts: as text, a line ``--- attempt N ---`` goes to stdout before the output of every
    attempt but a first one numbered 1 (so the log of a run that ran once is its output
    alone, and a log whose first attempt shown is not 1 says so). It goes to stdout, as the
    ``cut`` marker does, so that a log saved with ``> FILE`` keeps it, and on a terminal it
    sits where the attempts meet (the streams are printed in the node's order, each write
    flushed). With ``as_json`` nothing is added: every chunk carries its ``attempt``.
    """

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.decoders = {
            stream: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for stream in ("stdout", "stderr")
        }
        self.attempt: int | None = None
        self._stdout_line_open = False  # the last text on stdout did not end a line

    def _flush(self) -> None:
        """End every stream's text here: what a decoder holds is an incomplete character (in
        JSON, an object of its own: ``stream``, ``attempt`` and ``data``, without ``seq``)."""
        for stream, decoder in self.decoders.items():
            rest = decoder.decode(b"", final=True)
            if rest and self.as_json:
                print(json.dumps({"stream": stream, "attempt": self.attempt, "data": rest}))
            elif rest:
                self._write(stream, rest)

    def _write(self, stream: str, text: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        target.write(text)
        target.flush()
        if stream == "stdout" and text:
            self._stdout_line_open = not text.endswith("\n")

    def chunk(self, chunk: dict[str, Any]) -> None:
        """Print one chunk of a ``run.logs`` page."""
        if chunk["stream"] == "cut":
            # A marker belongs to no attempt (its ``attempt`` is 0): it neither starts one nor
            # ends the one being printed (found by review: a run that ran once, with output
            # cut, printed "--- attempt 0 ---" and "--- attempt 1 ---" around its marker).
            self._flush()
            if self.as_json:
                print(json.dumps(chunk, default=_json_default))
            else:
                self._write("stdout", f"\n[... {chunk['dropped']} bytes cut ...]\n")
            return
        if chunk.get("attempt") != self.attempt:
            self._flush()  # a new attempt's output never completes the last one's text
            first = self.attempt is None
            self.attempt = chunk.get("attempt")
            if not self.as_json and not (first and self.attempt == 1):
                # Found by the fifth adversarial pass: a retried run's attempts ran together.
                lead = "\n" if self._stdout_line_open else ""
                self._write("stdout", f"{lead}--- attempt {self.attempt} ---\n")
        decoder = self.decoders.get(chunk["stream"])
        data = bytes(chunk["data"] or b"")
        text = decoder.decode(data) if decoder is not None else data.decode("utf-8", "replace")
        if self.as_json:
            print(json.dumps({**chunk, "data": text}, default=_json_default))
        elif text:
            self._write(chunk["stream"], text)

    def close(self) -> None:
        """The output ended: what is left of an incomplete character is printed as U+FFFD."""
        self._flush()


CLIENT_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]] = {
    "submit": cmd_submit,
    "job": cmd_job,
    "jobs": cmd_jobs,
    "runs": cmd_runs,
    "skips": cmd_skips,
    "run": cmd_run,
    "logs": cmd_logs,
}


# =============================================================================== node, worker


def _duration_ms_or_zero(text: str, field: str) -> int:
    """An option's duration in ms (:func:`engine.schedules.parse_duration`), where ``0``
    (``0s``, ``0ms``) is allowed too: "none". Raises its :class:`EngineUsageError`."""
    from engine.schedules import parse_duration

    if text.strip() in ("0", "0s", "0ms"):
        return 0
    return parse_duration(text, field=field)


def serve(args: argparse.Namespace) -> int:
    """Run a node until SIGTERM/SIGINT. A node that cannot start (a data directory that is not
    a directory or is of another shape, an address it cannot listen on: a port in use, a host
    that is no address of this machine) prints one line and exits with status 2, without a
    traceback; failures after it started serving keep theirs."""
    from dataclasses import replace

    from cluster.node import NODE_ENGINE_CONFIG, Node, NodeError
    from engine.errors import EngineUsageError
    from engine.schedules import parse_duration

    def refuse(message: str) -> int:
        err_console.print(f"[red]error[/red] {escape(message)}")
        return 2

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = NODE_ENGINE_CONFIG
    try:
        if args.worker_lease is not None:
            lease = parse_duration(args.worker_lease, field="--worker-lease")
            config = replace(config, worker_lease_ms=lease, reattach_grace_ms=2 * lease)
        if args.fire_ahead is not None:
            ahead = _duration_ms_or_zero(args.fire_ahead, "--fire-ahead")
            config = replace(config, fire_ahead_ms=ahead)
    except EngineUsageError as exc:
        return refuse(str(exc))
    if not 0 <= args.port <= 65535:
        return refuse(f"--port must be in 0..65535, got {args.port}")
    if os.path.exists(args.data) and not os.path.isdir(args.data):
        return refuse(f"--data {args.data}: not a directory")
    # Listen once before the node opens its data directory: opening it creates the directory
    # and bumps its epoch, which a node that then cannot listen must not have done. (A port
    # taken between this probe and the node's own listen still fails below, cleanly, but
    # after the bump: the node opens its stores before it listens, so that it never accepts
    # a connection it cannot serve.)
    problem = _cannot_listen(args.host, args.port)
    if problem is not None:
        return refuse(f"cannot listen on {args.host}:{args.port}: {problem}")
    node = Node(
        args.data,
        host=args.host,
        port=args.port,
        shards=args.shards,
        config=config,
        freeze_recovered=True,
    )
    started = False

    async def main() -> None:
        nonlocal started
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            started = True

    try:
        trio.run(main)
    except BaseException as exc:  # sorted below: only failures to start are ours to word
        leaves = _leaves(exc)
        if not started and leaves and all(isinstance(e, NodeError | OSError) for e in leaves):
            return refuse("; ".join(_describe(e) for e in leaves))
        if len(leaves) == 1 and leaves[0] is not exc:
            raise leaves[0] from None  # one failure: its own traceback, not a group's
        raise
    return 0


def _cannot_listen(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on right now (None: it can), found by opening and
    closing the listeners the node would open (the same Trio call, so the same addresses)."""

    async def probe() -> None:
        for listener in await trio.open_tcp_listeners(port, host=host):
            await listener.aclose()

    try:
        trio.run(probe)
    except OSError as exc:
        return _describe(exc)
    return None


def _describe(exc: BaseException) -> str:
    """An OS error as its message (``Address already in use``), else the exception's text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return str(exc) or type(exc).__name__


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however nested (``[exc]`` for one that is
    not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def work(args: argparse.Namespace) -> int:
    """Run a worker until SIGTERM/SIGINT. The first signal stops it gracefully
    (:meth:`WorkerAgent.stop`: no new runs, running tasks get ``--drain`` to finish, what is
    left is stopped and reported, exit 0 once the node has the reports); a second one cuts
    the drain short; a third exits at once (tasks SIGKILLed, nothing reported). A mistake on
    the command line prints one line and exits 2; a node that cannot be reached within
    ``--connect-timeout`` (each failed attempt is logged), or that refuses the worker, one
    line and exit 1."""
    import signal
    from functools import partial

    from cluster.worker import WorkerAgent, WorkerError
    from engine.errors import EngineUsageError

    def refuse(message: str, status: int = 2) -> int:
        err_console.print(f"[red]error[/red] {escape(message)}")
        return status

    def seconds(text: str, field: str) -> float:
        return _duration_ms_or_zero(text, field) / 1000

    address, source = connect_address(args)
    try:
        host, port = parse_address(address)
    except ClientError as exc:
        return refuse(f"{source}: {exc}")
    tiers = tuple(args.tier or ["default"])
    if not all(tiers):
        return refuse("--tier: a tier name must not be empty")
    if args.slots > MAX_WORKER_SLOTS:
        return refuse(f"--slots: at most {MAX_WORKER_SLOTS:,}")
    try:
        drain_s = seconds(args.drain, "--drain")
        connect_timeout_s = seconds(args.connect_timeout, "--connect-timeout")
    except EngineUsageError as exc:
        return refuse(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("tickwheel.worker")
    agent = WorkerAgent(
        host,
        port,
        worker_id=args.id,
        tiers=tiers,
        slots=args.slots,
        container_runtime=args.runtime,
        connect_timeout_s=connect_timeout_s,
    )

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    await agent.run()
                    nursery.cancel_scope.cancel()  # ended by the graceful stop

                nursery.start_soon(serve)
                received = 0
                async for signum in signals:
                    received += 1
                    name = signal.Signals(signum).name
                    if not agent.serving:
                        log.info("%s before the worker served: exiting", name)
                        nursery.cancel_scope.cancel()
                        break
                    if received == 1:
                        log.info("%s: stopping gracefully (again: skip the drain)", name)
                        nursery.start_soon(partial(agent.stop, drain_s))
                    elif received == 2:
                        log.info("%s again: skipping the drain", name)
                        agent.skip_drain()
                    else:
                        log.warning(
                            "%s a third time: exiting now, tasks SIGKILLed unreported", name
                        )
                        nursery.cancel_scope.cancel()
                        break

    # What the process holds once started (its modules, the agent) is frozen out of the
    # collector's full passes, as a node does with what it recovered (Node.run): a full pass
    # then scans what the worker made since, not every import, and pauses its loop (its
    # heartbeats, the dispatches it reads) far less (measured with `tickwheel bench lateness`,
    # whose agents share a process: full passes of ~22 ms every ~9 s at 1,000 runs a second).
    gc.collect()
    gc.freeze()
    try:
        trio.run(main)
    except BaseException as exc:  # sorted below: only failures to serve are ours to word
        leaves = _leaves(exc)
        if leaves and all(isinstance(e, WorkerError) for e in leaves):
            return refuse("; ".join(str(e) for e in leaves), 1)
        if len(leaves) == 1 and isinstance(leaves[0], RemoteError):
            return refuse(f"the node refused the worker: {leaves[0]}", 1)
        if len(leaves) == 1 and leaves[0] is not exc:
            raise leaves[0] from None
        raise
    return 0
