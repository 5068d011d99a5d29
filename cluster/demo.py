"""``make demo``: a node and a worker on a fresh data directory, sample jobs, their runs and logs.

Owns the guided tour only: it starts ``tickwheel serve`` and ``tickwheel worker`` as real
processes on 127.0.0.1 (the port picked by the OS), registers an every-job, a cron job, a
once-job and a job that overruns its timeout with the real CLI, shows what happened with the
real CLI, then stops both processes with SIGTERM and removes the directory.

It checks what it shows, and fails when a check fails: the worker has run a job before the
others are registered (the every-job's first run); by the time the runs are shown, each job has
the runs it should have, in the state it should be (the once-job SUCCESS with its output, the
overrunning job TIMED_OUT, the cron and every-jobs several SUCCESS runs); the logs shown are
the tasks' output; the pause and the cancel took; both processes exit with status 0 after
SIGTERM. A failed check prints one line (``demo failed: ...``) on stderr, after the tail of the
node's and the worker's logs; everything is still stopped and removed, and :func:`main`
returns 1 (2 for a bad :data:`EXPECT_ENV`). Every wait is bounded.

Must never reach into the node: everything it shows and checks comes over the wire, through
the CLI's output (``--json`` where it checks what a table shows), as a user would see it.

Test seam: :data:`EXPECT_ENV` (``TICKWHEEL_DEMO_EXPECT=overrun=SUCCESS,poller=FAILED``)
replaces the run state a sample job's runs must end in, so that a test can make a check
impossible and see the demo fail (``tests/cluster/test_demo.py``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape

from cluster.runner import format_scheduled_at
from engine.runs import FINAL_VALUES

T = TypeVar("T")

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
_SERVING = re.compile(r"serving \d+ shards on [\d.]+:(\d+)")

WORKER_ID = "demo-worker"
#: The run state each sample job's runs must end in; :data:`EXPECT_ENV` replaces some.
EXPECTED_STATES: Mapping[str, str] = {
    "poller": "SUCCESS",
    "heartbeat": "SUCCESS",
    "report": "SUCCESS",
    "overrun": "TIMED_OUT",
}
#: ``JOB=STATE[,JOB=STATE...]``: the state the runs of those sample jobs must end in instead.
EXPECT_ENV = "TICKWHEEL_DEMO_EXPECT"
#: How many runs in their expected state each job must have when the runs are shown. The
#: every-job (3 s) and the cron job (every 4 s) are registered at least 13 s before: five and
#: three fire times at the least, but for the edges of the window; a once-job fires once.
MIN_RUNS: Mapping[str, int] = {"poller": 4, "heartbeat": 3, "report": 1, "overrun": 1}
ONCE_JOBS = frozenset({"report", "overrun"})

RUN_FOR_S = 12.0  # the tour's pause while the jobs run
WORKER_WAIT_S = 20.0  # for the worker to run the every-job's first run (it starts in ~1 s)
RUNS_GRACE_S = 20.0  # after RUN_FOR_S, for runs still under way (a loaded machine) to end
NODE_START_S = 30.0
STOP_WAIT_S = 20.0  # for each process to exit after SIGTERM
CLI_TIMEOUT_S = 30.0  # for one CLI command (it gives up connecting after 10 s itself)
POLL_S = 0.25


class DemoFailed(Exception):
    """A check of the demo failed; the message is the one-line reason printed."""


def expectations(text: str | None) -> dict[str, str]:
    """:data:`EXPECTED_STATES` with the replacements :data:`EXPECT_ENV` gives (``text``);
    :class:`DemoFailed` for an unknown job or a state that is not final (a typo in a test
    must not pass as a demo that checked nothing)."""
    expected = dict(EXPECTED_STATES)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        job_id, sep, state = (part.strip() for part in item.partition("="))
        if not sep or job_id not in expected or state not in FINAL_VALUES:
            raise DemoFailed(
                f"{EXPECT_ENV}: {item.strip()!r} is not JOB=STATE with JOB one of "
                f"{', '.join(expected)} and STATE one of {', '.join(sorted(FINAL_VALUES))}"
            )
        expected[job_id] = state
    return expected


def tickwheel(
    *args: str, show: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one CLI command the way a user would, print it and its output (``show``). A
    command that fails or hangs fails the demo."""
    argv = [sys.executable, "-m", "cluster.cli", *args]
    if show:
        # (soft_wrap: a command stays one line, to be copied, whatever the terminal's width)
        console.print(
            f"\n[bold cyan]$ tickwheel {escape(shlex.join(args))}[/bold cyan]", soft_wrap=True
        )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DemoFailed(
            f"tickwheel {shlex.join(args)} did not end within {CLI_TIMEOUT_S:g} s"
        ) from None
    if show:
        sys.stdout.write(done.stdout)
        sys.stdout.write(done.stderr)
        sys.stdout.flush()
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise DemoFailed(
            f"tickwheel {shlex.join(args)} failed with status {done.returncode}"
            + (f": {said[-1]}" if said else "")
        )
    return done


