"""The agent's side of fencing its workers from outside, and of sweeping their process trees.

Why: the agent fences its own workers when its lease is presumed lost (it kills them, no
grace), but a frozen agent fences nothing, and a killed one leaves its workers' descendants
behind. The warden (warden.py) is the guard outside the agent's process; this module feeds it:
each worker's pidfd as it starts, the lease's fence deadline while workers run (pushed by the
rendezvous' liveness port after every keep-alive), and ``inf`` when none run. It also
tags every worker's environment, so that after every stop whatever the workers started — double
forked, setsid'd — is found and killed (``warden.sweep``).

Pausing, not killing, at the fence deadline: an etcd leader election longer than the margin
left the leases alive (etcd renews them when a new leader takes over) yet restarted the whole
job. So while the lease is in doubt the workers are paused (SIGSTOP of every tagged process: a
stopped process does not talk, S4 holds) by the agent (``follow()``) and by the warden (for a
frozen agent), resumed when etcd answers with TTL > 0 and the round is unchanged, and killed
just before etcd could expire the lease (TTL after the last acknowledged keep-alive was sent,
less ``KILL_LEAD``).

Why a lead: killed at the very moment the lease could expire, a worker is gone only after it.
SIGKILL takes a while to end a process that imported torch (every standby worker) on a busy
machine, so a keep-alive acknowledged just before an etcd cut left such workers alive past the
moment etcd could expire the lease (tests/deploy/test_netns.py, the long outage; figures in
bench/results/figures.md, 'Design notes' figures', S4). The workers are paused already: killing them
``KILL_LEAD`` sooner loses only an answer that comes in that window.

Without the warden, a stopped agent's workers lived on beside the survivors' new workers of the same
RANK, and a killed agent's workers' children outlived it, adopted by init
(bench/results/figures.md). Linux only (pidfds); elsewhere the agent
fences its workers itself and nothing here runs.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable

from etcdrun.agent.fencing import warden
from etcdrun.rendezvous.api import LeaseReading, Liveness, LivenessPort

log = logging.getLogger("etcdrun.agent")
KILL_LEAD = 0.1  # s: the warden kills this long before etcd could expire the lease (docstring)


def kill_after(margin: float) -> float:
    """From the pause (the fence deadline) to the warden's kill."""
    return margin - min(KILL_LEAD, margin / 2)


def new_tag() -> str:
    """A node's tag: what its workers' (and standbys') environment carries for the sweep."""
    return os.urandom(6).hex()


def node_env(tag: str) -> dict[str, str]:
    return {warden.TAG_VAR: tag}


class Fencing:
    """One per agent: ``start()`` (the warden), per attempt ``started()``/``stopped()``,
    ``fenced()`` to read the warden's word, ``close()``.
    """

    def __init__(self, liveness: LivenessPort, tag: str | None = None) -> None:
        self.tag = tag or new_tag()
        self._liveness = liveness
        self._link: warden.Link | None = None
        self._running = False
        self._fenced = False
        self.paused_at: float | None = None  # monotonic: when the agent paused the workers
        self._wake: Callable[[], None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What every worker's environment carries, for the sweep to find its whole tree."""
        return node_env(self.tag)

    def start(self, wake: Callable[[], None]) -> None:
        """Start the warden; ``wake`` runs after every keep-alive and when the lease falls in
        doubt (the agent then calls ``follow()``).
        """
        self._wake = wake
        self._unsubscribe = self._liveness.subscribe(self._on_reading)
        if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
            return
        try:
            self._link = warden.Link(self.tag)
        except OSError as e:  # the agent still fences itself; say that this guard is off
            log.warning("could not start the warden (%s): a frozen agent cannot be fenced", e)

    def spawned(self, pidfd: int) -> None:
        """A worker was started (called on the thread that reaps workers, before any reap:
        the pidfd names exactly that process).
        """
        if self._link is not None:
            self._link.worker(pidfd)

    def started(self) -> None:
        """This attempt's workers run: from now on a silent agent gets them killed."""
        self._fenced, self._running = False, True
        self._deadline(self._liveness.read())

    def stopped(self, sweep: bool = True, skip: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """The workers are gone: no deadline while none run; kill what they left behind (but
        ``skip``: the waiting standbys, which carry the tag too).
        """
        self._running, self.paused_at = False, None
        if self._link is not None:
            self._link.deadline(math.inf)
            self._link.new_attempt()
        return warden.sweep(self.tag, skip=skip) if sweep and sys.platform == "linux" else 0

    def fenced(self) -> bool:
        """Whether the warden killed the workers because this agent fell silent (sticky for
        the attempt: it is read before the workers' exits are taken for failures).
        """
        if not self._fenced and self._link is not None:
            self._fenced = self._link.fenced()
            if self._fenced:  # our place is gone with them, even if the lease lives
                self._liveness.give_up("its warden fenced the workers (the agent was silent)")
        return self._fenced

    def follow(self) -> bool:
        """The agent's own pause and resume (it is not frozen): pause the workers' trees while
        the lease is in doubt, resume them once etcd answered again (the caller has checked
        that the round did not change). True: in doubt where nothing can pause them (no
        /proc to find the trees): fence now, as before the pause existed.
        """
        if not self._running:
            return False
        in_doubt = self._liveness.read().state is Liveness.IN_DOUBT
        if sys.platform != "linux":
            return in_doubt
        if in_doubt and self.paused_at is None:
            self.paused_at = time.monotonic()
            warden.sweep(self.tag, signal.SIGSTOP)
            log.warning(
                "etcd has not answered keep-alives past the fence deadline: workers paused "
                "(SIGSTOP) until it answers; killed before the lease could expire (in %.1f s)",
                kill_after(self._liveness.read().margin),
            )
        elif self.paused_at is not None and not in_doubt:
            self.resume("etcd answered: the lease is alive and the round unchanged")
        return False

    def resume(self, why: str) -> None:
        """SIGCONT the paused trees (the lease is alive, or a forwarded signal must reach them)."""
        if self.paused_at is None:
            return
        took, self.paused_at = time.monotonic() - self.paused_at, None
        warden.sweep(self.tag, signal.SIGCONT)
        log.warning("%s: workers resumed after %.2f s paused", why, took)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._link is not None:
            self._link.close()  # the warden sweeps once more and leaves
            self._link = None

    def _on_reading(self, reading: LeaseReading) -> None:
        """A backend thread, after every keep-alive and when the lease falls in doubt: move
        the warden's deadlines (a keep-alive answered: only a live reading carries a newer
        pair, and the warden takes a newer pair for etcd's answer), then wake the agent (it
        calls ``follow()``).
        """
        if reading.state is Liveness.LIVE:
            self._deadline(reading)
        if self._wake is not None:
            self._wake()

    def _deadline(self, reading: LeaseReading) -> None:
        at = reading.deadline
        if self._running and self._link is not None and at is not None:
            self._link.deadline(at, at + kill_after(reading.margin))


__all__ = ["Fencing"]
