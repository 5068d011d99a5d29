"""The node benchmarks (`tickwheel bench submit|lateness|dispatch`) run end to end at a tiny
size against a real node process and print the shared JSON shape. Figures are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def bench(suite: str, jobs: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", suite, "--jobs", str(jobs), "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    data: dict[str, Any] = json.loads(out)
    assert data["suite"] == suite and data["machine"]["cores"]
    for m in data["metrics"]:
        assert {"name", "value", "unit"} <= set(m) and m["value"] >= 0, m
    return data


def test_submit_suite_json_shape() -> None:
    data = bench("submit", 200)
    metrics = data["metrics"]
    assert {m["name"] for m in metrics} == {"submits_per_s"}
    modes = sorted((m["mode"], m.get("via", "")) for m in metrics)
    assert modes == [
        ("conns64", ""),
        ("pipelined", "create"),
        ("pipelined", "create_many"),
        ("single", ""),
    ]
    for m in metrics:
        assert m["unit"] == "jobs/s" and m["value"] > 0 and m["jobs"] > 0 and m["target"] > 0
    single = next(m for m in metrics if m["mode"] == "single")
    # The disk's own floor is measured in the same run, beside the single mode.
    assert single["anchor"].startswith("fdatasync") and single["anchor_value"] > 0
    assert single["ratio"] == round(single["value"] / single["anchor_value"], 3)
    assert single["quoted_redis_per_s"] == 1500
    # So is the floor of any one-at-a-time durable submit: a bare loopback echo with a sync.
    assert single["floor_per_s"] > 0
    conns = next(m for m in metrics if m["mode"] == "conns64")
    assert conns["connections"] == 64
    # Its floor too: a bare Trio echo over as many connections, measured in the same run.
    assert conns["floor_per_s"] > 0 and conns["floor_cpu_us_per_round_trip"] > 0


def test_lateness_suite_json_shape() -> None:
    data = bench("lateness", 200)
    metrics = data["metrics"]
    names = sorted((m["name"], m["at"]) for m in metrics)
    assert names == [
        ("lateness_max_ms", "dispatch received"),
        ("lateness_p50_ms", "dispatch received"),
        ("lateness_p50_ms", "payload handler called"),
        ("lateness_p99_ms", "dispatch received"),
        ("lateness_p99_ms", "payload handler called"),
    ]
    for m in metrics:
        assert m["unit"] == "ms" and m["fires_per_s"] == 200 and m["seconds"] == 1
        assert m["runs"] == m["expected"] == 200
    by = {(m["name"], m["at"]): m["value"] for m in metrics}
    received = "dispatch received"
    assert by[("lateness_p50_ms", received)] <= by[("lateness_p99_ms", received)]
    assert by[("lateness_p99_ms", received)] <= by[("lateness_max_ms", received)]


def test_dispatch_suite_json_shape() -> None:
    data = bench("dispatch", 200)
    assert {m["name"] for m in data["metrics"]} == {"executions_per_s", "preload_jobs_per_s"}
    runs = [m for m in data["metrics"] if m["name"] == "executions_per_s"]
    assert [m["slots"] for m in runs] == [32, 128]  # one measurement per slots setting
    for ex in runs:
        assert ex["unit"] == "runs/s" and ex["value"] > 0 and ex["target"] == 10_000
        assert ex["jobs"] == ex["completed"] == 200
        assert ex["in_flight"] == ex["workers"] * ex["slots"]
        # Every sampled run was read back SUCCESS from the node.
        assert ex["sampled"] == ex["sampled_success"] == 200
