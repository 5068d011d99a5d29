"""The job options and job commands of ``tickwheel`` that issue 6 asks for, as users run them:
``python -m cluster.cli`` in a subprocess against a real ``tickwheel serve`` node and real
``tickwheel worker`` processes on 127.0.0.1 (ports the OS picks). It proves that

- ``submit`` and ``job update`` store ``--timeout``, ``--on-timeout``, ``--delivery`` and
  ``--tier`` as given (``at-most-once`` as the spec's ``at_most_once``), and refuse bad values
  with a typed error and a non-zero status, creating or changing nothing;
- ``job cancel`` ends the job (``job get``: ``not_found``) and cancels its PENDING runs, and
  ``--stop-running`` also stops a running task, which a plain cancel lets finish;
- ``job pause`` stops the fires (none while paused) and ``job resume`` starts them again;
- ``runs JOB --last N`` gives exactly the N newest runs, newest first (docs/protocol.md,
  ``run.history``);
- ``worker --tier NAME`` runs that tier's jobs, and a default-tier worker does not;
- ``submit``'s plain output names the job id and its next fire time.

One node serves the whole module (every test uses its own job ids and tiers); tests that
need a worker use one on the tier :data:`TIER`, or start their own.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.schedules import parse_instant
from tests.cluster.procs import (
    NodeProc,
    WorkerProc,
    clean_failure,
    cli,
    history,
    job,
    ok,
    run_state,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

#: the tier of the module's shared worker: only the jobs of this file that are meant to run
#: are on it, so that it never runs another test's job by accident
TIER = "cli-opts"
#: a time no test outlives: a job scheduled then never fires while the module runs
FAR = "2090-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    root = tmp_path_factory.mktemp("cli_options")
    # A 5 s lease, not 1 s: a heartbeat answered late on a loaded machine would fence the
    # worker and kill the tasks the cancel test watches (as test_node_processes notes).
    proc = NodeProc(root / "data", root / "node.log", lease="5s")
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def worker(node: NodeProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    proc = start_worker(node.port, tmp_path_factory.mktemp("worker") / "worker.log", "w-opts", TIER)
    yield proc
    proc.terminate(timeout=15)


def run_ids(node: NodeProc, job_id: str) -> set[str]:
    return {r["run_id"] for r in history(node.port, job_id)}


def cancel_quietly(node: NodeProc, job_id: str) -> None:
    """End a repeating job at a test's end, so that it does not fire for the rest of the
    module (a job already cancelled is ``not_found``: fine)."""
    cli(node, "job", "cancel", job_id)


# ------------------------------------------------------------------ 1. job options


#: (job id, the options given, the spec values stored). Each option takes a value other than
#: its default in some case, so a CLI that dropped it would be seen. Durations are stored
#: canonical (docs/protocol.md, job.get): 90s as 1m30s, 1500ms as 1s500ms.
GOOD_OPTIONS: list[tuple[str, list[str], dict[str, Any]]] = [
    (
        "opt-kill",
        ["--timeout", "45s", "--on-timeout", "kill", "--delivery", "at-least-once"],
        {"timeout": "45s", "on_timeout": "kill", "delivery": "at_least_once", "tier": "default"},
    ),
    (
        "opt-mark",
        ["--timeout", "90s", "--on-timeout", "mark", "--delivery", "at-most-once"],
        {"timeout": "1m30s", "on_timeout": "mark", "delivery": "at_most_once", "tier": "default"},
    ),
    (
        "opt-retry",
        ["--timeout", "2h", "--on-timeout", "retry:3", "--tier", "batch.eu-1"],
        {
            "timeout": "2h",
            "on_timeout": "retry:3",
            "delivery": "at_least_once",
            "tier": "batch.eu-1",
        },
    ),
    (
        "opt-trigger",
        ["--timeout", "1500ms", "--on-timeout", "trigger:opt-kill", "--tier", "gpu_2"],
        {"timeout": "1s500ms", "on_timeout": "trigger:opt-kill", "tier": "gpu_2"},
    ),
]

#: (the option and its bad value, what the error says): each refused by the node's typed
#: validation (status 1, ``invalid_job`` naming the spec field) but ``--delivery``, whose
#: choices argparse checks (status 2, a usage error)
BAD_OPTIONS: list[tuple[list[str], str]] = [
    (["--timeout", "soon"], "error invalid_job: timeout: not a duration: 'soon'"),
    (["--timeout", "0s"], "error invalid_job: timeout: duration must be positive"),
    (["--timeout", "-5s"], "error invalid_job: timeout: duration must be positive"),
    (["--on-timeout", "explode"], "error invalid_job: on_timeout: must be 'kill', 'mark'"),
    (["--on-timeout", "retry:0"], "error invalid_job: on_timeout: retry:N needs an integer N"),
    (["--on-timeout", "retry:two"], "error invalid_job: on_timeout: retry:N needs an integer N"),
    (["--on-timeout", "trigger:"], "error invalid_job: on_timeout: trigger target"),
    (["--tier", "no spaces"], "error invalid_job: tier: must be 1-64 characters"),
    (["--tier", ""], "error invalid_job: tier: must be 1-64 characters"),
    (["--tier", "t" * 65], "error invalid_job: tier: must be 1-64 characters"),
    (["--delivery", "maybe"], "argument --delivery: invalid choice: 'maybe'"),
]


def refused(done: subprocess.CompletedProcess[str], says: str, option: str) -> None:
    """``done`` failed as a bad ``option`` value should: status 2 and argparse's usage error
    for ``--delivery``, else status 1 and the node's one typed error line."""
    if option == "--delivery":
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert says in done.stderr, done.stderr
    else:
        assert says in clean_failure(done), done.stderr


