"""`tickwheel bench engine` runs end to end and prints the shared JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_suite_json_shape() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "engine",
            "--pending",
            "2000",
            "--jobs",
            "500",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    data = json.loads(out)
    assert data["suite"] == "engine" and data["machine"]["cores"]
    names = {m["name"] for m in data["metrics"]}
    assert names == {
        "create_per_s",
        "fires_per_s",
        "resident_bytes_per_pending",
        "load_pending_per_s",
    }
    fires = [m for m in data["metrics"] if m["name"] == "fires_per_s"]
    assert sorted(m["mode"] for m in fires) == ["burst", "steady"]
    for m in fires:
        assert m["pending"] == 2000 and m["anchor"] == "heapq poller"
        # (the ratio of the unrounded figures: within its last place of the rounded ones')
        assert m["value"] > 0 and abs(m["ratio"] - m["value"] / m["anchor_value"]) <= 1.5e-3
