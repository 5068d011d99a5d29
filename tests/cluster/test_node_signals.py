"""A second SIGTERM while the node closes (an impatient supervisor) waits for the close to
finish instead of killing the process half-way through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# A node whose close takes a second (as a big snapshot would), that says when it began.
CHILD = """
import sys, trio
from cluster.node import Node

class SlowClose(Node):
    async def _close(self):
        print("closing", flush=True)
        await trio.sleep(1.0)
        await super()._close()
        print("closed", flush=True)

async def main():
    node = SlowClose(sys.argv[1], shards=1)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(node.run)
        print("port", port, flush=True)

trio.run(main)
"""


def test_a_second_sigterm_during_the_close_does_not_cut_it_short(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("port")
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "closing"
        time.sleep(0.2)
        child.send_signal(signal.SIGTERM)  # mid-close
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0 and "closed" in out
    finally:
        if child.poll() is None:
            child.kill()
