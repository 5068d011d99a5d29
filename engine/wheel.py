"""A hierarchical timing wheel holding every pending fire time of one shard.

Owns the mapping from dense integer keys to due times (integer ms) and hands back, in
``(due_ms, key)`` order, every entry that has come due. It stores no Python object per entry:
one ``int64`` due column indexed by key and, per slot, a ``uint32`` array of keys; about 12 bytes
per pending entry. It must never read a clock, sleep or allocate per entry: time only moves when
the driver calls :meth:`TimingWheel.advance`.

Layout (Varghese & Lauck's hierarchical scheme, with the Linux timer wheel's occupancy bitmap):

* Time is counted in ticks of ``tick_ms``. Level ``L`` has ``2**slot_bits`` slots of
  ``2**(slot_bits*L)`` ticks each; enough levels cover every int64 due, so no overflow list.
* An entry due at tick ``t`` after the current tick ``c`` sits at the lowest level ``L`` where
  ``t`` and ``c`` share a level-``L+1`` slot, that is ``L = (bit_length(t ^ c) - 1) // slot_bits``,
  in slot ``(t >> slot_bits*L) & mask``. Hence every entry at level ``L`` is later than every
  entry at a level below it, and the earliest non-empty slot is simply the lowest set bit of one
  occupancy bitmap whose bit index is ``L << slot_bits | slot``.
* Entries due at or before the current tick (past dues, or later in the current tick when
  ``tick_ms > 1``) wait in the *near* list and fire on the next :meth:`~TimingWheel.advance`.
* Cancel and replace are lazy: they only rewrite the due column. A bucket entry is live when the
  key's current due lies inside the bucket's time range; ranges of distinct buckets are disjoint,
  so a key is live in at most one bucket. Stale entries are dropped when their bucket is
  processed, or all at once by a compaction that runs when they outnumber the live ones.
* ``advance`` visits non-empty slots only: a slot wholly in the past fires with one vectorised
  sort; the slot holding ``now`` cascades its later entries to lower levels.

Complexity: ``schedule`` and ``cancel`` are O(1) amortised; ``schedule_many`` is O(n) for
strictly increasing keys and O(n log n) otherwise; ``advance`` is O(fired log fired) plus O(1)
per non-empty slot passed, each entry cascading at most once per level; ``next_due`` is O(1)
unless the near list holds entries.
"""

from __future__ import annotations

import operator
import sys
from array import array

import numpy as np
import numpy.typing as npt

from engine.errors import EngineUsageError, InvalidDue, InvalidKey, TimeWentBackwards

#: Due value of a key that is not pending. Also the exclusive upper bound of a valid due.
NOT_PENDING: int = 2**63 - 1
#: Largest key the wheel accepts: slots store keys as ``uint32``.
MAX_KEY: int = 2**32 - 1

# Buckets at or below this many entries are handled in plain Python: with a few entries, numpy's
# per-call overhead costs more than the loop it replaces.
_SMALL_BUCKET = 48
# schedule() stages keys and places them in one vectorised pass at the next advance/next_due, or
# when this many are waiting (which bounds the staging list's memory).
_STAGE_LIMIT = 1 << 16

#: Every empty slot holds this one array, never written to: a wheel starts with ~2,000
#: slots, and one array each made creating a wheel cost a millisecond. Writers swap in an
#: array of the slot's own first (``_bucket_for``).
_EMPTY: array[int] = array("I")

#: ``TimingWheel._hint`` when the next due must be computed again.
_NO_HINT: object = object()
# Stale entries tolerated on top of twice the live count before a compaction.
_COMPACT_SLACK = 1 << 16

Int64Array = npt.NDArray[np.int64]
UInt32Array = npt.NDArray[np.uint32]


