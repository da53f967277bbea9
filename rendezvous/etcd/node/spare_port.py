"""The port this node offers as MASTER_PORT of the next carried round in which it is rank 0.

Why: a carried round (design.md §3a) is frozen by the leader without its rank-0 node writing, so
the node must have published a port beforehand (AgentInfo.spare_port). A round's port must be
its own: a worker of the new round that reached an older round's store, still served by a
worker not yet stopped, would meet the wrong world. So the node draws a new one, and rewrites
its agent key, before it takes part in any round after one that used it, never drawing the
port of that round; the leader never carries a round on the port of the round it replaces.

Why held bound: a port drawn long before its round could be taken meanwhile by any socket of
the host (an outgoing connection picks a free port). A bound socket keeps it out of the
kernel's choice; it is closed when this node accepts the round that uses it, just before its
rank-0 worker binds it (``take``, with the next one held first: the window every reserved
MASTER_PORT has, free_port.py).
"""

from __future__ import annotations

import socket

from etcdrun.rendezvous.etcd.core.protocol import Round
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.node import joining
from etcdrun.rendezvous.events import EventLog


class SparePort:
    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self.port = 0

    def draw(self, avoid: frozenset[int] = frozenset()) -> int:
        """Hold a new port, other than the one held now and ``avoid``; then let the old go."""
        old, refused = self._sock, []
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                break
            refused.append(sock)  # held until we have another, so the kernel moves on
        for s in [*refused, old]:
            if s is not None:
                s.close()
        self._sock, self.port = sock, port
        return port

    def take(self, sess: Session, r: Round, events: EventLog) -> None:
        """Before this node accepts ``r``: if it is rank 0 of a round run on this spare (a
        carried round), the port goes to its rank-0 worker; hold another and publish it in
        the agent key, so the leader can carry the next round.
        """
        me = r.member(sess.node_id)  # a sharded round lists only this node's shard
        if r.master_port != sess.info.spare_port or me is None or me.node_rank != 0:
            return
        port = self.draw(avoid=frozenset({r.master_port}))
        if joining.publish_spare(sess, port):
            events.emit("spare_port_drawn", round=r.number, port=port)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self.port = None, 0


__all__ = ["SparePort"]
