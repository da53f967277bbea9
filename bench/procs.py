"""Agent processes for bench/compare.py: start, read their workers' lines, kill a node, clean up.

Why these rules:
- Every process the benchmark starts carries ``ETCDRUN_BENCH_TAG=<run tag>`` in its environment,
  and workers inherit it. torchrun starts its workers in their own sessions, and a kill -9'd
  agent leaves them running (parent 1), so neither process groups nor parent links find them
  all; the tag does. ``sweep()`` kills every tagged process and reports what it had to kill.
- The harness makes itself a child subreaper (Linux prctl): orphans re-parent to it, so they
  are reaped here and never linger as zombies of the machine's init.
- A node "dies" as a machine would: its agent and every process below it get SIGKILL at once.
  Killing only a torchrun agent would leave its worker in the collectives, and then no launcher
  has anything to notice.
- Times come from the workers' own lines (``BENCH_START``/``BENCH_READY t=<time.time()>``),
  never from the launchers' logs, so both launchers are measured the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from etcdrun.agent.fencing import warden

TAG_VAR = "ETCDRUN_BENCH_TAG"
_LINE = re.compile(
    r"BENCH_(START|READY) t=([0-9.]+) world=(\S+) rank=(\S+) group_rank=(\S+) "
    r"restart=(\S+) round=(\S+) pid=(\d+)"
)
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of our agents re-parent to us (best effort: Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans() -> None:
    """Collect exit statuses of re-parented orphans (never of an agent we still track)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass(frozen=True)
class WorkerLine:
    kind: str  # "START" (process began, before torch) or "READY" (process group up)
    t: float  # the worker's time.time()
    world: int
    rank: int
    group_rank: int
    restart: str  # TORCHELASTIC_RESTART_COUNT: per node (torchrun), job-wide (etcdrun)
    pid: int


def parse_lines(text: str) -> list[WorkerLine]:
    out = []
    for m in _LINE.finditer(text):
        kind, t, world, rank, group_rank, restart, _round, pid = m.groups()
        with contextlib.suppress(ValueError):
            out.append(
                WorkerLine(
                    kind, float(t), int(world), int(rank), int(group_rank), restart, int(pid)
                )
            )
    return out


def _ppid_map() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (any session), deepest last."""
    children: dict[int, list[int]] = {}
    for p, pp in _ppid_map().items():
        children.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries our tag (the warden's scan, our variable)."""
    return warden.tagged(tag, {os.getpid()}, TAG_VAR)


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def sweep(tag: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every tagged process until none is left; return the pids that had to be killed.

    Raises RuntimeError if some survive ``timeout`` (the report must not claim a clean run).
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        left = tagged(tag)
        if not left:
            reap_orphans()
            return killed
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes still alive after SIGKILL: {left}")
        killed.extend(p for p in left if p not in killed)
        kill_pids(left)
        time.sleep(0.05)
        reap_orphans()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU a live process has used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def proc_kb(pid: int, key: str, name: str = "status") -> int | None:
    """One ``key: N kB`` line of ``/proc/<pid>/<name>`` (status, smaps_rollup); None if the
    process is gone or the line is missing.
    """
    try:
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set size of a live process (VmHWM), in MB."""
    kb = proc_kb(pid, "VmHWM")
    return None if kb is None else kb / 1024


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port``, any address, IPv4 or IPv6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    return inodes


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def listener_pid(port: int, among: Sequence[int]) -> int | None:
    """Which of ``among`` (pids) listens on TCP ``port`` on any address (c10d's store host)."""
    inodes = _listening_inodes(port)
    return next((pid for pid in among if _holds_socket(pid, inodes)), None)


class Agent:
    """One launcher process (a "node"), its output in one log file (workers' lines included)."""

    def __init__(self, name: str, cmd: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.t_start = 0.0
        self.killed_at: float | None = None

    def start(self) -> float:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.t_start = time.time()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self.t_start

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def lines(self) -> list[WorkerLine]:
        try:
            return parse_lines(self.log.read_text(errors="replace"))
        except OSError:
            return []

    def ready_since(self, t0: float, world: int) -> WorkerLine | None:
        """This node's first worker READY line after ``t0`` with this world size."""
        return next(
            (ln for ln in self.lines() if ln.kind == "READY" and ln.t > t0 and ln.world == world),
            None,
        )

    def start_of(self, ready: WorkerLine) -> WorkerLine | None:
        """The START line of the worker process that printed ``ready`` (same pid).

        Why the same process and not the first START with that world: a worker that started
        with the new world and then failed does not count as running; its successor does.
        """
        return next((ln for ln in self.lines() if ln.kind == "START" and ln.pid == ready.pid), None)

    def group_rank(self) -> int | None:
        """Node rank of this agent's newest running worker."""
        ready = [ln for ln in self.lines() if ln.kind == "READY"]
        return ready[-1].group_rank if ready else None

    def last_start(self) -> WorkerLine | None:
        starts = [ln for ln in self.lines() if ln.kind == "START"]
        return starts[-1] if starts else None

    def kill_node(self) -> float:
        """SIGKILL the agent and everything below it at once; return the kill time."""
        victims = [self.pid, *descendants(self.pid)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGSTOP)  # freeze first: no child is spawned meanwhile
        victims = list(dict.fromkeys([*victims, *descendants(self.pid)]))
        self.killed_at = time.time()
        kill_pids(victims)
        return self.killed_at

    def cpu_s(self) -> float:
        """CPU seconds the agent process itself has used (not its workers)."""
        return cpu_seconds(self.pid) if self.alive() else 0.0

    def tree_cpu_s(self) -> dict[int, float]:
        """CPU seconds of the agent and of every live process below it, by pid."""
        return {p: cpu_seconds(p) for p in [self.pid, *descendants(self.pid)]}

    def rss_mb(self) -> float | None:
        return vm_hwm_mb(self.pid) if self.alive() else None

    def tail(self, n: int = 6) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(ln.strip()[:160] for ln in lines[-n:])

    def stop(self) -> None:
        """Kill the agent's tree and wait for the agent (the tag sweep catches the rest)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            kill_pids([self.pid, *descendants(self.pid)])
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