def test_submit_stores_each_job_option_as_given(node: NodeProc) -> None:
    for job_id, options, stored in GOOD_OPTIONS:
        ok(cli(node, "submit", "--id", job_id, "--at", FAR, "--shell", "true", *options))
        spec = job(node, job_id)["spec"]
        assert {key: spec[key] for key in stored} == stored, (job_id, spec)


def test_submit_refuses_bad_option_values_and_creates_nothing(node: NodeProc) -> None:
    ids = [f"bad-submit-{i}" for i in range(len(BAD_OPTIONS))]
    for job_id, (options, says) in zip(ids, BAD_OPTIONS, strict=True):
        done = cli(node, "submit", "--id", job_id, "--at", FAR, "--shell", "true", *options)
        refused(done, says, options[0])
    # A job that triggers itself on timeout is refused too (it would loop).
    done = cli(
        node,
        "submit",
        "--id",
        "bad-self",
        "--at",
        FAR,
        "--shell",
        "true",
        "--on-timeout",
        "trigger:bad-self",
    )
    assert "on_timeout: a job cannot trigger itself" in clean_failure(done)
    listed = {j["job_id"] for j in json.loads(ok(cli(node, "jobs", "--json")).stdout)}
    assert listed.isdisjoint([*ids, "bad-self"]), listed  # (cancelled jobs are listed too)


