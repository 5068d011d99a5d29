"""Tests of engine.jobs: defaults, valid forms and every kind of error per field, the to_dict
round trip, updates, policy interning and persistence, job ids, retry delays, and property tests
(valid specs round-trip; junk raises nothing but EngineUsageError)."""

from __future__ import annotations

import random
import zoneinfo
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import (
    EngineStateError,
    EngineUsageError,
    JobSpecError,
    PolicyRecordError,
    ScheduleError,
)
from engine.jobs import (
    JOB_KEYS,
    MAX_PAYLOAD_DEPTH,
    MAX_TASK_BYTES,
    JobSpec,
    Policy,
    PolicyTable,
    _packed_size,
    apply_update,
    new_job_id,
    parse_policy,
    retry_delay_ms,
    stored_policy,
    validate_job,
    validate_job_id,
)
from engine.schedules import format_duration, format_utc, parse_duration, parse_schedule

NOW = 1_767_225_600_000  # 2026-01-01T00:00:00Z
BASE: dict[str, Any] = {
    "id": "job-1",
    "schedule": {"cron": "*/5 * * * *"},
    "task": {"command": ["echo", "hi"]},
}
DROP = object()  # marks a key to delete from BASE


def spec(**changes: Any) -> dict[str, Any]:
    out = dict(BASE)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def job(**changes: Any) -> JobSpec:
    return validate_job(spec(**changes), now_ms=NOW)


def task(t: dict[str, Any]) -> dict[str, object]:
    return job(task=t).task


# ------------------------------------------------------------------------------------------
# Defaults and valid forms


def test_defaults() -> None:
    s = job()
    assert s.id == "job-1"
    assert s.schedule == parse_schedule({"cron": "*/5 * * * *"})
    assert s.task == {"command": ["echo", "hi"]}
    assert s.task_kind == "command"
    assert s.policy == Policy()
    assert (s.after, s.paused, s.labels, s.replace) == ((), False, (), False)
    p = s.policy
    assert (p.tier, p.delivery, p.timeout_ms, p.on_timeout) == (
        "default",
        "at_least_once",
        None,
        "kill",
    )
    assert (p.retries_max, p.retry_backoff_ms, p.retry_factor, p.retry_max_backoff_ms) == (
        0,
        10_000,
        2.0,
        3_600_000,
    )
    assert (p.catchup, p.catchup_window_ms, p.max_catchup, p.overlap) == (
        "latest",
        86_400_000,
        100,
        "allow",
    )
    assert s.to_dict() == {
        "id": "job-1",
        "schedule": {"cron": "*/5 * * * *", "tz": "UTC", "dst_gap": "shift", "dst_fold": "first"},
        "task": {"command": ["echo", "hi"]},
        "tier": "default",
        "timeout": None,
        "on_timeout": "kill",
        "delivery": "at_least_once",
        "retries": {"max": 0, "backoff": "10s", "factor": 2.0, "max_backoff": "1h"},
        "catchup": "latest",
        "catchup_window": "1d",
        "max_catchup": 100,
        "overlap": "allow",
        "after": [],
        "paused": False,
        "labels": {},
        "replace": False,
    }
    assert list(s.to_dict()) == list(JOB_KEYS)


def test_task_kinds_normalized() -> None:
    assert task({"command": ("ls", "-l", ""), "env": {"A": "1"}, "cwd": "/tmp"}) == {
        "command": ["ls", "-l", ""],
        "env": {"A": "1"},
        "cwd": "/tmp",
    }
    assert task({"shell": "echo $HOME", "env": {}}) == {"shell": "echo $HOME"}
    assert task({"container": {"image": "alpine:3.20"}}) == {
        "container": {"image": "alpine:3.20", "args": []}
    }
    assert task({"container": {"image": "busybox", "args": ["sh", "-c", "true"]}, "cwd": "/w"}) == {
        "container": {"image": "busybox", "args": ["sh", "-c", "true"]},
        "cwd": "/w",
    }
    payload = {"a": (1, 2.5, None, True, bytearray(b"x")), "b": {"c": "d"}, "e": -(2**63)}
    assert task({"payload": payload}) == {
        "payload": {"a": [1, 2.5, None, True, b"x"], "b": {"c": "d"}, "e": -(2**63)}
    }
    assert job(task={"payload": None}).task_kind == "payload"
    assert job(task={"shell": "x"}).task_kind == "shell"


def test_task_is_a_private_copy() -> None:
    given_task: dict[str, Any] = {"payload": {"list": [1, 2]}, "env": None}
    del given_task["env"]
    s = job(task=given_task)
    given_task["payload"]["list"].append(3)
    assert s.task == {"payload": {"list": [1, 2]}}
    out = s.to_dict()
    out["task"]["payload"]["list"].append(4)  # type: ignore[index]
    assert s.task == {"payload": {"list": [1, 2]}}


def test_payload_depth_limit() -> None:
    deep: object = 1
    for _ in range(MAX_PAYLOAD_DEPTH):
        deep = [deep]
    job(task={"payload": deep})
    with pytest.raises(JobSpecError, match="nested deeper than 32") as exc:
        job(task={"payload": [deep]})
    assert exc.value.field is not None and exc.value.field.startswith("task.payload[0][0]")


def test_payload_self_reference_is_refused_not_looped() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(JobSpecError, match="nested deeper"):
        job(task={"payload": loop})


