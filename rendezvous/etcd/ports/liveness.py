"""The etcd backend's liveness port: this node's right to run workers is its session's lease.

Why the lease: etcd expires it on the server when keep-alives stop, and the others then hand
this node's ranks out (design.md S4). The lease is *in doubt* from its fence deadline (the
workers pause) and *lost* when it could have expired or etcd said so (the workers die). Why
``confirm``: a round superseded because this node's own lease vanished (revoked with etcdctl,
expired behind our back) reaches the agent through the round watch first — the next keep-alive
may be TTL/3 away — and was stopped as a plain membership change, with the stop grace, while a
survivor reused the ranks. One LeaseTimeToLive call (about a millisecond) tells the two apart.
"""

from __future__ import annotations

from collections.abc import Callable

from etcdrun.rendezvous.api import LeaseReading, Liveness, LivenessPort
from etcdrun.rendezvous.client.lease import fence_margin
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation
from etcdrun.rendezvous.listeners import Listeners

Listener = Callable[[LeaseReading], None]


def reading(sess: Session | None) -> LeaseReading:
    """What ``sess`` says now; no session (before the first round): live, no deadline."""
    if sess is None:
        return LeaseReading()
    margin, left, age = fence_margin(sess.ttl), sess.lease_time_left(), sess.keepalive_age()
    if sess.lost.is_set():
        return LeaseReading(Liveness.LOST, None, margin, left, age, sess.ttl)
    state = Liveness.IN_DOUBT if sess.in_doubt else Liveness.LIVE
    return LeaseReading(state, sess.presumed_lost_at, margin, left, age, sess.ttl)


class SessionLiveness(LivenessPort):
    """Reads the handler's current session (``incarnation``); each new session is ``attach``ed
    so that its keep-alives and its doubt reach the subscribers. Holds nothing of the handler.
    """

    def __init__(self, incarnation: Incarnation) -> None:
        self._now = incarnation
        self._listeners: Listeners[LeaseReading] = Listeners()

    def read(self) -> LeaseReading:
        return reading(self._now.session)

    def confirm(self) -> Liveness:
        """LOST when etcd says our lease is gone (``read()`` then says so too); LIVE when it
        lives or etcd did not answer within the fence margin (the keep-alives decide).
        """
        sess = self._now.session
        if sess is None:
            return Liveness.LIVE
        if sess.lost.is_set() or sess.confirm() is False:
            return Liveness.LOST
        return Liveness.LIVE

    def give_up(self, why: str) -> None:
        sess = self._now.session
        if sess is not None and not sess.lost.is_set():
            sess.abandon(why)

    def subscribe(self, callback: Listener) -> Callable[[], None]:
        return self._listeners.add(callback)

    def attach(self, sess: Session) -> None:
        """A new session: its keep-alives move the fence deadline, its doubt wakes the agent."""
        sess.on_refreshed(lambda _at: self._tell(sess))
        sess.on_doubt(lambda: self._tell(sess))

    def _tell(self, sess: Session) -> None:
        self._listeners.tell(reading(sess))


__all__ = ["SessionLiveness", "reading"]