def test_job_update_sets_each_job_option_and_refuses_bad_values(node: NodeProc) -> None:
    ok(cli(node, "submit", "--id", "upd", "--at", FAR, "--shell", "true"))
    before = job(node, "upd")
    assert (before["spec"]["timeout"], before["spec"]["delivery"]) == (None, "at_least_once")
    changed = ok(
        cli(
            node,
            "job",
            "update",
            "upd",
            "--timeout",
            "2m",
            "--on-timeout",
            "retry:2",
            "--delivery",
            "at-most-once",
            "--tier",
            "upd-tier",
            "--json",
        )
    )
    assert json.loads(changed.stdout)["version"] == 2
    after = job(node, "upd")
    expected = {
        "timeout": "2m",
        "on_timeout": "retry:2",
        "delivery": "at_most_once",
        "tier": "upd-tier",
    }
    assert {k: after["spec"][k] for k in expected} == expected, after["spec"]
    # Back to at-least-once, and a trigger: what is not given is kept (job.update replaces
    # only the keys it is sent).
    ok(
        cli(
            node,
            "job",
            "update",
            "upd",
            "--delivery",
            "at-least-once",
            "--on-timeout",
            "trigger:opt-kill",
        )
    )
    after = job(node, "upd")
    expected = {**expected, "delivery": "at_least_once", "on_timeout": "trigger:opt-kill"}
    assert after["version"] == 3
    assert {k: after["spec"][k] for k in expected} == expected, after["spec"]
    # Bad values: refused the same way as on submit, and the job is left as it was.
    for options, says in BAD_OPTIONS:
        refused(cli(node, "job", "update", "upd", *options), says, options[0])
    done = cli(node, "job", "update", "upd", "--on-timeout", "trigger:upd")
    assert "on_timeout: a job cannot trigger itself" in clean_failure(done)
    final = job(node, "upd")
    assert (final["version"], final["spec"]) == (3, after["spec"])


# ------------------------------------------------------------------ 2. job cancel


def test_job_cancel_ends_the_job_and_cancels_its_pending_runs(node: NodeProc) -> None:
    # A tier no worker serves: every run the job fires stays PENDING until the cancel.
    ok(
        cli(
            node,
            "submit",
            "--id",
            "cancel-me",
            "--every",
            "200ms",
            "--tier",
            "nobody-serves",
            "--shell",
            "true",
        )
    )
    wait_until(lambda: len(run_ids(node, "cancel-me")) >= 2, timeout=10)
    done = ok(cli(node, "job", "cancel", "cancel-me", "--json"))
    assert json.loads(done.stdout) == {"job_id": "cancel-me", "cancelled": True}
    assert "not_found" in clean_failure(cli(node, "job", "get", "cancel-me"))
    runs = json.loads(ok(cli(node, "runs", "cancel-me", "--last", "1000", "--json")).stdout)
    assert len(runs) >= 2
    assert {(r["state"], r["why"]) for r in runs} == {("CANCELLED", "job cancelled")}, runs
    # It fires no more: five periods later, not one run more.
    time.sleep(1.0)
    assert run_ids(node, "cancel-me") == {r["run_id"] for r in runs}
    listed = {j["job_id"]: j for j in json.loads(ok(cli(node, "jobs", "--json")).stdout)}
    assert listed["cancel-me"]["cancelled"] is True and listed["cancel-me"]["next_fire"] is None


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not reaped yet counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def after_go(go: Path, then: str) -> str:
    """A task's shell line: wait for the test to make the file ``go``, then run ``then``.
    The file is looked for every 50 ms, at most 1200 times (a minute or more), so that a task
    the test never releases does not run forever: it fails then, without running ``then``."""
    at = shlex.quote(str(go))
    wait = f"i=0; while [ ! -e {at} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    return f"{wait}; [ -e {at} ] && {then}"


