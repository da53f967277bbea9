"""RankSampler: which (RANK, round) pairs live processes of a job hold, from /proc every 10 ms.

Why from /proc and not from the launcher: S4 is about processes, not about what an agent
believes; a worker its agent cannot fence (the agent frozen, killed) still shows here. Used by
tests/test_fencing.py and the chaos trials (tests/chaos/).

``running_only``: a stopped process (state T, SIGSTOP of a whole node) executes nothing and
holds nothing it can use; the chaos trials freeze whole node trees, so they count only
processes that can run. test_fencing freezes the agent alone and counts every live worker.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class RankSampler:
    """Every 10 ms: which (RANK, round) pairs are held by live processes of this job."""

    def __init__(self, job_tag: str, running_only: bool = False) -> None:
        self.needle = f"ETCDRUN_TEST_JOB={job_tag}".encode()
        self.dead_states = ("Z", "X", "T", "t") if running_only else ("Z", "X")
        self.samples = 0
        self.seen: set[tuple[str, str]] = set()  # every (RANK, round) ever held
        self.overlaps: list[str] = []
        self.overlap_times: list[float] = []  # time.time() of each line in ``overlaps``
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
        for _pid, env in self._processes():
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
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.needle not in raw.split(b"\0") or state in self.dead_states:
                continue
            env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            if b"RANK" in env and b"ETCDRUN_ROUND" in env:
                yield int(name), env
