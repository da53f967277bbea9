"""The chaos schedules are a pure function of the seed, cover every fault of issue 11, and never
hold a schedule under which the job may legitimately be lost (fewer than min nodes left, or more
worker kills than the restart budget).
"""

from __future__ import annotations

from chaos_schedule import (
    FAULTS,
    IN_PLACE_FAULTS,
    IN_PLACE_TARGETED,
    KILLS,
    MAX_RESTARTS,
    TARGETED,
    generate,
)


def test_the_same_seed_gives_the_same_schedule_and_seeds_differ():
    assert generate(7) == generate(7)
    assert len({generate(s) for s in range(50)}) == 50


def test_a_few_hundred_seeds_cover_every_fault_and_the_saturated_cores():
    schedules = [s for s in map(generate, range(450)) if not s.in_place]
    seen = {f.kind for s in schedules for f in s.faults}
    assert seen == set(FAULTS)
    assert 0.1 < sum(s.busy for s in schedules) / len(schedules) < 0.3
    assert {s.agents for s in schedules} == {3, 4, 5}


def test_no_schedule_may_lose_the_job():
    for seed in range(2000):
        s = generate(seed)
        if s.in_place:
            continue  # test_no_in_place_schedule_may_lose_the_job
        kills = [f.target for f in s.faults if f.kind == "agent_kill"]
        assert len(kills) == len(set(kills)) <= s.agents - s.min_nodes, s.describe()
        assert sum(f.kind == "worker_kill" for f in s.faults) <= MAX_RESTARTS
        for f in s.faults:
            assert 0 <= f.at <= 2.0
            assert (0 <= f.target < s.agents) == (f.kind in TARGETED), s.describe()
            span = FAULTS[f.kind][1]
            assert (span is None and f.duration == 0) or span[0] <= f.duration <= span[1]
        assert [f.at for f in s.faults] == sorted(f.at for f in s.faults)


def test_stops_come_shorter_and_longer_than_the_ttl():
    from chaos_schedule import TTL

    stops = [f for s in map(generate, range(300)) for f in s.faults if "stop" in f.kind]
    assert any(f.duration < TTL for f in stops) and any(f.duration > TTL for f in stops)


def test_about_a_third_of_the_seeds_run_in_place_and_cover_every_in_place_fault():
    schedules = [generate(s) for s in range(300)]
    in_place = [s for s in schedules if s.in_place]
    assert 0.2 < len(in_place) / len(schedules) < 0.4
    assert {f.kind for s in in_place for f in s.faults} == set(IN_PLACE_FAULTS)
    assert {s.agents for s in in_place} == {3, 4}


def test_no_in_place_schedule_may_lose_the_job():
    for s in (s for s in map(generate, range(2000)) if s.in_place):
        kills = [f for f in s.faults if f.kind in KILLS]
        assert len(kills) <= s.agents - s.min_nodes, s.describe()
        killed = [f.target for f in kills if f.target >= 0]
        assert len(killed) == len(set(killed)), s.describe()
        newcomers = [f.target for f in s.faults if f.kind == "newcomer"]
        assert newcomers == list(range(s.agents, s.max_nodes)), s.describe()
        for f in s.faults:
            assert 0 <= f.at <= 2.0 and f.kind in IN_PLACE_FAULTS
            assert (0 <= f.target < s.agents) == (f.kind in IN_PLACE_TARGETED), s.describe()
