"""``tickwheel job update`` keeps what it is not told to change, and bad or empty input to
``submit`` and ``job update`` is a usage error (status 2): the real CLI against a real node."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster import commands
from cluster.cli import build_parser
from tests.cluster.procs import NodeProc, clean_failure, cli, job, ok

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    root = tmp_path_factory.mktemp("cli_update")
    proc = NodeProc(root / "data", root / "node.log")
    yield proc
    proc.kill()


def submit_file(node: NodeProc, tmp_path: Path, *specs: dict[str, Any]) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    ok(cli(node, "submit", "--file", str(path)))


def test_the_tours_update_of_the_cron_expression_keeps_the_zone(node: NodeProc) -> None:
    ok(
        cli(
            node,
            "submit",
            "--id",
            "nightly",
            "--cron",
            "0 3 * * *",
            "--tz",
            "Europe/Berlin",
            "--shell",
            "backup.sh",
        )
    )
    done = ok(cli(node, "job", "update", "nightly", "--cron", "30 3 * * *"))
    assert "kept from the current schedule: tz=Europe/Berlin" in done.stderr
    after = job(node, "nightly")
    assert after["spec"]["schedule"]["tz"] == "Europe/Berlin"
    assert after["spec"]["schedule"]["cron"] == "30 3 * * *"
    assert after["version"] == 2
    # 03:30 in Berlin is 01:30 or 02:30 UTC, never 03:30 (the UTC the update used to give)
    assert after["next_fire"][11:16] in ("01:30", "02:30"), after["next_fire"]


def test_a_new_cron_keeps_every_other_schedule_field_and_the_tasks_env(
    node: NodeProc, tmp_path: Path
) -> None:
    schedule = {
        "cron": "0 2 * * *",
        "tz": "America/New_York",
        "dst_gap": "skip",
        "dst_fold": "both",
        "jitter": "5m",
        "end": "2090-01-01T00:00:00Z",
    }
    task = {"shell": "old", "env": {"A": "1"}, "cwd": "/tmp"}
    submit_file(node, tmp_path, {"id": "keep-cron", "schedule": schedule, "task": task})
    ok(cli(node, "job", "update", "keep-cron", "--cron", "0 4 * * *", "--shell", "new"))
    spec = job(node, "keep-cron")["spec"]
    assert spec["schedule"] == {**schedule, "cron": "0 4 * * *"}
    assert spec["task"] == {**task, "shell": "new"}
    # --tz alone: the job's own expression in another zone
    ok(cli(node, "job", "update", "keep-cron", "--tz", "Asia/Tokyo"))
    spec = job(node, "keep-cron")["spec"]
    assert spec["schedule"] == {**schedule, "cron": "0 4 * * *", "tz": "Asia/Tokyo"}


def test_a_new_every_keeps_start_end_and_jitter(node: NodeProc, tmp_path: Path) -> None:
    schedule = {
        "every": "1h",
        "start": "2030-01-01T00:00:00Z",
        "end": "2090-01-01T00:00:00Z",
        "jitter": "1m",
    }
    submit_file(node, tmp_path, {"id": "keep-every", "schedule": schedule, "task": {"shell": "x"}})
    ok(cli(node, "job", "update", "keep-every", "--every", "2h"))
    assert job(node, "keep-every")["spec"]["schedule"] == {**schedule, "every": "2h"}
    # --tz on a schedule that is not cron: refused, nothing changed
    done = cli(node, "job", "update", "keep-every", "--tz", "Europe/Berlin")
    assert "--tz applies to cron schedules only" in clean_failure(done, 2)
    assert job(node, "keep-every")["version"] == 2


def test_a_new_kind_keeps_what_it_accepts_and_names_what_it_drops(
    node: NodeProc, tmp_path: Path
) -> None:
    schedule = {
        "cron": "0 2 * * *",
        "tz": "Europe/Berlin",
        "dst_fold": "last",
        "jitter": "5m",
        "end": "2090-01-01T00:00:00Z",
    }
    submit_file(node, tmp_path, {"id": "kind", "schedule": schedule, "task": {"shell": "x"}})
    done = ok(cli(node, "job", "update", "kind", "--every", "1h", "--json"))
    assert json.loads(done.stdout)["version"] == 2  # the notes stay out of the JSON
    assert "kept from the current schedule: end=2090-01-01T00:00:00Z, jitter=5m" in done.stderr
    assert "dropped (every schedules have no such field): tz=Europe/Berlin, dst_fold=last" in (
        done.stderr
    )
    after = job(node, "kind")["spec"]["schedule"]
    assert set(after) == {"every", "start", "end", "jitter"}
    assert (after["every"], after["end"], after["jitter"]) == ("1h", schedule["end"], "5m")
    # a kept field the new schedule conflicts with: the node's error says where it came from
    done = cli(node, "job", "update", "kind", "--at", "2095-01-01T00:00:00Z")
    assert "schedule.end" in clean_failure(done)
    assert "(end was kept from the job's current schedule)" in done.stderr


def test_bad_or_empty_input_is_a_usage_error(node: NodeProc, tmp_path: Path) -> None:
    ok(cli(node, "submit", "--id", "plain", "--every", "1h", "--shell", "x"))
    done = cli(node, "job", "update", "plain")
    assert "nothing to change" in clean_failure(done, 2)
    assert job(node, "plain")["version"] == 1  # no new version, no skipped fire times
    for args in (
        ("submit", "--id", "empty-tz", "--cron", "0 3 * * *", "--tz", "", "--shell", "x"),
        ("job", "update", "plain", "--cron", "0 3 * * *", "--tz", ""),
    ):
        assert "--tz is empty" in clean_failure(cli(node, *args), 2)
    assert "not_found" in clean_failure(cli(node, "job", "get", "empty-tz"))

    path = tmp_path / "one.jsonl"
    path.write_text(
        json.dumps({"id": "from-file", "schedule": {"every": "1h"}, "task": {"shell": "x"}})
    )
    done = cli(node, "submit", "--file", str(path), "--id", "other", "--tier", "t", "--every", "1s")
    assert "--id, --every, --tier would be ignored" in clean_failure(done, 2)
    assert "not_found" in clean_failure(cli(node, "job", "get", "from-file"))

    ended = {"id": "ended", "schedule": {"every": "1m", "end": "2020-01-01T00:00:00Z"}}
    path.write_text(
        json.dumps({"id": "fine", "schedule": {"every": "1h"}, "task": {"shell": "x"}})
        + "\n\n"
        + json.dumps({**ended, "task": {"shell": "x"}})
        + "\n"
    )
    done = cli(node, "submit", "--file", str(path))
    assert f"{path}:3: schedule.end 2020-01-01T00:00:00Z is already past" in clean_failure(done, 2)
    for job_id in ("fine", "ended"):  # nothing was sent
        assert "not_found" in clean_failure(cli(node, "job", "get", job_id))


def test_an_update_made_from_a_read_job_asks_for_that_version() -> None:
    """The CLI completes a schedule change from the job as it read it, and sends the update
    with ``if_version`` of that read: another update landing between the two is not
    overwritten, the node answers ``conflict`` (a stand-in client: the interleaving cannot be
    forced through a real node)."""
    from cluster.client import RemoteError

    asked: list[int | None] = []

    class Racing:
        async def get(self, job_id: str) -> dict[str, Any]:
            return {"job_id": job_id, "version": 4, "spec": {"schedule": {"cron": "0 3 * * *"}}}

        async def update(
            self, job_id: str, changes: dict[str, Any], *, if_version: int | None = None
        ) -> dict[str, Any]:
            asked.append(if_version)
            raise RemoteError("conflict", f"job {job_id!r} is at version 5, not 4", "if_version")

    args: argparse.Namespace = build_parser().parse_args(
        ["job", "update", "raced", "--cron", "0 4 * * *"]
    )
    with pytest.raises(RemoteError, match="run the command again") as caught:
        trio.run(commands._update, Racing(), args)  # type: ignore[arg-type]
    assert caught.value.code == "conflict" and asked == [4]
