"""What decoding one frame may cost: a frame larger than ``BUDGET_FROM`` that would build more
than ``MAX_EXPANSION`` times its size in Python objects (small maps and lists, small negative
ints, short strings: 1-3 bytes each on the wire, 32-190 bytes each once built) is refused with
``frame_too_complex`` while it is decoded, not after; legitimate frames, however large, are
decoded as before. Sans-io tests of the codec, then one against a real node process on
127.0.0.1 (docs/protocol.md, section 2, "Memory per frame").
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cluster.client import Client, new_job_id
from cluster.codec import (
    BUDGET_FROM,
    DEFAULT_MAX_FRAME,
    MAX_ARRAY_LEN,
    MAX_EXPANSION,
    FrameDecoder,
    Message,
    ProtocolError,
    encode,
)
from engine.jobs import MAX_TASK_BYTES
from tests.cluster.procs import NodeProc, with_client

pytestmark = pytest.mark.timeout(120)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def drain(decoder: FrameDecoder) -> list[Message | ProtocolError]:
    events = []
    while (event := decoder.next_event()) is not None:
        events.append(event)
    return events


def lists_of(element: bytes, size: int) -> bytes:
    """A msgpack list of about ``size`` bytes of lists of ``element`` (one msgpack value,
    packed), each as long as the codec allows."""
    count = size // len(element)
    lists = []
    while count > 0:
        n = min(count, MAX_ARRAY_LEN)
        lists.append(b"\xdd" + struct.pack(">I", n) + element * n)
        count -= n + 6  # (a header's 5 bytes, and the outer list's, near enough)
    return b"\xdd" + struct.pack(">I", len(lists)) + b"".join(lists)


def bomb(element: bytes, size: int, request_id: int = 41) -> bytes:
    """The body of a ``job.create_many`` of at most ``size`` bytes whose specs are lists of
    ``element``."""
    head = msgpack.packb({"id": request_id, "op": "job.create_many"})
    start = b"\x83" + head[1:] + msgpack.packb("args") + b"\x81" + msgpack.packb("specs")
    return start + lists_of(element, size - len(start) - 64)


def realistic_specs(count: int, now: int | None = None) -> list[dict[str, Any]]:
    """Specs as a user writes them, ids filled in as ``Client.create_many`` does."""
    now = now or int(time.time() * 1000)
    return [
        {
            "id": new_job_id(now, os.urandom(10)),
            "schedule": {"cron": "*/5 * * * *", "tz": "Europe/Berlin"},
            "task": {"shell": f"/usr/local/bin/report --customer {i}", "env": {"REGION": "eu"}},
            "tier": "batch",
            "timeout": "10m",
            "retries": {"max": 3, "backoff": "30s"},
            "labels": {"team": "billing", "customer": f"c{i}"},
        }
        for i in range(count)
    ]


def small_specs(count: int) -> list[dict[str, Any]]:
    """The benchmarks' specs (bench/submit_suite.py): four small maps in 69 bytes each."""
    return [
        {
            "id": f"b-{i:08d}",
            "schedule": {"at": "2026-01-01T00:00:00Z"},
            "task": {"payload": {"n": i}},
        }
        for i in range(count)
    ]


def create_many(request_id: int, specs: list[Any]) -> bytes:
    return encode({"id": request_id, "op": "job.create_many", "args": {"specs": specs}})


# =============================================================================== sans-io


@pytest.mark.parametrize(
    ("name", "element"),
    [
        ("empty maps", b"\x80"),  # 1 byte, 64 built (72 with its slot)
        ("one-entry maps", b"\x81\xa0\xc0"),  # 3 bytes, 184 built
        ("empty lists", b"\x90"),  # 1 byte, 56 built
        ("negative fixints", b"\xec"),  # 1 byte (-20), a new int of 32
        ("one Cyrillic letter", b"\xa2\xd0\x96"),  # 3 bytes, a new str of 76
    ],
)
def test_a_frame_that_would_build_far_more_than_its_size_is_refused_while_decoded(
    name: str, element: bytes
) -> None:
    """Refused with ``frame_too_complex``, carrying the request's id (so that a client
    library pairs it with its request), having built at most about MAX_EXPANSION times the
    frame (before: 40-75 times); the next frame on the stream decodes."""
    body = bomb(element, 2 * BUDGET_FROM)
    assert BUDGET_FROM < len(body) <= 2 * BUDGET_FROM
    decoder = FrameDecoder()
    tracemalloc.start()
    try:
        decoder.feed(frame(body))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    decoder.feed(encode({"id": 42, "op": "ping"}))
    refused, after = drain(decoder)
    assert isinstance(refused, ProtocolError), name
    assert refused.code == "frame_too_complex" and refused.request_id == 41
    assert f"{MAX_EXPANSION} times" in refused.message
    # the frame's own bytes are held twice meanwhile (the buffer and the body): 2 more times
    assert peak < (MAX_EXPANSION + 4) * len(body), (name, peak / len(body))
    assert after == {"id": 42, "op": "ping"}


def test_the_refusal_names_no_id_when_there_is_none() -> None:
    body = b"\x81\xa1x" + lists_of(b"\x80", 2 * BUDGET_FROM)  # no id: refused all the same
    decoder = FrameDecoder()
    decoder.feed(frame(body))
    (refused,) = drain(decoder)
    assert isinstance(refused, ProtocolError)
    assert refused.code == "frame_too_complex" and refused.request_id is None