@pytest.mark.parametrize(
    "payload",
    [
        0,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        2**32 - 1,
        2**32,
        2**64 - 1,
        -1,
        -32,
        -33,
        -128,
        -129,
        -(2**15),
        -(2**15) - 1,
        -(2**31),
        -(2**31) - 1,
        -(2**63),
        1.5,
        "x" * 31,
        "x" * 32,
        "é" * 200,
        "x" * 70_000,
        b"",
        b"x" * 256,
        b"x" * 70_000,
        list(range(15)),
        list(range(16)),
        list(range(70_000)),
        {str(i): i for i in range(16)},
        {"k": [None, True, {"z": b"\x00"}]},
    ],
)
def test_size_estimate_is_msgpack_size(payload: object) -> None:
    normalized = job(task={"payload": payload}).task
    assert _packed_size(normalized) == len(msgpack.packb(normalized, use_bin_type=True))


def test_task_size_limit_boundary() -> None:
    overhead = _packed_size({"payload": ""}) + 5 - 1  # str32 header instead of fixstr
    job(task={"payload": "x" * (MAX_TASK_BYTES - overhead)})
    with pytest.raises(JobSpecError, match="256 KiB") as exc:
        job(task={"payload": "x" * (MAX_TASK_BYTES - overhead + 1)})
    assert exc.value.field == "task"
    with pytest.raises(JobSpecError, match="256 KiB") as exc:
        job(task={"command": ["a" * 200_000, "b" * 100_000]})
    assert exc.value.field == "task"
    with pytest.raises(JobSpecError, match="256 KiB") as exc:
        job(task={"payload": [None] * (MAX_TASK_BYTES + 1)})
    assert exc.value.field == "task"


def test_policy_fields_valid_forms() -> None:
    p = job(
        tier="gpu.large-1",
        timeout="90s",
        on_timeout="retry:05",
        delivery="at_most_once",
        retries={"max": 3, "backoff": "30s", "factor": 3, "max_backoff": "10m"},
        catchup="all",
        catchup_window="24h",
        max_catchup=10_000,
        overlap="cancel_previous",
    ).policy
    assert p == Policy(
        tier="gpu.large-1",
        delivery="at_most_once",
        timeout_ms=90_000,
        on_timeout="retry",
        on_timeout_retries=5,
        retries_max=3,
        retry_backoff_ms=30_000,
        retry_factor=3.0,
        retry_max_backoff_ms=600_000,
        catchup="all",
        catchup_window_ms=86_400_000,
        max_catchup=10_000,
        overlap="cancel_previous",
    )
    assert isinstance(p.retry_factor, float)
    d = p.to_dict()
    assert (d["timeout"], d["on_timeout"], d["catchup_window"]) == ("1m30s", "retry:5", "1d")
    assert job(timeout=None).policy.timeout_ms is None
    assert job(on_timeout="mark").policy.on_timeout == "mark"
    t = job(on_timeout="trigger:cleanup:nightly").policy
    assert (t.on_timeout, t.on_timeout_target, t.on_timeout_text()) == (
        "trigger",
        "cleanup:nightly",
        "trigger:cleanup:nightly",
    )
    for overlap in ("allow", "skip", "buffer_one", "cancel_previous"):
        assert job(overlap=overlap).policy.overlap == overlap
    for catchup in ("latest", "all", "skip"):
        assert job(catchup=catchup).policy.catchup == catchup


def test_retries_defaults_and_cap_follow_long_backoff() -> None:
    p = job(retries={"max": 2}).policy
    assert (p.retries_max, p.retry_backoff_ms, p.retry_max_backoff_ms) == (2, 10_000, 3_600_000)
    p = job(retries={"backoff": "2h"}).policy
    assert p.retry_max_backoff_ms == 7_200_000
    assert job(retries={"backoff": "1m", "max_backoff": "1m"}).policy.retry_max_backoff_ms == 60_000


def test_after_labels_flags() -> None:
    s = job(
        after=("b-job", "a-job"),
        labels={"team": "infra", "app.kubernetes.io/name": "x", "e": ""},
        paused=True,
        replace=True,
    )
    assert s.after == ("a-job", "b-job")
    assert s.labels == (("app.kubernetes.io/name", "x"), ("e", ""), ("team", "infra"))
    assert (s.paused, s.replace) == (True, True)
    assert s.to_dict()["labels"] == {"team": "infra", "app.kubernetes.io/name": "x", "e": ""}
    job(after=[f"dep-{i}" for i in range(32)], labels={f"k{i}": "v" for i in range(64)})
    job(labels={"k" * 63: "v" * 256})


def test_every_start_defaults_to_now_and_is_kept() -> None:
    s = job(schedule={"every": "15m"})
    assert s.to_dict()["schedule"] == {"every": "15m", "start": format_utc(NOW)}
    assert validate_job(s.to_dict(), now_ms=NOW + 999_999) == s


def test_validate_job_id() -> None:
    for good in ("a", "A-z_0.9:x", "x" * 200, new_job_id(NOW, bytes(10))):
        assert validate_job_id(good) == good
    for bad in ("", "x" * 201, "a b", "é", "a/b", None, 5):
        with pytest.raises(JobSpecError, match="job id") as exc:
            validate_job_id(bad, "after[3]")
        assert exc.value.field == "after[3]"


# ------------------------------------------------------------------------------------------
# Errors: class, field and a fragment of the message


