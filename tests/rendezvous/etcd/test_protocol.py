"""The pure decision function, exhaustively over small worlds, with a fake clock."""

from __future__ import annotations

import itertools

import pytest

from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.etcd.core.protocol import (
    FRESH_AFTER_ABANDONED,
    Agent,
    CloseFailed,
    Freeze,
    Join,
    Member,
    Phase,
    Round,
    Settings,
    StartRound,
    View,
    Wait,
    assign,
    decide,
)

NODES = ["a", "b", "c", "d", "e"]
REV = {n: 10 + i for i, n in enumerate(NODES)}  # a is the oldest


def agents(*names: str) -> dict[str, Agent]:
    return {n: Agent(n, REV[n], 2, f"{n}.host") for n in names}


def joins(*names: str, lws: int = 2) -> dict[str, Join]:
    return {n: Join(n, lws, f"{n}.host", 1000 + REV[n], REV[n]) for n in names}


def members(*names: str) -> tuple[Member, ...]:
    return assign(sorted(joins(*names).values(), key=lambda j: names.index(j.node_id)))


def joining(n: int = 1, hint: tuple[Member, ...] = (), restarts: int = 0) -> Round:
    return Round(n, Phase.JOINING, hint, restarts, mod_revision=100)


def frozen(*names: str, n: int = 1) -> Round:
    ms = members(*names)
    return Round(n, Phase.FROZEN, ms, 0, ms[0].addr, 1000, mod_revision=100)


def test_no_round_starts_round_one():
    a = decide(View(None, agents("a")), Settings(1, 2), 0.0)
    assert a == StartRound(1, "first agent", (), 0)


def test_closed_waits():
    r = Round(3, Phase.CLOSED)
    assert isinstance(decide(View(r, agents("a")), Settings(1, 2), 0.0), Wait)


def test_first_round_below_min_waits_without_deadline():
    a = decide(View(joining(), agents("a", "b"), joins("a")), Settings(2, 4), 0.0)
    assert isinstance(a, Wait) and a.until is None


def test_first_round_last_call_then_freeze_at_deadline():
    s = Settings(2, 4, last_call_timeout=30.0)
    v = View(joining(), agents("a", "b"), joins("a", "b"))
    a = decide(v, s, 5.0)
    assert isinstance(a, Wait) and a.until == 35.0
    v2 = View(v.round, v.agents, v.joined, last_call_deadline=35.0)
    assert isinstance(decide(v2, s, 34.9), Wait)
    f = decide(v2, s, 35.0)
    assert isinstance(f, Freeze) and [m.node_id for m in f.members] == ["a", "b"]


def test_first_round_freezes_at_once_at_max():
    s = Settings(2, 3, last_call_timeout=30.0)
    f = decide(View(joining(), agents("a", "b", "c"), joins("a", "b", "c")), s, 0.0)
    assert isinstance(f, Freeze) and len(f.members) == 3


def test_first_round_waits_for_registered_agent_that_has_not_joined():
    a = decide(View(joining(), agents("a", "b", "c"), joins("a", "b")), Settings(2, 4, 0), 0.0)
    assert isinstance(a, Wait)


def test_later_round_has_no_last_call():
    s = Settings(2, 4, last_call_timeout=30.0)
    r = joining(2, hint=members("a", "b", "c"))
    f = decide(View(r, agents("a", "b"), joins("a", "b")), s, 0.0)
    assert isinstance(f, Freeze) and [m.node_id for m in f.members] == ["a", "b"]


def test_restart_round_without_hint_has_no_last_call():
    f = decide(
        View(joining(2, restarts=1), agents("a", "b"), joins("a", "b")), Settings(2, 4, 30.0), 0.0
    )
    assert isinstance(f, Freeze)


def test_spares_beyond_max_wait_and_oldest_spare_takes_freed_place():
    s = Settings(1, 2)
    r = frozen("b", "a")
    assert isinstance(decide(View(r, agents("a", "b", "c", "d")), s, 0.0), Wait)
    # b died: new round, survivor a keeps its order, oldest spare c takes the place
    start = decide(View(r, agents("a", "c", "d")), s, 0.0)
    assert isinstance(start, StartRound) and [m.node_id for m in start.hint] == ["a"]
    r2 = joining(2, hint=start.hint)
    f = decide(View(r2, agents("a", "c", "d"), joins("a", "c", "d")), s, 0.0)
    assert [m.node_id for m in f.members] == ["a", "c"]


