"""cluster.watchdog: the guard's pure decisions (with a hypothesis model), the guard process on
its own (real processes, a real pipe), and a real node and worker whose worker is SIGKILLed,
stopped, or loses its guard."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.client import Client
from cluster.runner import _group_alive, container_client_env, guard_marker
from cluster.watchdog import (
    Announce,
    Done,
    Fence,
    MessageError,
    Spawned,
    Watch,
    format_announce,
    format_done,
    format_fence,
    format_spawned,
    hunt,
    may_kill,
    parse_line,
    parse_start_time,
)
from cluster.watchdog_link import GUARD_ARGV
from tests.cluster.procs import NodeProc, WorkerProc, wait_until, with_client

pytestmark = pytest.mark.timeout(120)

MARKER = (b"TICKWHEEL_RUN_ID=j@1", b"TICKWHEEL_FENCE=7")


# --------------------------------------------------------------------------------------------
# Pure decisions


def test_lines_round_trip() -> None:
    box = ("/usr/bin/docker", "tickwheel-j-abc", "")
    with_env = ("docker", "tickwheel-j-abc", "DOCKER_HOST=tcp://h:2375\0HOME=/home/x y")
    assert parse_line(format_announce(3, MARKER, None)[:-1]) == Announce(3, MARKER)
    assert parse_line(format_announce(4, MARKER, box)[:-1]) == Announce(4, MARKER, box)
    assert parse_line(format_announce(4, MARKER, with_env)[:-1]) == Announce(4, MARKER, with_env)
    assert parse_line(format_spawned(5, 1234)[:-1]) == Spawned(5, 1234)
    assert parse_line(format_done(5)[:-1]) == Done(5)
    assert parse_line(format_fence(123_456_789)[:-1]) == Fence(123_456_789)
    # a run id with spaces or newlines cannot break a line: the marker goes as hex
    odd = (b"TICKWHEEL_RUN_ID=a b\nc@1",)
    assert parse_line(format_announce(1, odd, None)[:-1]) == Announce(1, odd)


@pytest.mark.parametrize(
    "line",
    [b"", b"A", b"X 1", b"A 1", b"A x 6162", b"A 1 zz", b"A 1 6162 00", b"S 1", b"S 1 1",
     b"S 1 0", b"S 1 -5", b"S -1 9", b"D", b"D 1 2", b"A 1 61000062", b"A 1 6100", b"A 1 6162 " + b"ff" * 3 + b" 61", b"F", b"F x", b"F 1 2"],
)  # fmt: skip
def test_malformed_lines_are_refused(line: bytes) -> None:
    with pytest.raises(MessageError):
        parse_line(line)


def test_format_refuses_a_bad_marker() -> None:
    with pytest.raises(ValueError):
        format_announce(1, (), None)
    with pytest.raises(ValueError):
        format_announce(1, (b"A=\0",), None)


def test_may_kill_only_the_leader_it_recorded_or_a_group_without_one() -> None:
    assert may_kill(100, 100)
    assert may_kill(100, None)  # leader gone: the group (if any) kept the id reserved
    assert may_kill(None, None)
    assert not may_kill(100, 200)  # the pid was given out again: not ours
    assert not may_kill(None, 200)


def test_parse_start_time_counts_from_the_last_parenthesis() -> None:
    fields = ["S", *map(str, range(4, 60))]  # field 3 is the state; 22 is fields[19]
    text = "42 (a) b (c)) " + " ".join(fields)
    assert parse_start_time(text) == 22
    assert parse_start_time("garbage") is None
    assert parse_start_time(f"1 (x) {' '.join(fields[:10])}") is None
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert isinstance(parse_start_time(f.read()), int)


def test_hunt_needs_every_entry_of_a_marker() -> None:
    procs = [
        (10, 10, b"A=1\0" + b"\0".join(MARKER) + b"\0"),
        (11, 10, b"\0".join(MARKER)),
        (12, 12, MARKER[0] + b"\0TICKWHEEL_FENCE=8\0"),  # another attempt of the run
        (13, 13, b""),
    ]
    assert hunt([MARKER], procs) == {10, 11}
    assert hunt([], procs) == set()


def test_the_marker_is_the_run_id_and_the_fence() -> None:
    env = {"TICKWHEEL_RUN_ID": "j@1", "TICKWHEEL_FENCE": "7", "PATH": "/bin"}
    assert guard_marker(env) == MARKER


# A simple model: key -> None (announced) or its pgid (registered).
_ops = st.lists(
    st.tuples(
        st.sampled_from(["A", "S", "D", "F", "fence"]),
        st.integers(0, 6),
        st.integers(2, 9),
        st.booleans(),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_watch_follows_a_simple_model(ops: list[tuple[str, int, int, bool]]) -> None:
    """Through the wire format: what end-of-file kills is exactly the model's registered
    groups and announced tasks; the fence deadline applies only while something is
    registered, and acting on it kills everything and forgets it with the deadline; a replay
    (``lines``) rebuilds the same state."""
    watch = Watch()
    model: dict[int, tuple[int | None, bool]] = {}
    deadline: int | None = None
    for kind, key, pgid, boxed in ops:
        box = ("docker", f"c{key}", "") if boxed else None
        if kind == "fence":  # the guard acts on its deadline (not a line)
            before = (set(watch.doom().groups), len(watch.doom().markers))
            doomed = watch.fence_now()
            assert (set(doomed.groups), len(doomed.markers)) == before
            model, deadline = {}, None
            assert not watch.doom() and watch.wait_ms(0) is None
            continue
        if kind == "F":
            line = format_fence(key * 1000)
            deadline = key * 1000
        elif kind == "A":
            line = format_announce(key, (b"R=%d" % key, b"F=1"), box)
            model[key] = (None, boxed)
        elif kind == "S":
            line = format_spawned(key, pgid)
            if key in model:
                model[key] = (pgid, model[key][1])
        else:
            line = format_done(key)
            model.pop(key, None)
        message = parse_line(line.rstrip(b"\n"))
        watch.apply(message, start=pgid * 10 if isinstance(message, Spawned) else None)
        watch._check()
        doom = watch.doom()
        assert set(doom.groups) == {p for p, _ in model.values() if p is not None}
        assert all(doom.groups[p] == p * 10 for p in doom.groups)
        assert sorted(doom.markers) == sorted(
            (b"R=%d" % k, b"F=1") for k, (p, _) in model.items() if p is None
        )
        assert len(doom.containers) == sum(b for _, b in model.values())
        assert bool(doom) == bool(model)
        expected_wait = None if deadline is None or not model else max(0, deadline - 2500)
        assert watch.wait_ms(2500) == expected_wait
        again = Watch()
        for replayed in watch.lines():
            again.apply(parse_line(replayed.rstrip(b"\n")))
        assert {k: (t.pgid, t.marker, t.container) for k, t in again.tasks.items()} == {
            k: (t.pgid, t.marker, t.container) for k, t in watch.tasks.items()
        }
        assert again.fence_at == watch.fence_at == deadline


# --------------------------------------------------------------------------------------------
# The guard process alone


def _live(pid: int) -> bool:
    return _group_alive(pid)


def _sleeper(env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen(["sleep", "300"], start_new_session=True, env=env)


@pytest.fixture
def guard() -> Iterator[tuple[subprocess.Popen[bytes], Any]]:
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(list(GUARD_ARGV), stdin=read_end, stderr=subprocess.PIPE)
    os.close(read_end)
    pipe = os.fdopen(write_end, "wb", buffering=0)
    try:
        yield proc, pipe
    finally:
        if not pipe.closed:
            pipe.close()
        proc.kill()
        proc.wait()


def test_guard_kills_registered_groups_at_eof_and_not_finished_ones(guard: Any) -> None:
    proc, pipe = guard
    kept, doomed = _sleeper(), _sleeper()
    try:
        pipe.write(format_announce(1, MARKER, None) + format_spawned(1, doomed.pid))
        pipe.write(format_announce(2, (b"X=1",), None) + format_spawned(2, kept.pid))
        pipe.write(format_done(2) + b"garbage line\n")
        pipe.close()
        assert proc.wait(10) == 0
        assert doomed.wait(10) == -signal.SIGKILL
        assert kept.poll() is None
        err = proc.stderr.read().decode()
        assert f"SIGKILLed task process groups {doomed.pid}" in err and "malformed" in err
    finally:
        kept.kill()
        kept.wait()
        doomed.kill()
        doomed.wait()


def test_guard_finds_a_task_announced_but_not_registered(guard: Any) -> None:
    """The window between the spawn and its registration: the worker died after ``A``,
    before ``S``. The guard finds the task by its environment."""
    proc, pipe = guard
    other = _sleeper({"TICKWHEEL_RUN_ID": "j@1", "TICKWHEEL_FENCE": "8"})  # another attempt
    unregistered = _sleeper({"TICKWHEEL_RUN_ID": "j@1", "TICKWHEEL_FENCE": "7"})
    try:
        pipe.write(format_announce(1, MARKER, None))
        pipe.close()
        assert proc.wait(10) == 0
        assert unregistered.wait(10) == -signal.SIGKILL
        assert other.poll() is None
        assert f"unregistered tasks {unregistered.pid}" in proc.stderr.read().decode()
    finally:
        for p in (other, unregistered):
            p.kill()
            p.wait()


def test_guard_kills_registered_groups_at_the_fence_deadline_and_carries_on(guard: Any) -> None:
    """A worker that says nothing by its fence deadline (stopped, its loop blocked) cannot
    fence itself: the guard kills its tasks then, without end-of-file, and goes on guarding
    what the worker registers afterwards (it may run again)."""
    proc, pipe = guard
    doomed, later = _sleeper(), _sleeper()
    try:
        now_ms = time.monotonic_ns() // 1_000_000
        pipe.write(format_announce(1, MARKER, None) + format_spawned(1, doomed.pid))
        pipe.write(format_fence(now_ms + 300))
        assert doomed.wait(10) == -signal.SIGKILL
        assert proc.poll() is None  # still guarding
        # The worker again: a new deadline, a new task; end-of-file still kills what it holds.
        now_ms = time.monotonic_ns() // 1_000_000
        pipe.write(format_fence(now_ms + 60_000))
        pipe.write(format_announce(2, (b"X=1",), None) + format_spawned(2, later.pid))
        time.sleep(0.3)
        assert later.poll() is None
        pipe.close()
        assert proc.wait(10) == 0
        assert later.wait(10) == -signal.SIGKILL
        err = proc.stderr.read().decode()
        assert f"passed its fence deadline: SIGKILLed task process groups {doomed.pid}" in err
        assert f"is gone: SIGKILLed task process groups {later.pid}" in err
    finally:
        for p in (doomed, later):
            p.kill()
            p.wait()


def test_a_container_a_fence_could_not_remove_is_removed_again_at_eof(tmp_path: Path) -> None:
    """The fence's ``rm -f`` failed (the daemon down): forgotten with its task, the container
    ran on for good (found by review). It is tried again at end-of-file."""
    runtime = tmp_path / "fakedocker"
    log = tmp_path / "rm.log"
    runtime.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    runtime.chmod(0o755)
    leader = _sleeper()
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(list(GUARD_ARGV), stdin=read_end, stderr=subprocess.PIPE)
    os.close(read_end)
    pipe = os.fdopen(write_end, "wb", buffering=0)
    try:
        pipe.write(format_announce(1, MARKER, (str(runtime), "tw-box", "")))
        pipe.write(format_spawned(1, leader.pid))
        pipe.write(format_fence(time.monotonic_ns() // 1_000_000 + 200))
        assert leader.wait(10) == -signal.SIGKILL  # fenced; its rm -f fails
        wait_until(lambda: log.exists() and log.read_text().count("rm -f tw-box") == 1)
        pipe.close()  # the worker goes: the container may still run
        assert proc.wait(20) == 0
        assert log.read_text().count("rm -f tw-box") == 2
        assert "could not remove tw-box" in proc.stderr.read().decode()
    finally:
        if not pipe.closed:
            pipe.close()
        leader.kill()
        leader.wait()
        proc.kill()
        proc.wait()


def test_a_deadline_renewed_in_time_kills_nothing(guard: Any) -> None:
    proc, pipe = guard
    task = _sleeper()
    try:
        pipe.write(format_announce(1, MARKER, None) + format_spawned(1, task.pid))
        # Renewed every 0.1 s, each 1 s ahead, for 1.2 s (longer than one deadline, so it
        # is the renewals that keep the task): a loaded machine may oversleep a 0.1 s sleep
        # by a few hundred ms, which a deadline 0.4 s ahead did not survive.
        for _ in range(12):
            pipe.write(format_fence(time.monotonic_ns() // 1_000_000 + 1000))
            time.sleep(0.1)
        assert task.poll() is None
        pipe.write(format_done(1))
        pipe.close()
        assert proc.wait(10) == 0
        assert task.poll() is None
    finally:
        task.kill()
        task.wait()


def test_guard_with_nothing_registered_exits_quietly(guard: Any) -> None:
    proc, pipe = guard
    pipe.write(format_announce(1, MARKER, None) + format_spawned(1, 999_999) + format_done(1))
    pipe.close()
    assert proc.wait(10) == 0
    assert proc.stderr.read() == b""


# --------------------------------------------------------------------------------------------
# A real node and a real worker


class Worker(WorkerProc):
    """``tickwheel worker`` ``wd`` with 4 slots, and the guard it started."""

    def __init__(self, port: int, log: Path, *extra: str) -> None:
        super().__init__(port, log, *extra, slots=4, worker_id="wd")

    def guard_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"guard pid (\d+) watches", self.text())]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProc]:
    proc = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="5s")
    yield proc
    proc.kill()


def _create(port: int, *specs: dict[str, Any]) -> None:
    async def body(c: Client) -> None:
        for spec in specs:
            await c.create(spec)

    with_client(port, body)


def _in_s(seconds: float) -> dict[str, str]:
    from engine.schedules import format_utc

    return {"at": format_utc(int((time.time() + seconds) * 1000))}


def _long_tasks(port: int, pids: Path, *job_ids: str) -> list[int]:
    """Jobs whose shell writes its pid (its process group's id) then sleeps 300 s, one
    at-least-once and one at-most-once; returns the pids once both run."""
    task = {"shell": f"echo $$ > {pids}/$TICKWHEEL_JOB_ID.pid; sleep 300; echo done"}
    _create(
        port,
        *(
            {
                "id": job,
                "schedule": _in_s(1),
                "task": task,
                "delivery": "at_most_once" if i % 2 else "at_least_once",
            }
            for i, job in enumerate(job_ids)
        ),
    )

    def written() -> list[int] | None:
        found = [pids / f"{job}.pid" for job in job_ids]
        if all(p.exists() and p.read_text().strip() for p in found):
            return [int(p.read_text()) for p in found]
        return None

    result: list[int] = wait_until(written)
    return result


def _kill_groups(pgids: list[int]) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_sigkilled_workers_tasks_are_killed_by_its_guard(tmp_path: Path, node: NodeProc) -> None:
    """The worker alone is SIGKILLed (not its process group): its guard sees end-of-file and
    SIGKILLs the task groups, so no orphan runs beside the next attempt (at-least-once) or
    behind a LOST run (at-most-once). Without the watchdog the groups live on (checked by
    hand: this test fails)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = Worker(node.port, tmp_path / "worker.log")
    groups: list[int] = []
    try:
        groups = _long_tasks(node.port, pids, "alo", "amo")
        guards = worker.guard_pids()
        assert all(_live(g) for g in groups)
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        wait_until(lambda: not any(_live(g) for g in groups), timeout=10)
        [guard] = guards
        wait_until(lambda: not _live(guard), timeout=10)
        assert "the worker (pid" in worker.text() and "is gone" in worker.text()
    finally:
        worker.kill()
        _kill_groups(groups)


def test_a_clean_stop_still_drains_and_the_guard_exits_quietly(
    tmp_path: Path, node: NodeProc
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = Worker(node.port, tmp_path / "worker.log", "--drain", "0s")
    groups: list[int] = []
    try:
        groups = _long_tasks(node.port, pids, "alo", "amo")
        [guard] = worker.guard_pids()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(60) == 0, worker.text()
        assert not any(_live(g) for g in groups)
        assert not _live(guard)  # the worker reaped it: not even a zombie
        text = worker.text()
        assert "drain over: stopping 2 runs" in text and "stopped: the node has" in text
        assert "is gone" not in text and "watchdog: the guard" not in text  # quiet
    finally:
        worker.kill()
        _kill_groups(groups)


def test_a_worker_whose_guard_is_killed_starts_another_and_its_tasks_run_on(
    tmp_path: Path, node: NodeProc
) -> None:
    """The guard killed from outside: the worker logs it and starts another, told about the
    tasks already running (a replay); the tasks are not disturbed; a later SIGKILL of the
    worker still kills them."""
    pids = tmp_path / "pids"
    pids.mkdir()
    worker = Worker(node.port, tmp_path / "worker.log")
    groups: list[int] = []
    try:
        groups = _long_tasks(node.port, pids, "alo", "amo")
        [first] = worker.guard_pids()
        os.kill(first, signal.SIGKILL)
        pids_seen = wait_until(lambda: len(worker.guard_pids()) == 2 and worker.guard_pids())
        second = pids_seen[1]
        assert f"the guard (pid {first}) exited" in worker.text()
        assert worker.alive() and all(_live(g) for g in groups)
        # a task started after the restart is guarded too
        groups += _long_tasks(node.port, pids, "later")
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        wait_until(lambda: not any(_live(g) for g in groups), timeout=10)
        wait_until(lambda: not _live(second), timeout=10)
    finally:
        worker.kill()
        _kill_groups(groups)


# --------------------------------------------------------------------------------------------
# What the runner tells the guard (a recording fake)


class _Recorder:
    """A :class:`cluster.runner.Guard` that records the calls, and whether the task's
    process existed at each."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def announce(self, marker: tuple[bytes, ...], container: tuple[str, str, str] | None) -> int:
        self.calls.append(("announce", marker, container))
        return 41

    async def announced(self) -> None:
        self.calls.append(("announced",))

    def spawned(self, key: int, pgid: int) -> None:
        self.calls.append(("spawned", key, pgid, _live(pgid)))

    def done(self, key: int) -> None:
        self.calls.append(("done", key))


def _run_guarded(task: dict[str, Any], **kwargs: Any) -> tuple[Any, _Recorder]:
    import trio

    from cluster.runner import RunHandle, run_task
    from tests.cluster.test_runner import ticket

    guard = _Recorder()

    async def sink(stream: str, data: bytes) -> None:
        pass

    async def main() -> Any:
        handle = RunHandle()
        async with trio.open_nursery() as nursery:
            if kwargs.pop("kill", False):

                async def kill() -> None:
                    await handle.wait_started()
                    handle.kill("test")

                nursery.start_soon(kill)
            return await run_task(
                ticket(task), on_output=sink, handle=handle, guard=guard, kill_grace_s=0.2
            )

    return trio.run(main), guard


def test_the_runner_registers_before_the_task_runs_and_unregisters_once_reaped() -> None:
    outcome, guard = _run_guarded({"shell": "exit 3"})
    assert outcome.exit_code == 3
    (a, marker, box), (w,), (s, key, pgid, _), (d, key2) = guard.calls
    assert (a, w, s, d, key, key2, box) == (
        "announce",
        "announced",
        "spawned",
        "done",
        41,
        41,
        None,
    )
    assert marker[0].startswith(b"TICKWHEEL_RUN_ID=nightly-report@")
    assert marker[1].startswith(b"TICKWHEEL_FENCE=")
    assert not _live(pgid)  # done came after the group was over


def test_a_stopped_task_is_unregistered_and_so_is_one_that_never_started() -> None:
    outcome, guard = _run_guarded({"shell": "exec sleep 30"}, kill=True)
    assert outcome.outcome == "killed"
    assert [c[0] for c in guard.calls] == ["announce", "announced", "spawned", "done"]
    outcome, guard = _run_guarded({"command": ["/nonexistent/program"]})
    assert outcome.exit_code == 127
    assert [c[0] for c in guard.calls] == ["announce", "announced", "done"]


def test_the_guard_removes_a_container_with_the_tasks_runtime_settings(
    guard: Any, tmp_path: Path
) -> None:
    """Found by a review: the guard's ``rm -f`` ran with the worker's environment, so a task
    that set ``DOCKER_HOST`` had its container removal sent to another daemon."""
    proc, pipe = guard
    seen = tmp_path / "rm.txt"
    fake = tmp_path / "docker"
    fake.write_text(f'#!/bin/sh\necho "$DOCKER_HOST $*" >> {seen}\n')
    fake.chmod(0o755)
    env = container_client_env(
        {"DOCKER_HOST": "tcp://10.0.0.9:2375", "OTHER": "x", "TICKWHEEL_RUN_ID": "j@1"}
    )
    assert env == "DOCKER_HOST=tcp://10.0.0.9:2375"
    pipe.write(format_announce(1, MARKER, (str(fake), "tickwheel-j-1", env)))
    pipe.write(format_spawned(1, 999_999))  # its runtime client is gone: the container stays
    pipe.close()
    assert proc.wait(20) == 0
    assert seen.read_text() == "tcp://10.0.0.9:2375 rm -f tickwheel-j-1\n"


def test_container_client_env_keeps_what_a_runtime_reads_within_its_bound() -> None:
    env = {
        "DOCKER_CONFIG": "/c",
        "PODMAN_X": "1",
        "CONTAINER_HOST": "unix:///s",
        "HOME": "/h",
        "PATH": "/bin",
        "SECRET": "no",
        "DOCKER_BIG": "x" * 5000,
    }
    assert container_client_env(env).split("\0") == [
        "CONTAINER_HOST=unix:///s",
        "DOCKER_CONFIG=/c",
        "HOME=/h",
        "PATH=/bin",
        "PODMAN_X=1",
    ]  # DOCKER_BIG left out: over the bound
