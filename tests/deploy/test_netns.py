"""Several hosts on one machine: etcd in one network namespace, an agent in each of three more,
joined by veth pairs and a bridge (tests/netns_helpers.py), and real partitions.

Why here and not only in containers: this runs in every CI run in seconds (no image, no daemon)
and still crosses real interfaces: every agent has its own address, MASTER_ADDR is a real peer's,
and a cut link drops packets silently as a partition does. lease_ttl=2 throughout, so the lease
keeper declares a lease lost 1.5 s after the last acknowledged keep-alive (fence_margin 0.5 s) and
keep-alives go every 0.67 s.

Each test prints its figures (fence time vs TTL, recovery times) and checks the rendezvous
invariants with the checker over etcd's history and every agent's round_accepted event.
Measured here over 8 runs (2 shared cores): the cut agent fenced 0.9-1.3 s after the cut, 0.5-1.0
s before the leader saw its lease expire; the survivors ran at world 4 1.9-2.4 s after the cut;
world 6 again 0.25-0.9 s after the restore. etcd cut for 3 s: every agent fenced 0.9-1.3 s after
the cut, the world whole 0.8-1.2 s after the restore. The module takes ~20 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, Start, alive, clean_env, wait_for
from netns_helpers import Net, NetnsEtcd, NetnsJob, print_figures, require_netns

TTL = 2
AGENTS = ("a0", "a1", "a2")
CONF = f"lease_ttl={TTL},last_call_timeout=1,join_timeout=60"
GLOO = str(SCRIPTS / "gloo_allreduce.py")


class Cluster:
    """One Net (etcd + three agent hosts), its etcd, and the jobs a test starts on it."""

    def __init__(self, net: Net, etcd: NetnsEtcd, root: Path) -> None:
        self.net, self.etcd, self.root = net, etcd, root
        self.jobs: list[NetnsJob] = []

    def job(self, **kw: object) -> NetnsJob:
        kw.setdefault("nnodes", "2:3")
        kw.setdefault("conf", CONF)
        job = NetnsJob(self.net, self.etcd.endpoint, self.root / f"job{len(self.jobs)}", **kw)
        self.jobs.append(job)
        return job

    def close(self) -> None:
        for job in self.jobs:
            job.close()


@pytest.fixture
def cluster(etcd_bin: str, tmp_path: Path) -> Iterator[Cluster]:
    require_netns()
    with Net(["etcd", *AGENTS]) as net, NetnsEtcd(net, "etcd", etcd_bin, tmp_path) as etcd:
        c = Cluster(net, etcd, tmp_path)
        try:
            yield c
        finally:
            c.close()


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]):
    return lambda what, **figures: print_figures(capsys, "netns", what, **figures)


def start_all(job: NetnsJob) -> list[Start]:
    for host in AGENTS:
        job.start_on(host)
    return job.wait_round(len(AGENTS) * job.nproc)


def pids_on(job: NetnsJob, starts: list[Start], host: str) -> list[int]:
    return [s.pid for s in starts if job.host_of(s) == host]


def wait_dead(pids: list[int], timeout: float, what: str) -> float:
    """Wall time at which every pid was seen gone (polled every 20 ms)."""
    wait_for(lambda: not alive(pids), timeout, what)
    return time.time()


def node_of(job: NetnsJob, agent_name: str, round_no: int) -> str:
    return next(
        e["node"]
        for e in job.events("round_accepted")
        if e["agent"] == agent_name and e["round"] == round_no
    )


def assert_master(job: NetnsJob, starts: list[Start], world: int) -> str:
    """Every worker of the round got WORLD_SIZE ``world`` and the node-rank-0 host's address."""
    rank0 = next(s for s in starts if s.env["GROUP_RANK"] == "0")
    addr = job.net.addr(job.host_of(rank0))
    assert {(s.world_size, s.env["MASTER_ADDR"]) for s in starts} == {(world, addr)}
    return job.host_of(rank0)


def test_real_gloo_job_across_namespaces(cluster, torch_available, report):
    """Three hosts, one gloo worker each: every rank all_reduces with the others through
    MASTER_ADDR, which is the node-rank-0 host's own address, and the job ends with exit 0.
    """
    job = cluster.job(nnodes="3", nproc=1)
    t0 = time.time()
    env = clean_env(LOGLEVEL="DEBUG", GLOO_SOCKET_IFNAME="eth0")  # gloo: the host's own NIC
    agents = [job.start_on(host, GLOO, str(job.out), env=env) for host in AGENTS]
    codes = [a.wait(120) for a in agents]
    assert codes == [0, 0, 0], job.describe()
    starts = job.starts()
    assert sorted(s.rank for s in starts) == [0, 1, 2]
    assert len({s.round for s in starts}) == 1  # one round: nothing restarted
    assert_master(job, starts, 3)
    # Three hosts for real: each rank ran in a network namespace of its own, none the test's.
    spaces = {json.loads(p.read_text())["netns"] for p in job.out.glob("start_*.json")}
    assert len(spaces) == 3 and os.readlink("/proc/self/ns/net") not in spaces
    sums = re.findall(r"^\[\d+\]:rank (\d)/3 sum (\d+)$", "".join(a.stdout for a in agents), re.M)
    assert sorted(sums) == [("0", "6"), ("1", "6"), ("2", "6")], job.describe()
    assert job.violations(cluster.etcd, 3, 3) == []
    report("gloo job on 3 namespaces", launch_to_exit=time.time() - t0)


