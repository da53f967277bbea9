"""One started worker's bookkeeping and what its exit means (failure, stderr tail, return value).

Why apart from workers.py: that module is the group's life cycle (start, watch, stop) under one
lock; this is per process, and reads only that process's own files.
"""

from __future__ import annotations

import os
from typing import Any

from etcdrun.agent.api import Worker
from etcdrun.agent.errors import ProcessFailure
from etcdrun.agent.worker import spawn as _spawn
from etcdrun.agent.worker.logdir import WorkerFiles, full_disk_line
from etcdrun.agent.worker.reactor import TAIL_LINES


class WorkerProc:
    """Bookkeeping of one started worker (guarded by the group's lock)."""

    def __init__(self, worker: Worker, files: WorkerFiles, modes: tuple[str, str]) -> None:
        self.worker = worker
        self.files = files
        self.modes = modes
        self.handle: _spawn.Handle | None = None
        self.stream_fds: list[int] = []
        self.stderr_tail: Any = None
        self.reaped = False  # exit status collected: the pid may be reused, never signal it
        self.reaped_code: int | None = None
        self.exitcode: int | None = None  # published once its buffered output was relayed
        self.exit_time: float | None = None
        self.signalled_at: float | None = None
        self.stop_signal: str | None = None
        self.failure: ProcessFailure | None = None
        self.returned: tuple[Any] | None = None  # (value,) once read

    def failure_for(self, code: int, host: str) -> ProcessFailure:
        """Its failure record (built once): a worker the agent signalled while it ran is
        *stopped by the agent*, unless its error file proves it had failed before.
        """
        if self.failure is None:
            assert self.handle is not None
            f = ProcessFailure(
                local_rank=self.worker.local_rank,
                pid=self.handle.pid,
                exitcode=code,
                error_file=self.files.error_file,
                global_rank=self.worker.global_rank,
                host=host,
                exit_time=self.exit_time,
                stderr_tail=self._tail_for(code),
            )
            if self.signalled_at is not None and not f.failed_before(self.signalled_at):
                f.stopped_by_agent, f.stop_signal = True, self.stop_signal
            self.failure = f
        return self.failure

    def _tail_for(self, code: int) -> tuple[str, ...]:
        tail = self.stderr_lines()
        if code > 0 and _spawn.FILE in self.modes:  # the worker may have died writing to it
            full = full_disk_line(self.files.dir)
            if full is not None:
                tail += (full,)
        return tail

    def stderr_lines(self) -> tuple[str, ...]:
        """The last lines of its stderr: relayed ones if it had a pipe, else its log file's."""
        if self.stderr_tail is not None:
            return tuple(self.stderr_tail)
        try:
            with open(self.files.stderr, "rb") as fp:
                fp.seek(0, os.SEEK_END)
                fp.seek(max(fp.tell() - 8192, 0))
                text = fp.read().decode("utf-8", "replace")
        except OSError:
            return ()
        return tuple(line.rstrip("\r") for line in text.splitlines()[-TAIL_LINES:])

    def return_value(self) -> Any:
        """A callable's return value (read once); None for commands, which return nothing."""
        if self.returned is None:
            import pickle

            try:
                with open(self.files.return_file, "rb") as fp:
                    self.returned = (pickle.load(fp),)
            except FileNotFoundError:
                self.returned = (None,)
        return self.returned[0]
