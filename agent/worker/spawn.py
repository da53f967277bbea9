"""How one worker process is made: its environment, its files, its streams and its process.

Why apart from ``workers.py``: the per-process mechanics (fds, exec shim, multiprocessing,
imported lazily); group.py is the group's life cycle (state, stop, results).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from etcdrun.agent.api import EntrypointKind, Std, Worker, WorkerSpec
from etcdrun.agent.worker import boot as _boot
from etcdrun.agent.worker.credentials import credential_names, scrubbed
from etcdrun.agent.worker.logdir import WorkerFiles
from etcdrun.agent.worker.output import filtered_file, line_prefix
from etcdrun.agent.worker.reactor import STDERR, STDOUT, Reactor

if TYPE_CHECKING:  # pragma: no cover
    from etcdrun.rendezvous.api import RendezvousInfo

# Where a stream goes: console only (torchrun's default), file only (redirect), or both (tee).
CONSOLE, FILE, TEE = "console", "file", "tee"

# The worker interpreter's exit hook (why, and what it fixes: agent/worker/_site/sitecustomize.py).
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
USER_PYTHONPATH = "ETCDRUN_USER_PYTHONPATH"  # the same name as the hook's USER_PATH_VAR


def worker_env(
    spec: WorkerSpec, info: RendezvousInfo, worker: Worker, error_file: str
) -> dict[str, str]:
    """The variables torchrun sets (design.md §4), plus ``ETCDRUN_ROUND``.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 1 as under torchrun (a user value wins), so a
    NCCL job fails instead of hanging the same way under both launchers.
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is what torchrun's launcher puts in its environment for
    the workers to inherit (``--signals-to-handle``). ``--virtual-local-rank``: LOCAL_RANK 0
    and CUDA_VISIBLE_DEVICES naming the worker's one GPU, picked from the agent's own
    CUDA_VISIBLE_DEVICES when set (torch's ``_set_local_rank_env``).
    """
    env = {
        "RANK": str(worker.global_rank),
        "LOCAL_RANK": str(worker.local_rank),
        "WORLD_SIZE": str(worker.world_size),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(info.node_rank),
        "GROUP_WORLD_SIZE": str(info.node_count),
        "ROLE_NAME": spec.role,
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(info.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(info.max_restarts),
        "TORCHELASTIC_RUN_ID": info.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(False),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": spec.signals_to_handle,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "ETCDRUN_ROUND": str(info.round),
    }
    if "OMP_NUM_THREADS" not in os.environ and spec.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    if spec.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = virtual_device(worker.local_rank)
    return env


def virtual_device(local_rank: int) -> str:
    """The one GPU a worker sees under ``--virtual-local-rank`` (torch's rule)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return str(local_rank)
    gpus = parent.split(",")
    if local_rank >= len(gpus):
        raise ValueError(
            f"local_rank {local_rank} exceeds available GPUs in CUDA_VISIBLE_DEVICES={parent}"
        )
    return gpus[local_rank].strip()


def exit_hook_env(env: Mapping[str, str]) -> dict[str, str]:
    """What makes every Python a worker command runs import the exit hook before anything else.

    Why through ``PYTHONPATH``: the hook must be registered in the worker's own interpreter
    before the user's code (atexit runs it last), and a script, a ``-m`` module or a
    ``--no-python`` wrapper is run by the interpreter itself, with no code of ours around it;
    ``site`` imports the first ``sitecustomize`` on the path. The user's value rides along and
    the hook puts it back, so the worker's ``os.environ`` and ``sys.path`` are as torchrun's.
    """
    user = env.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": SITE_DIR + os.pathsep + user if user else SITE_DIR,
        USER_PYTHONPATH: user,
    }


def stream_modes(spec: WorkerSpec, worker: Worker) -> tuple[str, str]:
    """(stdout, stderr) destinations for one worker, with torchrun's meaning of the flags.

    A worker filtered off the console keeps its output in its log file (torchrun does the same).
    """
    redirects, tee = spec.redirect_map(), spec.tee_map()
    shown = (spec.local_ranks_filter is None or worker.local_rank in spec.local_ranks_filter) and (
        spec.global_ranks_filter is None or worker.global_rank in spec.global_ranks_filter
    )
    modes = []
    for std in (Std.OUT, Std.ERR):
        if tee[worker.local_rank] & std:
            mode = TEE
        elif redirects[worker.local_rank] & std:
            mode = FILE
        else:
            mode = CONSOLE
        if not shown:
            mode = FILE
        modes.append(mode)
    return modes[0], modes[1]


def command_for(spec: WorkerSpec, kind: EntrypointKind) -> list[str]:
    """The real command of a SCRIPT/MODULE/EXECUTABLE worker (before the shim)."""
    args = [str(a) for a in spec.args]
    entry = str(spec.entrypoint)
    if kind is EntrypointKind.SCRIPT:
        return [sys.executable, "-u", entry, *args]
    if kind is EntrypointKind.MODULE:
        return [sys.executable, "-u", "-m", entry, *args]
    return [entry, *args]


def callable_target(spec: WorkerSpec, kind: EntrypointKind) -> tuple[Any, tuple[Any, ...]]:
    if kind is EntrypointKind.RUN_PATH:
        return _boot.run_path_main, (str(spec.entrypoint), *spec.args)
    return spec.entrypoint, tuple(spec.args)


def spawn_payload(spec: WorkerSpec, kind: EntrypointKind) -> bytes:
    """What a spawned callable worker loads: multiprocessing's preparation data, then (fn, args).

    Pickled in the caller's thread so that an unpicklable entrypoint fails ``start()`` cleanly.
    """
    import multiprocessing.spawn  # here, not at the top: the CLI forks its standbys first
    import pickle

    fn, args = callable_target(spec, kind)
    buf = io.BytesIO()
    prep = multiprocessing.spawn.get_preparation_data(spec.role)
    if "authkey" in prep:  # an AuthenticationString pickles only inside multiprocessing
        prep["authkey"] = bytes(prep["authkey"])
    try:
        pickle.dump(prep, buf)
        pickle.dump((fn, args), buf)
    except Exception as e:  # noqa: BLE001 - pickling raises many types
        raise ValueError(
            f"cannot pickle the entrypoint {spec.get_entrypoint_name()!r} or its arguments for"
            f" start_method 'spawn' ({type(e).__name__}: {e}); use a module-level function"
            " or start_method 'fork'"
        ) from e
    return buf.getvalue()


class Handle:
    """A started worker process, whichever way it was made."""

    def __init__(self, proc: subprocess.Popen[bytes] | Any, via_mp: bool, forkserver: bool):
        self._proc = proc
        self._via_mp = via_mp
        self.forkserver = forkserver
        self.pid: int = proc.pid

    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal) once exited (reaps it), else None."""
        return self._proc.exitcode if self._via_mp else self._proc.poll()

    def exit_fd(self) -> tuple[int | None, bool]:
        """(fd readable at exit, whether the caller owns it); (None, False) → poll instead."""
        if self.forkserver:
            return self._proc.sentinel, False  # not our child: the forkserver reports the exit
        try:
            return os.pidfd_open(self.pid), True
        except (AttributeError, OSError):
            return None, False

    def close(self) -> None:
        if self._via_mp:
            try:
                self._proc.close()
            except ValueError:
                pass  # still running (unkillable): leave it to multiprocessing


def launch(
    spec: WorkerSpec,
    kind: EntrypointKind,
    *,
    env: Mapping[str, str],
    stdout: int,
    stderr: int,
    files: WorkerFiles,
    payload_file: str | None,
    close_in_child: list[int],
    name: str,
    takeover: Any = None,
) -> Handle:
    """Start one worker in its own session, with the parent-death signal armed; a Python
    command goes to ``takeover(command, env, stdout, stderr)`` first (a standby: standby.py).
    """
    agent_pid = os.getpid()
    full_env = scrubbed({**os.environ, **env})  # no etcd credentials for user code
    full_env.update(exit_hook_env(full_env))  # fork/forkserver children never finalize: not them
    is_fn = kind in (EntrypointKind.CALLABLE, EntrypointKind.RUN_PATH)
    if not is_fn or spec.start_method == "spawn":
        argv = [sys.executable, "-u", "-c", _boot.SPAWN_CODE, str(agent_pid), str(payload_file)]
        argv = [*argv, files.return_file] if is_fn else command_for(spec, kind)
        proc = takeover(argv, full_env, stdout, stderr) if takeover is not None else None
        if proc is None:
            run = argv if is_fn else _boot.shim_argv(agent_pid, argv)
            proc = _popen(run, full_env, stdout, stderr)
        return Handle(proc, via_mp=False, forkserver=False)
    fn, args = callable_target(spec, kind)
    params = {
        "agent_pid": agent_pid,
        "direct_child": spec.start_method == "fork",
        "close_fds": close_in_child if spec.start_method == "fork" else [],
        "stdout": _boot.InheritFd(stdout),
        "stderr": _boot.InheritFd(stderr),
        "env": dict(env),
        "drop_env": credential_names({**os.environ, **env}),
        "fn": fn,
        "args": args,
        "return_file": files.return_file,
    }
    import multiprocessing

    ctx = multiprocessing.get_context(spec.start_method)
    proc = ctx.Process(target=_boot.mp_child_main, args=(params,), name=name, daemon=False)
    proc.start()
    return Handle(proc, via_mp=True, forkserver=spec.start_method == "forkserver")


def release(handles: list[Handle | None], spec: WorkerSpec, payload_file: str | None) -> None:
    """What an attempt held once its workers are gone: handles, helpers, the payload file."""
    for handle in handles:
        if handle is not None:
            handle.close()
    if spec.start_method == "forkserver":
        release_forkserver()
    if payload_file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(payload_file)


def release_forkserver() -> None:
    """Stop multiprocessing's forkserver and resource tracker after a forkserver attempt.

    Why: they are process-wide helpers that outlive the workers; an agent that promises to leave
    no child process behind after ``stop()`` must end them (the next attempt starts new ones).
    They are private APIs of multiprocessing, hence the guards.
    """
    from multiprocessing import forkserver, resource_tracker

    for owner, name in ((forkserver, "_forkserver"), (resource_tracker, "_resource_tracker")):
        stop = getattr(getattr(owner, name, None), "_stop", None)
        if stop is not None:
            try:
                stop()
            except (OSError, ChildProcessError):
                pass


def start_worker(
    reactor: Reactor,
    spec: WorkerSpec,
    info: RendezvousInfo,
    kind: EntrypointKind,
    worker: Worker,
    files: WorkerFiles,
    modes: tuple[str, str],
    payload_file: str | None,
    extra_env: Mapping[str, str] | None = None,
    standbys: Any = None,
) -> tuple[Handle, list[int], collections.deque[str] | None]:
    """Open the worker's stdout/stderr (a log file, or a pipe to the relay), launch it, and hand
    its pipes to the relay. Returns (handle, pipe fds, stderr tail). Call on the relay thread.
    """
    child_fds: list[int] = []
    pipes: list[tuple[int, str, int]] = []  # (read end, mode, STDOUT/STDERR)
    try:
        targets = ((STDOUT, modes[0], files.stdout), (STDERR, modes[1], files.stderr))
        for which, mode, path in targets:
            if mode == FILE:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                child_fds.append(os.open(path, flags, 0o644))
            else:
                r, w = os.pipe()
                child_fds.append(w)
                pipes.append((r, mode, which))
        handle = launch(
            spec,
            kind,
            env={**worker_env(spec, info, worker, files.error_file), **(extra_env or {})},
            stdout=child_fds[0],
            stderr=child_fds[1],
            files=files,
            payload_file=payload_file,
            close_in_child=reactor.fds() + [r for r, _, _ in pipes],
            name=f"{spec.role}-{worker.global_rank}",
            takeover=standbys.taker(worker.local_rank) if standbys else None,
        )
    except BaseException:
        for r, _, _ in pipes:
            os.close(r)
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    tail = _relay(reactor, spec, worker, files, pipes)
    return handle, [r for r, _, _ in pipes], tail


def _relay(
    reactor: Reactor,
    spec: WorkerSpec,
    worker: Worker,
    files: WorkerFiles,
    pipes: list[tuple[int, str, int]],
) -> collections.deque[str] | None:
    """Hand a worker's pipes to the relay: console prefix, tee file, duplicate filters; returns
    the stderr tail (for the root-cause report).
    """
    tail = None
    for r, mode, which in pipes:
        path = files.stdout if which == STDOUT else files.stderr
        stream_tail = reactor.new_tail() if which == STDERR else None
        if stream_tail is not None:
            tail = stream_tail
        tee_file = open(path, "ab", buffering=0) if mode == TEE else None  # noqa: SIM115
        std, filters = (
            ("stdout", spec.duplicate_stdout_filters)
            if which == STDOUT
            else ("stderr", spec.duplicate_stderr_filters)
        )
        dup = filtered_file(files, std, filters) if mode == TEE else None  # torch: teed only
        reactor.add_stream(
            r,
            prefix=line_prefix(spec, worker, mode),
            console=which,
            file=tee_file,
            tail=stream_tail,
            duplicate=(dup, [f.encode() for f in filters or []]) if dup else None,
        )
    return tail


def _popen(argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> subprocess.Popen:
    # No preexec_fn (unsafe with threads): the session, by _posixsubprocess; the death signal,
    # by the child.
    return subprocess.Popen(
        argv, env=env, stdout=stdout, stderr=stderr, start_new_session=True, close_fds=True
    )
