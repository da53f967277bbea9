"""The error file a worker leaves: torch's format, read (both shapes) and written (atomically).

Why torch's format: a user script decorated with torch's own ``@record`` must be read by the same
code as one decorated with ours, so ``write_error_file`` writes exactly torch's JSON
(``{"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": ..., "timestamp":
"<seconds>"}}}``) plus one extra key torch's reader ignores, ``extraInfo.timestamp_ms``: with
whole seconds two failures of one collective are usually indistinguishable. Why apart from
errors.py: this is the file format; errors.py is what the agent makes of failures.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["ErrorFileContent", "read_error_file", "write_error_file", "write_error_json"]


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
