#!/usr/bin/env python3
"""Standby workers (issue 14), measured: "ready" with and without them, beside torchrun, and
what a waiting standby costs: ``python -m bench.standby_bench [--trials 3]``.

Why a bench of its own beside compare.py: it changes one thing, ``--prewarm`` (``PET_PREWARM``),
on the same etcdrun, in the two scenarios the issue judges it on — kill -9 of a node with
lease_ttl=2, and scale-up 3 -> 4 — with torchrun's best tuned setting alongside, trials
interleaved (spawn, standby, torchrun, spawn, ...) so the machine's load falls on all three
alike. It reuses compare.py's venv, harness and definitions (bench/scenarios.py: "running" is
the new world's first worker line, "ready" is init_process_group returned everywhere), then
measures one waiting standby with torch imported: RSS and PSS (/proc/<pid>/smaps_rollup) and
its CPU use over ``--idle-window`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench import compare  # its venv: torch, torchrun, this checkout installed
from bench.procs import cpu_seconds, proc_kb

HERE = Path(__file__).resolve().parent

ROOM_VAR = "ETCDRUN_STANDBY_ROOM"  # etcdrun.agent.standby.pool's: only a waiting standby has it


def _launchers():
    from bench.launchers import LAUNCHERS

    tuned = LAUNCHERS["etcdrun-tuned"]
    return [
        tuned.with_env("etcdrun-spawn", "etcdrun (--prewarm none)", PET_PREWARM="none"),
        tuned.with_env("etcdrun-standby", "etcdrun (--prewarm auto)", PET_PREWARM="auto"),
        LAUNCHERS["c10d-tuned"],
    ]


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f}) ×{len(values)}"


def _record(row: dict, trial) -> None:
    if trial.value is None:
        row["other"].append(f"{trial.outcome}: {trial.note}")
        return
    row["ready"].append(round(trial.value, 3))
    if trial.spawn is not None:
        row["running"].append(round(trial.spawn, 3))


def run_scenarios(args: argparse.Namespace, out: Path, tag: str) -> dict:
    from bench import scenarios as sc

    ctx = sc.Ctx(bindir=compare.VENV / "bin", out=out, tag=tag, recover_timeout=args.timeout)
    cases = {
        "kill -9 of a node (lease_ttl=2)": lambda la, nm: sc.kill_node(
            ctx, la, args.n, "member", "allreduce", nm
        ),
        f"scale-up {args.n - 1} -> {args.n}": lambda la, nm: sc.scale_up(ctx, la, args.n, nm),
    }
    results: dict = {}
    for case, fn in cases.items():
        rows = results.setdefault(case, {})
        for i in range(args.trials):
            for la in _launchers():
                trial = fn(la, f"standby-{len(rows)}-{la.key}-{i}")
                _record(rows.setdefault(la.label, {"ready": [], "running": [], "other": []}), trial)
                print(
                    f"  [{case}] {la.label} {i + 1}/{args.trials}: ready {trial.value} "
                    f"running {trial.spawn} {trial.note} (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    return results


def _waiting_standbys(parent: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != parent:
                continue
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(kv.startswith(ROOM_VAR.encode() + b"=") for kv in env):
            found.append(int(name))
    return found


def _settled_standby(agent_pid: int, deadline: float) -> tuple[int, float] | None:
    """A standby still waiting once its imports are done, and how long they took to settle.

    Why re-check that it still waits: the node's first standby is handed the first round
    while it imports, and then it is the worker (gloo's loop thread, the script's sleeps use a
    little CPU: an earlier version measured that by mistake, bench/results/standby_bench.md, 'What a
    waiting standby costs'); the one to measure is the refill started at that hand-over.
    """
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        pids = _waiting_standbys(agent_pid)
        if not pids:
            time.sleep(0.2)
            continue
        pid, before = pids[0], -1.0
        while time.monotonic() < deadline and pid in _waiting_standbys(agent_pid):
            time.sleep(1.0)  # importing torch: until its CPU time stands still
            now = cpu_seconds(pid)
            if now == before:
                return pid, time.monotonic() - t0
            before = now
    return None


def standby_cost(args: argparse.Namespace) -> dict:
    """One agent, one slot, --prewarm auto: the standby that waits beside the running worker."""
    etcdrun = str(compare.VENV / "bin" / "etcdrun")
    worker = str(HERE / "compare_worker.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    agent = subprocess.Popen(
        [etcdrun, "--standalone", "--prewarm", "auto", worker, "idle"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        found = _settled_standby(agent.pid, time.monotonic() + 120)
        if found is None:
            return {"error": "no waiting standby seen"}
        pid, warm_s = found
        rss, pss = proc_kb(pid, "VmRSS"), proc_kb(pid, "Pss", "smaps_rollup")
        if rss is None or pss is None:
            return {"error": "the standby ended before its memory was read"}
        c0, w0 = cpu_seconds(pid), time.monotonic()
        time.sleep(args.idle_window)
        idle = (cpu_seconds(pid) - c0) / (time.monotonic() - w0)
        if pid not in _waiting_standbys(agent.pid):
            return {"error": "the standby measured was handed a round during the window"}
        return {
            "rss_mb": rss / 1024,
            "pss_mb": pss / 1024,
            "idle_cpu_pct": 100 * idle,
            "idle_window_s": args.idle_window,
            "import_settled_s": round(warm_s, 1),
        }
    finally:
        agent.terminate()
        agent.wait(60)


def main() -> int:
    compare.ensure_venv()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--n", type=int, default=4, help="agents (scale-up: n-1 -> n)")
    ap.add_argument("--timeout", type=float, default=75.0)
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--skip-scenarios", action="store_true")
    args = ap.parse_args()
    out = HERE / "out" / f"standby-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results = {"load1_start": os.getloadavg()[0], "cpus": os.cpu_count()}
    if not args.skip_scenarios:
        results["scenarios"] = run_scenarios(args, out, uuid.uuid4().hex)
    results["standby"] = standby_cost(args)
    results["load1_end"] = os.getloadavg()[0]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    for case, rows in results.get("scenarios", {}).items():
        print(f"\n{case}: ready | running")
        for label, row in rows.items():
            extra = f"  ({'; '.join(row['other'])})" if row["other"] else ""
            print(f"  {label}: {_cell(row['ready'])} | {_cell(row['running'])}{extra}")
    print(f"\none waiting standby (torch imported): {json.dumps(results['standby'])}")
    print(f"load {results['load1_start']:.1f} -> {results['load1_end']:.1f}; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
