"""The rendezvous under etcd faults: leader kill -9 mid-round, etcd restart, stalled keep-alives."""

from __future__ import annotations

import threading
import time

import pytest
from agent_helpers import wait_for
from etcd_helpers import require_local
from rdzv_helpers import (
    accepted_events,
    handler,
    new_run_id,
    rendezvous,
    shutdown_all,
    violations,
)

from etcdrun.rendezvous.api import Liveness
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousConnectionError
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.tools import checker


def frozen_rounds(endpoints: str, run: str) -> list[int]:
    with EtcdClient(endpoints) as c:
        return [
            v.state.number
            for v in checker.round_history(c, RunKeys("/etcdrun", run))
            if v.state is not None and v.state.phase == 2
        ]


def test_etcd_leader_killed_mid_round_round_completes_without_extra_round(etcd_cluster):
    run = new_run_id()
    eps = etcd_cluster.endpoints
    hs = [handler(eps, run, 4, 4, request_timeout=1, lease_ttl=5) for _ in range(4)]
    with accepted_events(hs) as acc:
        try:
            results: list = []
            th = threading.Thread(target=lambda: results.append(rendezvous(hs[:3])))
            th.start()
            # Three joined and wait for the fourth: the kill must come mid-round.
            keys = RunKeys("/etcdrun", run)
            with EtcdClient(eps) as c:
                wait_for(
                    lambda: c.get_prefix(keys.joined(1), count_only=True).count == 3,
                    30,
                    "three nodes joined round 1",
                )
            etcd_cluster.leader().kill()
            infos = rendezvous(hs[3:])
            th.join(30)
            infos += results[0]
            assert sorted(i.node_rank for i in infos) == [0, 1, 2, 3]
            assert {i.round for i in infos} == {1}
            time.sleep(1.0)
            assert not any(h.membership_changed.is_set() for h in hs)
        finally:
            shutdown_all(hs)
    assert frozen_rounds(eps, run) == [1]
    assert violations(eps, run, 4, 4, acc) == []


def test_etcd_restart_while_running_causes_no_new_round(etcd):
    local = require_local(etcd)
    run = new_run_id()
    hs = [handler(local.endpoints, run, 1, 3, request_timeout=1, lease_ttl=5) for _ in range(3)]
    with accepted_events(hs) as acc:
        try:
            first = rendezvous(hs)
            local.members[0].kill()
            local.members[0].restart()
            time.sleep(2.0)
            assert not any(h.membership_changed.is_set() for h in hs)  # L4
            # watches resumed: a graceful leave is still seen at once
            leaver = next(h for h, i in zip(hs, first, strict=True) if i.node_rank == 2)
            leaver.shutdown()
            rest = [h for h in hs if h is not leaver]
            for h in rest:
                assert h.membership_changed.wait(5)
            assert {i.round for i in rendezvous(rest)} == {2}
        finally:
            shutdown_all(hs)
    assert violations(local.endpoints, run, 1, 3, acc) == []


def test_stalled_keepalive_fences_before_the_ttl_and_rejoins_as_new_node(etcd):
    local = require_local(etcd)
    run = new_run_id()
    ttl = 2
    hs = [handler(local.endpoints, run, 1, 2, request_timeout=0.3, lease_ttl=ttl) for _ in range(2)]
    with accepted_events(hs) as acc:
        try:
            first = rendezvous(hs)
            before = {i.node_id for i in first}
            local.members[0].pause()  # no keep-alive is answered from now on
            t0 = time.monotonic()
            try:
                for h in hs:
                    assert h.membership_changed.wait(ttl + 1)
                fenced = time.monotonic() - t0
                assert all(h.liveness().read().state is Liveness.LOST for h in hs)
                assert fenced < ttl, f"fencing took {fenced:.2f}s, TTL is {ttl}s"
            finally:
                local.members[0].resume()
            again = rendezvous(hs)
            assert {i.node_id for i in again}.isdisjoint(before)  # new participants
            assert sorted(i.node_rank for i in again) == [0, 1]
        finally:
            shutdown_all(hs)
    assert violations(local.endpoints, run, 1, 2, acc) == []


def test_after_an_etcd_outage_the_round_forms_without_waiting_for_the_old_leases(etcd):
    """Every node was fenced while etcd was down. A restarted etcd restores their old leases and
    renews them for a whole TTL, so their agent keys came back and the next round waited for
    nodes that would never rejoin as themselves: 6.6 s at lease_ttl 5. Each node now revokes
    its lost lease as soon as etcd answers again (its new session's grant).
    """
    local = require_local(etcd)
    run = new_run_id()
    ttl = 5
    conf = dict(request_timeout=0.5, retry_timeout=60, lease_ttl=ttl)
    hs = [handler(local.endpoints, run, 1, 2, **conf) for _ in range(2)]
    with accepted_events(hs) as acc:
        try:
            first = rendezvous(hs)
            local.members[0].kill()
            for h in hs:
                assert h.membership_changed.wait(ttl + 2)
            wait_for(
                lambda: all(h.liveness().read().state is Liveness.LOST for h in hs), ttl, "loss"
            )
            local.members[0].start()
            local.members[0].wait_ready(10)
            t0 = time.monotonic()
            again = rendezvous(hs)
            took = time.monotonic() - t0
            assert {i.node_id for i in again}.isdisjoint({i.node_id for i in first})
            assert sorted(i.node_rank for i in again) == [0, 1]
            assert took < ttl, f"the new round took {took:.2f} s after etcd answered"
        finally:
            shutdown_all(hs)
    assert violations(local.endpoints, run, 1, 2, acc) == []


def test_an_outage_is_said_with_its_start_and_the_give_up_time_that_then_holds(etcd):
    """The waiting line used to say "round 1 frozen with 3 nodes" for the whole outage, and the
    one warning named one call's deadline: a 45 s outage printed "retrying until 00:20:37" and
    waited on until 00:21:10, because the next session's calls each retried a whole
    retry_timeout. One deadline per outage: its start plus retry_timeout.
    """
    local = require_local(etcd)
    run = new_run_id()
    retry = 4
    conf = dict(request_timeout=0.3, retry_timeout=retry, lease_ttl=2)
    h = handler(local.endpoints, run, 1, 1, **conf)
    try:
        rendezvous([h])
        local.members[0].kill()
        assert h.membership_changed.wait(5)
        line = wait_for(lambda: "unreachable since" in (s := h.report().status()) and s, 5, "it")
        since, until = h.client.outage()
        assert until - since == retry and time.strftime("%H:%M:%S", time.localtime(until)) in line
        with pytest.raises(RendezvousConnectionError):
            h.next_rendezvous()  # its session is gone: registering again meets the outage
        assert time.time() - until < 1.5, "gave up later than it said"
    finally:
        h.shutdown()