NAN = float("nan")
ERRORS: list[tuple[dict[str, Any], type[Exception], str | None, str]] = [
    # the spec as a whole, keys
    ({"bogus": 1}, JobSpecError, "bogus", "unknown key"),
    ({"id": DROP}, JobSpecError, "id", "required"),
    ({"schedule": DROP}, JobSpecError, "schedule", "required"),
    ({"task": DROP}, JobSpecError, "task", "required"),
    # id
    ({"id": ""}, JobSpecError, "id", "1-200"),
    ({"id": "x" * 201}, JobSpecError, "id", "1-200"),
    ({"id": "a b"}, JobSpecError, "id", "A-Za-z0-9._:-"),
    ({"id": 7}, JobSpecError, "id", "got int"),
    # schedule: the schedules module's errors propagate
    ({"schedule": "daily"}, ScheduleError, "schedule", "must be an object"),
    ({"schedule": {"cron": "61 * * * *"}}, ScheduleError, "schedule.cron", "61"),
    (
        {"schedule": {"cron": "* * * * *", "tz": "Mars/Base"}},
        ScheduleError,
        "schedule.tz",
        "unknown",
    ),
    ({"schedule": {"every": "0s"}}, ScheduleError, "schedule.every", "positive"),
    ({"schedule": {"at": "2026-01-01T00:00:00"}}, ScheduleError, "schedule.at", "naive"),
    # task
    ({"task": ["echo"]}, JobSpecError, "task", "must be an object"),
    ({"task": {}}, JobSpecError, "task", "is required"),
    ({"task": {"command": ["a"], "shell": "b"}}, JobSpecError, "task.shell", "exactly one"),
    ({"task": {"command": ["a"], "user": "root"}}, JobSpecError, "task.user", "unknown key"),
    ({"task": {"command": "echo hi"}}, JobSpecError, "task.command", "list of strings"),
    ({"task": {"command": []}}, JobSpecError, "task.command", "non-empty"),
    ({"task": {"command": [""]}}, JobSpecError, "task.command[0]", "non-empty"),
    ({"task": {"command": ["a", 1]}}, JobSpecError, "task.command[1]", "got int"),
    ({"task": {"command": ["a\x00b"]}}, JobSpecError, "task.command[0]", "NUL"),
    ({"task": {"command": ["\ud800"]}}, JobSpecError, "task.command[0]", "Unicode"),
    ({"task": {"shell": ""}}, JobSpecError, "task.shell", "non-empty"),
    ({"task": {"shell": " \n"}}, JobSpecError, "task.shell", "non-empty"),
    ({"task": {"shell": ["ls"]}}, JobSpecError, "task.shell", "got list"),
    ({"task": {"container": "alpine"}}, JobSpecError, "task.container", "must be an object"),
    ({"task": {"container": {}}}, JobSpecError, "task.container.image", "required"),
    ({"task": {"container": {"image": ""}}}, JobSpecError, "task.container.image", "non-empty"),
    ({"task": {"container": {"image": "a b"}}}, JobSpecError, "task.container.image", "spaces"),
    ({"task": {"container": {"image": 3}}}, JobSpecError, "task.container.image", "got int"),
    (
        {"task": {"container": {"image": "x", "args": "a"}}},
        JobSpecError,
        "task.container.args",
        "list of strings",
    ),
    (
        {"task": {"container": {"image": "x", "args": [None]}}},
        JobSpecError,
        "task.container.args[0]",
        "got NoneType",
    ),
    (
        {"task": {"container": {"image": "x", "tag": "1"}}},
        JobSpecError,
        "task.container.tag",
        "unknown key",
    ),
    ({"task": {"command": ["a"], "env": ["A=1"]}}, JobSpecError, "task.env", "must be an object"),
    ({"task": {"command": ["a"], "env": {"A": 1}}}, JobSpecError, "task.env.A", "got int"),
    ({"task": {"command": ["a"], "env": {"A=B": "1"}}}, JobSpecError, "task.env.A=B", "'='"),
    ({"task": {"command": ["a"], "env": {"": "1"}}}, JobSpecError, "task.env.", "non-empty"),
    ({"task": {"command": ["a"], "env": {"A": "\x00"}}}, JobSpecError, "task.env.A", "NUL"),
    ({"task": {"command": ["a"], "cwd": ""}}, JobSpecError, "task.cwd", "non-empty"),
    ({"task": {"command": ["a"], "cwd": 1}}, JobSpecError, "task.cwd", "got int"),
    ({"task": {"payload": 1, "env": {}}}, JobSpecError, "task.env", "applies only"),
    ({"task": {"payload": 1, "cwd": "/"}}, JobSpecError, "task.cwd", "applies only"),
    ({"task": {"payload": {1: "x"}}}, JobSpecError, "task.payload", "keys must be strings"),
    ({"task": {"payload": {"a": [1, {2}]}}}, JobSpecError, "task.payload.a[1]", "got set"),
    ({"task": {"payload": [NAN]}}, JobSpecError, "task.payload[0]", "finite"),
    ({"task": {"payload": float("inf")}}, JobSpecError, "task.payload", "finite"),
    ({"task": {"payload": 2**64}}, JobSpecError, "task.payload", "64 bits"),
    ({"task": {"payload": -(2**63) - 1}}, JobSpecError, "task.payload", "64 bits"),
    ({"task": {"payload": {"s": "\udfff"}}}, JobSpecError, "task.payload.s", "Unicode"),
    ({"task": {"payload": "x" * MAX_TASK_BYTES}}, JobSpecError, "task", "256 KiB"),
    # tier
    ({"tier": ""}, JobSpecError, "tier", "1-64"),
    ({"tier": "x" * 65}, JobSpecError, "tier", "1-64"),
    ({"tier": "gpu:large"}, JobSpecError, "tier", "A-Za-z0-9._-"),
    ({"tier": 1}, JobSpecError, "tier", "got int"),
    # timeout
    ({"timeout": "5x"}, JobSpecError, "timeout", "not a duration"),
    ({"timeout": "0s"}, JobSpecError, "timeout", "positive"),
    ({"timeout": 30}, JobSpecError, "timeout", "got int"),
    # on_timeout
    ({"on_timeout": "explode"}, JobSpecError, "on_timeout", "'kill', 'mark'"),
    ({"on_timeout": "retry"}, JobSpecError, "on_timeout", "'kill', 'mark'"),
    ({"on_timeout": "retry:0"}, JobSpecError, "on_timeout", "1..100"),
    ({"on_timeout": "retry:101"}, JobSpecError, "on_timeout", "1..100"),
    ({"on_timeout": "retry:-1"}, JobSpecError, "on_timeout", "1..100"),
    ({"on_timeout": "retry: 2"}, JobSpecError, "on_timeout", "1..100"),
    ({"on_timeout": "trigger:"}, JobSpecError, "on_timeout", "trigger target"),
    ({"on_timeout": "trigger:a b"}, JobSpecError, "on_timeout", "trigger target"),
    ({"on_timeout": "trigger:job-1"}, JobSpecError, "on_timeout", "trigger itself"),
    ({"on_timeout": None}, JobSpecError, "on_timeout", "got NoneType"),
    # delivery
    ({"delivery": "exactly_once"}, JobSpecError, "delivery", "'at_least_once'"),
    ({"delivery": 1}, JobSpecError, "delivery", "must be one of"),
    # retries
    ({"retries": 3}, JobSpecError, "retries", "must be an object"),
    ({"retries": {"max": 101}}, JobSpecError, "retries.max", "0..100"),
    ({"retries": {"max": -1}}, JobSpecError, "retries.max", "0..100"),
    ({"retries": {"max": True}}, JobSpecError, "retries.max", "got bool"),
    ({"retries": {"max": 2.0}}, JobSpecError, "retries.max", "got float"),
    ({"retries": {"backoff": "soon"}}, JobSpecError, "retries.backoff", "not a duration"),
    ({"retries": {"factor": 0.5}}, JobSpecError, "retries.factor", "1..100"),
    ({"retries": {"factor": 101}}, JobSpecError, "retries.factor", "1..100"),
    ({"retries": {"factor": NAN}}, JobSpecError, "retries.factor", "1..100"),
    ({"retries": {"factor": "2"}}, JobSpecError, "retries.factor", "got str"),
    ({"retries": {"factor": True}}, JobSpecError, "retries.factor", "1..100"),
    ({"retries": {"max_backoff": "1s"}}, JobSpecError, "retries.max_backoff", "below backoff"),
    ({"retries": {"jitter": "1s"}}, JobSpecError, "retries.jitter", "unknown key"),
    # catch-up
    ({"catchup": "never"}, JobSpecError, "catchup", "'latest', 'all', 'skip'"),
    ({"catchup_window": "1y"}, JobSpecError, "catchup_window", "not a duration"),
    ({"max_catchup": 0}, JobSpecError, "max_catchup", "1..10000"),
    ({"max_catchup": 10_001}, JobSpecError, "max_catchup", "1..10000"),
    ({"max_catchup": "5"}, JobSpecError, "max_catchup", "got str"),
    # overlap
    ({"overlap": "queue"}, JobSpecError, "overlap", "'buffer_one'"),
    # after
    ({"after": "other"}, JobSpecError, "after", "list of job ids"),
    ({"after": [1]}, JobSpecError, "after[0]", "job id"),
    ({"after": ["a", "b", "a"]}, JobSpecError, "after[2]", "duplicate"),
    ({"after": ["job-1"]}, JobSpecError, "after[0]", "itself"),
    ({"after": [f"d{i}" for i in range(33)]}, JobSpecError, "after", "at most 32"),
    # flags
    ({"paused": "yes"}, JobSpecError, "paused", "true or false"),
    ({"paused": 1}, JobSpecError, "paused", "true or false"),
    ({"replace": None}, JobSpecError, "replace", "true or false"),
    # labels
    ({"labels": ["a"]}, JobSpecError, "labels", "must be an object"),
    ({"labels": {f"k{i}": "v" for i in range(65)}}, JobSpecError, "labels", "at most 64"),
    ({"labels": {1: "v"}}, JobSpecError, "labels", "keys must be strings"),
    ({"labels": {"": "v"}}, JobSpecError, "labels.", "1-63"),
    ({"labels": {"k" * 64: "v"}}, JobSpecError, "labels." + "k" * 64, "1-63"),
    ({"labels": {"a b": "v"}}, JobSpecError, "labels.a b", "A-Za-z0-9._/-"),
    ({"labels": {"team": 5}}, JobSpecError, "labels.team", "got int"),
    ({"labels": {"team": "v" * 257}}, JobSpecError, "labels.team", "at most 256"),
    ({"labels": {"team": "\ud800"}}, JobSpecError, "labels.team", "Unicode"),
]


