"""The etcd rendezvous with N in-process participants on a real etcd, checked by the invariant
checker (S1–S6) after every scenario.
"""

from __future__ import annotations

import threading
import time

import pytest
from agent_helpers import wait_for
from etcd_helpers import assert_no_leases
from rdzv_helpers import (
    accepted_events,
    crash,
    handler,
    new_run_id,
    rendezvous,
    shutdown_all,
    violations,
)

from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import (
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from etcdrun.rendezvous.etcd.core.keys import RunKeys


def ranks(infos):
    return sorted(i.node_rank for i in infos)


@pytest.mark.parametrize("n", [1, 8, 64])
def test_n_participants_agree_on_one_round(etcd, n):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, n, lws=2) for _ in range(n)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            assert {i.round for i in infos} == {1}
            assert ranks(infos) == list(range(n))
            assert {i.world_size for i in infos} == {2 * n}
            assert sorted(i.first_global_rank for i in infos) == list(range(0, 2 * n, 2))
            assert len({(i.master_addr, i.master_port) for i in infos}) == 1
            assert {i.restart_count for i in infos} == {0}
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, n, acc) == []
    assert_no_leases(etcd.endpoints)
    with EtcdClient(etcd.endpoints) as c:  # the last agent out removed the run's keys
        assert c.get_prefix(f"/etcdrun/{run}/").kvs == []


def test_graceful_leave_after_freeze_starts_new_round_with_stable_ranks(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 4) for _ in range(4)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            by_rank = {i.node_rank: h for i, h in zip(infos, hs, strict=True)}
            leaving = by_rank[1]
            rest = [by_rank[0], by_rank[2], by_rank[3]]
            leaving.shutdown()
            for h in rest:
                assert h.membership_changed.wait(5)
            infos2 = rendezvous(rest)
            assert {i.round for i in infos2} == {2}
            # carried (design.md §3a): each survivor keeps its place, the last fills the one
            # left, rank 0 stays; nobody wrote a join record for round 2
            assert [i.node_rank for i in infos2] == [0, 2, 1]
            assert infos2[0].master_addr == infos[0].master_addr
            assert infos2[0].master_port != infos[0].master_port  # a round's port is its own
            assert not rest[0].client.get_prefix(rest[0].keys.joined(2)).kvs
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 4, acc) == []


def test_crash_after_freeze_is_seen_after_lease_expiry(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 3, lease_ttl=2) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            # the master host
            victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 0)
            rest = [h for h in hs if h is not victim]
            t0 = time.monotonic()
            crash(victim)
            for h in rest:
                assert h.membership_changed.wait(10)
            seen = time.monotonic() - t0
            infos2 = rendezvous(rest)
            assert ranks(infos2) == [0, 1] and {i.round for i in infos2} == {2}
            assert seen < 2 + 1.5, seen  # TTL + one watch round trip (+ etcd's lease tick)
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, 3, acc) == []
    assert_no_leases(etcd.endpoints, within=3)


def test_death_mid_round_does_not_block_the_round(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 4, lease_ttl=2, last_call_timeout=1) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            results: list = []
            th = threading.Thread(target=lambda: results.append(rendezvous(hs[:2])))
            th.start()
            hs[2]._ensure_session()  # registered, then dies before joining
            crash(hs[2])
            th.join(20)
            infos = results[0]
            assert ranks(infos) == [0, 1] and infos[0].node_count == 2
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 4, acc) == []


def test_newcomer_below_max_triggers_a_new_round(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 3) for _ in range(2)]
    new = handler(etcd.endpoints, run, 1, 3)  # made now (no I/O yet) so its events count too
    with accepted_events([*hs, new]) as acc:
        try:
            first = rendezvous(hs)
            hs.append(new)
            results: list = []
            th = threading.Thread(target=lambda: results.append(rendezvous([new])))
            th.start()
            for h in hs[:2]:
                assert h.membership_changed.wait(5)
            infos = rendezvous(hs[:2])
            th.join(10)
            assert [i.node_rank for i in infos] == [i.node_rank for i in first]
            assert results[0][0].node_rank == 2 and results[0][0].node_count == 3
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, 3, acc) == []


