"""The leader's straggler recipe: name the slow node of a round, and with ``evict_stragglers``
ask it to leave through the drain path (design.md §4d).

Why the leader and not every node: N nodes each watching N records is O(N²) events per period;
the leader already watches the run and receives each record once (its term snapshots and
watches ``progress/`` beside agents/, rounds/ and cooldown/, and hands the records here). Why a
drain and not a round of the leader's own: a drained node leaves as after ``etcdrun drain``
(no restart charged, it exits 0, a hot spare takes its place at the next round), and the drain
path already checks that the job keeps its min nodes; refused, the node is named and stays,
and is asked again at its next pace (a spare may have come meanwhile).

Borrows the run context and the leader's session; owns the records of the current round and
what it named and evicted, once per node and round.
"""

from __future__ import annotations

import logging

from etcdrun.rendezvous.etcd.core import drain_request
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.core.stragglers import Pace, judge

log = logging.getLogger(__name__)


class Stragglers:
    """``put``/``remove`` from the leader's watch, then ``act(round)`` on the driver's thread."""

    def __init__(self, ctx: RunContext, session: Session) -> None:
        self._ctx = ctx
        self._session = session
        self._paces: dict[str, Pace] = {}
        self._named: set[tuple[int, str]] = set()
        self._evicted: set[str] = set()
        self._refused: set[str] = set()  # said once; asked again at its next pace
        self._dirty = False

    def put(self, node: str, value: bytes) -> None:
        pace = Pace.decode(value)
        if pace is None:
            log.error("leader %s: ignoring an unreadable pace of %s", self._session.node_id, node)
            return
        self._paces[node] = pace
        self._dirty = True

    def remove(self, node: str) -> None:
        self._paces.pop(node, None)

    def act(self, r: Round | None) -> None:
        """Judge the frozen round's members once their paces changed; name each straggler
        once per round and, when asked to, evict it (an etcd error propagates: the next
        batch judges again, and a node already evicted is not asked twice).
        """
        cfg = self._ctx.config
        if (
            not self._dirty
            or r is None
            or r.phase is not Phase.FROZEN
            or not cfg.straggler_fraction
        ):
            return
        members = {m.node_id for m in r.members}
        paces = [p for n, p in self._paces.items() if n in members and p.round == r.number]
        verdict = judge(paces, cfg.straggler_fraction)
        by_node = {p.node: p for p in paces}
        for node in verdict.stragglers:
            pace = by_node[node]
            if (r.number, node) not in self._named:
                self._named.add((r.number, node))
                self._name(r.number, pace, verdict.median or 0.0)
            if cfg.evict_stragglers and node not in self._evicted:
                self._evict(r.number, pace)
        self._dirty = False

    def _name(self, number: int, pace: Pace, median: float) -> None:
        fraction = self._ctx.config.straggler_fraction
        log.warning(
            "run %s round %d: node %s is a straggler: %.2f steps per CPU-second, below %g of "
            "the median %.2f",
            self._ctx.keys.run_id,
            number,
            pace.node,
            pace.rate,
            fraction,
            median,
        )
        self._ctx.events.emit(
            "straggler_named",
            round=number,
            straggler=pace.node,
            rate=pace.rate,
            median=round(median, 3),
            fraction=fraction,
            step=pace.step,
        )

    def _evict(self, number: int, pace: Pace) -> None:
        by = f"straggler eviction (leader {self._session.node_id})"
        try:
            asked = drain_request.request(self._ctx.client, self._ctx.keys, pace.node, by)
        except drain_request.DrainRefused as e:  # it stays, until a spare gives the job room
            if pace.node not in self._refused:
                self._refused.add(pace.node)
                log.warning("straggler %s not evicted yet: %s", pace.node, e)
            return
        self._evicted.add(pace.node)
        log.warning(
            "run %s round %d: asked straggler %s to leave (%d node(s) remain, min %d)",
            self._ctx.keys.run_id,
            number,
            pace.node,
            asked.remaining,
            asked.min_nodes,
        )
        self._ctx.events.emit(
            "straggler_evicted",
            round=number,
            straggler=pace.node,
            remaining=asked.remaining,
            already=asked.already,
        )


__all__ = ["Stragglers"]
