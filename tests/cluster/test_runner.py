"""cluster.runner: the pure decisions without processes, then run_task with real subprocesses.

The process tests use short graces and timeouts (tenths of a second) so that each stays well
under a few seconds on a shared machine. Trio is driven with ``trio.run`` in plain test
functions (no pytest-trio dependency).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.runner import (
    CHUNK_BYTES,
    RUN_VAR_NAMES,
    Launch,
    LaunchRefused,
    RunHandle,
    RunnerUsageError,
    Stop,
    TaskNotRunnable,
    TaskOutcome,
    container_argv,
    container_name,
    decide_outcome,
    format_scheduled_at,
    parse_proc_stat,
    pick_runtime,
    plan_launch,
    run_task,
    run_vars,
    spawn_failure,
    stop_notice,
    task_kind,
)
from engine.effects import RunTicket

pytestmark = pytest.mark.timeout(30)

GRACE = 0.3  # seconds: the kill grace in these tests
SCHEDULED_MS = 1_795_000_000_123  # 2026-11-18T11:06:40.123Z


def ticket(task: dict[str, Any], *, timeout_ms: int | None = None, **fields: Any) -> RunTicket:
    values: dict[str, Any] = {
        "run_id": f"nightly-report@{SCHEDULED_MS}",
        "job_id": "nightly-report",
        "scheduled_ms": SCHEDULED_MS,
        "attempt": 2,
        "token": (7 << 32) | 19,
        "version": 3,
        "delivery": "at_least_once",
        "tier": "default",
        "timeout_ms": timeout_ms,
        "task": task,
    }
    values.update(fields)
    return RunTicket(**values)


class Collected:
    """An on_output that keeps every chunk (for small outputs)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, bytes, float]] = []

    async def __call__(self, stream: str, data: bytes) -> None:
        self.chunks.append((stream, data, time.monotonic()))

    def text(self, stream: str) -> str:
        return b"".join(d for s, d, _ in self.chunks if s == stream).decode()


def run(
    t: RunTicket,
    *,
    sink: Callable[[str, bytes], Awaitable[None]] | None = None,
    **kwargs: Any,
) -> tuple[TaskOutcome, Collected]:
    collected = Collected()
    kwargs.setdefault("kill_grace_s", GRACE)
    outcome = trio.run(
        lambda: run_task(t, on_output=sink if sink is not None else collected, **kwargs)
    )
    return outcome, collected


def run_killed_when_ready(t: RunTicket, **kwargs: Any) -> tuple[TaskOutcome, Collected]:
    """Run ``t`` and request a kill (reason ``cancelled``) once its output holds ``ready``."""
    handle = RunHandle()
    collected = Collected()

    async def sink(stream: str, data: bytes) -> None:
        await collected(stream, data)
        if b"ready" in data:
            handle.kill("cancelled")

    return run(t, sink=sink, handle=handle, **kwargs)[0], collected


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parsed = parse_proc_stat(f.read())
    except FileNotFoundError:
        return False
    return parsed is not None and parsed[0] not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --------------------------------------------------------------------------------------------
# Pure decisions


class TestDecideOutcome:
    def test_exit_zero_is_success(self) -> None:
        assert decide_outcome(0, None) == ("success", None)

    @pytest.mark.parametrize("code", [1, 2, 127, 255, -9, -15])
    def test_other_statuses_and_outside_signals_fail(self, code: int) -> None:
        assert decide_outcome(code, None) == ("failed", None)

    @pytest.mark.parametrize("code", [0, 1, -15, -9, 143])
    def test_a_timeout_wins_over_any_status(self, code: int) -> None:
        stop = Stop("timeout", "timed out after 5 ms")
        assert decide_outcome(code, stop) == ("timed_out", "timed out after 5 ms")

    def test_a_kill_carries_its_reason(self) -> None:
        assert decide_outcome(-15, Stop("kill", "superseded")) == ("killed", "superseded")


class TestTaskKind:
    @pytest.mark.parametrize(
        ("task", "kind"),
        [
            ({"command": ["true"]}, "command"),
            ({"command": ["env"], "env": {"A": "1"}, "cwd": "/"}, "command"),
            ({"shell": "echo hi"}, "shell"),
            ({"container": {"image": "alpine:3", "args": ["true"]}}, "container"),
            ({"container": {"image": "alpine:3"}, "env": {"A": "1"}}, "container"),
        ],
    )
    def test_runnable_kinds(self, task: dict[str, Any], kind: str) -> None:
        assert task_kind(task) == kind

    def test_payload_is_refused_with_its_kind(self) -> None:
        with pytest.raises(TaskNotRunnable) as info:
            task_kind({"payload": {"to": "x"}})
        assert info.value.kind == "payload"
        assert info.value.code == "not_runnable"
        assert isinstance(info.value, ValueError)

    @pytest.mark.parametrize(
        "task",
        [
            {},
            {"command": ["a"], "shell": "b"},
            {"command": []},
            {"command": [""]},
            {"command": "ls -l"},
            {"shell": "   "},
            {"shell": "echo", "image": "x"},
            {"container": {"args": []}},
            {"container": {"image": "-v"}},
            {"container": {"image": "x", "args": "true"}},
            {"command": ["true"], "env": {"A=B": "1"}},
            {"command": ["true"], "env": {"A": 1}},
            {"command": ["true"], "cwd": ""},
            {"command": ["a\0b"]},
            {"shell": "true", "env": {"A": "x\0"}},
        ],
    )
    def test_malformed_tasks_are_refused(self, task: dict[str, Any]) -> None:
        with pytest.raises(TaskNotRunnable):
            task_kind(task)


