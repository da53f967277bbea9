"""Worker failures: what the agent makes of a worker that did not exit 0, and the report it raises.

The error file itself (torch's format, read and written) is error_file.py's; its names are
re-exported here, where torch users look for them next to ``record``.

Why a better ``ChildFailedError`` than torch's: torch picks the smallest timestamp among all
failures, including the workers its own agent killed, and prints them in one list. Here the
root cause is the first *real* failure (by the time of its exception, else the time its exit
was seen), and the workers the agent stopped are listed apart as not being failures.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from etcdrun.agent.worker.error_file import (
    ErrorFileContent,
    _write_json,
    read_error_file,
    write_error_file,
    write_error_json,
)

__all__ = [
    "ChildFailedError",
    "ErrorFileContent",
    "ProcessFailure",
    "read_error_file",
    "real_failures",
    "record",
    "root_cause",
    "write_error_file",
    "write_error_json",
]

T = TypeVar("T")
_TRACEBACK_INDENT = "    "


def _signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; ``signal 77`` for numbers the platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class ProcessFailure:
    """A worker that did not exit 0, with what its error file says.

    ``exitcode`` is negative when a signal killed it (``signal`` then names it). ``timestamp``
    orders failures: the error file's time when it has one, else when the agent saw the exit.
    ``stopped_by_agent`` means the agent signalled this worker (``stop_signal``) while it was
    running: its death is a consequence, not a cause.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str | None = None
    global_rank: int = -1
    host: str = ""
    stopped_by_agent: bool = False
    stop_signal: str | None = None
    exit_time: float | None = None
    stderr_tail: tuple[str, ...] = ()
    message: str = field(init=False)
    traceback: str = field(init=False)
    timestamp: float = field(init=False)
    error_file_data: Any = field(init=False)
    error_file_problem: str | None = field(init=False)
    error_time: float | None = field(init=False)
    error_time_resolution: float = field(init=False)
    signal: str | None = field(init=False)

    def __post_init__(self) -> None:
        content = read_error_file(self.error_file) if self.error_file else None
        self.signal = _signal_name(-self.exitcode) if self.exitcode < 0 else None
        self.error_file_data = content.data if content else None
        self.error_file_problem = content.problem if content else None
        self.traceback = content.traceback if content else ""
        self.error_time = ts = content.timestamp if content else None
        self.error_time_resolution = content.resolution if content else 1.0
        if ts is None:
            ts = self.exit_time if self.exit_time is not None else time.time()
        self.timestamp = ts
        if content and content.message:
            self.message = content.message
        elif self.signal:
            self.message = f"Signal {-self.exitcode} ({self.signal}) received by PID {self.pid}"
        else:
            self.message = f"exited with code {self.exitcode}"

    @property
    def has_error_file(self) -> bool:
        """True when the worker left a readable error file (it raised under ``@record``)."""
        return self.error_file_data is not None

    def failed_before(self, when: float) -> bool:
        """True when the error file proves the exception was raised before ``when`` (wall time).

        Why the resolution: torch's files hold whole seconds, so an exception raised 0.3 s after
        the agent's SIGTERM may carry a smaller number than the signal's time.
        """
        if self.error_time is None:
            return False
        return self.error_time + self.error_time_resolution <= when

    def signal_name(self) -> str:
        """torch's accessor: the signal's name, or ``<N/A>`` for a plain exit."""
        return self.signal or "<N/A>"

    def exit_description(self) -> str:
        if self.signal:
            return f"killed by {self.signal} (exit code {self.exitcode})"
        return f"exit code {self.exitcode}"

    def timestamp_isoformat(self) -> str:
        return datetime.fromtimestamp(self.timestamp).isoformat(sep=" ", timespec="milliseconds")


def _sort_key(item: tuple[int, ProcessFailure]) -> tuple[float, int]:
    rank, failure = item
    return (failure.timestamp, rank)