def test_cut_agent_fences_before_ttl_and_rejoins_as_new_node(cluster, report):
    """Cut the node-rank-0 host: its workers die before its lease's TTL is over, the two others
    run on with WORLD_SIZE 4 and the next host's address as MASTER_ADDR; plug it back and it
    joins again as a new node, at the end of the order, and the world is 6 again.
    """
    job = cluster.job(nproc=2)
    first = start_all(job)
    victim = assert_master(job, first, 6)
    agent = job.on[victim]
    old_node = node_of(job, agent.name, first[0].round)
    doomed = pids_on(job, first, victim)

    t_cut = cluster.net.cut(victim)
    t_fenced = wait_dead(doomed, 10, f"{victim}'s workers to be fenced")
    smaller = job.wait_round(4, after=first[0].round)
    t_smaller = max(s.t for s in smaller)
    survivor0 = assert_master(job, smaller, 4)
    assert victim not in {job.host_of(s) for s in smaller}
    assert survivor0 != victim
    # The leader opens the next round once etcd has expired the victim's lease (a watch event
    # on its agent key), and the smaller world's workers start after that. The victim's workers
    # were gone before any of them started — no RANK was ever held twice. (``t_fenced`` is when
    # the polling above saw them dead, an upper bound. Paused since the lease fell in doubt, they
    # are killed at the moment it could expire, and the round may open within the same ~10 ms —
    # CI saw it 9 ms before the polling did — so only "before the workers started" is ordered.)
    t_expired = next(e["time"] for e in job.events("round_started") if e["round"] > first[0].round)
    assert t_expired < min(s.t for s in smaller)
    assert t_fenced < min(s.t for s in smaller), "a worker of the smaller world started first"
    assert t_fenced - t_cut < TTL, f"fenced {t_fenced - t_cut:.2f} s after the cut"
    assert agent.proc.poll() is None, job.describe()  # it keeps trying to reach etcd

    t_restore = cluster.net.restore(victim)
    back = job.wait_round(6, after=smaller[0].round)
    t_back = max(s.t for s in back)
    assert assert_master(job, back, 6) == survivor0  # rank 0 stayed with the survivor (S6)
    rejoined = [s for s in back if job.host_of(s) == victim]
    assert sorted(s.rank for s in rejoined) == [4, 5]  # a newcomer: last in the order
    assert node_of(job, agent.name, back[0].round) != old_node
    assert job.violations(cluster.etcd, 2, 3) == []
    lost = [e for e in job.events("session_lost") if e["agent"] == agent.name]
    assert len(lost) == 1, lost
    report(
        f"cut {victim} (node rank 0), TTL {TTL} s",
        lease_declared_lost=lost[0]["time"] - t_cut,
        workers_fenced=t_fenced - t_cut,
        lease_expired_new_round=t_expired - t_cut,
        survivors_running_world4=t_smaller - t_cut,
        restore_to_world6=t_back - t_restore,
    )


# The longest etcd outage that can never fence an agent, on paper: a keep-alive may have been
# sent just under one interval (TTL/3) before the cut, and the lease is declared lost fence_margin
# before TTL after it: TTL - TTL/3 - margin = 0.83 s at TTL 2 (2.33 s at the default TTL 5).
# In practice less: keep-alives ride one TCP connection, and after a silent partition its first
# packet gets through only at the next retransmission, whose timer doubles (0.2, 0.4, 0.8 s):
# a 0.5 s cut was seen to bring the connection back 0.92 s after the cut (ss -ti). Measured here
# (outage: runs in which an agent fenced): 0.15 s 0/10, 0.3 s 0/10, 0.5 s 1/15, 0.6 s 0/15,
# 0.7 s 1/5, 0.8 s 1/5. So the test holds L4 to a blip shorter than the first retransmission
# (0.2 s) — the size of a leader change on fast raft timings — and records the gap with 1.8 s.
GUARANTEED = TTL - TTL / 3 - 0.5


def outage(cluster: Cluster, job: NetnsJob, seconds: float) -> tuple[list[Start], float, float]:
    """Three agents running; etcd's host unplugged for ``seconds`` (the fault schedule, not a
    wait for anything), then plugged back. The first round, cut and restore times.
    """
    first = start_all(job)
    t_cut = cluster.net.cut("etcd")
    time.sleep(seconds)
    return first, t_cut, cluster.net.restore("etcd")


