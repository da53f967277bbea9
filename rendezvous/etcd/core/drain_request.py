"""Asking one node of a running job to leave gracefully (``etcdrun drain``; docs/drain.md).

Why a tool beside status.py and not part of the rendezvous: the one who asks takes no part in
the run (no session, no lease of its own). It reads the run at one revision, checks that the
job keeps its min nodes, and puts ``drain/<node_id>`` under *the node's own lease*, in a Txn
that checks the node's agent key is still held by that lease: the request vanishes with the
node, so it never outlives the run nor reaches a later incarnation, and a node that left
between the read and the write is "unknown", not drained twice.

The min check counts live agents (hot spares included: one takes the drained node's place)
less those already asked to drain. It is advice at the time of the read, not a lock: two
operators draining two nodes at the same instant can both pass it; ``decide`` still never
freezes a round below min nodes (S2), so the job then waits for a node instead of running
short.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys


class DrainRefused(RendezvousError):
    """The drain would leave the job below its min nodes, or names no node of the run."""


@dataclass(frozen=True)
class Requested:
    """What was asked: ``remaining`` live nodes once ``node_id`` is gone, of ``min_nodes``."""

    node_id: str
    round: int | None
    remaining: int
    min_nodes: int
    already: bool = False  # it had been asked before: nothing new was written


@dataclass(frozen=True)
class _Run:
    agents: dict[str, tuple[st.AgentInfo, int]]  # node id -> (its record, the key's lease)
    draining: set[str]
    round: int | None


def _read(client: EtcdClient, keys: RunKeys) -> _Run:
    res = client.txn(
        [],
        [
            t.get(keys.agents, prefix=True),
            t.get(keys.drains, prefix=True, keys_only=True),
            t.get(keys.round),
        ],
    )
    agents: dict[str, tuple[st.AgentInfo, int]] = {}
    for kv in res.responses[0].response_range.kvs:
        try:
            info = codec.agent_info(kv.key, kv.value, keys.run_id, kv.lease)
        except RendezvousError:
            continue  # no agent (the leader removes it): it cannot be drained
        agents[info.node_id] = (info, kv.lease)
    draining = {keys.parse_drain(kv.key) for kv in res.responses[1].response_range.kvs}
    rounds = res.responses[2].response_range.kvs
    number = (
        codec.round_message(rounds[0].value, keys.round, keys.run_id).number if rounds else None
    )
    return _Run(agents, draining, number)


def _find(run: _Run, node: str, keys: RunKeys) -> str:
    """``node`` is a node id, or a prefix of exactly one (the id without its incarnation, or
    a host name with one agent on it).
    """
    if node in run.agents:
        return node
    found = sorted(n for n in run.agents if n.startswith(node))
    if len(found) == 1:
        return found[0]
    known = ", ".join(sorted(run.agents)) or "none"
    what = f"{len(found)} nodes match" if found else "no live node matches"
    raise DrainRefused(
        f"cannot drain {node!r}: {what} (live nodes: {known})",
        run_id=keys.run_id,
        round=run.round,
        node=node,
    )


def request(
    client: EtcdClient, keys: RunKeys, node: str, by: str, force: bool = False
) -> Requested:
    """Ask ``node`` to drain; DrainRefused when it names no live node, or (without ``force``)
    when the job would keep fewer than its min nodes.
    """
    run = _read(client, keys)
    node_id = _find(run, node, keys)
    info, lease = run.agents[node_id]
    min_nodes = max((a.min_nodes for a, _ in run.agents.values()), default=0)
    remaining = len(set(run.agents) - run.draining - {node_id})
    if node_id in run.draining:
        return Requested(node_id, run.round, remaining, min_nodes, already=True)
    if remaining < min_nodes and not force:
        raise DrainRefused(
            f"draining {node_id} would leave {remaining} node(s), below min nodes "
            f"{min_nodes}: refused (--force drains it anyway; the job then waits for a node)",
            run_id=keys.run_id,
            round=run.round,
            node=node_id,
        )
    msg = st.DrainRequest(
        schema_version=codec.SCHEMA_VERSION,
        node_id=node_id,
        by=by,
        requested_unix_ms=int(time.time() * 1000),
        forced=force and remaining < min_nodes,
    )
    res = client.txn(
        [t.lease(keys.agent(node_id), "==", lease)],
        [t.put(keys.drain(node_id), codec.encode(msg), lease)],
    )
    if not res.succeeded:
        raise DrainRefused(
            f"node {node_id} left the job before it could be asked to drain",
            run_id=keys.run_id,
            round=run.round,
            node=node_id,
        )
    return Requested(node_id, run.round, remaining, min_nodes)


__all__ = ["DrainRefused", "Requested", "request"]
