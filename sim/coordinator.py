"""The lease coordinator, with etcd's semantics as far as shard ownership uses them.

Owns per shard an ``owner`` key attached to a TTL lease and an ``epoch`` key, changed only by
compare-and-swap (:class:`engine.lease.Acquire`): a free shard at the expected epoch goes to
the asker at epoch + 1. A lease lapses ``ttl`` after its last grant or renewal *reached* the
coordinator, on the coordinator's clock, which is the simulation's true time. Changes are
pushed to watchers (nodes and workers) as :class:`engine.lease.ShardView` notifications.

It also keeps the history the checks need: when each (shard, epoch) was granted, to whom,
and when its lease ended in the coordinator's view. Must never decide anything for a node:
the node's decisions are :class:`engine.lease.ShardLease`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.lease import (
    Acquire,
    Denied,
    Granted,
    LeaseGone,
    ReadShard,
    Renew,
    Renewed,
    Request,
    Response,
    Revoke,
    ShardView,
)
from sim.config import T0
from sim.kernel import Kernel
from sim.net import Network

if TYPE_CHECKING:
    from sim.node import SimNode

NAME = "coord"


@dataclass(slots=True)
class _Lease:
    lease_id: int
    shard: int
    node: str
    nonce: int
    epoch: int
    ttl: int
    expiry: int


@dataclass(slots=True)
class Tenure:
    """One (shard, epoch): who got it, when, and when its lease ended (None: still live)."""

    node: str
    granted_at: int
    ended_at: int | None = None
    how: str = ""


class Coordinator:
    def __init__(self, kernel: Kernel, net: Network, shards: int) -> None:
        self._k = kernel
        self._net = net
        self.epoch = [0] * shards
        self.owner: list[_Lease | None] = [None] * shards
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 0
        self._expiry_at: int | None = None  # when the one expiry timer is due
        self.tenures: dict[tuple[int, int], Tenure] = {}
        self.watchers: list[tuple[str, Callable[[ShardView], None]]] = []

    # ---------------------------------------------------------------- queries (checks)

    def owner_of(self, shard: int) -> str | None:
        lease = self.owner[shard]
        return None if lease is None else lease.node

    def live(self, shard: int, epoch: int, at: int) -> bool:
        """Whether the lease of ``epoch`` was live at ``at`` in the coordinator's view."""
        tenure = self.tenures.get((shard, epoch))
        if tenure is None or at < tenure.granted_at:
            return False
        return tenure.ended_at is None or at < tenure.ended_at

    # ---------------------------------------------------------------- requests

    def requests(self, node: SimNode, incarnation: int, requests: Sequence[Request]) -> None:
        """A node's requests arrived (one packet); the answers travel back in one packet."""
        responses = []
        for request in requests:
            response = self._handle(request)
            if response is not None:
                responses.append(response)
        if responses:
            self._net.send(
                NAME,
                node.name,
                node.receive,
                incarnation,
                node.on_lease_responses,
                tuple(responses),
            )

    def _handle(self, request: Request) -> Response | None:
        now = self._k.now
        wall = T0 + now
        shard = request.shard
        if isinstance(request, ReadShard):
            return ShardView(request.req, shard, self.owner_of(shard), self.epoch[shard], wall)
        if isinstance(request, Acquire):
            held = self.owner[shard]
            if held is not None and (held.node, held.nonce) == (request.node, request.nonce):
                return Granted(request.req, shard, held.epoch, held.lease_id, wall)
            if held is None and self.epoch[shard] == request.expected_epoch:
                self._next_lease += 1
                epoch = self.epoch[shard] + 1
                lease = _Lease(
                    self._next_lease,
                    shard,
                    request.node,
                    request.nonce,
                    epoch,
                    request.ttl_ms,
                    now + request.ttl_ms,
                )
                self._leases[lease.lease_id] = lease
                self.owner[shard], self.epoch[shard] = lease, epoch
                self.tenures[(shard, epoch)] = Tenure(request.node, now)
                self._k.trace("grant", f"s{shard}", f"e{epoch}", request.node)
                self._arm_expiry(lease.expiry)
                self._notify(shard)
                return Granted(request.req, shard, epoch, lease.lease_id, wall)
            return Denied(request.req, shard, self.owner_of(shard), self.epoch[shard], wall)
        if isinstance(request, Renew):
            live = self._leases.get(request.lease_id)
            if live is None:
                return LeaseGone(request.req, shard, request.lease_id, wall)
            live.expiry = now + live.ttl
            return Renewed(request.req, shard, request.lease_id, wall)
        assert isinstance(request, Revoke)
        live = self._leases.get(request.lease_id)
        if live is not None:
            self._end(live, "revoked")
        return None

    # ---------------------------------------------------------------- expiry

    def _arm_expiry(self, at: int) -> None:
        """One timer for every lease, at the earliest expiry (a renewal only moves an expiry
        later, so the timer is never late; when it finds nothing lapsed, it moves on to the
        new earliest): one event per TTL or so instead of one per lease."""
        if self._expiry_at is None or at < self._expiry_at:
            self._expiry_at = at
            self._k.later(at - self._k.now, self._expire, at)

    def _expire(self, at: int) -> None:
        if self._expiry_at != at:
            return  # superseded by an earlier one
        self._expiry_at = None
        now = self._k.now
        soonest: int | None = None
        for lease in list(self._leases.values()):  # in grant order
            if lease.expiry <= now:
                self._end(lease, "expired")
            elif soonest is None or lease.expiry < soonest:
                soonest = lease.expiry
        if soonest is not None:
            self._arm_expiry(soonest)

    def _end(self, lease: _Lease, how: str) -> None:
        del self._leases[lease.lease_id]
        tenure = self.tenures[(lease.shard, lease.epoch)]
        tenure.ended_at, tenure.how = self._k.now, how
        if self.owner[lease.shard] is lease:
            self.owner[lease.shard] = None
        self._k.trace(how, f"s{lease.shard}", f"e{lease.epoch}", lease.node)
        self._notify(lease.shard)

    def _notify(self, shard: int) -> None:
        view = ShardView(0, shard, self.owner_of(shard), self.epoch[shard], T0 + self._k.now)
        for name, fn in self.watchers:
            self._net.send(NAME, name, fn, view)
