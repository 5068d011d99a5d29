"""The wire codec: length-prefixed msgpack frames, sans-io.

Owns the bytes on the wire and nothing else: a frame is a 4-byte big-endian length followed by
that many bytes of one msgpack map. :class:`FrameDecoder` takes bytes in any slicing and hands
out whole messages (or a typed :class:`ProtocolError` for one bad frame); :func:`encode` turns a
message into bytes. Like h11, it never touches a socket, a clock or a task: the Trio streams
that feed it live in :mod:`cluster.node` and :mod:`cluster.client`.

Must never let one bad frame poison the stream: a frame whose body is not a msgpack map, holds
a list or map longer than any message needs, would decode to far more memory than its size, or
whose declared length passes the limit, yields an error for that frame and the decoder moves
on to the next one (an oversized body is skipped as it arrives, never buffered).
"""

from __future__ import annotations

import struct
import sys
import threading
from collections import deque
from typing import Any, Final

import msgpack

#: Frames larger than this are refused (their bytes skipped). Job specs are capped at 256 KiB of
#: task; a batch of specs must fit too.
DEFAULT_MAX_FRAME: Final = 8 * 1024 * 1024
#: Most elements of one msgpack array (and, halved, entries of one map) in a frame: the largest
#: container a valid message needs is inside a job's task, at most 256 KiB encoded
#: (``engine.jobs.MAX_TASK_BYTES``: an element takes at least a byte, a map entry two); the
#: protocol's own lists are shorter (10,000: ``MAX_BATCH`` specs or reports, ``MAX_LIMIT``
#: pages). A frame holding a longer one is refused before it is built (``container_too_large``).
#: Strings and bins are bounded by the frame alone (a string over a job's limits must get the
#: job's own error, naming its field). This bounds each container, not their number:
#: :data:`BUDGET_FROM` and :data:`MAX_EXPANSION` bound what decoding one frame allocates.
MAX_ARRAY_LEN: Final = 256 * 1024
MAX_MAP_LEN: Final = MAX_ARRAY_LEN // 2
#: Frames up to this size are decoded as they come, with no count: even the densest (1-byte
#: empty maps in lists, about 72 bytes of Python each) costs at most about 37 MiB, and every
#: request of a single job (a task is at most 256 KiB encoded) stays below it.
BUDGET_FROM: Final = 512 * 1024
#: A larger frame may decode to at most this many times its size (``frame_too_complex``
#: otherwise), as :func:`_charge` counts: what each list and map costs (``sys.getsizeof``: its
#: slots and hash table), plus the scalars that cost more than their bytes (see
#: :data:`_SCALAR_CLASS`). Legitimate frames cost 5-16 times their size (measured: batches of
#: specs, pages of jobs; docs/protocol.md, "Memory per frame"); a worst frame about 72.
MAX_EXPANSION: Final = 20
_HEADER: Final = struct.Struct(">I")

Message = dict[str, Any]

# One packer per thread, kept: ``msgpack.packb`` builds a new one per call, about half of the
# cost of encoding a small reply.
_packers = threading.local()


