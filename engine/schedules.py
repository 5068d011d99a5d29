"""Schedules: validate a job's schedule spec and compute its fire times.

Owns the three kinds (``cron`` in an IANA zone, once ``at``, ``every`` interval), their validation
into :class:`~engine.errors.ScheduleError` naming the field to blame, the mapping of cron wall
times to instants across DST gaps and folds, the interning of cron rules shared by many jobs (with
a bounded per-rule cache), per-job jitter, and human previews. Must never read a clock, do I/O
beyond zoneinfo's tz database, or draw random numbers: every node computes the same fire times from
the same spec and job id. Time is integer milliseconds since the Unix epoch, UTC.
"""

from __future__ import annotations

import hashlib
import operator
import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Final, SupportsIndex
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from mypy_extensions import mypyc_attr

from engine.errors import EngineUsageError, ScheduleError
from engine.memo import remember

__all__ = [
    "MAX_INSTANT_MS",
    "MIN_INSTANT_MS",
    "AtSchedule",
    "CronRule",
    "CronSchedule",
    "EverySchedule",
    "FireTime",
    "Preview",
    "Schedule",
    "clear_caches",
    "format_duration",
    "format_utc",
    "interned_rule_count",
    "parse_duration",
    "parse_instant",
    "parse_schedule",
    "preview",
]

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_NAIVE: Final = datetime(1970, 1, 1)
# datetime cannot represent instants outside years 1..9999; a query past the end has no answer,
# one before the start is a caller bug.
_MIN_S: Final = -62_135_596_800 + 2 * 86_400
_MAX_S: Final = 253_402_300_799 - 2 * 86_400

#: The fire times a schedule may have: 1970-01-01T00:00:00Z (a run id carries its time as
#: unsigned ms) to 9999-12-31T23:59:59.999Z (the last instant ISO 8601's four-digit years and
#: datetime can render). An ``at`` outside it is refused, as is an ``at`` or ``start`` whose
#: jitter could push it past the end; ``every`` and cron schedules are exhausted once their
#: next time would be past it. (A ``start`` or ``end`` before 1970 is fine: what fires is
#: after now.)
MIN_INSTANT_MS: Final = 0
MAX_INSTANT_MS: Final = 253_402_300_799_999
#: 0001-01-01T00:00:00Z: the earliest instant whose stored text (format_utc) parse_instant reads
#: back; a schedule's ``start`` and ``end`` may be before 1970, not before this
EARLIEST_STORABLE_MS: Final = -62_135_596_800_000

KINDS: Final = ("cron", "at", "every")
_COMMON_KEYS: Final = frozenset({"end", "jitter"})
KEYS_BY_KIND: Final[dict[str, frozenset[str]]] = {
    "cron": frozenset({"cron", "tz", "dst_gap", "dst_fold"}) | _COMMON_KEYS,
    "at": frozenset({"at"}) | _COMMON_KEYS,
    "every": frozenset({"every", "start"}) | _COMMON_KEYS,
}
_ALL_KEYS: Final = frozenset().union(*KEYS_BY_KIND.values())

DST_GAP_POLICIES: Final = ("shift", "skip")
DST_FOLD_POLICIES: Final = ("first", "last", "both")

# cronsim 2.8 has no @-aliases; these are Vixie cron's.
CRON_ALIASES: Final[dict[str, str]] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MAX_CRON_LEN: Final = 256
# Fixed, not the current time: validation must not depend on when it runs.
_PROBE: Final = datetime(2000, 1, 1)
# Zone keys that name the host's own setting rather than a zone: nodes would disagree.
_HOST_ZONES: Final = frozenset({"localtime", "posixrules"})
_UTC_NAMES: Final = frozenset({"UTC", "Etc/UTC"})

_DURATION_UNITS: Final[dict[str, int]] = {
    "ms": 1,
    "s": 1_000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
}
_DURATION_RE: Final = re.compile(r"(?:[0-9]+(?:ms|s|m|h|d))+")
_DURATION_PART_RE: Final = re.compile(r"([0-9]+)(ms|s|m|h|d)")
_MAX_DURATION_TEXT: Final = 64
MAX_DURATION_MS: Final = 36_500 * 86_400_000

# Mapping kinds of a wall time, for previews' notes.
_NORMAL: Final = 0
_GAP: Final = 1
_FOLD: Final = 2


# --------------------------------------------------------------------------------------------
# Durations and instants


#: Parsed and rendered durations by text and by value: a node meets few distinct ones ("1h",
#: "30s") and parses or renders one per every schedule, timeout and backoff of each create,
#: replayed job and snapshot profile (a fifth of a snapshot's load of `every` jobs). Bounded:
#: cleared when full. Only valid durations are kept.
_DURATION_CACHE_LIMIT: Final = 4096
_PARSED_DURATIONS: dict[str, int] = {}
_DURATION_TEXTS: dict[int, str] = {}


