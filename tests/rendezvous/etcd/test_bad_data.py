"""No silent hangs on bad data in etcd (issue 11): garbage in an agent key, garbage in the round
key, on a real etcd with real handlers.

What used to happen here: an ``etcdctl put`` of garbage into an agent key stripped the key's
lease, the key stayed forever, the leader went on counting it, and after a kill -9 no new round
ever came; garbage in the round key left every agent on its last good copy and the leader fencing
on a revision that no longer existed, so the next kill -9 gave no new round and no output.
"""

from __future__ import annotations

import threading

from agent_helpers import wait_for
from etcd_helpers import assert_no_leases
from rdzv_helpers import (
    accepted_events,
    crash,
    handler,
    new_run_id,
    rendezvous,
    settle,
    shutdown_all,
    violations,
)

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys

GARBAGE = b"\xff\xfe etcdctl put of garbage"


def agent_keys(c: EtcdClient, run: str) -> dict[str, int]:
    return {kv.key.decode(): kv.lease for kv in c.get_prefix(f"/etcdrun/{run}/agents/").kvs}


def test_garbage_in_an_agents_key_then_kill_9_of_that_agent_gives_a_new_round(etcd):
    """The issue's exact case: the tampered key lost its lease and would never expire."""
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, last_call_timeout=0) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 2)
            with EtcdClient(etcd.endpoints) as c:
                c.put(victim.session.key, GARBAGE)
            crash(victim)
            rest = [h for h in hs if h is not victim]
            for h in rest:
                assert h.membership_changed.wait(10)
            assert [i.node_count for i in rendezvous(rest)] == [2, 2]
        finally:
            shutdown_all(hs)
        with EtcdClient(etcd.endpoints) as c:
            assert agent_keys(c, run) == {}  # the garbage key went too: nothing outlives the run
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_garbage_in_a_live_agents_key_never_blocks_a_round(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, last_call_timeout=0) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            by_rank = {i.node_rank: h for h, i in zip(hs, infos, strict=True)}
            tampered, victim = by_rank[1], by_rank[2]
            with EtcdClient(etcd.endpoints) as c:
                c.put(tampered.session.key, GARBAGE)  # no lease: the key would stay forever
            old_id = tampered.node_id
            crash(victim)  # kill -9 of another member: a new round must come
            survivors = [by_rank[0], tampered]
            for h in survivors:
                assert h.membership_changed.wait(10)
            again = settle(survivors)
            assert [i.node_count for i in again] == [2, 2]
            assert tampered.node_id != old_id  # it registered anew, as a new node
            with EtcdClient(etcd.endpoints) as c:
                keys = agent_keys(c, run)
            assert f"/etcdrun/{run}/agents/{old_id}" not in keys  # the leader removed it
            assert all(lease for lease in keys.values())  # every key left is an agent's
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_garbage_in_the_dead_leaders_key_does_not_stop_the_election(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, last_call_timeout=0) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            leader = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 0)
            with EtcdClient(etcd.endpoints) as c:
                c.put(leader.session.key, GARBAGE)  # the leader's key, lease stripped
            crash(leader)  # its lease expires; its key never would
            rest = [h for h in hs if h is not leader]
            for h in rest:
                assert h.membership_changed.wait(10)
            again = rendezvous(rest)
            assert sorted(i.node_rank for i in again) == [0, 1]
        finally:
            shutdown_all(hs)
        with EtcdClient(etcd.endpoints) as c:
            assert agent_keys(c, run) == {}  # nothing of the run is left behind
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_garbage_in_the_live_leaders_key_after_a_kill_never_blocks_a_round(etcd):
    """Near the chaos soak's seed 1434 (a kill -9, then garbage in the live leader's own key while
    the next round gathers): here the round still comes. The soak's own case, where the leader
    had already joined the next round, is the test after this one.
    """
    run = new_run_id()
    hs = [
        handler(etcd.endpoints, run, 2, 3, lease_ttl=2, last_call_timeout=0, join_timeout=15)
        for _ in range(3)
    ]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            by_rank = {i.node_rank: h for h, i in zip(hs, infos, strict=True)}
            leader, victim = by_rank[0], by_rank[2]
            crash(victim)  # seed 1434's order: a kill -9, then the leader's key tampered
            survivors = [leader, by_rank[1]]
            for h in survivors:
                assert h.membership_changed.wait(10)
            with EtcdClient(etcd.endpoints) as c:  # while the next round gathers
                c.put(leader.session.key, GARBAGE)
            assert [i.node_count for i in settle(survivors, timeout=20)] == [2, 2]
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_garbage_in_the_leaders_key_after_it_joined_the_next_round_never_blocks_it(etcd):
    """The soak's seed 1434 exactly: the leader had asked for a restart (its workers failed) and
    joined the next round when garbage went into its own key. The other node then led too,
    removed the key as no agent, and each leader waited alone (1/1 live nodes joined, min 2)
    until join_timeout. A session that sees its own key removed or rewritten is lost at once and
    comes back as a new node.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, join_timeout=15) for _ in range(2)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            by_rank = {i.node_rank: h for h, i in zip(hs, infos, strict=True)}
            leader, other = by_rank[0], by_rank[1]
            old_node = leader.session.node_id
            assert leader.request_restart("worker failed", None)
            got: list = [None]
            th = threading.Thread(target=lambda: got.__setitem__(0, leader.next_rendezvous()))
            th.start()
            with EtcdClient(etcd.endpoints) as c:
                joined = RunKeys("/etcdrun", run).join(2, old_node)
                wait_for(lambda: c.get(joined) is not None, 10, "the leader joined round 2")
                c.put(leader.session.key, GARBAGE)  # no --lease: the key loses ours
            mine = rendezvous([other], timeout=20)[0]
            th.join(20)
            assert not th.is_alive() and got[0] is not None
            assert [got[0].node_count, mine.node_count] == [2, 2]
            assert got[0].round == mine.round
            assert leader.session.node_id != old_node  # back as a new node
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def garbage_in_the_round_key_then_repaired(endpoints: str, run: str, hs: list):
    """Put garbage into the round key; the repaired key, once the leader says it repaired it."""
    repaired = threading.Event()
    for h in hs:
        h.events.subscribe(lambda e: repaired.set() if e["event"] == "round_repaired" else None)
    with EtcdClient(endpoints) as c:
        c.put(f"/etcdrun/{run}/round", GARBAGE)
        assert repaired.wait(10)
        return c.get(f"/etcdrun/{run}/round")


def test_garbage_in_the_round_key_is_repaired_and_the_job_goes_on(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, last_call_timeout=0) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            kv = garbage_in_the_round_key_then_repaired(etcd.endpoints, run, hs)
            r = codec.round_from(kv.key, kv.value, kv.mod_revision, run)
            assert (r.number, r.phase.name) == (infos[0].round, "FROZEN")
            assert not any(h.membership_changed.is_set() for h in hs)  # workers undisturbed
            victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 2)
            crash(victim)  # and the next death still gives a new round
            rest = [h for h in hs if h is not victim]
            for h in rest:
                assert h.membership_changed.wait(10)
            assert [i.node_count for i in rendezvous(rest)] == [2, 2]
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_nothing_a_run_writes_outlives_it_and_failover_keeps_it_alive(etcd):
    """The round key and the hints live under the run lease, which only the leader of the day
    keeps alive: a new leader adopts it (so a failover loses nothing), and once every agent was
    killed it expires — before, `round` and `rounds/<n>/hint` stayed forever, leaseless.
    """
    run = new_run_id()
    run_ttl = 5  # shorter than its default, max(10, 6 x lease_ttl), and still past a failover
    conf = dict(lease_ttl=1, last_call_timeout=0, run_lease_ttl=run_ttl)
    hs = [handler(etcd.endpoints, run, 1, 3, **conf) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            leader = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 0)
            crash(leader)
            rest = [h for h in hs if h is not leader]
            for h in rest:
                assert h.membership_changed.wait(10)
            again = rendezvous(rest)
            assert [i.node_count for i in again] == [2, 2]
            key = f"/etcdrun/{run}/round"
            with EtcdClient(etcd.endpoints) as c:
                kv = c.get(key)
                assert kv.lease  # under the run lease
                w = c.watch(key, start_revision=kv.mod_revision + 1)
                try:
                    # Past its TTL nothing happens to it: the new leader keeps it alive.
                    assert w.get(timeout=run_ttl + 2) is None
                finally:
                    w.cancel()
                assert not any(h.membership_changed.is_set() for h in rest)
                w = c.watch(key, start_revision=kv.mod_revision + 1)
                try:
                    for h in rest:
                        crash(h)  # kill -9 of every agent left: nobody cleans up
                    batch = w.get(timeout=run_ttl + 3)  # the run lease expires and takes it
                    assert batch is not None and batch.events[0].type == 1  # DELETE
                finally:
                    w.cancel()
                assert not c.get_prefix(f"/etcdrun/{run}/").kvs  # the hints went with it
                assert_no_leases(etcd.endpoints, within=2)
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, 3, acc) == []


def test_a_worker_failure_after_the_round_keys_repair_opens_the_next_round_once(etcd):
    """Found by the chaos soak (seed 37: garbage in the round key, then a kill -9 broke the
    workers' collective): the repair rewrites the running round at a new revision, so every
    agent's request_restart, fenced on the revision it had accepted, failed as if the round had
    moved on — and then each agent took the repaired copy for a new round and ran round 1 again
    (S5: a round already accepted is never run again), its failure lost.
    """
    from etcdrun.rendezvous.api import FailureInfo

    run = new_run_id()
    conf = {"lease_ttl": 2, "last_call_timeout": 0, "max_restarts": 1}
    hs = [handler(etcd.endpoints, run, 2, 3, **conf) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            rev = garbage_in_the_round_key_then_repaired(etcd.endpoints, run, hs).mod_revision
            for h in hs:  # every view has the repaired copy (the watch brings it)
                wait_for(lambda h=h: h.view.current().mod_revision >= rev, 10, "the repair seen")
            failed = FailureInfo(hs[1].node_id or "", "host", 1, 1, message="exited with code 1")
            assert hs[1].request_restart("worker rank 1 failed", failed)
            again = rendezvous(hs)
            assert {(i.round, i.restart_count) for i in again} == {(infos[0].round + 1, 1)}
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []


def test_a_rewrite_of_the_accepted_round_is_never_run_again():
    """S5, whatever rewrote it (the repair above): the round view refuses the same round number
    at a newer revision, not only an older copy.
    """
    from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
    from etcdrun.rendezvous.etcd.core.round_view import RoundView

    view = RoundView()
    view.accept(Round(3, Phase.FROZEN, mod_revision=10))
    assert not view.is_fresh(Round(3, Phase.FROZEN, mod_revision=10))
    assert not view.is_fresh(Round(3, Phase.FROZEN, mod_revision=12))  # the repaired copy
    assert view.is_fresh(Round(4, Phase.FROZEN, mod_revision=12))
