"""Where an agent's events go: ``<log_dir>/events.jsonl``, and the console when asked.

Why a file of JSON lines beside the logs: every transition of the rendezvous (the handler's
EventLog) and of this node's workers (the agent's) is one line, in the order this node saw
them, readable by ``jq`` or a log shipper without parsing prose. Several agents sharing one
``--log-dir`` (local tests, a shared file system) append to one file: each line is one
``write`` on an ``O_APPEND`` descriptor, so lines never interleave. The schema is
docs/events.md.

``--event-log-handler`` (torchrun's flag and its names): ``null`` (default: the file only) or
``console`` (each line on stderr too). torch's ``dynamic_rendezvous`` is accepted as ``null``.

Without ``--log-dir`` the file is in the agent's temporary log folder, which the agent removes
after a successful run (agent/worker/logdir.py) — events.jsonl with it; a failed run keeps the
folder and the agent names it. Give ``--log-dir`` to keep the events of every run.

Cost: one ``json.dumps`` and one ``write`` per event (bench/results/figures.md); a node sees a few
events per round, none on the hot path of a running job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, TextIO

from etcdrun.agent.worker.logdir import NOTICES

HANDLERS = ("null", "console", "dynamic_rendezvous")
FILE_NAME = "events.jsonl"


def check_handler(name: str) -> str:
    """The handler's name as given, or ValueError naming the ones there are."""
    if name not in HANDLERS:
        raise ValueError(
            f"--event-log-handler {name!r}: use one of {', '.join(HANDLERS[:2])} (events always "
            f"go to <log dir>/{FILE_NAME}; console also prints them on stderr)"
        )
    return name


class EventSink:
    """A subscriber for EventLogs: ``sink(record)`` writes one line. Thread-safe."""

    def __init__(self, path: str | None, handler: str = "null", console: TextIO | None = None):
        check_handler(handler)
        self.path = path
        self._console = (console or sys.stderr) if handler == "console" else None
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(path, flags, 0o644)

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            if self._fd is not None:
                try:
                    os.write(self._fd, line.encode())
                except OSError as e:  # a full disk: said once, and the run goes on
                    NOTICES("events", self.path or "", e, "events go unrecorded from now on")
            if self._console is not None:
                self._console.write(line)
                self._console.flush()

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def read(path: str) -> list[dict[str, Any]]:
    """The events of a file, in order (tests, tools)."""
    with open(path) as fp:
        return [json.loads(line) for line in fp if line.strip()]


__all__ = ["FILE_NAME", "HANDLERS", "EventSink", "check_handler", "read"]