def parse_duration(
    text: object,
    *,
    field: str = "duration",
    error: type[EngineUsageError] = ScheduleError,
) -> int:
    """Parse a duration such as ``"1500ms"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"``, ``"1h30m"``.

    Returns whole milliseconds, always in ``1..MAX_DURATION_MS`` (100 years). Units are ``ms s m
    h d``, lower case, integer amounts, no spaces; parts of a compound add up. Raises ``error``
    (default :class:`ScheduleError`) with ``field`` set for a non-string, unparsable, zero,
    negative or too long duration, so callers outside schedules (timeouts, backoff) can raise
    their own error class. O(len(text)).
    """
    if type(text) is str:
        known = _PARSED_DURATIONS.get(text)
        if known is not None:
            return known
    if not isinstance(text, str):
        raise error(
            f"must be a duration string such as '90s' or '1h30m', got {type(text).__name__}",
            field=field,
        )
    if len(text) > _MAX_DURATION_TEXT:
        raise error(f"duration longer than {_MAX_DURATION_TEXT} characters", field=field)
    if text.startswith("-"):
        raise error(f"duration must be positive, got {text!r}", field=field)
    if not _DURATION_RE.fullmatch(text):
        raise error(
            f"not a duration: {text!r}; use integer amounts with units ms, s, m, h, d "
            "such as '1500ms', '90s' or '1h30m'",
            field=field,
        )
    total = sum(int(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART_RE.findall(text))
    if total <= 0:
        raise error(f"duration must be positive, got {text!r}", field=field)
    if total > MAX_DURATION_MS:
        raise error(f"duration {text!r} is longer than 100 years", field=field)
    if type(text) is str:  # not a str subclass: its own equality could differ
        remember(_PARSED_DURATIONS, text, total, _DURATION_CACHE_LIMIT)
    return total


def format_duration(ms: int) -> str:
    """The canonical text of a positive duration: largest units first (``5400000`` -> ``1h30m``).

    ``parse_duration(format_duration(x)) == x`` for every valid ``x``.
    """
    known = _DURATION_TEXTS.get(ms)
    if known is not None:
        return known
    if ms <= 0:
        raise ValueError(f"duration must be positive, got {ms}")
    value = ms
    parts: list[str] = []
    for unit in ("d", "h", "m", "s", "ms"):
        size = _DURATION_UNITS[unit]
        amount, ms = divmod(ms, size)
        if amount:
            parts.append(f"{amount}{unit}")
    text = "".join(parts)
    if type(value) is int:  # a bool or float would share an int's dict slot
        remember(_DURATION_TEXTS, value, text, _DURATION_CACHE_LIMIT)
    return text


def parse_instant(text: object, *, field: str) -> int:
    """Parse an ISO 8601 timestamp with an offset or ``Z`` into epoch milliseconds.

    A naive timestamp (no offset) is refused, as its instant would depend on an unstated zone.
    Sub-millisecond digits are truncated toward the past. Raises :class:`ScheduleError` with
    ``field`` for a non-string, an unparsable text or a naive timestamp.
    """
    if not isinstance(text, str):
        raise ScheduleError(
            "must be an ISO 8601 timestamp string with an offset, such as "
            f"'2026-03-29T02:30:00+01:00' or '2026-03-29T01:30:00Z', got {type(text).__name__}",
            field=field,
        )
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ScheduleError(f"not an ISO 8601 timestamp: {text!r}", field=field) from None
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ScheduleError(
            f"naive timestamp {text!r}: an offset or Z is required, "
            "such as '2026-03-29T02:30:00+01:00' or '2026-03-29T01:30:00Z'",
            field=field,
        )
    delta = dt - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


#: format_utc's text per whole second: strftime costs ~8 us, and a node formats the same few
#: seconds over and over (fire times, replies, stored specs). Bounded; a cache, not an LRU.
_UTC_TEXT: dict[int, str] = {}
_UTC_TEXT_LIMIT: Final = 65_536


def _civil(days: int) -> tuple[int, int, int]:
    """(year, month, day) of ``days`` since 1970-01-01 in the proleptic Gregorian calendar,
    for any integer (H. Hinnant's ``civil_from_days``): no datetime range to overflow."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def format_utc(ms: int) -> str:
    """ISO 8601 in UTC with a ``Z``: ``2026-03-29T01:00:00Z``, milliseconds only when nonzero.

    Total: any integer renders, years always with at least four digits (``0001-01-01...``),
    years past 9999 with a ``+`` and years before 1 with a ``-`` (ISO 8601's expanded form),
    so a bad instant can never make a description or a listing fail.
    """
    seconds, milli = divmod(ms, 1000)
    text = _UTC_TEXT.get(seconds)
    if text is None:
        days, rest = divmod(seconds, 86_400)
        year, month, day = _civil(days)
        hour, rest = divmod(rest, 3600)
        minute, second = divmod(rest, 60)
        if 0 <= year <= 9999:
            ytext = f"{year:04d}"
        else:
            ytext = f"{'+' if year > 0 else '-'}{abs(year):06d}"
        text = remember(
            _UTC_TEXT,
            seconds,
            f"{ytext}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}",
            _UTC_TEXT_LIMIT,
        )
    return f"{text}.{milli:03d}Z" if milli else text + "Z"


def _format_offset(offset: timedelta | None) -> str:
    seconds = int((offset or timedelta()).total_seconds())
    sign = "+" if seconds >= 0 else "-"
    hours, rest = divmod(abs(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{sign}{hours:02d}:{minutes:02d}"
    return text + (f":{secs:02d}" if secs else "")


def _format_local(ms: int, zone: ZoneInfo) -> str:
    try:
        dt = (_EPOCH + timedelta(milliseconds=ms)).astimezone(zone)
    except (OverflowError, ValueError):
        # Beyond what datetime renders in a zone (near year 1 or 9999): the UTC text, total.
        return f"{format_utc(ms)} (UTC)"
    text = dt.strftime("%Y-%m-%d %H:%M:%S")
    if ms % 1000:
        text += f".{ms % 1000:03d}"
    return f"{text} {dt.tzname()} ({_format_offset(dt.utcoffset())})"


def _short_local(seconds: int, zone: ZoneInfo) -> str:
    dt = (_EPOCH + timedelta(seconds=seconds)).astimezone(zone)
    return f"{_hhmm(dt)} {dt.tzname()}"


def _hhmm(dt: datetime) -> str:
    return dt.strftime("%H:%M:%S" if dt.second else "%H:%M")


def _naive_seconds(wall: datetime) -> int:
    delta = wall - _EPOCH_NAIVE
    return delta.days * 86_400 + delta.seconds


def _offset_seconds(offset: timedelta | None) -> int:
    assert offset is not None  # a ZoneInfo always has an offset
    return offset.days * 86_400 + offset.seconds


# --------------------------------------------------------------------------------------------
# Zones and DST transitions


def _load_zone(name: object) -> ZoneInfo:
    if not isinstance(name, str):
        raise ScheduleError(
            f"must be an IANA time zone name such as 'Europe/Berlin', got {type(name).__name__}",
            field="schedule.tz",
        )
    if name in _HOST_ZONES:
        raise ScheduleError(
            f"{name!r} names the host's setting, not a zone; use an IANA name such as "
            "'Europe/Berlin'",
            field="schedule.tz",
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(
            f"unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin' or 'UTC'",
            field="schedule.tz",
        ) from None


def _offset_at(seconds: int, zone: ZoneInfo) -> int:
    return _offset_seconds((_EPOCH + timedelta(seconds=seconds)).astimezone(zone).utcoffset())


# (zone key, proleptic day of the wall time, offset before, offset after) -> transition instant.
# Bounded because callers choose the days; any entry can be recomputed exactly.
_TRANSITIONS: dict[tuple[str, int, int, int], int] = {}
_TRANSITIONS_MAX: Final = 4096


def _gap_transition(wall: datetime, zone: ZoneInfo, before: int, after: int) -> int:
    """The instant (s) a spring-forward jumps over ``wall``: the first instant on the new offset.

    Every nonexistent wall time in the gap lies in (instant - after, instant - before], so a binary
    search in whole seconds between those bounds finds it in O(log(after - before)) offset lookups;
    tzdata transitions fall on whole seconds. Cached per zone and day.
    """
    key = (str(zone.key), wall.toordinal(), before, after)
    found = _TRANSITIONS.get(key)
    if found is not None:
        return found
    base = _naive_seconds(wall)
    lo, hi = base - after, base - before  # offset(lo) == before, offset(hi) == after
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset_at(mid, zone) == after:
            hi = mid
        else:
            lo = mid
    if len(_TRANSITIONS) >= _TRANSITIONS_MAX:
        del _TRANSITIONS[next(iter(_TRANSITIONS))]
    _TRANSITIONS[key] = hi
    return hi


# --------------------------------------------------------------------------------------------
# Cron rules: interned, cached


@mypyc_attr(native_class=False)
class CronRule:
    """One normalized cron expression in one zone with its DST policy, shared by many jobs.

    Obtain rules through :func:`parse_schedule`; identical ``(expr, tz, dst_gap, dst_fold)``
    specs yield the same object while any schedule holds it. Cron matches are iterated by
    cronsim in naive wall time (no DST fix-ups of its own) and mapped to instants here:

    - a wall time with one offset maps to its one instant;
    - a wall time a spring-forward skips (a gap) maps, with ``dst_gap="shift"``, to the
      transition instant, so several skipped wall times coalesce into one fire there; with
      ``"skip"`` it maps to nothing;
    - a wall time a fall-back repeats (a fold) maps to its first occurrence, its last one, or
      both, per ``dst_fold``.

    :meth:`next_after_s` returns the smallest such instant strictly after its argument. Results
    are cached per argument in a FIFO-bounded dict of ``cache_max`` entries: jobs sharing a rule
    ask about the same instants (the fire time they all just fired at), so a small cache serves
    them all. Instances are immutable apart from that cache; not thread-safe.
    """

    __slots__ = (
        "__weakref__",
        "_cache",
        "_utc",
        "cache_max",
        "dst_fold",
        "dst_gap",
        "expr",
        "misses",
        "tz",
        "zone",
    )

    def __init__(
        self, expr: str, tz: str, zone: ZoneInfo, dst_gap: str, dst_fold: str, cache_max: int
    ) -> None:
        self.expr = expr
        self.tz = tz
        self.zone = zone
        self.dst_gap = dst_gap
        self.dst_fold = dst_fold
        self.cache_max = cache_max
        self.misses = 0
        self._utc = tz in _UTC_NAMES
        self._cache: dict[int, int | None] = {}

    def __repr__(self) -> str:
        return (
            f"CronRule({self.expr!r}, tz={self.tz!r}, dst_gap={self.dst_gap!r}, "
            f"dst_fold={self.dst_fold!r})"
        )

    def clear_cache(self) -> None:
        self._cache.clear()

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def next_after_s(self, after_s: int) -> int | None:
        """The first fire instant (epoch seconds) strictly after ``after_s``, or None.

        O(1) on a cache hit; a miss costs what :meth:`next_after_s_uncached` costs and may evict
        the oldest entry.
        """
        cache = self._cache
        try:
            return cache[after_s]
        except KeyError:
            pass
        result = self.next_after_s_uncached(after_s)
        if len(cache) >= self.cache_max:
            del cache[next(iter(cache))]
        cache[after_s] = result
        return result

    def next_after_s_uncached(self, after_s: int) -> int | None:
        """:meth:`next_after_s` without the cache: the reference the cache must agree with.

        None when the expression has no match within cronsim's 50-year horizon or before year
        9999. Costs one cronsim construction plus one match per wall time visited: usually one,
        up to the matches in one DST fold (``dst_fold="both"``, or a query inside a fold).
        """
        self.misses += 1
        start = self._wall_start(after_s)
        if start is None:
            return None
        best: int | None = None
        try:
            for wall in CronSim(self.expr, start):
                lower, instants, _kind = self._map(wall)
                for t in instants:
                    if t > after_s and (best is None or t < best):
                        best = t
                # ``lower`` never decreases from one wall time to the next and bounds every
                # instant of later ones, so nothing later can undercut ``best``.
                if best is not None and lower >= best:
                    break
        except OverflowError:
            pass  # iteration ran past year 9999: no more fire times
        return best

    def _wall_start(self, after_s: int) -> datetime | None:
        """The wall time to iterate cron matches from (exclusive), or None past year 9999.

        Usually the wall time of ``after_s``. When that wall time is repeated by a fold and the
        policy can pick a later occurrence, earlier wall times of the fold can still map after
        ``after_s``, so start one fold-width earlier.
        """
        if after_s > _MAX_S:
            return None
        if after_s < _MIN_S:
            raise EngineUsageError("instant before year 1", field="after_ms")
        if self._utc:
            return _EPOCH_NAIVE + timedelta(seconds=after_s)
        zone = self.zone
        wall = (_EPOCH + timedelta(seconds=after_s)).astimezone(zone).replace(tzinfo=None)
        if self.dst_fold != "first":
            first = _offset_seconds(wall.replace(tzinfo=zone).utcoffset())
            second = _offset_seconds(wall.replace(tzinfo=zone, fold=1).utcoffset())
            if first > second:
                wall -= timedelta(seconds=first - second)
        return wall

    def _map(self, wall: datetime) -> tuple[int, tuple[int, ...], int]:
        """``(lower, instants, kind)`` of one matching wall time, instants in epoch seconds.

        ``lower`` is a bound on the instants of this and every later wall time under this rule's
        policy, non-decreasing in wall time: the instant itself for single-valued policies, the
        first occurrence under ``dst_fold="both"``, the transition for a skipped gap time.
        """
        base = _naive_seconds(wall)
        if self._utc:
            return base, (base,), _NORMAL
        zone = self.zone
        first = _offset_seconds(wall.replace(tzinfo=zone).utcoffset())
        second = _offset_seconds(wall.replace(tzinfo=zone, fold=1).utcoffset())
        if first == second:
            t = base - first
            return t, (t,), _NORMAL
        if first < second:
            # zoneinfo: in a gap, fold=0 applies the offset before the transition.
            transition = _gap_transition(wall, zone, first, second)
            return transition, ((transition,) if self.dst_gap == "shift" else ()), _GAP
        early, late = base - first, base - second
        if self.dst_fold == "first":
            return early, (early,), _FOLD
        if self.dst_fold == "last":
            return late, (late,), _FOLD
        return early, (early, late), _FOLD

    def walk(
        self, after_s: int
    ) -> Iterator[tuple[int, list[tuple[datetime, int]], list[datetime]]]:
        """Fire instants after ``after_s`` in order, with where they came from (for previews).

        Yields ``(instant, origins, skipped)``: ``origins`` lists the ``(wall, kind)`` pairs that
        map to the instant; ``skipped`` the gap wall times dropped (``dst_gap="skip"``) since the
        previous yield. The instants equal repeated :meth:`next_after_s`. Unbounded: the caller
        stops it.
        """
        start = self._wall_start(after_s)
        if start is None:
            return
        pending: dict[int, list[tuple[datetime, int]]] = {}
        skipped: list[tuple[int, datetime]] = []

        def flush(
            below: int | None,
        ) -> Iterator[tuple[int, list[tuple[datetime, int]], list[datetime]]]:
            for t in sorted(pending):
                if below is not None and t >= below:
                    break
                dropped = [w for (at, w) in skipped if at <= t]
                skipped[:] = [(at, w) for (at, w) in skipped if at > t]
                yield t, pending.pop(t), dropped

        try:
            for wall in CronSim(self.expr, start):
                lower, instants, kind = self._map(wall)
                yield from flush(lower)
                if kind == _GAP and not instants and lower > after_s:
                    skipped.append((lower, wall))
                for t in instants:
                    if t > after_s:
                        pending.setdefault(t, []).append((wall, kind))
        except OverflowError:
            pass
        yield from flush(None)


_RULES: weakref.WeakValueDictionary[tuple[str, str, str, str], CronRule] = (
    weakref.WeakValueDictionary()
)
# Jobs sharing a rule ask about the instants they all just fired at, so the working set is a
# few entries; the bound caps the worst case (a per-second rule queried for weeks) at about
# 100 KB per rule.
RULE_CACHE_MAX: Final = 1024
# A bounded memo rather than weak references (compiled classes take none): jobs created
# while an entry is held share its schedule; after a clear, new jobs start sharing again.
_CRON_SCHEDULES: dict[tuple[tuple[tuple[str, str], ...], int], CronSchedule] = {}
_CRON_SCHEDULES_LIMIT: Final = 4096


def _intern_rule(expr: str, tz: str, dst_gap: str, dst_fold: str) -> CronRule:
    key = (expr, tz, dst_gap, dst_fold)
    rule = _RULES.get(key)
    if rule is None:
        zone = _load_zone(tz)
        _validate_cron(expr)
        rule = CronRule(expr, tz, zone, dst_gap, dst_fold, RULE_CACHE_MAX)
        _RULES[key] = rule
    return rule


def interned_rule_count() -> int:
    """How many distinct cron rules are alive (held by at least one schedule)."""
    return len(_RULES)


def clear_caches() -> None:
    """Empty every rule's next-fire cache and the transition cache (benchmarks, tests)."""
    for rule in list(_RULES.values()):
        rule.clear_cache()
    _TRANSITIONS.clear()


def _normalize_cron(expr: object) -> str:
    if not isinstance(expr, str):
        raise ScheduleError(
            f"must be a cron expression string such as '30 2 * * *', got {type(expr).__name__}",
            field="schedule.cron",
        )
    if len(expr) > _MAX_CRON_LEN:
        raise ScheduleError(
            f"cron expression longer than {_MAX_CRON_LEN} characters", field="schedule.cron"
        )
    text = " ".join(expr.split())
    if not text:
        raise ScheduleError("empty cron expression", field="schedule.cron")
    if text.startswith("@"):
        alias = text.lower()
        if alias == "@reboot":
            raise ScheduleError(
                "@reboot is not supported: a scheduler has no boot of the job's host to run "
                "at; use 'at' for a one-off run",
                field="schedule.cron",
            )
        if alias not in CRON_ALIASES:
            raise ScheduleError(
                f"unknown cron alias {text!r}; known: {', '.join(CRON_ALIASES)}",
                field="schedule.cron",
            )
        return CRON_ALIASES[alias]
    fields = text.split(" ")
    if len(fields) not in (5, 6):
        raise ScheduleError(
            f"cron expression {expr!r} has {len(fields)} fields; expected 5 (minute hour "
            "day-of-month month day-of-week) or 6 with seconds first",
            field="schedule.cron",
        )
    return text.upper()


def _validate_cron(expr: str) -> None:
    try:
        next(CronSim(expr, _PROBE))
    except CronSimError as exc:
        never = _days_never_in_months(expr) if str(exc) == "Bad day-of-month" else None
        if never is not None:
            raise ScheduleError(never, field="schedule.cron") from None
        raise ScheduleError(f"{exc} in cron expression {expr!r}", field="schedule.cron") from None
    except StopIteration:
        raise ScheduleError(
            f"cron expression {expr!r} never matches", field="schedule.cron"
        ) from None


def _days_never_in_months(expr: str) -> str | None:
    """The message for a day-of-month that is valid alone but occurs in none of the months
    the expression names (``0 0 30 2 *``: February has no 30th), which cronsim reports as a
    bad day-of-month; None when the day-of-month is bad by itself."""
    fields = expr.split(" ")
    dom, month = (2, 3) if len(fields) == 5 else (3, 4)
    try:
        CronSim(" ".join([*fields[:month], "*", *fields[month + 1 :]]), _PROBE)
    except CronSimError:
        return None
    return (
        f"cron expression {expr!r} never matches: no month of {fields[month]!r} has day "
        f"{fields[dom]!r}"
    )


# --------------------------------------------------------------------------------------------
# Schedules


def _jitter_offset(jitter_ms: int | None, job_id: str | None) -> int:
    """The job's fixed delay in [0, jitter_ms): a stable hash, identical on every node."""
    if jitter_ms is None:
        return 0
    if job_id is None:
        raise ScheduleError(
            "jitter needs the job id, which picks the job's fixed delay", field="schedule.jitter"
        )
    digest = hashlib.blake2b(
        job_id.encode("utf-8"), digest_size=8, person=b"tickwheel.jitter"
    ).digest()
    return int.from_bytes(digest, "big") % jitter_ms


def _after_ms(value: object) -> int:
    if type(value) is int:  # the engine's every call (a Protocol check costs ~5 us)
        return value
    if not isinstance(value, SupportsIndex):
        raise EngineUsageError(
            f"must be integer milliseconds, got {type(value).__name__}", field="after_ms"
        )
    return operator.index(value)


class Schedule:
    """A validated schedule: when a job fires. Build with :func:`parse_schedule`.

    Immutable, hashable and comparable by its normalized spec plus the job's jitter delay, so
    the engine can intern equal schedules. :meth:`next_after` is pure: the same arguments give
    the same answer on every node, at any time.
    """

    __slots__ = ("_key", "_spec", "end_ms", "jitter_ms", "jitter_offset_ms")
    kind: ClassVar[str]

    def __init__(
        self, spec: dict[str, str], end_ms: int | None, jitter_ms: int | None, jitter_offset: int
    ) -> None:
        self._spec = spec
        self.end_ms = end_ms
        self.jitter_ms = jitter_ms
        self.jitter_offset_ms = jitter_offset
        self._key = (self.kind, tuple(sorted(spec.items())), jitter_offset)

    def next_after(self, after_ms: object) -> int | None:
        """The first fire time (ms) strictly after ``after_ms``; None once exhausted.

        Exhausted means: an ``at`` already passed, the next fire time would be after ``end``,
        or a cron expression without further matches. Never earlier than ``after_ms + 1``.
        Raises :class:`EngineUsageError` for a non-integer ``after_ms``.
        """
        raise NotImplementedError

    def next_after_uncached(self, after_ms: object) -> int | None:
        """:meth:`next_after` bypassing any cache (equal results; for benchmarks and checks)."""
        return self.next_after(after_ms)

    def to_spec(self) -> dict[str, str]:
        """The normalized spec: defaults filled in, instants in UTC, durations canonical.

        ``parse_schedule(s.to_spec(), job_id=...)`` equals ``s`` for the same job id.
        """
        return dict(self._spec)

    @property
    def tz(self) -> str:
        return "UTC"

    def _within_end(self, t: int) -> int | None:
        end = self.end_ms
        return None if end is not None and t > end else t

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        extra = f", jitter_offset_ms={self.jitter_offset_ms}" if self.jitter_ms else ""
        return f"{type(self).__name__}({self._spec!r}{extra})"

    def _describe(self) -> str:
        raise NotImplementedError

    def _describe_tail(self) -> str:
        parts: list[str] = []
        if self.jitter_ms:
            parts.append(
                f"each fire delayed by {self.jitter_offset_ms} ms (this job's fixed share of "
                f"the {format_duration(self.jitter_ms)} jitter)"
            )
        if self.end_ms is not None:
            parts.append(f"no fire after {format_utc(self.end_ms)}")
        return "".join(f"; {p}" for p in parts)


class CronSchedule(Schedule):
    """A cron expression in a zone; the work is done by its interned :class:`CronRule`."""

    __slots__ = ("rule",)
    kind = "cron"

    def __init__(
        self,
        spec: dict[str, str],
        rule: CronRule,
        end_ms: int | None,
        jitter_ms: int | None,
        jitter_offset: int,
    ) -> None:
        super().__init__(spec, end_ms, jitter_ms, jitter_offset)
        self.rule = rule

    @property
    def tz(self) -> str:
        return self.rule.tz

    def next_after(self, after_ms: object) -> int | None:
        # Fire times are whole seconds plus the job's fixed delay, so "after a" in ms is
        # "after floor((a - delay) / 1000)" in the rule's seconds.
        delay = self.jitter_offset_ms
        if type(after_ms) is int:
            key = (after_ms - delay) // 1000
        else:
            key = (_after_ms(after_ms) - delay) // 1000  # another integer, or the typed error
        # The cache probe is inlined: this is the engine's hot path, once per fire of every job.
        try:
            s = self.rule._cache[key]
        except KeyError:
            s = self.rule.next_after_s(key)
        if s is None:
            return None
        t = s * 1000 + delay
        end = self.end_ms
        if end is None:
            end = MAX_INSTANT_MS  # a jitter delay may carry the rule's last match past it
        return None if t > end else t

    def next_after_uncached(self, after_ms: object) -> int | None:
        delay = self.jitter_offset_ms
        s = self.rule.next_after_s_uncached((_after_ms(after_ms) - delay) // 1000)
        if s is None or s * 1000 + delay > MAX_INSTANT_MS:
            return None
        return self._within_end(s * 1000 + delay)

    def _describe(self) -> str:
        rule = self.rule
        try:
            words = CronSim(rule.expr, _PROBE).explain()
        except Exception:
            # explain() is best-effort prose; it must never make a valid schedule unpreviewable.
            words = f"Cron {rule.expr!r}"
        text = f"{words} ({rule.tz})"
        if not rule._utc:
            gap = "fire once at the end of the gap" if rule.dst_gap == "shift" else "are skipped"
            fold = {
                "first": "fire at their first occurrence",
                "last": "fire at their last occurrence",
                "both": "fire at both occurrences",
            }[rule.dst_fold]
            text += (
                f"; wall times that a spring-forward skips {gap}, wall times that a "
                f"fall-back repeats {fold}"
            )
        return text + self._describe_tail()


class AtSchedule(Schedule):
    """A single fire time."""

    __slots__ = ("at_ms",)
    kind = "at"

    def __init__(
        self,
        spec: dict[str, str],
        at_ms: int,
        end_ms: int | None,
        jitter_ms: int | None,
        jitter_offset: int,
    ) -> None:
        super().__init__(spec, end_ms, jitter_ms, jitter_offset)
        self.at_ms = at_ms

    def next_after(self, after_ms: object) -> int | None:
        t = self.at_ms + self.jitter_offset_ms
        return self._within_end(t) if t > _after_ms(after_ms) else None

    def _describe(self) -> str:
        return f"Once at {format_utc(self.at_ms)}" + self._describe_tail()


class EverySchedule(Schedule):
    """Fire times ``start + k * interval`` for k >= 0 (plus the job's jitter delay)."""

    __slots__ = ("interval_ms", "start_ms")
    kind = "every"

    def __init__(
        self,
        spec: dict[str, str],
        interval_ms: int,
        start_ms: int,
        end_ms: int | None,
        jitter_ms: int | None,
        jitter_offset: int,
    ) -> None:
        super().__init__(spec, end_ms, jitter_ms, jitter_offset)
        self.interval_ms = interval_ms
        self.start_ms = start_ms

    def next_after(self, after_ms: object) -> int | None:
        base = _after_ms(after_ms) - self.jitter_offset_ms
        start, interval = self.start_ms, self.interval_ms
        k = 0 if base < start else (base - start) // interval + 1
        t = start + k * interval + self.jitter_offset_ms
        if t > MAX_INSTANT_MS:
            return None  # exhausted: no fire time past the last instant a schedule may reach
        return self._within_end(t)

    def _describe(self) -> str:
        return (
            f"Every {format_duration(self.interval_ms)} from {format_utc(self.start_ms)}"
            + self._describe_tail()
        )


def _bounded(text: object, field: str, *, lower: bool = False) -> int:
    """:func:`parse_instant`, refusing an instant after ``MAX_INSTANT_MS`` and, with ``lower``
    (a fire time itself), before ``MIN_INSTANT_MS``; without it, before year 1 in UTC, which
    :func:`format_utc` would store as a text :func:`parse_instant` cannot read back (found by
    review: a ``start`` of 0001-01-01T00:00:00+14:00 was accepted, stored as year 0, and the
    node could not recover the shard). :class:`ScheduleError` naming ``field``."""
    ms = parse_instant(text, field=field)
    if not lower and ms < EARLIEST_STORABLE_MS:
        raise ScheduleError(
            f"{text!r} is before 0001-01-01T00:00:00Z in UTC, the earliest time a schedule "
            "can store",
            field=field,
        )
    if lower and ms < MIN_INSTANT_MS:
        raise ScheduleError(
            f"{format_utc(ms)} is before 1970-01-01T00:00:00Z, the earliest time a schedule "
            "may name",
            field=field,
        )
    if ms > MAX_INSTANT_MS:
        raise ScheduleError(
            f"{format_utc(ms)} is after {format_utc(MAX_INSTANT_MS)}, the latest time a "
            "schedule may name",
            field=field,
        )
    return ms


def _check_jitter_room(first_ms: int, jitter_ms: int | None, field: str) -> None:
    """Refuse a first fire time whose jitter delay (up to ``jitter_ms - 1``, whichever the job
    id draws) could land past ``MAX_INSTANT_MS``: validity must not depend on the id."""
    if jitter_ms is not None and first_ms + jitter_ms - 1 > MAX_INSTANT_MS:
        raise ScheduleError(
            f"{format_utc(first_ms)} plus a jitter of {format_duration(jitter_ms)} may be after "
            f"{format_utc(MAX_INSTANT_MS)}, the latest time a schedule may reach",
            field=field,
        )


def _choice(spec: Mapping[str, object], key: str, options: tuple[str, ...]) -> str:
    value = spec.get(key, options[0])
    if not isinstance(value, str) or value not in options:
        raise ScheduleError(
            f"must be one of {', '.join(repr(o) for o in options)}, got {value!r}",
            field=f"schedule.{key}",
        )
    return value


def parse_schedule(
    spec: object, *, created_ms: int | None = None, job_id: str | None = None
) -> Schedule:
    """Validate a schedule spec and return its :class:`Schedule`.

    ``spec`` is exactly one of ``{"cron": EXPR, "tz": ZONE, "dst_gap": ..., "dst_fold": ...}``,
    ``{"at": ISO8601}`` or ``{"every": DURATION, "start": ISO8601}``, each optionally with
    ``"end"`` (ISO 8601; no fire time after it, jitter included) and ``"jitter"`` (a duration;
    the job's fire times are all delayed by one amount in ``[0, jitter)`` picked by a stable
    hash of ``job_id``). ``created_ms`` is the default ``start`` of an ``every``.

    Raises :class:`ScheduleError` whose ``field`` names the culprit (``schedule`` for the spec
    as a whole, ``schedule.cron``, ``schedule.tz``...) for a non-dict or empty spec, unknown or
    misplaced keys, two kinds at once, wrong types, bad cron fields (cronsim's message kept),
    unknown zones, naive timestamps, bad durations, an ``end`` before the only or first fire
    time, and jitter without a job id. Cost: O(len(spec)) plus, for a cron rule not yet
    interned, one cronsim parse and zone load.
    """
    if not isinstance(spec, Mapping):
        raise ScheduleError(
            f"must be an object with one of {', '.join(KINDS)}, got {type(spec).__name__}",
            field="schedule",
        )
    if not spec:
        raise ScheduleError(f"empty schedule: give one of {', '.join(KINDS)}", field="schedule")
    for key in spec:
        if key not in _ALL_KEYS:
            raise ScheduleError(
                f"unknown key {key!r}; known keys: {', '.join(sorted(_ALL_KEYS))}",
                field=f"schedule.{key}",
            )
    kinds = [k for k in KINDS if k in spec]
    if not kinds:
        raise ScheduleError(
            f"one of {', '.join(KINDS)} is required, got only {', '.join(map(repr, spec))}",
            field="schedule",
        )
    if len(kinds) > 1:
        raise ScheduleError(
            f"give only one of {', '.join(KINDS)}; got {' and '.join(kinds)}",
            field=f"schedule.{kinds[1]}",
        )
    kind = kinds[0]
    for key in spec:
        if key not in KEYS_BY_KIND[kind]:
            owners = [k for k in KINDS if key in KEYS_BY_KIND[k]]
            raise ScheduleError(
                f"{key!r} applies only to {' and '.join(owners)} schedules, not {kind}",
                field=f"schedule.{key}",
            )
    if job_id is not None and not isinstance(job_id, str):
        raise EngineUsageError(f"must be a string, got {type(job_id).__name__}", field="job_id")

    end_ms = _bounded(spec["end"], "schedule.end") if "end" in spec else None
    jitter_ms = (
        parse_duration(spec["jitter"], field="schedule.jitter") if "jitter" in spec else None
    )
    offset = _jitter_offset(jitter_ms, job_id)
    tail: dict[str, str] = {}
    if end_ms is not None:
        tail["end"] = format_utc(end_ms)
    if jitter_ms is not None:
        tail["jitter"] = format_duration(jitter_ms)

    if kind == "cron":
        expr = _normalize_cron(spec["cron"])
        tz = spec.get("tz", "UTC")
        if not isinstance(tz, str):
            raise ScheduleError(
                f"must be an IANA time zone name such as 'Europe/Berlin', got {type(tz).__name__}",
                field="schedule.tz",
            )
        gap = _choice(spec, "dst_gap", DST_GAP_POLICIES)
        fold = _choice(spec, "dst_fold", DST_FOLD_POLICIES)
        normalized = {"cron": expr, "tz": tz, "dst_gap": gap, "dst_fold": fold, **tail}
        # Jobs sharing a cron spec share one schedule object too: less memory, and the hot
        # next_after path touches a few thousand objects instead of one per job.
        key = (tuple(normalized.items()), offset)
        shared = _CRON_SCHEDULES.get(key)
        if shared is None:
            rule = _intern_rule(expr, tz, gap, fold)
            shared = CronSchedule(normalized, rule, end_ms, jitter_ms, offset)
            remember(_CRON_SCHEDULES, key, shared, _CRON_SCHEDULES_LIMIT)
        return shared

    if kind == "at":
        at_ms = _bounded(spec["at"], "schedule.at", lower=True)
        _check_jitter_room(at_ms, jitter_ms, "schedule.at")
        if end_ms is not None and end_ms < at_ms:
            raise ScheduleError(
                f"end {format_utc(end_ms)} is before at {format_utc(at_ms)}", field="schedule.end"
            )
        return AtSchedule({"at": format_utc(at_ms), **tail}, at_ms, end_ms, jitter_ms, offset)

    interval = parse_duration(spec["every"], field="schedule.every")
    if "start" in spec:
        start_ms = _bounded(spec["start"], "schedule.start")
    elif created_ms is not None:
        if isinstance(created_ms, bool) or not isinstance(created_ms, int):
            raise EngineUsageError("must be integer milliseconds", field="created_ms")
        start_ms = created_ms
    else:
        raise ScheduleError(
            "an every schedule needs a start: give schedule.start, or let the engine default "
            "it to the job's creation time",
            field="schedule.start",
        )
    _check_jitter_room(start_ms, jitter_ms, "schedule.start")
    if end_ms is not None and end_ms < start_ms:
        raise ScheduleError(
            f"end {format_utc(end_ms)} is before start {format_utc(start_ms)}",
            field="schedule.end",
        )
    normalized = {"every": format_duration(interval), "start": format_utc(start_ms), **tail}
    return EverySchedule(normalized, interval, start_ms, end_ms, jitter_ms, offset)


# --------------------------------------------------------------------------------------------
# Previews

MAX_PREVIEW: Final = 1000


@dataclass(frozen=True)
class FireTime:
    """One previewed fire time: the instant, its UTC and local renderings, and a DST note."""

    at_ms: int
    utc: str
    local: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"at_ms": self.at_ms, "utc": self.utc, "local": self.local, "note": self.note}


@dataclass(frozen=True)
class Preview:
    """The next fire times of a spec, with the spec explained in words."""

    kind: str
    spec: dict[str, str]
    tz: str
    description: str
    fires: tuple[FireTime, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: kind, spec, tz, description, fires (each a dict)."""
        return {
            "kind": self.kind,
            "spec": dict(self.spec),
            "tz": self.tz,
            "description": self.description,
            "fires": [f.to_dict() for f in self.fires],
        }


def preview(
    spec: object,
    count: object,
    after_ms: object,
    *,
    job_id: str | None = None,
    created_ms: int | None = None,
) -> Preview:
    """The next ``count`` fire times strictly after ``after_ms``, explained for people.

    Fewer than ``count`` when the schedule runs out. Each cron fire carries a note where DST
    moved it: a shifted gap time, the occurrence picked in a fold, or gap times skipped since
    the previous fire. Raises :class:`ScheduleError` as :func:`parse_schedule` does, and
    :class:`EngineUsageError` (field ``count``) unless ``1 <= count <= 1000``. O(count) fire
    time computations, uncached.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PREVIEW:
        raise EngineUsageError(
            f"must be an integer in 1..{MAX_PREVIEW}, got {count!r}", field="count"
        )
    after = _after_ms(after_ms)
    schedule = parse_schedule(spec, created_ms=created_ms, job_id=job_id)
    fires: list[FireTime] = []
    if isinstance(schedule, CronSchedule):
        rule, delay = schedule.rule, schedule.jitter_offset_ms
        for s, origins, skipped in rule.walk((after - delay) // 1000):
            t = s * 1000 + delay
            if schedule.end_ms is not None and t > schedule.end_ms:
                break
            note = _note(rule, s, origins, skipped)
            fires.append(FireTime(t, format_utc(t), _format_local(t, rule.zone), note))
            if len(fires) == count:
                break
    else:
        t_or_none = schedule.next_after(after)
        utc = ZoneInfo("UTC")
        while t_or_none is not None and len(fires) < count:
            fires.append(FireTime(t_or_none, format_utc(t_or_none), _format_local(t_or_none, utc)))
            t_or_none = schedule.next_after(t_or_none)
    return Preview(
        schedule.kind, schedule.to_spec(), schedule.tz, schedule._describe(), tuple(fires)
    )


def _list_walls(walls: list[datetime]) -> str:
    texts = [_hhmm(w) for w in walls]
    if len(texts) > 4:
        return f"{texts[0]} to {texts[-1]} ({len(texts)} wall times)"
    if len(texts) == 1:
        return texts[0]
    return ", ".join(texts[:-1]) + f" and {texts[-1]}"


def _note(
    rule: CronRule, instant: int, origins: list[tuple[datetime, int]], skipped: list[datetime]
) -> str | None:
    notes: list[str] = []
    zone, tz = rule.zone, rule.tz
    if skipped:
        day = skipped[0].date().isoformat()
        verb = "was" if len(skipped) == 1 else "were"
        notes.append(
            f"{_list_walls(skipped)} on {day} {verb} skipped: "
            f"{'it does' if len(skipped) == 1 else 'they do'} not exist in {tz} "
            "(clocks sprang forward; dst_gap=skip)"
        )
    gap_walls = [w for w, kind in origins if kind == _GAP]
    if gap_walls:
        day = gap_walls[0].date().isoformat()
        exists = "does not exist" if len(gap_walls) == 1 else "do not exist"
        # "once" tells the reader that several wall times (or a regular one) merged here.
        once = " once" if len(gap_walls) > 1 or any(k == _NORMAL for _, k in origins) else ""
        notes.append(
            f"{_list_walls(gap_walls)} {exists} on {day} in {tz} (clocks sprang forward); "
            f"fired{once} at {_short_local(instant, zone)}"
        )
    for wall, kind in origins:
        if kind != _FOLD:
            continue
        fire = (_EPOCH + timedelta(seconds=instant)).astimezone(zone)
        occurrence = "first" if fire.fold == 0 else "last"
        if rule.dst_fold == "both":
            which = f"fires at both, this is the {occurrence} occurrence"
        else:
            which = f"{occurrence} occurrence"
        notes.append(
            f"{_hhmm(wall)} occurs twice on {wall.date().isoformat()} in {tz} "
            f"(clocks fell back); {which} ({fire.tzname()})"
        )
    return "; ".join(notes) if notes else None