def test_hot_spares_wait_without_restarting_anyone_and_fill_a_freed_place(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 2) for _ in range(2)]
    spares = [handler(etcd.endpoints, run, 1, 2) for _ in range(2)]
    with accepted_events(hs + spares) as acc:
        try:
            infos = rendezvous(hs)
            got: list = []

            def spare(h):
                try:
                    got.append((h, h.next_rendezvous()))
                except BaseException as e:
                    got.append((h, e))

            ths = [threading.Thread(target=spare, args=(s,)) for s in spares]
            for th in ths:
                th.start()
            keys = RunKeys("/etcdrun", run)
            with EtcdClient(etcd.endpoints) as c:  # both spares are in etcd, waiting
                wait_for(
                    lambda: c.get_prefix(keys.agents, count_only=True).count == 4,
                    10,
                    "both spares registered",
                )
            time.sleep(1)  # nothing may happen now, and no event says so: a second to show it
            assert not any(h.membership_changed.is_set() for h in hs)  # spares restart nobody
            assert got == []
            leaver = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 1)
            stay = next(h for h in hs if h is not leaver)
            leaver.shutdown()
            assert stay.membership_changed.wait(5)
            info = rendezvous([stay])[0]
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
            assert info.node_rank == 0 and info.node_count == 2
            # One spare took the freed place (L1 freezes at max at once: whichever joined
            # first); the other still waits, restarting nobody.
            assert len(got) == 1 and got[0][0] in spares
            assert got[0][1].node_rank == 1
        finally:
            shutdown_all(hs + spares)
            for th in ths:
                th.join(10)
    assert violations(etcd.endpoints, run, 1, 2, acc) == []


def test_min_equals_max_waits_for_a_replacement(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 2) for _ in range(2)]
    with accepted_events(hs) as acc:
        try:
            rendezvous(hs)
            hs[1].shutdown()
            assert hs[0].membership_changed.wait(5)
            results: list = []
            th = threading.Thread(target=lambda: results.append(rendezvous([hs[0]])))
            th.start()
            keys = RunKeys("/etcdrun", run)
            with EtcdClient(etcd.endpoints) as c:  # the survivor has joined round 2
                wait_for(
                    lambda: c.get_prefix(keys.joined(2), count_only=True).count == 1,
                    10,
                    "the survivor joined round 2",
                )
            time.sleep(1.0)  # and waits there: no event says it did not freeze
            assert results == []  # waiting, not frozen with 1 < min
            repl = handler(etcd.endpoints, run, 2, 2)
            hs.append(repl)
            info = rendezvous([repl])[0]
            th.join(10)
            assert info.node_rank == 1 and results[0][0].node_rank == 0
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 2, acc) == []


def test_min_equals_max_times_out_clearly(etcd):
    run = new_run_id()
    h = handler(etcd.endpoints, run, 2, 2, join_timeout=1.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeoutError) as err:
            h.next_rendezvous()
        assert 1.5 <= time.monotonic() - t0 < 4
        msg = str(err.value)
        assert run in msg and "join_timeout=1.5" in msg and "round 1" in msg
    finally:
        h.shutdown()


def test_closed_run_fails_joiners_at_once(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 2) for _ in range(2)]
    try:
        rendezvous(hs)
        hs[0].set_closed()
        assert hs[1].membership_changed.wait(5)
        assert hs[1].is_closed()
        late = handler(etcd.endpoints, run, 1, 2)
        hs.append(late)
        t0 = time.monotonic()
        with pytest.raises(RendezvousClosedError, match=run):
            late.next_rendezvous()
        assert time.monotonic() - t0 < 2
    finally:
        shutdown_all(hs)


def test_corrupt_round_value_is_a_state_error_naming_the_key(etcd):
    run = new_run_id()
    with EtcdClient(etcd.endpoints) as c:
        c.put(f"/etcdrun/{run}/round", b"\xff\xfe not a protobuf")
    h = handler(etcd.endpoints, run, 1, 1)
    try:
        with pytest.raises(RendezvousStateError, match=f"/etcdrun/{run}/round"):
            h.next_rendezvous()
    finally:
        h.shutdown()
    with EtcdClient(etcd.endpoints) as c:  # other state is left intact for inspection
        assert c.get(f"/etcdrun/{run}/round").value.startswith(b"\xff")


