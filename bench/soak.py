#!/usr/bin/env python3
"""Chaos soak: ``python -m bench.soak --trials N --seed S`` runs N seeded chaos trials (seeds
S..S+N-1; tests/chaos/: a real 3-member etcd, 3-5 real agents, short real workers, random
faults) and prints trials, violations, jobs lost, and p50/p99 recovery. A failing trial prints
its seed, schedule and the command that replays it: ``python -m bench.soak --replay SEED``.
About a third of the seeds are in-place trials (workers that opt in through etcdrun.elastic,
tests/chaos/chaos_inplace.py); ``--in-place`` runs only those.

Why seeds and not a fixed list: each seed is one schedule (tests/chaos/chaos_schedule.py, pure),
so a long soak explores, and any trial it fails replays exactly (the schedule, not the timing: the
processes are real). Why ``--pause-file``: a long soak shares this machine with measurements;
while the file exists the soak waits between trials.

Why it imports from tests/: a soak trial is the test suite's chaos trial (tests/chaos/
chaos_trial.py, with its schedule, faults and invariant checks), the one CI's short soak runs
(tests/chaos/test_chaos_soak.py); this script only runs more seeds of it. A copy in bench/ would
drift from what CI checks, and moving it here would make the tests import bench/. tests/ is not
a package (its helpers import one another by bare name, as pytest puts their folders on
``sys.path``), so this script adds tests/ and tests/chaos/ to ``sys.path`` itself, right above
its imports from them: the one place it edits ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import become_subreaper, reap_orphans
from etcdrun.rendezvous.localetcd import find_etcd

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path += [str(TESTS), str(TESTS / "chaos")]  # the chaos trial, from tests/ (see the docstring)

from chaos_inplace import trial  # noqa: E402
from chaos_schedule import generate, in_place  # noqa: E402
from chaos_trial import Result  # noqa: E402


def pick(first: int, trials: int, only_in_place: bool) -> list[int]:
    """The seeds to run: ``trials`` seeds from ``first`` on, or the first ``trials`` of them
    whose schedule is an in-place trial (chaos_schedule.in_place: about a third).
    """
    if not only_in_place:
        return list(range(first, first + trials))
    seeds: list[int] = []
    seed = first
    while len(seeds) < trials:
        seeds += [seed] if in_place(seed) else []
        seed += 1
    return seeds


def run_one(seed: int, etcd_bin: str, keep: bool = False) -> Result:
    """One trial; its files (agents' logs, events, worker start files) are kept when it fails:
    a timing-dependent failure may not come back on replay (bench/results/soak.md, 'What the soak
    found').
    """
    root = Path(tempfile.mkdtemp(prefix=f"etcdrun-soak-{seed}-"))
    r = Result(generate(seed))
    try:
        r = trial(generate(seed), etcd_bin, root).run()
    except Exception as e:  # the harness's own failure is a failed trial, never a pass
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        r.violations.append(f"trial crashed (load average {load}): {type(e).__name__}: {e}"[:2000])
    finally:
        reap_orphans()
        if keep or not r.ok:
            r.log.append(f"files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return r


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(results: list[Result]) -> dict:
    recov = sorted(r.recovery for r in results if r.recovery is not None)
    p50, p99 = pct(recov, 50), pct(recov, 99)
    return {
        "trials": len(results),
        "violations": sum(len(r.violations) for r in results),
        "trials_with_violations": sum(bool(r.violations) for r in results),
        "jobs_lost": sum(r.lost for r in results),
        "recovery_p50_s": None if p50 is None else round(p50, 2),
        "recovery_p99_s": None if p99 is None else round(p99, 2),
        "recoveries": len(recov),
        "resume_window_trials": sum(bool(r.resume_window) for r in results),
        "resume_window_max_s": round(
            max((w for r in results for w in r.resume_window), default=0.0), 3
        ),
        "trial_s_mean": round(statistics.mean(r.seconds for r in results), 1) if results else 0,
    }


def print_failure(r: Result) -> None:
    print(f"FAILED seed {r.schedule.seed}: {r.schedule.describe()}")
    for v in r.violations:
        print(f"  violation: {v}")
    for line in r.log:
        print(f"  {line}")
    print(f"  replay: python -m bench.soak --replay {r.schedule.seed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replay", type=int, help="run this one seed, verbosely, keeping its files")
    ap.add_argument("--json", type=Path, help="also write the figures (and failures) here")
    ap.add_argument("--pause-file", type=Path, help="wait between trials while this file exists")
    ap.add_argument(
        "--in-place",
        action="store_true",
        help="run only in-place trials: the first N seeds from --seed that draw one",
    )
    args = ap.parse_args(argv)
    etcd_bin = find_etcd()
    if etcd_bin is None:
        print("soak: etcd not found (set ETCD_BIN or apt-get install etcd-server)", file=sys.stderr)
        return 2
    become_subreaper()
    if args.replay is not None:
        seeds = [args.replay]
    else:
        seeds = pick(args.seed, args.trials, args.in_place)
    results: list[Result] = []
    for seed in seeds:
        while args.pause_file is not None and args.pause_file.exists():
            time.sleep(1)
        r = run_one(seed, etcd_bin, keep=args.replay is not None)
        results.append(r)
        rec = "-" if r.recovery is None else f"{r.recovery:.2f}s"
        if r.resume_window:
            rec += f" (resume window {max(r.resume_window):.3f}s)"
        print(
            f"seed {seed}: {'ok' if r.ok else 'FAIL'} {r.seconds:.1f}s recovery {rec}"
            f" | {r.schedule.describe()}",
            flush=True,
        )
        if not r.ok or args.replay is not None:
            print_failure(r) if not r.ok else [print(f"  {line}") for line in r.log]
        if args.json:
            write_json(args.json, results)
    figures = report(results)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0 if all(r.ok for r in results) else 1


def write_json(path: Path, results: list[Result]) -> None:
    failures = [
        {
            "seed": r.schedule.seed,
            "schedule": r.schedule.describe(),
            "violations": r.violations,
            "lost": r.lost,
            "log": r.log,
        }
        for r in results
        if not r.ok
    ]
    path.write_text(json.dumps({**report(results), "failures": failures}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
