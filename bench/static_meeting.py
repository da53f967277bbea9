"""A two-node static job (torchrun's own multi-node command line) under etcdrun and torchrun, side
by side: how long the nodes take to meet, and whether they wait for each other at the end.

Why: torchrun's static rendezvous makes the nodes meet in a TCPStore on the master before any
worker starts, and its agents wait at an exit barrier; etcdrun's static backend now does both
over a few lines of its own on ``MASTER_PORT`` (rendezvous/static/barrier.py). This prints what
each costs, per trial and as medians:

- start: node 1 runs first, node 0 ``--delay`` s later; node 0's start -> both workers running
  (each worker prints its ``time.time()`` as its first line);
- lag: node 1's worker start - node 0's worker start (how soon the waiting node goes on);
- end: node 1's worker sleeps ``--work`` s longer than node 0's; node 1's worker's last line ->
  node 0's agent gone (a launcher without an exit barrier has node 0 gone long before).

    python -m bench.static_meeting [--trials 5] [--delay 2] [--work 2]

Workers import nothing heavy (no torch), so the figures are the launchers'.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import sys, time
print("WSTART", time.time(), flush=True)
time.sleep(float(sys.argv[1]))
print("WEND", time.time(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def command(launcher: str, rank: int, port: int, script: str, sleep: float) -> list[str]:
    exe = Path(sys.executable).parent / launcher
    flags = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"]
    flags += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [str(exe), *flags, script, str(sleep)]


def stamp(text: str, what: str) -> float:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-2].endswith(what):
            return float(parts[-1])
    raise RuntimeError(f"no {what!r} line in:\n{text[-2000:]}")


def trial(launcher: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    script = tmp / "w.py"
    script.write_text(WORKER)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    logs = [tmp / f"{launcher}{r}.log" for r in (0, 1)]
    files = [open(p, "w") for p in logs]  # noqa: SIM115 - closed below
    try:
        n1 = subprocess.Popen(
            command(launcher, 1, port, str(script), args.work),
            stdout=files[1],
            stderr=subprocess.STDOUT,
            env=env,
        )
        time.sleep(args.delay)
        t0 = time.time()
        n0 = subprocess.Popen(
            command(launcher, 0, port, str(script), 0.0),
            stdout=files[0],
            stderr=subprocess.STDOUT,
            env=env,
        )
        n0.wait(120)
        t_gone0 = time.time()
        n1.wait(120)
    finally:
        for f in files:
            f.close()
    text = [p.read_text() for p in logs]
    s0, s1 = stamp(text[0], "WSTART"), stamp(text[1], "WSTART")
    return {
        "start": max(s0, s1) - t0,
        "lag": s1 - s0,
        "end": t_gone0 - stamp(text[1], "WEND"),
        "codes": float(n0.returncode or 0) + float(n1.returncode or 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--delay", type=float, default=2.0, help="node 0 starts this much later")
    p.add_argument("--work", type=float, default=2.0, help="node 1's worker runs this long")
    p.add_argument("--launchers", default="etcdrun,torchrun")
    args = p.parse_args()
    launchers = args.launchers.split(",")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            for name in launchers:  # interleaved: a busy moment hits both
                r = trial(name, args, Path(tmp))
                rows[name].append(r)
                print(
                    f"trial {i + 1} {name:9} start {r['start']:.3f} s  lag {r['lag']:+.3f} s  "
                    f"end {r['end']:+.3f} s  exit codes sum {r['codes']:.0f}",
                    flush=True,
                )
    print(
        f"\nmedians over {args.trials} trials (node 0 {args.delay:g} s after node 1; 1-min load "
        f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs):"
    )
    print(f"{'':10}{'start':>10}{'lag':>10}{'end':>10}")
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("start", "lag", "end")}
        print(f"{name:10}{med['start']:>9.3f}s{med['lag']:>+9.3f}s{med['end']:>+9.3f}s")
    print("end > 0: node 0 left after node 1's worker ended (it waited); < 0: it did not wait")


if __name__ == "__main__":
    main()
