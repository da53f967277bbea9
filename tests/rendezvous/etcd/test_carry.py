"""Carried rounds (design.md §3a): decide() freezes the next round from the live agent keys.

Pure, with a fake clock, like test_protocol.py: every case is a View and the one Action that
follows. The two hard cases of the design are here: a survivor whose lease lapses while the
leader freezes (its key still in the leader's cache), and a survivor frozen (SIGSTOP) while it
is carried over.
"""

from __future__ import annotations

import pytest

from etcdrun.rendezvous.etcd.core import carry
from etcdrun.rendezvous.etcd.core.protocol import (
    PROTOCOL,
    Agent,
    Carry,
    Member,
    Phase,
    Round,
    Settings,
    StartRound,
    View,
    Wait,
    decide,
)

NODES = ["a", "b", "c", "d", "e", "f"]
REV = {n: 10 + i for i, n in enumerate(NODES)}  # a is the oldest
PORT = {n: 20000 + i for i, n in enumerate(NODES)}  # each agent's spare port


def agents(*names: str, protocol: int = PROTOCOL, lws: int = 2, gen: int = 0) -> dict[str, Agent]:
    """Live agents; ``gen``: how many spare ports each drew before (rank 0 draws one after
    each round run on its spare).
    """
    return {
        n: Agent(n, REV[n], lws, f"{n}.host", n, REV[n], protocol, PORT[n] + 100 * gen)
        for n in names
    }


def frozen(*names: str, n: int = 1, port: int = 1000, lws: int = 2) -> Round:
    ms, first = [], 0
    for rank, name in enumerate(names):
        ms.append(Member(name, rank, lws, f"{name}.host", first, name, REV[name]))
        first += lws
    return Round(n, Phase.FROZEN, tuple(ms), 0, ms[0].addr, port, mod_revision=100)


def after(r: Round, c: Carry) -> Round:
    """The round the leader writes for ``c`` (as term.py does)."""
    return Round(
        c.number,
        Phase.FROZEN,
        c.members,
        c.restart_count,
        c.master_addr,
        c.master_port,
        mod_revision=r.mod_revision + 1,
        carried=True,
        held=c.held,
        protocol=PROTOCOL,
    )


def places(c: Carry) -> list[tuple[str, int, int]]:
    return [(m.node_id, m.node_rank, m.first_global_rank) for m in c.members]


S = Settings(1, 6)


def test_a_leave_is_carried_the_last_survivor_fills_the_place():
    r = frozen("a", "b", "c", "d")
    c = decide(View(r, agents("a", "c", "d")), S, 0.0)
    assert isinstance(c, Carry) and c.number == 2 and c.departed == ("b",)
    # a and c keep their places and global ranks; d (beyond the new size) takes b's place
    assert places(c) == [("a", 0, 0), ("d", 1, 2), ("c", 2, 4)]
    assert c.held == (("d", (6,)),)  # d's old workers may still hold ranks 6-7
    assert c.master_addr == "a.host" and c.master_port == PORT["a"]
    assert c.reason == "node(s) left: b" and c.restart_count == 0


def test_the_last_node_leaving_moves_nobody():
    c = decide(View(frozen("a", "b", "c"), agents("a", "b")), S, 0.0)
    assert isinstance(c, Carry) and places(c) == [("a", 0, 0), ("b", 1, 2)] and c.held == ()


def test_rank_0_leaving_hands_rank_0_to_the_last_node():
    c = decide(View(frozen("a", "b", "c"), agents("b", "c")), S, 0.0)
    assert isinstance(c, Carry) and places(c) == [("c", 0, 0), ("b", 1, 2)]
    assert c.master_addr == "c.host" and c.master_port == PORT["c"]


