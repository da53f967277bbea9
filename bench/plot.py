"""bench/recovery.png: recovery and scale-up times of etcdrun and torchrun, from one run.

Why bars with whiskers: medians with min–max over the trials show both the figure and how much
it moved. Each bar is two: solid up to "workers running" (the launcher's job), light up to
"workers ready" (the workers' own start-up added). A run that never recovered is drawn as a
hatched bar up to its timeout and labelled "never"; a job that died is a cross labelled "job died" —
both are results, not gaps.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GROUPS = (
    ("3", "default", "3. kill -9 node\n(default)"),
    ("3", "tuned", "3. kill -9 node\n(tuned)"),
    ("3i", "default", "3'. kill, idle workers\n(default)"),
    ("3i", "tuned", "3'. kill, idle workers\n(tuned)"),
    ("4", "default", "4. kill -9 rank 0\n(default)"),
    ("4", "tuned", "4. kill -9 rank 0\n(tuned)"),
    ("5", "default", "5. scale-up\n(default)"),
    ("5", "tuned", "5. scale-up\n(tuned)"),
)
SERIES = (
    ("etcdrun", "etcdrun", "#1f77b4"),
    ("c10d", "torchrun c10d", "#d62728"),
    ("etcd-v2", "torchrun etcd-v2", "#ff7f0e"),
    ("etcd-v3", "torchrun + etcd-v3", "#2ca02c"),
)


def _col(run: dict) -> str:
    return "etcdrun" if run["kind"] == "etcdrun" else run["backend"]


def _find(runs: list[dict], scenario: str, setting: str, col: str) -> dict | None:
    return next(
        (
            r
            for r in runs
            if r["scenario"] == scenario and r["setting"] == setting and _col(r) == col
        ),
        None,
    )


def _bar(ax, y: float, h: float, color: str, values: list[float], **kw) -> float:
    """A bar to the median of ``values`` with min–max whiskers; returns the median."""
    med = statistics.median(values)
    ax.barh(
        y,
        med,
        h * 0.9,
        color=color,
        xerr=[[med - min(values)], [max(values) - med]],
        capsize=2,
        **kw,
    )
    return med


def _draw_recovered(ax, y: float, h: float, color: str, trials: list[dict]) -> bool:
    """The light "ready" bar and the solid "running" bar; False when no trial recovered."""
    ok = [t for t in trials if t["value"] is not None]
    ready = [t["value"] for t in ok]
    running = [t["spawn"] for t in ok if t.get("spawn") is not None]
    if not ready:
        return False
    med = _bar(ax, y, h, color, ready, alpha=0.3, error_kw={"alpha": 0.4})
    label = f"ready {med:.1f} s"
    if running:
        label = f"running {_bar(ax, y, h, color, running):.1f} s, {label}"
    ax.text(max(ready) + 0.5, y, label, va="center", fontsize=7)
    return True


def _draw_unrecovered(ax, y: float, h: float, color: str, trials: list[dict]) -> None:
    """Never recovered: a hatched bar to the timeout. Died (or else): a cross where it ended."""
    t0 = trials[0]
    if t0["outcome"] == "never":
        m = re.search(r"timeout (\d+)s", t0["note"])
        to = float(m.group(1)) if m else 60.0
        ax.barh(y, to, h * 0.9, color="white", edgecolor=color, hatch="//")
        ax.text(to + 0.3, y, f"never (>{to:.0f} s)", va="center", fontsize=7)
        return
    afters = [(t.get("extra") or {}).get("after") for t in trials]
    after = max((a for a in afters if a is not None), default=0.0)  # as the table
    ax.plot([after], [y], marker="x", color=color, markersize=8)
    text = f"job died ({after:.1f} s)" if t0["outcome"] == "died" else t0["outcome"]
    ax.text(after + 0.6, y, text, va="center", fontsize=7)


def _decorate(ax, groups: list[tuple], meta: dict) -> None:
    ax.set_xlim(0, ax.get_xlim()[1] * 1.15)  # room for the labels right of the bars
    ax.set_yticks(range(len(groups)), [g[2] for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(
        "seconds until every worker runs again (solid) and is past init_process_group "
        "(light); median, min–max; lower is better"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, _, c in SERIES]
    ax.legend(handles, [lb for _, lb, _ in SERIES], loc="lower right", fontsize=8)
    ax.set_title(
        f"etcdrun vs torchrun {meta['torch'].split('+')[0]}: N = {meta['n']} local agents, "
        f"{meta['date'][:10]}, 1-min load {meta['load_before']}",
        fontsize=9,
    )
    ax.grid(axis="x", alpha=0.3)


def recovery_plot(res: dict, path: Path) -> None:
    runs = res["runs"]
    groups = [
        g for g in GROUPS if any(r["scenario"] == g[0] and r["setting"] == g[1] for r in runs)
    ]
    fig, ax = plt.subplots(figsize=(10, 0.9 * max(len(groups), 2) + 1.5))
    h = 0.8 / len(SERIES)
    for gi, (s, setting, _) in enumerate(groups):
        for si, (col, _, color) in enumerate(SERIES):
            run = _find(runs, s, setting, col)
            if run is None:
                continue
            y = gi + (si - (len(SERIES) - 1) / 2) * h
            if not _draw_recovered(ax, y, h, color, run["trials"]):
                _draw_unrecovered(ax, y, h, color, run["trials"])
    _decorate(ax, groups, res["meta"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
