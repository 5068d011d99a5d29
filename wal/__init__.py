"""Durable storage of one shard (RocksDB through rocksdict): record batches, group commit,
snapshots and the log tail for recovery, retention and run logs.

Imports ``engine``, the standard library, numpy, msgpack and rocksdict only; never decides what
a record means for the schedule — the engine does, on recovery, from what the store hands back.
"""

from engine import refuse_stale_compiled

refuse_stale_compiled(__file__)
