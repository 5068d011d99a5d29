"""``tickwheel submit --file`` with many specs: a bounded number of batches in flight, ids made
before sending, and a batch whose reply was lost sent again without creating any job twice.
Against a real node process on 127.0.0.1 (once through a TCP proxy that drops the connection
mid-file), and the retry accounting against a fake client whose replies go missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RequestTimeout
from cluster.commands import submit_lines
from tests.cluster.procs import NodeProc

pytestmark = pytest.mark.timeout(180)

FAR = {"at": "2099-01-01T00:00:00Z"}


def write_specs(path: Path, count: int, *, given_every: int = 0) -> None:
    """``count`` one-shot specs far ahead, one per line; every ``given_every``-th has its own
    id."""
    with open(path, "w") as f:
        for i in range(count):
            spec: dict[str, Any] = {"schedule": FAR, "task": {"shell": f"echo {i}"}}
            if given_every and i % given_every == 0:
                spec["id"] = f"given-{i}"
            f.write(json.dumps(spec) + "\n")


async def all_job_ids(port: int) -> list[str]:
    async with Client.connect("127.0.0.1", port, timeout_s=30) as client:
        return [job["job_id"] async for job in client.list_jobs(page=5000)]


async def submit(port: int, path: Path) -> tuple[int, list[str | None], str]:
    done = await trio.run_process(
        [sys.executable, "-m", "cluster.cli", "submit", "--file", str(path), "--json"],
        env={"TICKWHEEL_CONNECT": f"127.0.0.1:{port}", "PATH": "/usr/bin:/bin"},
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = done.stdout.decode()
    return done.returncode, json.loads(out) if out else [], done.stderr.decode()


def test_a_file_of_20000_specs_is_created_whole(tmp_path: Path) -> None:
    """Found by the user: 50,000 specs, every batch in flight at once, failed with
    ``job.create_many: no reply within 10 s`` on a loaded machine."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        path = tmp_path / "specs.jsonl"
        write_specs(path, 20_000, given_every=1000)

        async def main() -> None:
            status, ids, err = await submit(node.port, path)
            assert status == 0, err
            assert len(ids) == 20_000 and None not in ids and len(set(ids)) == 20_000
            assert ids[1000] == "given-1000"
            assert sorted(await all_job_ids(node.port)) == sorted(ids)  # type: ignore[type-var]

        trio.run(main)
    finally:
        node.terminate()


