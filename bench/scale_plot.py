#!/usr/bin/env python3
"""The shape of bench/rendezvous_scale.py's curve: power-law fits of round time vs N, and a plot.

Why: L5 (design.md) promises O(N) per round; a table of four N cannot show whether the cost grows
as N or as N^2 on the way to 4096 or 8192. The fit is least squares of log(time) on log(N) over
N >= 100 (below that a round is a few ms of fixed round trips, not per-node work), so the
exponent b in time ~ a * N^b says it: 1 is linear, 2 quadratic. Each step's local exponent
(between adjacent N) shows where it bends. Only rounds whose simulation kept up are points.
The plot is hand-built SVG: no plotting library is a dependency.

Usage: ``python -m bench.scale_plot RESULTS.json [MORE.json ...] --svg bench/rendezvous_scale.svg``
(the JSON of ``rendezvous_scale.py --json``; several files are merged, a later one winning for
the same N, cluster size and round).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

FIT_FROM = 100
ROUNDS = {"round1": "join", "round2": "one leaves"}
COLORS = {("round1", 1): "#1f77b4", ("round1", 3): "#d62728", ("round2", 1): "#7fb3e0"}
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 460, 70, 230, 30, 50


def series(results: list[dict]) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(round, members) -> sorted (N, time) points that have a time, from rounds whose
    simulation kept up (scale_keepalive.py; results from before that rule count).
    """
    got: dict[tuple[str, int], dict[int, float]] = {}
    for res in results:
        for name in ROUNDS:
            r = res.get(name) or {}
            t, valid = r.get("time"), r.get("keepalive", {}).get("kept_up", True)
            if t is not None and t > 0 and valid:
                got.setdefault((name, res.get("members", 1)), {})[res["n"]] = t
    return {k: sorted(v.items()) for k, v in sorted(got.items())}


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of time = a * N^b, least squares in log-log over N >= FIT_FROM; None under 2."""
    xs = [(math.log(n), math.log(t)) for n, t in points if n >= FIT_FROM]
    if len(xs) < 2:
        return None
    mx = sum(x for x, _ in xs) / len(xs)
    my = sum(y for _, y in xs) / len(xs)
    sxx = sum((x - mx) ** 2 for x, _ in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in xs) / sxx
    return math.exp(my - b * mx), b


def local_exponents(points: list[tuple[int, float]]) -> list[tuple[int, int, float]]:
    """(N1, N2, b) between adjacent points: log(t2/t1) / log(N2/N1)."""
    return [
        (n1, n2, math.log(t2 / t1) / math.log(n2 / n1))
        for (n1, t1), (n2, t2) in zip(points, points[1:], strict=False)
    ]


def shape(b: float) -> str:
    if b < 1.25:
        return "about O(N)"
    if b < 1.75:
        return "worse than O(N), better than O(N^2)"
    return "about O(N^2) or worse"


def fit_lines(results: list[dict]) -> list[str]:
    out = []
    for (name, m), pts in series(results).items():
        f = fit(pts)
        if f is None:
            continue
        steps = ", ".join(f"{n1}->{n2}: {b:.2f}" for n1, n2, b in local_exponents(pts))
        out.append(
            f"fit {ROUNDS[name]} round, {m} member(s): time = {f[0]:.3g} * N^{f[1]:.2f} over "
            f"N >= {FIT_FROM} ({shape(f[1])}); local exponents {steps}"
        )
    return out


def failed(results: list[dict]) -> list[tuple[int, int]]:
    """(N, members) of the runs whose join round never came: shown on the plot, not left out."""
    return sorted(
        {
            (r["n"], r.get("members", 1))
            for r in results
            if (r.get("round1") or {}).get("time") is None
        }
    )


def _axes(pts: list[tuple[int, float]], more_ns: list[int]) -> tuple[float, float, float, float]:
    ns = [n for n, _ in pts] + more_ns
    ts = [t for _, t in pts] + [2.0, 4.0]  # the targets stay in view
    return (
        math.log10(min(ns)),
        math.log10(max(ns)),
        math.floor(math.log10(min(ts))),
        math.ceil(math.log10(max(ts))),
    )


def svg(results: list[dict], title: str = "rendezvous round time vs N") -> str:
    """A log-log plot: every series' points, its fitted line (dashed), the N=4096 targets."""
    ss = series(results)
    every = [p for pts in ss.values() for p in pts]
    if not every:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}"></svg>\n'
    bad = failed(results)
    x0, x1, y0, y1 = _axes(every, [n for n, _ in bad])
    x1 = max(x1, x0 + 1e-9)

    def px(n: float) -> float:
        return LEFT + (math.log10(n) - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def py(t: float) -> float:
        return H - BOTTOM - (math.log10(t) - y0) / (y1 - y0) * (H - TOP - BOTTOM)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="14">{title}</text>',
    ]
    out += _grid(every, bad, y0, y1, px, py)
    out += _targets(px, py)
    for i, (n, m) in enumerate(bad):
        x, y = px(n), TOP + 14 + 16 * i
        out.append(
            f'<text x="{x:.1f}" y="{y}" text-anchor="end" fill="#b00">x no join round '
            f"(N={n}, {m} member{'s' if m > 1 else ''})</text>"
        )
    for i, ((name, m), pts) in enumerate(ss.items()):
        out += _series(name, m, pts, i, px, py)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _grid(every: list, failed_ns: list, y0: float, y1: float, px, py) -> list[str]:
    out = []
    for n in sorted({n for n, _ in every} | {n for n, _ in failed_ns}):
        x = px(n)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{n}</text>')
    for e in range(int(y0), int(y1) + 1):
        y = py(10.0**e)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{10.0**e:g}</text>')
    out.append(
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">'
        f"N (participants, log scale)</text>"
    )
    out.append(
        f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">round time, s (log scale)</text>'
    )
    return out