@pytest.mark.parametrize(("changes", "cls", "field", "fragment"), ERRORS)
def test_errors(
    changes: dict[str, Any], cls: type[Exception], field: str | None, fragment: str
) -> None:
    with pytest.raises(cls) as exc:
        job(**changes)
    err = exc.value
    assert isinstance(err, EngineUsageError)
    assert err.field == field
    assert fragment in err.message
    assert fragment in str(err)


def test_error_codes_and_non_mapping_spec() -> None:
    with pytest.raises(JobSpecError) as exc:
        validate_job(["id"], now_ms=NOW)  # type: ignore[arg-type]
    assert exc.value.field is None and exc.value.code == "invalid_job"
    with pytest.raises(JobSpecError) as exc:
        validate_job({**BASE, 3: "x"}, now_ms=NOW)  # type: ignore[dict-item]
    assert exc.value.field == "3"
    with pytest.raises(JobSpecError) as exc:
        validate_job(BASE, now_ms=True)
    assert exc.value.field == "now_ms"
    with pytest.raises(ScheduleError) as sched:
        job(schedule={"cron": "nope"})
    assert sched.value.code == "invalid_schedule"


def test_long_keys_are_cut_in_field_names() -> None:
    with pytest.raises(JobSpecError) as exc:
        job(**{"x" * 5000: 1})
    assert exc.value.field == "x" * 64 + "..."
    with pytest.raises(JobSpecError) as exc:
        job(labels={"y" * 5000: "v"})
    assert exc.value.field == "labels." + "y" * 64 + "..."


