"""Whether this node can take part in the run as etcd holds it now.

Why a small object of its own: the answer depends on what this node saw before — a run it saw
live and that then closed is *its* run's end (its outcome and root cause are this node's to
report), while a run found closed at the first look is an earlier job under the same id (never
reported as ours); a round key that vanishes while the run was live means the run was aborted.
The gate remembers that, across the node's sessions, and says each fact once.
"""

from __future__ import annotations

import logging

from etcdrun.rendezvous._version import __version__
from etcdrun.rendezvous.errors import RendezvousClosedError, RendezvousStateError
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import FRESH_AFTER_ABANDONED, PROTOCOL, Phase, Round
from etcdrun.rendezvous.etcd.node import lifecycle

log = logging.getLogger(__name__)


class RunGate:
    def __init__(self, ctx: RunContext) -> None:
        self._client = ctx.client
        self._keys = ctx.keys
        self._view = ctx.view
        self.saw_live = False  # this node saw the run live (a round not CLOSED), in any session
        self._retry_noted: int | None = None  # said once: waiting to retry a failed run
        self._taken_up: int | None = None  # said once: the round that took up an abandoned run

    def check(self, r: Round | None, node: str) -> None:
        """Raise when this node cannot take part: the run closed (or ran before, under another
        job), was removed while live (aborted), or is unreadable with no good state known. A
        failed run's id waits: the leader starts it afresh (protocol.py).
        """
        ctx = dict(run_id=self._keys.run_id, node=node)
        if r is not None and r.protocol > PROTOCOL:  # a newer agent's round (design.md §3a)
            raise RendezvousStateError(
                f"round {r.number} needs rendezvous protocol {r.protocol}, and this agent "
                f"(etcdrun {__version__}) follows protocol {PROTOCOL}: run one etcdrun version "
                "on every node of the job",
                round=r.number,
                **ctx,
            )
        if r is not None and r.phase is not Phase.CLOSED:
            self.saw_live = True
            self._say_taken_up(r)
        elif r is None and self.saw_live:  # the run's state vanished while in it: aborted
            raise RendezvousClosedError(
                lifecycle.describe_vanished(self._client, self._keys), **ctx
            )
        bad = self._view.corruption()
        if bad is not None and r is None:  # nobody knows the last good state: stop
            raise RendezvousStateError(bad[1], **ctx)
        if r is None or r.phase is not Phase.CLOSED:
            return
        if self.saw_live or (r.failure is None and not r.cancelled):
            why = "the run is closed" if self.saw_live else self._before()
            ok = self.saw_live and r.failure is None and not r.cancelled
            raise RendezvousClosedError(why, succeeded=ok, round=r.number, **ctx)
        if self._retry_noted != r.number:
            self._retry_noted = r.number
            log.warning("%s; starting it afresh once its last agent has left", self._before())

    def _say_taken_up(self, r: Round) -> None:
        """One line, once, when the round is the one that took up an abandoned run: the
        rule for every end state but success is that a new job under the id starts it afresh
        (docs/rendezvous.md, "Reusing a run id"), and the user must know it was not empty.
        """
        msg = self._view.message()
        if self._taken_up == r.number or msg is None or msg.reason != FRESH_AFTER_ABANDONED:
            return
        self._taken_up = r.number
        log.warning(
            "run %s: round %d's nodes all left without closing it (etcd unreachable past their "
            "retries, or every node killed); starting it afresh as round %d, with a restart "
            "budget of its own",
            self._keys.run_id,
            r.number - 1,
            r.number,
        )

    def _before(self) -> str:
        return lifecycle.describe_closed(self._client, self._keys, self._view.message())


__all__ = ["RunGate"]
