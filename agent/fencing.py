"""The agent's side of fencing its workers from outside, and of sweeping their process trees.

Why: the agent fences its own workers when its lease is presumed lost (it kills them, no
grace), but a frozen agent fences nothing, and a killed one leaves its workers' descendants
behind. The warden (warden.py) is the guard outside the agent's process; this module feeds it:
each worker's pidfd as it starts, the lease's fence deadline while workers run (pushed by the
rendezvous after every keep-alive: ``on_fence_deadline``), and ``inf`` when none run. It also
tags every worker's environment, so that after every stop whatever the workers started — double
forked, setsid'd — is found and killed (``warden.sweep``).

Measured before: SIGSTOP of an agent for 8 s left two live processes per RANK for 5.6 s; after
kill -9 of an agent a grandchild survived with parent 1. Linux only (pidfds); elsewhere the
agent fences itself as before and nothing here runs.
"""

from __future__ import annotations

import logging
import math
import os
import sys

from etcdrun.agent import warden
from etcdrun.rendezvous.api import RendezvousHandler

log = logging.getLogger("etcdrun.agent")


class Fencing:
    """One per agent: ``start()`` (the warden), per attempt ``started()``/``stopped()``,
    ``fenced()`` to read the warden's word, ``close()``."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self.tag = os.urandom(6).hex()
        self._h = handler
        self._link: warden.Link | None = None
        self._running = False
        self._fenced = False
        self._unsubscribe = None

    @property
    def env(self) -> dict[str, str]:
        """What every worker's environment carries, for the sweep to find its whole tree."""
        return {warden.TAG_VAR: self.tag}

    def start(self) -> None:
        if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
            return
        try:
            self._link = warden.Link(self.tag)
        except OSError as e:  # the agent still fences itself; say that this guard is off
            log.warning("could not start the warden (%s): a frozen agent cannot be fenced", e)
            return
        self._unsubscribe = self._h.on_fence_deadline(self._deadline)

    def spawned(self, pidfd: int) -> None:
        """A worker was started (called on the thread that reaps workers, before any reap:
        the pidfd names exactly that process)."""
        if self._link is not None:
            self._link.worker(pidfd)

    def started(self) -> None:
        """This attempt's workers run: from now on a silent agent gets them killed."""
        self._fenced, self._running = False, True
        deadline = self._h.fence_deadline()
        if self._link is not None and deadline is not None:
            self._link.deadline(deadline)

    def stopped(self, sweep: bool = True, skip: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """The workers are gone: no deadline while none run; kill what they left behind (but
        ``skip``: the waiting standbys, which carry the tag too)."""
        self._running = False
        if self._link is not None:
            self._link.deadline(math.inf)
            self._link.new_attempt()
        return warden.sweep(self.tag, skip=skip) if sweep and sys.platform == "linux" else 0

    def fenced(self) -> bool:
        """Whether the warden killed the workers because this agent fell silent (sticky for
        the attempt: it is read before the workers' exits are taken for failures)."""
        if not self._fenced and self._link is not None:
            self._fenced = self._link.fenced()
        return self._fenced

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._link is not None:
            self._link.close()  # the warden sweeps once more and leaves
            self._link = None

    def _deadline(self, at: float) -> None:
        if self._running and self._link is not None:
            self._link.deadline(at)


__all__ = ["Fencing"]
