"""deploy/slurm/etcdrun.sbatch under a real Slurm: slurmctld and etcd on a head namespace, three
slurmd nodes on three host namespaces (tests/slurm_helpers.py), jobs submitted with sbatch.

Real Slurm, not the script's body with SLURM_* set by hand: Slurm's own side is what is under
test — one agent per node from ``srun --ntasks-per-node=1``, the job id on every node, the
script's ``--signal`` really reaching the agents before the time limit, and srun leaving the
survivors alone when one agent dies. Measured here: the cluster is up in ~1 s; Slurm acts on
``--signal`` at its first time-limit check, 30 s after slurmctld starts, so the signal test takes
~30 s (the other one ~8 s).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import WORKER, Job, Start, clean_env, etcdrun_bin, wait_for
from layout import ROOT
from netns_helpers import Net, NetnsEtcd, print_figures, require_netns
from slurm_helpers import SlurmCluster, require_slurm

SBATCH = str(ROOT / "deploy" / "slurm" / "etcdrun.sbatch")
HOSTS = ("a0", "a1", "a2")


class Slurm:
    def __init__(self, net: Net, etcd: NetnsEtcd, cluster: SlurmCluster, root: Path) -> None:
        self.net, self.etcd, self.cluster, self.root = net, etcd, cluster, root

    def submit(self, *sbatch_args: str, **settings: str) -> tuple[int, Job, Path]:
        """sbatch the script on every node with worker.py (sleep mode); its id, a Job that reads
        the workers' records, and the job's output file.
        """
        job = Job(self.etcd.endpoint, self.root / "job", nnodes="2:3")
        out = self.root / "slurm.out"
        env = clean_env(
            ETCDRUN_ENDPOINTS=self.etcd.endpoint,
            ETCDRUN_IFACE="eth0",
            ETCDRUN_NPROC_PER_NODE="2",
            ETCDRUN_RDZV_CONF="lease_ttl=2,last_call_timeout=1,join_timeout=60",
            ETCDRUN_BIN=etcdrun_bin(),
            LOGLEVEL="DEBUG",  # the agents' events, for the checker
            ETCDRUN_ARGS=f"--log-dir {self.root / 'logs'}",  # not a /tmp/etcdrun_logs_* each
            **settings,
        )
        argv = ("--nodes=3", "-o", str(out), *sbatch_args, SBATCH, WORKER, str(job.out), "sleep")
        return self.cluster.sbatch(*argv, env=env), job, out

    def node_of(self, start: Start) -> str:
        return start.env["SLURMD_NODENAME"]

    def host_of_node(self, node: str) -> str:
        return next(h for h, n in self.cluster.nodes.items() if n == node)

    def violations(self, job_id: int, out: Path, lo: int, hi: int) -> list[str]:
        """The invariant checker over the Slurm job's run (``slurm-<job id>``, as the sbatch
        script names it), with the agents' round_accepted events from the job's output.
        """
        accepted = [
            json.loads(line[line.find("{") :])
            for line in out.read_text(errors="replace").splitlines()
            if '"event": "round_accepted"' in line
        ]
        found = self.net.probe(
            "head",
            "check",
            self.etcd.endpoint,
            f"slurm-{job_id}",
            str(lo),
            str(hi),
            stdin=json.dumps(accepted),
        )
        assert isinstance(found, list)
        return found


@pytest.fixture
def slurm(etcd_bin: str, tmp_path: Path) -> Iterator[Slurm]:
    require_netns()
    require_slurm()
    with (
        Net(["head", *HOSTS]) as net,
        NetnsEtcd(net, "head", etcd_bin, tmp_path) as etcd,
        SlurmCluster(net, "head", HOSTS, kill_on_bad_exit=True) as cluster,
    ):
        yield Slurm(net, etcd, cluster, tmp_path)


@pytest.fixture
def report_slurm(capsys: pytest.CaptureFixture[str]):
    return lambda what, **figures: print_figures(capsys, "slurm", what, **figures)


def assert_one_agent_per_node(s: Slurm, job_id: int, starts: list[Start]) -> None:
    """Every node ran one agent (two workers), the run id is the Slurm job's, and MASTER_ADDR is
    the address of the node holding node rank 0.
    """
    by_node: dict[str, set[int]] = {}
    for st in starts:
        by_node.setdefault(s.node_of(st), set()).add(st.ppid)
    assert sorted(by_node) == ["n0", "n1", "n2"] and all(len(p) == 1 for p in by_node.values())
    assert {st.env["TORCHELASTIC_RUN_ID"] for st in starts} == {f"slurm-{job_id}"}
    rank0 = next(st for st in starts if st.env["GROUP_RANK"] == "0")
    addr = s.net.addr(s.host_of_node(s.node_of(rank0)))
    assert {st.env["MASTER_ADDR"] for st in starts} == {addr}


def test_sbatch_one_agent_per_node_and_the_scripts_signal_stops_them(slurm, report_slurm):
    """A 1-minute job: the script's ``--signal=TERM@120`` makes Slurm send SIGTERM to the agents
    at its first check; they forward it to their workers and leave (exit 143, leases revoked),
    so the job ends FAILED 143 before its time limit — without the directive it would run into
    the limit (TIMEOUT), its agents killed by Slurm.
    """
    t0 = time.time()
    job_id, job, out = slurm.submit("--time=1")
    starts = job.wait_round(6, timeout=90)
    t_running = max(st.t for st in starts)
    assert_one_agent_per_node(slurm, job_id, starts)

    ended = slurm.cluster.wait_ended(job_id, 90)
    t_end = time.time()
    text = out.read_text(errors="replace")
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "143:0"), text[-3000:]
    assert text.count("Exited with exit code 143") == 3, text[-3000:]
    sigs = job.signals()
    assert {pid: sigs.get(pid, {}).get("signal") for pid in (st.pid for st in starts)} == {
        st.pid: signal.SIGTERM for st in starts
    }
    # All revoked on leaving but the run's record: every node signalled, it says CANCELLED and
    # expires by itself (docs/drain.md).
    assert slurm.net.probe("head", "leases", slurm.etcd.endpoint) == [
        f"/etcdrun/slurm-{job_id}/round"
    ]
    assert slurm.net.probe("head", "outcome", slurm.etcd.endpoint, f"slurm-{job_id}") == "CANCELLED"
    assert slurm.violations(job_id, out, 2, 3) == []
    report_slurm(
        "sbatch --nodes=3 --time=1, the script's --signal",
        submit_to_workers_running=t_running - t0,
        submit_to_sigterm=min(s["t"] for s in sigs.values()) - t0,
        submit_to_job_end=t_end - t0,
    )


def test_sbatch_job_goes_on_when_one_agent_dies(slurm, report_slurm):
    """kill -9 of one node's agent: srun leaves the other two running although the cluster says
    KillOnBadExit=1 (the script's --kill-on-bad-exit=0), and they go on with WORLD_SIZE 4; then
    ``scancel --signal=TERM`` (Slurm's own path for --signal) ends the job with 143.
    """
    job_id, job, out = slurm.submit(ETCDRUN_MIN_NODES="2")
    first = job.wait_round(6, timeout=90)
    assert_one_agent_per_node(slurm, job_id, first)
    victim = next(st for st in first if slurm.node_of(st) == "n2")
    t_kill = time.time()
    os.kill(victim.ppid, signal.SIGKILL)
    smaller = job.wait_round(4, after=first[0].round, timeout=30)
    assert {slurm.node_of(st) for st in smaller} == {"n0", "n1"}
    assert slurm.cluster.job(job_id)["JobState"] == "RUNNING"

    slurm.cluster.run("scancel", "--signal=TERM", str(job_id))
    ended = slurm.cluster.wait_ended(job_id, 60)
    text = out.read_text(errors="replace")
    assert text.count("Exited with exit code 143") == 2, text[-3000:]
    assert ended["JobState"] == "FAILED", ended
    wait_for(
        lambda: (
            slurm.net.probe("head", "leases", slurm.etcd.endpoint)
            == [f"/etcdrun/slurm-{job_id}/round"]
        ),
        5,
        "every lease gone but the run's CANCELLED record",
    )
    assert slurm.net.probe("head", "outcome", slurm.etcd.endpoint, f"slurm-{job_id}") == "CANCELLED"
    assert slurm.violations(job_id, out, 2, 3) == []
    report_slurm(
        "sbatch --nodes=3, one agent killed -9, lease_ttl 2",
        kill_to_survivors_running=max(st.t for st in smaller) - t_kill,
    )
