"""What the node says of jobs and runs that wait (a real node process on 127.0.0.1): why a due
run is not taken (``run.get``'s ``waiting``), and a paused or cancelled job's preview."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.client import Client, RemoteError
from tests.cluster.procs import NodeProc, in_s


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
                # run.history says it too (found by the fifth adversarial pass: only run.get
                # did, so `tickwheel runs`, the command people type first, showed no why).
                with trio.fail_after(20):
                    while (await client.history("g", last=1))[0].get("waiting") is None:
                        await trio.sleep(0.05)
                return await client.run(runs[0]["run_id"])

        run = trio.run(main)
        assert run["state"] == "PENDING" and run["waiting"] == "no worker serves tier 'gpu'"
        for argv in (["run", run["run_id"]], ["runs", "g"]):
            shown = subprocess.run(
                [sys.executable, "-m", "cluster.cli", *argv],
                env={"TICKWHEEL_CONNECT": f"127.0.0.1:{node.port}", "PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert shown.returncode == 0 and "no worker serves tier 'gpu'" in shown.stdout, argv
    finally:
        node.terminate()


def test_preview_of_a_cancelled_job_is_not_found_and_of_a_paused_one_says_so(
    tmp_path: Path,
) -> None:
    """As job.get (found by the fourth adversarial pass: a cancelled job's preview answered,
    and a paused job's listed fires as if it ran)."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", shards=2)
    try:

        async def main() -> None:
            async with Client.connect("127.0.0.1", node.port) as client:
                for job_id in ("p", "c"):
                    await client.create(
                        {"id": job_id, "schedule": {"every": "1h"}, "task": {"payload": 1}}
                    )
                assert (await client.preview(job_id="p", count=2))["paused"] is False
                await client.pause("p")
                assert (await client.preview(job_id="p", count=2))["paused"] is True
                await client.cancel("c")
                with pytest.raises(RemoteError) as gone:
                    await client.preview(job_id="c", count=2)
                assert gone.value.code == "not_found"

        trio.run(main)
        shown = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "job", "preview", "p"],
            env={"TICKWHEEL_CONNECT": f"127.0.0.1:{node.port}", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0 and "paused" in shown.stdout, shown
    finally:
        node.terminate()


def test_skipped_fire_times_are_shown_with_their_reason(tmp_path: Path) -> None:
    """Found by the fourth adversarial pass: no operation showed skip records, so a user
    could not learn why a fire time did not run."""
    node = NodeProc(tmp_path / "data", tmp_path / "node.log", shards=2)
    try:

        async def main() -> list[dict[str, Any]]:
            async with Client.connect("127.0.0.1", node.port) as client:
                spec = {
                    "id": "e",
                    "schedule": {"every": "500ms"},
                    "catchup": "skip",
                    "task": {"payload": 1},
                }
                await client.create(spec)
                await client.pause("e")
                await trio.sleep(1.6)
                await client.resume("e")
                with trio.fail_after(20):
                    while not (skips := await client.skips("e")):
                        await trio.sleep(0.05)
                with pytest.raises(RemoteError) as unknown:
                    await client.skips("nobody")
                assert unknown.value.code == "not_found"
                return skips

        skips = trio.run(main)
        assert skips[0]["reason"] == "paused" and skips[0]["from_ms"] <= skips[0]["to_ms"]
        shown = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "skips", "e", "--json"],
            env={"TICKWHEEL_CONNECT": f"127.0.0.1:{node.port}", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown
        assert json.loads(shown.stdout)[0]["reason"] == "paused"
    finally:
        node.terminate()
