"""The invariant checker itself: it must flag what breaks S5 and pass what the protocol does."""

from __future__ import annotations

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.etcd.core import shards, transitions
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Member, Phase, Round
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


# ---- sharded rounds (design.md §2): put together from the shard keys' history ------------------
SKEYS = RunKeys("/etcdrun", "job")


def _members(names: list[str]) -> tuple[Member, ...]:
    return tuple(Member(n, i, 1, f"{n}.host", i) for i, n in enumerate(names))


def _events(ops: list[pb.RequestOp], revision: int) -> list[pb.Event]:
    """The watch events a Txn's puts make, in its op order, at one revision."""
    out = []
    for op in ops:
        if op.HasField("request_put"):
            put = op.request_put
            kv = pb.KeyValue(key=put.key, value=put.value, mod_revision=revision)
            out.append(pb.Event(type=pb.Event.PUT, kv=kv))
    return out


def _sharded_freeze(number: int, names: list[str], revision: int) -> list[pb.Event]:
    r = Round(number, Phase.FROZEN, _members(names), master_addr=f"{names[0]}.host")
    _, ops = transitions.freeze(SKEYS, Round(number, Phase.JOINING), shards.shard(r, 2), None, "x")
    return _events(ops, revision)


def test_a_sharded_round_is_checked_whole_from_its_shard_keys():
    names = [f"node-{i}" for i in range(9)]
    history = checker.assemble(_sharded_freeze(1, names, 5), SKEYS)
    assert len(history) == 1 and history[0].layout == ()
    assert [p.node_id for p in history[0].state.participants] == names
    assert checker.check(history, 2, 9, [{"round": 1, "node": "node-4", "node_rank": 4}]) == []
    # the same round with rank 0 moved in the next one: S6, seen through the shards
    later = checker.assemble(
        [*_sharded_freeze(1, names, 5), *_sharded_freeze(2, names[::-1], 8)], SKEYS
    )
    assert [e.split(" ")[0] for e in checker.check(later, 2, 9)] == ["S6", "S6"]


def test_a_sharded_round_whose_shards_do_not_make_it_is_a_violation():
    names = [f"node-{i}" for i in range(9)]
    events = _sharded_freeze(1, names, 5)
    i = shards.index(names[4], shards.SHARDS)
    lost = [e for e in events if e.kv.key != SKEYS.shard(i).encode()]
    found = checker.check(checker.assemble(lost, SKEYS), 2, 9)
    assert found and all(e.startswith("S2") for e in found)
    assert any(f"shard(s) [{i}] of 64 missing" in e for e in found)
    # a node started workers in a round whose shard lost it: S3 as for any unlisted node
    gone = checker.assemble(lost, SKEYS)[0].state
    missing = next(n for n in names if n not in [p.node_id for p in gone.participants])
    found = checker.check(
        checker.assemble(lost, SKEYS), 2, 9, [{"round": 1, "node": missing, "node_rank": 0}]
    )
    assert any(e.startswith("S3") for e in found)


def test_a_shard_key_still_holding_an_older_round_does_not_fill_a_newer_one():
    """The shard keys are the same every sharded round: one the next freeze did not rewrite
    (a Txn that lost a put) still names the older round, and counts as missing.
    """
    names = [f"node-{i}" for i in range(9)]
    i = shards.index(names[4], shards.SHARDS)
    second = [e for e in _sharded_freeze(2, names, 8) if e.kv.key != SKEYS.shard(i).encode()]
    history = checker.assemble([*_sharded_freeze(1, names, 5), *second], SKEYS)
    assert [v.state.number for v in history] == [1, 2] and history[0].layout == ()
    assert any(f"shard(s) [{i}] of 64 missing" in p for p in history[1].layout)
    assert names[4] not in [p.node_id for p in history[1].state.participants]


def test_a_sharded_round_asking_less_than_protocol_4_is_a_violation():
    events = _sharded_freeze(1, ["a", "b", "c"], 5)
    header = st.RoundState.FromString(events[0].kv.value)
    header.protocol = 3  # an agent of protocol 3 read per-round shard keys: it would find none
    events[0].kv.value = header.SerializeToString()
    found = checker.check(checker.assemble(events, SKEYS), 2, 3)
    assert any("asks protocol 3" in e for e in found)