class TimingWheel:
    """Pending ``(due_ms, key)`` timers, fired in order as time advances.

    Guarantees: each pending key is returned by :meth:`advance` exactly once, at the first call
    whose ``now_ms`` is at or after its due, in ascending ``(due_ms, key)`` order; a key is pending
    at most once (scheduling it again replaces its due); nothing fires early.

    Failure modes: :class:`~engine.errors.InvalidKey` for a key outside ``0..MAX_KEY``,
    :class:`~engine.errors.InvalidDue` for a due outside int64 (or equal to ``NOT_PENDING``),
    :class:`~engine.errors.TimeWentBackwards` when ``advance`` is given an earlier time. A failed
    call leaves the wheel unchanged. Keys are meant to be dense (a shard hands them out from 0):
    the due column is as long as the largest key ever scheduled.
    """

    __slots__ = (
        "_bits",
        "_buckets",
        "_cur_tick",
        "_due",
        "_hint",
        "_len",
        "_levels",
        "_mask",
        "_near",
        "_now",
        "_occupied",
        "_placement",
        "_shifts",
        "_staged",
        "_stale",
        "_thresholds",
        "_tick",
    )

    def __init__(
        self, now_ms: int, *, tick_ms: int = 1, slot_bits: int = 8, capacity: int = 0
    ) -> None:
        """Create an empty wheel whose current time is ``now_ms``.

        ``tick_ms`` is the width of a level-0 slot (1 ms gives exact ordering at no extra cost,
        since empty slots are skipped); ``slot_bits`` sets ``2**slot_bits`` slots per level
        (4..12); ``capacity`` pre-sizes the due column for keys ``0..capacity-1``.
        """
        if not isinstance(now_ms, int) or now_ms < 0 or now_ms >= NOT_PENDING:
            raise InvalidDue(f"now_ms must be a non-negative int64, got {now_ms!r}", field="now_ms")
        if not isinstance(tick_ms, int) or not 1 <= tick_ms <= 2**31:
            raise InvalidDue(
                f"tick_ms must be an int in 1..2**31, got {tick_ms!r}", field="tick_ms"
            )
        if not isinstance(slot_bits, int) or not 4 <= slot_bits <= 12:
            raise InvalidDue(f"slot_bits must be in 4..12, got {slot_bits!r}", field="slot_bits")
        self._tick = tick_ms
        self._bits = slot_bits
        self._mask = (1 << slot_bits) - 1
        self._levels = -(-63 // slot_bits)
        self._shifts = [slot_bits * level for level in range(self._levels)]
        # bit_length(t ^ c) -> (shift of the level, index of its first slot); entry 0 (t == c)
        # is never used, as such entries go to the near list.
        self._placement = [
            (self._shifts[lv], lv << slot_bits)
            for lv in (max(0, (n - 1) // slot_bits) for n in range(65))
        ]
        self._thresholds = np.array(
            [1 << (slot_bits * level) for level in range(1, self._levels)], dtype=np.uint64
        )
        self._buckets = [_EMPTY] * (self._levels << slot_bits)
        self._near = array("I")
        self._staged = array("I")  # keys scheduled one by one, not yet placed in a bucket
        self._occupied = 0
        self._now = now_ms
        self._cur_tick = now_ms // tick_ms
        self._due = array("q", [NOT_PENDING]) * max(1, capacity)
        self._len = 0
        self._stale = 0  # bucket entries whose key was cancelled, fired or re-scheduled
        # The last next_due() answer while it is still a valid one (_NO_HINT: recompute).
        # Drivers ask after every event and most events do not matter to it: schedule()
        # lowers it, and only moving or removing the earliest key drops it.
        self._hint: int | object | None = _NO_HINT

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """The number of pending keys. O(1)."""
        return self._len

    @property
    def now_ms(self) -> int:
        """The wheel's current time: the largest ``now_ms`` passed to :meth:`advance` so far."""
        return self._now

    def due_of(self, key: int) -> int | None:
        """The pending due of ``key``, or None when it is not pending. O(1)."""
        if 0 <= key < len(self._due):
            due = self._due[key]
            return None if due == NOT_PENDING else due
        return None

    def dues(self) -> Int64Array:
        """The due column: element ``k`` is key ``k``'s pending due, or :data:`NOT_PENDING`.

        A read-only view, valid until the next call that schedules a key beyond its length.
        O(1); for exporting a snapshot in bulk.
        """
        view = np.frombuffer(self._due, dtype=np.int64)
        view.flags.writeable = False
        return view

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.due_of(key) is not None

    def next_due(self) -> int | None:
        """A time at or before the earliest pending due, or None when nothing is pending.

        It is the earliest due itself when that due waits in the near list or in a slot of at
        most a few dozen entries (``_SMALL_BUCKET``); else the start of the
        earliest non-empty slot: a driver may sleep until then and call :meth:`advance`, which
        fires what is due and returns an updated answer here. O(1) when nothing changed since
        the last call (the answer is kept), else O(levels + a small bucket).
        """
        hint = self._hint
        if hint is not _NO_HINT:
            return hint  # type: ignore[return-value]
        answer = self._compute_next_due()
        self._hint = answer
        return answer

    def _compute_next_due(self) -> int | None:
        if self._len == 0:
            return None
        if self._staged:
            self._place_staged()
        if self._near:
            best = self._near_min()
            if best is not None:
                return best
        dues = self._due
        while True:
            occupied = self._occupied
            if not occupied:  # pragma: no cover - _len > 0 implies a live entry somewhere
                raise AssertionError("pending entries but no occupied slot")
            index = (occupied & -occupied).bit_length() - 1
            start_tick = self._slot_start_tick(index)
            start = start_tick * self._tick
            bucket = self._buckets[index]
            if len(bucket) > _SMALL_BUCKET:
                return start
            # Slots are disjoint ranges in index order, so the earliest live entry of the
            # earliest slot is the earliest due: exact, which saves a driver the wake-ups at
            # each level's slot start on the way down.
            span = 1 << self._shifts[index >> self._bits]
            end = min((start_tick + span) * self._tick, NOT_PENDING)
            live = [d for d in map(dues.__getitem__, bucket) if start <= d < end]
            if live:
                return min(live)
            # Only stale entries (keys fired, cancelled or moved since): drop the slot.
            self._stale -= len(bucket)
            self._buckets[index] = _EMPTY
            self._occupied = occupied & ~(1 << index)

    def nbytes(self) -> int:
        """Bytes held by the wheel's columns and buckets (allocated, not just used)."""
        total = sys.getsizeof(self._due) + sys.getsizeof(self._near) + sys.getsizeof(self._staged)
        total += sum(sys.getsizeof(b) for b in self._buckets if b is not _EMPTY)
        return total + sys.getsizeof(self._buckets)

    # ------------------------------------------------------------------ mutation

    def schedule(self, key: object, due_ms: object) -> None:
        """Make ``key`` pending at ``due_ms``, replacing any due it had. O(1) amortised.

        A due at or before the wheel's current time fires on the next :meth:`advance`.
        """
        # The hot path: a key inside the due column and an int64 due. Anything else (a new key
        # beyond the column, a wrong type, a due out of range) takes the validating slow path.
        dues = self._due
        if type(key) is not int or type(due_ms) is not int:
            # (typed object, not int: compiled, an int annotation would refuse a numpy
            # integer with a TypeError before the slow path could accept it)
            self._schedule_slow(key, due_ms)
            return
        try:
            if key < 0 or due_ms == NOT_PENDING:
                raise IndexError(key)
            old = dues[key]
            dues[key] = due_ms  # array('q') refuses values beyond int64
        except (IndexError, OverflowError):
            self._schedule_slow(key, due_ms)
            return
        # Placement is deferred to the next advance/next_due, which places every staged key in
        # one vectorised pass: cheaper than computing a slot per call in Python.
        hint = self._hint
        if hint is not _NO_HINT:
            if hint is None or due_ms < hint:  # type: ignore[operator]
                self._hint = due_ms
            elif old == hint:  # the earliest key moved later: ask again
                self._hint = _NO_HINT
        staged = self._staged
        staged.append(key)
        if len(staged) >= _STAGE_LIMIT:
            self._place_staged()
        if old == NOT_PENDING:
            self._len += 1
        else:  # the entry placed for the old due is now stale
            self._stale += 1
            if self._stale > self._len + _COMPACT_SLACK:
                self._compact()

    def _schedule_slow(self, key: object, due_ms: object) -> None:
        """:meth:`schedule` with full validation: typed errors, growth of the due column."""
        key, due_ms = _as_int(key, "key"), _as_int(due_ms, "due_ms")
        if key < 0 or key > MAX_KEY:
            raise InvalidKey(f"key must be in 0..{MAX_KEY}, got {key!r}", field="key")
        if not -NOT_PENDING <= due_ms < NOT_PENDING:
            raise InvalidDue(f"due_ms must be an int64 below 2**63-1, got {due_ms!r}", field="due")
        if key >= len(self._due):
            self._grow(key + 1)
        self.schedule(key, due_ms)

    def cancel(self, key: int) -> bool:
        """Stop ``key`` from firing; True when it was pending. O(1) amortised."""
        dues = self._due
        if 0 <= key < len(dues) and (old := dues[key]) != NOT_PENDING:
            dues[key] = NOT_PENDING
            self._len -= 1
            if old == self._hint:  # the earliest key left: ask again
                self._hint = _NO_HINT
            self._stale += 1
            if self._stale > self._len + _COMPACT_SLACK:
                self._compact()
            return True
        return False

    def schedule_many(self, keys: npt.ArrayLike, dues: npt.ArrayLike) -> None:
        """:meth:`schedule` for every ``(keys[i], dues[i])``, vectorised.

        A key repeated in the batch takes its last due, as if scheduled one by one. The whole
        batch is validated before anything changes. O(n) when keys are strictly increasing (the
        recovery case), O(n log n) otherwise.
        """
        key_arr = np.asarray(keys)
        due_arr = np.asarray(dues)
        if key_arr.ndim != 1 or due_arr.shape != key_arr.shape:
            raise InvalidKey("keys and dues must be 1-D arrays of the same length", field="keys")
        if key_arr.size == 0:
            return
        if key_arr.dtype.kind not in "iu":
            raise InvalidKey(f"keys must be integers, got dtype {key_arr.dtype}", field="keys")
        if due_arr.dtype.kind not in "iu":
            raise InvalidDue(f"dues must be integers, got dtype {due_arr.dtype}", field="dues")
        if int(key_arr.min()) < 0 or int(key_arr.max()) > MAX_KEY:
            raise InvalidKey(f"keys must be in 0..{MAX_KEY}", field="keys")
        if int(due_arr.max()) >= NOT_PENDING:
            raise InvalidDue("dues must be int64 values below 2**63-1", field="dues")
        due64 = due_arr.astype(np.int64, copy=False)
        key64 = key_arr.astype(np.int64, copy=False)
        top = int(key64.max())
        if key64.size > 1 and not bool(np.all(key64[1:] > key64[:-1])) and _has_repeats(key64, top):
            # Keep the last occurrence of each key: stable sort, then the end of each run.
            order = np.argsort(key64, kind="stable")
            sorted_keys = key64[order]
            last = np.ones(sorted_keys.size, dtype=bool)
            last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
            pick = order[last]
            key64, due64 = key64[pick], due64[pick]
        if top >= len(self._due):
            self._grow(top + 1)
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            added = int(np.count_nonzero(due_view[key64] == NOT_PENDING))
            due_view[key64] = due64
        finally:
            del due_view
        self._hint = _NO_HINT
        self._len += added
        self._stale += int(key64.size) - added
        self._place_many(key64.astype(np.uint32), due64)
        if self._stale > self._len + _COMPACT_SLACK:
            self._compact()

    def advance(self, now_ms: int, *, limit: int | None = None) -> list[tuple[int, int]]:
        """Move the wheel to ``now_ms`` and return every entry due at or before it.

        Returns ``(due_ms, key)`` pairs in ascending order; they are no longer pending. With
        ``limit``, at most that many are returned: the earliest ones, the rest staying pending
        (and due, so the next call returns them first). A burst larger than what its consumer
        can take is thus handed out in slices at a cost of O(slice + rest) numpy work per call,
        without a Python object per entry left behind. Raises
        :class:`~engine.errors.TimeWentBackwards` (and changes nothing) when ``now_ms`` is before
        the wheel's current time; the same time again is fine and fires what was scheduled in
        the past since.
        """
        if now_ms < self._now:
            raise TimeWentBackwards(
                f"advance({now_ms}) is before the wheel's time {self._now}", field="now_ms"
            )
        if now_ms >= NOT_PENDING:
            raise InvalidDue(f"now_ms must be below 2**63-1, got {now_ms!r}", field="now_ms")
        if limit is not None and limit < 0:
            raise EngineUsageError(f"limit must be >= 0, got {limit!r}", field="limit")
        tick = self._tick
        self._hint = _NO_HINT
        if self._staged:
            self._place_staged()
        if not self._near:
            # The driver's steady state: nothing due yet. Answer without building anything.
            occupied = self._occupied
            if not occupied or (
                self._slot_start_tick((occupied & -occupied).bit_length() - 1) * tick > now_ms
            ):
                self._now = now_ms
                self._cur_tick = now_ms // tick
                return []
        out = _Fired()
        if self._near:
            near, self._near = self._near, array("I")
            hi = min((self._cur_tick + 1) * tick, NOT_PENDING)
            self._split(near, -NOT_PENDING, hi, now_ms, out)
        # Slots wholly at or before `now` are gathered and fired in one vectorised pass; the slot
        # holding `now` (at most one per level) is split: due entries fire, later ones cascade.
        past: list[tuple[array[int], int, int]] = []
        bits = self._bits
        while self._occupied:
            occupied = self._occupied
            index = (occupied & -occupied).bit_length() - 1
            start_tick = self._slot_start_tick(index)
            start = start_tick * tick
            if start > now_ms:
                break
            end = min((start_tick + (1 << self._shifts[index >> bits])) * tick, NOT_PENDING)
            bucket = self._buckets[index]
            self._buckets[index] = _EMPTY
            self._occupied = occupied & ~(1 << index)
            if end - 1 <= now_ms:
                past.append((bucket, start, end))
                continue
            if past:
                self._fire_past(past, out)
                past = []
            # Every remaining entry is at or after this slot's start, so it is a valid current
            # tick for re-placing the slot's later entries into lower levels.
            self._cur_tick = start_tick
            self._split(bucket, start, end, now_ms, out)
        if past:
            self._fire_past(past, out)
        self._now = now_ms
        self._cur_tick = now_ms // tick
        if self._stale > self._len + _COMPACT_SLACK:
            self._compact()
        fired, rest_dues, rest_keys = out.result(limit)
        if rest_keys is not None and rest_dues is not None:
            # Beyond the limit: pending again, in the near list (they are all due).
            due_view = np.frombuffer(self._due, dtype=np.int64)
            try:
                due_view[rest_keys] = rest_dues
            finally:
                del due_view
            self._len += int(rest_keys.size)
            self._near.frombytes(rest_keys.astype(np.uint32).tobytes())
        return fired

    # ------------------------------------------------------------------ internals

    def _near_min(self) -> int | None:
        """The earliest live due in the near list, or None when all its entries are stale."""
        hi = min((self._cur_tick + 1) * self._tick, NOT_PENDING)
        if len(self._near) <= _SMALL_BUCKET:
            dues = self._due
            live = [d for d in map(dues.__getitem__, self._near) if d < hi]
            return min(live) if live else None
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            d = due_view[np.frombuffer(self._near, dtype=np.uint32)]
        finally:
            del due_view
        d = d[d < hi]
        return int(d.min()) if d.size else None

    def _slot_start_tick(self, index: int) -> int:
        """First tick of slot ``index``, in the block of its level that holds the current tick."""
        shift = self._shifts[index >> self._bits]
        block_shift = shift + self._bits
        return (self._cur_tick >> block_shift << block_shift) + ((index & self._mask) << shift)

    def _place_staged(self) -> None:
        """Place every key staged by :meth:`schedule`; drop the ones cancelled since."""
        staged, self._staged = self._staged, array("I")
        if len(staged) <= _SMALL_BUCKET:
            dues = self._due
            for key in staged:
                due = dues[key]
                if due == NOT_PENDING:
                    self._stale -= 1
                else:
                    self._place_one(key, due)
            return
        keys = np.frombuffer(staged, dtype=np.uint32)
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            d = due_view[keys]
        finally:
            del due_view
        live = d != NOT_PENDING
        self._stale -= int(live.size) - int(np.count_nonzero(live))
        self._place_many(keys[live], d[live])

    def _grow(self, size: int) -> None:
        """Lengthen the due column to hold keys below ``size`` (geometric, so O(1) amortised)."""
        current = len(self._due)
        target = min(max(size, current + (current >> 2), 1024), MAX_KEY + 1)
        self._due.extend(array("q", [NOT_PENDING]) * (target - current))

    def _fire_past(self, past: list[tuple[array[int], int, int]], out: _Fired) -> None:
        """Fire the live entries of buckets whose whole range ``[lo, hi)`` is due."""
        total = sum(len(bucket) for bucket, _lo, _hi in past)
        if total <= _SMALL_BUCKET:
            dues = self._due
            pairs: set[tuple[int, int]] = set()
            for bucket, lo, hi in past:
                for key in bucket:
                    due = dues[key]
                    if lo <= due < hi:
                        pairs.add((due, key))
            ordered = sorted(pairs)
            for _due, key in ordered:
                dues[key] = NOT_PENDING
            self._len -= len(ordered)
            self._stale -= total - len(ordered)
            out.extend_pairs(ordered)
            return
        if len(past) == 1:
            bucket, lo, hi = past[0]
            keys = np.frombuffer(bucket, dtype=np.uint32)
            los: Int64Array | int = lo
            his: Int64Array | int = hi
        else:
            keys = np.concatenate([np.frombuffer(b, dtype=np.uint32) for b, _lo, _hi in past])
            lengths = [len(b) for b, _lo, _hi in past]
            los = np.repeat(np.array([lo for _b, lo, _hi in past], dtype=np.int64), lengths)
            his = np.repeat(np.array([hi for _b, _lo, hi in past], dtype=np.int64), lengths)
        base, top = past[0][1], past[-1][2]
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            d = due_view[keys]
            live = (d >= los) & (d < his)
            d, keys = _sort_unique(d[live], keys[live], base, top)
            due_view[keys] = NOT_PENDING
        finally:
            del due_view
        self._len -= int(keys.size)
        self._stale -= total - int(keys.size)
        out.extend_arrays(d, keys)

    def _split(self, bucket: array[int], lo: int, hi: int, now_ms: int, out: _Fired) -> None:
        """Fire the live entries of ``bucket`` (range ``[lo, hi)``) due by ``now_ms`` and
        re-place the later live ones relative to the current tick."""
        total = len(bucket)
        if total <= _SMALL_BUCKET:
            dues = self._due
            pairs: set[tuple[int, int]] = set()
            later: dict[int, int] = {}
            for key in bucket:
                due = dues[key]
                if lo <= due < hi:
                    if due <= now_ms:
                        pairs.add((due, key))
                    else:
                        later[key] = due
            ordered = sorted(pairs)
            for _due, key in ordered:
                dues[key] = NOT_PENDING
            self._len -= len(ordered)
            self._stale -= total - len(ordered) - len(later)
            out.extend_pairs(ordered)
            for key, due in later.items():
                self._place_one(key, due)
            return
        keys = np.frombuffer(bucket, dtype=np.uint32)
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            d = due_view[keys]
            live = (d >= lo) & (d < hi)
            keys, d = keys[live], d[live]
            ready = d <= now_ms
            fire_d, fire_keys = _sort_unique(d[ready], keys[ready], lo if lo >= 0 else None, hi)
            due_view[fire_keys] = NOT_PENDING
        finally:
            del due_view
        rest_keys, first = np.unique(keys[~ready], return_index=True)
        rest_d = d[~ready][first]
        self._len -= int(fire_keys.size)
        self._stale -= total - int(fire_keys.size) - int(rest_keys.size)
        out.extend_arrays(fire_d, fire_keys)
        self._place_many(rest_keys, rest_d)

    def _place_one(self, key: int, due: int) -> None:
        """Append a live ``key`` due at ``due`` to its bucket (no accounting)."""
        tick = due // self._tick
        cur = self._cur_tick
        if tick <= cur:
            self._near.append(key)
        else:
            shift, base = self._placement[(tick ^ cur).bit_length()]
            index = base + ((tick >> shift) & self._mask)
            bucket = self._buckets[index]
            if not bucket:
                self._occupied |= 1 << index
                bucket = self._buckets[index] = array("I")
            bucket.append(key)

    def _place_many(self, keys: UInt32Array, dues: Int64Array) -> None:
        """Append distinct live ``keys`` due at ``dues`` to their buckets (no accounting)."""
        n = int(keys.size)
        if n == 0:
            return
        if n <= _SMALL_BUCKET:
            for key, due in zip(keys.tolist(), dues.tolist(), strict=True):
                self._place_one(key, due)
            return
        ticks = dues // self._tick if self._tick != 1 else dues
        cur = self._cur_tick
        near = ticks <= cur
        if bool(near.any()):
            self._near.frombytes(keys[near].tobytes())
            far = ~near
            keys, ticks = keys[far], ticks[far]
            if keys.size == 0:
                return
        levels = np.searchsorted(self._thresholds, (ticks ^ cur).astype(np.uint64), side="right")
        shifts = (levels * self._bits).astype(np.int64)
        index = (levels.astype(np.int64) << self._bits) | ((ticks >> shifts) & self._mask)
        first = int(index[0])
        if bool(np.all(index == first)):
            self._bucket_for(first).frombytes(keys.tobytes())
            self._occupied |= 1 << first
            return
        order = np.argsort(index.astype(np.uint16), kind="stable")  # radix sort: O(n)
        sorted_index = index[order]
        sorted_keys = keys[order]
        cuts = (np.flatnonzero(sorted_index[1:] != sorted_index[:-1]) + 1).tolist()
        occupied = self._occupied
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            i = int(sorted_index[a])
            self._bucket_for(i).frombytes(sorted_keys[a:b].tobytes())
            occupied |= 1 << i
        self._occupied = occupied

    def _bucket_for(self, index: int) -> array[int]:
        """Slot ``index``'s array, to append to (its own, never the shared empty one)."""
        bucket = self._buckets[index]
        if bucket is _EMPTY:
            bucket = self._buckets[index] = array("I")
        return bucket

    def _compact(self) -> None:
        """Rebuild every bucket from the due column, dropping stale entries. O(capacity)."""
        due_view = np.frombuffer(self._due, dtype=np.int64)
        try:
            live = np.flatnonzero(due_view != NOT_PENDING)
            live_dues = due_view[live]
        finally:
            del due_view
        self._buckets = [_EMPTY] * (self._levels << self._bits)
        self._near = array("I")
        self._staged = array("I")
        self._occupied = 0
        self._stale = 0
        self._place_many(live.astype(np.uint32), live_dues)

    # ------------------------------------------------------------------ invariants

    def _check(self) -> None:
        """Assert every internal invariant. O(capacity + entries); for tests.

        Places staged keys first (as the next advance would), which changes no observable
        behaviour.
        """
        if self._staged:
            self._place_staged()
        due_view = np.frombuffer(self._due, dtype=np.int64).copy()
        pending = np.flatnonzero(due_view != NOT_PENDING)
        assert self._len == pending.size, (self._len, pending.size)
        assert self._cur_tick == self._now // self._tick
        assert not _EMPTY, "the shared empty slot was written to"
        entries = len(self._near) + sum(len(b) for b in self._buckets)
        assert entries == self._len + self._stale, (entries, self._len, self._stale)
        # Stale entries stay bounded by the live count (plus a constant): compaction's promise.
        assert self._stale <= self._len + _COMPACT_SLACK
        live_parts: list[npt.NDArray[np.int64]] = []
        near_keys = np.frombuffer(self._near, dtype=np.uint32).astype(np.int64)
        if near_keys.size:
            hi = min((self._cur_tick + 1) * self._tick, NOT_PENDING)
            assert int(near_keys.max()) < len(self._due)
            live_parts.append(np.unique(near_keys[due_view[near_keys] < hi]))
        for index, bucket in enumerate(self._buckets):
            bit = bool(self._occupied >> index & 1)
            assert bit == (len(bucket) > 0), (index, bit, len(bucket))
            if not bucket:
                continue
            start_tick = self._slot_start_tick(index)
            # A non-empty slot always starts after the current tick: advance cascades a slot
            # before time enters it.
            assert start_tick > self._cur_tick, (index, start_tick, self._cur_tick)
            span = 1 << self._shifts[index >> self._bits]
            lo = start_tick * self._tick
            hi = min((start_tick + span) * self._tick, NOT_PENDING)
            keys = np.frombuffer(bucket, dtype=np.uint32).astype(np.int64)
            assert int(keys.max()) < len(self._due)
            d = due_view[keys]
            live_parts.append(np.unique(keys[(d >= lo) & (d < hi)]))
        live = np.concatenate(live_parts) if live_parts else np.empty(0, dtype=np.int64)
        # Every pending key is live in exactly one bucket (or the near list).
        assert live.size == pending.size, (live.size, pending.size)
        assert np.array_equal(np.sort(live), pending)


class _Fired:
    """The output of one :meth:`TimingWheel.advance`: chunks already in order, as Python pairs
    or numpy columns, turned into one list of ``(due, key)`` at the end; past a limit, the rest
    stays in columns (no Python object is made for it)."""

    __slots__ = ("_chunks",)

    def __init__(self) -> None:
        self._chunks: list[list[tuple[int, int]] | tuple[Int64Array, UInt32Array]] = []

    def extend_pairs(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._chunks.append(pairs)

    def extend_arrays(self, dues: Int64Array, keys: UInt32Array) -> None:
        if keys.size:
            self._chunks.append((dues, keys))

    def result(
        self, limit: int | None
    ) -> tuple[list[tuple[int, int]], Int64Array | None, UInt32Array | None]:
        """The first ``limit`` pairs (all when None), and the rest as columns (or Nones)."""
        out: list[tuple[int, int]] = []
        rest_dues: list[Int64Array] = []
        rest_keys: list[UInt32Array] = []
        room = limit if limit is not None else -1
        for chunk in self._chunks:
            if isinstance(chunk, list):
                dues = keys = None
                size = len(chunk)
            else:
                dues, keys = chunk
                size = int(keys.size)
            take = size if room < 0 else min(size, room)
            if take:
                if dues is None or keys is None:
                    out.extend(chunk[:take] if take < size else chunk)  # type: ignore[arg-type]
                else:
                    out.extend(zip(dues[:take].tolist(), keys[:take].tolist(), strict=True))
            if take < size:
                if dues is None or keys is None:
                    tail = chunk[take:]
                    rest_dues.append(np.array([d for d, _k in tail], dtype=np.int64))
                    rest_keys.append(np.array([k for _d, k in tail], dtype=np.uint32))
                else:
                    rest_dues.append(dues[take:])
                    rest_keys.append(keys[take:])
            if room >= 0:
                room -= take
        if not rest_keys:
            return out, None, None
        return out, np.concatenate(rest_dues), np.concatenate(rest_keys)


def _as_int(value: object, field: str) -> int:
    """``value`` as a Python int (numpy integers welcome); floats and others are refused."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        error = InvalidKey if field == "key" else InvalidDue
        raise error(f"{field} must be an int, got {type(value).__name__}", field=field)
    return operator.index(value)


def _has_repeats(keys: npt.NDArray[np.int64], top: int) -> bool:
    """Whether ``keys`` (all in ``0..top``) holds a key twice: O(n + top) with a byte per key,
    instead of a sort, for the common batch of distinct keys in any order."""
    seen = np.zeros(top + 1, dtype=np.uint8)
    seen[keys] = 1
    return int(np.count_nonzero(seen)) != keys.size


def _sort_unique(
    dues: Int64Array, keys: UInt32Array, base: int | None, hi: int
) -> tuple[Int64Array, UInt32Array]:
    """Sort by ``(due, key)`` and drop repeated pairs (a key appended twice to one bucket)."""
    if base is not None and hi - base <= 1 << 32:
        # One uint64 sort instead of a lexsort: the offset in the slot above, the key below.
        packed = ((dues - base).astype(np.uint64) << np.uint64(32)) | keys.astype(np.uint64)
        packed.sort()
        if packed.size > 1:
            keep = np.empty(packed.size, dtype=bool)
            keep[0] = True
            np.not_equal(packed[1:], packed[:-1], out=keep[1:])
            if not keep.all():
                packed = packed[keep]
        out_dues = (packed >> np.uint64(32)).astype(np.int64) + base
        out_keys = (packed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        return out_dues, out_keys
    order = np.lexsort((keys, dues))
    dues, keys = dues[order], keys[order]
    if dues.size > 1:
        keep = np.ones(dues.size, dtype=bool)
        keep[1:] = (dues[1:] != dues[:-1]) | (keys[1:] != keys[:-1])
        dues, keys = dues[keep], keys[keep]
    return dues, keys
