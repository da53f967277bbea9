"""Session: the single owner of one agent incarnation's liveness (etcd's concurrency.Session).

A session is a lease kept alive by the client plus the agent key registered under it. Everything
else the agent writes that must die with it (join records, barrier entries) is put under the same
lease, so a crash or partition removes all of it in one revision, and peers see one event.

Recipes (the election, the leader, the run's lifecycle) *borrow* a session: they write under its
``lease_id`` and fence their transactions with ``is_owner()`` — the Compare that holds only while
this session's agent key is still held by this session's lease — so a node whose lease is gone
can never write again (S4). Nothing else holds the lease. etcd's Go recipe compares the key's
create revision; ours compares its lease, because a write by anyone else (an ``etcdctl put``
without ``--lease``) keeps the create revision but strips the lease, and such a key then outlives
the agent forever. The value names the lease too (``AgentInfo.lease_id``): the leader counts a
key as an agent only when both agree.

The term mark (``keys.lease_term``): the etcd raft term in which this session last renewed its
lease, put with the registration and again, off the keeper thread, after the first renewal in a
newer term. Why: a new etcd leader (a restart, a failover) renews every lease it takes over, a
dead agent's too, so ``etcdrun status`` trusts a lease's time left only when its mark is of the
current term. Best effort: a mark that could not be written is tried again at the next renewal.

Lifecycle: ``Session.open()`` (grants the lease and registers the key, or raises: a session is
never half made) → use → ``close()`` (revokes: peers see the departure at once). Connection loss:
when keep-alives stay unanswered until shortly before the lease could expire, ``lost`` is set
(fencing, S4); a lost session never revives — the owner opens a new one, as a new participant
with a new node id. ``orphan()`` stops the keep-alives without revoking: the lease then expires on
the server after its TTL, as if this process had been killed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import (
    EtcdClient,
    EtcdError,
    Lease,
    LeaseLoss,
    Watch,
    WatchBatch,
)
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.client.lease import fence_margin
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys

log = logging.getLogger(__name__)


class NodeIdTaken(RendezvousStateError):
    """Another live agent of the run registered this node id first (names are short: the
    owner draws a new suffix and registers again).
    """


def _tail(answer: pb.ResponseOp) -> tuple[str, int] | None:
    """The tail key as the registering Txn read it: the node id it names and the revision of
    the Txn that put it, which is that agent key's create revision.
    """
    kvs = answer.response_range.kvs
    if not kvs:
        return None
    try:
        return kvs[0].value.decode(), kvs[0].mod_revision
    except UnicodeDecodeError:
        return None  # not ours: the election reads the line in full


class Session:
    """Made by ``Session.open``: holds a live lease and the create revision of its agent key."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        info: st.AgentInfo,
        lease: Lease,
        created: int,
        opened_with: Sequence[pb.ResponseOp] = (),
        registered_after: tuple[str, int] | None = None,
    ) -> None:
        if created <= 0:
            raise ValueError("a session needs the create revision of its agent key")
        self.client = client
        self.keys = keys
        self.info = info
        self._lease = lease
        self.create_revision = created
        # The answers to the ops ``open`` was asked to apply with the registration; empty when
        # unknown (the registration's answer was lost: the caller does that step on its own).
        self.opened_with = tuple(opened_with)
        # The agent that registered just before this one (node id, create revision of its
        # key), read from the run's tail key by the registering Txn; None when there was none,
        # or the answer was lost. Only a hint for the election (election.py): that agent may
        # be gone since, or an older etcdrun may have registered in between without a tail.
        self.registered_after = registered_after
        self._closed = False
        self._orphaned = False
        self._watch: Watch | None = None
        self._watch_own_key(created + 1)
        self._marked_term = lease.term  # the registration's Txn put the mark of this term
        self._marking = threading.Lock()
        lease.on_refreshed(self._on_renewed)

    @classmethod
    def open(
        cls,
        client: EtcdClient,
        keys: RunKeys,
        info: st.AgentInfo,
        ttl: int,
        also: Callable[[int], Sequence[pb.RequestOp]] | None = None,
    ) -> Session:
        """Grant the lease and register the agent key; the key's create revision orders agents
        (the election's order). Raises when the key exists already (two agents, one node id).

        ``also(lease_id)`` gives ops applied in the same Txn when the key is registered (a
        newcomer's join record: one write instead of two); their answers are ``opened_with``.
        The same Txn reads the run's tail key and puts this node there (``registered_after``).
        """
        lease = client.lease(ttl)
        key = keys.agent(info.node_id)
        registered = st.AgentInfo()
        registered.CopyFrom(info)
        registered.lease_id = lease.id
        info = registered
        try:
            extra = list(also(lease.id)) if also is not None else []
            line = [t.get(keys.tail), t.put(keys.tail, info.node_id.encode(), lease.id)]
            mark = t.put(keys.lease_term(info.node_id), str(lease.term).encode(), lease.id)
            res = client.txn(
                [t.create_revision(key, "==", 0)],
                [t.put(key, codec.encode(info), lease.id), *extra, *line, mark],
                [t.get(key)],
            )
        except BaseException:
            lease.revoke()
            raise
        if res.succeeded:
            answers = res.responses[1 : 1 + len(extra)]
            after = _tail(res.responses[1 + len(extra)])
            return cls(client, keys, info, lease, res.revision, answers, after)
        kvs = res.responses[0].response_range.kvs
        if kvs and kvs[0].lease == lease.id:
            # Our own write, applied although its answer was lost and the call retried.
            return cls(client, keys, info, lease, kvs[0].create_revision)
        lease.revoke()
        raise NodeIdTaken(
            f"agent key {key} already exists: two agents with one node id",
            run_id=keys.run_id,
            node=info.node_id,
        )

    # ---- what recipes borrow ---------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def key(self) -> str:
        return self.keys.agent(self.node_id)

    @property
    def lease_id(self) -> int:
        return self._lease.id

    @property
    def ttl(self) -> int:
        return self._lease.ttl

    @property
    def lost(self) -> threading.Event:
        """Set once the lease expired, was revoked, or must be presumed gone."""
        return self._lease.lost

    @property
    def lost_reason(self) -> str:
        return self._lease.lost_reason

    @property
    def lost_how(self) -> LeaseLoss | None:
        return self._lease.lost_how

    def is_owner(self) -> pb.Compare:
        """The fence: true while our agent key exists, held by our lease."""
        return t.lease(self.key, "==", self.lease_id)

    def owns(self, kv: pb.KeyValue | None) -> bool:
        """Whether ``kv`` (our agent key as read) is still ours: the same test as the fence."""
        return kv is not None and kv.lease == self.lease_id

    @property
    def presumed_lost_at(self) -> float:
        """The monotonic moment the lease must be presumed lost without a newer keep-alive."""
        return self._lease.presumed_lost_at

    @property
    def in_doubt(self) -> bool:
        """Keep-alives unanswered past ``presumed_lost_at``, not (yet) lost: workers pause."""
        return self._lease.in_doubt.is_set() and not self._lease.lost.is_set()

    def on_doubt(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` each time the lease falls in doubt (keeper thread)."""
        self._lease.on_doubt(lambda _lease: callback())

    def on_refreshed(self, callback: Callable[[float], None]) -> None:
        """Run ``callback(presumed_lost_at)`` after every keep-alive (keeper thread)."""
        self._lease.on_refreshed(lambda lease: callback(lease.presumed_lost_at))

    def confirm(self) -> bool | None:
        """Whether etcd says our lease lives (False: gone, and ``lost`` is set; None: no
        answer within the fence margin, so the keep-alives decide).
        """
        return self._lease.confirm(fence_margin(self._lease.ttl))

    def lease_time_left(self) -> float:
        """Seconds before etcd could expire our lease, counted conservatively from the send time
        of the last acknowledged keep-alive (negative: it may be gone).
        """
        return self._lease.expires_no_earlier_than - time.monotonic()

    def keepalive_age(self) -> float:
        """Seconds since the last acknowledged keep-alive was sent: TTL/3 at most while all is
        well, towards TTL - margin (fencing) when etcd does not answer.
        """
        return time.monotonic() - (self._lease.expires_no_earlier_than - self._lease.ttl)

    def mark_leaving(self, why: str, timeout: float) -> None:
        """Say in our agent key that we leave on purpose, before revoking: the leader then says
        the node *left* rather than that it was *lost*. Fenced on our lease; best effort.
        """
        info = st.AgentInfo()
        info.CopyFrom(self.info)
        info.leaving = why or "left"
        put = t.put(self.key, codec.encode(info), self.lease_id)
        try:
            self.client.txn([self.is_owner()], [put], timeout=timeout)
        except EtcdError as e:
            log.debug("session %s: could not mark itself leaving: %s", self.node_id, e)

    def publish(self, info: st.AgentInfo) -> bool:
        """Rewrite our agent key with ``info``, under our lease and fenced on it (our own
        rewrite: the own-key watch sees our lease and lets it be). False: the key is not ours.
        """
        put = t.put(self.key, codec.encode(info), self.lease_id)
        if not self.client.txn([self.is_owner()], [put]).succeeded:
            return False
        self.info = info
        return True

    def abandon(self, why: str) -> None:
        """Give our place up now, though the lease lives (our workers were fenced behind our
        back): ``lost`` is set; the owner's next ``close()`` revokes the lease.
        """
        self._lease.abandon(why)

    def on_lost(self, callback: Callable[[Session], None]) -> None:
        """Run ``callback(session)`` once when the lease is lost (on the keep-alive thread)."""
        self._lease.on_lost(lambda _lease: callback(self))

    # ---- the term mark -------------------------------------------------------------------------
    def _on_renewed(self, lease: Lease) -> None:
        """Keeper thread: a renewal in a newer term than the mark's rewrites the mark, on a
        thread of its own (the keeper must not wait on etcd). At most one at a time.
        """
        if lease.term <= self._marked_term or self._closed or self._orphaned:
            return
        if self._marking.acquire(blocking=False):
            threading.Thread(
                target=self._mark_term, args=(lease.term,), name="etcd-term-mark", daemon=True
            ).start()

    def _mark_term(self, term: int) -> None:
        """Put the mark, fenced on our lease; on failure the next renewal tries again. Bounded
        by the fence margin, so that a session closed meanwhile leaves no thread behind for long.
        """
        try:
            put = t.put(self.keys.lease_term(self.node_id), str(term).encode(), self.lease_id)
            ok = self.client.txn([self.is_owner()], [put], timeout=fence_margin(self.ttl))
            if ok.succeeded:
                self._marked_term = max(self._marked_term, term)
        except EtcdError as e:
            log.debug("session %s: could not mark term %d: %s", self.node_id, term, e)
        finally:
            self._marking.release()

    # ---- our own key, watched -----------------------------------------------------------------
    def _watch_own_key(self, start_revision: int) -> None:
        """Our key deleted or rewritten by anyone else (an ``etcdctl put`` of garbage strips its
        lease; the leader then removes it as no agent) ends our place in the run while the lease
        still lives: the others count us gone and hand our ranks out. Found by the chaos soak
        (bench/results/soak.md, 'Restart trials before network cuts'): a node already joined to a
        gathering round never noticed, led a round alone beside the real leader, and the job was
        lost at join_timeout. Now the session is lost at once — workers fenced, a new node id — as
        when the lease lapses.
        """
        self._watch = self.client.watch(
            self.key, start_revision=start_revision, callback=self._on_own_key
        )

    def _on_own_key(self, batch: WatchBatch) -> None:
        if self._closed or self._orphaned or self._lease.lost.is_set():
            return  # ours to end, or already ended: a DELETE is then its consequence
        if batch.error is not None:  # compacted or refused: read again, off the watch thread
            threading.Thread(target=self._recheck_own_key, daemon=True).start()
            return
        for ev in batch.events:
            if ev.type == pb.Event.DELETE:  # by a hand, or our lease expired on the server first
                threading.Thread(target=self._after_delete, daemon=True).start()
                return
            if ev.kv.lease != self.lease_id:
                self._lease.abandon(f"agent key {self.key} was overwritten by someone else")
                return

    def _after_delete(self) -> None:
        """One LeaseTimeToLive (off the watch thread) says which: a lease gone on the server is
        lost as such (``confirm`` sets it); a live one means someone removed the key.
        """
        alive = self._lease.confirm(fence_margin(self._lease.ttl))
        if alive is not False:
            self._lease.abandon(f"agent key {self.key} was removed by someone else")

    def _recheck_own_key(self) -> None:
        try:
            res = self.client.range(self.key)
        except EtcdError as e:  # etcd unreachable: the keep-alives decide, as for any outage
            log.warning("session %s: could not re-read its agent key: %s", self.node_id, e)
            return
        if not self.owns(res.kvs[0] if res.kvs else None):
            self._lease.abandon(f"agent key {self.key} was removed or overwritten by someone else")
        elif not (self._closed or self._orphaned):
            self._watch_own_key(res.revision + 1)

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # ---- the end -------------------------------------------------------------------------------
    @property
    def orphaned(self) -> bool:
        return self._orphaned

    def orphan(self) -> None:
        """Stop keeping the lease alive, without revoking it: it expires after its TTL, as if
        this process had died. ``close()`` afterwards revokes nothing.
        """
        self._orphaned = True
        self._cancel_watch()
        self._lease.orphan()

    def close(self) -> bool:
        """Leave: revoke the lease, so that every key under it vanishes now. Idempotent; True
        when etcd confirmed (or the lease was already gone, or the session was orphaned).
        """
        if self._closed or self._orphaned:
            return True
        self._closed = True
        self._cancel_watch()
        try:
            return self._lease.revoke()
        except EtcdError as e:
            log.warning("session %s: could not revoke its lease: %s", self.node_id, e)
            return False


__all__ = ["NodeIdTaken", "Session"]
