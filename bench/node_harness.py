"""What the node benchmarks share: a real node process on a temporary data directory, the disk's
own fsync rate beside it, and percentiles.

Owns starting ``tickwheel serve --port 0`` as a subprocess on 127.0.0.1 (its port read from its
"serving N shards on HOST:PORT" log line), stopping it with SIGTERM (it finishes its batches and
closes its stores) and deleting the directory, and optional profiling: with
``TICKWHEEL_BENCH_PROFILE=DIR`` set, the node (and any helper process a suite starts through
:func:`python_argv`) runs under cProfile and leaves ``DIR/<name>.prof`` behind. Must never leave
a process running or a directory behind, and never judge a figure.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

PROFILE_ENV = "TICKWHEEL_BENCH_PROFILE"
_SERVING = re.compile(rb"serving \d+ shards on [\d.]+:(\d+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def python_argv(module: str, args: list[str], *, profile_name: str) -> list[str]:
    """``python -m module args``, under cProfile when :data:`PROFILE_ENV` names a directory."""
    profile_dir = os.environ.get(PROFILE_ENV)
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        out = str(Path(profile_dir) / f"{profile_name}.prof")
        return [sys.executable, "-m", "cProfile", "-o", out, "-m", module, *args]
    return [sys.executable, "-m", module, *args]


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far, from ``/proc`` (Linux); None
    when it cannot be read. CPU time per operation, unlike a rate, barely moves when other
    processes share the cores, so the suites report it beside their rates."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14 and 15 of proc(5) (utime, stime), counted after the ")" that ends field 2.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class NodeProcess:
    """A node serving a fresh temporary data directory; use as a context manager.

    ``port`` is known once the context is entered. On exit the node gets SIGTERM and up to
    :data:`STOP_TIMEOUT_S` to stop cleanly (then SIGKILL), and the directory is removed.
    ``stop_s`` is how long the clean stop took.
    """

    def __init__(self, *, shards: int = 2, name: str = "node") -> None:
        self.shards = shards
        self.name = name
        self.root = Path(tempfile.mkdtemp(prefix="tickwheel-bench-"))
        self.data = self.root / "data"
        self.log_path = self.root / "node.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.stop_s = 0.0
        self.returncode: int | None = None

    def __enter__(self) -> NodeProcess:
        argv = python_argv(
            "cluster.cli",
            ["serve", "--data", str(self.data), "--port", "0", "--shards", str(self.shards)],
            profile_name=self.name,
        )
        try:
            with open(self.log_path, "wb") as log:
                # Its own session, so a Ctrl-C of the benchmark does not reach it twice.
                self.proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            self.port = self._wait_port()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop()

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the node used so far; None where /proc is missing."""
        return process_cpu_s(self.proc.pid) if self.proc is not None else None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def _wait_port(self) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = _SERVING.search(self.log_path.read_bytes())
            if found:
                return int(found[1])
            if self.proc.poll() is not None:
                raise RuntimeError(f"the node exited at start:\n{self.log_tail()}")
            time.sleep(0.02)
        raise RuntimeError(f"the node did not start within {START_TIMEOUT_S} s")

    def _stop(self) -> None:
        try:
            if self.proc is not None:
                start = time.monotonic()
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.returncode = self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.returncode = self.proc.wait(10)
                self.stop_s = time.monotonic() - start
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM, wait, SIGKILL if it will not stop: never leave a helper process behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def fdatasync_rate(directory: Path, *, count: int, max_s: float, size: int = 128) -> float:
    """One small write plus one fdatasync at a time, on the disk under ``directory``: what a
    store that syncs every submit alone could reach at best. Up to ``count`` syncs or
    ``max_s`` seconds; returns syncs per second."""
    path = directory / "fdatasync.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        record = b"x" * size
        done = 0
        start = time.perf_counter()
        deadline = start + max_s
        while done < count and (done < 10 or time.perf_counter() < deadline):
            os.write(fd, record)
            os.fdatasync(fd)
            done += 1
        return done / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _durable_echo_server(path: str, ports: multiprocessing.Queue[int]) -> None:
    """The far end of :func:`durable_echo_rate`: listens on a port it reports in ``ports``;
    per request, one write + fdatasync, then a small reply; ends when the peer closes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ports.put(listener.getsockname()[1])
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while data := conn.recv(4096):
            os.write(fd, data)
            os.fdatasync(fd)
            conn.sendall(b"k" * 32)
    finally:
        os.close(fd)
        conn.close()


def durable_echo_rate(directory: Path, *, count: int, max_s: float) -> float:
    """The floor of one-at-a-time durable submits on this machine, with no framework at all:
    a client sends a 120-byte request over loopback TCP to another process, which writes it,
    fdatasyncs it (on the disk under ``directory``) and replies; the client waits for the reply
    before the next request. Two blocking sockets and a plain loop, so what is left is the
    kernel's wake-ups and the disk. Up to ``count`` round trips or ``max_s`` seconds; returns
    round trips per second."""
    path = directory / "echo.bin"
    # forkserver, not fork: the caller has run Trio and may have threads whose locks a forked
    # child would inherit.
    context = multiprocessing.get_context("forkserver")
    ports: multiprocessing.Queue[int] = context.Queue()
    server = context.Process(target=_durable_echo_server, args=(str(path), ports), daemon=True)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", ports.get(timeout=60))) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request = b"r" * 120
            done = 0
            start = time.perf_counter()
            deadline = start + max_s
            while done < count and (done < 10 or time.perf_counter() < deadline):
                conn.sendall(request)
                if not conn.recv(4096):
                    raise RuntimeError("the echo server closed its side")
                done += 1
            return done / (time.perf_counter() - start)
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(10)
        path.unlink(missing_ok=True)


def _trio_echo_server(ports: multiprocessing.Queue[int]) -> None:
    """The far end of :func:`trio_echo_rate`: a Trio server on a port it reports in ``ports``,
    one task per connection answering each read with a 32-byte reply; runs until killed."""
    import trio

    async def handle(stream: trio.SocketStream) -> None:
        while await stream.receive_some(4096):
            await stream.send_all(b"k" * 32)

    async def serve() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        ports.put(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handle, listeners)

    trio.run(serve)


def trio_echo_rate(*, connections: int, max_s: float) -> tuple[float, float, float | None]:
    """What a Trio server and Trio clients cost on this machine before they do any work: a
    server process that only echoes (no decoding, no engine, no disk), ``connections`` client
    connections in this process, each sending a 120-byte request and waiting for the reply
    before the next, for ``max_s`` seconds. Returns (round trips/s, client CPU us and server
    CPU us per round trip; the server's None where /proc is missing). A node and its client
    library do all of this and their work besides, so their rate in the same mode stays under
    this one."""
    import trio

    context = multiprocessing.get_context("forkserver")  # as durable_echo_rate: no fork
    ports: multiprocessing.Queue[int] = context.Queue()
    server = context.Process(target=_trio_echo_server, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)

        async def measure() -> tuple[int, float]:
            streams: list[trio.SocketStream] = []
            done = 0

            async def lane(stream: trio.SocketStream, end: float) -> None:
                nonlocal done
                request = b"r" * 120
                while time.perf_counter() < end:
                    await stream.send_all(request)
                    if not await stream.receive_some(4096):
                        raise RuntimeError("the echo server closed its side")
                    done += 1

            try:
                for _ in range(connections):
                    streams.append(await trio.open_tcp_stream("127.0.0.1", port))
                start = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for stream in streams:
                        nursery.start_soon(lane, stream, start + max_s)
                return done, time.perf_counter() - start
            finally:
                # Closed however the measurement ends, a failed one included (synchronously:
                # a close must not wait in a cancelled scope).
                for stream in streams:
                    stream.socket.close()

        server_cpu0, client_cpu0 = process_cpu_s(server.pid or 0), time.process_time()
        done, elapsed = trio.run(measure)
        client_cpu = time.process_time() - client_cpu0
        server_cpu1 = process_cpu_s(server.pid or 0)
        done = max(1, done)
        server_us = (
            None
            if server_cpu0 is None or server_cpu1 is None
            else (server_cpu1 - server_cpu0) / done * 1e6
        )
        return done / elapsed, client_cpu / done * 1e6, server_us
    finally:
        server.kill()
        server.join(10)


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]
