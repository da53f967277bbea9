"""Scenario 7 of bench/compare.py's report: one row per round kind, from rendezvous_scale.

Why its own module: report.py holds the launcher tables; these rows come from another bench
(bench/rendezvous_scale.py, N simulated participants) with their own target.
"""

from __future__ import annotations

from bench.report import _DASHES, TARGETS


def scale_rows(scale: dict) -> list[list[str]]:
    """Scenario 7, one row per round kind: time and etcd writes per N, from rendezvous_scale."""
    if not scale:
        return []
    title = "7. One round, N simulated participants (bench/rendezvous_scale.py)"
    if "error" in scale:
        return [
            [
                title,
                "—",
                f"not run: {scale['error']}",
                *_DASHES,
                TARGETS["7"],
                "MISS",
                scale["error"],
            ]
        ]
    out = []
    for rnd, label in (("round1", "all join"), ("round2", "one leaves")):
        rs = [r for r in scale["rows"] if r["round"] == rnd]
        if not rs:
            continue
        parts = []
        for r in rs:
            t = "—" if r["time"] is None else f"{r['time']:.3f} s"
            w = "—" if r["writes"] is None else f"{r['writes'] / r['n']:.1f} writes/N"
            parts.append(f"N={r['n']}: {t}, {w}")
        v, why = "—", ""
        big = next((r for r in rs if r["n"] == 1000), None)
        if rnd == "round1" and big is not None:
            v = "PASS" if big["time"] is not None and big["time"] <= 3 else "MISS"
        problems = [p for r in rs for p in r["problems"]]
        if problems:
            v, why = "MISS", "; ".join(problems)[:200]
        target = TARGETS["7"] if rnd == "round1" else "O(N) writes"
        out.append([f"{title}: {label}", "lease_ttl 5", "; ".join(parts), *_DASHES, target, v, why])
    return out
