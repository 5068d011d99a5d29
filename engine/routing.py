"""Which shard a job lives on.

Owns the one function every node, client and tool must agree on: a job id's shard, from a
stable hash (never Python's per-process ``hash``). Must never depend on anything but the id and
the shard count, which is fixed when a data directory is created.
"""

from __future__ import annotations

import hashlib

from engine.errors import EngineUsageError
from engine.runs import parse_run_id


def shard_of(job_id: str, shards: int) -> int:
    """The shard (``0..shards-1``) of ``job_id``. O(len(job_id)); the same on every machine."""
    if shards < 1:
        raise EngineUsageError(f"shard count must be >= 1, got {shards}", field="shards")
    digest = hashlib.blake2b(job_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_of_run(run_id: str, shards: int) -> int:
    """The shard of a run id (``job_id@ms``): its job's. Raises :class:`EngineUsageError` for
    something that is not a run id."""
    job_id, _at = parse_run_id(run_id)
    return shard_of(job_id, shards)
