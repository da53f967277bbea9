"""Who holds which RANK, seen from /proc every 10 ms: the check of S4 from outside the agents.

Why from /proc and not from the launcher: S4 is about processes, not about what an agent
believes; a worker its agent cannot fence (the agent frozen, killed) still shows here. Used by
tests/agent/test_fencing.py, test_fault_stops.py, test_lease_doubt.py and the chaos trials.

The rule, explicit: a process is *live* unless it is a zombie or dead (state Z or X), or exiting
(PF_EXITING in its /proc flags): a SIGKILLed process runs none of its own code again, but the
kernel takes a while to free its memory and shows it running meanwhile (a 3 GB process: 0.26 s
in state R here; a worker with torch imported, as every standby worker is, ~0.1-0.2 s). A stopped
process (state T: SIGSTOP, paused by fencing) counts as live by default — it holds its rank and
could be resumed, so a paused worker of round n beside a running worker of round n+1 with the
same RANK is a violation too, and pausing is never a way around the check: the paused tree must
be killed before anyone else can be given its ranks. ``running_only`` counts only processes that
can run: the chaos trials freeze whole node trees (agent, warden and workers), where nothing on
the node can act until the thaw (the thaw window is counted apart; docs/design.md S4).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from agent_helpers import clean_env
from etcd_helpers import pid_alive, proc_state

# s after the thaw of a whole node frozen past its TTL (SIGCONT of its tree, docker unpause): its
# warden's moment to kill the thawed workers (docs/design.md S4; measured < 0.1 s), during which
# they may run beside the new round's. Counted apart from the violations, never hidden.
RESUME_WINDOW = 0.25


def tagged_env() -> tuple[str, dict[str, str]]:
    """A fresh job tag and the agents' environment carrying it (the sampler finds it)."""
    tag = uuid.uuid4().hex[:8]
    return tag, clean_env(ETCDRUN_TEST_JOB=tag)


class RankSampler:
    """Every 10 ms: which (RANK, round) pairs are held by live processes of this job."""

    def __init__(self, job_tag: str, running_only: bool = False) -> None:
        self.needle = f"ETCDRUN_TEST_JOB={job_tag}".encode()
        self.dead_states = ("Z", "X", "T", "t") if running_only else ("Z", "X")
        self.samples = 0
        self.seen: set[tuple[str, str]] = set()  # every (RANK, round) ever held
        self.overlaps: list[str] = []
        self.overlap_times: list[float] = []  # time.time() of each line in ``overlaps``
        self.paused: set[int] = set()  # pids ever seen stopped (state T)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-sampler")

    def __enter__(self) -> RankSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def sample(self) -> None:
        """One look at /proc (the thread's tick; tests call it directly)."""
        held: dict[str, set[str]] = {}
        # One pass over /proc is no snapshot: a worker read early (lower pid) may be gone before a
        # later one starts. Kept are those still alive after the pass — alive at their own read
        # and after it, so all alive together at the last read.
        found = list(self._processes())
        for pid, state, env in (f for f in found if alive(f[0])):
            if state in ("T", "t"):
                self.paused.add(pid)
                if state in self.dead_states:
                    continue
            rank, rnd = env[b"RANK"].decode(), env[b"ETCDRUN_ROUND"].decode()
            held.setdefault(rank, set()).add(rnd)
            self.seen.add((rank, rnd))
        self.samples += 1
        for rank, rounds in held.items():
            if len(rounds) > 1:
                now = time.time()
                self.overlaps.append(f"t={now:.2f} RANK {rank}: rounds {sorted(rounds)}")
                self.overlap_times.append(now)

    def _processes(self):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                raw = Path(f"/proc/{name}/environ").read_bytes()
            except OSError:
                continue
            state = proc_state(int(name))
            if self.needle not in raw.split(b"\0") or state in ("Z", "X"):
                continue
            env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            if b"RANK" in env and b"ETCDRUN_ROUND" in env:
                yield int(name), state, env


def alive(pid: int) -> bool:
    return pid_alive(pid)
