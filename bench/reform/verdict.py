"""What a run says, case by case: whether each path held, and why etcdrun keeps fresh.

Why a module of its own: the tables of bench/reform/report.py give the numbers; this part
judges them. ``tally`` counts, per (case, path), the repetitions that held (a seed without a
hang or crash, a survivor re-formed, a newcomer joined, a blocked rank released, a superseded
round got past); ``verdict`` turns the counts into the page's last section: a holds/fails table,
the reason of each failure read back from the raw results, notes whose every figure comes from
this run, and the reasons etcdrun keeps fresh. No sentence states a figure that is not
computed here, so a re-run that measures otherwise says otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.reform.harness import PATHS


def tally(out: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int, str]]:
    """(case, path) -> (good, of, what is counted), as measured."""
    t: dict[tuple[str, str], tuple[int, int, str]] = {}
    for row in out.get("stress", []):
        ss = row["seeds"]
        t[("1-hook" if row["hook"] else "1-ddp", row["path"])] = (
            sum(s["ok"] for s in ss),
            len(ss),
            "seeds without a hang or crash",
        )
    for row in out.get("kill0", []):
        sv = [s for r in row["reps"] for s in r.get("survivors", {}).values()]
        t[("2", row["path"])] = (sum(s["ok"] for s in sv), 2 * len(row["reps"]), "re-formed")
    for row in out.get("join", []):
        g, n, _ = t.get(("3", row["path"]), (0, 0, ""))
        t[("3", row["path"])] = (
            g + sum(bool(r.get("joined")) for r in row["reps"]),
            n + len(row["reps"]),
            "joins",
        )
    for row in out.get("stop", []):
        sv = [s for r in row["reps"] for s in r["ranks"].values()]
        t[("4", row["path"])] = (sum(s["released"] for s in sv), 2 * len(row["reps"]), "released")
    for row in out.get("supersede", []):
        t[("5", row["path"])] = (sum(r["reached"] for r in row["reps"]), row["n"], "got past")
    return t


def held(out: dict[str, Any]) -> dict[tuple[str, str], bool]:
    """(case, path) -> every repetition of it held, as measured."""
    return {k: n > 0 and g == n for k, (g, n, _) in tally(out).items()}


CASE_NAMES = {
    "1-hook": "1. release stress, InFlight's hook",
    "1-ddp": "1. release stress, DDP's own all-reduce (a control: etcdrun hooks InFlight)",
    "2": "2. the first store's host SIGKILLed",
    "3": "3. a newcomer joins",
    "4": "4. a synchronous all_reduce on a SIGSTOPped peer",
    "5": "5. a round superseded while it forms",
}


def verdict(out: dict[str, Any]) -> list[str]:
    h, t = held(out), tally(out)

    def cell(case: str, path: str) -> str:
        if (case, path) not in t:
            return "–"
        g, n, what = t[(case, path)]
        return f"{'holds' if h[(case, path)] else '**fails**'} ({g} of {n} {what})"

    lines = [
        "etcdrun runs **fresh**: `Group` forms a new store and group every round, and releases "
        "by shutting the group's sockets and ending InFlight's futures. As measured in this run:",
        "",
        "| case | fresh | reconf (swappable store) | other reconf variant |",
        "|---|---|---|---|",
    ]
    for case, name in CASE_NAMES.items():
        if (case, "fresh") not in h:
            continue
        other = ""
        for p in ("reconf-plain", "reconf-alone"):
            if (case, p) in h:
                other = f"{p}: {cell(case, p)}"
        lines.append(
            f"| {name} | {cell(case, 'fresh')} | {cell(case, 'reconf')} | {other or '–'} |"
        )
    lines.append("")
    fails = [(c, p) for (c, p), ok in h.items() if not ok and p != "fresh"]
    if fails:
        lines.append("Where torch's reconfigure fails a case, as measured:")
        lines.append("")
        lines += [f"- {CASE_NAMES[c]}: {p} ({_why(out, c, p)})" for c, p in fails]
        lines.append("")
    ffails = [c for (c, p), ok in h.items() if not ok and p == "fresh"]
    if ffails:
        lines.append(
            "Where fresh fails: "
            + "; ".join(f"{CASE_NAMES[c]} ({_why(out, c, 'fresh')})" for c in ffails)
            + "."
        )
        lines.append("")
    lines += _notes(out)
    return lines


def _why(out: dict[str, Any], case: str, path: str) -> str:
    if case.startswith("1"):
        row = next(
            r for r in out["stress"] if r["path"] == path and r["hook"] == (case == "1-hook")
        )
        hung = [s for s in row["seeds"] if s["hung"]]
        crashed = [s["crashed"] for s in row["seeds"] if s["crashed"]]
        bits = []
        if hung:
            bits.append(f"{len(hung)} of {len(row['seeds'])} seeds hung")
            w = [x.split(": ", 1)[1] for s in hung for x in s["where"]]
            if w:
                bits.append(f"e.g. in {w[0]}")
        if crashed:
            bits.append(f"crashed: {crashed[0]}")
        return "; ".join(bits)
    if case == "2":
        row = next(r for r in out["kill0"] if r["path"] == path)
        errs = sorted(
            {
                s.get("error", "")
                for r in row["reps"]
                for s in r.get("survivors", {}).values()
                if not s["ok"]
            }
        )
        return "the survivors' re-form raised " + "; ".join(f"`{e}`" for e in errs)
    if case == "3":
        row = next(r for r in out["join"] if r["path"] == path)
        return "; ".join(sorted({r.get("why", "") for r in row["reps"] if not r.get("joined")}))
    if case == "4":
        row = next(r for r in out["stop"] if r["path"] == path)
        sv = [s for r in row["reps"] for s in r["ranks"].values()]
        w = [s["watched_s"] for s in sv if "watched_s" in s]
        return (
            f"{sum(not s['released'] for s in sv)} of {len(sv)} blocked all_reduces not released"
            + (f", still blocked {min(w):.0f} s after the release" if w else "")
        )
    row = next(r for r in out["supersede"] if r["path"] == path)
    st = [r for r in row["reps"] if not r["reached"]]
    return f"{len(st)} superseded round(s) not got past" if st else "a rank stuck"


def _med(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.0f} ms" if xs else "–"


def _notes(out: dict[str, Any]) -> list[str]:
    """What the numbers of this run say beyond holds/fails (each sentence from the data)."""
    notes = []
    st = {(r["path"], r["hook"]): r for r in out.get("stress", [])}
    if ("fresh", True) in st and ("reconf", True) in st:
        f = [x for s in st[("fresh", True)]["seeds"] for x in s["last"]]
        r = [x for s in st[("reconf", True)]["seeds"] for x in s["last"]]
        notes.append(
            f"- Speed: a re-form in the release stress (InFlight) took {_med(f)} (fresh) and "
            f"{_med(r)} (reconf) at p50 from the last rank's release, file barrier included. "
            "Both build a store per round; reconfigure saves the old group's destroy and the "
            "new `init_process_group` (the parts columns): milliseconds on this machine."
        )
    if ("fresh", False) in st and ("reconf", False) in st:
        hung = {p: sum(bool(s["hung"]) for s in st[(p, False)]["seeds"]) for p in PATHS}
        n = len(st[("fresh", False)]["seeds"])
        notes.append(
            f"- DDP's own all-reduce: {hung['fresh']} of {n} seeds hung with fresh, "
            f"{hung['reconf']} of {n} with reconf. "
            + (
                "The hang (a send gloo never fails, REPORT Q7) is not in how the group is "
                "formed: the release is the same, and only InFlight's hook ends it; counts this "
                "small do not rank the two paths."
                if hung["fresh"] and hung["reconf"]
                else "A hang this rare needs more seeds to compare (`--seeds`)."
            )
        )
    sup = {r["path"]: r for r in out.get("supersede", [])}
    if set(sup) == set(PATHS):
        host = {
            p: [r["time_s"] for r in sup[p]["reps"] if "time_s" in r and r["skip"] == "r0"]
            for p in PATHS
        }
        if host["fresh"] and host["reconf"]:
            notes.append(
                f"- Case 5: when the rank told early is the store's host, the others wait for a "
                f"store nobody serves: {_med(host['fresh'])} (fresh) and "
                f"{_med(host['reconf'])} (reconf) at p50 to reach the next round. The release is "
                "seen only when a try to reach the store ends (Group._store's tries, which the "
                "reconf path copies: a wait for the listener of up to STORE_TRY, then torch's "
                "client connect with that timeout); a slow try hits the other case now and then."
            )
    joins = {(r["path"], r["early"]): r for r in out.get("join", [])}
    if ("fresh", True) in joins and ("fresh", False) in joins:
        e = [v for r in joins[("fresh", True)]["reps"] for v in r.get("join_s", {}).values()]
        n = [v for r in joins[("fresh", False)]["reps"] for v in r.get("join_s", {}).values()]
        notes.append(
            f"- Case 3: fresh's newcomer (a plain `init_process_group`) that dials before "
            f"the survivors' store listens joins in {_med(e)}, against {_med(n)} once it "
            "listens: torch's refused client waits before it dials again. A real newcomer "
            "imports torch for seconds first, so the second figure is the usual one."
        )
    h = held(out)
    reasons = []
    if all(ok for (c, p), ok in h.items() if p == "fresh" and c != "1-ddp"):
        reasons.append("fresh held in every case etcdrun runs (all but the DDP-own control)")
    if ("fresh", True) in st and ("reconf", True) in st:
        f = [x for s in st[("fresh", True)]["seeds"] for x in s["last"]]
        r = [x for s in st[("reconf", True)]["seeds"] for x in s["last"]]
        if f and r:
            reasons.append(
                f"what reconfigure would save is the difference of {_med(f)} (fresh) and "
                f"{_med(r)} (reconf) per re-form (case 1, p50)"
            )
    if h.get(("2", "reconf-plain")) is False:
        reasons.append(
            "reconfigure survives the death of the first store's host only through a "
            "swappable Python store of the worker's own (plain TCPStore: case 2 fails)"
        )
    if h.get(("4", "reconf-alone")) is False:
        reasons.append(
            "reconfigure does not release a blocked synchronous collective (case 4), so the "
            "socket shut and InFlight stay whichever path re-forms"
        )
    reasons.append(
        "`_reconfigure` is marked experimental in torch 2.14, and a script's own "
        "`init_process_group` (adopted by etcdrun) is not made with `enable_reconfigure`"
    )
    out_lines = ["Notes from this run:", "", *notes, ""] if notes else []
    out_lines += ["Why etcdrun keeps fresh: " + "; ".join(reasons) + "."]
    return out_lines
