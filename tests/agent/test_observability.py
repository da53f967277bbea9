"""Seeing the job, end to end: events.jsonl, /metrics and /healthz, and the console's story.

Real agents (the console script) on a real etcd with real worker processes. One job loses a node
while an operator watches it every way there is — the metrics port scraped with a real HTTP
client while it runs and while it recovers, ``etcdrun status --json``, the shared events.jsonl
replayed and compared with what status saw, the agents' own lines — and two more show the
first round's last call and a restart's real root cause on every node.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from agent_helpers import WORKER, clean_env, etcdrun_bin, wait_for

from etcdrun.agent.report.event_sink import read
from etcdrun.rendezvous.free_port import reserve_free_port

HOST = socket.gethostname()
# The transitions a node goes through once each per round (per worker for the workers').
ONCE = ("node_joined", "round_accepted", "worker_started", "worker_stopped", "worker_exited")


def scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""  # not serving yet


def health(port: int) -> tuple[int, dict]:
    code, body = scrape(port, "/healthz")
    return code, json.loads(body) if body else {}


def status_json(endpoints: str, run: str) -> dict:
    proc = subprocess.run(
        [etcdrun_bin(), "status", "--rdzv-endpoint", endpoints, "--rdzv-id", run, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def replay(events: list[dict], number: int) -> dict:
    """What the events say about round ``number``: who runs in it at which rank, who left and
    why, the restart count — the same questions ``status --json`` answers from etcd.
    """
    accepted = {e["node"]: e["node_rank"] for e in events if _is(e, "round_accepted", number)}
    opened = [e for e in events if _is(e, "round_started", number)]
    restarts = [e["restart_count"] for e in events if _is(e, "workers_restarted", number)]
    return {
        "participants": sorted(accepted.items(), key=lambda kv: kv[1]),
        "departed": opened[0]["departed"] if opened else [],
        "departed_cause": opened[0]["departed_cause"] if opened else [],
        "restart_count": restarts[0] if restarts else 0,
    }


def _is(e: dict, name: str, number: int) -> bool:
    return e["event"] == name and e["round"] == number


def test_a_job_that_loses_a_node_seen_every_way(etcd, job_factory):
    port = reserve_free_port()
    logs = None
    job = job_factory(nnodes="3", conf="lease_ttl=2,join_timeout=60")
    logs = job.root / "logs"  # one --log-dir for every agent: one agent.log, one events.jsonl
    shared = ("--log-dir", str(logs))
    watched = job.start(
        extra=(*shared, "--metrics-port", str(port), "--event-log-handler", "console")
    )
    others = [job.start(extra=shared) for _ in range(2)]
    first = job.wait_round(6)
    r1 = first[0].round
    code, body = wait_for(lambda: (h := health(port))[0] == 200 and h, 20, "healthz 200")
    assert (body["round"], body["phase"], body["workers"]) == (
        r1,
        "running",
        {"0": "running", "1": "running"},
    )
    assert 0 < body["lease_time_left_s"] <= 2
    code, text = scrape(port, "/metrics")
    assert code == 200
    assert metric(text, 'etcdrun_workers{state="running"}') == 2
    assert metric(text, "etcdrun_round") == r1
    assert metric(text, 'etcdrun_rounds_total{reason="first"}') == 1
    assert metric(text, 'etcdrun_etcd_request_duration_seconds_count{method="Txn"}') >= 1
    assert 0 < metric(text, "etcdrun_lease_time_to_expiry_seconds") <= 2

    rank_of = {s.ppid: int(s.env["GROUP_RANK"]) for s in first}
    victim = others[0]
    before = status_json(etcd.endpoints, job.run_id)
    lost = next(n for n in before["participants"] if n["pid"] == victim.pid)
    assert (lost["host"], lost["node_rank"]) == (HOST, rank_of[victim.pid])
    assert re.fullmatch(rf"{re.escape(HOST)}-[0-9a-f]{{5}}\.1", lost["node_id"])  # readable
    victim.proc.kill()

    # Recovering: min is 3, so the survivors wait for a newcomer — not ready meanwhile.
    # (the workers may be stopped a moment before the phase moves on: "workers not running")
    joining = lambda: (h := health(port))[0] == 503 and h[1]["why"] == "joining" and h  # noqa: E731
    code, body = wait_for(joining, 20, "healthz 503 (joining)")
    assert body["healthy"] is False
    assert scrape(port, "/livez")[0] == 200  # alive all along: no reason to kill the pod
    during = status_json(etcd.endpoints, job.run_id)
    assert during["missing"] == [lost["node_id"]]
    assert (during["departed"], during["departed_cause"]) == ([lost["node_id"]], ["lease expired"])
    assert scrape(port, "/metrics")[0] == 200  # scraped while it recovers too

    job.start(extra=shared)  # a replacement
    second = job.wait_round(6, after=r1, timeout=30)
    r2 = second[0].round
    wait_for(lambda: health(port)[0] == 200, 20, "healthz 200 again")
    assert health(port)[1]["round"] == r2
    text = scrape(port, "/metrics")[1]
    assert metric(text, 'etcdrun_rounds_total{reason="node_lost"}') == 1
    assert metric(text, "etcdrun_round") == r2

    # The survivors say it in one line.
    line = (
        f"node {lost['node_rank']} ({HOST}, pid {victim.pid}) lost: lease expired; "
        f"new round {r2} with 3 nodes (no restart charged)"
    )
    for agent in (watched, others[1]):
        assert line in agent.stderr, agent.stderr
    after = status_json(etcd.endpoints, job.run_id)
    for a in job.agents:
        if a.proc.poll() is None:
            a.proc.send_signal(signal.SIGTERM)
    for a in job.agents:
        a.wait(30)

    events = read(str(logs / "events.jsonl"))
    _check_events(events, watched, after, r1, r2, lost["node_id"])
    _check_agent_log(logs / "agent.log", {e["node"] for e in events if e["node"]})


def _check_events(events, watched, after, r1, r2, lost_id) -> None:
    assert all(isinstance(e["time_ms"], int) and e["run_id"] for e in events)
    # Every transition once: no node reports one twice for the same round (and worker).
    keys = Counter(
        (e["event"], e["node"], e["round"], e.get("local_rank"))
        for e in events
        if e["event"] in ONCE
    )
    assert [k for k, n in keys.items() if n > 1] == []
    assert sum(1 for e in events if _is(e, "round_frozen", r2)) == 1  # the leader's, once
    assert sum(1 for e in events if _is(e, "worker_started", r2)) == 6
    # Replayed, the events tell what status read from etcd.
    told = replay(events, r2)
    assert told["participants"] == [(n["node_id"], n["node_rank"]) for n in after["participants"]]
    assert (told["departed"], told["departed_cause"]) == ([lost_id], ["lease expired"])
    assert (told["departed"], told["departed_cause"]) == (
        after["departed"],
        after["departed_cause"],
    )
    assert told["restart_count"] == after["restart_count"] == 0
    assert after["round"] == r2 and after["phase"] == "FROZEN"
    # The console handler printed the watched agent's events as the same JSON lines.
    printed = [json.loads(ln) for ln in watched.stderr.splitlines() if ln.startswith('{"event"')]
    assert any(e["event"] == "round_accepted" and e["round"] == r2 for e in printed)
    assert {e["node"] for e in printed if e["node"]} <= {e["node"] for e in events}


def _check_agent_log(path: Path, nodes: set[str]) -> None:
    """Three agents appended to one agent.log: every line names its node."""
    lines = [ln for ln in path.read_text().splitlines() if re.match(r"\d{4}-\d\d-\d\d ", ln)]
    assert lines
    named = [ln.split(" ")[2] for ln in lines]
    fallback = re.compile(rf"{re.escape(HOST)}:\d+")  # before its first session
    assert all(n in nodes or fallback.fullmatch(n) for n in named), set(named) - nodes
    assert len({n for n in named if n in nodes}) >= 4  # three agents and the replacement


def test_the_first_rounds_last_call_is_one_line_on_every_node(job_factory):
    job = job_factory(nnodes="2:3", nproc=1, conf="lease_ttl=2,last_call_timeout=8")
    agents = [job.start() for _ in range(2)]
    pattern = re.compile(
        r"first round: 2 of max 3 joined \(min 2\); starting in \d+ s unless more join"
    )
    for a in agents:  # the leader and the other node alike
        wait_for(lambda a=a: pattern.search(a.stderr), 20, f"the last-call line of {a.name}")
    job.wait_round(2)
    for a in agents:
        assert "waiting for a round" not in a.stderr


def test_a_restart_names_the_real_root_cause_on_every_node(job_factory):
    """Rank 3 raises (no @record: no error file, only its stderr tells), rank 2 beside it is
    stopped by its agent: every node names rank 3 and what it said, never a worker an agent
    stopped, and the final report carries rank 3's stderr to the node that never saw it.
    """
    job = job_factory(
        nnodes="2",
        conf="lease_ttl=2,join_timeout=30",
        extra=("--max-restarts", "1", "--stop-grace", "5"),
    )
    agents = [job.start(WORKER, str(job.out), "raw", "3") for _ in range(2)]
    codes = [a.wait(60) for a in agents]
    assert codes == [1, 1], job.describe()
    (r1, _), (r2, _) = sorted(job.rounds().items())
    cause = (
        f"worker rank 3 (local 1) on {HOST} failed (exit code 1): ValueError: boom from rank 3; "
        f"new round {r2} with 2 nodes (restart 1 of 1 charged)"
    )
    for a in agents:
        err = a.stderr
        assert cause in err, err
        story = [ln for ln in err.splitlines() if "failed (" in ln or "superseded" in ln]
        assert not [ln for ln in story if "SIGTERM" in ln], story
        assert "Root cause" in err and "rank 3 (local rank 1)" in err, err
        assert "stderr (last" in err and "ValueError: boom from rank 3" in err, err
        # Where the logs are: said at the start, and kept (a failed run) at the end.
        where = re.search(r"logs: (/\S+) \(events\.jsonl; .*a temporary folder, removed", err)
        assert where is not None, err
        assert f"worker logs and error files are in {where[1]}" in err, err
        assert Path(where[1], "events.jsonl").exists()
