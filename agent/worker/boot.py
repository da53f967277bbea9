"""Code that runs in the worker process, before (and around) the user's entrypoint.

Why this exists: a worker must die with its agent, even when the agent dies by SIGKILL (torchrun
leaves them running). Linux's PR_SET_PDEATHSIG does that, but it must be set in the child, and
``preexec_fn`` is unsafe in a parent with threads (gRPC has some). So a command entrypoint goes
through ``SHIM``: a ``python -I -S -c`` one-liner (quick: no site import) that sets the death
signal, checks that the agent still is its parent (closing the fork→prctl race), then execs the
real command with the same pid. A callable entrypoint does the same first thing in Python.

What runs *after* the user's code lives apart, in ``_site/sitecustomize.py``: every worker
interpreter the agent starts imports it at start-up (``_spawn.exit_hook_env``), so that a script,
a module and a spawned callable alike let gloo's threads finish before Python finalizes (else
SIGABRT at exit; figures there). Fork/forkserver children end with ``os._exit`` and need none.

Keep this module import-light: spawned workers import it before the user's code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
SIGKILL = 9
EXIT_PARENT_GONE = 128 + SIGKILL

# argv: <agent pid> <command> [args...]. Exit 127/126 like a shell when the command cannot run.
SHIM = (
    "import os,sys\n"
    "try:\n"
    " import ctypes\n"
    f" ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG},{SIGKILL},0,0,0)\n"
    "except Exception:\n"
    " pass\n"
    f"if os.getppid()!=int(sys.argv[1]):os._exit({EXIT_PARENT_GONE})\n"
    "a=sys.argv[2:]\n"
    "try:\n"
    " os.execvp(a[0],a)\n"
    "except OSError as e:\n"
    " sys.stderr.write('etcdrun: cannot execute %r: %s\\n'%(a[0],e.strerror or e))\n"
    " os._exit(126 if isinstance(e,PermissionError) else 127)\n"
)

SPAWN_CODE = "from etcdrun.agent.worker.boot import spawn_main; spawn_main()"


def shim_argv(agent_pid: int, command: list[str]) -> list[str]:
    """The argv that runs ``command`` through the death-signal shim."""
    return [sys.executable, "-I", "-S", "-c", SHIM, str(agent_pid), *command]


def set_parent_death_signal(agent_pid: int, direct_child: bool = True) -> None:
    """Die by SIGKILL when the agent dies; exit at once if it is already gone.

    ``direct_child`` False (forkserver): our parent is the forkserver, which exits with the
    agent, so we check that the agent is alive instead of being our parent.
    """
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux: nothing to set
        pass
    if direct_child:
        if os.getppid() != agent_pid:
            os._exit(EXIT_PARENT_GONE)
        return
    try:
        os.kill(agent_pid, 0)
    except ProcessLookupError:
        os._exit(EXIT_PARENT_GONE)
    except PermissionError:
        pass


class InheritFd:
    """An fd handed to a multiprocessing child, for the fork and forkserver start methods.

    Under fork the number is simply inherited. Under forkserver the object is pickled while
    multiprocessing launches the child, and ``multiprocessing.reduction.DupFd`` sends the fd along
    (SCM_RIGHTS): no resource-sharer thread is started in the agent.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritFd:
    return InheritFd(dup.detach())


def _fresh_std_streams() -> None:
    # A forked child inherits the agent's sys.stdout object, which may not even write to fd 1
    # (a test runner's capture); rebuild both on the real fds, unbuffered like ``python -u``.
    import io

    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name, None)
        encoding = getattr(old, "encoding", None) or "utf-8"
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=encoding,
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_callable(fn: Any, args: tuple[Any, ...], return_file: str) -> int:
    """Run the user's function under ``@record``; save its return value; give the exit code."""
    import pickle
    import traceback

    from etcdrun.agent.errors import record, write_error_file

    try:
        value = record(fn)(*args)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Like an interpreter killed by SIGINT, so the agent sees the signal, not "exit 1".
        import signal

        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    try:
        tmp = f"{return_file}.tmp"
        with open(tmp, "wb") as fp:
            pickle.dump(value, fp)
        os.replace(tmp, return_file)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the user's, report it
        err = TypeError(f"the return value of {fn!r} cannot be pickled: {type(e).__name__}: {e}")
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            write_error_file(path, err)
        print(f"etcdrun: {err}", file=sys.stderr)
        return 1
    return 0


def _default_signal_handlers() -> None:
    # A forked worker inherits the agent's Python signal handlers (its SIGTERM forwarding, its
    # wake-up fd): the worker must die of SIGTERM like an exec'd one, not run the agent's code.
    import signal

    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def mp_child_main(params: dict[str, Any]) -> None:
    """Target of a fork/forkserver multiprocessing worker."""
    try:
        os.setsid()
    except OSError:
        pass
    _default_signal_handlers()
    set_parent_death_signal(params["agent_pid"], direct_child=params["direct_child"])
    for fd in params["close_fds"]:
        try:
            os.close(fd)
        except OSError:
            pass
    out, err = params["stdout"].fd, params["stderr"].fd
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err} - {1, 2}:
        os.close(fd)
    os.environ.update(params["env"])
    for name in params["drop_env"]:  # a forked worker inherits the agent's environment whole
        os.environ.pop(name, None)
    _fresh_std_streams()
    code = run_callable(params["fn"], params["args"], params["return_file"])
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def spawn_main() -> None:
    """Entry of a spawned callable worker: ``python -u -c SPAWN_CODE <agent pid> <payload> <ret>``.

    The payload holds multiprocessing's preparation data (so functions of the agent's
    ``__main__`` resolve, as with multiprocessing's spawn) and then ``(fn, args)``.
    """
    agent_pid, payload, return_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    set_parent_death_signal(agent_pid)
    import multiprocessing.spawn
    import pickle

    with open(payload, "rb") as fp:
        multiprocessing.spawn.prepare(pickle.load(fp))
        fn, args = pickle.load(fp)
    sys.exit(run_callable(fn, args, return_file))


def run_path_main(path: str, *args: Any) -> None:
    """torchrun's ``--run-path``: run a script as ``__main__`` inside the worker process."""
    import runpy

    sys.argv = [path, *(str(a) for a in args)]
    runpy.run_path(path, run_name="__main__")
