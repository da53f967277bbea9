#!/usr/bin/env python3
"""One kill -9 recovery, quiet and with every core saturated (issue 11, "recovery under load"):
``python -m bench.recovery_load [--busy] [--trials N]``.

4 etcdrun agents (``--nnodes 2:4``, 1 worker each, default lease_ttl 5) run
bench/compare_worker.py (gloo all_reduce every 0.2 s) on a one-member etcd; the node rank 1
agent and its workers are SIGKILLed; recovery is the kill to the survivors' three workers past
``init_process_group`` (BENCH_READY), as in bench/compare.py's scenario 3. ``--busy`` starts one
busy loop per core first (our own, killed by pid). Where the time goes comes from each agent's
events.jsonl (time_ms) and the workers' BENCH_START/READY lines: the lease expiring, the round
frozen, the workers spawned, their ``import torch`` and gloo meeting.

Why it imports from tests/: the agents run under the test suite's own harness
(tests/agent_helpers.py: ``Job`` starts etcdrun agents, keeps their output and tears down
leaving nothing; ``clean_env``, ``wait_for``), the one the agent tests rely on, and this one-off
measurement (issue 11) needs nothing else. A copy in bench/ would be a second harness to keep in
step; moving it here would make the tests import bench/. tests/ is not a package (agent_helpers
imports etcd_helpers by bare name, as pytest puts tests/ on ``sys.path``), so this script adds
tests/ to ``sys.path`` itself, right above its one import from it: the one place it edits
``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import become_subreaper, descendants, kill_pids, parse_lines, reap_orphans
from etcdrun.rendezvous.localetcd import LocalEtcd

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # the agents' harness, from tests/ (see docstring)

from agent_helpers import Job, clean_env, wait_for  # noqa: E402

WORKER = str(HERE / "compare_worker.py")  # started by the agents as a script file


def lines(job: Job) -> list:
    return [w for a in job.agents for w in parse_lines(a.stdout)]


def events(root: Path) -> list[dict]:
    out = []
    for path in root.glob("logs*/events.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["time_ms"])


def one(root: Path) -> dict:
    with LocalEtcd(1) as etcd:
        job = Job(etcd.endpoints, root, nnodes="2:4", nproc=1, run_id=f"load-{os.getpid()}")
        try:
            for i in range(4):
                job.start(
                    WORKER,
                    "allreduce",
                    env=clean_env(),
                    extra=("--log-dir", str(root / f"logs{i}")),
                )
            wait_for(
                lambda: len([w for w in lines(job) if w.kind == "READY" and w.world == 4]) == 4,
                120,
                "world 4 ready",
            )
            time.sleep(1.0)  # settle, as compare.py does
            ready4 = [w for w in lines(job) if w.kind == "READY" and w.world == 4]
            victim = next(a for a in job.agents if a.pid == _agent_of(job, ready4, 1))
            pids = [victim.pid, *descendants(victim.pid)]
            t_kill = time.time()
            kill_pids(pids)
            wait_for(
                lambda: len([w for w in lines(job) if w.kind == "READY" and w.world == 3]) == 3,
                120,
                "world 3 ready",
            )
            return _breakdown(job, root, t_kill)
        finally:
            job.close()
            reap_orphans()


def _agent_of(job: Job, ready: list, group_rank: int) -> int:
    pid = next(w.pid for w in ready if w.group_rank == group_rank)
    with open(f"/proc/{pid}/stat") as fp:
        return int(fp.read().rsplit(")", 1)[1].split()[1])


def _breakdown(job: Job, root: Path, t_kill: float) -> dict:
    w3 = [w for w in lines(job) if w.world == 3]
    evs = [e for e in events(root) if e["time_ms"] / 1000 >= t_kill]

    def first(name: str) -> float | None:
        hit = [e["time_ms"] / 1000 - t_kill for e in evs if e["event"] == name]
        return round(min(hit), 2) if hit else None

    def last(name: str) -> float | None:
        hit = [e["time_ms"] / 1000 - t_kill for e in evs if e["event"] == name]
        return round(max(hit), 2) if hit else None

    return {
        "round_started": first("round_started"),
        "round_frozen": first("round_frozen"),
        "workers_started_last": last("worker_started"),
        "worker_START_last": round(max(w.t for w in w3 if w.kind == "START") - t_kill, 2),
        "recovery_READY": round(max(w.t for w in w3 if w.kind == "READY") - t_kill, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", action="store_true", help="one busy loop per core meanwhile")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    become_subreaper()
    busy = []
    if args.busy:
        busy = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)
        ]
    try:
        rows = []
        for n in range(args.trials):
            with tempfile.TemporaryDirectory(prefix="etcdrun-load-") as tmp:
                rows.append(one(Path(tmp)))
            print(f"trial {n + 1}: {rows[-1]}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    med = statistics.median(r["recovery_READY"] for r in rows)
    print(f"{'busy' if args.busy else 'quiet'}: recovery median {med:.2f} s over {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
