"""A worker's Python stack, asked for from outside and read back (design.md §4b).

Why faulthandler on a signal (armed in every worker by agent/worker/_site/sitecustomize.py):
its handler is C code that walks the interpreter's frames without the GIL, so it answers from a
worker blocked anywhere: in gloo's ``all_reduce``, in ``os.read`` on a pipe, in a C extension.
py-spy would need ptrace rights; a Python-level handler runs only when the main thread returns
to the interpreter, which a hung worker by definition does not.

The file is the worker's own ``stacks.log`` beside its other logs; each dump is appended after
the line naming the process and its main thread, so ``parse`` finds the main thread's frames of
the last dump. A stopped process (SIGSTOP, a frozen node) cannot run the handler: ``dump`` says
so instead of waiting.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

VAR = "ETCDRUN_STACKS"  # "<signal>:<file>": the same name as sitecustomize's STACKS_VAR
SIGNAL = signal.SIGRTMIN + 5  # real-time, so no library's SIGUSR1/2 meaning is taken
_HEADER = re.compile(r"^etcdrun stacks of pid \d+, main thread (0x[0-9a-f]+)$", re.M)
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
# A frame in these files is a wait for peers, not the place where a step is stuck. autograd's
# engine is one: DDP's gradient all-reduce runs inside backward, in C++, so a rank that waits for
# a peer there shows only autograd's frames (``_engine_run_backward``), never torch.distributed's.
_COLLECTIVE = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")


def env(path: str) -> dict[str, str]:
    """The variable that arms the dump in a worker started with it."""
    return {VAR: f"{int(SIGNAL)}:{path}"}


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} in {self.func}"


@dataclass(frozen=True)
class Stack:
    """The main thread's frames, innermost first; ``text`` the whole dump (every thread)."""

    frames: tuple[Frame, ...]
    text: str

    @property
    def waiting(self) -> bool:
        """Inside torch.distributed: waiting for its peers, not stuck on its own."""
        return any(any(c in f.file for c in _COLLECTIVE) for f in self.frames)

    def where(self) -> str:
        """The frame to show: the innermost one outside torch.distributed and the standard
        library, with the innermost of all when they differ.
        """
        if not self.frames:
            return "no Python frame"
        inner = self.frames[0]
        own = next((f for f in self.frames if not _library(f.file)), inner)
        return own.short() if own == inner else f"{own.short()} (in {inner.short()})"


def _library(path: str) -> bool:
    return "/site-packages/" in path or "/lib/python3" in path or path.startswith("<")


def parse(text: str) -> Stack | None:
    """The main thread's stack in the last dump of ``text``; None when there is none."""
    headers = list(_HEADER.finditer(text))
    if not headers:
        return None
    main = headers[-1].group(1)
    dump = text[headers[-1].end() :]
    frames: list[Frame] = []
    inside = False
    for line in dump.splitlines():
        m = _THREAD.match(line)
        if m:
            if inside:
                break  # the main thread's section ended; a later dump would have a header
            inside = m.group(1) == main
            continue
        f = _FRAME.match(line) if inside else None
        if f:
            frames.append(Frame(f.group(1), int(f.group(2)), f.group(3)))
    if not frames and not inside:
        return None
    return Stack(tuple(frames), dump.strip("\n"))


TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")  # /proc's CPU times are in these


def _stat(pid: int) -> list[bytes]:
    """/proc/<pid>/stat's fields after "(comm)" (the state letter first); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            stat = fp.read()
    except OSError:
        return []
    return stat[stat.rindex(b")") + 2 :].split()


def _state(pid: int) -> bytes:
    """The process's state letter; b"" when gone."""
    fields = _stat(pid)
    return fields[0] if fields else b""


def cpu_seconds(pid: int) -> float | None:
    """The process's CPU time so far (utime + stime, every thread; not its children), for the
    pace (agent/hang/pace.py); None when gone.
    """
    fields = _stat(pid)
    if len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): it cannot answer a dump."""
    return _state(pid) in (b"T", b"t")


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its SigCgt mask): a process without
    one (exiting: faulthandler is gone at finalization; or started without the hook) would be
    killed by the dump's signal, not answer it.
    """
    try:
        with open(f"/proc/{pid}/status") as fp:
            mask = next((ln.split()[1] for ln in fp if ln.startswith("SigCgt:")), "0")
    except (OSError, IndexError):
        return False
    return bool(int(mask, 16) >> (signum - 1) & 1)


def alive(pid: int) -> bool:
    """Running or asleep: not exited, not a zombie awaiting its reaper."""
    return _state(pid) not in (b"", b"Z")


def dump(pids: dict[int, tuple[int, str]], timeout: float) -> dict[int, Stack | str]:
    """Ask every worker (rank → (pid, stacks file)) at once; each rank's stack, or why none.

    The handler writes the whole dump before the process runs on, so the file stops growing
    within milliseconds; the wait ends when every file has a complete new dump, or at
    ``timeout``.
    """
    sizes: dict[int, int] = {}
    out: dict[int, Stack | str] = {}
    for rank, (pid, path) in pids.items():
        if stopped(pid):
            out[rank] = f"pid {pid} is stopped (SIGSTOP or a debugger): no stack"
            continue
        if not catches(pid, SIGNAL):
            out[rank] = f"pid {pid} does not answer stack dumps (exiting, or run without the hook)"
            continue
        sizes[rank] = _size(path)
        try:
            os.kill(pid, SIGNAL)
        except OSError as e:
            out[rank] = f"pid {pid} gone ({e.strerror})"
            sizes.pop(rank)
    deadline = time.monotonic() + timeout
    while sizes:
        for rank in list(sizes):
            stack = _new_dump(pids[rank][1], sizes[rank])
            if stack is not None:
                out[rank] = stack
                del sizes[rank]
        if not sizes or time.monotonic() >= deadline:
            break
        time.sleep(0.02)  # a C signal handler's write: milliseconds, nothing to wait on
    for rank in sizes:
        out[rank] = f"pid {pids[rank][0]} wrote no stack within {timeout:g} s"
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _new_dump(path: str, since: int) -> Stack | None:
    """The dump appended after byte ``since``, once it is complete (two reads agree)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            text = fp.read()
    except OSError:
        return None
    if len(text.encode()) <= since:
        return None
    time.sleep(0.005)
    if _size(path) != len(text.encode()):
        return None  # still being written
    # Each dump is a header only at start-up; later ones follow without one: give parse the
    # header (the file's first line) and the new part.
    first = text.split("\n", 1)[0] + "\n"
    return parse(first + text.encode()[since:].decode("utf-8", "replace"))


__all__ = ["SIGNAL", "VAR", "Frame", "Stack", "alive", "catches", "dump", "env", "parse", "stopped"]
