"""The ``tickwheel`` command line.

Owns argument parsing and printing only; every subcommand delegates to a library module. The
benchmark and simulation packages are imported lazily, so that ``tickwheel serve`` and the client
commands never pay for numpy-heavy benchmark code they do not run.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Final, NoReturn

from cluster import options

# suite name -> (module, one-line description). Each module has
# ``run(args: argparse.Namespace) -> bench.common.SuiteResult``.
BENCH_SUITES: dict[str, tuple[str, str]] = {
    "wheel": ("bench.wheel_suite", "timing wheel vs heapq and SortedList: rates and bytes"),
    "schedules": ("bench.schedules_suite", "next fire times of many cron jobs, cached vs not"),
    "engine": ("bench.engine_suite", "one shard engine: creates, fires and bytes per pending job"),
    "store": ("bench.store_suite", "shard store: group commit, recovery and bytes on disk"),
    "submit": ("bench.submit_suite", "durable submits per second over TCP to a real node"),
    "lateness": ("bench.lateness_suite", "how late runs fire at 1,000 fires per second"),
    "dispatch": ("bench.dispatch_suite", "payload runs executed end to end per second"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors under ``--json`` are one JSON object on stdout
    (code ``usage``, status 2), as every other error of a command asked for JSON is: a
    script reading stdout gets an object, not usage text on stderr (found by review). Its
    subcommands' parsers are of this class too (argparse's default ``parser_class``)."""

    #: set by :func:`_main` from the raw arguments: the error may come before ``--json`` is
    #: parsed (options that exclude each other, a bad choice)
    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            import json

            error = {"code": "usage", "message": f"{self.prog}: {message}", "field": None}
            print(json.dumps({"error": error}))
            sys.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tickwheel", description="tickwheel: a distributed job scheduler")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help="run a benchmark suite and print its figures")
    bench_sub = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_module, description) in BENCH_SUITES.items():
        p = bench_sub.add_parser(name, help=description, description=description)
        p.add_argument(
            "--json", action="store_true", help="print one JSON object instead of a table"
        )
        p.add_argument(
            "--pending",
            type=options.positive_int,
            action="append",
            metavar="N",
            help="pending entries to measure at (repeatable; the suite has defaults)",
        )
        p.add_argument(
            "--jobs",
            type=options.positive_int,
            metavar="N",
            help="number of jobs (suites that use it)",
        )

    serve = sub.add_parser("serve", help="run a node on a data directory (embedded default)")
    serve.add_argument("--data", required=True, metavar="DIR", help="the data directory")
    serve.add_argument("--port", type=int, default=7070, help="TCP port (0: any free port)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--shards",
        type=options.positive_int,
        help="shard count of a new data directory (default 2)",
    )
    serve.add_argument(
        "--worker-lease",
        metavar="DUR",
        help="a worker's lease without heartbeats (default 10s; the reattach grace is twice it)",
    )
    serve.add_argument(
        "--fire-ahead",
        metavar="DUR",
        help=(
            "fire jobs this far ahead of their time, durable before it, dispatched at it, so "
            "that a slow disk does not delay them (default 500ms; 0: at their time)"
        ),
    )

    worker = sub.add_parser(
        "worker",
        help="run a worker: pull runs from a node and run them",
        description=(
            "Run a worker: pull runs from a node and run them. SIGTERM or SIGINT stops it "
            "gracefully: it takes no new runs, lets running tasks finish for --drain, then "
            "stops what is left (SIGTERM, a 5 s grace, SIGKILL) and reports it (an "
            "at-most-once run as killed; an at-least-once run is handed back and runs "
            "again elsewhere), waits up to 10 s for the node to acknowledge, and exits 0. "
            "A second signal skips the drain; a third exits at once."
        ),
    )
    options.add_connect(worker, with_json=False)
    worker.add_argument("--tier", action="append", metavar="NAME", help="repeatable")
    worker.add_argument("--slots", type=options.positive_int, default=4, help="tasks at once")
    worker.add_argument("--id", help="worker id (default host-pid)")
    worker.add_argument("--runtime", choices=["docker", "podman"], help="container runtime")
    worker.add_argument(
        "--drain",
        default="30s",
        metavar="DUR",
        help="on SIGTERM/SIGINT, how long running tasks may finish before they are stopped "
        "(default 30s; 0: stop them at once)",
    )
    worker.add_argument(
        "--connect-timeout",
        default="1h",
        metavar="DUR",
        help="give up (exit 1) when the node cannot be reached for this long at start; "
        "each failed attempt is logged (default 1h)",
    )

    submit = sub.add_parser("submit", help="submit a job (or --file: many)")
    options.add_connect(submit)
    submit.add_argument("--id", help="job id (default: a generated, time-sortable one)")
    submit.add_argument("--file", metavar="FILE", help="JSON-lines job specs, in batches")
    options.add_spec_options(submit, update=False)

    job = sub.add_parser("job", help="get, update, cancel, pause, resume or preview a job")
    job_sub = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in ("get", "update", "cancel", "pause", "resume", "preview"):
        p = job_sub.add_parser(action)
        p.add_argument("id", metavar="ID")
        options.add_connect(p)
        if action == "update":
            options.add_spec_options(p, update=True)
            p.add_argument(
                "--if-version",
                type=options.positive_int,
                default=None,
                help="only if the job is at this version (else: conflict, nothing changed)",
            )
        if action == "cancel":
            p.add_argument("--stop-running", action="store_true", help="also stop its runs")
        if action == "preview":
            p.add_argument("--count", type=options.positive_int, default=5)

    jobs = sub.add_parser("jobs", help="list jobs")
    options.add_connect(jobs)

    runs = sub.add_parser("runs", help="run history of jobs")
    runs.add_argument("job_ids", nargs="+", metavar="JOB_ID")
    runs.add_argument("--last", type=options.positive_int, default=20)
    options.add_connect(runs)

    skips = sub.add_parser("skips", help="fire times jobs owed and did not run, and why")
    skips.add_argument("job_ids", nargs="+", metavar="JOB_ID")
    skips.add_argument("--last", type=options.positive_int, default=20)
    options.add_connect(skips)

    run = sub.add_parser("run", help="one run's status")
    run.add_argument("run_id", metavar="RUN_ID")
    options.add_connect(run)

    logs = sub.add_parser("logs", help="a run's output")
    logs.add_argument("run_id", metavar="RUN_ID")
    logs.add_argument("--follow", "-f", action="store_true", help="until the run ends")
    options.add_connect(logs)

    # The simulation owns its options; sim.cli imports SimPy and the engine only inside run().
    sim = sub.add_parser("sim", help="run seeds of the fault-injection simulation")
    importlib.import_module("sim.cli").add_arguments(sim)
    return parser


