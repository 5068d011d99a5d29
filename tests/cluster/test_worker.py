"""The worker agent's side of the protocol: which dispatches it takes (by run id and token, and
the epoch fence), when it says hello again, and when it fences itself.

Most tests put the real :class:`~cluster.worker.WorkerAgent` (real task processes, real TCP on
127.0.0.1) against a scripted node: a socket server speaking the wire protocol that answers
what the test says and pushes the dispatches the test writes, so that a stale epoch or a
repeated run id can be sent on purpose. The fence test uses a real node process, frozen with
SIGSTOP right after an acknowledged heartbeat.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.codec import FrameDecoder, ProtocolError, encode
from cluster.worker import FENCE_MARGIN_MS, WorkerAgent
from engine.lease import worker_fence_at
from engine.routing import shard_of
from engine.runs import fencing_token
from tests.cluster.procs import NodeProc, in_process_node

pytestmark = pytest.mark.timeout(90)

Answer = Callable[[str, dict[str, Any]], dict[str, Any] | None]


class ScriptedNode:
    """A node stand-in: records every request, answers ``ok`` (or what ``answer`` returns for
    an op: a result, or ``{"error": {...}}``; None: no answer at all), and pushes to the
    newest connection."""

    def __init__(self, *, lease_ms: int = 30_000, shards: int = 2) -> None:
        self.lease_ms, self.shards = lease_ms, shards
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.answer: Answer | None = None
        self.stream: trio.SocketStream | None = None
        self.changed = trio.Event()
        self.sending = trio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        assert self.stream is not None
        async with self.sending:
            await self.stream.send_all(encode(message))

    async def serve(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        decoder = FrameDecoder()
        try:
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                while (msg := decoder.next_event()) is not None:
                    assert not isinstance(msg, ProtocolError)
                    op, args = msg["op"], msg.get("args", {})
                    self.requests.append((op, args))
                    self.changed.set()
                    self.changed = trio.Event()
                    reply = self.reply(op, args)
                    if reply is not None:
                        await self.send({"id": msg["id"], **reply})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def default(self, op: str) -> dict[str, Any]:
        """A real node's answer to a worker op that it takes."""
        if op == "worker.hello":
            return {"lease_ms": self.lease_ms, "shards": self.shards}
        if op == "worker.heartbeat":
            return {"lease_ms": self.lease_ms}
        return {}

    def reply(self, op: str, args: dict[str, Any]) -> dict[str, Any] | None:
        result = self.default(op) if self.answer is None else self.answer(op, args)
        if result is None:
            return None
        if "error" in result:
            return {"ok": False, **result}
        return {"ok": True, "result": result}

    async def push(self, message: dict[str, Any]) -> None:
        await self.send(message)

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [args for o, args in self.requests if o == op]

    def finished(self) -> dict[tuple[str, int], str]:
        """(run id, token) -> outcome of every final report received."""
        out = {}
        for op, args in self.requests:
            reports = args["reports"] if op == "worker.finished_many" else [args]
            if op in ("worker.finished", "worker.finished_many"):
                for r in reports:
                    out[(r["run_id"], r["token"])] = r["outcome"]
        return out

    async def until(self, predicate: Callable[[], Any], timeout: float = 20) -> Any:
        with trio.fail_after(timeout):
            while not (value := predicate()):
                with trio.move_on_after(0.05):  # a request, or the worker's state, changed
                    await self.changed.wait()
            return value


def dispatch(job_id: str, at: int, token: int, shell: str, *, attempt: int = 1) -> dict[str, Any]:
    return {
        "push": "dispatch",
        "run": {
            "run_id": f"{job_id}@{at}",
            "job_id": job_id,
            "scheduled_ms": at,
            "attempt": attempt,
            "token": token,
            "version": 1,
            "delivery": "at_least_once",
            "tier": "default",
            "timeout_ms": None,
            "on_timeout": "kill",
            "task": {"shell": shell},
        },
    }