async def dropping_proxy(
    target_port: int, drop_after: int, task_status: trio.TaskStatus[int]
) -> None:
    """Forward TCP to ``target_port``. The first connection is cut (both ways) once
    ``drop_after`` bytes from the client have reached the node, before the node's replies to
    them get back: the requests were received, their replies are lost."""
    connections = 0

    async def handle(client: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        dropping = connections == 1
        server = await trio.open_tcp_stream("127.0.0.1", target_port)
        async with client, server, trio.open_nursery() as nursery:
            forwarded = 0

            async def upstream() -> None:
                nonlocal forwarded
                async for data in client:
                    await server.send_all(data)
                    forwarded += len(data)
                    if dropping and forwarded >= drop_after:
                        await trio.sleep(0.3)  # the node has them; its replies are dropped
                        nursery.cancel_scope.cancel()
                        return
                nursery.cancel_scope.cancel()

            async def downstream() -> None:
                async for data in server:
                    if dropping and forwarded >= drop_after:
                        continue
                    await client.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(upstream)
            nursery.start_soon(downstream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        task_status.started(listeners[0].socket.getsockname()[1])


def test_a_batch_whose_connection_broke_is_sent_again_without_duplicates(
    tmp_path: Path,
) -> None:
    """The connection breaks after two batches reached the node and before their replies came
    back: the CLI connects again and sends them again with the same ids; the jobs the lost
    attempt created count as created, none exists twice, every line is reported created."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        path = tmp_path / "specs.jsonl"
        write_specs(path, 5000, given_every=7)
        one_batch = len(b"".join(path.read_bytes().splitlines()[:1000]))

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(dropping_proxy, node.port, 2 * one_batch)
                status, ids, err = await submit(port, path)
                nursery.cancel_scope.cancel()
            assert status == 0, err
            assert len(ids) == 5000 and None not in ids and len(set(ids)) == 5000, err
            assert sorted(await all_job_ids(node.port)) == sorted(ids)  # type: ignore[type-var]

        trio.run(main)
    finally:
        node.terminate()


class LosingClient:
    """Stands in for :class:`Client`: creates as a node would, at most ``limit`` batches
    at once, and loses the reply of its ``lose``-th request (the jobs are created)."""

    def __init__(self, lose: int, existing: dict[str, dict[str, Any]]) -> None:
        self.jobs = dict(existing)
        self.lose = lose
        self.requests = 0
        self.in_flight = self.most_in_flight = 0

    async def request(
        self,
        op: str,
        args: dict[str, Any],
        *,
        timeout_s: float | None = None,
        sent_on: list[int] | None = None,
        retry: bool = True,
    ) -> Any:
        assert op == "job.create_many"
        self.requests += 1
        if sent_on is not None:
            sent_on.append(self.requests)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await trio.sleep(0.01)
        self.in_flight -= 1
        results = []
        for spec in args["specs"]:
            if spec["id"] in self.jobs:
                error = {"code": "exists", "message": "taken", "field": "id"}
                results.append({"ok": False, "error": error})
            else:
                self.jobs[spec["id"]] = spec
                results.append({"ok": True, "result": {"job_id": spec["id"]}})
        if self.requests == self.lose:
            raise RequestTimeout("job.create_many: no reply within 30 s")
        return {"results": results}

    async def get(self, job_id: str, **kw: Any) -> dict[str, Any]:
        return {"job_id": job_id, "spec": self.jobs[job_id]}


def test_a_retried_batch_counts_its_own_jobs_and_refuses_others() -> None:
    spec = {"schedule": FAR, "task": {"shell": "true"}}
    other = {"schedule": FAR, "task": {"shell": "false"}}
    numbered = [(n, dict(spec)) for n in range(1, 51)]
    numbered[12] = (13, {**spec, "id": "mine"})  # in the batch whose reply is lost
    numbered[14] = (15, {**spec, "id": "theirs"})  # someone else's job, another spec
    numbered[16] = (17, {**spec, "id": "mine"})  # the file gives the id twice
    fake = LosingClient(lose=2, existing={"theirs": {**other, "id": "theirs"}})

    lines = trio.run(lambda: submit_lines(fake, numbered, batch=10, in_flight=2))  # type: ignore[arg-type]

    assert fake.most_in_flight <= 2
    assert fake.requests == 6  # five batches, the second sent twice
    by_number = {line.number: line for line in lines}
    assert by_number[13].error is None  # its own earlier attempt created it
    assert by_number[15].error is not None and by_number[15].error.startswith("exists")
    assert by_number[17].error is not None and by_number[17].error.startswith("exists")
    assert [n for n, line in by_number.items() if line.error] == [15, 17]
    created = [line.job_id for line in lines if line.error is None]
    assert len(created) == 48 == len(set(created))
    assert set(fake.jobs) == {*created, "theirs"}  # nothing created twice or under a new id


class ScriptedClient(LosingClient):
    """A :class:`LosingClient` that refuses a request holding more than ``fits`` specs as
    ``RequestNotSendable`` (or, with ``remote``, as the node's ``frame_too_large``), refuses
    a spec whose id is ``bad`` with a whole-request ``shard_failed``, and, with ``dead``,
    answers nothing at all (a node that died: a connection that cannot be made)."""

    def __init__(self, fits: int, *, remote: bool = False, dead: bool = False) -> None:
        super().__init__(lose=0, existing={})
        self.fits, self.remote, self.dead = fits, remote, dead

    async def request(
        self,
        op: str,
        args: dict[str, Any],
        *,
        timeout_s: float | None = None,
        sent_on: list[int] | None = None,
        retry: bool = True,
    ) -> Any:
        from cluster.client import ConnectionLost, RemoteError, RequestNotSendable

        if self.dead:
            await trio.sleep(0.02)
            raise ConnectionLost("connection lost (reconnect pending)")
        if len(args["specs"]) > self.fits:
            if not self.remote:
                raise RequestNotSendable("job.create_many: request of 9 MB; the limit is 8")
            self.requests += 1
            raise RemoteError("frame_too_large", "frame of 9 MB")
        if any(spec["id"] == "bad" for spec in args["specs"]):
            self.requests += 1
            raise RemoteError("shard_failed", "shard 0 failed")
        return await super().request(op, args, timeout_s=timeout_s, sent_on=sent_on)


@pytest.mark.parametrize("remote", [False, True])
def test_a_batch_too_big_for_a_frame_is_split_and_a_refused_batch_fails_its_lines(
    remote: bool,
) -> None:
    """Found by a review: one oversized batch ended the command with a traceback, after the
    other batches had created their jobs, and nothing said which."""
    spec = {"schedule": FAR, "task": {"shell": "true"}}
    numbered = [(n, dict(spec)) for n in range(1, 41)]
    numbered[25] = (26, {**spec, "id": "bad"})
    fake = ScriptedClient(fits=3, remote=remote)
    done: list[int] = []

    lines = trio.run(
        lambda: submit_lines(fake, numbered, batch=10, in_flight=2, on_batch=done.append)  # type: ignore[arg-type]
    )

    assert sum(done) == 40  # each top-level batch counted once, however it was split
    failed = {line.number: line.error for line in lines if line.error}
    # the part holding "bad" (split down to at most 3 specs) was refused whole
    assert 26 in failed and all(e == "shard_failed: shard 0 failed" for e in failed.values())
    assert 1 <= len(failed) <= 3
    created = [line.job_id for line in lines if line.error is None]
    assert len(created) == 40 - len(failed) and set(created) == set(fake.jobs)


def test_a_spec_too_big_alone_is_its_lines_error() -> None:
    spec = {"schedule": FAR, "task": {"shell": "true"}}
    fake = ScriptedClient(fits=0)
    lines = trio.run(lambda: submit_lines(fake, [(1, spec), (2, spec)], batch=10))  # type: ignore[arg-type]
    assert [line.error for line in lines] == [
        "not_sendable: job.create_many: request of 9 MB; the limit is 8"
    ] * 2
    assert not any(line.unconfirmed for line in lines) and fake.jobs == {}


def test_a_node_gone_for_good_ends_the_submit_after_the_stall_limit() -> None:
    """Found by a review: against a node that died, a 5,000-line file waited 4 minutes in
    silence (each batch its tries x its timeout), and batches never sent were reported as
    possibly existing."""
    spec = {"schedule": FAR, "task": {"shell": "true"}}
    numbered = [(n, dict(spec)) for n in range(1, 101)]
    fake = ScriptedClient(fits=1000, dead=True)

    async def main() -> tuple[list[Any], float]:
        start = trio.current_time()
        lines = await submit_lines(fake, numbered, batch=10, in_flight=2, stall_s=0.2)  # type: ignore[arg-type]
        return lines, trio.current_time() - start

    lines, took = trio.run(main)
    assert took < 5  # not tries x timeout per batch
    assert all(line.error and line.error.startswith("not sent") for line in lines)
    assert not any(line.unconfirmed for line in lines)


def test_a_failed_check_of_an_existing_job_leaves_its_line_unconfirmed() -> None:
    spec = {"schedule": FAR, "task": {"shell": "true"}}

    class NoGet(LosingClient):
        async def get(self, job_id: str, **kw: Any) -> dict[str, Any]:
            from cluster.client import RequestTimeout

            raise RequestTimeout("job.get: no reply")

    fake = NoGet(lose=1, existing={})
    lines = trio.run(lambda: submit_lines(fake, [(1, {**spec, "id": "given"})]))  # type: ignore[arg-type]
    assert lines[0].unconfirmed and lines[0].error and "unknown" in lines[0].error


def test_a_replacing_line_whose_reply_was_lost_is_applied_once() -> None:
    """A ``replace`` create is never answered ``exists``, so sending its batch again after a
    lost reply replaced the job a second time (found by review). The lines whose jobs hold
    their specs already are not sent again; the others are."""
    from cluster.client import ConnectionLost

    spec = {"schedule": FAR, "task": {"shell": "true"}}

    class Replacing(LosingClient):
        def __init__(self) -> None:
            super().__init__(lose=1, existing={"r": {**spec, "id": "r", "paused": True}})
            self.versions = {"r": 1}
            self.sent: list[list[str]] = []

        async def request(self, op: str, args: dict[str, Any], **kw: Any) -> Any:
            assert kw.get("retry") is False  # the client's own retry would apply it again
            self.requests += 1
            kw["sent_on"].append(self.requests)
            self.sent.append([s["id"] for s in args["specs"]])
            results = []
            for one in args["specs"]:
                if one["id"] in self.jobs and not one.get("replace"):
                    error = {"code": "exists", "message": "taken", "field": "id"}
                    results.append({"ok": False, "error": error})
                    continue
                self.jobs[one["id"]] = one
                self.versions[one["id"]] = self.versions.get(one["id"], 0) + 1
                results.append({"ok": True, "result": {"job_id": one["id"]}})
            if self.requests == self.lose:
                raise ConnectionLost("connection lost (reconnect pending)")
            return {"results": results}

    async def get(job_id: str, **kw: Any) -> dict[str, Any]:
        if job_id not in fake.jobs:
            from cluster.client import RemoteError

            raise RemoteError("not_found", f"no job {job_id!r}", "id")
        return {"job_id": job_id, "version": fake.versions[job_id], "spec": fake.jobs[job_id]}

    fake = Replacing()
    fake.get = get  # type: ignore[method-assign]
    numbered = [(1, {**spec, "id": "r", "replace": True}), (2, {**spec, "id": "n"})]
    lines = trio.run(lambda: submit_lines(fake, numbered, batch=10))  # type: ignore[arg-type]
    assert [line.error for line in lines] == [None, None]
    assert fake.versions == {"r": 2, "n": 1}
    assert fake.sent == [["r", "n"], ["n"]]  # the replace was not sent again


def test_replacing_lines_of_a_batch_lost_with_its_node_are_read_back_within_the_stall_limit(
    tmp_path: Path,
) -> None:
    """The node's host goes while a batch of replacing lines is out: each line was read
    back one after another, each with a whole timeout (a node gone cost a timeout per line,
    hours for a big file: found by review). They are read in parallel within the stall
    limit, and left unconfirmed."""
    from cluster.node import Node

    spec = {"schedule": FAR, "task": {"shell": "echo X"}}

    async def main() -> tuple[list[Any], float]:
        node = Node(tmp_path / "data", shards=2)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(node.run)
            gone = trio.CancelScope()
            scopes: list[trio.CancelScope] = []

            async def handle(down: trio.SocketStream) -> None:
                up = await trio.open_tcp_stream("127.0.0.1", port)
                with trio.CancelScope() as scope:
                    scopes.append(scope)

                    async def forward() -> None:
                        async for data in down:
                            if b"job.create_many" in data:
                                gone.cancel()  # the host vanishes: nothing is accepted
                                for s in scopes:
                                    s.cancel()
                                return
                            await up.send_all(data)

                    async def back() -> None:
                        async for data in up:
                            await down.send_all(data)

                    async with trio.open_nursery() as inner:
                        inner.start_soon(forward)
                        inner.start_soon(back)
                await down.aclose()
                await up.aclose()

            async def serve(task_status: trio.TaskStatus[Any]) -> None:
                with gone:
                    await trio.serve_tcp(handle, 0, host="127.0.0.1", task_status=task_status)

            listeners = await nursery.start(serve)
            proxy_port = listeners[0].socket.getsockname()[1]
            async with Client.connect("127.0.0.1", proxy_port, timeout_s=1) as client:
                client.reconnect = True
                numbered = [(i, {**spec, "id": f"r{i}", "replace": True}) for i in range(1, 13)]
                start = trio.current_time()
                lines = await submit_lines(client, numbered, timeout_s=0.5, stall_s=1.0)
                took = trio.current_time() - start
            nursery.cancel_scope.cancel()
        return lines, took

    lines, took = trio.run(main)
    assert took < 4, took  # not 12 lines x 0.5 s of read-back
    assert all(line.error and line.unconfirmed for line in lines)
