"""The wire codec: length-prefixed msgpack frames, sans-io.

Owns the bytes on the wire and nothing else: a frame is a 4-byte big-endian length followed by
that many bytes of one msgpack map. :class:`FrameDecoder` takes bytes in any slicing and hands
out whole messages (or a typed :class:`ProtocolError` for one bad frame); :func:`encode` turns a
message into bytes. Like h11, it never touches a socket, a clock or a task: the Trio streams
that feed it live in :mod:`cluster.node` and :mod:`cluster.client`.

Must never let one bad frame poison the stream: a frame whose body is not a msgpack map, holds
a list or map longer than any message needs, or whose declared length passes the limit, yields an error for that frame and the decoder moves
on to the next one (an oversized body is skipped as it arrives, never buffered).
"""

from __future__ import annotations

import struct
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
#: job's own error, naming its field). This bounds each container, not their number: see
#: docs/protocol.md, "Limits", for what decoding one frame may still allocate.
MAX_ARRAY_LEN: Final = 256 * 1024
MAX_MAP_LEN: Final = MAX_ARRAY_LEN // 2
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
    one :class:`ProtocolError` in its place; memory is bounded by ``max_frame`` plus one read.
    Cost: O(bytes) per feed; msgpack decoding per frame.
    """

    __slots__ = ("_buffer", "_events", "_max_frame", "_skip")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._max_frame = max_frame
        self._buffer = bytearray()
        self._skip = 0  # bytes of an oversized frame still to discard
        self._events: deque[Message | ProtocolError] = deque()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the stream (any slicing)."""
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
            self._events.append(_decode(bytes(buffer[start + _HEADER.size : end])))
            start = end
        if start:
            del buffer[:start]


def _decode(body: bytes) -> Message | ProtocolError:
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except Exception as error:  # msgpack raises several unrelated types for bad input
        if isinstance(error, ValueError) and "exceeds max_" in str(error):
            # msgpack's own limit check ("N exceeds max_array_len(M)"), before it allocates
            return ProtocolError(
                "container_too_large", f"frame holds a list or map over the limit: {error}"
            )
        return ProtocolError("malformed", f"frame is not valid msgpack: {error}")
    if not isinstance(message, dict):
        return ProtocolError("malformed", f"a message is a map, got {type(message).__name__}")
    request_id = message.get("id")
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, int)):
        return ProtocolError("malformed", "'id' must be an integer")
    return message
