"""The elastic rendezvous on etcd v3: EtcdRendezvousHandler.

Roles (docs/design.md §2–3): every agent holds a Session (lease + agent key), joins rounds by
writing a leased join record, and watches the round key alone; the oldest agent is also the
Leader, which decides (protocol.py) and applies. Membership changes reach the agent through
``membership_changed`` — set by the round-key watch, never by polling.

Who owns what: the handler owns the client (unless given one), the round view, the event log and
the current incarnation (session and driver), and builds the RunContext the pieces borrow; each
session has one Driver (the round watch, the election, the leader's term). The agent reaches the
session through the ports the handler gives (ports/node_ports.py: liveness, report, hang, drain,
progress); none holds the handler.

Threads: the agent's own thread (next_rendezvous, joins, restarts, close), the client's watch and
keep-alive threads (callbacks only update the view and post to the driver) and one driver thread
per session.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import (
    FailureInfo,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from etcdrun.rendezvous.client import (
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdPermissionError,
    LeaseLoss,
    RetryPolicy,
)
from etcdrun.rendezvous.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.keys import RunKeys, require_run_id
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round, Settings
from etcdrun.rendezvous.etcd.core.rdzv_conf import etcd_config
from etcdrun.rendezvous.etcd.core.round_view import RoundView
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader.driver import Driver, SessionLost
from etcdrun.rendezvous.etcd.node import joining, lifecycle, node_names
from etcdrun.rendezvous.etcd.node.cooldown import Cooldown
from etcdrun.rendezvous.etcd.node.own_shard import OwnShard
from etcdrun.rendezvous.etcd.node.run_gate import RunGate
from etcdrun.rendezvous.etcd.node.spare_port import SparePort
from etcdrun.rendezvous.etcd.ports.drain import EtcdDrain
from etcdrun.rendezvous.etcd.ports.hang import EtcdHang
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation
from etcdrun.rendezvous.etcd.ports.liveness import SessionLiveness
from etcdrun.rendezvous.etcd.ports.node_ports import NodePorts
from etcdrun.rendezvous.etcd.ports.progress import EtcdProgress
from etcdrun.rendezvous.etcd.ports.report import EtcdReport
from etcdrun.rendezvous.events import EventLog

log = logging.getLogger(__name__)


class _Reopen(Exception):
    """This session is done with: start over with a new one (or "shut down")."""


class EtcdRendezvousHandler(RendezvousHandler):
    """Elastic rendezvous for one node; see the module docstring for the moving parts.

    Connection loss: etcd calls retry across endpoints for ``retry_timeout``; a lease that cannot
    be refreshed is declared lost before it can expire, ``membership_changed`` is set, and the
    next ``next_rendezvous()`` rejoins as a new participant.
    """

    def __init__(self, params: RendezvousParameters, client: EtcdClient | None = None) -> None:
        require_run_id(params.run_id)
        self.params = params
        self.cfg = etcd_config(params.config)
        self._own_client = client is None
        self.ctx = RunContext(
            client=client or EtcdClient(self.cfg.client_config(params.endpoint)),
            keys=RunKeys(self.cfg.prefix, params.run_id),
            events=EventLog(params.run_id),
            view=RoundView(),
            settings=Settings(
                params.min_nodes,
                params.max_nodes,
                self.cfg.last_call_timeout,
                self.cfg.max_restarts,
            ),
            config=self.cfg,
        )
        self.run_id = params.run_id
        self.host = socket.gethostname()
        self.addr = params.local_addr or self.host
        self._now = Incarnation()
        self._ports = NodePorts.build(self.ctx, self._now)  # what the agent talks to
        self._cooldown = Cooldown(self.ctx)  # a bad host sits rounds out (node/cooldown.py)
        self._spare = SparePort()  # MASTER_PORT of a carried round we lead off (design.md §3a)
        self._incarnation = 0
        self._tag = node_names.draw_suffix()  # node ids: <host>-<tag>.<incarnation>
        self._joined: int | None = None  # the round number this session has joined
        self._gate = RunGate(self.ctx)
        self._shutdown = False
        self._superseded: int | None = None  # the running round whose end was reported
        self._seat = OwnShard(self.ctx)  # this node's shard of sharded rounds, by watch
        self.view.listen(self._on_superseded)

    # ---- what the run context holds, for the backend's own tests and tools -------------------
    @property
    def client(self) -> EtcdClient:
        return self.ctx.client

    @property
    def keys(self) -> RunKeys:
        return self.ctx.keys

    @property
    def events(self) -> EventLog:
        return self.ctx.events

    @property
    def view(self) -> RoundView:
        return self.ctx.view

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    # ---- RendezvousHandler: torch's part -------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd"

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def membership_changed(self) -> threading.Event:
        return self.view.membership_changed

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.cfg.join_timeout
        try:
            return self._next(deadline)
        except EtcdError as e:
            raise self._wrap(e) from None

    def is_closed(self) -> bool:
        return self._phase() is Phase.CLOSED

    def set_closed(self) -> None:
        self._close(st.SUCCEEDED, None)

    def job_running(self) -> bool:
        return self._phase() is Phase.FROZEN

    def _phase(self) -> Phase | None:
        """The round key's phase as etcd has it now (None: no round yet)."""
        try:
            r = lifecycle.read_round(self.client, self.keys)
        except EtcdError as e:
            raise self._wrap(e) from None
        return None if r is None else r.phase

    def num_nodes_waiting(self) -> int:
        try:
            res = self.client.get_prefix(self.keys.agents, keys_only=True)
        except EtcdError as e:
            raise self._wrap(e) from None
        r = self.view.current()
        live = [self.keys.parse(kv.key)[2] or "" for kv in res.kvs]
        return len(live) if r is None else r.outside(live)

    def shutdown(self) -> bool:
        """Leave now: revoke the lease so peers start a new round at once. Idempotent.
        After ``session.orphan()`` (a test playing kill -9) nothing is revoked or reported.
        """
        if self._shutdown:
            return True
        self._shutdown = True
        sess = self._now.session
        orphaned = sess is not None and sess.orphaned
        if sess is not None and not orphaned and not sess.lost.is_set():
            sess.mark_leaving("left", self.policy.parting_timeout)  # "left", not "lost"
        ok = self._drop_session()  # the driver first: a leader must not reopen the round
        self._ports.close()
        self.view.wake()  # a next_rendezvous() waiting in another thread ends now
        if not orphaned and self.client.reached:  # never reached: nothing of ours to remove
            lifecycle.clean_up_if_none_left(self.ctx)
        if self._own_client:
            self.client.close(revoke_leases=not orphaned)
        if not orphaned:
            self.events.emit("node_left")
        node_names.release_suffix(self._tag)
        self._spare.close()
        return ok

    # ---- RendezvousHandler: membership, the restart contract, the ports ------------------------
    def on_membership_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self.view.listen(callback)

    def liveness(self) -> SessionLiveness:
        return self._ports.liveness

    def report(self) -> EtcdReport:
        return self._ports.report

    def hang(self) -> EtcdHang:
        return self._ports.hang

    def drain(self) -> EtcdDrain:
        return self._ports.drain

    def progress(self) -> EtcdProgress:
        return self._ports.progress

    def request_restart(self, reason: str, failure: FailureInfo | None = None) -> bool:
        running = self.view.running()
        if running is None:
            return False
        try:
            opened = lifecycle.request_restart(
                self.ctx, running, reason, failure, by=self.node_id or ""
            )
            if opened and failure is not None:  # charged to the node that opened the restart
                self._cooldown.charge(running, failure, self.node_id or "")
            return opened
        except EtcdError as e:
            raise self._wrap(e) from None

    def exit_barrier(self, timeout: float | None = None) -> bool:
        running, sess = self.view.running(), self._now.session
        if running is None or sess is None or sess.lost.is_set():
            return False  # a lost session's success is of a round the others left
        try:
            wait = self.cfg.close_timeout if timeout is None else timeout
            return lifecycle.exit_barrier(self.ctx, sess, running, timeout=wait)
        except EtcdError as e:
            raise self._wrap(e) from None

    def close_with_failure(self, failure: FailureInfo) -> None:
        self._close(st.FAILED, codec.failure_to(failure))

    def closed_failure(self) -> FailureInfo | None:
        msg = self.view.closed_state()
        if not self._gate.saw_live:
            return None  # a run that ended before we came: its failure is not ours to report
        if msg is None or msg.outcome != st.FAILED:
            return None
        return codec.failure_from(msg.failure)

    # ---- ours ----------------------------------------------------------------------------------
    @property
    def session(self) -> Session | None:
        """This node's current session (None before the first round and after shutdown)."""
        return self._now.session

    @property
    def node_id(self) -> str | None:
        return self._now.node_id

    @property
    def policy(self) -> RetryPolicy:
        return self.client.policy

    # ---- joining rounds --------------------------------------------------------------------------
    def _next(self, deadline: float) -> RendezvousInfo:
        while True:
            try:
                return self._next_once(deadline)
            except _Reopen:
                continue  # with a new session

    def _next_once(self, deadline: float) -> RendezvousInfo:
        sess = self._ensure_session()
        self.view.begin()
        while True:
            r = self.view.current()
            if sess.lost.is_set() or self._shutdown:
                self._drop_session()
                raise _Reopen()  # a new session, or "shut down"
            if self._ports.drain.requested is not None:  # asked to leave: wait for no round
                raise RendezvousClosedError(
                    f"this node was asked to drain by {self._ports.drain.requested.by}",
                    run_id=self.run_id,
                    round=r.number if r else None,
                    node=sess.node_id,
                )
            self._gate.check(r, sess.node_id)
            if self._cooldown.until() is not None:  # cooled down: a spare until its time is up
                self._rest(sess, r)
                deadline = time.monotonic() + self.cfg.join_timeout
                continue
            seat = self._seat.of(r, sess.node_id)  # ``r`` with this node's entry, if it has one
            if r is not None and r.phase is Phase.JOINING and self._joined != r.number:
                if self._join(sess, r):
                    continue  # joined: wait for the freeze; else wait for the newer round
            elif seat is not None and seat.phase is Phase.FROZEN and seat.member(sess.node_id):
                if self.view.is_fresh(seat):
                    self._spare.take(sess, seat, self.events)  # rank 0 on its spare: redraw
                    return joining.accept(self.ctx, sess.node_id, seat)
            spare = (
                seat is not None and seat.phase is Phase.FROZEN and not seat.member(sess.node_id)
            )
            if spare:  # a hot spare (or a newcomer about to be let in): join_timeout bounds a
                deadline = time.monotonic() + self.cfg.join_timeout  # round that gathers
            came = self._seat.arrival(r, sess.node_id)  # a shard due: its watch wakes us
            if not self.view.wait(r, deadline, lambda c=came: c() or self._stop_waiting(sess)):
                if spare:
                    continue  # the job runs on without us: keep waiting for a place
                raise RendezvousTimeoutError(
                    f"no round with this node completed within join_timeout="
                    f"{self.cfg.join_timeout:g}s ({self._ports.report.status()})",
                    run_id=self.run_id,
                    round=r.number if r else None,
                    node=sess.node_id,
                )

    def _rest(self, sess: Session, r: Round | None) -> None:
        """Sit this node's cooldown out, joining no round: a timed wait on its end (the round
        view wakes it for a loss, a drain, a shutdown or a new round), then say it is over.
        """
        until = self._cooldown.until()
        if until is not None and not self.view.wait(r, until, lambda: self._stop_waiting(sess)):
            self._cooldown.end(sess.node_id, self.view.current())

    def _stop_waiting(self, sess: Session) -> bool:
        return sess.lost.is_set() or self._shutdown or self._ports.drain.requested is not None

    def _join(self, sess: Session, r: Round) -> bool:
        lws = self.params.local_world_size
        outcome = joining.join(self.client, self.keys, sess, r, self.addr, lws)
        if outcome is joining.Joined.YES:
            self._joined = r.number
            self.events.emit("node_joined", round=r.number)
        elif outcome is joining.Joined.NOT_OWNER:
            log.error("%s was overwritten or removed by someone else; registering anew", sess.key)
            self.events.emit("session_replaced", reason=outcome.value)
            self._drop_session()
            raise _Reopen()
        return outcome is joining.Joined.YES

    def _ensure_session(self) -> Session:
        if self._shutdown:
            raise RendezvousClosedError("handler was shut down", run_id=self.run_id)
        sess = self._now.session
        if sess is not None and not sess.lost.is_set():
            return sess
        self._drop_session()
        self._incarnation += 1
        self._spare.draw()  # a new session offers a new port (node/spare_port.py)
        fold = joining.FoldedJoin(self.keys, self.addr, self.params.local_world_size)
        if self._cooldown.until() is not None:
            fold = None  # cooled down: it registers, but joins no round yet
        sess, self._tag = node_names.register(
            self.ctx, self.host, self._tag, self._incarnation, self._agent_info, fold
        )
        self._now.session, self._joined = sess, fold.joined(sess) if fold else None
        self.events.node = sess.node_id
        driver = Driver(self.ctx, sess)
        sess.on_lost(lambda s: self._on_lost(s, driver))
        self._ports.liveness.attach(sess)
        self._ports.drain.attach(sess)
        self._seat.place(sess.node_id, sess.create_revision)  # when sharding: its shard key
        self._now.driver = driver
        driver.start()
        rev, pid = sess.create_revision, os.getpid()
        self.events.emit(
            "session_opened", create_revision=rev, lease=sess.lease_id, host=self.host, pid=pid
        )
        if self._joined is not None:  # its join record went in with the agent key
            self.events.emit("node_joined", round=self._joined, with_registration=True)
        return sess

    def _agent_info(self, node_id: str) -> st.AgentInfo:
        lws = self.params.local_world_size
        spare = self._spare.port
        return joining.agent_info(node_id, self.host, self.addr, lws, self.settings, spare)

    def _on_superseded(self) -> None:
        """View listener (any thread): the round this node runs in is over — once per round."""
        run, sess = self.view.running(), self._now.session
        if run is None or self._superseded == run.number or sess is None or sess.lost.is_set():
            return
        r = self.view.current()
        if r is not None and r.phase is Phase.CLOSED:
            return  # not superseded: the run ended (run_closed says how)
        self._superseded = run.number
        self.events.emit(
            "round_superseded",
            round=run.number,
            by_round=r.number if r is not None else None,
            phase=r.phase.name if r is not None else None,
            reason=self.view.reason(),
        )

    def _drop_session(self) -> bool:
        self._ports.drain.detach()
        self._seat.cancel()
        driver, self._now.driver = self._now.driver, None
        if driver is not None:
            driver.stop()
        sess, self._now.session = self._now.session, None
        return sess.close() if sess is not None else True

    def _on_lost(self, sess: Session, driver: Driver) -> None:
        """Keep-alive thread: fence (wake the agent, stop leading) — unless we left ourselves."""
        if sess.lost_how is LeaseLoss.REVOKED:
            self.view.wake()
            return  # our own leave (node_left says so), not a loss
        self.events.emit("session_lost", reason=sess.lost_reason)
        self.view.interrupt()
        driver.post(SessionLost())

    # ---- the run's end -------------------------------------------------------------------------
    def _close(self, outcome: int, failure: st.Failure | None) -> None:
        try:
            done = lifecycle.set_closed(self.ctx, outcome, failure, by=self.node_id or "")
        except EtcdError as e:
            raise self._wrap(e) from None
        if done is not None:
            self.view.apply(*done)  # our own write, known at once

    def _wrap(self, e: EtcdError) -> RendezvousError:
        refused = isinstance(e, (EtcdAuthError, EtcdPermissionError))
        r = self.view.current()
        return RendezvousConnectionError.of(
            str(e), self.keys.root if refused else None, self.run_id, r and r.number, self.node_id
        )


__all__ = ["EtcdRendezvousHandler"]
