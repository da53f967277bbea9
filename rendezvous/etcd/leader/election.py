"""Leader election by create revision (etcd's election recipe), without a herd.

Why: exactly one agent — the oldest live one — watches the joined/ and agents/ prefixes and
freezes rounds (L5: O(N) watch events per round, not O(N^2)). Every other agent watches only the
one agent key just older than its own, from the revision it read + 1; when that key is deleted it
looks again, and either finds a new predecessor or is now the oldest. A death wakes one agent.

Finding the predecessor: the registering Txn read the run's tail key (``registered_after``), the
agent registered just before. While that agent's key is the one it registered (same create
revision), no live agent lies between, so it is the predecessor: one read of one key. Otherwise
(it is gone, or was never named) the agent reads the line sorted by create revision, which etcd
serves by reading every key under agents/ whatever the limit: O(N) for etcd, so an election at
every registration would cost a job of N agents O(N^2). With the tail that full read happens
once per departure, at the departed agent's successor. The tail only ever proves that an older
agent lives, so a stale or foreign tail can cost a read, never a second leader.

The election borrows the session (its key is the candidacy, its create revision the place in
line); it writes nothing. Connection loss: a watch that ends in error counts as a change, so the
owner calls ``check()`` again and reads the line afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import DepartureCause
from etcdrun.rendezvous.client import Watch, WatchBatch
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.session import Session

log = logging.getLogger(__name__)
PAGE = 8  # predecessors read at a time (values included, to check each one is an agent)


class Election:
    """Call ``check()`` at start and whenever ``on_change`` fires; ``is_leader`` tells the rest.

    ``on_change`` runs on the client's watch thread: it must only post work elsewhere.
    """

    def __init__(self, session: Session, prefix: str, on_change: Callable[[], None]) -> None:
        self._session = session
        self._prefix = prefix
        self._on_change = on_change
        self._watch: Watch | None = None
        self.is_leader = False
        # How the predecessors we watched went (LEFT: it marked itself leaving first; else
        # LEASE_EXPIRED): the leader this agent becomes says why the round opened.
        self.departed: dict[str, DepartureCause] = {}
        self._leaving: set[str] = set()
        # The agent registered just before this one (the session's tail read), until it is
        # found gone: it never comes back, so a later check does not read it again.
        self._after = session.registered_after

    def check(self) -> bool:
        """Find the predecessor; watch it, or become leader. Returns ``is_leader``.

        A key under agents/ that is no agent (not held by the lease its value names) is passed
        over: an agent waiting on it would wait forever, since such a key never expires.
        """
        if self.is_leader:
            return True
        self._cancel()
        if self._watch_registered_after():
            return False
        below, client = self._session.create_revision - 1, self._session.client
        while True:
            res = client.range(
                self._prefix,
                prefix=True,
                max_create_revision=below,
                sort=("create", "descend"),
                limit=PAGE,
            )
            kv = next((kv for kv in res.kvs if self._is_agent(kv)), None)
            if kv is not None:
                self._follow(kv, res.revision)
                return False
            if not res.more:
                self.is_leader = True
                return True
            below = res.kvs[-1].create_revision - 1

    def _watch_registered_after(self) -> bool:
        """Watch the agent registered just before this one, if it is still that agent."""
        if self._after is None:
            return False
        node, created = self._after
        res = self._session.client.range(self._session.keys.agent(node))
        kv = res.kvs[0] if res.kvs else None
        if kv is None or kv.create_revision != created or not self._is_agent(kv):
            self._after = None
            return False
        self._follow(kv, res.revision)
        return True

    def _follow(self, kv: pb.KeyValue, read_at: int) -> None:
        """Watch the predecessor ``kv``, as read at revision ``read_at``, for what comes next."""
        self._watch = self._session.client.watch(
            kv.key, start_revision=read_at + 1, callback=self._changed
        )

    def _is_agent(self, kv: pb.KeyValue) -> bool:
        try:
            codec.agent_from(
                kv.key, kv.value, kv.create_revision, self._session.keys.run_id, kv.lease
            )
        except RendezvousError as e:
            log.warning("election: passing over %s", e)
            return False
        return True

    def _changed(self, batch: WatchBatch) -> None:
        # Any event on the predecessor counts: a delete (it is gone), or a put (it may no
        # longer be an agent); either way the line is read again.
        for ev in batch.events:
            node = self._session.keys.parse(ev.kv.key)[2] or ""
            if ev.type == pb.Event.DELETE:
                self.departed[node] = (
                    DepartureCause.LEFT if node in self._leaving else DepartureCause.LEASE_EXPIRED
                )
            elif ev.kv.value:
                self._note_leaving(node, ev.kv.value)
        if batch.error is not None or batch.events:
            self._on_change()

    def _note_leaving(self, node: str, value: bytes) -> None:
        try:
            info = codec.decode(st.AgentInfo, node, value)
        except RendezvousError:
            return
        if info.leaving:
            self._leaving.add(node)

    def _cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        """Stop watching; a later ``check()`` runs the election again. Idempotent."""
        self._cancel()
        self.is_leader = False


__all__ = ["Election"]
