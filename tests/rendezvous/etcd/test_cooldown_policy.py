"""The bad-host cooldown's pure parts (rendezvous/etcd/node/cooldown.py) with a fake clock, and
what the leader's ``decide`` does with a resting node (protocol.py, ``View.resting``).
"""

from __future__ import annotations

import pytest

from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core.protocol import (
    Agent,
    Freeze,
    Join,
    Phase,
    Round,
    Settings,
    StartRound,
    View,
    Wait,
    assign,
    decide,
)
from etcdrun.rendezvous.etcd.core.rdzv_conf import etcd_config
from etcdrun.rendezvous.etcd.node import cooldown as cd
from etcdrun.rendezvous.etcd.node.node_names import node_name

POLICY = cd.Policy(failures=3, base=10.0, cap=60.0)
CLOCK = 1_000_000.0  # the fake wall clock, in seconds


def fail(rec: cd.Record, times: int, now: float = CLOCK, policy: cd.Policy = POLICY) -> cd.Record:
    for _ in range(times):
        rec = cd.charged(rec, policy, "host-abcde.2", "rank 4 failed (exit 1)", now)
    return rec


def test_k_failures_cool_a_node_down_and_start_its_count_over():
    rec = fail(cd.Record(), 2)
    assert (rec.failures, rec.resting, rec.cooldowns) == (2, False, 0)
    rec = fail(rec, 1)
    assert rec.resting and rec.failures == 0 and rec.cooldowns == 1
    assert (rec.seconds, rec.until_unix) == (10.0, CLOCK + 10.0)
    assert rec.node == "host-abcde.2" and rec.why == "rank 4 failed (exit 1)"


def test_each_cooldown_doubles_up_to_the_cap():
    assert [cd.length(POLICY, n) for n in range(5)] == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert cd.length(POLICY, 10_000) == 60.0  # no overflow, however many
    rec, seen = cd.Record(), []
    for round_ in range(5):
        rec = cd.over(fail(rec, 3, now=CLOCK + round_), "host-abcde.3")
        seen.append(rec.seconds)
        assert not rec.resting and rec.failures == 0
    assert seen == [10.0, 20.0, 40.0, 60.0, 60.0] and rec.cooldowns == 5


def test_zero_failures_turns_the_cooldown_off():
    rec = fail(cd.Record(), 50, policy=cd.Policy(failures=0))
    assert not rec.resting and rec.cooldowns == 0


def test_a_record_round_trips_and_garbage_names_its_key():
    rec = fail(cd.Record(), 3)
    assert cd.decode(b"/p/run/cooldown/x", cd.encode(rec), "run") == rec
    with pytest.raises(RendezvousStateError, match="/p/run/cooldown/x"):
        cd.decode(b"/p/run/cooldown/x", b"not json", "run")


def test_node_name_drops_the_incarnation_only():
    assert node_name("host.b-3f2a1.12") == "host.b-3f2a1"
    assert node_name("host-3f2a1") == "host-3f2a1"


def test_settings_and_their_check():
    c = etcd_config({}, environ={})
    assert (c.cooldown_failures, c.cooldown_base, c.cooldown_cap) == (3, 10.0, 300.0)
    c = etcd_config({"cooldown_failures": "2", "cooldown_base": "2", "cooldown_cap": 8}, environ={})
    assert (c.cooldown_failures, c.cooldown_base, c.cooldown_cap) == (2, 2.0, 8.0)
    with pytest.raises(ValueError, match="cooldown_cap=1 is shorter than cooldown_base=2"):
        etcd_config({"cooldown_base": 2, "cooldown_cap": 1}, environ={})
    with pytest.raises(ValueError, match="cooldown_failures"):
        etcd_config({"cooldown_failures": "-1"}, environ={})


# ---- decide() with a resting node ---------------------------------------------------------------
REV = {"a": 10, "b": 11, "c": 12}
FAIL = FailureInfo("c", "c.host", 4, 1)
S = Settings(2, 3, max_restarts=5)


def agents(*names: str) -> dict[str, Agent]:
    return {n: Agent(n, REV[n], 2, f"{n}.host") for n in names}


def joins(*names: str) -> dict[str, Join]:
    return {n: Join(n, 2, f"{n}.host", 1000 + REV[n], REV[n]) for n in names}


def members(*names: str):
    return assign([joins(*names)[n] for n in names])


def test_a_resting_survivor_is_not_waited_for_and_its_failure_is_charged():
    r = Round(2, Phase.JOINING, members("a", "b", "c"), 1, mod_revision=100, failure=FAIL)
    view = View(r, agents("a", "b", "c"), joins("a", "b"))
    assert isinstance(decide(view, S, 0.0), Wait)  # not resting: c is a late survivor
    act = decide(View(r, agents("a", "b", "c"), joins("a", "b"), resting=frozenset("c")), S, 0.0)
    assert isinstance(act, Freeze) and [m.node_id for m in act.members] == ["a", "b"]
    assert act.restart_count == 2  # c is live: its failure is no death's consequence


def test_a_resting_node_is_no_arrival_until_its_cooldown_ends():
    r = Round(3, Phase.FROZEN, members("a", "b"), 2, "a.host", 1010, mod_revision=100)
    resting = View(r, agents("a", "b", "c"), resting=frozenset("c"))
    assert decide(resting, S, 0.0) == Wait("round running")
    back = decide(View(r, agents("a", "b", "c")), S, 0.0)
    assert isinstance(back, StartRound) and back.arrived == ("c",) and back.restart_count == 2


def test_below_min_without_the_resting_node_the_round_waits():
    r = Round(2, Phase.JOINING, members("a", "c"), 1, mod_revision=100, failure=FAIL)
    view = View(r, agents("a", "c"), joins("a"), resting=frozenset("c"))
    assert decide(view, S, 0.0) == Wait("1/2 nodes joined")
