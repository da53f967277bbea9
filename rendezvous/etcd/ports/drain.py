"""The etcd backend's drain port: this node hears of ``etcdrun drain`` through a watch on its
own drain key (design.md §2, ``drain/<node_id>``), never by polling.

Why a key per node and a watch per session: a request must reach exactly one node and cost the
others nothing; the leader's prefix watches (agents/, rounds/) never see it, and the round key
every agent watches stays as it is. The key is put under the node's own lease by the one who
asks (rendezvous/etcd/core/drain_request.py), so it vanishes with the node: a new incarnation
(a new node id) is never drained by a request meant for the old one, and nothing outlives the run.

Why ``room`` reads the round view only: the agent asks from its signal handler (SIGTERM), where
no etcd call may run. The frozen round this node runs in says how many nodes the job has; a
node that is no member of it (a hot spare, a newcomer) can always leave. ``claim`` and
``stopped`` are etcd's word on the same question when several nodes are signalled at once
(signalled.py); the agent asks them from a thread of its own and on its way out.
"""

from __future__ import annotations

import logging
import threading

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import DrainPort, DrainRequest
from etcdrun.rendezvous.client import Watch, WatchBatch
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.node import signalled
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation

log = logging.getLogger(__name__)


class EtcdDrain(DrainPort):
    """Watches the current session's drain key; ``requested`` once a request came (from the
    key or from ``request``), which the handler's joining loop reads to stop waiting.
    """

    def __init__(self, ctx: RunContext, incarnation: Incarnation) -> None:
        super().__init__()
        self._ctx = ctx
        self._now = incarnation
        self._watch: Watch | None = None
        self._mu = threading.Lock()
        self._taken = False
        self._signalled_in: Round | None = None  # the round a signal's claim was made in
        self.requested: DrainRequest | None = None

    def node_id(self) -> str:
        return self._now.node_id or ""

    def room(self) -> bool:
        r, me, s = self._ctx.view.placed(), self._now.node_id, self._ctx.settings
        if r is None or r.phase is not Phase.FROZEN or me is None or r.member(me) is None:
            return r is None or r.phase is not Phase.CLOSED
        return r.node_count > s.min_nodes

    def claim(self, by: str) -> bool | None:
        """The signalled-nodes record decides (signalled.py); a node that is no member of the
        frozen round it sees (a spare, a newcomer) can always leave, as ``room`` says.
        """
        r, me = self._ctx.view.placed(), self._now.node_id
        if r is None or r.phase is not Phase.FROZEN or me is None or r.member(me) is None:
            return self.room()
        self._signalled_in = r
        return signalled.claim(self._ctx, r, me, by)

    def stopped(self, by: str) -> bool:
        r = self._signalled_in or self._ctx.view.placed()
        me = self._now.node_id
        if r is None or r.phase is not Phase.FROZEN or me is None or r.member(me) is None:
            return False
        return signalled.stopped(self._ctx, r, me, by)

    def request(self, by: str) -> None:
        """From the agent's signal handler: the work (an event, a lock, the subscribers) runs
        on a thread of its own, since the interrupted code may hold the event log's lock.
        """
        req = DrainRequest(self.node_id(), by)
        threading.Thread(target=self._take, args=(req,), name="etcdrun-drain", daemon=True).start()

    def attach(self, sess: Session) -> None:
        """A new session: watch its drain key from its registration on (the key can only be
        put while the agent key lives, so nothing older can exist).
        """
        self.detach()
        key = self._ctx.keys.drain(sess.node_id)
        self._watch = self._ctx.client.watch(
            key, start_revision=sess.create_revision, callback=self._on_batch
        )

    def detach(self) -> None:
        w, self._watch = self._watch, None
        if w is not None:
            w.cancel()

    def _on_batch(self, batch: WatchBatch) -> None:
        """Watch thread: a put of our key is the request (a broken watch is logged: the node
        is then drained only by SIGTERM until its next session; a drain is never urgent).
        """
        if batch.error is not None:
            log.warning("the watch on this node's drain key ended: %s", batch.error)
            return
        for ev in batch.events:
            if ev.type != pb.Event.PUT:
                continue
            try:
                msg = codec.decode(st.DrainRequest, ev.kv.key, ev.kv.value, self._ctx.keys.run_id)
            except RendezvousError as e:
                log.error("ignoring a drain request nobody can read: %s", e)
                continue
            self._take(DrainRequest(msg.node_id, msg.by or "someone"))

    def _take(self, req: DrainRequest) -> None:
        """Once per handler: the first request wins, later ones say nothing new. The agent
        hears of it before ``requested`` is set: the joining loop ends on ``requested``, and
        the agent must know why by then.
        """
        with self._mu:
            if self._taken:
                return
            self._taken = True
        r = self._ctx.view.running()
        self._ctx.events.emit("drain_requested", by=req.by, round=r.number if r else None)
        self._tell(req)
        self.requested = req
        self._ctx.view.wake()  # a next_rendezvous() waiting for a round stops waiting


__all__ = ["EtcdDrain"]