def test_a_scale_up_is_carried_survivors_keep_their_ranks():
    r = frozen("a", "b")
    c = decide(View(r, agents("a", "b", "c")), Settings(1, 3), 0.0)
    assert isinstance(c, Carry) and c.arrived == ("c",) and c.departed == ()
    assert places(c) == [("a", 0, 0), ("b", 1, 2), ("c", 2, 4)] and c.held == ()
    assert c.reason == "node(s) joined: c"


def test_a_spare_takes_the_place_of_the_node_that_left():
    r = frozen("a", "b", "c")
    c = decide(View(r, agents("a", "c", "d", "e")), Settings(1, 3), 0.0)
    assert isinstance(c, Carry) and c.departed == ("b",) and c.arrived == ("d",)
    assert places(c) == [("a", 0, 0), ("d", 1, 2), ("c", 2, 4)] and c.held == ()


def test_below_min_the_round_gathers():
    a = decide(View(frozen("a", "b", "c"), agents("a", "b")), Settings(3, 4), 0.0)
    assert isinstance(a, StartRound) and a.departed == ("c",)


@pytest.mark.parametrize("old", ["a", "c", "d"])
def test_an_older_agent_among_the_new_members_makes_the_round_gather(old):
    live = agents("a", "c", "d")
    live[old] = Agent(old, REV[old], 2, f"{old}.host")  # protocol 0: an older etcdrun
    a = decide(View(frozen("a", "b", "c", "d"), live), S, 0.0)
    assert isinstance(a, StartRound) and a.departed == ("b",)


def test_a_resting_survivor_makes_the_round_gather():
    v = View(frozen("a", "b", "c"), agents("a", "c"), resting=frozenset({"c"}))
    assert isinstance(decide(v, S, 0.0), StartRound)


def test_rank_0_whose_spare_port_ran_the_round_is_waited_for():
    """The port of the round being replaced is never the next round's: rank 0 draws another
    and rewrites its agent key, then the leader carries (node/spare_port.py).
    """
    r = frozen("a", "b", "c", port=PORT["a"])
    w = decide(View(r, agents("a", "c")), S, 0.0)
    assert isinstance(w, Wait) and w.until is None and "rank 0 (a)" in w.reason
    live = agents("a", "c")
    live["a"] = Agent("a", REV["a"], 2, "a.host", "a", 1, PROTOCOL, 30000)
    c = decide(View(r, live), S, 0.0)
    assert isinstance(c, Carry) and c.master_port == 30000


def test_a_new_rank_0_is_not_held_to_its_predecessors_port_number():
    """The replaced round's port was on the departed rank 0's host: the same number drawn on
    another node's host is no reuse, and waiting for a redraw would never end.
    """
    r = frozen("a", "b", "c", port=PORT["c"])
    c = decide(View(r, agents("b", "c")), S, 0.0)
    assert isinstance(c, Carry) and c.members[0].node_id == "c" and c.master_port == PORT["c"]


def test_a_node_that_moved_keeps_its_old_ranks_until_a_round_gathers():
    """d moved from 6-7 to 2-3 (its old workers may still hold 6-7). A newcomer must not get
    6-7 in a carried round while d lives; once d is gone they are free.
    """
    r1 = frozen("a", "b", "c", "d")
    c2 = decide(View(r1, agents("a", "c", "d")), S, 0.0)
    assert isinstance(c2, Carry)
    r2 = after(r1, c2)
    grow = decide(View(r2, agents("a", "c", "d", "e", gen=1)), S, 0.0)
    assert isinstance(grow, StartRound) and grow.arrived == ("e",)  # gathers: S4 needs it
    gone = decide(View(r2, agents("a", "c", "e", gen=1)), S, 0.0)
    assert isinstance(gone, Carry) and gone.departed == ("d",) and gone.arrived == ("e",)
    assert places(gone) == [("a", 0, 0), ("e", 1, 2), ("c", 2, 4)]


