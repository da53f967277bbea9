"""The standby's own code: a worker interpreter started ahead of need, that becomes the worker.

Why: a worker's start is mostly round-independent (the interpreter, ``sys.path``, ``import torch``:
seconds), while the round's facts (RANK, WORLD_SIZE, MASTER_*) arrive only at the freeze. A standby
does the first part early and waits for the second on a socket; then it runs the command line a
fresh worker would have run (``python -u script.py ...``, ``-m module``, or the ``-c`` of a spawned
callable), in this process, as ``__main__``. So a survivor's worker is ready almost as soon as it
runs, where a spawned one first imports torch (bench/results/standby_bench.md).

Invisible to the script, by construction: ``os.environ`` is replaced wholesale by the round's
(nothing of the standby's own start stays; the block ``/proc/<pid>/environ`` shows is rewritten
in place too, from the room ``ROOM_VAR`` reserved, so the warden's sweep and anyone reading
/proc see the worker's variables; safe because every variable was unset first, so libc no longer
points into that block — only a library that kept a ``getenv()`` pointer from before the
hand-over would now read the round's text there), ``sys.argv``/``sys.orig_argv``/
``sys.path[0]``, ``__main__`` (its dict rebuilt as the interpreter builds it: ``__file__``
absolute, unnormalised, a ``SourceFileLoader``, ``__cached__`` None), stdout/stderr moved onto
the round's fds (what was printed while importing is replayed there first), the parent-death
signal set at start (it holds across the hand-over), default signal handlers, and an uncaught
exception printed without our frames, then left to the interpreter, so exit codes (1,
SystemExit's, death by SIGINT) are its own. What differs: more modules already in
``sys.modules`` (the point of it), with their objects frozen (``_prewarm``), ``ps`` shows the
standby's command line (with the worker's command at its end), and with torch imported rank
0's store already listens (``_early_store``).

How it runs: ``python -u -c LOADER <this file> <agent pid> <socket fd> <turns> <prewarm>
<command...>``; a refill (``turns`` > 0) first waits for a warm-up turn (``_take_turn``); after
its imports it sends one byte back (``WARM``: the agent's first join waits for it);
LOADER executes this file in a namespace of its own (neither ``__main__`` nor in
``sys.modules``), so the script finds ``__main__`` pristine. Standard library only (builtins
where possible: ``marshal``, not ``json``); etcdrun itself is never imported here. The agent
imports this file as a module for ``WARM`` and ``ROOM_VAR`` only: nothing runs on import.
"""

import marshal
import os
import sys

PR_SET_PDEATHSIG, SIGKILL = 1, 9
EXIT_PARENT_GONE = 128 + SIGKILL
WARM = b"w"  # one byte back to the agent: the imports are done (standby.Standbys.wait_warm)
ROOM_VAR = "ETCDRUN_STANDBY_ROOM"  # only in the standby's start environment: room to rewrite
# What a fresh interpreter's __main__ holds before it runs anything (python 3.10-3.13).
TURN_NAME = "\0etcdrun-warmup-{uid}-{i}"  # abstract UNIX socket names: one per warm-up turn
TURN_POLL = 0.05  # seconds between tries while every turn is taken
TURN_WAIT = 60.0  # a refill imports anyway after this long: a hung import must not hold the rest
EARLY_STORE_VAR = "ETCDRUN_EARLY_STORE"  # "0" in the worker's env: no early store (_early_store)
STORE_WAIT = 0.5  # seconds a rank > 0 waits for rank 0's store: torch's own retry interval
STORE_POLL = 0.005  # seconds between its connection attempts
MAIN_AT_START = (
    "__name__",
    "__doc__",
    "__package__",
    "__loader__",
    "__spec__",
    "__annotations__",
    "__builtins__",
)


def _die_with_agent(agent_pid):
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux
        pass
    if os.getppid() != agent_pid:
        os._exit(EXIT_PARENT_GONE)


def _path0(command):
    """``sys.path[0]`` as the interpreter computes it for this command line (None: -P)."""
    if sys.flags.safe_path:
        return None
    if command[0] == "-c":
        return ""
    if command[0] == "-m":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(command[0]))


def _set_path0(command, had_path0):
    path0 = _path0(command)
    if had_path0 and path0 is not None:
        sys.path[0] = path0


