"""One retry and timeout policy: change ``request_timeout`` and ``retry_timeout`` and every loop
follows — unary calls, the keep-alive, the watch, the leader and the parting requests.

Each loop is observed doing its real work against a stub (a gRPC stub that records its deadline,
a transport whose streams break, an in-memory etcd), never timed.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fake_etcd import FakeEtcd
from leader_world import World

from etcdrun.rendezvous.api import RendezvousParameters
from etcdrun.rendezvous.client import EtcdClient, EtcdConnectionError, RetryPolicy
from etcdrun.rendezvous.client import keeper as keeper_mod
from etcdrun.rendezvous.client import lease as lease_mod
from etcdrun.rendezvous.client import policy as policy_mod
from etcdrun.rendezvous.client import transport as transport_mod
from etcdrun.rendezvous.client import watch as watch_mod
from etcdrun.rendezvous.etcd.core.protocol import Settings
from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler

SETTINGS = [(2.0, 30.0), (0.4, 5.0)]


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def test_the_rendezvous_and_every_part_of_its_client_share_one_policy():
    conf = {"request_timeout": 0.4, "retry_timeout": 5}
    h = EtcdRendezvousHandler(RendezvousParameters("etcd", "127.0.0.1:1", "p", 1, 1, config=conf))
    try:
        assert h.policy == RetryPolicy(0.4, 5.0)
        t = h.client._t
        assert t.policy is h.client.policy and h.client._leases._t is t
        assert h.client._watches._t is t
    finally:
        h.shutdown()


@pytest.mark.parametrize("request_timeout, retry_timeout", SETTINGS)
def test_unary_calls_each_attempt_and_the_whole_call(monkeypatch, request_timeout, retry_timeout):
    deadlines: list[float] = []
    budgets: list[float] = []

    def bind(channel, name):
        def call(request, timeout=None, metadata=None):
            deadlines.append(timeout)
            raise Unavailable()

        return call

    import tenacity

    def stop_after_delay(delay):
        budgets.append(delay)
        return tenacity.stop_after_attempt(3)  # the budget is recorded; end the test quickly

    monkeypatch.setattr(transport_mod, "bind", bind)
    monkeypatch.setattr(tenacity, "stop_after_delay", stop_after_delay)
    with EtcdClient(
        "127.0.0.1:1,127.0.0.1:2", request_timeout=request_timeout, retry_timeout=retry_timeout
    ) as c:
        with pytest.raises(EtcdConnectionError, match="unreachable"):
            c.range("k")
    # the bare first try, then the three tenacity let through: each gets request_timeout
    # The call's budget is what is left of the outage's (it began with this call's first try).
    assert deadlines == [request_timeout] * 4 and budgets == [pytest.approx(retry_timeout, 0.01)]


class BrokenTransport:
    """A transport whose every stream breaks: what the keep-alive and the watch see when etcd
    is unreachable.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.stream_timeouts: list[float | None] = []

    def preferred(self) -> int:
        return 0

    def endpoint(self, index: int) -> str:
        return "127.0.0.1:1"

    def stream(self, name, requests, index, timeout=None):
        self.stream_timeouts.append(timeout)
        raise Unavailable()

    def on_stream_error(self, exc, index):
        return EtcdConnectionError("unreachable")


@pytest.mark.parametrize("request_timeout, retry_timeout", SETTINGS)
def test_the_keepalive_tick_and_its_retry(request_timeout, retry_timeout):
    policy = RetryPolicy(request_timeout, retry_timeout)
    transport = BrokenTransport(policy)
    keeper = keeper_mod.LeaseKeeper(transport)  # type: ignore[arg-type]
    now = time.monotonic()
    ls = lease_mod.Lease(keeper, 7, 60, now, policy.keepalive_interval(60))
    assert ls._next_at == pytest.approx(now + 20)  # every TTL/3
    keeper._tick([ls])
    assert transport.stream_timeouts == [request_timeout]  # min(request, TTL/3, time left)
    assert ls._next_at - time.monotonic() <= policy.backoff_limit(1)
    assert policy.backoff_limit(1) == pytest.approx(request_timeout / 40)


@pytest.mark.parametrize("request_timeout, retry_timeout", SETTINGS)
def test_the_watch_reconnect_backoff(monkeypatch, request_timeout, retry_timeout):
    policy = RetryPolicy(request_timeout, retry_timeout)
    monkeypatch.setattr(policy_mod.random, "uniform", lambda lo, hi: hi)  # the bound itself
    manager = watch_mod.WatchManager(BrokenTransport(policy))  # type: ignore[arg-type]
    waits: list[float] = []
    two = threading.Event()

    class Recorder:
        def wait(self, timeout=None):
            waits.append(timeout)
            if len(waits) >= 2:
                two.set()
                time.sleep(0.05)  # keep the stream thread from spinning while the test reads
            return False

        def set(self):
            pass

    manager._closed_event = Recorder()  # type: ignore[assignment]
    manager.watch(b"k")
    try:
        assert two.wait(5)
    finally:
        manager.close()
    assert waits[:2] == [policy.backoff_limit(1), policy.backoff_limit(2)]


@pytest.mark.parametrize("request_timeout, retry_timeout", SETTINGS)
def test_the_leader_retry_and_the_parting_requests(request_timeout, retry_timeout):
    policy = RetryPolicy(request_timeout, retry_timeout)
    w = World(1, Settings(1, 1), policy=policy)
    w.fake.fail_next("txn", EtcdConnectionError("etcd unreachable"))
    assert w.step() == pytest.approx(w.now + policy.backoff_limit(1))

    fake = FakeEtcd(policy=policy)
    conf = {"request_timeout": request_timeout, "retry_timeout": retry_timeout}
    h = EtcdRendezvousHandler(RendezvousParameters("etcd", "f:1", "p", 1, 1, config=conf), fake)
    h.next_rendezvous()
    fake.timeouts.clear()
    h.shutdown()  # the last agent out cleans up: bounded by one request, not a retry budget
    # its "leaving" mark (a fenced txn), then the clean-up's read and txn
    t = request_timeout
    assert fake.timeouts == [("txn", t), ("range", t), ("txn", t)]
    assert policy.parting_timeout == request_timeout
    assert policy.thread_stop_timeout == request_timeout + retry_timeout
