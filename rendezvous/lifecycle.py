"""The end of a round or of the run: restarts after a worker failure, the exit barrier, closing
the run (as succeeded or failed), and the last agent's clean-up.

Why apart from the handler: these are the writes an agent makes about the *job* rather than about
its own membership; each is one fenced transaction from transitions.py. A mixin of
EtcdRendezvousHandler (it uses the handler's client, keys, caches and session).
"""

from __future__ import annotations

import logging
import time

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import codec, events, transitions
from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.protocol import Phase

log = logging.getLogger(__name__)


class RunLifecycle:
    def set_closed(self, outcome: int = st.SUCCEEDED, failure: st.Failure | None = None) -> None:
        """Close the run (fenced on the round key); a run already closed stays as it is.
        The closed marker lives for join_timeout, so late joiners fail at once meanwhile."""
        try:
            marker = None
            while True:
                kv = self.client.get(self.keys.round)
                cur = (
                    codec.round_from(kv.key, kv.value, kv.mod_revision, self.run_id) if kv else None
                )
                if cur is not None and cur.phase is Phase.CLOSED:
                    if marker is not None:
                        marker.revoke()
                    return
                if marker is None:
                    marker = self.client.lease(int(self.cfg.join_timeout), keepalive=False)
                closed, (guard, ops) = transitions.close(
                    self.keys, cur, outcome, failure, marker.id, self.node_id or ""
                )
                if self.client.txn(guard, ops).succeeded:
                    events.emit(
                        "run_closed",
                        run_id=self.run_id,
                        round=closed.number,
                        node=self.node_id,
                        outcome=st.Outcome.Name(outcome),
                    )
                    return
        except EtcdError as e:
            raise self._wrap(e) from None

    def closed_state(self) -> st.RoundState | None:
        """The CLOSED round record (outcome, failure) once the run is closed, else None."""
        with self._cond:
            msg = self._round_msg
        return msg if msg is not None and msg.phase == st.CLOSED else None

    def close_with_failure(self, failure: FailureInfo) -> None:
        self.set_closed(st.FAILED, codec.failure_to(failure))

    def closed_failure(self) -> FailureInfo | None:
        msg = self.closed_state()
        if msg is None or msg.outcome != st.FAILED:
            return None
        return codec.failure_from(msg.failure)

    def request_restart(self, reason: str, failure: FailureInfo | None = None) -> bool:
        """Open the next round after a worker failure. The leader charges the job-wide budget
        when it freezes that round — or closes the run as failed when the budget is spent —
        unless a member turns out to be gone (its death made the workers fail: free). False when
        the round had already moved on (someone else restarted it)."""
        r = self._running
        if r is None:
            return False
        new, (guard, ops) = transitions.start_round(
            self.keys,
            r,
            r.number + 1,
            r.members,
            r.restart_count,
            reason,
            self.node_id or "",
            failure=failure,
        )
        try:
            res = self.client.txn(guard, ops)
        except EtcdError as e:
            raise self._wrap(e) from None
        if res.succeeded:
            events.emit(
                "round_started",
                run_id=self.run_id,
                round=new.number,
                node=self.node_id,
                reason=reason,
                restart_count=new.restart_count,
            )
        return res.succeeded

    def exit_barrier(self, timeout: float | None = None) -> bool:
        """Wait until every node of the running round finished (or the run closed); the last
        one to arrive closes the run as SUCCEEDED. True when everyone made it in time."""
        r, sess = self._running, self._session
        if r is None or sess is None:
            return False
        prefix = self.keys.barrier(r.number, "exit")
        try:
            self.client.put(prefix + sess.node_id, b"", lease=sess.lease.id)
            count = self.client.get_prefix(prefix, count_only=True).count
            if count >= len(r.members):
                self.set_closed(st.SUCCEEDED)
                return True
        except EtcdError as e:
            raise self._wrap(e) from None
        end = time.monotonic() + (self.cfg.close_timeout if timeout is None else timeout)
        with self._cond:
            while time.monotonic() < end:
                cur = self._round
                if (
                    cur is not r
                    and cur is not None
                    and (cur.phase is Phase.CLOSED or cur.number > r.number)
                ):
                    return cur.phase is Phase.CLOSED
                self._cond.wait(min(1.0, max(0.0, end - time.monotonic())))
        return False

    def _clean_up_if_none_left(self) -> None:
        """The last agent out removes the run's keys (a closed run keeps its marker, which
        expires by itself), so nothing of a finished job stays in etcd. Best effort, bounded."""
        try:
            kv = self.client.get(self.keys.round, timeout=2.0)
            cur = codec.round_from(kv.key, kv.value, kv.mod_revision, self.run_id) if kv else None
            guard, ops = transitions.clean_up_if_none_left(self.keys, cur)
            if self.client.txn(guard, ops, timeout=2.0).succeeded:
                events.emit("run_cleaned", run_id=self.run_id, node=self.node_id)
        except (EtcdError, RendezvousError) as e:
            log.warning("could not remove the run's keys: %s", e)
