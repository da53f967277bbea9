"""Re-forming the gloo group, fresh vs torch's ``_reconfigure``: the command line.

    python -m bench.reform [--quick] [--seeds 16] [--rounds 10] [--reps 5] [--only 1,4]
        [--out PATH] [--json RAW] [--from-json RAW] [--keep]

How: the cases asked for (``--only``) run one after another in one ``harness.Run`` (one
forkserver, every process killed at the end, even on an error or SIGTERM), each adding its raw
results to one dict; the run's meta (command, date, torch, CPUs, wall time, the machine's load
sampled every 5 s) goes with them. Without ``--quick`` (or with ``--out``) the page is written
to bench/results/reform.md: about 10 minutes on 2 busy cores; ``--quick`` under 90 s.
``--json`` also saves the raw results, and ``--from-json`` renders such a file again without
running anything, so that a change of the page's wording keeps a run's numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.reform.blocked import case_stop
from bench.reform.harness import Run
from bench.reform.host_killed import case_kill0
from bench.reform.newcomer import case_join
from bench.reform.report import render
from bench.reform.stress import case_stress
from bench.reform.supersede import case_supersede

PAGE = Path(__file__).parent.parent / "results" / "reform.md"
CASES = (
    ("1", case_stress),
    ("2", case_kill0),
    ("3", case_join),
    ("4", case_stop),
    ("5", case_supersede),
)


class Load:
    """The machine's 1-minute load average, sampled every 5 s during the run."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> str:
        self._stop.set()
        s = self.samples + [os.getloadavg()[0]]
        return f"min {min(s):.1f}, mean {statistics.mean(s):.1f}, max {max(s):.1f}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with the defaults of a full run or of ``--quick`` filled in."""
    ap = argparse.ArgumentParser(prog="python -m bench.reform", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run (< 90 s), not written")
    ap.add_argument("--seeds", type=int, default=None, help="case 1: seeds per configuration (16)")
    ap.add_argument("--first", type=int, default=0, help="case 1: the first seed")
    ap.add_argument("--rounds", type=int, default=None, help="case 1: releases per seed (10)")
    ap.add_argument("--reps", type=int, default=None, help="cases 2-4: repetitions (5)")
    ap.add_argument("--supersede", type=int, default=None, help="case 5: superseded rounds (6)")
    ap.add_argument("--watch", type=float, default=None, help="case 4: watchdog, s (10)")
    ap.add_argument("--only", default="1,2,3,4,5", help="the cases to run, e.g. 2,4")
    ap.add_argument("--out", default=None, help=f"the page to write (default {PAGE})")
    ap.add_argument("--keep", action="store_true", help="keep the logs' temporary directory")
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    ap.add_argument("--from-json", default=None, help="render a saved run's --json, not run")
    a = ap.parse_args(argv)
    q = a.quick
    a.seeds = a.seeds if a.seeds is not None else (1 if q else 16)
    a.rounds = a.rounds if a.rounds is not None else (4 if q else 10)
    a.reps = a.reps if a.reps is not None else (1 if q else 5)
    a.supersede = a.supersede if a.supersede is not None else (3 if q else 6)
    a.watch = a.watch if a.watch is not None else (5.0 if q else 10.0)
    return a


def run_cases(a: argparse.Namespace) -> dict[str, Any]:
    """The raw results of the cases asked for, in one forkserver whose processes all end."""
    only = {c.strip() for c in a.only.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="etcdrun-reform-"))
    run = Run(tmp)
    out: dict[str, Any] = {}
    try:
        for c, fn in CASES:
            if c in only:
                fn(run, a, out)
    finally:
        run.kill_all()
        if a.keep:
            print(f"logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out_path = Path(a.out) if a.out else (None if a.quick else PAGE)
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        page = render(saved["out"], saved["meta"])
        print(page)
        if a.out:
            Path(a.out).write_text(page)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began, load = time.monotonic(), Load()
    out = run_cases(a)
    import torch  # only now: the driver stays light while the ranks run

    meta = {
        "cmd": "python -m bench.reform" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - began,
        "load": load.stop(),
        "rounds": a.rounds,
    }
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "out": out}, indent=1))
    page = render(out, meta)
    print(page)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(page)
        print(f"written to {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