def test_first_error_is_in_key_order() -> None:
    with pytest.raises(JobSpecError) as exc:
        job(tier="", overlap="bad", labels=5)
    assert exc.value.field == "tier"


# ------------------------------------------------------------------------------------------
# Round trip and updates


ROUND_TRIP_SPECS: list[dict[str, Any]] = [
    spec(),
    spec(
        id="report:daily",
        schedule={"cron": "30 2 * * *", "tz": "Europe/Berlin", "jitter": "300s"},
        task={"container": {"image": "reports:1"}, "env": {"MODE": "full"}},
        tier="batch",
        timeout="7200s",
        on_timeout="trigger:report-alert",
        delivery="at_most_once",
        retries={"max": 5, "backoff": "1500ms", "factor": 1.5},
        catchup="all",
        catchup_window="48h",
        max_catchup=7,
        overlap="buffer_one",
        after=["ingest", "clean"],
        paused=True,
        labels={"team": "bi"},
        replace=True,
    ),
    spec(schedule={"at": "2026-03-29T02:30:00+01:00"}, task={"payload": {"b": b"\x00\xff"}}),
    spec(
        schedule={"every": "1h30m", "start": "2026-01-01T00:00:00Z", "end": "2027-01-01T00:00:00Z"}
    ),
]


@pytest.mark.parametrize("given_spec", ROUND_TRIP_SPECS)
def test_round_trip(given_spec: dict[str, Any]) -> None:
    s = validate_job(given_spec, now_ms=NOW)
    d = s.to_dict()
    again = validate_job(d, now_ms=NOW + 86_400_000)
    assert again == s
    assert again.to_dict() == d
    wire = msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)
    assert validate_job(wire, now_ms=0) == s


def test_update_replaces_top_level_keys() -> None:
    current = job(
        timeout="1m", retries={"max": 3, "backoff": "1m"}, labels={"a": "1"}, replace=True
    )
    updated = apply_update(current, {"timeout": "2m", "retries": {"max": 1}}, now_ms=NOW + 1)
    assert updated.policy.timeout_ms == 120_000
    assert (updated.policy.retries_max, updated.policy.retry_backoff_ms) == (1, 10_000)
    assert updated.labels == (("a", "1"),)
    assert updated.replace is False  # a create-time flag does not stick
    assert updated.schedule == current.schedule and updated.task == current.task
    assert current.policy.timeout_ms == 60_000  # the current spec is untouched
    assert apply_update(current, {}, now_ms=NOW).to_dict() == {
        **current.to_dict(),
        "replace": False,
    }
    assert apply_update(current, {"timeout": None}, now_ms=NOW).policy.timeout_ms is None
    assert apply_update(current, {"id": "job-1", "paused": True}, now_ms=NOW).paused is True


def test_update_new_every_starts_at_update_time_old_one_keeps_start() -> None:
    current = job(schedule={"every": "1h"})
    later = NOW + 3_600_000 * 5
    assert apply_update(current, {"paused": True}, now_ms=later).schedule == current.schedule
    moved = apply_update(current, {"schedule": {"every": "2h"}}, now_ms=later)
    assert moved.to_dict()["schedule"] == {"every": "2h", "start": format_utc(later)}


def test_update_errors() -> None:
    current = job()
    for bad_id in ("job-2", 5):
        with pytest.raises(JobSpecError, match="cannot change the job id") as exc:
            apply_update(current, {"id": bad_id}, now_ms=NOW)
        assert exc.value.field == "id"
    with pytest.raises(JobSpecError) as exc:
        apply_update(current, {"retries": {"max": 500}}, now_ms=NOW)
    assert exc.value.field == "retries.max"
    with pytest.raises(JobSpecError) as exc:
        apply_update(current, {"colour": "red"}, now_ms=NOW)
    assert exc.value.field == "colour"
    with pytest.raises(ScheduleError):
        apply_update(current, {"schedule": {"cron": "bad"}}, now_ms=NOW)
    with pytest.raises(JobSpecError) as exc:
        apply_update(current, None, now_ms=NOW)  # type: ignore[arg-type]
    assert exc.value.field is None
    assert current == job()


@pytest.mark.parametrize(
    ("tz", "suggested"),
    [("right/UTC", "'UTC'"), ("posix/Europe/Berlin", "'Europe/Berlin'")],
)
def test_a_zone_only_the_hosts_files_have_is_refused_for_new_versions(
    tz: str, suggested: str
) -> None:
    """Found by the sixth adversarial pass: such a name loaded here, but the tzdata package
    (a node without system zone files) has no ``right/`` or ``posix/`` copies."""
    with pytest.raises(ScheduleError, match=suggested) as exc:
        job(schedule={"cron": "0 * * * *", "tz": tz})
    assert exc.value.field == "schedule.tz"
    with pytest.raises(ScheduleError):
        apply_update(job(), {"schedule": {"cron": "0 * * * *", "tz": tz}}, now_ms=NOW)
    try:
        zoneinfo.ZoneInfo(tz)
    except zoneinfo.ZoneInfoNotFoundError:
        return  # this host has no such files: nothing stored could name it either
    # A store that already holds one (from before the check) still loads it.
    assert parse_schedule({"cron": "0 * * * *", "tz": tz}).next_after(NOW) is not None


# ------------------------------------------------------------------------------------------
# Policies


def test_policy_table_interns() -> None:
    table = PolicyTable()
    a = table.intern(job(id="a", timeout="1m").policy)
    b = table.intern(job(id="b", timeout="60s", labels={"x": "y"}).policy)
    c = table.intern(job(id="c", timeout="2m").policy)
    d = table.intern(job(id="d").policy)
    assert (a, b, c, d) == (0, 0, 1, 2)
    assert len(table) == 3
    assert table.get(1).timeout_ms == 120_000
    assert table.intern(Policy()) == 2
    table._check()
    for bad in (3, -1, True, "0"):
        with pytest.raises(PolicyRecordError) as exc:
            table.get(bad)  # type: ignore[arg-type]
        assert exc.value.field == "policy_id"
        assert isinstance(exc.value, EngineStateError)
    with pytest.raises(EngineUsageError):
        table.intern({"tier": "x"})  # type: ignore[arg-type]


