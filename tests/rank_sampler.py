"""Who holds which RANK, seen from /proc: the check of S4 from outside the agents (issue 11).

The rule, explicit: a process is *live* unless it is a zombie or dead (state Z or X). A stopped
process (state T: SIGSTOP, paused by fencing) counts as live — it holds its rank and could be
resumed, so a paused worker of round n beside a running worker of round n+1 with the same RANK is
a violation too. Pausing is therefore never a way around the check: the paused tree must be
killed before anyone else can be given its ranks.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from agent_helpers import clean_env


def tagged_env() -> tuple[str, dict[str, str]]:
    """A fresh job tag and the agents' environment carrying it (the sampler finds it)."""
    tag = uuid.uuid4().hex[:8]
    return tag, clean_env(ETCDRUN_TEST_JOB=tag)


class RankSampler:
    """Every 10 ms: which (RANK, round) pairs are held by live processes of this job."""

    def __init__(self, job_tag: str) -> None:
        self.needle = f"ETCDRUN_TEST_JOB={job_tag}".encode()
        self.samples = 0
        self.seen: set[tuple[str, str]] = set()  # every (RANK, round) ever held
        self.overlaps: list[str] = []
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
            held: dict[str, set[str]] = {}
            for pid, state, env in self._processes():
                if state == "T":
                    self.paused.add(pid)
                rank, rnd = env[b"RANK"].decode(), env[b"ETCDRUN_ROUND"].decode()
                held.setdefault(rank, set()).add(rnd)
                self.seen.add((rank, rnd))
            self.samples += 1
            for rank, rounds in held.items():
                if len(rounds) > 1:
                    self.overlaps.append(f"t={time.monotonic():.2f} RANK {rank}: rounds {rounds}")

    def _processes(self):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                raw = Path(f"/proc/{name}/environ").read_bytes()
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.needle not in raw.split(b"\0") or state in ("Z", "X"):
                continue
            env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            if b"RANK" in env and b"ETCDRUN_ROUND" in env:
                yield int(name), state, env


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
