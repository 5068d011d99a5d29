"""Shard ownership: when a node may act for a shard, and what a store or worker refuses.

Owns the decisions both drivers make about who acts for a shard (DESIGN.md, "Cluster"), so
that the simulation exercises the very rules the Trio node will follow:

* :class:`ShardLease`, one per (node, shard): read the shard's owner and epoch, acquire it by
  compare-and-swap (taking epoch + 1), renew, give it up, and fence itself: stop acting before
  the lease can have expired in the coordinator's view, judged by its own monotonic clock
  with a drift bound and a safety margin. A node whose wall clock disagrees with the
  coordinator's beyond ``clock_bound_ms`` stops acting and acquires nothing until it agrees.
* :class:`EpochFence`: the store's and the worker's rule: anything stamped with an epoch older
  than the newest one opened (store) or seen (worker) is refused.
* :func:`worker_fence_at` and :func:`stop_disposition`: when a worker must stop its tasks, and
  what a worker stopping gracefully does with a run it will not finish.
* :func:`shard_of` and :func:`preference`: which shard a job id belongs to, and the order in
  which nodes offer to own a shard (rendezvous hashing), the same on every node.

Events in (monotonic and wall ms, coordinator responses), effects out (requests for the
coordinator, start or stop acting). Must never do I/O, read a clock or draw randomness; the
coordinator itself (etcd, or the simulation's model of it) lives with its driver.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import EngineUsageError, StaleEpoch
from engine.frozen import rebuilt_by_init

#: The guard :attr:`LeaseConfig.mutants` may switch off.
LEASE_MUTANTS = frozenset({"no-self-fence"})
#: The guard :attr:`EpochFence.mutants` may switch off.
FENCE_MUTANTS = frozenset({"no-epoch-fence"})
#: The worker's self-fence (:func:`worker_fence_at`), which the simulated worker may skip
#: (``SimConfig.worker_mutants``): its tasks then run on past the deadline.
WORKER_MUTANTS = frozenset({"no-worker-fence"})

_PPM = 1_000_000


# ------------------------------------------------------------------------ routing


def preference(shard: int, nodes: Sequence[str]) -> list[str]:
    """``nodes`` in the order they offer to own ``shard`` (highest random weight first).

    Rendezvous hashing: removing a node moves only the shards it preferred, and every node
    computes the same order without talking to the others. O(n log n).
    """

    def weight(node: str) -> bytes:
        return hashlib.blake2b(f"{shard}/{node}".encode(), digest_size=8).digest()

    return sorted(nodes, key=lambda n: (weight(n), n), reverse=True)


# ------------------------------------------------------------------------ the fence


@dataclass(frozen=True)
class EpochFence:
    """The store's fence (and a worker's, for dispatches): a write or dispatch stamped with an
    epoch older than the newest one the receiver knows is refused.

    ``mutants`` may hold ``"no-epoch-fence"`` (stale writes and dispatches accepted), so the
    simulation can prove its checks catch it. Empty in production; never set it outside tests.
    """

    mutants: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = self.mutants - FENCE_MUTANTS
        if unknown:
            raise EngineUsageError(f"unknown mutants {sorted(unknown)}", field="mutants")

    def accepts(self, newest_epoch: int, stamped_epoch: int) -> bool:
        """Whether a write or dispatch stamped ``stamped_epoch`` may be applied by a receiver
        that has seen ``newest_epoch``. O(1)."""
        if "no-epoch-fence" in self.mutants:
            return True  # the mutant: a stale owner's writes and dispatches go through
        return stamped_epoch >= newest_epoch

    def open(self, newest_epoch: int, opening_epoch: int) -> int:
        """The receiver's newest epoch after a new owner opens it at ``opening_epoch``; from
        then on, everything stamped older is refused. Raises :class:`StaleEpoch` when an owner
        at or above ``opening_epoch`` opened it already (the opener lost a race)."""
        if opening_epoch <= newest_epoch:
            raise StaleEpoch(
                f"opened at epoch {newest_epoch} already; cannot open at {opening_epoch}",
                field="epoch",
            )
        return opening_epoch


# ------------------------------------------------------------------------ the clock rule


def clock_disagreement(sent_mono: int, recv_mono: int, recv_wall: int, coord_wall: int) -> int:
    """An upper bound, in ms, on how far this node's wall clock is from the coordinator's.

    The coordinator read its clock (``coord_wall``) somewhere between our request leaving
    (``sent_mono``) and its answer arriving (``recv_mono``, when our wall clock said
    ``recv_wall``); our wall clock at that moment was within ``[recv_wall - rtt, recv_wall]``.
    The distance to a point is largest at an end of the interval. A slow round trip makes the
    bound loose, never wrong (drift during one round trip aside).
    """
    rtt = max(0, recv_mono - sent_mono)
    return max(abs(recv_wall - coord_wall), abs(recv_wall - rtt - coord_wall))


# ------------------------------------------------------------------------ messages


@dataclass(frozen=True)
class ReadShard:
    """Ask the coordinator who owns ``shard`` and at which epoch."""

    req: int
    shard: int


@dataclass(frozen=True)
class Acquire:
    """Compare-and-swap: if ``shard`` has no owner and its epoch is ``expected_epoch``, make
    ``node`` the owner at ``expected_epoch + 1`` under a new lease of ``ttl_ms``. A resend with
    the same ``nonce`` gets the same grant back (the first answer may have been lost)."""

    req: int
    shard: int
    node: str
    nonce: int
    expected_epoch: int
    ttl_ms: int


@dataclass(frozen=True)
class Renew:
    req: int
    shard: int
    lease_id: int


@dataclass(frozen=True)
class Revoke:
    """Give the lease up now (best effort: it lapses by itself anyway)."""

    req: int
    shard: int
    lease_id: int


Request = ReadShard | Acquire | Renew | Revoke


@dataclass(frozen=True)
class ShardView:
    """The owner (None: nobody) and epoch of ``shard``. ``req`` 0: an unsolicited change
    notification (a watch), which carries no round trip to judge the clock by."""

    req: int
    shard: int
    owner: str | None
    epoch: int
    coord_wall_ms: int


@dataclass(frozen=True)
class Granted:
    req: int
    shard: int
    epoch: int
    lease_id: int
    coord_wall_ms: int


@dataclass(frozen=True)
class Denied:
    req: int
    shard: int
    owner: str | None
    epoch: int
    coord_wall_ms: int


@dataclass(frozen=True)
class Renewed:
    req: int
    shard: int
    lease_id: int
    coord_wall_ms: int


@dataclass(frozen=True)
class LeaseGone:
    """A renew came too late: the coordinator expired or revoked the lease."""

    req: int
    shard: int
    lease_id: int
    coord_wall_ms: int


Response = ShardView | Granted | Denied | Renewed | LeaseGone


@dataclass(frozen=True)
class StartActing:
    """The driver may open the shard's store at ``epoch`` and act for it."""

    shard: int
    epoch: int


