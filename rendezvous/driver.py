"""The per-session driver thread: the election and, when this agent leads, the decisions.

Why a thread of its own: watch callbacks must return at once (they run on the client's single
watch thread), while the leader's work does etcd round trips. Callbacks post to this queue; the
driver drains it, applies every event to the caches, then decides once — so a burst of N join
events costs one decision, not N.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from etcdrun.rendezvous.client import EtcdError, WatchBatch
from etcdrun.rendezvous.election import Election
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.leader import Leader
from etcdrun.rendezvous.session import Session

if TYPE_CHECKING:
    from etcdrun.rendezvous.etcd_rendezvous import EtcdRendezvousHandler

log = logging.getLogger(__name__)


class Driver:
    """One thread per session: the election and, when leader, the decisions."""

    def __init__(self, h: EtcdRendezvousHandler, sess: Session) -> None:
        self.h = h
        self.sess = sess
        self.q: queue.Queue = queue.Queue()
        self.leader: Leader | None = None
        self.election = Election(
            h.client, h.keys.agents, sess.create_revision, lambda: self.post(("election",))
        )
        self.thread = threading.Thread(target=self._run, name=f"rdzv-{sess.node_id}", daemon=True)
        self.q.put(("election",))
        self.thread.start()

    def post(self, item: object) -> None:
        self.q.put(item)

    def _run(self) -> None:
        until: float | None = None
        while True:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            try:
                items = [self.q.get(timeout=timeout)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            try:
                for item in items:
                    if isinstance(item, tuple) and item[0] == "stop":
                        self._stop_leader()
                        self.election.close()
                        return
                    if isinstance(item, tuple) and item[0] == "lost":
                        self._stop_leader()
                        self.election.close()
                    elif isinstance(item, tuple) and item[0] == "election":
                        if (
                            not self.sess.lost.is_set()
                            and self.leader is None
                            and self.election.check()
                        ):
                            self.leader = Leader(
                                self.h.client,
                                self.h.keys,
                                self.h.settings,
                                self.sess.node_id,
                                self.sess.create_revision,
                                self.h.get_round,
                                self.h.set_round,
                                self.post,
                                closed_ttl=int(self.h.cfg.join_timeout),
                            )
                            self.leader.start()
                    elif isinstance(item, tuple) and item[0] == "rewatch":
                        self.h.rewatch_round()
                    elif isinstance(item, WatchBatch) and self.leader is not None:
                        self.leader.on_batch(item)
                until = None
                if self.leader is not None and not self.sess.lost.is_set():
                    until = self.leader.act(time.monotonic())
            except RendezvousError as e:
                log.error("rendezvous driver: %s", e)
                until = time.monotonic() + 1.0
            except EtcdError as e:
                # Whatever broke (a call, or a leader watch ended by compaction), start the
                # election over: a new leader term re-reads a consistent snapshot.
                log.warning("rendezvous driver: etcd: %s; retrying", e)
                self._stop_leader()
                self.election.close()
                self.q.put(("election",))
                until = None

    def _stop_leader(self) -> None:
        if self.leader is not None:
            self.leader.stop()
            self.leader = None

    def stop(self) -> None:
        self.q.put(("stop",))
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
            if self.thread.is_alive():  # stuck in an etcd call past every timeout: say so
                log.error("rendezvous driver %s did not stop within 10 s", self.thread.name)
