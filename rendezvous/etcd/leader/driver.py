"""The per-session driver: a small actor that owns the round watch, the election and, when this
agent leads, the leader's term.

Why an actor with a thread of its own: watch callbacks must return at once (they run on the
client's single watch thread), while the leader's work does etcd round trips. Callbacks only post
typed messages here; the driver drains its mailbox, applies every message, then decides once — so
a burst of N join events costs one decision, not N. Nothing here holds a reference to the
handler: the driver borrows the run context and the session it was given.

Connection loss: an etcd error inside a term ends the term (the leader's caches may have missed
events); the election runs again and a new term re-reads a consistent snapshot. A lost session
ends everything: the owner opens a new session with a new driver.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from etcdrun.rendezvous.client import EtcdError, WatchBatch
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.round_watch import RoundWatch
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader.election import Election
from etcdrun.rendezvous.etcd.leader.status import LeaderStatus
from etcdrun.rendezvous.etcd.leader.term import Leader

log = logging.getLogger(__name__)


# ---- the mailbox's messages ---------------------------------------------------------------------
@dataclass(frozen=True)
class Elect:
    """Run the election (at start; when the predecessor's key went away)."""


@dataclass(frozen=True)
class RoundChanged:
    """The round key changed: a leader decides again."""


@dataclass(frozen=True)
class RoundWatchEnded:
    """The round watch ended (compaction, refusal): re-read the key and watch again."""


@dataclass(frozen=True)
class LeaderEvents:
    """A batch of the leader's agents/ and rounds/ watches."""

    batch: WatchBatch


@dataclass(frozen=True)
class SessionLost:
    """The lease is gone: stop leading, stop everything but the mailbox."""


@dataclass(frozen=True)
class Stop:
    """End the driver's thread."""


Message = Elect | RoundChanged | RoundWatchEnded | LeaderEvents | SessionLost | Stop


class Driver:
    """One per session. ``start()`` (reads the round, starts the thread) → ``post`` → ``stop()``."""

    def __init__(self, ctx: RunContext, session: Session) -> None:
        self._ctx = ctx
        self._session = session
        self._policy = ctx.policy
        self._mailbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._round_watch = RoundWatch(
            ctx,
            on_change=lambda: self.post(RoundChanged()),
            on_end=lambda: self.post(RoundWatchEnded()),
        )
        self._election = Election(session, ctx.keys.agents, lambda: self.post(Elect()))
        self._leader: Leader | None = None
        self._failures = 0  # decisions in a row that raised: the policy's backoff index
        self._stopped = False
        self.status: LeaderStatus | None = None  # published by reference swap: read anywhere
        self._thread = threading.Thread(
            target=self._run, name=f"rdzv-{session.node_id}", daemon=True
        )
        self._handlers = {
            Elect: self._on_elect,
            RoundChanged: self._on_nothing,
            RoundWatchEnded: self._on_round_watch_ended,
            LeaderEvents: self._on_leader_events,
            SessionLost: self._on_session_lost,
            Stop: self._on_stop,
        }

    def start(self) -> None:
        """Read the round key (on the caller's thread: the caller decides from it next), then
        run the election and the leader on the driver's thread.
        """
        self._round_watch.start()
        self.post(Elect())
        self._thread.start()

    def post(self, msg: Message) -> None:
        if type(msg) not in self._handlers:
            raise TypeError(f"the driver takes driver messages, not {msg!r}")
        self._mailbox.put(msg)

    @property
    def is_leader(self) -> bool:
        return self._leader is not None

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        wake_at: float | None = None
        while not self._stopped:
            batch = self._drain(wake_at)
            try:
                for msg in batch:
                    self._handlers[type(msg)](msg)
                    if self._stopped:
                        return
                wake_at = self._decide()
                self._failures = 0
            except RendezvousError as e:
                self._failures += 1
                log.error("rendezvous driver: %s", e)
                wake_at = time.monotonic() + self._policy.backoff_limit(self._failures)
            except EtcdError as e:
                # Whatever broke (a call, or a leader watch ended by compaction), start the
                # election over: a new leader term re-reads a consistent snapshot.
                self._failures += 1
                log.warning("rendezvous driver: etcd: %s; retrying", e)
                self._restart_term()
                wake_at = None
            except Exception:  # a bug: say it loudly, then start the term over — never go quiet
                self._failures += 1
                log.exception("rendezvous driver %s: unexpected error", self._session.node_id)
                self._restart_term()
                wake_at = time.monotonic() + self._policy.backoff_limit(self._failures)

    def _drain(self, wake_at: float | None) -> list[Message]:
        """Every message now waiting, after blocking for the first until ``wake_at``."""
        timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
        try:
            msgs = [self._mailbox.get(timeout=timeout)]
        except queue.Empty:
            msgs = []
        while True:
            try:
                msgs.append(self._mailbox.get_nowait())
            except queue.Empty:
                return msgs

    def _decide(self) -> float | None:
        if self._leader is None or self._session.lost.is_set():
            return None
        wake_at = self._leader.act(time.monotonic())
        self.status = self._leader.status
        return wake_at

    # ---- handlers ----------------------------------------------------------------------------
    def _on_elect(self, _msg: Elect) -> None:
        if self._session.lost.is_set() or self._leader is not None:
            return
        if not self._election.check():
            return
        leader = Leader(
            self._ctx,
            self._session,
            deliver=lambda b: self.post(LeaderEvents(b)),
            departed=self._election.departed,
        )
        self._leader = leader  # before start(): its first batches may arrive at once
        leader.start()

    def _on_nothing(self, _msg: Message) -> None:
        """The decision after the batch is all a round change needs."""

    def _on_round_watch_ended(self, _msg: RoundWatchEnded) -> None:
        self._round_watch.restart()

    def _on_leader_events(self, msg: LeaderEvents) -> None:
        if self._leader is not None:  # a batch of an ended term is dropped
            self._leader.on_batch(msg.batch)

    def _on_session_lost(self, _msg: SessionLost) -> None:
        self._end_term()
        self._election.close()

    def _on_stop(self, _msg: Stop) -> None:
        self._end_term()
        self._election.close()
        self._round_watch.cancel()
        self._stopped = True

    def _restart_term(self) -> None:
        self._end_term()
        self._election.close()
        self._mailbox.put(Elect())

    def _end_term(self) -> None:
        if self._leader is not None:
            self._leader.stop()
            self._leader = None
        self.status = None

    # ---- the end -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the thread (and every watch it owns). Idempotent; bounded by the policy."""
        if not self._thread.is_alive():
            self._round_watch.cancel()
            return
        self._mailbox.put(Stop())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._policy.thread_stop_timeout)
            if self._thread.is_alive():  # stuck in an etcd call past every timeout: say so
                log.error("rendezvous driver %s did not stop in time", self._thread.name)


__all__ = [
    "Driver",
    "Elect",
    "LeaderEvents",
    "Message",
    "RoundChanged",
    "RoundWatchEnded",
    "SessionLost",
    "Stop",
]