@dataclass(frozen=True)
class StopActing:
    """The driver must stop acting for the shard now: no write, no dispatch, no reply."""

    shard: int
    epoch: int
    reason: str


LeaseEffect = ReadShard | Acquire | Renew | Revoke | StartActing | StopActing


# ------------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class LeaseConfig:
    """Tunables of shard leases; every duration in ms.

    ``max_drift_ppm`` bounds how far the node's monotonic clock may run from the
    coordinator's clock, in parts per million: the node relies on a lease for
    ``safe_ms`` of its own monotonic time after sending the request that (re)started it.
    """

    ttl_ms: int = 6_000
    renew_every_ms: int = 2_000
    #: resend a request that got no answer after this long
    retry_ms: int = 1_000
    #: re-read a shard owned by someone else this often (changes also arrive as watches)
    poll_ms: int = 10_000
    #: a node of rank r in :func:`preference` waits r times this before acquiring a free shard
    stagger_ms: int = 1_000
    max_drift_ppm: int = 1_000
    margin_ms: int = 500
    #: a node whose wall clock may be further than this from the coordinator's owns nothing
    clock_bound_ms: int = 1_000
    #: guards switched off on purpose, so the simulation can prove its checks catch the fault:
    #: "no-self-fence" (a node keeps acting after its lease may have expired). Empty in
    #: production; never set it outside tests.
    mutants: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = self.mutants - LEASE_MUTANTS
        if unknown:
            raise EngineUsageError(f"unknown mutants {sorted(unknown)}", field="mutants")
        if not 0 <= self.max_drift_ppm < _PPM // 10:
            raise EngineUsageError("drift bound must be in 0..99999 ppm", field="max_drift_ppm")
        for name in ("ttl_ms", "renew_every_ms", "retry_ms", "poll_ms"):
            if getattr(self, name) <= 0:
                raise EngineUsageError("must be positive", field=name)
        if self.margin_ms < 1:
            # at least 1 ms: clocks are read in whole milliseconds
            raise EngineUsageError("margin must be at least 1 ms", field="margin_ms")
        if self.stagger_ms < 0 or self.clock_bound_ms < 0:
            raise EngineUsageError("must not be negative", field="stagger_ms")
        if self.renew_every_ms >= self.safe_ms:
            raise EngineUsageError(
                f"renewing every {self.renew_every_ms} ms cannot keep a lease that is safe "
                f"for {self.safe_ms} ms",
                field="renew_every_ms",
            )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return rebuilt_by_init(self)

    @property
    def safe_ms(self) -> int:
        """How long, by the node's monotonic clock, after sending a request the lease it
        grants or renews may be relied on.

        The coordinator counts ``ttl_ms`` from when it receives the request (after we sent
        it), on its own clock; ours may run fast by ``max_drift_ppm`` relative to it, so
        ``ttl * (1 - drift)`` of our time is at most ``ttl`` of its time. The margin covers
        the rest (a pause between checking and acting is the epoch fence's job).
        """
        return self.ttl_ms * (_PPM - self.max_drift_ppm) // _PPM - self.margin_ms


