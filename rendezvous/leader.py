"""The leader's duties: keep the agents/ and rounds/ caches, decide, apply one fenced Txn.

Why separate from the handler: only one agent at a time does this, and it is where the O(N) cost
lives (N join events per round reach this one watcher). Every write is guarded twice: on the round
key's mod_revision (S1: at most one outcome per round) and on our own agent key's create revision
(a leader whose lease was lost cannot write, S4). A failed guard is not an error: the watch brings
the newer state, and the next decision starts from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import codec, events, transitions
from etcdrun.rendezvous.client import EtcdClient, EtcdError, Watch, WatchBatch
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.keys import RunKeys
from etcdrun.rendezvous.protocol import (
    Agent,
    CloseFailed,
    Freeze,
    Join,
    Member,
    Phase,
    Round,
    Settings,
    StartRound,
    View,
    Wait,
    decide,
)

log = logging.getLogger(__name__)


class Leader:
    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        settings: Settings,
        node_id: str,
        create_revision: int,
        get_round: Callable[[], Round | None],
        set_round: Callable[[Round], None],
        post: Callable[[object], None],
        closed_ttl: int = 600,
    ) -> None:
        self._c = client
        self._keys = keys
        self._settings = settings
        self._me = node_id
        self._my_rev = create_revision
        self._get_round = get_round
        self._set_round = set_round
        self._post = post
        self._closed_ttl = closed_ttl  # how long a failed run's marker stays
        self.agents: dict[str, Agent] = {}
        self.joins: dict[int, dict[str, Join]] = {}
        self.hints: dict[int, tuple[Member, ...]] = {}  # rounds/<n>/hint: order for round n
        self._watches: list[Watch] = []
        self._last_call: tuple[int, float] | None = None  # (round number, deadline)
        self.writes = 0

    # ---- caches -----------------------------------------------------------------------------
    def start(self) -> None:
        """Snapshot agents/ and rounds/ at one revision, then watch both from revision + 1."""
        res = self._c.txn(
            [], [t.get(self._keys.agents, prefix=True), t.get(self._keys.rounds, prefix=True)]
        )
        rev = res.revision
        for kv in res.responses[0].response_range.kvs:
            self._apply_kv(kv, deleted=False)
        for kv in res.responses[1].response_range.kvs:
            self._apply_kv(kv, deleted=False)
        for prefix in (self._keys.agents, self._keys.rounds):
            self._watches.append(
                self._c.watch(prefix, prefix=True, start_revision=rev + 1, callback=self._post)
            )
        events.emit(
            "leader_elected", run_id=self._keys.run_id, node=self._me, agents=len(self.agents)
        )

    def on_batch(self, batch: WatchBatch) -> None:
        if batch.error is not None:
            raise batch.error
        for ev in batch.events:
            self._apply_kv(ev.kv, deleted=ev.type == pb.Event.DELETE)

    def _apply_kv(self, kv: pb.KeyValue, deleted: bool) -> None:
        try:
            self._apply_kv_checked(kv, deleted)
        except RendezvousError as e:  # a foreign or corrupt record counts as absent
            log.error("leader %s: ignoring %s", self._me, e)

    def _apply_kv_checked(self, kv: pb.KeyValue, deleted: bool) -> None:
        kind, n, node = self._keys.parse(kv.key)
        rid = self._keys.run_id
        if kind == "agent" and node:
            if deleted:
                self.agents.pop(node, None)
            else:
                self.agents[node] = codec.agent_from(kv.key, kv.value, kv.create_revision, rid)
        elif kind == "hint" and n is not None:
            if deleted:
                self.hints.pop(n, None)
            else:
                self.hints[n] = codec.hint_from(kv.key, kv.value, rid)
        elif kind == "join" and node and n is not None:
            if deleted:
                self.joins.get(n, {}).pop(node, None)
            else:
                self.joins.setdefault(n, {})[node] = codec.join_from(kv.key, kv.value, rid)

    # ---- decisions --------------------------------------------------------------------------
    def act(self, now: float) -> float | None:
        """Decide and apply until the decision is to wait; return when to decide again."""
        for _ in range(4):  # a write changes the view; re-decide at once (bounded)
            r = self._get_round()
            if r is not None:
                for cache in (self.joins, self.hints):
                    for old in [k for k in cache if k < r.number]:
                        del cache[old]
                if r.phase is Phase.JOINING:
                    if r.number not in self.hints:
                        return None  # written in the same Txn as the round: its event is near
                    r = replace(r, members=self.hints[r.number])
            deadline = None
            if self._last_call and r is not None and self._last_call[0] == r.number:
                deadline = self._last_call[1]
            view = View(r, self.agents, self.joins.get(r.number, {}) if r else {}, deadline)
            action = decide(view, self._settings, now)
            if isinstance(action, Wait):
                if action.until is not None and r is not None:
                    self._last_call = (r.number, action.until)
                return action.until
            try:
                if not self._apply(r, action):
                    return None
            except EtcdError as e:
                log.warning(
                    "leader %s: %s failed: %s; retrying", self._me, type(action).__name__, e
                )
                return now + 0.5
        return None

    def _apply(self, r: Round | None, action: StartRound | Freeze | CloseFailed) -> bool:
        if isinstance(action, StartRound):
            new, (guard, ops) = transitions.start_round(
                self._keys,
                r,
                action.number,
                action.hint,
                action.restart_count,
                action.reason,
                self._me,
            )
        elif isinstance(action, Freeze):
            assert r is not None
            new, (guard, ops) = transitions.freeze(
                self._keys,
                r,
                action.members,
                action.master_addr,
                action.master_port,
                action.restart_count,
                self._me,
            )
        else:
            marker = self._c.lease(self._closed_ttl, keepalive=False)
            new, (guard, ops) = transitions.close(
                self._keys, r, st.FAILED, codec.failure_to(action.failure), marker.id, self._me
            )
        # S4: a leader whose own agent key is gone (lease lost) cannot write.
        guard.append(t.create_revision(self._keys.agent(self._me), "==", self._my_rev))
        res = self._c.txn(guard, ops)
        self.writes += 1
        if not res.succeeded:
            return False
        self._set_round(
            Round(
                new.number,
                new.phase,
                new.members,
                new.restart_count,
                new.master_addr,
                new.master_port,
                res.revision,
            )
        )
        if isinstance(action, CloseFailed):
            events.emit(
                "run_closed",
                run_id=self._keys.run_id,
                round=action.number,
                node=self._me,
                outcome="FAILED",
                restart_count=action.restart_count,
                failed_rank=action.failure.global_rank,
            )
        elif isinstance(action, StartRound):
            self.hints[action.number] = action.hint
            events.emit(
                "round_started",
                run_id=self._keys.run_id,
                round=action.number,
                node=self._me,
                reason=action.reason,
                restart_count=action.restart_count,
            )
        else:
            events.emit(
                "round_frozen",
                run_id=self._keys.run_id,
                round=action.number,
                node=self._me,
                nodes=[m.node_id for m in action.members],
                world_size=sum(m.local_world_size for m in action.members),
                revision=res.revision,
            )
        return True

    def last_call_left(self, number: int, now: float) -> float | None:
        """Seconds until the first round's last call ends, while it runs."""
        if self._last_call is None or self._last_call[0] != number:
            return None
        return max(0.0, self._last_call[1] - now)

    def joined_count(self, number: int) -> int:
        return sum(1 for n in self.joins.get(number, {}) if n in self.agents)

    def stop(self) -> None:
        for w in self._watches:
            w.cancel()
        self._watches.clear()
