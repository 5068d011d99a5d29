"""The ``tickwheel`` command line as users run it: ``python -m cluster.cli`` in a subprocess
against a real node process on 127.0.0.1; runs with chosen output made by a payload worker in
the test's own Trio run (each ``out()`` call is one stored chunk, so chunk boundaries are
exact)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from cluster.codec import FrameDecoder, encode
from cluster.worker import WorkerAgent
from engine.effects import RunTicket
from engine.jobs import validate_job_id
from engine.schedules import format_utc
from tests.cluster.procs import NodeProc, clean_failure, cli, tw, with_client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    root = tmp_path_factory.mktemp("cli")
    proc = NodeProc(root / "data", root / "node.log")
    yield proc
    proc.kill()


def run_payload(
    node: NodeProc,
    job_id: str,
    chunks: list[tuple[str, bytes]],
    *,
    worker_id: str = "w1",
) -> str:
    """Run a payload job once on a worker of this process whose handler writes ``chunks``
    (one ``out()`` each); returns the run id once the run is final."""

    async def handler(ticket: RunTicket, out: Callable[[str, bytes], Awaitable[None]]) -> int:
        for stream, data in chunks:
            await out(stream, data)
        return 0

    async def body(client: Client) -> str:
        agent = WorkerAgent(
            "127.0.0.1", node.port, worker_id=worker_id, tiers=(job_id,), payload_handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            at = format_utc(int(time.time() * 1000) + 200)
            await client.create(
                {"id": job_id, "schedule": {"at": at}, "task": {"payload": {}}, "tier": job_id}
            )
            for _ in range(300):
                runs = await client.history(job_id)
                if runs and runs[0]["state"] == "SUCCESS":
                    nursery.cancel_scope.cancel()
                    return str(runs[0]["run_id"])
                await trio.sleep(0.05)
            raise AssertionError(f"{job_id}: no successful run in 15 s")

    return with_client(node.port, body)


# ------------------------------------------------------------------ C2: logs of no run


def test_logs_of_a_run_that_does_not_exist_fail_at_once_with_or_without_follow(
    node: NodeProc,
) -> None:
    created = cli(node, "submit", "--id", "exists", "--in", "1h", "--shell", "true")
    assert created.returncode == 0, created.stderr
    for run_id in ("exists@123", "no-such-job@123"):
        for follow in ((), ("--follow",)):
            done = cli(node, "logs", run_id, *follow, timeout=30)  # (hung forever before)
            assert "not_found" in clean_failure(done), done.stderr


def test_follow_logs_asks_run_get_when_a_page_has_no_state() -> None:
    """The client's own end of C2, against a node as it was before the fix (run.logs: an
    empty page, state null, for a run that does not exist), stood in for by a server that
    speaks the real frame codec: follow_logs must not wait forever."""
    asked: list[str] = []

    async def old_node(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        async for data in stream:
            decoder.feed(data)
            while (msg := decoder.next_event()) is not None:
                assert isinstance(msg, dict)
                asked.append(msg["op"])
                if msg["op"] == "run.logs":
                    result = {"chunks": [], "cursor": 0, "at_end": True, "state": None}
                    reply = {"id": msg["id"], "ok": True, "result": result}
                else:
                    error = {"code": "not_found", "message": "no run", "field": "run_id"}
                    reply = {"id": msg["id"], "ok": False, "error": error}
                await stream.send_all(encode(reply))

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(trio.serve_tcp, old_node, 0)
                port = listeners[0].socket.getsockname()[1]
                async with Client.connect("127.0.0.1", port) as client:
                    with pytest.raises(RemoteError) as gone:
                        async for _chunk in client.follow_logs("x@1", poll_s=0.01):
                            pass
                assert gone.value.code == "not_found"
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert asked == ["run.logs", "run.get"]


# ------------------------------------------------------------------ C3: user text is text


def test_user_text_is_printed_as_text_never_as_markup(node: NodeProc) -> None:
    shell = 'echo "[/oops]" [bold]x[/bold]'
    assert cli(node, "submit", "--id", "markup", "--in", "1h", "--shell", shell).returncode == 0
    done = cli(node, "job", "get", "markup")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert '\\"[/oops]\\"' in done.stdout and "[bold]x[/bold]" in done.stdout, done.stdout
    for action in ("pause", "resume"):  # (their result has no spec; the table is the same)
        assert cli(node, "job", action, "markup").returncode == 0
    run_id = run_payload(node, "markup-runs", [("stdout", b"ok\n")], worker_id="w[/x][bold]")
    for args in (("runs", "markup-runs"), ("run", run_id)):
        done = cli(node, *args)
        assert done.returncode == 0, done.stderr
        assert "w[/x][bold]" in done.stdout, done.stdout
    assert "markup" in cli(node, "jobs").stdout


# ------------------------------------------------------------------ C4: UTF-8 across chunks


def test_logs_decode_each_stream_across_chunk_boundaries(node: NodeProc) -> None:
    chunks = [
        ("stdout", b"caf\xc3"),  # e-acute, split
        ("stderr", b"\xe2\x82"),  # the euro sign, split, with stdout's in between
        ("stdout", b"\xa9 ok "),
        ("stderr", b"\xac\n"),
        ("stdout", b"\xffbad \xf0\x9f"),  # invalid byte; then a 4-byte char split 2 + 2
        ("stdout", b"\x99\x82\n\xc3"),  # ...and a partial character at the very end
    ]
    run_id = run_payload(node, "utf8", chunks)
    done = cli(node, "logs", run_id)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "café ok \ufffdbad 🙂\n\ufffd"
    assert done.stderr == "€\n"
    followed = cli(node, "logs", run_id, "--follow")
    assert (followed.stdout, followed.stderr) == (done.stdout, done.stderr)
    as_json = [
        json.loads(line) for line in cli(node, "logs", run_id, "--json").stdout.split("\n")[:-1]
    ]
    text = {
        s: "".join(c["data"] for c in as_json if c["stream"] == s) for s in ("stdout", "stderr")
    }
    assert text == {"stdout": done.stdout, "stderr": "€\n"}


# ------------------------------------------------------------------ C5, C6: submit --file


def test_submit_file_refuses_unreadable_files_and_lines_with_their_line_number(
    node: NodeProc, tmp_path: Path
) -> None:
    cases = {
        "missing.jsonl": None,
        "a-directory": "dir",
        "latin1.jsonl": b'\n{"id": "caf\xe9"}\n',
        "list.jsonl": b'\n\n["not", "a", "spec"]\n',
        "string.jsonl": b'"a string"\n',
        "number.jsonl": b"\n42\n",
    }
    expected = {
        "missing.jsonl": "No such file",
        "a-directory": "Is a directory",
        "latin1.jsonl": "latin1.jsonl:2: not UTF-8",
        "list.jsonl": "list.jsonl:3: a job spec is a JSON object, got a list",
        "string.jsonl": "string.jsonl:1: a job spec is a JSON object, got a string",
        "number.jsonl": "number.jsonl:2: a job spec is a JSON object, got a number",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content == "dir":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        done = cli(node, "submit", "--file", str(path))
        assert expected[name] in clean_failure(done, status=2), done.stderr
    # A spec the node refuses is named by its line in the file, blank lines counted.
    good = {"schedule": {"every": "1h"}, "task": {"shell": "true"}}
    bad = {"schedule": {"every": "0s"}, "task": {"shell": "true"}}
    path = tmp_path / "mixed.jsonl"
    path.write_text(f"\n{json.dumps(good)}\n\n\n{json.dumps(bad)}\n{json.dumps(good)}\n")
    done = cli(node, "submit", "--file", str(path))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{path}:5: invalid_schedule" in done.stderr, done.stderr
    assert "2 jobs created, 1 not created" in done.stdout


def test_create_many_sends_entries_that_are_not_maps_for_the_node_to_refuse(
    node: NodeProc,
) -> None:
    async def body(client: Client) -> list[dict[str, Any]]:
        return await client.create_many([["a list"], "a string"])  # type: ignore[list-item]

    results = with_client(node.port, body)
    assert [(r["ok"], r["error"]["code"]) for r in results] == [(False, "bad_args")] * 2


# ------------------------------------------------------------------ C7: serve refusals


def test_serve_refuses_an_address_it_cannot_listen_on_before_touching_the_data(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = tw("serve", "--data", str(tmp_path / "d1"), "--port", str(port), timeout=30)
        assert "Address already in use" in clean_failure(done, 2), done.stderr
    assert not (tmp_path / "d1").exists()  # not created, no epoch bumped
    done = tw("serve", "--data", str(tmp_path / "d2"), "--host", "256.1.1.1", timeout=30)
    assert "cannot listen on 256.1.1.1:7070" in clean_failure(done, 2)
    assert not (tmp_path / "d2").exists()
    (tmp_path / "a-file").write_text("x")
    done = tw("serve", "--data", str(tmp_path / "a-file"), "--port", "0", timeout=30)
    assert "not a directory" in clean_failure(done, 2)


def test_serve_refuses_a_fire_ahead_window_it_cannot_keep_before_touching_the_data(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d"
    for value, says in (
        ("soon", "--fire-ahead"),
        ("-5s", "--fire-ahead"),
        ("11s", "fire_ahead_ms must be in 0..10000"),
    ):
        done = tw("serve", "--data", str(data), "--port", "0", "--fire-ahead", value, timeout=30)
        assert says in clean_failure(done, 2), (value, done.stderr)
    assert not data.exists()


# ------------------------------------------------------------------ C8: job.list cursors


def test_job_list_refuses_cursors_out_of_range(node: NodeProc) -> None:
    async def body(client: Client) -> list[tuple[str, str | None]]:
        out = []
        for after in ("1:18446744073709551616", "-1:0", "0:-5", "2:0", "1:9223372036854775807"):
            try:
                await client.request("job.list", {"after": after})
                out.append(("ok", None))
            except RemoteError as exc:
                out.append((exc.code, exc.field))
        await client.request("job.list", {"after": "1:0"})  # a real one still pages on
        return out

    assert with_client(node.port, body) == [("bad_args", "after")] * 5


# ------------------------------------------------------------------ C9: small ones


def test_tz_without_cron_is_refused_with_what_to_do(node: NodeProc) -> None:
    for when in (("--every", "5m"), ("--at", "2040-01-01T00:00:00Z"), ("--in", "1h")):
        done = cli(node, "submit", *when, "--tz", "Europe/Berlin", "--shell", "true")
        assert "--tz applies to --cron only" in clean_failure(done, 2)
    # `job update ID --tz ZONE` alone changes a cron job's zone: test_cli_update.py


def test_a_negative_duration_reaches_the_typed_validation(node: NodeProc) -> None:
    done = cli(node, "submit", "--every", "-5s", "--shell", "true")
    assert "invalid_schedule: schedule.every" in clean_failure(done), done.stderr
    done = cli(node, "submit", "--in", "-5s", "--shell", "true")
    assert "--in:" in clean_failure(done, 2)


def test_output_into_a_closed_pipe_ends_quietly(node: NodeProc) -> None:
    run_id = run_payload(node, "piped", [("stdout", b"x" * 1000 + b"\n")])
    for args in (("logs", run_id), ("logs", run_id, "--json"), ("job", "get", "piped")):
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", *args, "--connect", f"127.0.0.1:{node.port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # as `| head` that has read what it wanted
        stderr = proc.stderr.read().decode()
        assert proc.wait(60) == 1 and stderr == "", stderr


def test_a_command_with_no_node_to_reach_says_why_at_once_and_at_the_end() -> None:
    """Found by the fifth adversarial pass: ten silent seconds, then only "cannot connect"."""
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        done = tw("jobs", "--connect", f"127.0.0.1:{port}")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"cannot connect to 127.0.0.1:{port} (Connection refused); trying for 10 s"
    assert lines[-1].endswith(f"cannot connect to 127.0.0.1:{port} within 10 s: Connection refused")


def test_connect_reason_names_each_distinct_error() -> None:
    from cluster.client import connect_reason

    group = ExceptionGroup(
        "all failed", [ConnectionRefusedError(111, "x"), ConnectionRefusedError(111, "y")]
    )
    exc = OSError("all attempts to connect to h:1 failed")
    exc.__cause__ = group
    assert connect_reason(exc) == "Connection refused"
    assert connect_reason(OSError(113, "No route to host")) == "No route to host"
    assert connect_reason(OSError("plain")) == "plain"


# --------------------------------------------- found by the review of the commands


def test_json_nested_too_deeply_is_a_usage_error_not_a_traceback(
    node: NodeProc, tmp_path: Path
) -> None:
    """Python's JSON reader raised RecursionError (not a JSONDecodeError) at ~1,000 levels:
    a traceback, where the README promises a usage error."""
    deep = "[" * 5000 + "]" * 5000
    done = cli(node, "submit", "--at", "2040-01-01T00:00:00Z", "--payload", deep)
    assert "--payload is not usable JSON: nested too deeply" in clean_failure(done, 2)
    path = tmp_path / "deep.jsonl"
    path.write_text('{"schedule": {"every": "1h"}, "task": {"shell": "true"}}\n' + deep + "\n")
    done = cli(node, "submit", "--file", str(path))
    assert f"{path}:2: not usable JSON: nested too deeply" in clean_failure(done, 2)


def test_a_duration_error_names_its_option_once(node: NodeProc) -> None:
    done = cli(node, "submit", "--in", "5x", "--shell", "true")
    stderr = clean_failure(done, 2)
    assert stderr.count("--in") == 1, stderr


def test_negative_worker_durations_reach_the_typed_validation() -> None:
    for option in ("--drain", "--connect-timeout"):
        done = tw("worker", "--connect", "127.0.0.1:1", option, "-1s")
        assert "expected one argument" not in done.stderr, done.stderr
        assert done.returncode == 2 and option in done.stderr, (option, done.stderr)


def test_command_lines_are_split_as_sh_splits_them(node: NodeProc) -> None:
    """The review's case: ``\\$`` inside double quotes lost its backslash to no one."""
    line = 'sh -c "echo \\$0 \\`x\\`" "it\'s"'
    done = cli(node, "submit", "--id", "split", "--at", "2040-01-01T00:00:00Z", "--command", line)
    assert done.returncode == 0, done.stderr
    job = json.loads(cli(node, "job", "get", "split", "--json").stdout)
    assert job["spec"]["task"]["command"] == ["sh", "-c", "echo $0 `x`", "it's"]


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:7070", ("127.0.0.1", 7070)),
        ("[::1]:7070", ("::1", 7070)),
        ("::1:7070", ("::1", 7070)),
        ("node.example:1", ("node.example", 1)),
    ],
)
def test_addresses_bracketed_ipv6_included(text: str, address: tuple[str, int]) -> None:
    from cluster.client import parse_address

    assert parse_address(text) == address


