"""The job-settings check at registration, on a real etcd: who speaks for the job, and at what cost.

Why count sorted ranges: etcd 3.4 answers a range sorted by create revision by reading the whole
agents/ prefix. Two of them per registration made N registrations O(N^2) in etcd and N=4,096
never formed a round; with a round running, a newcomer must find the job's settings in O(1).
"""

from __future__ import annotations

import re

import pytest
from rdzv_helpers import crash, handler, new_run_id, rendezvous, shutdown_all

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Settings
from etcdrun.rendezvous.etcd.node import job_settings, joining


class CountingClient(EtcdClient):
    """An EtcdClient that counts the sorted ranges it sends."""

    sorted_ranges = 0

    def range(self, key, range_end=None, **kw):  # type: ignore[override]
        if kw.get("sort"):
            self.sorted_ranges += 1
        return super().range(key, range_end, **kw)


def info(node: str, lo: int, hi: int, restarts: int = 0):
    return joining.agent_info(node, "host-x", "127.0.0.1", 1, Settings(lo, hi, 0.5, restarts))


def agent_keys(c: EtcdClient, run: str) -> list[str]:
    return sorted(kv.key.decode() for kv in c.get_prefix(f"/etcdrun/{run}/agents/").kvs)


def test_a_newcomer_to_a_running_job_reads_no_sorted_range(etcd):
    run = new_run_id()
    job = [handler(etcd.endpoints, run, 2, 3) for _ in range(2)]
    keys = RunKeys("/etcdrun", run)
    try:
        rendezvous(job)
        with CountingClient(etcd.endpoints) as c:
            sess = job_settings.open_session(c, keys, info("newcomer-1.1", 2, 3), 5)
            try:
                assert c.sorted_ranges == 0  # the round's writer answered, both times
                assert f"/etcdrun/{run}/agents/newcomer-1.1" in agent_keys(c, run)
            finally:
                sess.close()
            with pytest.raises(RendezvousStateError, match=re.escape("--nnodes 2:4 here, 2:3")):
                job_settings.open_session(c, keys, info("stranger-1.1", 2, 4), 5)
            assert c.sorted_ranges == 0
            assert len(agent_keys(c, run)) == 2  # refused before registering: nothing left
    finally:
        shutdown_all(job)


def test_with_no_round_yet_the_oldest_decides_and_the_younger_is_refused(etcd):
    """Two first agents that differ, starting together: the check after registering (against
    the oldest, by a sorted range: no round names a writer yet) refuses the younger.
    """
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    with CountingClient(etcd.endpoints) as c:
        first = job_settings.open_session(c, keys, info("first-1.1", 2, 2), 5)
        try:
            with pytest.raises(RendezvousStateError, match=re.escape("--nnodes 3:3 here, 2:2")):
                job_settings.open_session(c, keys, info("second-1.1", 3, 3), 5)
            assert c.sorted_ranges > 0
            assert agent_keys(c, run) == [f"/etcdrun/{run}/agents/first-1.1"]
        finally:
            first.close()


def test_when_the_rounds_writer_is_gone_the_oldest_decides(etcd):
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    job = [handler(etcd.endpoints, run, 1, 3) for _ in range(2)]
    try:
        rendezvous(job)
        with CountingClient(etcd.endpoints) as c:
            writer = job_settings.round_writer(c, keys)
            assert writer is not None and writer.node_id in {h.node_id for h in job}
            # As if it had just died and its lease expired, before a new round. Every handler
            # crashed first (their keys stay, leased for 5 s): a live handler whose key is
            # deleted registers again at once, and a live survivor that sees the writer's key go
            # opens the next round itself and is its writer (both seen in the suite: then no
            # fallback was needed, and the count stayed 0).
            for h in job:
                crash(h)
            c.delete(keys.agent(writer.node_id))
            assert job_settings.round_writer(c, keys) is None
            with pytest.raises(RendezvousStateError, match=re.escape("--max-restarts 2 here")):
                job_settings.open_session(c, keys, info("late-1.1", 1, 3, restarts=2), 5)
            assert c.sorted_ranges > 0  # the fallback: the oldest of those left
    finally:
        shutdown_all(job)
