"""The reactor: one thread per attempt that forks the workers, relays their pipes, sees them exit.

Why one thread and a selector: torchrun tails log files with a thread per stream and polls the
processes; with 8 workers that is 16+ threads and up to a monitor interval of latency. Here the
workers' pipes, their pidfds (readable when the process exits: no polling) and a wake-up pipe sit
in one selector. The same thread also forks the workers, so that PR_SET_PDEATHSIG (which fires
when the *thread* that forked a child dies) fires exactly when the agent dies, and not when
whichever thread happened to call ``start()`` ends.

Console lines get their stream's prefix (torchrun's: see _spawn.line_prefix); log files get the
raw bytes; a teed line holding one of ``--duplicate-*-filters`` also goes, prefixed, to the
attempt's filtered log. Output is relayed as bytes end to end, so binary output and partial lines
cannot crash the relay; a partial line goes out when its newline arrives, when it reaches 64 KiB,
or at end of stream.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import selectors
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

__all__ = ["Reactor", "STDOUT", "STDERR"]

STDOUT, STDERR = 1, 2
READ_SIZE = 65536
MAX_PENDING = 65536
TAIL_LINES = 20


@dataclass(eq=False)
class _Stream:
    fd: int
    prefix: bytes
    console: int | None  # STDOUT/STDERR: where complete lines go; None: not on the console
    file: BinaryIO | None  # tee target: raw bytes
    tail: collections.deque[str] | None
    pending: bytearray = field(default_factory=bytearray)
    duplicate: tuple[BinaryIO, list[bytes]] | None = None  # (file, filters): matching lines


@dataclass(eq=False)
class _ExitWatch:
    fd: int | None  # readable when the process exited; None: poll every interval
    owns_fd: bool
    check: Callable[[], bool]  # True once the exit has been handled


class _Wake:
    pass


class Reactor:
    """A selector thread for one attempt's workers. Use: ``start()``, ``call(spawn)``, ``close()``.

    ``console_out``/``console_err`` are binary sinks; None means the agent's current
    ``sys.stdout``/``sys.stderr`` (looked up at each write, so a redirected stdout is honoured).
    Every fd handed to ``add_stream``/``watch_exit`` belongs to the reactor from then on.
    """

    def __init__(
        self,
        *,
        console_out: BinaryIO | None = None,
        console_err: BinaryIO | None = None,
        poll_interval: float = 0.1,
        name: str = "etcdrun-workers",
        on_file_error: Callable[[str, OSError], None] | None = None,
    ) -> None:
        self._console = {STDOUT: console_out, STDERR: console_err}
        self._on_file_error = on_file_error  # (path, error): a tee or filtered copy stopped
        self._interval = max(poll_interval, 0.01)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _Wake())
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._polled: list[_ExitWatch] = []
        self._streams: set[_Stream] = set()
        self._close_deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- caller side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the reactor thread and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        box: list[Any] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        self._wake()
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the worker relay thread is not running")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[1]

    def close(self, drain_timeout: float = 1.0) -> None:
        """Relay what is left (until every pipe ends or ``drain_timeout``), close all, join."""
        if self._thread.is_alive():
            self._close_deadline = time.monotonic() + drain_timeout
            self._wake()
            self._thread.join()
        else:
            self._close_all()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def fds(self) -> list[int]:
        """Every fd the reactor holds (a forked worker closes them)."""
        return [key.fd for key in self._sel.get_map().values()] + [self._wake_w]

    # ---- reactor-thread side (also safe inside ``call``) ---------------------------------------

    def add_stream(
        self,
        fd: int,
        *,
        prefix: bytes,
        console: int | None,
        file: BinaryIO | None,
        tail: collections.deque[str] | None = None,
        duplicate: tuple[BinaryIO, list[bytes]] | None = None,
    ) -> None:
        os.set_blocking(fd, False)
        stream = _Stream(fd, prefix, console, file, tail, duplicate=duplicate)
        self._streams.add(stream)
        self._sel.register(fd, selectors.EVENT_READ, stream)

    def watch_exit(self, fd: int | None, check: Callable[[], bool], *, owns_fd: bool) -> None:
        watch = _ExitWatch(fd, owns_fd, check)
        if fd is None:
            self._polled.append(watch)
        else:
            self._sel.register(fd, selectors.EVENT_READ, watch)

    def drain(self, fds: list[int]) -> None:
        """Relay what the given pipes hold now, without waiting for their end."""
        for stream in [s for s in self._streams if s.fd in fds]:
            while stream in self._streams and self._read(stream):
                pass

    @staticmethod
    def new_tail() -> collections.deque[str]:
        return collections.deque(maxlen=TAIL_LINES)

    # ---- internals ----------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already wakes the thread

    def _run(self) -> None:
        try:
            while True:
                deadline = self._close_deadline
                if deadline is not None and (not self._streams or time.monotonic() >= deadline):
                    break
                timeout = self._interval if self._polled else None
                if deadline is not None:
                    remaining = max(deadline - time.monotonic(), 0.0)
                    timeout = remaining if timeout is None else min(timeout, remaining)
                for key, _ in self._sel.select(timeout):
                    self._dispatch(key)
                for watch in list(self._polled):
                    if watch.check():
                        self._polled.remove(watch)
        finally:
            self._run_calls()  # never leave a caller of call() waiting
            self._close_all()

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        data = key.data
        if isinstance(data, _Wake):
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            self._run_calls()
        elif isinstance(data, _Stream):
            if data in self._streams:
                self._read(data)
        elif isinstance(data, _ExitWatch):
            if data.check():
                self._unregister(data.fd)
                if data.owns_fd and data.fd is not None:
                    os.close(data.fd)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, box, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                box[:] = [None, fn()]
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box[:] = [e]
            done.set()

    def _read(self, stream: _Stream) -> bool:
        """Relay one chunk; False when nothing more is available now (or the pipe ended)."""
        try:
            data = os.read(stream.fd, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._end_stream(stream)
            return False
        if stream.file is not None:
            self._write_file(stream, data)
        if stream.console is not None or stream.tail is not None:
            stream.pending += data
            self._emit_lines(stream, final=False)
        return True

    def _emit_lines(self, stream: _Stream, final: bool) -> None:
        pending = stream.pending
        cut = pending.rfind(b"\n") + 1
        if final or len(pending) - cut >= MAX_PENDING:
            cut = len(pending)
        if cut == 0:
            return
        chunk = bytes(pending[:cut])
        del pending[:cut]
        lines = chunk.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if stream.tail is not None:
            stream.tail.extend(ln.decode("utf-8", "replace").rstrip("\r") for ln in lines)
        if stream.console is not None:
            out = b"".join(stream.prefix + ln + b"\n" for ln in lines)
            self._write_console(stream.console, out)
        if stream.duplicate is not None:
            self._write_duplicate(stream, lines)

    def _write_duplicate(self, stream: _Stream, lines: list[bytes]) -> None:
        sink, filters = stream.duplicate  # type: ignore[misc]
        hits = [ln for ln in lines if any(f in ln for f in filters)]
        if not hits:
            return
        try:
            sink.write(b"".join(stream.prefix + ln + b"\n" for ln in hits))
        except (OSError, ValueError) as e:  # disk full or closed: keep relaying the rest
            stream.duplicate = None
            self._file_error(sink, e)
            with contextlib.suppress(OSError):
                sink.close()

    def _write_console(self, which: int, data: bytes) -> None:
        sink = self._console[which]
        try:
            if sink is not None:
                sink.write(data)
                sink.flush()
                return
            text = sys.stdout if which == STDOUT else sys.stderr
            if text is None:
                return
            buf = getattr(text, "buffer", None)
            text.flush()
            if buf is not None:
                buf.write(data)
                buf.flush()
            else:
                text.write(data.decode("utf-8", "replace"))
                text.flush()
        except (OSError, ValueError):
            pass  # a closed or broken console must not stop the relay (workers would block)

    def _write_file(self, stream: _Stream, data: bytes) -> None:
        try:
            stream.file.write(data)  # type: ignore[union-attr]
        except (OSError, ValueError) as e:
            sink, stream.file = stream.file, None  # disk full: keep relaying to the console
            self._file_error(sink, e)
            with contextlib.suppress(OSError):
                sink.close()  # type: ignore[union-attr]

    def _file_error(self, sink: BinaryIO, e: Exception) -> None:
        if isinstance(e, OSError) and self._on_file_error is not None:
            self._on_file_error(str(getattr(sink, "name", "?")), e)

    def _end_stream(self, stream: _Stream) -> None:
        if stream.pending:
            self._emit_lines(stream, final=True)
        self._streams.discard(stream)
        self._unregister(stream.fd)
        os.close(stream.fd)
        for sink in (stream.file, stream.duplicate[0] if stream.duplicate else None):
            if sink is not None:
                try:
                    sink.close()
                except OSError:
                    pass

    def _unregister(self, fd: int | None) -> None:
        if fd is None:
            return
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in list(self._streams):
            self._end_stream(stream)
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, _ExitWatch) and key.data.owns_fd:
                os.close(key.fd)
        self._polled.clear()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
