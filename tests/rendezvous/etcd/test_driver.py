"""The per-session driver and the handler's status line, against an in-memory etcd.

Why a fake here too: leadership churn (the oldest agent dying again and again while another
thread reads the status line) is a race the real etcd makes rare; in memory it runs hundreds of
times a second. Waits are on events (the event log, the round view), never on sleeps.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import pytest
from fake_etcd import FakeEtcd
from leader_world import KEYS, open_session

from etcdrun.rendezvous.api import RendezvousParameters
from etcdrun.rendezvous.client import EtcdCompactedError, EtcdConnectionError, WatchBatch
from etcdrun.rendezvous.etcd.core.config import EtcdRendezvousConfig
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Phase, Settings
from etcdrun.rendezvous.etcd.core.round_view import RoundView
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler
from etcdrun.rendezvous.etcd.leader.driver import Driver, RoundChanged
from etcdrun.rendezvous.events import EventLog


class Node(NamedTuple):
    driver: Driver
    session: Session
    view: RoundView
    got: list[dict]  # its events
    elected: threading.Event  # set at its first leader_elected event


def node(fake: FakeEtcd, name: str, settings: Settings) -> Node:
    session = open_session(fake, name)
    view, log = RoundView(), EventLog(KEYS.run_id)
    got: list[dict] = []
    elected = threading.Event()
    log.subscribe(got.append)
    log.subscribe(lambda e: elected.set() if e["event"] == "leader_elected" else None)
    return Node(
        Driver(
            RunContext(fake, KEYS, log, view, settings, EtcdRendezvousConfig(run_lease_ttl=30)),
            session,
        ),
        session,
        view,
        got,
        elected,
    )


def wait_round(view: RoundView, number: int, phase: Phase, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = view.current()
        if r is not None and r.number == number and r.phase is phase:
            return
        if not view.wait(r, deadline, stop=lambda: False):
            raise AssertionError(f"round {number} {phase.name} did not come; at {r}")


def test_messages_are_typed_and_a_stray_one_is_refused():
    d = node(FakeEtcd(), "a", Settings(1, 1)).driver
    for stray in (("round",), "election", object()):
        with pytest.raises(TypeError, match="driver messages"):
            d.post(stray)  # type: ignore[arg-type]
    d.post(RoundChanged())  # a real one is taken
    d.stop()


def test_the_only_agent_leads_and_opens_the_first_round():
    fake = FakeEtcd()
    a = node(fake, "a", Settings(1, 2))
    a.driver.start()
    try:
        wait_round(a.view, 1, Phase.JOINING)
        events = [e["event"] for e in a.got]
        assert a.driver.is_leader and events[:2] == ["leader_elected", "round_started"]
    finally:
        a.driver.stop()
    own_key = a.session.key.encode()  # the session's own watch is the session's, not the driver's
    assert not [w for w in fake.watches if not w.cancelled and w.key != own_key]
    a.session.close()
    assert not [w for w in fake.watches if not w.cancelled]  # and goes with the session


def test_leadership_moves_to_the_next_oldest_when_the_leader_goes():
    fake = FakeEtcd()
    a, b = node(fake, "a", Settings(1, 3)), node(fake, "b", Settings(1, 3))
    a.driver.start()
    b.driver.start()
    try:
        wait_round(b.view, 1, Phase.JOINING)
        assert a.driver.is_leader and not b.driver.is_leader and not b.elected.is_set()
        fake.expire(a.session.lease_id)  # the leader dies: its key goes, b's watch fires
        assert b.elected.wait(5) and b.driver.is_leader
    finally:
        a.driver.stop()
        b.driver.stop()


def test_an_ended_round_watch_is_read_again_and_watched_anew():
    fake = FakeEtcd()
    a = node(fake, "a", Settings(1, 1))
    d, view = a.driver, a.view
    d.start()
    try:
        wait_round(view, 1, Phase.JOINING)
        round_watch = next(w for w in fake.watches if w.key == KEYS.round.encode())
        round_watch.callback(WatchBatch(round_watch, [], 0, EtcdCompactedError("compacted")))
        # The driver re-reads the key and watches it again: later changes still arrive.
        deadline = time.monotonic() + 5
        while round_watch in fake.watches and not round_watch.cancelled:
            assert time.monotonic() < deadline
            view.wait(view.current(), time.monotonic() + 0.05, stop=lambda: False)
        fresh = [w for w in fake.watches if w.key == KEYS.round.encode() and not w.cancelled]
        assert len(fresh) == 1 and fresh[0] is not round_watch
    finally:
        d.stop()


def handler(fake: FakeEtcd, lo: int, hi: int) -> EtcdRendezvousHandler:
    # A last call, so the first round waits for all of them (it freezes at once at max): with
    # none it freezes with whoever registered first, and the rest form the next round only
    # once the first ones rejoin (L1) — which a plain next_rendezvous() per handler never does.
    conf = {"last_call_timeout": 10, "join_timeout": 10}
    params = RendezvousParameters("etcd", "fake:2379", KEYS.run_id, lo, hi, config=conf)
    return EtcdRendezvousHandler(params, client=fake)


def rendezvous(hs: list[EtcdRendezvousHandler]) -> list:
    out: list = [None] * len(hs)

    def go(i: int) -> None:
        try:
            out[i] = hs[i].next_rendezvous()
        except BaseException as e:  # reported below
            out[i] = e

    ths = [threading.Thread(target=go, args=(i,)) for i in range(len(hs))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(20)
    for o in out:
        if isinstance(o, BaseException) or o is None:
            raise AssertionError(f"next_rendezvous failed: {o!r}")
    return out


def test_status_during_leader_churn_never_raises():
    """The status line (the agent's ticker thread) reads the leader's snapshot while the driver
    thread drops the leader and elects the next: it must never raise, whatever it interleaves
    with. Here the leader dies five times in a row under a reader hammering status().
    """
    fake = FakeEtcd()
    hs = [handler(fake, 1, 6) for _ in range(6)]
    errors: list[BaseException] = []
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            for h in list(hs):
                try:
                    lines.append(h.report().status())
                except BaseException as e:  # the failure this test exists to catch
                    errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    alive = list(hs)
    try:
        infos = rendezvous(alive)
        for _ in range(5):
            rank0 = next(h for h, i in zip(alive, infos, strict=True) if i.node_rank == 0)
            lease = rank0.session.lease_id
            rank0.session.orphan()
            rank0.shutdown()
            fake.expire(lease)
            alive.remove(rank0)
            infos = rendezvous(alive)
            assert [i.node_count for i in infos] == [len(alive)] * len(alive)
    finally:
        done.set()
        th.join(10)
        for h in alive:
            h.shutdown()
    assert errors == []
    assert any("running with" in s for s in lines) and len(lines) > 100


def test_the_driver_runs_the_election_again_after_an_etcd_error():
    fake = FakeEtcd()
    a = node(fake, "a", Settings(1, 1))
    # The first read (the round key, by start()) passes; the election's read fails once.
    fake.fail_next("range", EtcdConnectionError("etcd unreachable"), skip=1)
    a.driver.start()
    try:
        assert a.elected.wait(5)
        wait_round(a.view, 1, Phase.JOINING)
    finally:
        a.driver.stop()
