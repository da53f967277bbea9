"""Plain torchrun nodes for the plugin's end-to-end tests: ``python -m torch.distributed.run``
from this interpreter, ``--rdzv-backend etcd-v3``, output to files.

Why a node is killed as a tree: torchrun starts its workers in sessions of their own and does
not make them die with it, so a kill -9 of the agent alone would leave its workers running — a
node that dies takes both. The test process is a child subreaper (conftest), so the killed
agent's workers come to it: ``reap`` collects them, and the leak check sees any left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from agent_helpers import clean_env, wait_for
from etcd_helpers import pid_alive


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc/<pid>/task/*/children)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            new = [k for k in kids if k not in found]
            found += new
            stack += new
    return [p for p in found if pid_alive(p)]


class Node:
    """One torchrun process; stdout and stderr together in one file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.workers: set[int] = set()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
            )

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self, pattern: str) -> list[re.Match[str]]:
        return list(re.finditer(pattern, self.text, re.MULTILINE))

    def kill_tree(self) -> float:
        """kill -9 of the node: the agent frozen first (it spawns nothing more), then the agent
        and its workers at once; returns the time of the kill.
        """
        os.kill(self.proc.pid, signal.SIGSTOP)
        victims = [self.proc.pid, *descendants(self.proc.pid)]
        self.workers.update(victims[1:])
        t = time.monotonic()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        return t

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"torchrun {self.log.name} did not exit within {timeout:g} s:\n{self.text[-4000:]}"
            ) from None


class TorchrunJob:
    """torchrun nodes of one run (``--rdzv-backend etcd-v3``) and a teardown that leaves none."""

    def __init__(self, endpoints: str, root: Path, *, nnodes: str, nproc: int, conf: str) -> None:
        self.endpoints, self.root = endpoints, root
        self.nnodes, self.nproc, self.conf = nnodes, nproc, conf
        self.run_id = "tr-" + uuid.uuid4().hex[:8]
        self.nodes: list[Node] = []

    def start(self, *script: str, max_restarts: int = 3) -> Node:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            self.endpoints,
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            self.conf,
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.1",
            *script,
        ]
        node = Node(argv, self.root / f"node{len(self.nodes)}.log", clean_env(PYTHONUNBUFFERED="1"))
        self.nodes.append(node)
        return node

    def describe(self) -> str:
        return "\n".join(
            f"--- {n.log.name} (exit {n.proc.poll()}):\n{n.text[-2500:]}" for n in self.nodes
        )

    def wait_lines(self, nodes: list[Node], pattern: str, timeout: float) -> float:
        """Wait until every one of ``nodes`` printed a line matching ``pattern``; the time."""
        wait_for(
            lambda: all(n.lines(pattern) for n in nodes), timeout, f"{pattern!r}\n{self.describe()}"
        )
        return time.monotonic()

    def close(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.kill_tree()
            n.proc.wait()
        reap({w for n in self.nodes for w in n.workers})


def reap(pids: set[int], within: float = 5.0) -> None:
    """Collect the killed agents' workers, which came to the test process (a subreaper)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
