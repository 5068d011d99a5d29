"""Teeth: each guard switched off is caught, and the run stops at the first violating seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.config import SimConfig
from sim.names import MUTANTS
from sim.runner import run_seeds
from tests.sim.conftest import SMALL

#: The checks each mutant is expected to trip (any of them).
EXPECTED = {
    "claim-after-fire": {"at-most-once-executed-twice"},
    "no-epoch-fence": {"stale-write-accepted", "interleaved-epochs", "stale-dispatch-accepted"},
    "no-self-fence": {"acted-after-lease"},
    "no-redispatch": {"stuck-run"},
    "report-ack-before-durable": {"acknowledged-report"},
    "no-stop-wait": {"at-most-once-executed-twice"},
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_mutant_is_caught_within_200_seeds(mutant: str) -> None:
    summary = run_seeds(replace(SMALL, mutant=mutant), 200, procs=2)
    assert summary.stopped_at is not None, f"{mutant} was not caught in 200 seeds"
    assert summary.seeds_run == summary.stopped_at - SMALL.seed + 1  # stopped right there
    checks = {v["check"] for v in summary.violations}
    assert checks & EXPECTED[mutant], checks
    assert all(v["seed"] == summary.stopped_at for v in summary.violations)
    assert summary.violations[0]["trace"], "a violation comes with a trace excerpt"


def test_the_mutant_names_match_the_guards() -> None:
    from engine.lease import FENCE_MUTANTS, LEASE_MUTANTS
    from engine.shard import ENGINE_MUTANTS

    assert set(MUTANTS) == set(EXPECTED) == ENGINE_MUTANTS | LEASE_MUTANTS | FENCE_MUTANTS
    with pytest.raises(ValueError):
        SimConfig(mutant="no-such-guard")
