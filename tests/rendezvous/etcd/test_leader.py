"""The leader, the session and the lifecycle's close against an in-memory etcd (tests/fake_etcd.py).

Why a fake: these are the rules the way ``decide()``'s tests check the decisions — small worlds,
every step visible (watch batches are delivered by hand), nothing timed. The same code runs on a
real etcd in test_rendezvous.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
from fake_etcd import FakeEtcd
from leader_world import FAIL, KEYS, World, open_session

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdConnectionError, RetryPolicy
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.protocol import Phase, Round, Settings
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader import last_call
from etcdrun.rendezvous.etcd.leader.last_call import ANNOUNCE_AFTER
from etcdrun.rendezvous.etcd.leader.status import LeaderStatus, status_line


def test_first_round_opens_then_freezes_once_every_live_agent_joined():
    w = World(2, Settings(2, 2))
    assert w.step() is None and w.round().number == 1 and w.round().phase is Phase.JOINING
    w.join(1)
    w.step()
    assert w.round().phase is Phase.JOINING  # one of two: wait
    assert w.leader.status.joined == 1 and w.leader.status.live == 2
    w.join(0)
    w.step()
    r = w.round()
    assert r.phase is Phase.FROZEN
    assert [(m.node_id, m.node_rank, m.first_global_rank) for m in r.members] == [
        ("n0", 0, 0),
        ("n1", 1, 1),
    ]  # ordered by age (create revision), ranks contiguous (S2)
    assert (r.master_addr, r.master_port) == ("n0.addr", 1000)
    # 2 sessions + open round 1 + 2 joins + freeze: O(N) writes (L5)
    assert w.fake.writes == 6


def test_the_status_snapshot_is_immutable_and_names_the_last_call():
    w = World(3, Settings(2, 4, last_call_timeout=30))
    w.step()
    for i in range(3):
        w.join(i)
    until = w.step()
    s = w.leader.status
    assert until == pytest.approx(w.now + ANNOUNCE_AFTER)  # to publish the last call
    assert (s.round, s.phase, s.live, s.joined) == (1, Phase.JOINING, 3, 3)
    assert s.last_call_left(w.now + 10) == pytest.approx(20)
    assert "last call" in s.decision
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.joined = 0  # type: ignore[misc]
    w.now += 31
    w.step()
    assert w.round().phase is Phase.FROZEN and w.leader.status is not s


def test_a_last_call_that_lasts_is_published_in_the_round_key_once():
    """Every node can then say "first round: 3 of max 4 joined (min 2); starting in 29 s unless
    more join" (last_call.py); one write, and none for a last call that ends at once.
    """
    w = World(3, Settings(2, 4, last_call_timeout=30))
    w.step()
    for i in range(3):
        w.join(i)
    w.step()
    writes = w.fake.writes
    w.now += ANNOUNCE_AFTER
    assert w.step() == pytest.approx(100 + 30)  # published: wait for the deadline again
    msg = w.view.message()
    assert (msg.phase, msg.last_call_joined) == (st.JOINING, 3)
    assert msg.last_call_deadline_unix_ms / 1000 == pytest.approx(time.time() + 29, abs=2)
    assert w.fake.writes == writes + 1
    call = last_call.notice(msg, 2, 4)
    assert call is not None
    text = call.line(time.time())
    assert text.startswith("first round: 3 of max 4 joined (min 2); starting in 2")
    assert text.endswith("s unless more join")
    w.step()
    assert w.fake.writes == writes + 1  # once
    assert [e["joined"] for e in w.got if e["event"] == "last_call"] == [3]
    w.now += 30
    w.step()
    assert w.round().phase is Phase.FROZEN


def test_a_last_call_that_ends_at_once_costs_no_write():
    w = World(4, Settings(2, 4, last_call_timeout=30))
    w.step()
    for i in range(3):
        w.join(i)
    w.step()  # a last call for 3 of 4 ...
    w.join(3)  # ... that the 4th ends before it was published
    w.step()
    assert w.round().phase is Phase.FROZEN and not w.view.message().last_call_joined
    assert not [e for e in w.got if e["event"] == "last_call"]


def test_a_leader_whose_lease_is_gone_cannot_write():
    """S4: the leader's own agent key is part of every write's fence."""
    w = World(3, Settings(1, 3, last_call_timeout=0))
    w.step()
    for i in range(3):
        w.join(i)
    w.step()
    frozen = w.round()
    assert frozen.phase is Phase.FROZEN
    w.fake.expire(w.sessions[0].lease_id)  # its key is gone; this leader has not noticed yet
    writes = w.fake.writes
    assert w.step() is None  # it decides to open round 2 (a member left) but cannot write
    assert w.fake.writes == writes and w.round() is frozen
    assert "lost its fence" in w.leader.status.decision


def test_a_failed_run_closes_with_the_root_cause_when_the_budget_is_spent():
    w = World(2, Settings(1, 2, last_call_timeout=0, max_restarts=0))
    w.step()
    w.join(0)
    w.join(1)
    w.step()
    running = w.round()
    res = w.fake.txn(*_restart_txn(running))
    assert res.succeeded
    w.join(0, 2)
    w.join(1, 2)
    w.step()
    # The leader's own view knows the outcome and the root cause at once, before its watch
    # brings its write back (its agent asks for the root cause next: it once got none).
    known = w.view.message()
    assert known.outcome == st.FAILED and codec.failure_from(known.failure) == FAIL
    r = w.round()
    assert r.phase is Phase.CLOSED
    msg = w.view.message()
    assert msg.outcome == st.FAILED and codec.failure_from(msg.failure) == FAIL
    closed = w.got[-1]
    assert (closed["event"], closed["outcome"], closed["failed_rank"]) == (
        "run_closed",
        "FAILED",
        1,
    )


def test_a_close_that_loses_its_fence_leaves_no_marker_lease():
    """The marker lease of a CLOSED round is revoked when the close's compare fails (it used to
    live join_timeout, 600 s by default).
    """
    w = World(2, Settings(1, 2, last_call_timeout=0, max_restarts=0))
    w.step()
    w.join(0)
    w.join(1)
    w.step()
    w.fake.txn(*_restart_txn(w.round()))
    w.join(0, 2)
    w.join(1, 2)
    w.fake.pump()
    while w.batches:
        w.leader.on_batch(w.batches.pop(0))
    # Someone else moves the round key on; the leader's view has not caught up yet.
    w.fake.put(KEYS.round, w.fake.get(KEYS.round).value)
    leases = w.fake.live_leases()
    assert w.leader.act(w.now) is None  # CloseFailed, but the fence failed
    assert w.fake.live_leases() == leases  # the marker was granted and revoked again


@pytest.mark.parametrize("request_timeout", [2.0, 0.4])
def test_an_etcd_error_backs_off_as_the_policy_says(request_timeout):
    policy = RetryPolicy(request_timeout=request_timeout, retry_timeout=10)
    w = World(1, Settings(1, 1), policy=policy)
    w.fake.fail_next("txn", EtcdConnectionError("etcd unreachable"), times=2)
    assert w.step() == pytest.approx(w.now + policy.backoff_limit(1))
    assert w.step() == pytest.approx(w.now + policy.backoff_limit(2))
    assert w.step() is None and w.round().number == 1  # then it goes through


@pytest.mark.parametrize(
    "n, lo, hi, victim",
    [
        (n, lo, hi, v)
        for n, lo, hi in itertools.product(range(2, 5), range(1, 4), range(1, 5))
        if lo <= hi and lo <= n - 1
        for v in range(min(n, hi))
    ],
)
def test_small_worlds_survivors_keep_their_order_and_rank_zero_stays(n, lo, hi, victim):
    """Every small world: freeze, kill one member, and the next round keeps the survivors'
    relative order; rank 0 moves only when its holder died (S2, S6).
    """
    w = World(n, Settings(lo, hi, last_call_timeout=0))
    w.step()
    for i in range(n):
        w.join(i)
    w.step()
    first = w.round()
    assert first.phase is Phase.FROZEN and len(first.members) == min(n, hi)
    assert [m.node_rank for m in first.members] == list(range(len(first.members)))
    dead = first.members[victim].node_id
    idx = int(dead[1:])
    if idx == 0:
        return  # the leader itself: covered by the driver's tests (a new leader takes over)
    w.fake.expire(w.sessions[idx].lease_id)
    w.step()
    second = w.round()
    assert second.number == 2 and second.phase is Phase.JOINING
    for i in range(n):
        if i != idx:
            w.join(i)
    w.step()
    r = w.round()
    if n - 1 < lo:  # too few left to run
        assert r.phase is Phase.JOINING
        return
    assert r.phase is Phase.FROZEN
    before = [m.node_id for m in first.members if m.node_id != dead]
    after = [m.node_id for m in r.members]
    assert after[: len(before)] == before  # survivors first, in their order
    assert r.members[0].node_id == first.members[0].node_id  # rank 0 stayed (it lives)


def test_a_session_is_whole_its_fence_names_its_key_and_orphan_leaves_the_lease():
    fake = FakeEtcd()
    s = open_session(fake, "a")
    assert s.create_revision > 0 and s.lease_id in fake.live_leases()
    fence = s.is_owner()  # our key exists and is held by our lease
    assert fence.key == KEYS.agent("a").encode() and fence.lease == s.lease_id
    assert fake.txn([fence]).succeeded
    fake.put(KEYS.agent("a"), fake.get(KEYS.agent("a")).value)  # rewritten without the lease
    assert not fake.txn([fence]).succeeded and not s.owns(fake.get(KEYS.agent("a")))
    with pytest.raises(ValueError, match="create revision"):
        Session(fake, KEYS, s.info, fake.lease(5), 0)
    s = open_session(fake, "b")
    s.orphan()
    assert s.close() is True  # nothing revoked: the lease expires on the server, as on kill -9
    assert s.lease_id in fake.live_leases() and fake.get(KEYS.agent("b")) is not None
    assert not s.lost.is_set()


def test_two_agents_with_one_node_id_refuse_the_second():
    fake = FakeEtcd()
    open_session(fake, "a")
    with pytest.raises(Exception, match="already exists"):
        open_session(fake, "a")
    assert len(fake.live_leases()) == 1  # the refused session's lease was revoked


def test_round_cache_is_keyed_by_the_value_not_only_by_key_and_revision():
    """Two clusters (or an etcd rebuilt with the same prefix and run id) reuse revisions."""
    key = KEYS.round
    a = codec.round_to(Round(3, Phase.JOINING, restart_count=1))
    b = codec.round_to(Round(7, Phase.JOINING, restart_count=2))
    ra = codec.round_from(key, a, 42, KEYS.run_id)
    rb = codec.round_from(key, b, 42, KEYS.run_id)
    assert (ra.number, rb.number) == (3, 7)
    assert codec.round_from(key, a, 42, KEYS.run_id) is ra  # still decoded once


def test_leader_status_defaults_are_empty():
    s = LeaderStatus()
    assert s.round is None and s.last_call_left(0.0) is None


def _restart_txn(running: Round):
    from etcdrun.rendezvous.etcd.core import transitions

    new = transitions.opening(running.number + 1, running.restart_count, FAIL)
    return transitions.start_round(KEYS, running, new, running.members, codec.Why("x"), "n1")


@pytest.mark.parametrize(
    ("phase", "said"),
    [
        (Phase.JOINING, "round 4 forming"),
        (Phase.FROZEN, "round 4 running with 0 nodes"),
        (Phase.CLOSED, "round 4 ended"),
    ],
)
def test_the_waiting_line_says_the_round_in_peoples_words(phase, said):
    """A new user read "round 1 frozen with 3 nodes" (the docs' word for a stopped node) as a
    hung job: the line says forming, running or ended, as ``etcdrun status`` does.
    """
    line = status_line(Round(4, phase), None, Settings(1, 2), 0.0)
    assert line == said and "frozen" not in line and "joining" not in line