@pytest.mark.parametrize(
    "seconds",
    [
        pytest.param(0.15, id="0.15s"),
        pytest.param(
            1.8,
            id="1.8s",
            marks=pytest.mark.xfail(
                strict=True,
                reason="L4 says an outage shorter than the TTL causes no new round, but no agent "
                "can ride out more than TTL - TTL/3 - fence_margin (0.83 s at TTL 2): it fences "
                "1.5 s after its last acknowledged keep-alive, and etcd itself may expire a lease "
                "TTL after the last one it received, up to TTL/3 before the cut",
            ),
        ),
    ],
)
def test_etcd_outage_shorter_than_ttl_causes_no_new_round(cluster, report, seconds):
    """L4: cut etcd from every agent for less than the TTL, then restore it: no lease is lost,
    the workers started for the first round are the ones still running, no new round starts.

    Watched until every lease would have been lost (TTL after the cut) and one more keep-alive
    interval: later, a lost lease could only come from a new fault.
    """
    job = cluster.job(nproc=2)
    first, t_cut, t_restore = outage(cluster, job, seconds)
    pids = [s.pid for s in first]

    def changed() -> bool:
        return bool(job.events("session_lost") or len(job.rounds()) > 1 or len(alive(pids)) < 6)

    until = t_cut + TTL + TTL / 3
    wait_for(lambda: changed() or time.time() > until, TTL + 5, "the outage's deadline")
    lost = [round(e["time"] - t_cut, 2) for e in job.events("session_lost")]
    report(
        f"etcd cut {seconds:g} s (guaranteed {GUARANTEED:.2f} s, TTL {TTL} s)",
        cut=t_restore - t_cut,
        **{f"lost_{i}": t for i, t in enumerate(lost)},
    )
    assert lost == [], f"leases declared lost {lost} s after the cut"
    assert sorted(alive(pids)) == sorted(pids)
    assert list(job.rounds()) == [first[0].round], job.describe()
    assert all(a.proc.poll() is None for a in job.agents)
    assert job.violations(cluster.etcd, 2, 3) == []


def test_long_etcd_outage_fences_everyone_and_the_job_comes_back(cluster, report):
    """Cut etcd for longer than the TTL: every agent fences before its lease's TTL is over (no
    worker outlives it), keeps trying, and once etcd is back all three rejoin as new nodes and
    the world is whole again.
    """
    job = cluster.job(nproc=2)
    first = start_all(job)
    nodes = {a.name: node_of(job, a.name, first[0].round) for a in job.agents}
    t_cut = cluster.net.cut("etcd")
    fenced = {
        host: wait_dead(pids_on(job, first, host), 10, f"{host}'s workers to be fenced") - t_cut
        for host in AGENTS
    }
    time.sleep(max(0.0, t_cut + TTL + 1 - time.time()))  # the outage lasts TTL + 1 s at least
    t_restore = cluster.net.restore("etcd")
    back = job.wait_round(6, after=first[0].round)
    t_back = max(s.t for s in back)
    report(
        f"etcd cut {t_restore - t_cut:.2f} s, TTL {TTL} s",
        **{f"fenced_{h}": t for h, t in fenced.items()},
        restore_to_world6=t_back - t_restore,
    )
    assert max(fenced.values()) < TTL, fenced
    assert all(a.proc.poll() is None for a in job.agents), job.describe()
    for a in job.agents:  # each is a new node now
        assert node_of(job, a.name, back[0].round) != nodes[a.name]
    assert len(job.events("session_lost")) == 3
    assert job.violations(cluster.etcd, 2, 3) == []


def test_the_sweep_kills_and_reports_what_is_left_inside_and_leaves_others_alone():
    """The helper's own promise: a process left in a namespace is killed and reported, the
    namespaces are gone afterwards, and a namespace of the same name it did not create is
    neither used nor deleted.
    """
    require_netns()
    net = Net(["h0"])
    with pytest.raises(AssertionError, match="processes .* still running"):
        with net:
            left = subprocess.Popen(net.exec_argv("h0", ["sleep", "60"]))
            wait_for(lambda: str(left.pid) in ip("netns", "pids", net.ns("h0")), 5, "sleep inside")
    assert left.wait(5) == -signal.SIGKILL
    assert not {net.ns("hub"), net.ns("h0")} & set(ip("netns", "list").split())

    theirs = Net(["h0"])
    ip("netns", "add", theirs.ns("hub"))  # someone else's, by chance under the same name
    try:
        with pytest.raises(RuntimeError, match="already exists"):
            theirs.__enter__()
        assert theirs.ns("hub") in ip("netns", "list")
    finally:
        ip("netns", "del", theirs.ns("hub"))


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout
