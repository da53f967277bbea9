"""Which nodes of a round a signal took, decided in etcd: drains while the job keeps its min
nodes, stops after that, and the run CANCELLED when every node of the round was taken.

Why in etcd: a job-wide teardown (a compose or pod teardown, ``scancel``, the demo's Ctrl-C)
sends SIGTERM to every node at once. Each node judged alone from its own view that the job kept
its min without it, so every node drained, exited 0 and the run's record vanished: a scheduler
then marks a cancelled job as completed. One record per round, ``signalled/<round>`` (JSON:
people read it with etcdctl), written only by compare-and-swap on its mod revision, orders the
signalled nodes: the first ``node_count - min_nodes`` of them drain, the rest stop as under
torchrun (exit 128 + signal), and the one whose entry completes the round (every member drained
or stopped) closes the run CANCELLED. One signalled node alone at min nodes stops and closes
nothing: the others wait for a newcomer, as for any lost node (a pod deleted and recreated).

The record lives under the run lease, like the round key, so it never outlives the run, and it
is read and written only when a signal came: a job that no one signals never touches it.

Connection loss: a node that cannot reach etcd within the policy's deadlines gets None from
``claim`` (the agent then decides from its own view, as before) and closes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core import shard_reads
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Round
from etcdrun.rendezvous.etcd.node import lifecycle

TRIES = 16  # compare-and-swap attempts: each lost one means another node's entry went in


@dataclass(frozen=True)
class Signalled:
    """``signalled/<round>``: the nodes that drained and that stopped, in the order they came."""

    drained: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    by: dict[str, str] = field(default_factory=dict)  # node -> the signal or who asked

    def encode(self) -> bytes:
        raw = {"drained": list(self.drained), "stopped": list(self.stopped), "by": self.by}
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> Signalled:
        try:
            raw = json.loads(value)
            return cls(tuple(raw["drained"]), tuple(raw["stopped"]), dict(raw.get("by", {})))
        except (ValueError, KeyError, TypeError):
            return cls()  # unreadable: counted as empty; the CAS then replaces it

    def taken(self) -> set[str]:
        return {*self.drained, *self.stopped}


def claim(ctx: RunContext, r: Round, node: str, by: str) -> bool | None:
    """Whether ``node``, signalled in frozen round ``r``, may drain (True) or must stop
    (False); None when etcd could not say. A node already entered keeps its first answer.
    """
    room = max(0, r.node_count - ctx.settings.min_nodes)
    for _ in range(TRIES):
        try:
            cur, rev = _read(ctx, r)
        except EtcdError:
            return None
        if node in cur.drained:
            return True
        if node in cur.stopped:
            return False
        drain = len(cur.drained) < room
        new = (
            Signalled((*cur.drained, node), cur.stopped, {**cur.by, node: by})
            if drain
            else Signalled(cur.drained, (*cur.stopped, node), {**cur.by, node: by})
        )
        try:
            if _swap(ctx, r, new, rev):
                return drain
        except EtcdError:
            return None
    return None


def stopped(ctx: RunContext, r: Round, node: str, by: str) -> bool:
    """``node`` stops on a signal in frozen round ``r`` (entered already when ``claim`` said
    so; entered here otherwise); when that completes the round, close the run CANCELLED.
    True when this call closed it: two nodes that both find the round complete (their entries
    went in together) race to close it, and only the winner says so, once for the job.
    """
    try:
        every = shard_reads.whole(ctx.client, ctx.keys, r)  # a sharded round lists its shard
    except EtcdError:
        return False
    if every is None:
        return False
    members = {m.node_id for m in every.members}
    for _ in range(TRIES):
        try:
            cur, rev = _read(ctx, r)
            if node not in cur.taken():
                new = Signalled(cur.drained, (*cur.stopped, node), {**cur.by, node: by})
                if not _swap(ctx, r, new, rev):
                    continue
                cur = new
        except EtcdError:
            return False
        if not members <= cur.taken():
            return False
        try:
            done = lifecycle.set_closed(ctx, st.CANCELLED, by=node)
        except EtcdError:
            return False
        return done is not None  # None: another node's close came first
    return False


def _read(ctx: RunContext, r: Round) -> tuple[Signalled, int]:
    """The round's record and its mod revision (0: none yet)."""
    kv = ctx.client.get(ctx.keys.signalled(r.number))
    if kv is None:
        return Signalled(), 0
    return Signalled.decode(kv.value), kv.mod_revision


def _swap(ctx: RunContext, r: Round, new: Signalled, rev: int) -> bool:
    """Put ``new`` if the record is still at ``rev`` (0: absent). Not guarded on the round
    key: the first drained node leaves at once and the next round opens while the others are
    still entering this round's record, which is the one their nodes were signalled in.
    """
    key = ctx.keys.signalled(r.number)
    same = t.mod_revision(key, "==", rev) if rev else t.create_revision(key, "==", 0)
    return ctx.client.txn([same], [t.put(key, new.encode(), lease=r.run_lease)]).succeeded


__all__ = ["Signalled", "claim", "stopped"]
