"""bench/compare.py's own parts: the verdicts it publishes, and its harness against real agents.

Why test a benchmark: its tables are the project's claims. The report is pure logic over a results
dict (synthetic here); the harness is checked end to end on a small real job (etcd, etcdrun agents,
torch workers), so that `python -m bench.compare` does not rot between its long runs.
bench/ is a package, importable from the repository root (pyproject.toml: pytest's
``pythonpath``).
"""

from __future__ import annotations

import sys
import types
import uuid
from pathlib import Path

import pytest
from layout import ROOT

import bench
from bench import publish, report, scale_fanout


def _run(scenario, col, trials, setting="default", unit="s", n=8):
    kind = "etcdrun" if col == "etcdrun" else "torchrun"
    backend = {"etcdrun": "etcd"}.get(col, col)
    label = "etcdrun" if kind == "etcdrun" else f"torchrun {col}"
    if setting == "tuned":
        label += " (lease_ttl=2)" if kind == "etcdrun" else " (last_call_timeout=1)"
    return {
        "scenario": scenario,
        "setting": setting,
        "launcher": col,
        "label": label,
        "kind": kind,
        "backend": backend,
        "tuned": setting == "tuned",
        "unit": unit,
        "trials": trials,
        "n": n,
    }


def _t(ready, running, **extra):
    return {"value": ready, "spawn": running, "outcome": "ok", "note": "", "extra": extra}


def _never(note="timeout 75s: no worker"):
    return {"value": None, "spawn": None, "outcome": "never", "note": note}


def _results(runs):
    meta = {
        "date": "2026-11-30T00:00:00",
        "cpus": 2,
        "python": "3.11",
        "torch": "2.13.0",
        "etcdrun": "0.1.0",
        "n": 4,
        "n_first": 8,
        "trials": 3,
        "slow_trials": 2,
        "load_before": 0.5,
        "load_after": 0.6,
        "duration_s": 60,
        "leftover_processes": 0,
        "complete": True,
    }
    return {"meta": meta, "runs": runs, "help": {}, "scale": {}}


def test_verdicts_are_on_workers_running_and_name_the_reason():
    runs = [
        _run("1", "etcdrun", [_t(4.9, 0.62, agent_cpu_s=0.12), _t(4.5, 0.64, agent_cpu_s=0.12)]),
        _run("1s", "etcdrun", [_t(4.4, 0.20), _t(4.2, 0.22)]),
        _run("3", "etcdrun", [_t(5.8, 3.9), _t(5.6, 4.0)]),  # ready > 6 s, running < 6 s
        _run("3", "etcdrun", [_t(3.8, 2.2)], setting="tuned"),
        _run("3", "c10d", [_t(6.8, 4.9)], setting="tuned"),
        _run("3i", "etcdrun", [_t(3.5, 2.9)], setting="tuned"),  # < 3 s, but torchrun: 2.5
        _run("3i", "c10d", [_t(3.0, 2.5)], setting="tuned"),
        _run("5", "etcdrun", [_t(2.6, 0.2), _t(2.7, None)]),  # a START line went missing
    ]
    # scenario 3i compares with torchrun's best tuned figure of scenario 3 (4.9 s): 2.9 passes
    assert report.verdict("3i", "tuned", runs) == ("PASS", "")
    runs[4]["trials"] = [_t(4.0, 2.8)]
    v, why = report.verdict("3i", "tuned", runs)
    assert v == "MISS" and "not ahead of torchrun's best tuned (2.80 s)" in why

    v, why = report.verdict("1", "default", runs)
    assert v == "MISS" and "median 0.63 s > 0.5 s" in why
    assert "all 8 agents start at once" in why and "each agent used 0.12 s of CPU" in why
    assert report.verdict("1s", "default", runs) == ("PASS", "")
    assert report.verdict("3", "default", runs) == ("PASS", "")
    v, why = report.verdict("5", "default", runs)
    assert v == "MISS" and "BENCH_START" in why


