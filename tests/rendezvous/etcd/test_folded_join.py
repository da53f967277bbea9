"""A newcomer to a JOINING round writes its join record in the Txn that registers it, on a real
etcd: one raft proposal less per node, the same ranks, and the usual join when the round moved.

Why count writes from etcd itself: the promise is "2 writes per node for the first round" (a
lease grant and one Txn), and only etcd's applied proposals can show it.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

from rdzv_helpers import accepted_events, handler, new_run_id, rendezvous, shutdown_all, violations

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.node import job_settings


def applied(endpoint: str) -> int:
    """Raft proposals etcd applied so far (every Put, Txn, DeleteRange, LeaseGrant, ...)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as f:
        for line in f.read().decode().splitlines():
            if line.startswith("etcd_server_proposals_applied_total"):
                return int(float(line.split()[-1]))
    raise AssertionError("etcd_server_proposals_applied_total not in /metrics")


def joined_events(hs) -> list[dict]:
    got: list[dict] = []
    lock = threading.Lock()

    def keep(e: dict) -> None:
        if e["event"] == "node_joined":
            with lock:
                got.append(e)

    for h in hs:
        h.events.subscribe(keep)
    return got


def leader_joined(h) -> threading.Event:
    """Set once ``h`` (the first agent: it opens round 1) has joined its own round."""
    done = threading.Event()
    h.events.subscribe(lambda e: done.set() if e["event"] == "node_joined" else None)
    return done


@contextlib.contextmanager
def leader_and_newcomers(etcd) -> Iterator[tuple[list, threading.Thread, list[dict]]]:
    """A 4-node job whose first agent opened round 1 and joined it; yields it and the 3
    newcomers (``hs``), the first agent's thread and the newcomers' ``node_joined`` events.
    Afterwards every handler is shut down and the invariant checker replays the run.
    """
    run = new_run_id()
    first = handler(etcd.endpoints, run, 4, 4)
    joined = leader_joined(first)
    t = threading.Thread(target=first.next_rendezvous, daemon=True)
    t.start()
    assert joined.wait(30), "the first agent never joined its round"
    hs = [first, *(handler(etcd.endpoints, run, 4, 4) for _ in range(3))]
    joins = joined_events(hs[1:])
    with accepted_events(hs) as acc:
        try:
            yield hs, t, joins
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 4, 4, acc) == []


def test_newcomers_join_with_their_registration_in_one_write(etcd):
    ep = etcd.endpoints.split(",")[0]
    with leader_and_newcomers(etcd) as (hs, t, joins):
        keys, rest = hs[0].keys, hs[1:]
        before = applied(ep)
        infos = rendezvous(rest)
        t.join(30)
        # 3 lease grants, 3 registration Txns with their joins, the leader's freeze; the
        # join as its own Txn would make it 10
        assert applied(ep) - before <= 3 * 2 + 2
        assert sorted(e["node"] for e in joins if e.get("with_registration")) == sorted(
            i.node_id for i in infos
        )
        with EtcdClient(etcd.endpoints) as c:
            created = {}
            for i in infos:
                rec, agent = c.get(keys.join(1, i.node_id)), c.get(keys.agent(i.node_id))
                assert st.JoinRecord.FromString(rec.value).agent_create_revision == 0
                assert rec.create_revision == agent.create_revision
                created[i.node_id] = agent.create_revision
        by_age = sorted(created, key=created.__getitem__)  # newcomers rank by age (S6)
        assert [i.node_id for i in sorted(infos, key=lambda i: i.node_rank)] == by_age
        assert sorted(i.node_rank for i in infos) == [1, 2, 3]


def test_when_the_round_moved_before_registration_the_node_joins_as_usual(etcd, monkeypatch):
    """The registration's nested compare fails (the round read is stale): the agent key is
    still registered, and the node joins the round it then reads, with a Txn of its own.
    """
    real = job_settings._joining
    monkeypatch.setattr(
        job_settings,
        "_joining",
        lambda keys, kv: (r := real(keys, kv)) and replace(r, mod_revision=r.mod_revision - 1),
    )
    with leader_and_newcomers(etcd) as (hs, t, joins):
        infos = rendezvous(hs[1:])
        t.join(30)
        assert sorted(i.node_rank for i in infos) == [1, 2, 3]
        assert len(joins) == 3 and not any(e.get("with_registration") for e in joins)