def test_large_legitimate_frames_decode_as_before() -> None:
    """Batches of 10,000 specs (realistic ones; the benchmarks' small ones, four maps in 69
    bytes), a batch of CJK payloads, output of random bytes, a page of ints: all over
    BUDGET_FROM, all decoded whole. A single job with the densest task the job limit allows
    (a 256 KiB list of one-entry maps: about 64 times its size) stays below BUDGET_FROM, so
    that no request of one job is refused for what it costs."""
    rng = random.Random(7)
    frames = [
        create_many(1, realistic_specs(10_000)),
        create_many(2, small_specs(10_000)),
        create_many(
            3,
            [
                {
                    "id": f"j{i}",
                    "schedule": {"every": "1h"},
                    "task": {"payload": "定时任务报告" * 30},
                }
                for i in range(3_000)
            ],
        ),
        encode(
            {
                "id": 4,
                "op": "worker.output",
                "args": {
                    "run_id": "r@1",
                    "token": 1,
                    "stream": "stdout",
                    "data": os.urandom(3 << 20),
                },
            }
        ),
        encode({"id": 5, "x": [rng.randrange(-(2**40), 2**40) for _ in range(200_000)]}),
    ]
    dense_task = {"payload": [{"a": None}] * ((MAX_TASK_BYTES - 16) // 4)}
    assert len(msgpack.packb(dense_task)) <= MAX_TASK_BYTES
    single = encode(
        {
            "id": 6,
            "op": "job.create",
            "args": {"spec": {"id": "d", "schedule": {}, "task": dense_task}},
        }
    )
    assert len(single) - 4 < BUDGET_FROM
    for data in frames:
        assert len(data) - 4 > BUDGET_FROM
    for data in [*frames, single]:
        decoder = FrameDecoder()
        decoder.feed(data)
        (event,) = drain(decoder)
        assert isinstance(event, dict), getattr(event, "message", None)
        assert encode(event) == data


def test_a_decoder_without_a_budget_decodes_everything() -> None:
    """``max_expansion=None`` (the client library's: its node is trusted) decodes what the
    node's decoder refuses."""
    body = bomb(b"\x81\xa0\xc0", BUDGET_FROM + 4096)
    decoder = FrameDecoder(max_expansion=None)
    decoder.feed(frame(body))
    (event,) = drain(decoder)
    assert isinstance(event, dict) and event["id"] == 41


def test_the_budget_and_its_error_are_documented() -> None:
    doc = DOCS.read_text()
    assert "`frame_too_complex`" in doc
    for name, value in (("BUDGET_FROM", BUDGET_FROM), ("MAX_EXPANSION", MAX_EXPANSION)):
        assert f"`{name}` = {value:,}" in doc, name
    assert BUDGET_FROM < DEFAULT_MAX_FRAME


# =============================================================================== a real node


def test_a_real_node_refuses_the_bomb_and_serves_everyone_else(tmp_path: Path) -> None:
    """A node process on 127.0.0.1: an 8 MiB frame of empty maps in lists (before: about 600
    MiB built, then a ``bad_args``) gets ``frame_too_complex`` with its request's id; the
    same connection and another client's requests are served meanwhile and after, and a
    legitimate batch larger than BUDGET_FROM is created whole."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log")
    try:

        async def other_before(client: Client) -> None:
            await client.create(
                {"id": "before", "schedule": {"every": "1h"}, "task": {"shell": "true"}}
            )

        with_client(node.port, other_before)
        body = bomb(b"\x80", DEFAULT_MAX_FRAME)
        assert len(body) <= DEFAULT_MAX_FRAME
        with socket.create_connection(("127.0.0.1", node.port), timeout=60) as raw:
            raw.sendall(frame(body) + encode({"id": 43, "op": "ping"}))
            decoder = FrameDecoder()
            replies: list[Message | ProtocolError] = []
            while len(replies) < 2:
                data = raw.recv(1 << 16)
                assert data, "the node closed the connection"
                decoder.feed(data)
                replies += drain(decoder)
        refused, pong = replies
        assert isinstance(refused, dict) and refused["id"] == 41 and refused["ok"] is False
        assert refused["error"]["code"] == "frame_too_complex", refused
        assert isinstance(pong, dict) and pong["id"] == 43 and pong["ok"] is True

        async def other_after(client: Client) -> None:
            assert (await client.get("before"))["spec"]["task"] == {"shell": "true"}
            results = await client.create_many(small_specs(10_000))
            assert all(r["ok"] for r in results), [r for r in results if not r["ok"]][:3]
            assert (await client.get("b-00009999"))["spec"]["task"] == {"payload": {"n": 9999}}

        assert len(create_many(1, small_specs(10_000))) - 4 > BUDGET_FROM
        with_client(node.port, other_after)

        # The client library decodes with the budget too: the largest reply the node makes (a
        # page of 10,000 jobs, over BUDGET_FROM) is read whole, far under it.
        async def big_page(client: Client) -> None:
            page = await client.request("job.list", {"limit": 10_000})
            assert len(page["jobs"]) == 10_000 and len(encode(page)) > BUDGET_FROM

        with_client(node.port, big_page)
        assert node.alive()
    finally:
        node.terminate()
