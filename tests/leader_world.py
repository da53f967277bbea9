"""A small world against the in-memory etcd (tests/fake_etcd.py): N agents' sessions, the
oldest one's leader and a round view, with every watch batch delivered by hand. Shared by the
leader's, the driver's and the retry policy's tests.
"""

from __future__ import annotations

from fake_etcd import FakeEtcd

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import RetryPolicy
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.config import EtcdRendezvousConfig
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Round, Settings
from etcdrun.rendezvous.etcd.core.round_view import RoundView
from etcdrun.rendezvous.etcd.core.round_watch import RoundWatch
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader.term import Leader
from etcdrun.rendezvous.events import EventLog

KEYS = RunKeys("/etcdrun", "unit")
FAIL = FailureInfo(node_id="n1", host="h", global_rank=1, exit_code=1, message="boom")


def open_session(fake: FakeEtcd, name: str) -> Session:
    info = st.AgentInfo(node_id=name, host="h", addr=f"{name}.addr", local_world_size=1)
    return Session.open(fake, KEYS, info, ttl=5)


class World:
    """N agents' sessions, the oldest one's leader, and a round view fed by a round watch."""

    def __init__(self, n: int, settings: Settings, policy: RetryPolicy | None = None) -> None:
        self.fake = FakeEtcd(deliver="manual", policy=policy)
        self.sessions = [open_session(self.fake, f"n{i}") for i in range(n)]
        self.view = RoundView()
        self.events = EventLog(KEYS.run_id)
        self.got: list[dict] = []  # every event the leader emitted
        self.events.subscribe(self.got.append)
        self.batches: list = []
        config = EtcdRendezvousConfig(run_lease_ttl=30)
        self.ctx = RunContext(self.fake, KEYS, self.events, self.view, settings, config)
        self.watch = RoundWatch(self.ctx, on_change=lambda: None, on_end=lambda: None)
        self.watch.start()
        self.leader = Leader(self.ctx, self.sessions[0], deliver=self.batches.append)
        self.leader.start()
        self.now = 100.0

    def step(self) -> float | None:
        """Deliver what etcd sent, then let the leader decide once."""
        self.fake.pump()
        while self.batches:
            self.leader.on_batch(self.batches.pop(0))
        return self.leader.act(self.now)

    def join(self, i: int, number: int | None = None) -> None:
        s = self.sessions[i]
        r = self.view.current()
        n = number if number is not None else r.number
        rec = st.JoinRecord(
            node_id=s.node_id,
            addr=s.info.addr,
            local_world_size=1,
            master_port=1000 + i,
            agent_create_revision=s.create_revision,
        )
        self.fake.put(KEYS.join(n, s.node_id), codec.encode(rec), s.lease_id)

    def round(self) -> Round:
        self.fake.pump()
        r = self.view.current()
        assert r is not None
        return r
