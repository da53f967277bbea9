"""The keeper's batches and its relay port (rendezvous/client/keeper.py), without etcd: leases
due within the batch window go on one stream (one relay call), the counters say whether the
keeper kept up, and a lease nobody answers lapses and is counted.
"""

from __future__ import annotations

import time

from etcdrun.rendezvous.client import keeper as keeper_mod
from etcdrun.rendezvous.client import lease as lease_mod
from etcdrun.rendezvous.client.policy import RetryPolicy


class QuietTransport:
    """Only what the keeper asks of a transport when a relay sends its keep-alives."""

    def __init__(self) -> None:
        self.policy = RetryPolicy()

    def preferred(self) -> int:
        return 0

    def answered_now(self) -> None:
        pass

    def stream(self, *a, **kw):
        raise AssertionError("with a relay, the keeper opens no stream of its own")


def _keeper(answer: bool = True):
    calls: list[tuple[list[int], float]] = []

    def relay(ids: list[int], timeout: float) -> dict[int, int]:
        calls.append((list(ids), timeout))
        return {i: 5 for i in ids} if answer else {}

    return keeper_mod.LeaseKeeper(QuietTransport(), relay), calls  # type: ignore[arg-type]


def _lease(keeper, lease_id: int, sent_at: float) -> lease_mod.Lease:
    ls = lease_mod.Lease(keeper, lease_id, 6, sent_at, keeper._t.policy.keepalive_interval(6))
    keeper._leases[ls.id] = ls  # kept, without the keeper's thread: the test drives the ticks
    return ls


def test_leases_due_within_the_window_share_one_tick():
    keeper, calls = _keeper()
    now = time.monotonic()
    policy = keeper._t.policy
    assert policy.keepalive_interval(6) == 2.0 and policy.keepalive_batch_window(6) == 0.5
    first = _lease(keeper, 1, now - 2.1)  # due 0.1 s ago
    _lease(keeper, 2, now - 1.6)  # due in 0.4 s: inside the window
    _lease(keeper, 3, now - 1.0)  # due in 1 s: outside
    with keeper._cv:
        due, wait = keeper._pick(now)
    assert sorted(ls.id for ls in due) == [1, 2] and wait == 0.0
    keeper._tick(due)
    assert [sorted(ids) for ids, _ in calls] == [[1, 2]]
    assert first.keepalives == 1 and not first.lost.is_set()
    with keeper._cv:
        due, wait = keeper._pick(time.monotonic())
    assert due == [] and 0.0 < wait <= 1.0  # lease 3 next; 1 and 2 a whole interval away
    st = keeper.stats(reset=True)
    assert (st.leases, st.sent, st.acked, st.ticks, st.lapsed) == (3, 2, 2, 1, 0)
    assert 0.09 <= st.late_max < 1.0  # the first lease was due 0.1 s before the tick
    assert 1.0 <= st.gap_max < 1.5  # in intervals: lease 1 was answered after 2.1 s of 2
    assert keeper.stats().late_max == 0.0  # a new window


def test_a_lease_nobody_answers_lapses_and_is_counted():
    keeper, calls = _keeper(answer=False)
    now = time.monotonic()
    ls = _lease(keeper, 7, now - 6.5)  # unanswered past its TTL: etcd may have expired it
    assert keeper.stats().stale_max > 3.0  # 6.5 s of a 2 s interval
    keeper._tick([ls])
    assert calls and ls.lost.is_set() and "no keep-alive acknowledged" in ls.lost_reason
    st = keeper.stats()
    assert (st.leases, st.acked, st.lapsed) == (0, 0, 1)
