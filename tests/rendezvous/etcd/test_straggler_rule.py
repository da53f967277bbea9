"""The straggler rule (rendezvous/etcd/core/stragglers.py) and the agent's pace
(agent/hang/pace.py), pure: no etcd, no processes (design.md §4d).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from etcdrun.agent.hang import stacks
from etcdrun.agent.hang.pace import Sample, measure
from etcdrun.rendezvous.etcd.core.rdzv_conf import etcd_config
from etcdrun.rendezvous.etcd.core.stragglers import MIN_NODES, Pace, judge


def _pace(node: str, rate: float, step: int = 100, rnd: int = 1) -> Pace:
    return Pace(node, rnd, step, 10.0, rate)


def test_a_node_below_the_fraction_of_the_median_is_named_slowest_first():
    got = judge([_pace("a", 10), _pace("b", 9), _pace("c", 2, 98), _pace("d", 1, 97)], 0.5)
    assert got.median == pytest.approx(5.5)
    assert got.stragglers == ("d", "c")
    assert got.lag == {"a": 0, "b": 0, "c": 2, "d": 3}


def test_the_fraction_is_a_strict_bound_and_zero_names_nobody():
    paces = [_pace("a", 10), _pace("b", 10), _pace("c", 5)]
    assert judge(paces, 0.5).stragglers == ()  # 5 is not below 0.5 x 10
    assert judge(paces, 0.51).stragglers == ("c",)
    assert judge(paces, 0.0).stragglers == ()


def test_too_few_rates_name_nobody_but_lag_is_still_told():
    two = [_pace("a", 10, 50), _pace("b", 1, 40)]
    assert len(two) < MIN_NODES
    got = judge(two, 0.5)
    assert (got.median, got.stragglers, got.lag) == (None, (), {"a": 0, "b": 10})
    # a node that published no rate yet (0) is no sample: still too few
    assert judge([*two, _pace("c", 0.0)], 0.5).stragglers == ()
    assert judge([*two, _pace("c", 9.0)], 0.5).stragglers == ("b",)


def test_a_pace_round_trips_and_a_foreign_value_is_none():
    p = Pace("host-a1b2c.1", 3, 120, 4.5, 12.25, 1700000000000)
    assert Pace.decode(p.encode()) == p
    assert Pace.decode(b"not json") is None
    assert Pace.decode(b'{"node": "x"}') is None


def test_the_node_rate_is_its_slowest_worker_per_cpu_second():
    old = {0: Sample(10, 10, 1.0, 100.0), 1: Sample(10, 10, 1.0, 100.0)}
    new = {0: Sample(60, 60, 2.0, 105.0), 1: Sample(60, 60, 6.0, 105.0)}  # rank 1: 5x the CPU
    got = measure(7, old, new)
    assert got is not None
    assert (got.round, got.step) == (7, 60)
    assert got.rate == pytest.approx(50 / 5.0)  # rank 1's
    assert got.step_rate == pytest.approx(50 / 5.0)


def test_no_pace_when_nothing_moved_and_a_tick_floor_for_no_cpu():
    old = {0: Sample(10, 10, 1.0, 100.0)}
    assert measure(1, old, {0: Sample(10, 10, 1.0, 105.0)}) is None
    assert measure(1, {}, {0: Sample(10, 10, 1.0, 105.0)}) is None
    got = measure(1, old, {0: Sample(20, 20, 1.0, 105.0)})
    assert got is not None and got.rate == pytest.approx(10 * stacks.TICKS_PER_SECOND)


def test_cpu_seconds_reads_this_process_and_none_for_a_gone_pid():
    import os

    assert stacks.cpu_seconds(os.getpid()) > 0
    assert stacks.cpu_seconds(2**22 + 12345) is None


def test_the_settings_default_and_check():
    c = etcd_config({}, environ={})
    assert (c.straggler_fraction, c.evict_stragglers) == (0.5, False)
    c = etcd_config({"straggler_fraction": "0.3", "evict_stragglers": "1"}, environ={})
    assert (c.straggler_fraction, c.evict_stragglers) == (0.3, True)
    with pytest.raises(ValueError, match="straggler_fraction"):
        etcd_config({"straggler_fraction": "1.5"}, environ={})
    with pytest.raises(ValueError, match="evict_stragglers"):
        etcd_config({"evict_stragglers": "maybe"}, environ={})


class _Group:
    """What PacePublisher reads of the worker group: the round and whether workers run."""

    def __init__(self) -> None:
        self.info = type("Info", (), {"round": 1})()
        self.workers = [object()]


class _Port:
    def __init__(self) -> None:
        self.sent: list = []

    def publish(self, reading) -> None:
        self.sent.append(reading)


def test_the_publisher_writes_at_most_once_per_period_and_never_while_idle(monkeypatch):
    """One simulated worker at 10 steps/s, then idle, then a new round (a fake clock)."""
    from etcdrun.agent.hang.pace import MIN_WINDOW, PERIOD, PacePublisher

    group, port = _Group(), _Port()
    pub = PacePublisher(group, port)  # type: ignore[arg-type]
    beats = {"n": 0}
    monkeypatch.setattr(
        pub, "_samples", lambda now: {0: Sample(beats["n"], beats["n"], beats["n"] / 100, now)}
    )
    sent_at = []
    for t in range(0, 31):  # one tick a second, training
        beats["n"] = 1 + 10 * t
        before = len(port.sent)
        pub._tick(float(t))
        if len(port.sent) > before:
            sent_at.append(t)
    assert sent_at[0] == MIN_WINDOW  # the round's first, after its window
    assert all(b - a >= PERIOD for a, b in zip(sent_at, sent_at[1:], strict=False))
    assert len(sent_at) == 1 + (30 - MIN_WINDOW) // PERIOD
    assert port.sent[-1].step_rate == pytest.approx(10.0)
    assert port.sent[-1].rate == pytest.approx(100.0)
    n = len(port.sent)
    for t in range(31, 60):  # idle: the beats stop; the last window's steps are told once
        pub._tick(float(t))
    assert len(port.sent) == n + 1 and port.sent[-1].step == 301
    n = len(port.sent)
    group.info.round = 2  # a new round: a new window, the first pace after MIN_WINDOW again
    for t in range(60, 60 + int(MIN_WINDOW) + 1):
        beats["n"] += 10
        pub._tick(float(t))
    assert len(port.sent) == n + 1 and port.sent[-1].round == 2


def test_status_judges_the_current_round_and_the_text_view_marks_the_straggler():
    from etcdrun.agent.status_cmd import render
    from etcdrun.rendezvous.tools.status import RunStatus, _paces

    paces = [_pace("a", 100, 50, 2), _pace("b", 98, 49, 2), _pace("c", 20, 47, 2)]
    paces.append(_pace("old", 1, 10, 1))  # an earlier round's: shown, judged with no one
    rows, median = _paces(paces, 2, 0.5, now=0.0)
    assert median == 98 and [r.node_id for r in rows] == ["a", "b", "c", "old"]
    assert [(r.node_id, r.lag, r.straggler) for r in rows] == [
        ("a", 0, False),
        ("b", 1, False),
        ("c", 3, True),
        ("old", 40, False),
    ]
    s = RunStatus("job", "/etcdrun/job/", 1, True, round=2, phase="FROZEN", paces=rows)
    text = render(replace(s, median_rate=median))
    assert "progress (straggler: below 0.5 of the median; median 98.00 steps/CPU-s):" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("c "))
    assert line.endswith("STRAGGLER") and "20.00" in line
    assert "STRAGGLER" not in next(ln for ln in text.splitlines() if ln.strip().startswith("a "))
