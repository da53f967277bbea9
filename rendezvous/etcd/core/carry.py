"""Places in a carried round: who sits where, and which global ranks a node may be given.

Why its own module: a carried round (design.md §3a) is frozen while the survivors' workers of
earlier rounds still run — nobody acknowledged anything — so the places cannot follow the
gathered round's rule (survivors in their relative order, S6), which shifts every node after a
departed one onto global ranks that a live neighbour's old workers may still hold (S4: no two
live processes ever hold one RANK of different rounds). Instead every survivor keeps its place;
only the survivors whose place is beyond the new round's size move, into places departed nodes
left, and newcomers take the places still free. A global rank goes to another node only when
every node that held it since the last gathered round is gone (its lease expired or was revoked,
so S4's fencing already stopped its workers). Pure: protocol.decide and the checker use it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from etcdrun.rendezvous.api import Participant

Span = tuple[int, int, str]  # [first, end) global ranks, and the node that may hold them


def place(
    survivors: Sequence[Participant], comers: Sequence[Participant]
) -> tuple[Participant, ...]:
    """The carried round's members: ``survivors`` (of the previous round, in its rank order) keep
    their node ranks below the new size; the others, in order, then ``comers``, fill the free
    places from the lowest. Node ranks 0..k-1 and contiguous global ranks (S2).
    """
    k = len(survivors) + len(comers)
    slots: list[Participant | None] = [None] * k
    movers: list[Participant] = []
    for m in survivors:
        if m.node_rank < k:
            slots[m.node_rank] = m
        else:
            movers.append(m)
    queue = iter([*movers, *comers])
    out, first = [], 0
    for rank, m in enumerate(slots):
        m = m if m is not None else next(queue)
        out.append(Participant(m.node_id, rank, m.local_world_size, m.addr, first, m.host, m.pid))
        first += m.local_world_size
    return tuple(out)


def owned(
    survivors: Sequence[Participant], held_by: Callable[[str], tuple[int, ...]]
) -> list[Span]:
    """Every global rank a live node may still hold: its current ranks and those it held since
    the last gathered round (``held_by``), sorted. Spans of different nodes never overlap.
    """
    spans = [
        (f, f + m.local_world_size, m.node_id)
        for m in survivors
        for f in {m.first_global_rank, *held_by(m.node_id)}
    ]
    return sorted(spans)


def handed_over_safely(spans: list[Span], members: Sequence[Participant]) -> bool:
    """True when no member is given a global rank that another node may still hold (S4)."""
    starts = [s[0] for s in spans]
    widest = max((s[1] - s[0] for s in spans), default=0)
    for m in members:
        lo, hi = m.first_global_rank, m.first_global_rank + m.local_world_size
        i = bisect.bisect_left(starts, lo - widest)
        while i < len(spans) and spans[i][0] < hi:
            first, end, node = spans[i]
            if end > lo and node != m.node_id:
                return False
            i += 1
    return True


def held_after(
    survivors: Sequence[Participant],
    held_by: Callable[[str], tuple[int, ...]],
    members: Sequence[Participant],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What each member of the carried round may still hold besides its new ranks: its old
    ranks and what it held before them, for a survivor that moved; nothing for the others.
    """
    new = {m.node_id: m.first_global_rank for m in members}
    out = []
    for m in survivors:
        rest = {m.first_global_rank, *held_by(m.node_id)} - {new[m.node_id]}
        if rest:
            out.append((m.node_id, tuple(sorted(rest))))
    return tuple(out)


__all__ = ["Span", "handed_over_safely", "held_after", "owned", "place"]
