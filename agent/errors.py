"""Worker failures: the error file a worker leaves, and the report the agent raises.

Why torch's error-file format: a user script decorated with torch's own ``@record`` must be read
by the same code as one decorated with ours, so ``record`` writes exactly torch's JSON
(``{"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": ..., "timestamp":
"<seconds>"}}}``) plus one extra key torch's reader ignores, ``extraInfo.timestamp_ms``: with
whole seconds two failures of one collective are usually indistinguishable.

Why a better ``ChildFailedError`` than torch's: torch picks the smallest timestamp among all
failures, including the workers its own agent killed, and prints them in one list. Here the
root cause is the first *real* failure (by the time of its exception, else the time its exit
was seen), and the workers the agent stopped are listed apart as not being failures.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

__all__ = [
    "ChildFailedError",
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
class ErrorFileContent:
    """What a worker's error file says; ``problem`` is set (and the rest empty) when unreadable."""

    message: str = ""
    traceback: str = ""
    timestamp: float | None = None
    resolution: float = 1.0  # seconds: torch's timestamps are whole seconds, ours have ms
    data: Any = None
    problem: str | None = None


def read_error_file(path: str) -> ErrorFileContent | None:
    """Parse an error file in torch's format (either of its two shapes); None when absent.

    Never raises: a worker killed while writing, or a foreign file, must not take the agent's
    failure report down with it, so a corrupt file comes back with ``problem`` set.
    """
    try:
        with open(path, "rb") as fp:
            raw = fp.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return ErrorFileContent(problem=f"cannot read it: {type(e).__name__}: {e}")
    if not raw.strip():
        return ErrorFileContent(problem="it is empty (the worker died while writing it?)")
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
        return _parse(data)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return ErrorFileContent(problem=f"it is not a valid error file: {type(e).__name__}: {e}")


def _parse(data: Any) -> ErrorFileContent:
    message = data["message"]
    if isinstance(message, str):
        # torch's second shape: {"message": "...", "timestamp": <seconds>}
        ts = data.get("timestamp")
        return ErrorFileContent(
            message=message, timestamp=float(ts) if ts is not None else None, data=data
        )
    if not isinstance(message, dict):
        raise TypeError(f"'message' is a {type(message).__name__}")
    extra = message.get("extraInfo") or {}
    if not isinstance(extra, dict):
        raise TypeError(f"'extraInfo' is a {type(extra).__name__}")
    timestamp: float | None = None
    resolution = 1.0
    if extra.get("timestamp_ms") is not None:
        timestamp, resolution = float(extra["timestamp_ms"]) / 1000.0, 0.001
    elif extra.get("timestamp") is not None:
        timestamp = float(extra["timestamp"])
    return ErrorFileContent(
        message=str(message.get("message", "")),
        traceback=str(extra.get("py_callstack") or ""),
        timestamp=timestamp,
        resolution=resolution,
        data=data,
    )


def write_error_file(path: str, exc: BaseException, skip_frames: int = 0) -> None:
    """Write ``exc`` in torch's format, atomically (a reader never sees half a file).

    ``skip_frames`` drops the outermost frames (``record``'s own wrapper), so the
    traceback starts in the user's code.
    """
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    write_error_json(
        path,
        f"{type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(type(exc), exc, tb)),
        time.time(),
    )


def write_error_json(path: str, message: str, callstack: str, timestamp: float) -> None:
    """An error file in torch's format from its parts, written atomically.

    Why public: the agent writes another node's root cause (what the rendezvous reported) as a
    local error file, so that its report and a nested launch's ``@record`` read it like any
    worker's; one writer keeps the format and the atomic rename in one place.
    """
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(timestamp)),
                "timestamp_ms": str(int(timestamp * 1000)),
            },
        }
    }
    _write_json(path, data)


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fp:
        json.dump(data, fp)
    os.replace(tmp, path)


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
