"""Regression tests for four worker fixes found by review.

1. Heartbeats over a slow link (``WorkerAgent._heartbeats``/``_heartbeat``): each heartbeat
   waits for its answer up to a lease, in a task of its own, so an answer slower than
   lease / 3 still moves the fence deadline. Before, each waited lease / 3 and threw a later
   answer away: with a round trip above that, the worker fenced itself (killing its tasks)
   once a lease although the node never lost it. Real node and worker processes, the
   worker's connection through a proxy that holds back the worker -> node bytes.
2. A payload handler that raises while it is being cancelled (its nursery's child raises in
   its ``finally`` during the timeout's cancel: Trio gives a group of Cancelled and that
   error) ends that run, not the agent (``WorkerAgent._execute``): a later job still runs on
   the same in-process agent.
3. The runner's hard stop (``runner._supervise``, cancelled from outside: a worker's hard
   exit) after the leader exited, while a member of its group still has the grace of the
   stop sequence: the member is SIGKILLed too, not left running.
4. A start report lost with a broken connection (``WorkerAgent._hello``): the hello after the
   reconnect re-sends the start reports of the tasks still running, so the run leaves CLAIMED
   while its task runs, not only at its final report.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client
from cluster.runner import RunHandle, parse_proc_stat, run_task
from cluster.worker import FENCE_MARGIN_MS, HEARTBEAT_FRACTION, WorkerAgent
from engine.effects import RunTicket
from engine.lease import worker_fence_at
from engine.schedules import format_utc
from tests.cluster.procs import (
    NodeProc,
    WorkerProc,
    history,
    in_process_node,
    in_s,
    wait_until,
    with_client,
)

pytestmark = pytest.mark.timeout(60)

Out = Callable[[str, bytes], Awaitable[None]]


# --------------------------------------------------------------------------------------------
# 1. Heartbeats whose answers come later than lease / 3


class SlowLink:
    """A TCP proxy on 127.0.0.1 (a port the OS picks) to ``target_port``, in a thread with a
    Trio loop of its own (the test's waits block). Bytes from the client (the worker) are
    held back ``delay_s`` each, counted from when they were read, in order; the node's bytes
    go back at once. ``delay_s`` may be raised while it runs (never lowered: order holds)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.port = 0
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def __enter__(self) -> SlowLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(10)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            self._ready.set()

    async def _handle(self, down: trio.SocketStream) -> None:
        try:
            up = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await down.aclose()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, down, up, True, nursery.cancel_scope)
            nursery.start_soon(self._pump, up, down, False, nursery.cancel_scope)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, slow: bool, both: trio.CancelScope
    ) -> None:
        send, receive = trio.open_memory_channel[tuple[float, bytes]](float("inf"))

        async def reader() -> None:
            async with send:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await src.receive_some(65536):
                        due = trio.current_time() + (self.delay_s if slow else 0.0)
                        await send.send((due, data))

        async def writer() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                async for due, data in receive:
                    await trio.sleep_until(due)
                    await dst.send_all(data)
            both.cancel()  # one side closed, and all it sent is through: close both

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(writer)


# The numbers: with a lease L the worker fences F = worker_fence_at(sent, L) - sent after
# the newest acknowledged heartbeat left, and sends one every P = L / 3. In the steady state
# the deadline set by one heartbeat's answer must be met by the next one's, which comes
# P + D after it left (D the worker -> node delay): D + P < F. The old code failed for any
# D > P. Both hold with room to spare only when F > 2 P, which for a margin of 2 s takes a
# lease above 6 s (with a 3 s lease, F is 1.5 s and P 1 s: no D above P is survivable).
LEASE_MS = 10_000
DELAY_S = 4.0
PERIOD_S = LEASE_MS / HEARTBEAT_FRACTION / 1000
FENCE_S = worker_fence_at(0, LEASE_MS, FENCE_MARGIN_MS) / 1000


