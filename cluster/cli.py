"""The ``tickwheel`` command line.

Owns argument parsing and printing only; every subcommand delegates to a library module. The
benchmark and simulation packages are imported lazily, so that ``tickwheel serve`` and the client
commands never pay for numpy-heavy benchmark code they do not run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# suite name -> (module, one-line description). Each module has
# ``run(args: argparse.Namespace) -> bench.common.SuiteResult``.
BENCH_SUITES: dict[str, tuple[str, str]] = {
    "wheel": ("bench.wheel_suite", "timing wheel vs heapq and SortedList: rates and bytes"),
    "schedules": ("bench.schedules_suite", "next fire times of many cron jobs, cached vs not"),
    "engine": ("bench.engine_suite", "one shard engine: creates, fires and bytes per pending job"),
    "store": ("bench.store_suite", "shard store: group commit, recovery and bytes on disk"),
}


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tickwheel", description="tickwheel: a distributed job scheduler"
    )
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
            type=_positive_int,
            action="append",
            metavar="N",
            help="pending entries to measure at (repeatable; the suite has defaults)",
        )
        p.add_argument(
            "--jobs", type=_positive_int, metavar="N", help="number of jobs (suites that use it)"
        )

    # The simulation owns its options; sim.cli imports SimPy and the engine only inside run().
    sim = sub.add_parser("sim", help="run seeds of the fault-injection simulation")
    importlib.import_module("sim.cli").add_arguments(sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from bench.common import emit

        module = importlib.import_module(BENCH_SUITES[args.suite][0])
        result = module.run(args)
        emit(result, as_json=args.json)
        return 0
    if args.command == "sim":
        run_sim: int = importlib.import_module("sim.cli").run(args)
        return run_sim
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
