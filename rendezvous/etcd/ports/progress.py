"""The etcd backend's progress port: this node's pace, one leased key (design.md §2, §4d).

Why a key per node on the session lease: ``etcdrun status`` reads every node's pace in the
one transaction it already makes, the leader's straggler rule watches one prefix, and a node
that goes takes its record with it (a later incarnation is a new node id). The agent writes at
most once per 5 s and not at all while nothing moves (agent/hang/pace.py), so the cost is
bounded per node and nothing is written for a job that does not report progress.

Connection loss: a write that fails is logged once and dropped; the next one, seconds later,
carries the newer pace anyway.
"""

from __future__ import annotations

import logging
import time

from etcdrun.rendezvous.api import PaceReading, ProgressPort
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.stragglers import Pace
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation

log = logging.getLogger("etcdrun.rendezvous")


class EtcdProgress(ProgressPort):
    """Puts ``progress/<node_id>`` under the current session's lease; owns nothing."""

    def __init__(self, ctx: RunContext, incarnation: Incarnation) -> None:
        self._ctx = ctx
        self._now = incarnation
        self._failing = False

    def enabled(self) -> bool:
        return True

    def publish(self, reading: PaceReading) -> None:
        session = self._now.session
        if session is None:  # between incarnations: no place to speak for
            return
        pace = Pace(
            session.node_id,
            reading.round,
            reading.step,
            round(reading.step_rate, 3),
            round(reading.rate, 3),
            int(time.time() * 1000),
        )
        try:
            self._ctx.client.put(
                self._ctx.keys.pace(session.node_id), pace.encode(), session.lease_id
            )
        except EtcdError as e:
            if not self._failing:
                log.warning("could not publish this node's pace (round %d): %s", reading.round, e)
            self._failing = True
            return
        self._failing = False


__all__ = ["EtcdProgress"]