def real_failures(failures: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """The failures of the workers themselves: not those the agent stopped."""
    return {r: f for r, f in failures.items() if not f.stopped_by_agent}


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the root cause: the earliest real failure, by its timestamp
    (rank breaks ties); the earliest of all when the agent stopped every worker.

    Why one function: the agent reports this failure to the rendezvous (what every node then
    prints) and ``ChildFailedError`` prints it locally; the two must name the same worker.
    """
    if not failures:
        raise ValueError("no failure to find the root cause of")
    return min((real_failures(failures) or failures).items(), key=_sort_key)


class ChildFailedError(Exception):
    """Raised by the agent when its workers failed for good; the message is the report.

    ``name`` says what failed (the role or entrypoint); ``failures`` maps global ranks to
    ``ProcessFailure``. Like torch's, so a nested launch under ``@record`` propagates the root
    cause's error file to its own parent.
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        super().__init__(self.format_msg())

    def real_failures(self) -> dict[int, ProcessFailure]:
        return real_failures(self.failures)

    def stopped(self) -> dict[int, ProcessFailure]:
        return {r: f for r, f in self.failures.items() if f.stopped_by_agent}

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause (see ``root_cause``); torch's name for it."""
        return root_cause(self.failures)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        root_rank, root = self.get_first_failure()
        others = sorted(
            ((r, f) for r, f in self.real_failures().items() if r != root_rank), key=_sort_key
        )
        stopped = sorted(
            ((r, f) for r, f in self.stopped().items() if r != root_rank), key=lambda i: i[0]
        )
        border, section = boarder_delim * 72, section_delim * 72
        lines = [border, f"{self.name} FAILED", section]
        title = "Root cause (first failure)"
        if root.stopped_by_agent:
            title = "No worker failed by itself; first worker stopped by the agent"
        lines.append(f"{title}:")
        lines.extend(_format_root(root_rank, root))
        if others:
            lines += [section, "Other failures:"]
            lines.extend(_format_short(r, f) for r, f in others)
        if stopped:
            lines += [section, "Stopped by the agent (not failures):"]
            lines.extend(_format_stopped(r, f) for r, f in stopped)
        lines.append(border)
        return "\n" + "\n".join(lines)


def _who(rank: int, f: ProcessFailure) -> str:
    host = f" on {f.host}" if f.host else ""
    return f"rank {rank} (local rank {f.local_rank}){host}, pid {f.pid}"


def _indent(text: str, prefix: str) -> list[str]:
    return [prefix + line for line in text.rstrip("\n").splitlines()]


def _format_root(rank: int, f: ProcessFailure) -> list[str]:
    lines = [f"  {_who(rank, f)}", f"  exit      : {f.exit_description()}"]
    if f.stopped_by_agent:
        lines.append(f"  stopped   : the agent sent {f.stop_signal}")
    lines.append(f"  time      : {f.timestamp_isoformat()}")
    if f.error_file_problem:
        lines.append(f"  error_file: {f.error_file} (unreadable: {f.error_file_problem})")
    elif f.has_error_file:
        lines.append(f"  error_file: {f.error_file}")
    if f.has_error_file:
        lines.append(f"  error     : {f.message}")
    if f.traceback:
        lines.append("  traceback :")
        lines.extend(_indent(f.traceback, _TRACEBACK_INDENT))
    elif f.stderr_tail:
        lines.append(
            f"  stderr (last {len(f.stderr_tail)} lines; decorate the entrypoint with"
            " @record for a traceback):"
        )
        lines.extend(_TRACEBACK_INDENT + line for line in f.stderr_tail)
    elif not f.has_error_file and not f.stopped_by_agent:
        lines.append("  traceback : none (decorate the entrypoint with @record to get one)")
    return lines


def _format_short(rank: int, f: ProcessFailure) -> str:
    text = f"  {_who(rank, f)}: {f.exit_description()} at {f.timestamp_isoformat()}"
    if f.has_error_file:
        text += f": {f.message}"
    elif f.error_file_problem:
        text += f" (error file {f.error_file} unreadable: {f.error_file_problem})"
    return text


def _format_stopped(rank: int, f: ProcessFailure) -> str:
    return f"  {_who(rank, f)}: the agent sent {f.stop_signal}; {f.exit_description()}"


def _enable_faulthandler() -> None:
    # A segfault in a worker then leaves every thread's Python stack on its stderr.
    try:
        faulthandler.enable(all_threads=True)
    except Exception:  # noqa: BLE001 - stderr may be closed; recording must not fail the worker
        pass


def record(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorate a worker's entrypoint so an uncaught exception lands in its error file.

    The file is ``$TORCHELASTIC_ERROR_FILE`` (set by the agent for each worker); without it the
    exception just propagates. ``SystemExit(0)`` counts as success (a ``run_path`` script that
    calls ``sys.exit(0)``); a ``ChildFailedError`` (a nested launch) passes on its root cause's
    error file, as torch does.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except SystemExit as se:
            if se.code == 0:
                return None
            raise
        except ChildFailedError as e:
            _forward_child_error(e)
            raise
        except Exception as e:
            path = os.environ.get("TORCHELASTIC_ERROR_FILE")
            if path:
                try:
                    write_error_file(path, e, skip_frames=1)
                except OSError:
                    pass  # the traceback still reaches stderr; never mask the real error
            raise

    return wrapper


def _forward_child_error(e: ChildFailedError) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    _, root = e.get_first_failure()
    if not path or root.error_file_data is None:
        return
    data = root.error_file_data
    if isinstance(data.get("message"), dict) and root.exitcode:
        data = {**data, "message": {**data["message"], "errorCode": root.exitcode}}
    try:
        _write_json(path, data)
    except OSError:
        pass
