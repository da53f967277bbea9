"""OwnShard: this node's entry in sharded rounds, delivered by a watch of its one shard key.

Why a watch: a sharded round's header (the round key) lists nobody, and a Range per node per
round at the header's revision cost etcd more than the bytes it saved
(bench/results/rendezvous_scale.md, "Shards read by Range"). The shard keys are the same every round
and their count is fixed (shards.py), so a node knows its key at registration and watches it from
there: the Txn that freezes a round puts the header and every shard at one revision, and etcd sends
each node the shard it needs as it sends the header, one event each.

Why from the session's create revision: a node is in a round only once its agent key exists,
so every round that can hold it was frozen after its registration, and its shard event comes
on this watch. A sharded round older than that is one the node is not in.

The two events (header, shard) come on two watches, in either order: ``of`` returns None
while the shard of a header already seen is still to come (``pending`` says so), and the
watch wakes the round view when it comes. On connection loss the client resumes the watch
from its last revision, so no event is lost; when the watch ends (compacted history, a
refusal) or was never placed (``shard_at`` unset here but not at the leader), the node reads
its shard once per round at the header's revision instead (shard_reads.own).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import Watch, WatchBatch
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec, shard_reads, shards
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round

log = logging.getLogger(__name__)


class OwnShard:
    """Watches one session's shard key (``place``/``cancel``) and answers ``of``: a round as
    this node needs it. Holds no session: the node id and create revision are passed in.
    """

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._mu = threading.Lock()
        self._watch: Watch | None = None
        self._node: str | None = None  # the node id whose shard key is watched
        self._since = 0  # the watch's start revision
        self._shard: Round | None = None  # the latest version of that key seen (mod_revision)
        self._ended = False  # the watch ended: fall back to reads
        self._gen = 0  # bumped by place and cancel: a cancelled watch's late batch is dropped
        self._read: tuple[str, int, Round | None] | None = None  # the last fallback read

    def place(self, node_id: str, create_revision: int) -> None:
        """A new session: watch its shard key from its registration on, when this node shards
        rounds (``shard_at``); else nothing, and a sharded round is read.
        """
        self.cancel()
        if not self._ctx.config.shard_at:
            return
        key = self._ctx.keys.shard(shards.index(node_id, shards.SHARDS))
        with self._mu:
            self._node, self._since = node_id, create_revision
            self._shard, self._ended = None, False
            self._gen += 1
            gen = self._gen
        self._watch = self._ctx.client.watch(
            key, start_revision=create_revision, callback=lambda b: self._on_batch(b, gen)
        )

    def cancel(self) -> None:
        w, self._watch = self._watch, None
        if w is not None:
            w.cancel()
        with self._mu:
            self._node = None
            self._gen += 1

    def of(self, r: Round | None, node_id: str) -> Round | None:
        """``r`` as ``node_id`` needs it: a sharded frozen round with that node's shard (the
        node is among its members when it takes part); any other round as it is. None while
        the shard is still to come (``pending``) or when the round moved on (the round watch
        brings the newer one).
        """
        where = self._where(r, node_id)
        if where == "read":
            assert r is not None
            return self._read_once(r, node_id)
        if isinstance(where, Round):
            assert r is not None
            return replace(r, members=where.members, held=where.held)
        return r if where == "as is" else None

    def pending(self, r: Round | None, node_id: str) -> bool:
        """Whether ``of(r, node_id)`` is None only because the shard's event has not come."""
        return self._where(r, node_id) == "due"

    def arrival(self, r: Round | None, node_id: str) -> Callable[[], bool]:
        """For the join loop's wait on the round view: a check that turns true once the shard
        of ``r`` that is due now has come (always false when none is due).
        """
        due = self.pending(r, node_id)
        return lambda: due and not self.pending(r, node_id)

    def _where(self, r: Round | None, node_id: str) -> str | Round:
        """Where ``r``'s entry for ``node_id`` is: "as is" (not a sharded frozen round, or one
        frozen before this node registered, which cannot hold it), "read" (the watch cannot
        say), "due" (its event is on its way), "moved" (the key holds a later round), or the
        shard the watch brought.
        """
        if r is None or r.phase is not Phase.FROZEN or r.whole:  # a CLOSED one's too: unread
            return "as is"
        assert r.sharded is not None
        with self._mu:
            watched = self._node == node_id and not self._ended
            since, got = self._since, self._shard
        if not watched or r.sharded.shards != shards.SHARDS:
            return "read"
        if r.mod_revision < since:
            return "as is"
        if got is None or got.mod_revision < r.mod_revision:
            return "due"
        if got.mod_revision > r.mod_revision or got.number != r.number:
            return "moved"
        return got

    def _read_once(self, r: Round, node_id: str) -> Round | None:
        """The fallback: one read per node and round revision, whatever wakes the join loop."""
        if self._read is None or self._read[:2] != (node_id, r.mod_revision):
            got = shard_reads.own(self._ctx.client, self._ctx.keys, r, node_id)
            self._read = (node_id, r.mod_revision, got)
        return self._read[2]

    def _on_batch(self, batch: WatchBatch, gen: int) -> None:
        """Watch thread: keep the newest version of the key, then wake the join loop. A batch
        of a watch placed before the last ``place`` or ``cancel`` is another session's: dropped.
        """
        if batch.error is not None:
            log.warning("the watch on this node's shard key ended (%s); reading it", batch.error)
            with self._mu:
                self._ended = self._ended or gen == self._gen
            self._ctx.view.wake()
            return
        for ev in batch.events:
            if ev.type != pb.Event.PUT:
                continue  # removed with the run's records: no round of this run needs it
            try:
                got = codec.shard_from(
                    ev.kv.key, ev.kv.value, None, self._ctx.keys.run_id, ev.kv.mod_revision
                )
            except RendezvousError as e:  # its round then reads as moved on, not pending
                log.error("%s; waiting for the next round", e)
                got = Round(0, Phase.FROZEN, mod_revision=ev.kv.mod_revision)
            with self._mu:
                if gen != self._gen:
                    return
                self._shard = got
        self._ctx.view.wake()


__all__ = ["OwnShard"]