def test_member_death_starts_new_round_keeping_restart_count():
    r = Round(4, Phase.FROZEN, members("a", "b", "c"), 2, "a.host", 1, 100)
    a = decide(View(r, agents("a", "c")), Settings(1, 3), 0.0)
    assert isinstance(a, StartRound) and a.number == 5 and a.restart_count == 2
    assert [m.node_id for m in a.hint] == ["a", "c"]


def test_newcomer_below_max_starts_new_round():
    a = decide(View(frozen("a", "b"), agents("a", "b", "c")), Settings(1, 3), 0.0)
    assert isinstance(a, StartRound) and "c" in a.reason


def test_survivors_keep_their_places_against_quicker_spares():
    s = Settings(1, 2)
    r = joining(2, hint=members("a"))  # b left; a survives but is still stopping its workers
    w = decide(View(r, agents("a", "c", "d"), joins("c", "d")), s, 0.0)
    assert isinstance(w, Wait) and "a" in w.reason
    f = decide(View(r, agents("a", "c", "d"), joins("a", "c", "d")), s, 0.0)
    assert [m.node_id for m in f.members] == ["a", "c"]


def test_dead_joiner_is_ignored():
    f = decide(
        View(joining(2, hint=members("a")), agents("a", "b"), joins("a", "b", "c")),
        Settings(1, 3),
        0.0,
    )
    assert isinstance(f, Freeze) and {m.node_id for m in f.members} == {"a", "b"}


def test_rank_zero_stays_with_its_node_when_an_older_agent_joins_later():
    # c held rank 0; a (older by create revision) arrives: a must not take rank 0.
    f = decide(
        View(joining(2, hint=members("c", "d")), agents("a", "c", "d"), joins("a", "c", "d")),
        Settings(1, 4),
        0.0,
    )
    assert [m.node_id for m in f.members] == ["c", "d", "a"]
    assert f.master_addr == "c.host" and f.master_port == 1000 + REV["c"]


def test_global_ranks_contiguous_with_mixed_local_world_sizes():
    js = {
        "a": Join("a", 3, "a", 1, 10),
        "b": Join("b", 1, "b", 2, 11),
        "c": Join("c", 2, "c", 3, 12),
    }
    f = decide(View(joining(), agents("a", "b", "c"), js), Settings(3, 3), 0.0)
    assert [(m.node_rank, m.first_global_rank) for m in f.members] == [(0, 0), (1, 3), (2, 4)]


FAIL = FailureInfo("b", "b.host", 2, 1, message="ValueError: boom")


def test_worker_failure_is_charged_at_the_freeze():
    r = Round(2, Phase.JOINING, members("a", "b"), 0, mod_revision=100, failure=FAIL)
    f = decide(View(r, agents("a", "b"), joins("a", "b")), Settings(1, 2, max_restarts=1), 0.0)
    assert isinstance(f, Freeze) and f.restart_count == 1


def test_failure_with_a_dead_member_is_a_free_membership_change():
    r = Round(2, Phase.JOINING, members("a", "b"), 0, mod_revision=100, failure=FAIL)
    f = decide(View(r, agents("a"), joins("a")), Settings(1, 2, max_restarts=0), 0.0)
    assert isinstance(f, Freeze) and f.restart_count == 0


def test_failure_with_the_budget_spent_closes_the_run():
    r = Round(3, Phase.JOINING, members("a", "b"), 2, mod_revision=100, failure=FAIL)
    c = decide(View(r, agents("a", "b"), joins("a", "b")), Settings(1, 2, max_restarts=2), 0.0)
    assert c == CloseFailed(3, FAIL, 2)


def test_settings_validation():
    with pytest.raises(ValueError):
        Settings(3, 2)
    with pytest.raises(ValueError):
        Settings(0, 2)


def _subsets(items):
    for k in range(len(items) + 1):
        yield from itertools.combinations(items, k)


