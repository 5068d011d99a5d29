"""One simulated machine's clocks: a wall clock with an offset, a drift and steps, and a
monotonic clock with a drift of its own, both as functions of true (simulated) time.

Owns the arithmetic only (integer ppm rates, piecewise linear, monotonic never backwards);
faults (``sim.faults``) decide when a clock jumps or drifts, NTP (``sim.world``) when it is
stepped back. Must never be read by anything but its own machine's driver.
"""

from __future__ import annotations

from sim.config import T0

_PPM = 1_000_000


class NodeClock:
    """``wall(t)`` and ``mono(t)`` at true time ``t`` (ms since T0).

    The wall clock reads ``T0 + t`` plus its error; the monotonic clock counts from an
    arbitrary start. Each is ``base + (t - since) * (1 + ppm / 1e6)``, re-based whenever a
    rate changes or the wall clock is stepped, so the monotonic clock never goes backwards.
    """

    __slots__ = ("_mono_base", "_mono_ppm", "_mono_since", "_wall_base", "_wall_ppm", "_wall_since")

    def __init__(
        self, *, mono_start: int, wall_error_ms: int, wall_ppm: int, mono_ppm: int
    ) -> None:
        self._mono_base, self._mono_since, self._mono_ppm = mono_start, 0, mono_ppm
        self._wall_base, self._wall_since, self._wall_ppm = T0 + wall_error_ms, 0, wall_ppm

    def mono(self, t: int) -> int:
        return self._mono_base + (t - self._mono_since) * (_PPM + self._mono_ppm) // _PPM

    def wall(self, t: int) -> int:
        return self._wall_base + (t - self._wall_since) * (_PPM + self._wall_ppm) // _PPM

    def true_at_mono(self, mono: int) -> int:
        """The earliest true time at which ``mono(t) >= mono`` (not before the last re-base)."""
        ahead = mono - self._mono_base
        if ahead <= 0:
            return self._mono_since
        return self._mono_since - (-ahead * _PPM // (_PPM + self._mono_ppm))

    def wall_error(self, t: int) -> int:
        return self.wall(t) - (T0 + t)

    @property
    def wall_ppm(self) -> int:
        return self._wall_ppm

    @property
    def mono_ppm(self) -> int:
        return self._mono_ppm

    def step_wall(self, t: int, to_error_ms: int) -> None:
        """Set the wall clock so that it is ``to_error_ms`` off true time (a jump, or NTP)."""
        self._wall_base, self._wall_since = T0 + t + to_error_ms, t

    def set_wall_rate(self, t: int, ppm: int) -> None:
        self._wall_base, self._wall_since, self._wall_ppm = self.wall(t), t, ppm

    def set_mono_rate(self, t: int, ppm: int) -> None:
        self._mono_base, self._mono_since, self._mono_ppm = self.mono(t), t, ppm
