"""Sharded rounds on a real etcd (design.md §2): from ``shard_at`` participants the round key
holds a header and each node gets its own shard by the watch of its shard key (no read); a
carried round is sharded too, in its one Txn, rewriting the run's shard keys; the last agent out
removes them; an agent of the previous protocol refuses a sharded round in one line.
"""

from __future__ import annotations

import pytest
from rdzv_helpers import (
    accepted_events,
    handler,
    new_run_id,
    rendezvous,
    shard_reads_recorded,
    shutdown_all,
    violations,
)

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec, shard_reads, shards
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.node import run_gate
from etcdrun.rendezvous.tools import status


def header(c: EtcdClient, keys: RunKeys) -> st.RoundState:
    return st.RoundState.FromString(c.get(keys.round).value)  # as stored: no inflating


def shard_keys(c: EtcdClient, keys: RunKeys) -> dict[str, int]:
    """The shard keys there, by path under rounds/, with the round each value names."""
    kvs = c.get_prefix(keys.rounds).kvs
    return {
        kv.key.decode()[len(keys.rounds) :]: codec.shard_from(kv.key, kv.value, None, None).number
        for kv in kvs
        if keys.parse(kv.key)[0] == "shard"
    }


def whole(c: EtcdClient, keys: RunKeys):
    kv = c.get(keys.round)
    r = codec.round_from(kv.key, kv.value, kv.mod_revision, keys.run_id)
    return shard_reads.whole(c, keys, r)


def test_a_sharded_round_forms_carries_a_leave_and_gives_every_node_its_rank(etcd, monkeypatch):
    reads = shard_reads_recorded(monkeypatch)
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 2, 4, lws=2, shard_at=2) for _ in range(4)]
    with accepted_events(hs) as acc, EtcdClient(etcd.endpoints) as c:
        try:
            infos = rendezvous(hs)
            msg = header(c, keys)
            # the header: no participant list, the layout, and the protocol that reads it
            assert (msg.schema_version, msg.phase, msg.shards, msg.node_count) == (1, 2, 64, 4)
            assert not msg.participants and not msg.participants_zlib and msg.protocol == 4
            assert msg.world_size == 8
            assert shard_keys(c, keys) == {f"shard/{i}": 1 for i in range(64)}
            r1 = whole(c, keys)
            assert r1 is not None and r1.whole and [m.node_rank for m in r1.members] == [0, 1, 2, 3]
            for i, h in zip(infos, hs, strict=True):
                m = r1.member(h.node_id)
                assert m is not None and (i.node_rank, i.first_global_rank) == (
                    m.node_rank,
                    m.first_global_rank,
                )
                assert (i.node_count, i.world_size, i.round) == (4, 8, 1)
                assert (i.master_addr, i.master_port) == (r1.master_addr, r1.master_port)
                # a node reads its own shard: it holds itself, and only nodes hashing there
                # (the leader knows every member: it wrote them)
                mine = {p.node_id for p in i.participants}
                assert h.node_id in mine
                if mine != {m.node_id for m in r1.members}:
                    assert {shards.index(n, 64) for n in mine} == {shards.index(h.node_id, 64)}
            by_rank = {i.node_rank: h for i, h in zip(infos, hs, strict=True)}
            rest = [by_rank[0], by_rank[2], by_rank[3]]
            leaving = by_rank[1].node_id
            before = c.get(keys.round).mod_revision
            by_rank[1].shutdown()
            for h in rest:
                assert h.membership_changed.wait(10)
            msg = header(c, keys)
            assert (msg.number, msg.carried, msg.shards, msg.node_count) == (2, True, 64, 3)
            assert list(msg.departed) == [leaving]
            # carried in one write: the round key and the shard keys, at one revision
            kvs = c.get_prefix(keys.root).kvs
            written = {kv.key.decode()[len(keys.root) :]: kv.mod_revision for kv in kvs}
            written = {k: rev for k, rev in written.items() if rev > before}
            assert set(written) == {"round"} | {f"rounds/shard/{i}" for i in range(64)}
            assert len(set(written.values())) == 1
            assert shard_keys(c, keys) == {f"shard/{i}": 2 for i in range(64)}
            infos2 = rendezvous(rest)
            assert [(i.round, i.node_rank) for i in infos2] == [(2, 0), (2, 2), (2, 1)]
            r2 = whole(c, keys)
            assert r2 is not None
            for i, h in zip(infos2, rest, strict=True):
                m = r2.member(h.node_id)
                assert m is not None and m.first_global_rank == i.first_global_rank
                assert (i.node_count, i.world_size) == (3, 6)
            # etcdrun status puts the round together from its shards
            got = status.read(c, keys, ttls=False)
            assert [n.node_id for n in got.participants] == [m.node_id for m in r2.members]
            assert not got.unreadable
        finally:
            shutdown_all(hs)
        # the last agent out removes the rounds, shards and all
        assert not c.get_prefix(keys.rounds).kvs
    assert violations(etcd.endpoints, run, 2, 4, acc) == []
    assert reads == []  # every node had its shard from its watch


def test_below_shard_at_the_round_key_lists_everyone_as_before(etcd):
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 2, 2, shard_at=3) for _ in range(2)]
    with EtcdClient(etcd.endpoints) as c:
        try:
            rendezvous(hs)
            msg = header(c, keys)
            assert (msg.shards, msg.node_count, msg.protocol) == (0, 0, 0)
            assert len(msg.participants) == 2 and not shard_keys(c, keys)
        finally:
            shutdown_all(hs)


def test_an_agent_of_protocol_3_refuses_a_sharded_round_in_one_line(etcd, monkeypatch):
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 2, 3, shard_at=2, last_call_timeout=0) for _ in range(2)]
    try:
        rendezvous(hs)
        with EtcdClient(etcd.endpoints) as c:
            msg = header(c, keys)
        # what an older codec reads: a schema-1 round that lists nobody, and says protocol 4
        assert msg.schema_version == 1 and not msg.participants and msg.protocol == 4
        monkeypatch.setattr(run_gate, "PROTOCOL", 3)  # the gate of per-round shard keys
        old = handler(etcd.endpoints, run, 2, 3, shard_at=2)
        try:
            with pytest.raises(RendezvousStateError) as got:
                old.next_rendezvous()
            said = str(got.value)
            # round 1, or round 2 if the leader carried this node in first: sharded either way
            assert "needs rendezvous protocol 4" in said and "follows protocol 3" in said
            assert f"run {run}" in said and "\n" not in said
        finally:
            old.shutdown()
    finally:
        shutdown_all(hs)
