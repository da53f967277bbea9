"""The end of a round or of the run: a restart after a worker failure, the exit barrier, closing
the run (as succeeded or failed), and the last agent's clean-up.

Why functions over the run context: these are the writes an agent makes about the *job* rather
than about its own membership; each is one fenced transaction from transitions.py. They borrow
what they need and keep nothing, so the handler and the leader share one ``close_run`` instead
of each closing the run its own way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import EtcdClient, EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.client.errors import NO_SPACE_REMEDY, EtcdLeaseNotFoundError
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec, shard_reads, transitions
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round
from etcdrun.rendezvous.etcd.core.session import Session

log = logging.getLogger(__name__)


def read_round(client: EtcdClient, keys: RunKeys, timeout: float | None = None) -> Round | None:
    kv = client.get(keys.round, timeout=timeout)
    return codec.round_from(kv.key, kv.value, kv.mod_revision, keys.run_id) if kv else None


def close_run(
    ctx: RunContext,
    current: Round | None,
    outcome: int,
    failure: st.Failure | None,
    *,
    by: str,
    fence: Sequence[pb.Compare] = (),
) -> tuple[Round, st.RoundState] | None:
    """One attempt to close the run, fenced on the round key as read (and on ``fence``).

    The CLOSED marker lives under a lease of its own (``closed_ttl``: late joiners fail at once
    meanwhile, then it expires by itself). When the compare fails, that lease is revoked at once
    — it would otherwise live ``closed_ttl`` for nothing. Returns the closed round and the
    message written (for the writer's own view: see ``written``), or None when the round key
    had moved (re-read and decide again).
    """
    client = ctx.client
    marker = client.lease(ctx.config.closed_ttl, keepalive=False)
    closed, (guard, ops) = transitions.close(ctx.keys, current, outcome, failure, marker.id, by)
    # An exception leaves the marker alone: the write may have been applied with its answer
    # lost, and revoking would delete the CLOSED key with it.
    res = client.txn([*guard, *fence], ops)
    if not res.succeeded:
        marker.revoke()
        return None
    return replace(closed, mod_revision=res.revision), written(ops)


def written(ops: Sequence[pb.RequestOp]) -> st.RoundState:
    """The round state a transaction's first op writes (the round key), decoded: a writer
    applies its own write to its view with the message, so that it knows its outcome and root
    cause at once, not only when its watch brings them.
    """
    put = ops[0].request_put
    return codec.round_message(put.value, put.key.decode(errors="replace"))


def set_closed(
    ctx: RunContext, outcome: int, failure: st.Failure | None = None, *, by: str
) -> tuple[Round, st.RoundState] | None:
    """Close the run, whatever round it is in; a run already closed stays as it is. Returns
    what this call wrote (for the writer's own view), or None when it was closed already.
    """
    while True:
        cur = read_round(ctx.client, ctx.keys)
        if cur is not None and cur.phase is Phase.CLOSED:
            return None
        done = close_run(ctx, cur, outcome, failure, by=by)
        if done is not None:
            ctx.events.emit("run_closed", round=done[0].number, outcome=st.Outcome.Name(outcome))
            return done


def request_restart(
    ctx: RunContext, running: Round, reason: str, failure: FailureInfo | None, *, by: str
) -> bool:
    """Open the round after ``running`` because a worker failed. The leader charges the
    job-wide budget when it freezes that round — or closes the run as failed when the budget is
    spent — unless a member turns out to be gone (its death made the workers fail: free). False
    when the round had already moved on (someone else opened it): then an earlier failure than
    the one it carries replaces it, since the root cause is the first failure, not the first
    report (else two nodes failing in one round name whichever reported first).
    """
    client, keys = ctx.client, ctx.keys
    new = transitions.opening(running.number + 1, running.restart_count, failure, running.run_lease)
    # The hint orders the next round (S6): every member, so a sharded round's shards are read.
    # None: they are gone, the round moved on, and the fenced write below fails as it should.
    hint = (shard_reads.whole(client, keys, running) or running).members
    fenced_on: Round | None = running
    while fenced_on is not None:
        why = codec.Why(reason)
        guard, ops = transitions.start_round(keys, fenced_on, new, hint, why, by)
        if client.txn(guard, ops).succeeded:
            ctx.events.emit(
                "round_started", round=new.number, reason=reason, restart_count=new.restart_count
            )
            return True
        fenced_on = _rewritten(client, keys, running, fenced_on)
    if failure is not None:
        _attach_if_earlier(ctx, new.number, failure, reason)
    return False


def _rewritten(client: EtcdClient, keys: RunKeys, running: Round, tried: Round) -> Round | None:
    """The round key as it is now when it still holds ``running`` itself, rewritten at a newer
    revision than ``tried`` (the leader's repair of a corrupt value, repair.py): the round has
    not moved on, so the restart is fenced on the rewrite. Else None. Found by the chaos soak
    (bench/results/soak.md, 'Restart trials before network cuts'): the restart, fenced on the
    revision accepted before the repair, failed on every node as if the round had moved on, and the
    failure was lost.
    """
    kv = client.get(keys.round)
    if kv is None or kv.mod_revision <= tried.mod_revision:
        return None
    try:
        now = codec.round_from(kv.key, kv.value, kv.mod_revision, keys.run_id)
    except RendezvousError:
        return None
    # A sharded round's header lists nobody: its layout stands for its members (its shards are
    # written once, with the round).
    same = (now.number, now.phase, now.sharded) == (running.number, running.phase, running.sharded)
    if same and now.sharded is None:
        same = now.members == running.members
    return now if same else None


def _attach_if_earlier(ctx: RunContext, number: int, failure: FailureInfo, reason: str) -> None:
    """Put ``failure`` (and its ``reason`` line) on round ``number`` while it gathers, in place
    of an older failure it carries: fenced on the value read, so a round that moved on is left
    alone. The reason goes with it: every node prints the earliest failure as the restart's
    cause, never the first report (a worker its own agent stopped, or a consequence of the real
    failure).
    """
    client, keys = ctx.client, ctx.keys
    kv = client.get(keys.round)
    if kv is None:
        return
    try:
        msg = codec.round_message(kv.value, keys.round, keys.run_id)
    except RendezvousError:
        return
    if msg.number != number or msg.phase != st.JOINING or not msg.HasField("failure"):
        # Only a failure replaces a failure. A round opened by a departure (or an arrival)
        # carries none, and must not get one: its failures are the departure's doing, free —
        # attached, they would be charged (a kill -9 of rank 0 failed a --max-restarts 0 job).
        return
    ours = codec.failure_to(failure)
    if msg.failure.timestamp_ms <= ours.timestamp_ms:
        return
    msg.failure.CopyFrom(ours)
    if not msg.departed:  # "node(s) left: ..." stays: a death outranks a failure
        msg.reason = reason
    put = t.put(keys.round, msg.SerializeToString(), kv.lease)
    if client.txn([t.mod_revision(keys.round, "==", kv.mod_revision)], [put]).succeeded:
        ctx.events.emit("round_failure_replaced", round=number, failed_rank=failure.global_rank)


def exit_barrier(ctx: RunContext, session: Session, running: Round, *, timeout: float) -> bool:
    """Wait until every node of ``running`` finished (or the run closed); the last one to
    arrive closes the run as SUCCEEDED. True when everyone made it in time.

    A member whose lease lapsed before it arrived (frozen past its TTL near the end: found by the
    chaos soak, bench/results/soak.md, 'Restart trials before network cuts') can never arrive as
    itself. When the round moves on without it, or time is up, and every member still registered has
    arrived, the run is closed SUCCEEDED all the same — else the fenced node, back, joined a run
    nobody else would join and waited out join_timeout before failing. It finds the run closed and
    leaves at once.
    """
    client, view = ctx.client, ctx.view
    prefix = ctx.keys.barrier(running.number, "exit")
    try:
        client.put(prefix + session.node_id, b"", lease=session.lease_id)
    except EtcdLeaseNotFoundError:  # expired while we could not act: ask, so ``lost`` is set
        session.confirm()
        return False
    if client.get_prefix(prefix, count_only=True).count >= running.node_count:
        set_closed(ctx, st.SUCCEEDED, by=session.node_id)
        return True
    deadline = time.monotonic() + timeout
    while True:
        cur = view.current()
        if cur is not None and cur.phase is Phase.CLOSED:
            return True
        if cur is not None and cur.number > running.number:
            # Opening the next round removed this round's directory, barrier keys and all: who
            # had arrived is read as it stood just before. Only the departure's own round can say
            # (a round frozen since ran someone's workers: the run goes on) — gathering, or
            # carried (design.md §3a: frozen at once; a member still working keeps the run open).
            departure = cur.phase is Phase.JOINING or cur.carried
            if cur.number > running.number + 1 or not departure:
                return False
            return _close_if_the_rest_are_gone(ctx, session, running, cur.mod_revision - 1)
        if not view.wait(cur, deadline, stop=lambda: False):
            return _close_if_the_rest_are_gone(ctx, session, running, 0)


def _close_if_the_rest_are_gone(
    ctx: RunContext, session: Session, running: Round, at_revision: int
) -> bool:
    """Close the run SUCCEEDED when each member of ``running`` is at the barrier or gone (its
    agent key lapsed: it cannot come back as itself); True then. A member still registered may
    still be working, and keeps the run open. Newcomers and spares do not count: the work is
    done.
    """
    client, keys = ctx.client, ctx.keys
    try:
        arrived = _names(client, keys.barrier(running.number, "exit"), at_revision)
        whole = shard_reads.whole(client, keys, running)  # all members: at its revision
    except EtcdError:  # compacted since: who arrived is unknown, so the run stays open
        return False
    if whole is None:  # its shards are gone, and that revision compacted: as above
        return False
    live = _names(client, keys.agents)
    late = [m.node_id for m in whole.members if m.node_id not in arrived]
    if any(node in live for node in late):
        return False
    if set_closed(ctx, st.SUCCEEDED, by=session.node_id):
        ctx.events.emit("exit_barrier_incomplete", round=running.number, gone=late)
        log.warning(
            "run %s round %d: %s left before the exit barrier; every other node finished, so "
            "the run closed as SUCCEEDED",
            keys.run_id,
            running.number,
            ", ".join(late),
        )
    return True


def _names(client: EtcdClient, prefix: str, revision: int = 0) -> set[str]:
    """The last path element of every key under ``prefix`` (at ``revision``; 0: now)."""
    kvs = client.get_prefix(prefix, keys_only=True, revision=revision).kvs
    return {kv.key.decode()[len(prefix) :] for kv in kvs}


def describe_closed(client: EtcdClient, keys: RunKeys, msg: st.RoundState | None) -> str:
    """Why a node cannot join a run that ended before it came, and how to reuse the id."""
    outcome = st.Outcome.Name(msg.outcome) if msg is not None and msg.outcome else "CLOSED"
    when, cause = "", ""
    if msg is not None and msg.closed_unix_ms:
        when = " at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(msg.closed_unix_ms / 1e3))
    if msg is not None and msg.HasField("failure"):
        f = msg.failure
        cause = f" (root cause: rank {f.global_rank} on {f.host}: {f.message or f.exit_code})"
    expires = ""
    try:
        kv = client.get(keys.round)
        if kv is not None and kv.lease:
            expires = f" in {client.lease_ttl(kv.lease).TTL} s"
    except EtcdError:
        pass
    if msg is not None and msg.outcome in (st.FAILED, st.CANCELLED):  # taken up afresh
        return f"run {keys.run_id} already ran: it ended {outcome}{when}{cause}"
    return (
        f"run {keys.run_id} already ran: it ended {outcome}{when}{cause}. Use a new --rdzv-id, or "
        f"reuse this one once its record expires{expires} (or after: etcdctl del --prefix "
        f"{keys.root})"
    )


def describe_vanished(client: EtcdClient, keys: RunKeys) -> str:
    """The round key is gone while this node is in the run: only an abort (or a hand) removes
    it then — the last agent out removes it only when no agent is left.
    """
    try:
        errors = list(client.status().errors)
    except EtcdError:
        errors = []
    if any("NOSPACE" in err for err in errors):
        return f"the run was aborted: {NO_SPACE_REMEDY}"
    return f"the run was aborted: its state ({keys.round}) was removed from etcd while it ran"


def clean_up_if_none_left(ctx: RunContext) -> None:
    """The last agent out removes the run's keys (a closed run keeps its marker, which
    expires by itself), so nothing of a finished job stays in etcd. Best effort, bounded by the
    policy's parting timeout: leaving must not hang on a dead etcd.
    """
    client, keys, policy = ctx.client, ctx.keys, ctx.policy
    try:
        cur = read_round(client, keys, timeout=policy.parting_timeout)
        guard, ops = transitions.clean_up_if_none_left(keys, cur)
        if client.txn(guard, ops, timeout=policy.parting_timeout).succeeded:
            if cur is not None and cur.run_lease:
                client.revoke(cur.run_lease, timeout=policy.parting_timeout)
            ctx.events.emit("run_cleaned")
    except (EtcdError, RendezvousError) as e:
        log.warning("could not remove the run's keys: %s", e)


__all__ = [
    "clean_up_if_none_left",
    "describe_closed",
    "describe_vanished",
    "close_run",
    "exit_barrier",
    "read_round",
    "request_restart",
    "set_closed",
]