def test_a_miss_by_milliseconds_shows_the_digits_that_make_it_one():
    """A median of 1.003 s against 1 s was published as "median 1.00 s > 1 s"."""
    assert report.over(1.003, 1.0) == "median 1.003 s > 1 s"
    assert report.over(0.63, 0.5) == "median 0.63 s > 0.5 s"
    assert report.over(2.5004, 2.5) == "median 2.5004 s > 2.5 s"
    runs = [_run("5", "etcdrun", [_t(1.003, 0.993)] * 3)]
    v, why = report.ready_verdict("5", "default", runs)
    assert v == "MISS" and why.startswith("median 1.003 s > 1 s; ")


def test_a_run_that_never_recovers_is_a_miss_and_an_infinite_ratio():
    runs = [
        _run("3i", "etcdrun", [_never()], setting="tuned"),
        _run("3", "etcdrun", [_t(3.0, 1.0)], setting="tuned"),
        _run("3", "c10d", [_never()], setting="tuned"),
    ]
    v, why = report.verdict("3i", "tuned", runs)
    assert v == "MISS" and "1/1 trial(s)" in why
    table = report.rows(_results(runs))
    row = next(r for r in table if r[0].startswith("3. "))
    assert row[2].startswith("1.00 s") and row[3] == "never (timeout 75 s) ×1"
    assert row[report.RATIO] == "∞ (torchrun: never)"


def test_published_tables_ready_first_both_judged():
    runs = [
        _run("1", "etcdrun", [_t(4.9, 0.4)]),
        _run("1", "c10d", [_t(9.0, 5.0)]),
        _run("5", "etcdrun", [_t(2.6, 0.2)]),
        _run("5", "c10d", [_t(6.0, 3.5)]),
    ]
    res = _results(runs)
    md = publish.results_md(res)
    ready, running = md.split("## To workers running", 1)
    assert "## To workers ready" in ready  # the headline comes first
    running = running.split("## How it is measured", 1)[0]
    assert "| 1. First round" in running and "workers running | default | 0.40 s" in running
    assert "PASS" in running and "12.5x" in running  # 5.0 / 0.4
    assert "workers ready | default | 4.90 s" in ready and "1.8x" in ready
    assert "(2.4-4.5 s in this run)" in ready  # from the trials, not typed in
    row5 = next(ln for ln in ready.splitlines() if ln.startswith("| 5. Scale-up"))
    assert "<= 1.0 s" in row5 and "MISS" in row5
    assert "median 2.60 s > 1 s; of it the workers' own start-up (running -> ready) 2.40 s" in row5


def test_publish_writes_the_run_alone(tmp_path, monkeypatch):
    """results.md is compare.py's run and nothing else: a section another bench once kept there
    is gone after the next publish (each bench has its own page, bench/results/<bench>.md).
    """
    plots = []  # the plot needs matplotlib (the bench venv's): a stand-in records the call
    stand_in = types.SimpleNamespace(recovery_plot=lambda res, path: plots.append(path))
    monkeypatch.setitem(sys.modules, "bench.plot", stand_in)
    monkeypatch.setattr(bench, "plot", stand_in, raising=False)
    md, png = tmp_path / "results.md", tmp_path / "recovery.png"
    other = "## Rendezvous at scale (bench/x.py; not from the compare.py run above)\n\nfigures\n"
    md.write_text("# old\n\n## To workers ready\n\nold table\n\n" + other + "\n## Notes\n")
    res = _results([_run("5", "etcdrun", [_t(2.6, 0.2)])])
    publish.publish(res, md, png)
    assert md.read_text() == publish.results_md(res) and plots == [png]
    assert "Rendezvous at scale" not in md.read_text() and "old table" not in md.read_text()


