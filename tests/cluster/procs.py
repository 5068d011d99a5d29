"""Real node and worker processes for integration tests: started on 127.0.0.1 with ports the OS
picks, stopped (or SIGKILLed) by the test, never left running; and the ``tickwheel`` CLI and
the client calls the tests drive them with (here, so that no test module imports another)."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import trio

from cluster.client import Client
from cluster.codec import FrameDecoder, Message, ProtocolError
from engine.schedules import format_utc

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
        """SIGTERM, and its exit status once it exits. One not gone within ``timeout`` is
        SIGKILLed with its group before the ``TimeoutExpired`` goes on: a stop that fails
        leaves no process running past the test."""
        try:
            if self.alive():
                self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout)
        finally:
            self.kill()  # (a no-op once it exited)


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
        self.worker_id = worker_id

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self, timeout: float = 20) -> WorkerProc:
        """Wait until the worker logs that it serves (its first hello answered): a test that
        asserts what a worker does *not* run must know it was there to run it. One that does
        not serve in time is SIGKILLed, and the test fails with its log."""
        try:
            wait_until(lambda: f"worker {self.worker_id} serving" in self.text(), timeout)
        except AssertionError:
            self.kill()
            raise AssertionError(
                f"worker {self.worker_id} did not serve: {self.text()[-2000:]}"
            ) from None
        return self


def start_worker(port: int, log: Path, worker_id: str, *tiers: str, slots: int = 4) -> WorkerProc:
    """A ``tickwheel worker`` on ``tiers`` (none: the default tier) of the node at ``port``,
    returned once it serves. ``--drain 0s``: its stop ends it at once, not after the default
    30 s drain."""
    extra = [arg for tier in tiers for arg in ("--tier", tier)]
    worker = WorkerProc(port, log, *extra, "--drain", "0s", slots=slots, worker_id=worker_id)
    return worker.wait_serving()


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
    return {"at": format_utc(int((time.time() + seconds) * 1000))}


# ------------------------------------------------------------------ the CLI and the client


def tw(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``tickwheel ARGS`` (no --connect added), with ``env`` added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})},
    )


def cli(node: NodeProc, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return tw(*args, "--connect", f"127.0.0.1:{node.port}", timeout=timeout)


def clean_failure(done: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The stderr of a command that failed with ``status`` and one error line, no traceback."""
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error "), done.stderr
    return done.stderr


def ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return done


def job(node: NodeProc, job_id: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ok(cli(node, "job", "get", job_id, "--json")).stdout)
    return result


def history(port: int, job_id: str) -> list[dict[str, Any]]:
    async def body(c: Client) -> list[dict[str, Any]]:
        return await c.history(job_id, last=50)

    return with_client(port, body)


def run_state(port: int, job_id: str) -> str | None:
    """The state of job ``job_id``'s newest run (None: it has none)."""
    runs = history(port, job_id)
    return str(runs[0]["state"]) if runs else None


class Raw:
    """A bare protocol connection to a node on 127.0.0.1: whatever bytes or requests we like
    out (no client-side checks), decoded frames in, pushes kept apart from replies."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.pushes: list[Message] = []
        self.next_id = 0

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_body(self, body: bytes) -> None:
        """One frame around ``body``, whatever it holds."""
        await self.stream.send_all(struct.pack(">I", len(body)) + body)

    async def send(self, message: Any) -> None:
        await self.send_body(msgpack.packb(message, use_bin_type=True))

    async def receive(self) -> Message:
        """The next reply (pushes are set aside)."""
        while True:
            event = self.decoder.next_event()
            if event is None:
                data = await self.stream.receive_some(1 << 16)
                assert data, "the node closed the connection"
                self.decoder.feed(data)
                continue
            assert not isinstance(event, ProtocolError), event
            if "push" in event:
                self.pushes.append(event)
                continue
            return event

    async def call(self, op: str, args: Any = None, **extra: Any) -> Message:
        """Send one request and return its reply (nothing else is in flight)."""
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "op": op, **extra}
        if args is not None:
            message["args"] = args
        await self.send(message)
        reply = await self.receive()
        assert reply["id"] == self.next_id, reply
        return reply

    async def first_push(self) -> Message:
        """The first push, pinging until one came (pushes arrive between replies)."""
        with trio.fail_after(5):
            while not self.pushes:
                assert (await self.call("ping"))["ok"]
        return self.pushes[0]

    async def ok(self, op: str, args: dict[str, Any] | None = None) -> Any:
        reply = await self.call(op, args)
        assert reply["ok"] is True, (op, reply)
        return reply["result"]

    async def push(self, kind: str, timeout: float = 10) -> Message:
        """The first push of ``kind``, pinging until it came (pushes arrive between replies)."""
        with trio.fail_after(timeout):
            while True:
                for push in self.pushes:
                    if push["push"] == kind:
                        self.pushes.remove(push)
                        return push
                await self.ok("ping")
                await trio.sleep(0.02)

    async def aclose(self) -> None:
        await self.stream.aclose()


def in_process_node(tmp_path: Path, *, lease_ms: int, grace_ms: int) -> Any:
    """A ``cluster.node.Node`` (two shards) on ``tmp_path / "data"``, for a test that runs it
    in its own Trio run, with this worker lease and reattach grace."""
    from cluster.node import Node
    from engine.shard import EngineConfig

    return Node(
        tmp_path / "data",
        shards=2,
        config=EngineConfig(worker_lease_ms=lease_ms, reattach_grace_ms=grace_ms),
    )
