"""The plan of bench/compare.py: which scenario runs with which launchers, how many trials.

Why fewer trials for torchrun's default settings: each of those trials waits out torchrun's own
timers (a 30 s last call, a ~40 s recovery, a 60 s deadlock), so three of each would double the
run for no new information; ``--slow-trials`` sets them. Runs expected never to recover (torchrun
with workers that never talk) get one trial with ``--never-timeout``: the point is to show it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from bench import scenarios as sc
from bench.launchers import ETCDRUN, LAUNCHERS, TORCHRUN, Launcher
from bench.procs import TAG_VAR, become_subreaper, sweep

ALL = ("1", "1s", "2", "3", "3i", "4", "5", "6", "7", "8")
ALL_SIX = ("etcdrun", "c10d", "etcd-v2", "etcdrun-tuned", "c10d-tuned", "etcd-v2-tuned")
PLUGIN = ("etcd-v3", "etcd-v3-tuned")  # torchrun + etcd-v3: plain torchrun on our rendezvous


def _trials(args: argparse.Namespace, launcher: Launcher) -> int:
    slow = launcher.kind == TORCHRUN and not launcher.tuned and launcher.backend != "etcd-v3"
    return args.slow_trials if slow else args.trials


def _fmt(t: sc.Trial, unit: str = "s") -> str:
    if t.value is None:
        return f"{t.outcome.upper()}: {t.note}"
    note = f" [{t.note}]" if t.note else ""
    if t.spawn is not None:
        return f"running {t.spawn:.2f} s, ready {t.value:.2f} s{note}"
    return f"{t.value:.2f} {unit}{note}"


def _series(
    runs: list[dict],
    ctx: sc.Ctx,
    scenario: str,
    setting: str,
    launcher: Launcher,
    trials: int,
    fn: Callable[[sc.Ctx, Launcher, str], sc.Trial],
    unit: str = "s",
    **meta: object,
) -> None:
    rec = {
        "scenario": scenario,
        "setting": setting,
        "launcher": launcher.key,
        "label": launcher.label,
        "kind": launcher.kind,
        "backend": launcher.backend,
        "tuned": launcher.tuned,
        "unit": unit,
        "trials": [],
        **meta,
    }
    runs.append(rec)
    for i in range(trials):
        name = f"s{scenario}-{setting}-{launcher.key}-{i + 1}"
        t0 = time.monotonic()
        try:
            trial = fn(ctx, launcher, name)
        except Exception as exc:  # a harness error in one trial must not lose the others
            trial = sc.Trial(None, "error", f"{type(exc).__name__}: {exc}")
            sweep(ctx.tag)
        rec["trials"].append({**trial.to_json(), "load1": round(os.getloadavg()[0], 2)})
        print(
            f"  [{scenario} {setting}] {launcher.label} {i + 1}/{trials}: {_fmt(trial, unit)}"
            f"  ({time.monotonic() - t0:.0f}s, load {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def _scale(args: argparse.Namespace, out: Path, tag: str) -> dict:
    """Scenario 7: bench/rendezvous_scale.py, unchanged; its JSON is what we report.

    Run as ``python -m bench.rendezvous_scale`` from the repository root, where ``bench`` is.
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "rendezvous_scale.py").exists():
        return {"error": "bench/rendezvous_scale.py is missing"}
    path = out / "rendezvous_scale.json"
    cmd = [sys.executable, "-m", "bench.rendezvous_scale", "--n", args.scale_n, "--json", str(path)]
    print(f"  [7] {' '.join(cmd[1:])}", flush=True)
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, TAG_VAR: tag},
            cwd=root,
        )  # its etcd and workers: swept
    except subprocess.TimeoutExpired:
        return {"error": "rendezvous_scale.py did not finish within 900 s"}
    (out / "rendezvous_scale.txt").write_text(p.stdout + p.stderr)
    if not path.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"rendezvous_scale.py exited {p.returncode}: {tail[0]}"}
    rows = []
    for r in json.loads(path.read_text()):
        for rnd in ("round1", "round2"):
            x = r.get(rnd) or {}
            rows.append(
                {
                    "n": r["n"],
                    "round": rnd,
                    "time": x.get("time"),
                    "writes": x.get("writes"),
                    "watch_events": x.get("watch_events"),
                    "problems": r.get("problems", []) + x.get("problems", []),
                }
            )
    print(
        "  [7] "
        + "; ".join(f"N={x['n']} {x['round']}: {x['time']} s, {x['writes']} writes" for x in rows),
        flush=True,
    )
    return {"rows": rows, "exit_code": p.returncode}


@dataclass
class _Plan:
    """What every scenario's series needs: the options, the two contexts, the runs so far."""

    args: argparse.Namespace
    ctx: sc.Ctx
    never: sc.Ctx  # for runs expected never to recover: one trial, --never-timeout
    out: Path
    tag: str
    runs: list[dict] = field(default_factory=list)
    help_out: dict = field(default_factory=dict)
    scale_out: dict = field(default_factory=dict)

    def series(self, scenario: str, k: str, trials: int, fn, **kw: object) -> None:
        la = LAUNCHERS[k]
        setting = "tuned" if la.tuned else "default"
        _series(self.runs, self.ctx, scenario, setting, la, trials, fn, **kw)