def test_ready_verdicts_use_the_ready_targets():
    runs = [
        _run("3", "etcdrun", [_t(5.4, 3.9), _t(5.6, 4.0), _t(5.2, 3.8)]),  # median 5.4 <= 5.5
        _run("3", "etcdrun", [_t(2.6, 1.1)], setting="tuned"),  # 2.6 > 2.5
        _run("1s", "etcdrun", [_t(0.9, 0.2)]),
        _run("1", "etcdrun", [_t(4.9, 0.4)]),  # all at once: judged on running only
    ]
    assert report.ready_verdict("3", "default", runs) == ("PASS", "")
    v, why = report.ready_verdict("3", "tuned", runs)
    assert v == "MISS" and "median 2.60 s > 2.5 s" in why and "1.50 s" in why
    assert report.ready_verdict("1s", "default", runs) == ("PASS", "")
    assert report.ready_verdict("1", "default", runs) == ("—", "")


@pytest.mark.timeout(180)
def test_harness_measures_a_real_job_and_leaves_nothing(etcd_bin, torch_available, tmp_path):
    """Scenario 1s and 3' at N = 3 with etcdrun agents and torch workers, as compare.py runs
    them (its own etcd per trial), then the tag sweep finds nothing left to kill.
    """
    from bench import scenarios as sc
    from bench.launchers import LAUNCHERS
    from bench.procs import sweep, tagged

    tag = uuid.uuid4().hex
    ctx = sc.Ctx(bindir=Path(sys.executable).parent, out=tmp_path, tag=tag, recover_timeout=30.0)
    try:
        first = sc.first_round(ctx, LAUNCHERS["etcdrun"], 3, 3, "s1s", stagger=True)
        assert first.outcome == "ok", first.note
        assert 0 < first.spawn < first.value and first.extra["settle_s"] > 0
        assert not tagged(tag)  # the trial's Job cleaned up after itself

        kill = sc.kill_node(ctx, LAUNCHERS["etcdrun-tuned"], 3, "member", "idle", "s3i")
        assert kill.outcome == "ok", kill.note
        assert 0 < kill.spawn < kill.value
        logs = sorted(p.name for p in (tmp_path / "s3i").iterdir())
        assert logs == ["node0.log", "node1.log", "node2.log"]
    finally:
        left = sweep(tag)
    assert left == []


# ---- bench/rendezvous_scale.py: its verdicts, its fit, and a small real run -------------------
def _scale_res(n, members, t1, w1, t2=0.5, w2=None):
    def rnd(t, w, left=None):
        r = {"time": t, "writes": w, "watch_events": 3 * n, "etcd_cpu": 1.0}
        r["leader"] = {"thread_cpu": 0.2, "process_cpu": 0.9}
        return {**r, "left": left} if left else r

    return {
        "n": n,
        "members": members,
        "procs": 4,
        "problems": [],
        "round1": rnd(t1, w1),
        "round2": rnd(t2, w2 if w2 is not None else n + 4, "member"),
    }


def test_scale_targets_per_cluster_size_and_round():
    from bench import scale_report as sr

    assert sr.verdicts({"time": 1.9, "writes": 3 * 4096 + 10}, 4096, 1) == ("PASS (<=2)", "PASS")
    assert sr.verdicts({"time": 2.1, "writes": 3 * 4096 + 11}, 4096, 1) == ("MISS (>2)", "MISS")
    assert sr.verdicts({"time": 3.9, "writes": 1}, 4096, 3)[0] == "PASS (<=4)"
    assert sr.verdicts({"time": 9.0, "writes": 1}, 4096, 1, "round2")[0] == "-"  # join only
    assert sr.verdicts({"time": 3.1, "writes": 1}, 1000, 1, "round2")[0] == "MISS (>3)"
    assert sr.verdicts({"time": None, "writes": 1}, 10, 1)[0] == "MISS (no time)"
    text, ok = sr.table([_scale_res(4096, 3, 3.5, 12290), _scale_res(4096, 1, 1.5, 12298)])
    assert ok and "0.20 / 0.90" in text and "3.000" in text
    text, ok = sr.table([_scale_res(4096, 1, 2.5, 12298)])
    assert not ok and "MISS (>2)" in text


