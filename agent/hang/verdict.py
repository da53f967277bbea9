"""Who is to blame for a hung round: a pure function of the alarm and the nodes' reports.

Why the stacks decide and not the alarm: when one rank stops, every rank stops with it, the
others inside the collective that waits for it, and the watchdog that fires first may be any
of them. The rank to blame is the one that is *not* waiting in torch.distributed: its peers'
stacks show ``all_reduce``, its own shows where it is stuck (a sleep, a blocking read, a data
loader). A rank that cannot answer at all (a stopped process) comes next, then a node that did
not report (frozen, or cut off from etcd), and only when every rank waits on the others (a
collective that lost a message) the rank that raised the alarm.

Reports are JSON values (they travel through etcd, HangPort): ``{"ranks": {"<rank>":
{"where": "train.py:31 in step", "waiting": false}}, "silent": {"<rank>": "why no stack"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alarm:
    round: int
    node: str
    rank: int
    stalled_s: float  # since the rank's last progress, when the alarm was raised
    step: int | None = None

    def body(self) -> dict[str, Any]:
        return {"rank": self.rank, "stalled_s": round(self.stalled_s, 3), "step": self.step}

    @classmethod
    def of(cls, round_: int, node: str, body: Mapping[str, Any]) -> Alarm:
        return cls(round_, node, int(body["rank"]), float(body["stalled_s"]), body.get("step"))


@dataclass(frozen=True)
class Verdict:
    """``node`` and ``rank`` to blame; ``where`` its stuck frame, or why there is none;
    ``line`` what every node prints; ``act``: the blamed rank's node kills it. Not when a node
    did not report: a frozen node's lease takes it out, and the rank named is only the one
    that raised the alarm.
    """

    round: int
    node: str
    rank: int | None
    where: str
    line: str
    act: bool = True

    def body(self) -> dict[str, Any]:
        return {
            "blamed": self.node,
            "rank": self.rank,
            "where": self.where,
            "line": self.line,
            "act": self.act,
        }

    @classmethod
    def of(cls, round_: int, body: Mapping[str, Any]) -> Verdict:
        rank = body.get("rank")
        return cls(
            round_,
            str(body["blamed"]),
            None if rank is None else int(rank),
            str(body["where"]),
            str(body["line"]),
            bool(body.get("act", True)),
        )


def blame(alarm: Alarm, reports: Mapping[str, Mapping[str, Any]], nodes: int) -> Verdict:
    """The verdict from the alarm and the reports received (node → report) of a round of
    ``nodes`` nodes.
    """
    stalled = f"made no progress for {alarm.stalled_s:.1f} s"
    stacks = {
        (int(rank), node): r
        for node, report in reports.items()
        for rank, r in report.get("ranks", {}).items()
    }
    waiting = sum(1 for r in stacks.values() if r.get("waiting"))
    own = sorted(key for key, r in stacks.items() if not r.get("waiting"))
    if own:
        rank, node = next((k for k in own if k[0] == alarm.rank), own[0])
        where = str(stacks[(rank, node)].get("where", "?"))
        peers = f"; {waiting} other rank(s) wait in torch.distributed" if waiting else ""
        line = f"rank {rank} on node {node} {stalled}: stuck at {where}{peers}"
        return Verdict(alarm.round, node, rank, where, line)
    silent = sorted(
        (int(rank), node, str(why))
        for node, report in reports.items()
        for rank, why in report.get("silent", {}).items()
    )
    if silent:
        rank, node, why = next((s for s in silent if s[0] == alarm.rank), silent[0])
        return Verdict(alarm.round, node, rank, why, f"rank {rank} on node {node} {stalled}: {why}")
    if len(reports) < nodes:
        missing = f"{nodes - len(reports)} node(s) did not report (frozen, or cut off from etcd)"
        line = f"rank {alarm.rank} on node {alarm.node} {stalled}, every rank that answered "
        line += f"waits in torch.distributed; {missing}"
        return Verdict(alarm.round, alarm.node, alarm.rank, missing, line, act=False)
    where = str(stacks.get((alarm.rank, alarm.node), {}).get("where", "?"))
    line = f"rank {alarm.rank} on node {alarm.node} {stalled}: every rank waits in "
    line += f"torch.distributed (rank {alarm.rank} at {where})"
    return Verdict(alarm.round, alarm.node, alarm.rank, where, line)


__all__ = ["Alarm", "Verdict", "blame"]
