"""The node under peers and failures that must not take it down or grow it: a peer that does
not read, a peer that half-closes, a shard whose background work or turn fails, a clean stop
with a commit in flight. A real node in the test's Trio run, real sockets, real RocksDB."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from cluster import node as node_module
from cluster.client import Client, RemoteError
from cluster.node import Connection, Node, ShardHost
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.routing import shard_of
from engine.shard import EngineConfig
from wal.errors import StoreIOError
from wal.store import RetentionReport, ShardStore

pytestmark = pytest.mark.timeout(90)


def frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def create(request_id: int, job_id: str) -> bytes:
    spec = {"id": job_id, "schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "true"}}
    return frame({"id": request_id, "op": "job.create", "args": {"spec": spec}})


async def read_frames(sock: trio.socket.SocketType, want: int) -> list[dict[str, Any]]:
    """Up to ``want`` frames, or fewer if the peer closes first."""
    buf = b""
    out: list[dict[str, Any]] = []
    while len(out) < want:
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            (n,) = struct.unpack(">I", buf[:4])
            out.append(msgpack.unpackb(buf[4 : 4 + n], raw=False))
            buf = buf[4 + n :]
        if len(out) >= want:
            break
        chunk = await sock.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    return out


def with_node(tmp_path: Path, body: Callable[[Node, int], Awaitable[None]], **options: Any) -> Node:
    node = Node(tmp_path / "data", shards=2, config=EngineConfig(worker_lease_ms=1000), **options)

    async def main() -> None:
        with trio.fail_after(80):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                await body(node, port)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return node


async def connect(port: int, rcvbuf: int | None = None) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    return sock


def big_logs(node: Node, job_id: str) -> None:
    """About 1 MiB of stored output for run ``job_id@1000`` (its run.logs page is ~1 MiB)."""
    host = node.host_of(job_id)
    key = host.store.key_of(job_id)
    assert key is not None
    for i in range(16):
        host.store.logs.append(key, 1000, "stdout", bytes([i]) * 65_536, attempt=1)


def unsent(conn: Connection) -> int:
    return sum(len(f) for f in conn.outbox.frames)


# ------------------------------------------------------------------ a peer that does not read


class _Overridden:
    """``target`` with some methods replaced, handed to a host in place of its engine: a
    compiled engine takes no new attributes, so its methods cannot be patched on it."""

    def __init__(self, target: Any, **methods: Any) -> None:
        self._target = target
        self.__dict__.update(methods)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def test_a_peer_that_does_not_read_is_held_back_not_buffered(tmp_path: Path) -> None:
    """Pipelined run.logs requests (~1 MiB replies each) from a peer that reads nothing:
    the node's outbox for it stays near the high-water mark (it stops making replies and
    reading requests), the connection stays open, and once the peer reads, every reply
    comes."""
    n = 40

    async def body(node: Node, port: int) -> None:
        async with Client.connect("127.0.0.1", port) as client:
            await client.create(
                {"id": "big", "schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "x"}}
            )
        big_logs(node, "big")
        sock = await connect(port, rcvbuf=4096)
        requests = b"".join(
            frame({"id": 100 + i, "op": "run.logs", "args": {"run_id": "big@1000"}})
            for i in range(n)
        )
        await sock.send(requests)
        most = 0
        for _ in range(100):  # ~1 s of the node serving what it can
            await trio.sleep(0.01)
            for conn in node.connections:
                most = max(most, unsent(conn))
        # the high-water mark (4 MiB) and about a reply (1 MiB) over it, not 40 replies
        assert most <= 6 * 1024 * 1024, most
        assert all(not conn.closed for conn in node.connections)
        replies = await read_frames(sock, n)
        assert sorted(r["id"] for r in replies) == [100 + i for i in range(n)]
        assert all(r["ok"] and len(r["result"]["chunks"]) == 16 for r in replies)
        sock.close()

    with_node(tmp_path, body)


def test_a_peer_over_the_hard_cap_is_closed_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # below one reply
    monkeypatch.setattr(node_module, "OUTBOX_HARD_CAP", 512 * 1024, raising=False)

    async def body(node: Node, port: int) -> None:
        async with Client.connect("127.0.0.1", port) as client:
            await client.create(
                {"id": "big", "schedule": {"at": "2099-01-01T00:00:00Z"}, "task": {"shell": "x"}}
            )
            big_logs(node, "big")
            sock = await connect(port)
            await sock.send(frame({"id": 1, "op": "run.logs", "args": {"run_id": "big@1000"}}))
            assert await read_frames(sock, 1) == []  # closed, nothing sent
            sock.close()
            await client.request("ping", {})  # the node serves on

    with caplog.at_level(logging.WARNING, logger="tickwheel.node"):
        with_node(tmp_path, body)
    assert "unread (cap 524288)" in caplog.text


# ------------------------------------------------------------------ a peer that half-closes


def test_a_half_closed_peer_gets_the_replies_to_what_it_sent(tmp_path: Path) -> None:
    async def body(node: Node, port: int) -> None:
        sock = await connect(port)
        await sock.send(
            create(1, "hc1")
            + frame({"id": 2, "op": "job.list", "args": {}})
            + frame({"id": 3, "op": "ping"})
        )
        sock.shutdown(socket.SHUT_WR)
        replies = await read_frames(sock, 10)  # until the node closes
        sock.close()
        assert sorted(r["id"] for r in replies) == [1, 2, 3]
        assert all(r["ok"] for r in replies)

    with_node(tmp_path, body)


# ------------------------------------------------------------------ a shard that fails


def test_a_retention_error_on_a_backlog_pass_is_logged_and_the_node_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = [0]

    def retain(self: ShardStore, now_ms: int, policy: Any = None, **kw: Any) -> RetentionReport:
        calls[0] += 1
        if calls[0] % 2:
            return RetentionReport(runs_deleted=1, more=True)  # a backlog: a second pass
        raise StoreIOError("deleting old run history: injected", path=str(self.path))

    monkeypatch.setattr(ShardStore, "retain", retain)

    async def body(node: Node, port: int) -> None:
        async with Client.connect("127.0.0.1", port) as client:
            for _ in range(100):  # bounded: until both shards met the error
                if calls[0] >= 6:
                    break
                await trio.sleep(0.02)
            await client.request("ping", {})
            await client.create(
                {
                    "id": "after",
                    "schedule": {"at": "2099-01-01T00:00:00Z"},
                    "task": {"shell": "true"},
                }
            )
        assert all(host.failed is None for host in node.hosts)

    with caplog.at_level(logging.WARNING, logger="tickwheel.node"):
        with_node(tmp_path, body, retain_every_s=0.01)
    assert calls[0] >= 6
    assert "retention: deleting old run history: injected" in caplog.text


def _ids_on_shards(shards: int) -> list[str]:
    """One job id per shard, in shard order."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < shards:
        found.setdefault(shard_of(f"job-{i}", shards), f"job-{i}")
        i += 1
    return [found[s] for s in range(shards)]


