"""PacePublisher: this node's step and pace, shared through the backend's progress port at
most once per ``PERIOD`` (design.md §4d).

What it measures, per round, from what the agent already has: each local worker's progress
page (agent/worker/beat.py: its beats and last step) and its CPU time (/proc/<pid>/stat, by the
pid the agent started; no worker code beyond ``progress()``). Over the window since the last
write, a worker's *rate* is its beats per CPU-second and its *step rate* its beats per wall
second; the node publishes its slowest worker's (the lowest rate), with the lowest step. Why
CPU time: in synchronous training every rank steps at the same wall rate, since the fast ones
wait in ``all_reduce`` for the slow one; on CPU a rank that waits sleeps, so its CPU time per
step is its own work. On a GPU the slowness is in the device, which this does not see.

When it writes: the round's first pace once ``MIN_WINDOW`` of beats was seen, then at most one
per ``PERIOD``, and none while no local worker beat (idle, between rounds, a script that never
calls ``progress``). A new round, or an in-place regroup, starts the window over.

Threads: one of its own (``etcdrun-pace``), reading every ``TICK``; borrows the worker group
and the port, owns the thread and its window.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from etcdrun.agent.hang import stacks
from etcdrun.agent.worker import beat
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import PaceReading, ProgressPort

log = logging.getLogger("etcdrun.agent")

PERIOD = 5.0  # at most one write per node per PERIOD
TICK = 1.0  # how often the pages and /proc are read: cheap, local
MIN_WINDOW = 2.0  # the round's first pace needs this much window (its first beats excluded)


class Sample(NamedTuple):
    beats: int
    step: int  # the worker's last step; its beat count when it names none
    cpu: float  # seconds
    at: float  # monotonic seconds


def measure(number: int, old: dict[int, Sample], new: dict[int, Sample]) -> PaceReading | None:
    """The node's pace between two samples of its workers (pure); None when no worker moved.
    A worker that used no measurable CPU (less than a clock tick) counts one tick.
    """
    moved = [(old[r], s) for r, s in new.items() if r in old and s.beats > old[r].beats]
    if not moved:
        return None
    tick = 1.0 / stacks.TICKS_PER_SECOND
    rates = [(s.beats - o.beats) / max(s.cpu - o.cpu, tick) for o, s in moved]
    walls = [(s.beats - o.beats) / max(s.at - o.at, 1e-3) for o, s in moved]
    slowest = min(range(len(moved)), key=rates.__getitem__)
    step = min(s.step for s in new.values())
    return PaceReading(number, step, walls[slowest], rates[slowest])


class PacePublisher:
    """``start()`` → ``close()``."""

    def __init__(self, group: WorkerGroup, port: ProgressPort) -> None:
        self._group = group
        self._port = port
        self._stop = threading.Event()
        self._round: int | None = None
        self._base: dict[int, Sample] = {}
        self._published: float | None = None  # monotonic: the round's last write
        self._thread = threading.Thread(target=self._run, name="etcdrun-pace", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self._tick(time.monotonic())
            except Exception:  # noqa: BLE001 - a report must never end the agent
                log.exception("the pace publisher failed; it goes on")

    def _samples(self, now: float) -> dict[int, Sample]:
        files = self._group.log_paths
        out: dict[int, Sample] = {}
        for w in self._group.workers:
            got = files.get(w.global_rank)
            b = beat.read(got.progress) if got is not None and w.pid else None
            cpu = stacks.cpu_seconds(w.pid) if b is not None and b.step != beat.FINISHED else None
            if b is not None and cpu is not None:
                out[w.global_rank] = Sample(b.beats, b.step if b.step >= 0 else b.beats, cpu, now)
        return out

    def _tick(self, now: float) -> None:
        info = self._group.info
        if info is None or not self._group.workers:
            return
        if info.round != self._round:  # a new round (or a regroup): a new window
            self._round, self._base, self._published = info.round, {}, None
        new = self._samples(now)
        for rank, s in new.items():
            self._base.setdefault(rank, s)
        if not new:
            return
        since = self._published
        if since is None:
            due = now - min(self._base[r].at for r in new) >= MIN_WINDOW
        else:
            due = now - since >= PERIOD
        if not due:
            return
        reading = measure(info.round, self._base, new)
        if reading is None:
            return  # nothing moved: nothing to say
        self._port.publish(reading)
        self._published, self._base = now, new


__all__ = ["MIN_WINDOW", "PERIOD", "TICK", "PacePublisher", "Sample", "measure"]