def _prewarm(names):
    """Import what the user named; ``auto``: torch when importable. Not ``torch._dynamo``,
    although DDP's constructor imports it: with it imported before DDP is built, torch 2.13's gloo
    DDP scripts hang at exit (the Reducer's destructor joins a gloo thread that waits for the GIL),
    under torchrun too when the script imports it first (bench/results/clean_exit.md, 'A hang at
    exit with torch._dynamo imported'). A user may still name it. A failure is left for the worker's
    own import to report.

    The collector is off while they import, and what they built is then frozen (``gc.freeze``: the
    permanent generation, which collections never walk), as pre-fork servers do. Why: the import's
    own collections walk its ever-growing heap again and again, a share of ``import torch``'s CPU
    worth saving, on the critical path of a newcomer and of a first round's last node; turning the
    collector back on without a freeze would only move that cost (one pass over every object the
    imports built) to the worker's first allocations (bench/results/figures.md, 'Design notes'
    figures', §4, and 'Figures cited by the code'). Module-level objects live as long as the process
    anyway. The script sees the collector as it left it (on, default thresholds); only
    ``gc.get_objects()`` omits the frozen ones and ``gc.get_freeze_count()`` counts them (README,
    "what differs").
    """
    import gc

    was_on = gc.isenabled()
    gc.disable()
    try:
        for name in names.split(","):
            name = name.strip()
            if not name or name == "none":
                continue
            try:
                __import__("torch" if name == "auto" else name)
            except Exception:  # noqa: BLE001, S112 - the worker's own import will say it
                continue
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def _take_turn(sock, turns):
    """Wait for one of ``turns`` warm-up turns of this user on this host (network namespace);
    the held socket (close it to free the turn), or None: no turns asked, the hand-over came
    first (this standby is now on a round's critical path: it imports at once), or TURN_WAIT.

    Why: refills are speculative. Started at a hand-over, several importing together share the CPUs
    with the round that is starting; on a small machine the refills of a first round made the last
    node's own import several times slower (bench/results/figures.md, 'Design notes' figures', §4,
    refills in turn). A turn is a bound abstract socket name, so the kernel frees it when its holder
    ends, however it ends (nothing to clean up, no file).
    """
    import select
    import socket
    import time

    deadline = time.monotonic() + TURN_WAIT
    while turns > 0:
        for i in range(turns):
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                held.bind(TURN_NAME.format(uid=os.getuid(), i=i))
                return held
            except OSError:
                held.close()
        left = deadline - time.monotonic()
        if left <= 0 or select.select([sock], [], [], min(TURN_POLL, left))[0]:
            break
    return None


def _receive(sock):
    """The hand-over: 8-byte length, then a marshal'd {argv, env}, with stdout/stderr fds."""
    import socket

    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 2)
    if len(head) < 8:
        os._exit(0)  # the agent closed our socket without a round: nothing to run
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            os._exit(0)
        body += chunk
    return marshal.loads(body), fds


