"""Where one agent's worker logs go: the log dir it was given, or a folder it makes itself.

Why an object: a folder the agent made (no ``--log-dir``) is the agent's to remove once nothing
in it is worth keeping — else every run leaves a ``/tmp/etcdrun_logs_*`` behind, and they pile
up — and the agent must say where the logs are when it keeps them.

A log dir that cannot be written, or that fills up, is bad input like any other (issue 11): one line
each, and nothing else lost. Left to Python, a read-only ``--log-dir`` is an OSError traceback; a
full one prints a ``--- Logging error ---`` traceback per agent line, a ``--redirects`` worker that
dies of it is only ``exit code 1``, and ``--tee`` drops its file copy silently. So a read-only dir
is refused before the rendezvous is joined; a full disk while running is said once per file kind
(agent.log, events.jsonl, the teed copies), the console keeps everything, and a redirected worker's
failure names the full disk.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)
FULL_BELOW = 64 * 1024  # bytes free under which a worker's failed write is put down to the disk


class LogDirError(ValueError):
    """The log dir cannot be written: a mistake in the command line, said before anything
    starts (a ValueError: ``etcdrun`` exits 2 with one line).
    """


def describe(path: str, exc: OSError) -> str:
    """``<path> is full (ENOSPC)``, or ``<path>: Read-only file system (EROFS)``."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if exc.errno == errno.ENOSPC:
        return f"{path} is full ({name})"
    return f"{path}: {exc.strerror or exc} ({name})"


def check_writable(path: str, what: str = "--log-dir") -> None:
    """Make ``path`` and write a file in it, or raise LogDirError naming the path and errno."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".etcdrun-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LogDirError(f"{what} {describe(path, e)}: cannot write there") from None


def disk_full(path: str) -> bool:
    """True when the file system holding ``path`` has (almost) no room left."""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use reserved blocks
    return free * st.f_frsize < FULL_BELOW


def full_disk_line(files_dir: str) -> str | None:
    """For a redirected worker that failed: a line saying its files' disk is full, else None
    (its own traceback went to that full disk, so nothing else would say it).
    """
    if not disk_full(os.path.join(files_dir, "stdout.log")):
        return None
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return f"etcdrun: {describe(files_dir, full)}: the worker's output could not be written there"


class Once:
    """Says a write failure once per kind of file (the first path that hit it, and its
    errno), then stays quiet: a full disk must not print a line per worker line.
    """

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, path: str, exc: OSError, then: str) -> None:
        with self._lock:
            if kind in self._said:
                return
            self._said.add(kind)
        log.warning("%s: %s", describe(path, exc), then)

    def reset(self) -> None:
        """A new launch says its own (several launches in one process: tests, notebooks)."""
        with self._lock:
            self._said.clear()


NOTICES = Once()  # one per agent process: agent.log, events and the teed copies share a disk


def copy_stopped(path: str, exc: OSError) -> None:
    """A teed stream's file copy (or its filtered log) could not be written: the relay drops
    that copy and goes on with the console; said once.
    """
    NOTICES("copies", path, exc, "the file copy of teed output stopped; the console still gets it")


class AgentLogFile(logging.FileHandler):
    """agent.log: a failed write is said once on the console, not a traceback per line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        import sys

        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        NOTICES(
            "agent.log",
            self.baseFilename,
            exc,
            "agent.log misses lines from now on; the console has them all",
        )

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last buffered lines found no room either: already said once
            self.stream = None  # type: ignore[assignment]


class LogDir:
    def __init__(self, given: str | None) -> None:
        self._path = given
        self._made = False  # made by root(): ours to remove

    def root(self) -> str:
        """The folder; made on first use when none was given."""
        if self._path is None:
            try:
                self._path = tempfile.mkdtemp(prefix="etcdrun_logs_")
            except OSError as e:
                where = f"the temporary folder {tempfile.gettempdir()}"
                raise LogDirError(f"{describe(where, e)}: give --log-dir") from None
            self._made = True
        return self._path

    def settle(self, succeeded: bool, to_files: bool) -> str | None:
        """After the last attempt: a folder we made goes when the run succeeded, no worker
        output was asked to go to files and nothing in it explains a fault, or when no worker
        ever started (it holds the events alone: the agent's error line says it all); otherwise
        it stays, and its path is returned. What explains a fault: a worker's error file, a
        hang's stack dumps. A run can succeed after faults (a restart, a hang handled in place),
        and removing their record with the rest left the user nothing to look at.
        """
        if not self._made or self._path is None:
            return None
        try:
            events_only = set(os.listdir(self._path)) <= {"events.jsonl"}
        except OSError:
            events_only = True
        quiet = succeeded and not to_files and not evidence(self._path)
        if quiet or events_only:
            shutil.rmtree(self._path, ignore_errors=True)
            return None
        return self._path


EVIDENCE = ("error.json", "stacks.log")  # a worker's error file; a hang's stack dumps


def evidence(root: str) -> bool:
    """Whether a worker file under ``root`` records a fault (``EVIDENCE``, not empty)."""
    for where, _dirs, names in os.walk(root):
        found = [os.path.join(where, name) for name in names if name in EVIDENCE]
        if any(_size(path) > 0 for path in found):
            return True
    return False


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # gone meanwhile: nothing in it
        return 0


@dataclass(frozen=True)
class WorkerFiles:
    """A worker's files: ``<log_dir>/<run_id>/attempt_<n>/<global rank>/``.

    stdout.log/stderr.log exist when the stream is redirected or teed (or filtered off the
    console); error.json when the worker raised under ``@record``; return.pkl for a callable;
    progress (its beat page) and stacks.log (its stack dumps) under ``--hang-timeout``.
    """

    dir: str
    stdout: str
    stderr: str
    error_file: str
    return_file: str
    progress: str
    stacks: str

    @classmethod
    def under(cls, attempt_dir: str, global_rank: int) -> WorkerFiles:
        d = os.path.join(attempt_dir, str(global_rank))
        return cls(
            dir=d,
            stdout=os.path.join(d, "stdout.log"),
            stderr=os.path.join(d, "stderr.log"),
            error_file=os.path.join(d, "error.json"),
            return_file=os.path.join(d, "return.pkl"),
            progress=os.path.join(d, "progress"),
            stacks=os.path.join(d, "stacks.log"),
        )

    def prepare(self) -> None:
        """Create the directory; drop a previous run's error/return/progress files (they
        would lie).
        """
        os.makedirs(self.dir, exist_ok=True)
        for stale in (self.error_file, self.return_file, self.progress):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass


__all__ = [
    "full_disk_line",
    "NOTICES",
    "AgentLogFile",
    "LogDir",
    "LogDirError",
    "WorkerFiles",
    "check_writable",
    "copy_stopped",
    "describe",
    "disk_full",
]