def test_cancel_stop_running_stops_a_running_task_and_plain_cancel_lets_it_finish(
    node: NodeProc, worker: WorkerProc, tmp_path: Path
) -> None:
    # Both tasks wait for the file `go`, which the test makes only once both cancels are
    # done, and then leave their own file: neither can end on its own while the test looks
    # (a fixed sleep could, on a loaded machine). The stopped one also writes its pid.
    go, pid_file = tmp_path / "go", tmp_path / "stopped-task.pid"
    stopped, finished = tmp_path / "stopped-task-ended", tmp_path / "plain-task-ended"
    for job_id, line in (
        (
            "stop-me",
            f"echo $$ > {shlex.quote(str(pid_file))}; "
            + after_go(go, f"touch {shlex.quote(str(stopped))}"),
        ),
        ("let-run", after_go(go, f"touch {shlex.quote(str(finished))}")),
    ):
        ok(cli(node, "submit", "--id", job_id, "--in", "1s", "--tier", TIER, "--shell", line))
    try:
        wait_until(
            lambda: all(run_state(node.port, j) == "RUNNING" for j in ("stop-me", "let-run")), 15
        )
        ok(cli(node, "job", "cancel", "stop-me", "--stop-running"))
        ok(cli(node, "job", "cancel", "let-run"))
        for job_id in ("stop-me", "let-run"):
            assert "not_found" in clean_failure(cli(node, "job", "get", job_id))
        # --stop-running: the run is CANCELLED by the node at once, its task killed.
        wait_until(lambda: run_state(node.port, "stop-me") == "CANCELLED", timeout=15)
        pid = int(wait_until(lambda: pid_file.read_text().strip() if pid_file.exists() else ""))
        wait_until(lambda: gone(pid), timeout=15)
        # Without it the run carries on (docs/protocol.md, job.cancel): still waiting for go.
        assert run_state(node.port, "let-run") == "RUNNING"
    finally:
        go.touch()  # (also on a failure: no task is left waiting in the module's worker)
    # ... and runs to its end once released, while the stopped task, released too, never
    # got to leave its file.
    wait_until(lambda: run_state(node.port, "let-run") == "SUCCESS", timeout=15)
    assert finished.exists()
    assert not stopped.exists(), worker.text()[-2000:]
    runs = json.loads(ok(cli(node, "runs", "stop-me", "--json")).stdout)
    assert [(r["state"], r["why"]) for r in runs] == [("CANCELLED", "job cancelled")]


# ------------------------------------------------------------------ 3. pause and resume


def test_pause_stops_the_fires_and_resume_starts_them_again(
    node: NodeProc, worker: WorkerProc
) -> None:
    ok(cli(node, "submit", "--id", "pulse", "--every", "300ms", "--tier", TIER, "--shell", "true"))
    try:
        wait_until(lambda: len(run_ids(node, "pulse")) >= 2, timeout=10)  # it fires
        paused = json.loads(ok(cli(node, "job", "pause", "pulse", "--json")).stdout)
        assert (paused["paused"], paused["next_fire"]) == (True, None), paused
        got = job(node, "pulse")
        assert (got["paused"], got["next_fire_ms"]) == (True, None), got
        # No wait for a fire decided just before the pause: the shard's engine takes commands
        # one at a time, and answers the pause only once its batch is durable (batches become
        # durable in order, and the store shows a batch before its fsync returns), so every
        # run it fired before the pause is in the store now; after the pause it fires none
        # (engine/shard.py, _pause, _reply_after_durable, _on_durable).
        before = run_ids(node, "pulse")
        time.sleep(2.0)  # six periods of the job
        assert run_ids(node, "pulse") == before, "a run fired while the job was paused"
        resumed = json.loads(ok(cli(node, "job", "resume", "pulse", "--json")).stdout)
        assert resumed["paused"] is False and resumed["next_fire"] is not None, resumed
        assert job(node, "pulse")["paused"] is False
        # Fires again: the catch-up run of the paused time and then the regular ones.
        wait_until(lambda: len(run_ids(node, "pulse") - before) >= 2, timeout=10)
    finally:
        cancel_quietly(node, "pulse")


# ------------------------------------------------------------------ 4. runs --last


def test_runs_last_n_gives_the_n_newest_newest_first(node: NodeProc, worker: WorkerProc) -> None:
    ok(cli(node, "submit", "--id", "many", "--every", "200ms", "--tier", TIER, "--shell", "true"))
    try:
        wait_until(lambda: len(run_ids(node, "many")) >= 8, timeout=15)
        # Paused, so that the runs stored stay the same while they are read several ways
        # (every run fired before the pause is stored by its answer: see the pause test).
        ok(cli(node, "job", "pause", "many"))
        every = history(node.port, "many")  # (at most 50: far fewer exist)
        assert len(every) > 3
        newest = sorted((r["scheduled_ms"] for r in every), reverse=True)[:3]
        shown = json.loads(ok(cli(node, "runs", "many", "--last", "3", "--json")).stdout)
        assert [r["scheduled_ms"] for r in shown] == newest  # the three newest, newest first
        assert [r["run_id"] for r in shown] == [f"many@{ms}" for ms in newest]
        # As a table: the same three rows, in the same order, and no other run of the job.
        table = ok(cli(node, "runs", "many", "--last", "3")).stdout
        assert re.findall(r"many@\d+", table) == [r["run_id"] for r in shown], table
        # More than there are: all of them.
        shown = json.loads(ok(cli(node, "runs", "many", "--last", "1000", "--json")).stdout)
        assert [r["run_id"] for r in shown] == [r["run_id"] for r in every]
        done = cli(node, "runs", "many", "--last", "0")
        assert done.returncode == 2 and "must be positive" in done.stderr, done.stderr
    finally:
        cancel_quietly(node, "many")