class ProtocolError(Exception):
    """A frame that cannot be a message. ``code`` is the error code sent back to the peer;
    ``request_id`` is the frame's request id when it could be read (else None)."""

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def encode(message: Message) -> bytes:
    """One frame holding ``message``. Raises :class:`ProtocolError` (``unencodable``) for a
    value msgpack cannot encode; the caller's bug, never the peer's."""
    packer: msgpack.Packer | None = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        body: bytes = packer.pack(message)  # a failed pack leaves the packer empty
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError("unencodable", f"cannot encode message: {error}") from None
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Bytes in (:meth:`feed`), messages out (:meth:`next_event`).

    Guarantees: messages come out in the order their frames went in; a bad frame yields exactly
    one :class:`ProtocolError` in its place; memory is bounded by ``max_frame`` plus one read,
    and, with ``max_expansion`` set, decoding one frame larger than :data:`BUDGET_FROM` builds
    at most about ``max_expansion`` times its size before it is refused (``frame_too_complex``).
    ``max_expansion=None`` decodes every frame whatever it costs, for a peer that is trusted
    (the node's replies stay far under the budget: a page of 10,000 jobs costs about 5 times
    its size).
    Cost: O(bytes) per feed; msgpack decoding per frame, plus one call per list and map for
    the frames above :data:`BUDGET_FROM` when counted.
    """

    __slots__ = ("_buffer", "_events", "_max_expansion", "_max_frame", "_skip")

    def __init__(
        self, max_frame: int = DEFAULT_MAX_FRAME, *, max_expansion: int | None = MAX_EXPANSION
    ) -> None:
        self._max_frame = max_frame
        self._max_expansion = max_expansion
        self._buffer = bytearray()
        self._skip = 0  # bytes of an oversized frame still to discard
        self._events: deque[Message | ProtocolError] = deque()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the stream (any slicing)."""
        if not self._buffer and not self._skip and type(data) is bytes and len(data) > 4:
            # The commonest read (a lone request or reply): exactly one whole frame, nothing
            # held before it. Decoded straight from the read, never copied into the buffer.
            (length,) = _HEADER.unpack_from(data)
            if length == len(data) - 4 and length <= min(self._max_frame, BUDGET_FROM):
                self._events.append(_decode(data[4:]))
                return
        view = memoryview(data)
        if self._skip:
            dropped = min(self._skip, len(view))
            self._skip -= dropped
            view = view[dropped:]
        self._buffer += view
        self._split()

    def next_event(self) -> Message | ProtocolError | None:
        """The next whole message, or the error standing for a bad frame, or None (need more
        bytes)."""
        return self._events.popleft() if self._events else None

    def has_event(self) -> bool:
        """Whether :meth:`next_event` has a message (or error) to give now."""
        return bool(self._events)

    @property
    def pending_bytes(self) -> int:
        """Bytes held for a frame not yet complete."""
        return len(self._buffer)

    def _split(self) -> None:
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            if length > self._max_frame:
                available = len(buffer) - start - _HEADER.size
                dropped = min(length, available)
                self._skip = length - dropped
                start += _HEADER.size + dropped
                self._events.append(
                    ProtocolError(
                        "frame_too_large",
                        f"frame of {length} bytes; the limit is {self._max_frame}",
                    )
                )
                continue
            end = start + _HEADER.size + length
            if end > len(buffer):
                break
            body = bytes(buffer[start + _HEADER.size : end])
            if length > BUDGET_FROM and self._max_expansion is not None:
                self._events.append(_decode(body, length * self._max_expansion))
            else:
                self._events.append(_decode(body))
            start = end
        if start:
            del buffer[:start]


class _OverBudget(Exception):
    """Raised from a hook of :func:`_decode` to stop decoding a frame that costs too much."""