def _first_round(plan: _Plan, s: str) -> None:
    a = plan.args
    for k in ("etcdrun", "c10d", "etcd-v2", "etcd-v3"):
        plan.series(
            s,
            k,
            a.trials,
            lambda c, la, nm: sc.first_round(c, la, a.n_first, a.n_first, nm, stagger=s == "1s"),
            n=a.n_first,
        )


def _double(plan: _Plan, s: str) -> None:
    n = plan.args.n
    for k in ALL_SIX + PLUGIN:
        trials = _trials(plan.args, LAUNCHERS[k])
        plan.series("2", k, trials, lambda c, la, nm: sc.first_round(c, la, n, 2 * n, nm), n=n)


def _kill(plan: _Plan, s: str) -> None:
    n, which = plan.args.n, "rank0" if s == "4" else "member"
    mode = "idle" if s == "3i" else "allreduce"
    keys = ("etcdrun", "etcdrun-tuned", "c10d-tuned") if s == "3i" else ALL_SIX
    for k in keys + PLUGIN:
        la = LAUNCHERS[k]
        c, trials = plan.ctx, _trials(plan.args, la)
        if s == "3i" and la.kind == TORCHRUN and la.backend != "etcd-v3":
            c, trials = plan.never, 1
        setting = "tuned" if la.tuned else "default"
        fn = lambda c, la, nm, w=which, m=mode: sc.kill_node(c, la, n, w, m, nm)  # noqa: E731
        _series(plan.runs, c, s, setting, la, trials, fn, n=n)


def _scale_up(plan: _Plan, s: str) -> None:
    n = plan.args.n
    for k in ALL_SIX + PLUGIN:
        trials = _trials(plan.args, LAUNCHERS[k])
        plan.series("5", k, trials, lambda c, la, nm: sc.scale_up(c, la, n, nm), n=n)


def _help_and_rss(plan: _Plan, s: str) -> None:
    n = plan.args.n
    plan.help_out = sc.help_times(plan.ctx.bindir, [ETCDRUN, TORCHRUN], 7)
    print(
        "  [6] --help: "
        + ", ".join(f"{k} {sorted(v)[len(v) // 2]:.3f} s" for k, v in plan.help_out.items())
    )
    for k in ("etcdrun", "c10d", "etcd-v2", "etcd-v3"):
        fn = lambda c, la, nm: sc.agent_rss(c, la, n, nm)  # noqa: E731
        plan.series("6", k, plan.args.trials, fn, unit="MB", n=n)


def _rendezvous_scale(plan: _Plan, s: str) -> None:
    plan.scale_out = _scale(plan.args, plan.out, plan.tag)


def _idle(plan: _Plan, s: str) -> None:
    n = plan.args.n
    for k in ("etcdrun", "etcdrun-tuned", "etcd-v2", "etcd-v2-tuned", *PLUGIN):
        fn = lambda c, la, nm: sc.idle_requests(c, la, n, nm)  # noqa: E731
        plan.series("8", k, 2, fn, unit="req/s", n=n)


SCENARIOS: dict[str, Callable[[_Plan, str], None]] = {
    "1": _first_round,
    "1s": _first_round,
    "2": _double,
    "3": _kill,
    "3i": _kill,
    "4": _kill,
    "5": _scale_up,
    "6": _help_and_rss,
    "7": _rendezvous_scale,
    "8": _idle,
}


def _meta(args: argparse.Namespace, only: list[str], load: float, load_ok: bool) -> dict:
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "etcdrun": version("etcdrun"),
        "n": args.n,
        "n_first": args.n_first,
        "trials": args.trials,
        "slow_trials": args.slow_trials,
        "scenarios": only,
        "load_before": round(load, 2),
        "load_waited_ok": load_ok,
        "load_limit": args.wait_load,
        "complete": set(only) == set(ALL),
    }


def _plan(args: argparse.Namespace, out: Path, tag: str) -> _Plan:
    def ctx(timeout: float) -> sc.Ctx:
        return sc.Ctx(
            bindir=Path(sys.executable).parent,
            out=out,
            tag=tag,
            recover_timeout=timeout,
            idle_window=args.idle_window,
            verbose=args.verbose,
        )

    return _Plan(args, ctx(args.timeout), ctx(args.never_timeout), out, tag)


def run_all(args: argparse.Namespace, out: Path, tag: str, load: float, load_ok: bool) -> dict:
    become_subreaper()
    only = [s.strip() for s in args.only.split(",") if s.strip()] or list(ALL)
    bad = sorted(set(only) - set(ALL))
    if bad:
        raise SystemExit(
            f"compare.py: unknown scenario(s) {', '.join(bad)} (known: {', '.join(ALL)})"
        )
    plan = _plan(args, out, tag)
    meta = _meta(args, only, load, load_ok)
    started = time.monotonic()
    # Warm the page cache (torch's shared libraries) so the first trial is not the odd one out.
    subprocess.run([str(plan.ctx.bindir / "python"), "-c", "import torch"], check=False)
    try:
        for s in only:
            print(f"scenario {s}", flush=True)
            SCENARIOS[s](plan, s)
    finally:
        left = sweep(tag)
    meta.update(
        {
            "duration_s": round(time.monotonic() - started),
            "load_after": round(os.getloadavg()[0], 2),
            "leftover_processes": len(left),
        }
    )
    return {"meta": meta, "runs": plan.runs, "help": plan.help_out, "scale": plan.scale_out}