def with_scripted_node(
    body: Callable[[ScriptedNode, WorkerAgent], Awaitable[None]],
    *,
    lease_ms: int = 30_000,
    **agent_options: Any,
) -> None:
    async def main() -> None:
        node = ScriptedNode(lease_ms=lease_ms)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    partial(trio.serve_tcp, node.serve, 0, host="127.0.0.1")
                )
                port = listeners[0].socket.getsockname()[1]
                agent = WorkerAgent("127.0.0.1", port, worker_id="w-test", **agent_options)
                await nursery.start(agent.run)
                await body(node, agent)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_newer_attempt_of_a_held_run_supersedes_the_old_one() -> None:
    t1, t2 = fencing_token(1, 1), fencing_token(2, 1)
    rid = "job-a@1000"
    # The first attempt hangs (and ignores SIGTERM); the second ends at once.
    shell = f'trap "" TERM; if [ "$TICKWHEEL_FENCE" = "{t1}" ]; then sleep 60; fi; echo done'

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        await node.push(dispatch("job-a", 1000, t1, shell))
        await node.until(lambda: any(a["token"] == t1 for a in node.ops("worker.started")))
        # The node handed the run out again (a restart undid the claim): attempt 2, to us.
        await node.push(dispatch("job-a", 1000, t2, shell, attempt=2))
        await node.until(lambda: (rid, t2) in node.finished())
        assert node.finished() == {(rid, t2): "success"}  # the old attempt reports nothing
        # The old task was killed, not waited for; the new attempt is acknowledged.
        await node.until(lambda: agent.running == 0 and rid not in agent.held)
        # A repeat of the same attempt is ignored.
        await node.push(dispatch("job-a", 1000, t2, shell, attempt=2))
        await node.push(dispatch("job-b", 1000, t2, "true"))
        await node.until(lambda: ("job-b@1000", t2) in node.finished())
        assert list(node.finished()) == [(rid, t2), ("job-b@1000", t2)]

    with_scripted_node(body, kill_grace_s=30.0)


def _jobs_on_shards(shards: int) -> tuple[str, str]:
    """Two job ids on different shards."""
    first = "job-0"
    for i in range(1, 100):
        other = f"job-{i}"
        if shard_of(other, shards) != shard_of(first, shards):
            return first, other
    raise AssertionError("no job id on another shard")


def test_a_dispatch_of_an_older_epoch_than_seen_for_its_shard_is_refused() -> None:
    job, elsewhere = _jobs_on_shards(2)

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        await node.push(dispatch(job, 1, fencing_token(3, 1), "true"))
        await node.until(lambda: (f"{job}@1", fencing_token(3, 1)) in node.finished())
        # A stale owner of the shard (epoch 2) dispatches: refused, never run.
        await node.push(dispatch(job, 2, fencing_token(2, 9), "true"))
        # Another shard has its own epochs; the same shard at epoch 3 or later goes on.
        await node.push(dispatch(elsewhere, 3, fencing_token(1, 1), "true"))
        await node.push(dispatch(job, 4, fencing_token(4, 1), "true"))
        await node.until(lambda: len(node.finished()) == 3)
        assert set(node.finished()) == {
            (f"{job}@1", fencing_token(3, 1)),
            (f"{elsewhere}@3", fencing_token(1, 1)),
            (f"{job}@4", fencing_token(4, 1)),
        }
        assert agent.newest_epoch == {shard_of(job, 2): 4, shard_of(elsewhere, 2): 1}
        held = [args["held"] for args in node.ops("worker.heartbeat")]
        assert not any(r[0] == f"{job}@2" for h in held for r in h)

    with_scripted_node(body)


def test_a_worker_told_not_a_worker_says_hello_again() -> None:
    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        refused: list[int] = []

        def answer(op: str, args: dict[str, Any]) -> dict[str, Any] | None:
            if op == "worker.heartbeat" and not refused:
                refused.append(1)
                return {"error": {"code": "not_a_worker", "message": "say hello", "field": None}}
            return node.default(op)

        node.answer = answer
        await node.until(lambda: refused)
        await node.until(lambda: len(node.ops("worker.hello")) >= 2, timeout=10)

    with_scripted_node(body, lease_ms=900)  # a heartbeat every 0.3 s