#: Byte value -> class of the scalars that cost more than their bytes (0: none), and per class
#: what one may cost beyond the 8-byte slot its container already counts. 1: a negative
#: fixint below -5 (one byte) is a new int of 32 bytes (-5..256 are shared); a 3-byte UTF-8
#: character's first byte. 2: a str of 2 or 3 bytes (0xa2, 0xa3: a new string of 56 bytes when
#: ASCII; one character is shared), an ext value (a new ``ExtType``; the protocol uses none).
#: 3: the other types' first bytes from 0xc4 (bin, float, ints beyond fixints, str8: a new
#: object of 24-40 bytes), and a 2-byte UTF-8 character's first byte beyond Latin-1 (a
#: one-character string of 80). What is not counted stays within about 22 times its size (an
#: int8 of 2 bytes; a str8 of one 2-byte character). Bytes inside strings and bins are
#: classed too: that only overcounts (random bytes by about 7 per byte, non-Latin text by
#: about 12-14), never undercounts.
_SCALAR_CLASS: Final = bytes(
    1
    if 0xE0 <= b <= 0xFA
    else 2
    if b in (0xA2, 0xA3, 0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8
    else 3
    if 0xC4 <= b <= 0xDF and b != 0xCC  # (a uint8 is 0..255: shared)
    else 0
    for b in range(256)
)
_SCALAR_COST: Final = ((1, 32), (2, 56), (3, 24))
#: What a map of n entries costs as msgpack builds it (``sys.getsizeof``: the object and its
#: hash table), measured once for n < 64 on this interpreter; larger maps are counted at 64 +
#: 40 per entry, above what they cost (about 21-35 per entry).
_MAP_SIZE: Final = tuple(
    sys.getsizeof(msgpack.unpackb(msgpack.packb({f"k{i}": None for i in range(n)})))
    for n in range(64)
)
#: What a list of n elements costs (``PyList_New(n)``: 56 bytes and one slot per element).
_LIST_BASE: Final = sys.getsizeof([])


def _charge(body: bytes, budget: int) -> Any:
    """``body`` decoded, or :class:`_OverBudget` as soon as what it built passes ``budget``
    bytes (nothing of it is kept then). The scalars are counted first, from the bytes (a pass
    at C speed); each list and map is counted by a hook as msgpack completes it (the hooks are
    about a quarter of a microsecond each: a batch of small specs decodes up to about 1.8
    times slower than with none), so that decoding stops about one container past the budget
    (plus the slots of the lists still open: at most 2 MiB each)."""
    classes = body.translate(_SCALAR_CLASS)
    left = budget - sum(cost * classes.count(code) for code, cost in _SCALAR_COST)
    del classes
    if left < 0:
        raise _OverBudget
    map_size = _MAP_SIZE

    def charge_map(container: dict[str, Any]) -> dict[str, Any]:
        nonlocal left
        n = len(container)
        left -= map_size[n] if n < 64 else 64 + 40 * n
        if left < 0:
            raise _OverBudget
        return container

    def charge_list(container: list[Any]) -> list[Any]:
        nonlocal left
        left -= _LIST_BASE + 8 * len(container)
        if left < 0:
            raise _OverBudget
        return container

    return msgpack.unpackb(
        body,
        raw=False,
        strict_map_key=True,
        max_array_len=MAX_ARRAY_LEN,
        max_map_len=MAX_MAP_LEN,
        object_hook=charge_map,
        list_hook=charge_list,
        ext_hook=_refuse_ext,
    )


def _refuse_ext(code: int, data: bytes) -> object:
    """msgpack's ``ext_hook``: no part of the protocol is an ext type (docs/protocol.md, 1)."""
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def _request_id(body: bytes) -> int | None:
    """The ``id`` of the message in ``body``, read without building the rest (skipped keys'
    values are parsed, not built); None if there is none or the body is not a map."""
    try:
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_buffer_size=max(len(body), 1),
        )
        unpacker.feed(body)
        for _ in range(min(unpacker.read_map_header(), 3)):  # a request has id, op, args
            if unpacker.unpack() == "id":  # a key is a str or bin; a bin is read as bytes
                value = unpacker.unpack()
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
                return None
            unpacker.skip()
    except Exception:  # msgpack raises several unrelated types for bad input
        return None
    return None


def _decode(body: bytes, budget: int | None = None) -> Message | ProtocolError:
    """The message in ``body``, or the error that stands for it. With a ``budget`` (bytes),
    decoding stops with ``frame_too_complex`` (carrying the request's id when it can be read)
    once the lists, maps and small scalars built pass it."""
    try:
        if budget is None:
            message = msgpack.unpackb(
                body,
                raw=False,
                strict_map_key=True,
                max_array_len=MAX_ARRAY_LEN,
                max_map_len=MAX_MAP_LEN,
                ext_hook=_refuse_ext,
            )
        else:
            message = _charge(body, budget)
    except _OverBudget:
        times = (budget or 0) // len(body)
        return ProtocolError(
            "frame_too_complex",
            f"a frame of {len(body)} bytes decodes to more than {times} times "
            "its size; send it in smaller frames (fewer specs per batch)",
            _request_id(body),
        )
    except Exception as error:  # msgpack raises several unrelated types for bad input
        if isinstance(error, ValueError) and "exceeds max_" in str(error):
            # msgpack's own limit check ("N exceeds max_array_len(M)"), before it allocates
            return ProtocolError(
                "container_too_large",
                f"frame holds a list or map over the limit: {error}",
                _request_id(body),
            )
        # With the request's id when it can be read (a whole frame whose args are at fault):
        # an error without one reaches no request, and its sender waited out its timeout
        # instead (found by review).
        return ProtocolError("malformed", f"frame is not valid msgpack: {error}", _request_id(body))
    if not isinstance(message, dict):
        return ProtocolError("malformed", f"a message is a map, got {type(message).__name__}")
    request_id = message.get("id")
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, int)):
        return ProtocolError("malformed", "'id' must be an integer")
    return message
