"""``tickwheel bench dispatch``: payload runs executed end to end per second.

Owns the workload: a node process on a temporary data directory (two shards) is pre-loaded with
M one-shot jobs due at once (``job.create_many`` batches), then worker processes start, each
running several :class:`cluster.worker.WorkerAgent` (the client library's worker) whose payload
handler returns 0 at once. Every run goes the whole way: fired (its PENDING record durable), claimed
and dispatched, ``worker.started``, ``worker.finished`` (SUCCESS), and the worker's next
``worker.pull``; every state change goes through the node's group commit. The clock runs from
the first dispatch any worker received to the moment the last runs the workers finished are
read back from the node as SUCCESS (so durable); executions per second = M / that time. A sample
of runs is then read back to check each is SUCCESS. Must never judge a figure.

A worker process is this module run as a program (``python -m bench.dispatch_suite worker ...``);
it writes its counters to a small JSON file a few times a second, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from bench.common import Metric, SuiteResult
from bench.node_harness import NodeProcess, python_argv, stop_process
from cluster.client import Client
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.schedules import format_utc

DEFAULT_JOBS = 20_000
PROCESSES = 2  # worker processes
AGENTS = 2  # worker agents (connections) per process
#: Slots per agent, one measurement each. A run's cycle holds a group commit and two hops, so
#: with few runs in flight the node and the workers take turns (each idle while the other
#: works); more in flight lets them overlap and makes every batch larger.
SLOTS_SWEEP = (32, 128)
BATCH = 1_000
PRELOAD_CAP_S = 40.0
RUN_CAP_S = 45.0
SAMPLE = 2_000  # runs read back after the clock stops
TARGET = 10_000


# =============================================================================== worker process


class _Counters:
    def __init__(self) -> None:
        self.done = 0
        self.first_ms = 0.0
        self.last_ms = 0.0
        # The process's CPU seconds at its first dispatch and at its latest acknowledgement.
        self.first_cpu = 0.0
        self.last_cpu = 0.0
        self.recent: list[str] = []  # the last runs this process finished


async def _succeed(ticket: RunTicket, on_output: Callable[[str, bytes], Awaitable[None]]) -> int:
    return 0


class _CountingAgent(WorkerAgent):
    """Notes its first dispatch, and counts a run once its ``worker.finished`` report has been
    answered by the node."""

    def __init__(self, counters: _Counters, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.counters = counters

    def _start(self, ticket: RunTicket) -> None:
        if not self.counters.first_ms:
            self.counters.first_ms = time.time_ns() / 1e6
            self.counters.first_cpu = time.process_time()
        super()._start(ticket)

    def acknowledged(self, rid: str) -> None:
        c = self.counters
        c.done += 1
        c.last_ms = time.time_ns() / 1e6
        c.last_cpu = time.process_time()
        c.recent.append(rid)
        if len(c.recent) > 64:
            del c.recent[:32]


async def _worker(port: int, agents: int, slots: int, stats: Path, tag: str) -> None:
    counters = _Counters()

    def write_stats() -> None:
        tmp = stats.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "done": counters.done,
                    "first_ms": counters.first_ms,
                    "last_ms": counters.last_ms,
                    "cpu_s": counters.last_cpu - counters.first_cpu,
                    "recent": counters.recent[-16:],
                }
            )
        )
        os.replace(tmp, stats)

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            for i in range(agents):
                agent = _CountingAgent(
                    counters,
                    "127.0.0.1",
                    port,
                    worker_id=f"bench-dispatch-{tag}-{i}",
                    slots=slots,
                    payload_handler=_succeed,
                )
                nursery.start_soon(agent.run)

            async def report() -> None:
                while True:
                    write_stats()
                    await trio.sleep(0.1)

            nursery.start_soon(report)
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()
    write_stats()


def worker_main(argv: list[str]) -> int:
    """``worker PORT AGENTS SLOTS STATS_FILE TAG``: serve until SIGTERM."""
    port, agents, slots, stats, tag = argv
    trio.run(_worker, int(port), int(agents), int(slots), Path(stats), tag)
    return 0


# =============================================================================== the benchmark


async def _preload(port: int, count: int) -> float:
    """``count`` one-shot jobs due now, in batches on a few connections; the seconds taken."""
    at = format_utc(int(time.time() * 1000))
    specs = [
        {"id": f"d-{i:08d}", "schedule": {"at": at}, "task": {"payload": i}} for i in range(count)
    ]
    batches = [specs[i : i + BATCH] for i in range(0, count, BATCH)]
    start = time.perf_counter()
    deadline = start + PRELOAD_CAP_S

    async def lane(client: Client) -> None:
        while batches:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"pre-loading {count} jobs took over {PRELOAD_CAP_S} s")
            batch = batches.pop()
            results = await client.request("job.create_many", {"specs": batch}, timeout_s=120)
            bad = [r for r in results["results"] if not r["ok"]]
            if bad:
                raise RuntimeError(f"the node refused a job: {bad[0]}")

    async def connection() -> None:
        async with Client.connect("127.0.0.1", port, reconnect=False) as client:
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(lane, client)

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(connection)
    return time.perf_counter() - start


def _read_stats(files: list[Path]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            out.append({"done": 0, "first_ms": 0.0, "last_ms": 0.0, "cpu_s": 0.0, "recent": []})
    return out


async def _states(port: int, run_ids: list[str]) -> dict[str, str]:
    """The stored state of each run, read on one connection, many requests in flight."""
    states: dict[str, str] = {}
    todo = list(run_ids)

    async with Client.connect("127.0.0.1", port, reconnect=False) as client:

        async def lane() -> None:
            while todo:
                rid = todo.pop()
                states[rid] = (await client.run(rid))["state"]

        async with trio.open_nursery() as nursery:
            for _ in range(min(64, len(run_ids))):
                nursery.start_soon(lane)
    return states


def measure(jobs: int, work_dir: Path, slots: int) -> dict[str, Any]:
    with NodeProcess(shards=2, name="node-dispatch") as node:
        preload_s = trio.run(_preload, node.port, jobs)
        stats_files = [work_dir / f"worker-{p}.json" for p in range(PROCESSES)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for p, stats_file in enumerate(stats_files):
                argv = python_argv(
                    "bench.dispatch_suite",
                    ["worker", str(node.port), str(AGENTS), str(slots), str(stats_file), str(p)],
                    profile_name=f"worker-dispatch-{p}",
                )
                procs.append(subprocess.Popen(argv, start_new_session=True))
            deadline = time.monotonic() + RUN_CAP_S
            done = 0
            node_cpu_start: float | None = None
            while time.monotonic() < deadline:
                stats = _read_stats(stats_files)
                done = sum(s["done"] for s in stats)
                if node_cpu_start is None and any(s["first_ms"] for s in stats):
                    node_cpu_start = node.cpu_s()  # (within one poll of the first dispatch)
                if done >= jobs:
                    break
                if any(proc.poll() is not None for proc in procs):
                    raise RuntimeError("a worker process exited early")
                time.sleep(0.05)
            stats = _read_stats(stats_files)
            # The clock stops once the last runs finished are durable: read them back.
            recent = [rid for s in stats for rid in s["recent"]]
            while True:
                states = trio.run(_states, node.port, recent)
                if all(v == "SUCCESS" for v in states.values()):
                    break
                if time.monotonic() > deadline + 10:
                    raise RuntimeError(f"runs not SUCCESS after the run: {states}")
                time.sleep(0.01)
            end_ms = time.time_ns() / 1e6
            node_cpu_end = node.cpu_s()
        finally:
            for proc in procs:
                stop_process(proc)
        firsts = [s["first_ms"] for s in stats if s["first_ms"]]
        start_ms = min(firsts) if firsts else end_ms
        done = sum(s["done"] for s in stats)
        step = max(1, jobs // SAMPLE)
        sample = [f"d-{i:08d}" for i in range(0, jobs, step)]
        job_states = trio.run(_sample_states, node.port, sample)
    return {
        "done": done,
        "seconds": (end_ms - start_ms) / 1000,
        "preload_s": preload_s,
        "sample": len(sample),
        "sample_success": sum(1 for s in job_states if s == "SUCCESS"),
        "node_cpu_s": None
        if node_cpu_start is None or node_cpu_end is None
        else node_cpu_end - node_cpu_start,
        "worker_cpu_s": sum(s.get("cpu_s", 0.0) for s in stats),
    }


async def _sample_states(port: int, job_ids: list[str]) -> list[str]:
    """The state of each sampled job's (only) run, from its run history."""
    out: list[str] = []
    todo = list(job_ids)
    async with Client.connect("127.0.0.1", port, reconnect=False) as client:

        async def lane() -> None:
            while todo:
                runs = await client.history(todo.pop(), last=1)
                out.append(runs[0]["state"] if runs else "NONE")

        async with trio.open_nursery() as nursery:
            for _ in range(min(64, len(job_ids))):
                nursery.start_soon(lane)
    return out


