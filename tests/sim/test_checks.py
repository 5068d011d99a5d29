"""Check 8 on hand-made ground truth (and check 9 on a real seed's logs, edited): two attempts of an at-least-once run executing at once
is a violation, but for the crash window DESIGN.md leaves open (the next owner could not know
of the earlier attempt: no record of its token was durable when the later one started)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sim.checks import Execution, Violation, _check_triggers, alo_overlaps
from sim.world import World
from tests.sim.conftest import SMALL


def token(epoch: int, n: int) -> int:
    return epoch << 32 | n


def execution(tok: int, start: int, end: int | None, attempt: int) -> Execution:
    return Execution(
        worker=f"w{attempt}",
        shard=0,
        run_id="job-1@1000",
        attempt=attempt,
        token=tok,
        delivery="at_least_once",
        scheduled_ms=1000,
        start=start,
        end=end,
        outcome=None if end is None else "killed",
    )


def claim(tok: int, durable_at: int) -> dict[tuple[int, int], int]:
    """The attempt ``tok`` of shard 0 became known (a durable record) at ``durable_at``."""
    return {(0, tok): durable_at}


def violations(executions: list[Execution], known: dict[tuple[int, int], int]) -> list[Violation]:
    return alo_overlaps({"job-1@1000": executions}, known)


def test_attempts_one_after_the_other_hold() -> None:
    a, b = token(1, 1), token(1, 2)
    assert violations([execution(a, 0, 500, 1), execution(b, 500, 900, 2)], claim(a, 1)) == []


def test_an_overlap_under_one_owner_is_a_violation() -> None:
    a, b = token(1, 1), token(1, 2)
    found = violations([execution(a, 0, 600, 1), execution(b, 500, 900, 2)], {})
    assert [v.check for v in found] == ["at-least-once-attempts-overlap"]


def test_an_overlap_with_an_attempt_the_next_owner_knew_of_is_a_violation() -> None:
    a, b = token(1, 1), token(2, 1)
    found = violations([execution(a, 0, None, 1), execution(b, 500, 900, 2)], claim(a, 10))
    assert [v.check for v in found] == ["at-least-once-attempts-overlap"]


def test_an_overlap_in_the_crash_window_is_not() -> None:
    a, b = token(1, 1), token(2, 1)
    # The claim never became durable, or only after the next owner sent the run again.
    assert violations([execution(a, 0, 520, 1), execution(b, 500, 900, 2)], {}) == []
    assert violations([execution(a, 0, 520, 1), execution(b, 500, 900, 2)], claim(a, 700)) == []


def test_an_attempt_exempt_against_one_is_still_judged_against_the_next() -> None:
    """a ran on past b (the crash window) and past c, which its next owner started after a's
    claim had become durable: (a, c) is an overlap, though b ended before c started (found by
    review: only neighbours were compared)."""
    a, b, c = token(1, 1), token(2, 1), token(2, 2)
    found = violations(
        [execution(a, 0, 1000, 1), execution(b, 10, 20, 2), execution(c, 500, 600, 3)],
        claim(a, 100),
    )
    assert [v.check for v in found] == ["at-least-once-attempts-overlap"]
    assert "attempt 1" in found[0].message and "attempt 3" in found[0].message


# Check 9 on a real seed's logs, edited after the run: what a lost trigger or a lost
# registration leaves behind is seen (the mutants no-trigger and trigger-no-dedupe cover the
# sending side and the repeats; no mutant drops a delivery, so these edits do).


def _seed_world(seed: int) -> World:
    world = World(replace(SMALL, seed=seed))
    result = world.run()
    assert result.violations == []
    return world


def _checked(world: World) -> list[str]:
    out: list[Violation] = []
    _check_triggers(world, out)
    return [v.check for v in out]


def _drop(world: World, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Remove the durable records ``keep`` refuses (fire records are kept whole)."""
    dropped = 0
    for store in world.stores:
        for batch in store.batches:
            kept = tuple(r for r in batch.records if keep(r))
            dropped += len(batch.records) - len(kept)
            batch.records = kept
    return dropped


def test_a_trigger_that_left_nothing_in_its_target_is_seen() -> None:
    world = _seed_world(3)
    assert _checked(world) == []
    sources = {
        r["src"]
        for store in world.stores
        for batch in store.batches
        for r in batch.records
        if r["t"] in ("run", "skip") and r.get("src") is not None
    }
    assert sources
    assert _drop(world, lambda r: not (r["t"] in ("run", "skip") and r.get("src") in sources))
    assert "trigger-lost" in _checked(world)


def test_a_registration_that_never_reached_its_upstream_is_seen() -> None:
    world = _seed_world(3)
    assert _drop(world, lambda r: r["t"] != "dep")
    assert "dependency-not-registered" in _checked(world)
