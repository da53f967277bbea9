#!/usr/bin/env python3
"""etcdrun vs torchrun, side by side, in one run on this machine: ``python -m bench.compare``.

Runs issue 5's scenarios for both launchers with the same worker script (bench/compare_worker.py:
gloo all_reduce every 0.2 s, or idle) on N local agents, a few trials each, every wait bounded,
every process killed and checked gone after each trial. Prints medians, min-max and the
torchrun/etcdrun ratio per scenario, and writes bench/results.md and bench/recovery.png (only
on a full run; ``--only`` runs publish nothing unless ``--publish``); README and the docs link to
them rather than repeat them. Raw figures and every agent's log go to bench/out/<time>/.

Why its own venv (bench/.venv-torch, created on first use): torch 2.13 CPU (torchrun and the
workers' gloo), python-etcd (torchrun's etcd-v2) and matplotlib are the benchmark's needs, not
etcdrun's. etcdrun is installed there too (from this checkout), so both launchers start the same
interpreter for their workers; etcdrun's agent never imports torch, and its start-up and RSS are
measured as such. The script re-executes itself under that venv's Python, as the same module
(``-m bench.compare``, same working directory: run it from the repository root).

Scenario 7 (N simulated participants) is bench/rendezvous_scale.py's job: it is run as is and
its JSON is reported here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV = HERE / ".venv-torch"
VENV_PY = VENV / "bin" / "python"
TORCH_PIN = "torch==2.13.0"  # the CPU build pip finds on this machine; never a CUDA one
LOAD_MAX = 1.5


def ensure_venv(module: str | None = None) -> None:
    """Create the bench venv if missing, install this checkout into it, re-exec ``module``
    (default: the module run with ``-m`` — bench.compare, or a bench borrowing this) under it
    with ``python -m`` (once).

    Why a regular install of the working tree on every run, not an editable one: that is what a user
    runs (byte-compiled modules, no import hook). An editable install adds an import hook that every
    Python process in the venv pays at start-up (agents and workers of both launchers), and where
    PYTHONDONTWRITEBYTECODE is set (it is on this machine) an edited checkout is recompiled by every
    agent that starts: both would show in the start-up times measured (bench/results/figures.md).
    bench/ itself is not installed: the re-executed ``python -m`` finds it in the working directory,
    as the first run did.
    """
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    module = module or _main_module()
    steps = []
    if not VENV_PY.exists():
        print(
            f"creating {VENV.relative_to(REPO)} ({TORCH_PIN} CPU, python-etcd, matplotlib)...",
            flush=True,
        )
        steps += [
            [sys.executable, "-m", "venv", str(VENV)],
            [
                str(VENV_PY),
                "-m",
                "pip",
                "install",
                "-q",
                TORCH_PIN,
                "python-etcd",
                "matplotlib",
                "setuptools>=68",
                str(REPO),
            ],
        ]  # REPO: etcdrun's own deps
    steps.append(
        [
            str(VENV_PY),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--force-reinstall",
            "--no-build-isolation",
            str(REPO),
        ]
    )
    print("installing this checkout into the bench venv (regular install)...", flush=True)
    for cmd in steps:
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"compare.py: setup step failed: {' '.join(cmd)}")
    os.execv(str(VENV_PY), [str(VENV_PY), "-m", module, *sys.argv[1:]])


def _main_module() -> str:
    """The module ``python -m`` ran (``bench.compare``, ``bench.ab``, ...)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        sys.exit("run the benchmarks from the repository root as modules: python -m bench.<name>")
    return spec.name


def loadavg() -> float:
    return os.getloadavg()[0]


def wait_for_load(limit: float, max_wait: float) -> tuple[float, bool]:
    """Wait (bounded) until the 1-minute load average is below ``limit``; (load, waited ok)."""
    deadline = time.monotonic() + max_wait
    while True:
        load = loadavg()
        if load < limit:
            return load, True
        if time.monotonic() > deadline:
            return load, False
        print(
            f"  1-min load {load:.2f} >= {limit}: waiting (up to "
            f"{deadline - time.monotonic():.0f}s more)",
            flush=True,
        )
        time.sleep(30)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4, help="agents for scenarios 2-6, 8 (default 4)")
    ap.add_argument("--n-first", type=int, default=8, help="agents for scenario 1 (default 8)")
    ap.add_argument("--trials", type=int, default=3, help="trials per launcher (default 3)")
    ap.add_argument(
        "--slow-trials",
        type=int,
        default=2,
        help="trials of torchrun runs with default settings, which take 30-90 s each (default 2)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma list of scenarios, e.g. 1,3 (default all:"
        " 1,1s,2,3,3i,4,5,6,7,8; 1s = scenario 1 with the last agent started"
        " after the others wait; 3i = scenario 3 with idle workers)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=75.0,
        help="bound on one recovery/scale-up wait, seconds (default 75)",
    )
    ap.add_argument(
        "--never-timeout",
        type=float,
        default=60.0,
        help="bound for runs expected never to recover (torchrun, idle workers)",
    )
    ap.add_argument("--idle-window", type=float, default=10.0, help="scenario 8 window, s")
    ap.add_argument("--scale-n", default="10,100,1000", help="scenario 7 participant counts")
    ap.add_argument(
        "--wait-load",
        type=float,
        default=LOAD_MAX,
        help=f"wait until the 1-min load is below this (default {LOAD_MAX})",
    )
    ap.add_argument(
        "--max-wait",
        type=float,
        default=900.0,
        help="give up waiting for a low load after this many seconds, run anyway",
    )
    ap.add_argument(
        "--publish",
        action="store_true",
        help="write results.md and recovery.png even with --only",
    )
    ap.add_argument("--report", metavar="JSON", help="only rebuild the report from a saved run")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if min(args.n, args.n_first) < 3 or args.trials < 1 or args.slow_trials < 1:
        ap.error("--n and --n-first must be >= 3, --trials and --slow-trials >= 1")
    return args


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT unwind the running trial, so its Job kills its agents and etcd.

    Set explicitly: a shell starts background jobs with SIGINT ignored.
    """
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ensure_venv()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    from bench import publish  # not at the top: they import etcdrun, sure to be in the bench venv
    from bench.runner import run_all

    if args.report:
        results = json.loads(Path(args.report).read_text())
    else:
        from etcdrun.rendezvous.localetcd import find_etcd

        if find_etcd() is None:
            print("compare.py: etcd not found (apt-get install etcd-server)", file=sys.stderr)
            return 2
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = HERE / "out" / f"compare-{stamp}"
        out.mkdir(parents=True, exist_ok=True)
        load, ok = wait_for_load(args.wait_load, args.max_wait)
        try:
            results = run_all(args, out, uuid.uuid4().hex, load, ok)
        except KeyboardInterrupt:
            print("compare.py: interrupted; every process it started is gone", file=sys.stderr)
            return 130
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"\nraw figures and agent logs: {out.relative_to(REPO)}/")
    print()
    print(publish.console(results))
    if args.publish or results["meta"]["complete"]:
        publish.publish(results, HERE / "results.md", HERE / "recovery.png")
        print("wrote bench/results.md, bench/recovery.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