def test_scale_row_counts_only_when_the_simulation_kept_up():
    """The validity rule (bench/scale_keepalive.py): a lease unanswered for more than 1.5 of
    its intervals, or given up, makes the round's row invalid, and the run not ok.
    """
    from bench import scale_keepalive as ka
    from bench import scale_report as sr

    def reading(t, lease_s, sent, acked, gap=1.0, stale=0.5, lapsed=0):
        return {"t": t, "lease_seconds": lease_s, "leases": 100, "sent": sent, "acked": acked} | {
            "ticks": 4,
            "late_max": 0.01,
            "gap_max": gap,
            "stale_max": stale,
            "lapsed": lapsed,
        }

    a = ka.combine([reading(10.0, 0.0, 0, 0), reading(10.2, 0.0, 0, 0)])
    assert a["t"] == 10.2 and a["leases"] == 200
    good = ka.keep_up(a, reading(20.2, 1000.0, 598, 597), 5 / 3)
    assert good["due"] == 600 and good["acked_per_s"] == 59.7 and good["kept_up"]
    assert ka.kept_up_text(good) == "yes 0.99/1.0"
    for bad in (
        reading(20.2, 1000.0, 598, 597, gap=1.6),  # one answer came 1.6 intervals after the last
        reading(20.2, 1000.0, 598, 597, stale=1.7),  # one lease unanswered for 1.7 intervals now
        reading(20.2, 1000.0, 598, 590, lapsed=1),  # one given up
    ):
        assert not ka.keep_up(a, bad, 5 / 3)["kept_up"]
    starved = ka.keep_up(a, reading(20.2, 1000.0, 598, 300, gap=2.4), 5 / 3)
    assert ka.kept_up_text(starved) == "NO 0.50/2.4"
    res = _scale_res(1000, 1, 0.5, 3010)
    res["round2"]["keepalive"] = starved
    text, ok = sr.table([res])
    assert not ok and "NO 0.50/2.4" in text and "PASS (<=3)" in text  # fast, but not valid
    res["round2"]["keepalive"] = good
    assert sr.table([res])[1]
    from bench import scale_plot as sp

    res["round2"]["keepalive"] = starved  # an invalid row is no point of the curve
    assert sp.series([res]) == {("round1", 1): [(1000, 0.5)]}


def test_scale_fit_tells_linear_from_quadratic(tmp_path):
    from bench import scale_plot as sp

    lin = [_scale_res(n, 1, 0.0004 * n, 3 * n) for n in (10, 100, 1000, 4096)]
    quad = [_scale_res(n, 3, 1e-7 * n * n, 3 * n) for n in (10, 100, 1000, 4096)]
    ss = sp.series(lin + quad)
    assert abs(sp.fit(ss[("round1", 1)])[1] - 1.0) < 1e-9
    assert abs(sp.fit(ss[("round1", 3)])[1] - 2.0) < 1e-9
    lines = sp.fit_lines(lin + quad)
    assert any("1 member(s)" in x and "N^1.00" in x and "about O(N)" in x for x in lines)
    assert any("3 member(s)" in x and "N^2.00" in x and "O(N^2)" in x for x in lines)
    out = tmp_path / "plot.svg"
    sp.write_svg(lin + quad, str(out))
    text = out.read_text()
    assert text.startswith("<svg") and text.count("<circle") >= 8 and "~N^2.00" in text


