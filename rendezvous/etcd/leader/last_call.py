"""The first round's last call, published in the round key so that every node can say it.

Why: only the leader knows that the first round waits for more nodes, and until when; without this
the other agents can only print ``waiting for a round (5 s): round 1 joining`` every 5 s, with no
reason and no time left. Once a last call has lasted ``ANNOUNCE_AFTER`` the leader writes its
deadline (wall clock, informational only: nothing decides from it, S5) and the count joined into the
JOINING round (one fenced write), and every node prints ``first round: 2 of max 3 joined (min 2);
starting in 25 s unless more join``.

Why wait before writing: a last call that ends at once (the max-th agent registering a moment
later, as in the scale bench's round of 1000) costs no write and no watch event; a rewrite of
the round key also fails the join Txns in flight (they re-read and join again).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import api
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
from etcdrun.rendezvous.etcd.core.session import Session

log = logging.getLogger(__name__)
ANNOUNCE_AFTER = 1.0  # seconds a last call must last before the leader publishes it


@dataclass
class LastCall:
    """One leader term's last call: which round, since when, until when, and what it published."""

    number: int = 0
    began: float = 0.0  # leader-local monotonic time
    until: float = 0.0
    published: tuple[int, int] | None = None  # (round, joined) written to the round key

    def wait(self, number: int, until: float, now: float) -> None:
        """The decision is to wait for the last call of round ``number`` until ``until``."""
        if number != self.number:
            self.number, self.began, self.published = number, now, None
        self.until = until

    def deadline(self, number: int) -> float | None:
        return self.until if self.number == number else None

    def due(self, r: Round, joined: int, now: float) -> float | None:
        """When to publish (now or later), or None when nothing needs publishing."""
        if r.phase is not Phase.JOINING or r.number != self.number:
            return None
        if self.published == (r.number, joined):
            return None
        return max(now, self.began + ANNOUNCE_AFTER)


def publish(
    ctx: RunContext, session: Session, call: LastCall, r: Round, joined: int, now: float
) -> bool:
    """Write the last call into the JOINING round ``r`` (fenced on it, and on our session)."""
    keys, view = ctx.keys, ctx.view
    msg = view.message()
    if msg is None or msg.number != r.number or msg.phase != st.JOINING:
        return False
    out = st.RoundState()
    out.CopyFrom(msg)
    out.last_call_deadline_unix_ms = int((time.time() + (call.until - now)) * 1000)
    out.last_call_joined = joined
    client = session.client
    put = t.put(keys.round, out.SerializeToString(), r.run_lease)
    res = client.txn([t.mod_revision(keys.round, "==", r.mod_revision), session.is_owner()], [put])
    if not res.succeeded:
        return False
    call.published = (r.number, joined)
    view.apply(replace(r, mod_revision=res.revision), out)
    ctx.events.emit(
        "last_call",
        round=r.number,
        joined=joined,
        deadline_ms=out.last_call_deadline_unix_ms,
        seconds_left=round(max(0.0, call.until - now), 3),
    )
    return True


def announce(
    ctx: RunContext, session: Session, call: LastCall, r: Round, joined: int, now: float
) -> float:
    """The leader waits in a last call: publish it once it has lasted ``ANNOUNCE_AFTER`` (and
    again when the count joined changes); return when to decide again.
    """
    due = call.due(r, joined, now)
    if due is None:
        return call.until
    if due > now:
        return min(call.until, due)
    try:
        publish(ctx, session, call, r, joined, now)
    except EtcdError as e:  # informational: the round goes on without it
        log.warning("leader %s: publishing the last call failed: %s", session.node_id, e)
    return call.until


def notice(msg: st.RoundState | None, min_nodes: int, max_nodes: int) -> api.LastCall | None:
    """The last call the round key carries, for every node to say it (``first round: 2 of max
    3 joined (min 2); starting in 25 s unless more join``); None when it carries none.
    """
    if msg is None or msg.phase != st.JOINING or not msg.last_call_deadline_unix_ms:
        return None
    deadline = msg.last_call_deadline_unix_ms / 1000
    return api.LastCall(deadline, msg.last_call_joined, min_nodes, max_nodes)


__all__ = ["ANNOUNCE_AFTER", "LastCall", "announce", "notice", "publish"]
