"""The elastic rendezvous on etcd v3: EtcdRendezvousHandler.

Roles (design.md §2–3): every agent holds a Session (lease + agent key), joins rounds by writing a
leased join record, and watches the round key alone; the oldest agent is also the Leader, which
decides (protocol.py) and applies. Membership changes reach the agent through
``membership_changed`` — set by the round-key watch, never by polling.

Threads: the agent's own thread (next_rendezvous, joins, restarts, close), the client's watch and
keep-alive threads (callbacks only update caches and post to a queue), and one driver thread per
session that runs the election and the leader's decisions from that queue.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous import codec, events
from etcdrun.rendezvous._version import __version__
from etcdrun.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from etcdrun.rendezvous.client import (
    ClientConfig,
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdPermissionError,
    Watch,
    WatchBatch,
)
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.driver import Driver
from etcdrun.rendezvous.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from etcdrun.rendezvous.etcd_config import EtcdRendezvousConfig
from etcdrun.rendezvous.keys import RunKeys
from etcdrun.rendezvous.lifecycle import RunLifecycle
from etcdrun.rendezvous.ports import reserve_free_port
from etcdrun.rendezvous.protocol import Phase, Round, Settings
from etcdrun.rendezvous.session import Session

log = logging.getLogger(__name__)


def client_for(params: RendezvousParameters, cfg: EtcdRendezvousConfig) -> EtcdClient:
    return EtcdClient(
        ClientConfig.create(
            params.endpoint,
            ca_cert=cfg.cacert,
            cert=cfg.cert,
            key=cfg.key,
            user=cfg.user,
            password=cfg.password,
            request_timeout=cfg.request_timeout,
            retry_timeout=cfg.retry_timeout,
        )
    )


class EtcdRendezvousHandler(RunLifecycle, RendezvousHandler):
    """Elastic rendezvous for one node; see the module docstring for the moving parts.

    Connection loss: etcd calls retry across endpoints for ``retry_timeout``; a lease that cannot
    be refreshed is declared lost before it can expire, ``membership_changed`` is set, and the
    next ``next_rendezvous()`` rejoins as a new participant.
    """

    def __init__(self, params: RendezvousParameters, client: EtcdClient | None = None) -> None:
        self.params = params
        self.cfg = EtcdRendezvousConfig.from_conf(params.config)
        self.settings = Settings(
            params.min_nodes, params.max_nodes, self.cfg.last_call_timeout, self.cfg.max_restarts
        )
        self.keys = RunKeys(self.cfg.prefix, params.run_id)
        self.run_id = params.run_id
        self._own_client = client is None
        self.client = client or client_for(params, self.cfg)
        self.host = socket.gethostname()
        self.addr = params.local_addr or self.host
        self._cond = threading.Condition()
        self._round: Round | None = None
        self._round_msg: st.RoundState | None = None
        self._running: Round | None = None
        self._changed = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._session: Session | None = None
        self._incarnation = 0
        self._tag = os.urandom(3).hex()  # several handlers may share one process
        self._driver: Driver | None = None
        self._round_watch: Watch | None = None
        self._joined: int | None = None
        self._accepted_rev = 0  # the last round run: a cached stale copy is never rerun
        self._shutdown = False

    # ---- RendezvousHandler -------------------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd"

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def membership_changed(self) -> threading.Event:
        return self._changed

    def on_membership_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        with self._cond:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._cond:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def _set_changed_locked(self) -> None:
        self._changed.set()
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:
                log.exception("membership listener failed")

    def session_lost(self) -> bool:
        """True when this node's lease is gone: its workers must stop at once (fencing, S4)."""
        sess = self._session
        return sess is not None and sess.lease is not None and sess.lost.is_set()

    @property
    def node_id(self) -> str | None:
        return self._session.node_id if self._session else None

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.cfg.join_timeout
        try:
            return self._next(deadline)
        except EtcdError as e:
            raise self._wrap(e) from None

    def _next(self, deadline: float) -> RendezvousInfo:
        self._ensure_session()
        self._running = None
        self._changed.clear()
        sess = self._session
        assert sess is not None
        while True:
            with self._cond:
                r = self._round
            if sess.lost.is_set():
                self._drop_session()
                return self._next(deadline)
            if r is not None and r.phase is Phase.CLOSED:
                raise RendezvousClosedError(
                    "the run is closed", run_id=self.run_id, round=r.number, node=sess.node_id
                )
            if r is not None and r.phase is Phase.JOINING and self._joined != r.number:
                self._join(sess, r)
                continue
            if (
                r is not None
                and r.phase is Phase.FROZEN
                and r.member(sess.node_id)
                and r.mod_revision > self._accepted_rev
            ):
                return self._accept(sess, r)
            with self._cond:
                if self._round is r and not sess.lost.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RendezvousTimeoutError(
                            f"no round with this node completed within join_timeout="
                            f"{self.cfg.join_timeout:g}s ({self.status()})",
                            run_id=self.run_id,
                            round=r.number if r else None,
                            node=sess.node_id,
                        )
                    self._cond.wait(min(left, 1.0))

    def _join(self, sess: Session, r: Round) -> None:
        rec = st.JoinRecord(
            node_id=sess.node_id,
            addr=self.addr,
            local_world_size=self.params.local_world_size,
            master_port=reserve_free_port(),
            agent_create_revision=sess.create_revision,
        )
        res = self.client.txn(
            [t.mod_revision(self.keys.round, "==", r.mod_revision)],
            [t.put(self.keys.join(r.number, sess.node_id), codec.encode(rec), sess.lease.id)],
        )
        if res.succeeded:
            self._joined = r.number
            events.emit("node_joined", run_id=self.run_id, round=r.number, node=sess.node_id)
        else:
            self._wait_newer(r)

    def _wait_newer(self, r: Round, timeout: float = 1.0) -> None:
        with self._cond:
            if self._round is r:
                self._cond.wait(timeout)

    def _accept(self, sess: Session, r: Round) -> RendezvousInfo:
        me = r.member(sess.node_id)
        assert me is not None
        self._running = r
        self._accepted_rev = r.mod_revision
        info = RendezvousInfo(
            run_id=self.run_id,
            round=r.number,
            node_id=sess.node_id,
            node_rank=me.node_rank,
            node_count=len(r.members),
            first_global_rank=me.first_global_rank,
            world_size=sum(m.local_world_size for m in r.members),
            master_addr=r.master_addr,
            master_port=r.master_port,
            restart_count=r.restart_count,
            participants=r.members,
            max_restarts=self.settings.max_restarts,
        )
        with self._cond:
            if self._round is not r:
                self._on_round_locked(self._round)
        events.emit(
            "round_accepted",
            run_id=self.run_id,
            round=r.number,
            node=sess.node_id,
            node_rank=me.node_rank,
            node_count=len(r.members),
        )
        return info

    def is_closed(self) -> bool:
        try:
            kv = self.client.get(self.keys.round)
        except EtcdError as e:
            raise self._wrap(e) from None
        if kv is None:
            return False
        return (
            codec.round_from(kv.key, kv.value, kv.mod_revision, self.run_id).phase is Phase.CLOSED
        )

    def round_reason(self) -> str:
        """Why the current round was opened ("node(s) left: ...", "worker rank 3 failed")."""
        with self._cond:
            msg = self._round_msg
        return msg.reason if msg is not None else ""

    def num_nodes_waiting(self) -> int:
        try:
            res = self.client.get_prefix(self.keys.agents, keys_only=True)
        except EtcdError as e:
            raise self._wrap(e) from None
        with self._cond:
            r = self._round
        members = {m.node_id for m in r.members} if r and r.phase is Phase.FROZEN else set()
        return sum(1 for kv in res.kvs if self.keys.parse(kv.key)[2] not in members)

    def shutdown(self) -> bool:
        """Leave now: revoke the lease so peers start a new round at once. Idempotent."""
        if self._shutdown:
            return True
        self._shutdown = True
        node = self.node_id
        self._stop_watching()  # a leader must not reopen the round it is about to remove
        ok = self._drop_session()
        self._clean_up_if_none_left()
        if self._own_client:
            self.client.close()
        events.emit("node_left", run_id=self.run_id, node=node)
        return ok

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> str:
        with self._cond:
            r = self._round
        if r is None:
            return "waiting for the first round"
        s = f"round {r.number} {r.phase.name.lower()}"
        d = self._driver
        if d is not None and d.leader is not None and r.phase is Phase.JOINING:
            s += (
                f": {d.leader.joined_count(r.number)}/{len(d.leader.agents)} live nodes "
                f"joined (min {self.settings.min_nodes}, max {self.settings.max_nodes})"
            )
            left = d.leader.last_call_left(r.number, time.monotonic())
            if left is not None:
                s += f", last call in {left:.0f} s"
        elif r.phase is Phase.FROZEN:
            s += f" with {len(r.members)} nodes"
        return s

    # ---- internals ---------------------------------------------------------------------------
    def _wrap(self, e: EtcdError) -> RendezvousError:
        kind = RendezvousConnectionError
        what = (
            f"etcd refused access to {self.keys.root}"
            if isinstance(e, (EtcdAuthError, EtcdPermissionError))
            else "etcd error"
        )
        r = self._round
        return kind(
            f"{what}: {e}", run_id=self.run_id, round=r.number if r else None, node=self.node_id
        )

    def _ensure_session(self) -> None:
        if self._shutdown:
            raise RendezvousClosedError("handler was shut down", run_id=self.run_id)
        if self._session is not None and not self._session.lost.is_set():
            return
        self._drop_session()
        self._incarnation += 1
        node_id = f"{self.host}-{os.getpid()}-{self._tag}.{self._incarnation}"
        info = st.AgentInfo(
            node_id=node_id,
            host=self.host,
            addr=self.addr,
            pid=os.getpid(),
            local_world_size=self.params.local_world_size,
            version=__version__,
            started_unix_ms=int(time.time() * 1000),
        )
        sess = Session(self.client, self.keys, info, self.cfg.lease_ttl).open()
        self._session = sess
        self._joined = None
        sess.lease.on_lost(self._on_lost)
        kv_rev = self._load_round()
        self._round_watch = self.client.watch(
            self.keys.round, start_revision=kv_rev + 1, callback=self._on_round_batch
        )
        self._driver = Driver(self, sess)
        events.emit(
            "session_opened",
            run_id=self.run_id,
            node=node_id,
            create_revision=sess.create_revision,
            lease=sess.lease.id,
        )

    def _load_round(self) -> int:
        res = self.client.range(self.keys.round)
        with self._cond:
            if res.kvs:
                kv = res.kvs[0]
                self._set_round_locked(
                    *codec.round_and_message(kv.key, kv.value, kv.mod_revision, self.run_id)
                )
            else:
                self._round, self._round_msg = None, None
        return res.revision

    def _stop_watching(self) -> None:
        if self._round_watch is not None:
            self._round_watch.cancel()
            self._round_watch = None
        if self._driver is not None:
            self._driver.stop()
            self._driver = None

    def _drop_session(self) -> bool:
        self._stop_watching()
        ok = True
        if self._session is not None:
            ok = self._session.close()
            self._session = None
        return ok

    def _on_lost(self, lease) -> None:
        if lease.lost_reason == "revoked":
            return  # our own leave (node_left says so), not a loss
        events.emit("session_lost", run_id=self.run_id, node=self.node_id, reason=lease.lost_reason)
        with self._cond:
            self._set_changed_locked()
            self._cond.notify_all()
        d = self._driver
        if d is not None:
            d.post(("lost",))

    def _on_round_batch(self, batch: WatchBatch) -> None:
        if batch.error is not None:  # compacted, or refused: read it again and re-watch
            log.warning("round watch ended (%s); re-reading the round", batch.error)
            d = self._driver
            if d is not None:
                d.post(("rewatch",))
            return
        for ev in batch.events:
            if ev.type == pb.Event.DELETE:  # the closed marker expired, or run cleaned up
                with self._cond:
                    self._round, self._round_msg = None, None
                    self._on_round_locked(None)
                continue
            try:
                r, msg = codec.round_and_message(
                    ev.kv.key, ev.kv.value, ev.kv.mod_revision, self.run_id
                )
            except RendezvousError as e:
                log.error("%s", e)
                continue
            with self._cond:
                self._set_round_locked(r, msg)
        d = self._driver
        if d is not None:
            d.post(("round",))

    def rewatch_round(self) -> None:
        """Re-read the round key and watch it again from there (after a watch ended)."""
        if self._round_watch is not None:
            self._round_watch.cancel()
        rev = self._load_round()
        self._round_watch = self.client.watch(
            self.keys.round, start_revision=rev + 1, callback=self._on_round_batch
        )

    def set_round(self, r: Round) -> None:
        """The leader's own successful write, applied before its watch event arrives."""
        with self._cond:
            self._set_round_locked(r, None)

    def get_round(self) -> Round | None:
        with self._cond:
            return self._round

    def _set_round_locked(self, r: Round, msg: st.RoundState | None) -> None:
        cur = self._round
        if cur is not None and r.mod_revision < cur.mod_revision:
            return
        if cur is not None and r.mod_revision == cur.mod_revision and msg is None:
            return
        self._round = r
        if msg is not None or cur is None or r.mod_revision > cur.mod_revision:
            self._round_msg = msg
        self._on_round_locked(r)

    def _on_round_locked(self, r: Round | None) -> None:
        run = self._running
        if run is not None and (r is None or r.number != run.number or r.phase is not run.phase):
            self._set_changed_locked()
        self._cond.notify_all()