# ------------------------------------------------------------------ 5. worker --tier


def test_a_worker_runs_the_jobs_of_its_tier_and_a_default_worker_does_not(
    node: NodeProc, tmp_path: Path
) -> None:
    default = start_worker(node.port, tmp_path / "default.log", "w-default")
    named = None
    try:
        ok(
            cli(
                node, "submit", "--id", "tiered", "--in", "1s", "--tier", "gpu-5", "--shell", "true"
            )
        )
        # The control: a default-tier job due at the same time, which the default worker
        # does run (so it was there, serving, when it left the other one alone).
        ok(cli(node, "submit", "--id", "untiered", "--in", "1s", "--shell", "true"))
        wait_until(lambda: run_state(node.port, "untiered") == "SUCCESS", timeout=15)
        assert history(node.port, "untiered")[0]["worker"] == "w-default"
        (run,) = history(node.port, "tiered")
        assert (run["state"], run["worker"]) == ("PENDING", None), run
        assert "no worker serves tier 'gpu-5'" in (run.get("waiting") or ""), run
        named = start_worker(node.port, tmp_path / "named.log", "w-gpu", "gpu-5")
        wait_until(lambda: run_state(node.port, "tiered") == "SUCCESS", timeout=15)
        (run,) = history(node.port, "tiered")
        assert (run["state"], run["worker"]) == ("SUCCESS", "w-gpu"), run
    finally:
        try:
            default.terminate(timeout=15)
        finally:
            if named is not None:
                named.terminate(timeout=15)


# ------------------------------------------------------------------ 6. submit's output


def test_submit_prints_the_job_id_and_its_next_fire_time(node: NodeProc) -> None:
    # (tier text-out: no worker serves it, so the job fired at creation just waits)
    line = re.compile(r"(\S+)  next fire (\S+)\n")
    done = ok(
        cli(
            node,
            "submit",
            "--id",
            "text-at",
            "--at",
            "2090-06-01T12:00:00+02:00",
            "--shell",
            "true",
            "--tier",
            "text-out",
        )
    )
    assert done.stdout == "text-at  next fire 2090-06-01T10:00:00Z\n", done.stdout
    assert job(node, "text-at")["next_fire"] == "2090-06-01T10:00:00Z"
    # A generated id, printed as the job's name: `job get` of it is the job. An `every`
    # without a start fires first at its creation: the time printed is that start.
    started = time.time()
    done = ok(cli(node, "submit", "--every", "1h", "--shell", "true", "--tier", "text-out"))
    found = line.fullmatch(done.stdout)
    assert found is not None, done.stdout
    job_id, fire = found.groups()
    spec = job(node, job_id)["spec"]
    assert spec["id"] == job_id and fire == spec["schedule"]["start"], (done.stdout, spec)
    # `--in`: the time printed is the one-shot's instant, about that far from now.
    done = ok(
        cli(
            node, "submit", "--id", "text-in", "--in", "1h", "--shell", "true", "--tier", "text-out"
        )
    )
    found = line.fullmatch(done.stdout)
    assert found is not None and found.group(1) == "text-in", done.stdout
    assert found.group(2) == job(node, "text-in")["spec"]["schedule"]["at"]
    in_s = parse_instant(found.group(2), field="next fire") / 1000 - started
    assert 3600 - 5 < in_s < 3600 + 30, in_s
