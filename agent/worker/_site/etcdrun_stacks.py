"""Arm a worker's stack dump for the agent's hang watchdog (``--hang-timeout``, agent/hang/).

With ``ETCDRUN_STACKS`` set to ``<signal>:<file>``, faulthandler writes every thread's Python
stack to that file when the signal comes, from its C signal handler. That works where a Python
handler cannot: in a thread blocked in a collective, in ``os.read``, in any C call. A first line
names the process and its main thread, whose stack is the one that matters.

Who calls ``arm``: the worker's ``sitecustomize`` at start-up, and a standby worker once it is
handed its round's environment (agent/standby/boot.py). Standard library only and never fatal,
like the hook beside it.
"""

import os

VAR = "ETCDRUN_STACKS"  # the same name as agent/hang/stacks.py's VAR
_file = None  # kept open for the life of the process: faulthandler writes to its fd


def arm(environ):
    """Register the dump that ``environ`` asks for; the variable is removed, so the worker's
    own children do not write into its file.
    """
    global _file
    spec = environ.pop(VAR, None)
    if not spec:
        return
    try:
        import faulthandler
        import threading

        signum, path = spec.split(":", 1)
        fp = open(path, "a", buffering=1)  # noqa: SIM115 - open until the process ends
        main = threading.main_thread().ident
        fp.write(f"etcdrun stacks of pid {os.getpid()}, main thread 0x{main:016x}\n")
        faulthandler.register(int(signum), file=fp, all_threads=True, chain=False)
        _file = fp
    except (OSError, ValueError, RuntimeError):  # the worker runs without it
        pass
