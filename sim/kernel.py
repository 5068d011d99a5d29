"""The simulation's bare machinery: simulated time, callbacks, seeded randomness, the trace.

Owns how everything else schedules work (:meth:`Kernel.later`, on SimPy's event queue, whose
order for equal times is insertion order, hence deterministic), how each part gets its own
random stream (``random.Random`` seeded from the run's seed and the part's name, never the
global one), and the trace: a hash over every line (``trace_hash``), the last lines for an
excerpt, and, on a re-run, the lines that name what a violation is about. Must never make a
decision about the cluster: that is the engine's, and the drivers' (``sim.node`` ...).
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Callable
from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL


class Trace:
    """Every notable event, as one line ``"<ms> <kind> <fields...>"``.

    All lines feed a blake2b hash, so the same seed and options give the same ``digest``
    (and a changed behaviour a different one). Only the last ``keep`` lines are kept, plus,
    when ``focus`` is set, every line containing one of its strings (a re-run of a violating
    seed keeps what the violation is about). Cost: one f-string and one hash update per line.
    """

    __slots__ = ("_env", "_hash", "focus", "focused", "lines", "recent")

    def __init__(self, env: simpy.Environment, *, keep: int, focus: frozenset[str]) -> None:
        self._env = env
        self._hash = hashlib.blake2b(digest_size=16)
        self.recent: deque[str] = deque(maxlen=keep)
        self.focus = tuple(sorted(focus))
        self.focused: list[str] = []
        self.lines = 0

    def __call__(self, kind: str, *fields: object) -> None:
        line = f"{self._env._now} {kind} {' '.join(map(str, fields))}"
        self._hash.update(f"{line}\n".encode())  # the same digest as line, then newline
        self.lines += 1
        self.recent.append(line)
        if self.focus and any(f in line for f in self.focus):
            self.focused.append(line)

    def digest(self) -> str:
        return self._hash.hexdigest()


class _Call(simpy.Event):
    """An already triggered event whose value is the call to make when it is processed."""


def _run_call(event: simpy.Event) -> None:
    fn, args = event._value
    fn(*args)


class Kernel:
    """Simulated time in integer ms since T0, callbacks at later times, random streams."""

    __slots__ = ("env", "seed", "trace")

    def __init__(self, seed: int, *, keep: int, focus: frozenset[str]) -> None:
        self.seed = seed
        self.env = simpy.Environment(initial_time=0)
        self.trace = Trace(self.env, keep=keep, focus=focus)

    @property
    def now(self) -> int:
        # Every delay is an int, so SimPy's clock stays an int: no conversion needed.
        return self.env._now  # type: ignore[return-value]

    def later(self, delay: int, fn: Callable[..., Any], *args: Any) -> simpy.Event:
        """Call ``fn(*args)`` after ``delay`` ms (0: after what is already due now).

        The hot path of the whole simulation (one call per message and timer): a bare
        :class:`simpy.Event` carrying the call, scheduled like a ``Timeout`` (same queue,
        same priority, so the order of equal times is still insertion order). Returns the
        event, for :meth:`cancel`.
        """
        env = self.env
        event = _Call.__new__(_Call)
        event.env = env
        event.callbacks = [_run_call]
        event._value = (fn, args)
        event._ok = True
        # ``env.schedule(event, NORMAL, delay)``, inline: the same queue entry.
        heappush(
            env._queue, (env._now + (delay if delay > 0 else 0), NORMAL, next(env._eid), event)
        )
        return event

    @staticmethod
    def cancel(event: simpy.Event) -> None:
        """The call of ``event`` (from :meth:`later`) is not made; the queue still holds the
        event until its time (a cheap no-op then). Harmless once it ran."""
        # simpy's annotation says a list, but a processed event holds None; read it untyped so
        # that compiled code does not check it against the annotation.
        callbacks: object = getattr(event, "callbacks")  # noqa: B009 (not a checked read)
        if callbacks:
            event.callbacks = []

    def rng(self, name: str) -> random.Random:
        """A random stream of its own for the part called ``name``: adding draws in one part
        leaves the others' draws unchanged."""
        return random.Random(f"{self.seed}/{name}")