def test_unknown_conf_key_is_an_error_naming_it(etcd):
    with pytest.raises(ValueError, match="lease_tll"):
        handler(etcd.endpoints, new_run_id(), 1, 1, lease_tll=2)


FAIL = FailureInfo("n", "host-a", 3, 1, "", "ValueError: boom", "Traceback ...", 1.0, 1, 42)


def test_worker_failure_restart_is_job_wide(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 3, max_restarts=3) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            assert hs[2].request_restart("worker failed", FAIL)
            assert not hs[1].request_restart("worker failed too", FAIL)  # same round: once
            infos2 = rendezvous(hs)
            assert {i.restart_count for i in infos2} == {1}
            assert [i.node_rank for i in infos2] == [i.node_rank for i in infos]
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, 3, acc) == []


def test_failure_caused_by_a_peer_death_costs_no_restart(etcd):
    """Collectives fail on the survivors when a peer dies, before its lease expires: the
    restart they ask for is a membership change, free even with max_restarts=0.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 3, lease_ttl=2) for _ in range(3)]
    try:
        infos = rendezvous(hs)
        victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 1)
        rest = [h for h in hs if h is not victim]
        crash(victim)
        assert rest[0].request_restart("all_reduce failed", FAIL)  # before the lease expires
        infos2 = rendezvous(rest)
        assert {i.restart_count for i in infos2} == {0} and {i.node_count for i in infos2} == {2}
    finally:
        shutdown_all(hs)


def test_failure_with_the_budget_spent_closes_the_run_with_it(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 2, max_restarts=0) for _ in range(2)]
    try:
        rendezvous(hs)
        assert hs[0].request_restart("worker failed", FAIL)
        with pytest.raises(RendezvousClosedError):
            rendezvous(hs)
        for h in hs:
            deadline = time.monotonic() + 5
            while h.closed_failure() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert h.closed_failure() == FAIL
    finally:
        shutdown_all(hs)


def test_foreign_record_under_the_run_is_ignored_by_the_leader(etcd):
    run = new_run_id()
    with EtcdClient(etcd.endpoints) as c:
        c.put(f"/etcdrun/{run}/rounds/0000000001/joined/intruder", b"garbage")
    hs = [handler(etcd.endpoints, run, 2, 2) for _ in range(2)]
    try:
        infos = rendezvous(hs, timeout=15)
        assert sorted(i.node_rank for i in infos) == [0, 1]
        assert all("intruder" not in [p.node_id for p in i.participants] for i in infos)
    finally:
        shutdown_all(hs)


def test_agents_leaving_together_leave_no_keys(etcd):
    """Of agents leaving at the same moment, whichever goes last removes the run's keys."""
    for _ in range(3):
        run = new_run_id()
        hs = [handler(etcd.endpoints, run, 1, 3) for _ in range(3)]
        rendezvous(hs)
        ths = [threading.Thread(target=h.shutdown) for h in hs]
        for th in ths:
            th.start()
        for th in ths:
            th.join(10)
        with EtcdClient(etcd.endpoints) as c:
            assert c.get_prefix(f"/etcdrun/{run}/").kvs == []
    assert_no_leases(etcd.endpoints)


def test_status_line_while_waiting_names_counts_and_last_call(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 4, last_call_timeout=30) for _ in range(2)]
    try:

        def wait(h):
            with pytest.raises(RendezvousClosedError, match="shut down"):
                h.next_rendezvous()  # interrupted by shutdown() below: a clean error

        ths = [threading.Thread(target=wait, args=(h,), daemon=True) for h in hs]
        for th in ths:
            th.start()
        deadline = time.monotonic() + 10
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = [h.report().status() for h in hs]
            if any("last call in" in s for s in lines):
                break
            time.sleep(0.05)
        leader_line = next(s for s in lines if "last call in" in s)
        assert leader_line.startswith("round 1 forming: 2/2 live nodes joined (min 2, max 4)")
    finally:
        shutdown_all(hs)
        for th in ths:
            th.join(10)