def test_hard_case_a_lease_that_lapses_during_the_freeze():
    """c's lease expires while the leader freezes round 2: the leader's cache still lists c
    (its watch has not delivered the delete), so round 2 names c. Nothing is repaired: c never
    takes part (its session is lost, so it cannot accept; a new session is a new node id), and
    the delete's event makes the next decision carry the others on, with c's places free.
    """
    r1 = frozen("a", "b", "c", "d")
    c2 = decide(View(r1, agents("a", "c", "d")), S, 0.0)  # b left; c still cached as live
    assert isinstance(c2, Carry) and "c" in [m.node_id for m in c2.members]
    r2 = after(r1, c2)
    c3 = decide(View(r2, agents("a", "d", gen=1)), S, 0.0)  # c's key is gone: it departed round 2
    assert isinstance(c3, Carry) and c3.number == 3 and c3.departed == ("c",)
    assert places(c3) == [("a", 0, 0), ("d", 1, 2)]
    # d keeps the ranks it was given in round 2 and may still hold 6-7 from round 1; c's 4-5
    # go to nobody while they might still be held
    assert dict(c3.held) == {"d": (6,)}
    back = agents("a", "d", "e", gen=2)  # c, restarted, is a new node id: an arrival, never c
    back["e"] = Agent("e", 99, 2, "c.host", "c", 1, PROTOCOL, 31000)
    c4 = decide(View(after(r2, c3), back), S, 0.0)
    assert isinstance(c4, Carry) and c4.arrived == ("e",) and places(c4)[-1] == ("e", 2, 4)


def test_hard_case_a_survivor_frozen_while_carried_over():
    """c is SIGSTOPped while carried into round 2. The leader waits for no acknowledgement:
    while c's lease lives the round runs (c accepts it when it wakes, as any member). Once its
    lease lapses, c is gone like any departed member (its warden fenced its workers first,
    S4) and the rest are carried on; c, thawed, finds its session lost and registers anew.
    """
    r1 = frozen("a", "b", "c")
    c2 = decide(View(r1, agents("a", "b", "c", "d")), S, 0.0)
    assert isinstance(c2, Carry) and c2.arrived == ("d",)
    r2 = after(r1, c2)
    w = decide(View(r2, agents("a", "b", "c", "d", gen=1)), S, 0.0)  # c stopped, lease still live
    assert isinstance(w, Wait) and w.reason == "round running"
    c3 = decide(View(r2, agents("a", "b", "d", gen=1)), S, 0.0)  # c's lease lapsed
    assert isinstance(c3, Carry) and c3.departed == ("c",)
    assert places(c3) == [("a", 0, 0), ("b", 1, 2), ("d", 2, 4)] and dict(c3.held) == {"d": (6,)}


def test_place_keeps_ranks_contiguous_with_mixed_local_world_sizes():
    ms = (
        Member("a", 0, 4, "a", 0),
        Member("c", 2, 1, "c", 6),
        Member("d", 3, 4, "d", 7),
    )
    out = carry.place(ms, ())
    assert [(m.node_id, m.node_rank, m.first_global_rank) for m in out] == [
        ("a", 0, 0),
        ("d", 1, 4),
        ("c", 2, 8),
    ]
    spans = carry.owned(ms, lambda n: ())
    assert not carry.handed_over_safely(spans, out)  # d's 4-7 overlaps c's old rank 6


def test_mixed_local_world_sizes_that_cannot_be_carried_gather():
    live = {**agents("a", "c", lws=4), **agents("d", lws=4)}
    live["c"] = Agent("c", REV["c"], 1, "c.host", "c", 1, PROTOCOL, PORT["c"])
    r = Round(
        1,
        Phase.FROZEN,
        (
            Member("a", 0, 4, "a.host", 0),
            Member("b", 1, 2, "b.host", 4),
            Member("c", 2, 1, "c.host", 6),
            Member("d", 3, 4, "d.host", 7),
        ),
        master_addr="a.host",
        master_port=1000,
        mod_revision=100,
    )
    assert isinstance(decide(View(r, live), S, 0.0), StartRound)
