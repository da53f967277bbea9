"""The four columns of bench/in_place_compare.py and one trial's cluster for any of them.

Why a cluster of its own and not bench/trial.py's ``Job``: the figures here come from the toy
job's step log (bench/toy_job.py), not from the ``BENCH_READY`` lines, each node needs its name
in its environment (``BENCH_NODE``) so that a restarted worker is counted on its node, and
torchft has no launcher: its "node" is one worker process (a replica group of one) beside a
Lighthouse. The processes, the node kill and the clean-up are bench/procs.py's, as in
compare.py.

Settings, each side as its users would set it:
- defaults: etcdrun lease_ttl 5 (its default); torchrun c10d as shipped; torchft's Lighthouse
  as shipped (heartbeat timeout 5000 ms, join timeout 60000 ms) and its Manager's 60 s timeout;
- tuned: etcdrun ``lease_ttl=2,last_call_timeout=1``; torchrun bench/launchers.py's best;
  torchft heartbeat timeout 2000 ms (the lease), join timeout 1000 ms (the last call) and a 2 s
  Manager and process-group timeout (what notices a frozen peer, as the lease does here);
- tuned-hb (kill -9 only): torchft tuned but its join timeout at its default, so that the
  table shows which of its two timers its tuned recovery comes from.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.launchers import ETCDRUN, LAUNCHERS, Launcher
from bench.procs import TAG_VAR, Agent, descendants, kill_pids, listener_pid, sweep
from bench.step_metrics import last_ranks, read_log

HERE = Path(__file__).resolve().parent
WORKER = HERE / "in_place_worker.py"
FT_WORKER = HERE / "torchft_worker.py"
NNODES = "2:4"


@dataclass(frozen=True)
class TorchftSetting:
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    timeout_s: float

    def describe(self) -> str:
        return (
            f"heartbeat_timeout_ms={self.heartbeat_timeout_ms}, "
            f"join_timeout_ms={self.join_timeout_ms}, timeout={self.timeout_s:g} s"
        )


TORCHFT = {
    "default": TorchftSetting(5000, 60000, 60.0),
    "tuned": TorchftSetting(2000, 1000, 2.0),
    # only the lease's counterpart tuned: without the 1 s join timeout, torchft waits for the
    # dead replica's heartbeat to time out, as etcdrun waits for its lease
    "tuned-hb": TorchftSetting(2000, 60000, 2.0),
}


@dataclass(frozen=True)
class Column:
    key: str  # etcdrun-restart | etcdrun-inplace | torchrun | torchft
    label: str
    mode: str  # the worker's: restart | inplace | torchft
    launcher: Launcher | None = None  # None: torchft (no launcher)
    ft: TorchftSetting | None = None

    def describe(self) -> str:
        return self.launcher.label if self.launcher else f"torchft 0.2.0 ({self.ft.describe()})"


def columns(setting: str) -> list[Column]:
    """The columns of a setting; ``tuned-hb`` is torchft alone, its join timeout at default."""
    if setting == "tuned-hb":
        return [
            Column(
                "torchft", "torchft 0.2.0, join timeout at default", "torchft", ft=TORCHFT[setting]
            )
        ]
    tuned = setting == "tuned"
    er = LAUNCHERS["etcdrun-tuned" if tuned else "etcdrun"]
    tr = LAUNCHERS["c10d-tuned" if tuned else "c10d"]
    return [
        Column("etcdrun-restart", "etcdrun restart", "restart", er),
        Column("etcdrun-inplace", "etcdrun in place", "inplace", er),
        Column("torchrun", "torchrun c10d", "restart", tr),
        Column("torchft", "torchft 0.2.0", "torchft", ft=TORCHFT[setting]),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warden_pids(agent_pid: int) -> list[int]:
    """etcdrun's warden of this agent (agent/fencing/warden.py: started with the agent's pid,
    outside its process tree).
    """
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (d / "cmdline").read_bytes().split(b"\0")
                if any(a.endswith(b"warden.py") for a in argv) and str(agent_pid).encode() in argv:
                    found.append(int(d.name))
    return found


class Cluster:
    """One trial's world: etcd, a c10d port or a Lighthouse; the nodes; a guaranteed clean-up."""

    def __init__(self, ctx, col: Column, name: str) -> None:
        self.ctx, self.col = ctx, col
        self.dir = ctx.out / name
        self.steps_dir = self.dir / "steps"
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Agent] = []
        self.frozen: list[int] = []
        self.etcd = None
        self.lighthouse: Agent | None = None
        self.endpoint = ""
        self.port = 0

    def __enter__(self) -> Cluster:
        self.steps_dir.mkdir(parents=True, exist_ok=True)
        la = self.col.launcher
        if la is not None and la.needs_etcd:
            from etcdrun.rendezvous.localetcd import LocalEtcd

            self.etcd = LocalEtcd().start()
            self.endpoint = self.etcd.endpoints
        else:
            self.port = _free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
        if la is None:
            self._start_lighthouse()
        return self

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        la_env = self.col.launcher.env if self.col.launcher else {}
        return {**env, **la_env, TAG_VAR: self.ctx.tag, "PYTHONUNBUFFERED": "1", **extra}

    def _start_lighthouse(self) -> None:
        ft = self.col.ft
        cmd = [
            str(self.ctx.bindir / "torchft_lighthouse"),
            "--min_replicas",
            "2",
            "--bind",
            self.endpoint,
            "--heartbeat_timeout_ms",
            str(ft.heartbeat_timeout_ms),
            "--join_timeout_ms",
            str(ft.join_timeout_ms),
        ]
        self.lighthouse = Agent("lighthouse", cmd, self._env(), self.dir / "lighthouse.log")
        self.lighthouse.start()

    def _node_cmd(self) -> list[str]:
        la, steps = self.col.launcher, str(self.steps_dir)
        if la is None:
            addr = f"http://{self.endpoint}"
            timeout = str(self.col.ft.timeout_s)
            return [str(self.ctx.bindir / "python"), str(FT_WORKER), steps, addr, timeout]
        worker = (str(WORKER), self.col.mode, steps)
        return la.command(self.ctx.bindir, NNODES, self.endpoint, self.run_id, "", worker)

    def start(self, n: int) -> float:
        """Start ``n`` more nodes back to back; the last one's start time."""
        t = 0.0
        for _ in range(n):
            name = f"node{len(self.nodes)}"
            env = self._env(BENCH_NODE=name)
            if self.col.launcher is not None and self.col.launcher.kind == ETCDRUN:
                env["PET_LOG_DIR"] = str(self.dir / f"logs-{name}")  # its events.jsonl
            a = Agent(name, self._node_cmd(), env, self.dir / f"{name}.log")
            self.nodes.append(a)
            t = a.start()
        return t

    def records(self) -> list[dict]:
        return read_log(self.steps_dir)

    def events(self, nodes: list[str]) -> list[dict]:
        """etcdrun's events of these nodes' agents (none for the other launchers)."""
        out = []
        for name in nodes:
            path = self.dir / f"logs-{name}" / "events.jsonl"
            if path.exists():
                out += [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return out

    def victim(self, which: str) -> tuple[Agent, str]:
        """The node to kill or freeze: rank 0's, or the highest rank that does not host
        torchrun's c10d store (killing that host is the rank-0 scenario for c10d).
        """
        ranks = last_ranks(self.records())
        host = None
        la = self.col.launcher
        if la is not None and la.backend == "c10d":
            host = listener_pid(self.port, [a.pid for a in self.nodes])
        if which == "rank0":
            a = next(a for a in self.nodes if ranks.get(a.name) == 0)
            where = ", the c10d store host" if host == a.pid else ""
            return a, f"{a.name} (rank 0{where})"
        cands = [a for a in self.nodes if ranks.get(a.name, 0) != 0 and a.pid != host]
        a = max(cands, key=lambda a: ranks[a.name])
        return a, f"{a.name} (rank {ranks[a.name]})"

    def freeze(self, node: Agent) -> float:
        """SIGSTOP the node's every process (etcdrun's warden too): a machine that hangs."""
        pids = [node.pid, *descendants(node.pid), *warden_pids(node.pid)]
        t = time.time()
        kill_pids(pids, signal.SIGSTOP)
        self.frozen = pids
        return t

    def __exit__(self, *exc: object) -> None:
        try:
            kill_pids(self.frozen)
            for a in [*self.nodes, *([self.lighthouse] if self.lighthouse else [])]:
                a.stop()
            sweep(self.ctx.tag)
        finally:
            if self.etcd is not None:
                self.etcd.stop()