def test_heartbeat_answers_slower_than_a_third_of_the_lease_keep_the_worker_unfenced(
    tmp_path: Path,
) -> None:
    # Room of at least half a second on either side (a loaded machine's jitter).
    assert DELAY_S > PERIOD_S + 0.5 and DELAY_S + PERIOD_S + 0.5 < FENCE_S
    ticks = tmp_path / "ticks"
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease=f"{LEASE_MS // 1000}s")
    worker: WorkerProc | None = None
    try:
        with SlowLink(node.port) as link:
            worker = started = WorkerProc(
                link.port, tmp_path / "worker.log", "--drain", "0s", worker_id="ws"
            )
            started.wait_serving()
            # The link turns slow once the hello is answered: a hello held back D as well
            # would have its fence deadline (F after it left) come before the first
            # heartbeat's answer (D + P + D after it), a fence the fix does not claim to
            # avoid. Everything the worker sends from now on is late: every heartbeat, the
            # run's start and final reports.
            link.delay_s = DELAY_S
            slow_from = time.monotonic()
            # 11 s: past the hello's own deadline (F = 8 s after it) and the one set by the
            # first heartbeat's late answer. Its ticks go to a file, not the run's log: each
            # chunk of output would wait D for its answer before the next (and the final
            # report behind them), for nothing this test looks at.
            shell = f"for i in $(seq 1 11); do echo tick $i >> {ticks}; sleep 1; done"
            with_client(
                node.port,
                lambda c: c.create(
                    {"id": "slow1", "schedule": in_s(0.3), "task": {"shell": shell}}
                ),
            )

            def over() -> list[dict[str, Any]] | str:
                """The runs once the first ended, or the worker's log once it fenced (the run
                it killed goes out again: waiting for that one would only take longer)."""
                if "fencing" in (text := started.text()):
                    return text
                runs = history(node.port, "slow1")
                return runs if runs and runs[0]["state"] in ("SUCCESS", "FAILED") else []

            seen = wait_until(over, timeout=30, step=0.5)
            took_s = time.monotonic() - slow_from
        # The old worker counted no heartbeat's answer (each came after its wait of P): it
        # fenced F after its hello, some 8 s into the run, which went out again as attempt 2.
        assert not isinstance(seen, str), f"the worker fenced itself: {seen[-3000:]}"
        assert [(r["state"], r["attempt"]) for r in seen] == [("SUCCESS", 1)], seen
        assert ticks.read_text().split("\n")[:-1] == [f"tick {i}" for i in range(1, 12)]
        assert took_s > FENCE_S + DELAY_S  # (the slow link was slow: its final report too)
        assert "fencing" not in started.text()
    finally:
        if worker is not None:
            worker.kill()
        node.kill()


# --------------------------------------------------------------------------------------------
# 2. A payload handler that raises while it is cancelled


async def _final(client: Client, job_id: str, timeout_s: float = 20) -> dict[str, Any]:
    with trio.fail_after(timeout_s):
        while True:
            runs = await client.history(job_id, last=10)
            if runs and runs[0]["state"] in ("SUCCESS", "FAILED", "TIMED_OUT", "LOST"):
                return runs[0]
            await trio.sleep(0.05)


def test_a_handler_raising_while_its_timeout_cancels_it_does_not_end_the_agent(
    tmp_path: Path,
) -> None:
    cleaned = trio.Event()

    async def child() -> None:
        try:
            await trio.sleep(30)
        finally:
            cleaned.set()
            raise RuntimeError("cleanup failed")  # (the point of the test)

    async def handler(ticket: RunTicket, out: Out) -> int:
        if ticket.task["payload"] == "nursery":
            # The timeout cancels both; the nursery raises a group of the child's
            # RuntimeError and the Cancelled of the body: not an Exception the handler's
            # own except takes, and (before the fix) past every scope up to the agent.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
                await trio.sleep(30)
        await trio.sleep(0.2)
        return 0

    async def main() -> None:
        # (3 s: with 1 s a heartbeat answered a little late on a loaded machine fences a worker)
        node = in_process_node(tmp_path, lease_ms=3000, grace_ms=3000)
        with trio.fail_after(45):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                agent = WorkerAgent(
                    "127.0.0.1", port, worker_id="w-group", payload_handler=handler, watchdog=False
                )
                async with Client.connect("127.0.0.1", port) as client:
                    await nursery.start(agent.run)
                    now = time.time()
                    for job_id, payload, due_s, extra in (
                        ("group1", "nursery", 0.2, {"timeout": "1s"}),
                        ("plain1", "plain", 3.0, {}),  # due after the first has ended
                    ):
                        at = format_utc(int((now + due_s) * 1000))
                        await client.create(
                            {
                                "id": job_id,
                                "schedule": {"at": at},
                                "task": {"payload": payload},
                                **extra,
                            }
                        )
                    first = await _final(client, "group1")
                    assert cleaned.is_set()  # the handler did raise in its cleanup
                    # (The timeout fired: it is the run's end, as for a process.)
                    assert first["state"] == "TIMED_OUT", first
                    page = await client.logs(first["run_id"])
                    stderr = b"".join(c["data"] for c in page["chunks"]).decode()
                    assert "payload handler raised" in stderr, stderr
                    # The same agent takes and runs the next job: it did not end.
                    second = await _final(client, "plain1")
                    assert (second["state"], second["attempt"]) == ("SUCCESS", 1), second
                    assert agent.serving and agent.completed == 2
                nursery.cancel_scope.cancel()

    trio.run(main)


