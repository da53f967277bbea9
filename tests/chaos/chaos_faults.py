"""Carrying out a chaos schedule (chaos_schedule.py) on real processes: agents, their wardens and
workers, and the members of a real 3-member etcd.

Why a timeline of actions: a stop or an etcd outage is two actions (SIGSTOP then SIGCONT; kill -9
then restart) that may overlap other faults, so every fault becomes one or two timed actions,
run in time order by one thread. A node is every process whose environment carries its
``ETCDRUN_CHAOS_NODE`` tag (the agent, its warden, its workers and theirs): the agent's own
process tree does not hold the warden (its own session), the environment does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from chaos_netcut import NetCut
from chaos_schedule import Fault
from etcd_helpers import pid_alive

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.localetcd import LocalEtcd

NODE_VAR = "ETCDRUN_CHAOS_NODE"
GARBAGE = b"\xff\xfe chaos: an etcdctl put of garbage"


def tagged(needle: str) -> list[int]:
    """Live pids whose environment holds ``needle`` (``VAR=value``), in pid order."""
    want = needle.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env and pid_alive(int(name)):
            found.append(int(name))
    return sorted(found)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Busy:
    """Every core saturated by busy loops of our own (killed by pid on exit)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Busy:
        for _ in range(os.cpu_count() or 2):
            self.procs.append(
                subprocess.Popen([sys.executable, "-c", "while True: pass"], env=self.env)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


class Executor:
    """Applies faults to one trial's agents (``agents[i]``: a tests/agent_helpers Agent), tagged
    ``<tag>-<i>``, and its etcd. ``log`` says what was done when (wall time), for the report.
    """

    def __init__(
        self,
        etcd: LocalEtcd,
        agents: list,
        tag: str,
        run_prefix: str,
        history_at: Callable,
        cuts: dict[int, NetCut],
    ) -> None:
        self.etcd, self.agents, self.tag, self.prefix = etcd, agents, tag, run_prefix
        self.history_at = history_at  # the revision the trial's history recorder resumes from
        self.log: list[tuple[float, str]] = []
        self.down: list = []  # etcd members killed and not restarted yet
        self.cuts = cuts  # by agent index: the groups the cut nodes started in

    def node(self, i: int) -> list[int]:
        return tagged(f"{NODE_VAR}={self.tag}-{i}")

    def run(self, faults: tuple[Fault, ...], t0: float) -> None:
        """Every action at its time (``t0``: time.monotonic() of the first full round)."""
        actions: list[tuple[float, int, str, Callable[[], None]]] = []
        for n, f in enumerate(faults):
            start, end = self._actions(f)
            actions.append((t0 + f.at, n, f.describe(), start))
            if end is not None:
                actions.append((t0 + f.at + f.duration, n, f"end of {f.kind}", end))
        for when, _, what, act in sorted(actions, key=lambda a: (a[0], a[1])):
            time.sleep(max(0.0, when - time.monotonic()))  # the schedule's clock, not a wait
            self.log.append((time.time(), what))
            act()

    def _actions(self, f: Fault) -> tuple[Callable[[], None], Callable[[], None] | None]:
        if f.kind == "agent_kill":
            return lambda: self._kill_agent(f.target), None
        if f.kind.startswith(("agent_stop", "node_stop")):
            held: list[int] = []
            whole = f.kind.startswith("node")
            return lambda: held.extend(self._stop(f.target, whole)), lambda: self._cont(held)
        if f.kind == "worker_kill":
            return lambda: self._kill_worker(f.target), None
        if f.kind.startswith("net_cut"):
            cut = self.cuts[f.target]
            return cut.start, cut.end
        if f.kind.startswith("etcd_"):
            which = f.kind.split("_")[1]
            return lambda: self._etcd_down(which), self._etcd_up
        if f.kind == "compact":
            return self._compact, None
        return lambda: self._corrupt(f), None

    def _kill_agent(self, i: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.agents[i].pid, signal.SIGKILL)

    def _stop(self, i: int, whole: bool) -> list[int]:
        pids = self.node(i) if whole else [self.agents[i].pid]
        signal_all(pids, signal.SIGSTOP)
        return pids

    def _cont(self, pids: list[int]) -> None:
        signal_all(pids, signal.SIGCONT)

    def _kill_worker(self, i: int) -> None:
        agent_pid = self.agents[i].pid  # its warden is its child too, but holds no RANK
        workers = [p for p in self.node(i) if _ppid(p) == agent_pid and _is_worker(p)]
        signal_all(workers[:1], signal.SIGKILL)
        if not workers:
            self.log.append((time.time(), f"no worker of agent{i} to kill"))

    def _etcd_down(self, which: str) -> None:
        live = [m for m in self.etcd.members if m.is_running()]
        if which == "all":
            victims = live
        else:
            try:
                leader = self.etcd.leader()
            except RuntimeError:
                return  # no leader right now (another outage): nothing to pick
            victims = [leader] if which == "leader" else [m for m in live if m is not leader][:1]
        for m in victims:
            m.kill()
        self.down += victims

    def _etcd_up(self) -> None:
        back, self.down = self.down, []
        for m in back:
            m.start()

    def _client(self) -> EtcdClient:
        return EtcdClient(self.etcd.endpoints, request_timeout=1.0, retry_timeout=3.0)

    def _compact(self) -> None:
        with contextlib.suppress(Exception), self._client() as c:
            # Never past the recorder: the checker reads the history it kept.
            c.compact(min(c.status().header.revision, self.history_at()))

    def _corrupt(self, f: Fault) -> None:
        with contextlib.suppress(Exception), self._client() as c:
            if f.kind == "corrupt_round":
                c.put(f"{self.prefix}round", GARBAGE)
                return
            keys = sorted(kv.key for kv in c.get_prefix(f"{self.prefix}agents/").kvs)
            if keys:
                c.put(keys[f.target % len(keys)], GARBAGE)


def _is_worker(pid: int) -> bool:
    try:
        return b"\0RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
