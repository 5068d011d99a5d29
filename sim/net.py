"""The simulated network: latency, loss, partitions, FIFO per link.

Owns message delivery between named endpoints (``n0``..., ``w0``..., ``coord``, ``client``).
A link keeps order (TCP): a message never overtakes an earlier one on the same link. A lost
message on a connection (a worker's with a node) breaks it, as TCP would rather than lose one
message silently: the worker is told and greets again. Partitions cut pairs of endpoints both
ways; a message sent into a cut, or arriving while its link is cut, is dropped (and breaks
its connection, if it has one); others are resent by their senders' timers. Must never
look inside messages: it moves callables and their arguments.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from sim.kernel import Kernel


class _Packet:
    """What one link carries from one instant: calls delivered together, in order."""

    __slots__ = ("calls", "resets", "sent_at")

    def __init__(
        self,
        sent_at: int,
        call: tuple[Callable[..., Any], tuple[Any, ...]],
        on_reset: Callable[[], None] | None,
    ) -> None:
        self.sent_at = sent_at
        self.calls = [call]
        self.resets = [] if on_reset is None else [on_reset]


class Network:
    __slots__ = ("_cut", "_k", "_last", "_open", "_rng", "delivered", "dropped", "loss")

    def __init__(self, kernel: Kernel, rng: random.Random, *, loss: float) -> None:
        self._k = kernel
        self._rng = rng
        self.loss = loss
        self._last: dict[tuple[str, str], int] = {}
        self._open: dict[tuple[str, str], _Packet] = {}  # the packet of this instant, per link
        self._cut: dict[tuple[str, str], int] = {}  # (a, b) with a < b -> number of cuts
        self.delivered = 0
        self.dropped = 0

    # ---------------------------------------------------------------- partitions

    @staticmethod
    def _pair(a: str, b: str) -> tuple[str, str]:
        return (a, b) if a < b else (b, a)

    def cut(self, a: str, b: str) -> None:
        pair = self._pair(a, b)
        self._cut[pair] = self._cut.get(pair, 0) + 1

    def heal(self, a: str, b: str) -> None:
        pair = self._pair(a, b)
        left = self._cut.get(pair, 0) - 1
        if left > 0:
            self._cut[pair] = left
        else:
            self._cut.pop(pair, None)

    def is_cut(self, a: str, b: str) -> bool:
        return bool(self._cut) and self._pair(a, b) in self._cut

    # ---------------------------------------------------------------- delivery

    def latency(self) -> int:
        """1 ms plus an exponential tail with a 2 ms mean."""
        return 1 + int(self._rng.expovariate(0.5))

    def send(
        self,
        src: str,
        dst: str,
        fn: Callable[..., Any],
        *args: Any,
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        """Deliver ``fn(*args)`` at ``dst`` after a latency, unless cut or lost. A message on
        a connection (``on_reset`` given) that is lost or cut breaks it: ``on_reset`` is called
        (at the worker's end, which reconnects and greets again) instead.

        Messages a link carries from one instant travel as one packet (a sender writes them
        to its socket together): the first decides latency and loss, the others ride along,
        in order, and share its fate (a broken packet calls each ``on_reset`` it carries)."""
        now: int = self._k.env._now  # type: ignore[assignment]
        link = (src, dst)
        packet = self._open.get(link)
        if packet is not None and packet.sent_at == now:
            packet.calls.append((fn, args))
            if on_reset is not None:
                packet.resets.append(on_reset)
            return
        if self._cut and self.is_cut(src, dst):
            self.dropped += 1
            if on_reset is not None:
                self._k.later(self.latency(), on_reset)
            return
        if self.loss and self._rng.random() < self.loss:
            self.dropped += 1
            self._k.trace("lost", src, dst)
            if on_reset is not None:
                self._k.later(self.latency(), on_reset)
            return
        packet = self._open[link] = _Packet(now, (fn, args), on_reset)
        at = now + 1 + int(self._rng.expovariate(0.5))  # now + self.latency()
        last = self._last.get(link, 0)
        if last > at:
            at = last
        self._last[link] = at
        self._k.later(at - now, self._arrive, src, dst, packet)

    def _arrive(self, src: str, dst: str, packet: _Packet) -> None:
        if self._cut and self.is_cut(src, dst):
            self.dropped += 1
            for on_reset in packet.resets:
                on_reset()
            return
        self.delivered += 1
        for fn, args in packet.calls:
            fn(*args)