def _targets(px, py) -> list[str]:
    out = []
    for t, label in ((2.0, "target, 1 member"), (4.0, "target, 3 members")):
        x, y = px(4096), py(t)
        out.append(
            f'<line x1="{x - 18:.1f}" y1="{y:.1f}" x2="{x + 6:.1f}" y2="{y:.1f}" '
            f'stroke="black" stroke-width="2"/>'
        )
        out.append(f'<text x="{x - 22:.1f}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    return out


def _series(name: str, m: int, pts: list, i: int, px, py) -> list[str]:
    color = COLORS.get((name, m), "#2ca02c" if name == "round1" else "#f4a582")
    out = []
    for n, t in pts:
        shapes = (
            f'<circle cx="{px(n):.1f}" cy="{py(t):.1f}" r="4" fill="{color}"/>'
            if name == "round1"
            else f'<rect x="{px(n) - 4:.1f}" y="{py(t) - 4:.1f}" width="8" height="8" '
            f'fill="{color}"/>'
        )
        out.append(shapes)
    f = fit(pts)
    label = f"{ROUNDS[name]}, {m} member{'s' if m > 1 else ''}"
    if f is not None:
        lo = min(n for n, _ in pts if n >= FIT_FROM)
        hi = max(n for n, _ in pts)
        a, b = f
        out.append(
            f'<line x1="{px(lo):.1f}" y1="{py(a * lo**b):.1f}" x2="{px(hi):.1f}" '
            f'y2="{py(a * hi**b):.1f}" stroke="{color}" stroke-dasharray="5,3"/>'
        )
        label += f": ~N^{b:.2f}"
    y = TOP + 14 + 20 * i
    out.append(f'<circle cx="{W - RIGHT + 16}" cy="{y - 4}" r="4" fill="{color}"/>')
    out.append(f'<text x="{W - RIGHT + 26}" y="{y}">{label}</text>')
    return out


def write_svg(results: list[dict], path: str) -> None:
    with open(path, "w") as f:
        f.write(svg(results))


def merge(files: list[str]) -> list[dict]:
    """Results of several runs; a later file wins for the same (N, members)."""
    got: dict[tuple[int, int], dict] = {}
    for path in files:
        with open(path) as f:
            for res in json.load(f):
                got[(res["n"], res.get("members", 1))] = res
    return [got[k] for k in sorted(got, key=lambda k: (k[1], k[0]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="rendezvous_scale.py --json files")
    ap.add_argument("--svg", required=True, help="where to write the plot")
    args = ap.parse_args(argv)
    try:
        results = merge(args.json)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"cannot read the results: {e}", file=sys.stderr)
        return 2
    for line in fit_lines(results):
        print(line)
    write_svg(results, args.svg)
    print(f"plot: {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
