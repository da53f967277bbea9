"""Why nodes went: what the leader says about each departure, and what a frozen round keeps.

Why: a watch shows a lease that expired and one that was revoked alike (the agent key is
deleted), yet "node 2 lost: lease expired" and "node 2 left" are different stories. An agent
that leaves on purpose marks itself first (``AgentInfo.leaving``, Session.mark_leaving); the
leader, or the election watching the leader's key, sees that put before the delete.
"""

from __future__ import annotations

from collections.abc import Mapping

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import DepartureCause
from etcdrun.rendezvous.etcd.core.protocol import Member

LIMIT = 4096  # departures remembered: only the last rounds' matter


class Departures:
    """One leader's record of how agents went: ``cause(node)`` (GONE when not seen: it went
    before this leader's term).
    """

    def __init__(self, seed: Mapping[str, DepartureCause] | None = None) -> None:
        self._causes: dict[str, DepartureCause] = dict(seed or {})
        self._leaving: set[str] = set()

    def put(self, node: str, leaving: bool) -> None:
        if leaving:
            self._leaving.add(node)

    def deleted(self, node: str) -> None:
        self._causes[node] = (
            DepartureCause.LEFT if node in self._leaving else DepartureCause.LEASE_EXPIRED
        )
        self._leaving.discard(node)
        if len(self._causes) > LIMIT:
            self._causes.pop(next(iter(self._causes)))

    def cause(self, node: str) -> DepartureCause:
        return self._causes.get(node, DepartureCause.GONE)

    def causes(self, nodes: tuple[str, ...]) -> tuple[DepartureCause, ...]:
        return tuple(self.cause(n) for n in nodes)

    def why_frozen(
        self,
        joining: st.RoundState | None,
        number: int,
        hint: tuple[Member, ...],
        agents: Mapping[str, object],
    ) -> st.RoundState:
        """What a frozen round keeps of why it opened: the JOINING round's reason, departures,
        arrivals and failure (``joining``, when it is round ``number``), with the previous
        members (``hint``) found gone at the freeze (not in ``agents``) added with their
        causes: a worker failure reported before a dead node's lease expired is that death's
        consequence, and the round must say so.
        """
        why = st.RoundState()
        if joining is not None and joining.number == number and joining.phase == st.JOINING:
            why.CopyFrom(joining)
        missing = len(why.departed) - len(why.departed_cause)
        gone = DepartureCause.GONE.value
        why.departed_cause.extend([gone] * max(0, missing))  # written by an older etcdrun
        for node in (m.node_id for m in hint if m.node_id not in agents):
            if node not in why.departed:
                why.departed.append(node)
                why.departed_cause.append(self.cause(node).value)
        return why


def reason(departed: tuple[str, ...], causes: tuple[DepartureCause, ...]) -> str:
    """The reason line of a round opened by departures, with each one's cause when known:
    ``node(s) lost: a (lease expired)``; ``node(s) left: b`` when every one left on purpose.
    Empty when nothing is known beyond the decision's own line.
    """
    if not departed or all(c is DepartureCause.GONE for c in causes):
        return ""
    if all(c is DepartureCause.LEFT for c in causes):
        return f"node(s) left: {', '.join(departed)}"
    pairs = zip(departed, causes, strict=False)
    return "node(s) lost: " + ", ".join(f"{n} ({c.value})" for n, c in pairs)


__all__ = ["Departures", "reason"]
