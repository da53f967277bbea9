"""Fork safety of the etcd client: children forked while the parent's client is busy, counted by
how they end.

Why this benchmark: ``EtcdClient`` promises that a client made before ``fork()`` works in the
child (rendezvous/client/client.py). A child that inherits gRPC's C core while one of the
parent's threads is inside a call can abort in its first request (``ev_epoll1_linux.cc``,
SIGABRT) or hang on a lock; rendezvous/client/forks.py keeps the calls out of gRPC across a fork.
Failures are rare per fork, so the suite's short version (tests/client/test_client_fork.py)
makes them likely with a busy parent, and this one counts them over many forks:
bench/results/fork_safety.md has the figures.

What it does: the parent's client keeps a lease alive (TTL ``--ttl``: a keep-alive every TTL/3),
with ``--watch`` holds a watch open, and with ``--busy N`` runs N threads making requests; then
the parent forks ``--forks`` children one after another, each making one request on the inherited
client and exiting. A child ends ``ok``, ``error`` (its request raised), ``abort`` (SIGABRT),
another signal, or ``hung`` (killed after ``--hang-after`` seconds). The last line, for scripts,
is ``aborts=N hung=M``.

Usage (from the repository root): ``python -m bench.fork_safety [--forks 500] [--endpoints
host:port] [--ttl 1] [--watch] [--busy [N]] [--hang-after 10] [--stderr]``. Without
``--endpoints`` it starts (and removes) its own single-member etcd on random ports. It imports
only etcdrun and the standard library.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections import Counter

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.localetcd import LocalEtcd

KEY = "/etcdrun-bench/fork-safety"  # not leased: a late keep-alive must not look like a failure


def _child(client: EtcdClient, quiet: bool) -> None:
    """One request on the inherited client, then leave without running the parent's atexit."""
    if quiet:  # gRPC's abort message goes to fd 2; the count is what this script reports
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    code = 3
    try:
        client.get(KEY)
        code = 0
    except BaseException:
        traceback.print_exc()  # to fd 2: shown with --stderr
    finally:
        os._exit(code)


def _outcome(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return "abort" if sig == signal.SIGABRT else f"signal {signal.Signals(sig).name}"
    return "ok" if os.WEXITSTATUS(status) == 0 else "error"


def reap(pid: int, hang_after: float) -> str:
    """The child's outcome; ``hung`` (and killed) when it is still there after ``hang_after``
    seconds: a child that deadlocks on a lock held at the fork is a failure too.
    """
    fd = os.pidfd_open(pid)  # readable once the child has exited
    try:
        exited, _, _ = select.select([fd], [], [], hang_after)
    finally:
        os.close(fd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hung"
    return _outcome(os.waitpid(pid, 0)[1])


def _busy(client: EtcdClient, stop: threading.Event) -> None:
    """Requests back to back on the parent's client, so that forks land mid-call too."""
    while not stop.is_set():
        try:
            client.get(KEY)
        except Exception:
            time.sleep(0.01)


def run(
    endpoints: str,
    forks: int,
    ttl: int = 1,
    busy: int = 0,
    watch: bool = False,
    quiet: bool = True,
    hang_after: float = 10.0,
) -> Counter[str]:
    """Fork ``forks`` children while the parent's client is busy; their outcomes, counted."""
    client = EtcdClient(endpoints)
    stop = threading.Event()
    workers = [
        threading.Thread(target=_busy, args=(client, stop), name=f"bench-busy-{i}", daemon=True)
        for i in range(busy)
    ]
    outcomes: Counter[str] = Counter()
    try:
        client.put(KEY, b"x")
        lease = client.lease(ttl)
        if watch:
            client.watch(KEY, callback=lambda batch: None)
        for worker in workers:
            worker.start()
        for _ in range(forks):
            pid = os.fork()
            if pid == 0:
                _child(client, quiet)
            outcomes[reap(pid, hang_after)] += 1
        outcomes["keep-alives"] = lease.keepalives
    finally:
        stop.set()
        for worker in workers:
            if worker.is_alive():
                worker.join()
        client.delete(KEY)
        client.close()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forks", type=int, default=500)
    ap.add_argument("--endpoints", help="an etcd to use (default: start one here)")
    ap.add_argument("--ttl", type=int, default=1, help="lease TTL, s (keep-alive every TTL/3)")
    ap.add_argument("--watch", action="store_true", help="the parent's client holds a watch")
    ap.add_argument("--busy", type=int, nargs="?", const=1, default=0, help="request threads")
    ap.add_argument("--hang-after", type=float, default=10.0, help="s before a child is hung")
    ap.add_argument("--stderr", action="store_true", help="keep the children's stderr")
    args = ap.parse_args(argv)
    opts = (args.forks, args.ttl, args.busy, args.watch, not args.stderr, args.hang_after)
    started = time.monotonic()
    if args.endpoints:
        counts = run(args.endpoints, *opts)
    else:
        with LocalEtcd() as etcd:
            counts = run(etcd.endpoints, *opts)
    keepalives = counts.pop("keep-alives")
    print(
        f"{args.forks} forks in {time.monotonic() - started:.1f} s (ttl {args.ttl} s, "
        f"{keepalives} keep-alives, watch {args.watch}, busy threads {args.busy}): "
        f"{dict(sorted(counts.items()))}"
    )
    print(f"aborts={counts['abort']} hung={counts['hung']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
