"""What the straggler report costs in etcd: writes per node per minute, idle and training.

    python -m bench.stragglers [--window 60]

Two 3-node jobs (etcd backend, one worker each, ``--prewarm none``) on one local etcd, side by
side for the same window: *idle* runs tests/agent_scripts/worker.py ``sleep`` (it never calls
``progress``), *training* runs tests/agent_scripts/straggler.py (``progress(step)`` every
0.1 s, no node slow). A watch on the etcd root counts every put and delete per run and per key
kind (``progress/``, the rest) once both jobs run; the lines for bench/results/stragglers.md ("etcd
writes of the pace") are printed as markdown with the load average. The times from a slowdown to the
straggler's naming and eviction come from tests/agent/test_stragglers.py (``pytest -s``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.hang import _bin
from bench.procs import become_subreaper, reap_orphans

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "agent_scripts"
NODES = 3


def _job(endpoints: str, run_id: str, script: list[str], logs: Path) -> list[subprocess.Popen]:
    argv = [_bin("etcdrun"), "--nnodes", str(NODES), "--nproc-per-node", "1"]
    argv += ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", run_id]
    argv += ["--prewarm", "none", "--log-dir", str(logs), *script]
    return [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(NODES)
    ]


def measure(window: float, work: Path) -> dict[tuple[str, str], int]:
    """Writes per (run, kind) during ``window`` seconds once both jobs' workers run."""
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.rendezvous.client import EtcdClient
    from etcdrun.rendezvous.localetcd import LocalEtcd

    counts: Counter[tuple[str, str]] = Counter()
    with LocalEtcd() as etcd, EtcdClient(etcd.endpoints) as client:
        idle_out, train_out = work / "idle", work / "train"
        idle_out.mkdir(parents=True)
        train_out.mkdir(parents=True)
        agents = _job(
            etcd.endpoints, "idle", [str(SCRIPTS / "worker.py"), str(idle_out), "sleep"], work
        )
        agents += _job(
            etcd.endpoints, "train", [str(SCRIPTS / "straggler.py"), str(train_out)], work
        )
        try:
            while len(list(idle_out.glob("start_*"))) + len(list(train_out.glob("start_*"))) < 6:
                time.sleep(0.1)
            time.sleep(3)  # past the round's own writes and the first pace

            def count(batch) -> None:
                for ev in batch.events:
                    parts = ev.kv.key.decode().split("/")  # /etcdrun/<run>/<kind>/...
                    kind = "progress" if parts[3] == "progress" else "other"
                    counts[(parts[2], kind)] += (
                        1 if ev.type in (pb.Event.PUT, pb.Event.DELETE) else 0
                    )

            w = client.watch("/etcdrun/", prefix=True, callback=count)
            time.sleep(window)
            w.cancel()
        finally:
            for a in agents:
                a.kill()
                a.wait()
            reap_orphans()
    return dict(counts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=60.0)
    a = p.parse_args(argv)
    become_subreaper()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        counts = measure(a.window, Path(d))
    per_min = 60 / a.window / NODES
    for run in ("idle", "train"):
        pace = counts.get((run, "progress"), 0) * per_min
        other = counts.get((run, "other"), 0) * per_min
        print(
            f"- {run}: progress/ writes per node per minute {pace:.1f}, other writes {other:.1f} "
            f"({NODES} nodes, {a.window:g} s window, load average {load:.2f} at start)"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