def _dead(pid: int) -> bool:
    """The process is gone or a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_cut_off_worker_kills_its_task_before_its_lease_can_lapse(tmp_path: Path) -> None:
    """The node freezes right after acknowledging a heartbeat: the task (which ignores
    SIGTERM, and the kill grace is long) must be dead before that heartbeat's send time plus
    the lease, when the node could hand the run out again."""
    lease_ms = 5_000
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", lease="5s")
    pid_file = tmp_path / "task.pid"

    async def main() -> None:
        from cluster.client import Client

        agent = WorkerAgent("127.0.0.1", node.port, worker_id="w-fence", kill_grace_s=30.0)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                async with Client.connect("127.0.0.1", node.port) as client:
                    await client.create(
                        {
                            "id": "fence1",
                            "schedule": {"at": "2020-01-01T00:00:00Z"},
                            "task": {
                                "shell": f"trap '' TERM; echo $$ > {pid_file}; "
                                "while :; do sleep 0.1; done"
                            },
                        }
                    )
                while not pid_file.exists() or not pid_file.read_text().strip():
                    await trio.sleep(0.05)
                last = agent.acked_sent_ms
                while agent.acked_sent_ms == last:  # a heartbeat acknowledged just now
                    await trio.sleep(0.005)
                acked = agent.acked_sent_ms
                os.kill(node.proc.pid, signal.SIGSTOP)
                pid = int(pid_file.read_text())
                for _ in range(400):  # bounded: 20 s
                    if _dead(pid):
                        break
                    await trio.sleep(0.05)
                dead_at = time.monotonic_ns() // 1_000_000
                assert _dead(pid), "the task outlived the fence"
                assert agent.fenced >= 1
                # Dead (reaped) before the node's lease could lapse, and not before the fence.
                assert dead_at < acked + lease_ms
                assert dead_at >= worker_fence_at(acked, lease_ms, FENCE_MARGIN_MS)
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        node.kill()


def test_output_whose_answer_was_lost_is_not_stored_twice(tmp_path: Path) -> None:
    """A proxy between worker and node passes the first ``worker.output`` on, then cuts the
    connection before its answer comes back: the worker sends the chunk again after the
    reconnect, and the node keeps it once."""
    from cluster.client import Client, RemoteError

    cut = trio.Event()

    async def proxy(node_port: int, down: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream("127.0.0.1", node_port)
        hold = trio.Event()  # this connection's answers stop here

        async def to_worker() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while data := await up.receive_some(65536):
                    if hold.is_set():
                        return  # the answer to the output never reaches the worker
                    await down.send_all(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(to_worker)
            buf = b""
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while data := await down.receive_some(65536):
                    buf += data
                    while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
                        size = 4 + int.from_bytes(buf[:4], "big")
                        frame, buf = buf[:size], buf[size:]
                        await up.send_all(frame)
                        decoder = FrameDecoder()
                        decoder.feed(frame)
                        msg = decoder.next_event()
                        if isinstance(msg, dict) and msg.get("op") == "worker.output":
                            if not cut.is_set():
                                cut.set()
                                hold.set()
                                await trio.sleep(0.3)  # the node appends and answers
                                await down.aclose()
                                await up.aclose()
                                nursery.cancel_scope.cancel()
                                return
            nursery.cancel_scope.cancel()

    async def main() -> None:
        node = in_process_node(tmp_path, lease_ms=5000, grace_ms=10_000)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                node_port = await nursery.start(node.run)
                listeners = await nursery.start(
                    partial(trio.serve_tcp, partial(proxy, node_port), 0, host="127.0.0.1")
                )
                proxy_port = listeners[0].socket.getsockname()[1]
                agent = WorkerAgent("127.0.0.1", proxy_port, worker_id="w-dup")
                await nursery.start(agent.run)
                async with Client.connect("127.0.0.1", node_port) as client:
                    await client.create(
                        {
                            "id": "dup1",
                            "schedule": {"at": "2020-01-01T00:00:00Z"},
                            "task": {"shell": "echo first-line; sleep 1; echo second-line"},
                        }
                    )
                    rid = "dup1@1577836800000"
                    run: dict[str, Any] = {}
                    for _ in range(300):  # bounded: 30 s
                        with contextlib.suppress(RemoteError):  # not fired yet
                            run = await client.run(rid)
                        if run.get("state") in ("SUCCESS", "FAILED"):
                            break
                        await trio.sleep(0.1)
                    assert run["state"] == "SUCCESS"
                    assert cut.is_set()
                    page = await client.logs(rid)
                text = b"".join(c["data"] for c in page["chunks"])
                assert text == b"first-line\nsecond-line\n"
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_output_for_a_run_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    from cluster.client import Client, RemoteError

    async def main() -> None:
        node = in_process_node(tmp_path, lease_ms=5000, grace_ms=10_000)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                async with Client.connect("127.0.0.1", port) as client:
                    await client.create(
                        {"id": "real", "schedule": {"every": "1h"}, "task": {"shell": "true"}}
                    )
                    await client.request(
                        "worker.hello", {"worker_id": "w", "tiers": ["none"], "slots": 0}
                    )
                    for rid in ("real@1000", "nosuch@1000"):
                        with pytest.raises(RemoteError) as refused:
                            await client.request(
                                "worker.output",
                                {"run_id": rid, "token": 1, "stream": "stdout", "data": b"x"},
                            )
                        assert (refused.value.code, refused.value.field) == ("not_found", "run_id")
                    with pytest.raises(RemoteError) as missing:  # nothing was stored for it
                        await client.request("run.logs", {"run_id": "real@1000"})
                    assert missing.value.code == "not_found"
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_output_goes_without_offsets_to_a_node_that_refuses_them() -> None:
    """A node from before output offsets answers ``bad_args`` (field ``offset``): the chunk
    goes again without it, and so do the later ones."""

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        def answer(op: str, args: dict[str, Any]) -> dict[str, Any] | None:
            if op == "worker.output" and "offset" in args:
                message = "offset: unknown argument 'offset' for worker.output"
                return {"error": {"code": "bad_args", "message": message, "field": "offset"}}
            return node.default(op)

        node.answer = answer
        await node.push(dispatch("job-o", 1, fencing_token(1, 1), "echo one; sleep 0.2; echo two"))
        await node.until(lambda: ("job-o@1", fencing_token(1, 1)) in node.finished())
        stored = [a["data"] for a in node.ops("worker.output") if "offset" not in a]
        assert b"".join(stored) == b"one\ntwo\n"
        assert not agent.output_offsets

    with_scripted_node(body)


def test_an_attempt_let_go_is_never_run_again_when_sent_again(tmp_path: Path) -> None:
    """A node keeps a run whose dispatch a hello had not seen, and sends it again; if the
    worker let that attempt go meanwhile (a fence), the repeat must not run it a second time
    (found by review: an at-most-once task ran twice with one token)."""
    t1 = fencing_token(1, 1)
    starts = tmp_path / "starts"
    shell = f'echo x >> {starts}; trap "" TERM; sleep 60'
    shard = shard_of("job-a", 2)

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        first = {**dispatch("job-a", 1000, t1, shell), "shard": shard, "seq": 7}
        await node.push(first)
        await node.until(lambda: starts.exists())
        agent._fence()  # its heartbeats went unanswered: let go, hello again
        await node.until(lambda: len(node.ops("worker.hello")) >= 2)
        hello = node.ops("worker.hello")[-1]
        assert hello["held"] == [] and [shard, 7] in hello["seen"]
        await node.push({**first, "seq": 8})  # the repeat
        await node.push(dispatch("job-b", 1000, t1, "true"))
        await node.until(lambda: ("job-b@1000", t1) in node.finished())
        await trio.sleep(0.3)
        assert "job-a@1000" not in agent.held
        assert starts.read_text() == "x\n"

    with_scripted_node(body, kill_grace_s=30.0)


def test_a_hello_asked_for_while_one_is_out_follows_it() -> None:
    """The hello under way was built before the runs dropped since: another must follow,
    or the node never hears they are gone (found by review: runs kept CLAIMED for good)."""

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        real_request = agent.client.request
        asked: list[int] = []

        async def request(op: str, args: dict[str, Any], **kw: Any) -> Any:
            if op == "worker.hello" and not asked:
                asked.append(1)
                agent._greet_again()  # a fence while this hello is out
            return await real_request(op, args, **kw)

        agent.client.request = request  # type: ignore[method-assign]
        before = len(node.ops("worker.hello"))
        agent._greet_again()
        await node.until(lambda: len(node.ops("worker.hello")) >= before + 2)
        await trio.sleep(0.3)
        assert len(node.ops("worker.hello")) == before + 2 and not agent._greeting

    with_scripted_node(body)


def test_a_node_from_before_dispatch_numbers_is_still_served() -> None:
    """A rolling upgrade, workers first: a node that refuses ``instance``/``seen`` as unknown
    arguments gets hellos and heartbeats without them (found by the fourth adversarial pass:
    every heartbeat was refused, so the worker would fence itself each lease)."""

    def answer(op: str, args: dict[str, Any]) -> dict[str, Any] | None:
        for name in ("instance", "seen"):
            if name in args:
                message = f"unknown argument {name!r} for {op}"
                return {"error": {"code": "bad_args", "message": message, "field": name}}
        return node_ref[0].default(op)

    node_ref: list[ScriptedNode] = []

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        await node.until(lambda: len(node.ops("worker.heartbeat")) >= 2, timeout=10)
        hellos = node.ops("worker.hello")
        assert "instance" not in hellos[-1] and not agent.dispatch_numbers
        assert all("seen" not in beat for beat in node.ops("worker.heartbeat"))
        assert agent.acked_sent_ms > 0

    async def main() -> None:
        node = ScriptedNode(lease_ms=900)
        node_ref.append(node)
        node.answer = answer
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    partial(trio.serve_tcp, node.serve, 0, host="127.0.0.1")
                )
                port = listeners[0].socket.getsockname()[1]
                agent = WorkerAgent("127.0.0.1", port, worker_id="w-old-node")
                await nursery.start(agent.run)
                await body(node, agent)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_heartbeat_refused_for_seen_goes_again_without_it() -> None:
    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        def answer(op: str, args: dict[str, Any]) -> dict[str, Any] | None:
            if op == "worker.heartbeat" and "seen" in args:
                message = "unknown argument 'seen' for worker.heartbeat"
                return {"error": {"code": "bad_args", "message": message, "field": "seen"}}
            return node.default(op)

        node.answer = answer
        await node.until(lambda: any("seen" not in b for b in node.ops("worker.heartbeat")))
        assert not agent.dispatch_numbers

    with_scripted_node(body, lease_ms=900)


@pytest.mark.parametrize("delivery", ["at_most_once", "at_least_once"])
def test_a_run_killed_while_it_waits_for_a_slot(tmp_path: Path, delivery: str) -> None:
    """A kill for a run still waiting for a slot drops it, never run. At-most-once: reported
    ``killed`` at once, the confirmed stop the node waits for (found by review: with no report
    the node waited out the reattach grace and recorded a timeout unconfirmed, without its
    retry). At-least-once: dropped unreported (the node decided its timeout already)."""
    t1, t2 = fencing_token(1, 1), fencing_token(1, 2)
    ran = tmp_path / "ran"

    async def body(node: ScriptedNode, agent: WorkerAgent) -> None:
        await node.push(dispatch("busy", 1000, t1, "sleep 30"))
        await node.until(lambda: "busy@1000" in agent.held)
        waiting = dispatch("late", 1000, t2, f"echo x > {ran}")
        waiting["run"]["delivery"] = delivery
        await node.push(waiting)
        await node.until(lambda: agent.waiting)
        await node.push({"push": "kill", "run_id": "late@1000", "token": t2, "reason": "timed out"})
        if delivery == "at_most_once":
            await node.until(lambda: ("late@1000", t2) in node.finished())
            assert node.finished()[("late@1000", t2)] == "killed"
        else:
            await node.until(lambda: not agent.waiting)
            await trio.sleep(0.3)
            assert ("late@1000", t2) not in node.finished()
        assert not agent.waiting
        await node.push(waiting)  # sent again: never run here
        await node.push({"push": "kill", "run_id": "busy@1000", "token": t1})
        await node.until(lambda: ("busy@1000", t1) in node.finished())
        await trio.sleep(0.3)
        assert not ran.exists() and not agent.waiting

    with_scripted_node(body, slots=1, kill_grace_s=1.0)


def test_the_nodes_timeout_waits_for_the_workers_stop_sequence() -> None:
    """Found by review: the node's grace was the worker's kill grace itself, so for a task
    ignoring SIGTERM the node recorded TIMED_OUT a moment before the worker's report (with
    the exit code) could arrive. The node's grace must leave the worker's whole stop sequence
    and a margin for its report."""
    import inspect

    from cluster.runner import run_task
    from engine.shard import EngineConfig

    kill_grace_ms = 1000 * inspect.signature(WorkerAgent).parameters["kill_grace_s"].default
    runner_grace_ms = 1000 * inspect.signature(run_task).parameters["kill_grace_s"].default
    assert EngineConfig().timeout_grace_ms >= max(kill_grace_ms, runner_grace_ms) + 2_000


@pytest.mark.parametrize(
    "kwargs", [{"slots": 0}, {"kill_grace_s": -1.0}, {"kill_grace_s": float("nan")}]
)
def test_an_agent_with_bad_settings_is_refused_when_made(kwargs: dict[str, float]) -> None:
    """Not at the first timeout, where a negative grace ended the agent (found by review)."""
    from cluster.worker import WorkerAgent

    with pytest.raises(ValueError):
        WorkerAgent("127.0.0.1", 1, watchdog=False, **kwargs)  # type: ignore[arg-type]


def test_a_dispatch_ahead_of_a_retried_hellos_answer_is_not_fenced() -> None:
    """A reconnect hello refused worker_id_in_use a few times, then accepted: the node pushes
    the hello's dispatches before its answer, and the worker took that push for the answer
    to its first attempt, sent seconds before: the fence deadline was past, and the run just
    handed out was killed at once (found by review)."""
    from cluster.client import RemoteError

    async def handler(ticket: Any, out: Any) -> int:
        await trio.sleep(5)
        return 0

    agent = WorkerAgent(
        "127.0.0.1", 1, worker_id="w", slots=2, payload_handler=handler, watchdog=False
    )
    agent.lease_ms = 3000  # learnt from an earlier hello
    agent.acked_sent_ms = time.monotonic_ns() // 1_000_000 - 10_000  # a partition, long ago
    run = {
        "run_id": "j@1",
        "job_id": "j",
        "scheduled_ms": 1,
        "attempt": 1,
        "token": 7,
        "version": 1,
        "delivery": "at_most_once",
        "tier": "default",
        "timeout_ms": None,
        "task": {"payload": 1},
    }

    class Refusing:
        generation = 2
        attempts = 0

        async def request(self, op: str, args: dict[str, Any], **kw: Any) -> Any:
            assert op == "worker.hello"
            self.attempts += 1
            if self.attempts <= 3:  # the node still holds the id for the old process
                await trio.sleep(0.5)
                raise RemoteError("worker_id_in_use", "another live worker's", "worker_id")
            agent._on_push({"push": "dispatch", "shard": 0, "seq": 1, "run": run})
            await trio.sleep(0.3)
            return {"lease_ms": 3000, "shards": 1}

        def notify(self, *args: Any, **kwargs: Any) -> None:
            pass

    agent.client = Refusing()  # type: ignore[assignment]

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            agent.nursery = nursery
            nursery.start_soon(agent._fence_timer)
            await trio.sleep(0.1)
            await agent._hello(opens=True)
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()
        return agent.fenced

    assert trio.run(main) == 0
