"""``make demo``: a node and a worker on a fresh data directory, sample jobs, their runs and logs.

Owns the guided tour only: it starts ``tickwheel serve`` and ``tickwheel worker`` as real
processes on 127.0.0.1 (the port picked by the OS), registers a cron job, an every-job, a
once-job and a job that overruns its timeout with the real CLI, shows what happened with the
real CLI, then stops both processes with SIGTERM and removes the directory. Must never reach
into the node: everything it shows comes over the wire, as a user would see it.
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
from pathlib import Path

from rich.console import Console

console = Console(highlight=False)
_SERVING = re.compile(r"serving \d+ shards on [\d.]+:(\d+)")


def tickwheel(*args: str, show: bool = True, env: dict[str, str] | None = None) -> str:
    """Run one CLI command the way a user would, print it and its output."""
    argv = [sys.executable, "-m", "cluster.cli", *args]
    if show:
        console.print(f"\n[bold cyan]$ tickwheel {shlex.join(args)}[/bold cyan]")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if show:
        sys.stdout.write(done.stdout)
        sys.stdout.write(done.stderr)
        sys.stdout.flush()
    if done.returncode != 0:
        raise SystemExit(f"tickwheel {' '.join(args)} failed ({done.returncode})")
    return done.stdout


def start_node(data: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    node = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--data", str(data), "--port", "0"],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = _SERVING.search(log.read_text())
        if found:
            return node, int(found.group(1))
        if node.poll() is not None:
            raise SystemExit(f"the node exited:\n{log.read_text()}")
        time.sleep(0.05)
    raise SystemExit("the node did not start within 30 s")


def stop(proc: subprocess.Popen[bytes], name: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        console.print(f"{name} stopped (exit status {code})")


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="tickwheel-demo-"))
    data = workdir / "data"
    node = worker = None
    try:
        console.rule("[bold]tickwheel demo")
        node, port = start_node(data, workdir / "node.log")
        connect = f"127.0.0.1:{port}"
        console.print(f"node serving {data} on {connect} (embedded default, 2 shards)")
        worker = subprocess.Popen(
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
                "demo-worker",
            ],
            stdout=open(workdir / "worker.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        console.print("worker demo-worker connected with 4 slots")
        env = {**os.environ, "TICKWHEEL_CONNECT": connect}

        console.rule("register four jobs")
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
        tickwheel("submit", "--id", "poller", "--every", "3s", "--command", "uname -sr", env=env)
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

        console.rule("let it run for 12 seconds")
        time.sleep(12)

        console.rule("what happened")
        tickwheel("jobs", env=env)
        tickwheel("runs", "heartbeat", "poller", "report", "overrun", "--last", "4", env=env)
        report = json.loads(tickwheel("runs", "report", "--json", show=False, env=env))
        tickwheel("logs", report[0]["run_id"], env=env)
        overrun = json.loads(tickwheel("runs", "overrun", "--json", show=False, env=env))
        tickwheel("run", overrun[0]["run_id"], env=env)
        tickwheel("logs", overrun[0]["run_id"], env=env)
        tickwheel("job", "pause", "poller", env=env)
        tickwheel("job", "cancel", "heartbeat", env=env)

        console.rule("stop")
        return 0
    finally:
        if worker is not None:
            stop(worker, "worker")
        if node is not None:
            stop(node, "node")
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
