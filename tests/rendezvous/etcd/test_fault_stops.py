"""How fast workers that ignore SIGTERM go when the world changes under them (issue 11, items 2
and 4), on a real etcd with real agents.

Why these figures matter: a worker blocked in a collective never answers SIGTERM, so whatever
grace the agent gives is time the whole job stands still (or, for a fenced node, time its
workers hold ranks that are no longer theirs). Measured before: a revoked lease was taken for a
plain membership change — `superseded (membership changed)` and the full 30 s stop grace, while
the survivors reused the ranks.
"""

from __future__ import annotations

import time

from agent_helpers import WORKER, Job, wait_for
from rank_sampler import RankSampler, alive, tagged_env

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client.lease import fence_margin
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys

TTL = 2


def lease_of(endpoints: str, run_id: str, pid: int) -> int:
    """The lease holding the agent key of the agent with ``pid``."""
    keys = RunKeys("/etcdrun", run_id)
    with EtcdClient(endpoints) as c:
        for kv in c.get_prefix(keys.agents).kvs:
            info = codec.agent_info(kv.key, kv.value, run_id, kv.lease)
            if info.pid == pid:
                return kv.lease
    raise AssertionError(f"no agent key of pid {pid}")


def revoke(endpoints: str, lease: int) -> None:
    with EtcdClient(endpoints) as c:
        c._leases._t.call("LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), timeout=5)


def test_a_revoked_lease_kills_deaf_workers_at_once_and_says_so(etcd, tmp_path):
    """etcdctl lease revoke of the rank-0 node's lease: its workers ignore SIGTERM, yet they are
    gone within the S4 margin, before the survivor runs their ranks, and the log says the lease
    was lost (before: 30 s of grace, "superseded (membership changed)").
    """
    tag, env = tagged_env()
    conf = f"lease_ttl={TTL},last_call_timeout=0,join_timeout=60"
    job = Job(etcd.endpoints, tmp_path, nnodes="1:2", nproc=2, conf=conf)
    try:
        with RankSampler(tag) as sampler:
            a0 = job.start(WORKER, str(job.out), "deaf", env=env)
            job.wait_round(2, timeout=60)
            job.start(WORKER, str(job.out), "deaf", env=env)
            first = job.wait_round(4, timeout=60)
            mine = [s.pid for s in first if s.ppid == a0.pid]
            assert {s.rank for s in first if s.pid in mine} == {0, 1}
            lease = lease_of(etcd.endpoints, job.run_id, a0.pid)
            t0 = time.monotonic()
            revoke(etcd.endpoints, lease)
            wait_for(lambda: not any(alive(p) for p in mine), 60, "the fenced workers gone")
            took = time.monotonic() - t0
            job.wait_round(4, after=first[0].round, timeout=60)  # a0 rejoined as a new node
        print(f"revoked lease -> deaf workers gone: {took:.3f} s (margin {fence_margin(TTL)} s)")
        assert took < fence_margin(TTL), f"fenced workers lived {took:.2f} s after the revoke"
        assert sampler.overlaps == [], sampler.overlaps[:5]
        wait_for(lambda: "lease was lost" in a0.stderr, 10, "the agent saying its lease was lost")
        assert "superseded (membership changed)" not in a0.stderr
    finally:
        job.close()


def test_survivors_with_deaf_workers_run_again_after_the_restart_grace(etcd, tmp_path):
    """kill -9 of one of 3 agents whose workers ignore SIGTERM (blocked in a collective): the
    survivors' workers get SIGTERM, then SIGKILL after the restart grace (3 s by default), not
    the 30 s stop grace of the job's end. The bound: the lease's TTL (the death is seen when it
    expires) + the restart grace + 3 s for the round and the starts on 2 shared cores.
    """
    from etcdrun.agent.grace import DEFAULT_RESTART_GRACE

    conf = f"lease_ttl={TTL},last_call_timeout=1,join_timeout=60"
    job = Job(etcd.endpoints, tmp_path, nnodes="2:3", nproc=2, conf=conf)
    try:
        agents = [job.start(WORKER, str(job.out), "deaf") for _ in range(3)]
        first = job.wait_round(6, timeout=60)
        victim = job.agent_of(next(s for s in first if s.rank == 2))  # not the rank-0 node
        t_kill = time.time()
        victim.proc.kill()
        second = job.wait_round(4, after=first[0].round, timeout=60)
        recovery = max(s.t for s in second) - t_kill
        grace = DEFAULT_RESTART_GRACE
        print(
            f"kill -9, deaf workers: survivors running again after {recovery:.2f} s "
            f"(restart grace {grace:g} s, lease TTL {TTL} s)"
        )
        survivors = {s.pid for s in first if s.ppid != victim.pid}
        termed = {pid for pid in job.signals() if pid in survivors}
        assert termed == survivors, "SIGTERM comes first, so a worker can still flush"
        assert recovery < TTL + grace + 3.0, f"survivors waited {recovery:.2f} s"
        assert {s.ppid for s in second} == {a.pid for a in agents if a is not victim}
    finally:
        job.close()
