"""How many etcd leader kills restart the job: kill -9 the leader of a 3-member etcd N times
under a running 3-agent job (lease_ttl 2) and count the kills after which a new round started.

Why: an election longer than the client's fence margin fenced every agent although etcd renews every
lease when a new leader takes over (issue 11, item 5). The agents now pause their workers while the
lease is in doubt and resume them when etcd answers. etcd runs on its default raft timings here
(heartbeat 100 ms, election 1 s), not the tests' fast ones, so elections take as long as they do in
production.

It prints how many kills restarted the job, every election's length (those of the restarting kills
apart), and how often the agents paused, resumed and fenced their workers. Figures, before and after
the pause: bench/results/leader_kills.md. An election that
outlasts TTL after the last acknowledged keep-alive still fences, by design — etcd could have
expired the lease by then, and S4 comes first.

    python -m bench.leader_kills --kills 12
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from etcdrun.rendezvous.localetcd import LocalEtcd

TTL = 2
WORKER = """import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["ETCDRUN_ROUND"] + "_" + os.environ["RANK"]).touch()
time.sleep(3600)
"""


def rounds(out: Path) -> set[int]:
    return {int(p.name.split("_")[0]) for p in out.iterdir()}


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_agents(etcd: LocalEtcd, root: Path, out: Path) -> list[subprocess.Popen]:
    script = root / "worker.py"
    script.write_text(WORKER)
    etcdrun = shutil.which("etcdrun") or str(Path(sys.executable).parent / "etcdrun")
    conf = f"lease_ttl={TTL},last_call_timeout=1"
    argv = [
        etcdrun,
        "--nnodes",
        "3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        etcd.endpoints,
        "--rdzv-id",
        f"kills-{os.getpid()}",
        "--rdzv-conf",
        conf,
        str(script),
        str(out),
    ]
    logs = [open(root / f"agent{i}.log", "wb") for i in range(3)]
    return [subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL) for f in logs]


FENCED = "lease was lost: workers killed"  # the agent's line when it fenced its workers


def fences(root: Path) -> int:
    return sum((root / f"agent{i}.log").read_text(errors="replace").count(FENCED) for i in range(3))


def whole(out: Path, after: int) -> bool:
    """A round later than ``after`` runs all 3 workers."""
    last = max(rounds(out))
    return last > after and len(list(out.glob(f"{last}_*"))) == 3


def one_kill(etcd: LocalEtcd, root: Path, out: Path) -> tuple[float, bool]:
    """Kill the leader, time the election, bring the member back; whether the job restarted
    (an agent fenced its workers, or a new round started).
    """
    before, fenced = max(rounds(out)), fences(root)
    old = etcd.wait_leader()
    t0 = time.monotonic()
    old.kill()
    etcd.wait_leader(30)
    election = time.monotonic() - t0
    old.restart(wait=True)
    etcd.wait_healthy(30)
    # Every agent decides within TTL of its last keep-alive before the kill; then the round
    # the leader opens (if any) shows within a second.
    wait(lambda: time.monotonic() > t0 + TTL + 1.5, 10, "the horizon")
    restarted = max(rounds(out)) > before or fences(root) > fenced
    if restarted:  # let the job run whole again (a later round, all 3) before the next kill
        wait(lambda: whole(out, before), 60, "the job whole")
    return election, restarted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=12)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="leader_kills_"))
    out = root / "out"
    out.mkdir()
    with LocalEtcd(members=3, fast=False) as etcd:
        agents = start_agents(etcd, root, out)
        try:
            wait(lambda: len(list(out.glob("*"))) == 3, 90, "the first round")
            results = [one_kill(etcd, root, out) for _ in range(args.kills)]
        finally:
            for a in agents:
                a.send_signal(signal.SIGTERM)
            for a in agents:
                a.wait(60)
    restarts = sum(r for _, r in results)
    times = sorted(e for e, _ in results)
    print(f"leader kills: {len(results)}, restarted the job: {restarts}")
    print("elections (kill -> new leader), s: " + ", ".join(f"{e:.2f}" for e in times))
    print("restarting kills' elections, s: " + ", ".join(f"{e:.2f}" for e, r in results if r))
    text = "".join((root / f"agent{i}.log").read_text(errors="replace") for i in range(3))
    print(
        f"agents' workers paused: {text.count('workers paused')} times, resumed: "
        f"{text.count('workers resumed')}, fenced: {text.count(FENCED)}; "
        f"rounds in all: {max(rounds(out))}"
    )
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
