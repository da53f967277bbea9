"""The worker interpreter's exit hook: native threads get the GIL they wait for before Python
finalizes, so a job that succeeded is not killed by SIGABRT on its way out.

Why: a gloo worker thread (``ProcessGroupGloo::runLoop``) drops its reference to a finished
collective's tensors *after* the collective returned to Python, and in torch 2.13 dropping a C++
reference to a tensor that has a Python object decrefs that object, under the GIL. When the main
thread reaches ``Py_FinalizeEx`` first, CPython (< 3.14) answers that thread's GIL request with
``pthread_exit``; the forced unwind crosses a ``noexcept`` destructor (``~AsyncWork``), and
libstdc++ calls ``std::terminate``: "terminate called without an active exception", SIGABRT (core
dumps: the gloo thread in ``take_gil`` → ``PyThread_exit_thread``, the main thread in finalization's
first ``gc.collect``). Nothing of the launcher is involved: workers started by hand abort the same
way, whoever hosts the store and wherever their output goes, and not at all when they sleep a moment
before exiting; only ``setsid`` matters: alone in its session (its own scheduler autogroup) the gloo
thread loses the race far more often. torchrun's ``--run-path`` and callable workers escape by their
exit path: they block, GIL released, until the agent has read every return value. Its script and
``-m`` workers (own sessions, like ours) do not. bench/clean_exit.py counts the launches that abort,
case by case, under both launchers: with this hook, etcdrun's never do (bench/results/clean_exit.md;
the counts before the hook and the runs by hand: bench/results/figures.md).

What it does: ``settle`` runs last at exit (registered here, before any user code, and atexit is
last-in first-out): it sleeps, GIL released, until no other thread of the process is running or
runnable (``/proc/self/task/*/stat``) twice in a row, at most ``CAP`` seconds. A process with no
other thread returns at once; a torch worker waits briefly for gloo's threads
(bench/results/clean_exit.md).

It also arms the stack dump of the agent's hang watchdog (etcdrun_stacks.py, beside it).

How it gets here: the agent puts this folder first on the worker's ``PYTHONPATH`` and the user's
own in ``ETCDRUN_USER_PYTHONPATH``; ``site`` imports this module at start-up of every Python the
worker command runs (script, ``-m``, spawned callables, a ``--no-python`` wrapper's Python). It
puts ``sys.path`` and ``os.environ`` back as the user had them (the worker's own children inherit
nothing of it) and imports the ``sitecustomize`` it shadows, if any. Standard library only and
never fatal: ``PYTHON_EXEC`` may be an interpreter without etcdrun.
"""

import os
import sys

USER_PATH_VAR = "ETCDRUN_USER_PYTHONPATH"
CAP = 1.0  # seconds; only a thread that never sleeps (a spinning native thread) costs this much
QUIET_SAMPLES = 2


def _others_running(me):
    """Whether a thread other than ``me`` is running, runnable or in uninterruptible sleep."""
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            with open(os.path.join("/proc/self/task", tid, "stat"), "rb") as fp:
                stat = fp.read()
        except OSError:  # it ended meanwhile
            continue
        state = stat[stat.rindex(b")") + 2 :][:1]  # the field after "(comm)"
        if state in (b"R", b"D"):
            return True
    return False


def settle(cap=CAP):
    """Release the GIL until the process's other threads are all asleep (see the module doc).

    The step is twice the GIL switch interval: a thread woken when the GIL was released is then
    either done with it or still runnable (seen), never asleep waiting for it again.
    """
    import threading
    import time

    me = str(threading.get_native_id())
    try:
        if os.listdir("/proc/self/task") == [me]:
            return
        step = max(2 * sys.getswitchinterval(), 0.005)
        deadline = time.monotonic() + cap
        quiet = 0
        while quiet < QUIET_SAMPLES and time.monotonic() < deadline:
            time.sleep(step)
            quiet = 0 if _others_running(me) else quiet + 1
    except OSError:  # no /proc: nothing to watch
        pass


def _restore_user_path():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    user = os.environ.pop(USER_PATH_VAR, None)
    if user is None:
        return  # not set by an agent: leave PYTHONPATH alone
    if user:
        os.environ["PYTHONPATH"] = user
    else:
        os.environ.pop("PYTHONPATH", None)


def _install():
    import atexit

    atexit.register(settle)
    try:
        import etcdrun_stacks  # beside this file, still on the path until the next line

        etcdrun_stacks.arm(os.environ)
    except ImportError:  # a partial copy of this folder: run without the stack dump
        pass
    _restore_user_path()
    if __name__ == "sitecustomize":
        # Import the sitecustomize this one shadows (Debian's, a tracer's...), as site would.
        this = sys.modules.pop(__name__)
        try:
            import sitecustomize  # noqa: F401
        except ImportError as e:
            sys.modules[__name__] = this  # none to chain: the import in progress ends with us
            if e.name != "sitecustomize":
                raise


_install()
