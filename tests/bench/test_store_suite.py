"""`tickwheel bench store` runs end to end at a tiny size and prints the shared JSON shape,
every durability figure beside its fdatasync anchor, recovery in both scopes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_store_suite_json_shape() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "store",
            "--pending",
            "3000",
            "--jobs",
            "64",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    data = json.loads(out)
    assert data["suite"] == "store" and data["machine"]["cores"]
    by_name: dict[str, list[dict[str, object]]] = {}
    for metric in data["metrics"]:
        assert {"name", "value", "unit"} <= set(metric)
        assert isinstance(metric["value"], int | float) and metric["value"] > 0
        by_name.setdefault(str(metric["name"]), []).append(metric)
    assert set(by_name) == {
        "durable_records_per_s",
        "recovery_pending_per_s",
        "disk_bytes_per_pending",
        "store_cpu_us_per_record",
    }
    (cpu,) = by_name["store_cpu_us_per_record"]
    parts = cpu["make_us"] + cpu["prepare_us"] + cpu["write_us"]  # type: ignore[operator]
    assert abs(parts - cpu["value"]) < 0.05  # type: ignore[operator]
    ceiling = 1e6 / cpu["value"]  # type: ignore[operator]
    assert abs(cpu["ceiling_records_per_s"] - ceiling) <= ceiling * 1e-3  # (value is rounded)
    durable = by_name["durable_records_per_s"]
    assert {(m["producers"], m["driver"]) for m in durable} >= {
        (1, "threads"),
        (16, "threads"),
        (256, "threads"),
    }
    for m in durable:
        assert m["anchor"] == "write+fdatasync loop"
        # (the ratio is of the figures before they were rounded to three places: equal to
        # the rounded figures' ratio within its own last place)
        assert abs(m["ratio"] - m["value"] / m["anchor_value"]) <= 1.5e-3  # type: ignore[operator]
    recovery = by_name["recovery_pending_per_s"]
    assert all(m["pending"] == 3000 for m in recovery)
    # Both scopes, once each: the store's (reopen + the snapshot into arrays) and the
    # engine's, the whole restart (that plus ShardEngine.recover from the snapshot, which
    # the suite checks holds every pending job): the recovery target is the latter,
    # and a suite that silently lost it (an engine that no longer takes snapshots back)
    # would report only the cheaper half.
    scopes = {str(m["scope"]): m for m in recovery}
    assert sorted(m["scope"] for m in recovery) == ["engine", "store"], recovery  # type: ignore[type-var]
    store, engine = scopes["store"], scopes["engine"]
    # timed from the same start, the engine's after the store's: never shorter, never faster
    assert engine["seconds"] >= store["seconds"] > 0, recovery  # type: ignore[operator]
    assert engine["value"] <= store["value"], recovery  # type: ignore[operator]
    assert {m["scope"] for m in by_name["disk_bytes_per_pending"]} == {
        "snapshot",
        "records+snapshot",
    }
