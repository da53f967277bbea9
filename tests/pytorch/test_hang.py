"""The hang watchdog end to end (design.md §4b): real agents, a real etcd, real gloo workers.

Two nodes of two workers run tests/agent_scripts/hang_train.py with ``--hang-timeout 3``; rank 3
hangs once at step 20 while its peers wait for it in ``all_reduce``: asleep in Python, blocked
in C (``os.read`` on a pipe), or stopped (SIGSTOP). Every node must print the verdict naming
rank 3 and the line it is stuck on (or that it is stopped) within S + 2 s of rank 3's last
progress, the blamed worker's error file must carry that line and its stack, and the job must
go on after one restart and succeed. A frozen node (agent and workers stopped) gets no verdict
against a rank that waits: the survivors' line says that a node did not report, and the lease
takes it out.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, Job, clean_env, wait_for, warden_of

SCRIPT = SCRIPTS / "hang_train.py"
TIMEOUT = 3.0
STUCK_RANK, STUCK_STEP = 3, 20


def line_of(text: str) -> int:
    """The line number of the script's line holding ``text``."""
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text in line:
            return n
    raise AssertionError(f"{text!r} is not in {SCRIPT}")


def events(logs: Path, name: str) -> list[dict]:
    found = []
    for path in logs.rglob("events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name]
    return found


def last_progress(out: Path) -> float:
    rows = [json.loads(ln) for ln in (out / f"rank{STUCK_RANK}.jsonl").read_text().splitlines()]
    return next(r["last_progress"] for r in rows if "hang" in r)


def make_job(etcd, tmp_path: Path, mode: str, conf: str, prewarm: str = "none") -> Job:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1:2" if mode == "frozen" else "2",
        nproc=2,
        conf=conf,
        extra=("--prewarm", prewarm, "--max-restarts", "1", "--hang-timeout", str(TIMEOUT)),
        script=(str(SCRIPT), str(out), "sleep" if mode == "frozen" else mode)
        + (str(STUCK_RANK), str(STUCK_STEP)),
    )
    job.hang_out, job.logs = out, logs
    return job


@pytest.mark.parametrize(
    "mode, prewarm, where",
    [
        ("sleep", "none", f"hang_train.py:{line_of('time.sleep(3600)')} in step_once"),
        ("read", "none", f"hang_train.py:{line_of('os.read(r, 1)')} in step_once"),
        # from standbys: a standby arms its stack dump when it is handed its round
        ("read", "auto", f"hang_train.py:{line_of('os.read(r, 1)')} in step_once"),
        ("stop", "none", "is stopped (SIGSTOP or a debugger): no stack"),
    ],
)
def test_a_hung_rank_is_named_on_every_node_and_the_job_goes_on(
    etcd, tmp_path, torch_available, mode, prewarm, where
):
    job = make_job(etcd, tmp_path, mode, "lease_ttl=2,last_call_timeout=1", prewarm)
    try:
        agents = [
            job.start(env=clean_env(), extra=("--log-dir", str(job.logs / f"n{i}")))
            for i in range(2)
        ]
        for a in agents:
            assert a.wait(120) == 0, a.stderr[-3000:]
        verdicts = events(job.logs, "hang_verdict")
        assert len(verdicts) == 2, "one verdict on each node"
        hung_at = last_progress(job.hang_out)
        for v in verdicts:
            assert v["rank"] == STUCK_RANK and where in v["where"], v
            assert v["time"] - hung_at <= TIMEOUT + 2, f"line {v['time'] - hung_at:.2f} s late"
        for a in agents:
            (line,) = [ln for ln in a.stderr.splitlines() if "hang: rank" in ln]
            assert f"rank {STUCK_RANK} on node" in line and where in line, line
            assert f"run {job.run_id} round 1 node" in line
        (error_file,) = job.logs.rglob(f"attempt_1/{STUCK_RANK}/error.json")
        message = json.loads(error_file.read_text())["message"]
        assert where in message["message"]
        if mode != "stop":  # its stack, all threads, in the file every node reports from
            assert "(most recent call first)" in message["extraInfo"]["py_callstack"]
        stacks = list(job.logs.rglob("attempt_1/*/stacks.log"))
        assert len(stacks) == 4, "every worker's stack file is kept"
        waiting = [p for p in stacks if "torch/distributed" in p.read_text()]
        assert len(waiting) == 3, "the three peers were dumped waiting in torch.distributed"
        finished = [
            json.loads(ln)
            for p in job.hang_out.glob("rank*.jsonl")
            for ln in p.read_text().splitlines()
        ]
        assert {r["rank"] for r in finished if r["attempt"] == 1 and r.get("step") == 3} == {
            0,
            1,
            2,
            3,
        }, "the restarted job ran to its end"
    finally:
        job.close()


