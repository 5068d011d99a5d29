"""The command line's shared option groups: where to connect, and a job spec's options.

Owns only argparse declarations, so that building the whole ``tickwheel`` parser imports no
network, table or engine code (``tickwheel sim`` and ``bench`` start without Trio and rich).
Must never parse or act on the values: :mod:`cluster.commands` does.
"""

from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, ``_`` and ``,`` allowed as separators."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


#: the node a command talks to when neither ``--connect`` nor ``TICKWHEEL_CONNECT`` names one
DEFAULT_CONNECT = "127.0.0.1:7070"


def add_connect(p: argparse.ArgumentParser, *, with_json: bool = True) -> None:
    p.add_argument(
        "--connect",
        default=None,  # (resolved by connect_address, which knows where the value came from)
        metavar="HOST:PORT",
        help=f"the node to talk to (default $TICKWHEEL_CONNECT or {DEFAULT_CONNECT})",
    )
    if not with_json:
        return
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def connect_address(args: argparse.Namespace) -> tuple[str, str]:
    """The node's address the command line asks for, and where it came from (``--connect``,
    ``TICKWHEEL_CONNECT`` or ``the default``), for an error about it."""
    if args.connect is not None:
        return args.connect, "--connect"
    env = os.environ.get("TICKWHEEL_CONNECT")
    if env is not None:
        return env, "TICKWHEEL_CONNECT"
    return DEFAULT_CONNECT, "the default"


def add_spec_options(p: argparse.ArgumentParser, *, update: bool) -> None:
    when = p.add_mutually_exclusive_group(required=False)
    when.add_argument("--cron", metavar="EXPR", help="a cron expression (5 or 6 fields)")
    when.add_argument("--at", metavar="ISO", help="once, at this instant (ISO 8601 with zone)")
    when.add_argument("--every", metavar="DUR", help="every DUR (e.g. 30s, 5m, 1h)")
    when.add_argument("--in", dest="in_", metavar="DUR", help="once, DUR from now")
    p.add_argument("--tz", metavar="ZONE", help="the cron expression's time zone (IANA)")
    what = p.add_mutually_exclusive_group(required=False)
    what.add_argument(
        "--command",
        dest="command_line",
        metavar="CMD",
        help="run CMD (split like a shell, then run without one)",
    )
    what.add_argument("--shell", metavar="LINE", help="run LINE through /bin/sh")
    what.add_argument(
        "--payload",
        metavar="JSON",
        help="hand JSON to a user worker (Linux caps one argument at 128 KiB: a larger payload "
        "goes in a line of submit --file)",
    )
    p.add_argument("--timeout", metavar="DUR")
    p.add_argument("--on-timeout", metavar="kill|mark|retry:N|trigger:JOB")
    p.add_argument("--delivery", choices=["at-least-once", "at-most-once"])
    p.add_argument("--tier", metavar="NAME")