class LeaseState(enum.StrEnum):
    IDLE = "idle"  # neither owner nor asking; re-reads at poll time if it wants the shard
    READING = "reading"  # asked who owns the shard
    WAITING = "waiting"  # the shard is free: waiting its turn (rank * stagger) to acquire
    ACQUIRING = "acquiring"  # compare-and-swap sent
    ACTIVE = "active"  # owner; acts while its monotonic clock is before the deadline


@dataclass(slots=True)
class _Sent:
    kind: str  # "read", "acquire", "renew"
    mono: int  # when this request left
    first_mono: int  # for an acquire: when its first copy (same nonce) left


class ShardLease:
    """Whether one node may act for one shard, and what to ask the coordinator next.

    Guarantees, given a coordinator with etcd's semantics (a lease lapses ``ttl_ms`` after
    its last grant or renewal reached it; compare-and-swap grants a free shard at epoch + 1)
    and a monotonic clock within ``max_drift_ppm`` of the coordinator's:

    * :meth:`may_act` is true only between a grant and ``safe_ms`` after the newest request
      that (re)started the lease left, which is before the coordinator can let it lapse; so
      no two nodes act for a shard at once, and never under the same epoch.
    * It is false while the last clock check put the wall clock further than
      ``clock_bound_ms`` from the coordinator's.
    * Responses to requests this machine did not send (or no longer waits for) are ignored.

    Failure modes: a driver that performs an action it decided before a pause (a process
    frozen between :meth:`may_act` and the write) is not covered; the :class:`EpochFence` at
    the store and at the workers is. Not thread-safe; one driver calls it. Every method is
    O(requests in flight), a handful.
    """

    def __init__(
        self, *, node: str, shard: int, rank: int = 0, config: LeaseConfig | None = None
    ) -> None:
        self.node = node
        self.shard = shard
        self.rank = rank
        self.config = config or LeaseConfig()
        self.state = LeaseState.IDLE
        self.want = False
        self.epoch = 0  # the epoch held (ACTIVE) or last seen
        self.lease_id: int | None = None
        self.deadline = 0  # ACTIVE: act only while mono < deadline
        self.clock_ok = True
        self.last_disagreement = 0
        self._renew_at = 0
        self._poll_at = 0
        self._acquire_at = 0
        self._expected = 0
        self._nonce = 0
        self._req = 0
        self._sent: dict[int, _Sent] = {}
        self._out: list[LeaseEffect] = []

    # ---------------------------------------------------------------- inputs

    def want_ownership(self, mono_ms: int) -> list[LeaseEffect]:
        """The node would like to own this shard: read it now, acquire it when it is free."""
        self.want = True
        if self.state is LeaseState.IDLE:
            self._read(mono_ms)
        return self._flush()

    def give_up(self, mono_ms: int, reason: str = "released") -> list[LeaseEffect]:
        """Stop wanting the shard; stop acting and revoke the lease if held."""
        self.want = False
        if self.state is LeaseState.ACTIVE:
            self._stop(reason, revoke=True)
        elif self.state in (LeaseState.READING, LeaseState.WAITING):
            self.state = LeaseState.IDLE
            self._forget("read")
        # ACQUIRING: the answer decides (a grant is revoked at once).
        return self._flush()

    def store_refused(self, mono_ms: int) -> list[LeaseEffect]:
        """The store (or a worker) refused our epoch: a newer owner exists. Stop now."""
        if self.state is LeaseState.ACTIVE:
            self._stop("fenced: a newer epoch opened the shard", revoke=True)
            self._poll_at = mono_ms + self.config.poll_ms
        return self._flush()

    def tick(self, mono_ms: int) -> list[LeaseEffect]:
        """Time passes: fence, renew, resend, poll or acquire as due."""
        cfg = self.config
        if self.state is LeaseState.ACTIVE:
            if mono_ms >= self.deadline and "no-self-fence" not in cfg.mutants:
                self._stop("lease may have expired", revoke=True)
                self._poll_at = mono_ms  # try again at once (a new epoch)
            else:
                # Renew on schedule; resend one that got no answer (every answer counts).
                newest = self._newest("renew")
                if (newest is None and mono_ms >= self._renew_at) or (
                    newest is not None and mono_ms - newest >= cfg.retry_ms
                ):
                    self._send_renew(mono_ms)
        if self.state is LeaseState.READING:
            newest = self._newest("read")
            if newest is None or mono_ms - newest >= cfg.retry_ms:
                self._read(mono_ms)
        elif self.state is LeaseState.WAITING and mono_ms >= self._acquire_at:
            self._send_acquire(mono_ms, fresh=True)
        elif self.state is LeaseState.ACQUIRING:
            newest = self._newest("acquire")
            if newest is None or mono_ms - newest >= cfg.retry_ms:
                self._send_acquire(mono_ms, fresh=False)
        elif self.state is LeaseState.IDLE and self.want and mono_ms >= self._poll_at:
            self._read(mono_ms)
        return self._flush()

    def on_response(self, response: Response, mono_ms: int, wall_ms: int) -> list[LeaseEffect]:
        """A coordinator answer (or a watch notification) arrived at ``mono_ms``/``wall_ms``."""
        if response.shard != self.shard:
            raise EngineUsageError(
                f"response for shard {response.shard} given to shard {self.shard}",
                field="shard",
            )
        sent = self._sent.get(response.req) if response.req else None
        if sent is not None:
            self._judge_clock(sent, mono_ms, wall_ms, response.coord_wall_ms)
        if isinstance(response, ShardView):
            self._on_view(response, sent, mono_ms)
        elif isinstance(response, Granted):
            if sent is not None and sent.kind == "acquire":
                self._on_granted(response, sent, mono_ms)
        elif isinstance(response, Denied):
            if sent is not None and sent.kind == "acquire":
                self._forget("acquire")
                self.state = LeaseState.IDLE
                self.epoch = max(self.epoch, response.epoch)
                self._poll_at = mono_ms + self.config.poll_ms
        elif isinstance(response, Renewed):
            if sent is not None and sent.kind == "renew":
                # This answer supersedes every renew sent before it (lost ones included).
                for req in [r for r, s in self._sent.items() if s.kind == "renew"]:
                    if self._sent[req].mono <= sent.mono:
                        del self._sent[req]
                if self.state is LeaseState.ACTIVE and response.lease_id == self.lease_id:
                    self.deadline = max(self.deadline, sent.mono + self.config.safe_ms)
        elif isinstance(response, LeaseGone):
            if self.state is LeaseState.ACTIVE and response.lease_id == self.lease_id:
                self._stop("lease expired at the coordinator", revoke=False)
                self._poll_at = mono_ms
        if self.state is LeaseState.ACTIVE and not self.clock_ok:
            self._stop(f"wall clock off by up to {self.last_disagreement} ms", revoke=True)
            self._poll_at = mono_ms + self.config.poll_ms
        return self._flush()

    # ---------------------------------------------------------------- queries

    def may_act(self, mono_ms: int) -> bool:
        """Whether the node may write, dispatch or reply for the shard at ``mono_ms``. The
        driver asks right before every action (and :meth:`tick` at :meth:`next_wakeup_mono`
        turns a lapsed deadline into :class:`StopActing`)."""
        if self.state is not LeaseState.ACTIVE or not self.clock_ok:
            return False
        return mono_ms < self.deadline or "no-self-fence" in self.config.mutants

    def next_wakeup_mono(self) -> int | None:
        """The monotonic time by which :meth:`tick` should next be called."""
        cfg = self.config
        times: list[int] = []
        if self.state is LeaseState.ACTIVE:
            times += [self.deadline, self._renew_at]
        elif self.state is LeaseState.WAITING:
            times.append(self._acquire_at)
        elif self.state is LeaseState.IDLE and self.want:
            times.append(self._poll_at)
        if self._sent:
            for kind in ("read", "acquire", "renew"):
                newest = self._newest(kind)
                if newest is not None:
                    times.append(newest + cfg.retry_ms)  # when it is resent
        return min(times) if times else None

    def _check(self) -> None:
        """Assert the invariants (tests call this after every step)."""
        if self.state is LeaseState.ACTIVE:
            assert self.lease_id is not None and self.epoch > 0
        else:
            assert self.lease_id is None
        assert all(s.first_mono <= s.mono for s in self._sent.values())
        # Bounded: a renew is resent at most once per retry_ms until the deadline stops it.
        assert len(self._sent) <= 2 + self.config.safe_ms // self.config.retry_ms
        if self.state is LeaseState.ACQUIRING:
            assert any(s.kind == "acquire" for s in self._sent.values())

    # ---------------------------------------------------------------- internals

    def _flush(self) -> list[LeaseEffect]:
        out, self._out = self._out, []
        return out

    def _next_req(self) -> int:
        self._req += 1
        return self._req

    def _newest(self, kind: str) -> int | None:
        """When the newest request of ``kind`` in flight left (None: none in flight)."""
        if not self._sent:
            return None  # the common case: every request answered
        return max((s.mono for s in self._sent.values() if s.kind == kind), default=None)

    def _forget(self, kind: str) -> None:
        for req in [r for r, s in self._sent.items() if s.kind == kind]:
            del self._sent[req]

    def _read(self, mono_ms: int) -> None:
        self._forget("read")
        req = self._next_req()
        self._sent[req] = _Sent("read", mono_ms, mono_ms)
        self.state = LeaseState.READING
        self._out.append(ReadShard(req, self.shard))

    def _send_acquire(self, mono_ms: int, *, fresh: bool) -> None:
        first = mono_ms
        if fresh:
            self._forget("acquire")
            self._nonce = self._next_req()
        else:
            first = min((s.first_mono for s in self._sent.values()), default=mono_ms)
        req = self._next_req()
        self._sent[req] = _Sent("acquire", mono_ms, first)
        self.state = LeaseState.ACQUIRING
        self._out.append(
            Acquire(req, self.shard, self.node, self._nonce, self._expected, self.config.ttl_ms)
        )

    def _send_renew(self, mono_ms: int) -> None:
        assert self.lease_id is not None
        req = self._next_req()
        self._sent[req] = _Sent("renew", mono_ms, mono_ms)
        self._renew_at = mono_ms + self.config.renew_every_ms
        self._out.append(Renew(req, self.shard, self.lease_id))

    def _judge_clock(self, sent: _Sent, mono_ms: int, wall_ms: int, coord_wall: int) -> None:
        self.last_disagreement = clock_disagreement(sent.mono, mono_ms, wall_ms, coord_wall)
        self.clock_ok = self.last_disagreement <= self.config.clock_bound_ms

    def _on_view(self, view: ShardView, sent: _Sent | None, mono_ms: int) -> None:
        if self.state is LeaseState.ACTIVE and view.epoch > self.epoch:
            # Someone holds a newer epoch: whatever our clock says, we are not the owner.
            self._stop(f"epoch {view.epoch} granted to {view.owner}", revoke=False)
        self.epoch = max(self.epoch, view.epoch)
        if sent is not None and sent.kind == "read":
            self._forget("read")
            if self.state is LeaseState.READING:
                self.state = LeaseState.IDLE
        if self.state is not LeaseState.IDLE or not self.want:
            return
        if view.owner is None and self.clock_ok:
            self._expected = view.epoch
            self._acquire_at = mono_ms + self.rank * self.config.stagger_ms
            self.state = LeaseState.WAITING
        else:
            self._poll_at = mono_ms + self.config.poll_ms

    def _on_granted(self, grant: Granted, sent: _Sent, mono_ms: int) -> None:
        self._forget("acquire")
        self.lease_id, self.epoch = grant.lease_id, grant.epoch
        # The lease started when the coordinator received the first copy of this acquire,
        # which was after that copy left: count from there.
        self.deadline = sent.first_mono + self.config.safe_ms
        self._renew_at = sent.first_mono + self.config.renew_every_ms
        if self.want and self.clock_ok and mono_ms < self.deadline:
            self.state = LeaseState.ACTIVE
            self._out.append(StartActing(self.shard, self.epoch))
            return
        # Not usable (given up meanwhile, a wall clock off, or an answer too late to rely
        # on): hand it back without ever acting.
        self.state = LeaseState.IDLE
        self.lease_id = None
        self._out.append(Revoke(self._next_req(), self.shard, grant.lease_id))
        self._poll_at = mono_ms + (self.config.poll_ms if not self.clock_ok else 0)

    def _stop(self, reason: str, *, revoke: bool) -> None:
        lease_id = self.lease_id
        self._forget("renew")
        self.state = LeaseState.IDLE
        self.lease_id = None
        self._out.append(StopActing(self.shard, self.epoch, reason))
        if revoke and lease_id is not None:
            self._out.append(Revoke(self._next_req(), self.shard, lease_id))


