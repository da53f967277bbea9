"""Every node of a job agrees on the job's settings: a newcomer that differs is refused.

Why: a newcomer started with ``--nnodes 3`` (or another ``--max-restarts``) would join a running
``--nnodes 2`` job silently, and the oldest agent's settings would win — a job that behaves
differently from what its owner typed, found out much later. Each agent publishes the settings it
was started with in its agent key (AgentInfo: min_nodes, max_nodes, max_restarts); a newcomer
compares its own with the oldest agent's *before* registering, so a running job is never disturbed,
and once more right after (two first agents that start together). Settings a node may choose for
itself (``--nproc-per-node``, lease_ttl, timeouts) are not compared.

Who speaks for the job: the oldest agent (the leader's rule). Found as "the oldest", that is a range
sorted by create revision, which etcd 3.4 answers by reading the whole agents/ prefix: two per
registration, beside the election's one, made N registrations O(N^2) in etcd, and at 4,096 agents
the round never formed (bench/results/rendezvous_scale.md, 'Round time against N'). So the first
look is at the round key's writer, two O(1) gets: once a job runs that is its leader (the oldest) or
one of its members, and each of them passed this very check. The sorted range is left for when there
is no round yet (the first agents, a small prefix) or its writer is gone.
"""

from __future__ import annotations

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousError, RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.node import joining

PAGE = 8  # agents read at a time while looking for the oldest valid one


def oldest_agent(client: EtcdClient, keys: RunKeys) -> st.AgentInfo | None:
    """The oldest key under agents/ that is an agent (by create revision), or None."""
    after = 0
    while True:
        res = client.range(
            keys.agents,
            prefix=True,
            sort=("create", "ascend"),
            limit=PAGE,
            min_create_revision=after + 1,
        )
        for kv in res.kvs:
            try:
                return codec.agent_info(kv.key, kv.value, keys.run_id, kv.lease)
            except RendezvousError:
                continue  # no agent (the leader removes it): look further
        if not res.more or not res.kvs:
            return None
        after = res.kvs[-1].create_revision


def round_writer(client: EtcdClient, keys: RunKeys) -> st.AgentInfo | None:
    """The live agent that wrote the round key, or None (no round, unreadable, or it is gone)."""
    return _writer(client, keys, client.get(keys.round))


def _writer(client: EtcdClient, keys: RunKeys, kv: pb.KeyValue | None) -> st.AgentInfo | None:
    if kv is None:
        return None
    try:
        writer = codec.decode(st.RoundState, keys.round, kv.value).decided_by
        if writer:
            got = client.range(keys.agent(writer))
            if got.kvs:
                kv = got.kvs[0]
                return codec.agent_info(kv.key, kv.value, keys.run_id, kv.lease)
    except RendezvousError:
        pass  # a corrupt round (repair's business) or a non-agent key: ask the oldest
    return None


def job_agent(client: EtcdClient, keys: RunKeys) -> st.AgentInfo | None:
    """The agent whose settings are the job's: the round's writer if alive, else the oldest."""
    return round_writer(client, keys) or oldest_agent(client, keys)


def differences(mine: st.AgentInfo, theirs: st.AgentInfo) -> list[str]:
    """What differs, in the flags' words; empty when they agree (or ``theirs`` published no
    settings: an older etcdrun).
    """
    if theirs.max_nodes == 0:
        return []
    out = []
    if (mine.min_nodes, mine.max_nodes) != (theirs.min_nodes, theirs.max_nodes):
        out.append(
            f"--nnodes {mine.min_nodes}:{mine.max_nodes} here, "
            f"{theirs.min_nodes}:{theirs.max_nodes} in the job"
        )
    if mine.max_restarts != theirs.max_restarts:
        out.append(f"--max-restarts {mine.max_restarts} here, {theirs.max_restarts} in the job")
    return out


def check(client: EtcdClient, keys: RunKeys, mine: st.AgentInfo) -> None:
    """Raise RendezvousStateError when the job's agent (job_agent) was started differently."""
    _compare(keys, mine, job_agent(client, keys))


def _compare(keys: RunKeys, mine: st.AgentInfo, theirs: st.AgentInfo | None) -> None:
    if theirs is None or theirs.node_id == mine.node_id:
        return
    diff = differences(mine, theirs)
    if diff:
        raise RendezvousStateError(
            f"this node was started with other job settings than the running job: "
            f"{'; '.join(diff)} (its node {theirs.node_id} on {theirs.host}); start every "
            "node of a job with the same settings",
            run_id=keys.run_id,
            node=mine.node_id,
        )


def open_session(
    client: EtcdClient,
    keys: RunKeys,
    info: st.AgentInfo,
    ttl: int,
    fold: joining.FoldedJoin | None = None,
) -> Session:
    """Register this agent only when the job agrees on its settings: checked before (so a
    running job never sees a stranger) and right after (two first nodes starting together).

    When the first look found the round's writer alive and the round JOINING, ``fold`` puts
    this node's join record into the registration Txn, and the second look is skipped: it
    guards against two *first* agents, and this node compared itself with a live agent that
    had passed the same check against the job (the leader, or a member) — every registered
    agent agrees with the job by induction. No join is folded while a second look is still
    due: the leader would count a node that this look may send away.
    """
    kv = client.get(keys.round)
    writer = _writer(client, keys, kv)
    _compare(keys, info, writer or oldest_agent(client, keys))
    r = _joining(keys, kv) if fold is not None and writer is not None else None
    if fold is not None and r is not None:
        return Session.open(client, keys, info, ttl, lambda lease: fold.ops(r, info, lease))
    sess = Session.open(client, keys, info, ttl)
    try:
        check(client, keys, info)
    except RendezvousError:
        sess.close()
        raise
    return sess


def _joining(keys: RunKeys, kv: pb.KeyValue | None) -> Round | None:
    """The round as read, when it is JOINING (else no join to fold)."""
    if kv is None:
        return None
    try:
        r = codec.round_from(kv.key, kv.value, kv.mod_revision, keys.run_id)
    except RendezvousError:
        return None  # unreadable: the repair's business, not a registration's
    return r if r.phase is Phase.JOINING else None


__all__ = ["check", "differences", "job_agent", "oldest_agent", "open_session", "round_writer"]