# --------------------------------------------------------------------------------------------
# 3. A hard stop during the grace a member of an ended leader's group is given


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parsed = parse_proc_stat(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if parsed is None else (parsed[0], parsed[1])


def _running(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    """The running processes of group ``pgid`` (zombies do not count)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def test_a_hard_stop_after_the_leader_exited_kills_the_members_still_in_their_grace() -> None:
    ticket = RunTicket(
        run_id="bgterm@1000",
        job_id="bgterm",
        scheduled_ms=1000,
        attempt=1,
        token=1,
        version=1,
        delivery="at_least_once",
        tier="default",
        timeout_ms=None,
        # The leader ends at once, 0; its member ignores SIGTERM: the stop sequence that
        # follows gives it the whole (long) grace, during which the worker exits hard.
        task={"shell": '(trap "" TERM; exec sleep 300) & echo "member $!"; exit 0'},
    )
    handle = RunHandle()
    member: list[int] = []
    leader: list[int] = []

    async def on_output(stream: str, data: bytes) -> None:
        if found := re.search(rb"member (\d+)", data):
            member.append(int(found[1]))

    async def main() -> bool:
        with trio.move_on_after(20) as hard_exit:  # (bounded, whatever happens)
            async with trio.open_nursery() as nursery:

                async def exit_hard() -> None:
                    leader.append(await handle.wait_started())
                    while not member or _proc_stat(leader[0]) is not None:
                        await trio.sleep(0.02)  # until the leader is reaped, not just dead
                    # In the grace by now: SIGTERM sent, the member alive and ignoring it.
                    await trio.sleep(0.5)
                    assert _running(member[0])
                    hard_exit.cancel()

                nursery.start_soon(exit_hard)
                await run_task(ticket, on_output=on_output, handle=handle, kill_grace_s=30)
                raise AssertionError("the task's stop sequence ended before the hard exit")
        return hard_exit.cancelled_caught

    started = time.monotonic()
    try:
        assert trio.run(main)
        assert time.monotonic() - started < 10  # no 30 s grace on a hard stop
        assert member, "the task never said its member's pid"
        assert wait_until(lambda: not _running(member[0]), timeout=3), "the member outlived it"
        assert _group_members(leader[0]) == []
    except AssertionError:
        if member and _running(member[0]):
            raise AssertionError(f"member {member[0]} of the task's group still runs") from None
        raise
    finally:
        if leader:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(leader[0], signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# 4. A start report lost with the connection


def test_a_start_report_lost_with_the_connection_is_sent_again_after_the_hello(
    tmp_path: Path,
) -> None:
    release = trio.Event()
    running = trio.Event()

    async def handler(ticket: RunTicket, out: Out) -> int:
        running.set()
        await release.wait()
        return 0

    async def main() -> None:
        node = in_process_node(tmp_path, lease_ms=5000, grace_ms=5000)
        with trio.fail_after(45):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                agent = WorkerAgent(
                    "127.0.0.1", port, worker_id="w-start", payload_handler=handler, watchdog=False
                )
                dropped: list[str] = []
                async with Client.connect("127.0.0.1", port) as client:
                    await nursery.start(agent.run)
                    notify = agent.client.notify

                    def lose_the_first_start(op: str, args: dict[str, Any]) -> bytes | None:
                        if op == "worker.started" and not dropped:
                            # The report is "sent" into a connection that breaks at once:
                            # the node never reads it.
                            dropped.append(args["run_id"])
                            stream = agent.client._stream
                            assert stream is not None
                            stream.socket.shutdown(socket.SHUT_RDWR)
                            return None
                        return notify(op, args)

                    agent.client.notify = lose_the_first_start  # type: ignore[method-assign]
                    at = format_utc(int((time.time() + 0.2) * 1000))
                    created = await client.create(
                        {"id": "held1", "schedule": {"at": at}, "task": {"payload": "p"}}
                    )
                    assert created["job_id"] == "held1"
                    await running.wait()
                    # Before the fix: CLAIMED until the handler ended (here: for good).
                    with trio.fail_after(15):
                        while True:
                            runs = await client.history("held1", last=1)
                            if runs and runs[0]["state"] == "RUNNING":
                                break
                            await trio.sleep(0.05)
                    assert dropped == [runs[0]["run_id"]]
                    assert not release.is_set()  # its task still runs
                    release.set()
                    final = await _final(client, "held1")
                    assert (final["state"], final["attempt"]) == ("SUCCESS", 1), final
                nursery.cancel_scope.cancel()

    trio.run(main)