# ------------------------------------------------------------------------ workers


def worker_fence_at(heartbeat_sent_ms: int, lease_ms: int, margin_ms: int) -> int:
    """When a worker must stop its tasks (DESIGN.md, "Workers fence themselves"), given when
    it sent the newest heartbeat the node acknowledged (its own monotonic ms).

    The node renewed the worker's lease when that heartbeat arrived, which is no earlier than
    it left: counting from the send, less ``margin_ms`` (at least half the lease is kept), the
    worker stops before the node can consider it gone, however slow the acknowledgement was.
    """
    return heartbeat_sent_ms + max(lease_ms - margin_ms, lease_ms // 2)


def guard_fence_at(heartbeat_sent_ms: int, lease_ms: int, margin_ms: int) -> int:
    """When a worker's guard (``cluster.watchdog``, a process of its own) kills the worker's
    tasks if the worker has not fenced itself by then (:func:`worker_fence_at`): halfway
    from the worker's own deadline to the earliest moment the node may consider it gone
    (``heartbeat_sent_ms + lease_ms``). A worker that runs fences first, so its tasks end as
    fenced; one that cannot (stopped, its loop blocked by synchronous code) still has them
    killed before the node hands its runs out again. The result is no earlier than the
    worker's own deadline, and earlier than the node's whenever that one is."""
    fence = worker_fence_at(heartbeat_sent_ms, lease_ms, margin_ms)
    return fence + (heartbeat_sent_ms + lease_ms - fence) // 2


def stop_disposition(delivery: str) -> str:
    """What a stopping worker does with a run it will not finish (stopped at the end of the
    drain, or dispatched while stopping and never started): ``report`` it as ``killed``, or
    ``hand_back`` (unreported, and a hello without it).

    At-most-once: ``report``. The node can never send it again, and without a report it
    becomes LOST once the lease and the reattach grace lapse ("outcome unknown") although the
    worker knows the outcome: a killed run is FAILED, final, with the reason. At-least-once:
    ``hand_back``. It is owed until it completes, and the node sends it out again at once (a
    new attempt, no retry used), as for a worker that is gone; a ``killed`` report would make
    it FAILED with no retry at all."""
    return "report" if delivery == "at_most_once" else "hand_back"


__all__ = [
    "FENCE_MUTANTS",
    "LEASE_MUTANTS",
    "WORKER_MUTANTS",
    "Acquire",
    "Denied",
    "EpochFence",
    "Granted",
    "LeaseConfig",
    "LeaseEffect",
    "LeaseGone",
    "LeaseState",
    "ReadShard",
    "Renew",
    "Renewed",
    "Request",
    "Response",
    "Revoke",
    "ShardLease",
    "ShardView",
    "StartActing",
    "StopActing",
    "clock_disagreement",
    "guard_fence_at",
    "preference",
    "stop_disposition",
    "worker_fence_at",
]
