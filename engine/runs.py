"""Runs: their states, the one table of legal transitions, run ids and fencing tokens.

Owns what a run *is* (job id + scheduled time, an attempt, the fencing token of that attempt) and
which state changes are legal (DESIGN.md, "Delivery semantics: states and crash windows"). Every
state change anywhere in the engine goes through :func:`transition`, so the contract lives in one
place, h11-style. Must never decide *when* a transition happens: that is the shard engine's job.
"""

from __future__ import annotations

import enum
import re
from typing import Final

from engine.errors import EngineStateError, EngineUsageError, IllegalTransition


class RunState(enum.StrEnum):
    PENDING = "PENDING"  # fired, durable, waiting for a worker
    CLAIMED = "CLAIMED"  # handed to a worker with a fencing token
    RUNNING = "RUNNING"  # the worker reported the start
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    LOST = "LOST"  # at-most-once only: outcome unknown after the lease and the reattach grace
    SKIPPED = "SKIPPED"  # a fire time not run on purpose (overlap, catch-up, paused)
    CANCELLED = "CANCELLED"  # cancelled before it started, or stopped by cancel_previous


class RunEvent(enum.StrEnum):
    CLAIM = "claim"  # a worker pulled it
    START = "start"  # the worker reported the start
    SUCCEED = "succeed"  # exit code 0
    FAIL = "fail"  # non-zero exit, or the task could not start
    TIME_OUT = "time_out"  # the worker's or the node's timeout
    REQUEUE = "requeue"  # at-least-once: lease lapsed or node restarted; goes out again
    LOSE = "lose"  # at-most-once: lease and reattach grace lapsed; never sent again
    SKIP = "skip"
    CANCEL = "cancel"
    RETRY = "retry"  # a new attempt after a final failure, PENDING at its backoff time


S, E = RunState, RunEvent

#: (state, event) -> next state. Anything not listed is illegal.
TRANSITIONS: Final[dict[tuple[RunState, RunEvent], RunState]] = {
    (S.PENDING, E.CLAIM): S.CLAIMED,
    (S.PENDING, E.SKIP): S.SKIPPED,
    (S.PENDING, E.CANCEL): S.CANCELLED,
    (S.CLAIMED, E.START): S.RUNNING,
    (S.CLAIMED, E.SUCCEED): S.SUCCESS,
    (S.CLAIMED, E.FAIL): S.FAILED,
    (S.CLAIMED, E.TIME_OUT): S.TIMED_OUT,
    (S.CLAIMED, E.REQUEUE): S.PENDING,
    (S.CLAIMED, E.LOSE): S.LOST,
    (S.CLAIMED, E.CANCEL): S.CANCELLED,
    (S.RUNNING, E.SUCCEED): S.SUCCESS,
    (S.RUNNING, E.FAIL): S.FAILED,
    (S.RUNNING, E.TIME_OUT): S.TIMED_OUT,
    (S.RUNNING, E.REQUEUE): S.PENDING,
    (S.RUNNING, E.LOSE): S.LOST,
    (S.RUNNING, E.CANCEL): S.CANCELLED,
    (S.FAILED, E.RETRY): S.PENDING,
    (S.TIMED_OUT, E.RETRY): S.PENDING,
}

#: States a run never leaves on its own (a retry is a new attempt of the same run id).
FINAL_STATES: Final = frozenset({S.SUCCESS, S.FAILED, S.TIMED_OUT, S.LOST, S.SKIPPED, S.CANCELLED})
#: States in which a worker may hold the run.
IN_FLIGHT_STATES: Final = frozenset({S.CLAIMED, S.RUNNING})
# The same sets by value, asked as ``state._value_ in ...``: an enum member hashes, and its
# ``.value`` property resolves, through Python code, its ``_value_`` attribute in C; the
# engine asks these on every fire.
FINAL_VALUES: Final = frozenset(s.value for s in FINAL_STATES)
IN_FLIGHT_VALUES: Final = frozenset(s.value for s in IN_FLIGHT_STATES)


def transition(state: RunState, event: RunEvent) -> RunState:
    """The state after ``event`` in ``state``; raises :class:`IllegalTransition` otherwise."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"run in {state} cannot take {event}") from None


# ---------------------------------------------------------------------------- run ids

#: (matched whole with fullmatch: ``$`` also matches before a final newline, and
#: ``"j@1\n"`` was taken for ``j@1``, found by review). The time in canonical digits only, no
#: leading zero: ``j@01`` named the run ``j@1`` under another string, which the node's caches
#: keyed by the text did not know (found by review).
_RUN_ID_RE: Final = re.compile(r"(?P<job>[A-Za-z0-9._:-]{1,200})@(?P<ms>0|[1-9][0-9]{0,18})")


def run_id(job_id: str, scheduled_ms: int) -> str:
    """The run id: job id and scheduled time, so that firing twice creates one run.

    It is also the task's idempotency key: retries and re-dispatches keep it.
    """
    return f"{job_id}@{scheduled_ms}"


def parse_run_id(text: str) -> tuple[str, int]:
    """``(job_id, scheduled_ms)`` of a run id; :class:`EngineUsageError` when malformed."""
    match = _RUN_ID_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise EngineUsageError(f"not a run id (JOB_ID@MS): {text!r}", field="run_id")
    ms = int(match["ms"])
    if ms >= 1 << 63:  # (19 digits reach past it: no run is scheduled there)
        raise EngineUsageError(
            f"not a run id: its time {ms} is past 2**63-1 ms: {text!r}", field="run_id"
        )
    return match["job"], ms


# ---------------------------------------------------------------------------- fencing tokens

#: A token is (epoch << 32) | counter: one integer a task compares, growing across epochs.
_COUNTER_BITS: Final = 32
_COUNTER_MASK: Final = (1 << _COUNTER_BITS) - 1


def fencing_token(epoch: int, counter: int) -> int:
    """The token of the ``counter``-th dispatch in ``epoch``. Later epochs always compare
    greater, so a task can refuse a zombie attempt by remembering the largest token it saw."""
    if not 0 <= counter <= _COUNTER_MASK:
        raise EngineStateError(f"fencing counter {counter} out of range in epoch {epoch}")
    if epoch < 0:
        raise EngineStateError(f"negative epoch {epoch}")
    return (epoch << _COUNTER_BITS) | counter


def token_epoch(token: int) -> int:
    """The shard epoch a token was issued in."""
    return token >> _COUNTER_BITS
