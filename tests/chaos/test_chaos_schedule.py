"""The chaos schedules are a pure function of the seed, cover every fault of issue 11, and never
hold a schedule under which the job may legitimately be lost (fewer than min nodes left, or more
worker kills than the restart budget)."""

from __future__ import annotations

from chaos_schedule import FAULTS, MAX_RESTARTS, TARGETED, generate


def test_the_same_seed_gives_the_same_schedule_and_seeds_differ():
    assert generate(7) == generate(7)
    assert len({generate(s) for s in range(50)}) == 50


def test_a_few_hundred_seeds_cover_every_fault_and_the_saturated_cores():
    schedules = [generate(s) for s in range(300)]
    seen = {f.kind for s in schedules for f in s.faults}
    assert seen == set(FAULTS)
    assert 0.1 < sum(s.busy for s in schedules) / len(schedules) < 0.3
    assert {s.agents for s in schedules} == {3, 4, 5}


def test_no_schedule_may_lose_the_job():
    for seed in range(2000):
        s = generate(seed)
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
