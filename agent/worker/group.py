"""The local worker processes of one agent: start them, watch them, stop them, report on them.

The elastic loop drives one ``WorkerGroup`` for its whole life:

    group = WorkerGroup(log_dir)                      # one per agent
    group.start(spec, info)                           # one per round (attempt = info.round)
    result = group.wait(timeout)                      # or poll(); on_exit= wakes the loop
    ...membership change / failure / signal...
    final = group.stop()                              # SIGTERM → grace → SIGKILL; RunResult
    raise ChildFailedError(spec.role, final.failures) # when final.is_failed()

Why the agent must call ``stop()`` even after success: it joins the relay thread and closes the
pipes; before that, the workers' parent-death signal is tied to that thread (see reactor.py).
A worker that was running when the agent signalled it (``stop``/``signal_all``) is reported as
*stopped by the agent*, not as a failure, unless its error file proves it failed earlier.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from etcdrun.agent.api import EntrypointKind, RunResult, Worker, WorkerSpec, WorkerState
from etcdrun.agent.errors import ProcessFailure
from etcdrun.agent.hang import stacks
from etcdrun.agent.worker import beat
from etcdrun.agent.worker import spawn as _spawn
from etcdrun.agent.worker.logdir import NOTICES, LogDir, WorkerFiles, copy_stopped
from etcdrun.agent.worker.proc import WorkerProc
from etcdrun.agent.worker.reactor import Reactor
from etcdrun.rendezvous.api import check_run_id

if TYPE_CHECKING:  # pragma: no cover
    from etcdrun.rendezvous.api import RendezvousInfo


def _progress_page(path: str) -> None:
    """A worker's zeroed progress page (no beat yet), or, on a log dir that cannot take it (full,
    read-only since), one line and a worker without one: its hang watchdog and its pace are
    off (it never beats), and the job goes on. Unguarded, a full disk crashed the agent here
    with a traceback.
    """
    try:
        beat.create(path)
    except OSError as e:
        NOTICES("progress", path, e, "the workers' progress pages are off: no hang watchdog")


def _beats(spec: WorkerSpec, paced: bool) -> bool:
    """Whether workers get a progress page: for the hang watchdog, or for the pace a backend
    shares (agent/hang/pace.py).
    """
    return paced or spec.hang_timeout is not None


def _hang_env(spec: WorkerSpec, files: WorkerFiles, paced: bool) -> dict[str, str]:
    """Where a worker beats (the watchdog, the pace) and dumps its stacks (the watchdog)."""
    env = {beat.VAR: files.progress} if _beats(spec, paced) else {}
    if spec.hang_timeout is not None:
        env.update(stacks.env(files.stacks))
    return env


__all__ = ["WorkerGroup"]

KILL_WAIT = 10.0  # after SIGKILL: only an unkillable (D-state) process takes longer
DRAIN_WAIT = 1.0  # after the workers are gone: output their children may still hold


class WorkerGroup:
    """Runs one attempt's workers at a time; reusable across attempts.

    ``log_dir`` None → a temp dir made once per group (kept: logs outlive the agent).
    ``console_out``/``console_err`` are binary sinks for the prefixed console lines (None: the
    agent's stdout/stderr). ``on_exit(worker)`` is called from the relay thread whenever a worker
    exits, so the elastic loop can wake up on one event for exits and membership changes alike.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        *,
        console_out: BinaryIO | None = None,
        console_err: BinaryIO | None = None,
        on_exit: Callable[[Worker], None] | None = None,
        on_spawn: Callable[[int], None] | None = None,
        extra_env: dict[str, str] | None = None,
        host: str | None = None,
        standbys: Any = None,
        paced: bool = False,
    ) -> None:
        self._logs = LogDir(log_dir)
        self._console = (console_out, console_err)
        self._on_exit = on_exit
        self._on_spawn = on_spawn  # (pidfd): a worker started (the warden takes a dup of it)
        self._extra_env = dict(extra_env or {})  # in every worker's environment
        self._standbys = standbys  # standby.Standbys: warm interpreters that become workers
        self._paced = paced  # progress pages for the pace, even without the hang watchdog
        self.host = host or socket.gethostname()
        self._cond = threading.Condition()
        self._generation = 0
        self._procs: list[WorkerProc] = []
        self._reactor: Reactor | None = None
        self._spec: WorkerSpec | None = None
        self._info: RendezvousInfo | None = None
        self._attempt: int | None = None
        self._next_attempt = 0
        self._attempt_dir: str | None = None
        self._payload_file: str | None = None
        self._stopped = True
        self._result: RunResult | None = None

    @property
    def workers(self) -> list[Worker]:
        return [p.worker for p in self._procs]

    @property
    def spec(self) -> WorkerSpec | None:
        return self._spec

    @property
    def info(self) -> RendezvousInfo | None:
        return self._info

    @property
    def attempt(self) -> int | None:
        return self._attempt

    @property
    def attempt_dir(self) -> str | None:
        return self._attempt_dir

    @property
    def log_paths(self) -> dict[int, WorkerFiles]:
        """The current attempt's files, by global rank."""
        return {p.worker.global_rank: p.files for p in self._procs}

    @property
    def relay_thread(self) -> threading.Thread | None:
        return self._reactor.thread if self._reactor else None

    @property
    def state(self) -> WorkerState:
        if not self._procs:
            return WorkerState.INIT
        if self._result is not None:
            return self._result.state
        result = self.poll()
        return WorkerState.HEALTHY if result is None else result.state

    def pids(self) -> dict[int, int]:
        """Process ids by local rank (torch's ``pcontext.pids()``)."""
        return {p.worker.local_rank: p.worker.pid for p in self._procs if p.worker.pid}

    def log_root(self) -> str:
        return self._logs.root()

    def settle_logs(self, succeeded: bool) -> str | None:
        """After the last attempt: remove a log folder the group made itself when nothing in it
        is worth keeping; else return its path (see logdir.py).
        """
        to_files = any(mode != "console" for p in self._procs for mode in p.modes)
        return self._logs.settle(succeeded, to_files)

    # ---- start ---------------------------------------------------------------------------------

    def start(
        self, spec: WorkerSpec, info: RendezvousInfo, attempt: int | None = None
    ) -> list[Worker]:
        """Start ``spec.local_world_size`` workers for this round; returns them with their pids.

        ``attempt`` names the log folder (``attempt_<n>``); by default the round number when new
        to this group (etcd's: the same on every node, unique in a run, so agents sharing a log
        dir never write into each other's folders), else the last attempt + 1 (static: round 0).
        """
        if not self._stopped:
            raise RuntimeError("workers are running: stop() them before starting new ones")
        if spec.entrypoint is None:
            raise ValueError("WorkerSpec.entrypoint is None: there is nothing to run")
        lws = spec.local_world_size
        if info.first_global_rank < 0 or info.first_global_rank + lws > info.world_size:
            raise ValueError(
                f"rendezvous gave ranks [{info.first_global_rank}, {info.first_global_rank + lws})"
                f" outside world size {info.world_size} (run {info.run_id}, round {info.round},"
                f" node {info.node_id})"
            )
        kind = spec.resolved_kind()
        in_python = kind in (EntrypointKind.CALLABLE, EntrypointKind.RUN_PATH)
        spawned = in_python and spec.start_method == "spawn"
        payload = _spawn.spawn_payload(spec, kind) if spawned else None
        self._attempt = max(info.round, self._next_attempt) if attempt is None else attempt
        self._next_attempt = self._attempt + 1
        root = spec.log_dir or self.log_root()
        check_run_id(info.run_id)  # a name: the folder stays under the log dir
        self._attempt_dir = os.path.join(root, info.run_id, f"attempt_{self._attempt}")
        procs = []
        for local_rank in range(lws):
            rank = info.first_global_rank + local_rank
            worker = Worker(local_rank, rank, rank, info.world_size, info.world_size)
            files = WorkerFiles.under(self._attempt_dir, rank)
            files.prepare()
            if _beats(spec, self._paced):
                _progress_page(files.progress)
            procs.append(WorkerProc(worker, files, _spawn.stream_modes(spec, worker)))
        self._payload_file = None
        if payload is not None:
            self._payload_file = os.path.join(self._attempt_dir, f".payload-{os.getpid()}.pkl")
            with open(self._payload_file, "wb") as fp:
                fp.write(payload)
        with self._cond:
            self._spec, self._info, self._procs = spec, info, procs
            self._result, self._stopped = None, False
            self._generation += 1
        self._reactor = Reactor(
            console_out=self._console[0],
            console_err=self._console[1],
            poll_interval=spec.monitor_interval,
            name=f"etcdrun-workers-{info.run_id}-{self._attempt}",
            on_file_error=copy_stopped,
        )
        self._reactor.start()
        try:
            self._reactor.call(lambda: self._spawn_all(spec, info, kind))
        except BaseException:
            self.stop(grace=0)
            raise
        return self.workers

    def add_env(self, env: dict[str, str]) -> None:
        """More variables for every worker started from now on."""
        self._extra_env.update(env)

    def regroup(self, info: RendezvousInfo) -> dict[int, dict[str, str]]:
        """The running workers go on in ``info``'s round (in place, design.md §4a): their global
        ranks and world change, their processes, files and attempt folder do not. Returns the
        environment each local rank gets for the new round, to hand over on the control
        channel (the variables a worker started now would get, its error file unchanged).
        """
        spec = self._spec
        if self._stopped or spec is None:
            raise RuntimeError("no workers run: there is nothing to regroup")
        envs = {}
        with self._cond:
            self._info = info
            for proc in self._procs:
                w = proc.worker
                w.global_rank = w.role_rank = info.first_global_rank + w.local_rank
                w.world_size = w.role_world_size = info.world_size
                env = _spawn.worker_env(spec, info, w, proc.files.error_file)
                envs[w.local_rank] = {
                    **env,
                    **self._extra_env,
                    **_hang_env(spec, proc.files, self._paced),
                }
        return envs

    def _spawn_all(self, spec: WorkerSpec, info: RendezvousInfo, kind: EntrypointKind) -> None:
        # Runs on the relay thread: see the module docstring of reactor.py for why.
        for proc in self._procs:
            self._spawn_one(spec, info, kind, proc)

    def _spawn_one(
        self, spec: WorkerSpec, info: RendezvousInfo, kind: EntrypointKind, proc: WorkerProc
    ) -> None:
        reactor = self._reactor
        assert reactor is not None
        handle, proc.stream_fds, proc.stderr_tail = _spawn.start_worker(
            reactor,
            spec,
            info,
            kind,
            proc.worker,
            proc.files,
            proc.modes,
            self._payload_file,
            {**self._extra_env, **_hang_env(spec, proc.files, self._paced)},
            self._standbys,
        )
        with self._cond:
            proc.handle = handle
            proc.worker.pid = handle.pid
        fd, owns = handle.exit_fd()
        if owns and fd is not None and self._on_spawn is not None:
            self._on_spawn(fd)  # a pidfd, opened before any reap on this (the reaping) thread
        reactor.watch_exit(fd, lambda: self._check_exit(proc), owns_fd=owns)

    @staticmethod
    def _reap(proc: WorkerProc) -> bool:
        # Caller holds the lock.
        if not proc.reaped:
            assert proc.handle is not None
            code = proc.handle.poll()
            if code is None:
                return False
            proc.reaped, proc.reaped_code = True, code
        return True

    def _check_exit(self, proc: WorkerProc) -> bool:
        """Relay thread: collect an exit, relay the output it left, then publish it."""
        with self._cond:
            if proc.exitcode is not None:
                return True
            if not self._reap(proc):
                return False
            code = proc.reaped_code
        if self._reactor is not None:
            self._reactor.drain(proc.stream_fds)
        with self._cond:
            proc.exitcode, proc.exit_time = code, time.time()
            self._generation += 1
            self._cond.notify_all()
        if self._on_exit is not None:
            try:
                self._on_exit(proc.worker)
            except Exception:  # noqa: BLE001 - a listener's bug must not kill the relay
                import traceback

                traceback.print_exc()
        return True

    # ---- watch ---------------------------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """None while the attempt goes on; else its result (FAILED as soon as one worker failed).

        After ``stop()`` this is the final result, STOPPED when the agent ended workers that had
        not failed.
        """
        if self._result is not None:
            return self._result
        return self._compute(final=False)

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Block until ``poll()`` has a result or ``timeout`` passes (then None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                generation = self._generation
            result = self.poll()
            if result is not None:
                return result
            with self._cond:
                while self._generation == generation:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    self._cond.wait(remaining)

    def _compute(self, final: bool) -> RunResult | None:
        if not self._procs:
            return None
        with self._cond:
            exited = [(p, p.exitcode) for p in self._procs if p.exitcode is not None]
            everyone = len(exited) == len(self._procs)
            # A worker that exits 0 on the agent's SIGTERM did not finish its job.
            interrupted = any(p.signalled_at is not None for p, _ in exited)
        failures: dict[int, ProcessFailure] = {}
        returns: dict[int, Any] = {}
        for proc, code in exited:
            if code != 0:
                failures[proc.worker.global_rank] = proc.failure_for(code, self.host)
            else:
                returns[proc.worker.global_rank] = proc.return_value()
        if any(not f.stopped_by_agent for f in failures.values()):
            return RunResult(WorkerState.FAILED, returns, failures)
        if everyone and not failures and not interrupted:
            return RunResult(WorkerState.SUCCEEDED, returns, failures)
        if everyone or final:
            return RunResult(WorkerState.STOPPED, returns, failures)
        return None

    # ---- signals and stop ----------------------------------------------------------------------

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every running worker's process group (the agent forwarding a signal).

        The workers are then counted as stopped by the agent: use it for signals meant to end
        them (TERM, INT, HUP, QUIT), which is what the agent forwards.
        """
        with self._cond:
            for proc in self._procs:
                self._signal(proc, sig)

    def _signal(self, proc: WorkerProc, sig: int) -> None:
        # Caller holds the lock, and the relay thread reaps under it: a reaped pid is never hit.
        # A worker that already exited by itself (not yet seen by the relay) is not marked.
        if proc.handle is None or self._reap(proc):
            return
        if proc.signalled_at is None:
            proc.signalled_at = time.time()
        proc.stop_signal = signal.Signals(sig).name
        try:
            os.killpg(proc.handle.pid, sig)
        except ProcessLookupError:  # not yet its own group (a child still starting)
            try:
                os.kill(proc.handle.pid, sig)
            except ProcessLookupError:
                pass

    def _wait_exited(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(p.handle is not None and p.exitcode is None for p in self._procs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def stop(self, grace: float | None = None, sig: int = signal.SIGTERM) -> RunResult:
        """End the attempt: ``sig`` (SIGTERM; the agent passes on a signal it got) to each
        worker's group, wait up to ``grace`` (default ``spec.stop_grace``) returning as soon as
        all are gone, then SIGKILL; relay the last output; join the relay thread. Returns the
        final result; calling it again returns the same.
        """
        if self._stopped:
            return self._result or RunResult(WorkerState.INIT)
        assert self._spec is not None and self._reactor is not None
        if threading.current_thread() is self._reactor.thread:
            raise RuntimeError(
                "stop() cannot run on the relay thread (from on_exit): wake the"
                " elastic loop instead"
            )
        grace = self._spec.stop_grace if grace is None else grace
        self.signal_all(sig if grace > 0 else signal.SIGKILL)  # no grace (fencing): at once
        if not self._wait_exited(grace):
            self.signal_all(signal.SIGKILL)
            self._wait_exited(KILL_WAIT)
        with self._cond:
            for proc in self._procs:  # whatever the workers left in their groups
                if proc.handle is not None:
                    try:
                        os.killpg(proc.handle.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        self._reactor.close(drain_timeout=DRAIN_WAIT)
        _spawn.release([p.handle for p in self._procs], self._spec, self._payload_file)
        result = self._compute(final=True)
        assert result is not None
        with self._cond:
            self._result, self._stopped = result, True
            self._generation += 1
            self._cond.notify_all()
        return result

    def close(self) -> None:
        """Stop the workers if they run (with the spec's grace period)."""
        if not self._stopped:
            self.stop()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
