"""The handler's answers about this node's right to run workers (fencing, design.md S4).

Why apart from etcd/handler.py: these are the agent's questions about the session's lease —
lost, deadline, confirmed now — and they grow with fencing, while the handler's own file is
about rounds. A mixin over ``_session`` (the handler's current Session, or None) and
``_fence_listeners``; nothing here owns anything.

Why ``confirm_session``: a round superseded because this node's own lease vanished (revoked with
etcdctl, expired behind our back) reaches the agent through the round watch first — the next
keep-alive may be TTL/3 away — and was stopped as a plain membership change, with the stop grace,
while a survivor reused the ranks. One LeaseTimeToLive call (about a millisecond) tells the two
apart before the agent chooses how to stop.
"""

from __future__ import annotations

from collections.abc import Callable

from etcdrun.rendezvous.client.lease import fence_margin
from etcdrun.rendezvous.etcd.node.session import Session


class SessionFence:
    _session: Session | None
    _fence_listeners: list[Callable[[float], None]]
    _lease_listeners: list[Callable[[], None]]

    def session_lost(self) -> bool:
        sess = self._session
        return sess is not None and sess.lost.is_set()

    def give_up_session(self, why: str) -> None:
        sess = self._session
        if sess is not None and not sess.lost.is_set():
            sess.abandon(why)

    def confirm_session(self) -> bool:
        """False when etcd says our lease is gone (``session_lost()`` is then True too); True
        when it lives or etcd did not answer within the fence margin (the keep-alives decide)."""
        sess = self._session
        if sess is None or sess.lost.is_set():
            return sess is None
        return sess.confirm() is not False

    def session_in_doubt(self) -> bool:
        sess = self._session
        return sess is not None and sess.in_doubt

    def fence_margin(self) -> float:
        sess = self._session
        return fence_margin(sess.ttl) if sess is not None else 0.0

    def on_lease_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._lease_listeners.append(callback)
        return lambda: self._lease_listeners.remove(callback)

    def _wire_fence(self, sess: Session) -> None:
        """A new session: its keep-alives move the fence deadline, its doubt wakes the agent."""

        def refreshed(at: float) -> None:
            for cb in list(self._fence_listeners):
                cb(at)
            self._tell_lease_listeners()

        sess.on_refreshed(refreshed)
        sess.on_doubt(self._tell_lease_listeners)

    def _tell_lease_listeners(self) -> None:
        for cb in list(self._lease_listeners):
            cb()

    def fence_deadline(self) -> float | None:
        sess = self._session
        return sess.presumed_lost_at if sess is not None and not sess.lost.is_set() else None

    def on_fence_deadline(self, callback: Callable[[float], None]) -> Callable[[], None]:
        self._fence_listeners.append(callback)
        return lambda: self._fence_listeners.remove(callback)


__all__ = ["SessionFence"]
