"""``Client.create`` and ``exists`` across reconnects (and the other requests whose retry can
meet their own earlier attempt: ``create_many``, ``update`` with ``if_version``, ``cancel``): a
real node in this Trio run, and a TCP proxy between it and the client that breaks the
connection at chosen moments."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from cluster.node import Node

pytestmark = pytest.mark.timeout(60)

SPEC_MINE = {"schedule": {"at": "2040-01-01T00:00:00Z"}, "task": {"shell": "echo MINE"}}
SPEC_OTHER = {"schedule": {"at": "2035-01-01T00:00:00Z"}, "task": {"shell": "echo OTHER"}}


class Proxy:
    """Forwards 127.0.0.1 connections to the node. ``cut_now()`` breaks the current one;
    ``on_create`` set to ``"lose_reply"`` forwards the next ``job.create`` and breaks the
    connection instead of passing its reply on; set to ``"drop"`` breaks the connection
    without forwarding it, after awaiting ``before_drop``. ``lose_reply_of`` set to an op's
    name (bytes) forwards the next request holding it and breaks the connection instead of
    passing its reply on; ``drop_of`` set to an op's name breaks the connection instead of
    forwarding the next request holding it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.on_create: str | None = None
        self.lose_reply_of: bytes | None = None
        self.drop_of: bytes | None = None
        self.before_drop: Callable[[], Awaitable[None]] | None = None
        self.cut = trio.Event()
        self.scopes: list[trio.CancelScope] = []

    def cut_now(self) -> None:
        for scope in self.scopes:
            scope.cancel()

    async def handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
        lose_next_reply = False

        async def up(scope: trio.CancelScope) -> None:
            nonlocal lose_next_reply
            async for data in client:
                if b"job.create" in data and self.on_create == "drop":
                    self.on_create = None
                    if self.before_drop is not None:
                        await self.before_drop()
                    scope.cancel()
                    return
                if b"job.create" in data and self.on_create == "lose_reply":
                    self.on_create = None
                    lose_next_reply = True
                if self.drop_of is not None and self.drop_of in data:
                    self.drop_of = None
                    scope.cancel()
                    return
                if self.lose_reply_of is not None and self.lose_reply_of in data:
                    self.lose_reply_of = None
                    lose_next_reply = True
                await upstream.send_all(data)
            scope.cancel()

        async def down(scope: trio.CancelScope) -> None:
            nonlocal lose_next_reply
            async for data in upstream:
                if lose_next_reply:
                    scope.cancel()
                    return
                await client.send_all(data)
            scope.cancel()

        with trio.CancelScope() as scope:
            self.scopes.append(scope)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(up, scope)
                nursery.start_soon(down, scope)
        self.scopes.remove(scope)
        self.cut.set()
        await client.aclose()
        await upstream.aclose()


def run_with_proxy(
    tmp_path: Path, body: Callable[[Client, Client, Proxy], Awaitable[None]]
) -> None:
    """``body(through_proxy, direct, proxy)``."""

    async def main() -> None:
        node = Node(tmp_path / "data", shards=2)
        with trio.fail_after(50):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                proxy = Proxy(port)
                listeners = await nursery.start(
                    partial(trio.serve_tcp, proxy.handle, 0, host="127.0.0.1")
                )
                proxy_port = listeners[0].socket.getsockname()[1]
                async with (
                    Client.connect("127.0.0.1", port) as direct,
                    Client.connect("127.0.0.1", proxy_port, timeout_s=20) as client,
                ):
                    await body(client, direct, proxy)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_an_exists_after_an_earlier_reconnect_is_someone_elses_job(tmp_path: Path) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "taken", **SPEC_OTHER})
        proxy.cut_now()  # the client's connection breaks; it reconnects
        await proxy.cut.wait()
        await client.request("ping")
        assert client.generation == 2
        with pytest.raises(RemoteError) as refused:
            await client.create({"id": "taken", **SPEC_MINE})
        assert refused.value.code == "exists"
        assert (await direct.get("taken"))["spec"]["task"]["shell"] == "echo OTHER"

    run_with_proxy(tmp_path, body)


def test_a_retried_create_whose_first_attempt_never_arrived_is_not_the_job_found(
    tmp_path: Path,
) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        async def someone_else_creates_it() -> None:
            await direct.create({"id": "raced", **SPEC_OTHER})

        proxy.on_create, proxy.before_drop = "drop", someone_else_creates_it
        with pytest.raises(RemoteError) as refused:
            await client.create({"id": "raced", **SPEC_MINE})
        assert refused.value.code == "exists" and client.generation == 2
        assert (await direct.get("raced"))["spec"]["task"]["shell"] == "echo OTHER"

    run_with_proxy(tmp_path, body)


