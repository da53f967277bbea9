"""One trial's world for bench/scenarios.py: a ``Job`` (fresh etcd if needed, agents, a clean-up
that kills every tagged process), the bounded waits, and how a trial ends (``Trial``, ``Fail``).

Why apart from the scenarios: this is the harness every scenario shares; scenarios.py says what
each scenario does and measures.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench.launchers import Launcher
from bench.procs import Agent, sweep

POLL = 0.05
FORM_TIMEOUT = 90.0  # a first round, beyond the launcher's own last-call wait
SETTLE = 1.0  # collectives running before we disturb the job
QUIET_WINDOW = 0.5  # wait_quiet: sampling window, s
QUIET_CPU = 0.1  # wait_quiet: CPUs the waiting agents may use together and count as idle


@dataclass
class Ctx:
    bindir: Path  # the bench venv's bin/ (etcdrun, torchrun, python)
    out: Path  # logs of this run
    tag: str  # environment tag of every process we start
    recover_timeout: float = 90.0
    idle_window: float = 10.0
    verbose: bool = False


@dataclass
class Trial:
    value: float | None
    outcome: str = "ok"  # ok | never | died | error
    note: str = ""
    spawn: float | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "value": self.value,
            "outcome": self.outcome,
            "note": self.note,
            "spawn": self.spawn,
            **({"extra": self.extra} if self.extra else {}),
        }


class Fail(Exception):
    """A trial that ended without its figure (the outcome says how)."""

    def __init__(self, outcome: str, note: str, after: float | None = None) -> None:
        super().__init__(note)
        self.outcome = outcome
        self.note = note
        self.after = after  # "died": seconds from the action to the exits being seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One trial's world: etcd (if needed), agents, and a guaranteed clean-up."""

    def __init__(self, ctx: Ctx, launcher: Launcher, nnodes: str, mode: str, name: str) -> None:
        self.ctx, self.launcher, self.nnodes, self.mode = ctx, launcher, nnodes, mode
        self.dir = ctx.out / name
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.agents: list[Agent] = []
        self.etcd = None
        self.endpoint = ""
        self.port = 0

    def __enter__(self) -> Job:
        if self.launcher.needs_etcd:
            from etcdrun.rendezvous.localetcd import LocalEtcd

            extra = ["--enable-v2"] if self.launcher.backend == "etcd-v2" else []
            self.etcd = LocalEtcd(extra_args=extra).start()
            self.endpoint = self.etcd.endpoints
        else:
            self.port = _free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
        return self

    def agent(self) -> Agent:
        import os

        i = len(self.agents)
        cmd = self.launcher.command(
            self.ctx.bindir, self.nnodes, self.endpoint, self.run_id, self.mode
        )
        env = {
            **os.environ,
            **self.launcher.env,
            "ETCDRUN_BENCH_TAG": self.ctx.tag,
            "PYTHONUNBUFFERED": "1",
        }
        a = Agent(f"node{i}", cmd, env, self.dir / f"node{i}.log")
        self.agents.append(a)
        return a

    def start(self, n: int) -> float:
        """Start ``n`` agents back to back; return the last one's start time."""
        new = [self.agent() for _ in range(n)]
        return max(a.start() for a in new)

    def metrics_url(self) -> str:
        assert self.etcd is not None
        return f"http://{self.etcd.endpoint_list[0]}/metrics"

    def __exit__(self, *exc: object) -> None:
        try:
            for a in self.agents:
                a.stop()
            left = sweep(self.ctx.tag)
            if left and self.ctx.verbose:
                print(f"    (swept {len(left)} leftover process(es))")
        finally:
            if self.etcd is not None:
                self.etcd.stop()


def wait_world(
    agents: list[Agent], t0: float, world: int, timeout: float, what: str
) -> tuple[float, float | None]:
    """(newest READY, newest START of those same workers) with ``world``, after ``t0``."""
    deadline = time.monotonic() + timeout
    while True:
        ready = [a.ready_since(t0, world) for a in agents]
        if all(ready):
            starts = [a.start_of(r) for a, r in zip(agents, ready, strict=True) if r]
            spawn = max(s.t for s in starts) if len(starts) == len(agents) and all(starts) else None
            return max(r.t for r in ready if r), spawn
        dead = [a for a, r in zip(agents, ready, strict=True) if not r and not a.alive()]
        if dead and len(dead) == len([r for r in ready if not r]):
            codes = sorted({a.proc.returncode for a in dead if a.proc})
            gone = time.time() - t0
            if len(dead) == len(agents):
                raise Fail(
                    "died", f"every agent exited (codes {codes}) within {gone:.1f}s of {what}", gone
                )
            raise Fail(
                "died",
                f"{len(dead)} of {len(agents)} agents exited (codes {codes}) "
                f"within {gone:.1f}s of {what}; "
                f"{dead[0].name}: {dead[0].tail(3)}",
                gone,
            )
        if time.monotonic() > deadline:
            missing = [a.name for a, r in zip(agents, ready, strict=True) if not r]
            raise Fail(
                "never",
                f"timeout {timeout:.0f}s: no worker with WORLD_SIZE={world} "
                f"on {', '.join(missing)}; {_last_starts(agents)}",
            )
        time.sleep(POLL)


def _last_starts(agents: list[Agent]) -> str:
    """Each node's newest worker (WORLD_SIZE, restart count): why a world never formed."""
    parts = []
    for a in agents:
        ln = a.last_start()
        parts.append(
            f"{a.name} " + ("no worker" if ln is None else f"world {ln.world} restart {ln.restart}")
        )
    return "newest workers: " + ", ".join(parts)


def _trial(fn):
    """Run one trial function; a Fail becomes a Trial with its outcome."""

    def run(*args, **kw) -> Trial:
        try:
            return fn(*args, **kw)
        except Fail as f:
            return Trial(
                None,
                f.outcome,
                f.note,
                extra={} if f.after is None else {"after": round(f.after, 2)},
            )

    return run


def wait_quiet(agents: list[Agent], timeout: float = 60.0) -> float:
    """Wait until ``agents`` (with anything below them) have started up and sit waiting.

    Why CPU and not a log line: it means the same for every launcher. "Waiting" is the whole
    group using under ``QUIET_CPU`` of a CPU over ``QUIET_WINDOW``; returns how long it took.
    """

    def sample() -> dict[int, float]:
        return {p: c for a in agents for p, c in a.tree_cpu_s().items()}

    t0 = time.monotonic()
    last = sample()
    while True:
        time.sleep(QUIET_WINDOW)
        dead = [a.name for a in agents if not a.alive()]
        if dead:
            raise Fail("died", f"{', '.join(dead)} exited while the others were starting up")
        now = sample()
        # per pid: a child that exited in between must not make the group look idle
        used = sum(c - last.get(p, 0.0) for p, c in now.items())
        if used < QUIET_CPU * QUIET_WINDOW:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise Fail("error", f"agents still busy (CPU) {timeout:.0f}s after their start")
        last = now
