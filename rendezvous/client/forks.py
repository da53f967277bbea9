"""fork() and gRPC: no call of this process's etcd clients is inside gRPC when the process forks.

Why: a fork copies gRPC's C core as it is at that instant. When another thread is inside a call
(polling for its answer, or holding one of the core's locks), the child inherits that state
without the thread: its own first request aborts (``ev_epoll1_linux.cc ... g_active_poller``,
SIGABRT) or waits forever on the lock. gRPC's own fork handlers (on by default in the grpcio we
run; ``GRPC_ENABLE_FORK_SUPPORT=0`` turns them off, and then children hang) restart the core in
the child, but they cannot make a thread that is inside a call leave it; its poll strategies
(``GRPC_POLL_STRATEGY=poll``) change which check fails, not whether one does. So the client keeps
its own calls out of gRPC across a fork. Measured with bench/fork_safety.py
(bench/results/fork_safety.md).

How: every unary call and keep-alive tick passes the gate (``call``), and a watch stream also
registers to be cancelled (``stream``). Just before ``os.fork()`` the gate closes: calls not yet
started wait, open watch streams are cancelled (the watch thread resumes them from the last
revision once the gate opens: no event lost, no failover), and the fork waits, at most
``DRAIN_S``, for the calls inside to return. After the fork the gate opens again in the parent;
the child starts with a fresh gate, and with fresh channels (Transport drops the parent's when
the pid changes).

A fork from inside a call (a watch callback that forks) does not wait for itself. A fork that
gives up waiting goes ahead, as it would have without the gate (``unsafe_forks`` counts them).
``subprocess`` is untouched: it runs no Python fork handler, and its child execs at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

DRAIN_S = 5.0  # at most this long a fork waits for calls to return (a request's own deadline)


class ForkGate:
    """Counts the threads inside gRPC; holds new calls, and cancels streams, across a fork."""

    def __init__(self) -> None:
        self._reset()
        self.unsafe_forks = 0  # forks that went ahead with a call still inside

    def _reset(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._inside = 0
        self._closed = False
        self._streams: dict[int, Any] = {}  # id(call) -> call, to cancel before a fork
        self._cancelled: set[int] = set()  # ids of streams cancelled for a fork
        self._depth = threading.local()  # this thread's calls inside the gate

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around anything that enters gRPC: waits while a fork is under way."""
        depth = getattr(self._depth, "n", 0)
        with self._cv:
            while self._closed and depth == 0:
                self._cv.wait()
            self._inside += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            with self._cv:
                self._inside -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def stream(self, call: Any) -> Iterator[None]:
        """Inside ``call()``: a long stream, cancelled before a fork rather than waited for."""
        with self._cv:
            self._streams[id(call)] = call
            closed = self._closed
        if closed:  # the fork is waiting for this thread already
            self._cancel(call)
        try:
            yield
        finally:
            with self._cv:
                self._streams.pop(id(call), None)

    def cancelled_for_fork(self, call: Any) -> bool:
        """Whether ``call`` ended because a fork cancelled it (not a broken stream); once."""
        with self._cv:
            if id(call) in self._cancelled:
                self._cancelled.discard(id(call))
                return True
            return False

    def _cancel(self, call: Any) -> None:
        with self._cv:
            self._cancelled.add(id(call))
        call.cancel()

    # ---- os.register_at_fork ------------------------------------------------------------------
    def before_fork(self) -> None:
        mine = getattr(self._depth, "n", 0)
        with self._cv:
            self._closed = True
            streams = list(self._streams.values())
        for call in streams:
            self._cancel(call)
        with self._cv:
            if not self._cv.wait_for(lambda: self._inside <= mine, timeout=DRAIN_S):
                self.unsafe_forks += 1
                log.warning(
                    "fork: %d etcd call(s) still inside gRPC after %.0f s; forking anyway",
                    self._inside - mine,
                    DRAIN_S,
                )

    def after_fork_in_parent(self) -> None:
        with self._cv:
            self._closed = False
            self._cv.notify_all()

    def after_fork_in_child(self) -> None:
        """The parent's threads are not here: nothing of theirs is inside, nothing to cancel;
        only the forking thread's own calls, which it leaves again in the child.
        """
        mine = getattr(self._depth, "n", 0)
        self._reset()
        self._inside = mine
        self._depth.n = mine


GATE = ForkGate()
os.register_at_fork(
    before=GATE.before_fork,
    after_in_parent=GATE.after_fork_in_parent,
    after_in_child=GATE.after_fork_in_child,
)

__all__ = ["DRAIN_S", "GATE", "ForkGate"]