def as_json(*args: str, env: dict[str, str]) -> Any:
    """A CLI command's ``--json`` output, not printed: what a check reads."""
    out = tickwheel(*args, "--json", show=False, env=env).stdout
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        raise DemoFailed(f"tickwheel {shlex.join(args)} --json printed no JSON: {out!r}") from None


def start_node(data: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    with open(log, "wb") as out:  # (the child has its own copy of the descriptor)
        node = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--data", str(data), "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + NODE_START_S
    while time.monotonic() < deadline:
        found = _SERVING.search(log.read_text())
        if found:
            return node, int(found.group(1))
        if node.poll() is not None:
            raise DemoFailed(f"the node exited with status {node.returncode} before it served")
        time.sleep(0.05)
    node.kill()  # (not serving: nothing of it to stop gracefully)
    node.wait()
    raise DemoFailed(f"the node did not start serving within {NODE_START_S:g} s")


def start_worker(connect: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "worker",
                "--connect",
                connect,
                "--slots",
                "4",
                "--id",
                WORKER_ID,
                # A stop in the middle of a run (a failed check) must end within STOP_WAIT_S:
                # the default drain (30 s) would outlast it, and the worker be killed.
                "--drain",
                "5s",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen[bytes], name: str) -> str | None:
    """SIGTERM ``proc`` and wait for it (``STOP_WAIT_S``, then SIGKILL). Why the stop was not
    clean (it had exited already, it had to be killed, it exited with a status other than 0),
    or None."""
    code = proc.poll()
    if code is not None:
        return f"the {name} had exited before the stop, with status {code}"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        console.print(f"{name} killed")
        return f"the {name} did not exit within {STOP_WAIT_S:g} s of SIGTERM (killed)"
    console.print(f"{name} stopped (exit status {code})")
    if code != 0:
        return f"the {name} exited with status {code} after SIGTERM, not 0"
    return None


def check_alive(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """A process that died in the tour fails it at once, by name (rather than by the CLI's
    ``connection_lost`` 10 s later, or by runs that never come)."""
    for name, proc in procs.items():
        code = proc.poll()
        if code is not None:
            raise DemoFailed(f"the {name} exited during the demo, with status {code}")


def wait_for(
    what: str,
    check: Callable[[], tuple[T | None, str | None]],
    within_s: float,
    procs: Mapping[str, subprocess.Popen[bytes]],
) -> T:
    """Call ``check`` until it returns a value, for at most ``within_s``. ``check`` returns
    ``(value, None)`` when done, ``(None, why_not_yet)`` to be called again, and raises
    :class:`DemoFailed` for what can no longer come right (so that a wrong state fails at
    once, not at the deadline)."""
    deadline = time.monotonic() + within_s
    while True:
        check_alive(procs)
        value, not_yet = check()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise DemoFailed(f"{what}: not within {within_s:g} s ({not_yet})")
        time.sleep(POLL_S)


def describe(run: Mapping[str, Any]) -> str:
    """A run as a reason names it: id, state and why."""
    why = f" ({run['why']})" if run.get("why") else ""
    waiting = f" ({run['waiting']})" if run.get("waiting") else ""
    return f"{run['run_id']} {run['state']}{why}{waiting}"


def runs_problem(
    runs: list[dict[str, Any]], expected: Mapping[str, str]
) -> tuple[str | None, bool]:
    """What is wrong with the sample jobs' ``runs`` (``run.history`` results, as ``runs
    --json`` prints them), and whether it is final: ``(None, False)`` when every job has its
    runs; ``(why, False)`` when some are still to come or to end; ``(why, True)`` when waiting
    cannot help (a run ended in another state, by another worker, or with an exit status
    that does not go with SUCCESS; a once-job ran twice)."""
    not_yet: str | None = None
    for job_id, state in expected.items():
        mine = [r for r in runs if r["job_id"] == job_id]
        for run in mine:
            if run["state"] not in FINAL_VALUES:
                continue
            if run["state"] != state:
                return f"{describe(run)}, expected {state}", True
            if run["worker"] != WORKER_ID:
                return f"{describe(run)} ran on {run['worker']!r}, not {WORKER_ID}", True
            if state == "SUCCESS" and run["exit_code"] != 0:
                return f"{describe(run)} has exit status {run['exit_code']}, not 0", True
        if job_id in ONCE_JOBS and len(mine) > 1:
            ids = ", ".join(r["run_id"] for r in mine)
            return f"the once-job {job_id} has {len(mine)} runs: {ids}", True
        done = sum(1 for r in mine if r["state"] == state)
        if done < MIN_RUNS[job_id] and not_yet is None:
            under_way = "; ".join(describe(r) for r in mine if r["state"] not in FINAL_VALUES)
            not_yet = f"{job_id} has {done} {state} runs of the {MIN_RUNS[job_id]} expected" + (
                f"; under way: {under_way}" if under_way else ""
            )
    return not_yet, False


def expect_output(
    done: subprocess.CompletedProcess[str], run_id: str, stdout: str, stderr: str | None = None
) -> None:
    """The ``logs`` shown of ``run_id`` are its task's output: ``stdout`` at the start of
    its stdout (the end of an overrun's holds the worker's note, which is not ours to fix),
    its stderr ``stderr`` exactly when given."""
    if not done.stdout.startswith(stdout):
        raise DemoFailed(f"logs {run_id}: stdout {done.stdout!r} does not start with {stdout!r}")
    if stderr is not None and done.stderr != stderr:
        raise DemoFailed(f"logs {run_id}: stderr {done.stderr!r}, expected {stderr!r}")


def tour(
    workdir: Path, expected: Mapping[str, str], procs: dict[str, subprocess.Popen[bytes]]
) -> None:
    """The demo itself; the processes it starts go into ``procs`` (worker before node, the
    order they stop in is the reverse), which the caller stops whatever happens."""
    data = workdir / "data"
    console.rule("[bold]tickwheel demo")
    node, port = start_node(data, workdir / "node.log")
    procs["node"] = node
    connect = f"127.0.0.1:{port}"
    console.print(f"node serving {data} on {connect} (embedded default, 2 shards)", soft_wrap=True)
    procs["worker"] = start_worker(connect, workdir / "worker.log")
    console.print(f"worker {WORKER_ID} started with 4 slots")
    env = {**os.environ, "TICKWHEEL_CONNECT": connect}

    console.rule("register four jobs")
    # The every-job first: it fires at once, and its first run ending is how the demo knows
    # the worker is connected (the protocol lists no workers), before the timed jobs go in.
    tickwheel("submit", "--id", "poller", "--every", "3s", "--command", "uname -sr", env=env)

    def first_poller_run() -> tuple[dict[str, Any] | None, str | None]:
        runs: list[dict[str, Any]] = as_json("runs", "poller", env=env)
        ended = [r for r in runs if r["state"] in FINAL_VALUES]
        if not ended:
            return None, "; ".join(describe(r) for r in runs) or "poller has not fired"
        first = ended[-1]  # (newest first)
        if first["state"] != expected["poller"] or first["worker"] != WORKER_ID:
            raise DemoFailed(
                f"the worker's first run: {describe(first)} on {first['worker']!r}, "
                f"expected {expected['poller']} on {WORKER_ID}"
            )
        return first, None

    first = wait_for("the worker's first run", first_poller_run, WORKER_WAIT_S, procs)
    console.print(
        f"worker {WORKER_ID} connected: {first['run_id']} ran on it ({first['state']})",
        soft_wrap=True,
    )
    tickwheel(
        "submit",
        "--id",
        "heartbeat",
        "--cron",
        "*/4 * * * * *",
        "--tz",
        "Europe/Berlin",
        "--shell",
        "echo cron fired at $TICKWHEEL_SCHEDULED_AT",
        env=env,
    )
    tickwheel(
        "submit",
        "--id",
        "report",
        "--in",
        "2s",
        "--shell",
        "echo building the report; seq 1 3; echo done >&2",
        env=env,
    )
    tickwheel(
        "submit",
        "--id",
        "overrun",
        "--in",
        "1s",
        "--shell",
        "echo starting a long task; sleep 30",
        "--timeout",
        "2s",
        "--on-timeout",
        "kill",
        "--delivery",
        "at-most-once",
        env=env,
    )
    tickwheel("job", "preview", "heartbeat", "--count", "3", env=env)

    console.rule(f"let it run for {RUN_FOR_S:g} seconds")
    until = time.monotonic() + RUN_FOR_S
    while time.monotonic() < until:
        check_alive(procs)
        time.sleep(min(POLL_S, max(0.0, until - time.monotonic())))

    def all_runs() -> tuple[list[dict[str, Any]] | None, str | None]:
        runs: list[dict[str, Any]] = as_json("runs", *expected, env=env)
        problem, final = runs_problem(runs, expected)
        if final:
            raise DemoFailed(str(problem))
        return (None, problem) if problem else (runs, None)

    # Shown once checked: a run still under way on a loaded machine gets RUNS_GRACE_S more.
    runs = wait_for("the sample jobs' runs", all_runs, RUNS_GRACE_S, procs)

    def of(job_id: str) -> list[dict[str, Any]]:
        return [r for r in runs if r["job_id"] == job_id and r["state"] == expected[job_id]]

    console.rule("what happened")
    console.print(
        "checked: "
        + ", ".join(f"{job_id} {len(of(job_id))} {expected[job_id]}" for job_id in expected),
        soft_wrap=True,
    )
    tickwheel("jobs", env=env)
    tickwheel("runs", "heartbeat", "poller", "report", "overrun", "--last", "4", env=env)
    report = of("report")[0]["run_id"]
    logs = tickwheel("logs", report, env=env)
    expect_output(logs, report, "building the report\n1\n2\n3\n", "done\n")
    beat = of("heartbeat")[0]
    logs = tickwheel("logs", beat["run_id"], env=env)
    expect_output(
        logs, beat["run_id"], f"cron fired at {format_scheduled_at(beat['scheduled_ms'])}\n"
    )
    overrun = of("overrun")[0]["run_id"]
    tickwheel("run", overrun, env=env)
    logs = tickwheel("logs", overrun, env=env)
    expect_output(logs, overrun, "starting a long task\n")
    tickwheel("job", "pause", "poller", env=env)
    tickwheel("job", "cancel", "heartbeat", env=env)
    jobs = {j["job_id"]: j for j in as_json("jobs", env=env)}
    if not jobs.get("poller", {}).get("paused"):
        raise DemoFailed(f"poller is not paused after job pause: {jobs.get('poller')}")
    if not jobs.get("heartbeat", {}).get("cancelled"):
        raise DemoFailed(f"heartbeat is not cancelled after job cancel: {jobs.get('heartbeat')}")


def tail(log: Path, lines: int = 8) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main() -> int:
    try:
        expected = expectations(os.environ.get(EXPECT_ENV))
    except DemoFailed as exc:
        err_console.print(f"[bold red]demo failed:[/bold red] {escape(str(exc))}", soft_wrap=True)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="tickwheel-demo-"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    problems: list[str] = []
    try:
        tour(workdir, expected, procs)
    except DemoFailed as exc:
        problems.append(str(exc))
    except Exception as exc:  # a bug of the demo's own (a --json shape it misread): still one line
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        console.rule("stop")
        for name in reversed(procs):  # the worker first: its reports reach the node
            problem = stop(procs[name], name)
            if problem:
                problems.append(problem)
        if problems:  # (the logs go with the directory: what they end with, first)
            for name in procs:
                err_console.print(f"--- the end of the {name}'s log ---")
                err_console.out(tail(workdir / f"{name}.log"), highlight=False)
        shutil.rmtree(workdir, ignore_errors=True)
    if problems:
        reason = problems[0] + "".join(f"; also: {p}" for p in problems[1:])
        err_console.print(f"[bold red]demo failed:[/bold red] {escape(reason)}", soft_wrap=True)
        return 1
    console.print("[bold green]demo passed[/bold green]: every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