def test_a_bug_in_a_turn_stops_that_shard_only_and_it_decides_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception out of one shard's engine call: that shard stops (its
    commands get ``shard_failed``; its engine is never called again: no fire, no dispatch),
    the node and the other shard serve on."""
    ids = _ids_on_shards(2)
    boom = next(f"boom-{i}" for i in range(1000) if shard_of(f"boom-{i}", 2) == 0)
    calls_after: list[str] = []

    async def body(node: Node, port: int) -> None:
        bad = node.hosts[0]
        engine = bad.engine
        real_handle_many, real_tick = engine.handle_many, engine.tick

        def handle_many(commands: Any, wall: int, mono: int, **kw: Any) -> Any:
            if bad.failed is not None:
                calls_after.append("handle_many")
            if any(getattr(c, "spec", None) and c.spec.id == boom for c in commands):
                raise RuntimeError("a bug")
            return real_handle_many(commands, wall, mono, **kw)

        def tick(wall: int, mono: int) -> Any:
            if bad.failed is not None:
                calls_after.append("tick")
            return real_tick(wall, mono)

        monkeypatch.setattr(bad, "engine", _Overridden(engine, handle_many=handle_many, tick=tick))
        async with Client.connect("127.0.0.1", port) as client:
            # a job due soon on the bad shard: once it failed, it must never fire
            await client.create(
                {"id": ids[0], "schedule": {"every": "50ms"}, "task": {"shell": "true"}}
            )
            with pytest.raises(RemoteError) as caught:
                await client.create(
                    {
                        "id": boom,
                        "schedule": {"at": "2099-01-01T00:00:00Z"},
                        "task": {"shell": "true"},
                    }
                )
            assert caught.value.code == "shard_failed"
            assert isinstance(bad.failed, node_module.ShardFailed)
            with pytest.raises(RemoteError) as again:
                await client.get(ids[0])
            assert again.value.code == "shard_failed"
            await client.create(
                {
                    "id": ids[1],
                    "schedule": {"at": "2099-01-01T00:00:00Z"},
                    "task": {"shell": "true"},
                }
            )
            assert (await client.get(ids[1]))["job_id"] == ids[1]
            await trio.sleep(0.3)  # the bad shard's job would have fired several times
            await client.request("ping", {})
        assert node.hosts[1].failed is None

    with_node(tmp_path, body)
    assert calls_after == []


def test_a_bug_in_a_reply_callback_leaves_the_shard_and_the_node_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection's reply callback that raises (a bug): that one request goes unanswered,
    logged; the shard keeps acknowledging, deciding and answering the others."""
    real_send = Connection.send

    def send(self: Connection, message: dict[str, Any]) -> None:
        if message.get("id") == 7:
            raise RuntimeError("a bug in the reply path")
        real_send(self, message)

    monkeypatch.setattr(Connection, "send", send)

    async def body(node: Node, port: int) -> None:
        sock = await connect(port)
        await sock.send(create(7, "cb1"))
        await trio.sleep(0.2)
        await sock.send(create(8, "cb2") + frame({"id": 9, "op": "ping"}))
        replies = await read_frames(sock, 2)
        sock.close()
        assert sorted(r["id"] for r in replies) == [8, 9]
        assert all(r["ok"] for r in replies)
        assert all(host.failed is None for host in node.hosts)

    with_node(tmp_path, body)


