#!/usr/bin/env python3
"""In place against restarts and torchft, in one run: ``python -m bench.in_place_compare``.

Issue 29's benchmark. Four columns train the same toy DDP job (bench/toy_job.py: a 132k
parameter model, a step every ~0.05 s, a checkpoint every 20 steps) on local nodes of one
worker each: etcdrun restarting its workers (today's default: they reload the checkpoint),
etcdrun in place (``etcdrun.elastic``), torchrun c10d (restart and reload) and torchft 0.2.0
(Lighthouse and Manager, ``ProcessGroupGloo``, its DDP and optimizer wrappers). Scenarios: a
node killed (-9) at defaults and tuned; a node frozen (SIGSTOP) past the TTL, the rank-0 node
killed and a newcomer (3 -> 4), tuned. Figures (bench/step_metrics.py): recovery, pause and
work lost, from each worker's step log. Trials of the columns alternate, so the machine's load
falls on all alike.

Each event comes at the same point of the job: ``SETTLE`` s after every node trains (etcdrun's
standbys have imported torch by then), at the middle of a checkpoint interval (step 10 of 20),
so a restart's lost work is comparable between columns.

Uses bench/compare.py's venv (torch 2.13 CPU; torchft must be installed there, see
docs/benchmarks.md). Writes bench/out/inplace-<time>/results.json and section.md, the markdown that
bench/results/in_place_compare.md's tables were made from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench import compare

HERE = Path(__file__).resolve().parent
PLAN = (
    ("kill", "default"),
    ("kill", "tuned"),
    ("kill", "tuned-hb"),
    ("sigstop", "tuned"),
    ("scale", "tuned"),
    ("rank0", "tuned"),
)
SETTLE = 5.0  # s of training before the event
FORM_TIMEOUT = 120.0
POLL = 0.05


@dataclass
class Ctx:
    bindir: Path
    out: Path
    tag: str
    recover_timeout: float


class Failed(Exception):
    def __init__(self, outcome: str, note: str) -> None:
        super().__init__(note)
        self.outcome, self.note = outcome, note


def _wait(cond, timeout: float, what: str, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if nodes and not any(a.alive() for a in nodes):
            raise Failed("died", f"every node exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise Failed("never", f"no {what} within {timeout:.0f} s")
        time.sleep(POLL)


def _training(cl, n: int, at_least: int) -> bool:
    from bench.step_metrics import steps

    recs = cl.records()
    return all(
        len([r for r in steps(recs, a.name) if r["w"] == n]) >= at_least for a in cl.nodes[:n]
    )


def _mid_interval(cl) -> None:
    """Until the newest step is 10 of its checkpoint interval of 20 (bounded)."""
    from bench.step_metrics import newest_step
    from bench.toy_job import CKPT_EVERY

    deadline = time.monotonic() + 10
    while newest_step(cl.records()) % CKPT_EVERY != CKPT_EVERY // 2:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _event(cl, scenario: str, n0: int) -> tuple[float, list[str], int, str]:
    """Do it; (when, the surviving nodes, the new world size, what was done)."""
    if scenario == "scale":
        survivors = [a.name for a in cl.nodes]
        return cl.start(1), survivors, n0 + 1, "a newcomer"
    victim, who = cl.victim("rank0" if scenario == "rank0" else "member")
    t = cl.freeze(victim) if scenario == "sigstop" else victim.kill_node()
    return t, [a.name for a in cl.nodes if a is not victim], n0 - 1, who


def trial(ctx: Ctx, col, scenario: str, name: str) -> dict:
    from bench.in_place_cluster import Cluster
    from bench.step_metrics import agent_figures, measure, newcomer_start, resumed

    n0 = 3 if scenario == "scale" else 4
    with Cluster(ctx, col, name) as cl:
        cl.start(n0)
        _wait(lambda: _training(cl, n0, 3), FORM_TIMEOUT, f"{n0} nodes training", cl.nodes)
        time.sleep(SETTLE)
        _mid_interval(cl)
        t, survivors, world, who = _event(cl, scenario, n0)
        alive = [a for a in cl.nodes if a.name in survivors]
        try:
            _wait(
                lambda: resumed(cl.records(), survivors, t, world),
                ctx.recover_timeout,
                f"step with world {world} on every survivor",
                alive,
            )
        except Failed as f:
            raise Failed(f.outcome, f"{who}: {f.note}") from None
        recs = cl.records()
        m = measure(recs, survivors, t, world)
        extra = {"t_event": t, **agent_figures(cl.events(survivors), t)}
        if scenario == "scale":  # where the stall goes
            extra |= newcomer_start(recs, cl.nodes[-1].name, t, t + m.recovery_s - m.pause_s)
        return {"outcome": "ok", "note": who, **m.to_json(), **extra}


def _run_trial(ctx: Ctx, col, scenario: str, name: str) -> dict:
    from bench.procs import sweep

    try:
        out = trial(ctx, col, scenario, name)
    except Failed as f:
        out = {"outcome": f.outcome, "note": f.note}
    except Exception as exc:  # one harness error must not lose the other trials
        out = {"outcome": "error", "note": f"{type(exc).__name__}: {exc}"}
        sweep(ctx.tag)
    return {**out, "load1": round(os.getloadavg()[0], 2)}


def _slow(col, scenario: str, setting: str) -> bool:
    """torchrun where it waits out its own timers (defaults; a frozen peer; its store host)."""
    return col.key == "torchrun" and (setting == "default" or scenario in ("sigstop", "rank0"))


def run(args: argparse.Namespace, out: Path) -> dict:
    from bench.in_place_cluster import columns

    ctx = Ctx(compare.VENV / "bin", out, uuid.uuid4().hex, args.timeout)
    plan = [p for p in PLAN if not args.only or p[0] in args.only.split(",")]
    res = {"series": [], "meta": {"cpus": os.cpu_count(), "settings": {}}}
    res["meta"]["load_before"] = round(os.getloadavg()[0], 2)
    t0 = time.monotonic()
    for scenario, setting in plan:
        cols = [c for c in columns(setting) if not args.columns or c.key in args.columns]
        series = []
        for c in cols:
            res["meta"]["settings"][f"{c.label}, {setting}"] = c.describe()
            s = {"scenario": scenario, "setting": setting, "column": c.key, "label": c.label}
            series.append((c, {**s, "trials": []}))
        res["series"] += [s for _, s in series]
        for i in range(args.trials):
            for c, s in series:
                if i >= (args.slow_trials if _slow(c, scenario, setting) else args.trials):
                    continue
                name = f"{scenario}-{setting}-{c.key}-{i + 1}"
                tr = _run_trial(ctx, c, scenario, name)
                s["trials"].append(tr)
                print(f"  [{name}] {json.dumps(tr)}", flush=True)
    res["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    res["meta"]["duration_s"] = round(time.monotonic() - t0)
    return res


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--slow-trials", type=int, default=1, help="torchrun where it waits out its timers"
    )
    ap.add_argument("--only", default="", help="scenarios: kill,sigstop,scale,rank0")
    ap.add_argument(
        "--columns", default="", help="etcdrun-restart,etcdrun-inplace,torchrun,torchft"
    )
    ap.add_argument("--timeout", type=float, default=90.0, help="bound on one recovery, s")
    ap.add_argument("--wait-load", type=float, default=compare.LOAD_MAX)
    ap.add_argument("--max-wait", type=float, default=600.0)
    ap.add_argument("--report", metavar="JSON", help="only rebuild the report from a saved run")
    return ap.parse_args(argv)


def main() -> int:
    compare.ensure_venv()
    args = parse_args(sys.argv[1:])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, compare._interrupt)
    from bench.in_place_report import markdown

    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("torchft missing: bench/.venv-torch/bin/pip install torchft==0.2.0", file=sys.stderr)
        return 2
    from bench.procs import become_subreaper

    become_subreaper()
    out = HERE / "out" / f"inplace-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    load, _ = compare.wait_for_load(args.wait_load, args.max_wait)
    print(f"1-min load {load:.2f}; out: {out}", flush=True)
    try:
        res = run(args, out)
    except KeyboardInterrupt:
        print("in_place_compare: interrupted; every process it started is gone", file=sys.stderr)
        return 130
    (out / "results.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (out / "section.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