class TestEnvironment:
    def test_scheduled_at_is_iso_utc_with_milliseconds(self) -> None:
        assert format_scheduled_at(0) == "1970-01-01T00:00:00.000Z"
        assert format_scheduled_at(1_795_000_000_123) == "2026-11-18T11:06:40.123Z"
        assert format_scheduled_at(-1) == "1969-12-31T23:59:59.999Z"

    def test_run_vars(self) -> None:
        assert run_vars(ticket({"command": ["true"]}, timeout_ms=1500)) == {
            "TICKWHEEL_RUN_ID": f"nightly-report@{SCHEDULED_MS}",
            "TICKWHEEL_JOB_ID": "nightly-report",
            "TICKWHEEL_ATTEMPT": "2",
            "TICKWHEEL_SCHEDULED_AT": "2026-11-18T11:06:40.123Z",
            "TICKWHEEL_SCHEDULED_MS": str(SCHEDULED_MS),
            "TICKWHEEL_FENCE": str((7 << 32) | 19),
            "TICKWHEEL_JOB_VERSION": "3",
            "TICKWHEEL_DELIVERY": "at_least_once",
            "TICKWHEEL_TIER": "default",
            "TICKWHEEL_TIMEOUT_MS": "1500",
        }

    def test_no_timeout_no_timeout_var_and_far_instants_keep_the_ms_form(self) -> None:
        out = run_vars(ticket({"command": ["true"]}, scheduled_ms=10**15))
        assert "TICKWHEEL_TIMEOUT_MS" not in out
        assert "TICKWHEEL_SCHEDULED_AT" not in out
        assert out["TICKWHEEL_SCHEDULED_MS"] == str(10**15)

    def test_precedence_worker_then_task_then_run_vars(self) -> None:
        t = ticket(
            {"command": ["env"], "env": {"SHARED": "task", "TICKWHEEL_FENCE": "0", "OWN": "1"}}
        )
        plan = plan_launch(t, base_env={"SHARED": "worker", "PATH": "/bin", "HOME": "/h"})
        assert isinstance(plan, Launch)
        assert plan.env["SHARED"] == "task"
        assert plan.env["OWN"] == "1"
        assert plan.env["HOME"] == "/h"
        assert plan.env["TICKWHEEL_FENCE"] == str(t.token)  # a task cannot fake its fence

    def test_no_tickwheel_variable_is_inherited(self) -> None:
        # A worker running under tickwheel itself: its own run's timeout must not leak into a
        # task without one; nor do the worker's own settings (its connect address). A task
        # sets one in its own env if it wants it.
        t = ticket({"command": ["env"], "env": {"TICKWHEEL_TIMEOUT_MS": "1", "TICKWHEEL_X": "t"}})
        inherited = {
            "TICKWHEEL_TIMEOUT_MS": "9",
            "TICKWHEEL_CONNECT": "node:7070",
            "TICKWHEEL_X": "w",
            "PATH": "/bin",
        }
        plan = plan_launch(t, base_env=inherited)
        assert isinstance(plan, Launch)
        assert "TICKWHEEL_TIMEOUT_MS" not in plan.env
        assert "TICKWHEEL_CONNECT" not in plan.env
        assert plan.env["TICKWHEEL_X"] == "t"  # the task's own
        assert plan.env["PATH"] == "/bin"
        assert set(run_vars(t)) <= RUN_VAR_NAMES


