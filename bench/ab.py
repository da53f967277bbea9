#!/usr/bin/env python3
"""etcdrun against an older etcdrun, trial by trial: ``python -m bench.ab --before DIR``.

Why a bench of its own: "status, metrics and events cost nothing on the hot path" (issue 13) is
a claim about the difference between two versions of etcdrun, and on a shared machine the load
moves more between two runs of bench/compare.py than 10%. Here both versions run the same
scenarios (bench/scenarios.py, the same worker, the same torch) in one process, alternating
ABBA round after round, so that a drift in load falls on both alike; each side's figure is its
median, and the ratio after/before is printed per scenario with the load average seen.

``--before DIR``: a checkout of the older version whose own ``bench/.venv-torch`` exists (run its
``python -m bench.compare --help`` once to make it; ``python bench/compare.py --help`` in a
checkout from before bench/ was a package). The newer side is this checkout, installed into
this checkout's bench venv (bench/compare.py's ``ensure_venv``). Scenarios: ``1s`` (first
round N=8, the last agent after the others wait), ``3`` (kill -9 of a member, N=4), ``5``
(scale-up 3 -> 4), ``8`` (idle etcd requests per agent); ``--rounds`` ABBA rounds (default 2:
4 trials a side). ``--prewarm none`` runs both sides with standby workers off (the question
"did this change cost anything" asked of the spawn path alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import compare

SCENARIOS = ("1s", "3", "5", "8")


def _run(sc, ctx, launcher, scenario: str, name: str):
    if scenario == "1s":
        return sc.first_round(ctx, launcher, 8, 8, name, stagger=True)
    if scenario == "3":
        return sc.kill_node(ctx, launcher, 4, "member", "allreduce", name)
    if scenario == "5":
        return sc.scale_up(ctx, launcher, 4, name)
    return sc.idle_requests(ctx, launcher, 4, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="", help="older checkout with its bench/.venv-torch")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds: 2 trials a side each")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma list of 1s,3,5,8")
    ap.add_argument(
        "--prewarm",
        default="",
        help="PET_PREWARM for both sides (e.g. none: compare with standby workers off; a side"
        " older than standby workers ignores it); default: each side's own default",
    )
    ap.add_argument("--json", help="write every trial here")
    ap.add_argument("--report", metavar="JSON", help="only print the table of a saved run")
    args = ap.parse_args()
    if args.report:
        try:
            print(_table(json.loads(Path(args.report).read_text())))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"ab: cannot read {args.report} as a saved run: {e}")
            return 2
        return 0
    if not args.before:
        ap.error("--before DIR is required (or --report JSON)")
    before_bin = Path(args.before).resolve() / "bench" / ".venv-torch" / "bin"
    if not (before_bin / "etcdrun").exists():
        print(
            f"ab: no etcdrun in {before_bin}: run `python -m bench.compare --help` there once",
            flush=True,
        )
        return 2
    compare.ensure_venv()  # re-executes under this checkout's bench venv, this checkout installed
    from bench import scenarios as sc
    from bench.launchers import LAUNCHERS
    from bench.procs import become_subreaper

    become_subreaper()
    launcher = LAUNCHERS["etcdrun"]
    if args.prewarm:
        launcher = launcher.with_env("etcdrun", launcher.label, PET_PREWARM=args.prewarm)
    sides = {"before": before_bin, "after": Path(sys.executable).parent}
    only = [s for s in args.only.split(",") if s]
    out = Path(tempfile.mkdtemp(prefix="etcdrun-ab-"))
    tag = "ab-" + uuid.uuid4().hex[:6]
    got: dict[str, dict[str, list]] = {s: {"before": [], "after": []} for s in only}
    for r in range(args.rounds):
        order = ("before", "after", "after", "before") if r % 2 == 0 else ("after", "before") * 2
        for scenario in only:
            for i, side in enumerate(order):
                ctx = sc.Ctx(bindir=sides[side], out=out, tag=tag, recover_timeout=90.0)
                trial = _run(sc, ctx, launcher, scenario, f"{scenario}-{side}-{r}-{i}")
                load = os.getloadavg()[0]
                got[scenario][side].append({**trial.to_json(), "load1": round(load, 2)})
                shown = "-" if trial.value is None else f"{trial.value:.3f}"
                print(
                    f"  [{scenario}] {side}: {shown} ({trial.outcome}, load {load:.1f})", flush=True
                )
    print(_table(got))
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


def _median(trials: list, pick) -> float | None:
    vals = [v for v in (pick(t) for t in trials) if v is not None]
    return statistics.median(vals) if vals else None


# what each row compares: the users' figure (ready), the launcher's own (running: every worker
# started with the new world), and the agent's CPU where the scenario reads it
MEASURES = (
    ("ready", "s", lambda t: t["value"]),
    ("running", "s", lambda t: t["spawn"]),
    ("agent CPU", "s", lambda t: t.get("extra", {}).get("agent_cpu_s")),
)


def _cell(median: float | None, trials: list, pick, unit: str) -> str:
    """The median, and the spread it comes from (so a ratio can be judged against it)."""
    vals = [v for v in (pick(t) for t in trials) if v is not None]
    if median is None or not vals:
        return "-"
    return f"{median:.3f} {unit} ({min(vals):.3f}-{max(vals):.3f})".replace("  ", " ")


def _table(got: dict[str, dict[str, list]]) -> str:
    head = (
        "scenario | measure | before: median (range) | after: median (range) | after/before | loads"
    )
    lines = [head, "---|---|---|---|---|---"]
    for scenario, by in got.items():
        loads = [t["load1"] for ts in by.values() for t in ts] or [0.0]
        span = f"{min(loads):.1f}-{max(loads):.1f}"
        measures = (("requests/s/agent", "", MEASURES[0][2]),) if scenario == "8" else MEASURES
        for what, unit, pick in measures:
            b, a = _median(by["before"], pick), _median(by["after"], pick)
            if a is None and b is None:
                continue
            ratio = f"{a / b:.2f}" if a and b else "-"
            cells = [
                _cell(v, trials, pick, unit) for v, trials in ((b, by["before"]), (a, by["after"]))
            ]
            lines.append(f"{scenario} | {what} | {cells[0]} | {cells[1]} | {ratio} | {span}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    t0 = time.monotonic()
    rc = main()
    print(f"ab: {time.monotonic() - t0:.0f} s", flush=True)
    sys.exit(rc)
