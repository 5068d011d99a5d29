"""The CLI under a retry, a ^C, a node that died, and --json on a usage error (found by review).

Real node processes on 127.0.0.1 (ports the OS picks), and a fake client for the stall limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cluster.client import ConnectionLost
from cluster.commands import submit_lines
from tests.cluster.procs import NodeProc

pytestmark = pytest.mark.timeout(60)


def cli(port: int, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TICKWHEEL_CONNECT": f"127.0.0.1:{port}"}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=40,
        **kw,
    )


def test_submit_again_with_the_same_id_and_spec_is_not_an_error(tmp_path: Path) -> None:
    """A timed-out `submit` says: "submit again with --id to retry without a second job".
    Doing so, when the first attempt did create the job (the same spec), succeeds; it was
    answered `exists` with exit status 1, and a retry loop in a script never ended. Another
    spec under that id stays an error."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        argv = ("submit", "--id", "retry-me", "--every", "1h", "--shell", "echo hi", "--json")
        first = cli(node.port, *argv)
        assert first.returncode == 0, first.stderr
        again = cli(node.port, *argv)  # the retry the timeout message tells the user to make
        assert again.returncode == 0, (again.stdout, again.stderr)
        assert json.loads(again.stdout)["job_id"] == "retry-me"
        assert "exists already, with this spec" in again.stderr
        other = cli(node.port, "submit", "--id", "retry-me", "--every", "2h", "--shell", "x")
        assert other.returncode == 1 and "exists" in other.stderr
    finally:
        node.kill()


def test_ctrl_c_during_submit_file_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """^C inside `submit --file` comes out of submit_lines' nursery wrapped in a
    BaseExceptionGroup: it was a 60-line traceback and status 1, with nothing said of the
    jobs created. Now status 130, and a line on what is left and how to go on."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        path = tmp_path / "specs.jsonl"
        with open(path, "w") as f:
            for _ in range(60_000):
                spec = {"schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "true"}}
                f.write(json.dumps(spec) + "\n")
        env = {**os.environ, "TICKWHEEL_CONNECT": f"127.0.0.1:{node.port}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "submit", "--file", str(path), "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(1.5)  # batches in flight
        assert proc.poll() is None, "the submit ended before the ^C"
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err[-3000:]
        assert proc.returncode == 130, (proc.returncode, err[-500:])
        assert "interrupted: jobs of the lines already sent may exist" in err
    finally:
        node.kill()


def test_submit_file_gives_up_within_the_stall_limit_after_the_node_died() -> None:
    """SUBMIT_STALL_S promises: no answer to any batch for stall_s -> the batches not yet
    answered stop trying. The stall was checked only before each try, and a try then waited
    its whole timeout_s: a batch whose first try ended just under stall_s after the last
    answer started a second full try (live, 30,000 lines, the node SIGKILLed at 1.3 s: 11
    batches ended at 31.3 s, 3 more at 61.2 s). Here: one batch answered at 0.1 s, the
    other's connection is gone (each try waits its timeout, as Client.request does while a
    reconnect fails)."""

    class DyingClient:
        def __init__(self) -> None:
            self.calls = 0

        async def request(
            self,
            op: str,
            args: dict[str, Any],
            *,
            timeout_s: float | None = None,
            sent_on: list[int] | None = None,
            retry: bool = True,
        ) -> Any:
            self.calls += 1
            if sent_on is not None:
                sent_on.append(1)
            if self.calls == 2:  # the first batch's reply comes, then the node dies
                await trio.sleep(0.1)
                return {"results": [{"ok": True, "result": {}} for _ in args["specs"]]}
            await trio.sleep(timeout_s or 1.0)
            raise ConnectionLost("connection lost and not made again")

    spec = {"schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "true"}}
    numbered = [(n, dict(spec)) for n in range(1, 21)]

    async def main() -> float:
        start = trio.current_time()
        await submit_lines(
            DyingClient(),  # type: ignore[arg-type]
            numbered,
            batch=10,
            in_flight=2,
            timeout_s=1.0,
            stall_s=1.0,
        )
        return trio.current_time() - start

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert took <= 1.0 + 0.2, f"gave up after {took:.2f} s, the stall limit is 1 s"


def test_a_usage_error_under_json_is_json(tmp_path: Path) -> None:
    """With --json every failure is one JSON object on stdout: a usage error (--in 0s, a bad
    TICKWHEEL_CONNECT, --tz without --cron) printed only plain text on stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "jobs", "--json"],
        env={**os.environ, "TICKWHEEL_CONNECT": "garbage"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["code"] == "usage"


def test_a_file_submitted_again_counts_the_jobs_already_there(tmp_path: Path) -> None:
    """After a ^C or a failure, the same file again: lines with an id whose job holds their
    spec are done (not `exists` errors); a line whose id holds another spec is an error."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        path = tmp_path / "specs.jsonl"
        specs = [
            {"id": f"f-{i}", "schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "true"}}
            for i in range(5)
        ]
        path.write_text("".join(json.dumps(spec) + "\n" for spec in specs[:3]))
        first = cli(node.port, "submit", "--file", str(path))
        assert first.returncode == 0, first.stderr
        specs[1]["task"] = {"shell": "false"}  # another spec under f-1
        path.write_text("".join(json.dumps(spec) + "\n" for spec in specs))
        again = cli(node.port, "submit", "--file", str(path), "--json")
        assert again.returncode == 1
        assert json.loads(again.stdout) == ["f-0", None, "f-2", "f-3", "f-4"]
        assert f"{path}:2: exists" in again.stderr
        plain = cli(node.port, "submit", "--file", str(path))
        assert "0 jobs created, 1 not created, 4 there already with the same spec" in plain.stdout
    finally:
        node.kill()


def test_runs_of_a_known_and_an_unknown_job_shows_the_known_ones(tmp_path: Path) -> None:
    """`runs A NOPE`: A's history was fetched and dropped, only the not_found printed."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        assert (
            cli(node.port, "submit", "--id", "a", "--in", "1s", "--shell", "true").returncode == 0
        )
        deadline = time.monotonic() + 20
        while True:
            done = cli(node.port, "runs", "a", "nope", "--json")
            if json.loads(done.stdout) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert done.returncode == 1
        assert [r["job_id"] for r in json.loads(done.stdout)] == ["a"]
        assert "not_found: no job nope" in done.stderr
        alone = cli(node.port, "runs", "nope", "--json")  # one job: its error, as before
        assert alone.returncode == 1 and json.loads(alone.stdout)["error"]["code"] == "not_found"
    finally:
        node.kill()