class TestPlanLaunch:
    def test_command_runs_without_a_shell(self) -> None:
        plan = plan_launch(ticket({"command": ["ls", "-l", "a b"], "cwd": "/tmp"}), base_env={})
        assert isinstance(plan, Launch)
        assert plan.argv == ("ls", "-l", "a b")
        assert plan.cwd == "/tmp"
        assert plan.runtime is None and plan.container is None

    def test_shell_runs_through_bin_sh(self) -> None:
        plan = plan_launch(ticket({"shell": "echo $HOME | wc -c"}), base_env={})
        assert isinstance(plan, Launch)
        assert plan.argv == ("/bin/sh", "-c", "echo $HOME | wc -c")

    def test_payload_is_refused(self) -> None:
        with pytest.raises(TaskNotRunnable):
            plan_launch(ticket({"payload": [1, 2]}), base_env={})

    def test_container_without_runtime_is_refused_not_raised(self) -> None:
        t = ticket({"container": {"image": "alpine", "args": []}})
        plan = plan_launch(t, base_env={"PATH": "/x"}, which=lambda name, path=None: None)
        assert isinstance(plan, LaunchRefused)
        assert plan.exit_code == 127
        assert "docker or podman" in plan.message

    def test_container_command_line(self) -> None:
        t = ticket(
            {
                "container": {"image": "alpine:3.20", "args": ["sh", "-c", "echo $A"]},
                "env": {"A": "1", "TICKWHEEL_RUN_ID": "fake"},
                "cwd": "/work",
            }
        )
        found: list[tuple[str, str | None]] = []

        def which(name: str, path: str | None = None) -> str | None:
            found.append((name, path))
            return f"/usr/bin/{name}" if name == "podman" else None

        plan = plan_launch(t, base_env={"PATH": "/usr/bin"}, which=which)
        assert isinstance(plan, Launch)
        assert found == [("docker", "/usr/bin"), ("podman", "/usr/bin")]
        name = container_name(t)
        env_flags = [a for i, a in enumerate(plan.argv) if plan.argv[i - 1] == "-e"]
        assert env_flags[0] == "A"
        assert sorted(env_flags[1:]) == sorted(run_vars(t))  # TICKWHEEL_RUN_ID only once
        assert plan.argv[:5] == ("/usr/bin/podman", "run", "--rm", "--name", name)
        assert plan.argv[-6:] == ("--workdir", "/work", "alpine:3.20", "sh", "-c", "echo $A")
        assert "1" not in plan.argv  # values travel in the environment, not on the command line
        assert plan.env["A"] == "1" and plan.env["TICKWHEEL_RUN_ID"] == t.run_id
        assert plan.cwd is None  # the runtime runs where the worker runs
        assert (plan.runtime, plan.container) == ("/usr/bin/podman", name)

    def test_container_argv_minimal(self) -> None:
        assert container_argv("docker", name="n", image="img", args=[], env_names=[]) == [
            "docker",
            "run",
            "--rm",
            "--name",
            "n",
            "img",
        ]

    def test_container_names_are_valid_and_differ_per_attempt(self) -> None:
        t = ticket({"shell": "x"}, job_id="billing/émoji job!!", run_id="billing@1")
        name = container_name(t)
        assert name.startswith("tickwheel-billing-")
        assert all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)
        again = ticket({"shell": "x"}, job_id="billing/émoji job!!", run_id="billing@1", token=2)
        assert container_name(again) != name
        assert container_name(ticket({"shell": "x"}, job_id="///")).startswith("tickwheel-job-")


def test_pick_runtime() -> None:
    installed = {"podman": "/bin/podman", "docker": "/bin/docker", "nerdctl": "/bin/nerdctl"}

    def which(name: str) -> str | None:
        return installed.get(name)

    assert pick_runtime(None, which) == "/bin/docker"
    assert pick_runtime("podman", which) == "/bin/podman"
    assert pick_runtime("nerdctl", which) == "/bin/nerdctl"
    assert pick_runtime("crun", which) is None  # a runtime asked for is not swapped for another
    del installed["docker"]
    assert pick_runtime(None, which) == "/bin/podman"


class TestSpawnFailure:
    def test_not_found(self) -> None:
        err = FileNotFoundError(errno.ENOENT, "No such file or directory", "nope")
        code, message = spawn_failure(err, "nope", None)
        assert code == 127 and "nope: command not found" in message

    def test_a_script_whose_interpreter_is_missing(self) -> None:
        err = FileNotFoundError(errno.ENOENT, "No such file or directory", "/opt/job.sh")
        code, message = spawn_failure(err, "/opt/job.sh", None, exists=lambda p: True)
        assert code == 126 and "bad interpreter" in message
        assert spawn_failure(err, "/opt/job.sh", None, exists=lambda p: False)[0] == 127

    def test_a_script_found_on_path_or_from_its_cwd_whose_interpreter_is_missing(
        self, tmp_path: Path
    ) -> None:
        """Only a path with a ``/`` was looked at, from the worker's directory: such a script
        found on the task's PATH, or relative to its cwd, was 'command not found' (found by
        review). A real script with a missing interpreter, run both ways."""
        script = tmp_path / "badint"
        script.write_text("#!/nonexistent/interpreter\necho hi\n")
        script.chmod(0o755)
        on_path = ticket({"command": ["badint"], "env": {"PATH": f"/usr/bin:{tmp_path}"}})
        from_cwd = ticket({"command": ["./badint"], "cwd": str(tmp_path)})
        for t in (on_path, from_cwd):
            outcome, out = run(t)
            assert (outcome.outcome, outcome.exit_code) == ("failed", 126), out.text("stderr")
            assert "bad interpreter" in out.text("stderr")
        missing = ticket({"command": ["nope-not-here"], "env": {"PATH": str(tmp_path)}})
        assert run(missing)[0].exit_code == 127
        # a relative PATH entry is searched from the task's cwd, where the child execs
        (tmp_path / "bin").mkdir()
        script.rename(tmp_path / "bin" / "badint")
        relative = ticket(
            {"command": ["badint"], "cwd": str(tmp_path), "env": {"PATH": "bin:/usr/bin"}}
        )
        outcome, out = run(relative)
        assert (outcome.outcome, outcome.exit_code) == ("failed", 126), out.text("stderr")

    def test_not_executable(self) -> None:
        denied = PermissionError(errno.EACCES, "Permission denied", "/etc/passwd")
        assert spawn_failure(denied, "/etc/passwd", None)[0] == 126
        bad_format = OSError(errno.ENOEXEC, "Exec format error", "/tmp/x")
        assert spawn_failure(bad_format, "/tmp/x", None)[0] == 126

    def test_missing_working_directory(self) -> None:
        err = FileNotFoundError(errno.ENOENT, "No such file or directory", "/gone")
        code, message = spawn_failure(err, "true", "/gone")
        assert code == 126 and "working directory '/gone'" in message