@pytest.mark.timeout(120)
def test_rendezvous_scale_small_real_run(etcd_bin, tmp_path):
    """N = 6 real handlers in 2 processes (2 clients each: ``--per-client 2``; etcd and the
    handlers pinned to CPU 0), on 1 and on 3 etcd members: every figure the table shows is
    there, writes are 3 per node plus the round's own, the leader's CPU is found.
    """
    import json
    import subprocess

    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "bench.rendezvous_scale", "--n", "6", "--members", "1,3"]
    cmd += ["--procs", "2", "--per-client", "2", "--timeout", "30", "--quiet-wait", "0"]
    cmd += ["--etcd-cpus", "0", "--worker-cpus", "0"]  # both on one CPU: every machine has it
    cmd += ["--json", str(out), "--svg", str(tmp_path / "s.svg")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [(r["n"], r["members"]) for r in results] == [(6, 1), (6, 3)]
    for r in results:
        assert r["problems"] == [] and r["round2"]["problems"] == [] and r["per_client"] == 2
        assert r["etcd_cpus"] == r["worker_cpus"] == [0]
        r1 = r["round1"]
        assert 3 * 6 <= r1["writes"] <= 3 * 6 + 10 and r1["watch_events"] >= 6
        assert r1["slow_applies"] >= 0 and r1["leases_expired"] == 0  # scraped, and calm
        for k in (r1["keepalive"], r["round2"]["keepalive"]):  # the relay's keep-alives came
            assert k["window_s"] >= 2 * k["interval_s"] - 0.01  # both rounded
            assert k["acked"] > 0 and k["lapsed"] == 0
        assert len(r1["watch_events_by_member"]) == len(r1["etcd_cpu_by_member"]) == r["members"]
        assert r1["leader"]["worker"] in (0, 1) and r1["leader"]["thread_cpu"] is not None
        assert r["round2"]["leader"]["node"] == r1["leader"]["node"]  # a member left
    assert "fit join round" not in p.stdout  # N < 100: nothing to fit
    assert (tmp_path / "s.svg").read_text().startswith("<svg")


# ---- bench/in_place_compare.py: its figures from a step log, and its verdicts ---------------


def _log(node, steps, world, t0, dt=0.1, pid=1):
    return [
        {"k": "step", "node": node, "pid": pid, "t": t0 + i * dt, "s": s, "w": world, "r": 0}
        for i, s in enumerate(steps)
    ]


def test_step_metrics_in_place_kill_and_restart_from_a_checkpoint():
    from bench.step_metrics import measure

    # in place: steps 1-30 in a world of 4, a kill at t=3.05, steps 31.. in a world of 3 at t=5
    recs = _log("a", range(1, 31), 4, 0.1) + _log("a", range(31, 35), 3, 5.0)
    recs += _log("b", range(1, 31), 4, 0.12) + _log("b", range(31, 35), 3, 5.2)
    m = measure(sorted(recs, key=lambda r: r["t"]), ["a", "b"], 3.05, 3)
    assert m.recovery_s == pytest.approx(5.2 - 3.05)
    assert m.pause_s == pytest.approx(5.2 - 3.02)  # b's last old step to b's first new one
    assert m.work_lost == 0 and not m.loaded_checkpoint
    # a restart: a new process on node "a" reads the checkpoint of step 20 and does 21.. again
    recs = _log("a", range(1, 31), 4, 0.1)
    recs += [{"k": "load", "node": "a", "pid": 2, "t": 6.0, "s": 20}]
    recs += _log("a", range(21, 25), 3, 6.5, pid=2)
    m = measure(recs, ["a"], 3.05, 3)
    assert m.work_lost == 10 and m.loaded_checkpoint
    assert m.recovery_s == pytest.approx(6.5 - 3.05)
    with pytest.raises(ValueError, match="no step with world 2"):
        measure(recs, ["a"], 3.05, 2)


def test_step_metrics_scale_up_pause_is_the_stall_not_the_newcomers_start():
    from bench.step_metrics import measure, newcomer_start

    # survivors train on in a world of 3 until t=4.0 while the newcomer starts (event t=1.0)
    recs = _log("a", range(1, 41), 3, 0.1) + _log("a", range(41, 45), 4, 4.25)
    recs += [{"k": "sync", "node": "n", "pid": 9, "t": 4.2, "bytes": 2_000_000, "secs": 0.02}]
    m = measure(sorted(recs, key=lambda r: r["t"]), ["a"], 1.0, 4)
    assert m.pause_s == pytest.approx(4.25 - 4.0)
    assert m.recovery_s == pytest.approx(3.25)
    assert m.work_lost == 0 and m.sync_mb_s == pytest.approx(100.0)
    recs.append({"k": "start", "node": "n", "pid": 9, "t": 4.05})  # handed the round
    got = newcomer_start(sorted(recs, key=lambda r: r["t"]), "n", 1.0, 4.0)
    assert got == {
        "newcomer_start_s": 0.05,
        "newcomer_to_group_s": None,
        "newcomer_to_wrapped_s": None,
        "newcomer_to_sync_s": 0.15,
    }


def _series(scenario, setting, column, trials):
    return {
        "scenario": scenario,
        "setting": setting,
        "column": column,
        "label": column,
        "trials": [{"outcome": "ok", "note": "", **t} for t in trials],
    }


def test_in_place_report_verdicts():
    from bench.in_place_report import markdown, targets

    fast = {"recovery_s": 2.0, "pause_s": 2.1, "work_lost": 0}
    slow = {"recovery_s": 2.6, "pause_s": 2.7, "work_lost": 0}
    res = {
        "series": [
            _series("kill", "tuned", "etcdrun-inplace", [fast, slow, fast]),
            _series("kill", "tuned", "torchft", [slow, slow]),
            _series("kill", "default", "etcdrun-inplace", [slow]),
            _series("kill", "default", "torchft", [fast]),
            _series(
                "scale",
                "tuned",
                "etcdrun-inplace",
                [{**fast, "pause_s": 0.35, "sync_bytes": 1_000_000, "sync_s": 0.1}],
            ),
        ],
        "meta": {"cpus": 2, "load_before": 1.0, "settings": {}},
    }
    got = {t: v for t, v, _ in targets(res)}
    assert list(got.values()) == ["PASS", "PASS", "MISS", "PASS"], got
    assert "10.0 MB/s" in markdown(res)
    res["series"][0] = _series("kill", "tuned", "etcdrun-inplace", [slow, slow])  # 2.6 > 2.3
    assert targets(res)[0][1] == "MISS"


def test_agent_figures_from_etcdruns_events():
    from bench.step_metrics import agent_figures

    events = [
        {"event": "round_superseded", "time": 9.0},  # an earlier round: before the event
        {"event": "round_superseded", "time": 11.5},
        {"event": "round_superseded", "time": 11.6},
        {"event": "worker_resumed", "time": 12.0, "form_s": 0.2},
        {"event": "worker_resumed", "time": 12.1, "form_s": 0.7},
    ]
    assert agent_figures(events, 10.0) == {"notice_s": 1.5, "form_s": 0.7}
    assert agent_figures([], 10.0) == {"notice_s": None, "form_s": None}


def test_scale_fanout_sharded_round_costs_a_fraction_of_the_listed_one():
    s = scale_fanout.sizes(4096, "distinct")
    assert s["shards"] == 64 and 0 < s["header_bytes"] < 100  # the header lists nobody
    listed = 4096 * s["round_bytes"]
    assert s["sharded_bytes"] == pytest.approx(4096 * (s["header_bytes"] + s["shard_bytes"]))
    assert s["sharded_bytes"] * 4 < listed  # issue 31's "<= 1/4 of today", from the encoding
    # a node gets its own shard, never an empty one: at 16 nodes in 64 shards, about its own
    # entry (an averaged empty shard, a few bytes, would be under 20 B)
    small = scale_fanout.sizes(16, "one")
    assert small["shards"] == 64 and small["shard_bytes"] > 40
    assert small["sharded_bytes"] > 16 * (small["header_bytes"] + 40)
