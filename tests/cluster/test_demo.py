"""``make demo`` (``python -m cluster.demo``) as a real process: it passes on a healthy system,
and a check that cannot hold (made so through its test seam, ``TICKWHEEL_DEMO_EXPECT``) makes
it fail with one line of reason, a status other than 0, both processes still stopped cleanly
and its directory removed. Also the demo's own checks (:func:`cluster.demo.runs_problem`,
:func:`cluster.demo.stop`) on runs and processes made for them.

Never reaches into a node: the demo starts its own, and these tests read only what the demo
prints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cluster import demo

#: Above the sum of the demo's own bounded waits (node start 30 s, worker 20 s, the tour's
#: 12 s, runs 20 s, CLI calls, two stops of 20 s), so that a slow run ends with the demo's
#: own reason rather than this test's timeout.
DEMO_TIMEOUT_S = 200
pytestmark = pytest.mark.timeout(DEMO_TIMEOUT_S + 60)

ROOT = Path(__file__).resolve().parents[2]
_WORKDIR = re.compile(r"node serving (\S+)/data on")


def run_demo(
    expect: str | None = None, timeout: float = DEMO_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """The demo as ``make demo`` runs it, in a session of its own: on a timeout its whole
    group (the demo, its node and its worker) is killed; the tasks run in sessions of their
    own, and the worker's guard kills those when the worker dies."""
    env = {k: v for k, v in os.environ.items() if k != demo.EXPECT_ENV}
    if expect is not None:
        env[demo.EXPECT_ENV] = expect
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.demo"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the demo did not end within {timeout:g} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def workdir_of(done: subprocess.CompletedProcess[str]) -> Path:
    found = _WORKDIR.search(done.stdout)
    assert found, done.stdout
    return Path(found.group(1))


def stopped_cleanly(done: subprocess.CompletedProcess[str]) -> None:
    assert "worker stopped (exit status 0)" in done.stdout, done.stdout
    assert "node stopped (exit status 0)" in done.stdout, done.stdout
    assert not workdir_of(done).exists()


