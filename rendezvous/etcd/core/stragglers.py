"""Who is a straggler: the pure rule over the nodes' published pace (design.md §4d).

Why not steps per second: in synchronous training every rank completes its steps at the same
rate, since the fast ones wait for the slow one in ``all_reduce``. What differs is each rank's
own work per step. On CPU (gloo) a rank waiting in a collective sleeps, so a worker's CPU time
per step is its own work: a node's ``rate`` is the steps per CPU-second of its slowest local
worker (agent/hang/pace.py measures it). A node is a straggler when its rate is below
``fraction`` of the median rate of the round's nodes.

Why at least ``MIN_NODES`` rates: with two, the median is their mean, and a node a third slower
than its only peer would be named. Why lag beside it: the newest step in the job less a node's
own says how far behind it is; in synchronous training it stays small even for a straggler (the
others wait), so it names nobody by itself.

The record is one small JSON value per node, ``progress/<node_id>`` (rendezvous/etcd/core/keys.py),
on the node's session lease; ``Pace`` is its one reader and writer.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

MIN_NODES = 3  # rates needed before anyone is named


@dataclass(frozen=True)
class Pace:
    """One node's published pace in one round: ``step`` (its slowest worker's last step),
    ``step_rate`` (steps per wall second), ``rate`` (steps per CPU-second of its slowest
    worker), ``at_unix_ms`` (when it was measured, the node's clock: for people only).
    """

    node: str
    round: int
    step: int
    step_rate: float
    rate: float
    at_unix_ms: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> Pace | None:
        """The record, or None when it is not one (written by something other than etcdrun)."""
        try:
            d = json.loads(value)
            return cls(
                str(d["node"]),
                int(d["round"]),
                int(d["step"]),
                float(d["step_rate"]),
                float(d["rate"]),
                int(d.get("at_unix_ms", 0)),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Judgement:
    """The rule's answer for one round: the median rate (None with fewer than ``MIN_NODES``
    rates), the stragglers (slowest first), and each node's lag in steps.
    """

    median: float | None
    stragglers: tuple[str, ...]
    lag: dict[str, int]


def judge(paces: Iterable[Pace], fraction: float) -> Judgement:
    """Judge one round's paces; a ``fraction`` of 0 names nobody."""
    got = list(paces)
    newest = max((p.step for p in got), default=0)
    lag = {p.node: max(0, newest - p.step) for p in got}
    rated = [p for p in got if p.rate > 0]
    if len(rated) < MIN_NODES:
        return Judgement(None, (), lag)
    median = statistics.median(p.rate for p in rated)
    slow = sorted((p for p in rated if p.rate < fraction * median), key=lambda p: p.rate)
    return Judgement(median, tuple(p.node for p in slow), lag)


__all__ = ["MIN_NODES", "Judgement", "Pace", "judge"]