# ------------------------------------------------------------------ a clean stop


def test_a_clean_stop_with_commits_in_flight_stores_every_final_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = ShardStore.write_prepared

    def slow_write(self: ShardStore, prepared: Any) -> Any:
        time.sleep(0.03)  # a disk with a slow fsync: a group is in flight at the stop
        return real_write(self, prepared)

    snapshots: list[int] = []
    real_snapshot = ShardStore.write_snapshot

    def write_snapshot(self: ShardStore, *args: Any, **kwargs: Any) -> Any:
        snapshots.append(self.shard)
        return real_snapshot(self, *args, **kwargs)

    monkeypatch.setattr(ShardStore, "write_prepared", slow_write)
    monkeypatch.setattr(ShardStore, "write_snapshot", write_snapshot)
    failures: list[int] = []
    real_fail = ShardHost._fail

    def fail(self: ShardHost, exc: Any) -> None:
        failures.append(self.index)
        real_fail(self, exc)

    monkeypatch.setattr(ShardHost, "_fail", fail)

    async def handler(ticket: RunTicket, out: Any) -> int:
        return 0

    async def body(node: Node, port: int) -> None:
        agent = WorkerAgent("127.0.0.1", port, worker_id="w", slots=16, payload_handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            async with Client.connect("127.0.0.1", port) as client:
                await client.create_many(
                    [
                        {
                            "id": f"j{i}",
                            "schedule": {"every": "20ms"},
                            "delivery": "at_most_once",
                            "task": {"payload": i},
                        }
                        for i in range(100)
                    ]
                )
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    node = Node(tmp_path / "data", shards=2, config=EngineConfig(worker_lease_ms=1000))

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                await body(node, port)
                nursery.cancel_scope.cancel()  # a clean stop (what SIGTERM does)

    trio.run(main)
    assert failures == []
    assert sorted(snapshots) == [0, 1]


def test_a_store_failure_met_in_a_turn_keeps_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn that reads a store which failed a write a moment ago meets the store's typed
    failure: the shard stops with it (clients are told ``disk_full``), not as a bug
    (``shard_failed``). Found by review."""
    from wal.errors import DiskFull

    boom = next(f"full-{i}" for i in range(1000) if shard_of(f"full-{i}", 2) == 0)

    async def body(node: Node, port: int) -> None:
        bad = node.hosts[0]
        engine = bad.engine
        real_handle_many = engine.handle_many

        def handle_many(commands: Any, wall: int, mono: int, **kw: Any) -> Any:
            if any(getattr(c, "spec", None) and c.spec.id == boom for c in commands):
                raise DiskFull("no space left on device", path="shard-000")
            return real_handle_many(commands, wall, mono, **kw)

        monkeypatch.setattr(bad, "engine", _Overridden(engine, handle_many=handle_many))
        async with Client.connect("127.0.0.1", port) as client:
            with pytest.raises(RemoteError) as caught:
                await client.create(
                    {
                        "id": boom,
                        "schedule": {"at": "2099-01-01T00:00:00Z"},
                        "task": {"shell": "true"},
                    }
                )
            assert caught.value.code == "disk_full"
            assert isinstance(bad.failed, DiskFull)

    with_node(tmp_path, body)


def test_a_periodic_snapshot_not_stored_leaves_the_final_one_to_the_clean_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A periodic snapshot counted its records as covered when it was exported: when it
    was then not stored (a failed write, or abandoned by the stop), the clean stop saw
    nothing since the last one and took no final snapshot, and the next start replayed the
    tail (found by review). They count again when it is not stored."""
    from wal.errors import StoreIOError

    stored: list[int] = []
    refused: list[int] = []
    real_snapshot = ShardStore.write_snapshot

    def write_snapshot(self: ShardStore, *args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(self.shard)
            raise StoreIOError("the disk hiccuped", path=self.path)
        stored.append(self.shard)
        return real_snapshot(self, *args, **kwargs)

    monkeypatch.setattr(ShardStore, "write_snapshot", write_snapshot)

    async def body(node: Node, port: int) -> None:
        async with Client.connect("127.0.0.1", port) as client:
            for i in range(20):
                await client.create(
                    {
                        "id": f"s{i}",
                        "schedule": {"at": "2099-01-01T00:00:00Z"},
                        "task": {"payload": i},
                    }
                )
        host = node.hosts[0]
        assert host.since_snapshot > 0
        host._start_snapshot()
        while host.snapshot_pending:
            await trio.sleep(0.01)
        assert refused == [0] and host.since_snapshot > 0

    with_node(tmp_path, body)
    assert sorted(stored) == [0, 1]  # the clean stop's, for both shards
