"""Stragglers end to end (docs/hangs.md, "Stragglers"): real agents on a real etcd, real workers.

Three nodes (``--nnodes 3:3``, ``--evict-stragglers``) run tests/agent_scripts/straggler.py; once
every node published its pace (none a straggler), ``slow`` is made, and one node's worker then
does 5x the CPU work per step. The leader must name that node
(``etcdrun status --json`` marks it, ``straggler_named`` in events.jsonl), and must not evict it
while the job has no node to spare (the drain path's min check). A fourth agent arrives as a
hot spare: the straggler is then asked to leave, exits 0, and the spare takes its place in the
next round, with no restart charged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from agent_helpers import SCRIPTS, clean_env, wait_for
from test_drain import status

from etcdrun.agent.hang.pace import MIN_WINDOW, PERIOD, TICK

SCRIPT = str(SCRIPTS / "straggler.py")


def events(log_dir: Path, name: str) -> list[dict]:
    path = log_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_5x_slower_node_is_named_then_evicted_once_a_spare_gives_room(etcd, job_factory):
    job = job_factory(nnodes="3:3", nproc=1, conf="lease_ttl=5,join_timeout=30")
    logs = job.root / "logs"
    job.extra = ("--log-dir", str(logs), "--evict-stragglers", "--stop-grace", "5")
    agents = [job.start(SCRIPT, str(job.out)) for _ in range(2)]
    slow = job.start(SCRIPT, str(job.out), env=clean_env(ETCDRUN_TEST_SLOW="1"))
    first = job.wait_round(3, timeout=30)
    round1 = first[0].round
    paced = wait_for(
        lambda: (s := status(job))["median_rate"] is not None and s,
        MIN_WINDOW + 3 * TICK + 5,
        "every node's first pace",
    )
    assert not [p for p in paced["paces"] if p["straggler"]], paced["paces"]  # all alike
    (job.out / "slow").touch()
    t_slow = time.time()

    def named() -> dict | None:
        s = status(job)
        marked = [p for p in s["paces"] if p["straggler"]]
        return s if marked and events(logs, "straggler_named") else None

    s = wait_for(named, 2 * PERIOD + MIN_WINDOW + 4 * TICK + 5, "the straggler to be named")
    t_named = min(e["time_ms"] for e in events(logs, "straggler_named")) / 1000
    slow_node = next(p["node_id"] for p in s["participants"] if p["pid"] == slow.pid)
    assert [p["node_id"] for p in s["paces"] if p["straggler"]] == [slow_node]
    rates = {p["node_id"]: p["rate"] for p in s["paces"]}
    assert rates[slow_node] < 0.5 * s["median_rate"], rates
    assert {e["straggler"] for e in events(logs, "straggler_named")} == {slow_node}
    assert slow.proc.poll() is None and not events(logs, "straggler_evicted")  # no spare yet

    spare = job.start(SCRIPT, str(job.out))
    t_spare = time.time()
    assert slow.wait(2 * PERIOD + 15) == 0, slow.stderr
    second = job.wait_round(3, after=round1, timeout=20)
    evicted = events(logs, "straggler_evicted")
    assert [e["straggler"] for e in evicted] == [slow_node]
    assert {s.ppid for s in second} == {a.pid for a in agents} | {spare.pid}
    assert {s.env["TORCHELASTIC_RESTART_COUNT"] for s in second} == {"0"}
    assert " drained (asked by straggler eviction (leader " in slow.stderr
    t_evicted = evicted[0]["time_ms"] / 1000
    print(
        f"slowdown -> straggler_named {t_named - t_slow:.1f} s; spare started -> "
        f"straggler_evicted {t_evicted - t_spare:.1f} s; evicted -> the next round's workers "
        f"all started {max(s.t for s in second) - t_evicted:.2f} s (PERIOD {PERIOD:g} s)"
    )

    (job.out / "stop").touch()
    for a in (*agents, spare):
        assert a.wait(30) == 0, a.stderr