def test_policy_table_persistence_round_trip() -> None:
    table = PolicyTable()
    policies = [
        Policy(),
        job(on_timeout="trigger:x", retries={"max": 2, "factor": 1.25}).policy,
        job(on_timeout="retry:4", timeout="1d", tier="t", catchup="skip").policy,
    ]
    for p in policies:
        table.intern(p)
    stored = msgpack.packb(table.to_list(), use_bin_type=True)
    loaded = PolicyTable.from_list(msgpack.unpackb(stored, raw=False))
    loaded._check()
    assert len(loaded) == 3
    assert [loaded.get(i) for i in range(3)] == policies
    assert [loaded.intern(p) for p in policies] == [0, 1, 2]
    assert PolicyTable.from_list([]).to_list() == []
    for p in policies:
        assert parse_policy(p.to_dict()) == p


@pytest.mark.parametrize(
    ("items", "field", "fragment"),
    [
        ({"tier": "x"}, "policies", "must be a list"),
        ([{"tier": ""}], "policies[0].tier", "1-64"),
        ([{}, {"retries": {"max": -1}}], "policies[1].retries.max", "0..100"),
        ([{}, {"tier": "default"}], "policies[1]", "duplicates policy 0"),
        ([{"id": "x"}], "policies[0].id", "unknown policy key"),
        ([7], "policies[0]", "must be an object"),
    ],
)
def test_policy_table_bad_records(items: object, field: str, fragment: str) -> None:
    with pytest.raises(PolicyRecordError) as exc:
        PolicyTable.from_list(items)
    assert exc.value.field == field
    assert fragment in exc.value.message


# ------------------------------------------------------------------------------------------
# Job ids and retry delays


def test_new_job_id_known_values() -> None:
    assert new_job_id(0, bytes(10)) == "0" * 26
    assert new_job_id(2**48 - 1, b"\xff" * 10) == "7" + "Z" * 25
    # The ULID spec's example timestamp prefix: 1469918176385 ms -> 01ARYZ6S41.
    assert new_job_id(1_469_918_176_385, bytes(10)).startswith("01ARYZ6S41")


def test_new_job_id_properties() -> None:
    rng = random.Random(7)
    times = sorted(rng.randrange(0, 2**48) for _ in range(500))
    times += [times[-1] + 1, times[-1] + 2]
    ids = [new_job_id(t, rng.randbytes(10)) for t in times]
    assert ids == sorted(ids)
    assert all(len(i) == 26 and validate_job_id(i) == i for i in ids)
    entropy = rng.randbytes(16)
    assert new_job_id(NOW, entropy) == new_job_id(NOW, bytearray(entropy[:10]))
    assert new_job_id(NOW, entropy) != new_job_id(NOW, bytes(10))
    assert new_job_id(NOW + 1, bytes(10)) > new_job_id(NOW, b"\xff" * 10)


def test_new_job_id_errors() -> None:
    with pytest.raises(JobSpecError, match="at least 10 bytes") as exc:
        new_job_id(NOW, b"123456789")
    assert exc.value.field == "entropy"
    with pytest.raises(JobSpecError) as exc:
        new_job_id(NOW, "0123456789")  # type: ignore[arg-type]
    assert exc.value.field == "entropy"
    for bad in (-1, 2**48, True, 1.0):
        with pytest.raises(JobSpecError) as exc:
            new_job_id(bad, bytes(10))  # type: ignore[arg-type]
        assert exc.value.field == "now_ms"


def test_retry_delay() -> None:
    p = job(retries={"max": 20}).policy
    assert [retry_delay_ms(p, a) for a in range(1, 10)] == [
        10_000,
        20_000,
        40_000,
        80_000,
        160_000,
        320_000,
        640_000,
        1_280_000,
        2_560_000,
    ]
    assert retry_delay_ms(p, 10) == 3_600_000
    assert retry_delay_ms(p, 10**9) == 3_600_000  # saturates, no OverflowError
    flat = job(retries={"backoff": "5s", "factor": 1}).policy
    assert {retry_delay_ms(flat, a) for a in (1, 2, 50, 10**9)} == {5_000}
    odd = job(retries={"backoff": "1s", "factor": 1.5, "max_backoff": "10s"}).policy
    assert [retry_delay_ms(odd, a) for a in (1, 2, 3, 4, 5, 6, 7)] == [
        1000,
        1500,
        2250,
        3375,
        5062,  # 5062.5 rounds half to even
        7594,
        10_000,
    ]
    for bad in (0, -1, True, 1.0):
        with pytest.raises(JobSpecError) as exc:
            retry_delay_ms(p, bad)  # type: ignore[arg-type]
        assert exc.value.field == "attempt"


# ------------------------------------------------------------------------------------------
# Property tests

