"""The wire codec against a reference: frames fed in any slicing give back the messages, and a
bad frame costs exactly one error, never the stream."""

from __future__ import annotations

import struct

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from cluster.codec import FrameDecoder, ProtocolError, encode

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
values = st.recursive(
    scalars | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=8), values, max_size=5).map(lambda m: {**m, "id": 7})


def drain(decoder: FrameDecoder) -> list[object]:
    out: list[object] = []
    while (event := decoder.next_event()) is not None:
        out.append(event)
    return out


@given(st.lists(messages, max_size=8), st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_any_slicing_gives_back_the_messages_in_order(
    sent: list[dict[str, object]], cuts: list[int]
) -> None:
    stream = b"".join(encode(m) for m in sent)
    decoder = FrameDecoder()
    got: list[object] = []
    i = 0
    k = 0
    while i < len(stream):
        step = cuts[k % len(cuts)]
        decoder.feed(stream[i : i + step])
        got += drain(decoder)
        i += step
        k += 1
    assert got == sent
    assert decoder.pending_bytes == 0


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_a_bad_frame_is_one_error_and_the_next_frame_still_decodes() -> None:
    decoder = FrameDecoder()
    decoder.feed(frame(b"\xc1") + frame(msgpack.packb([1, 2])) + encode({"id": 1, "op": "x"}))
    errors = drain(decoder)
    assert [type(e) for e in errors[:2]] == [ProtocolError, ProtocolError]
    assert all(isinstance(e, ProtocolError) and e.code == "malformed" for e in errors[:2])
    assert errors[2] == {"id": 1, "op": "x"}


def test_an_oversized_frame_is_skipped_without_being_buffered() -> None:
    decoder = FrameDecoder(max_frame=100)
    big = frame(b"\x00" * 10_000)
    decoder.feed(big[:50])
    (error,) = drain(decoder)
    assert isinstance(error, ProtocolError) and error.code == "frame_too_large"
    for i in range(50, len(big), 1000):
        decoder.feed(big[i : i + 1000])
        assert decoder.pending_bytes < 1000
    decoder.feed(encode({"id": 2}))
    assert drain(decoder) == [{"id": 2}]


def test_a_non_integer_request_id_is_malformed() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode({"id": "seven"}) + encode({"id": True}))
    assert [e.code for e in drain(decoder) if isinstance(e, ProtocolError)] == [
        "malformed",
        "malformed",
    ]


def test_encoding_an_unencodable_value_is_a_typed_error() -> None:
    try:
        encode({"id": 1, "x": object()})
    except ProtocolError as error:
        assert error.code == "unencodable"
    else:
        raise AssertionError("no error")


def test_a_list_or_map_longer_than_any_message_needs_is_refused_before_it_is_built() -> None:
    """The reviewer's frame: 4,000,000 empty maps in one list (3.8 MiB, under the frame
    limit, ~300 MiB once built) is one typed error, and the stream goes on; a list as long as
    the largest a valid message holds still decodes."""
    from cluster.codec import MAX_ARRAY_LEN, MAX_MAP_LEN
    from cluster.protocol import MAX_BATCH, MAX_LIMIT
    from engine.jobs import MAX_TASK_BYTES

    # the limits are the protocol's: nothing valid is refused by them
    assert MAX_ARRAY_LEN >= max(MAX_TASK_BYTES, MAX_BATCH, MAX_LIMIT)
    assert MAX_MAP_LEN >= MAX_TASK_BYTES // 2
    n = 4_000_000
    head = msgpack.packb({"id": 1, "op": "ping"})
    body = (
        b"\x83"
        + head[1:]
        + msgpack.packb("args")
        + b"\x81"
        + msgpack.packb("x")
        + b"\xdd"
        + struct.pack(">I", n)
        + b"\x80" * n
    )
    wide_map = b"\xdf" + struct.pack(">I", MAX_MAP_LEN + 1)
    wide_map += b"".join(msgpack.packb(f"k{i}") + b"\xc0" for i in range(MAX_MAP_LEN + 1))
    decoder = FrameDecoder()
    decoder.feed(
        frame(body)
        + frame(b"\x81\xa1m" + wide_map)
        + encode({"id": 2, "x": [None] * MAX_ARRAY_LEN})
    )
    events = drain(decoder)
    assert [getattr(e, "code", None) for e in events[:2]] == ["container_too_large"] * 2
    # (the first names its request: its id comes before the list; the second has none)
    assert isinstance(events[0], ProtocolError) and events[0].request_id == 1
    assert isinstance(events[1], ProtocolError) and events[1].request_id is None
    assert events[2] == {"id": 2, "x": [None] * MAX_ARRAY_LEN}


def test_a_read_of_exactly_one_frame_decodes_as_any_other_slicing() -> None:
    """One whole frame in one read, nothing held before it (the decoder's shortcut): the
    same message, or the same error, as the frame fed a byte at a time; an oversized frame
    and a frame behind held bytes still take the general path."""
    frames = [
        encode({"id": 1, "op": "ping", "args": {}}),
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        encode({"id": 2, "op": "job.get", "args": {"id": "x" * 100}}),
    ]
    for frame in frames:
        whole, bytewise = FrameDecoder(), FrameDecoder()
        whole.feed(frame)
        for i in range(len(frame)):
            bytewise.feed(frame[i : i + 1])
        a, b = whole.next_event(), bytewise.next_event()
        assert whole.next_event() is None and bytewise.next_event() is None
        if isinstance(a, ProtocolError):
            assert isinstance(b, ProtocolError) and (a.code, a.message) == (b.code, b.message)
        else:
            assert a == b and a is not None
        assert whole.pending_bytes == 0
    small = FrameDecoder(max_frame=64)
    small.feed(frames[2])  # over the limit: refused, its bytes skipped
    event = small.next_event()
    assert isinstance(event, ProtocolError) and event.code == "frame_too_large"
    small.feed(frames[0])
    assert small.next_event() == {"id": 1, "op": "ping", "args": {}}
    held = FrameDecoder()
    held.feed(frames[0][:3])  # a partial header held: the next read is not a frame alone
    held.feed(frames[0][3:] + frames[2])
    assert held.next_event() == {"id": 1, "op": "ping", "args": {}}
    assert held.next_event() is not None and held.pending_bytes == 0
