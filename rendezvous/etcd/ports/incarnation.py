"""Incarnation: this node's current session and the driver that runs beside it.

Why a slot of its own: a node's session changes whenever its lease is lost (a new incarnation,
a new node id), and the ports the agent holds for the whole run (liveness, report) must follow
it without holding the handler. The handler alone writes the slot; the ports only read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from etcdrun.rendezvous.etcd.core.session import Session

if TYPE_CHECKING:  # the driver imports the leader's term, which imports the session: no cycle
    from etcdrun.rendezvous.etcd.leader.driver import Driver


@dataclass
class Incarnation:
    """``session`` and ``driver`` are None before the first round and after a loss or a leave."""

    session: Session | None = None
    driver: Driver | None = None

    @property
    def node_id(self) -> str | None:
        sess = self.session
        return sess.node_id if sess is not None else None


__all__ = ["Incarnation"]
