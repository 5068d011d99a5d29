"""The names the CLI offers, in a module that imports nothing (``tickwheel`` builds its parser
on every call, so ``sim.cli`` must not pull in SimPy or the engine to list them)."""

from __future__ import annotations

#: Fault kinds, in the order the CLI lists them.
FAULTS: tuple[str, ...] = (
    "crash",
    "pause",
    "skew",
    "partition",
    "burst",
    "worker-crash",
    "slow-disk",
)
#: Guards that can be switched off, each in the module that owns the guard.
MUTANTS: tuple[str, ...] = (
    "claim-after-fire",
    "no-epoch-fence",
    "no-self-fence",
    "no-redispatch",
    "report-ack-before-durable",
    "no-stop-wait",
    "no-worker-fence",
    "lose-fire",
    "eager-catchup",
    "alo-lost",
    "retry-no-backoff",
    "unpinned",
    "amo-no-grace",
    "no-trigger",
    "trigger-no-dedupe",
)
