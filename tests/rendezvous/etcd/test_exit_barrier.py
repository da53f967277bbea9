"""The exit barrier when a member is gone for good: the job ends for everyone, at once.

Why: the soak (seeds 1259, 1376, 1403, 1447, 1480) froze a whole node past its TTL near the end
of the work. The others' workers finished, their barrier waited for a node that could never
come back as itself, and they left without closing the run; the fenced node, thawed, joined a
run nobody else would join and failed after join_timeout (600 s by default).
"""

from __future__ import annotations

import json
import os
import signal
import time

from agent_helpers import Job, clean_env, wait_for
from rdzv_helpers import crash, exit_barriers, handler, new_run_id, rendezvous, shutdown_all
from torchrun_helpers import descendants

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import Liveness
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys

UNTIL = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / f"start_{os.environ['RANK']}_{os.environ['ETCDRUN_ROUND']}").touch()
while not (out / "finish").exists():
    time.sleep(0.05)
"""


def _signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_node_frozen_past_its_ttl_at_the_end_does_not_hang_the_job(etcd, tmp_path):
    script = tmp_path / "until.py"
    script.write_text(UNTIL)
    out = tmp_path / "out"
    job = Job(etcd.endpoints, tmp_path, nnodes="2:3", nproc=1, conf="lease_ttl=2,join_timeout=120")
    frozen: list[int] = []
    try:
        logs = [("--log-dir", str(tmp_path / f"logs{i}")) for i in range(3)]  # kept, to read
        agents = [job.start(str(script), str(out), env=clean_env(), extra=x) for x in logs]
        wait_for(lambda: len(list(out.glob("start_*_1"))) == 3, 60, "round 1 with three nodes")
        victim = agents[2]
        frozen = [victim.pid, *descendants(victim.pid)]  # agent, warden, worker: the whole node
        _signal_tree(frozen, signal.SIGSTOP)
        (out / "finish").touch()  # the others' workers end their work
        codes = [a.wait(60) for a in agents[:2]]
        assert codes == [0, 0], job.describe()
        said = "".join(a.stderr for a in agents[:2])
        assert "left before the exit barrier" in said and "closed as SUCCEEDED" in said, said
        assert "leaving anyway" not in said, said
        assert said.count("round 1: the job SUCCEEDED") == 2, said  # the run's end, said
        for i in (0, 1):  # the node's departure is in its events; the close is no supersession
            events = [json.loads(x) for x in (tmp_path / f"logs{i}/events.jsonl").open()]
            names = [e["event"] for e in events]
            assert names.count("node_left") == 1
            superseded = [e for e in events if e["event"] == "round_superseded"]
            # the departure's round: carried (design.md §3a), frozen at once without the victim
            assert [e["phase"] for e in superseded] == ["FROZEN"], superseded
        t_thaw = time.monotonic()
        _signal_tree(frozen, signal.SIGCONT)
        frozen = []
        assert victim.wait(30) == 0, victim.stderr
        took = time.monotonic() - t_thaw
        assert took < 10, f"the thawed node took {took:.1f} s to leave (join_timeout is 120)"
        assert "SUCCEEDED) while this node was out of round 1" in victim.stderr, victim.stderr
        assert not list(out.glob("start_*_2")), "nobody ran another round"
    finally:
        _signal_tree(frozen, signal.SIGCONT)
        job.close()


def _outcome(endpoints: str, run: str) -> str:
    with EtcdClient(endpoints) as c:
        kv = c.get(RunKeys("/etcdrun", run).round)
    msg = codec.round_message(kv.value, RunKeys("/etcdrun", run).round, run)
    return st.Phase.Name(msg.phase) + " " + st.Outcome.Name(msg.outcome)


def test_the_barrier_closes_the_run_when_the_late_member_is_gone(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2) for _ in range(3)]
    try:
        rendezvous(hs)
        crash(hs[2])  # its lease expires after the TTL: it can never arrive as itself
        assert exit_barriers(hs[:2], 30) == [True, True]
        assert _outcome(etcd.endpoints, run) == "CLOSED SUCCEEDED"
    finally:
        shutdown_all(hs)


def test_a_late_member_still_registered_keeps_the_run_open(etcd):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 2, lease_ttl=2) for _ in range(2)]
    try:
        rendezvous(hs)
        assert hs[0].exit_barrier(0.5) is False  # hs[1] is alive: it may still be working
        assert not _outcome(etcd.endpoints, run).startswith("CLOSED")
        assert hs[1].exit_barrier(5) is True  # the last to arrive closes it
        assert _outcome(etcd.endpoints, run) == "CLOSED SUCCEEDED"
    finally:
        shutdown_all(hs)


def test_a_node_whose_lease_expired_unseen_is_told_it_is_fenced_at_the_barrier(etcd):
    """The put of its barrier entry meets a lease etcd no longer has: the session is then lost
    (the agent rejoins, agent/loop.py), never an error that ends the agent.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2) for _ in range(2)]
    try:
        rendezvous(hs)
        with EtcdClient(etcd.endpoints) as c:
            c.revoke(hs[0].session.lease_id)  # as if it had expired while the node was frozen
        assert hs[0].exit_barrier(5) is False
        assert hs[0].liveness().read().state is Liveness.LOST
    finally:
        shutdown_all(hs)


def test_a_node_whose_workers_were_fenced_behind_its_back_comes_back_as_a_new_node(etcd):
    """Its warden killed the workers (``give_up``) though the lease lived: the next join
    registers a new node, so the others hear of a departure and an arrival, not of a member
    still running (soak seed 1591).
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=2) for _ in range(2)]
    try:
        rendezvous(hs)
        old = hs[0].session.node_id
        hs[0].liveness().give_up("its warden fenced the workers")
        assert hs[0].liveness().read().state is Liveness.LOST
        infos = rendezvous(hs)
        assert hs[0].session.node_id != old
        assert {i.round for i in infos} == {2} and [i.node_count for i in infos] == [2, 2]
    finally:
        shutdown_all(hs)