def test_leave_and_loss_events_name_the_node(etcd):
    """A deliberate leave is `node_left` with the node id (not a `session_lost`); a lease taken
    away by another client is `session_lost`, with the reason.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 2) for _ in range(2)]
    got: list[dict] = []
    unsubscribes = [h.events.subscribe(got.append) for h in hs]
    try:
        rendezvous(hs)
        leaving, staying = hs
        leaving_id, staying_id = leaving.node_id, staying.node_id
        leaving.shutdown()
        left = [e for e in got if e["event"] == "node_left"]
        assert [e["node"] for e in left] == [leaving_id]
        assert not [e for e in got if e["event"] == "session_lost"]

        # Another client (an operator, say) revokes the staying agent's lease.
        with EtcdClient(etcd.endpoints) as other:
            assert other._leases.revoke(staying.session.lease_id, timeout=5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not [e for e in got if e["event"] == "session_lost"]:
            time.sleep(0.05)
        lost = [e for e in got if e["event"] == "session_lost"]
        assert [e["node"] for e in lost] == [staying_id] and lost[0]["reason"]
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()
        shutdown_all(hs)


def test_membership_listener_fires_when_the_running_round_is_superseded(etcd):
    """The agent waits on one event for worker exits and round changes: the handler calls its
    listeners whenever membership_changed is set (here: a newcomer supersedes the round).
    """
    run = new_run_id()
    first = handler(etcd.endpoints, run, 1, 2)
    fired = threading.Event()
    unsubscribe = first.on_membership_change(fired.set)
    second = None
    try:
        rendezvous([first])
        assert not fired.is_set()
        second = handler(etcd.endpoints, run, 1, 2)
        box = []
        th = threading.Thread(target=lambda: box.append(second.next_rendezvous()))
        th.start()
        assert fired.wait(10) and first.membership_changed.is_set()
        unsubscribe()
        rendezvous([first])
        th.join(10)
        assert box and box[0].node_count == 2
    finally:
        shutdown_all([h for h in (first, second) if h is not None])


def test_the_root_cause_is_the_first_failure_not_the_first_report(etcd):
    """Two nodes fail in one round: rank 0's follow-on error reported first, rank 1's own (the
    real cause, earlier) second. The run closes naming rank 1 (it named rank 0 before).
    """
    run = new_run_id()
    first = FailureInfo("n1", "host-b", 1, 1, "", "RuntimeError: bad batch", "tb", 10.0, 1, 11)
    later = FailureInfo("n0", "host-a", 0, -11, "SIGSEGV", "", "", 10.5, 0, 10)
    hs = [handler(etcd.endpoints, run, 2, 2, max_restarts=0) for _ in range(2)]
    with accepted_events(hs) as acc:
        try:
            rendezvous(hs)
            assert hs[0].request_restart("rank 0 died", later)  # reported first
            assert not hs[1].request_restart("rank 1 failed", first)  # earlier: replaces it
            assert not hs[1].request_restart("again", later)  # a later one never does
            with pytest.raises(RendezvousClosedError):  # both rejoin; the budget (0) is spent
                rendezvous(hs)
            for h in hs:
                assert h.closed_failure() == first
        finally:
            shutdown_all(hs)
    # The rewrite (round 2 JOINING again, with the earlier failure) is no S5 violation.
    assert violations(etcd.endpoints, run, 2, 2, acc) == []


def test_a_failure_never_makes_a_round_opened_by_a_departure_chargeable(etcd):
    """kill -9 of rank 0: the leader opens the next round for the departure (free); the
    survivors' follow-on failures, reported after that, must not turn it into a charged restart
    (with --max-restarts 0 the job would fail).
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2, max_restarts=0) for _ in range(3)]
    boom = FailureInfo("n", "vm", 1, 1, "", "RuntimeError: Connection reset by peer", "", 5.0)
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 0)
            crash(victim)
            rest = [h for h in hs if h is not victim]
            for h in rest:
                assert h.membership_changed.wait(10)  # the departure's round is open
            assert not rest[0].request_restart("gloo broke", boom)  # reported afterwards
            again = rendezvous(rest)
            assert [i.restart_count for i in again] == [0, 0]  # free: no restart charged
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 3, acc) == []
