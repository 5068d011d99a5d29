"""Real node and worker processes for integration tests: started on 127.0.0.1 with ports the OS
picks, stopped (or SIGKILLed) by the test, never left running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from cluster.client import Client

T = TypeVar("T")
_SERVING = re.compile(rb"serving \d+ shards on [\d.:a-f]+:(\d+)")  # (IPv6 hosts too)


class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process and its group (its tasks too, as a machine losing power)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class NodeProc(Proc):
    def __init__(
        self,
        data: Path,
        log: Path,
        *,
        shards: int = 2,
        lease: str = "1s",
        port: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        """``port`` 0: one the OS picks. A restarted node takes its old port (``port=``), where
        its workers reconnect."""
        super().__init__(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "serve",
                "--data",
                str(data),
                "--port",
                str(port),
                "--shards",
                str(shards),
                "--worker-lease",
                lease,
                "--host",
                host,
            ],
            log,
        )
        self.port = self._wait_port(log)

    def _wait_port(self, log: Path) -> int:
        deadline = time.monotonic() + 30
        seen = log.stat().st_size if log.exists() else 0
        while time.monotonic() < deadline:
            text = log.read_bytes()
            found = _SERVING.findall(text[max(0, seen - 200) :]) or _SERVING.findall(text)
            if found and self.alive():
                return int(found[-1])
            if not self.alive():
                raise RuntimeError(f"node exited: {text.decode(errors='replace')[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError("node did not start in 30 s")


class WorkerProc(Proc):
    """``tickwheel worker`` on the node at ``port``, with any further options (``extra``:
    ``--drain 3s`` and the like)."""

    def __init__(
        self, port: int, log: Path, *extra: str, slots: int = 2, worker_id: str = "w1"
    ) -> None:
        super().__init__(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "worker",
                "--connect",
                f"127.0.0.1:{port}",
                "--slots",
                str(slots),
                "--id",
                worker_id,
                *extra,
            ],
            log,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def with_client(port: int, body: Callable[[Client], Awaitable[T]], timeout: float = 60) -> T:
    async def main() -> T:
        with trio.fail_after(timeout):
            async with Client.connect("127.0.0.1", port, timeout_s=20) as client:
                return await body(client)

    return trio.run(main)


def wait_until(predicate: Callable[[], Any], timeout: float = 30, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not true within {timeout} s")


def in_s(seconds: float) -> dict[str, str]:
    """A one-shot schedule ``seconds`` from now."""
    from engine.schedules import format_utc

    return {"at": format_utc(int((time.time() + seconds) * 1000))}
