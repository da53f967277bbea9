"""The invariant checker itself: it must flag what breaks S5 and pass what the protocol does."""

from __future__ import annotations

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.tools import checker


def joining(n: int, failure: st.Failure | None = None, reason: str = "") -> st.RoundState:
    msg = st.RoundState(number=n, phase=st.JOINING, reason=reason)
    if failure is not None:
        msg.failure.CopyFrom(failure)
    return msg


def test_a_joining_round_rewritten_only_to_carry_an_earlier_failure_is_no_violation():
    late = st.Failure(node_id="a", global_rank=0, timestamp_ms=20)
    early = st.Failure(node_id="b", global_rank=1, timestamp_ms=10)
    history = [checker.Version(1, joining(2, late)), checker.Version(2, joining(2, early))]
    assert checker.check(history, 1, 2) == []
    # Its reason line goes with it (every node prints the earliest failure as the cause).
    moved = [
        checker.Version(1, joining(2, late, reason="rank 0 failed")),
        checker.Version(2, joining(2, early, reason="rank 1 failed")),
    ]
    assert checker.check(moved, 1, 2) == []
    # A failure added to a round that had none (one opened by a departure) is not allowed.
    added = [checker.Version(1, joining(2)), checker.Version(2, joining(2, early))]
    assert [e.split(" ")[0] for e in checker.check(added, 1, 2)] == ["S5"]


def test_a_joining_round_rewritten_otherwise_is_a_violation():
    history = [checker.Version(1, joining(2)), checker.Version(2, joining(2, reason="other"))]
    assert [e.split(" ")[0] for e in checker.check(history, 1, 2)] == ["S5"]
    backwards = [checker.Version(1, joining(3)), checker.Version(2, joining(2))]
    assert [e.split(" ")[0] for e in checker.check(backwards, 1, 2)] == ["S5"]


def test_the_first_rounds_last_call_published_while_it_gathers_is_no_violation():
    published = joining(1)
    published.last_call_deadline_unix_ms, published.last_call_joined = 5000, 2
    history = [checker.Version(1, joining(1)), checker.Version(2, published)]
    assert checker.check(history, 1, 3) == []
    published.reason = "other"  # but nothing else may change with it
    assert [e.split(" ")[0] for e in checker.check(history, 1, 3)] == ["S5"]


def test_the_earlier_failure_comes_with_its_reason_line_and_that_is_no_violation():
    """What lifecycle._attach_if_earlier writes (found by the chaos soak, seed 20: an etcd
    restart fenced three nodes, and each one's SIGKILLed worker replaced the failure with its
    reason; the checker called it S5)."""
    late = st.Failure(node_id="a", global_rank=0, timestamp_ms=20)
    early = st.Failure(node_id="b", global_rank=1, timestamp_ms=10)
    history = [
        checker.Version(1, joining(2, late, reason="worker rank 0 failed")),
        checker.Version(2, joining(2, early, reason="worker rank 1 failed")),
    ]
    assert checker.check(history, 1, 2) == []
    moved = joining(2, early, reason="worker rank 1 failed")
    moved.restart_count = 1  # anything else changed still is one
    assert [
        e.split(" ")[0] for e in checker.check([history[0], checker.Version(2, moved)], 1, 2)
    ] == ["S5"]
