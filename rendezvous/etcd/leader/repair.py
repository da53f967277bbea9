"""Repairing a round key that holds a value nobody can read.

Why: the round key is what every agent waits on. A value that does not decode (an ``etcdctl
put`` of garbage, a foreign program under our prefix) would leave every agent on its last good
copy, and the leader fencing its next write on a revision that no longer exists: the next node
death would then produce no new round and no output. So every agent reports the bad value once
(round_watch.py), and the leader restores the last good state — fenced on the bad
value's revision, so it overwrites exactly that value and nothing newer. When no agent knows the
run's last state (every agent started after the value went bad), nothing is overwritten: each
agent stops with one error naming the key, and the value stays for inspection.

Restoring keeps the round number and phase, so workers of a running round go on undisturbed.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.session import Session

log = logging.getLogger(__name__)


def repair_round(ctx: RunContext, session: Session, bad: tuple[int, str], run_lease: int) -> bool:
    """Overwrite the unreadable round key (at revision ``bad[0]``) with the last good state;
    True when this call did. False when no good state is known or the fence failed.
    """
    keys, view = ctx.keys, ctx.view
    revision, problem = bad
    good, msg = view.current(), view.message()
    if good is None:
        return False
    fence = [t.mod_revision(keys.round, "==", revision), session.is_owner()]
    value = codec.encode_round(msg) if msg is not None else codec.round_to(good)
    res = session.client.txn(fence, [t.put(keys.round, value, run_lease)])
    if not res.succeeded:
        return False
    view.apply(replace(good, mod_revision=res.revision), msg)
    ctx.events.emit("round_repaired", round=good.number, bad_revision=revision, problem=problem)
    log.error(
        "%s held a value etcdrun cannot read (%s); restored round %d %s",
        keys.round,
        problem,
        good.number,
        good.phase.name.lower(),
    )
    return True


__all__ = ["repair_round"]
