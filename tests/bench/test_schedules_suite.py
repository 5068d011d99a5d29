"""``tickwheel bench schedules`` runs end to end as a real subprocess and prints well-formed JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.schedules_suite import ZONES, cron_expressions
from engine.schedules import parse_schedule

ROOT = Path(__file__).resolve().parents[2]


def test_expressions_are_distinct_valid_and_varied() -> None:
    exprs = cron_expressions()
    assert len(exprs) == len(set(exprs)) == 1000
    assert exprs == cron_expressions()  # deterministic
    joined = " ".join(exprs)
    for form in ("L ", "LW ", "#", "*/", "1-5"):
        assert form in joined
    assert any(len(e.split()) == 6 for e in exprs)
    for expr in exprs[:50]:
        for tz in ZONES:
            parse_schedule({"cron": expr, "tz": tz})


def test_cli_json_shape() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "schedules", "--jobs", "3000", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    data: dict[str, Any] = json.loads(lines[0])
    assert data["suite"] == "schedules"
    assert {"cpu", "cores", "python", "numpy"} <= set(data["machine"])
    metrics = data["metrics"]
    names = {m["name"] for m in metrics}
    assert names == {"parse_per_s", "cron_next_fire_per_s", "cron_next_fire_total_s"}
    for m in metrics:
        assert isinstance(m["name"], str) and isinstance(m["unit"], str)
        assert isinstance(m["value"], int | float) and m["value"] > 0
        assert m["jobs"] == 3000 and m["expressions"] == 1000 and m["zones"] == 3
        if "anchor" in m:
            assert isinstance(m["anchor"], str)
            assert isinstance(m["anchor_value"], int | float) and m["anchor_value"] > 0
            exact = m["value"] / m["anchor_value"]  # both rounded to 3 decimals in JSON
            assert abs(m["ratio"] - exact) <= 0.01 * max(1.0, exact)
    modes = {m.get("mode") for m in metrics if m["name"] == "cron_next_fire_per_s"}
    assert modes == {"cached-cold", "cached-warm", "uncached-cold", "uncached-warm"}
    cached = [m for m in metrics if m["name"] == "cron_next_fire_per_s" and "anchor" in m]
    assert {m["anchor"] for m in cached} == {"uncached"}