def test_parse_proc_stat() -> None:
    assert parse_proc_stat("123 (sleep) S 1 456 456 0 -1") == ("S", 456)
    assert parse_proc_stat("9 (a) b) (c) Z 1 77 77") == ("Z", 77)  # names may hold ')'
    assert parse_proc_stat("garbage") is None
    assert parse_proc_stat("1 (x) R 1 notanumber") is None


def test_stop_notice() -> None:
    stop = Stop("timeout", "timed out after 200 ms")
    text = stop_notice(stop, grace_s=0.5, sigkill=True, returncode=-9)
    assert text == (
        "tickwheel: stopped (timed out after 200 ms): SIGTERM, then SIGKILL after the 0.5 s "
        "grace; exit signal SIGKILL"
    )
    text = stop_notice(Stop("kill", "cancelled"), grace_s=5, sigkill=False, returncode=0)
    assert text.endswith("SIGTERM to the process group; exit 0")


# --------------------------------------------------------------------------------------------
# Real processes


class TestExitStatus:
    def test_true_succeeds(self) -> None:
        outcome, out = run(ticket({"command": ["true"]}))
        assert (outcome.outcome, outcome.exit_code, outcome.reason) == ("success", 0, None)
        assert outcome.stdout_bytes == outcome.stderr_bytes == 0
        assert outcome.finished >= outcome.started
        assert out.chunks == []

    def test_false_fails(self) -> None:
        outcome, _ = run(ticket({"command": ["false"]}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 1)

    def test_shell_exit_status_and_both_streams(self) -> None:
        outcome, out = run(ticket({"shell": "echo out; echo err >&2; exit 3"}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 3)
        assert out.text("stdout") == "out\n" and out.text("stderr") == "err\n"
        assert (outcome.stdout_bytes, outcome.stderr_bytes) == (4, 4)

    def test_command_argv_is_not_interpreted_by_a_shell(self) -> None:
        outcome, out = run(ticket({"command": ["echo", "$HOME", "a;b", "*"]}))
        assert outcome.outcome == "success"
        assert out.text("stdout") == "$HOME a;b *\n"

    def test_a_signal_from_outside_is_a_failure_with_the_negative_signal(self) -> None:
        outcome, _ = run(ticket({"command": ["sh", "-c", "kill -USR1 $$"]}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", -signal.SIGUSR1)


class TestEnvironmentOfAProcess:
    def test_run_vars_task_env_and_cwd(self, tmp_path: Path) -> None:
        script = (
            'printf "%s|%s|%s|%s|%s|%s|%s|%s\\n" "$TICKWHEEL_RUN_ID" "$TICKWHEEL_JOB_ID" '
            '"$TICKWHEEL_ATTEMPT" "$TICKWHEEL_SCHEDULED_AT" "$TICKWHEEL_SCHEDULED_MS" '
            '"$TICKWHEEL_FENCE" "$GREETING" "$(pwd)"'
        )
        t = ticket({"shell": script, "env": {"GREETING": "hello world"}, "cwd": str(tmp_path)})
        outcome, out = run(t, base_env={"PATH": os.environ["PATH"], "GREETING": "worker"})
        assert outcome.outcome == "success"
        assert out.text("stdout").strip().split("|") == [
            t.run_id,
            "nightly-report",
            "2",
            "2026-11-18T11:06:40.123Z",
            str(SCHEDULED_MS),
            str(t.token),
            "hello world",
            str(tmp_path.resolve()),
        ]

    def test_own_session_and_stdin_from_dev_null(self) -> None:
        script = (
            "import os, sys; "
            "print(os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid(), "
            "repr(sys.stdin.read()))"
        )
        outcome, out = run(ticket({"command": [sys.executable, "-c", script]}))
        assert outcome.outcome == "success"
        assert out.text("stdout") == "True True ''\n"


class TestOutput:
    def test_big_output_comes_in_bounded_chunks_without_being_kept(self) -> None:
        total = 0
        sizes: list[int] = []

        async def count(stream: str, data: bytes) -> None:
            nonlocal total
            assert stream == "stdout"
            total += len(data)
            sizes.append(len(data))

        size = 20 * 1024 * 1024
        outcome, _ = run(ticket({"command": ["head", "-c", str(size), "/dev/zero"]}), sink=count)
        assert outcome.outcome == "success"
        assert total == outcome.stdout_bytes == size
        assert max(sizes) <= CHUNK_BYTES
        assert len(sizes) >= size // CHUNK_BYTES

    def test_chunk_size_is_configurable(self) -> None:
        outcome, out = run(ticket({"shell": "printf 0123456789"}), chunk_bytes=3)
        assert out.text("stdout") == "0123456789"
        assert max(len(d) for _, d, _ in out.chunks) <= 3
        assert outcome.stdout_bytes == 10

    def test_output_streams_while_the_task_runs(self) -> None:
        outcome, out = run(ticket({"shell": "echo first; sleep 0.6; echo second"}))
        assert outcome.outcome == "success"
        first = next(at for _, d, at in out.chunks if d.startswith(b"first"))
        assert outcome.finished - first >= 0.4

    def test_on_output_is_never_called_concurrently(self) -> None:
        busy = False

        async def slow(stream: str, data: bytes) -> None:
            nonlocal busy
            assert not busy
            busy = True
            await trio.sleep(0.001)
            busy = False

        script = "for i in 1 2 3 4 5 6 7 8; do echo o$i; echo e$i >&2; done"
        outcome, _ = run(ticket({"shell": script}), sink=slow)
        assert outcome.outcome == "success"
        assert outcome.stdout_bytes == outcome.stderr_bytes == 24

    def test_a_slow_on_output_past_the_drain_loses_nothing(self) -> None:
        """on_output may take longer than the drain (a worker waiting out its node's outage):
        what the task wrote is delivered all the same, the pipes read to their end (the sixth
        review found the drain cancelling the chunk in delivery and the rest of the pipe)."""
        chunks: list[tuple[str, bytes]] = []

        async def slow(stream: str, data: bytes) -> None:
            if not chunks:
                await trio.sleep(0.5)  # ten drains: the task has long ended meanwhile
            chunks.append((stream, data))

        script = "for i in $(seq 1 200); do echo o$i; echo e$i >&2; done"
        outcome, _ = run(ticket({"shell": script}), sink=slow, chunk_bytes=64, drain_s=0.05)
        assert outcome.outcome == "success"
        for stream, mark in (("stdout", "o"), ("stderr", "e")):
            text = b"".join(d for s, d in chunks if s == stream).decode()
            assert text.split() == [f"{mark}{i}" for i in range(1, 201)]
        assert (
            outcome.stdout_bytes
            == outcome.stderr_bytes
            == sum(len(f"o{i}\n") for i in range(1, 201))
        )

    def test_on_output_raising_kills_the_task_and_propagates(self, tmp_path: Path) -> None:
        pidfile = tmp_path / "pid"

        async def boom(stream: str, data: bytes) -> None:
            raise RuntimeError("log store down")

        script = f"echo $$ > {pidfile}; echo hello; exec sleep 30"
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="log store down"):
            run(ticket({"shell": script}), sink=boom)
        assert time.monotonic() - started < 5
        assert wait_dead(int(pidfile.read_text()))


class TestTimeout:
    def test_timeout_terminates_the_group(self) -> None:
        outcome, out = run(ticket({"command": ["sleep", "30"]}, timeout_ms=200))
        assert outcome.outcome == "timed_out"
        assert outcome.exit_code == -signal.SIGTERM
        assert outcome.reason == "timed out after 200 ms"
        assert not outcome.sigkill
        assert 0.2 <= outcome.duration_s < 0.2 + GRACE + 1.5
        assert out.text("stderr").startswith("tickwheel: stopped (timed out after 200 ms)")
        assert outcome.stderr_bytes == len(out.text("stderr"))

    def test_a_mark_task_runs_past_its_timeout_and_still_sees_it(self) -> None:
        """``on_timeout: mark``: the node records TIMED_OUT and the task runs on. The worker
        used to run it from a ticket without its timeout, so TICKWHEEL_TIMEOUT_MS was
        missing, which docs/tasks.md promises for every job with one (found by review)."""
        t = ticket(
            {"shell": 'sleep 0.4; echo "$TICKWHEEL_TIMEOUT_MS"'}, timeout_ms=100, on_timeout="mark"
        )
        outcome, out = run(t)
        assert outcome.outcome == "success" and out.text("stdout") == "100\n"

    # Timeouts below leave the shell ample time (0.5 s and more) to set its traps first, so a
    # loaded machine does not turn "ignores TERM" into "died before the trap was set".
    def test_a_task_that_ignores_term_gets_the_grace_then_sigkill(self) -> None:
        t = ticket({"shell": "trap '' TERM; echo ready; sleep 30"}, timeout_ms=500)
        outcome, out = run(t)
        assert outcome.outcome == "timed_out"
        assert outcome.exit_code == -signal.SIGKILL
        assert outcome.sigkill
        assert outcome.duration_s >= 0.5 + GRACE
        assert outcome.duration_s < 0.5 + GRACE + 1.5
        assert out.text("stdout") == "ready\n"
        assert "SIGKILL after the 0.3 s grace" in out.text("stderr")

    def test_a_task_that_traps_term_and_exits_cleanly_still_timed_out(self) -> None:
        script = "trap 'echo cleaning up; exit 0' TERM; sleep 30 & wait"
        outcome, out = run(ticket({"shell": script}, timeout_ms=500))
        # No SIGKILL: it exited within the grace, and the grace was not waited out.
        assert (outcome.outcome, outcome.exit_code, outcome.sigkill) == ("timed_out", 0, False)
        assert "cleaning up" in out.text("stdout")

    def test_children_in_the_group_die_too(self, tmp_path: Path) -> None:
        pids = tmp_path / "pids"
        script = f"sleep 30 & echo $! > {pids}; sh -c 'sleep 30' & echo $! >> {pids}; wait"
        outcome, _ = run(ticket({"shell": script}, timeout_ms=800))
        assert outcome.outcome == "timed_out"
        children = [int(p) for p in pids.read_text().split()]
        assert len(children) == 2
        assert all(wait_dead(pid) for pid in children)

    def test_a_grandchild_that_ignores_term_is_killed_after_the_grace(self, tmp_path: Path) -> None:
        pidfile = tmp_path / "pid"
        # The leader dies on TERM at once; the grandchild ignores it and must still go. The
        # stop is requested once the grandchild says its trap is set.
        script = f"sh -c \"trap '' TERM; echo \\$\\$ > {pidfile}; echo ready; sleep 30\" & sleep 30"
        outcome, _ = run_killed_when_ready(ticket({"shell": script}))
        assert (outcome.outcome, outcome.reason) == ("killed", "cancelled")
        assert outcome.sigkill
        assert outcome.exit_code == -signal.SIGTERM  # the leader itself went on TERM
        assert outcome.duration_s >= GRACE
        assert wait_dead(int(pidfile.read_text()))


class TestLeftovers:
    def test_background_children_do_not_outlive_a_finished_task(self, tmp_path: Path) -> None:
        pidfile = tmp_path / "pid"
        outcome, _ = run(ticket({"shell": f"sleep 30 & echo $! > {pidfile}; exit 0"}))
        assert (outcome.outcome, outcome.exit_code) == ("success", 0)
        assert outcome.duration_s < 2
        assert wait_dead(int(pidfile.read_text()))

    def test_a_process_that_left_the_group_does_not_hold_the_run(self, tmp_path: Path) -> None:
        pidfile = tmp_path / "pid"
        # setsid escapes the group and keeps stdout open: output is drained for drain_s only.
        script = (
            f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 30' & "
            f"while [ ! -s {pidfile} ]; do sleep 0.01; done; echo done"
        )
        try:
            outcome, out = run(ticket({"shell": script}), drain_s=0.3)
            assert outcome.outcome == "success"
            assert out.text("stdout") == "done\n"
            # Not silent: the log says that reading stopped before the pipes' end.
            assert out.text("stderr") == (
                "tickwheel: stopped reading stdout and stderr 0.3 s after the task ended: "
                "a process that left its process group still holds them open\n"
            )
            assert outcome.duration_s < 2
        finally:
            if pidfile.exists():
                os.kill(int(pidfile.read_text()), signal.SIGKILL)

    def test_what_the_group_wrote_is_read_even_when_the_drain_ends_first(
        self, tmp_path: Path
    ) -> None:
        """A process that left the group holds the pipes, and on_output is slower than the
        drain: what the group wrote before it ended (still in the pipe at the drain's end) is
        read and delivered, then reading stops."""
        pidfile = tmp_path / "pid"
        delivered = Collected()

        async def slow(stream: str, data: bytes) -> None:
            if not delivered.chunks:
                await trio.sleep(0.5)
            await delivered(stream, data)

        script = (
            f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 30' & "
            f"while [ ! -s {pidfile} ]; do sleep 0.01; done; "
            "for i in $(seq 1 300); do echo line$i; done"
        )
        try:
            outcome, _ = run(ticket({"shell": script}), sink=slow, chunk_bytes=64, drain_s=0.05)
            assert outcome.outcome == "success"
            assert delivered.text("stdout").split() == [f"line{i}" for i in range(1, 301)]
            assert "tickwheel: stopped reading stdout and stderr" in delivered.text("stderr")
        finally:
            if pidfile.exists():
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


class TestKill:
    def test_kill_request_stops_the_task_with_its_reason(self) -> None:
        handle = RunHandle()
        result: list[TaskOutcome] = []

        async def main() -> None:
            async def sink(stream: str, data: bytes) -> None:
                pass

            async with trio.open_nursery() as nursery:

                async def runner() -> None:
                    result.append(
                        await run_task(
                            ticket({"command": ["sleep", "30"]}, timeout_ms=60_000),
                            on_output=sink,
                            handle=handle,
                            kill_grace_s=GRACE,
                        )
                    )

                nursery.start_soon(runner)
                pid = await handle.wait_started()
                assert alive(pid)
                handle.kill("superseded by attempt 3")
                handle.kill("a later reason is ignored")

        trio.run(main)
        outcome = result[0]
        assert outcome.outcome == "killed"
        assert outcome.reason == "superseded by attempt 3"
        assert outcome.exit_code == -signal.SIGTERM
        assert outcome.duration_s < 2

    def test_kill_of_a_term_ignoring_task_waits_the_grace(self) -> None:
        handle = RunHandle()

        async def main() -> TaskOutcome:
            async def sink(stream: str, data: bytes) -> None:
                if data.startswith(b"ready"):
                    handle.kill("cancelled")

            return await run_task(
                ticket({"shell": "trap '' TERM; echo ready; sleep 30"}),
                on_output=sink,
                handle=handle,
                kill_grace_s=GRACE,
            )

        outcome = trio.run(main)
        assert (outcome.outcome, outcome.reason) == ("killed", "cancelled")
        assert outcome.sigkill and outcome.exit_code == -signal.SIGKILL
        assert GRACE <= outcome.duration_s < GRACE + 1.5

    def test_kill_before_start_starts_nothing(self, tmp_path: Path) -> None:
        handle = RunHandle()
        handle.kill("cancelled")
        marker = tmp_path / "ran"
        outcome, out = run(ticket({"shell": f"touch {marker}"}), handle=handle)
        assert (outcome.outcome, outcome.exit_code, outcome.reason) == ("killed", None, "cancelled")
        assert not marker.exists() and out.chunks == []
        assert handle.pid is None

    def test_cancelling_the_call_kills_the_group_at_once(self, tmp_path: Path) -> None:
        pidfile = tmp_path / "pid"

        async def main() -> bool:
            with trio.CancelScope() as scope:

                async def sink(stream: str, data: bytes) -> None:
                    if b"ready" in data:
                        scope.cancel()

                await run_task(
                    ticket({"shell": f"trap '' TERM; echo $$ > {pidfile}; echo ready; sleep 30"}),
                    on_output=sink,
                    kill_grace_s=10,
                )
            return scope.cancelled_caught

        started = time.monotonic()
        assert trio.run(main)
        assert time.monotonic() - started < 3  # no 10 s grace on cancellation
        assert wait_dead(int(pidfile.read_text()))


class TestCannotStart:
    def test_missing_binary(self) -> None:
        outcome, out = run(ticket({"command": ["tickwheel-no-such-program", "x"]}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 127)
        assert out.text("stderr") == (
            "tickwheel: tickwheel-no-such-program: command not found (No such file or directory)\n"
        )
        assert outcome.stderr_bytes == len(out.text("stderr"))
        assert outcome.reason is not None and "command not found" in outcome.reason

    def test_missing_binary_in_a_shell_task_is_the_shells_127(self) -> None:
        outcome, out = run(ticket({"shell": "tickwheel-no-such-program"}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 127)
        assert "tickwheel-no-such-program" in out.text("stderr")

    def test_not_executable(self, tmp_path: Path) -> None:
        script = tmp_path / "script.sh"
        script.write_text("#!/bin/sh\necho hi\n")  # no x bit
        outcome, out = run(ticket({"command": [str(script)]}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 126)
        assert "cannot execute (Permission denied)" in out.text("stderr")

    def test_missing_interpreter(self, tmp_path: Path) -> None:
        script = executable(tmp_path / "script.sh", "#!/no/such/interpreter\necho hi\n")
        outcome, out = run(ticket({"command": [str(script)]}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 126)
        assert "bad interpreter" in out.text("stderr")

    def test_missing_working_directory(self, tmp_path: Path) -> None:
        gone = str(tmp_path / "gone")
        outcome, out = run(ticket({"command": ["true"], "cwd": gone}))
        assert (outcome.outcome, outcome.exit_code) == ("failed", 126)
        assert "working directory" in out.text("stderr")

    def test_payload_is_refused_before_anything_runs(self) -> None:
        with pytest.raises(TaskNotRunnable):
            run(ticket({"payload": {"n": 1}}))

    @pytest.mark.parametrize(
        "kwargs", [{"kill_grace_s": -1.0}, {"chunk_bytes": 0}, {"drain_s": float("nan")}]
    )
    def test_bad_arguments(self, kwargs: dict[str, Any]) -> None:
        with pytest.raises(RunnerUsageError):
            run(ticket({"command": ["true"]}), **kwargs)


class TestContainer:
    def test_no_runtime_installed_fails_with_a_clear_message(self, tmp_path: Path) -> None:
        t = ticket({"container": {"image": "alpine:3", "args": ["true"]}})
        outcome, out = run(t, base_env={"PATH": str(tmp_path)})
        assert (outcome.outcome, outcome.exit_code) == ("failed", 127)
        assert out.text("stderr").startswith("tickwheel: container task: no container runtime")
        assert "docker or podman" in out.text("stderr")

    def test_a_runtime_asked_for_but_missing(self, tmp_path: Path) -> None:
        t = ticket({"container": {"image": "alpine:3"}})
        outcome, out = run(t, base_env={"PATH": str(tmp_path)}, container_runtime="podman")
        assert outcome.outcome == "failed"
        assert "podman is not installed" in out.text("stderr")

    def fake_runtime(self, tmp_path: Path) -> tuple[dict[str, str], Path]:
        """A ``docker`` on PATH that logs its argv, then for ``run`` prints the container's
        variables and runs its last argument as a shell script (a fake, not a mock: a real
        process the runner drives)."""
        log = tmp_path / "calls"
        bindir = tmp_path / "bin"
        bindir.mkdir()
        executable(
            bindir / "docker",
            "#!/bin/sh\n"
            f'echo "$*" >> {log}\n'
            '[ "$1" = run ] || exit 0\n'
            'echo "fence=$TICKWHEEL_FENCE token=$TOKEN"\n'
            'for last; do :; done\nexec /bin/sh -c "$last"\n',
        )
        return {"PATH": f"{bindir}:{os.environ['PATH']}"}, log

    def test_runs_through_the_detected_runtime(self, tmp_path: Path) -> None:
        env, log = self.fake_runtime(tmp_path)
        t = ticket(
            {"container": {"image": "alpine:3", "args": ["exit 4"]}, "env": {"TOKEN": "s3cret"}}
        )
        outcome, out = run(t, base_env=env)
        assert (outcome.outcome, outcome.exit_code) == ("failed", 4)
        assert out.text("stdout") == f"fence={t.token} token=s3cret\n"
        calls = log.read_text().splitlines()
        assert len(calls) == 1 and calls[0].startswith(f"run --rm --name {container_name(t)} ")
        assert "-e TOKEN" in calls[0] and "s3cret" not in calls[0]

    def test_a_stopped_container_is_removed(self, tmp_path: Path) -> None:
        env, log = self.fake_runtime(tmp_path)
        t = ticket({"container": {"image": "alpine:3", "args": ["sleep 30"]}}, timeout_ms=200)
        outcome, _ = run(t, base_env=env)
        assert outcome.outcome == "timed_out"
        calls = log.read_text().splitlines()
        assert calls[-1] == f"rm -f {container_name(t)}"


def test_outcome_values_are_what_report_finished_expects() -> None:
    from cluster.runner import OUTCOMES

    assert OUTCOMES == ("success", "failed", "timed_out", "killed")


@pytest.mark.parametrize("first", ["at_once", "then_at_once"])
def test_a_kill_at_once_sends_sigkill_without_waiting_out_the_grace(first: str) -> None:
    """A fencing worker's kill: SIGKILL to the group now, whether the task was already in the
    grace of an ordinary kill (which it cuts short) or not (no SIGTERM at all). The grace here
    is far longer than the test's bound, so waiting it out fails the test."""
    handle = RunHandle()
    collected = Collected()

    async def sink(stream: str, data: bytes) -> None:
        await collected(stream, data)
        if b"ready" in data:
            if first == "then_at_once":
                handle.kill("cancelled")
                await trio.sleep(0.2)  # inside the grace now (SIGTERM is ignored)
            handle.kill("fenced", at_once=True)

    script = "trap 'echo got-term' TERM; echo ready; while :; do sleep 0.05; done"

    async def main() -> TaskOutcome:
        with trio.fail_after(20):
            return await run_task(
                ticket({"shell": script}), on_output=sink, handle=handle, kill_grace_s=60
            )

    outcome = trio.run(main)
    assert outcome.outcome == "killed" and outcome.exit_code == -signal.SIGKILL
    assert outcome.reason == ("cancelled" if first == "then_at_once" else "fenced")
    assert collected.text("stderr").endswith(
        "SIGKILL to the process group at once; exit signal SIGKILL\n"
    )
    if first == "at_once":
        assert "got-term" not in collected.text("stdout")  # no SIGTERM was sent
