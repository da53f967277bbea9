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
    reason; the checker called it S5).
    """
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


# ---- carried rounds (design.md §3a) ---------------------------------------------------------
def frozen(n: int, nodes: list[str], carried: bool = False, **why) -> st.RoundState:
    """Round n FROZEN with ``nodes`` in node-rank order, 2 workers each."""
    ps = [
        st.Participant(node_id=x, node_rank=i, local_world_size=2, addr=x, first_global_rank=2 * i)
        for i, x in enumerate(nodes)
    ]
    return st.RoundState(
        number=n,
        phase=st.FROZEN,
        participants=ps,
        master_addr=nodes[0],
        world_size=2 * len(nodes),
        carried=carried,
        departed=why.get("departed", []),
        arrived=why.get("arrived", []),
    )


def history(*states: st.RoundState) -> list[checker.Version]:
    return [checker.Version(i + 1, s) for i, s in enumerate(states)]


def codes(errors: list[str]) -> list[str]:
    return [e.split(" ")[0] for e in errors]


GATHERED = [joining(1), frozen(1, ["a", "b", "c", "d"])]


def test_carried_rounds_as_the_leader_writes_them_are_no_violation():
    """b leaves: d fills its place (and may still hold 6-7); then d leaves and f takes its
    place: 2-3 and 6-7 are free again, d being gone.
    """
    ok = history(
        *GATHERED,
        frozen(2, ["a", "d", "c"], True, departed=["b"]),
        frozen(3, ["a", "f", "c"], True, departed=["d"], arrived=["f"]),
        frozen(4, ["a", "f", "c", "e"], True, arrived=["e"]),
    )
    assert checker.check(ok, 1, 4) == []


def test_a_newcomer_given_ranks_a_moved_node_may_still_hold_is_a_violation():
    """After d moved from 6-7 to 2-3, a newcomer appended in a carried round gets 6-7 while d
    is listed: S4 (the leader gathers that round instead).
    """
    h = history(
        *GATHERED,
        frozen(2, ["a", "d", "c"], True, departed=["b"]),
        frozen(3, ["a", "d", "c", "e"], True, arrived=["e"]),
    )
    assert codes(checker.check(h, 1, 4)) == ["S4"]
    gathered = history(*[v.state for v in h[:3]], joining(3), frozen(3, ["a", "d", "c", "e"]))
    assert checker.check(gathered, 1, 4) == []


def test_a_carried_round_that_shifts_ranks_onto_a_live_nodes_is_a_violation():
    """A gathered round may shift c into b's place (c stopped its workers before joining); a
    carried one may not: c's old workers may still hold 4-5 when d is given them.
    """
    shifted = history(*GATHERED, frozen(2, ["a", "c", "d"], True, departed=["b"]))
    assert codes(checker.check(shifted, 1, 4)) == ["S6", "S6", "S4"]  # c and d moved
    gathered = history(*GATHERED, joining(2), frozen(2, ["a", "c", "d"]))
    assert checker.check(gathered, 1, 4) == []


def test_carried_membership_must_match_its_departures_and_arrivals():
    stranger = history(*GATHERED, frozen(2, ["a", "b", "c", "d", "x"], True))
    assert codes(checker.check(stranger, 1, 5)) == ["S3"]
    unnamed = history(*GATHERED, frozen(2, ["a", "b", "c"], True))
    assert codes(checker.check(unnamed, 1, 4)) == ["S3"]
    skipped = history(*GATHERED, frozen(3, ["a", "b", "c"], True, departed=["d"]))
    assert codes(checker.check(skipped, 1, 4)) == ["S1"]
