"""torch's FileTimer, served by the agent: a worker whose timer runs out is killed.

``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the agent's environment makes the agent serve the FIFO
that torch's ``FileTimerClient`` writes to (``TORCHELASTIC_TIMER_FILE``, given to the
workers; a path of the agent's choosing when unset), as torchrun's agent does. A worker that
runs ``torch.distributed.elastic.timer.configure(FileTimerClient(path))`` and
``with expires(after=5): ...`` is killed with the client's signal when the five seconds pass
without a release.

Why speak the protocol here rather than run torch's ``FileTimerServer``: the agent never imports
torch. The protocol is small: one JSON object per line, written in one ``write`` of at most
``PIPE_BUF`` bytes (so lines from many writers never interleave) — ``version``, ``pid``,
``scope_id``, ``expiration_time`` (wall clock; negative: release), ``signal``.
tests/agent/test_file_timer.py runs torch's own client against it.

Two differences from torch's server, on purpose: it kills only processes that are this agent's
workers (a pid in the FIFO is any local process's word), and it does not kill the agent itself
afterwards (torch's does, with the same signal): the worker's death is a failure like any other,
charged to the job's restart budget, and its error file names the timer's scope, so every node
reports it.

Why open the FIFO read-write: a reader alone sees end-of-file whenever the last writer closes
(each client opens, writes a line and closes) and would spin or block; with its own write end
open, the descriptor is readable exactly when a line waits, and ``select`` sleeps until then or
the next expiry.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from etcdrun.agent.worker.error_file import write_error_json
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.events import EventLog

log = logging.getLogger("etcdrun.agent")

ENABLE_VAR = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_VAR = "TORCHELASTIC_TIMER_FILE"


@dataclass(frozen=True)
class Expired:
    """A timer that ran out: the worker's pid, its scope, the signal it asked to be killed with."""

    pid: int
    scope: str
    signum: int
    expiration: float


def enabled(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ENABLE_VAR) == "1"


class FileTimerServer:
    """``start(is_ours, on_expired)`` makes the FIFO and its thread; ``close()`` ends both and
    removes the FIFO. ``is_ours(pid)`` (any thread) says whether a pid is one of the agent's
    workers; ``on_expired(Expired)`` runs on the server's thread just *before* the kill, so that
    the worker's failure already names the scope when its exit is seen. The path is known from
    the start (``env``): the workers' environment is built before the server runs.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.path.join(tempfile.gettempdir(), f"etcdrun_timer_{uuid.uuid4()}")
        self._is_ours: Callable[[int], bool] = lambda pid: False
        self._on_expired: Callable[[Expired], None] = lambda e: None
        self._timers: dict[tuple[int, str], tuple[float, int]] = {}
        self._fd: int | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        return {FILE_VAR: self.path}

    def start(self, is_ours: Callable[[int], bool], on_expired: Callable[[Expired], None]) -> None:
        self._is_ours, self._on_expired = is_ours, on_expired
        if os.path.exists(self.path):
            os.remove(self.path)
        os.mkfifo(self.path, 0o600)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="etcdrun-file-timer", daemon=True)
        self._thread.start()
        log.info("serving torch's FileTimer at %s (%s=1)", self.path, ENABLE_VAR)

    def close(self) -> None:
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd is not None:
                os.close(fd)
        self._fd = None
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    # ---- the server's thread -------------------------------------------------------------------
    def _run(self) -> None:
        assert self._fd is not None
        buf = b""
        while True:
            wait = self._until_next()
            ready, _, _ = select.select([self._fd, self._stop_r], [], [], wait)
            if self._stop_r in ready:
                return
            if self._fd in ready:
                try:
                    buf += os.read(self._fd, 65536)
                except BlockingIOError:
                    pass
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._take(line)
            self._expire(time.time())

    def _until_next(self) -> float | None:
        if not self._timers:
            return None
        return max(0.0, min(exp for exp, _ in self._timers.values()) - time.time())

    def _take(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            req = json.loads(line)
            key = (int(req["pid"]), str(req["scope_id"]))
            expiration, signum = float(req["expiration_time"]), int(req.get("signal", 0))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("FileTimer: ignoring a request that is not torch's (%s): %r", e, line)
            return
        if expiration < 0:
            self._timers.pop(key, None)
        else:
            self._timers[key] = (expiration, signum)

    def _expire(self, now: float) -> None:
        due = [(key, v) for key, v in self._timers.items() if v[0] <= now]
        for (pid, scope), (expiration, signum) in due:
            self._timers.pop((pid, scope), None)
            if not self._is_ours(pid):
                log.warning(
                    "FileTimer: scope %r of pid %d expired; not a worker of ours", scope, pid
                )
                continue
            if signum <= 0:
                log.warning("FileTimer: scope %r of pid %d expired; no signal asked", scope, pid)
                continue
            self._on_expired(Expired(pid, scope, signum, expiration))
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue
            self._timers = {k: v for k, v in self._timers.items() if k[0] != pid}


class WorkerTimers:
    """What the agent does with its workers' timers: which pids are its workers, and, before a
    kill, the worker's error file (torch's format) naming the scope, a log line and an event.
    Borrows the agent's worker group and event log.
    """

    def __init__(self, group: WorkerGroup, events: EventLog) -> None:
        self._group = group
        self._events = events

    def is_worker(self, pid: int) -> bool:
        return pid in self._group.pids().values()

    def expired(self, e: Expired) -> None:
        worker = next((w for w in self._group.workers if w.pid == e.pid), None)
        rank = worker.global_rank if worker is not None else None
        files = self._group.log_paths.get(rank) if rank is not None else None
        how = signal_name(e.signum)
        log.warning(
            "rank %s (pid %d): torch FileTimer scope %r expired; killing it with %s",
            "?" if rank is None else rank,
            e.pid,
            e.scope,
            how,
        )
        if files is not None and not os.path.exists(files.error_file):
            message = f"FileTimer scope {e.scope!r} expired: the worker was killed with {how}"
            write_error_json(files.error_file, message, "", time.time())
        info = self._group.info
        self._events.emit(
            "worker_timer_expired",
            round=info.round if info is not None else None,
            pid=e.pid,
            rank=rank,
            scope=e.scope,
            signal=how,
        )


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


__all__ = [
    "ENABLE_VAR",
    "FILE_VAR",
    "Expired",
    "FileTimerServer",
    "WorkerTimers",
    "enabled",
    "signal_name",
]