def _move_streams(fds):
    """Put the round's stdout/stderr on fds 1/2; what was printed before goes there first."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, new in zip((1, 2), fds, strict=True):
        early = []
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 65536):
            early.append(chunk)
        os.dup2(new, fd)
        os.close(new)
        for chunk in early:
            os.write(fd, chunk)


def _set_environ(env, exec_env):
    """``os.environ`` as the exit hook leaves a fresh worker's; /proc/<pid>/environ as its
    exec left it (``exec_env``, what the agent would have passed to the exec).
    """
    os.environ.clear()
    os.environ.update(env)
    env = exec_env
    try:  # what /proc/<pid>/environ shows: the block the kernel handed us at exec
        with open("/proc/self/stat", "rb") as fp:
            fields = fp.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])
        blob = b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
        if len(blob) <= end - start:
            import ctypes

            ctypes.memmove(start, blob.ljust(end - start, b"\0"), end - start)
    except (OSError, IndexError, ValueError):
        pass


def _early_store(env):
    """Rank 0: the TCPStore server its ``init_process_group`` starts on MASTER_PORT, started now
    and held for the worker's life; other ranks: wait (at most STORE_WAIT) until it listens.
    None, or the held store.

    Why: a round's workers start together, and a rank whose store client dials MASTER_PORT before
    rank 0 listens is refused and tries again only ~0.5 s later (torch 2.13): a rank 0 a few
    milliseconds late cost the round that half second, in half the scale-up trials
    (bench/results/figures.md, 'Design notes' figures', §4, rank 0's early store, and 'Figures cited
    by the code'). torchrun's c10d has no such race: its agent serves MASTER_PORT before any worker
    starts. Ours has no torch; rank 0's standby has. The script's own store (env:// and tcp:// start
    rank 0's with ``multi_tenant=True``) shares this server: same keys, same port, one more socket.
    Only when torch.distributed was prewarmed (nothing is imported here), never under
    TORCHELASTIC_USE_AGENT_STORE, and any failure (port taken, no gloo, rank 0 never listening)
    leaves the script to meet it itself, as a fresh worker.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or env.get(EARLY_STORE_VAR) == "0" or "MASTER_PORT" not in env:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    try:
        addr, port = env.get("MASTER_ADDR", "localhost"), int(env["MASTER_PORT"])
        if env.get("RANK") != "0":
            return await_listener(addr, port, STORE_WAIT)
        from datetime import timedelta

        return dist.TCPStore(
            addr,
            port,
            None,
            True,
            timedelta(seconds=60),
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=env.get("USE_LIBUV", "1") == "1",
        )
    except Exception:  # noqa: BLE001 - the script's own store meets the same failure
        return None


def await_listener(addr, port, wait, stop=None):
    """Until ``addr:port`` accepts a connection (closed at once: the server drops it without a
    word), or ``wait`` seconds: past torch's own retry interval, its retry is as quick. Also
    etcdrun.elastic's group, for a kept rank dialling a round's store (agent/elastic),
    which passes ``stop()``: the round ended, no one will listen (its host moved on).
    """
    import socket
    import time

    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0 and not (stop is not None and stop()):
        try:
            socket.create_connection((addr, port), timeout=left).close()
            return None
        except ConnectionRefusedError:
            time.sleep(STORE_POLL)
        except OSError:
            return None
    return None


def _fresh_main(keep):
    """``__main__``'s dict as the interpreter starts it (``keep``: its start-up entries)."""
    d = sys.modules["__main__"].__dict__
    d.clear()
    d.update(keep)
    return d


def _strip_ours(ours):
    """Print an uncaught exception without the standby's frames, as a fresh worker shows it."""
    hook = sys.excepthook

    def excepthook(kind, value, tb):
        while tb is not None and tb.tb_frame.f_code in ours:
            tb = tb.tb_next
        sys.excepthook = hook
        if isinstance(value, BaseException):  # the default hook prints value.__traceback__
            value = value.with_traceback(tb)
        hook(kind, value, tb)

    sys.excepthook = excepthook


def _run(command, keep, ours):
    ours.update((sys._getframe().f_code, _run_script.__code__))
    d = _fresh_main(keep)
    try:
        if command[0] == "-c":
            sys.argv = ["-c", *command[2:]]
            exec(compile(command[1], "<string>", "exec", dont_inherit=True), d)
        elif command[0] == "-m":
            import runpy

            sys.argv = ["-m", *command[2:]]
            runpy._run_module_as_main(command[1], alter_argv=True)
        else:
            _run_script(command, d)
    except SystemExit:
        raise
    except BaseException:
        _strip_ours(ours)
        raise


def _run_script(command, d):
    from importlib.machinery import SourceFileLoader

    path = command[0]
    sys.argv = list(command)
    file = path if os.path.isabs(path) else os.getcwd() + os.sep + path
    d.update(__loader__=SourceFileLoader("__main__", file), __file__=file, __cached__=None)
    try:
        with open(file, "rb") as fp:
            code = compile(fp.read(), file, "exec", dont_inherit=True)
        exec(code, d)
    finally:
        d.pop("__file__", None)
        d.pop("__cached__", None)


def main(argv):
    import socket

    agent_pid, sock_fd, turns, prewarm = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    command = argv[4:]
    _die_with_agent(agent_pid)
    keep = {k: v for k, v in vars(sys.modules["__main__"]).items() if k in MAIN_AT_START}
    had_path0 = bool(sys.path) and sys.path[0] == "" and not sys.flags.safe_path
    _set_path0(command, had_path0)
    sock = socket.socket(fileno=sock_fd)  # the round may already wait in it: any time is fine
    turn = _take_turn(sock, turns)
    _prewarm(prewarm)
    if turn is not None:
        turn.close()  # the next refill's turn
    try:
        sock.send(WARM, socket.MSG_NOSIGNAL)  # the agent's first join waits for this
    except OSError:
        pass  # its end is closed: the round it sent before is still ours to read (or EOF)
    msg, fds = _receive(sock)
    sock.close()
    _move_streams(fds)
    _set_environ(msg["env"], msg["exec_env"])
    stacks = sys.modules.get("etcdrun_stacks")  # imported by the exit hook, when it ran
    if stacks is not None:
        stacks.arm(os.environ)  # the round's environment names this worker's stack file
    store = _early_store(msg["env"])  # noqa: F841 - held, so it serves until the worker ends
    sys.orig_argv = list(msg["argv"])
    command = msg["argv"][2:]  # after the interpreter and -u
    _set_path0(command, had_path0)
    ours, f = set(), sys._getframe()
    while f is not None:
        ours.add(f.f_code)
        f = f.f_back
    del f
    _run(command, keep, ours)


if __name__ == "etcdrun_standby":  # run by LOADER (argv[1] is this file), never imported
    main(sys.argv[2:])
