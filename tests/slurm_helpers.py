"""A real Slurm cluster on one machine: slurmctld in a head namespace, one slurmd per host
namespace of a tests/netns_helpers.py Net, munged for all of them, in a temp dir of its own.

Why real Slurm and not the sbatch script's body with SLURM_* set by hand: what is under test is
Slurm's side — that ``srun --ntasks-per-node=1`` really puts one agent on each node, that the
job id reaches every node, that ``--signal`` / ``scancel --signal`` really land on the agents.
Debian's slurm-wlm 22.05 installs in ~3 s and this cluster is up in ~1 s (measured here).

Why namespaces: every node needs its own address (MASTER_ADDR must be a real peer's), and inside
private namespaces the standard ports (6817/6818) can never clash with a Slurm the machine or
another test runs. munged's socket is a file, so one munged serves every namespace. The daemons
enter their namespaces with ``nsenter --net`` rather than ``ip netns exec``: the latter mounts a
fresh /sys, without the cgroup mounts slurmd refuses to start without.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from agent_helpers import wait_for
from netns_helpers import Net

BINARIES = (
    *("munged", "slurmctld", "slurmd", "nsenter"),
    *("sbatch", "scontrol", "scancel", "sinfo", "squeue"),
)

CONF = """\
ClusterName=etcdrun-test
SlurmctldHost={host}({head_addr})
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MinJobAge=600
"""


def require_slurm() -> None:
    """Skip when Slurm is not installed; FAIL instead when CI=true (.ci/run installs it)."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not missing:
        return
    msg = f"Slurm not installed ({', '.join(missing)} missing: apt-get install slurmctld slurmd)"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{msg} [CI=true: .ci/run installs Slurm]", pytrace=False)
    pytest.skip(msg)


class SlurmCluster:
    """slurmctld on ``head``, a slurmd named n<i> on each of ``hosts``; everything stopped and
    removed on exit, failure included (jobs cancelled first: slurmstepd outlives slurmd).
    """

    def __init__(
        self, net: Net, head: str, hosts: Sequence[str], *, kill_on_bad_exit: bool = False
    ) -> None:
        """``kill_on_bad_exit``: the site default some clusters set (srun then kills a step's
        other tasks when one exits non-zero); a job script must override it to be elastic.
        """
        self.net, self.head, self.hosts = net, head, list(hosts)
        self.kill_on_bad_exit = kill_on_bad_exit
        self.root = Path(tempfile.mkdtemp(prefix="etcdrun-slurm-"))  # short: socket paths
        self.nodes = {h: f"n{i}" for i, h in enumerate(self.hosts)}
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self._procs: list[subprocess.Popen[bytes]] = []

    def _enter(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.net.ns(host)}", *argv]

    def _spawn(self, argv: list[str], log: str) -> None:
        with open(self.root / "log" / log, "wb") as out:
            self._procs.append(
                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        for d in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes.values())):
            (self.root / d).mkdir(parents=True)
        munge = self.root / "munge"
        munge.chmod(0o700)
        (munge / "key").write_bytes(os.urandom(1024))
        (munge / "key").chmod(0o400)
        conf = CONF.format(
            host=socket.gethostname().split(".")[0],
            head_addr=self.net.addr(self.head),
            root=self.root,
        )
        conf += f"KillOnBadExit={int(self.kill_on_bad_exit)}\n"
        conf += "".join(
            f"NodeName={n} NodeAddr={self.net.addr(h)} CPUs=2 State=UNKNOWN\n"
            for h, n in self.nodes.items()
        )
        conf += "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        (self.root / "slurm.conf").write_text(conf)
        self._spawn(
            ["munged", "-F", "-f", f"--key-file={munge}/key", f"--socket={munge}/socket"]
            + [f"--pid-file={munge}/pid", f"--log-file={munge}/log", f"--seed-file={munge}/seed"],
            "munged.out",
        )
        wait_for(lambda: (munge / "socket").exists(), 10, "munged's socket")
        self._spawn(self._enter(self.head, ["slurmctld", "-D", "-i"]), "slurmctld.out")
        for host, node in self.nodes.items():
            self._spawn(self._enter(host, ["slurmd", "-D", "-N", node]), f"slurmd-{node}.out")
        idle = f"idle {len(self.hosts)}"
        try:
            wait_for(lambda: self.run("sinfo", "-h", "-o", "%T %D", check=False) == idle, 20, idle)
        except AssertionError as e:
            raise AssertionError(f"{e}; daemons said: {self.log_tails()}") from None

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        """A Slurm command, run on the head node; its stdout, stripped."""
        res = subprocess.run(
            self._enter(self.head, argv),
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=30,
        )
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
        return res.stdout.strip()

    def sbatch(self, *argv: str, env: dict[str, str]) -> int:
        """Submit; the job id. ``env`` is the submitting shell's environment (exported)."""
        return int(self.run("sbatch", "--parsable", *argv, env=env).split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id))
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_ended(self, job_id: int, timeout: float) -> dict[str, str]:
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        return wait_for(
            lambda: (j := self.job(job_id))["JobState"] in ended and j,
            timeout,
            f"job {job_id} to end",
        )

    def log_tails(self, lines: int = 5) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.out")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"{log.name}: " + " | ".join(tail))
        return "; ".join(parts)

    def close(self) -> None:
        if self._procs and all(p.poll() is None for p in self._procs):
            self.run("scancel", "--user=root", check=False)  # our own cluster: every job
            wait_for(lambda: self.run("squeue", "-h", check=False) == "", 15, "no Slurm job left")
        for p in reversed(self._procs):  # slurmds, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        shutil.rmtree(self.root, ignore_errors=True)
