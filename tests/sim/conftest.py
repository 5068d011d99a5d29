"""A small cluster with every fault, sized so that the whole of tests/sim stays within a few
minutes on two cores: 150 jobs over half an hour, then a five-minute drain; snapshots every
40 durable batches, so that new owners recover from snapshot + tail here too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.config import SimConfig
from sim.names import FAULTS

SMALL = SimConfig(
    jobs=150,
    hours=0.5,
    drain_ms=5 * 60_000,
    faults=frozenset(FAULTS),
    samples=False,
    snapshot_every=40,
)


@pytest.fixture
def small() -> SimConfig:
    return replace(SMALL)