ID_CHARS = "abcXYZ019._:-"
ids = st.text(ID_CHARS, min_size=1, max_size=30)
durations = st.one_of(
    st.integers(1, 10**10).map(format_duration),
    st.sampled_from(["90s", "1500ms", "24h", "60m", "1h30m", "0d5s"]),
)
instants = st.integers(0, 4_000_000_000_000).map(format_utc)
schedules = st.one_of(
    st.fixed_dictionaries(
        {"cron": st.sampled_from(["*/5 * * * *", "0 3 * * 1-5", "@daily", "30 2 * * *"])},
        optional={
            "tz": st.sampled_from(["UTC", "Europe/Berlin", "Australia/Sydney"]),
            "dst_gap": st.sampled_from(["shift", "skip"]),
            "dst_fold": st.sampled_from(["first", "last", "both"]),
            "jitter": durations,
        },
    ),
    st.fixed_dictionaries({"at": instants}, optional={"jitter": durations}),
    st.fixed_dictionaries({"every": durations}, optional={"start": instants, "jitter": durations}),
)
plain = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=12)
envs = st.dictionaries(plain.filter(lambda k: bool(k) and "=" not in k), plain, max_size=3)
extras = {"env": envs, "cwd": plain.filter(bool)}
payloads = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=15,
)
tasks = st.one_of(
    st.fixed_dictionaries(
        {"command": st.lists(plain, min_size=1, max_size=4).filter(lambda a: a[0] != "")},
        optional=extras,
    ),
    st.fixed_dictionaries({"shell": plain.filter(lambda s: s.strip() != "")}, optional=extras),
    st.fixed_dictionaries(
        {
            "container": st.fixed_dictionaries(
                {"image": st.text("abc:/.0-9", min_size=1, max_size=20)},
                optional={"args": st.lists(plain, max_size=3)},
            )
        },
        optional=extras,
    ),
    st.fixed_dictionaries({"payload": payloads}),
)
retries = st.fixed_dictionaries(
    {},
    optional={
        "max": st.integers(0, 100),
        "backoff": durations,
        "factor": st.floats(1, 100) | st.integers(1, 100),
        "max_backoff": durations,
    },
)
on_timeouts = st.one_of(
    st.sampled_from(["kill", "mark"]),
    st.integers(1, 100).map(lambda n: f"retry:{n}"),
    ids.map(lambda i: f"trigger:{i}"),
)
label_keys = st.text("abXY09._/-", min_size=1, max_size=63)
optional_fields: dict[str, st.SearchStrategy[Any]] = {
    "tier": st.text("abXY09._-", min_size=1, max_size=64),
    "timeout": st.none() | durations,
    "on_timeout": on_timeouts,
    "delivery": st.sampled_from(["at_least_once", "at_most_once"]),
    "retries": retries,
    "catchup": st.sampled_from(["latest", "all", "skip"]),
    "catchup_window": durations,
    "max_catchup": st.integers(1, 10_000),
    "overlap": st.sampled_from(["allow", "skip", "buffer_one", "cancel_previous"]),
    "after": st.lists(ids, unique=True, max_size=5),
    "paused": st.booleans(),
    "labels": st.dictionaries(label_keys, st.text(max_size=20), max_size=5),
    "replace": st.booleans(),
}
valid_specs = st.fixed_dictionaries(
    {"id": ids, "schedule": schedules, "task": tasks}, optional=optional_fields
)


def _repair(s: dict[str, Any]) -> dict[str, Any]:
    """Drop the few combinations a strategy cannot rule out on its own."""
    job_id = s["id"]
    if "after" in s:
        s["after"] = [a for a in s["after"] if a != job_id]
    if s.get("on_timeout") == f"trigger:{job_id}":
        s["on_timeout"] = "kill"
    r = s.get("retries", {})
    if "max_backoff" in r and parse_duration(r["max_backoff"]) < parse_duration(
        r.get("backoff", "10s")
    ):
        del r["max_backoff"]
    return s


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(valid_specs, st.integers(0, 4_000_000_000_000), st.integers(0, 4_000_000_000_000))
def test_property_round_trip(raw: dict[str, Any], now: int, later: int) -> None:
    given_spec = _repair(raw)
    s = validate_job(given_spec, now_ms=now)
    d = s.to_dict()
    assert validate_job(d, now_ms=later) == s
    wire = msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)
    again = validate_job(wire, now_ms=later)
    assert again == s and again.to_dict() == d
    assert _packed_size(s.task) == len(msgpack.packb(s.task, use_bin_type=True))
    table = PolicyTable()
    pid = table.intern(s.policy)
    assert PolicyTable.from_list(table.to_list()).get(pid) == s.policy
    # What a replay reads back of the stored form (the policy kept by raw values).
    assert stored_policy(d) == (s.policy, s.after)
    assert stored_policy(wire) == (s.policy, s.after)


junk_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(st.characters(exclude_categories=()), max_size=8),
    st.sampled_from(["", "1s", "0s", "-1s", "kill", "retry:", "trigger:", "\ud800", "*/5 * * * *"]),
    st.binary(max_size=4),
)
junk = st.recursive(
    junk_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.one_of(
                st.sampled_from(["cron", "at", "every", "command", "payload", "max"]),
                st.text(max_size=4),
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
key_names = st.sampled_from(list(JOB_KEYS)) | st.text(max_size=6)


@PROPERTY
@given(
    st.one_of(
        st.dictionaries(key_names, junk, max_size=6),
        st.tuples(valid_specs, st.sampled_from(list(JOB_KEYS)), junk).map(
            lambda t: {**t[0], t[1]: t[2]}
        ),
        st.tuples(
            valid_specs,
            st.sampled_from(["schedule", "task", "retries"]),
            st.dictionaries(st.text(max_size=10), junk, max_size=3),
        ).map(lambda t: {**t[0], t[1]: t[2]}),
        junk,
    )
)
def test_property_junk_raises_only_usage_errors(raw: Any) -> None:
    try:
        validate_job(raw, now_ms=NOW)
    except (JobSpecError, ScheduleError):
        pass
    except EngineUsageError:
        pass  # the schedules module's own argument errors are usage errors too
    try:
        apply_update(job(), raw, now_ms=NOW)
    except EngineUsageError:
        pass


@PROPERTY
@given(junk)
def test_property_policy_records_raise_only_state_errors(raw: Any) -> None:
    try:
        PolicyTable.from_list([raw])
    except PolicyRecordError:
        pass


def test_the_policy_cache_tells_booleans_from_numbers_and_keeps_no_errors() -> None:
    # Parsed policies are kept by their raw values; True == 1 as a dict key must not let a
    # boolean through where an integer was accepted, and a refusal must come back every time.
    assert job(max_catchup=1).policy.max_catchup == 1
    for _ in range(2):
        with pytest.raises(JobSpecError) as exc:
            job(max_catchup=True)
        assert exc.value.field == "max_catchup"
    assert job(retries={"max": 2}).policy.retries_max == 2
    assert job(retries={"max": 3}).policy.retries_max == 3  # retries objects told apart
    assert job(retries={"factor": 2}).policy.retry_factor == 2.0
    with pytest.raises(JobSpecError):
        job(retries={"factor": True})


# The payload's fast walk (exact dicts, lists and scalars, no field names) against the general
# walk it stands in for: a task that is not a plain dict (a mapping proxy) always takes the
# general path, so both must accept the same payloads, return equal copies and raise the same
# errors (type, field, message).
payload_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**65),
    st.floats(),
    st.text(st.characters(exclude_categories=()), max_size=40),
    st.binary(max_size=300),
    st.builds(bytearray, st.binary(max_size=3)),
    st.sampled_from(["\ud800", "é" * 20, "x" * 31, "x" * 32, "x" * 255, "x" * 256]),
)
payloads = st.recursive(
    payload_leaves,
    lambda inner: (
        st.lists(inner, max_size=20)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=40) | st.integers(0, 3) | st.binary(max_size=2), inner)
    ),
    max_leaves=40,
)