def test_a_create_whose_reply_was_lost_returns_its_job_once_retried(tmp_path: Path) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        proxy.on_create = "lose_reply"
        every = {"schedule": {"every": "1h"}, "task": {"command": ["true"]}, "timeout": "90m"}
        job = await client.create({"id": "mine", **every})  # no start: the node's time
        assert client.generation == 2
        assert job["job_id"] == "mine" and job["version"] == 1 and "spec" not in job
        assert (await direct.get("mine"))["spec"]["timeout"] == "1h30m"

    run_with_proxy(tmp_path, body)


def test_a_create_without_an_id_whose_reply_was_lost_makes_one_job(tmp_path: Path) -> None:
    """The id the library generates is made once, before the first attempt: the retry after a
    lost reply carries the same one, so the node holds one job, the one returned (with an id
    made per attempt it would hold two, and the caller would know of one)."""

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        proxy.on_create = "lose_reply"
        job = await client.create(dict(SPEC_MINE))
        assert client.generation == 2  # the first attempt's connection broke: it was retried
        stored = [j["job_id"] async for j in direct.list_jobs()]
        assert stored == [job["job_id"]]
        assert (await direct.get(job["job_id"]))["version"] == 1

    run_with_proxy(tmp_path, body)


def test_a_lost_connection_leaves_no_socket_or_writer_behind() -> None:
    """Found by a second adversarial pass: on a peer's close the reader reconnected without
    closing the old socket (CLOSE-WAIT) or ending its writer, one each per lost connection:
    a long-lived worker leaked them at every node restart."""
    import os

    from cluster.client import Client

    def sockets() -> int:
        fds = os.listdir("/proc/self/fd")
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        return sum(1 for link in links if link.startswith("socket:"))

    async def main() -> None:
        accepted = 0

        async def hang_up(stream: trio.SocketStream) -> None:
            nonlocal accepted
            accepted += 1
            await trio.sleep(0.05)
            await stream.aclose()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with Client.connect("127.0.0.1", port) as client:
                await trio.sleep(0.2)
                before = sockets()
                assert client._nursery is not None
                tasks_before = len(client._nursery.child_tasks)
                while client.generation < 8:
                    await trio.sleep(0.02)
                await trio.sleep(0.2)
                assert sockets() - before <= 2  # (the live connection, both ends in-process)
                assert len(client._nursery.child_tasks) <= tasks_before + 2
            nursery.cancel_scope.cancel()

    trio.run(main)


# Found by the sixth adversarial pass: each of these answered a request the node had applied,
# whose reply was lost with its connection and which the client sent again, with an error.


def test_a_create_many_whose_reply_was_lost_reports_its_jobs_created(tmp_path: Path) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "other", **SPEC_OTHER})
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many(
            [{"id": "m1", **SPEC_MINE}, dict(SPEC_MINE), {"id": "other", **SPEC_MINE}]
        )
        assert client.generation == 2
        assert results[0]["ok"] and results[0]["result"]["job_id"] == "m1"
        assert "spec" not in results[0]["result"]
        assert results[1]["ok"]  # its id generated by the library, the same on the retry
        generated = results[1]["result"]["job_id"]
        assert (await direct.get(generated))["version"] == 1
        # someone else's job of another spec stays an ``exists``
        assert not results[2]["ok"] and results[2]["error"]["code"] == "exists"
        assert (await direct.get("other"))["spec"]["task"]["shell"] == "echo OTHER"

    run_with_proxy(tmp_path, body)


def test_an_update_with_if_version_whose_reply_was_lost_is_not_a_conflict(
    tmp_path: Path,
) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "u", **SPEC_MINE})
        proxy.lose_reply_of = b"job.update"
        job = await client.update("u", {"timeout": "90m"}, if_version=1)
        assert client.generation == 2
        assert job["job_id"] == "u" and job["version"] == 2 and "spec" not in job
        assert (await direct.get("u"))["spec"]["timeout"] == "1h30m"
        # a real conflict after a retry stays one: someone else's change in between
        proxy.lose_reply_of = b"job.update"
        await direct.update("u", {"timeout": "5m"})  # version 3
        with pytest.raises(RemoteError) as refused:
            await client.update("u", {"timeout": "7m"}, if_version=2)
        assert refused.value.code == "conflict"

    run_with_proxy(tmp_path, body)


def test_a_cancel_whose_reply_was_lost_reports_the_job_cancelled(tmp_path: Path) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "c", **SPEC_MINE})
        proxy.lose_reply_of = b"job.cancel"
        assert await client.cancel("c") == {"job_id": "c", "cancelled": True}
        assert client.generation == 2
        with pytest.raises(RemoteError) as gone:
            await direct.get("c")
        assert gone.value.code == "not_found"
        # an id that never was a job stays ``not_found`` after a retry
        proxy.lose_reply_of = b"job.cancel"
        with pytest.raises(RemoteError) as missing:
            await client.cancel("never-was")
        assert missing.value.code == "not_found"

    run_with_proxy(tmp_path, body)


