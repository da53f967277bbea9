"""Helpers for end-to-end tests: real ``etcdrun`` agents (console-script subprocesses) on a real
etcd, running real worker processes that report through files.

Why files and not pipes: agents and workers are separate processes that may be killed at any
moment; a file per worker start (written atomically by tests/agent_scripts/worker.py) survives
that, and a test can poll a folder without ever blocking on a pipe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcd_helpers import list_leases, pid_alive

SCRIPTS = Path(__file__).parent / "agent_scripts"
WORKER = str(SCRIPTS / "worker.py")


def etcdrun_bin() -> str:
    """The installed console script (next to this interpreter; not a pyenv shim)."""
    beside = Path(sys.executable).parent / "etcdrun"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcdrun")
    assert found, "the etcdrun console script is not installed (pip install -e '.[test]')"
    return found


def torchrun_bin() -> str:
    """torch's console script, beside this interpreter when there; in a venv that sees the
    system's torch, the one beside the interpreter the venv was made from (never a shim on
    PATH, such as pyenv's, which changes the workers' environment).
    """
    for python in (Path(sys.executable), Path(sys.executable).resolve()):
        beside = python.parent / "torchrun"
        if beside.exists():
            return str(beside)
    found = shutil.which("torchrun")
    assert found, "torch's torchrun console script is not installed (pip install torch)"
    return found


# Worker lines labelled with their global rank (torch's own example template), so that a test can
# tell whose line it is; by default etcdrun, like torchrun, prefixes teed lines only.
RANK_PREFIX = "[${rank}]:"


def suite_prewarm() -> str:
    """The suite's ``--prewarm`` (conftest.py: ``none`` unless ``ETCDRUN_TEST_PREWARM`` says
    otherwise), for an environment a test builds without ``PET_*``: a test that is about
    standbys passes ``--prewarm`` itself, which wins.
    """
    from etcdrun.agent import flags

    return flags.DEFAULT_PREWARM


def unused_port() -> str:
    """A loopback port free now (a MASTER_PORT for a test's own process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without what would change an agent's or worker's behaviour, with
    the suite's ``PET_PREWARM``, and with worker lines prefixed ``[<global rank>]:``
    (``RANK_PREFIX``).
    """
    drop = ("PET_", "ETCDCTL_", "TORCHELASTIC_", "OMP_NUM_THREADS", "PYTHON_EXEC", "LOGLEVEL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PET_PREWARM"] = suite_prewarm()
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX
    env.update(extra)
    return env


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until truthy; its value. Fails with ``what`` (a deadlock guard, not
    a timing assertion: the bounds a test checks are measured and asserted separately).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Start:
    """One worker start, as the worker recorded it."""

    rank: int
    round: int
    pid: int
    ppid: int
    t: float
    env: dict[str, str]

    @property
    def world_size(self) -> int:
        return int(self.env["WORLD_SIZE"])


class Agent:
    """One ``etcdrun`` process; its stdout/stderr go to files (never a pipe that could fill)."""

    def __init__(self, argv: list[str], out_dir: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.stdout_path = out_dir / f"{name}.stdout"
        self.stderr_path = out_dir / f"{name}.stderr"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} did not exit within {timeout:g} s; "
                f"stderr:\n{self.stderr[-3000:]}"
            ) from None


class Job:
    """Agents of one run on one etcd, the workers' reports, and a teardown that leaves nothing.

    ``conf`` is the --rdzv-conf; ``extra`` more etcdrun flags before the script.
    """

    def __init__(
        self,
        endpoints: str,
        root: Path,
        *,
        nnodes: str,
        nproc: int = 2,
        conf: str = "",
        extra: tuple[str, ...] = (),
        run_id: str | None = None,
        script: tuple[str, ...] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.root = root
        self.out = root / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or "e2e-" + uuid.uuid4().hex[:8]
        self.nnodes, self.nproc, self.conf, self.extra = nnodes, nproc, conf, extra
        self.script = script
        self.agents: list[Agent] = []

    def argv(self, *script: str) -> list[str]:
        argv = [
            etcdrun_bin(),
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            self.endpoints,
            "--rdzv-id",
            self.run_id,
            "--monitor-interval",
            "0.05",
        ]
        if self.conf:
            argv += ["--rdzv-conf", self.conf]
        return [*argv, *self.extra, *script]

    def start(
        self,
        *script: str,
        env: dict[str, str] | None = None,
        extra: tuple[str, ...] = (),
        wrap: tuple[str, ...] = (),
    ) -> Agent:
        """One more agent; ``script`` defaults to the worker with this job's out dir; ``wrap``
        goes before the command (it must exec it: tests/chaos/chaos_netcut.py).
        """
        name = f"agent{len(self.agents)}"
        args = script or self.script or (WORKER, str(self.out), "sleep")
        argv = [*wrap, *self.argv(), *extra, *args]
        agent = Agent(argv, self.root, name, env or clean_env())
        self.agents.append(agent)
        return agent

    # ---- what the workers reported -------------------------------------------------------------
    def starts(self) -> list[Start]:
        found = []
        for path in self.out.glob("start_*.json"):
            data = json.loads(path.read_text())
            env = data["env"]
            found.append(
                Start(
                    int(env["RANK"]),
                    int(env["ETCDRUN_ROUND"]),
                    data["pid"],
                    data["ppid"],
                    data["t"],
                    env,
                )
            )
        return sorted(found, key=lambda s: (s.round, s.rank))

    def rounds(self) -> dict[int, list[Start]]:
        by_round: dict[int, list[Start]] = {}
        for s in self.starts():
            by_round.setdefault(s.round, []).append(s)
        return by_round

    def wait_round(self, world_size: int, after: int = 0, timeout: float = 30.0) -> list[Start]:
        """The first round numbered > ``after`` in which all ``world_size`` workers started."""

        def complete() -> list[Start] | None:
            for number, starts in sorted(self.rounds().items()):
                if (
                    number > after
                    and len({s.rank for s in starts}) == world_size
                    and all(s.world_size == world_size for s in starts)
                ):
                    return starts
            return None

        return wait_for(
            complete,
            timeout,
            f"a round > {after} with {world_size} workers running ({self.describe()})",
        )

    def signals(self) -> dict[int, dict[str, Any]]:
        """Signals workers recorded, by worker pid."""
        return {
            int(p.stem.split("_")[1]): json.loads(p.read_text())
            for p in self.out.glob("signal_*.json")
        }

    def describe(self) -> str:
        rounds = {n: sorted(s.rank for s in ss) for n, ss in self.rounds().items()}
        codes = [a.proc.poll() for a in self.agents]
        tails = "; ".join(f"{a.name}: {a.stderr.strip().splitlines()[-1:]}" for a in self.agents)
        return f"worker starts by round {rounds}, agent exit codes {codes}; last lines: {tails}"

    def agent_of(self, start: Start) -> Agent:
        return next(a for a in self.agents if a.pid == start.ppid)

    # ---- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """SIGKILL any agent still running (its workers die with it: PR_SET_PDEATHSIG), then reap
        workers that came to the test process as orphans (it is a child subreaper).
        """
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.kill()
            a.proc.wait()
        pids = {s.pid for s in self.starts()}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.02)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)  # reported by the leak check all the same
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def leased_keys(endpoints: str) -> list[bytes]:
    """Every key attached to any lease in etcd."""
    return sorted(k for keys in list_leases(endpoints).values() for k in keys)


def wait_leases_only(endpoints: str, allowed: set[bytes], within: float) -> None:
    """Wait until every lease left holds only ``allowed`` keys (or nothing); fail otherwise.

    Why not "no lease at all": a finished run keeps its closed marker under a lease of
    join_timeout seconds by design, so that late joiners fail at once.
    """
    wait_for(
        lambda: (
            set(leased_keys(endpoints)) <= allowed
            and all(keys for keys in list_leases(endpoints).values())
            or None
        ),
        within,
        f"only {sorted(allowed)} leased (now: {leased_keys(endpoints)})",
    )


def alive(pids: Iterator[int] | list[int]) -> list[int]:
    return [p for p in pids if pid_alive(p)]


def warden_of(agent_pid: int) -> int:
    """The agent's warden (agent/fencing/warden.py, started with the agent's pid)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"warden.py") for a in argv) and str(agent_pid).encode() in argv:
                return int(d.name)
    raise AssertionError(f"no warden for agent {agent_pid}")


def rows_by_pid(out: Path) -> dict[int, list[dict]]:
    """What each worker of an in-place test logged: its ``steps_<pid>.jsonl``, line by line."""
    found = {}
    for path in out.glob("steps_*.jsonl"):
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        found[int(path.stem.split("_")[1])] = [json.loads(ln) for ln in lines]
    return found


def parent(pid: int) -> int:
    """The parent pid of ``pid`` (a worker's agent)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
