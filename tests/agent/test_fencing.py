"""Safety under real faults, checked from outside (issue 11): no two live workers with the same
RANK of different rounds while an agent is frozen, and no process of a worker's tree left after
a kill -9 of the agent or after any stop.

Measured before: SIGSTOP of the node-rank-0 agent for 8 s (3 agents, 2 workers each,
lease_ttl=2) left two live processes per RANK for 5.6 s; after kill -9 of an agent, a
grandchild (or a setsid'd one) survived with parent 1.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, WORKER, Job, clean_env, wait_for
from rank_sampler import RankSampler, alive

from etcdrun.agent.fencing.guard import KILL_LEAD, kill_after

FORKER = str(SCRIPTS / "forker.py")


@pytest.mark.parametrize("margin", [0.02, 0.15, 0.5, 2 / 3, 2.0, 10.0])
def test_the_warden_kills_before_etcd_could_expire_the_lease(margin):
    """From the pause to the kill: never as late as the margin (the moment etcd could expire
    the lease and a new round start: a SIGKILL to gone took up to 0.2 s, so ``KILL_LEAD``
    early), and never before half of it (short margins keep a pause worth having).
    """
    kill = kill_after(margin)
    assert margin / 2 <= kill < margin
    assert kill == pytest.approx(margin - min(KILL_LEAD, margin / 2))


@pytest.mark.parametrize("frozen_rank", [0, 1])
def test_a_frozen_agents_workers_are_gone_before_anyone_reuses_their_ranks(
    etcd, tmp_path, frozen_rank
):
    tag = uuid.uuid4().hex[:8]
    env = clean_env(ETCDRUN_TEST_JOB=tag)
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2:3",
        nproc=2,
        conf="lease_ttl=2,last_call_timeout=1,join_timeout=60",
    )
    try:
        with RankSampler(tag) as sampler:
            agents = [job.start(WORKER, str(job.out), "sleep", env=env) for _ in range(3)]
            first = job.wait_round(6, timeout=60)
            target = next(s for s in first if s.env["GROUP_RANK"] == str(frozen_rank))
            agent = job.agent_of(target)
            agent.proc.send_signal(signal.SIGSTOP)
            try:
                later = job.wait_round(4, after=first[0].round, timeout=30)  # the survivors
                reused = {s.rank for s in later} & {s.rank for s in first if s.ppid == agent.pid}
                assert reused, "the survivors' round should reuse the frozen node's ranks"
                pairs = {(str(s.rank), str(s.round)) for s in later}
                n0 = sampler.samples  # a second of samples from here, the new round seen
                wait_for(
                    lambda: sampler.samples > n0 + 50 and pairs & sampler.seen,
                    10,
                    "the survivors' round sampled",
                )
            finally:
                agent.proc.send_signal(signal.SIGCONT)
        assert sampler.overlaps == [], sampler.overlaps[:5]
        wait_for(lambda: "fencing" in agent.stderr, 10, "the warden's word")
        # The sampler saw both: the frozen node's ranks in the first round, and the same ranks
        # in the survivors' round — never at the same time.
        again = {(str(s.rank), str(s.round)) for s in later} & sampler.seen
        before = {(str(s.rank), str(s.round)) for s in first if s.ppid == agent.pid}
        assert before <= sampler.seen and again and sampler.samples > 100
        assert all(a.proc.poll() is None for a in agents if a is not agent)
    finally:
        job.close()


def _kids(out: Path) -> list[int]:
    pids: list[int] = []
    for path in out.glob("kids_*.txt"):
        pids += [int(p) for p in path.read_text().split()]
    return pids


def test_kill_9_of_the_agent_leaves_nothing_of_its_workers_trees(etcd, tmp_path):
    job = Job(etcd.endpoints, tmp_path, nnodes="1", nproc=2, conf="lease_ttl=2")
    try:
        agent = job.start(FORKER, str(job.out), env=clean_env())
        wait_for(lambda: len(list(job.out.glob("kids_*.txt"))) == 2, 60, "both workers forked")
        kids = _kids(job.out)
        assert len(kids) == 4 and all(alive(p) for p in kids)
        agent.proc.kill()
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(p) for p in kids), 5, "the workers' descendants gone")
        took = time.monotonic() - t0
        assert took < 1.0, f"descendants outlived the agent by {took:.2f} s"
    finally:
        job.close()


def test_every_stop_takes_the_workers_descendants_with_it(etcd, tmp_path):
    """A membership change stops the workers: their double-forked and setsid'd descendants go
    too, before the next round's workers start.
    """
    job = Job(
        etcd.endpoints, tmp_path, nnodes="1:2", nproc=1, conf="lease_ttl=2,last_call_timeout=0"
    )
    try:
        job.start(FORKER, str(job.out), env=clean_env())
        wait_for(lambda: len(list(job.out.glob("kids_*.txt"))) == 1, 60, "the worker forked")
        kids = _kids(job.out)
        job.start(FORKER, str(job.out), env=clean_env())  # a newcomer: a new round
        wait_for(lambda: len(list(job.out.glob("kids_*.txt"))) >= 3, 60, "round 2 forked")
        assert not any(alive(p) for p in kids), "round 1's descendants outlived its stop"
    finally:
        job.close()


def test_sigterm_of_the_agent_leaves_nothing_either(tmp_path):
    from agent_helpers import Agent, etcdrun_bin

    out = tmp_path / "out"
    out.mkdir()
    agent = Agent(
        [etcdrun_bin(), "--standalone", "--nproc-per-node", "1", FORKER, str(out)],
        tmp_path,
        "standalone",
        clean_env(),
    )
    try:
        wait_for(lambda: len(list(out.glob("kids_*.txt"))) == 1, 60, "the worker forked")
        kids = _kids(out)
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 143
        assert not any(alive(p) for p in kids)
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
