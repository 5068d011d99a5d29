"""A connection that breaks under a client that does not reconnect (the CLI's), with real node
processes on 127.0.0.1: the client says ``ConnectionLost`` at once, and ``tickwheel logs
--follow`` rides out a node restart, resuming exactly where it was."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cluster.client import Client, ConnectionLost
from tests.cluster.procs import NodeProc, WorkerProc, wait_until, with_client

pytestmark = pytest.mark.timeout(120)


def test_a_broken_connection_without_reconnect_fails_requests_with_connection_lost(
    tmp_path: Path,
) -> None:
    """Found by the fifth adversarial pass: a request after the break waited out the whole
    timeout and raised ``RequestTimeout`` (read as "the node is slow")."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:

        async def main() -> list[BaseException]:
            errors: list[BaseException] = []
            # A timeout far beyond the bound below: waiting it out fails the test.
            async with Client.connect("127.0.0.1", node.port, timeout_s=600, reconnect=False) as c:
                await c.request("ping")
                node.kill()
                with trio.fail_after(30):
                    while c._stream is not None:  # the reader has seen the end
                        await trio.sleep(0.01)
                    for op in ("ping", "ping"):  # each later request too, not only the first
                        try:
                            await c.request(op)
                        except ConnectionLost as exc:
                            errors.append(exc)
            return errors

        errors = trio.run(main)
        assert len(errors) == 2 and all("lost" in str(e) for e in errors), errors
    finally:
        node.kill()


def test_logs_follow_rides_out_a_node_restart_without_repeating_or_skipping(
    tmp_path: Path,
) -> None:
    """Found by the fifth adversarial pass: ``logs --follow`` ended with "no reply within
    10 s" when the node was restarted, although the run carried on."""
    # A lease long enough for the worker to ride out the restart without fencing its task.
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="10s")
    port = node.port
    worker = WorkerProc(port, tmp_path / "worker.log", slots=1)
    follow: subprocess.Popen[str] | None = None
    try:
        marker = tmp_path / "started"
        lines = 12
        shell = f"touch {marker}; for i in $(seq 1 {lines}); do echo line $i; sleep 0.4; done"

        async def create(c: Client) -> None:
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
            await c.create({"id": "tick", "schedule": {"at": at}, "task": {"shell": shell}})

        with_client(port, create)
        wait_until(marker.exists, timeout=30, step=0.05)

        async def run_id(c: Client) -> str:
            return str((await c.history("tick", last=1))[0]["run_id"])

        rid = with_client(port, run_id)
        out_path, err_path = tmp_path / "follow.out", tmp_path / "follow.err"
        follow = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "logs", rid, "--follow"],
            env={"TICKWHEEL_CONNECT": f"127.0.0.1:{port}", "PATH": "/usr/bin:/bin"},
            stdout=open(out_path, "w"),
            stderr=open(err_path, "w"),
        )
        wait_until(lambda: out_path.read_text(), timeout=30, step=0.05)  # following
        node.kill()
        node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="10s", port=port)
        follow.wait(timeout=90)
        out, err = out_path.read_text(), err_path.read_text()
        assert follow.returncode == 0, err
        stored = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "logs", rid, "--json"],
            env={"TICKWHEEL_CONNECT": f"127.0.0.1:{port}", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        expected = "".join(f"line {i}\n" for i in range(1, lines + 1))
        assert out == expected, (out, err, stored)
        assert "connected again" in err, err

        async def final(c: Client) -> dict[str, object]:
            return (await c.history("tick", last=1))[0]

        run = with_client(port, final)
        assert (run["state"], run["attempt"]) == ("SUCCESS", 1), run  # one execution
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
        worker.terminate()
        node.kill()


def test_a_request_a_silent_peer_never_answers_times_out() -> None:
    """A peer that reads requests and never answers: each request raises ``RequestTimeout``
    after its own timeout (the call's, else the client's), and the connection stays usable
    for the next one."""
    from cluster.client import RequestTimeout

    async def main() -> list[float]:
        took: list[float] = []

        async def silent(stream: trio.SocketStream) -> None:
            while await stream.receive_some():
                pass

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            async with Client.connect("127.0.0.1", port, timeout_s=0.3) as c:
                for timeout_s in (None, 0.1, 0.5):
                    started = trio.current_time()
                    with trio.fail_after(10), pytest.raises(RequestTimeout, match="no reply"):
                        await c.request("ping", timeout_s=timeout_s)
                    took.append(trio.current_time() - started)
            nursery.cancel_scope.cancel()
        return took

    took = trio.run(main)
    assert 0.3 <= took[0] < 2 and 0.1 <= took[1] < 1.5 and 0.5 <= took[2] < 2.5, took
