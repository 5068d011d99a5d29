"""A worker never runs more tasks at once than its ``--slots``, and runs every one it is owed:
a real node and a real ``tickwheel worker`` on 127.0.0.1, and shell tasks that write when they
start and end, so that the overlap is read from the tasks themselves, not from the node's view
(which could be right while the worker over-runs its credits, or the other way round)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.client import Client
from tests.cluster.procs import NodeProc, WorkerProc, in_s, start_worker, wait_until, with_client

pytestmark = pytest.mark.timeout(90)

SLOTS = 2
JOBS = 7  # more than three slots' worth: the worker must queue, not run them all
TASK_S = 0.6  # long enough that jobs due together overlap when the worker lets them


def _most_at_once(lines: list[str]) -> int:
    """The largest number of tasks between their start and end at one moment, from lines
    ``start|end <ns since the epoch> <job>``; a start and an end at the same instant count the end
    first (the slot was free)."""
    events = sorted((int(ns), 0 if kind == "end" else 1) for kind, ns, _ in map(str.split, lines))
    running = most = 0
    for _ns, starts in events:
        running += 1 if starts else -1
        most = max(most, running)
    return most


def test_a_worker_runs_at_most_its_slots_at_once_and_every_run_it_owes(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    # A lease of 5 s, not 1: a heartbeat late on a loaded machine must not fence the worker
    # and hand its runs out again (a second start line would read as a third task at once).
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="5s")
    worker: WorkerProc | None = None
    try:
        worker = start_worker(node.port, tmp_path / "worker.log", "slots-worker", slots=SLOTS)
        # Each line is one write of under PIPE_BUF bytes with O_APPEND (the shell's >>): lines
        # of tasks running side by side never interleave.
        shell = (
            f'echo "start $(date +%s%N) $TICKWHEEL_JOB_ID" >> {trace}; sleep {TASK_S}; '
            f'echo "end $(date +%s%N) $TICKWHEEL_JOB_ID" >> {trace}'
        )

        async def submit(client: Client) -> None:
            # All due at one moment, a moment after the worker has connected and pulled.
            due = in_s(1.5)
            for i in range(JOBS):
                await client.create({"id": f"slot-{i}", "schedule": due, "task": {"shell": shell}})

        with_client(node.port, submit)

        def ended() -> list[str]:
            if not trace.exists():
                return []
            lines = trace.read_text().splitlines()
            return lines if sum(line.startswith("end ") for line in lines) == JOBS else []

        lines = wait_until(ended, timeout=30)
        assert sorted(line.split()[2] for line in lines if line.startswith("start ")) == sorted(
            f"slot-{i}" for i in range(JOBS)
        )
        # Every slot was used (so the bound is a bound, not an accident of a slow worker) and
        # never more than the slots.
        assert _most_at_once(lines) == SLOTS, lines

        async def states(client: Client) -> list[str]:
            out = []
            for i in range(JOBS):
                out += [run["state"] for run in await client.history(f"slot-{i}")]
            return out

        assert wait_until(lambda: with_client(node.port, states) == ["SUCCESS"] * JOBS)
    finally:
        try:
            if worker is not None:
                worker.terminate()
        finally:
            node.terminate()


def test_the_overlap_count_sees_a_third_task() -> None:
    """The check above can fail: three tasks overlapping are counted as three."""
    lines = ["start 1 a", "start 2 b", "start 3 c", "end 4 a", "end 5 b", "end 6 c"]
    assert _most_at_once(lines) == 3
    assert _most_at_once(["start 1 a", "end 2 a", "start 2 b", "end 3 b"]) == 1
