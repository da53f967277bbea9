"""RoundView: the one owner of what this node knows of the round key, and of its place in it.

Why an object of its own: the cached round, its raw message, the condition variable that wakes
waiters and ``membership_changed`` are written by the watch thread, the driver thread and the
agent's thread alike. Held as loose attributes of the handler they could change apart; here
they change together, under one lock, and every read is thread-safe.

Writers: the round watch (every committed version, in commit order) and this node's own
successful writes (applied before their watch event arrives). A version older than the one held
is ignored (S5: decisions use revisions, never clocks). Readers: the agent's thread
(``next_rendezvous``, the exit barrier), the driver (the leader decides from ``current()``) and
the status line.

``membership_changed`` is set when the round this node runs in (``accept``) is superseded, or
when ``interrupt`` says the session is lost; listeners hear the same, so the agent can wait on one
event for its workers and its membership alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.etcd.core.protocol import Round

log = logging.getLogger(__name__)


class RoundView:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._round: Round | None = None
        self._msg: st.RoundState | None = None  # the raw value of ``_round`` when read from etcd
        self._running: Round | None = None  # the round this node's workers run in
        self._accepted_rev = 0  # the last round accepted: a stale cached copy is never rerun
        self._accepted_number = 0  # ... nor a rewrite of it (a repair): S5, found by the chaos soak
        self._corrupt: tuple[int, str] | None = None  # (mod_revision, why) of an unreadable value
        self._listeners: list[Callable[[], None]] = []
        self.membership_changed = threading.Event()

    # ---- reads ---------------------------------------------------------------------------------
    def current(self) -> Round | None:
        with self._cond:
            return self._round

    def message(self) -> st.RoundState | None:
        with self._cond:
            return self._msg

    def running(self) -> Round | None:
        with self._cond:
            return self._running

    def placed(self) -> Round | None:
        """The current round as this node knows it: the round it runs in when that is the
        current one (a sharded round's header lists nobody; the running copy holds this node's
        shard), else the current round.
        """
        with self._cond:
            run, r = self._running, self._round
            if run is not None and r is not None and run.mod_revision == r.mod_revision:
                return run
            return r

    def reason(self) -> str:
        """Why the current round was opened ("node(s) left: ...", "worker rank 3 failed")."""
        msg = self.message()
        return msg.reason if msg is not None else ""

    def closed_state(self) -> st.RoundState | None:
        """The CLOSED round record (outcome, failure) once the run is closed, else None."""
        msg = self.message()
        return msg if msg is not None and msg.phase == st.CLOSED else None

    def corruption(self) -> tuple[int, str] | None:
        """(mod_revision, problem) while the round key holds a value nobody can read."""
        with self._cond:
            return self._corrupt

    def is_fresh(self, r: Round) -> bool:
        """True unless ``r`` is (a copy or a rewrite of) a round this node already accepted."""
        with self._cond:
            return r.mod_revision > self._accepted_rev and r.number > self._accepted_number

    # ---- writes --------------------------------------------------------------------------------
    def apply(self, r: Round, msg: st.RoundState | None = None) -> None:
        """A version of the round key: from the watch (with its message) or from our own write
        (without: its watch event brings the message a moment later).
        """
        with self._cond:
            cur = self._round
            if cur is not None and r.mod_revision < cur.mod_revision:
                return
            if cur is not None and r.mod_revision == cur.mod_revision and msg is None:
                return
            if msg is not None or cur is None or r.mod_revision > cur.mod_revision:
                self._msg = msg
            self._round = r
            if self._corrupt is not None and r.mod_revision > self._corrupt[0]:
                self._corrupt = None
            self._changed_locked()

    def corrupt(self, mod_revision: int, problem: str) -> None:
        """The round key now holds a value that does not decode: keep the last good copy (the
        leader restores it) and remember the bad revision (the fence of that repair).
        """
        with self._cond:
            if self._round is not None and mod_revision <= self._round.mod_revision:
                return
            self._corrupt = (mod_revision, problem)
            self._cond.notify_all()

    def deleted(self) -> None:
        """The round key is gone (the closed marker expired, or the run was cleaned up)."""
        with self._cond:
            self._round, self._msg, self._corrupt = None, None, None
            self._changed_locked()

    # ---- this node's place ---------------------------------------------------------------------
    def begin(self) -> None:
        """A new ``next_rendezvous``: no round runs until the next ``accept``."""
        with self._cond:
            self._running = None
            self.membership_changed.clear()

    def accept(self, r: Round) -> None:
        """This node's workers now run in ``r``; if the key already moved on, that counts."""
        with self._cond:
            self._running = r
            self._accepted_rev = r.mod_revision
            self._accepted_number = r.number
            self._changed_locked()

    def interrupt(self) -> None:
        """The session is lost: whatever ran is superseded, and every waiter wakes up."""
        with self._cond:
            self._set_changed_locked()
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter to re-check its own stop condition (a leave, a shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` whenever ``membership_changed`` is set; return an unsubscribe."""
        with self._cond:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._cond:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def wait(self, seen: Round | None, deadline: float, stop: Callable[[], bool]) -> bool:
        """Block until the round is no longer ``seen``, ``stop()`` holds (checked at every
        wake-up: ``interrupt`` wakes us) or the monotonic ``deadline`` passes (then False).
        """
        with self._cond:
            while self._round is seen and not stop():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # ---- internals -----------------------------------------------------------------------------
    def _changed_locked(self) -> None:
        run, r = self._running, self._round
        if run is not None and (r is None or r.number != run.number or r.phase is not run.phase):
            self._set_changed_locked()
        self._cond.notify_all()

    def _set_changed_locked(self) -> None:
        self.membership_changed.set()
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # a listener's bug must not stop the watch thread
                log.exception("membership listener failed")


__all__ = ["RoundView"]
