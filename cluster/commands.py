"""The client and server commands of ``tickwheel``: what each does and how it prints.

Owns turning parsed arguments into requests (through :mod:`cluster.client`), the node and
worker entry points, and the printing (rich tables for people, JSON with ``--json``). Must
never decide anything a node decides; a command is a request and a rendering.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cluster.client import Client, ClientError, RemoteError, parse_address

# Wide when piped, so that run ids are never cut in a log or a demo transcript.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False)


# =============================================================================== arguments


def spec_from_args(args: argparse.Namespace, *, update: bool) -> dict[str, Any]:
    """The (partial, for an update) job spec the options describe."""
    spec: dict[str, Any] = {}
    if args.cron is not None:
        spec["schedule"] = {"cron": args.cron, **({"tz": args.tz} if args.tz else {})}
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
            raise ClientError(f"--in: {exc}") from None
        spec["schedule"] = {"at": format_utc(_now_ms() + delay)}
    elif args.tz is not None:
        raise ClientError("--tz goes with --cron")
    if args.command_line is not None:
        try:
            argv = shlex.split(args.command_line)
        except ValueError as exc:
            raise ClientError(f"--command: {exc}") from None
        spec["task"] = {"command": argv}
    elif args.shell is not None:
        spec["task"] = {"shell": args.shell}
    elif args.payload is not None:
        try:
            spec["task"] = {"payload": json.loads(args.payload)}
        except json.JSONDecodeError as exc:
            raise ClientError(f"--payload is not JSON: {exc}") from None
    for option, key in (("timeout", "timeout"), ("on_timeout", "on_timeout"), ("tier", "tier")):
        value = getattr(args, option)
        if value is not None:
            spec[key] = value
    if args.delivery is not None:
        spec["delivery"] = args.delivery.replace("-", "_")
    if not update:
        if "schedule" not in spec:
            raise ClientError("give a schedule: --cron, --at, --every or --in")
        if "task" not in spec:
            raise ClientError("give a task: --command, --shell or --payload")
    return spec


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
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


def render_job(job: dict[str, Any]) -> None:
    rows = [[k, json.dumps(v) if isinstance(v, dict | list) else v] for k, v in job.items()]
    _table(f"job {job.get('job_id')}", ["field", "value"], rows)


def render_runs(runs: list[dict[str, Any]]) -> None:
    _table(
        "runs",
        ["run id", "state", "scheduled at", "attempt", "exit", "worker", "why"],
        [
            [
                r["run_id"],
                r["state"],
                r["scheduled_at"],
                r["attempt"],
                r["exit_code"],
                r["worker"],
                r["why"],
            ]
            for r in runs
        ],
    )


# =============================================================================== client commands


async def _with_client(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    host, port = parse_address(args.connect)
    async with Client.connect(host, port, timeout_s=10, reconnect=False) as client:
        return await body(client)


def run_client_command(args: argparse.Namespace) -> int:
    """Run a client subcommand; typed errors become a message and exit status 1 (2 for
    usage)."""
    handler = CLIENT_COMMANDS[args.command]
    try:
        return trio.run(_with_client, args, lambda c: handler(c, args))
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
    except ClientError as exc:
        err_console.print(f"[red]error[/red] {escape(str(exc))}")
        return 2 if not isinstance(exc, RemoteError) and "give" in str(exc) else 1


async def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    if args.file is not None:
        return await _submit_file(client, args)
    spec = spec_from_args(args, update=False)
    if args.id is not None:
        spec["id"] = args.id
    job = await client.create(spec)
    emit(args, job, lambda j: console.print(f"{j['job_id']}  next fire {j['next_fire'] or '-'}"))
    return 0


async def _submit_file(client: Client, args: argparse.Namespace) -> int:
    specs: list[dict[str, Any]] = []
    with open(args.file) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    specs.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ClientError(f"{args.file}:{number}: not JSON: {exc}") from None
    ids: list[str | None] = []
    failed = 0
    batch = 1000
    results: list[dict[str, Any]] = [{}] * 0

    async def send(chunk: list[dict[str, Any]], into: list[list[dict[str, Any]]], i: int) -> None:
        into[i] = await client.create_many(chunk)

    chunks = [specs[i : i + batch] for i in range(0, len(specs), batch)]
    out: list[list[dict[str, Any]]] = [[] for _ in chunks]
    async with trio.open_nursery() as nursery:  # pipelined: every batch in flight at once
        for i, chunk in enumerate(chunks):
            nursery.start_soon(send, chunk, out, i)
    for chunk_results in out:
        results.extend(chunk_results)
    for number, r in enumerate(results, 1):
        if r.get("ok"):
            ids.append(r["result"]["job_id"])
        else:
            failed += 1
            ids.append(None)
            e = r.get("error", {})
            err_console.print(escape(f"line {number}: {e.get('code')}: {e.get('message')}"))
    emit(args, ids, lambda v: console.print(f"{len(v) - failed} jobs created, {failed} refused"))
    return 1 if failed else 0


async def cmd_job(client: Client, args: argparse.Namespace) -> int:
    action, job_id = args.action, args.id
    if action == "get":
        result = await client.get(job_id)
    elif action == "update":
        result = await client.update(job_id, spec_from_args(args, update=True))
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
                p["description"],
                ["fire time (UTC)", "local", "note"],
                [[f["utc"], f["local"], f["note"]] for f in p["fires"]],
            ),
        )
        return 0
    emit(args, result, render_job)
    return 0


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


async def cmd_runs(client: Client, args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    for job_id in args.job_ids:
        runs.extend(await client.history(job_id, last=args.last))
    emit(args, runs, render_runs)
    return 0


async def cmd_run(client: Client, args: argparse.Namespace) -> int:
    run = await client.run(args.run_id)
    emit(args, run, lambda r: render_runs([r]))
    return 0


async def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    if args.follow:
        async for chunk in client.follow_logs(args.run_id):
            _print_chunk(args, chunk)
        return 0
    offset = 0
    while True:
        page = await client.logs(args.run_id, offset=offset)
        for chunk in page["chunks"]:
            _print_chunk(args, chunk)
        offset = page["cursor"]
        if page["at_end"]:
            return 0


def _print_chunk(args: argparse.Namespace, chunk: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(chunk, default=_json_default))
    elif chunk["stream"] == "cut":
        sys.stdout.write(f"\n[... {chunk['dropped']} bytes cut ...]\n")
    else:
        target = sys.stdout if chunk["stream"] == "stdout" else sys.stderr
        target.write(chunk["data"].decode("utf-8", "replace"))
        target.flush()


CLIENT_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], Awaitable[int]]] = {
    "submit": cmd_submit,
    "job": cmd_job,
    "jobs": cmd_jobs,
    "runs": cmd_runs,
    "run": cmd_run,
    "logs": cmd_logs,
}


# =============================================================================== node, worker


def serve(args: argparse.Namespace) -> int:
    from cluster.node import Node, NodeError
    from engine.errors import EngineUsageError
    from engine.schedules import parse_duration
    from engine.shard import EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = EngineConfig()
    if args.worker_lease is not None:
        try:
            lease = parse_duration(args.worker_lease, field="--worker-lease")
        except EngineUsageError as exc:
            err_console.print(f"[red]error[/red] {escape(str(exc))}")
            return 2
        config = EngineConfig(worker_lease_ms=lease, reattach_grace_ms=2 * lease)
    node = Node(
        args.data,
        host=args.host,
        port=args.port,
        shards=args.shards,
        config=config,
        freeze_recovered=True,
    )
    try:
        trio.run(node.run)
    except NodeError as exc:
        err_console.print(f"[red]error[/red] {escape(str(exc))}")
        return 2
    return 0


def work(args: argparse.Namespace) -> int:
    from cluster.worker import WorkerAgent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host, port = parse_address(args.connect)
    agent = WorkerAgent(
        host,
        port,
        worker_id=args.id,
        tiers=tuple(args.tier or ["default"]),
        slots=args.slots,
        container_runtime=args.runtime,
    )

    async def main() -> None:
        import signal

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agent.run)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return 0
