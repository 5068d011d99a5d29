"""Options and entry point of ``tickwheel sim``.

Owns argument parsing for the simulation only. Must stay cheap to import (the CLI builds its
parser from it on every call): SimPy and the engine are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=1, help="first seed (default 1)")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("tickwheel sim: not built yet (issue 4)")
