"""What the leader knows, published for others to read, and the one line it makes.

Why apart from the leader: the status line runs on the agent's ticker thread while the driver
thread decides, and may drop the leader at any moment. The leader therefore publishes an
immutable snapshot after every decision (a reference swap: readers never see it half made),
and the line is built from that snapshot and the round alone, never from the leader's caches.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcdrun.rendezvous.etcd.core.protocol import Phase, Round, Settings

WORDS = {Phase.JOINING: "forming", Phase.FROZEN: "running", Phase.CLOSED: "ended"}


@dataclass(frozen=True)
class LeaderStatus:
    """What the leader knew at its last decision. Immutable: readers never see it half made."""

    round: int | None = None
    phase: Phase | None = None
    live: int = 0  # agents whose key exists (their lease is alive)
    joined: int = 0  # live agents with a join record for the current round
    waiting: int = 0  # live agents outside the frozen round: newcomers and hot spares
    last_call_deadline: float | None = None  # leader-local monotonic time, first round only
    decision: str = ""  # the last Wait's reason, or the action applied

    def last_call_left(self, now: float) -> float | None:
        if self.last_call_deadline is None:
            return None
        return max(0.0, self.last_call_deadline - now)


def status_line(
    r: Round | None, leader: LeaderStatus | None, settings: Settings, now: float
) -> str:
    """Where the rendezvous stands, in one line: the round, and while it gathers nodes, what the
    leader counts (only the leader knows; the others say the round and what it is doing). In
    people's words, as ``etcdrun status`` says them (``WORDS``): "frozen" is what the docs call
    a stopped node, and a new user read "round 1 frozen" as a job that hung.
    """
    if r is None:
        return "waiting for the first round"
    s = f"round {r.number} {WORDS[r.phase]}"
    if leader is not None and leader.round == r.number and r.phase is Phase.JOINING:
        s += (
            f": {leader.joined}/{leader.live} live nodes joined "
            f"(min {settings.min_nodes}, max {settings.max_nodes})"
        )
        left = leader.last_call_left(now)
        if left is not None:
            s += f", last call in {left:.0f} s"
    elif r.phase is Phase.FROZEN:
        s += f" with {r.node_count} nodes"
    return s


__all__ = ["WORDS", "LeaderStatus", "status_line"]
