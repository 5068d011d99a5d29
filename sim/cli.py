"""Options and entry point of ``tickwheel sim``.

Owns argument parsing for the simulation only. Must stay cheap to import (the CLI builds its
parser from it on every call): SimPy, the engine, rich and matplotlib are imported inside
:func:`run`.

Exit status: 0 when every check held; 1 when a check failed. With ``--mutant``, the other way
round: 0 when the mutant was caught (the run stops at the first violating seed), 1 when it
was not, since a checker that catches nothing proves nothing. 2 for bad options.
"""

from __future__ import annotations

import argparse
import os
import sys

from cluster.options import positive_int
from sim.names import FAULTS, MUTANTS


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 168:
        raise argparse.ArgumentTypeError(f"must be in (0, 168]: {text!r}")
    return value


def _faults(text: str) -> frozenset[str]:
    names = {part.strip() for part in text.split(",") if part.strip()}
    if "all" in names:
        return frozenset(FAULTS)
    unknown = names - set(FAULTS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}, all"
        )
    return frozenset(names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="first seed (default 1)")
    parser.add_argument(
        "--seeds", type=positive_int, default=1, metavar="N", help="run seeds S..S+N-1 (default 1)"
    )
    parser.add_argument("--nodes", type=positive_int, default=3, metavar="N", help="default 3")
    parser.add_argument("--workers", type=positive_int, default=6, metavar="N", help="default 6")
    parser.add_argument(
        "--jobs", type=positive_int, default=2_000, metavar="N", help="default 2,000"
    )
    parser.add_argument(
        "--hours", type=_hours, default=2.0, metavar="H", help="simulated hours (default 2)"
    )
    parser.add_argument(
        "--faults",
        type=_faults,
        default=frozenset(),
        metavar="LIST",
        help=f"comma-separated, or 'all': {','.join(FAULTS)} (default none)",
    )
    parser.add_argument(
        "--mutant",
        choices=MUTANTS,
        metavar="NAME",
        help=f"switch one guard off: {', '.join(MUTANTS)}; stops at the first violating seed",
    )
    parser.add_argument(
        "--procs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="P",
        help="run several seeds in P processes at once; the output is the same for any P "
        "(default: the machine's cores)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--report", metavar="DIR", help="write summary.json, summary.md and PNG plots to DIR"
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sim.config import SimConfig, SimConfigError
    from sim.report import print_summary, to_json, write_report
    from sim.runner import Summary, run_seeds
    from sim.world import SeedResult

    try:
        config = SimConfig(
            seed=args.seed,
            nodes=args.nodes,
            workers=args.workers,
            jobs=args.jobs,
            hours=args.hours,
            faults=args.faults,
            mutant=args.mutant,
            samples=args.report is not None,
        )
    except SimConfigError as error:
        print(f"tickwheel sim: {error}", file=sys.stderr)
        return 2

    # A bar when it is worth one: several seeds, or one long seed, on a terminal. rich is
    # imported only when something is shown with it (a tenth of a second of a short run).
    long_run = args.seeds > 1 or args.jobs * args.hours > 20_000
    summary: Summary
    if long_run:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        err = Console(stderr=True)
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
            disable=not err.is_terminal,
        ) as progress:
            task = progress.add_task("seeds", total=args.seeds)
            bad = 0

            def on_seed(result: SeedResult) -> None:
                nonlocal bad
                bad += bool(result.violations)
                progress.update(
                    task, advance=1, description=f"seed {result.seed} ({bad} violating)"
                )

            summary = run_seeds(config, args.seeds, on_seed=on_seed, procs=args.procs)
    else:
        summary = run_seeds(config, args.seeds, procs=args.procs)

    if args.report is not None:
        for path in write_report(summary, Path(args.report)):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(to_json(summary))
    else:
        from rich.console import Console

        print_summary(summary, Console())
    if config.mutant is not None:
        return 0 if summary.stopped_at is not None else 1
    return 1 if summary.violations else 0