def _task_outcome(task: Any) -> tuple[str, Any]:
    try:
        return "ok", job(task=task).task
    except EngineUsageError as exc:
        return type(exc).__name__, (exc.field, str(exc))


@PROPERTY
@given(payloads)
def test_property_fast_payload_walk_matches_the_general_one(payload: Any) -> None:
    from types import MappingProxyType

    fast = _task_outcome({"payload": payload})
    general = _task_outcome(MappingProxyType({"payload": payload}))
    assert fast == general
    if fast[0] == "ok":
        packed = msgpack.packb(fast[1], use_bin_type=True)
        assert len(packed) <= MAX_TASK_BYTES


@pytest.mark.parametrize(
    "payload",
    [
        "x" * (MAX_TASK_BYTES - 20),  # the largest that fits, and just over it
        "x" * (MAX_TASK_BYTES - 14),
        "x" * (MAX_TASK_BYTES - 13),
        ["x" * 1000] * 300,
        list(range(MAX_TASK_BYTES + 1)),
        {"k": [[[[float("nan")]]]]},
        {"k": {"\udc80": 1}},
        [2**64],
    ],
)
def test_fast_payload_walk_at_the_limits(payload: Any) -> None:
    from types import MappingProxyType

    fast = _task_outcome({"payload": payload})
    assert fast == _task_outcome(MappingProxyType({"payload": payload}))


def test_deep_and_self_referencing_payloads_take_the_general_walk() -> None:
    from types import MappingProxyType

    deep: object = 1
    for _ in range(MAX_PAYLOAD_DEPTH + 1):
        deep = {"a": deep}
    fast = _task_outcome({"payload": deep})
    assert fast[0] == "JobSpecError" and "nested deeper" in fast[1][1]
    assert fast == _task_outcome(MappingProxyType({"payload": deep}))
    loop: dict[str, object] = {}
    loop["a"] = loop
    assert _task_outcome({"payload": loop})[0] == "JobSpecError"


def test_schedules_shared_by_raw_text_keep_what_depends_on_the_job() -> None:
    # Kept per raw spec: equal raw schedules give equal results, but a jitter (drawn for the
    # job id) and an every without start (starting at creation) are never shared.
    a = validate_job(spec(id="a", schedule={"at": "2026-03-01T00:00:00Z"}), now_ms=NOW)
    b = validate_job(spec(id="b", schedule={"at": "2026-03-01T00:00:00Z"}), now_ms=NOW + 5)
    assert a.schedule == b.schedule
    jittered = {"cron": "0 * * * *", "jitter": "30m"}
    offsets = {
        validate_job(
            spec(id=f"j{i}", schedule=dict(jittered)), now_ms=NOW
        ).schedule.jitter_offset_ms
        for i in range(20)
    }
    assert len(offsets) > 1
    first = validate_job(spec(schedule={"every": "1h"}), now_ms=NOW).schedule
    second = validate_job(spec(schedule={"every": "1h"}), now_ms=NOW + 60_000).schedule
    assert first.next_after(NOW) != second.next_after(NOW)
    for _ in range(2):  # a refusal comes back every time (errors are not kept)
        with pytest.raises(ScheduleError):
            validate_job(spec(schedule={"at": "2026-13-01T00:00:00Z"}), now_ms=NOW)


def test_a_mapping_that_is_not_a_dict_gets_the_same_typed_errors() -> None:
    """The fast check of a spec's keys is for dicts only: another Mapping's keys() need not be
    a set (here a list), and its unknown key is still a JobSpecError naming it."""
    from collections.abc import Iterator, Mapping

    class ListKeys(Mapping[str, object]):
        def __init__(self, data: dict[str, object]) -> None:
            self._data = data

        def __getitem__(self, key: str) -> object:
            return self._data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

        def keys(self) -> list[str]:  # type: ignore[override]
            return list(self._data)

    base = {"id": "m", "schedule": {"at": "2031-01-01T00:00:00Z"}, "task": {"payload": 1}}
    with pytest.raises(JobSpecError) as caught:
        validate_job(ListKeys({**base, "bogus": 1}), now_ms=0)
    assert caught.value.field == "bogus"
    assert validate_job(ListKeys(base), now_ms=0) == validate_job(base, now_ms=0)
