"""``run.get`` says why a due run waits (a real node process on 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from cluster.client import Client
from tests.cluster.procs import NodeProc
from tests.cluster.test_node_processes import in_s


def test_a_run_of_a_tier_no_worker_serves_says_so(tmp_path: Path) -> None:
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", shards=2)
    try:

        async def main() -> dict[str, Any]:
            async with Client.connect("127.0.0.1", node.port) as client:
                spec = {"id": "g", "schedule": in_s(0.2), "tier": "gpu", "task": {"payload": 1}}
                await client.create(spec)
                with trio.fail_after(20):
                    while not (runs := await client.history("g", last=1)):
                        await trio.sleep(0.05)
                return await client.run(runs[0]["run_id"])

        run = trio.run(main)
        assert run["state"] == "PENDING" and run["waiting"] == "no worker serves tier 'gpu'"
        shown = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "run", run["run_id"]],
            env={"TICKWHEEL_CONNECT": f"127.0.0.1:{node.port}", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0 and "no worker serves tier 'gpu'" in shown.stdout
    finally:
        node.terminate()