@pytest.mark.parametrize(
    "text", ["7070", ":7070", "[::1:7070", "::1]:7070", "[]:7070", "h:0", "h:x"]
)
def test_addresses_that_are_not_host_port_are_refused(text: str) -> None:
    from cluster.client import ClientError, parse_address

    with pytest.raises(ClientError, match="not HOST:PORT"):
        parse_address(text)


def test_a_connect_address_that_is_not_host_port_is_a_usage_error_everywhere() -> None:
    """Status 2 for client commands too, as for `worker --connect` (found by review: 1), and
    the message says where the address came from (found by review: it did not)."""
    for argv, env, source in (
        (("jobs", "--connect", "h:0"), {}, "--connect"),
        (("run", "j@1", "--connect", ":7070"), {}, "--connect"),
        (("jobs",), {"TICKWHEEL_CONNECT": "nonsense"}, "TICKWHEEL_CONNECT"),
        (("jobs", "--connect", "x"), {"TICKWHEEL_CONNECT": "127.0.0.1:1"}, "--connect"),
        (("worker", "--connect", "nonsense"), {}, "--connect"),
        (("worker",), {"TICKWHEEL_CONNECT": "nonsense"}, "TICKWHEEL_CONNECT"),
    ):
        done = tw(*argv, env=env)
        assert done.returncode == 2 and "not HOST:PORT" in done.stderr, (argv, done.stderr)
        assert f"{source}: " in done.stderr, (argv, done.stderr)