def failed_demo(expect: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """The demo run with ``expect`` (:data:`cluster.demo.EXPECT_ENV`), which must fail it with
    status 1, everything stopped cleanly: the run and its one line of reason."""
    done = run_demo(expect)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    stopped_cleanly(done)
    return done, failure_line(done)


def failure_line(done: subprocess.CompletedProcess[str]) -> str:
    """The demo's reason: the last line on stderr, and one line."""
    lines = done.stderr.strip().splitlines()
    assert lines, done.stdout
    assert lines[-1].startswith("demo failed: "), done.stderr
    return lines[-1]


@pytest.mark.slow
def test_the_demo_passes_and_shows_its_runs_and_logs() -> None:
    done = run_demo()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert re.search(r"│ overrun@\d+ +│ TIMED_OUT +│", out), out
    assert re.search(r"│ report@\d+ +│ SUCCESS +│", out), out
    assert re.search(r"│ poller@\d+ +│ SUCCESS +│", out), out
    # the once-job's logs (its stderr's line too), the cron job's, the overrun's
    assert "building the report\n1\n2\n3\ndone\n" in out, out
    assert re.search(r"cron fired at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.000Z\n", out), out
    assert "starting a long task\n" in out, out
    assert "worker demo-worker connected: poller@" in out, out
    assert "checked: poller " in out and "overrun 1 TIMED_OUT" in out, out
    assert "demo passed" in out, out
    assert "demo failed" not in done.stderr, done.stderr
    stopped_cleanly(done)


@pytest.mark.slow
def test_a_run_in_another_state_than_expected_fails_the_demo() -> None:
    # The overrun cannot end SUCCESS: its task sleeps 30 s under a 2 s timeout.
    done, line = failed_demo("overrun=SUCCESS")
    assert re.search(r"overrun@\d+ TIMED_OUT .*expected SUCCESS", line), line
    assert "demo passed" not in done.stdout
    assert "what happened" not in done.stdout  # (failed before showing the runs as checked)


@pytest.mark.slow
def test_a_worker_check_that_cannot_hold_fails_the_demo_early() -> None:
    # The every-job's first run is how the demo knows the worker is there: expected FAILED,
    # the SUCCESS it gets fails the demo before the other jobs are registered.
    done, line = failed_demo("poller=FAILED")
    assert re.search(r"first run: poller@\d+ SUCCESS .*expected FAILED", line), line
    assert "--id heartbeat" not in done.stdout
    assert "--- the end of the worker's log ---" in done.stderr


def test_a_bad_expectation_is_refused_before_anything_starts() -> None:
    done = run_demo("overrun=DONE", timeout=30)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert "TICKWHEEL_DEMO_EXPECT" in failure_line(done)
    assert "node serving" not in done.stdout


def test_expectations_replace_only_what_they_name() -> None:
    assert demo.expectations(None) == dict(demo.EXPECTED_STATES)
    assert demo.expectations(" overrun = SUCCESS ,")["overrun"] == "SUCCESS"
    for bad in ("overrun", "nosuch=SUCCESS", "report=RUNNING"):
        with pytest.raises(demo.DemoFailed):
            demo.expectations(bad)


def _run(job_id: str, n: int, state: str, **fields: Any) -> dict[str, Any]:
    run = {
        "run_id": f"{job_id}@{n}",
        "job_id": job_id,
        "state": state,
        "scheduled_ms": n,
        "worker": demo.WORKER_ID,
        "exit_code": 0 if state == "SUCCESS" else None,
        "why": None,
    }
    return {**run, **fields}


def _healthy() -> list[dict[str, Any]]:
    return (
        [_run("poller", n, "SUCCESS") for n in range(5)]
        + [_run("heartbeat", n, "SUCCESS") for n in range(3)]
        + [_run("report", 1, "SUCCESS"), _run("overrun", 1, "TIMED_OUT", exit_code=-15)]
    )


def test_runs_problem_passes_the_runs_a_healthy_demo_has() -> None:
    assert demo.runs_problem(_healthy(), demo.EXPECTED_STATES) == (None, False)


def test_runs_problem_waits_for_runs_still_to_come_or_to_end() -> None:
    runs = [r for r in _healthy() if r["job_id"] != "report"]
    problem, final = demo.runs_problem(runs, demo.EXPECTED_STATES)
    assert not final and problem is not None and "report has 0 SUCCESS" in problem
    runs.append(_run("report", 1, "RUNNING", exit_code=None))
    problem, final = demo.runs_problem(runs, demo.EXPECTED_STATES)
    assert not final and problem is not None and "under way: report@1 RUNNING" in problem


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda r: r.append(_run("overrun", 2, "TIMED_OUT")), "has 2 runs"),
        (
            lambda r: r.__setitem__(0, _run("poller", 0, "FAILED", why="failed")),
            "FAILED (failed), expected SUCCESS",
        ),
        (lambda r: r.__setitem__(0, _run("poller", 0, "SUCCESS", exit_code=3)), "exit status 3"),
        (lambda r: r.__setitem__(0, _run("poller", 0, "SUCCESS", worker="other")), "ran on"),
    ],
)
def test_runs_problem_is_final_for_what_waiting_cannot_mend(change: Any, said: str) -> None:
    runs = _healthy()
    change(runs)
    problem, final = demo.runs_problem(runs, demo.EXPECTED_STATES)
    assert final and problem is not None and said in problem, problem


def _child(body: str) -> subprocess.Popen[bytes]:
    """A Python process running ``body``, once it has set up its signal handlers (it says
    so on stdout): a SIGTERM before that would find Python's default and prove nothing."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(body) + "\nprint('ready', flush=True)\n"
            "import time\nwhile True: time.sleep(1)\n",
        ],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.stdout.close()  # (it prints nothing more)
    return proc


def test_stop_passes_a_process_that_exits_0_on_sigterm() -> None:
    proc = _child("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))")
    assert demo.stop(proc, "worker") is None
    assert proc.returncode == 0


def test_stop_names_a_status_other_than_0() -> None:
    proc = _child("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(3))")
    assert demo.stop(proc, "node") == "the node exited with status 3 after SIGTERM, not 0"


def test_stop_names_a_process_that_had_exited_already() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    proc.wait(30)
    assert demo.stop(proc, "worker") == "the worker had exited before the stop, with status 4"


def test_stop_kills_a_process_that_ignores_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "STOP_WAIT_S", 0.5)
    proc = _child("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)")
    problem = demo.stop(proc, "node")
    assert problem == "the node did not exit within 0.5 s of SIGTERM (killed)"
    assert proc.returncode == -signal.SIGKILL
