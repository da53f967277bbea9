"""The chaos trials' checks can fail: each is fed the violation it exists to catch — a history
with two leaders' frozen lists for one round, two running RANK 0s of different rounds in /proc,
a key, a lease and a process left behind — and must report it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

from agent_helpers import clean_env, wait_for
from chaos_faults import tagged
from chaos_schedule import generate
from chaos_trial import Trial
from rank_sampler import RankSampler

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.tools import checker


def frozen(n: int, nodes: list[str]) -> st.RoundState:
    s = st.RoundState(number=n, phase=st.FROZEN, master_addr="10.0.0.1", world_size=len(nodes))
    for rank, node in enumerate(nodes):
        s.participants.add(
            node_id=node,
            node_rank=rank,
            local_world_size=1,
            addr="10.0.0.1",
            first_global_rank=rank,
        )
    return s


def test_the_checker_catches_two_leaders_freezing_one_round():
    one = [checker.Version(5, frozen(2, ["a", "b"]))]
    assert checker.check(one, 2, 3) == []
    two = [*one, checker.Version(7, frozen(2, ["a", "c"]))]
    found = checker.check(two, 2, 3, [{"round": 2, "node": "c", "node_rank": 1}])
    assert any(v.startswith("S1 round 2") for v in found), found
    assert checker.check(two[:1], 2, 3, [{"round": 2, "node": "c", "node_rank": 1}])  # S3


def _fake_worker(tag: str, rank: int, rnd: int) -> subprocess.Popen:
    env = clean_env(ETCDRUN_TEST_JOB=tag, RANK=str(rank), ETCDRUN_ROUND=str(rnd))
    code = "import sys; sys.stdin.read()"  # lives until we close its stdin
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE)


def test_the_sampler_catches_two_running_rank_0s_of_different_rounds_and_not_a_stopped_one():
    tag = uuid.uuid4().hex[:8]
    procs = [_fake_worker(tag, 0, 1), _fake_worker(tag, 0, 2), _fake_worker(tag, 1, 2)]
    try:
        wait_for(lambda: len(tagged(f"ETCDRUN_TEST_JOB={tag}")) == 3, 10, "three fake workers")
        sampler = RankSampler(tag, running_only=True)
        sampler.sample()
        assert sampler.overlaps and "RANK 0: rounds ['1', '2']" in sampler.overlaps[0]
        assert not any("RANK 1" in o for o in sampler.overlaps)
        procs[0].send_signal(signal.SIGSTOP)  # a frozen node's worker runs nothing
        wait_for(lambda: _state(procs[0].pid) == "T", 10, "the old RANK 0 stopped")
        stopped_seen = RankSampler(tag, running_only=True)
        stopped_seen.sample()
        assert stopped_seen.overlaps == []
        every_live = RankSampler(tag)
        every_live.sample()
        assert every_live.overlaps
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fp:
        return fp.read().rsplit(")", 1)[1].split()[0]


def test_leftover_keys_leases_and_processes_are_reported(etcd, tmp_path):
    trial = Trial(generate(1), "etcd", tmp_path)
    assert trial.leftovers(etcd.endpoints, within=0.5) == []
    with EtcdClient(etcd.endpoints) as c:
        c.put(trial.keys.round, b"closed")
        assert trial.leftovers(etcd.endpoints, within=0.5) == []  # the closed marker may stay
        lease = c.lease(30, keepalive=False)
        c.put(trial.keys.agents + "ghost", b"x", lease=lease.id)
        proc = _fake_worker(trial.tag, 0, 1)
        try:
            wait_for(lambda: tagged(f"ETCDRUN_TEST_JOB={trial.tag}"), 10, "the leftover")
            found = trial.leftovers(etcd.endpoints, within=0.5)
        finally:
            proc.kill()
            proc.wait()
            c.revoke(lease.id)
    assert any(f.startswith("processes left") for f in found), found
    assert any("ghost" in f and str(lease.id) in f for f in found), found