def test_a_node_on_ipv6_loopback_is_reached_by_its_bracketed_address(tmp_path: Path) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = NodeProc(tmp_path / "data", tmp_path / "node.log", host="::1")
    try:
        done = tw("jobs", "--json", "--connect", f"[::1]:{proc.port}")
        assert done.returncode == 0 and json.loads(done.stdout) == [], done.stderr
    finally:
        proc.kill()


def test_the_clients_own_errors_carry_their_code_and_json(tmp_path: Path) -> None:
    """A client-side error (here ``not_sendable``: an integer past 64 bits) is printed with
    its code, and as the JSON error object under ``--json``, as the node's errors are (found
    by review: plain text, without the code, whatever ``--json`` said)."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:
        args = ("submit", "--in", "1h", "--payload", '{"n": 100000000000000000000000}')
        done = cli(node, *args)
        assert done.returncode == 1 and done.stderr.startswith("error not_sendable: "), done
        done = cli(node, *args, "--json")
        assert done.returncode == 1
        assert json.loads(done.stdout)["error"]["code"] == "not_sendable"
    finally:
        node.kill()


def test_a_submit_whose_answer_never_came_names_the_job_it_may_have_made() -> None:
    """The id is made by the CLI: a create whose connection broke (here a peer that reads the
    request and hangs up) may have made the job, and the error says which, so the user can
    look and retry with that --id instead of making a second job (found by review)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def hang_up() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the test is over
            conn.recv(65536)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        port = server.getsockname()[1]
        done = tw("submit", "--in", "1h", "--shell", "true", "--connect", f"127.0.0.1:{port}")
        assert done.returncode == 1 and "connection_lost" in done.stderr, done.stderr
        job_id = done.stderr.split("(job ", 1)[1].split()[0]
        assert f"tickwheel job get {job_id}" in done.stderr
        validate_job_id(job_id)
    finally:
        server.close()