@pytest.mark.parametrize("mn,mx", [(1, 1), (1, 3), (2, 3), (2, 5), (3, 3)])
def test_exhaustive_invariants(mn, mx):
    """Every world of up to 5 nodes: a freeze satisfies S2 and S6; no action breaks L1."""
    s = Settings(mn, mx, last_call_timeout=10.0)
    checked = 0
    for live in _subsets(NODES):
        if not live:
            continue
        ag = agents(*live)
        for joined in _subsets(NODES):
            for hint_len in range(0, 4):
                hint_nodes = NODES[::-1][:hint_len]  # previous members, in rank order e, d, c
                hint = members(*hint_nodes) if hint_nodes else ()
                r = joining(2 if hint else 1, hint=hint)
                a = decide(View(r, ag, joins(*joined)), s, 0.0)
                checked += 1
                live_joined = [n for n in joined if n in ag]
                if isinstance(a, Freeze):
                    ids = [m.node_id for m in a.members]
                    assert mn <= len(ids) <= mx  # S2: size
                    assert [m.node_rank for m in a.members] == list(range(len(ids)))
                    assert all(n in live_joined for n in ids)
                    first = 0
                    for m in a.members:  # S2: contiguous
                        assert m.first_global_rank == first
                        first += m.local_world_size
                    survivors = [n for n in hint_nodes if n in ids]
                    assert ids[: len(survivors)] == survivors  # S6: order kept
                    if hint_nodes and hint_nodes[0] in live_joined:
                        assert ids[0] == hint_nodes[0]  # S6: rank 0 stays
                    assert len(ids) == min(len(live_joined), mx)
                else:
                    assert isinstance(a, Wait)
                    late = [n for n in hint_nodes if n in ag and n not in joined]
                    if late:
                        assert "survivor" in a.reason
                        continue
                    # L1: never wait when max nodes joined, or all live joined past first round
                    assert len(live_joined) < mx
                    if hint and len(live_joined) >= mn:
                        assert len(live_joined) < len(ag)
                    if a.until is not None:
                        assert not hint and len(live_joined) >= mn
    assert checked > 100


def test_a_failed_runs_id_opens_a_fresh_run_once_only_newcomers_are_alive():
    """A Kubernetes Job retry or a Slurm requeue reuses the id of a failed run: it starts over
    — but only once no agent of the failed run is alive (they registered before the close).
    """
    boom = FailureInfo("a", "h", 1, 1, message="boom")
    closed = Round(4, Phase.CLOSED, failure=boom, mod_revision=50)
    old = {"a": Agent("a", 10), "b": Agent("b", 60)}  # a registered before the close
    assert decide(View(closed, old), Settings(1, 2), 0.0) == Wait("run closed")
    new = {"b": Agent("b", 60), "c": Agent("c", 61)}
    action = decide(View(closed, new), Settings(1, 2), 0.0)
    assert isinstance(action, StartRound) and action.number == 5
    assert (action.hint, action.restart_count) == ((), 0)  # a new run: no survivors, no restarts
    ok = Round(4, Phase.CLOSED, mod_revision=50)  # a run that succeeded stays closed
    assert decide(View(ok, new), Settings(1, 2), 0.0) == Wait("run closed")
    assert decide(View(closed, {}), Settings(1, 2), 0.0) == Wait("run closed")


def test_a_round_whose_nodes_all_left_unclosed_is_taken_up_afresh_by_a_new_job():
    """Every node of a running job gone without closing it (an etcd outage that outlasted the
    agents' retries, every node killed): a new job under the id went on silently as the dead
    job's next round, its restart count carried. It starts afresh now, as after a failure;
    the same job's nodes back as later incarnations (their leases were lost) still carry on.
    """
    ms = (Member("job1-aaaaa.1", 0, 1, "h1", 0), Member("job1-bbbbb.1", 1, 1, "h2", 1))
    r = Round(3, Phase.FROZEN, ms, 2, "h1", 1000, mod_revision=100)
    new_job = {"job2-ccccc.1": Agent("job2-ccccc.1", 200)}
    action = decide(View(r, new_job), Settings(1, 2), 0.0)
    assert action == StartRound(4, FRESH_AFTER_ABANDONED, (), 0)
    back = {"job1-aaaaa.2": Agent("job1-aaaaa.2", 200)}  # fenced by the outage, rejoined
    action = decide(View(r, back), Settings(1, 2), 0.0)
    assert isinstance(action, StartRound) and action.restart_count == 2
    assert action.reason != FRESH_AFTER_ABANDONED
    spare = {"job1-ddddd.1": Agent("job1-ddddd.1", 50)}  # the job's own spare, from before
    action = decide(View(r, spare), Settings(1, 2), 0.0)
    assert isinstance(action, StartRound) and action.restart_count == 2


def test_member_lookup_and_world_size_agree_with_the_members():
    """Round.member() is an index built once per round (the scale bench's handlers each look
    themselves up in one shared round): it must answer as a scan of the members would.
    """
    r = frozen("c", "a", "e", "b")
    for m in r.members:
        assert r.member(m.node_id) is m
    assert r.member("d") is None and r.member("") is None
    assert r.world_size == sum(m.local_world_size for m in r.members) == 8
    twice = Round(2, Phase.FROZEN, (*members("a", "b"), *members("a")), mod_revision=5)
    assert twice.member("a") is twice.members[0]  # the first, as a scan finds it
    assert Round(3, Phase.JOINING).member("a") is None and Round(3, Phase.JOINING).world_size == 0