def test_a_frozen_node_is_said_to_be_silent_and_its_lease_ends_it(etcd, tmp_path, torch_available):
    """The whole node stops (agent, warden, workers) before its lease can tell: the survivors'
    watchdog fires first, no rank that answers is to blame, and the line says so; the lease
    then takes the node out and the survivor finishes alone.
    """
    job = make_job(etcd, tmp_path, "frozen", "lease_ttl=8,last_call_timeout=1")
    job.script = (str(SCRIPT), str(job.hang_out), "sleep", "-1", "0")  # nobody hangs by itself
    try:
        agents = [
            job.start(env=clean_env(), extra=("--log-dir", str(job.logs / f"n{i}")))
            for i in range(2)
        ]
        wait_for(lambda: len(list(job.hang_out.glob("rank*.jsonl"))) == 4, 90, "four workers")
        wait_for(
            lambda: all(
                len((job.hang_out / f"rank{r}.jsonl").read_text().splitlines()) >= 10
                for r in range(4)
            ),
            90,
            "ten steps on every rank",
        )
        victim = agents[1]
        frozen = [victim.pid, warden_of(victim.pid), *descendants(victim.pid)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        survivor = agents[0]
        wait_for(lambda: events(job.logs / "n0", "hang_verdict"), 30, "the survivor's verdict")
        (v,) = events(job.logs / "n0", "hang_verdict")
        assert "did not report" in v["where"], v
        victim.proc.kill()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert survivor.wait(120) == 0, survivor.stderr[-3000:]
        assert not events(job.logs / "n0", "worker_killed_for_hang"), "a waiting rank was blamed"
    finally:
        job.close()


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == p:
                    found.append(int(d.name))
                    todo.append(int(d.name))
    return found


def test_a_hung_rank_in_place_leaves_with_its_node_and_the_others_go_on(
    etcd, tmp_path, torch_available
):
    """Workers that run in place (``etcdrun.elastic``): the blamed rank's node leaves the job,
    as a drain does, and the other nodes re-form in place without it. Nobody restarts and no
    restart is charged; at min nodes the round would fail and restart as above.
    """
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    steps, stuck = 40, 10
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2:4",
        nproc=1,
        conf="lease_ttl=2,last_call_timeout=1",
        extra=("--prewarm", "none", "--max-restarts", "0", "--hang-timeout", str(TIMEOUT)),
        script=(str(SCRIPTS / "elastic_train.py"), str(out), str(steps), "0.05"),
    )
    try:
        agents = [
            job.start(env=clean_env(HANG_AT=f"2:{stuck}"), extra=("--log-dir", str(logs / f"n{i}")))
            for i in range(3)
        ]
        for a in agents:
            assert a.wait(120) == 0, a.stderr[-3000:]
        left = [a for a in agents if "drained (asked by the hang watchdog)" in a.stderr]
        assert len(left) == 1, [a.stderr[-1500:] for a in agents]
        for a in agents:  # the verdict's line on every node
            assert any("hang: rank 2 on node" in ln for ln in a.stderr.splitlines()), a.stderr
        rows: dict[int, list[dict]] = {}
        for path in out.glob("steps_*.jsonl"):
            rows[int(path.stem.split("_")[1])] = [
                json.loads(x) for x in path.read_text().splitlines()
            ]
        hung = [pid for pid, r in rows.items() if r[-1]["step"] == stuck]
        kept = [pid for pid in rows if pid not in hung]
        assert len(hung) == 1 and len(kept) == 2, {p: r[-1] for p, r in rows.items()}
        for pid in kept:  # the same processes, every step once, the last ones in a world of 2
            assert [r["step"] for r in rows[pid]] == list(range(1, steps + 1)), pid
            assert {r["round"] for r in rows[pid]} == {1, 2} and rows[pid][-1]["world"] == 2
        assert not events(logs, "workers_restarted"), "a survivor was restarted"
        (killed,) = events(logs, "worker_killed_for_hang")
        assert killed["left_in_place"] is True and killed["ranks"] == [2]
    finally:
        job.close()
