"""``tickwheel bench schedules``: next fire times of many cron jobs, cached vs uncached.

Owns the workload (1,000 distinct cron expressions in a realistic mix, in three zones, spread
over N jobs) and how its figures are timed: spec parsing, a cold-cache pass asking every job for
its next fire time after one fixed instant, a warm pass asking for the fire after that one, and
the uncached cost on a sample beside them. Must never judge the figures: it prints them with the
uncached anchor measured in the same run.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench.common import Metric, SuiteResult, rate
from engine.schedules import (
    CronSchedule,
    Schedule,
    clear_caches,
    format_utc,
    interned_rule_count,
    parse_instant,
    parse_schedule,
)

DEFAULT_JOBS = 300_000
EXPRESSIONS = 1_000
ZONES = ("UTC", "America/New_York", "Australia/Sydney")
UNCACHED_SAMPLE = 3_000
# A fixed "now" keeps runs comparable; an odd millisecond avoids flattering aligned queries.
NOW_MS = parse_instant("2026-03-07T10:17:23.456Z", field="now")
SEED = 20260307


def cron_expressions(count: int = EXPRESSIONS, *, seed: int = SEED) -> list[str]:
    """``count`` distinct cron expressions in a mix resembling real crontabs, deterministically.

    Fixed daily times dominate, then weekday jobs, hourly-at-minute-M, every-N-minutes, business
    hours, month ends (``L``, ``LW``), last weekday of the month (``5L``), nth weekday (``1#2``),
    fixed days of the month and a few 6-field expressions with seconds.
    """
    rng = random.Random(seed)
    steps = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30)

    def fixed() -> str:
        return f"{rng.randrange(60)} {rng.randrange(24)} * * *"

    def weekdays() -> str:
        return f"{rng.randrange(60)} {rng.randrange(24)} * * {rng.choice(['1-5', 'MON-FRI', '1', '5', '0,6'])}"

    def hourly() -> str:
        return f"{rng.randrange(60)} * * * *"

    def every_n() -> str:
        n = rng.choice(steps)
        offset = rng.randrange(n)
        return f"*/{n} * * * *" if offset == 0 else f"{offset}-59/{n} * * * *"

    def business() -> str:
        start = rng.randrange(6, 11)
        return f"*/{rng.choice(steps[3:])} {start}-{start + 8} * * 1-5"

    def month_end() -> str:
        return f"{rng.randrange(60)} {rng.randrange(24)} {rng.choice(['L', 'LW'])} * *"

    def last_weekday() -> str:
        return f"{rng.randrange(60)} {rng.randrange(24)} * * {rng.randrange(7)}L"

    def nth_weekday() -> str:
        return (
            f"{rng.randrange(60)} {rng.randrange(24)} * * {rng.randrange(7)}#{rng.randrange(1, 5)}"
        )

    def monthly() -> str:
        return f"{rng.randrange(60)} {rng.randrange(24)} {rng.randrange(1, 29)} * *"

    def seconds() -> str:
        return f"{rng.randrange(60)} {rng.randrange(60)} {rng.randrange(24)} * * *"

    kinds = (
        fixed,
        weekdays,
        hourly,
        every_n,
        business,
        month_end,
        last_weekday,
        nth_weekday,
        monthly,
        seconds,
    )
    weights = (30, 18, 8, 6, 6, 8, 6, 8, 6, 4)
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen.setdefault(rng.choices(kinds, weights)[0](), None)
    return list(seen)


def _specs(jobs: int, expressions: list[str]) -> list[dict[str, Any]]:
    combos = [{"cron": expr, "tz": tz} for expr in expressions for tz in ZONES]
    # Round-robin: every (expression, zone) pair gets jobs / 3000 jobs, none is favoured.
    return [combos[j % len(combos)] for j in range(jobs)]


def run(args: argparse.Namespace) -> SuiteResult:
    """Time parsing and next-fire computation of ``args.jobs`` cron jobs (default 300,000)."""
    jobs = getattr(args, "jobs", None) or DEFAULT_JOBS
    expressions = cron_expressions()
    specs = _specs(jobs, expressions)
    params = {"jobs": jobs, "expressions": len(expressions), "zones": len(ZONES)}
    result = SuiteResult("schedules")

    schedules: list[Schedule] = []

    def parse_all() -> None:
        schedules.extend(parse_schedule(spec) for spec in specs)

    parse_rate = rate(jobs, parse_all)
    rules = interned_rule_count()
    result.add(Metric("parse_per_s", parse_rate, "specs/s", dict(params)))

    clear_caches()
    firsts: list[int | None] = []
    cold_rate = rate(jobs, lambda: firsts.extend(s.next_after(NOW_MS) for s in schedules))
    cold_misses = _misses(schedules)

    after = [NOW_MS if f is None else f for f in firsts]
    seconds: list[int | None] = []
    warm_rate = rate(
        jobs, lambda: seconds.extend(s.next_after(a) for s, a in zip(schedules, after, strict=True))
    )
    warm_misses = _misses(schedules) - cold_misses

    # A seeded random sample: a strided one would hit only a few of the round-robin rules.
    sample = sorted(random.Random(SEED).sample(range(jobs), min(jobs, UNCACHED_SAMPLE)))
    sampled = [schedules[i] for i in sample]
    # The anchor of each pass asks the same questions as that pass, without the cache.
    anchors: dict[str, float] = {}
    for mode, queries, cached in (("cold", None, firsts), ("warm", after, seconds)):
        got: list[int | None] = []

        def uncached_pass(queries: list[int] | None = queries, got: list[int | None] = got) -> None:
            got.clear()
            if queries is None:
                got.extend(s.next_after_uncached(NOW_MS) for s in sampled)
            else:
                got.extend(sampled[k].next_after_uncached(queries[i]) for k, i in enumerate(sample))

        anchors[mode] = rate(len(sampled), uncached_pass, repeat=3)
        wrong = sum(1 for i, u in zip(sample, got, strict=True) if cached[i] != u)
        if wrong:
            raise AssertionError(f"{mode}: {wrong} cached next fire times differ from uncached")

    for mode, value in (("cold", cold_rate), ("warm", warm_rate)):
        result.add(
            Metric(
                "cron_next_fire_per_s",
                value,
                "jobs/s",
                {**params, "mode": f"cached-{mode}"},
                anchor="uncached",
                anchor_value=anchors[mode],
            )
        )
    for mode in ("cold", "warm"):
        result.add(
            Metric(
                "cron_next_fire_per_s",
                anchors[mode],
                "jobs/s",
                {**params, "mode": f"uncached-{mode}", "sample": len(sampled)},
            )
        )
    for mode, value in (("cold", cold_rate), ("warm", warm_rate)):
        result.add(
            Metric(
                "cron_next_fire_total_s",
                jobs / value,
                "s",
                {**params, "mode": f"cached-{mode}"},
                anchor="uncached (extrapolated)",
                anchor_value=jobs / anchors[mode],
            )
        )
    result.notes.extend(
        [
            f"now = {format_utc(NOW_MS)} (fixed); {rules} interned cron rules for {jobs} jobs",
            f"cold pass: next fire after now, {cold_misses} cache misses; warm pass: the fire "
            f"after each job's previous one, {warm_misses} misses",
            f"uncached anchors: the same questions for {len(sampled)} sampled jobs, best of 3; "
            "their answers are checked equal to the cached ones",
        ]
    )
    return result


def _misses(schedules: list[Schedule]) -> int:
    rules = {id(s.rule): s.rule for s in schedules if isinstance(s, CronSchedule)}
    return sum(r.misses for r in rules.values())
