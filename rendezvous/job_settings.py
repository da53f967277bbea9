"""Every node of a job agrees on the job's settings: a newcomer that differs is refused.

Why: a newcomer started with ``--nnodes 3`` (or another ``--max-restarts``) used to join a
running ``--nnodes 2`` job silently, and the oldest agent's settings won — a job that behaves
differently from what its owner typed, found out much later. Each agent publishes the settings
it was started with in its agent key (AgentInfo: min_nodes, max_nodes, max_restarts); a newcomer
compares its own with the oldest agent's *before* registering, so a running job is never
disturbed, and once more right after (two first agents that start together). Settings a node may
choose for itself (``--nproc-per-node``, lease_ttl, timeouts) are not compared.
"""

from __future__ import annotations

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import codec
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousError, RendezvousStateError
from etcdrun.rendezvous.keys import RunKeys
from etcdrun.rendezvous.session import Session

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


def differences(mine: st.AgentInfo, theirs: st.AgentInfo) -> list[str]:
    """What differs, in the flags' words; empty when they agree (or ``theirs`` published no
    settings: an older etcdrun)."""
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
    """Raise RendezvousStateError when the job's oldest agent was started differently."""
    theirs = oldest_agent(client, keys)
    if theirs is None or theirs.node_id == mine.node_id:
        return
    diff = differences(mine, theirs)
    if diff:
        raise RendezvousStateError(
            f"this node was started with other job settings than the running job: "
            f"{'; '.join(diff)} (its oldest node {theirs.node_id} on {theirs.host}); start every "
            "node of a job with the same settings",
            run_id=keys.run_id,
            node=mine.node_id,
        )


def open_session(client: EtcdClient, keys: RunKeys, info: st.AgentInfo, ttl: int) -> Session:
    """Register this agent only when the job agrees on its settings: checked before (so a
    running job never sees a stranger) and right after (two first nodes starting together)."""
    check(client, keys, info)
    sess = Session.open(client, keys, info, ttl)
    try:
        check(client, keys, info)
    except RendezvousError:
        sess.close()
        raise
    return sess


__all__ = ["check", "differences", "oldest_agent", "open_session"]
