"""The process harness of the benchmark: one forkserver, free ports, the processes of a seed.

Why a forkserver: importing torch takes 6-8 s on a loaded 2-core machine; the forkserver
imports the rank's code (bench/reform/worker.py, torch with it) once, and every rank is forked
from it, so that what is measured starts after the import. The driver itself never imports
torch while cases run.

How a launch is watched: each rank logs JSON events (``{"ev": ..., "t": time.monotonic()}``,
one clock for the machine) to ``<who>.log`` in the launch's directory; the driver reads them
back, and tells ranks what happened through notice files (``notice_<name>``, written then
renamed, so a rank never reads half a time). A rank silent for ``HANG_S`` past an event of its
round is hung: ``Launch.stop(dump=True)`` continues and SIGUSR1s every live rank (faulthandler
writes its Python stacks to its log), ``Launch.where`` reads the main thread's innermost frame
of our code back, and every process of the launch is killed. Ports come from 10000-32000,
below the kernel's ephemeral range, so that a port handed to a round is not taken by a client.
"""

from __future__ import annotations

import json
import linecache
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HANG_S = 10.0  # a rank silent this long after an event of its round is hung
FIRST_S = 40.0  # the first form of a launch (forks on a loaded machine)
PATHS = ("fresh", "reconf")  # the two ways of re-forming that every case compares
RANK_CODE = str(Path(__file__).parent) + os.sep  # the rank's own frames are in these files


class Run:
    """The forkserver, the ports, and every process started (all killed at the end)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["bench.reform.worker"])
        self.procs: list[Any] = []
        self._port = 10000 + random.randrange(15000)

    def ports(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            self._port = 10000 if self._port >= 32000 else self._port + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", self._port))
                except OSError:
                    continue
            out.append(self._port)
        return out

    def launch(self, name: str) -> Launch:
        d = self.tmp / name
        d.mkdir()
        return Launch(self, d)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


class Launch:
    """The processes of one seed or repetition: started, watched through their logs, killed."""

    def __init__(self, run: Run, d: Path) -> None:
        self.run, self.dir = run, d
        self.procs: dict[str, Any] = {}
        self.began = time.monotonic()

    def start(self, who: str, **spec: Any) -> None:
        from bench.reform import worker  # imports torch: already done in the forkserver

        spec.update(who=who, dir=str(self.dir), log=str(self.dir / f"{who}.log"))
        p = self.run.ctx.Process(target=worker.main, args=(spec,), daemon=False)
        p.start()
        self.run.procs.append(p)
        self.procs[who] = p

    def events(self, who: str) -> list[dict[str, Any]]:
        try:
            text = (self.dir / f"{who}.log").read_text(errors="replace")
        except OSError:
            return []
        out = []
        for ln in text.splitlines():
            if ln.startswith('{"ev"'):
                try:
                    out.append(json.loads(ln))
                except ValueError:
                    pass
        return out

    def first(self, who: str, ev: str, **match: Any) -> dict[str, Any] | None:
        for e in self.events(who):
            if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    def ended(self, who: str) -> bool:
        return any(e["ev"] in ("done", "crash") for e in self.events(who)) or (
            not self.procs[who].is_alive()
        )

    def notice(self, name: str, t: float | None = None) -> float:
        t = time.monotonic() if t is None else t
        tmp = self.dir / f".notice_{name}"
        tmp.write_text(repr(t))
        tmp.rename(self.dir / f"notice_{name}")
        return t

    def wait(self, cond: Callable[[], Any], within: float) -> bool:
        end = time.monotonic() + within
        while not cond():
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def where(self, who: str) -> str:
        """The main thread's innermost frames, from the worker's last SIGUSR1 dump."""
        try:
            text = (self.dir / f"{who}.log").read_text(errors="replace")
        except OSError:
            return "?"
        blocks: list[list[str]] = []
        for ln in text.splitlines():
            if ln.startswith(("Thread 0x", "Current thread 0x")):
                blocks.append([])
            elif blocks and ln.strip().startswith("File "):
                blocks[-1].append(ln.strip())
        found = "?"
        for frames in blocks:
            if not any(f.endswith(" in main") and f'{RANK_CODE}worker.py"' in f for f in frames):
                continue
            inner = frames[0].rsplit(" in ", 1)[-1]
            mine = next(f for f in frames if RANK_CODE in f)
            try:
                src = linecache.getline(mine.split('"')[1], int(mine.split("line ")[1].split()[0]))
            except (IndexError, ValueError):
                src = ""
            found = f"{mine.rsplit(' in ', 1)[-1]}: `{src.strip()}` (innermost: {inner})"
        return found

    def stop(self, dump: bool = False) -> None:
        if dump:
            for p in self.procs.values():
                if p.is_alive():
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
