"""Crash safety: a process committing heavily through group commit is SIGKILLed at random
moments, round after round on the same directory; after each kill the next round reopens it
(a recovery), and at the end every acknowledged batch is there and no batch is half-applied."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.wal.crash_child import T0
from wal.store import ShardStore, StoredJob

ROUNDS = 20
PRODUCERS = 16


class ForkServer:
    """The crash child's fork server (see :mod:`tests.wal.crash_child`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.wal.crash_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def line(self) -> bytes:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        if not out:
            raise AssertionError("the crash child's fork server died")
        return out

    def kill_round(self, path: Path, epoch: int, first: int, delay: float) -> set[int]:
        """Fork one committing child, SIGKILL it ``delay`` seconds after its store is open,
        and return the batch ids it reported acknowledged."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{path} {epoch} {first} {PRODUCERS}\n".encode())
        self.proc.stdin.flush()
        pid = int(self.line().split()[1])
        ready = self.line()
        assert ready == b"ready\n", f"round {epoch}: the child did not open the store: {ready!r}"
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        acked: set[int] = set()
        while (line := self.line()) != b"done\n":
            acked.add(int(line))
        return acked

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def all_jobs(store: ShardStore) -> list[StoredJob]:
    out: list[StoredJob] = []
    after = None
    while page := store.jobs(after=after, limit=5000):
        out.extend(page)
        after = page[-1].key
    return out


@pytest.mark.slow
def test_sigkill_loses_no_acknowledged_batch_and_tears_none(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    acked: set[int] = set()
    rounds_with_acks = 0
    server = ForkServer()
    try:
        for r in range(ROUNDS):
            got = server.kill_round(tmp_path, r + 1, r * 1_000_000, rng.uniform(0.0, 0.2))
            rounds_with_acks += bool(got)
            acked |= got
    finally:
        server.close()
    assert rounds_with_acks >= ROUNDS // 2, "the kills should land during heavy committing"

    with ShardStore.open(tmp_path, shard=0, shards=1, epoch=ROUNDS + 1) as store:
        logged: dict[int, list[dict[str, object]]] = {}
        epochs: dict[int, int] = {}
        for _seq, batch_id, epoch, records in store.log_batches():
            assert batch_id not in logged
            logged[batch_id] = records
            epochs[batch_id] = epoch
        missing = acked - set(logged)
        assert not missing, f"{len(missing)} acknowledged batches lost, e.g. {sorted(missing)[:5]}"
        for i, records in logged.items():
            # whole in the log ...
            assert [r["t"] for r in records] == ["job", "pos", "run", "skip", "note"], i
            assert epochs[i] == i // 1_000_000 + 1
            # ... and whole in every family it was routed to
            assert store.key_of(f"c{i}") == i
            job = store.job_by_key(i)
            assert job is not None and job.position is not None and job.position["next"] == T0 + i
            run = store.run(i, T0 + i)
            assert run is not None and run["state"] == "PENDING"
            assert sorted(h["t"] for h in store.history(i)) == ["note", "skip"]
            assert store.run_count(i) == 1
        # nothing routed without its log entry
        jobs = all_jobs(store)
        assert {j.key for j in jobs} == set(logged)
        counts = store.counts
        assert counts.jobs == counts.pending_jobs == counts.runs_pending == len(logged)