def test_a_plain_update_whose_reply_was_lost_is_applied_once(tmp_path: Path) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "p", **SPEC_MINE})
        proxy.lose_reply_of = b"job.update"
        job = await client.update("p", {"timeout": "90m"})
        assert client.generation == 2
        assert job["job_id"] == "p" and job["version"] == 2 and "spec" not in job
        stored = await direct.get("p")
        assert stored["version"] == 2 and stored["spec"]["timeout"] == "1h30m"
        # a plain update on a live connection still makes its version
        assert (await client.update("p", {"timeout": "5m"}))["version"] == 3

    run_with_proxy(tmp_path, body)


# Found by the review of the sixth pass's fixes.


def test_a_create_many_naming_one_spec_twice_still_reports_the_second_exists(
    tmp_path: Path,
) -> None:
    """The same spec object twice in one batch: its second entry was ``exists`` on the first
    attempt (the first entry created the job), and must stay so after a retry (the check
    for an earlier entry of the same id skipped entries that were the same object)."""

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        twice = {"id": "twice", **SPEC_MINE}
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many([twice, twice])
        assert client.generation == 2
        assert results[0]["ok"] and results[0]["result"]["job_id"] == "twice"
        assert not results[1]["ok"] and results[1]["error"]["code"] == "exists"

    run_with_proxy(tmp_path, body)


def test_a_plain_update_restarting_an_every_schedule_is_made_after_a_lost_connection(
    tmp_path: Path,
) -> None:
    """An ``every`` without ``start`` restarts the schedule at the update's time. Its first
    attempt lost with its connection before the node had it, the read-back job already had
    that period (with its old start): the client took that for the change made and reported
    success for an update never applied."""

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        old = {"every": "1h", "start": "2020-01-01T00:00:00Z"}
        await direct.create({"id": "r", "schedule": old, "task": {"shell": "true"}})
        proxy.drop_of = b"job.update"
        job = await client.update("r", {"schedule": {"every": "1h"}})
        assert client.generation == 2
        stored = await direct.get("r")
        assert stored["spec"]["schedule"]["start"] != old["start"]  # restarted: made
        assert job["version"] == stored["version"] == 2

    run_with_proxy(tmp_path, body)


def test_a_create_many_entry_after_a_refused_one_of_its_id_reports_its_create(
    tmp_path: Path,
) -> None:
    """An earlier entry of the same id that was refused for itself (a bad spec) made no job:
    the later entry's create was this batch's, and its ``exists`` after the retry is its own
    earlier attempt."""

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        bad = {"id": "later", "schedule": {"at": "not a time"}, "task": {"shell": "true"}}
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many([bad, {"id": "later", **SPEC_MINE}])
        assert client.generation == 2
        assert not results[0]["ok"] and results[0]["error"]["code"] != "exists"
        assert results[1]["ok"] and results[1]["result"]["job_id"] == "later"

    run_with_proxy(tmp_path, body)


def test_a_replacing_create_whose_reply_was_lost_is_applied_once(tmp_path: Path) -> None:
    """A create with ``replace`` is never answered ``exists``: sent again after its reply was
    lost, it replaced the job a second time (version 3, and an ``every`` without ``start``
    restarted: found by review). The job is read back first; it holds the spec: once."""

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "r", **SPEC_OTHER})
        every = {"schedule": {"every": "1h"}, "task": {"shell": "echo MINE"}, "replace": True}
        proxy.on_create = "lose_reply"
        job = await client.create({"id": "r", **every})
        assert client.generation == 2
        assert job["job_id"] == "r" and job["version"] == 2 and "spec" not in job
        assert (await direct.get("r"))["version"] == 2
        # never arrived: sent again, and made
        proxy.drop_of = b"job.create"
        job = await client.create({"id": "r", **SPEC_OTHER, "replace": True})
        assert job["version"] == 3
        assert (await direct.get("r"))["spec"]["task"]["shell"] == "echo OTHER"

    run_with_proxy(tmp_path, body)


def test_a_create_many_with_replacing_specs_whose_reply_was_lost_applies_each_once(
    tmp_path: Path,
) -> None:
    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "r1", **SPEC_OTHER})
        await direct.create({"id": "taken", **SPEC_OTHER})
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many(
            [
                {"id": "r1", **SPEC_MINE, "replace": True},
                {"id": "new", **SPEC_MINE},
                {"id": "taken", **SPEC_MINE},
            ]
        )
        assert client.generation == 2
        assert [r["ok"] for r in results] == [True, True, False]
        assert results[0]["result"]["version"] == 2 and "spec" not in results[0]["result"]
        assert results[1]["result"]["job_id"] == "new"
        assert results[2]["error"]["code"] == "exists"  # someone else's job stays theirs
        assert (await direct.get("r1"))["version"] == 2
        assert (await direct.get("new"))["version"] == 1
        assert (await direct.get("taken"))["spec"]["task"]["shell"] == "echo OTHER"

    run_with_proxy(tmp_path, body)


