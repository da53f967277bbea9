"""A lease as its owner sees it: live, in doubt, or lost, and why (keeper.py keeps it alive).

Why the client knows when a lease is lost before etcd does: fencing. A lease lives on the server
at least until ``sent + TTL``, where ``sent`` is when we sent the keep-alive etcd acknowledged
(etcd refreshes on receipt, which is later). So when no keep-alive has been acknowledged for
``TTL - margin``, we declare the lease lost *before* it can expire: the owner stops its workers
while its keys still exist, and no two live agents ever hold the same place.

Why a lease is first *in doubt*, and lost only later: an etcd leader election can outlast the
margin (bench/results/leader_kills.md; bench/results/figures.md, 'Design notes' figures', S4),
and declaring the lease lost then would fence every agent although etcd renews every lease when
a new leader takes over. So at
``presumed_lost_at`` the lease is only in doubt (``in_doubt`` set, ``on_doubt`` callbacks: the
agent pauses its workers, SIGSTOP — a stopped process does not talk), keep-alives go on, and an
answer with TTL > 0 clears the doubt (the workers resume); it is *lost* once etcd could have
expired it (``expires_no_earlier_than``, TTL after the last acknowledged keep-alive's send time)
or answers TTL <= 0.

Why each lease remembers the raft term of its last answer (``term``): a new etcd leader (a
restart, a failover) renews every lease it takes over, the dead agents' too, so for up to one
TTL afterwards a lease's remaining time says nothing of its owner. An owner that has renewed in
the new term is known alive; the session says so in etcd (session.py, the term mark).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etcdrun.rendezvous.client.keeper import LeaseKeeper

log = logging.getLogger(__name__)


def fence_margin(ttl: float) -> float:
    """How long before the earliest possible expiry we give up on a lease: enough to stop
    workers, but small enough that a short etcd blip (leader change) is ridden out.
    """
    return min(max(0.2 * ttl, 0.5), ttl / 2)


class LeaseLoss(enum.Enum):
    """How a lease was lost, for code to decide on (``Lease.lost_reason`` is the line for
    people, with its details). Only REVOKED is this process's own doing: its agent left.
    """

    REVOKED = "revoked"  # revoke(): this process gave it back
    ABANDONED = "abandoned"  # abandon(): its owner learnt it has no place left
    GONE = "gone"  # confirm(): etcd no longer knows it (revoked or expired there)
    EXPIRED = "expired"  # a keep-alive's answer: TTL 0
    UNANSWERED = "unanswered"  # no keep-alive acknowledged for its TTL: presumed lost


class Lease:
    """A granted lease. ``lost`` is set once it expired, was revoked, or etcd could have expired it.

    Connection loss: keep-alives are retried across endpoints; ``TTL - margin`` after the send
    time of the last acknowledged one it is ``in_doubt`` (until an answer), at ``TTL`` after it
    ``lost`` is set and the callbacks run (on the keeper thread; keep them short). A lost lease
    never comes back: the owner grants a new one.
    """

    def __init__(
        self, keeper: LeaseKeeper | None, lease_id: int, ttl: int, sent_at: float, interval: float
    ):
        self.id = lease_id
        self.ttl = ttl
        self.lost = threading.Event()
        self.lost_reason = ""  # the line for people
        self.lost_how: LeaseLoss | None = None  # what code decides on
        self._keeper = keeper
        self._callbacks: list[Callable[[Lease], None]] = []
        self._refreshed: list[Callable[[Lease], None]] = []
        self._doubted: list[Callable[[Lease], None]] = []
        self.in_doubt = threading.Event()  # past presumed_lost_at, unanswered, not yet lost
        self._acked_sent_at = sent_at
        self._interval = interval
        self._next_at = sent_at + interval
        self._failures = 0  # keep-alive ticks failed in a row
        self._revoked = False
        self._orphaned = False
        self._abandoned = False
        self._presumed = False  # lost for want of an answer, not known gone on the server
        self.keepalives = 0
        self.term = 0  # etcd's raft term in its last answer (grant or keep-alive); 0: not known

    @property
    def expires_no_earlier_than(self) -> float:
        """Monotonic time before which etcd cannot have expired the lease."""
        return self._acked_sent_at + self.ttl

    @property
    def presumed_lost_at(self) -> float:
        return self.expires_no_earlier_than - fence_margin(self.ttl)

    def on_refreshed(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` after every acknowledged keep-alive (on the keeper thread;
        keep it short): ``presumed_lost_at`` has moved.
        """
        self._refreshed.append(callback)

    def on_doubt(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` each time the lease falls in doubt (keeper thread)."""
        self._doubted.append(callback)

    @property
    def next_deadline(self) -> float:
        """When the keeper must look again without an answer: doubt, then loss."""
        return self.expires_no_earlier_than if self.in_doubt.is_set() else self.presumed_lost_at

    def _run_callbacks(self, callbacks: list[Callable[[Lease], None]]) -> None:
        for cb in list(callbacks):
            try:
                cb(self)
            except Exception:  # a listener must not stop the keep-alives
                log.exception("lease callback failed")

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` once when the lease is lost (at once if it already is)."""
        self._callbacks.append(callback)
        if self.lost.is_set():
            callback(self)

    def _mark_lost(self, how: LeaseLoss, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_how, self.lost_reason = how, reason
        self.lost.set()
        if not self._revoked:  # the owner says what it means (the agent: "fenced: ..."); here
            log.info("etcd lease %x lost: %s", self.id, reason)  # for agent.log, not the console
        for cb in list(self._callbacks):
            try:
                cb(self)
            except Exception:  # a callback must not kill the keeper thread
                log.exception("lease-lost callback failed")

    def confirm(self, timeout: float) -> bool | None:
        """Ask etcd now whether the lease still lives (LeaseTimeToLive, one bounded call):
        False — and ``lost`` set — when it is gone (revoked by someone else, expired); None
        when etcd did not answer in time (the keep-alives go on deciding). Why: a round
        superseded because our own lease vanished must be fenced at once, not stopped with a
        grace, and the next keep-alive could be TTL/3 away.
        """
        from etcdrun.rendezvous.client.errors import EtcdError, EtcdLeaseNotFoundError

        if self._keeper is None or self.lost.is_set():
            return not self.lost.is_set()
        try:
            if self._keeper.time_to_live(self.id, timeout) > 0:
                return True
        except EtcdLeaseNotFoundError:
            pass
        except EtcdError:
            return None
        self._keeper.forget(self)
        self._mark_lost(LeaseLoss.GONE, "gone on the server (revoked or expired)")
        return False

    def abandon(self, reason: str) -> None:
        """Give the lease up now, though etcd still holds it (its owner learnt it has no place
        left: its agent key was removed): ``lost`` is set with ``reason`` and the callbacks run
        — the workers are fenced — and keep-alives stop; ``revoke()`` afterwards still revokes
        it on the server, so its join records go at once. Safe on the watch thread: no call.
        """
        self._abandoned = True
        if self._keeper is not None:
            self._keeper.forget(self)
        self._mark_lost(LeaseLoss.ABANDONED, reason)

    def orphan(self) -> None:
        """Stop keeping it alive, and forget it, without revoking: on the server it expires
        after its TTL, exactly as if this process had died (etcd's Session.Orphan). Nothing is
        reported locally (``lost`` stays as it was), and ``revoke()`` afterwards does nothing.
        For tests that play a crash, and for handing a lease over to another process.
        """
        self._orphaned = True
        if self._keeper is not None:
            self._keeper.forget(self)

    def revoke(self, timeout: float | None = None) -> bool:
        """Revoke on the server (its keys vanish at once) and stop keeping it alive. Idempotent;
        True when etcd confirmed (or the lease was already gone). ``timeout`` defaults to the
        policy's parting timeout: a leave must not hang on a dead etcd.
        """
        if self._keeper is None or self._orphaned:
            return True
        self._keeper.forget(self)
        was_lost = self.lost.is_set()
        self._revoked = True
        self._mark_lost(LeaseLoss.REVOKED, "revoked")
        if was_lost and self._presumed:  # etcd did not answer: revoke when it next does
            self._keeper.revoke_later(self.id)
            return True  # nothing of this node's left to wait for here
        if was_lost and self.lost_how is not LeaseLoss.REVOKED and not self._abandoned:
            return True  # gone on the server already
        return self._keeper.revoke(self.id, timeout)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:x}, ttl={self.ttl}, lost={self.lost.is_set()})"


__all__ = ["Lease", "LeaseLoss", "fence_margin"]
