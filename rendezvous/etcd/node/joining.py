"""Joining a round: the join record a node writes, and what it learns from a frozen round.

Why apart from the handler: these are the two steps of a node's part in each round (join,
accept), each one call or none, over objects the handler lends (client, keys, session, the run
context). The handler keeps the loop
that waits between them.
"""

from __future__ import annotations

import enum
import os
import time

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous._version import __version__
from etcdrun.rendezvous.api import RendezvousInfo, RoundCause
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import PROTOCOL, Round, Settings
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.free_port import reserve_free_port


class Joined(enum.Enum):
    YES = "joined"
    ROUND_MOVED = "the round moved on"  # the watch brings the newer one
    NOT_OWNER = "our agent key is not ours any more"  # overwritten or removed by someone else


def agent_info(
    node_id: str,
    host: str,
    addr: str,
    local_world_size: int,
    settings: Settings,
    spare_port: int = 0,
) -> st.AgentInfo:
    """What this node publishes in its agent key (the session adds the lease id): with the
    protocol it follows and its spare port, the leader may carry it into rounds (§3a).
    """
    return st.AgentInfo(
        protocol=PROTOCOL,
        spare_port=spare_port,
        node_id=node_id,
        host=host,
        addr=addr,
        pid=os.getpid(),
        local_world_size=local_world_size,
        version=__version__,
        started_unix_ms=int(time.time() * 1000),
        min_nodes=settings.min_nodes,
        max_nodes=settings.max_nodes,
        max_restarts=settings.max_restarts,
    )


def record(
    node_id: str, addr: str, local_world_size: int, host: str, pid: int, created: int
) -> st.JoinRecord:
    """A join record; ``created`` 0 means "written with the agent key": the leader reads the
    agent's create revision from the record's own (JoinRecord.agent_create_revision).
    """
    return st.JoinRecord(
        node_id=node_id,
        addr=addr,
        local_world_size=local_world_size,
        master_port=reserve_free_port(),
        agent_create_revision=created,
        host=host,
        pid=pid,
    )


def join(
    client: EtcdClient, keys: RunKeys, sess: Session, r: Round, addr: str, local_world_size: int
) -> Joined:
    """Write this node's join record for ``r``, fenced on the round key as read and on our own
    agent key (a node whose key is not its own any more is not counted by the leader: its
    session is of no use and must be replaced).
    """
    info = sess.info
    rec = record(sess.node_id, addr, local_world_size, info.host, info.pid, sess.create_revision)
    res = client.txn(
        [t.mod_revision(keys.round, "==", r.mod_revision), sess.is_owner()],
        [t.put(keys.join(r.number, sess.node_id), codec.encode(rec), sess.lease_id)],
        [t.get(sess.key)],
    )
    if res.succeeded:
        return Joined.YES
    kvs = res.responses[0].response_range.kvs
    return Joined.ROUND_MOVED if sess.owns(kvs[0] if kvs else None) else Joined.NOT_OWNER


class FoldedJoin:
    """A newcomer's join record, written in the Txn that registers its agent key: one write
    per node for the first round instead of two (bench/rendezvous_scale.py, N=4096: 3.0 -> 2.0
    writes/N). Fenced like ``join``: only while the round key is still the JOINING round read
    just before (the job-settings check reads it); the agent key is created in the same Txn,
    so the ownership fence holds by construction. When the round moved, the registration still
    happens and the node joins the newer round the usual way.
    """

    def __init__(self, keys: RunKeys, addr: str, local_world_size: int) -> None:
        self._keys = keys
        self._addr = addr
        self._lws = local_world_size
        self.round: int | None = None  # the round whose join went into the registration

    def ops(self, r: Round, info: st.AgentInfo, lease_id: int) -> list[pb.RequestOp]:
        self.round = r.number
        rec = record(info.node_id, self._addr, self._lws, info.host, info.pid, 0)
        put = t.put(self._keys.join(r.number, info.node_id), codec.encode(rec), lease_id)
        return [t.nested([t.mod_revision(self._keys.round, "==", r.mod_revision)], [put])]

    def joined(self, sess: Session) -> int | None:
        """The round ``sess`` joined as it registered, or None (the round had moved on, or
        the registration's answer was lost: then it joins as usual).
        """
        done = bool(sess.opened_with) and sess.opened_with[0].response_txn.succeeded
        return self.round if done else None


def publish_spare(sess: Session, port: int) -> bool:
    """Rewrite our agent key with a new spare port (spare_port.py), fenced on our lease.
    False when the key is not ours any more: the session's own-key watch ends it.
    """
    new = st.AgentInfo()
    new.CopyFrom(sess.info)
    new.spare_port = port
    return sess.publish(new)


def info(
    run_id: str, node_id: str, r: Round, max_restarts: int, cause: RoundCause | None = None
) -> RendezvousInfo:
    """What this node runs with in the frozen round ``r`` (it must be a member). Of a sharded
    round, ``participants`` are the node's own shard: what its watch brought (own_shard.py).
    """
    me = r.member(node_id)
    if me is None:
        raise ValueError(f"node {node_id} is not in round {r.number}")
    return RendezvousInfo(
        run_id=run_id,
        round=r.number,
        node_id=node_id,
        node_rank=me.node_rank,
        node_count=r.node_count,
        first_global_rank=me.first_global_rank,
        world_size=r.world_size,
        master_addr=r.master_addr,
        master_port=r.master_port,
        restart_count=r.restart_count,
        participants=r.members,
        max_restarts=max_restarts,
        cause=cause,
    )


def accept(ctx: RunContext, node_id: str, r: Round) -> RendezvousInfo:
    """Take the frozen round ``r`` (``node_id`` is a member): what the node runs with, the
    round view told that its workers run in ``r``, and the one event of the transition. Why
    ``r`` opened travels with it when the view still holds that round's message.
    """
    msg = ctx.view.message()
    same = msg is not None and msg.number == r.number and msg.phase == st.FROZEN
    cause = codec.cause_from(msg) if same else None
    got = info(ctx.keys.run_id, node_id, r, ctx.settings.max_restarts, cause)
    ctx.view.accept(r)
    ctx.events.emit(
        "round_accepted", round=r.number, node_rank=got.node_rank, node_count=got.node_count
    )
    return got


__all__ = [
    "FoldedJoin",
    "Joined",
    "accept",
    "agent_info",
    "info",
    "join",
    "publish_spare",
    "record",
]
