"""What crosses process boundaries (the simulation's pool sends configs out and results back)
pickles, compiled or not: a compiled frozen dataclass has no ``__dict__`` for pickle to fill
and refuses ``__setattr__``, so these classes rebuild themselves through ``__init__``."""

from __future__ import annotations

import pickle

from engine.lease import LeaseConfig
from engine.shard import EngineConfig
from sim.checks import Violation
from sim.config import SimConfig


def test_configs_and_violations_survive_pickling() -> None:
    engine = EngineConfig(worker_lease_ms=12_345, reattach_grace_ms=23_456)
    lease = LeaseConfig(ttl_ms=7_000, mutants=frozenset({"no-self-fence"}))
    violation = Violation("double", "run r ran twice", ("r", "w1"))
    for value in (engine, lease, violation, SimConfig(seed=5, mutant="no-self-fence")):
        assert pickle.loads(pickle.dumps(value)) == value
