"""The leader's duties: keep the agents/ and rounds/ caches, decide, apply one fenced Txn.

Why separate from the handler: only one agent at a time does this, and it is where the O(N) cost
lives (N join events per round reach this one watcher). Every write is guarded twice: on the round
key's mod_revision (S1: at most one outcome per round) and on the session's ``is_owner()`` (a
leader whose lease was lost cannot write, S4). A failed guard is not an error: the watch brings
the newer state, and the next decision starts from it. What a round costs at N agents (time,
writes per agent): bench/rendezvous_scale.py, and bench/results/rendezvous_scale.md.

The leader borrows the session and the round view; it publishes what it knows as an immutable
``LeaderStatus`` after every decision, so the status line (another thread) reads a consistent
snapshot while the driver thread goes on deciding — or drops the leader altogether.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import DepartureCause
from etcdrun.rendezvous.client import (
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdNoSpaceError,
    Lease,
    Watch,
    WatchBatch,
)
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec, shard_reads, shards, transitions
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import (
    CARRIED,
    Action,
    Agent,
    Carry,
    CloseFailed,
    Freeze,
    Join,
    Member,
    Phase,
    Round,
    StartRound,
    View,
    Wait,
    decide,
)
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader import departures, last_call, repair
from etcdrun.rendezvous.etcd.leader.status import LeaderStatus
from etcdrun.rendezvous.etcd.leader.stragglers import Stragglers
from etcdrun.rendezvous.etcd.node import cooldown, lifecycle
from etcdrun.rendezvous.etcd.node.node_names import node_name

log = logging.getLogger(__name__)
MAX_STEPS = 4  # decisions in a row without a new event: each write changes the view


class Leader:
    """One leader term. ``deliver`` gets the leader's watch batches (on the watch thread: it
    must only queue them); the owner passes them back through ``on_batch``, then ``act``.
    """

    def __init__(
        self,
        ctx: RunContext,
        session: Session,
        *,
        deliver: Callable[[WatchBatch], None],
        departed: dict[str, DepartureCause] | None = None,
    ) -> None:
        self._ctx = ctx
        self._session = session
        self._client = ctx.client
        self._keys = ctx.keys
        self._view = ctx.view
        self._events = ctx.events
        self._run_lease: Lease | None = None  # kept alive by this term
        self._deliver = deliver
        self.agents: dict[str, Agent] = {}
        self.joins: dict[int, dict[str, Join]] = {}
        self.hints: dict[int, tuple[Member, ...]] = {}  # rounds/<n>/hint: order for round n
        self.resting: set[str] = set()  # node names cooled down now (cooldown/, node/cooldown.py)
        self._watches: list[Watch] = []
        self._last_call = last_call.LastCall()
        self._stragglers = Stragglers(ctx, session)  # progress/: the straggler rule
        self.departures = departures.Departures(departed)  # seeded by what the election saw
        self._failures = 0  # etcd errors in a row: the policy's backoff index
        self._invalid: dict[bytes, int] = {}  # key under agents/ that is no agent -> mod_revision
        self._whole: Round | None = None  # the current sharded round with every member (read)
        self.status = LeaderStatus()

    # ---- caches -----------------------------------------------------------------------------
    def start(self) -> None:
        """Snapshot agents/, rounds/, cooldown/ and progress/ at one revision, then watch them
        from revision + 1 (cooldown/ changes only when a node starts or ends a cooldown;
        progress/ at most once per node per 5 s, and only while its workers report progress).
        """
        keys = self._keys
        prefixes = (keys.agents, keys.rounds, keys.cooldowns, keys.paces)
        res = self._client.txn([], [t.get(p, prefix=True) for p in prefixes])
        for resp in res.responses:
            for kv in resp.response_range.kvs:
                self._apply_kv(kv, deleted=False)
        for prefix in prefixes:
            self._watches.append(
                self._client.watch(
                    prefix, prefix=True, start_revision=res.revision + 1, callback=self._deliver
                )
            )
        r = self._view.current()
        if r is not None and r.run_lease and r.phase is not Phase.CLOSED:
            self._run_lease_for(r)  # take over its keep-alive at once, not at the next write
        self._events.emit("leader_elected", agents=len(self.agents))

    def on_batch(self, batch: WatchBatch) -> None:
        """Apply one batch of the leader's watches; a watch that ended raises its error (the
        owner starts a new term, which re-reads a consistent snapshot).
        """
        if batch.error is not None:
            raise batch.error
        for ev in batch.events:
            self._apply_kv(ev.kv, deleted=ev.type == pb.Event.DELETE)

    def _apply_kv(self, kv: pb.KeyValue, deleted: bool) -> None:
        try:
            self._apply_kv_checked(kv, deleted)
        except RendezvousError as e:  # a foreign or corrupt record counts as absent
            log.error("leader %s: ignoring %s", self._session.node_id, e)

    def _apply_kv_checked(self, kv: pb.KeyValue, deleted: bool) -> None:
        kind, n, node = self._keys.parse(kv.key)
        rid = self._keys.run_id
        if kind == "agent" and node:
            was = self.agents.pop(node, None)  # whatever it was, it counts only if valid now
            self._invalid.pop(kv.key, None)
            if deleted:
                if was is not None:
                    self.departures.deleted(node)
                return
            try:
                info = codec.agent_info(kv.key, kv.value, rid, kv.lease)
            except RendezvousError:
                self._invalid[kv.key] = kv.mod_revision  # removed at the next decision
                raise
            self.departures.put(node, bool(info.leaving))
            self.agents[node] = codec.agent_of(info, kv.create_revision)
        elif kind == "progress" and node:
            if deleted:
                self._stragglers.remove(node)
            else:
                self._stragglers.put(node, kv.value)
        elif kind == "cooldown" and node:
            if not deleted and cooldown.decode(kv.key, kv.value, rid).resting:
                self.resting.add(node)
            else:
                self.resting.discard(node)
        elif kind == "hint" and n is not None:
            if deleted:
                self.hints.pop(n, None)
            else:
                self.hints[n] = codec.hint_from(kv.key, kv.value, rid)
        elif kind == "join" and node and n is not None:
            if deleted:
                self.joins.get(n, {}).pop(node, None)
            else:
                self.joins.setdefault(n, {})[node] = codec.join_from(
                    kv.key, kv.value, rid, kv.create_revision
                )

    # ---- decisions --------------------------------------------------------------------------
    def act(self, now: float) -> float | None:
        """Decide and apply until the decision is to wait; return when to decide again (a
        leader-local monotonic time) or None (at the next event). Then the straggler rule,
        after the rounds' decisions and apart from them: its failure never holds a round.
        """
        wake_at = self._decide(now)
        try:
            self._stragglers.act(self._current())
        except (EtcdError, RendezvousError) as e:  # judged again at the next pace
            log.warning("leader %s: the straggler rule failed: %s", self._session.node_id, e)
        return wake_at

    def _decide(self, now: float) -> float | None:
        try:
            self._sweep()
        except EtcdError as e:
            self._failures += 1
            log.warning("leader %s: cleaning up failed: %s; retrying", self._session.node_id, e)
            return now + self._client.policy.backoff_limit(self._failures)
        for _ in range(MAX_STEPS):
            try:
                r = self._current()
            except EtcdError as e:
                self._failures += 1
                log.warning("leader %s: reading the round failed: %s", self._session.node_id, e)
                return now + self._client.policy.backoff_limit(self._failures)
            except RendezvousError as e:  # a corrupt shard: decided again at the next event
                log.error("leader %s: %s", self._session.node_id, e)
                return None
            view = self._decision_view(r)
            if view is None:
                self._publish(r, "waiting for the round's hint or shards (written with it)")
                return None
            action = decide(view, self._ctx.settings, now)
            if isinstance(action, Wait):
                if action.until is not None and r is not None:
                    self._last_call.wait(r.number, action.until, now)
                self._publish(r, action.reason)
                if action.until is None or r is None:
                    return action.until
                joined = sum(1 for n in view.joined if n in self.agents)
                return last_call.announce(self._ctx, self._session, self._last_call, r, joined, now)
            try:
                applied = self._apply(r, action)
            except EtcdNoSpaceError as e:
                self._abort(r, e)
                return None
            except EtcdError as e:
                self._failures += 1
                log.warning("leader %s: %s failed: %s; retrying", self._session.node_id, action, e)
                return now + self._client.policy.backoff_limit(self._failures)
            self._failures = 0
            if not applied:
                self._publish(r, f"{type(action).__name__} lost its fence; re-reading")
                return None
        return None

    def _sweep(self) -> None:
        """Remove what must not block a round: keys under agents/ that are no agent (each
        delete fenced on the revision seen, so a key rewritten since is judged again), and a
        round key holding a value nobody can read (repair.py).
        """
        for key, rev in list(self._invalid.items()):
            res = self._client.txn(
                [t.mod_revision(key, "==", rev), self._session.is_owner()], [t.delete(key)]
            )
            if res.succeeded:
                self._invalid.pop(key, None)
                self._events.emit("agent_key_removed", key=key.decode(errors="replace"))
                log.error("leader %s: removed %s, which is no agent", self._session.node_id, key)
        bad = self._view.corruption()
        if bad is not None:
            good = self._view.current()
            lease = self._run_lease_for(good) if good is not None else 0
            repair.repair_round(self._ctx, self._session, bad, lease)

    def _abort(self, r: Round | None, e: EtcdNoSpaceError) -> None:
        """etcd takes no more writes (its space quota is exhausted), so no round can open and
        the run cannot even be closed. Deletes still work: remove the round key — every agent
        watches it — fenced as usual; an agent that saw the run live and then sees it gone
        stops with the reason (etcd/handler.py) instead of waiting for a round forever.
        """
        log.error("leader %s: %s; the run is aborted", self._session.node_id, e)
        if r is None:
            return
        res = self._client.txn(
            [t.mod_revision(self._keys.round, "==", r.mod_revision), self._session.is_owner()],
            [t.delete(self._keys.round), t.delete(self._keys.rounds, prefix=True)],
        )
        if res.succeeded:
            self._events.emit("run_aborted", round=r.number, reason="etcd space quota exhausted")

    def _run_lease_for(self, r: Round | None) -> int:
        """The run lease the next write goes under: the one this term keeps alive; else the
        round's, adopted (an earlier leader granted it); else, for the first round, or when the
        round's is gone or was never set (an older etcdrun), a new one.
        """
        held = self._run_lease
        if held is not None and not held.lost.is_set():
            if r is None or r.run_lease in (0, held.id):
                return held.id
        if r is not None and r.run_lease and r.phase is not Phase.CLOSED:  # a closed run's
            try:  # lease was revoked by its last agent: a fresh run gets a new one
                self._run_lease = self._client.keep_alive(r.run_lease)
                return self._run_lease.id
            except EtcdLeaseNotFoundError:
                log.warning(
                    "leader %s: the run lease %x expired", self._session.node_id, r.run_lease
                )
        self._run_lease = self._client.lease(self._ctx.config.run_lease_ttl)
        return self._run_lease.id

    def _current(self) -> Round | None:
        """The round key as the view holds it, with every member: a sharded round's header
        lists nobody, so its shards are read once, at its revision (shard_reads.py). The header
        itself when its shards are gone (the round moved on: the watch brings the newer one).
        """
        r = self._view.current()
        if r is None or r.whole:
            return r
        held = self._whole
        if held is None or (held.mod_revision, held.number) != (r.mod_revision, r.number):
            held = shard_reads.whole(self._client, self._keys, r)
            if held is None:
                return r
            self._whole = held
        return held

    def _decision_view(self, r: Round | None) -> View | None:
        """The input of ``decide`` from the caches (None until a JOINING round's hint is in,
        or while a sharded round's members are unknown).
        """
        if r is not None and not r.whole:
            return None
        if r is not None:
            for cache in (self.joins, self.hints):
                for old in [k for k in cache if k < r.number]:
                    del cache[old]
            if r.phase is Phase.JOINING:
                if r.number not in self.hints:
                    return None
                r = replace(r, members=self.hints[r.number])
        deadline = self._last_call.deadline(r.number) if r is not None else None
        joined = self.joins.get(r.number, {}) if r else {}
        rest = frozenset(n for n in self.agents if node_name(n) in self.resting)
        return View(r, self.agents, joined, deadline, rest)

    def _apply(self, r: Round | None, action: Action) -> bool:
        """One fenced write for ``action``; False when a fence failed."""
        fence = self._session.is_owner()  # S4: a leader whose lease was lost cannot write
        me = self._session.node_id
        if isinstance(action, CloseFailed):
            return self._close_failed(r, action)
        run_lease = self._run_lease_for(r)
        if isinstance(action, StartRound):
            new = transitions.opening(action.number, action.restart_count, run_lease=run_lease)
            guard, ops = transitions.start_round(
                self._keys, r, new, action.hint, self._why(action), me
            )
        elif isinstance(action, Carry):
            assert r is not None
            new = _frozen(action, run_lease, carried=True, held=action.held, protocol=CARRIED)
            new = shards.shard(new, self._ctx.config.shard_at)
            guard, ops = transitions.carry(self._keys, r, new, self._why(action), me)
        else:
            assert isinstance(action, Freeze) and r is not None
            new = shards.shard(_frozen(action, run_lease), self._ctx.config.shard_at)
            hint = self.hints.get(r.number, ())
            why = self.departures.why_frozen(self._view.message(), r.number, hint, self.agents)
            guard, ops = transitions.freeze(self._keys, r, new, why, me)
        res = self._client.txn([*guard, fence], ops)
        if not res.succeeded:
            return False
        # With its message, so that this node too can say why the round opened at once — its
        # watch event brings the same bytes a moment later.
        msg = lifecycle.written(ops)
        applied = replace(new, failure=None, mod_revision=res.revision)
        self._view.apply(applied, msg)
        if applied.sharded is not None:  # whole as written: nothing to read back
            self._whole = applied
        self._applied(action, res.revision)
        return True

    def _why(self, action: StartRound | Carry) -> codec.Why:
        """Why a round opens: each departure with how it went, and the arrivals."""
        causes = self.departures.causes(action.departed)
        reason = departures.reason(action.departed, causes) or action.reason
        words = tuple(c.value for c in causes)  # etcd keeps the words
        return codec.Why(reason, action.departed, words, action.arrived)

    def _close_failed(self, r: Round | None, action: CloseFailed) -> bool:
        """The budget is spent: close the run with the root cause every node will report."""
        closed = lifecycle.close_run(
            self._ctx,
            r,
            st.FAILED,
            codec.failure_to(action.failure),
            by=self._session.node_id,
            fence=[self._session.is_owner()],
        )
        if closed is None:
            return False
        self._view.apply(*closed)  # with its message: our agent asks for the root cause next
        self._events.emit(
            "run_closed",
            round=action.number,
            outcome="FAILED",
            restart_count=action.restart_count,
            failed_rank=action.failure.global_rank,
        )
        return True

    def _applied(self, action: StartRound | Freeze | Carry, revision: int) -> None:
        """The round's events. A carried round opens and freezes in one write (§3a): both
        are said, each once, marked ``carried``, so every reader of either finds it.
        """
        carried = isinstance(action, Carry)
        if isinstance(action, (StartRound, Carry)):
            if isinstance(action, StartRound):
                self.hints[action.number] = action.hint
            why = self._why(action)
            self._events.emit(
                "round_started",
                round=action.number,
                reason=why.reason,
                restart_count=action.restart_count,
                departed=list(why.departed),
                departed_cause=list(why.departed_cause),
                arrived=list(why.arrived),
                carried=carried,
            )
        if isinstance(action, (Freeze, Carry)):
            self._events.emit(
                "round_frozen",
                round=action.number,
                nodes=[m.node_id for m in action.members],
                world_size=sum(m.local_world_size for m in action.members),
                revision=revision,
                carried=carried,
            )

    def _publish(self, r: Round | None, decision: str) -> None:
        joined = self.joins.get(r.number, {}) if r is not None else {}
        frozen = r is not None and r.phase is Phase.FROZEN
        members = {m.node_id for m in r.members} if frozen and r is not None else set()
        deadline = self._last_call.deadline(r.number) if r is not None else None
        self.status = LeaderStatus(
            round=r.number if r is not None else None,
            phase=r.phase if r is not None else None,
            live=len(self.agents),
            joined=sum(1 for n in joined if n in self.agents),
            waiting=sum(1 for n in self.agents if n not in members) if frozen else 0,
            last_call_deadline=deadline,
            decision=decision,
        )

    def stop(self) -> None:
        """End the term: the watches go; the run lease is let go, not revoked — the next leader
        adopts it (or it expires after run_ttl when no agent is left to lead).
        """
        for w in self._watches:
            w.cancel()
        self._watches.clear()
        if self._run_lease is not None:
            self._run_lease.orphan()
            self._run_lease = None


def _frozen(action: Freeze | Carry, run_lease: int, **carried: object) -> Round:
    """The FROZEN round ``action`` writes (``carried``: a carried round's fields, §3a)."""
    return Round(
        action.number,
        Phase.FROZEN,
        action.members,
        action.restart_count,
        action.master_addr,
        action.master_port,
        run_lease=run_lease,
        **carried,  # type: ignore[arg-type]
    )


__all__ = ["Leader"]
