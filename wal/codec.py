"""How the store spells keys and values: big-endian integers and msgpack.

Owns the byte layout of every key, so that RocksDB's byte order is numeric order: unsigned
integers as 8 (or 4) big-endian bytes, signed ones offset by 2**63 first (so -1 sorts before 0).
Values are msgpack. Must never know what a record means; :mod:`wal.store` routes records.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgpack

_U64: Final = struct.Struct(">Q")
_U32: Final = struct.Struct(">I")
_I64_OFFSET: Final = 1 << 63
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1

#: The smallest and one past the largest 8-byte key part: range ends for whole prefixes.
LOW8: Final = b"\x00" * 8
HIGH8: Final = b"\xff" * 8
#: above every key of the job-keyed families (runs, history, logs): longer than any, all ones
PAST_EVERY_KEY: Final = b"\xff" * 64


def job_bound(key: int, at: int) -> bytes:
    """The smallest key of job ``key`` at time ``at`` in the job-keyed families (runs,
    history, logs: job key then time); ``at = 2**63`` gives the first key past the job (so
    ``[job_bound(k, lo), job_bound(k, 2**63))`` is all of the job from ``lo``)."""
    if at > I64_MAX:
        if key == I64_MAX:
            return PAST_EVERY_KEY  # (key + 1 does not fit: found by review)
        return i64(key + 1) + LOW8
    return i64(key) + i64(at)


def u64(value: int) -> bytes:
    """8 big-endian bytes of ``0 <= value < 2**64``."""
    return _U64.pack(value)


def u32(value: int) -> bytes:
    """4 big-endian bytes of ``0 <= value < 2**32``."""
    return _U32.pack(value)


def i64(value: int) -> bytes:
    """8 bytes of a signed 64-bit ``value`` that sort as the numbers do."""
    return _U64.pack(value + _I64_OFFSET)


def read_u64(data: bytes, offset: int = 0) -> int:
    value: int = _U64.unpack_from(data, offset)[0]
    return value


def read_u32(data: bytes, offset: int = 0) -> int:
    value: int = _U32.unpack_from(data, offset)[0]
    return value


def read_i64(data: bytes, offset: int = 0) -> int:
    value: int = _U64.unpack_from(data, offset)[0]
    return value - _I64_OFFSET


def pack(value: Any) -> bytes:
    """msgpack bytes of ``value`` (bin type for bytes, str for str)."""
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


def unpack(data: bytes) -> Any:
    """The value of msgpack ``data``; maps stay dicts, arrays become lists, map keys may be
    ints (``strict_map_key=False``: history keys, counters)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
