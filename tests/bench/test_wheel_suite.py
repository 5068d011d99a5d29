"""`tickwheel bench wheel` runs end to end (each structure in its own process) and prints the
shared JSON shape, with every anchor beside the wheel's figure."""

from __future__ import annotations

import json
import subprocess
import sys


def test_wheel_suite_json_shape() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "wheel", "--pending", "20000", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    data = json.loads(out)
    assert data["suite"] == "wheel"
    assert {"cpu", "cores", "python", "numpy"} <= set(data["machine"])
    # The host's speed as the suite ended, beside the figures (bench.common.host_probe_ns).
    probe = data["machine"]["python_probe_ns"]
    assert isinstance(probe, int | float) and 10 < probe < 10_000_000
    by_name: dict[str, list[dict[str, object]]] = {}
    for metric in data["metrics"]:
        assert {"name", "value", "unit", "pending"} <= set(metric)
        assert metric["pending"] == 20000
        by_name.setdefault(str(metric["name"]), []).append(metric)
    assert set(by_name) == {
        "schedule_per_s",
        "fire_per_s",
        "cancel_per_s",
        "resident_bytes_per_pending",
        "allocated_bytes_per_pending",
    }
    anchors = {m["anchor"] for m in by_name["fire_per_s"]}
    assert anchors == {"heapq.heappop", "SortedList.pop"}
    for metric in data["metrics"]:
        if "anchor" in metric:
            assert metric["ratio"] == round(metric["value"] / metric["anchor_value"], 3)
    fired = {m["fired"] for m in by_name["fire_per_s"]}
    assert all(isinstance(f, int) and f > 0 for f in fired)
