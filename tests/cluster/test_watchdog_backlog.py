"""The watchdog link with its guard behind (found by review, 2026-12-04): a task's guard
lines must reach the guard whole, and before the task runs, even when the guard's pipe is full.

1. A line longer than PIPE_BUF (a container task's announcement, with its runtime
   environment) was written in part into a nearly full pipe, the rest dropped: the guard read
   one malformed line in place of the announcement and the spawn report, and did not kill the
   task when the worker died.
2. With the pipe full, the announcement waited in the worker's own memory while the task was
   spawned: a worker killed then left a task the guard (alive, only slow) never heard of.

Each case runs a real worker-side process (``WatchdogLink`` and ``run_task``) that stops its
guard with SIGSTOP, fills the pipe and starts a task. If the task spawns while the guard is
stopped (before the fixes), the process SIGKILLs itself at once; else (the spawn waits for the
guard to catch up) it lets the guard go on, and SIGKILLs itself once the task runs. The test
resumes the guard and checks that it killed the task.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import fcntl, os, signal, struct, sys, termios
    import trio
    from cluster.runner import RunHandle, run_task
    from cluster.watchdog_link import WatchdogLink
    from engine.effects import RunTicket

    CASE, RUNTIME, PIDFILE = sys.argv[1], sys.argv[2], sys.argv[3]

    def pending(fd):
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\\0\\0\\0\\0"))[0]

    async def main():
        link = WatchdogLink()
        async with trio.open_nursery() as nursery:
            await nursery.start(link.supervise)
            await trio.sleep(0.3)
            os.kill(link.pid, signal.SIGSTOP)  # the guard descheduled for a moment
            i = 0
            if CASE == "partial":  # nearly full: room for part of a long line only
                while pending(link._fd) < 15 * 4096 - 1200:
                    link.done(link.announce((b"TICKWHEEL_RUN_ID=o@%d" % i, b"TICKWHEEL_FENCE=1"), None))
                    i += 1
                task = {"container": {"image": "alpine:3", "args": ["sleep", "60"]},
                        "env": {"DOCKER_CONFIG": "/etc/" + "d" * 3800}}
            else:  # full: the next lines wait in this process's backlog
                while link._backlog is None:
                    link.done(link.announce((b"TICKWHEEL_RUN_ID=o@%d" % i, b"TICKWHEEL_FENCE=1"), None))
                    i += 1
                task = {"command": ["sleep", "60"]}
            ticket = RunTicket("box@1795000000123", "box", 1795000000123, 1, (7 << 32) | 19, 1,
                               "at_most_once", "default", None, task, "kill")
            handle = RunHandle()

            async def out(stream, data):
                pass

            with open(PIDFILE + ".guard", "w") as f:
                f.write(str(link.pid))
            nursery.start_soon(lambda: run_task(ticket, on_output=out, handle=handle,
                                                container_runtime=RUNTIME, guard=link))
            with trio.move_on_after(1.0):
                pid = await handle.wait_started()
                # Spawned while the guard cannot have read of it (before the fixes): the
                # worker dies now, the guard still stopped (the test resumes it).
                with open(PIDFILE, "w") as f:
                    f.write(str(pid))
                os.kill(os.getpid(), signal.SIGKILL)
            # The spawn waits for the guard to catch up (the fixes): let it, then die.
            os.kill(link.pid, signal.SIGCONT)
            pid = await handle.wait_started()
            with open(PIDFILE, "w") as f:
                f.write(str(pid))
            os.kill(os.getpid(), signal.SIGKILL)

    trio.run(main)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("case", ["partial", "backlog"])
def test_a_task_started_while_the_guard_is_behind_is_killed_when_the_worker_dies(
    case: str, tmp_path: Path
) -> None:
    runtime = tmp_path / "fakert"  # a runtime client that stays in the foreground
    runtime.write_text("#!/bin/sh\nexec sleep 60\n")
    runtime.chmod(0o755)
    pidfile = tmp_path / "task.pid"
    child = tmp_path / "worker_side.py"
    child.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(child), case, str(runtime), str(pidfile)],
        env=env,
        capture_output=True,
        timeout=40,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    guard = int(Path(f"{pidfile}.guard").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(guard, signal.SIGCONT)  # (stopped still, when the worker died before it read)
    pid = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Before the fixes: still running, the guard having logged a malformed line (1) or
        # read to its end with nothing registered (2).
        assert not _alive(pid), proc.stderr.decode()[-3000:]
        assert b"malformed line" not in proc.stderr
    finally:
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        if _alive(guard):  # (a guard that failed the test: not left behind, stopped or not)
            os.kill(guard, signal.SIGKILL)
