"""Standby workers, the agent's side: one warm interpreter per local slot, handed the round.

Why: after a round freezes, what users wait for is *ready* (``init_process_group`` returned
everywhere), and most of that was the workers' own start: Python, ``sys.path``, ``import torch``
(seconds, the same under torchrun). That part does not depend on the round, so a standby does it
ahead of need — at agent start, and again for a slot right after its standby became a worker — and
at the freeze the agent sends the round's argv and environment (with the worker's stdout/stderr fds)
over a socket instead of spawning (agent/standby/boot.py: how it stays invisible to the script). A
node's first join into a running job waits until its standbys are warm (``wait_warm``;
docs/design.md §4 says why: a newcomer that joins cold stalls the running job for its imports).

With standbys, the survivors of a kill -9 and a scale-up's new world are ready a few times sooner
than with spawned workers (a scale-up gained nothing until a newcomer waited for its own standbys'
imports before joining), and a waiting standby costs the memory of its imports and no CPU: it blocks
reading its socket (bench/results/standby_bench.md, 'What a waiting standby costs'). Hence on by
default (``auto``); ``--prewarm none`` is the spawn path unchanged.

What keeps it as safe as a spawned worker:
- The standbys are started by one thread of their own that lives until ``close()``: the
  parent-death signal (which fires when the *thread* that forked a child ends) holds for them and
  for the workers they become, as the reactor thread does for spawned ones.
- Each carries the node's tag (``ETCDRUN_NODE_TAG``): the warden's sweep finds them when the
  agent dies; the agent's own sweep after a stop passes over the waiting ones (``waiting``); a
  standby that became a worker is a worker (its pidfd reaches the warden as a spawned one's).
- Its own session and process group, default signal handlers, the agent's stdin: what a
  spawned worker gets. A standby found dead at a freeze (swept, crashed) is replaced, and the
  round spawns as before.
- No CUDA: a standby imports what it is told and nothing touches a device, so
  ``CUDA_VISIBLE_DEVICES``/``LOCAL_RANK`` (set at the hand-over) still decide the GPU. An opt-in
  per-slot CUDA warm-up would go here: the slot (local rank) of each standby is known when it
  starts (docs/design.md §4).

Only Python worker commands take a standby: a ``.py`` script, ``-m`` module, and callables and
``--run-path`` under start method spawn. ``--no-python``, other executables and fork/forkserver
callables spawn as before, and so does everything with ``--prewarm none``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import marshal
import os
import queue
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from etcdrun.agent.api import EntrypointKind, WorkerSpec
from etcdrun.agent.fencing import guard as fencing
from etcdrun.agent.standby.boot import (  # the boot's words (it is stdlib only: importable)
    ROOM_VAR,
    WARM,
)
from etcdrun.agent.worker import credentials as worker_secrets
from etcdrun.agent.worker import spawn as _spawn

log = logging.getLogger("etcdrun.agent")

BOOT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
# Runs the boot file in a namespace of its own (what it binds in __main__, the boot drops).
LOADER = (
    "with open(__import__('sys').argv[1],'rb') as f:c=f.read()\n"
    "exec(compile(c,f.name,'exec'),{'__name__':'etcdrun_standby'})"
)
ROOM = 32768  # bytes of environment block the hand-over may rewrite (/proc/<pid>/environ)
NONE, AUTO = "none", "auto"
START_WAIT = 5.0  # seconds a hand-over waits for its slot's standby to be forked (usually far less)
# Seconds the first join waits for the standbys' imports. Why wait at all: a node that joins
# while its standbys still import makes the whole job wait for them, its peers' workers stopped
# (scale-up: the running job stalls for the newcomer's ``import torch``) and their refills
# importing beside the newcomer's. Bounded: a hung import must not keep a node out forever
# (its workers would hang in the same import when spawned).
WARM_WAIT = 60.0


def warmup_turns() -> int:
    """How many refills of this user may import at once on this host (_standby_boot's
    ``_take_turn``): half its CPUs, at least one, so that speculative imports leave the other
    half to the round that is starting (the last node's own import, which refills importing
    beside it slow several times over: bench/results/figures.md, 'Design notes' figures', §4).
    """
    return max(1, len(os.sched_getaffinity(0)) // 2)


def python_command(spec: WorkerSpec, kind: EntrypointKind) -> list[str] | None:
    """The command a standby of this spec prepares for: ``[python, -u, -c|-m|script, ...]``,
    or None when its workers cannot start from one (module docstring).
    """
    if kind in (EntrypointKind.CALLABLE, EntrypointKind.RUN_PATH):
        return (
            [sys.executable, "-u", "-c", "", "0", "", ""] if spec.start_method == "spawn" else None
        )
    command = _spawn.command_for(spec, kind)  # the CLI's: [python, -u, (-m) script, ...]
    if command[:2] != [sys.executable, "-u"] or len(command) < 3:
        return None
    if command[2] == "-m":
        return command if len(command) > 3 else None
    script = command[2]
    return command if script.endswith(".py") and os.path.isfile(script) else None


def check_importable(names: str, path0: str) -> None:
    """Bad input is one line: a ``--prewarm`` module the workers' Python cannot find."""
    import importlib.machinery

    for name in names.split(","):
        top = name.partition(".")[0]
        if (
            name != AUTO
            and importlib.machinery.PathFinder.find_spec(top, [path0, *sys.path]) is None
        ):
            if top not in sys.builtin_module_names:
                raise ValueError(f"--prewarm: no module named {top!r} for {sys.executable}")


class _Standby:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.settled = False  # it said warm, or it ended: wait_warm no longer waits for it
        self.warm = False  # it said warm (its imports are done)


class Standbys:
    """The pool: ``start()`` at agent start, ``take()`` per worker at a freeze, ``close()``."""

    def __init__(self, spec: WorkerSpec, kind: EntrypointKind, extra_env: Mapping[str, str]):
        self._spec = spec
        command = python_command(spec, kind)
        assert command is not None, "for_agent() checks"
        self._command = command
        self._env = self._start_env(extra_env)
        self._lock = threading.Condition()
        self._slots: dict[int, _Standby] = {}
        self._pending: set[int] = set()  # queued for the thread, not started yet
        self._todo: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="etcdrun-standby")

    def _start_env(self, extra_env: Mapping[str, str]) -> dict[str, str]:
        """The agent's environment with the node's tag (``extra_env``), the round-independent
        variables a worker gets that libraries read at load (OMP_NUM_THREADS: libgomp reads it
        once), and the room for the rewrite.
        """
        env = worker_secrets.scrubbed({**os.environ, **extra_env})  # no etcd credentials
        if "OMP_NUM_THREADS" not in os.environ and self._spec.local_world_size > 1:
            env["OMP_NUM_THREADS"] = "1"
        env.update(_spawn.exit_hook_env(env))
        env[ROOM_VAR] = "." * ROOM
        return env

    def start(self) -> None:
        if self._thread.ident is not None:  # started early (launcher), then by the agent
            return
        self._thread.start()
        for slot in range(self._spec.local_world_size):
            self._queue(slot, 0)  # a node's first standbys are its first round's: no turn

    def _queue(self, slot: int, turns: int) -> None:
        with self._lock:
            if not self._closed:
                self._pending.add(slot)
                self._todo.put((slot, turns))

    def _loop(self) -> None:
        # The thread that forks the standbys: their parent-death signal is tied to it.
        while (item := self._todo.get()) is not None:
            slot, turns = item
            try:
                self._start_one(slot, turns)
            except Exception as e:  # noqa: BLE001 - the thread must live: the round spawns
                log.warning("could not start a standby worker (%s): the round spawns", e)
            with self._lock:
                self._pending.discard(slot)
                self._lock.notify_all()

    def _start_one(self, slot: int, turns: int) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        prewarm = self._spec.prewarm
        argv = [sys.executable, "-u", "-c", LOADER, BOOT_FILE, str(os.getpid())]
        argv += [str(theirs.fileno()), str(turns), prewarm, *self._command[2:]]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, self._lock:
            if self._closed:
                mine.close()
                theirs.close()
                return
            try:
                proc = subprocess.Popen(
                    argv,
                    env=self._env,
                    stdout=out,
                    stderr=err,
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                    close_fds=True,
                )
            finally:
                theirs.close()
            self._slots[slot] = _Standby(proc, mine)

    def taker(self, slot: int) -> Callable[..., subprocess.Popen[bytes] | None]:
        """``take`` for one slot: what ``_spawn.launch`` calls before it spawns."""
        return functools.partial(self.take, slot)

    def take(
        self, slot: int, command: list[str], env: Mapping[str, str], stdout: int, stderr: int
    ) -> subprocess.Popen[bytes] | None:
        """Hand ``command`` (what a fresh worker would exec) to the slot's standby; its process,
        now the worker; None when there is no live standby for it (then spawn).
        """
        if command[:2] != [sys.executable, "-u"] or command[2:3] != self._command[2:3]:
            return None
        with self._lock:  # a start already queued costs less than a spawn: wait for it
            self._lock.wait_for(lambda: slot not in self._pending, START_WAIT)
            standby = self._slots.pop(slot, None)
        # The next round's, started right away, its imports in turn (warmup_turns()). A fixed
        # delay first measured no better for a scale-up and made a kill soon after a round
        # slower: its standbys were still importing (bench/results/standby_bench.md).
        self._queue(slot, warmup_turns())
        if standby is None:
            return None
        final = dict(env)  # as the exit hook leaves it in a fresh worker (sitecustomize.py)
        user = final.pop(_spawn.USER_PYTHONPATH, "")
        final.pop("PYTHONPATH", None)
        if user:
            final["PYTHONPATH"] = user
        body = marshal.dumps({"argv": list(command), "env": final, "exec_env": dict(env)})
        try:
            if standby.proc.poll() is not None:
                raise OSError("the standby is gone")
            socket.send_fds(standby.sock, [len(body).to_bytes(8, "big")], [stdout, stderr])
            standby.sock.sendall(body)
        except OSError:
            _end(standby)
            return None
        standby.sock.close()
        return standby.proc

    def wait_warm(self, timeout: float) -> tuple[int, int]:
        """Until every slot's standby has done its imports (or ended, or ``timeout`` passed);
        (warm, slots). Only the agent's thread calls it, before its first round: no hand-over
        reads or closes these sockets meanwhile.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.wait_for(lambda: not self._pending, START_WAIT)
            slots = list(self._slots.values())  # a slot without one (its start failed): cold
        cold = [s for s in slots if not s.settled]
        while cold and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([s.sock for s in cold], [], [], left)
            for standby in [s for s in cold if s.sock in readable]:
                try:
                    said = standby.sock.recv(1)
                except OSError:
                    said = b""  # it ended (swept, crashed): the round spawns for its slot
                standby.settled, standby.warm = True, said == WARM
                cold.remove(standby)
        return sum(s.warm for s in slots), self._spec.local_world_size

    @contextlib.contextmanager
    def waiting(self) -> Iterator[set[int]]:
        """The pids of the waiting standbys, none started meanwhile (the agent's sweep skips
        them).
        """
        with self._lock:
            yield {s.proc.pid for s in self._slots.values()}

    def close(self) -> None:
        """Kill every waiting standby and stop the thread (the workers are the group's)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            standbys, self._slots = list(self._slots.values()), {}
        for standby in standbys:
            _end(standby)
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()


def _end(standby: _Standby) -> None:
    standby.sock.close()
    with contextlib.suppress(ProcessLookupError):
        standby.proc.kill()
    standby.proc.wait()


@contextlib.contextmanager
def waiting(pool: Standbys | None) -> Iterator[set[int]]:
    """``pool.waiting()``, or nothing to skip without a pool."""
    if pool is None:
        yield set()
        return
    with pool.waiting() as pids:
        yield pids


def start(standbys: Standbys | None) -> None:
    """Start the slots' standbys (none with --prewarm none)."""
    if standbys is not None:
        standbys.start()


def wait_warm(
    standbys: Standbys | None, job_running: Callable[[], bool], timeout: float = WARM_WAIT
) -> None:
    """Before the first join into a running job (``job_running()``, asked only with standbys):
    the standbys' imports done (``Standbys.wait_warm``), in one line. A job that is forming
    or re-forming does not wait: its round waits for the same imports after the freeze, and
    the refills, started at that hand-over, are warm sooner for the change that may follow.
    """
    if standbys is None or not job_running():
        return
    t0 = time.monotonic()
    warm, slots = standbys.wait_warm(timeout)
    took = time.monotonic() - t0
    if warm < slots:
        log.warning(
            "standby workers: %d of %d warm after %.1f s; joining anyway", warm, slots, took
        )
    elif took >= 0.05:
        log.info("standby workers warm after %.2f s: joining", took)


def close(standbys: Standbys | None) -> None:
    """End every standby still waiting."""
    if standbys is not None:
        standbys.close()


class Early(NamedTuple):
    """A node's standbys started before its rendezvous handler (``early``), and the tag they
    carry, for the agent that takes them over.
    """

    tag: str
    pool: Standbys | None


def early(spec: WorkerSpec) -> Early:
    """Start the standbys first thing: what the agent does before its first join (gRPC and protobuf
    imports, the handler, the warden) then runs beside their ``import torch``, not before it, on the
    critical path of a node's first round (bench/results/figures.md, 'Design notes' figures', §4,
    the early fork). The CLI calls it before it imports the launcher.
    """
    tag = fencing.new_tag()
    pool = for_agent(spec, fencing.node_env(tag))
    start(pool)
    return Early(tag, pool)


def for_agent(spec: WorkerSpec, extra_env: Mapping[str, str]) -> Standbys | None:
    """The agent's pool, or None when ``--prewarm none`` or the entrypoint cannot use one."""
    if spec.prewarm == NONE or spec.entrypoint is None:
        return None
    kind = spec.resolved_kind()
    command = python_command(spec, kind)
    if command is None:
        log.info("standby workers: not for this entrypoint (%s): workers spawn", kind.value)
        return None
    if spec.prewarm != AUTO:
        script = command[2] not in ("-c", "-m")
        path0 = os.path.dirname(os.path.realpath(command[2])) if script else os.getcwd()
        check_importable(spec.prewarm, path0)
    return Standbys(spec, kind, extra_env)
