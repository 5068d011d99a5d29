"""Crash safety (issue 5): a process committing heavily through group commit is SIGKILLed at
random moments, round after round on the same directory, and after each kill the directory is
reopened and recovered (RocksDB's log replayed, then :meth:`ShardStore.load`: the snapshot and
the log tail after it, as a node's restart reads them) and checked before anything more is
written: every batch the killed process acknowledged is there, and no batch is half-applied.

The reopen after round r is round r+1's own process (see :mod:`tests.wal.crash_child`): it
checks, then commits; the test reopens after the last kill itself."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.wal.crash_child import (
    IDS_PER_ROUND,
    Verified,
    check_round,
    epoch_of,
    read_state,
    write_state,
)
from wal.store import ShardStore

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

    def kill_round(self, path: Path, r: int, state: Path | None, delay: float) -> set[int]:
        """Fork round ``r``'s committer (which first checks round ``r - 1`` from ``state``,
        unless None), SIGKILL it ``delay`` seconds after it starts committing, and return the
        batch ids it reported acknowledged."""
        assert self.proc.stdin is not None
        arg = "-" if state is None else str(state)
        self.proc.stdin.write(
            f"{path} {epoch_of(r)} {r * IDS_PER_ROUND} {PRODUCERS} {arg}\n".encode()
        )
        self.proc.stdin.flush()
        pid = int(self.line().split()[1])
        if state is not None:
            checked = self.line()
            if checked != b"checked\n":
                self.line()  # the server's "done": the child is gone
                raise AssertionError(f"after round {r - 1}'s kill: {checked.decode().strip()}")
        ready = self.line()
        assert ready == b"ready\n", f"round {r}: the child did not open the store: {ready!r}"
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


@pytest.mark.slow
@pytest.mark.timeout(120)  # ~5 s here; a hung fork server must not hold the suite for 300 s
def test_sigkill_loses_no_acknowledged_batch_and_tears_none(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    data = tmp_path / "shard"
    state = tmp_path / "verified.json"
    rounds_with_acks = 0
    server = ForkServer()
    try:
        for r in range(ROUNDS):
            acked = server.kill_round(data, r, state if r else None, rng.uniform(0.0, 0.2))
            rounds_with_acks += bool(acked)
            # For the next round's process, which checks this one right after its reopen.
            seen = read_state(str(state)) if r else Verified()
            seen.acked = sorted(acked)
            write_state(str(state), seen)
    finally:
        server.close()
    assert rounds_with_acks >= ROUNDS // 2, "the kills should land during heavy committing"
    # The last kill's reopen, here; and everything checked at once: every family's size, the
    # jobs against every id logged.
    seen = read_state(str(state))
    with ShardStore.open(data, shard=0, shards=1, epoch=epoch_of(ROUNDS)) as store:
        check_round(store, ROUNDS - 1, seen, everything=True)
    # (a bound a slow disk still passes: 20 ms fsyncs still commit a few groups of 16 a round;
    # rounds_with_acks above already shows the kills landed mid-commit)
    assert seen.batches >= ROUNDS * PRODUCERS, "the rounds should commit heavily"
