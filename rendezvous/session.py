"""Session: the single owner of one agent incarnation's liveness (etcd's concurrency.Session).

A session is a lease kept alive by the client plus the agent key registered under it. Everything
else the agent writes that must die with it (join records, barrier entries) is put under the same
lease, so a crash or partition removes all of it in one revision, and peers see one event.

Lifecycle: ``open()`` → use ``lease``/``create_revision`` → ``close()`` (revokes: peers see the
departure at once). Connection loss: when keep-alives stay unanswered until shortly before the
lease could expire, ``lost`` is set (fencing, S4); a lost session never revives — the owner opens
a new one, as a new participant with a new node id.
"""

from __future__ import annotations

import logging
import threading

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import codec
from etcdrun.rendezvous.client import EtcdClient, EtcdError, Lease
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.keys import RunKeys

log = logging.getLogger(__name__)


class Session:
    def __init__(self, client: EtcdClient, keys: RunKeys, info: st.AgentInfo, ttl: int) -> None:
        self.client = client
        self.keys = keys
        self.info = info
        self.ttl = ttl
        self.lease: Lease | None = None
        self.create_revision = 0
        self._closed = False

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def lost(self) -> threading.Event:
        assert self.lease is not None, "session not open"
        return self.lease.lost

    def open(self) -> Session:
        """Grant the lease and register the agent key; the key's create revision orders agents."""
        self.lease = self.client.lease(self.ttl)
        key = self.keys.agent(self.node_id)
        try:
            res = self.client.txn(
                [t.create_revision(key, "==", 0)],
                [t.put(key, codec.encode(self.info), self.lease.id)],
                [t.get(key)],
            )
        except BaseException:
            self.lease.revoke()
            raise
        if res.succeeded:
            self.create_revision = res.revision
            return self
        kvs = res.responses[0].response_range.kvs
        if kvs and kvs[0].lease == self.lease.id:
            # Our own write, applied although its answer was lost and the call retried.
            self.create_revision = kvs[0].create_revision
            return self
        self.lease.revoke()
        raise RendezvousStateError(
            f"agent key {key} already exists: two agents with one node id",
            run_id=self.keys.run_id,
            node=self.node_id,
        )

    def close(self) -> bool:
        """Leave: revoke the lease, so that every key under it vanishes now. Idempotent."""
        if self._closed or self.lease is None:
            return True
        self._closed = True
        try:
            return self.lease.revoke()
        except EtcdError as e:
            log.warning("session %s: could not revoke its lease: %s", self.node_id, e)
            return False
