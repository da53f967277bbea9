"""An etcd that stops answering for longer than the fence margin but less than the TTL pauses the
workers instead of restarting the job (issue 11, item 5), on a real 3-member etcd.

Why: with lease_ttl=2, etcd leader elections of 2.1 s and 3.1 s fenced every agent although etcd
renews every lease when a new leader takes over. Now the workers are paused (SIGSTOP) once the
lease is in doubt and resumed in the same round when etcd answers with TTL > 0.

How the pause is made to happen: the fixture's raft timings are fast (a new leader ~0.15 s after
a kill), far below the margin, so a leader kill alone almost never reaches it. The agents are
pointed at the leader member alone and its process is SIGSTOPped for 1.0 s — between the margin
(0.5 s) and the TTL (2 s): the followers elect a new leader meanwhile (which renews the leases),
and every agent whose last acknowledged keep-alive was sent more than 0.5 s before the stop
passes its fence deadline. Which agents do depends on their keep-alive phase, so the stop is
repeated (up to 5 times) until one agent paused. Measured here: before, the first such stop
fenced an agent and opened round 2; after, no new round. bench/leader_kills.py counts real
leader kills (default raft timings).
"""

from __future__ import annotations

import signal
import time

from agent_helpers import WORKER, Job, wait_for
from rank_sampler import RankSampler, alive, tagged_env

TTL = 2
STOP = 1.0  # seconds the etcd leader is SIGSTOPped: between the margin (0.5 s) and the TTL


def _paused(agents) -> list:
    return [a for a in agents if "workers paused" in a.stderr]


def test_etcd_silent_past_the_margin_pauses_the_workers_and_the_round_goes_on(
    etcd_cluster, tmp_path
):
    leader = etcd_cluster.wait_leader()
    tag, env = tagged_env()
    conf = f"lease_ttl={TTL},last_call_timeout=1,join_timeout=60"
    job = Job(leader.endpoint, tmp_path, nnodes="3", nproc=1, conf=conf)
    try:
        with RankSampler(tag) as sampler:
            agents = [job.start(WORKER, str(job.out), "sleep", env=env) for _ in range(3)]
            first = job.wait_round(3, timeout=60)
            for _attempt in range(5):
                t_stop = time.monotonic()
                leader.pause()
                time.sleep(STOP)  # the fault's length, not a wait for anything
                leader.resume()
                # Every agent decides within TTL of its last acknowledged keep-alive, sent
                # before the stop: past that horizon, what happened has happened.
                horizon = t_stop + TTL + 0.5
                wait_for(lambda h=horizon: time.monotonic() > h, 10, "the TTL horizon")
                if _paused(agents) or len(job.rounds()) > 1:
                    break
            paused = _paused(agents)
            wait_for(lambda: all("workers resumed" in a.stderr for a in paused), 10, "the resume")
        assert sorted(job.rounds()) == [first[0].round], f"the job restarted: {job.describe()}"
        assert paused, "no agent's keep-alives went past the fence deadline in 5 stops"
        assert all(alive(s.pid) for s in first), "a first-round worker died"
        assert not any("lease was lost" in a.stderr for a in agents)
        ours = {s.pid for s in first if s.ppid in {a.pid for a in paused}}
        assert ours & sampler.paused, "the sampler never saw a paused worker (state T)"
        assert sampler.overlaps == [], sampler.overlaps[:5]
        for a in agents:
            a.proc.send_signal(signal.SIGTERM)
        assert [a.wait(30) for a in agents] == [143] * 3
    finally:
        leader.resume()
        job.close()