def test_a_node_that_stays_away_is_connection_lost_not_timeout(tmp_path: Path) -> None:
    """With reconnect on, a request that waited its whole time for a connection that never
    came back raised ``timeout`` (found by review); the protocol promises
    ``connection_lost``, naming why the connection could not be made."""
    from cluster.client import ConnectionLost

    async def main() -> None:
        node = Node(tmp_path / "data", shards=1)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(node.run)
                proxy = Proxy(port)
                serving = trio.CancelScope()

                async def serve(task_status: trio.TaskStatus[Any]) -> None:
                    with serving:
                        await trio.serve_tcp(
                            proxy.handle, 0, host="127.0.0.1", task_status=task_status
                        )

                listeners = await nursery.start(serve)
                proxy_port = listeners[0].socket.getsockname()[1]
                async with Client.connect("127.0.0.1", proxy_port, timeout_s=1.5) as client:
                    await client.request("ping", {})
                    serving.cancel()  # the listener goes, and the connection with it
                    proxy.cut_now()
                    await trio.sleep(0.1)
                    started = trio.current_time()
                    with pytest.raises(ConnectionLost) as caught:
                        await client.request("ping", {})
                    assert trio.current_time() - started < 3
                    assert "not made again" in str(caught.value)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_replacing_create_that_never_arrived_is_sent_again_though_the_job_held_its_spec(
    tmp_path: Path,
) -> None:
    """The read-back compared specs only: a job last written by a replace of the same spec
    (a deploy re-applying its file) already held it, and a replace that never reached the
    node was reported applied (found by review). The version read before the first attempt
    tells: unchanged, the replace is sent again."""
    at = {"schedule": {"at": "2040-01-01T00:00:00Z"}, "task": {"shell": "echo X"}}

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        await direct.create({"id": "o", **at})
        assert (await direct.create({"id": "o", **at, "replace": True}))["version"] == 2
        proxy.drop_of = b"job.create"
        job = await client.create({"id": "o", **at, "replace": True})
        assert job["version"] == 3 and (await direct.get("o"))["version"] == 3

    run_with_proxy(tmp_path, body)


def test_two_replacing_entries_of_one_id_whose_reply_was_lost_are_not_sent_again(
    tmp_path: Path,
) -> None:
    """Both entries of one id apply, and the job holds the last: the read-back matched
    neither and sent both again, applying them twice over (found by review). Their outcome
    is unknown: each says so, and nothing is sent again."""
    a = {"schedule": {"at": "2040-01-01T00:00:00Z"}, "task": {"shell": "echo A"}, "replace": True}
    b = {"schedule": {"at": "2041-01-01T00:00:00Z"}, "task": {"shell": "echo B"}, "replace": True}

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many([{"id": "d", **a}, {"id": "d", **b}, {"id": "e", **a}])
        assert [r["ok"] for r in results] == [False, False, True]
        assert {r["error"]["code"] for r in results[:2]} == {"connection_lost"}
        assert (await direct.get("d"))["version"] == 2  # applied once each, no more
        assert (await direct.get("e"))["version"] == 1

    run_with_proxy(tmp_path, body)


def test_a_replacing_batch_keeps_the_per_entry_answers_of_plain_creates(
    tmp_path: Path,
) -> None:
    """From the review of the replace fix: a plain create whose id stands twice in a batch
    with a replace was no longer read back after a lost reply (both answered ``exists``, the
    first for its own job); an entry with an id that is not a string failed the whole batch
    (a TypeError, or the read first's ``bad_args``) where the node answers it alone."""
    a = {"schedule": {"at": "2040-01-01T00:00:00Z"}, "task": {"shell": "echo A"}}

    async def body(client: Client, direct: Client, proxy: Proxy) -> None:
        proxy.lose_reply_of = b"job.create_many"
        results = await client.create_many(
            [{"id": "t", **a}, {"id": "t", **a}, {"id": "r", **a, "replace": True}]
        )
        assert client.generation == 2
        assert [r["ok"] for r in results] == [True, False, True]
        assert results[1]["error"]["code"] == "exists"
        for bad in (["x"], 5, "bad id!"):
            results = await client.create_many(
                [{"id": bad, **a, "replace": True}, {"id": "q", **a, "replace": True}]
            )
            assert results[0]["error"]["code"] == "invalid_job" and results[1]["ok"]

    run_with_proxy(tmp_path, body)