#: options whose value may start with ``-`` and a digit (a negative duration): argparse takes
#: such a value for an option and says "expected one argument"; given as ``--every=-5s`` it
#: reaches the typed validation, which names the problem
DASH_VALUE_OPTIONS: frozenset[str] = frozenset(
    {
        "--every",
        "--in",
        "--timeout",
        "--worker-lease",
        "--fire-ahead",
        "--at",
        "--port",
        "--count",
        "--last",
        "--drain",
        "--connect-timeout",
    }
)


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``["--every", "-5s"]`` -> ``["--every=-5s"]`` for the options of
    :data:`DASH_VALUE_OPTIONS`, when the value is ``-`` then a digit (never an option name)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if token in DASH_VALUE_OPTIONS and following[:1] == "-" and following[1:2].isdigit():
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tickwheel``; returns the exit status. Output cut short by a reader that went
    away (``tickwheel logs RUN | head``) ends the command quietly with status 1 (as rich
    does for its tables, and as the Python documentation's note on SIGPIPE suggests), not
    with a BrokenPipeError traceback. A compiled module older than its source (``make
    native`` not run after an edit) is one line on stderr and status 2."""
    try:
        return _main(argv)
    except ImportError as exc:
        # engine.StaleCompiledModule (an edited source beside its old compiled module): one
        # line, not the import's traceback. Matched by name: the class cannot be imported once
        # the engine's own import raised it.
        if type(exc).__name__ != "StaleCompiledModule":
            raise
        print(f"tickwheel: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        return _cannot_write(exc)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if all(isinstance(e, BrokenPipeError) for e in leaves):
            _quiet_stdout()
            return 1
        failed = [e for e in leaves if isinstance(e, OSError) and e.errno in _OUTPUT_ERRNOS]
        if failed and len(failed) == len(leaves):
            return _cannot_write(failed[0])
        raise


#: The errors of a write to a file that cannot take it (stdout on a full disk, a device that
#: fails): one line and status 1, not a traceback (found by review). Client commands read no
#: files but ``submit --file``'s, whose errors are told before any of these could arise.
_OUTPUT_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG})


def _cannot_write(exc: OSError) -> int:
    print(f"tickwheel: cannot write the output: {exc.strerror}", file=sys.stderr)
    _quiet_stdout()
    return 1


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter flushes it at exit, and a flush into the
    closed pipe would print another BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _main(argv: Sequence[str] | None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    options_part = raw[: raw.index("--")] if "--" in raw else raw
    # (argparse takes an unambiguous abbreviation, `--jso`, for `--json` too)
    _Parser.json_errors = any(a.startswith("--js") and "--json".startswith(a) for a in options_part)
    args = build_parser().parse_args(join_dash_values(raw))
    if args.command == "bench":
        from bench.common import emit

        module = importlib.import_module(BENCH_SUITES[args.suite][0])
        result = module.run(args)
        emit(result, as_json=args.json)
        return 0
    if args.command in ("serve", "worker"):
        from cluster import commands

        return commands.serve(args) if args.command == "serve" else commands.work(args)
    if args.command in ("submit", "job", "jobs", "runs", "skips", "run", "logs"):
        from cluster import commands

        return commands.run_client_command(args)
    if args.command == "sim":
        run_sim: int = importlib.import_module("sim.cli").run(args)
        return run_sim
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