def run(args: argparse.Namespace) -> SuiteResult:
    jobs = args.jobs or DEFAULT_JOBS
    result = SuiteResult("dispatch")
    for slots in SLOTS_SWEEP:
        with tempfile.TemporaryDirectory(prefix="tickwheel-dispatch-") as work_dir:
            out = measure(jobs, Path(work_dir), slots)
        rate = out["done"] / out["seconds"] if out["seconds"] > 0 else 0.0
        done = max(1, out["done"])
        node_cpu = out["node_cpu_s"]
        result.add(
            Metric(
                "executions_per_s",
                rate,
                "runs/s",
                {
                    "jobs": jobs,
                    "completed": out["done"],
                    "seconds": round(out["seconds"], 3),
                    "worker_processes": PROCESSES,
                    "workers": PROCESSES * AGENTS,
                    "slots": slots,
                    "in_flight": PROCESSES * AGENTS * slots,
                    "sampled": out["sample"],
                    "sampled_success": out["sample_success"],
                    # CPU per run, which other load on the machine barely moves (the rate does):
                    "node_cpu_us_per_run": None
                    if node_cpu is None
                    else round(node_cpu / done * 1e6),
                    "worker_cpu_us_per_run": round(out["worker_cpu_s"] / done * 1e6),
                    "target": TARGET,
                },
            )
        )
        result.add(
            Metric(
                "preload_jobs_per_s",
                jobs / out["preload_s"] if out["preload_s"] > 0 else 0.0,
                "jobs/s",
                {"jobs": jobs, "via": "create_many", "batch": BATCH, "slots": slots},
            )
        )
    sweep = " or ".join(str(s) for s in SLOTS_SWEEP)
    result.notes.extend(
        [
            f"{jobs} one-shot payload jobs due at once; {PROCESSES} worker processes x {AGENTS} "
            f"agents x {sweep} slots (one measurement each, on a fresh node), handler returns 0 "
            "at once; each run fired, claimed, dispatched, started, finished SUCCESS and pulled "
            "again, every state change through the node's group commit",
            "the clock runs from the first dispatch a worker received to the moment the last "
            "finished runs read back SUCCESS from the node",
            f"target: >= {TARGET:,} executions/s; db-scheduler (on PostgreSQL) publishes "
            "10,000-12,000 executions/s with four instances",
        ]
    )
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: python -m bench.dispatch_suite worker PORT AGENTS SLOTS STATS_FILE TAG")
