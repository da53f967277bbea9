"""Where one agent's worker logs go: the log dir it was given, or a folder it makes itself.

Why an object: a folder the agent made (no ``--log-dir``) is the agent's to remove once nothing
in it is worth keeping — every run used to leave a ``/tmp/etcdrun_logs_*`` behind (about 1,200
on one machine) — and the agent must say where the logs are when it keeps them.
"""

from __future__ import annotations

import os
import shutil
import tempfile


class LogDir:
    def __init__(self, given: str | None) -> None:
        self._path = given
        self._made = False  # made by root(): ours to remove

    def root(self) -> str:
        """The folder; made on first use when none was given."""
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="etcdrun_logs_")
            self._made = True
        return self._path

    def settle(self, succeeded: bool, to_files: bool) -> str | None:
        """After the last attempt: a folder we made goes when the run succeeded and no worker
        output was asked to go to files, or when no worker ever started (it holds the events
        alone: the agent's error line says it all); otherwise it stays, and its path is
        returned."""
        if not self._made or self._path is None:
            return None
        try:
            events_only = set(os.listdir(self._path)) <= {"events.jsonl"}
        except OSError:
            events_only = True
        if (succeeded and not to_files) or events_only:
            shutil.rmtree(self._path, ignore_errors=True)
            return None
        return self._path


__all__ = ["LogDir"]
