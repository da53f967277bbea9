"""A worker's progress beat: the one shared page the hang watchdog reads (design.md §4b).

Why a memory-mapped file rather than the control channel or etcd: progress is reported at every
step (``state.commit()``, ``etcdrun.elastic.progress(step)``), so it must cost nothing anyone can
measure next to a step: one ``pack_into`` on a mapped page, no system call, no lock, no etcd
write. The agent reads the page a few times a second; a beat it misses is only late, never lost,
because the page holds the latest count and time rather than a queue.

Layout, little-endian: beats (u64, how many progress calls so far), step (i64, the last step the
worker named, -1 when none), at (u64, ``time.monotonic_ns()`` of the last beat: one clock for
every process of the host). A torn read between the worker's write and the agent's read shows an
old and a new field side by side; the reader takes two reads that agree.

The worker finds the page in ``ETCDRUN_PROGRESS_FILE``, set by its agent only when the watchdog
is on (``--hang-timeout``) or its backend shares the node's pace (the etcd one: agent/hang/
pace.py reads the page too); without it ``progress`` does nothing.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time
from typing import NamedTuple

VAR = "ETCDRUN_PROGRESS_FILE"
LAYOUT = struct.Struct("<QqQ")
FINISHED = -2  # the step a worker's page holds once its interpreter exits: never judged again


class Beat(NamedTuple):
    beats: int
    step: int  # -1: the worker named none
    at_ns: int  # time.monotonic_ns() of the last beat


def create(path: str) -> None:
    """The agent makes a zeroed page for one worker before starting it (no beat yet)."""
    with open(path, "wb") as fp:
        fp.write(bytes(LAYOUT.size))


def read(path: str) -> Beat | None:
    """The worker's last beat; None when it never beat or its page is gone."""
    try:
        with open(path, "rb") as fp:
            for _ in range(3):
                first = fp.read(LAYOUT.size)
                fp.seek(0)
                second = fp.read(LAYOUT.size)
                fp.seek(0)
                if first == second:
                    break
    except OSError:
        return None
    if len(second) != LAYOUT.size:
        return None
    beat = Beat(*LAYOUT.unpack(second))
    return beat if beat.beats > 0 else None


class Writer:
    """The worker's end: ``beat(step)`` writes the page in place."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        self._beats = 0
        atexit.register(self.finish)  # after the first beat, the end of a job is not a hang

    def finish(self) -> None:
        """The worker is on its way out (atexit, which runs before the exit hook's settle)."""
        self._beats += 1
        LAYOUT.pack_into(self._map, 0, self._beats, FINISHED, time.monotonic_ns())

    @classmethod
    def from_env(cls) -> Writer | None:
        path = os.environ.get(VAR)
        if not path:
            return None
        try:
            return cls(path)
        except (OSError, ValueError):  # the page is gone (the agent cleaned up): no watchdog
            return None

    def beat(self, step: int | None) -> None:
        self._beats += 1
        LAYOUT.pack_into(
            self._map, 0, self._beats, -1 if step is None else step, time.monotonic_ns()
        )


__all__ = ["FINISHED", "LAYOUT", "VAR", "Beat", "Writer", "create", "read"]
