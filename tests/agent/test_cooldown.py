"""The bad-host cooldown end to end (docs/hangs.md, "Bad hosts"): real agents on a real etcd.

One node of three runs workers that fail in every round it joins. After ``cooldown_failures``
(2 here) of its failures it is cooled down: the job goes on with the two other nodes, charged
only for those failures; ``etcdrun status`` shows it resting with its time left; when its
cooldown is over it comes back as an arrival (a round of three, charged nothing), the job ends,
and nothing of the cooldown stays in etcd.
"""

from __future__ import annotations

import json
import subprocess
import time

from agent_helpers import SCRIPTS, clean_env, etcdrun_bin, wait_for

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.tools import checker

BASE = 3  # seconds: the first cooldown (the status reads must fit in it on a busy machine)


def status(job, *more: str) -> str:
    out = subprocess.run(
        [etcdrun_bin(), "status", "--rdzv-endpoint", job.endpoints, "--rdzv-id", job.run_id]
        + list(more),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_node_whose_workers_keep_failing_sits_out_then_comes_back(etcd, job_factory):
    job = job_factory(
        nnodes="2:3",
        conf=f"cooldown_failures=2,cooldown_base={BASE},cooldown_cap=8,join_timeout=60",
        extra=("--max-restarts", "5"),
        script=(str(SCRIPTS / "bad_host.py"),),
    )
    job.script = (str(SCRIPTS / "bad_host.py"), str(job.out))
    job.extra = (*job.extra, "--log-dir", str(job.root / "logs"))  # one events.jsonl for all
    (job.out / "whole").write_text("6")
    good = [job.start() for _ in range(2)]
    bad = job.start(env=clean_env(ETCDRUN_TEST_BAD_HOST="1"))

    cooled = wait_for(
        lambda: next((ln for ln in bad.stderr.splitlines() if " cooled down for " in ln), None),
        60,
        f"the bad node cooled down ({job.describe()})",
    )
    t_cooled = time.monotonic()
    assert f"run {job.run_id} round " in cooled
    assert f"for {BASE} s after 2 worker failures (last: rank " in cooled
    without = job.wait_round(4, timeout=30)  # the job goes on without it
    assert {s.ppid for s in without} == {a.pid for a in good}
    assert {s.env["TORCHELASTIC_RESTART_COUNT"] for s in without} == {"2"}  # its 2 failures

    seen = json.loads(status(job, "--json"))
    rest = seen["cooldowns"]
    assert len(rest) == 1 and rest[0]["resting"], seen
    assert 0 < rest[0]["seconds_left"] <= BASE and rest[0]["cooldowns"] == 1
    assert rest[0]["node_id"] not in {p["node_id"] for p in seen["participants"]}
    text = status(job)
    assert f"COOLED DOWN: {rest[0]['node_id']} for " in text, text
    assert f"waiting: {rest[0]['node_id']} on " in text, text

    (job.out / "healed").write_text("")  # its workers succeed from now on
    back = job.wait_round(6, after=without[0].round, timeout=30)
    took = time.monotonic() - t_cooled
    print(f"cooldown of {BASE} s: the node was back in a round of 3 after {took:.2f} s")
    assert took >= BASE - 0.5, "it came back before its cooldown was over"
    assert bad.pid in {s.ppid for s in back}
    assert {s.env["TORCHELASTIC_RESTART_COUNT"] for s in back} == {"2"}  # its return is free
    assert "is back from its cooldown" in bad.stderr
    # every transition is one structured event (docs/events.md), in the agents' events.jsonl
    lines = (job.root / "logs" / "events.jsonl").read_text().splitlines()
    told = [e for e in map(json.loads, lines) if e["node"] == rest[0]["node_id"]]
    rest_events = [e for e in told if e["event"] in ("node_cooled_down", "node_cooldown_over")]
    assert [e["event"] for e in rest_events] == ["node_cooled_down", "node_cooldown_over"], told
    assert rest_events[0]["failures"] == 2 and rest_events[0]["seconds"] == BASE

    for a in job.agents:
        assert a.wait(60) == 0, a.stderr[-3000:]
    with EtcdClient(job.endpoints) as c:  # the cooldown record ended with the run
        assert not c.get_prefix(f"/etcdrun/{job.run_id}/cooldown/").kvs
        assert checker.check_run(c, RunKeys("/etcdrun", job.run_id), 2, 3) == []
