"""About fifty seeds of a small cluster with every fault: every check holds on each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.config import SimConfig
from sim.runner import run_seeds
from tests.sim.conftest import SMALL


@pytest.mark.slow
@pytest.mark.parametrize("first", [1, 11, 21, 31, 41])
def test_ten_seeds_with_every_fault_hold(first: int) -> None:
    summary = run_seeds(replace(SMALL, seed=first), 10)
    assert summary.seeds_run == 10
    assert summary.violations == [], [
        (v["seed"], v["check"], v["message"], v["trace"][-10:]) for v in summary.violations
    ]
    assert summary.runs > 0 and summary.executions >= summary.runs // 2
    assert summary.missed == summary.double_executed == summary.early == summary.stuck == 0


def test_faults_really_happen(small: SimConfig) -> None:
    """A seed of the small cluster sees every kind of fault at least once."""
    from sim.world import run_seed

    kinds: set[str] = set()
    for seed in (1, 2, 3):
        result = run_seed(replace(small, seed=seed))
        kinds |= {
            kind.split("-")[0] if kind.startswith(("skew", "partition")) else kind
            for _s, _e, kind, _t in result.faults
        }
        assert result.stats["epochs"] > small.shard_count  # shards changed owner
    assert {"crash", "pause", "worker-crash", "skew", "partition", "slow-disk"} <= kinds | {
        "crash"
    } and ("crash" in kinds or "crash-writing" in kinds)
