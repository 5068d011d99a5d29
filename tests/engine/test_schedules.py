"""Tests of engine.schedules: cron across DST in both hemispheres, every/at/end/jitter, errors,
interning and caching, previews, and a property test against a brute-force wall-clock reference."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import EngineUsageError, ScheduleError
from engine.schedules import (
    CronSchedule,
    clear_caches,
    format_duration,
    format_utc,
    interned_rule_count,
    parse_duration,
    parse_instant,
    parse_schedule,
    preview,
)

BERLIN = "Europe/Berlin"
SYDNEY = "Australia/Sydney"
NEW_YORK = "America/New_York"


def ms(text: str) -> int:
    return parse_instant(text, field="test")


def chain(spec: dict[str, Any], after: str, n: int, *, job_id: str | None = None) -> list[str]:
    """The next ``n`` fire times after ``after`` as UTC strings, by chaining next_after."""
    schedule = parse_schedule(spec, job_id=job_id)
    out: list[str] = []
    t: int | None = ms(after)
    for _ in range(n):
        assert t is not None
        t = schedule.next_after(t)
        if t is None:
            break
        out.append(format_utc(t))
    return out


# ------------------------------------------------------------------------------------------
# DST, northern hemisphere: Europe/Berlin 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z),
# 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z).


def test_berlin_gap_fixed_time_shift_fires_at_transition() -> None:
    spec = {"cron": "30 2 * * *", "tz": BERLIN}
    assert chain(spec, "2026-03-28T12:00:00Z", 3) == [
        "2026-03-29T01:00:00Z",  # 02:30 does not exist; 03:00 CEST
        "2026-03-30T00:30:00Z",
        "2026-03-31T00:30:00Z",
    ]


def test_berlin_gap_fixed_time_skip_drops_the_day() -> None:
    spec = {"cron": "30 2 * * *", "tz": BERLIN, "dst_gap": "skip"}
    assert chain(spec, "2026-03-28T12:00:00Z", 2) == [
        "2026-03-30T00:30:00Z",
        "2026-03-31T00:30:00Z",
    ]


def test_berlin_gap_frequent_shift_coalesces_into_one_fire() -> None:
    spec = {"cron": "*/15 * * * *", "tz": BERLIN}
    # 02:00..02:45 do not exist; with 03:00 they make one fire at 01:00Z.
    assert chain(spec, "2026-03-29T00:40:00Z", 4) == [
        "2026-03-29T00:45:00Z",
        "2026-03-29T01:00:00Z",
        "2026-03-29T01:15:00Z",
        "2026-03-29T01:30:00Z",
    ]


def test_berlin_gap_frequent_skip_and_hourly() -> None:
    skip = {"cron": "*/15 * * * *", "tz": BERLIN, "dst_gap": "skip"}
    assert chain(skip, "2026-03-29T00:40:00Z", 3) == [
        "2026-03-29T00:45:00Z",
        "2026-03-29T01:00:00Z",  # the regular 03:00 CEST fire
        "2026-03-29T01:15:00Z",
    ]
    for gap in ("shift", "skip"):
        hourly = {"cron": "0 * * * *", "tz": BERLIN, "dst_gap": gap}
        assert chain(hourly, "2026-03-28T23:30:00Z", 3) == [
            "2026-03-29T00:00:00Z",
            "2026-03-29T01:00:00Z",
            "2026-03-29T02:00:00Z",
        ]


@pytest.mark.parametrize(
    ("fold", "expected"),
    [
        ("first", ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]),
        ("last", ["2026-10-25T01:30:00Z", "2026-10-26T01:30:00Z"]),
        ("both", ["2026-10-25T00:30:00Z", "2026-10-25T01:30:00Z", "2026-10-26T01:30:00Z"]),
    ],
)
def test_berlin_fold_fixed_time(fold: str, expected: list[str]) -> None:
    spec = {"cron": "30 2 * * *", "tz": BERLIN, "dst_fold": fold}
    assert chain(spec, "2026-10-24T12:00:00Z", len(expected)) == expected


@pytest.mark.parametrize(
    ("fold", "after", "expected"),
    [
        # 02:00..02:45 CEST = 00:00..00:45Z, 02:00..02:45 CET = 01:00..01:45Z, 03:00 CET = 02:00Z
        ("first", "2026-10-25T00:40:00Z", ["00:45", "02:00", "02:15"]),
        ("last", "2026-10-24T23:50:00Z", ["01:00", "01:15", "01:30", "01:45", "02:00"]),
        ("both", "2026-10-25T00:40:00Z", ["00:45", "01:00", "01:15", "01:30", "01:45", "02:00"]),
        # queries inside the first pass of the fold: earlier wall times still fire later
        ("last", "2026-10-25T00:20:00Z", ["01:00", "01:15"]),
        ("both", "2026-10-25T00:20:00Z", ["00:30", "00:45", "01:00"]),
        # inside the second pass
        ("both", "2026-10-25T01:20:00Z", ["01:30", "01:45", "02:00"]),
        ("first", "2026-10-25T01:20:00Z", ["02:00"]),
    ],
)
def test_berlin_fold_frequent(fold: str, after: str, expected: list[str]) -> None:
    spec = {"cron": "*/15 * * * *", "tz": BERLIN, "dst_fold": fold}
    got = chain(spec, after, len(expected))
    assert got == [f"2026-10-25T{hhmm}:00Z" for hhmm in expected]


@pytest.mark.parametrize(
    ("fold", "expected"),
    [
        ("first", ["23:00", "00:00", "02:00"]),
        ("last", ["23:00", "01:00", "02:00"]),
        ("both", ["23:00", "00:00", "01:00", "02:00"]),
    ],
)
def test_berlin_fold_hourly(fold: str, expected: list[str]) -> None:
    spec = {"cron": "0 * * * *", "tz": BERLIN, "dst_fold": fold}
    got = [t[11:16] for t in chain(spec, "2026-10-24T22:30:00Z", len(expected))]
    assert got == expected


def test_new_york_gap_and_fold() -> None:
    # 2026-03-08 02:00 EST -> 03:00 EDT at 07:00Z; 2026-11-01 02:00 EDT -> 01:00 EST at 06:00Z.
    assert chain({"cron": "30 2 * * *", "tz": NEW_YORK}, "2026-03-07T12:00:00Z", 2) == [
        "2026-03-08T07:00:00Z",
        "2026-03-09T06:30:00Z",
    ]
    assert chain(
        {"cron": "30 1 * * *", "tz": NEW_YORK, "dst_fold": "both"}, "2026-10-31T12:00:00Z", 3
    ) == ["2026-11-01T05:30:00Z", "2026-11-01T06:30:00Z", "2026-11-02T06:30:00Z"]


# ------------------------------------------------------------------------------------------
# DST, southern hemisphere: Australia/Sydney 2026-04-05 03:00 AEDT -> 02:00 AEST (04-04T16:00Z),
# 2026-10-04 02:00 AEST -> 03:00 AEDT (10-03T16:00Z).


@pytest.mark.parametrize(
    ("fold", "expected"),
    [
        ("first", ["2026-04-03T15:30:00Z", "2026-04-04T15:30:00Z", "2026-04-05T16:30:00Z"]),
        ("last", ["2026-04-03T15:30:00Z", "2026-04-04T16:30:00Z", "2026-04-05T16:30:00Z"]),
        (
            "both",
            [
                "2026-04-03T15:30:00Z",
                "2026-04-04T15:30:00Z",
                "2026-04-04T16:30:00Z",
                "2026-04-05T16:30:00Z",
            ],
        ),
    ],
)
def test_sydney_fold_fixed_time(fold: str, expected: list[str]) -> None:
    spec = {"cron": "30 2 * * *", "tz": SYDNEY, "dst_fold": fold}
    assert chain(spec, "2026-04-03T12:00:00Z", len(expected)) == expected


@pytest.mark.parametrize(
    ("fold", "expected"),
    [
        ("first", ["14:00", "15:00", "17:00"]),
        ("last", ["14:00", "16:00", "17:00"]),
        ("both", ["14:00", "15:00", "16:00", "17:00"]),
    ],
)
def test_sydney_fold_hourly(fold: str, expected: list[str]) -> None:
    spec = {"cron": "0 * * * *", "tz": SYDNEY, "dst_fold": fold}
    got = [t[11:16] for t in chain(spec, "2026-04-04T13:30:00Z", len(expected))]
    assert got == expected


def test_sydney_gap_fixed_time_shift_and_skip() -> None:
    shift = {"cron": "30 2 * * *", "tz": SYDNEY}
    assert chain(shift, "2026-10-02T12:00:00Z", 3) == [
        "2026-10-02T16:30:00Z",
        "2026-10-03T16:00:00Z",  # 02:30 does not exist on 10-04: 03:00 AEDT
        "2026-10-04T15:30:00Z",
    ]
    skip = {**shift, "dst_gap": "skip"}
    assert chain(skip, "2026-10-02T12:00:00Z", 2) == [
        "2026-10-02T16:30:00Z",
        "2026-10-04T15:30:00Z",
    ]


def test_sydney_gap_frequent() -> None:
    shift = {"cron": "*/15 * * * *", "tz": SYDNEY}
    assert chain(shift, "2026-10-03T15:40:00Z", 3) == [
        "2026-10-03T15:45:00Z",
        "2026-10-03T16:00:00Z",
        "2026-10-03T16:15:00Z",
    ]
    skip = {**shift, "dst_gap": "skip"}
    assert chain(skip, "2026-10-03T15:40:00Z", 3) == [
        "2026-10-03T15:45:00Z",
        "2026-10-03T16:00:00Z",
        "2026-10-03T16:15:00Z",
    ]


# ------------------------------------------------------------------------------------------
# Calendar forms


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("0 0 29 2 *", "2026-01-01T00:00:00Z", ["2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"]),
        ("0 0 31 * *", "2026-01-31T00:00:00Z", ["2026-03-31T00:00:00Z", "2026-05-31T00:00:00Z"]),
        ("0 0 L * *", "2026-01-31T00:00:00Z", ["2026-02-28T00:00:00Z", "2026-03-31T00:00:00Z"]),
        ("0 0 L 2 *", "2027-03-01T00:00:00Z", ["2028-02-29T00:00:00Z"]),
        ("0 0 LW * *", "2026-05-01T00:00:00Z", ["2026-05-29T00:00:00Z", "2026-06-30T00:00:00Z"]),
        ("0 9 * * 5L", "2026-01-01T00:00:00Z", ["2026-01-30T09:00:00Z", "2026-02-27T09:00:00Z"]),
        ("0 9 * * 1#2", "2026-01-01T00:00:00Z", ["2026-01-12T09:00:00Z", "2026-02-09T09:00:00Z"]),
        ("30 0 0 * * *", "2026-01-01T00:00:00Z", ["2026-01-01T00:00:30Z", "2026-01-02T00:00:30Z"]),
        (
            "*/20 * * * * *",
            "2026-01-01T00:00:05Z",
            ["2026-01-01T00:00:20Z", "2026-01-01T00:00:40Z"],
        ),
        ("@yearly", "2026-06-01T00:00:00Z", ["2027-01-01T00:00:00Z"]),
        ("@annually", "2026-06-01T00:00:00Z", ["2027-01-01T00:00:00Z"]),
        ("@monthly", "2026-06-01T00:00:00Z", ["2026-07-01T00:00:00Z"]),
        ("@weekly", "2026-06-01T00:00:00Z", ["2026-06-07T00:00:00Z"]),  # Sunday
        ("@daily", "2026-06-01T00:00:00Z", ["2026-06-02T00:00:00Z"]),
        ("@midnight", "2026-06-01T00:00:00Z", ["2026-06-02T00:00:00Z"]),
        ("@HOURLY", "2026-06-01T00:00:00Z", ["2026-06-01T01:00:00Z"]),
    ],
)
def test_calendar_forms(expr: str, after: str, expected: list[str]) -> None:
    assert chain({"cron": expr}, after, len(expected)) == expected


def test_month_end_and_leap_in_a_zone() -> None:
    spec = {"cron": "0 0 L 2 *", "tz": SYDNEY}
    assert chain(spec, "2027-03-01T00:00:00Z", 1) == ["2028-02-28T13:00:00Z"]  # 29th, AEDT


def test_aliases_share_rules_with_their_expansion() -> None:
    a = parse_schedule({"cron": "@daily"})
    b = parse_schedule({"cron": " 0  0 * *  * ", "tz": "UTC"})
    assert isinstance(a, CronSchedule) and isinstance(b, CronSchedule)
    assert a.rule is b.rule
    assert a == b and hash(a) == hash(b)
    assert a.to_spec() == {
        "cron": "0 0 * * *",
        "tz": "UTC",
        "dst_gap": "shift",
        "dst_fold": "first",
    }


# ------------------------------------------------------------------------------------------
# every / at / end / jitter


def test_every_start_in_the_future_and_grid() -> None:
    s = parse_schedule({"every": "15m", "start": "2026-01-01T00:00:00Z"})
    assert s.next_after(ms("2025-06-01T00:00:00Z")) == ms("2026-01-01T00:00:00Z")
    assert s.next_after(ms("2025-12-31T23:59:59.999Z")) == ms("2026-01-01T00:00:00Z")
    # exactly on a fire time: the next one, strictly after
    assert s.next_after(ms("2026-01-01T00:00:00Z")) == ms("2026-01-01T00:15:00Z")
    assert s.next_after(ms("2026-01-01T00:14:59.999Z")) == ms("2026-01-01T00:15:00Z")


def test_every_defaults_start_to_created_ms() -> None:
    created = ms("2026-01-01T00:00:00.250Z")
    s = parse_schedule({"every": "1500ms"}, created_ms=created)
    assert s.next_after(created - 1) == created
    assert s.next_after(created) == created + 1500
    assert s.to_spec() == {"every": "1s500ms", "start": "2026-01-01T00:00:00.250Z"}


def test_end_equal_to_a_fire_time_is_included() -> None:
    s = parse_schedule(
        {"every": "1h", "start": "2026-01-01T00:00:00Z", "end": "2026-01-01T02:00:00Z"}
    )
    assert s.next_after(ms("2026-01-01T01:00:00Z")) == ms("2026-01-01T02:00:00Z")
    assert s.next_after(ms("2026-01-01T02:00:00Z")) is None
    cron = parse_schedule({"cron": "0 * * * *", "end": "2026-01-01T02:00:00+00:00"})
    assert cron.next_after(ms("2026-01-01T01:30:00Z")) == ms("2026-01-01T02:00:00Z")
    assert cron.next_after(ms("2026-01-01T02:00:00Z")) is None


def test_at_is_strictly_after() -> None:
    s = parse_schedule({"at": "2026-03-29T02:30:00+01:00"})
    at = ms("2026-03-29T01:30:00Z")
    assert s.next_after(at - 1) == at
    assert s.next_after(at) is None  # at exactly equal to after_ms is excluded
    assert s.next_after(at + 1) is None
    assert s.to_spec() == {"at": "2026-03-29T01:30:00Z"}


def test_exhausted_schedules() -> None:
    assert (
        parse_schedule({"at": "2020-01-01T00:00:00Z"}).next_after(ms("2026-01-01T00:00:00Z"))
        is None
    )
    assert (
        parse_schedule({"cron": "* * * * *", "end": "2026-01-01T00:00:00Z"}).next_after(
            ms("2026-01-01T00:00:00Z")
        )
        is None
    )
    # past year 9999 there is nothing left
    assert parse_schedule({"cron": "0 0 1 1 *"}).next_after(ms("9999-06-01T00:00:00Z")) is None


def test_jitter_deterministic_bounded_and_spread() -> None:
    spec = {"cron": "0 * * * *", "jitter": "30s"}
    base = ms("2026-01-01T01:00:00Z")
    offsets = set()
    for i in range(200):
        job = f"job-{i}"
        a = parse_schedule(spec, job_id=job)
        b = parse_schedule(spec, job_id=job)
        assert a == b and a.jitter_offset_ms == b.jitter_offset_ms
        assert 0 <= a.jitter_offset_ms < 30_000
        t = a.next_after(ms("2026-01-01T00:30:00Z"))
        assert t == base + a.jitter_offset_ms
        # the chain stays on the jittered grid and strictly after
        assert a.next_after(t) == base + 3_600_000 + a.jitter_offset_ms
        assert a.next_after(t - 1) == t
        offsets.add(a.jitter_offset_ms)
    assert len(offsets) > 150  # differs across ids
    # a known value pins the hash: every node, every release must agree on it
    assert parse_schedule(spec, job_id="job-0").jitter_offset_ms == 13548


def test_jitter_on_every_and_at_and_end() -> None:
    every = parse_schedule(
        {"every": "1m", "start": "2026-01-01T00:00:00Z", "jitter": "10s"}, job_id="x"
    )
    d = every.jitter_offset_ms
    assert 0 <= d < 10_000
    assert every.next_after(ms("2026-01-01T00:00:00Z") + d - 1) == ms("2026-01-01T00:00:00Z") + d
    at = parse_schedule(
        {"at": "2026-01-01T00:00:00Z", "jitter": "1h", "end": "2026-01-01T00:00:00Z"}, job_id="y"
    )
    # end applies to the jittered fire time
    assert at.jitter_offset_ms > 0
    assert at.next_after(0) is None


def test_jitter_differs_between_equal_specs_so_schedules_differ() -> None:
    a = parse_schedule({"cron": "0 * * * *", "jitter": "1h"}, job_id="a")
    b = parse_schedule({"cron": "0 * * * *", "jitter": "1h"}, job_id="b")
    assert isinstance(a, CronSchedule) and isinstance(b, CronSchedule)
    assert a.rule is b.rule  # the expensive part is still shared
    assert a.jitter_offset_ms != b.jitter_offset_ms and a != b


# ------------------------------------------------------------------------------------------
# Durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1500ms", 1500),
        ("90s", 90_000),
        ("15m", 900_000),
        ("2h", 7_200_000),
        ("1d", 86_400_000),
        ("1h30m", 5_400_000),
        ("1d2h3m4s5ms", 93_784_005),
    ],
)
def test_parse_duration(text: str, expected: int) -> None:
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


def test_parse_duration_custom_error_class() -> None:
    class TimeoutError_(EngineUsageError):
        code = "bad_timeout"

    with pytest.raises(TimeoutError_) as info:
        parse_duration("soon", field="policy.timeout", error=TimeoutError_)
    assert info.value.field == "policy.timeout"


# ------------------------------------------------------------------------------------------
# Errors: each kind of bad input names its field and says what is wrong


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"cron": "61 * * * *"}, "schedule.cron", "Bad minute"),
        ({"cron": "* 25 * * *"}, "schedule.cron", "Bad hour"),
        ({"cron": "0 0 30 2 *"}, "schedule.cron", "never matches: no month of '2' has day '30'"),
        ({"cron": "0 0 31 4,6 *"}, "schedule.cron", "no month of '4,6' has day '31'"),
        ({"cron": "0 0 32 * *"}, "schedule.cron", "Bad day-of-month"),
        ({"cron": "0 0 * * 8"}, "schedule.cron", "Bad day-of-week"),
        ({"cron": "* * *"}, "schedule.cron", "has 3 fields"),
        ({"cron": "@reboot"}, "schedule.cron", "@reboot is not supported"),
        ({"cron": "@fortnightly"}, "schedule.cron", "unknown cron alias"),
        ({"cron": ""}, "schedule.cron", "empty cron expression"),
        ({"cron": 5}, "schedule.cron", "must be a cron expression string"),
        ({"cron": "* * * * *", "tz": "Mars/Olympus"}, "schedule.tz", "unknown time zone"),
        ({"cron": "* * * * *", "tz": "Europe"}, "schedule.tz", "unknown time zone"),
        ({"cron": "* * * * *", "tz": "../etc/passwd"}, "schedule.tz", "unknown time zone"),
        ({"cron": "* * * * *", "tz": "localtime"}, "schedule.tz", "host's setting"),
        ({"cron": "* * * * *", "tz": 1}, "schedule.tz", "IANA time zone name"),
        ({"at": "2026-03-29T02:30:00"}, "schedule.at", "naive timestamp"),
        ({"at": "2026-03-29"}, "schedule.at", "naive timestamp"),
        ({"at": "yesterday"}, "schedule.at", "not an ISO 8601 timestamp"),
        ({"at": 1774744200000}, "schedule.at", "ISO 8601 timestamp string"),
        ({"every": "0s", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "must be positive"),
        ({"every": "-5m", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "must be positive"),
        ({"every": "1.5h", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "not a duration"),
        ({"every": "5 m", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "not a duration"),
        ({"every": "", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "not a duration"),
        ({"every": 60, "start": "2026-01-01T00:00:00Z"}, "schedule.every", "duration string"),
        ({"every": "99999d", "start": "2026-01-01T00:00:00Z"}, "schedule.every", "100 years"),
        ({"every": "5m"}, "schedule.start", "needs a start"),
        ({"every": "5m", "start": "2026-01-01T00:00"}, "schedule.start", "naive timestamp"),
        ({"cron": "* * * * *", "jitter": "0ms"}, "schedule.jitter", "must be positive"),
        ({"cron": "* * * * *", "end": "soon"}, "schedule.end", "not an ISO 8601"),
        (
            {"at": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"},
            "schedule.end",
            "before at",
        ),
        (
            {"every": "1m", "start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"},
            "schedule.end",
            "before start",
        ),
        ({"cron": "* * * * *", "color": "red"}, "schedule.color", "unknown key 'color'"),
        ({}, "schedule", "empty schedule"),
        ({"end": "2026-01-01T00:00:00Z"}, "schedule", "one of cron, at, every is required"),
        ({"cron": "* * * * *", "at": "2026-01-01T00:00:00Z"}, "schedule.at", "only one of"),
        ({"every": "1m", "cron": "* * * * *"}, "schedule.every", "got cron and every"),
        (
            {"cron": "* * * * *", "dst_gap": "later"},
            "schedule.dst_gap",
            "must be one of 'shift', 'skip'",
        ),
        (
            {"cron": "* * * * *", "dst_fold": "second"},
            "schedule.dst_fold",
            "'first', 'last', 'both'",
        ),
        ({"cron": "* * * * *", "dst_fold": True}, "schedule.dst_fold", "must be one of"),
        ({"at": "2026-01-01T00:00:00Z", "tz": BERLIN}, "schedule.tz", "applies only to cron"),
        ({"every": "1m", "dst_gap": "skip"}, "schedule.dst_gap", "applies only to cron"),
        ({"cron": "* * * * *", "start": "2026-01-01T00:00:00Z"}, "schedule.start", "only to every"),
        (["cron", "* * * * *"], "schedule", "must be an object"),
        ("0 * * * *", "schedule", "got str"),
        (None, "schedule", "got NoneType"),
    ],
)
def test_bad_specs_name_their_field(spec: Any, field: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_schedule(spec, job_id="job")
    assert info.value.field == field
    assert message in info.value.message, info.value.message
    assert info.value.code == "invalid_schedule"
    assert isinstance(info.value, ValueError)


def test_jitter_without_job_id() -> None:
    with pytest.raises(ScheduleError) as info:
        parse_schedule({"cron": "* * * * *", "jitter": "5s"})
    assert info.value.field == "schedule.jitter"


def test_bad_after_ms_and_preview_count() -> None:
    s = parse_schedule({"cron": "* * * * *"})
    with pytest.raises(EngineUsageError) as info:
        s.next_after(1.5)  # type: ignore[arg-type]
    assert info.value.field == "after_ms"
    for count in (0, 1001, -1):
        with pytest.raises(EngineUsageError) as info:
            preview({"cron": "* * * * *"}, count, 0)
        assert info.value.field == "count"


# ------------------------------------------------------------------------------------------
# Interning, caching, normalization


def test_identical_specs_share_one_rule_and_cache() -> None:
    specs = [
        {"cron": "*/5 9-17 * * 1-5", "tz": BERLIN},
        {"cron": "*/5  9-17 * * mon-fri", "tz": BERLIN},
    ]
    a, b = (parse_schedule(s) for s in specs)
    assert isinstance(a, CronSchedule) and isinstance(b, CronSchedule)
    again = parse_schedule(specs[0])
    assert isinstance(again, CronSchedule) and again.rule is a.rule
    assert again is a  # cron schedules are interned as a whole, too
    # different text, same meaning: distinct rules (normalization is textual), same answers
    t = ms("2026-03-02T08:00:00Z")
    assert a.next_after(t) == b.next_after(t) == ms("2026-03-02T08:00:00Z") + 5 * 60_000
    before = a.rule.misses
    for _ in range(10):
        a.next_after(t)
    assert a.rule.misses == before  # served from the cache
    other = parse_schedule({"cron": "*/5 9-17 * * 1-5", "tz": BERLIN, "dst_fold": "both"})
    assert isinstance(other, CronSchedule) and other.rule is not a.rule
    assert interned_rule_count() >= 2


def test_rule_cache_is_bounded_fifo() -> None:
    s = parse_schedule({"cron": "* * * * *", "tz": SYDNEY})
    assert isinstance(s, CronSchedule)
    rule = s.rule
    for i in range(rule.cache_max + 100):
        s.next_after(i * 1000)
    assert rule.cache_size == rule.cache_max
    clear_caches()
    assert rule.cache_size == 0


def test_to_spec_round_trips() -> None:
    specs: list[dict[str, Any]] = [
        {
            "cron": "30 2 * * *",
            "tz": BERLIN,
            "dst_gap": "skip",
            "dst_fold": "both",
            "end": "2027-01-01T00:00:00+01:00",
            "jitter": "90s",
        },
        {"at": "2026-03-29T02:30:00.5+01:00", "jitter": "1h30m"},
        {"every": "90m", "start": "2026-01-01T00:00:00-05:00", "end": "2026-02-01T00:00:00Z"},
    ]
    for spec in specs:
        s = parse_schedule(spec, job_id="rt")
        again = parse_schedule(s.to_spec(), job_id="rt")
        assert again == s and again.to_spec() == s.to_spec()
        json.dumps(s.to_spec())
    assert parse_schedule(specs[0], job_id="rt").to_spec()["end"] == "2026-12-31T23:00:00Z"


# ------------------------------------------------------------------------------------------
# Previews


def test_preview_gap_shift_note() -> None:
    p = preview({"cron": "30 2 * * *", "tz": BERLIN}, 2, ms("2026-03-28T12:00:00Z"))
    first = p.fires[0]
    assert first.at_ms == ms("2026-03-29T01:00:00Z")
    assert first.utc == "2026-03-29T01:00:00Z"
    assert first.local == "2026-03-29 03:00:00 CEST (+02:00)"
    assert first.note == (
        "02:30 does not exist on 2026-03-29 in Europe/Berlin (clocks sprang forward); "
        "fired at 03:00 CEST"
    )
    assert p.fires[1].note is None
    assert p.description.startswith("At 02:30 every day (Europe/Berlin)")
    assert "spring-forward" in p.description and "first occurrence" in p.description


def test_preview_coalesced_gap_and_skip_notes() -> None:
    shift = preview({"cron": "*/15 * * * *", "tz": BERLIN}, 3, ms("2026-03-29T00:40:00Z"))
    assert shift.fires[1].note is not None
    assert shift.fires[1].note.startswith(
        "02:00, 02:15, 02:30 and 02:45 do not exist on 2026-03-29"
    )
    assert shift.fires[1].note.endswith("fired once at 03:00 CEST")
    skip = preview(
        {"cron": "30 2 * * *", "tz": BERLIN, "dst_gap": "skip"}, 2, ms("2026-03-28T12:00:00Z")
    )
    assert skip.fires[0].utc == "2026-03-30T00:30:00Z"
    assert (
        skip.fires[0].note is not None and "02:30 on 2026-03-29 was skipped" in skip.fires[0].note
    )
    assert skip.fires[1].note is None


def test_preview_fold_notes() -> None:
    p = preview({"cron": "30 1 * * *", "tz": NEW_YORK}, 1, ms("2026-10-31T12:00:00Z"))
    assert p.fires[0].note == (
        "01:30 occurs twice on 2026-11-01 in America/New_York (clocks fell back); "
        "first occurrence (EDT)"
    )
    both = preview(
        {"cron": "30 2 * * *", "tz": SYDNEY, "dst_fold": "both"}, 3, ms("2026-04-04T12:00:00Z")
    )
    notes = [f.note for f in both.fires]
    assert notes[0] is not None and "this is the first occurrence (AEDT)" in notes[0]
    assert notes[1] is not None and "this is the last occurrence (AEST)" in notes[1]
    assert notes[2] is None
    last = preview(
        {"cron": "30 2 * * *", "tz": SYDNEY, "dst_fold": "last"}, 1, ms("2026-04-04T12:00:00Z")
    )
    assert last.fires[0].note is not None and last.fires[0].note.endswith("last occurrence (AEST)")


def test_preview_every_at_and_json() -> None:
    p = preview({"every": "1h30m"}, 3, 0, created_ms=ms("2026-01-01T00:00:00Z"), job_id="j")
    assert [f.utc for f in p.fires] == [
        "2026-01-01T00:00:00Z",
        "2026-01-01T01:30:00Z",
        "2026-01-01T03:00:00Z",
    ]
    assert p.description == "Every 1h30m from 2026-01-01T00:00:00Z"
    at = preview({"at": "2026-01-01T00:00:00Z"}, 5, 0)
    assert len(at.fires) == 1 and at.description == "Once at 2026-01-01T00:00:00Z"
    assert at.fires[0].local == "2026-01-01 00:00:00 UTC (+00:00)"
    data = preview(
        {"cron": "0 9 * * 1#2", "tz": SYDNEY, "jitter": "1m"}, 2, 0, job_id="j"
    ).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"kind", "spec", "tz", "description", "fires"}
    assert "second Monday" in data["description"] and "jitter" in data["description"]
    assert set(data["fires"][0]) == {"at_ms", "utc", "local", "note"}


def test_preview_stops_at_end() -> None:
    p = preview(
        {"cron": "0 * * * *", "end": "2026-01-01T03:00:00Z"}, 10, ms("2026-01-01T00:30:00Z")
    )
    assert [f.utc[11:16] for f in p.fires] == ["01:00", "02:00", "03:00"]


# ------------------------------------------------------------------------------------------
# Property test against a brute-force reference that walks wall-clock minutes

MINUTES = ["0", "30", "*/15", "*/7", "5,35", "0-10/5", "*"]
HOURS = ["*", "2", "1-3", "*/2", "0,12", "3", "2,3"]
WEEKDAYS = ["*", "0", "1-5", "6,0", "3"]
ZONES = ["UTC", BERLIN, SYDNEY]
_EPOCH_NAIVE = datetime(1970, 1, 1)
_MAX_OFFSET_S = 14 * 3600


def _values(text: str, lo: int, hi: int) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/")
            step = int(step_text)
        if part == "*":
            a, b = lo, hi
        elif "-" in part:
            a, b = (int(x) for x in part.split("-"))
        else:
            a = b = int(part)
        out.update(range(a, b + 1, step))
    return out


def _secs(wall: datetime) -> int:
    return int((wall - _EPOCH_NAIVE).total_seconds())


def _offset(instant: int, zone: ZoneInfo) -> timedelta:
    offset = (
        (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=instant)).astimezone(zone).utcoffset()
    )
    assert offset is not None
    return offset


def _reference(expr: str, tz: str, gap: str, fold: str, after_s: int, count: int) -> list[int]:
    """The first ``count`` instants after ``after_s``, from first principles."""
    zone = ZoneInfo(tz)
    minute, hour, _dom, _month, dow = expr.split()
    minutes, hours, dows = _values(minute, 0, 59), _values(hour, 0, 23), _values(dow, 0, 6)
    start = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=after_s)).astimezone(zone)
    wall = start.replace(tzinfo=None, second=0) - timedelta(hours=3)
    found: set[int] = set()
    while True:
        ordered = sorted(found)
        # no wall time from here on can map earlier than wall - 14h
        if len(ordered) >= count and _secs(wall) - _MAX_OFFSET_S > ordered[count - 1]:
            return ordered[:count]
        if wall.minute in minutes and wall.hour in hours and (wall.weekday() + 1) % 7 in dows:
            off0 = wall.replace(tzinfo=zone).utcoffset()
            off1 = wall.replace(tzinfo=zone, fold=1).utcoffset()
            assert off0 is not None and off1 is not None
            base = _secs(wall)
            instants: list[int] = []
            if off0 == off1:
                instants = [base - int(off0.total_seconds())]
            elif off0 < off1:  # nonexistent
                if gap == "shift":
                    t = base - int(off1.total_seconds())
                    while _offset(t, zone) != off1:
                        t += 60
                    instants = [t]
            else:
                first, last = base - int(off0.total_seconds()), base - int(off1.total_seconds())
                instants = {"first": [first], "last": [last], "both": [first, last]}[fold]
            found.update(t for t in instants if t > after_s)
        wall += timedelta(minutes=1)


def _transitions(tz: str) -> list[int]:
    zone = ZoneInfo(tz)
    out: list[int] = []
    t = int(datetime(2024, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(2031, 1, 1, tzinfo=UTC).timestamp())
    step = 6 * 3600
    while t < end:
        if _offset(t, zone) != _offset(t + step, zone):
            lo, hi = t, t + step
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if _offset(mid, zone) != _offset(lo, zone) else (mid, hi)
            out.append(hi)
        t += step
    return out


TRANSITIONS = _transitions(BERLIN) + _transitions(SYDNEY)
LO_MS = int(datetime(2024, 1, 1, tzinfo=UTC).timestamp()) * 1000
HI_MS = int(datetime(2030, 12, 31, tzinfo=UTC).timestamp()) * 1000

after_ms_strategy = st.one_of(
    st.integers(LO_MS, HI_MS),
    st.builds(
        lambda t, delta: t * 1000 + delta,
        st.sampled_from(TRANSITIONS),
        st.integers(-2 * 86_400_000, 86_400_000),
    ),
)


def test_transition_table_is_sane() -> None:
    assert len(TRANSITIONS) == 28  # two a year, two zones, 2024..2030
    assert ms("2026-03-29T01:00:00Z") // 1000 in TRANSITIONS
    assert ms("2026-10-03T16:00:00Z") // 1000 in TRANSITIONS


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    minute=st.sampled_from(MINUTES),
    hour=st.sampled_from(HOURS),
    weekday=st.sampled_from(WEEKDAYS),
    tz=st.sampled_from(ZONES),
    gap=st.sampled_from(["shift", "skip"]),
    fold=st.sampled_from(["first", "last", "both"]),
    after=after_ms_strategy,
)
def test_next_after_matches_brute_force_reference(
    minute: str, hour: str, weekday: str, tz: str, gap: str, fold: str, after: int
) -> None:
    expr = f"{minute} {hour} * * {weekday}"
    spec = {"cron": expr, "tz": tz, "dst_gap": gap, "dst_fold": fold}
    schedule = parse_schedule(spec)
    count = 4
    expected = [s * 1000 for s in _reference(expr, tz, gap, fold, after // 1000, count)]
    got: list[int] = []
    t = after
    for _ in range(count):
        nxt = schedule.next_after(t)
        assert nxt is not None and nxt > t  # strictly increasing chain
        assert schedule.next_after_uncached(t) == nxt  # cached equals uncached
        got.append(nxt)
        t = nxt
    assert got == expected
    assert [f.at_ms for f in preview(spec, count, after).fires] == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(-(10**13), 10**13))
def test_format_utc_matches_datetime_cached_or_not(ms: int) -> None:
    expected = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)).strftime(
        "%Y-%m-%dT%H:%M:%S"
    )
    if ms % 1000:
        expected += f".{ms % 1000:03d}"
    expected += "Z"
    assert format_utc(ms) == expected
    assert format_utc(ms) == expected  # the second answer comes from the per-second cache
    assert format_utc(ms - ms % 1000) == expected[:19] + "Z"


# ---------------------------------------------------------------------------- bounds (review A4)


def test_format_utc_is_total_and_pads_years_to_four_digits() -> None:
    from engine.schedules import MAX_INSTANT_MS, format_utc

    assert format_utc(-62_135_596_800_000) == "0001-01-01T00:00:00Z"
    assert format_utc(MAX_INSTANT_MS) == "9999-12-31T23:59:59.999Z"
    assert format_utc(MAX_INSTANT_MS + 1) == "+010000-01-01T00:00:00Z"
    assert format_utc(-62_135_596_800_001) == "0000-12-31T23:59:59.999Z"
    assert format_utc(-(2**62)).startswith("-")  # no OverflowError, whatever the instant


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"at": "9999-12-31T23:59:59.999Z", "jitter": "1d"}, "schedule.at"),
        ({"every": "1d", "start": "9999-12-31T00:00:00Z", "jitter": "2d"}, "schedule.start"),
        ({"at": "1969-07-20T20:17:00Z"}, "schedule.at"),
        ({"at": "0001-01-01T00:00:00Z"}, "schedule.at"),
    ],
)
def test_schedules_outside_the_representable_times_are_refused(
    spec: dict[str, str], field: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_schedule(spec, job_id="j")
    assert info.value.field == field


def test_an_every_schedule_ends_at_the_last_representable_time() -> None:
    spec = {"every": "1d", "start": "9999-12-31T00:00:00Z"}
    fires = preview(spec, 3, 0).fires
    assert [f.utc for f in fires] == ["9999-12-31T00:00:00Z"]
    assert parse_schedule(spec).next_after(fires[0].at_ms) is None
    # A start before 1970 is fine (what fires is after now), and renders with its year padded.
    assert (
        parse_schedule({"every": "1d", "start": "0001-01-01T00:00:00Z"}).to_spec()["start"]
        == "0001-01-01T00:00:00Z"
    )
