"""Releases during DDP training, over and over: does every rank leave its round?

    python -m bench.release_stress --seeds 50 --rounds 10 [--no-hook] [--first 0]

Why: the soak (bench/soak.py) meets a round that ends mid-step a few times in a hundred trials;
a defect that shows once in a hundred such rounds needs thousands of trials there. Here three
processes on one machine train a small gloo DDP model, are released at drawn moments a few
milliseconds apart, form the next group and train again, ``--rounds`` times per seed, without
agents or etcd (bench/release_stress_worker.py). A seed whose processes have not all ended in
time is a hang: its stacks (gdb's, every thread) are printed and the seed is counted. Lines
saying that a released group is kept (a collective gloo still runs) are counted too.

``--no-hook`` trains through DDP's own all-reduce instead of ``InFlight``'s: what the code did
before the hook (bench/results/release_stress.md, "Without the hook").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("release_stress_worker.py")
WORLD = 3
SEED_S = 30.0  # a seed's fixed allowance, and 3 s per round on top: the rounds take under 1 s


def _stacks(pid: int) -> str:
    if shutil.which("gdb") is None:
        return "(no gdb on PATH: no stacks)"
    out = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"],
        capture_output=True,
        text=True,
    )
    return "\n".join(ln for ln in out.stdout.splitlines() if ln.startswith(("Thread", "#")))


def _seed(seed: int, rounds: int, hook: bool, tmp: Path) -> tuple[bool, int, int]:
    """(every rank ended, rounds left by every rank, groups kept) of one seed."""
    barrier = tmp / f"barrier{seed}"
    barrier.mkdir()
    port = 20000 + (seed * 37) % 20000
    args = [str(WORLD), str(port), str(seed), str(rounds), str(barrier), "1" if hook else "0"]
    logs = [tmp / f"seed{seed}_rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank, path in enumerate(logs):  # a file, not a pipe: torch's retry lines would fill one
        with path.open("w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(rank), *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + SEED_S + 3 * rounds
    ended = True
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ended = False
            print(f"seed {seed}: pid {p.pid} did not end\n{_stacks(p.pid)}", flush=True)
    for p in procs:
        p.kill()
        p.wait()
    outs = [path.read_text(errors="replace") for path in logs]
    if not ended:
        for rank, out in enumerate(outs):
            tail = out.splitlines()[-8:]
            print(f"seed {seed}: rank {rank}'s output, last lines:", *tail, sep="\n")
    left = min(sum(ln.startswith('{"rank"') for ln in o.splitlines()) for o in outs)
    kept = sum(o.count("still inside gloo") for o in outs)
    return ended and all("DONE" in o for o in outs), left, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--rounds", type=int, default=10, help="releases per seed")
    ap.add_argument("--no-hook", action="store_true", help="DDP's own all-reduce")
    a = ap.parse_args(argv)
    hung = rounds = kept = 0
    with tempfile.TemporaryDirectory(prefix="etcdrun-release-stress-") as tmp:
        for seed in range(a.first, a.first + a.seeds):
            ok, left, k = _seed(seed, a.rounds, not a.no_hook, Path(tmp))
            hung, rounds, kept = hung + (not ok), rounds + left, kept + k
            print(f"seed {seed}: {'ok' if ok else 'HUNG'}, {left} rounds, {k} kept", flush=True)
    print(
        f"{a.seeds} seeds, {'InFlight' if not a.no_hook else 'DDP'}'s all-reduce: "
        f"{rounds} rounds left by every rank, {hung} seed(s) hung, {kept} group(s) kept"
    )
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
