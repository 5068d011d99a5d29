"""A shard's durable storage as the simulation models it: readable by whichever node owns the
shard next (DESIGN.md, "Cluster"), fenced by epoch, committed in groups.

Owns what survives: a write (one ``Persist`` batch) is accepted or refused when it arrives, by
:class:`engine.lease.EpochFence` against the newest epoch that opened the store; accepted
writes become durable in order, a group per fsync, and the writer is told ``Durable`` for its
last batch in the group. When the writer's machine crashes, its writes not yet durable are
resolved then: a prefix survives (the disk had them, the acknowledgement was lost), the rest
is lost, and the first lost one may be left torn (half written; dropped on the next open, as
a WAL drops a tail whose checksum fails). Opening at a new epoch fences first, then waits for
writes already accepted to settle, then hands the reader the newest snapshot and the durable
records after it. Like the real store, it answers the engine's directory questions (ids and
latest specs of durable jobs) and keeps the columnar snapshots an owner writes.

Must never interpret records beyond what the checks and plots ask (``sim.checks``): the
engine decides what they mean.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.directory import MemoryDirectory
from engine.effects import Persist
from engine.errors import StaleEpoch
from engine.lease import EpochFence
from engine.records import Record
from engine.snapshot import Snapshot
from sim.kernel import Kernel

if TYPE_CHECKING:
    from sim.node import SimNode


#: Called with the records to replay and the snapshot they follow (None, None: refused).
Reader = Callable[[list[Record] | None, Snapshot | None], None]


@dataclass(slots=True)
class StoredBatch:
    """A durable batch: who wrote it under which epoch, when it was accepted and synced."""

    epoch: int
    writer: str
    accepted_at: int
    durable_at: int
    records: tuple[Record, ...]
    batch_id: int
    end: int  # how many durable records there are up to and including this batch


class _Write:
    # A plain class, not a dataclass: a compiled dataclass evaluates its annotations at
    # import, and SimNode (imported for type checking only, sim.node imports this module)
    # does not exist yet then.
    __slots__ = ("accepted_at", "incarnation", "node", "persist")

    def __init__(self, node: SimNode, incarnation: int, persist: Persist, accepted_at: int) -> None:
        self.node = node
        self.incarnation = incarnation
        self.persist = persist
        self.accepted_at = accepted_at


class ShardStore:
    """One shard's storage. Every method is O(batch) except :meth:`open` (O(records))."""

    def __init__(self, kernel: Kernel, shard: int, rng: random.Random, fence: EpochFence) -> None:
        self._k = kernel
        self.shard = shard
        self._rng = rng
        self._fence = fence
        self.epoch = 0  # the newest epoch that opened this store
        self.batches: list[StoredBatch] = []
        self.records: list[Record] = []  # every durable record, in order
        self.opens: list[tuple[int, int]] = []  # (time, epoch)
        #: writes accepted although stamped with an epoch older than the newest open (only a
        #: switched-off fence lets one through): (time, writer, stamped, newest)
        self.stale_accepted: list[tuple[int, str, int, int]] = []
        self.torn: tuple[Record, ...] | None = None
        self.slow_ms = 0  # extra fsync latency while a slow-disk fault lasts
        # The store's read side for the engine (ids, latest specs), fed with durable batches
        # before they are acknowledged; and the newest snapshot with the log position it
        # reflects (recovery replays only the records after it).
        self.directory = MemoryDirectory()
        self.snapshot: tuple[Snapshot, int] | None = None
        self._pending: list[_Write] = []
        self._syncing: list[_Write] = []
        self._waiters: list[Callable[[], None]] = []
        self.on_durable: Callable[[int, StoredBatch], None] | None = None  # observer (plots)

    # ---------------------------------------------------------------- writes

    def submit(self, node: SimNode, incarnation: int, persist: Persist) -> None:
        """A write arrives from ``node``. Refused writes are answered at once; accepted ones
        when their group is durable."""
        now = self._k.now
        if not self._fence.accepts(self.epoch, persist.epoch):
            self._k.trace("refused", f"s{self.shard}", node.name, f"e{persist.epoch}", self.epoch)
            self._k.later(1, node.receive, incarnation, node.on_store_refused, self.shard)
            return
        if persist.epoch < self.epoch:
            self.stale_accepted.append((now, node.name, persist.epoch, self.epoch))
        self._pending.append(_Write(node, incarnation, persist, now))
        if not self._syncing:
            self._sync()

    def _fsync_ms(self) -> int:
        return 1 + int(self._rng.expovariate(1 / 2)) + self.slow_ms

    def _sync(self) -> None:
        self._syncing, self._pending = self._pending, []
        self._k.later(self._fsync_ms(), self._synced, self._syncing)

    def _synced(self, group: list[_Write]) -> None:
        if group is not self._syncing:
            return  # a crash resolved this group meanwhile
        now = self._k.now
        acks: dict[tuple[int, int], tuple[_Write, int]] = {}
        for w in group:
            self._make_durable(w, now)
            acks[(id(w.node), w.incarnation)] = (w, w.persist.batch_id)
        self._syncing = []
        self._next_group()
        # Acknowledged last, when the store is consistent again: a writer told now writes
        # more at once (into the next group), and must find no half-finished step.
        for w, batch_id in acks.values():
            w.node.receive(w.incarnation, w.node.on_durable, self.shard, w.persist.epoch, batch_id)

    def _make_durable(self, w: _Write, now: int) -> None:
        self.records.extend(w.persist.records)
        self.directory.absorb(w.persist.records)
        batch = StoredBatch(
            w.persist.epoch,
            w.node.name,
            w.accepted_at,
            now,
            w.persist.records,
            w.persist.batch_id,
            len(self.records),
        )
        self.batches.append(batch)
        if self.on_durable is not None:
            self.on_durable(self.shard, batch)

    def crash(self, node: SimNode, incarnation: int) -> None:
        """``node``'s machine crashed: resolve its writes that are not durable yet."""
        mine = [w for w in (*self._syncing, *self._pending) if w.node is node]
        if not mine:
            return
        keep = self._rng.randint(0, len(mine))
        now = self._k.now
        for w in mine[:keep]:
            self._make_durable(w, now)  # on disk, never acknowledged
        lost = mine[keep:]
        if lost and self._rng.random() < 0.5:
            half = lost[0].persist.records
            self.torn = half[: len(half) // 2]
        self._k.trace(
            "crash-writes",
            f"s{self.shard}",
            node.name,
            f"kept={keep}",
            f"lost={len(lost)}",
            "torn" if self.torn is not None else "",
        )
        gone = {id(w) for w in mine}
        self._pending = [w for w in self._pending if id(w) not in gone]
        syncing = [w for w in self._syncing if id(w) not in gone]
        if len(syncing) != len(self._syncing):
            # The group in flight changed: start over with what is left of it.
            self._syncing = []
            self._pending = syncing + self._pending
            self._next_group()

    def _next_group(self) -> None:
        """Nothing is syncing: sync what waits, or, with nothing accepted left to settle, let
        the openers waiting for that read."""
        if self._pending:
            self._sync()
        elif self._waiters:
            waiters, self._waiters = self._waiters, []
            for fn in waiters:
                fn()

    def write_snapshot(self, node: SimNode, epoch: int, batch_id: int, snap: Snapshot) -> bool:
        """Keep ``snap``, which reflects the writer's batches up to ``batch_id`` (durable), as
        the point recovery starts from. Fenced like a write; False when refused."""
        if not self._fence.accepts(self.epoch, epoch):
            return False
        for batch in reversed(self.batches):
            if batch.epoch == epoch and batch.batch_id == batch_id:
                self.snapshot = (snap, batch.end)
                self._k.trace("snapshot", f"s{self.shard}", node.name, f"e{epoch}", batch.end)
                return True
            if batch.epoch < epoch:
                break
        return False

    # ---------------------------------------------------------------- opening

    def open(self, epoch: int, reader: Reader) -> None:
        """Open at ``epoch`` for a new owner: fence older epochs now, then, once the writes
        already accepted are durable, call ``reader`` with the durable records after the
        newest snapshot, and that snapshot or None (None, None when a newer owner opened the
        store first)."""
        try:
            self.epoch = self._fence.open(self.epoch, epoch)
        except StaleEpoch:
            self._k.later(1, reader, None, None)
            return
        self.opens.append((self._k.now, epoch))
        if self.torn is not None:
            self._k.trace("torn-dropped", f"s{self.shard}", len(self.torn))
            self.torn = None
        if self._syncing or self._pending:
            self._waiters.append(lambda: self._read(reader))
        else:
            self._read(reader)

    def _read(self, reader: Reader) -> None:
        snap, start = self.snapshot if self.snapshot is not None else (None, 0)
        records = self.records[start:]
        # Reading costs time: a base plus a little per record.
        self._k.later(5 + len(records) // 2_000, reader, records, snap)
