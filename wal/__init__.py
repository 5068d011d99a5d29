"""Durable storage of one shard (RocksDB through rocksdict): record batches, group commit,
recovery into an engine, retention and run logs. Imports ``engine`` only; never decides what a
record means — the engine does.
"""
