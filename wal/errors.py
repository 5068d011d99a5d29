"""The store's exceptions, in one place.

Split like h11's errors. :class:`StoreUsageError` means the caller called the store wrong (a
batch that cannot be encoded, a shard count other than the data directory's, a closed store):
nothing was written, and retrying the same call fails the same way. :class:`StoreFailure` means
the disk or another owner misbehaved (no space, a read-only or corrupt directory, the directory
locked by another process, a newer epoch recorded by another owner): nothing was acknowledged
that is not durable, and the store may refuse further writes until it is reopened.

Every error carries a stable ``code`` (what drivers put on the wire), the data directory it is
about (``path``), and a message that says what failed and where. Must never decide what to do
about a failure: that is the driver's (retry, give up the shard, alert).
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.errors import StaleEpoch as EngineStaleEpoch
from wal import codec


class StoreError(Exception):
    """Root of every exception raised by ``wal``."""

    code: ClassVar[str] = "store_error"

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return f"{self.message} [{self.path}]" if self.path else self.message


# ------------------------------------------------------------------------- called wrong


class StoreUsageError(StoreError, ValueError):
    """The caller passed something invalid or used the store wrong; nothing was written."""

    code = "store_usage"


class StoreClosed(StoreUsageError):
    """The store (or the group committer) was closed before or during this call."""

    code = "store_closed"


class ShardCountMismatch(StoreUsageError):
    """The data directory was created for another number of shards (fixed at creation)."""

    code = "shard_count"


class ShardMismatch(StoreUsageError):
    """The directory holds another shard than the one the caller asked to open."""

    code = "shard_mismatch"


class InvalidBatch(StoreUsageError):
    """A batch or one of its records cannot be stored (not a record, not msgpack-able)."""

    code = "invalid_batch"


class EpochAhead(StoreUsageError):
    """A batch stamped with an epoch newer than the one the store was opened with: the
    caller mixed up two owners' engines; storing it would break the epoch fence."""

    code = "epoch_ahead"


class InvalidSnapshot(StoreUsageError):
    """A snapshot that cannot be stored: an object array, a log position the store never
    handed out, or one older than the newest stored snapshot."""

    code = "invalid_snapshot"


# ------------------------------------------------------------------------- disk or peer


class StoreFailure(StoreError):
    """The disk, or another owner of the shard, misbehaved. Nothing unacknowledged is assumed
    durable and nothing acknowledged was lost; after a failed write the store refuses further
    writes (RocksDB stops writing after an I/O error) until it is reopened."""

    code = "store_failure"


class StoreLocked(StoreFailure):
    """Another process (or another store object in this one) holds the directory's RocksDB
    ``LOCK``: a second owner of the same shard."""

    code = "store_locked"


class StaleEpoch(StoreFailure, EngineStaleEpoch):
    """A newer owner recorded an epoch at or above this one (on open), or a batch stamped with
    an epoch older than the store's (on write): this owner has been fenced off. Also an
    :class:`engine.errors.StaleEpoch`, so a driver can handle both alike."""

    code = "stale_epoch"

    def __init__(self, message: str, *, path: str | None = None) -> None:
        StoreFailure.__init__(self, message, path=path)
        self.field = "epoch"

    def __str__(self) -> str:
        return StoreFailure.__str__(self)


class DiskFull(StoreFailure):
    """No space left on the device, or a file size limit reached (ENOSPC, EFBIG, EDQUOT)."""

    code = "disk_full"


class ReadOnly(StoreFailure):
    """The directory or the file system cannot be written (EACCES, EPERM, EROFS)."""

    code = "read_only"


class Corrupt(StoreFailure):
    """A file of the store failed its checksum or cannot be parsed (SST, MANIFEST, CURRENT,
    the write-ahead log other than a torn tail, or a value this version cannot decode)."""

    code = "corrupt"


class StoreIOError(StoreFailure):
    """Any other I/O error RocksDB reported."""

    code = "store_io"


# RocksDB reports errors as text (rocksdict raises a bare ``Exception``); these fragments name
# the cause. Ordered: the first match wins, so the more specific come first.
_PATTERNS: tuple[tuple[tuple[str, ...], type[StoreFailure]], ...] = (
    (("Read-only file system", "Permission denied", "Operation not permitted"), ReadOnly),
    (("lock hold by", "While lock file"), StoreLocked),
    (("No space left", "File too large", "Disk quota exceeded", "NoSpace"), DiskFull),
    (("Corruption", "corrupt", "checksum mismatch"), Corrupt),
    # A failing device names the file it failed on: an EIO on the MANIFEST is the disk's
    # trouble, not a corrupt store (found by review).
    (("Input/output error",), StoreIOError),
    (("MANIFEST-", "CURRENT"), Corrupt),
)


def translate(exc: BaseException, *, path: str, doing: str) -> StoreFailure:
    """The typed failure for an exception RocksDB raised while ``doing`` something at ``path``.

    Classifies by RocksDB's status text (rocksdict exposes no error codes); anything
    unrecognised becomes :class:`StoreIOError`. O(len(message)).
    """
    if isinstance(exc, StoreFailure):
        return exc
    text = str(exc)
    for fragments, cls in _PATTERNS:
        if any(f in text for f in fragments):
            return cls(f"{doing}: {text}", path=path)
    return StoreIOError(f"{doing}: {text}", path=path)


def decoded(raw: bytes, *, path: str, what: str) -> Any:
    """The msgpack value of a stored ``raw`` (``what``: which value, for the message); one
    that cannot be decoded is :class:`Corrupt`, not the codec's own exception (which the
    drivers would take for a bug of theirs, not the disk's)."""
    try:
        return codec.unpack(raw)
    except Exception as exc:
        raise Corrupt(
            f"{what} cannot be decoded ({type(exc).__name__}: {exc})", path=path
        ) from None


def check_i64(**values: int | None) -> None:
    """Keys and times that fit the store's signed 64-bit keys (None: not given), or
    :class:`StoreUsageError` (not the key codec's ``struct.error``)."""
    for name, value in values.items():
        if value is not None and not codec.I64_MIN <= value <= codec.I64_MAX:
            raise StoreUsageError(f"{name} {value} is outside the signed 64-bit range")
